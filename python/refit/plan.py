"""Shard tables (refit_table), their wire encoding, and reshard plans (refit_plan) read back as plain
Python values."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
from ctypes import byref, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence, Tuple, Union

from ._args import boolean, byte_string, check_range, choice, integers, items, same_length, u64_array
from ._handle import Handle, borrow
from ._lib import (
    Arm,
    Commit,
    NeedQuantizationStruct,
    PlanOptions,
    PlanStatsStruct,
    Policy,
    QuantRouteInfo,
    RouteInfo,
    RouteKind,
    check,
    invalid_argument,
    lib,
)
from .executor import Executor
from .quant import Quantization, fill_quantization
from .segment import Segment

if TYPE_CHECKING:
    from .group import Group


def _placement(tensor: int, rank: int, device: int, addr: int) -> Tuple[int, int, int, int]:
    """The leading arguments of an offer or a need, checked against their C widths."""
    return (
        check_range(tensor, 32, "tensor"),
        check_range(rank, 32, "rank"),
        check_range(device, 32, "device"),
        check_range(addr, 64, "addr"),
    )


def _box(ndim: int, arrays: Iterable[Tuple[str, Optional[Sequence[Any]]]]) -> None:
    """Checks that every given array has `ndim` entries (the C API reads exactly that many)."""
    for what, values in arrays:
        if values is not None:
            same_length(values, ndim, what, f"the box has {ndim} dimensions (offset has {ndim} entries)")


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
        encoded = name.encode() if isinstance(name, str) else byte_string(name, "name", "a str or bytes")
        if b"\0" in encoded:
            raise invalid_argument(f"name = {name!r} contains NUL; a tensor name is a string without NUL")
        dims = u64_array(shape, "shape")
        index = c_uint32()
        arguments = (encoded, check_range(dtype, 32, "dtype"), check_range(elem_size, 32, "elem_size"), dims)
        with self._borrow(exclusive=True) as handle:
            check(lib.refit_table_add_tensor(handle, *arguments, len(dims), byref(index)))
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
        origin, size = u64_array(offset, "offset"), u64_array(extent, "extent")
        steps = None if strides is None else u64_array(strides, "strides")
        _box(len(origin), [("extent", size), ("strides", steps)])
        digest_value = None if digest is None else byref(c_uint64(check_range(digest, 64, "digest")))
        arguments = (
            *_placement(tensor, rank, device, addr),
            origin,
            size,
            steps,
            len(origin),
            digest_value,
        )
        with self._borrow(exclusive=True) as handle:
            check(lib.refit_table_add_offer(handle, *arguments))

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
        origin, size, steps = u64_array(offset, "offset"), u64_array(extent, "extent"), u64_array(strides, "strides")
        order = None if perm is None else integers(perm, "perm", 32)
        ndim = len(origin)
        _box(ndim, [("extent", size), ("strides", steps), ("perm", order)])
        perm_array = None if order is None else (c_uint32 * ndim)(*order)
        arguments = (
            *_placement(tensor, rank, device, addr),
            origin,
            size,
            perm_array,
            steps,
            ndim,
        )
        with self._borrow(exclusive=True) as handle:
            check(lib.refit_table_add_need(handle, *arguments))

    def add_quantized_need(
        self,
        tensor: int,
        rank: int,
        device: int,
        addr: int,
        offset: Sequence[int],
        extent: Sequence[int],
        strides: Sequence[int],
        quantization: Quantization,
        source_type: int,
        scales: int,
        scale_row_stride: int,
        scale_matrix_stride: int = 0,
        staging: int = 0,
    ) -> None:
        """refit_table_add_quantized_need: asks for the box `offset`/`extent` of tensor index `tensor`
        (elements of `source_type`, a SourceType) as FP8 codes at `addr` (byte `strides`, the last 1)
        and scales at `scales`, quantized as `quantization` says. The box's last two dimensions are
        each matrix's rows and columns; matrix m's scale grid starts `m * scale_matrix_stride`
        scales after `scales`, its rows `scale_row_stride` scales apart. `staging` (0: none) is a
        buffer on the receiver for the box's elements, row-major, where they are quantized when no
        offer in the receiver's process holds whole blocks of them."""
        origin, size, steps = u64_array(offset, "offset"), u64_array(extent, "extent"), u64_array(strides, "strides")
        ndim = len(origin)
        _box(ndim, [("extent", size), ("strides", steps)])
        if not isinstance(quantization, Quantization):
            raise invalid_argument(f"quantization is {quantization!r}; expected a refit.quant.Quantization")
        q = NeedQuantizationStruct()
        fill_quantization(q, quantization)
        q.source_type = check_range(source_type, 32, "source_type")
        q.scales = check_range(scales, 64, "scales")
        q.scale_row_stride = check_range(scale_row_stride, 64, "scale_row_stride")
        q.scale_matrix_stride = check_range(scale_matrix_stride, 64, "scale_matrix_stride")
        q.staging = check_range(staging, 64, "staging")
        arguments = (*_placement(tensor, rank, device, addr), origin, size, steps, ndim, byref(q))
        with self._borrow(exclusive=True) as handle:
            check(lib.refit_table_add_quantized_need(handle, *arguments))

    def share_amax(self, rank: int, scale: int, key: int) -> None:
        """refit_table_share_amax: the scales starting at `scale` of process `rank` share their amax
        with every scale any table gives the nonzero `key`: a per-tensor scale takes the amax of all
        the quantized needs writing any of them; per-row needs (the same rows of their tensors) take
        each row's amax over all of them (a weight's shards on several receivers, each with its own
        copy of the scales, as vLLM's per-tensor and row-parallel per-channel weights at tensor
        parallelism above 1)."""
        arguments = (
            check_range(rank, 32, "rank"),
            check_range(scale, 64, "scale"),
            check_range(key, 64, "key"),
        )
        with self._borrow(exclusive=True) as handle:
            check(lib.refit_table_share_amax(handle, *arguments))

    def encode(self) -> bytes:
        """The table's versioned, checksummed wire encoding, as bytes."""
        size = c_size_t()
        written = c_size_t()
        with self._borrow(exclusive=True) as handle:
            check(lib.refit_table_encoded_size(handle, byref(size)))
            buffer = (c_uint8 * size.value)()
            check(lib.refit_table_encode(handle, buffer, size.value, byref(written)))
        return bytes(buffer[: written.value])

    @classmethod
    def decode(cls, data: Union[bytes, bytearray, memoryview]) -> Table:
        """A new table from bytes written by encode() on any rank. Untrusted input is safe:
        corrupted bytes raise RefitError (DECODE_ERROR or VERSION_MISMATCH)."""
        data = byte_string(data, "data")
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


