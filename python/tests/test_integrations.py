"""refit.integrations without torch: the Megatron and vLLM layout rules on plain parameter
descriptions (each checked against pieces written out by hand), coverage of every checkpoint element,
and whole refits on the host backend from Megatron-laid-out bytes into vLLM-laid-out buffers,
compared byte for byte with the vLLM layout built independently (hostmodels.py)."""

from __future__ import annotations

import dataclasses
import unittest
from typing import Dict, List, Tuple

import refit
from hostmodels import POISON, HostTensor, checkpoint, megatron_params, vllm_params
from refit.integrations import (
    MegatronPublisher,
    MegatronRanks,
    ModelShape,
    RefitWorkerExtension,
    VllmRanks,
    VllmReceiver,
    megatron_layouts,
    vllm_layouts,
)
from refit.integrations.layout import Piece
from refit.integrations.recorder import ParamInfo, Recording, TensorSpec
from refit.integrations.megatron import stage_layers as megatron_stage
from refit.integrations.vllm import local_experts
from refit.integrations.vllm import stage_layers as vllm_stage
from refit.tensor import add_tensor_need, add_tensor_offer

QWEN3_MOE = ModelShape(
    layers=2, hidden=8, heads=4, kv_heads=2, head_dim=4, vocab=100, experts=4, moe_ffn=8, qk_norm=True, name="qwen3-moe"
)
LLAMA = ModelShape(layers=3, hidden=8, heads=4, kv_heads=1, head_dim=2, vocab=90, ffn=12, name="llama")


def pieces(layouts, name) -> Tuple[Piece, ...]:
    return next(layout for layout in layouts if layout.name == name).pieces


def P(tensor: str, offset, extent, at: int) -> Piece:
    return Piece(tensor, tuple(offset), tuple(extent), at)


