"""vLLM 0.33's own model classes (built on CPU per rank) loaded by their own load_weights, against
what refit installs from needs recorded from that same loader: every element of every parameter,
for each family of families.py at each parallel layout of its MATRIX. Targets: 0 mismatching
elements, 0 parameters only one side writes, 0 refusals. A family vLLM cannot build on its CPU
platform is reported as a skip with vLLM's reason (printed and counted as skipped, never passed)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import sys
import unittest
from typing import Any, Dict, List

import compare
import vllm_harness as harness
from families import ARCHITECTURES, FAMILIES, MATRIX
from refit.integrations.recorder import Recording

REPORT: List[str] = []


def setUpModule() -> None:
    print(f"\nframeworks: {compare.versions()}", file=sys.stderr)
    # vLLM's CPU wheel has no vllm._C, and NewGELU (GPT-2, GPT-J) and QuickGELU (the vision towers
    # of Qwen2-VL and CLIP) bind _C.gelu_new and _C.gelu_quick when built; the activation plays no
    # part in loading, so it is built without the op.
    from vllm.model_executor.layers import activation

    for op in (activation.NewGELU, activation.QuickGELU):
        op.__init__ = lambda self: activation.CustomOp.__init__(self)


def tearDownModule() -> None:
    for line in REPORT:
        print(line, file=sys.stderr)


@functools.lru_cache(maxsize=None)
def checkpoint(family: str) -> Any:
    folder = harness.hf_folder(family, FAMILIES[family]())
    if family in ARCHITECTURES:  # save_pretrained wrote the Hugging Face class's name
        path = os.path.join(folder, "config.json")
        with open(path) as handle:
            written = json.load(handle)
        written["architectures"] = [ARCHITECTURES[family]]
        with open(path, "w") as handle:
            json.dump(written, handle)
    specs = harness.checkpoint_specs(folder)
    return folder, specs, harness.index_encoded(specs)


class VllmLoaderTest(unittest.TestCase):
    def check(self, family: str, parallel: harness.Parallel) -> None:
        folder, specs, ckpt = checkpoint(family)
        try:
            config = harness.engine_config(folder, parallel)
        except Exception as error:  # vLLM refuses this configuration on its CPU platform
            REPORT.append(f"frameworks: {family} {parallel.label()}: vLLM cannot build it on CPU: {error}")
            self.skipTest(f"vLLM cannot build {family} {parallel.label()} on CPU: {error}")
        staged: Dict[str, str] = {}
        padding = 0
        experts: Dict[int, List[int]] = {}
        for tp_rank, pp_rank in parallel.ranks():
            result = compare.run_rank(config, parallel, tp_rank, pp_rank, specs, ckpt)
            if pp_rank == parallel.pp - 1:
                experts[tp_rank] = experts_of(result.recording)
            where = f"{family} {parallel.label()} rank tp{tp_rank}/pp{pp_rank}"
            self.assertEqual(result.mismatches, [], f"{where}: {result.recording.summary() if result.recording else ''}; {result.notes}")
            self.assertEqual(result.only_loader, [], f"{where}: parameters only vLLM's loader writes")
            self.assertEqual(result.only_refit, [], f"{where}: parameters only refit writes")
            self.assertGreater(result.elements, 0, where)
            staged.update(result.staged)
            padding += result.padding
        if parallel.ep and parallel.tp == 4:
            # Where vLLM places experts is read from the engine (recorded), never assumed: DeepSeek
            # has expert groups, so round-robin holds; Qwen3-MoE has none and vLLM falls back to
            # linear placement (expert_map_manager.determine_expert_placement_strategy).
            groups, linear = {r: [r, r + 4] for r in range(4)}, {r: [2 * r, 2 * r + 1] for r in range(4)}
            want = {
                "deepseek_v2_lite": groups, "deepseek_v3": groups, "deepseek_v32": groups, "glm_moe_dsa": linear,
                "qwen3_moe": linear, "qwen2_moe": linear, "qwen3_vl_moe": linear, "qwen3_5_moe": linear,
            }
            self.assertEqual(experts, want[family], f"{family} {parallel.label()}: experts per rank")
        REPORT.append(
            f"frameworks: {family} {parallel.label()}: experts per TP rank {experts or 'n/a'}; {len(parallel.ranks())} ranks equal vLLM's loader element for "
            f"element; {padding} padding elements (zero-filled by vLLM, left by refit); staged: {staged or 'none'}"
        )


def experts_of(recording: Recording) -> List[int]:
    """The checkpoint experts whose weights land on this rank (in the last MoE layer it holds): a
    tensor per expert, or the experts' rows of a fused one ([experts, ...]: Qwen3-VL-MoE)."""
    found: Dict[int, set] = {}
    for layout in recording.layouts:
        for piece in layout.pieces:
            match = re.search(r"layers\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward)\.experts\.(?:(\d+)\.|(?:gate_up|down)_proj$)", piece.tensor)
            if match:
                first, count = (int(match.group(2)), 1) if match.group(2) else (piece.offset[0], piece.extent[0])
                found.setdefault(int(match.group(1)), set()).update(range(first, first + count))
    return sorted(found[max(found)]) if found else []


