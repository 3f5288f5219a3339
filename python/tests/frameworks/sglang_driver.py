"""The trainer side both SGLang modules drive (test_sglang_adapter: a stand-in updater over vLLM's
model classes; test_sglang_real: SGLang's own updater and model): the ranks answer over pipes, and
each scenario runs the same updates and records what the test module asserts."""

from __future__ import annotations

from typing import Any, Callable, Dict, List


def fan_out(conns: List[Any]) -> Callable[..., List[Any]]:
    """`call(kind, arg)`: sends one request to every rank and returns their answers in rank order;
    an error on any rank raises (on a real engine it would have ended that scheduler)."""

    def call(kind: str, arg: Any = None) -> List[Any]:
        for conn in conns:
            conn.send((kind, arg))
        answers = [conn.recv() for conn in conns]
        errors = [value for status, value in answers if status == "error"]
        if errors:
            raise RuntimeError("; ".join(errors))
        return [value for _, value in answers]

    return call


def run_scenario(scenario: str, trainer: Any, model: Any, call: Callable[..., List[Any]], conns: List[Any], out: Dict[str, Any]) -> None:
    """After the first update: "updates" bumps every trainer weight by 1.0 and updates again
    (`second`: each rank's elements that differ from the engine's own load of the bumped
    checkpoint); "verify" makes rank 0's verify fail, bumps and updates (`refused`: the trainer's
    error, `unchanged`: each rank's elements that moved, `refusals`: what each rank logged)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if scenario == "updates":
        trainer.update()
        out["second"] = call("loaded", 1)
    elif scenario == "verify":
        call("snapshot")  # taken before the update, after the bump of the trainer's weights only
        conns[0].send(("poison_verify", None))
        conns[0].recv()
        try:
            trainer.update()
            out["refused"] = None
        except Exception as error:
            out["refused"] = str(error)
        out["unchanged"] = call("unchanged")
        out["refusals"] = call("refusals")
    else:
        raise ValueError(scenario)