class LayoutRuleTest(unittest.TestCase):
    def test_megatron_linear_qkv_interleaves_q_k_v_per_query_group(self):
        model = ModelShape(layers=1, hidden=8, heads=4, kv_heads=2, head_dim=2, vocab=64, ffn=4)
        got = pieces(megatron_layouts(model, MegatronRanks()), "decoder.layers.0.self_attention.linear_qkv.weight")
        q, k, v = (f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv")
        expected = (
            P(q, (0, 0), (4, 8), 0),
            P(k, (0, 0), (2, 8), 4 * 8),
            P(v, (0, 0), (2, 8), 6 * 8),
            P(q, (4, 0), (4, 8), 8 * 8),
            P(k, (2, 0), (2, 8), 12 * 8),
            P(v, (2, 0), (2, 8), 14 * 8),
        )
        self.assertEqual(got, expected)

    def test_megatron_linear_qkv_rows_cut_through_groups_when_tp_exceeds_them(self):
        model = ModelShape(layers=1, hidden=8, heads=4, kv_heads=2, head_dim=2, vocab=64, ffn=4)
        q, k, v = (f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv")
        expected = {
            0: (P(q, (0, 0), (4, 8), 0),),
            1: (P(k, (0, 0), (2, 8), 0), P(v, (0, 0), (2, 8), 16)),
            2: (P(q, (4, 0), (4, 8), 0),),
            3: (P(k, (2, 0), (2, 8), 0), P(v, (2, 0), (2, 8), 16)),
        }
        for rank, want in expected.items():
            layouts = megatron_layouts(model, MegatronRanks(tp=4, tp_rank=rank))
            self.assertEqual(pieces(layouts, "decoder.layers.0.self_attention.linear_qkv.weight"), want, rank)

    def test_vllm_qkv_replicates_kv_heads_over_ranks(self):
        model = ModelShape(layers=1, hidden=8, heads=8, kv_heads=2, head_dim=2, vocab=64, ffn=4)
        q, k, v = (f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv")
        for rank, kv_head in ((0, 0), (1, 0), (2, 1), (3, 1)):
            got = pieces(vllm_layouts(model, VllmRanks(tp=4, tp_rank=rank)), "model.layers.0.self_attn.qkv_proj.weight")
            want = (
                P(q, (4 * rank, 0), (4, 8), 0),
                P(k, (2 * kv_head, 0), (2, 8), 4 * 8),
                P(v, (2 * kv_head, 0), (2, 8), 6 * 8),
            )
            self.assertEqual(got, want, rank)

    def test_vocabulary_padding_of_each_framework(self):
        model = ModelShape(layers=1, hidden=8, heads=4, kv_heads=2, head_dim=2, vocab=100, ffn=4)
        embed = "model.embed_tokens.weight"
        # vLLM pads to a multiple of 64: 128 rows, 64 per rank of 2, 32 per rank of 4.
        for tp, rank, rows in ((2, 1, (64, 36, 64)), (4, 3, (96, 4, 32)), (4, 0, (0, 32, 32))):
            layout = vllm_layouts(model, VllmRanks(tp=tp, tp_rank=rank))[0]
            first, count, per = rows
            self.assertEqual(layout.shape, (per, 8))
            self.assertEqual(layout.pieces, (P(embed, (first, 0), (count, 8), 0),))
        # Megatron pads to 128 * tp: 256 rows for tp 2, so rank 1 holds only padding.
        layouts = [megatron_layouts(model, MegatronRanks(tp=2, tp_rank=r))[0] for r in range(2)]
        self.assertEqual([layout.shape for layout in layouts], [(128, 8), (128, 8)])
        self.assertEqual(layouts[0].pieces, (P(embed, (0, 0), (100, 8), 0),))
        self.assertEqual(layouts[1].pieces, ())

    def test_fused_moe_w13_holds_gate_then_up_per_expert(self):
        model = ModelShape(layers=1, hidden=8, heads=2, kv_heads=2, head_dim=4, vocab=64, experts=3, moe_ffn=6)
        layouts = vllm_layouts(model, VllmRanks(tp=2, tp_rank=1))
        x = "model.layers.0.mlp.experts"
        w13 = next(layout for layout in layouts if layout.name == f"{x}.routed_experts.w13_weight")
        self.assertEqual(w13.shape, (3, 6, 8))
        want = []
        for e in range(3):
            want += [P(f"{x}.{e}.gate_proj.weight", (3, 0), (3, 8), e * 48), P(f"{x}.{e}.up_proj.weight", (3, 0), (3, 8), e * 48 + 24)]
        self.assertEqual(w13.pieces, tuple(want))
        w2 = next(layout for layout in layouts if layout.name == f"{x}.routed_experts.w2_weight")
        self.assertEqual(w2.shape, (3, 8, 3))
        self.assertEqual(w2.pieces, tuple(P(f"{x}.{e}.down_proj.weight", (0, 3), (8, 3), e * 24) for e in range(3)))

    def test_megatron_experts_per_expert_or_stacked(self):
        model = ModelShape(layers=1, hidden=4, heads=2, kv_heads=2, head_dim=2, vocab=64, experts=4, moe_ffn=2)
        x = "model.layers.0.mlp.experts"
        separate = megatron_layouts(model, MegatronRanks(ep=2, ep_rank=1))
        self.assertEqual(
            pieces(separate, "decoder.layers.0.mlp.experts.linear_fc1.weight1"),
            (P(f"{x}.3.gate_proj.weight", (0, 0), (2, 4), 0), P(f"{x}.3.up_proj.weight", (0, 0), (2, 4), 8)),
        )
        self.assertEqual(
            pieces(separate, "decoder.layers.0.mlp.experts.linear_fc2.weight0"),
            (P(f"{x}.2.down_proj.weight", (0, 0), (4, 2), 0),),
        )
        stacked = megatron_layouts(model, MegatronRanks(ep=2, ep_rank=1, grouped_experts=True))
        fc1 = next(layout for layout in stacked if layout.name == "decoder.layers.0.mlp.experts.linear_fc1.weight")
        self.assertEqual(fc1.shape, (2, 4, 4))
        self.assertEqual(fc1.pieces[2], P(f"{x}.3.gate_proj.weight", (0, 0), (2, 4), 16))

    def test_expert_placement_linear_and_round_robin(self):
        self.assertEqual([local_experts(10, VllmRanks(ep=4, ep_rank=r)) for r in range(4)], [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]])
        self.assertEqual(local_experts(10, VllmRanks(ep=4, ep_rank=1, expert_placement="round_robin")), [1, 5, 9])
        self.assertEqual(local_experts(4, VllmRanks(tp=2, tp_rank=1)), [0, 1, 2, 3])

    def test_pipeline_stages(self):
        self.assertEqual([list(vllm_stage(10, VllmRanks(pp=4, pp_rank=r))) for r in range(4)], [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]])
        self.assertEqual(list(vllm_stage(10, VllmRanks(pp=2, pp_rank=1, pp_partition=(7, 3)))), [7, 8, 9])
        ranks = [MegatronRanks(pp=3, pp_rank=r, first_stage_layers=2, last_stage_layers=2) for r in range(3)]
        self.assertEqual([list(megatron_stage(10, r)) for r in ranks], [[0, 1], [2, 3, 4, 5, 6, 7], [8, 9]])
        # Megatron names layers by their index in the stage; vLLM by their global index.
        four_layers = dataclasses.replace(LLAMA, layers=4)
        names = [layout.name for layout in megatron_layouts(four_layers, MegatronRanks(pp=2, pp_rank=1))]
        self.assertIn("decoder.layers.1.mlp.linear_fc2.weight", names)
        self.assertNotIn("decoder.layers.2.mlp.linear_fc2.weight", names)
        self.assertEqual(names[-2:], ["decoder.final_layernorm.weight", "output_layer.weight"])
        self.assertNotIn("embedding.word_embeddings.weight", names)

    def test_bad_parallel_sizes_are_refused(self):
        for make in (
            lambda: MegatronRanks(tp=2, tp_rank=2),
            lambda: megatron_layouts(LLAMA, MegatronRanks(tp=8)),
            lambda: megatron_layouts(QWEN3_MOE, MegatronRanks(ep=3)),
            lambda: vllm_layouts(QWEN3_MOE, VllmRanks(tp=8)),
            lambda: vllm_layouts(LLAMA, VllmRanks(pp=2, pp_rank=0, pp_partition=(1, 1))),
            lambda: VllmRanks(expert_placement="random"),
            lambda: ModelShape(layers=1, hidden=8, heads=3, kv_heads=2, head_dim=2, vocab=8, ffn=4),
            lambda: ModelShape(layers=1, hidden=8, heads=2, kv_heads=2, head_dim=2, vocab=8),
        ):
            with self.assertRaises(refit.RefitError) as caught:
                make()
            self.assertEqual(caught.exception.status, refit.Status.INVALID_ARGUMENT)

    def test_model_shape_from_a_hugging_face_config(self):
        config = {
            "model_type": "qwen3_moe",
            "num_hidden_layers": 48,
            "hidden_size": 2048,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 151936,
            "intermediate_size": 6144,
            "num_experts": 128,
            "moe_intermediate_size": 768,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "mlp_only_layers": [],
            "decoder_sparse_step": 1,
        }
        model = ModelShape.from_hf_config(config)
        self.assertEqual((model.experts, model.moe_ffn, model.ffn, model.qk_norm), (128, 768, 0, True))
        tensors = model.checkpoint_tensors()
        self.assertEqual(len(tensors), 2 + 48 * (8 + 1 + 3 * 128) + 1)
        self.assertEqual(sum(_numel(s) for s in tensors.values()), 30_532_122_624)
        with self.assertRaises(refit.RefitError):
            ModelShape.from_hf_config({**config, "mlp_only_layers": [0]})

    def test_every_checkpoint_element_is_offered_and_needed(self):
        cases = [
            (QWEN3_MOE, megatron_world(QWEN3_MOE, tp=2, pp=2, ep=2), vllm_world(QWEN3_MOE, tp=4)),
            (QWEN3_MOE, megatron_world(QWEN3_MOE, tp=1, pp=1, ep=4, grouped=True), vllm_world(QWEN3_MOE, tp=2, pp=2, ep=2)),
            (LLAMA, megatron_world(LLAMA, tp=2, pp=1), vllm_world(LLAMA, tp=2, pp=2)),
        ]
        for model, publishers, receivers in cases:
            shapes = model.checkpoint_tensors()
            offered = count_elements(l for _, ranks in publishers for l in megatron_layouts(model, ranks))
            needed = count_elements(l for _, ranks in receivers for l in vllm_layouts(model, ranks))
            for name, shape in shapes.items():
                # Every element, each as often as the others (a tensor replicated over TP ranks, as
                # norms are, is offered by each of them; a split one once).
                for side, counts in (("offered", offered), ("needed", needed)):
                    count, distinct = counts[name]
                    self.assertEqual(distinct, _numel(shape), f"{model.name} {name} {side}")
                    self.assertEqual(count % distinct, 0, f"{model.name} {name} {side} unevenly")


def _numel(shape) -> int:
    n = 1
    for e in shape:
        n *= e
    return n


def count_elements(layouts) -> Dict[str, Tuple[int, int]]:
    """Per checkpoint tensor: (elements covered counting repeats, distinct elements covered)."""
    seen: Dict[str, List[int]] = {}
    for layout in layouts:
        for piece in layout.pieces:
            elements = seen.setdefault(piece.tensor, [])
            if len(piece.extent) == 1:
                elements += range(piece.offset[0], piece.offset[0] + piece.extent[0])
            else:
                # A 2-D tensor's element (r, c) as r * 2^20 + c.
                for row in range(piece.offset[0], piece.offset[0] + piece.extent[0]):
                    elements.extend((row << 20) + c for c in range(piece.offset[1], piece.offset[1] + piece.extent[1]))
    return {name: (len(elements), len(set(elements))) for name, elements in seen.items()}


def megatron_world(model, tp, pp, ep=1, dp=2, grouped=False) -> List[Tuple[int, MegatronRanks]]:
    """(device, ranks) of every Megatron rank: tensor-parallel ranks fastest, then data, then
    pipeline; expert-parallel ranks over tensor x data ranks, expert TP 1."""
    dp = max(dp, ep // tp) if model.experts else dp
    world = []
    for pp_rank in range(pp):
        for dp_rank in range(dp):
            for tp_rank in range(tp):
                device = (pp_rank * dp + dp_rank) * tp + tp_rank
                ep_rank = (dp_rank * tp + tp_rank) % ep
                etp = 1 if model.experts else None
                ranks = MegatronRanks(
                    tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank, etp=etp,
                    etp_rank=0 if etp else None, dp=dp, dp_rank=dp_rank, grouped_experts=grouped,
                )
                world.append((device, ranks))
    return world


def vllm_world(model, tp, pp=1, ep=1) -> List[Tuple[int, VllmRanks]]:
    """(device, ranks) of every vLLM worker: tensor-parallel ranks fastest; expert parallelism (when
    ep > 1) over the tensor-parallel ranks."""
    return [
        (pp_rank * tp + tp_rank, VllmRanks(tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=tp_rank % ep))
        for pp_rank in range(pp)
        for tp_rank in range(tp)
    ]


class HostRefitTest(unittest.TestCase):
    """Megatron-laid-out bytes refit into vLLM-laid-out buffers on the host backend."""

    def refit(self, model, publishers, receivers, expected_layers):
        ckpt = checkpoint(model)
        tables, received = [], []
        for device, ranks in publishers:
            publisher = MegatronPublisher(model, ranks)
            values = megatron_params(model, ranks, ckpt)
            params = {}
            for layout in publisher.layouts:
                self.assertEqual(len(values[layout.name]), layout.numel, layout.name)
                params[layout.name] = HostTensor(layout.shape, values[layout.name])
            self.assertEqual(set(values), set(params))
            tables.append((publisher.table(params, 0, device=device), params))
        for (device, ranks), layers in zip(receivers, expected_layers):
            receiver = VllmReceiver(model, ranks)
            params = {"module." + layout.name: HostTensor(layout.shape) for layout in receiver.layouts}
            tables.append((receiver.table(params, 0, device=device), params))
            received.append((ranks, layers, params))
        devices = 1 + max(device for device, _ in publishers + receivers)
        with refit.Plan.build(table for table, _ in tables) as plan, refit.Group(range(devices), refit.Backend.HOST) as group:
            for route in plan.routes():
                group.copy_batch(route.dst_device, route.segments)
        for table, _ in tables:
            table.close()
        for ranks, layers, params in received:
            expected = vllm_params(model, ranks, ckpt, layers)
            self.assertEqual(set(expected), {name[len("module."):] for name in params})
            for name, tensor in params.items():
                self.assertEqual(tensor.values(), expected[name[len("module."):]], f"{ranks} {name}")

    def test_qwen3_moe_megatron_tp2_pp2_ep2_to_vllm_tp4(self):
        self.refit(QWEN3_MOE, megatron_world(QWEN3_MOE, tp=2, pp=2, ep=2), vllm_world(QWEN3_MOE, tp=4), [range(2)] * 4)

    def test_qwen3_moe_megatron_ep4_stacked_experts_to_vllm_tp2_pp2_with_expert_parallelism(self):
        self.refit(
            QWEN3_MOE,
            megatron_world(QWEN3_MOE, tp=1, pp=1, ep=4, grouped=True),
            vllm_world(QWEN3_MOE, tp=2, pp=2, ep=2),
            [range(0, 1)] * 2 + [range(1, 2)] * 2,
        )

    def test_llama_megatron_tp2_one_kv_head_to_vllm_tp2_pp2(self):
        self.refit(LLAMA, megatron_world(LLAMA, tp=2, pp=1), vllm_world(LLAMA, tp=2, pp=2), [range(0, 2)] * 2 + [range(2, 3)] * 2)


def recording_of(model, layouts, staged=()):
    """A Recording as the recorder would give it for these layouts (what vLLM's loader does for
    them), with the checkpoint tensors in `staged` taking the staging path instead."""
    params = {l.name: ParamInfo(l.shape, HostTensor(l.shape).stride(), "torch.bfloat16") for l in layouts}
    kept = [dataclasses.replace(l, pieces=tuple(p for p in l.pieces if p.tensor not in staged)) for l in layouts]
    checkpoint = {n: TensorSpec(n, s, "bfloat16") for n, s in model.checkpoint_tensors().items()}
    writers = {t: [l.name for l in layouts if any(p.tensor == t for p in l.pieces)] for t in staged}
    return Recording([l for l in kept if l.pieces], {t: "computed by mul" for t in staged}, params, checkpoint, [], {}, writers)


class RecordedReceiverTest(unittest.TestCase):
    """The receiver side of a recording (receiver.py) without torch: needs at the live parameters'
    addresses, staged tensors whole into staging and then through the loader, refusals."""

    def test_a_recorded_llama_receiver_with_a_staged_tensor(self):
        model = LLAMA
        ckpt = checkpoint(model)
        ranks = VllmRanks(tp=2, tp_rank=1)
        layouts = vllm_layouts(model, ranks)
        norm = "model.norm.weight"
        receiver = VllmReceiver(recording_of(model, layouts, staged=(norm,)))
        self.assertEqual(receiver.staged, {norm: "computed by mul"})
        params = {l.name: HostTensor(l.shape) for l in layouts}
        staging = receiver.staging_buffers(lambda shape, dtype: HostTensor(shape))
        tables = []
        for device, mranks in megatron_world(model, tp=2, pp=1, dp=1):
            publisher = MegatronPublisher(model, mranks)
            values = megatron_params(model, mranks, ckpt)
            source = {l.name: HostTensor(l.shape, values[l.name]) for l in publisher.layouts}
            tables.append((publisher.table(source, 0, device=device), source))
        with refit.Table() as table:
            with self.assertRaises(refit.RefitError) as caught:
                receiver.add_to(table, params, 0, device=2)
            self.assertIn("no staging buffer", caught.exception.message)
        tables.append((receiver.table(params, 0, device=2, staging=staging), params))
        with refit.Plan.build(t for t, _ in tables) as plan, refit.Group(range(3), refit.Backend.HOST) as group:
            for route in plan.routes():
                group.copy_batch(route.dst_device, route.segments)
        for table, _ in tables:
            table.close()
        expected = vllm_params(model, ranks, ckpt, range(model.layers))
        self.assertEqual(params[norm].values(), [POISON] * model.hidden)  # not written by the plan
        self.assertEqual(staging[norm].values(), expected[norm])  # the whole tensor, in staging
        loaded = []

        def loader(items):  # the engine's loader: here it places the norm as it is
            for name, tensor in items:
                loaded.append(name)
                params[norm].buffer[:] = tensor.buffer

        self.assertEqual(receiver.load_staged(loader, staging), 1)
        self.assertEqual(loaded, [norm])
        for name, tensor in params.items():
            self.assertEqual(tensor.values(), expected[name], name)

    def test_a_recorded_receiver_refuses_parameters_other_than_the_recorded_ones(self):
        layouts = vllm_layouts(LLAMA, VllmRanks())
        receiver = VllmReceiver(recording_of(LLAMA, layouts))
        params = {l.name: HostTensor(l.shape) for l in layouts}
        with refit.Table() as table:
            for bad, text in (
                ({**params, "model.norm.weight": HostTensor((9,))}, "changed shape, strides or dtype"),
                ({**params, "extra.bias": HostTensor((2,))}, "1 new"),
            ):
                with self.assertRaises(refit.RefitError) as caught:
                    receiver.add_to(table, bad, 0, device=0)
                self.assertEqual(caught.exception.status, refit.Status.INVALID_ARGUMENT)
                self.assertIn(text, caught.exception.message)

    def test_a_post_processed_parameter_takes_the_reload_path_through_staging(self):
        layouts = vllm_layouts(LLAMA, VllmRanks())
        params = {l.name: HostTensor(l.shape) for l in layouts}
        down = "model.layers.0.mlp.down_proj.weight"
        post = VllmReceiver(recording_of(LLAMA, layouts), post={down: "X.process_weights_after_loading"})
        self.assertEqual(post.paths[down], "reload")
        self.assertEqual({n for n, path in post.paths.items() if path != "boxes"}, {down})
        self.assertEqual(post.reload, {down: "X.process_weights_after_loading"})
        self.assertIn("1 in 1 layers go through vLLM's layerwise reload", post.summary())
        with refit.Table() as table, self.assertRaises(refit.RefitError) as caught:
            post.add_to(table, params, 0, device=0)
        self.assertIn("no staging buffer", caught.exception.message)
        staging = post.staging_buffers(lambda shape, dtype: HostTensor(shape))
        self.assertEqual(list(staging), [down])
        # The engine may have reshaped the post-processed parameter (a padded, repacked copy).
        reshaped = {**params, down: HostTensor((3, 5))}
        with refit.Table() as table:
            boxes = sum(len(l.pieces) for l in layouts if l.name != down)
            self.assertEqual(post.add_to(table, reshaped, 0, device=0, staging=staging), boxes + 1)
        self.assertEqual(post.recorded.reloaded_tensors(staging), [(down, staging[down])])


class BindingTest(unittest.TestCase):
    def setUp(self):
        self.receiver = VllmReceiver(LLAMA, VllmRanks())
        self.params = {layout.name: HostTensor(layout.shape) for layout in self.receiver.layouts}

    def assert_refused(self, params, text, **kwargs):
        with refit.Table() as table, self.assertRaises(refit.RefitError) as caught:
            self.receiver.add_to(table, params, 0, device=0, **kwargs)
        self.assertEqual(caught.exception.status, refit.Status.INVALID_ARGUMENT)
        self.assertIn(text, caught.exception.message)

    def test_extra_missing_and_mismatched_parameters_are_refused(self):
        extra = {**self.params, "model.layers.0.self_attn.qkv_proj.bias": HostTensor((8,))}
        self.assert_refused(extra, "qkv_proj.bias")
        with refit.Table() as table:  # not strict: the extra parameter is left out
            added = self.receiver.add_to(table, extra, 0, device=0, strict=False)
            self.assertEqual(added, sum(len(layout.pieces) for layout in self.receiver.layouts))
        missing = dict(self.params)
        del missing["model.norm.weight"]
        self.assert_refused(missing, "missing")
        wrong = {**self.params, "model.norm.weight": HostTensor((9,))}
        self.assert_refused(wrong, "model.norm.weight has shape [9]")

    def test_non_contiguous_wrong_dtype_and_deviceless_parameters_are_refused(self):
        strided = HostTensor((8, 12))
        strided.stride = lambda: (1, 8)
        self.assert_refused({**self.params, "model.layers.0.mlp.down_proj.weight": strided}, "not contiguous")
        wrong = HostTensor((8,))
        wrong.dtype = "torch.float16"
        self.assert_refused({**self.params, "model.norm.weight": wrong}, "float16")
        with refit.Table() as table, self.assertRaises(refit.RefitError) as caught:
            self.receiver.add_to(table, self.params, 0)
        self.assertIn("needs device=", caught.exception.message)


class StridedView(HostTensor):
    """Columns [3, 6) of a [4, 6] HostTensor, as torch's `t[:, 3:]`."""

    def __init__(self, base: HostTensor) -> None:
        self.base, self.shape, self.buffer, self.device = base, (4, 3), base.buffer, base.device

    def data_ptr(self) -> int:
        return self.base.data_ptr() + 3 * 2

    def stride(self):
        return (6, 1)


class TensorHelperTest(unittest.TestCase):
    def test_a_strided_view_offered_and_a_tensor_needed(self):
        weight = HostTensor((4, 6), [10 * r + c + 1 for r in range(4) for c in range(6)])
        shard = HostTensor((4, 3))
        with refit.Table() as publisher, refit.Table() as receiver:
            add_tensor_offer(publisher, "w.right", StridedView(weight), rank=0, device=0)
            add_tensor_need(receiver, "w", shard, rank=0, shape=(4, 6), offset=(0, 3), device=1)
            add_tensor_offer(publisher, "w", weight, rank=0, device=0)
            with self.assertRaises(refit.RefitError) as caught:
                add_tensor_offer(publisher, "w", weight, rank=0)
            self.assertIn("needs device=", caught.exception.message)
            with self.assertRaises(refit.RefitError):
                add_tensor_need(receiver, "w", shard, rank=0, shape=(4, 6, 1), device=1)
            right = HostTensor((4, 3))
            add_tensor_need(receiver, "w.right", right, rank=0, device=1)
            with refit.Plan.build([publisher, receiver]) as plan, refit.Group([0, 1], refit.Backend.HOST) as group:
                for route in plan.routes():
                    group.copy_batch(route.dst_device, route.segments)
        want = [10 * r + c + 1 for r in range(4) for c in range(3, 6)]
        self.assertEqual(shard.values(), want)
        self.assertEqual(right.values(), want)


@dataclasses.dataclass
class StandInStats:
    bytes: int
    segments: int


class StandInExecutor:
    """Plan.executor's interface over routes and copy_batch, for as long as this branch has no
    executor: run, rebind (moves destination addresses), close."""

    built = 0

    def __init__(self, plan, group, process, **options):
        StandInExecutor.built += 1
        self.group, self.routes = group, [r for r in plan.routes() if r.dst_rank == process]

    def run(self, stream=None):
        for route in self.routes:
            self.group.copy_batch(0, route.segments, stream)
        segments = [s for route in self.routes for s in route.segments]
        return StandInStats(sum(s.bytes for s in segments), len(segments))

    def rebind(self, device, old, new, length):
        # A segment may join runs of several buffers (the planner coalesces by address): move runs.
        def runs(route):
            for segment in route.segments:
                for src, dst, n in segment.runs():
                    yield refit.Segment(src, dst - old + new if old <= dst < old + length else dst, n)

        self.routes = [dataclasses.replace(r, segments=tuple(runs(r))) for r in self.routes]

    def close(self):
        pass


class FakeModel:
    def __init__(self, params):
        self.params = params

    def named_parameters(self):
        return iter(self.params.items())


class FakeWorker(RefitWorkerExtension):
    """What vLLM's worker gives the extension: self.model_runner.model and self.device."""

    def __init__(self, params):
        self.model_runner = type("Runner", (), {"model": FakeModel(params)})()


class WorkerExtensionTest(unittest.TestCase):
    def setUp(self):
        self.stand_in = not hasattr(refit.Plan, "executor")
        if self.stand_in:
            refit.Plan.executor = lambda plan, group, process, **options: StandInExecutor(plan, group, process, **options)

    def tearDown(self):
        if self.stand_in:
            del refit.Plan.executor

    def test_receive_reuse_and_rebind_through_the_extension(self):
        model = LLAMA
        ckpt = checkpoint(model)
        publisher = MegatronPublisher(model, MegatronRanks())
        values = megatron_params(model, publisher.ranks, ckpt)
        source = {layout.name: HostTensor(layout.shape, values[layout.name]) for layout in publisher.layouts}
        with publisher.table(source, 0, device=0) as offers:
            encoded_offers = offers.encode()
        params = {layout.name: HostTensor(layout.shape) for layout in VllmReceiver(model, VllmRanks()).layouts}
        worker = FakeWorker(params)
        needs = worker.refit_needs(0, model=dataclasses.asdict(model), ranks={}, device=0, backend=refit.Backend.HOST)
        with refit.Table.decode(needs) as table:
            self.assertGreater(len(table.encode()), 0)
        built = StandInExecutor.built
        stats = worker.refit_receive([encoded_offers])
        expected = vllm_params(model, VllmRanks(), ckpt, range(model.layers))
        for name, tensor in params.items():
            self.assertEqual(tensor.values(), expected[name], name)
        self.assertIn("fingerprint", stats)
        # A second refit with the same tables reuses the executor; new weights arrive.
        source["decoder.layers.1.mlp.linear_fc2.weight"].buffer[0] = 4242
        worker.refit_receive([encoded_offers])
        self.assertEqual(params["model.layers.1.mlp.down_proj.weight"].buffer[0], 4242)
        if self.stand_in:
            self.assertEqual(StandInExecutor.built, built + 1)
        # The norm's storage moves (as vLLM's sleep mode does): rebind, and the next refit lands there.
        moved = HostTensor((model.hidden,))
        old = params["model.norm.weight"]
        params["model.norm.weight"] = moved
        self.assertEqual(worker.refit_rebind(), 1)
        old.buffer[:] = [POISON] * model.hidden
        worker.refit_receive([encoded_offers])
        self.assertEqual(moved.values(), expected["model.norm.weight"])
        self.assertEqual(old.values(), [POISON] * model.hidden)
        worker.refit_close()
        with self.assertRaises(refit.RefitError):
            worker.refit_receive([encoded_offers])

    def test_a_plan_gone_stale_at_run_is_planned_again_at_the_current_addresses(self):
        # The executor may find, when it runs, that a rebound parameter now lies inside one of its
        # coalesced copies (PLAN_STALE, depending on where the allocator put it): the extension
        # encodes its needs again and plans again, and the refit lands at the new address.
        model = LLAMA
        ckpt = checkpoint(model)
        publisher = MegatronPublisher(model, MegatronRanks())
        values = megatron_params(model, publisher.ranks, ckpt)
        source = {layout.name: HostTensor(layout.shape, values[layout.name]) for layout in publisher.layouts}
        with publisher.table(source, 0, device=0) as offers:
            encoded_offers = offers.encode()
        params = {layout.name: HostTensor(layout.shape) for layout in vllm_layouts(model, VllmRanks())}
        worker = FakeWorker(params)
        first_needs = worker.refit_needs(0, model=dataclasses.asdict(model), ranks={}, device=0, backend=refit.Backend.HOST)
        real_executor = refit.Plan.executor
        runs = []

        class StaleOnce:
            def __init__(self, inner):
                self.inner = inner

            def run(self, stream=None):
                runs.append(1)
                if len(runs) == 1:
                    raise refit.RefitError(refit.Status.PLAN_STALE, "after the rebinds, ranges overlap")
                return self.inner.run(stream)

            def __getattr__(self, name):
                return getattr(self.inner, name)

        refit.Plan.executor = lambda plan, group, process, **options: StaleOnce(real_executor(plan, group, process, **options))
        try:
            moved = HostTensor((model.hidden,))
            params["model.norm.weight"] = moved
            # The caller passes the needs it was given first: stale now, and left out.
            worker.refit_receive([encoded_offers, first_needs])
        finally:
            refit.Plan.executor = real_executor
        self.assertEqual(len(runs), 2)
        self.assertNotEqual(worker._refit()["needs"], first_needs)
        expected = vllm_params(model, VllmRanks(), ckpt, range(model.layers))
        self.assertEqual(moved.values(), expected["model.norm.weight"])
        worker.refit_close()


if __name__ == "__main__":
    unittest.main()
