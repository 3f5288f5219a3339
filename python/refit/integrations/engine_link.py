"""What refit's engine backends (vLLM's weight-transfer engines, SGLang's updater) share, with no
framework imported: a trainer's tensors as offers (`source_tensors`, `publisher_table`: Megatron's
module publisher, the DTensor publisher for DTensor models and vLLM's ModuleSource, the HF
publisher for plain modules), and `Link`, one process's part of a refit between processes kept from
round to round (communicator, plan, executor), with the per-round agreement on the tables."""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .._lib import Backend, Commit, RefitError, Status, invalid_argument
from ..comm import Communicator
from ..plan import Table
from .layout import new_table
from .offers import Offer, add_offers

log = logging.getLogger("refit.engines")


class MegatronSource:
    """A Megatron model as a refit source: `publisher` (a MegatronPublisher) lays out `module`'s
    named parameters as offers of the checkpoint tensors."""

    def __init__(self, publisher: Any, module: Any) -> None:
        self.publisher = publisher
        self.module = module

    def tensors(self) -> List[Tuple[str, Any]]:
        return list(self.module.named_parameters())

    def refit_table(self, tensors: Sequence[Tuple[str, Any]], process: int, device: Optional[int]) -> Table:
        return self.publisher.table(tensors, process, device)


def source_publisher(source: Any) -> Any:
    """The publisher describing a (non-Megatron) source where its tensors lie: vLLM's trainer-side
    `ModuleSource` (or any weight source wrapping a module) and a module with DTensor parameters
    through DTensorPublisher (each rank's live shards, no gather); a plain module, a mapping of
    names to tensors or (name, tensor) pairs through HfPublisher (whole tensors)."""
    from .dtensor import DTensorPublisher, named_tensors
    from .hf import HfPublisher

    if hasattr(source, "iter_full") or hasattr(source, "metadata"):
        return DTensorPublisher.from_weight_source(source)
    tensors = list(named_tensors(source))
    if any(getattr(tensor, "placements", None) is not None for _, tensor in tensors):
        return DTensorPublisher(tensors)
    return HfPublisher(tensors)


def source_tensors(source: Any) -> List[Tuple[str, Any]]:
    """This round's tensors of `source`, each kept alive by the caller until the round ends: a
    MegatronSource's parameters, or the offers of source_publisher (checkpoint name, Offer: the
    live shard, its box and the global shape), read again each round so moved storage is seen."""
    if hasattr(source, "refit_table"):
        return source.tensors()
    return [(offer.name, offer) for offer in source_publisher(source).offers]


def round_signature(tensors: Sequence[Tuple[str, Any]]) -> List[Tuple[Any, ...]]:
    """What identifies a round's tables (source_tensors' result): names, addresses, shapes and
    boxes. Equal signatures need no new table, so an unchanged source plans nothing."""
    out: List[Tuple[Any, ...]] = []
    for name, item in tensors:
        if isinstance(item, Offer):
            out.append((name, int(item.local.data_ptr()), tuple(item.local.shape), item.offset, item.shape))
        else:
            out.append((name, int(item.data_ptr()), tuple(item.shape)))
    return out


def publisher_table(source: Any, tensors: Sequence[Tuple[str, Any]], process: int, device: Optional[int] = None) -> Table:
    """The offers of this trainer rank: `tensors` (from source_tensors) laid out by the Megatron
    source's publisher, or the DTensor / HF publisher's offers."""
    if hasattr(source, "refit_table"):
        return source.refit_table(tensors, process, device)
    offers = [offer for _, offer in tensors]
    return new_table(lambda table: add_offers(table, offers, process, device))


@dataclasses.dataclass
class LinkOptions:
    """Executor options every process of a refit must agree on (the trainer chooses them and sends
    them to the workers at init)."""

    verify: bool = False
    sm_budget: int = 0
    arm: int = 0
    staging_memory_limit: int = 0
    """Bytes a worker may stage per update (0: no limit). Beyond it every process runs directly."""
    timeout_ms: int = 600_000


# How the planner refuses needs sharing an amax key that neither one device in one batch nor the
# devices holding them with the amax exchanged can quantize (src/plan/quantized.rs). Every process plans from the same tables, so every process's plan fails
# alike, and every process plans once more (Link.prepare).
AMAX_REFUSED = "needs sharing an amax across receiving devices"


