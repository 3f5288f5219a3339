"""Executors (refit_executor): one process's share of a plan prepared once for a group, run step
after step, optionally verified and committed all or nothing, rebound when buffers move."""

from __future__ import annotations

import ctypes
import dataclasses
from ctypes import byref, c_void_p
from typing import TYPE_CHECKING, Any, Callable, List, Sequence, Union

from ._args import boolean, choice
from ._handle import Handle, borrow
from ._lib import (
    Arm,
    Commit,
    ExecutorInfoStruct,
    ExecutorOptions,
    ExitMode,
    RouteKind,
    RunStatsStruct,
    check,
    check_range,
    invalid_argument,
    lib,
)

if TYPE_CHECKING:
    from .group import Group
    from .plan import Plan


@dataclasses.dataclass(frozen=True)
class RunStats:
    """refit_run_stats as a value: what one run or commit did and where its time went. Tuples are
    indexed by RouteKind (LOCAL, PEER, REMOTE); `arm` holds Arm.KERNEL, COPY_ENGINE or NONE.
    prepare_ns + enqueue_ns + wait_ns account for wall_ns (host); the *_ns of the stages and
    device_ns are device times, filled when `device_timed` (else Executor.stats() waits for them)."""

    descriptors_reused: bool
    device_timed: bool
    verified: bool
    slices: int
    arm: tuple
    bytes: tuple
    segments: tuple
    installed_bytes: int
    verified_bytes: int
    wall_ns: int
    prepare_ns: int
    enqueue_ns: int
    wait_ns: int
    local_ns: int
    peer_ns: int
    verify_ns: int
    commit_ns: int
    device_ns: int
    remote_received_bytes: int = 0
    remote_ipc_bytes: int = 0
    remote_wire_bytes: int = 0
    remote_ipc_peers: int = 0
    remote_staged_peers: int = 0
    quantized_elements: int = 0

    @classmethod
    def from_struct(cls, raw: RunStatsStruct) -> RunStats:
        values = {name: getattr(raw, name) for name, _ in RunStatsStruct._fields_ if name != "size"}
        values["arm"] = tuple(Arm(code) for code in raw.arm)
        values["bytes"] = tuple(raw.bytes)
        values["segments"] = tuple(raw.segments)
        return cls(**values)

    def bytes_of(self, kind: int) -> int:
        """Payload bytes of route kind `kind` (a RouteKind) this call copied."""
        return self.bytes[choice(kind, RouteKind, "kind")]


@dataclasses.dataclass(frozen=True)
class ExecutorInfo:
    """refit_executor_info as a value: what an executor was prepared to do, known at creation.
    `slices`: slices every run takes (more than 1 only when staged above staging_limit: the run then
    installs all but the last before the commit). `staging_bytes`: staging held on the receiving
    devices. `address_check_ns`: host time the creation spent checking every address it reads or
    writes against the device's memory. Beside staging_limit: `quantization_bytes`, device memory
    held for quantized needs (their staging under staged commit, the verify's scratch, the buffer of
    codes and scales quantized for other processes); `landing_bytes`, where bytes from other
    processes land under staged commit."""

    slices: int
    staging_bytes: int
    address_check_ns: int
    quantization_bytes: int
    landing_bytes: int


