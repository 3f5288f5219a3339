"""Parameters vLLM transforms after loading, received through vLLM's own layerwise reload.

On vLLM's CPU platform a Qwen3-MoE layer's experts are post-processed after loading: the CPU MoE
backend pads the intermediate dimension (`_pad_moe_intermediate`: w13 [8, 32, 32] becomes
[8, 64, 32]) and prepacks both weights (`cpu_prepack_moe_weight`). Checkpoint-layout bytes written
into those live parameters would be wrong. refit stages the checkpoint tensors of those layers whole
and runs vLLM's layerwise reload on them (VllmReceiver.install_staged). After an update through
RefitWorkerExtension, every live parameter equals what vLLM's own load_weights +
process_weights_after_loading gives from the same checkpoint, the live parameters kept their
storage, and the receiver says which path each parameter took. (The same through the weight-transfer
backend: test_vllm_backend's Qwen3-MoE case.)

One stand-in: the prepack itself is a compiled kernel (`torch.ops._C.prepack_moe_weight`) that
vLLM's pip wheel (a CUDA build) does not ship for CPU. `install_prepack_stand_in` registers an op of
that name and signature whose CPU kernel writes a fixed rearrangement (reversed last dimension,
doubled), so the post-processing runs, really transforms the weights, and any path that skipped it
or wrote checkpoint bytes would differ. Everything else (padding, parameter replacement, the
reload) is vLLM's own code.
"""

from __future__ import annotations

import logging
import unittest
from typing import Any, Dict

import torch

import compare
import refit
import vllm_harness as harness
from families import FAMILIES
from refit.integrations import RefitWorkerExtension

_LIBRARY: list = []


def install_prepack_stand_in() -> None:
    """`torch.ops._C.prepack_moe_weight(weight, output, isa)` where vLLM's CPU kernels are missing
    (see the module)."""
    try:
        torch.ops._C.prepack_moe_weight
        return
    except (AttributeError, RuntimeError):
        pass
    library = torch.library.Library("_C", "FRAGMENT")
    library.define("prepack_moe_weight(Tensor weight, Tensor(a!) output, str isa) -> ()")

    def prepack(weight: torch.Tensor, output: torch.Tensor, isa: str) -> None:
        output.copy_(weight.flip(-1) * 2.0)

    library.impl("prepack_moe_weight", prepack, "CPU")
    library.impl("prepack_moe_weight", lambda weight, output, isa: None, "Meta")
    _LIBRARY.append(library)  # registered for the life of the process


def loaded_and_processed(config: Any, ckpt: Dict[str, torch.Tensor]) -> torch.nn.Module:
    """What vLLM makes of `ckpt`: its model class, load_weights, then process_weights_after_loading."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model = harness.build(config, "cpu")
    model.load_weights(iter(ckpt.items()))
    process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    return model


def differing(expected: torch.nn.Module, got: torch.nn.Module) -> list:
    want, have = dict(expected.named_parameters()), dict(got.named_parameters())
    out = sorted(set(want) ^ set(have))
    out += [n for n in want if n in have and (want[n].shape != have[n].shape or not torch.equal(want[n], have[n]))]
    return out


class Worker(RefitWorkerExtension):
    def __init__(self, config, model) -> None:
        self.vllm_config = config
        self.model_runner = type("Runner", (), {"model": model})()


class PostProcessedReloadTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        install_prepack_stand_in()
        cls.folder = harness.hf_folder("postprocess", FAMILIES["qwen3_moe"]())
        cls.specs = harness.checkpoint_specs(cls.folder)
        cls.ckpt = harness.index_encoded(cls.specs)
        cls.update = {name: tensor * 3.0 + 7.0 for name, tensor in cls.ckpt.items()}

    def check_rank(self, parallel: Any, tp_rank: int) -> None:
        config = harness.engine_config(self.folder, parallel)
        with harness.as_rank(config, parallel, tp_rank, 0):
            engine = loaded_and_processed(config, self.ckpt)
            expected = loaded_and_processed(config, self.update)
            # The post-processing really transforms the experts: checkpoint bytes would differ.
            plain = harness.build(config, "cpu")
            plain.load_weights(iter(self.update.items()))
            experts = [n for n, _ in expected.named_parameters() if ".routed_experts." in n]
            self.assertEqual(len(experts), 4)
            for name in experts:
                self.assertNotEqual(tuple(dict(plain.named_parameters())[name].shape), tuple(dict(expected.named_parameters())[name].shape))
            addresses = {n: p.data_ptr() for n, p in engine.named_parameters()}
            worker = Worker(config, engine)
            with self.assertLogs("refit.integrations.vllm", logging.INFO) as logs:
                worker.refit_needs(0, device=0, backend=refit.Backend.HOST)
            receiver = worker._refit()["receiver"]
            self.assertTrue(any("4 in 2 layers go through vLLM's layerwise reload" in line for line in logs.output), logs.output)
            self.assertEqual(sorted(n for n, path in receiver.paths.items() if path == "reload"), sorted(experts))
            self.assertTrue(all(path == "boxes" for n, path in receiver.paths.items() if n not in experts))
            with refit.Table() as table:
                compare.offers(table, self.update, 0)
                worker.refit_receive([table.encode()])
            self.assertEqual(differing(expected, engine), [])
            self.assertEqual({n: p.data_ptr() for n, p in engine.named_parameters()}, addresses, "live storage moved")
            # Another update (the original checkpoint) through the same executor.
            with refit.Table() as table:
                compare.offers(table, self.ckpt, 0)
                worker.refit_receive([table.encode()])
            self.assertEqual(differing(loaded_and_processed(config, self.ckpt), engine), [])
            worker.refit_close()

    def test_tp1_worker_extension_equals_vllms_load_and_post_processing(self) -> None:
        self.check_rank(harness.Parallel(1), 0)

    def test_tp2_ep_worker_extension_equals_vllms_load_and_post_processing(self) -> None:
        for rank in range(2):
            with self.subTest(rank=rank):
                self.check_rank(harness.Parallel(2, ep=True), rank)


if __name__ == "__main__":
    unittest.main()