def amax_refused(error: BaseException) -> bool:
    """Whether `error` is the planner's refusal of a shared amax (AMAX_REFUSED)."""
    return isinstance(error, RefitError) and error.status == Status.UNSUPPORTED and AMAX_REFUSED in str(error)


class Link:
    """One process's part of a refit between processes: its communicator rank, and the plan and
    executor kept from round to round while no process's table changed.

    `without_shared_amax` (an engine adapter's; None on a trainer): this process's table with no
    amax keys (the layers whose scales shared one take the engine's own path instead), planned with
    when every process's plan refused a shared amax that the trainer's devices cannot quantize (its
    weights stored so that no kernel reads them in place): every process then plans once more, the
    trainer with its table as it was."""

    def __init__(self, comm_id: bytes, nranks: int, rank: int, device: int, backend: int, options: LinkOptions) -> None:
        from ..group import Group

        self.options = options
        self.rank = rank
        self.device = device
        self.backend = backend
        self.comm = Communicator(comm_id, nranks, rank, device=device, timeout_ms=options.timeout_ms)
        self.group = Group([device], backend=backend)
        # Steps run on a stream of their own: torch's pool streams do not wait for the legacy
        # default stream, so an engine generating on it keeps going while the bytes arrive.
        self.stream: Any = None
        if self.comm.backend != Backend.HOST:
            import torch

            self.stream = torch.cuda.Stream(device)
        self.plan: Any = None
        self.executor: Any = None
        self.staged = True
        self.digests: Optional[List[bytes]] = None
        self.plans_built = 0
        self.without_shared_amax: Optional[Callable[[], Table]] = None

    def _allgather(self, record: bytes) -> List[bytes]:
        """Every rank's 8-byte `record`, in rank order (also a barrier)."""
        size = self.comm.size
        if self.comm.backend == Backend.HOST:
            send = (ctypes.c_uint8 * 8).from_buffer_copy(record)
            recv = (ctypes.c_uint8 * (8 * size))()
            self.comm.allgather(ctypes.addressof(send), ctypes.addressof(recv), [8] * size)
            self.comm.synchronize()
            data = bytes(recv)
        else:
            import torch

            with torch.cuda.stream(self.stream):  # the upload and the allgather on one stream
                send_t = torch.frombuffer(bytearray(record), dtype=torch.uint8).to(f"cuda:{self.device}")
                recv_t = torch.empty(8 * size, dtype=torch.uint8, device=f"cuda:{self.device}")
                self.comm.allgather(send_t.data_ptr(), recv_t.data_ptr(), [8] * size, stream=self.stream)
                self.comm.synchronize(self.stream)
                data = bytes(recv_t.cpu().numpy().tobytes())
        return [data[8 * r : 8 * r + 8] for r in range(size)]

    def prepare(self, table: Table) -> bool:
        """Agrees with every process on the tables (collective); re-plans when any changed.
        Returns True when it re-planned."""
        digests = self._allgather(hashlib.blake2b(table.encode(), digest_size=8).digest())
        if digests == self.digests and self.executor is not None:
            return False
        self._drop()
        try:
            self.plan = self.comm.build_plan(table)
        except RefitError as error:
            if not amax_refused(error):
                raise
            log.warning("refit: %s; planning again with those layers on the engine's own path", error)
            if self.without_shared_amax is not None:
                table = self.without_shared_amax()
            digests = self._allgather(hashlib.blake2b(table.encode(), digest_size=8).digest())
            self.plan = self.comm.build_plan(table)
        stats = self.plan.receiver_stats(self.rank, self.device)
        limit = self.options.staging_memory_limit
        fits = limit == 0 or stats.needed_bytes <= limit
        verdicts = self._allgather(bytes([1 if fits else 0]) + bytes(7))
        self.staged = all(v[0] == 1 for v in verdicts)
        if not fits:
            log.warning(
                "refit: staging %d bytes exceeds staging_memory_limit %d on process %d: every process "
                "runs directly, and workers receive with their engine paused",
                stats.needed_bytes,
                limit,
                self.rank,
            )
        self.executor = self.plan.executor(
            self.group,
            self.rank,
            arm=self.options.arm,
            sm_budget=self.options.sm_budget,
            verify=self.options.verify,
            commit=Commit.STAGED if self.staged else Commit.DIRECT,
            comm=self.comm,
        )
        self.digests = digests
        self.plans_built += 1
        return True

    def run(self) -> Any:
        """One step of the executor (collective), then a meeting where every process says whether
        its step succeeded: no source is released or changed before every receiver has its bytes,
        and when any process failed (a verify mismatch) every process raises, so no worker commits
        an update another refused."""
        stats, failure = None, None
        try:
            stats = self.executor.run(self.stream)
            if self.stream is not None:
                self.stream.synchronize()
        except RefitError as error:
            if error.status in (Status.TIMEOUT, Status.ABORTED):
                raise  # the communicator is gone: no meeting is possible
            failure = error
        verdicts = self._allgather(bytes([0 if failure is None else 1]) + bytes(7))
        if failure is not None:
            raise failure
        failed = [rank for rank, verdict in enumerate(verdicts) if verdict[0]]
        if failed:
            raise RefitError(Status.INVALID_STATE, f"the step failed on process(es) {failed}: nothing is committed")
        return stats

    def commit(self, stream: Any = None) -> Any:
        return self.executor.commit(stream)

    def _drop(self) -> None:
        for handle in (self.executor, self.plan):
            if handle is not None:
                handle.close()
        self.executor = self.plan = None
        self.digests = None

    def close(self) -> None:
        self._drop()
        self.group.close()
        self.comm.close()


