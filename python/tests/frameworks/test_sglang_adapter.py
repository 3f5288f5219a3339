"""refit's SGLang adapter (refit.integrations.sglang) over vLLM's model classes, with a stand-in
for SGLang's updater. test_sglang_real.py runs the same loader through SGLang 0.5.23's own
updater and its own Qwen3 model; this module keeps the loader's other side covered, vLLM's model
classes (the layouts receiver_table's rules are written for), through the one place the adapter
meets SGLang: WeightUpdater.update_weights_from_tensor, with `load_format` naming a custom loader,
reduces to `dynamic_import(load_format)(model, [(name, tensor.to(device))])` on every TP rank's
scheduler (sglang/srt/model_executor/model_runner_components/weight_updater.py, 0.5.23). The
stand-in does exactly that in each rank's process (importlib for dynamic_import); SGLang's
begin/end weight-update session is not stood in for here (test_sglang_real has it). The ranks hold
the model vLLM builds per TP rank on CPU, so every element is compared with vLLM's own
load_weights from the same checkpoint.

- Two updates through the loader equal load_weights of the checkpoint (and of it bumped).
- A stand-in verify mismatch on rank 0 (its real step stages its bytes, then reports
  VERIFY_MISMATCH) refuses the update on both ranks: every element as before.
"""

from __future__ import annotations

import importlib
import os
import unittest
from typing import Any, Dict, List

import sglang_driver
import test_vllm_backend as shared

HERE = os.path.dirname(os.path.abspath(__file__))


def sglang_rank_main(rank: int, folder: str, conn: Any) -> None:
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    import sys

    sys.path.insert(0, HERE)
    import torch
    import vllm_ranks

    from refit.integrations import sglang as adapter

    config = vllm_ranks.engine_config(folder, 2, dtype="float32")
    ckpt = shared.checkpoint(folder)
    with vllm_ranks.as_rank(config, rank):
        model = vllm_ranks.build(config, "cpu")
        model.config = config.model_config.hf_config
        receiver = adapter.attach(model, tp=(2, rank), table_of=adapter.receiver_table)
        snapshot: Dict[str, Any] = {}

        def differing(expected: Dict[str, Any]) -> List[str]:
            return [n for n, p in model.named_parameters() if not torch.equal(p.detach(), expected[n])]

        while True:
            try:
                kind, arg = conn.recv()
            except EOFError:
                return
            try:
                if kind == "update_weights_from_tensor":
                    named, load_format = arg
                    loader = getattr(importlib.import_module(load_format.rsplit(".", 1)[0]), load_format.rsplit(".", 1)[1])
                    loader(model, [(name, tensor.to("cpu")) for name, tensor in named])
                    value: Any = (True, "Success")
                elif kind == "snapshot":
                    snapshot.update((n, p.detach().clone()) for n, p in model.named_parameters())
                    value = None
                elif kind == "unchanged":
                    value = differing(snapshot)
                elif kind == "loaded":
                    reference = vllm_ranks.build(config, "cpu")
                    bumped = dict(ckpt)
                    for _ in range(arg):
                        bumped = {n: t + 1.0 for n, t in bumped.items()}
                    reference.load_weights(iter(list(bumped.items())))
                    value = differing({n: p.detach() for n, p in reference.named_parameters()})
                elif kind == "poison_verify":
                    receiver.link.executor = shared.StandInVerifyMismatch(receiver.link.executor)
                    value = None
                elif kind == "refusals":
                    value = list(receiver.refusals)
                elif kind == "exit":
                    return
                else:
                    raise ValueError(kind)
                conn.send(("ok", value))
            except BaseException as error:
                conn.send(("error", f"{type(error).__name__}: {error}"))


def trainer_main(scenario: str, folder: str, conns: List[Any], results: Any) -> None:
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    try:
        import torch
        import transformers

        from refit.integrations.engine_link import LinkOptions
        from refit.integrations.sglang import SglangTrainer

        call = sglang_driver.fan_out(conns)

        def engine_call(named, load_format):  # stands in for Engine.update_weights_from_tensor
            return call("update_weights_from_tensor", (named, load_format))[0]

        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        trainer = SglangTrainer(engine_call, model, num_workers=2, device_backend="host", options=LinkOptions(timeout_ms=shared.TIMEOUT_MS))
        out: Dict[str, Any] = {}
        trainer.update()
        out["first"] = call("loaded", 0)

        sglang_driver.run_scenario(scenario, trainer, model, call, conns, out)
        if scenario == "updates":
            out["plans"] = trainer.link.plans_built
        results.put(out)
        trainer.shutdown()
        for conn in conns:
            conn.send(("exit", None))
    except BaseException:
        import traceback

        results.put({"error": traceback.format_exc()})


class SglangAdapterTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.folder = shared.save_checkpoint()

    def run_scenario(self, scenario: str) -> Dict[str, Any]:
        out = sglang_driver.run_processes(2, sglang_rank_main, (self.folder,), trainer_main, (scenario, self.folder), 300)
        self.assertNotIn("error", out, out.get("error"))
        return out

    def test_updates_through_the_custom_loader_equal_load_weights(self):
        out = self.run_scenario("updates")
        self.assertEqual(out["first"], [[], []])
        self.assertEqual(out["second"], [[], []])
        self.assertEqual(out["plans"], 1)

    def test_a_verify_mismatch_refuses_the_update_on_every_rank(self):
        out = self.run_scenario("verify")
        # The trainer hears of it through refit's round agreement; each rank logged its own refusal
        # (the mismatch on rank 0, the other process's failure on rank 1) and raised nothing into
        # the engine's updater.
        self.assertIn("failed on process", out["refused"] or "")
        self.assertEqual(out["unchanged"], [[], []])
        first, second = out["refusals"]
        self.assertEqual(len(first), 1)
        self.assertIn("VERIFY_MISMATCH", first[0])
        self.assertEqual(len(second), 1)
        self.assertIn("update refused", second[0])


if __name__ == "__main__":
    unittest.main()