def _add_cases() -> None:
    for family, layouts in MATRIX.items():
        for parallel in layouts:
            name = f"test_{family}_{parallel.label()}"
            setattr(VllmLoaderTest, name, lambda self, f=family, p=parallel: self.check(f, p))


_add_cases()


class StaleStageCacheTest(unittest.TestCase):
    """vLLM caches a model's pipeline-missing layers by id(model); a model built where a freed model
    of another stage lived would inherit that answer. forget_pp_layers (called by every build)
    drops it: planted here as such a stale entry, the recording of stage 1 stages nothing."""

    def test_a_stale_entry_for_the_models_id_is_dropped(self) -> None:
        from refit.integrations.recorder import record
        from refit.integrations.vllm import forget_pp_layers
        from vllm.model_executor.models import utils

        folder, specs, _ = checkpoint("deepseek_v2_lite")  # its loader looks stages up by name
        parallel = harness.Parallel(1, 2)
        config = harness.engine_config(folder, parallel)
        recordings = []
        for forget in (False, True):
            with harness.as_rank(config, parallel, 0, 1):
                model = harness.build(config, "meta")
                # What the inner model of stage 0 holds missing, under this inner model's id.
                utils._model_to_pp_missing_layer_names[id(model.model)] = ["layers.1", "norm"]
                if forget:
                    forget_pp_layers(model)
                recordings.append(record(model.load_weights, list(model.named_parameters()), specs, cache=False))
        stale, fresh = recordings
        self.assertNotEqual(stale.staged, {})  # the loader failed on stage 1's own tensors
        self.assertEqual(fresh.staged, {})


class RecordingKeyTest(unittest.TestCase):
    """DeepSeek-V3.2 and GLM-5 are alike in every parameter and checkpoint tensor here, but vLLM
    places GLM-5's experts linearly where round-robin is asked (it has one expert group): recorded
    under the engine's key (refit.integrations.vllm.recording_key), rank 0 of TP 4 gets experts 0 and 4
    of the one, 0 and 1 of the other, never one cached recording for both."""

    def test_models_alike_in_shapes_but_placing_experts_apart_share_no_recording(self) -> None:
        from refit.integrations.recorder import record
        from refit.integrations.vllm import recording_key

        parallel = harness.Parallel(4, ep=True, placement="round_robin")
        found = {}
        for family in ("deepseek_v32", "glm_moe_dsa"):
            folder, specs, _ = checkpoint(family)
            config = harness.engine_config(folder, parallel)
            with harness.as_rank(config, parallel, 0, 0):
                model = harness.build(config, "meta")
                shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
                found[family] = (shapes, specs, record(model.load_weights, list(model.named_parameters()), specs, key=recording_key(config)))
        (v32_shapes, v32_specs, v32), (glm_shapes, glm_specs, glm) = found["deepseek_v32"], found["glm_moe_dsa"]
        self.assertEqual(v32_shapes, glm_shapes)  # what makes the case: only the configuration differs
        self.assertEqual(v32_specs, glm_specs)
        self.assertEqual(experts_of(v32), [0, 4])
        self.assertEqual(experts_of(glm), [0, 1])


class SwappedLayoutTest(unittest.TestCase):
    """The comparison can fail: two equal-sized pieces of a recorded layout swapped (gate and up of
    a fused gate_up, then q and k rows of a fused qkv) must show up as mismatching elements."""

    def test_swapping_two_pieces_is_caught(self) -> None:
        folder, specs, ckpt = checkpoint("llama")
        parallel = harness.Parallel(2)
        config = harness.engine_config(folder, parallel)

        def swap(recording: Recording) -> Recording:
            layouts = list(recording.layouts)
            for i, layout in enumerate(layouts):
                pieces = list(layout.pieces)
                pairs = [(a, b) for a in range(len(pieces)) for b in range(a + 1, len(pieces)) if pieces[a].extent == pieces[b].extent and pieces[a].tensor != pieces[b].tensor]
                if layout.name.endswith("gate_up_proj.weight") and pairs:
                    a, b = pairs[0]
                    pieces[a], pieces[b] = dataclasses.replace(pieces[a], at=pieces[b].at), dataclasses.replace(pieces[b], at=pieces[a].at)
                    layouts[i] = dataclasses.replace(layout, pieces=tuple(pieces))
                    return dataclasses.replace(recording, layouts=layouts)
            self.fail("no gate_up_proj with two equal pieces to swap")

        result = compare.run_rank(config, parallel, 1, 0, specs, ckpt, tamper=swap)
        self.assertEqual(len(result.mismatches), 1, result.mismatches)
        self.assertIn("gate_up_proj.weight", result.mismatches[0])
        # The untampered recording still passes (the cache was not changed by the swap).
        self.assertEqual(compare.run_rank(config, parallel, 1, 0, specs, ckpt).mismatches, [])


if __name__ == "__main__":
    unittest.main()
