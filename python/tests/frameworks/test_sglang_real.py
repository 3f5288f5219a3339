"""refit's SGLang adapter (refit.integrations.sglang) against SGLang 0.5.23's own code on CPU.

What is SGLang's own, in each of two TP-rank processes (a real gloo world of two, SGLang's
parallel_state groups, the runtime context published from a real ServerArgs with
`custom_weight_loader=[LOADER]`):

- the model: SGLang's Qwen3ForCausalLM, built and loaded by SGLang's DefaultModelLoader
  (`sglang.srt.model_loader.get_model`) at TP 2 on CPU, fused qkv_proj / gate_up_proj as SGLang
  lays them out;
- the update path: the scheduler's SchedulerWeightUpdaterManager (begin_weight_update,
  update_weights_from_tensor, end_weight_update, with its barrier on SGLang's TP CPU group) over
  ModelRunner's WeightUpdater, whose `load_format in custom_weight_loaders` branch calls
  `dynamic_import(LOADER)(model, named_tensors)`; the request is SGLang's
  UpdateWeightsFromTensorReqInput carrying one MultiprocessingSerializer payload per TP rank (as
  Engine.update_weights_from_tensor serializes them) and each rank deserializes its own with
  TpModelWorker.deserialize_own_rank;
- the reference: SGLang's own disk-load path, DefaultModelLoader.load_weights_and_postprocess
  (the model's load_weights, then post-processing) of the same checkpoint.

The trainer calls through refit's `engine_call(engine)` (begin_weight_update,
update_weights_from_tensor, end_weight_update), on a stand-in for sglang.Engine.

What is still stood in for: the engine's processes and transport (sglang.Engine and the tokenizer
manager's ZMQ fan-out to the schedulers are a class whose three methods send to a pipe per rank; a
`SimpleNamespace` is the TpModelWorker that holds the ModelRunner, and the scheduler hooks the
manager calls, flush_cache and record_weight_version_change, do nothing); no forward pass runs
(SGLang's attention and CPU kernels need sgl-kernel, which has no CPU build on PyPI); and, as in
the vLLM tests, a verify mismatch is a stand-in executor (refit's verify cannot be made to fail
from Python). SGLANG_NCCL_SO_PATH names no library in the rank processes, SGLang's own way of
running its groups without a GPU (gloo only).

- Two updates through SGLang's updater equal SGLang's own load of the checkpoint (and of it
  bumped), every element; the second re-plans nothing.
- Outside a begin/end session SGLang 0.5.23 refuses update_weights_from_tensor (the trainer's
  engine call must open one; this suite's does, as a user's has to).
- A verify mismatch on rank 0 refuses the update on both ranks and every element stays as it was.
  SGLang does not catch a custom loader's error (a real scheduler's event loop would end on it), so
  the loader raises nothing: the test checks that SGLang's updater answered every call, that the
  refusal reaches the trainer through refit's own round agreement, that each rank logged its own
  refusal, that no element moved on either rank, and that engine_call closed the session.
"""

from __future__ import annotations

import os
import unittest
from typing import Any, Dict, List

import sglang_driver
import test_vllm_backend as shared

HERE = os.path.dirname(os.path.abspath(__file__))
TP = 2


def sglang_rank_main(rank: int, folder: str, port: int, conn: Any) -> None:
    import sys

    sys.path.insert(0, HERE)
    sglang_rank = sglang_driver.sglang_rank(rank, TP, folder, port)  # first: it sets SGLang's environment
    import torch
    from sglang.srt.model_loader.loader import DefaultModelLoader

    from refit.integrations import sglang as adapter

    model = sglang_rank.model
    ckpt = shared.checkpoint(folder)
    snapshot: Dict[str, Any] = {}

    def differing(expected: Dict[str, Any]) -> List[str]:
        return [n for n, p in model.named_parameters() if not torch.equal(p.detach(), expected[n])]

    def loaded(bumps: int) -> Dict[str, Any]:
        """SGLang's own load (load_weights, then post-processing) of the checkpoint after `bumps`
        bumps (1.0 added to every element, one bump at a time as the trainer does)."""
        weights = dict(ckpt)
        for _ in range(bumps):
            weights = {n: t + 1.0 for n, t in weights.items()}
        reference = sglang_rank.build("dummy")
        DefaultModelLoader.load_weights_and_postprocess(reference, iter(list(weights.items())), torch.device("cpu"))
        return {n: p.detach() for n, p in reference.named_parameters()}

    while True:
        try:
            kind, arg = conn.recv()
        except EOFError:
            return
        try:
            if kind in sglang_driver.WEIGHT_UPDATE_KINDS:
                value: Any = sglang_driver.weight_update(sglang_rank.manager, kind, arg)
            elif kind == "describe":
                value = {
                    "class": type(model).__module__ + "." + type(model).__name__,
                    "params": sorted(n for n, _ in model.named_parameters()),
                    "tp": adapter.sglang_tp(),
                }
            elif kind == "snapshot":
                snapshot.update((n, p.detach().clone()) for n, p in model.named_parameters())
                value = len(snapshot)
            elif kind == "unchanged":
                value = differing(snapshot)
            elif kind == "loaded":
                value = differing(loaded(arg))
            elif kind == "plans":
                value = adapter._receivers[id(model)].link.plans_built
            elif kind == "poison_verify":
                receiver = adapter._receivers[id(model)]
                receiver.link.executor = shared.StandInVerifyMismatch(receiver.link.executor)
                value = None
            elif kind == "refusals":
                value = list(adapter._receivers[id(model)].refusals)
            elif kind == "exit":
                return
            else:
                raise ValueError(kind)
            conn.send(("ok", value))
        except BaseException as error:
            conn.send(("error", f"{type(error).__name__}: {error}"))


