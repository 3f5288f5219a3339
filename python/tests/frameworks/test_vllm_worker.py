"""RefitWorkerExtension on a vLLM 0.33 model built on CPU: refit_needs records the needs from the
worker's own model class and loader (a meta copy built under the worker's config and parallel
state), refit_receive installs a HF publisher's whole tensors; every element equals what vLLM's
load_weights gives. Parameters vLLM post-processes after loading go through its layerwise reload:
test_vllm_postprocess.py."""

from __future__ import annotations

import unittest

import torch

import compare
import refit
import vllm_harness as harness
from families import FAMILIES
from refit.integrations import RefitWorkerExtension
from refit.integrations.vllm import post_processed


class Worker(RefitWorkerExtension):
    """What vLLM's worker gives the extension: vllm_config and model_runner.model."""

    def __init__(self, config, model) -> None:
        self.vllm_config = config
        self.model_runner = type("Runner", (), {"model": model})()


def publisher_table(ckpt) -> bytes:
    with refit.Table() as table:
        compare.offers(table, ckpt, 0)
        return table.encode()


class WorkerExtensionTest(unittest.TestCase):
    def setUp(self) -> None:
        self.folder = harness.hf_folder("worker", FAMILIES["qwen2"]())
        self.specs = harness.checkpoint_specs(self.folder)
        self.ckpt = harness.index_encoded(self.specs)

    def test_recorded_needs_receive_what_vllm_loads(self) -> None:
        parallel = harness.Parallel(2)
        config = harness.engine_config(self.folder, parallel)
        with harness.as_rank(config, parallel, 1, 0):
            truth = compare.poisoned(harness.build(config, "cpu"))
            truth.load_weights(iter(self.ckpt.items()))
            engine = compare.poisoned(harness.build(config, "cpu"))
            worker = Worker(config, engine)
            worker.refit_needs(0, device=0, backend=refit.Backend.HOST)  # checkpoint: the folder's headers
            stats = worker.refit_receive([publisher_table(self.ckpt)])
            self.assertIn("fingerprint", stats)
            result = compare.RankResult(1, 0)
            compare.compare_model(truth, engine, result, {n for n, _ in engine.named_parameters()})
            self.assertEqual(result.mismatches, [])
            self.assertGreater(result.padding, 0)  # 150 rows padded to 192: rank 1 holds 42 of padding
            worker.refit_close()


class PostProcessingTest(unittest.TestCase):
    """post_processed on layers whose quant method does each kind of thing after loading."""

    def test_changes_are_found_and_a_copy_onto_itself_is_not_one(self) -> None:
        class Method:
            def __init__(self, how: str) -> None:
                self.how = how

            def process_weights_after_loading(self, layer) -> None:
                w = layer.w
                if self.how == "identity":  # as the unquantized MoE method does when nothing pads
                    w.data.copy_(w.data)
                elif self.how == "swap":  # as FlashInfer's CUTLASS path swaps w13's halves
                    w.data.copy_(torch.cat([w.data[2:], w.data[:2]]))
                elif self.how == "replace":
                    layer.w.data = w.data.t().contiguous()
                elif self.how == "raise":
                    raise RuntimeError("a kernel the meta device has not")

        class Layer(torch.nn.Module):
            def __init__(self, how: str) -> None:
                super().__init__()
                self.w = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
                self.quant_method = Method(how)

        model = torch.nn.Module()
        for how in ("identity", "swap", "replace", "raise"):
            model.add_module(how, Layer(how))
        config = harness.engine_config(harness.hf_folder("post", FAMILIES["llama"]()), harness.Parallel(1))
        found = post_processed(model, config)
        self.assertEqual(sorted(found), ["raise.w", "replace.w", "swap.w"])
        self.assertIn("could not run on the meta device", found["raise.w"])


if __name__ == "__main__":
    unittest.main()
