"""refit as vLLM's weight-transfer backend, against the real vLLM 0.33 on CPU (host backend).

- vLLM finds backend "refit" by name: through its own general-plugin loader reading the entry point
  python/pyproject.toml declares, then its factories.
- A trainer process (a tiny Hugging Face Qwen3, vLLM's own ModuleSource over it, offered by
  DTensorPublisher where its parameters lie) updates two worker processes, each holding the model vLLM builds for its TP rank (TP 2)
  and the worker engine vLLM's factory made (the two workers are vLLM's TP group, over gloo: what
  vLLM reduces across TP ranks while loading is reduced between them); the workers are driven through a stand-in of vLLM's
  control plane (pipes: one process per worker, as vLLM's collective_rpc). Every element equals
  what vLLM's own load_weights gives from the same checkpoint, after every update; between the
  staged receive and finish_weight_update the live weights are still the old ones; the second
  update re-plans nothing (the trainer's offers sit at the live parameters' addresses; the workers'
  needs were recorded once from their own loader, VllmReceiver.from_engine); after the weights move (as vLLM's sleep / wake reallocates them) the next
  update plans again on every process and lands in the new storage.
- Qwen3-MoE at TP 2 with expert parallelism, the checkpoint's own tensors published by
  HfPublisher: vLLM's CPU platform pads and prepacks the experts after loading, so their checkpoint
  tensors arrive whole in staging and vLLM's layerwise reload rebuilds them (the receiver says so,
  24 tensors per worker per update); every element equals vLLM's load_weights +
  process_weights_after_loading, the live storage stays where it was, and the second update re-plans
  nothing. (The prepack kernel itself is test_vllm_postprocess's stand-in.)
- A vLLM engine that serves FP8 from BF16 (`quantization="fp8_per_block"`, TP 2; the GEMM kernel
  fp8_engines' stand-in) updated from a BF16 trainer in its own process: the trainer's
  executor quantizes (its offers hold whole 128 x 128 blocks), so FP8 codes and scales cross, and
  every code, scale and element equals vLLM's own load of the same weights, after every update.
- The same engine serving per-channel FP8 (`quantization="fp8_per_channel"`, vLLM's own CPU GEMM
  kernel): the trainer quantizes the rows of every FP8 layer (one scale per output channel); the
  row-parallel ones, whose row amax vLLM takes across the TP ranks, share each row's amax between
  the workers through amax keys; every code, scale and element equals vLLM's own load, and the
  bytes sent are asserted.
- The same engine serving per-tensor FP8 (`quantization="fp8_per_tensor"`; the quantizing CUDA op
  fp8_engines' stand-in): each layer's one scale comes from an amax vLLM reduces across the TP
  ranks, so each worker gives its copy of the scale one amax key with the other's, and the
  trainer's process (which holds every shard) quantizes both workers' boxes of a layer in one batch:
  FP8 codes and each worker's scale cross (the bytes sent are asserted), the scales are equal on
  both workers, and every code, scale and element equals vLLM's own load. At TP 1 (one worker) no
  amax is reduced: each layer's boxes share its one scale, quantized by the trainer's process too.
  With two trainer ranks each holding half of every projection's rows, each trainer quantizes its
  rows and the two exchange every layer's amax (per channel, its rows' amaxes) at each update. A
  trainer storing its projections column-major (no kernel reads them in place) falls back to vLLM's
  reload for the per-tensor layers.
- A verify mismatch (a stand-in: worker 0's real executor step runs and stages its bytes, then
  reports VERIFY_MISMATCH, since refit's verify cannot be made to fail from Python) and a killed
  trainer (it exits after the workers started receiving) each leave every worker's weights as they
  were, every element compared with a snapshot taken before.
"""

from __future__ import annotations

import os
import tempfile
import unittest
from multiprocessing.connection import wait
from typing import Any, Dict, List

import fork_server

