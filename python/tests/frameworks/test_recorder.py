"""The recorder on loaders written for the test, each a pattern a real loader uses: a transposed
destination, heads regrouped through view + transpose (not one box: cut into boxes), a contiguous
copy of a view read again, concatenations of such views, vocabulary padding, and what it must never
guess (arithmetic, dtype conversion, concatenation with a constant, a loader that reads values),
which goes through staging and the loader itself. Each is installed by refit through a plan on the
host backend and compared element by element with the loader's own result; then a plain Hugging
Face module loaded by load_state_dict."""

from __future__ import annotations

import unittest
from typing import Any, Callable, Dict, Tuple

import torch

import refit
from compare import POISON, offers
from refit.integrations.receiver import RecordedReceiver
from refit.integrations.recorder import TensorSpec, record

Specs = Dict[str, Tuple[Tuple[int, ...], torch.dtype]]


def encoded(specs: Specs) -> Dict[str, torch.Tensor]:
    out, start = {}, 1
    for name, (shape, dtype) in specs.items():
        n = 1
        for e in shape:
            n *= e
        out[name] = torch.arange(start, start + n, dtype=torch.float32).reshape(shape).to(dtype)
        start += n
    return out


def install(test: unittest.TestCase, make: Callable[[str], Dict[str, torch.Tensor]], loader_of, specs: Specs):
    """(recording, the loader's parameters, refit's parameters)."""
    meta = make("meta")
    recording = record(loader_of(meta), meta, specs, cache=False)
    truth, params = install_recorded(test, recording, make, loader_of, encoded(specs), POISON)
    return recording, truth, params


def install_recorded(test: unittest.TestCase, recording: Any, make: Callable[[str], Dict[str, torch.Tensor]], loader_of,
                     ckpt: Dict[str, torch.Tensor], fill: float) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """The loader's parameters and refit's (boxes, then the loader on the staged tensors), both
    starting from `fill`, asserted equal."""
    truth, params = make("cpu"), make("cpu")
    for tensors in (truth, params):
        for tensor in tensors.values():
            tensor.fill_(fill)
    # Copies: a loader that changes a checkpoint tensor in place must not change what is offered.
    loader_of(truth)((name, tensor.clone()) for name, tensor in ckpt.items())
    receiver = RecordedReceiver(recording)
    staging = receiver.staging_buffers(lambda shape, dtype: torch.full(shape, POISON).to(dtype))
    with refit.Table() as publisher, receiver.table(params, 0, device=1, staging=staging) as needs:
        offers(publisher, ckpt, 0)
        with refit.Plan.build([publisher, needs]) as plan, refit.Group([0, 1], refit.Backend.HOST) as group:
            for route in plan.routes():
                group.copy_batch(route.dst_device, route.segments)
    receiver.load_staged(loader_of(params), staging)
    for name in truth:
        test.assertTrue(torch.equal(truth[name], params[name]), f"{name}: refit {params[name]} loader {truth[name]}")
    return truth, params