def _backend_code(name: str) -> int:
    codes = {"auto": Backend.AUTO, "cuda": Backend.CUDA, "host": Backend.HOST}
    if name not in codes:
        raise invalid_argument(f"device_backend {name!r}: one of {', '.join(codes)}")
    return codes[name]


def resolved_backend(name: str) -> int:
    code = _backend_code(name)
    if code == Backend.AUTO:
        try:
            import torch

            return Backend.CUDA if torch.cuda.is_available() else Backend.HOST
        except ImportError:
            return Backend.HOST
    return code


class UpdateRefused(RuntimeError):
    """An update refused on this rank (a failed receive, a verify mismatch, a dead peer): nothing
    was installed, the engine's weights are as they were, and every other process of the refit
    fails the same round through the link's agreement."""


def refused(error: BaseException) -> UpdateRefused:
    """The error an engine sees when an update is refused: its weights are as they were."""
    return UpdateRefused(f"refit: update refused, the engine's weights are unchanged: {error}")


class InFlight:
    """One update in flight on a rank, as every engine adapter runs it: `start` agrees on the tables
    (re-planning when one changed) and receives, on a background thread while the engine keeps
    serving when the link is staged, or right there (the engine paused) when staging does not fit;
    `finish` waits for the receive and commits between two engine steps. A failed receive, a verify
    mismatch or a dead peer refuses the update at `finish` (or at `start`, for a direct run): nothing
    is installed. `stats` holds the last run's, then the commit's, refit stats."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._failure: Optional[BaseException] = None
        self._received = False
        self.stats: Any = None

    def start(self, link: Link, table: Table) -> None:
        if self._thread is not None:
            raise RuntimeError("refit: the previous update is still receiving; finish it first")
        self._failure, self._received = None, False
        try:
            link.prepare(table)
        except BaseException as error:
            self._failure = error
            raise
        if not link.staged:
            self._receive(link)
            if self._failure is not None:
                raise refused(self._failure) from self._failure
            return
        self._thread = threading.Thread(target=self._receive, args=(link,), name="refit-receive", daemon=True)
        self._thread.start()

    def _receive(self, link: Link) -> None:
        try:
            self.stats = link.run()
            self._received = True
        except BaseException as error:  # handed to finish()
            self._failure = error

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Waits for the receive (True when it is over, received or failed)."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def finish(self, link: Link, stream: Any) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise refused(failure) from failure
        if not self._received:
            raise RuntimeError("refit: nothing received to install (receive an update first)")
        self._received = False
        if link.staged:
            try:
                self.stats = link.commit(stream)
            except RefitError as error:
                raise refused(error) from error

    def abort(self, link: Optional[Link]) -> None:
        """Ends a receive still running (the communicator aborted: every peer fails the step)."""
        if self._thread is not None and link is not None:
            link.comm.abort()
            self._thread.join()
        self._thread = None


def concurrently(call: Callable[[], Any]) -> Callable[[], Any]:
    """Starts `call` on a thread; the returned function joins it and re-raises its error."""
    outcome: Dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()

    def join() -> Any:
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")

    return join