class QuantPath(enum.IntEnum):
    """REFIT_PATH_*: where a quantized need's elements are quantized."""

    IN_PLACE = 1
    STAGED = 2
    SENDER = 3


@dataclasses.dataclass(frozen=True)
class QuantRoute:
    """The quantization one device runs for one quantized need (refit_quant_route_info): the path
    the need took, the device that quantizes (a source's, in place or in the sending process; the
    receiver's, staged), and how much. A need quantized where it is offered on several devices has
    one per device, sharing `need`. `amax_exchanged`: its jobs share an amax with other devices'
    jobs, which the executors exchange at every run (Table.share_amax)."""

    tensor: str
    receiver_rank: int
    receiver_device: int
    runner_rank: int
    runner_device: int
    path: QuantPath
    need: int
    jobs: int
    elements: int
    source_bytes: int
    amax_exchanged: bool = False


PlanStats = dataclasses.make_dataclass(
    "PlanStats",
    [(field[0], int) for field in PlanStatsStruct._fields_ if field[0] not in ("size", "size_histogram")]
    + [("size_histogram", tuple)],
    frozen=True,
)
PlanStats.__doc__ = """refit_plan_stats as a value (field meanings: include/refit.h)."""


def _options(policy: int, coalesce: bool) -> PlanOptions:
    options = PlanOptions()
    check(lib.refit_plan_options_init(byref(options)))
    options.policy = choice(policy, Policy, "policy")
    options.coalesce = 1 if boolean(coalesce, "coalesce") else 0
    return options