HERE = os.path.dirname(os.path.abspath(__file__))
PYPROJECT = os.path.join(HERE, "..", "..", "pyproject.toml")
# The processes of a test each build a vLLM model before they join the communicator; on a loaded
# 2-core machine the last can arrive well after the first. A dead peer is found by its
# closed connection (ABORTED), not by this timeout, so a generous one costs nothing when all is well.
TIMEOUT_MS = 120_000
# The vLLM modules a worker or trainer imports, imported once by the fork server its processes come
# from (fork_server).
VLLM_MODULES = (
    "transformers",
    "vllm.config",
    "vllm.distributed.weight_transfer.factory",
    "vllm.model_executor.model_loader.utils",
    "vllm_ranks",
    "refit.integrations.vllm_backend",
)
# The FP8 engines' scenarios: vLLM's quantization of each.
FP8_SCENARIOS = {"fp8": "fp8_per_block", "fp8_channel": "fp8_per_channel", "fp8_tensor": "fp8_per_tensor",
                 "fp8_tensor_tp1": "fp8_per_tensor", "fp8_tensor_split": "fp8_per_tensor",
                 "fp8_channel_split": "fp8_per_channel", "fp8_tensor_column_major": "fp8_per_tensor"}


def tiny_qwen3() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=128, max_position_embeddings=256, tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    )


def tiny_qwen3_moe() -> Any:
    from families import qwen3_moe

    return qwen3_moe()


def save_checkpoint(hf_config: Any = None, dtype: str = "float32") -> str:
    """A folder with the checkpoint transformers writes for `hf_config` (default: the tiny Qwen3).
    In bfloat16, each matrix's rows are scaled from 2^-24 to 2^4, so that FP8 blocks' scales
    differ widely."""
    import torch
    import transformers

    hf_config = hf_config if hf_config is not None else tiny_qwen3()
    folder = tempfile.mkdtemp(prefix="refit-vllm-backend-")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, dtype))
    if dtype == "bfloat16":
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(torch.logspace(-24, 4, p.shape[0], base=2)[:, None].to(p.dtype))
    model.save_pretrained(folder)
    return folder


def checkpoint(folder: str) -> Dict[str, Any]:
    from safetensors.torch import load_file

    out: Dict[str, Any] = {}
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        out.update(load_file(os.path.join(folder, file)))
    return out


# --- a worker process: vLLM's model for one TP rank and the engine vLLM's factory makes ---------


class StandInVerifyMismatch:
    """Worker 0's executor for one step: runs for real (bytes staged), then reports a mismatch."""

    def __init__(self, executor: Any) -> None:
        self._executor = executor

    def run(self, *args: Any) -> Any:
        import refit

        self._executor.run(*args)
        raise refit.RefitError(refit.Status.VERIFY_MISMATCH, "stand-in: installed bytes differ from their source")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._executor, name)


