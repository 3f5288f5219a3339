"""refit as vLLM's weight-transfer backend: `LLM(..., weight_transfer_config={"backend": "refit"})`.

vLLM 0.33 (vllm/distributed/weight_transfer/) lets backends register by name with
`WeightTransferEngineFactory`; `register()` below does so from vLLM's general-plugin entry point
(python/pyproject.toml), so an installed refit needs no code in the user's engine. Two engines:

- `RefitWeightTransferEngine` (worker side, one per vLLM worker): joins refit's communicator at
  init, describes the worker's parameters as needs (`receiver_table`), and plans once with the
  trainer (`Link.prepare`). Each update is one executor run into staging on a background thread
  while the engine keeps generating (`receive_weights` returns at once), then
  `finish_weight_update` commits between two engine steps: the engine stalls only for that local
  copy. A dead trainer (communicator timeout or abort) or a verify mismatch refuses the update and
  leaves the live weights as they were (the staged bytes are never installed).
- `RefitTrainerEngine` (trainer side, every trainer rank): offers the trainer's tensors
  (`publisher_table`: a vLLM `ModuleSource` or DTensor model, a plain module, or a `MegatronSource`), makes the
  communicator id, and drives the round trip through vLLM's control-plane client.

Each round every process first allgathers a digest of its own table (`Link.prepare`): equal
digests reuse the plan and executors; any change (the trainer's tensors moved, vLLM's sleep / wake
moved the worker's weights) re-plans on every process at once, since executors across processes
cannot rebind. When the bytes a worker would stage exceed `staging_memory_limit`, the backend logs
it and every process falls back to direct runs: the worker then receives inside `receive_weights`,
which blocks the engine (paused) until the bytes are in; a failure there may leave a part of them.
A plan that refuses the amax the workers' per-tensor FP8 layers share across TP ranks (no one device
of the trainer holds every shard of such a layer) is refused alike on every process, and every
process plans once more, the workers' tables recorded again with those layers on vLLM's reload.

The tables: a worker's needs are recorded once from its own model's loader (`engine_receiver`:
VllmReceiver.from_engine); checkpoint tensors the loader transforms, and those of layers vLLM
post-processes after loading, arrive in staging buffers (whole, or for the reload only the boxes
vLLM's loader reads of them: the worker's TP share) and are installed after the commit by
the engine's loader and vLLM's layerwise reload (`VllmReceiver.install_staged`). The trainer's
offers come from its own description (`publisher_table`): a vLLM `ModuleSource` or DTensor model
through DTensorPublisher (the live shards, no gather: an update with unchanged storage plans
nothing), a plain module through HfPublisher, a MegatronSource through its module publisher.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple

from .._lib import Backend, invalid_argument
from ..comm import unique_id
from ..plan import Table
from .engine_link import InFlight, Link, LinkOptions, MegatronSource, concurrently, publisher_table, resolved_backend, round_signature, source_tensors

log = logging.getLogger("refit.vllm_backend")

BACKEND_NAME = "refit"


# --- where the tables come from --------------------------------------------------------------------


def engine_receiver(
    model: Any, vllm_config: Any, quantize: bool = True, share_amax: bool = True
) -> Tuple[Any, Dict[str, Any]]:
    """This worker's receiver, recorded from its own model class and loader
    (VllmReceiver.from_engine), and a staging buffer, beside the parameters, for every checkpoint
    tensor it receives whole (the loader transforms it, or the layer is post-processed).
    `quantize`: layers vLLM quantizes online (in blocks, per channel, per tensor) are quantized by refit during
    the refit (False: they take vLLM's reload path, as a trainer whose shards split a block needs). `share_amax`
    False: the per-tensor layers whose amax vLLM reduces across the ranks take the reload path
    (VllmReceiver.from_engine), as the worker does after a plan refused their shared amax."""
    import torch

    from .vllm import VllmReceiver

    receiver = VllmReceiver.from_engine(vllm_config, quantize=quantize, share_amax=share_amax)
    staging: Dict[str, Any] = {}
    if receiver.staged or receiver.reload:
        params = list(model.parameters())
        where = params[0].device if params else torch.device("cpu")
        staging = receiver.staging_buffers(lambda shape, dtype: torch.empty(shape, dtype=dtype, device=where))
    return receiver, staging


def receiver_table(receiver: Any, model: Any, staging: Dict[str, Any], process: int, device: Optional[int] = None) -> Table:
    """The needs of this worker's parameters (at their current addresses) and staging buffers, as
    process `process` of the refit (`device` for host memory standing in for a GPU)."""
    return receiver.table(list(model.named_parameters()), process, device, staging=staging or None)


def _vllm_base() -> Tuple[Any, Any, Any, Any, Any]:
    from vllm.distributed.weight_transfer import base  # type: ignore[import-not-found]

    return (
        base.WeightTransferEngine,
        base.TrainerWeightTransferEngine,
        base.WeightTransferInitInfo,
        base.WeightTransferUpdateInfo,
        base.TrainerInitInfo,
    )


(_WorkerBase, _TrainerBase, _InitInfoBase, _UpdateInfoBase, _TrainerInitBase) = _vllm_base()


# --- worker side ----------------------------------------------------------------------------------


@dataclasses.dataclass
class RefitInitInfo(_InitInfoBase):
    """What the trainer sends each worker at init (JSON-safe values: vLLM passes it over RPC)."""

    comm_id: str
    """The communicator id, hex."""
    nranks: int
    rank_offset: int
    """Trainer ranks come first; worker w is rank rank_offset + w."""
    device_backend: str = "auto"
    verify: bool = False
    sm_budget: int = 0
    arm: int = 0
    staging_memory_limit: int = 0
    timeout_ms: int = 600_000
    quantize_online_fp8: bool = True
    """Layers vLLM quantizes online (`quantization="fp8_per_block"`, `"fp8_per_channel"`, `"fp8_per_tensor"`) get
    FP8 codes and scales quantized by refit during the refit; False sends their BF16 through vLLM's reload instead
    (what a trainer needs whose offers split a 128 x 128 block: planning refuses those with UNSUPPORTED naming the
    tensor). Per-tensor layers at TP > 1 whose shards no one device of the trainer holds all of fall back to the
    reload by themselves: every process plans once more (Link.prepare)."""


@dataclasses.dataclass
class RefitUpdateInfo(_UpdateInfoBase):
    round: int = 0


def worker_index(vllm_config: Any) -> int:
    """This worker's index among the engine's workers (TP fastest, then PP, then DP)."""
    from vllm.distributed import parallel_state as ps  # type: ignore[import-not-found]

    parallel = vllm_config.parallel_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    dp_rank = int(getattr(parallel, "data_parallel_rank", 0) or 0)
    return ps.get_tp_group().rank_in_group + tp * (ps.get_pp_group().rank_in_group + pp * dp_rank)


class RefitWeightTransferEngine(_WorkerBase):
    """vLLM's worker-side engine for backend "refit" (see the module docstring)."""

    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.link: Optional[Link] = None
        self._addresses: Optional[List[Tuple[str, int]]] = None
        self._table: Optional[Table] = None
        self.receiver: Any = None
        self._staging: Dict[str, Any] = {}
        self.installed: Dict[str, int] = {}
        """How many staged checkpoint tensors the last commit handed to the loader / the reload."""
        self.update = InFlight()
        self._quantize = True
        self._share_amax = True

    def _current_table(self) -> Table:
        """This worker's needs at its parameters' current addresses (built again only when an
        address moved: vLLM's sleep / wake reallocates the weights)."""
        addresses = [(name, int(p.data_ptr())) for name, p in self.model.named_parameters()]
        if self._table is None or addresses != self._addresses:
            if self._table is not None:
                self._table.close()
            host = self.link is not None and self.link.backend == Backend.HOST
            if self.receiver is None:
                self.receiver, self._staging = engine_receiver(
                    self.model, self.vllm_config, self._quantize, self._share_amax
                )
            self._table = receiver_table(self.receiver, self.model, self._staging, self.link.rank, 0 if host else None)  # type: ignore[union-attr]
            self._addresses = addresses
        return self._table

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        backend = resolved_backend(init_info.device_backend)
        options = LinkOptions(
            verify=init_info.verify,
            sm_budget=init_info.sm_budget,
            arm=init_info.arm,
            staging_memory_limit=init_info.staging_memory_limit,
            timeout_ms=init_info.timeout_ms,
        )
        self._quantize = init_info.quantize_online_fp8
        rank = init_info.rank_offset + worker_index(self.vllm_config)
        device = 0 if backend == Backend.HOST else int(getattr(self.device, "index", 0) or 0)
        self.link = Link(bytes.fromhex(init_info.comm_id), init_info.nranks, rank, device, backend, options)
        self.link.without_shared_amax = self._without_shared_amax
        self.link.prepare(self._current_table())

    def _without_shared_amax(self) -> Table:
        """This worker's table recorded again with the per-tensor layers whose amax vLLM reduces
        across the ranks on the reload path: what Link.prepare plans with after every process's plan
        refused their shared amax (the trainer's shards of such a layer lie on several devices)."""
        self._share_amax = False
        self.receiver = None
        if self._table is not None:
            self._table.close()
            self._table = None
        return self._current_table()

    def start_weight_update(self) -> None:
        """Returns at once; the bytes move from receive_weights on."""
        if self.link is None:
            raise RuntimeError("refit: init_transfer_engine first")

    def update_weights(self, update_info: Dict[str, Any]) -> None:
        # vLLM's default synchronizes the device after each chunk; the staged receive must keep
        # running beside the engine, so only the chunk is received here.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        """Agrees on the tables with every process (re-planning if any changed), then receives:
        staged, on a background thread while the engine keeps running; direct (staging does not
        fit), here, with the engine paused until the bytes are in."""
        if self.link is None:
            raise RuntimeError("refit: init_transfer_engine first")
        self.update.start(self.link, self._current_table())

    def wait_received(self, timeout: Optional[float] = None) -> bool:
        """Waits for the staged receive (True when it is over, received or failed)."""
        return self.update.wait(timeout)

    @property
    def last_stats(self) -> Any:
        """The refit stats of the last run or commit."""
        return self.update.stats

    def finish_weight_update(self) -> None:
        """Waits for the staged receive, then installs it (between two engine steps). A failed
        receive or a verify mismatch refuses the update: nothing is installed."""
        if self.link is None:
            raise RuntimeError("refit: init_transfer_engine first")
        self.update.finish(self.link, self._stream())
        if self._staging:
            # Checkpoint tensors that arrived whole: the engine's own loader places them and its
            # layerwise reload rebuilds the post-processed layers from them.
            self.installed = self.receiver.install_staged(self.model, self._staging, self.vllm_config.model_config)

    def _stream(self) -> Any:
        if self.link is not None and self.link.backend == Backend.HOST:
            return None
        import torch

        return torch.cuda.current_stream(self.device)

    def shutdown(self) -> None:
        self.update.abort(self.link)
        if self._table is not None:
            self._table.close()
            self._table = None
        if self.link is not None:
            self.link.close()
            self.link = None


# --- trainer side ---------------------------------------------------------------------------------


@dataclasses.dataclass
class RefitTrainerInitInfo(_TrainerInitBase):
    """The trainer's choices for a refit (every trainer rank passes the same, its own `rank`)."""

    backend: ClassVar[str] = BACKEND_NAME
    num_workers: int = 1
    num_trainer_ranks: int = 1
    device_backend: str = "auto"
    device: Optional[int] = None
    """This trainer rank's CUDA device (default: torch's current one)."""
    verify: bool = False
    sm_budget: int = 0
    arm: int = 0
    staging_memory_limit: int = 0
    timeout_ms: int = 600_000
    quantize_online_fp8: bool = True
    """Passed to every worker (RefitInitInfo.quantize_online_fp8)."""
    comm_id: Optional[str] = None
    """The communicator id (hex) for trainers of several ranks that share it themselves; by
    default rank 0 makes it and broadcasts it over torch.distributed."""


class RefitTrainerEngine(_TrainerBase):
    """vLLM's trainer-side engine for backend "refit" (see the module docstring)."""

    init_info_cls = RefitTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True, rank: int = 0) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender, rank=rank)
        self.link: Optional[Link] = None
        self.rounds = 0
        self._held: List[Tuple[str, Any]] = []
        self._signature: Optional[List[Tuple[Any, ...]]] = None
        self._table: Optional[Table] = None
        self.last_stats: Any = None

    @classmethod
    def trainer_init(cls, init_info: RefitTrainerInitInfo, *, client: Any, source: Any = None) -> "RefitTrainerEngine":
        if source is None:
            raise invalid_argument("the refit trainer engine needs a source (a WeightSource, module or MegatronSource)")
        backend = resolved_backend(init_info.device_backend)
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        comm_id = init_info.comm_id
        if comm_id is None:
            comm_id = unique_id(backend).hex() if init_info.is_sender else None
            if init_info.num_trainer_ranks > 1:
                import torch.distributed as dist

                shared = [comm_id]
                dist.broadcast_object_list(shared, src=0)
                comm_id = shared[0]
        if backend == Backend.HOST:
            device = 0
        elif init_info.device is not None:
            device = init_info.device
        else:
            import torch

            device = torch.cuda.current_device()
        nranks = init_info.num_trainer_ranks + init_info.num_workers
        options = LinkOptions(
            verify=init_info.verify,
            sm_budget=init_info.sm_budget,
            arm=init_info.arm,
            staging_memory_limit=init_info.staging_memory_limit,
            timeout_ms=init_info.timeout_ms,
        )
        join = None
        if init_info.is_sender:
            worker_info = RefitInitInfo(
                comm_id=comm_id,  # type: ignore[arg-type]
                nranks=nranks,
                rank_offset=init_info.num_trainer_ranks,
                device_backend={Backend.HOST: "host", Backend.CUDA: "cuda"}[backend],
                verify=options.verify,
                sm_budget=options.sm_budget,
                arm=options.arm,
                staging_memory_limit=options.staging_memory_limit,
                timeout_ms=options.timeout_ms,
                quantize_online_fp8=init_info.quantize_online_fp8,
            )
            # The workers join the communicator and plan while this rank does: concurrently.
            payload = {f.name: getattr(worker_info, f.name) for f in dataclasses.fields(worker_info)}
            join = concurrently(lambda: client.init_weight_transfer_engine(payload))
        try:
            engine.link = Link(bytes.fromhex(comm_id), nranks, init_info.rank, device, backend, options)  # type: ignore[arg-type]
            engine.link.prepare(engine._current_table())
        finally:
            if join is not None:
                join()
        return engine

    def _current_table(self) -> Table:
        """This rank's offers for this round: the source's tensors, kept alive until the next round;
        the table is built again only when one moved or changed shape."""
        tensors = source_tensors(self.source)
        signature = round_signature(tensors)
        self._held = tensors
        if self._table is None or signature != self._signature:
            if self._table is not None:
                self._table.close()
            host = self.link is not None and self.link.backend == Backend.HOST
            self._table = publisher_table(self.source, tensors, self.link.rank, 0 if host else None)  # type: ignore[union-attr]
            self._signature = signature
        return self._table

    def send_weights(self) -> None:
        """One update: every worker starts, every process agrees on the tables and runs (the
        workers receive into staging beside their engine), then the workers commit."""
        link = self.link
        if link is None:
            raise RuntimeError("refit: trainer_init first")
        self.rounds += 1
        if self.is_sender:
            self.client.start_weight_update()
            join = concurrently(lambda: self.client.update_weights({"round": self.rounds}))
        else:
            join = None
        try:
            link.prepare(self._current_table())
            self.last_stats = link.run()
        except BaseException as error:
            reasons = self._close_round(join) if join is not None else []
            raise RuntimeError(f"refit: update refused ({error}); engine: {'; '.join(reasons) or 'no answer'}") from error
        if join is not None:
            join()
        if link.staged:
            link.commit()
        if self.is_sender:
            self.client.finish_weight_update()

    def _close_round(self, join: Callable[[], Any]) -> List[str]:
        """After a failed round: the workers' update calls return, and finish_weight_update ends
        their update (each refuses it: nothing is installed). Returns what the engine said."""
        reasons = []
        for step in (join, self.client.finish_weight_update):
            try:
                step()
            except Exception as error:
                reasons.append(str(error))
        return reasons

    def shutdown(self) -> None:
        if self._table is not None:
            self._table.close()
            self._table = None
        if self.link is not None:
            self.link.close()
            self.link = None
        self._held = []


def register() -> None:
    """vLLM general plugin (entry point `vllm.general_plugins`: refit): registers backend "refit"
    on both of vLLM's factories; safe to call again (vLLM loads plugins in every process)."""
    from vllm.distributed.weight_transfer.factory import (  # type: ignore[import-not-found]
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    module = __name__
    for factory, cls in (
        (WeightTransferEngineFactory, "RefitWeightTransferEngine"),
        (WeightTransferTrainerFactory, "RefitTrainerEngine"),
    ):
        if BACKEND_NAME not in factory._registry:
            factory.register_engine(BACKEND_NAME, module, cls)


__all__ = [
    "BACKEND_NAME",
    "Link",
    "LinkOptions",
    "MegatronSource",
    "RefitInitInfo",
    "RefitTrainerEngine",
    "RefitTrainerInitInfo",
    "RefitUpdateInfo",
    "RefitWeightTransferEngine",
    "publisher_table",
    "engine_receiver",
    "receiver_table",
    "register",
    "source_tensors",
]