@contextlib.contextmanager
def _borrow_tables(tables: Iterable[Table]) -> Iterator[tuple[Any, int]]:
    """(table pointer array, count) for the build calls, every table borrowed meanwhile."""
    with contextlib.ExitStack() as stack:
        handles = [
            stack.enter_context(borrow(table, "table", f"tables[{i}]", exclusive=True))
            for i, table in enumerate(items(tables, "tables"))
        ]
        yield (c_void_p * len(handles))(*handles), len(handles)


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
        options = _options(policy, coalesce)
        pointer = c_void_p()
        with _borrow_tables(tables) as (pointers, count):
            check(lib.refit_plan_build(pointers, count, byref(options), byref(pointer)))
        return cls(pointer.value)

    @classmethod
    def build_share(
        cls, tables: Iterable[Table], process: int, policy: int = Policy.LOCAL, coalesce: bool = True
    ) -> Plan:
        """The share of the plan process `process` takes part in (refit_plan_build_share): the
        routes from or to its endpoints, exactly as Plan.build gives them; coverage and overlaps
        are checked for its own needs only."""
        options = _options(policy, coalesce)
        process = check_range(process, 32, "process")
        pointer = c_void_p()
        with _borrow_tables(tables) as (pointers, count):
            check(lib.refit_plan_build_share(pointers, count, process, byref(options), byref(pointer)))
        return cls(pointer.value)

    def _release(self, pointer: int) -> None:
        lib.refit_plan_destroy(pointer)

    @property
    def stats(self) -> Any:
        """The whole plan's counts, a PlanStats."""
        with self._borrow() as handle:
            return _stats(lambda raw: lib.refit_plan_get_stats(handle, raw))

    def receiver_stats(self, rank: int, device: int) -> Any:
        """The counts of receiver (`rank`, `device`)'s needs and routes, a PlanStats."""
        rank, device = check_range(rank, 32, "rank"), check_range(device, 32, "device")
        with self._borrow() as handle:
            return _stats(lambda raw: lib.refit_plan_get_receiver_stats(handle, rank, device, raw))

    @property
    def fingerprint(self) -> int:
        """Equal for the same tables in any order, in any process."""
        value = c_uint64()
        with self._borrow() as handle:
            check(lib.refit_plan_fingerprint(handle, byref(value)))
        return value.value

    @property
    def inputs_fingerprint(self) -> int:
        """Equal for every plan and share built from the same tables (in any order) and options."""
        value = c_uint64()
        with self._borrow() as handle:
            check(lib.refit_plan_inputs_fingerprint(handle, byref(value)))
        return value.value

    @property
    def route_count(self) -> int:
        """The number of routes."""
        count = c_size_t()
        with self._borrow() as handle:
            check(lib.refit_plan_route_count(handle, byref(count)))
        return count.value

    def route(self, index: int) -> Route:
        """Route `index` as a Route (RefitError NOT_FOUND past the end)."""
        info = RouteInfo()
        info.size = ctypes.sizeof(info)
        index = check_range(index, 64, "index")
        with self._borrow() as handle:
            check(lib.refit_plan_route(handle, index, byref(info)))
            # info.segments points into the plan: copied out before close() may free it.
            raw = info.segments[: info.segment_count] if info.segment_count else ()
            segments = tuple(Segment.from_struct(segment) for segment in raw)
        kind = RouteKind(info.kind)
        return Route(info.src_rank, info.src_device, info.dst_rank, info.dst_device, kind, segments)

    def quant_routes(self) -> list[QuantRoute]:
        """Every quantized need's quantization, one per (need, device), ordered by receiver, tensor
        and box, then device (refit_plan_quant_route)."""
        count = c_size_t()
        out = []
        with self._borrow() as handle:
            check(lib.refit_plan_quant_route_count(handle, byref(count)))
            for index in range(count.value):
                info = QuantRouteInfo()
                info.size = ctypes.sizeof(info)
                check(lib.refit_plan_quant_route(handle, index, byref(info)))
                out.append(
                    QuantRoute(
                        (info.tensor or b"").decode("utf-8", "replace"),
                        info.receiver_rank,
                        info.receiver_device,
                        info.runner_rank,
                        info.runner_device,
                        QuantPath(info.path),
                        info.need,
                        info.jobs,
                        info.elements,
                        info.source_bytes,
                        bool(info.amax_exchanged),
                    )
                )
        return out

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
        process makes this call). A share built for another process (Plan.build_share) raises
        RefitError(INVALID_ARGUMENT): it lacks this process's routes.

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