def worker_main(rank: int, size: int, folder: str, control: Any, checks: Any, tp_port: int, moe: bool = False,
                quantization: Any = None) -> None:
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    import sys

    sys.path.insert(0, HERE)
    import torch
    import vllm_ranks
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from refit.integrations.vllm_backend import register

    register()
    # The workers form vLLM's TP group over gloo: what vLLM reduces across TP ranks (an FP8 layer's
    # amax, when it loads and when it reloads) is reduced between them.
    vllm_ranks.join_tp_world(rank, size, tp_port)
    if quantization is not None:
        import fp8_engines

        if quantization == "fp8_per_block":
            fp8_engines.use_kernel(fp8_engines.cutlass_kernel())  # this CPU lacks the AMX vLLM's FP8 block kernels need
        if quantization == "fp8_per_tensor":
            fp8_engines.use_scaled_fp8_quant(fp8_engines.static_scaled_fp8_quant)  # a CUDA op the CPU wheel lacks
        config = vllm_ranks.engine_config(folder, size, dtype="bfloat16", quantization=quantization)
    else:
        config = vllm_ranks.engine_config(folder, size, ep=moe, dtype="float32")
    ckpt = checkpoint(folder)
    if moe:
        from test_vllm_postprocess import install_prepack_stand_in

        install_prepack_stand_in()  # vLLM's CPU MoE prepack kernel (see test_vllm_postprocess)

    def vllm_loaded(weights: Dict[str, Any]) -> Any:
        """What vLLM's own loader makes of `weights`, post-processing included, as an engine does."""
        built = vllm_ranks.build(config, "cpu")
        built.load_weights(iter(list(weights.items())))
        process_weights_after_loading(built, config.model_config, torch.device("cpu"))
        return built

    with vllm_ranks.as_rank(config, rank):
        model = vllm_loaded(ckpt)
        engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="refit"), config, torch.device("cpu"), model)
        snapshot: Dict[str, Any] = {}

        def bits(tensor: Any) -> Any:
            """FP8 codes as bytes (torch compares no float8 tensors on CPU); the rest as they are."""
            return tensor.view(torch.uint8) if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else tensor

        def differing(expected: Dict[str, Any]) -> List[str]:
            return [n for n, p in model.named_parameters() if not torch.equal(bits(p.detach()), bits(expected[n]))]

        def handle(kind: str, arg: Any) -> Any:
            if kind == "init":
                return engine.init_transfer_engine(engine.parse_init_info(arg))
            if kind == "start":
                return engine.start_weight_update()
            if kind == "update":
                return engine.update_weights(arg)
            if kind == "finish":
                return engine.finish_weight_update()
            if kind == "plans":
                return engine.link.plans_built
            if kind == "engine":
                return type(engine).__name__
            if kind == "snapshot":
                snapshot.clear()
                snapshot.update((n, p.detach().clone()) for n, p in model.named_parameters())
                return len(snapshot)
            if kind == "unchanged":
                return differing(snapshot)
            if kind == "loaded":
                # What vLLM's own load_weights makes of the checkpoint after `arg` bumps (1.0 added
                # to every element, one bump at a time as the trainer does: float rounding alike).
                bumped = dict(ckpt)
                for _ in range(arg):
                    bumped = {n: t + 1.0 for n, t in bumped.items()}
                reference = vllm_loaded(bumped)
                return differing({n: p.detach() for n, p in reference.named_parameters()})
            if kind == "paths":
                paths = engine.receiver.paths
                return {path: sorted(n for n, p in paths.items() if p == path) for path in set(paths.values())}
            if kind == "scales":
                return {n: p.detach().float().tolist() for n, p in model.named_parameters() if n.endswith(".weight_scale")}
            if kind == "installed":
                return dict(engine.installed)
            if kind == "addresses":
                return {n: p.data_ptr() for n, p in model.named_parameters()}
            if kind == "move":
                for p in model.parameters():
                    p.data = p.data.clone()
                return len(list(model.parameters()))
            if kind == "poison_verify":
                engine.link.executor = StandInVerifyMismatch(engine.link.executor)
                return None
            raise ValueError(kind)

        pipes = [control, checks]
        while pipes:
            for conn in wait(pipes):
                try:
                    message = conn.recv()
                except EOFError:
                    pipes.remove(conn)
                    continue
                if message[0] == "exit":
                    engine.shutdown()
                    vllm_ranks.leave_tp_world()
                    return
                try:
                    conn.send(("ok", handle(*message)))
                except BaseException as error:  # the caller asserts on it
                    conn.send(("error", f"{type(error).__name__}: {error}"))


# --- the trainer process: vLLM's trainer factory, ModuleSource, a stand-in control plane -------


class PipeClient:
    """vLLM's VLLMWeightSyncClient over pipes to the workers: every call goes to every worker, then
    every answer is read (as collective_rpc); an error of any worker raises."""

    def __init__(self, conns: List[Any]) -> None:
        self.conns = conns

    def call(self, kind: str, arg: Any = None) -> List[Any]:
        for conn in self.conns:
            conn.send((kind, arg))
        answers = [conn.recv() for conn in self.conns]
        errors = [value for status, value in answers if status == "error"]
        if errors:
            raise RuntimeError("; ".join(errors))
        return [value for _, value in answers]

    def init_weight_transfer_engine(self, init_info: Dict[str, Any]) -> None:
        self.call("init", init_info)

    def start_weight_update(self) -> None:
        self.call("start")

    def update_weights(self, update_info: Any) -> None:
        self.call("update", update_info)

    def finish_weight_update(self, weight_version: Any = None) -> None:
        self.call("finish")


class HalfSource:
    """A trainer rank holding half of every projection weight (rank r: rows [r N/2, (r + 1) N/2)), as
    a row-sharded trainer does, and (rank 0 only) every other tensor whole: no one device holds a
    layer's every row."""

    def __init__(self, model: Any, rank: int) -> None:
        self.model, self.rank = model, rank

    def tensors(self) -> List[Any]:
        from refit.integrations.offers import Offer

        out = []
        for name, p in self.model.named_parameters():
            shape = tuple(int(n) for n in p.shape)
            if name.endswith("_proj.weight"):
                half = shape[0] // 2
                out.append((name, Offer(name, shape, (self.rank * half, 0), p.detach()[self.rank * half:(self.rank + 1) * half])))
            elif self.rank == 0:
                out.append((name, Offer(name, shape, (0,) * len(shape), p.detach())))
        return out

    def refit_table(self, tensors: List[Any], process: int, device: Any) -> Any:
        from refit.integrations.layout import new_table
        from refit.integrations.offers import add_offers

        return new_table(lambda table: add_offers(table, [offer for _, offer in tensors], process, device))