def trainer_main(scenario: str, folder: str, conns: List[Any], results: Any) -> None:
    try:
        import torch
        import transformers

        from refit.integrations.engine_link import LinkOptions
        from refit.integrations.sglang import CONTROL_NAME, SglangTrainer, control, engine_call

        call = sglang_driver.fan_out(conns)
        out: Dict[str, Any] = {"describe": call("describe")}
        # SGLang 0.5.23 refuses an update outside a begin/end session (and says why).
        shutdown = [(CONTROL_NAME, control({"op": "shutdown"}))]
        out["outside_session"] = call("update", sglang_driver.update_request(shutdown, "refit.integrations.sglang.refit_loader", TP))

        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        engine = sglang_driver.Engine(call, TP)
        trainer = SglangTrainer(engine_call(engine), model, num_workers=TP, device_backend="host", options=LinkOptions(timeout_ms=shared.TIMEOUT_MS))
        out["dummy"] = call("loaded", 0)  # before any update: the dummy weights differ from the checkpoint
        trainer.update()
        out["first"] = call("loaded", 0)

        sglang_driver.run_scenario(scenario, trainer, model, call, conns, out)
        if scenario == "updates":
            out["plans"] = call("plans") + [trainer.link.plans_built]
        else:
            out["end_after_refusal"] = call("end")
        results.put(out)
        trainer.shutdown()
        for conn in conns:
            conn.send(("exit", None))
    except BaseException:
        import traceback

        results.put({"error": traceback.format_exc()})


class SglangRealTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.folder = shared.save_checkpoint()

    def run_scenario(self, scenario: str) -> Dict[str, Any]:
        out = sglang_driver.run_processes(TP, sglang_rank_main, (self.folder, sglang_driver.free_port()), trainer_main, (scenario, self.folder), 480)
        self.assertNotIn("error", out, out.get("error"))
        return out

    def check_sglang_built_the_ranks(self, out: Dict[str, Any]) -> None:
        for rank, described in enumerate(out["describe"]):
            self.assertEqual(described["class"], "sglang.srt.models.qwen3.Qwen3ForCausalLM")
            self.assertEqual(tuple(described["tp"]), (TP, rank))
            self.assertIn("model.layers.0.self_attn.qkv_proj.weight", described["params"])
            self.assertIn("model.layers.0.mlp.gate_up_proj.weight", described["params"])
        success, message = out["outside_session"][0]
        self.assertFalse(success)
        self.assertIn("begin_weight_update", message)
        # Every parameter of the dummy-loaded model differs from the checkpoint's, so the
        # comparisons after an update cannot pass by leaving the weights alone.
        self.assertEqual([sorted(d) for d in out["dummy"]], [d["params"] for d in out["describe"]])

    def test_updates_through_sglangs_updater_equal_sglangs_own_load(self):
        out = self.run_scenario("updates")
        self.check_sglang_built_the_ranks(out)
        self.assertEqual(out["first"], [[], []])
        self.assertEqual(out["second"], [[], []])
        self.assertEqual(out["plans"], [1, 1, 1])

    def test_a_verify_mismatch_refuses_the_update_on_every_rank(self):
        out = self.run_scenario("verify")
        self.check_sglang_built_the_ranks(out)
        self.assertEqual(out["first"], [[], []])
        # The trainer hears of it through refit's round agreement; SGLang's updater answered every
        # call (the loader raised nothing into it, which would end a real scheduler); each rank
        # logged its own refusal: the mismatch on rank 0, the other process's failure on rank 1.
        self.assertIn("failed on process", out["refused"] or "")
        self.assertEqual(out["unchanged"], [[], []])
        first, second = out["refusals"]
        self.assertEqual(len(first), 1)
        self.assertIn("VERIFY_MISMATCH", first[0])
        self.assertEqual(len(second), 1)
        self.assertIn("update refused", second[0])
        # The session is closed by the engine call after the refused update.
        self.assertEqual(out["end_after_refusal"], [(False, "no weight-update session is open; call begin_weight_update() first")] * TP)


if __name__ == "__main__":
    unittest.main()
