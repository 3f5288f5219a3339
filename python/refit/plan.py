"""Shard tables (refit_table), their wire encoding, and reshard plans (refit_plan) read back as plain
Python values."""

from __future__ import annotations

import ctypes
import dataclasses
from ctypes import byref, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence, Tuple, Union

from ._handle import Handle
from ._lib import (
    Arm,
    Commit,
    PlanOptions,
    PlanStatsStruct,
    Policy,
    RouteInfo,
    RouteKind,
    check,
    check_range,
    invalid_argument,
    lib,
    u64_array,
)
from .executor import Executor
from .segment import Segment

if TYPE_CHECKING:
    from .group import Group


def _box(ndim: int, arrays: Iterable[Tuple[str, Optional[Sequence[int]]]]) -> None:
    """Checks that every given array has `ndim` entries (the C API reads exactly that many)."""
    for what, values in arrays:
        if values is not None and len(values) != ndim:
            raise invalid_argument(f"{what} has {len(values)} entries; the box has {ndim} dimensions")


class Table(Handle):
    """One rank's shard table: tensors, offers (what it publishes), needs (what it receives).

    Owns its refit_table; close() releases it (plans built from it are unaffected). Not for
    concurrent use from several threads.
    """

    _what = "table"

    def __init__(self, _pointer: Optional[int] = None) -> None:
        """An empty table (the argument is for Table.decode only)."""
        if _pointer is None:
            pointer = c_void_p()
            check(lib.refit_table_create(byref(pointer)))
            _pointer = pointer.value
        super().__init__(_pointer)

    def _release(self, pointer: int) -> None:
        lib.refit_table_destroy(pointer)

    def add_tensor(self, name: Union[str, bytes], shape: Sequence[int], elem_size: int, dtype: int = 0) -> int:
        """Adds tensor `name` of global `shape`, `elem_size` bytes per element and a caller-defined
        `dtype` code; returns its index in this table (the same index when added again alike)."""
        encoded = name.encode() if isinstance(name, str) else bytes(name)
        if b"\0" in encoded:
            raise invalid_argument("a tensor name must not contain NUL")
        dims = u64_array(shape, "shape")
        index = c_uint32()
        check(
            lib.refit_table_add_tensor(
                self.handle,
                encoded,
                check_range(dtype, 32, "dtype"),
                check_range(elem_size, 32, "elem_size"),
                dims,
                len(dims),
                byref(index),
            )
        )
        return index.value

    def add_offer(
        self,
        tensor: int,
        rank: int,
        device: int,
        addr: int,
        offset: Sequence[int],
        extent: Sequence[int],
        strides: Optional[Sequence[int]] = None,
        digest: Optional[int] = None,
    ) -> None:
        """Publishes the box `offset`/`extent` (global element coordinates) of tensor index
        `tensor`, held by (`rank`, `device`) at address `addr` with element `strides` (None:
        row-major over `extent`). Offers of one box are replicas; `digest` (an int) lets the
        planner refuse replicas that differ."""
        ndim = len(offset)
        _box(ndim, [("extent", extent), ("strides", strides)])
        digest_value = None if digest is None else byref(c_uint64(check_range(digest, 64, "digest")))
        check(
            lib.refit_table_add_offer(
                self.handle,
                check_range(tensor, 32, "tensor"),
                check_range(rank, 32, "rank"),
                check_range(device, 32, "device"),
                check_range(addr, 64, "addr"),
                u64_array(offset, "offset"),
                u64_array(extent, "extent"),
                None if strides is None else u64_array(strides, "strides"),
                ndim,
                digest_value,
            )
        )

    def add_need(
        self,
        tensor: int,
        rank: int,
        device: int,
        addr: int,
        offset: Sequence[int],
        extent: Sequence[int],
        strides: Sequence[int],
        perm: Optional[Sequence[int]] = None,
    ) -> None:
        """Asks for the box `offset`/`extent` of tensor index `tensor` on receiver (`rank`,
        `device`), written at `addr` with destination element `strides`; destination dimension d
        is tensor dimension `perm[d]` (None: the identity)."""
        ndim = len(offset)
        _box(ndim, [("extent", extent), ("strides", strides), ("perm", perm)])
        perm_array = None
        if perm is not None:
            perm_array = (c_uint32 * ndim)(*[check_range(p, 32, "perm[i]") for p in perm])
        check(
            lib.refit_table_add_need(
                self.handle,
                check_range(tensor, 32, "tensor"),
                check_range(rank, 32, "rank"),
                check_range(device, 32, "device"),
                check_range(addr, 64, "addr"),
                u64_array(offset, "offset"),
                u64_array(extent, "extent"),
                perm_array,
                u64_array(strides, "strides"),
                ndim,
            )
        )

    def encode(self) -> bytes:
        """The table's versioned, checksummed wire encoding, as bytes."""
        size = c_size_t()
        check(lib.refit_table_encoded_size(self.handle, byref(size)))
        buffer = (c_uint8 * size.value)()
        written = c_size_t()
        check(lib.refit_table_encode(self.handle, buffer, size.value, byref(written)))
        return bytes(buffer[: written.value])

    @classmethod
    def decode(cls, data: Union[bytes, bytearray, memoryview]) -> Table:
        """A new table from bytes written by encode() on any rank. Untrusted input is safe:
        corrupted bytes raise RefitError (DECODE_ERROR or VERSION_MISMATCH)."""
        data = bytes(data)
        buffer = (c_uint8 * len(data)).from_buffer_copy(data)
        pointer = c_void_p()
        check(lib.refit_table_decode(buffer, len(data), byref(pointer)))
        return cls(pointer.value)