def second_trainer_main(folder: str, comm_ids: Any, results: Any) -> None:
    """Trainer rank 1 of the split scenario: the other half of every projection, two updates in step
    with rank 0 (which drives the workers)."""
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    try:
        import torch
        import transformers
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from refit.integrations.vllm_backend import RefitTrainerInitInfo, register

        register()
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        info = RefitTrainerInitInfo(rank=1, num_workers=2, num_trainer_ranks=2, device_backend="host",
                                    timeout_ms=TIMEOUT_MS, comm_id=comm_ids.get(timeout=300))
        engine = WeightTransferTrainerFactory.trainer_init(info, client=None, source=HalfSource(model, 1))
        quantized = []
        for _ in range(2):
            engine.send_weights()
            quantized.append(engine.last_stats.quantized_elements)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        results.put({"plans": engine.link.plans_built, "quantized": quantized})
        engine.shutdown()
    except BaseException as error:
        import traceback

        results.put({"error": traceback.format_exc() or repr(error)})


def trainer_main(scenario: str, folder: str, conns: List[Any], results: Any, comm_ids: Any = None) -> None:  # noqa: C901
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    try:
        import torch
        import transformers
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from refit.integrations.engine_link import concurrently
        from refit.integrations.vllm_backend import RefitTrainerInitInfo, register

        register()
        trainers, comm_id = 1, None
        if scenario.endswith("_split"):
            # Rank 0 of two trainer ranks, each holding half of every projection.
            from refit.integrations.engine_link import resolved_backend
            from refit.comm import unique_id

            model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
            source = HalfSource(model, 0)
            tensors = list(model.parameters())
            trainers, comm_id = 2, unique_id(resolved_backend("host")).hex()
            comm_ids.put(comm_id)
        elif scenario in FP8_SCENARIOS:
            # A BF16 trainer holding whole tensors: its process quantizes, FP8 crosses.
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
            if scenario == "fp8_tensor_column_major":
                # Its projections stored column-major (strides (1, rows)): no quantizing kernel
                # reads them in place, which needs contiguous rows.
                for name, p in model.named_parameters():
                    if name.endswith("_proj.weight"):
                        p.data = p.data.t().contiguous().t()
            source = ModuleSource(model)
            tensors = list(model.parameters())
        elif scenario == "moe":
            # The checkpoint's own tensors through HfPublisher (transformers' in-memory Qwen3-MoE
            # fuses the experts under other names than its checkpoint's).
            weights = checkpoint(folder)
            source: Any = weights
            tensors = list(weights.values())
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            source = ModuleSource(model)
            tensors = list(model.parameters())
        client = PipeClient(conns)
        info = RefitTrainerInitInfo(rank=0, num_workers=len(conns), num_trainer_ranks=trainers, device_backend="host",
                                    timeout_ms=TIMEOUT_MS, comm_id=comm_id)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        out: Dict[str, Any] = {"engines": client.call("engine")}
        engine.send_weights()
        out["first"] = client.call("loaded", 0)

        def bump() -> None:
            with torch.no_grad():
                for p in tensors:
                    p.add_(1.0)

        if scenario == "updates":
            bump()
            engine.send_weights()
            out["second"] = client.call("loaded", 1)
            # The round by hand: after the staged receive, the engine still serves the old weights.
            bump()
            client.start_weight_update()
            join = concurrently(lambda: client.update_weights({"round": 3}))
            engine.link.prepare(engine._current_table())
            engine.link.run()
            join()
            out["before_commit"] = client.call("loaded", 1)
            client.finish_weight_update()
            out["after_commit"] = client.call("loaded", 2)
            out["plans"] = client.call("plans") + [engine.link.plans_built]
            # vLLM's sleep / wake reallocates the weights: the next round plans again, on every
            # process, and installs into the new storage.
            out["moved"] = client.call("move")
            bump()
            engine.send_weights()
            out["after_move"] = client.call("loaded", 3)
            out["plans_after_move"] = client.call("plans") + [engine.link.plans_built]
        elif scenario in FP8_SCENARIOS:
            import refit

            # What crossed to the workers, and the checkpoint's bytes (replicated norms: each worker's own).
            out["sent"] = engine.last_stats.bytes_of(refit.RouteKind.REMOTE)
            out["checkpoint_bytes"] = sum(p.numel() * p.element_size() for p in tensors)
            out["norm_bytes"] = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)
            out["projection_elements"] = sum(p.numel() for n, p in model.named_parameters() if n.endswith("_proj.weight"))
            out["quantized_by_trainer"] = [engine.last_stats.quantized_elements]
            out["paths"] = client.call("paths")
            out["scales"] = client.call("scales")
            bump()
            engine.send_weights()
            out["second"] = client.call("loaded", 1)
            out["quantized_by_trainer"].append(engine.last_stats.quantized_elements)
            out["plans"] = client.call("plans") + [engine.link.plans_built]
        elif scenario == "moe":
            out["paths"] = client.call("paths")
            out["installed_first"] = client.call("installed")
            addresses = client.call("addresses")
            bump()
            engine.send_weights()
            out["second"] = client.call("loaded", 1)
            out["installed"] = client.call("installed")
            out["kept_storage"] = [a == b for a, b in zip(addresses, client.call("addresses"))]
            out["plans"] = client.call("plans") + [engine.link.plans_built]
        elif scenario == "verify":
            client.call("snapshot")
            conns[0].send(("poison_verify", None))
            conns[0].recv()
            bump()
            try:
                engine.send_weights()
                out["refused"] = None
            except Exception as error:
                out["refused"] = str(error)
            out["unchanged"] = client.call("unchanged")
        elif scenario == "killed":
            client.call("snapshot")
            bump()
            client.start_weight_update()
            join = concurrently(lambda: client.update_weights({"round": 2}))
            engine.link.prepare(engine._current_table())
            join()  # every worker is receiving now, on its background thread
            results.put(out)
            results.close()
            results.join_thread()  # flushed: os._exit skips the queue's feeder thread
            os._exit(0)  # dies before its step: the workers' steps wait for a dead peer
        results.put(out)
        engine.shutdown()
        for conn in conns:
            conn.send(("exit",))
    except BaseException as error:
        import traceback

        results.put({"error": traceback.format_exc() or repr(error)})


