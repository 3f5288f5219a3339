"""What the SGLang modules share (test_sglang_adapter: a stand-in updater over vLLM's model
classes; test_sglang_real and test_sglang_families: SGLang's own updater and models): the rank and
trainer processes and the pipes between them, an SGLang TP rank as its scheduler sets it up, the
engine's three weight-update methods fanned out to the ranks, and the scenarios the adapter modules
run."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Sequence, Tuple

import fork_server

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The SGLang modules a rank imports (sglang_rank, the families' rank_main), imported by the fork server.
SGLANG_MODULES = (
    "sglang.srt.distributed.parallel_state",
    "sglang.srt.managers.scheduler_components.weight_updater",
    "sglang.srt.managers.tp_worker",
    "sglang.srt.model_executor.model_runner_components.weight_updater",
    "sglang.srt.model_loader.loader",
    "sglang.srt.server_args",
    "refit.integrations.sglang",
)


def run_processes(ranks: int, rank_main: Callable[..., None], rank_args: Tuple[Any, ...], trainer_main: Callable[..., None],
                  trainer_args: Tuple[Any, ...], timeout: float) -> Dict[str, Any]:
    """Starts `ranks` rank processes, `rank_main(rank, *rank_args, conn)`, and the trainer,
    `trainer_main(*trainer_args, conns, results)`; returns what the trainer put in `results`
    (processes still running after it are killed). They are forked from a server that has imported
    SGLang and the targets' modules (fork_server)."""
    context = fork_server.context(SGLANG_MODULES, rank_main, trainer_main)
    results = context.Queue()
    pipes = [context.Pipe() for _ in range(ranks)]
    processes = [context.Process(target=rank_main, args=(r, *rank_args, pipes[r][1])) for r in range(ranks)]
    processes.append(context.Process(target=trainer_main, args=(*trainer_args, [p[0] for p in pipes], results)))
    for process in processes:
        process.start()
    try:
        out = results.get(timeout=timeout)
        for process in processes:
            process.join(60)
        return out
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()


def sglang_rank(rank: int, tp: int, folder: str, port: int, ep: bool = False, **server_args: Any) -> SimpleNamespace:
    """SGLang's TP rank `rank` of `tp` as its scheduler process sets it up before it builds its
    ModelRunner: the gloo world, the published server args (custom_weight_loader lists refit's
    loader; expert parallelism over the TP ranks with `ep`), the parallel groups, then the model from
    SGLang's dummy weights (so the first update has to move them all), the ModelRunner's
    WeightUpdater and the scheduler's SchedulerWeightUpdaterManager over it. `server_args`: more
    ServerArgs fields, as a launch would set them (enable_multimodal). Returns
    (model, manager, model_config, build: load_format -> another model as SGLang's loader builds it)."""
    # torch's CUDA wheel ships libnccl, so SGLang's TP group would open a PyNccl communicator on a
    # machine without a GPU; a library that does not load is SGLang's own "no GPU here" case.
    os.environ["SGLANG_NCCL_SO_PATH"] = os.path.join(HERE, "no-nccl-on-cpu.so")
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.model_loader import get_model
    from sglang.srt.runtime_context import SpawnRanks, get_model as model_settings, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    from refit.integrations import sglang as adapter

    init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{port}")
    server_args = ServerArgs(
        model_path=folder, tp_size=tp, device="cpu", dtype="float32", skip_tokenizer_init=True,
        custom_weight_loader=[adapter.LOADER], **(dict(ep_size=tp) if ep else {}), **server_args,
    )
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank))
    initialize_model_parallel(backend="gloo")
    model_config = ModelConfig.from_server_args(server_args)

    def build(load_format: str) -> Any:
        return get_model(model_config=model_config, load_config=LoadConfig(load_format=load_format), device_config=DeviceConfig("cpu"))

    model = build("dummy")
    updater = WeightUpdater(  # as ModelRunner.init_weight_updater makes it
        tp_rank=get_parallel().tp_rank, device="cpu", gpu_id=0, model_config=model_config,
        custom_weight_loaders=model_settings().custom_weight_loader, get_model=lambda: model,
        update_model_fields=lambda *args, **kwargs: None, recapture_cuda_graph=lambda: None, get_model_runner=lambda: None,
    )
    worker = SimpleNamespace(weight_update_runners=lambda: [("target", SimpleNamespace(weight_updater=updater))])
    # SGLang's own: each rank deserializes its entry of the per-rank payload list.
    worker.deserialize_own_rank = lambda payloads: TpModelWorker.deserialize_own_rank(worker, payloads)
    manager = SchedulerWeightUpdaterManager(
        tp_worker=worker, draft_worker=None, memory_saver_adapter=None, flush_cache=lambda **kwargs: True,
        is_fully_idle=lambda **kwargs: True, scheduler=SimpleNamespace(record_weight_version_change=lambda **kwargs: None),
    )
    return SimpleNamespace(model=model, manager=manager, model_config=model_config, build=build)


# The requests the scheduler's weight-update manager answers, by message kind.
WEIGHT_UPDATE_KINDS = ("begin", "update", "end")


def weight_update(manager: Any, kind: str, arg: Any) -> Tuple[bool, str]:
    """The manager's answer (success, message) to a "begin", "update" or "end" message."""
    from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput, EndWeightUpdateReqInput

    if kind == "begin":
        out = manager.begin_weight_update(BeginWeightUpdateReqInput())
    elif kind == "update":
        out = manager.update_weights_from_tensor(arg)
    else:
        out = manager.end_weight_update(EndWeightUpdateReqInput())
    return out.success, out.message


def update_request(named: Sequence[Any], load_format: str, tp: int) -> Any:
    """What Engine.update_weights_from_tensor hands the schedulers: one serialized payload per TP rank."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.utils import MultiprocessingSerializer

    payloads = [MultiprocessingSerializer.serialize(list(named)) for _ in range(tp)]
    return UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads, load_format=load_format, flush_cache=False)


class Engine:
    """sglang.Engine's three weight-update methods, each fanned out to the ranks (the tokenizer
    manager's part; an error on a rank, which would end a real scheduler, raises)."""

    def __init__(self, call: Callable[..., List[Any]], tp: int) -> None:
        self.call, self.tp = call, tp

    def begin_weight_update(self) -> Any:
        return self.call("begin")[0]

    def update_weights_from_tensor(self, named: List[Any], load_format: str, flush_cache: bool) -> Any:
        assert flush_cache is False
        answers = self.call("update", update_request(named, load_format, self.tp))
        refused = [message for success, message in answers if not success]
        return (False, "; ".join(refused)) if refused else answers[0]

    def end_weight_update(self) -> Any:
        return self.call("end")[0]


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