@dataclasses.dataclass(frozen=True)
class Route:
    """Every segment from one source endpoint (rank, device) to one destination endpoint."""

    src_rank: int
    src_device: int
    dst_rank: int
    dst_device: int
    kind: RouteKind
    segments: Tuple[Segment, ...]


PlanStats = dataclasses.make_dataclass(
    "PlanStats",
    [(field[0], int) for field in PlanStatsStruct._fields_ if field[0] not in ("size", "size_histogram")]
    + [("size_histogram", tuple)],
    frozen=True,
)
PlanStats.__doc__ = """refit_plan_stats as a value (field meanings: include/refit.h)."""


def _build_arguments(
    tables: Iterable[Table], policy: int, coalesce: bool
) -> tuple[Any, int, PlanOptions]:
    """(table pointer array, count, refit_plan_options) for the build calls."""
    handles = [table.handle for table in tables]
    pointers = (c_void_p * len(handles))(*handles)
    options = PlanOptions()
    check(lib.refit_plan_options_init(byref(options)))
    options.policy = check_range(policy, 32, "policy")
    options.coalesce = 1 if coalesce else 0
    return pointers, len(handles), options


def _stats(fill: Callable[[Any], int]) -> Any:
    raw = PlanStatsStruct()
    raw.size = ctypes.sizeof(raw)
    check(fill(byref(raw)))
    values = {field[0]: getattr(raw, field[0]) for field in PlanStatsStruct._fields_ if field[0] != "size"}
    values["size_histogram"] = tuple(raw.size_histogram)
    return PlanStats(**values)