def fp8_layer_params() -> List[str]:
    """The weight and scale of both decoder layers' four FP8 layers, sorted."""
    modules = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}
    return sorted(f"model.layers.{i}.{module}.{layer}.{p}" for i in range(2) for layer, module in modules.items()
                  for p in ("weight", "weight_scale"))


class VllmBackendTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from fp8_engines import qwen3_config

        cls.folder = save_checkpoint()
        cls.moe_folder = save_checkpoint(tiny_qwen3_moe())
        config = qwen3_config()
        config.architectures = ["Qwen3ForCausalLM"]
        cls.fp8_folder = save_checkpoint(config, "bfloat16")

    def run_scenario(self, scenario: str, size: int = 2):
        """Runs `scenario` with the trainer in its own process and `size` vLLM workers (one TP group)."""
        import vllm_ranks

        moe, quantization = scenario == "moe", FP8_SCENARIOS.get(scenario)
        folder = self.moe_folder if moe else self.fp8_folder if quantization else self.folder
        context = fork_server.context(VLLM_MODULES, worker_main, trainer_main, second_trainer_main)
        results = context.Queue()
        control = [context.Pipe() for _ in range(size)]
        checks = [context.Pipe() for _ in range(size)]
        tp_port = vllm_ranks.free_port()
        workers = [
            context.Process(target=worker_main,
                            args=(rank, size, folder, control[rank][1], checks[rank][1], tp_port, moe, quantization))
            for rank in range(size)
        ]
        comm_ids = context.Queue()
        trainer = context.Process(target=trainer_main,
                                  args=(scenario, folder, [c[0] for c in control], results, comm_ids))
        trainers = [trainer]
        if scenario.endswith("_split"):
            second = context.Queue()
            trainers.append(context.Process(target=second_trainer_main, args=(folder, comm_ids, second)))
        for process in workers + trainers:
            process.start()
        try:
            out = results.get(timeout=300)
            self.assertNotIn("error", out, out.get("error"))
            if len(trainers) > 1:
                out["second_trainer"] = second.get(timeout=120)
                self.assertNotIn("error", out["second_trainer"], out["second_trainer"].get("error"))
            for process in trainers:
                process.join(120)
            after = None
            if scenario == "killed":
                after = {}
                for rank in range(size):
                    conn = checks[rank][0]
                    conn.send(("finish", None))
                    after.setdefault("finish", []).append(conn.recv())
                    conn.send(("unchanged", None))
                    after.setdefault("unchanged", []).append(conn.recv())
                    conn.send(("loaded", 0))
                    after.setdefault("loaded", []).append(conn.recv())
                    conn.send(("exit",))
            for process in workers:
                process.join(60)
            return out, after
        finally:
            for process in workers + trainers:
                if process.is_alive():
                    process.kill()

    def test_found_by_name_through_vllms_plugin_loader_and_factories(self):
        import importlib.metadata
        import sys
        import tomllib

        import vllm.plugins
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

        with open(PYPROJECT, "rb") as handle:
            declared = tomllib.load(handle)["project"]["entry-points"]["vllm.general_plugins"]
        self.assertEqual(declared, {"refit": "refit.integrations.vllm_backend:register"})
        self.assertNotIn("refit", WeightTransferEngineFactory._registry)
        # An installed distribution's metadata, as pip writes it from that entry point.
        site = tempfile.mkdtemp(prefix="refit-dist-")
        info = os.path.join(site, "refit_gpu-0.0.0.dist-info")
        os.makedirs(info)
        with open(os.path.join(info, "METADATA"), "w") as handle:
            handle.write("Metadata-Version: 2.1\nName: refit-gpu\nVersion: 0.0.0\n")
        with open(os.path.join(info, "entry_points.txt"), "w") as handle:
            handle.write("[vllm.general_plugins]\n" + "".join(f"{k} = {v}\n" for k, v in declared.items()))
        sys.path.insert(0, site)
        try:
            vllm.plugins.plugins_loaded = False
            vllm.plugins.load_general_plugins()
        finally:
            sys.path.remove(site)
        from refit.integrations.vllm_backend import RefitTrainerEngine, RefitWeightTransferEngine

        self.assertIs(WeightTransferEngineFactory._registry["refit"](), RefitWeightTransferEngine)
        self.assertIs(WeightTransferTrainerFactory._registry["refit"](), RefitTrainerEngine)
        self.assertTrue(importlib.metadata.version)  # the loader read real metadata, not a mock

    def test_updates_equal_vllms_own_load_weights_and_commit_only_at_finish(self):
        out, _ = self.run_scenario("updates")
        self.assertEqual(out["engines"], ["RefitWeightTransferEngine"] * 2)
        self.assertEqual(out["first"], [[], []])
        self.assertEqual(out["second"], [[], []])
        self.assertEqual(out["before_commit"], [[], []], "live weights changed before finish_weight_update")
        self.assertEqual(out["after_commit"], [[], []])
        self.assertEqual(out["plans"], [1, 1, 1], "a round with the same tables planned again")
        self.assertTrue(all(out["moved"]))
        self.assertEqual(out["after_move"], [[], []], "weights that moved did not get the update")
        self.assertEqual(out["plans_after_move"], [2, 2, 2])

    def test_an_fp8_engine_gets_codes_and_scales_quantized_by_the_trainers_process(self):
        out, _ = self.run_scenario("fp8")
        self.assertEqual(out["first"], [[], []], "codes, scales or elements differ from vLLM's own load")
        self.assertEqual(out["second"], [[], []])
        layers = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
        for paths in out["paths"]:
            quantized = paths.get("quantized", [])
            # Both decoder layers' four FP8 layers: codes and scales each.
            self.assertEqual(len(quantized), 2 * len(layers) * 2, paths)
            self.assertNotIn("reload", paths)
        # Each worker's half of every FP8 layer (256 x 256 of q, 128 x 256 of k and v, ...), both
        # workers, quantized by the trainer in each update: only codes and scales crossed.
        per_layer = 1024 * 256 + 256 * 512 + 1024 * 256 + 256 * 512
        self.assertEqual(out["quantized_by_trainer"], [2 * per_layer] * 2)
        self.assertEqual(out["plans"], [1, 1, 1], "a round with the same tables planned again")

    def test_a_per_channel_fp8_engine_gets_rows_quantized_by_the_trainers_process(self):
        out, _ = self.run_scenario("fp8_channel")
        self.assertEqual(out["first"], [[], []], "codes, scales or elements differ from vLLM's own load")
        self.assertEqual(out["second"], [[], []])
        for paths in out["paths"]:
            # Every FP8 layer is quantized by refit: qkv and gate_up (column parallel) by rows;
            # o_proj and down_proj (row parallel at TP 2: vLLM takes each row's amax across the
            # ranks) by rows whose amax both workers' needs share through amax keys, the trainer's
            # process quantizing both workers' column shards of a layer in one batch.
            self.assertEqual(paths.get("quantized"), fp8_layer_params(), paths)
            self.assertNotIn("reload", paths)
        # Each worker's share of every projection, both workers, quantized by the trainer in each
        # update: every projection element once.
        self.assertEqual(out["quantized_by_trainer"], [out["projection_elements"]] * 2)
        # Sent: the checkpoint less one byte of every projection element, the norms (replicated)
        # once more, and each worker's per-row scales: qkv and gate_up's rows (1024 each, split),
        # o_proj and down_proj's (256 each, on both workers), in both decoder layers.
        scales = 2 * 4 * (2 * 1024 + 2 * 2 * 256)
        want_sent = out["checkpoint_bytes"] - out["projection_elements"] + out["norm_bytes"] + scales
        self.assertEqual(out["sent"], want_sent)
        self.assertEqual(out["plans"], [1, 1, 1], "a round with the same tables planned again")

    def test_a_per_tensor_fp8_engine_at_tp_2_gets_codes_quantized_with_the_amax_across_ranks(self):
        out, _ = self.run_scenario("fp8_tensor")
        self.assertEqual(out["first"], [[], []], "codes, scales or elements differ from vLLM's own load")
        self.assertEqual(out["second"], [[], []])
        want = fp8_layer_params()
        for paths in out["paths"]:
            # One scale per layer over both TP ranks' shards (vLLM reduces the amax across them):
            # each worker's copy of it shares one amax key with the other's, and the trainer's
            # process, holding every shard, quantizes both workers' boxes of a layer in one batch.
            self.assertEqual(paths.get("quantized"), want, paths)
            self.assertNotIn("reload", paths)
        self.assertEqual(out["quantized_by_trainer"], [out["projection_elements"]] * 2)
        # Sent: the checkpoint less one byte of every projection element (codes instead of bf16),
        # the norms (replicated) once more, and 8 scales of 4 bytes per worker.
        want_sent = out["checkpoint_bytes"] - out["projection_elements"] + out["norm_bytes"] + 2 * 8 * 4
        self.assertEqual(out["sent"], want_sent)
        # The scales after the first update: one per layer, the same on both workers.
        first, second = out["scales"]
        self.assertEqual(sorted(first), [n for n in want if n.endswith("weight_scale")])
        self.assertEqual(first, second)
        self.assertEqual(out["plans"], [1, 1, 1], "a round with the same tables planned again")

    def test_a_per_tensor_fp8_engine_whose_layers_no_trainer_device_holds_whole_gets_them_quantized_by_both(self):
        out, _ = self.run_scenario("fp8_tensor_split")
        self.assertEqual(out["first"], [[], []], "codes, scales or elements differ from vLLM's own load")
        self.assertEqual(out["second"], [[], []])
        want = fp8_layer_params()
        for paths in out["paths"]:
            # Two trainer ranks each hold half of every projection's rows: no one device holds a
            # layer's every shard, so each trainer quantizes its rows of every worker's boxes (qkv and
            # gate_up from one trainer each, o_proj and down_proj from both), the two exchanging each
            # layer's amax at every update.
            self.assertEqual(paths.get("quantized"), want, paths)
            self.assertNotIn("reload", paths)
        half = out["projection_elements"] // 2
        self.assertEqual(out["quantized_by_trainer"], [half, half])
        self.assertEqual(out["second_trainer"]["quantized"], [half, half])
        first, second = out["scales"]
        self.assertEqual(sorted(first), [n for n in want if n.endswith("weight_scale")])
        self.assertEqual(first, second)
        self.assertEqual(out["plans"], [1, 1, 1], "a round with the same tables planned again")
        self.assertEqual(out["second_trainer"]["plans"], 1)

    def test_a_per_channel_fp8_engine_whose_layers_no_trainer_device_holds_whole_gets_them_quantized_by_both(self):
        out, _ = self.run_scenario("fp8_channel_split")
        self.assertEqual(out["first"], [[], []], "codes, scales or elements differ from vLLM's own load")
        self.assertEqual(out["second"], [[], []])
        for paths in out["paths"]:
            # o_proj and down_proj share each row's amax across the workers, and each worker's box of
            # them (every row, half the columns) lies on both trainers, half the rows each: each
            # trainer quantizes its band of rows of both boxes, the two exchanging those rows' amaxes
            # at every update. qkv and gate_up (rows of their own) come from one trainer each.
            self.assertEqual(paths.get("quantized"), fp8_layer_params(), paths)
            self.assertNotIn("reload", paths)
        half = out["projection_elements"] // 2
        self.assertEqual(out["quantized_by_trainer"], [half, half])
        self.assertEqual(out["second_trainer"]["quantized"], [half, half])
        self.assertEqual(out["plans"], [1, 1, 1], "a round with the same tables planned again")
        self.assertEqual(out["second_trainer"]["plans"], 1)

    def test_a_per_tensor_fp8_engine_whose_trainer_stores_weights_column_major_falls_back_to_the_reload(self):
        out, _ = self.run_scenario("fp8_tensor_column_major")
        self.assertEqual(out["first"], [[], []], "codes, scales or elements differ from vLLM's own load")
        self.assertEqual(out["second"], [[], []])
        want = fp8_layer_params()
        for paths in out["paths"]:
            # The trainer's projections are column-major: no kernel quantizes them in place, and
            # staging each worker's box would give each worker its own amax. Every process's first
            # plan refuses the shared amax alike, and every process plans again with the workers'
            # per-tensor layers on vLLM's reload (the BF16 gathered from the column-major storage).
            self.assertEqual(paths.get("reload"), want, paths)
            self.assertNotIn("quantized", paths)
        self.assertEqual(out["quantized_by_trainer"], [0, 0])
        self.assertEqual(out["plans"], [1, 1, 1], "the fallback plans once; a round with the same tables plans nothing")

    def test_a_per_tensor_fp8_engine_at_tp_1_gets_codes_quantized_by_the_trainers_process(self):
        out, _ = self.run_scenario("fp8_tensor_tp1", size=1)
        self.assertEqual(out["first"], [[]], "codes, scales or elements differ from vLLM's own load")
        self.assertEqual(out["second"], [[]])
        want = fp8_layer_params()
        (paths,) = out["paths"]
        # At TP 1 vLLM reduces no amax across ranks: each layer's boxes (q, k and v; gate and up)
        # share its one scale, and the trainer's process quantizes all of them (one device holds
        # every piece), so FP8 crosses, and one scale per layer.
        self.assertEqual(paths.get("quantized"), want, paths)
        self.assertNotIn("reload", paths)
        self.assertEqual(out["quantized_by_trainer"], [out["projection_elements"]] * 2)
        # Sent: the checkpoint less one byte of every projection element (codes instead of bf16),
        # and 8 scales of 4 bytes.
        self.assertEqual(out["sent"], out["checkpoint_bytes"] - out["projection_elements"] + 8 * 4)
        self.assertEqual(out["plans"], [1, 1], "a round with the same tables planned again")

    def test_qwen3_moe_post_processed_experts_go_through_vllms_reload(self):
        out, _ = self.run_scenario("moe")
        self.assertEqual(out["engines"], ["RefitWeightTransferEngine"] * 2)
        self.assertEqual(out["first"], [[], []])
        self.assertEqual(out["second"], [[], []])
        for paths in out["paths"]:
            # EP 2: each worker holds 4 of the 8 experts of both layers, repacked by vLLM's CPU backend.
            self.assertEqual(paths["reload"], [f"model.layers.{i}.mlp.experts.routed_experts.{w}" for i in range(2) for w in ("w13_weight", "w2_weight")])
            self.assertGreater(len(paths["boxes"]), 10)
        # Per worker and update: 2 layers x 4 local experts x 3 checkpoint tensors (gate, up, down).
        self.assertEqual(out["installed_first"], [{"loader": 0, "reload": 24}] * 2)
        self.assertEqual(out["installed"], [{"loader": 0, "reload": 24}] * 2)
        self.assertEqual(out["kept_storage"], [True, True])
        self.assertEqual(out["plans"], [1, 1, 1], "an update with unchanged storage planned again")

    def test_a_verify_mismatch_refuses_the_update_on_every_worker(self):
        out, _ = self.run_scenario("verify")
        self.assertIn("VERIFY_MISMATCH", out["refused"] or "")
        self.assertEqual(out["unchanged"], [[], []])

    def test_a_killed_trainer_leaves_the_weights_as_they_were(self):
        out, after = self.run_scenario("killed")
        self.assertEqual(out["first"], [[], []])
        for status, message in after["finish"]:
            self.assertEqual(status, "error")
            self.assertIn("update refused", message)
            self.assertTrue("ABORTED" in message or "TIMEOUT" in message, message)
        self.assertEqual(after["unchanged"], [("ok", []), ("ok", [])])
        self.assertEqual(after["loaded"], [("ok", []), ("ok", [])])


if __name__ == "__main__":
    unittest.main()