class RecorderTest(unittest.TestCase):
    def test_transposed_destination_is_one_box_with_its_strides(self):
        specs = {"w": ((3, 5), torch.float32)}
        make = lambda device: {"p": torch.empty(5, 3, device=device)}  # noqa: E731
        loader = lambda params: lambda items: [params["p"].copy_(t.t()) for _, t in items]  # noqa: E731
        recording, _, _ = install(self, make, loader, specs)
        (piece,) = recording.layouts[0].pieces
        self.assertEqual((piece.offset, piece.extent, piece.strides, piece.at), ((0, 0), (3, 5), (1, 3), 0))
        self.assertEqual(recording.staged, {})

    def test_heads_regrouped_through_view_and_transpose(self):
        # q rows grouped [head][dim] in the checkpoint, stored [dim][head] by the "engine".
        specs = {"q": ((4 * 2, 6), torch.float32)}
        make = lambda device: {"p": torch.empty(2, 4, 6, device=device)}  # noqa: E731
        loader = lambda params: lambda items: [params["p"].copy_(t.view(4, 2, 6).transpose(0, 1)) for _, t in items]  # noqa: E731
        recording, _, _ = install(self, make, loader, specs)
        # Rows 2h + d land at [d][h]: per h, rows 2h..2h+1 are one box (2 x 6) at stride 24 in p.
        self.assertEqual([p.offset for p in recording.layouts[0].pieces], [(0, 0), (2, 0), (4, 0), (6, 0)])
        self.assertEqual({p.strides for p in recording.layouts[0].pieces}, {(24, 1)})
        self.assertEqual(recording.staged, {})

    def test_a_contiguous_copy_read_again_maps_back(self):
        specs = {"w": ((4, 6), torch.float32)}
        make = lambda device: {"p": torch.empty(3, 4, device=device)}  # noqa: E731

        def loader(params):
            def load(items):
                for _, t in items:
                    params["p"].copy_(t.t().contiguous()[2:5])

            return load

        recording, _, _ = install(self, make, loader, specs)
        (piece,) = recording.layouts[0].pieces
        self.assertEqual((piece.offset, piece.extent), ((0, 2), (4, 3)))
        self.assertEqual(recording.staged, {})

    def test_a_reshape_that_copies_maps_back(self):
        # reshape of a tensor it cannot view copies it (clone) and views the copy through
        # aten._unsafe_view (not a view by its schema) across the copy's dimensions: split at them,
        # the copy's pieces are still boxes of the checkpoint tensor.
        specs = {"w": ((4, 6), torch.float32)}
        make = lambda device: {"p": torch.empty(2, 12, device=device)}  # noqa: E731
        loader = lambda params: lambda items: [params["p"].copy_(t.t().reshape(2, 12)) for _, t in items]  # noqa: E731
        recording, _, _ = install(self, make, loader, specs)
        self.assertEqual(recording.staged, {})
        # p[r, 4i + j] = w[j, 3r + i]: columns 3r..3r+2 of w, transposed, in row r of p.
        pieces = [(p.offset, p.extent, p.strides, p.at) for p in recording.layouts[0].pieces]
        self.assertEqual(pieces, [((0, 3 * r), (4, 3), (1, 4), 12 * r) for r in range(2)])

    def test_a_concatenation_of_checkpoint_views_maps_back(self):
        """Concatenation copies: Llama 4's vision q, k and v concatenated into one tensor when its
        encoder runs data parallel (mllama4 _consolidate_qkv_weights), then copied whole; Falcon's
        q, k and v regrouped out of its fused query_key_value by reshape (copies split to map),
        concatenated again and narrowed (across two of the parts); columns of a concatenation along
        dim 1; a stack of transposed copies. Each part maps back to boxes of its checkpoint tensor.
        Concatenated with a constant or with arithmetic, the tensors are still staged."""
        specs = {
            "q": ((4, 3), torch.float32), "k": ((2, 3), torch.float32), "v": ((2, 3), torch.float32),
            "fused": ((16, 3), torch.float32), "a": ((2, 3), torch.float32), "b": ((2, 4), torch.float32),
            "s0": ((2, 2), torch.float32), "s1": ((2, 2), torch.float32), "padded": ((2, 3), torch.float32),
            "scaled": ((2, 3), torch.float32),
        }
        make = lambda device: {  # noqa: E731
            "qkv": torch.empty(8, 3, device=device), "shard": torch.empty(6, 3, device=device), "cols": torch.empty(2, 5, device=device),
            "stacked": torch.empty(2, 4, device=device), "p_padded": torch.empty(4, 3, device=device), "p_scaled": torch.empty(4, 3, device=device),
        }

        def loader(params):
            def load(items):
                t = dict(items)  # a loader that holds tensors back until their group is complete
                if {"q", "k", "v"} <= set(t):
                    params["qkv"].copy_(torch.cat([t["q"], t["k"], t["v"]]))
                if "fused" in t:
                    grouped = t["fused"].view(2, 4, 2, 3)  # 2 kv groups: 2 q heads, a k and a v head, of 2 rows
                    q, k, v = (grouped.narrow(1, at, n).reshape(-1, 3) for at, n in ((0, 2), (2, 1), (3, 1)))
                    params["shard"].copy_(torch.cat([q, k, v]).narrow(0, 4, 6))  # q's group 1, k's group 0
                if {"a", "b"} <= set(t):
                    params["cols"].copy_(torch.cat([t["a"], t["b"]], dim=1)[:, 1:6])
                if {"s0", "s1"} <= set(t):
                    params["stacked"].copy_(torch.stack([t["s0"].t().reshape(4), t["s1"].t().reshape(4)]))
                if "padded" in t:
                    params["p_padded"].copy_(torch.cat([t["padded"], torch.zeros(2, 3, device=t["padded"].device)]))
                if "scaled" in t:
                    params["p_scaled"].copy_(torch.cat([t["scaled"], t["scaled"] * 2]))

            return load

        recording, _, _ = install(self, make, loader, specs)
        self.assertEqual(recording.staged, {"padded": "concatenation into a new tensor", "scaled": "computed by mul"})
        layouts = {layout.name: [(p.tensor, p.offset, p.extent, p.at) for p in layout.pieces] for layout in recording.layouts}
        self.assertEqual(layouts["qkv"], [("q", (0, 0), (4, 3), 0), ("k", (0, 0), (2, 3), 12), ("v", (0, 0), (2, 3), 18)])
        self.assertEqual(layouts["cols"], [("a", (0, 1), (2, 2), 0), ("b", (0, 0), (2, 3), 2)])
        # stacked[i, 2a + b] = s_i[b, a]: a transposed box of each.
        stacked = [(p.tensor, p.extent, p.strides, p.at) for p in recording.layouts[3].pieces]
        self.assertEqual(stacked, [("s0", (2, 2), (1, 2), 0), ("s1", (2, 2), (1, 2), 4)])
        # Rows 4..9 of [q; k; v]: q's 2 heads of group 1 (fused rows 8..11, in 2 boxes as the split
        # at q's heads leaves them), then k's head of group 0 (fused rows 4..5).
        self.assertEqual(layouts["shard"], [("fused", (8, 0), (2, 3), 0), ("fused", (10, 0), (2, 3), 6), ("fused", (4, 0), (2, 3), 12)])

    def test_flattened_and_strided_reads(self):
        # A flat parameter taking rows 1..2 of a matrix flattened; every other column of another.
        specs = {"w": ((4, 6), torch.float32), "v": ((4, 6), torch.float32)}
        make = lambda device: {"flat": torch.empty(12, device=device), "odd": torch.empty(4, 3, device=device)}  # noqa: E731

        def loader(params):
            def load(items):
                for name, t in items:
                    if name == "w":
                        params["flat"].copy_(t.reshape(-1)[6:18])
                    else:
                        params["odd"].copy_(t[:, 1::2])

            return load

        recording, _, _ = install(self, make, loader, specs)
        flat, odd = recording.layouts
        self.assertEqual([(p.offset, p.extent) for p in flat.pieces], [((1, 0), (2, 6))])
        self.assertEqual([(p.offset, p.extent, p.strides) for p in odd.pieces], [((0, c), (4, 1), (3, 1)) for c in (1, 3, 5)])

    def test_vocabulary_padding_is_reported_and_left(self):
        specs = {"embed": ((5, 2), torch.float32)}
        make = lambda device: {"p": torch.empty(8, 2, device=device)}  # noqa: E731

        def loader(params):
            def load(items):
                for _, t in items:
                    params["p"][: t.shape[0]].copy_(t)
                    params["p"][t.shape[0] :].fill_(0)

            return load

        ckpt_rows = 5
        recording, truth, got = install_allowing_padding(self, make, loader, specs, ckpt_rows)
        self.assertEqual(recording.padding, {"p": 6})

    def test_what_is_not_a_box_is_staged_with_its_reason_and_loaded_by_the_loader(self):
        specs = {
            "scaled": ((4,), torch.float32),
            "half": ((4,), torch.bfloat16),
            "a": ((2, 3), torch.float32),
            "b": ((2, 3), torch.float32),
            "counted": ((1,), torch.float32),
            "plain": ((4,), torch.float32),
        }
        make = lambda device: {  # noqa: E731
            "p_scaled": torch.empty(4, device=device),
            "p_half": torch.empty(4, device=device),
            "p_cat": torch.empty(5, 3, device=device),
            "p_counted": torch.empty(1, device=device),
            "p_plain": torch.empty(4, device=device),
        }

        def loader(params):
            def load(items):
                pending = {}
                for name, t in items:
                    if name == "scaled":
                        params["p_scaled"].copy_(t * 2)
                    elif name == "half":
                        params["p_half"].copy_(t)
                    elif name in ("a", "b"):
                        pending[name] = t
                        if len(pending) == 2:
                            params["p_cat"].copy_(torch.cat([pending["a"], pending["b"], torch.zeros(1, 3, device=t.device)]))
                    elif name == "counted":
                        params["p_counted"].fill_(t.item())
                    else:
                        params["p_plain"].copy_(t)

            return load

        # a and b are concatenated (with a row no checkpoint tensor holds) only when both arrive
        # together: staged, they arrive together.
        recording, _, _ = install(self, make, loader, specs)
        self.assertEqual(recording.staged["scaled"], "computed by mul")
        self.assertEqual(recording.staged["half"], "dtype conversion")
        self.assertEqual(recording.staged["a"], "concatenation into a new tensor")
        self.assertEqual(recording.staged["b"], "concatenation into a new tensor")
        self.assertIn("the loader raised", recording.staged["counted"])
        self.assertNotIn("plain", recording.staged)
        self.assertEqual([layout.name for layout in recording.layouts], ["p_plain"])
        self.assertIn("staged for the engine's loader", recording.summary())

    def test_a_tensor_whose_values_the_loader_reads_is_staged_for_the_parameters_it_writes(self):
        """SGLang's default_weight_loader fills a one-element parameter with `loaded_weight.item()`
        (Apertus's xIELU alpha_p / alpha_n): the meta stand-in cannot give the value, the loader
        raises, and the tensor is staged. The loader, given it once more alone with values, tells
        which parameter it reaches: the tensor's staged parameter, not an unwritten one. So for a
        tensor built from the values read and copied in, and for an in-place write; one whose
        loader raises before writing anything stays unattributed (its parameter unwritten)."""
        specs = {name: ((1,), torch.float32) for name in ("filled", "rebuilt", "added", "refused")}
        specs["plain"] = ((4,), torch.float32)
        make = lambda device: {f"p_{name}": torch.empty(specs[name][0], device=device) for name in specs}  # noqa: E731

        def loader(params):
            def load(items):
                for name, t in items:
                    p = params["p_" + name]
                    if name == "filled":
                        p.fill_(t.item())
                    elif name == "rebuilt":
                        p.copy_(torch.tensor([t.item() * 2.0]))
                    elif name == "added":
                        p.add_(t.item())
                    elif name == "refused":
                        if t.item() == 0.0:
                            raise ValueError("a zero scale")
                        p.fill_(t.item())
                    else:
                        p.copy_(t)

            return load

        ckpt = encoded(specs)
        meta = make("meta")
        recording = record(loader(meta), meta, specs, cache=False)
        self.assertEqual(sorted(recording.staged), ["added", "filled", "rebuilt", "refused"])
        self.assertIn("the loader raised", recording.staged["filled"])
        self.assertEqual(recording.staged_params, {"added": ["p_added"], "filled": ["p_filled"], "rebuilt": ["p_rebuilt"]})
        self.assertEqual(recording.unwritten, ["p_refused"])
        self.assertEqual([layout.name for layout in recording.layouts], ["p_plain"])
        # Installed: the staged tensors through the loader, the rest as boxes (from zeros: one
        # loader adds to what the parameter holds).
        install_recorded(self, recording, make, loader, ckpt, 0.0)

    def test_a_checkpoint_tensor_the_loader_fills_is_staged(self):
        """GPT-OSS's loader zeroes its row-parallel expert bias on every TP rank but the first, then
        copies it: the parameter holds zeros, not the checkpoint's elements. The same through a
        copy of the tensor; a fill of the parameter itself (padding) is no such change."""
        specs = {"bias": ((4, 2), torch.float32), "copied": ((4, 2), torch.float32), "plain": ((4, 2), torch.float32)}
        make = lambda device: {name: torch.empty(4, 2, device=device) for name in ("p_bias", "p_copied", "p_plain")}  # noqa: E731

        def loader(params):
            def load(items):
                for name, t in items:
                    if name == "bias":
                        t.zero_()
                        params["p_bias"].copy_(t)
                    elif name == "copied":
                        c = t.clone()
                        c[1:].fill_(3.0)
                        params["p_copied"].copy_(c)
                    else:
                        params["p_plain"].fill_(0)
                        params["p_plain"].copy_(t)

            return load

        recording, _, _ = install(self, make, loader, specs)
        self.assertEqual(recording.staged, {"bias": "changed in place by zero_", "copied": "changed in place by fill_"})
        self.assertEqual([layout.name for layout in recording.layouts], ["p_plain"])


    def test_a_parameter_read_back_after_the_loader_wrote_it_is_staged(self):
        """vLLM's Mamba2 loader (MambaMixer2's A: composed_weight_loader) copies A_log's rows into
        the parameter, then writes -exp(parameter) over it: the parameter does not hold A_log's
        elements. So for an in-place change of a written parameter, and for one parameter's
        elements copied into another; a parameter only read (a sum) keeps its boxes."""
        specs = {name: ((4, 2), torch.float32) for name in ("a_log", "scaled", "first", "plain")}
        make = lambda device: {name: torch.empty(2, 2, device=device) for name in ("p_a", "p_scaled", "p_first", "p_second", "p_plain")}  # noqa: E731

        def loader(params):
            def load(items):
                for name, t in items:
                    p = params["p_" + {"a_log": "a"}.get(name, name)]
                    p.copy_(t[2:])  # a box
                    if name == "a_log":
                        p.copy_(-torch.exp(p / 1000.0))
                    elif name == "scaled":
                        p.mul_(2.0)
                    elif name == "first":
                        params["p_second"].copy_(p)
                    else:
                        p.sum()

            return load

        recording, _, _ = install(self, make, loader, specs)
        self.assertEqual(set(recording.staged), {"a_log", "scaled", "first"})
        self.assertEqual(recording.staged_params["first"], ["p_first", "p_second"])
        self.assertEqual([layout.name for layout in recording.layouts], ["p_plain"])
    def test_recordings_are_cached_per_parameters_checkpoint_and_key(self):
        specs = [TensorSpec("w", (2, 2), torch.float32)]
        params = {"p": torch.empty(2, 2, device="meta")}
        calls = []

        def loader(items):
            calls.append(1)
            for _, t in items:
                params["p"].copy_(t)

        first = record(loader, params, specs, key="rank 0")
        self.assertIs(record(loader, params, specs, key="rank 0"), first)
        self.assertIsNot(record(loader, params, specs, key="rank 1"), first)
        self.assertEqual(len(calls), 2)
        with self.assertRaises(ValueError):
            record(loader, {"p": torch.empty(2, 2)}, specs)

    def test_a_changed_parameter_is_refused(self):
        specs = {"w": ((2, 2), torch.float32)}
        meta = {"p": torch.empty(2, 2, device="meta")}
        recording = record(lambda items: [meta["p"].copy_(t) for _, t in items], meta, specs, cache=False)
        receiver = RecordedReceiver(recording)
        with refit.Table() as table:
            for params, text in (
                ({"p": torch.empty(2, 2).t()}, "changed shape, strides or dtype"),
                ({"p": torch.empty(2, 2, dtype=torch.float16)}, "changed shape, strides or dtype"),
                ({"p": torch.empty(2, 2), "q": torch.empty(1)}, "1 new"),
                ({}, "1 gone"),
            ):
                with self.assertRaises(refit.RefitError) as caught:
                    receiver.add_to(table, params, 0, device=0)
                self.assertIn(text, caught.exception.message)