class Plan(Handle):
    """A built reshard plan (refit_plan): immutable, so any thread may read it. Owns the plan;
    routes() copies segments out, so they outlive close()."""

    _what = "plan"

    @classmethod
    def build(cls, tables: Iterable[Table], policy: int = Policy.LOCAL, coalesce: bool = True) -> Plan:
        """Plans moving every byte the tables' needs ask for exactly once (refit_plan_build);
        `tables` is every rank's Table, in any order. Raises RefitError on a coverage gap,
        overlapping writes, replica or tensor mismatch."""
        pointers, count, options = _build_arguments(tables, policy, coalesce)
        pointer = c_void_p()
        check(lib.refit_plan_build(pointers, count, byref(options), byref(pointer)))
        return cls(pointer.value)

    @classmethod
    def build_share(
        cls, tables: Iterable[Table], process: int, policy: int = Policy.LOCAL, coalesce: bool = True
    ) -> Plan:
        """The share of the plan process `process` takes part in (refit_plan_build_share): the
        routes from or to its endpoints, exactly as Plan.build gives them; coverage and overlaps
        are checked for its own needs only."""
        pointers, count, options = _build_arguments(tables, policy, coalesce)
        process = check_range(process, 32, "process")
        pointer = c_void_p()
        check(lib.refit_plan_build_share(pointers, count, process, byref(options), byref(pointer)))
        return cls(pointer.value)

    def _release(self, pointer: int) -> None:
        lib.refit_plan_destroy(pointer)

    @property
    def stats(self) -> Any:
        """The whole plan's counts, a PlanStats."""
        return _stats(lambda raw: lib.refit_plan_get_stats(self.handle, raw))

    def receiver_stats(self, rank: int, device: int) -> Any:
        """The counts of receiver (`rank`, `device`)'s needs and routes, a PlanStats."""
        rank, device = check_range(rank, 32, "rank"), check_range(device, 32, "device")
        return _stats(lambda raw: lib.refit_plan_get_receiver_stats(self.handle, rank, device, raw))

    @property
    def fingerprint(self) -> int:
        """Equal for the same tables in any order, in any process."""
        value = c_uint64()
        check(lib.refit_plan_fingerprint(self.handle, byref(value)))
        return value.value

    @property
    def inputs_fingerprint(self) -> int:
        """Equal for every plan and share built from the same tables (in any order) and options."""
        value = c_uint64()
        check(lib.refit_plan_inputs_fingerprint(self.handle, byref(value)))
        return value.value

    @property
    def route_count(self) -> int:
        """The number of routes."""
        count = c_size_t()
        check(lib.refit_plan_route_count(self.handle, byref(count)))
        return count.value

    def route(self, index: int) -> Route:
        """Route `index` as a Route (RefitError NOT_FOUND past the end)."""
        info = RouteInfo()
        info.size = ctypes.sizeof(info)
        check(lib.refit_plan_route(self.handle, check_range(index, 64, "index"), byref(info)))
        raw = info.segments[: info.segment_count] if info.segment_count else ()
        segments = tuple(Segment.from_struct(segment) for segment in raw)
        kind = RouteKind(info.kind)
        return Route(info.src_rank, info.src_device, info.dst_rank, info.dst_device, kind, segments)

    def routes(self) -> list[Route]:
        """Every route, ordered by destination, then local/peer/remote, then source."""
        return [self.route(index) for index in range(self.route_count)]

    def __iter__(self) -> Iterator[Route]:
        return iter(self.routes())

    def executor(
        self,
        group: Group,
        process: int,
        arm: int = Arm.AUTO,
        sm_budget: int = 0,
        verify: bool = False,
        commit: int = Commit.DIRECT,
        staging_limit: int = 0,
        comm: Any = None,
    ) -> Executor:
        """An Executor of process rank `process`'s share of this plan on `group` (whose device
        ordinals the plan's endpoints name): descriptors built and uploaded now, then run() at every
        step (refit_executor_create). With `comm` (a Communicator whose rank is `process`), the
        routes to and from the other processes of `comm` too (refit_executor_create_across; every
        process makes this call).

        arm: Arm.AUTO (by run length: the copy engine for long runs, the kernel for the others;
        stats.arm says which, Arm.SPLIT for both), KERNEL or COPY_ENGINE (no SMs). sm_budget: KERNEL
        copies on at most this many SMs; AUTO then moves every run by the copy engine, in 64 MiB
        copies paced to what that many SMs would copy (0: no cap; not with COPY_ENGINE). verify:
        compare every copied byte with its source (with `comm`, processes that exchange bytes through
        staging must all ask for it or all not: INVALID_ARGUMENT on every process otherwise).
        commit: Commit.DIRECT (run installs) or STAGED (run stages, commit() installs all at once).
        staging_limit: STAGED only, staging bytes per receiving device (0: the whole step)."""
        return Executor(self, group, process, arm, sm_budget, verify, commit, staging_limit, comm)


__all__ = ["Plan", "PlanStats", "Policy", "Route", "RouteKind", "Segment", "Table"]