class Executor(Handle):
    """One process's share of a plan prepared for a group (refit_executor): descriptors built and
    uploaded once, staging allocated, then run() step after step with no host work per segment.

    Owns the executor (close(), `with`, or garbage collection releases it, after its queued work).
    It keeps the Group object it was made for and calls into it: use it from the thread that
    drives the group. The plan may be closed once the executor exists.
    """

    _what = "executor"

    def __init__(
        self,
        plan: Plan,
        group: Group,
        process: int,
        arm: int = Arm.AUTO,
        sm_budget: int = 0,
        verify: bool = False,
        commit: int = Commit.DIRECT,
        staging_limit: int = 0,
        comm: Any = None,
        single_slice: bool = False,
    ) -> None:
        """Prepares `process`'s share of `plan` for `group` (refit_executor_create; see
        Plan.executor for the options). With `comm` (a Communicator), `process` must be its rank,
        and the routes between this process and the other processes of `comm` are prepared too
        (refit_executor_create_across: a collective call, every process makes it).
        `single_slice` (COMMIT STAGED only): refuse, with RefitError INVALID_ARGUMENT, a step that
        would run in more than one slice under `staging_limit`. Every address the plan reads or
        writes is checked here, once: memory that is not the named device's is INVALID_ARGUMENT
        naming the tensor, box and address."""
        if not isinstance(single_slice, bool):
            raise invalid_argument(f"single_slice={single_slice!r}; expected True or False")
        options = ExecutorOptions()
        check(lib.refit_executor_options_init(byref(options)))
        options.arm = check_range(arm, 32, "arm")
        options.sm_budget = check_range(sm_budget, 32, "sm_budget")
        options.verify = boolean(verify, "verify")
        options.commit = check_range(commit, 32, "commit")
        options.staging_limit = check_range(staging_limit, 64, "staging_limit")
        options.single_slice = single_slice
        pointer = c_void_p()
        process = check_range(process, 32, "process")
        planned = borrow(plan, "plan", "plan")
        with planned as plan_handle, borrow(group, "group", "group", exclusive=True) as group_handle:
            if comm is None:
                check(lib.refit_executor_create(plan_handle, group_handle, process, byref(options), byref(pointer)))
            else:
                with borrow(comm, "communicator", "comm", exclusive=True) as comm_handle:
                    if process != comm.rank:
                        raise invalid_argument(
                            f"process = {process} is not the communicator's rank: pass comm.rank ({comm.rank})"
                        )
                    check(
                        lib.refit_executor_create_across(
                            plan_handle, group_handle, comm_handle, byref(options), byref(pointer)
                        )
                    )
        super().__init__(pointer.value)
        self._group = group
        self._comm = comm

    def _release(self, pointer: int) -> None:
        lib.refit_executor_destroy(pointer)

    def run(self, stream: Union[object, Sequence[object], None] = None) -> RunStats:
        """Runs one step (refit_executor_run) and returns its RunStats.

        stream None: inside the group's open scope if there is one, else complete on return.
        Otherwise `stream` (one per rank of the group: a list, or a single stream for a one-rank
        group; torch/CuPy streams, ints, HostStreams) orders the step: it runs after the work
        queued so far on those streams, and work queued on them later runs after it; the call
        returns without waiting (except to read a verify outcome: see include/refit.h).
        Raises RefitError: VERIFY_MISMATCH names the tensor, box and element that differ."""
        return self._call(lib.refit_executor_run, stream)

    def commit(self, stream: Union[object, Sequence[object], None] = None) -> RunStats:
        """Installs a staged step into the live buffers (refit_executor_commit), ordered by
        `stream` as run() is; returns its RunStats. RefitError INVALID_STATE when nothing is
        staged or the executor commits directly; VERIFY_MISMATCH installs nothing."""
        return self._call(lib.refit_executor_commit, stream)

    def stats(self) -> RunStats:
        """The RunStats of the last run or commit with device times (waits for its device work)."""
        raw = RunStatsStruct()
        raw.size = ctypes.sizeof(raw)
        with self._borrow(exclusive=True) as handle:
            check(lib.refit_executor_stats(handle, byref(raw)))
        return RunStats.from_struct(raw)

    def info(self) -> ExecutorInfo:
        """What the executor was prepared to do (refit_executor_get_info): its slices per run, the
        device memory it holds and the time its creation spent checking addresses. Does not wait."""
        raw = ExecutorInfoStruct()
        raw.size = ctypes.sizeof(raw)
        with self._borrow(exclusive=True) as handle:
            check(lib.refit_executor_get_info(handle, byref(raw)))
        return ExecutorInfo(
            raw.slices, raw.staging_bytes, raw.address_check_ns, raw.quantization_bytes, raw.landing_bytes
        )

    def rebind(self, device: int, old_base: int, new_base: int, length: int) -> None:
        """Tells the executor that the `length` bytes at `old_base` on `device` now live at
        `new_base` (refit_executor_rebind): later runs use the new place with no planning.
        RefitError PLAN_STALE when the range cuts through bytes the plan moves together (build a
        new plan), NOT_FOUND when the plan uses none of it, INVALID_ARGUMENT when new_base equals
        old_base (nothing moved)."""
        arguments = (
            check_range(device, 32, "device"),
            check_range(old_base, 64, "old_base"),
            check_range(new_base, 64, "new_base"),
            check_range(length, 64, "length"),
        )
        with self._borrow(exclusive=True) as handle:
            check(lib.refit_executor_rebind(handle, *arguments))

    def _call(self, function: Callable[..., Any], stream: Union[object, Sequence[object], None]) -> RunStats:
        raw = RunStatsStruct()
        raw.size = ctypes.sizeof(raw)
        # The executor first: a closed executor is refused before the group is touched.
        with self._borrow(exclusive=True) as handle, self._group._borrow(exclusive=True) as group:
            if stream is None:
                check(function(handle, group, byref(raw)))
            else:
                with self._group.scope(self._per_rank(stream), mode=ExitMode.ASYNC):
                    check(function(handle, group, byref(raw)))
        return RunStats.from_struct(raw)

    def _per_rank(self, stream: Union[object, Sequence[object]]) -> List[object]:
        streams = list(stream) if isinstance(stream, (list, tuple)) else [stream]
        if len(streams) != self._group.size:
            raise invalid_argument(
                f"stream has {len(streams)} entries; the group has {self._group.size} ranks (one stream each, "
                "or a single stream for a one-rank group)"
            )
        return streams

    def __repr__(self) -> str:
        return "<refit.Executor closed>" if self.closed else f"<refit.Executor on {self._group!r}>"


__all__ = ["Arm", "Commit", "Executor", "ExecutorInfo", "RunStats"]