def install_allowing_padding(test, make, loader_of, specs, rows):
    """install(), where the loader's zero-filled padding rows stay POISON on refit's side."""
    ckpt = encoded(specs)
    truth = make("cpu")
    # Copies: a loader that changes a checkpoint tensor in place must not change what is offered.
    loader_of(truth)((name, tensor.clone()) for name, tensor in ckpt.items())
    meta = make("meta")
    recording = record(loader_of(meta), meta, specs, cache=False)
    params = {name: torch.full_like(t, POISON) for name, t in truth.items()}
    with refit.Table() as publisher, RecordedReceiver(recording).table(params, 0, device=1) as needs:
        offers(publisher, ckpt, 0)
        with refit.Plan.build([publisher, needs]) as plan, refit.Group([0, 1], refit.Backend.HOST) as group:
            for route in plan.routes():
                group.copy_batch(route.dst_device, route.segments)
    test.assertTrue(torch.equal(params["p"][:rows], truth["p"][:rows]))
    test.assertTrue(bool((params["p"][rows:] == POISON).all()))
    test.assertTrue(bool((truth["p"][rows:] == 0).all()))
    return recording, truth, params


class HuggingFaceModuleTest(unittest.TestCase):
    def test_a_plain_hugging_face_module_loaded_by_load_state_dict(self):
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=50, max_position_embeddings=64)

        def make(device):
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            return model

        meta = make("meta")
        specs = {name: (tuple(t.shape), t.dtype) for name, t in meta.state_dict().items()}
        loader = lambda model: lambda items: model.load_state_dict(dict(items), strict=False)  # noqa: E731
        ckpt = encoded(specs)
        truth = make("cpu")
        loader(truth)(iter(ckpt.items()))
        recording = record(loader(meta), list(meta.named_parameters()), specs, cache=False)
        self.assertEqual(recording.staged, {})
        self.assertEqual(recording.unwritten, [])
        engine = make("cpu")
        with torch.no_grad():
            for p in engine.parameters():
                p.fill_(POISON)
        with refit.Table() as publisher, RecordedReceiver(recording).table(list(engine.named_parameters()), 0, device=1) as needs:
            offers(publisher, ckpt, 0)
            with refit.Plan.build([publisher, needs]) as plan, refit.Group([0, 1], refit.Backend.HOST) as group:
                for route in plan.routes():
                    group.copy_batch(route.dst_device, route.segments)
        for name, p in truth.named_parameters():
            self.assertTrue(torch.equal(p, dict(engine.named_parameters())[name]), name)


if __name__ == "__main__":
    unittest.main()
