"""Device groups (refit_group), their scopes, per-rank runs and allgather; host streams."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from ctypes import byref, c_bool, c_int32, c_size_t, c_uint32, c_void_p
from typing import Callable, Iterable, Iterator, Optional, Sequence, Sized, Tuple

from ._args import (
    check_range,
    choice,
    device_ordinal,
    integer,
    integers,
    items,
    same_length,
    stream_value,
    u64_array,
    wrong_type,
    wrong_value,
)
from ._handle import Handle
from ._lib import (
    Algorithm,
    Backend,
    ExitMode,
    GroupOptions,
    RankCallback,
    RefitError,
    Status,
    check,
    last_error_message,
    lib,
    torch_cuda_in_use,
    torch_current_stream,
)
from .copy import PreparedCopy, copy_batch
from .digest import digest, digest_many
from .segment import SegmentLike


class HostStream(Handle):
    """A caller-side stream of the host backend (refit_host_stream_create): a FIFO queue with its own
    worker thread, usable as a caller stream of any host-backend group. Owned by this object;
    close() destroys it after its queued work has run. Any thread may use it."""

    _what = "host stream"

    def __init__(self) -> None:
        pointer = c_void_p()
        check(lib.refit_host_stream_create(byref(pointer)))
        super().__init__(pointer.value)

    def _release(self, pointer: int) -> None:
        check(lib.refit_host_stream_destroy(pointer))


class Group(Handle):
    """One rank per device, each with its own stream and thread (refit_group).

    Owns the group: close() (or leaving a `with` block) destroys it, draining its streams. Use it
    from one thread at a time; inside run(), the rank callbacks may call allgather_rank(),
    copy_batch() and the queries concurrently, but nothing else (not run, allgather, scopes or
    close).
    """

    _what = "group"
    _busy_hint = " (a rank callback runs on its own thread, inside its group's run())"

    def __init__(self, devices: Iterable[int], backend: int = Backend.AUTO, host_devices: int = 0) -> None:
        """Creates a group whose rank r is `devices[r]`. `backend` is a Backend; `host_devices` is
        how many devices the host backend simulates (0: the largest listed + 1)."""
        devices = [device_ordinal(device, f"devices[{i}]") for i, device in enumerate(items(devices, "devices"))]
        options = GroupOptions()
        check(lib.refit_group_options_init(byref(options)))
        options.backend = choice(backend, Backend, "backend")
        options.host_devices = check_range(host_devices, 32, "host_devices")
        array = (c_int32 * len(devices))(*devices)
        pointer = c_void_p()
        check(lib.refit_group_create(array, len(devices), byref(options), byref(pointer)))
        super().__init__(pointer.value)
        self._size = len(devices)
        chosen = c_uint32()
        with self._borrow() as handle:
            check(lib.refit_group_backend(handle, byref(chosen)))
        self._backend = Backend(chosen.value)

    def _release(self, pointer: int) -> None:
        lib.refit_group_destroy(pointer)

    # --- queries (any thread, including rank callbacks) ---

    @property
    def size(self) -> int:
        """The number of ranks."""
        size = c_size_t()
        with self._borrow() as handle:
            check(lib.refit_group_size(handle, byref(size)))
        return size.value

    def __len__(self) -> int:
        return self.size

    def device(self, rank: int) -> int:
        """The device ordinal of `rank`."""
        device = c_int32()
        rank = check_range(rank, 32, "rank")
        with self._borrow() as handle:
            check(lib.refit_group_device(handle, rank, byref(device)))
        return device.value

    def rank_of(self, device: int) -> int:
        """The rank whose device is `device` (the inverse of device()): plans, routes and tables
        name device ordinals, calls on a group take ranks. INVALID_ARGUMENT when `device` is not one
        of the group's devices."""
        device = integer(device, "device")
        if not -(1 << 31) <= device < (1 << 31):
            raise wrong_value("device", device, "one of the group's devices (32-bit ordinals)")
        rank = c_uint32()
        with self._borrow() as handle:
            check(lib.refit_group_rank_of(handle, device, byref(rank)))
        return rank.value

    @property
    def devices(self) -> list[int]:
        """Every rank's device, in rank order."""
        return [self.device(rank) for rank in range(self.size)]

    def stream(self, rank: int) -> int:
        """The group's own stream of `rank` as an int (CUstream, or host-stream handle)."""
        stream = c_void_p()
        rank = check_range(rank, 32, "rank")
        with self._borrow() as handle:
            check(lib.refit_group_stream(handle, rank, byref(stream)))
        return stream.value or 0

    def peer_access(self, rank: int, peer: int) -> bool:
        """Whether `rank` reaches `peer`'s memory directly."""
        direct = c_bool()
        rank, peer = check_range(rank, 32, "rank"), check_range(peer, 32, "peer")
        with self._borrow() as handle:
            check(lib.refit_group_peer_access(handle, rank, peer, byref(direct)))
        return direct.value

    @property
    def backend(self) -> Backend:
        """Backend.CUDA or Backend.HOST (never AUTO)."""
        self.handle  # refuses a closed group
        return self._backend

    # --- scopes ---

    def enter(self, caller_streams: Optional[Sequence[object]] = None) -> None:
        """Opens a scope (refit_group_enter): each rank's stream waits for the work queued so far
        on `caller_streams[rank]`, each a stream in any form refit takes (see stream_value).
        None: torch's current stream of every rank's device when torch uses CUDA (and the group is
        a CUDA group), else every device's legacy default stream."""
        if caller_streams is None:
            if self._backend == Backend.HOST or not torch_cuda_in_use():
                with self._borrow(exclusive=True) as handle:
                    check(lib.refit_group_enter(handle, None))
                return
            caller_streams = [torch_current_stream(device) for device in self.devices]
        caller_streams = items(caller_streams, "caller_streams")
        self._check_per_rank(caller_streams, "caller_streams")
        host = self._backend == Backend.HOST
        streams = [
            stream_value(stream, device, host=host, what=f"caller_streams[{rank}]")
            for rank, (stream, device) in enumerate(zip(caller_streams, self.devices))
        ]
        with self._borrow(exclusive=True) as handle:
            check(lib.refit_group_enter(handle, (c_void_p * len(streams))(*streams)))

    def exit(self, mode: int = ExitMode.SYNC) -> None:
        """Closes the open scope (refit_group_exit); ExitMode.SYNC blocks until the group's work is
        done, ExitMode.ASYNC makes the caller streams wait for it instead. A refused call (a mode
        that is not an ExitMode, no scope open, called from a rank callback) changes nothing; once
        accepted, the scope is closed even when this raises."""
        mode = choice(mode, ExitMode, "mode")
        with self._borrow(exclusive=True) as handle:
            check(lib.refit_group_exit(handle, mode))

    @contextlib.contextmanager
    def scope(self, caller_streams: Optional[Sequence[object]] = None, mode: int = ExitMode.SYNC) -> Iterator[Group]:
        """`with group.scope(...)`: enter() on the way in, exit(mode) on the way out, also when the
        body raises (then the body's exception wins over an exit error)."""
        self.enter(caller_streams)
        try:
            yield self
        except BaseException:
            with contextlib.suppress(RefitError):
                self.exit(mode)
            raise
        self.exit(mode)

    # --- work ---

    def run(self, fn: Callable[[int, int], object]) -> None:
        """Calls `fn(rank, stream)` for every rank at once, each on the group's thread for that rank
        with its device current; returns when all have returned (refit_group_run).

        An exception raised by `fn` fails that rank (other ranks waiting in allgather_rank are
        released with RefitError(ABORTED)); once every rank has returned, the first exception
        raised is re-raised here. A rank whose `fn` returns while others wait for it in
        allgather_rank releases them the same way; if every `fn` then returns normally, this raises
        RefitError(ABORTED) naming that rank. The group stays usable.
        """
        if not callable(fn):
            raise wrong_type("fn", fn, "callable: fn(rank, stream)")
        raised: list[BaseException] = []
        lock = threading.Lock()

        def body(rank: int, stream: Optional[int], _user_data: object) -> int:
            try:
                fn(rank, stream or 0)
                return 0
            except BaseException as error:  # nothing may unwind into the library
                with lock:
                    raised.append(error)
                # The library's message names this code: a refit status if that is what failed.
                return int(error.status) if isinstance(error, RefitError) else int(Status.CALLBACK_FAILED)

        callback = RankCallback(body)  # alive until refit_group_run returns
        with self._borrow(exclusive=True) as handle:
            status = lib.refit_group_run(handle, callback, None)
        if status == Status.SUCCESS:
            return
        message = RefitError(status, last_error_message())
        if raised:
            raise raised[0] from message
        raise message

    def allgather(
        self, send_ptrs: Sequence[int], recv_ptrs: Sequence[int], counts: Sequence[int], algorithm: int = Algorithm.AUTO
    ) -> Algorithm:
        """Gathers every rank's block into every rank's receive buffer in rank order
        (refit_allgather): rank r sends `counts[r]` bytes at `send_ptrs[r]`; `recv_ptrs[r]` holds
        sum(counts) bytes. Pointers are ints (host addresses on the host backend). Queued in the
        open scope, else complete on return. Returns the Algorithm that ran. A buffer that is not
        memory its rank's device can use (checked as copy_batch checks segments) is RefitError
        INVALID_ARGUMENT naming send[r] or recv[r]; nothing moves."""
        send = u64_array(send_ptrs, "send_ptrs")
        recv = u64_array(recv_ptrs, "recv_ptrs")
        sizes = self._counts(counts)
        for array, what in ((send, "send_ptrs"), (recv, "recv_ptrs")):
            self._check_per_rank(array, what)
        picked = c_uint32()
        algorithm = choice(algorithm, Algorithm, "algorithm")
        with self._borrow(exclusive=True) as handle:
            check(lib.refit_allgather(handle, send, recv, sizes, algorithm, byref(picked)))
        return Algorithm(picked.value)

    def allgather_rank(
        self, rank: int, send_ptr: int, recv_ptr: int, counts: Sequence[int], algorithm: int = Algorithm.AUTO
    ) -> Algorithm:
        """The per-rank allgather, only from a run() callback: every rank calls it with its own
        rank, buffers, and the same counts and algorithm (refit_group_allgather_rank). Returns the
        Algorithm that ran. Ranks that disagree all raise RefitError(INVALID_ARGUMENT) and copy
        nothing; the next call works."""
        sizes = self._counts(counts)
        picked = c_uint32()
        arguments = (
            check_range(rank, 32, "rank"),
            check_range(send_ptr, 64, "send_ptr"),
            check_range(recv_ptr, 64, "recv_ptr"),
            sizes,
            choice(algorithm, Algorithm, "algorithm"),
        )
        with self._borrow() as handle:
            check(lib.refit_group_allgather_rank(handle, *arguments, byref(picked)))
        return Algorithm(picked.value)

    # --- batched copies ---

    def copy_batch(
        self, rank: int, segments: Iterable[SegmentLike], stream: object = None, checked: bool = False
    ) -> None:
        """Copies `segments` (Segments, e.g. a plan Route's, or (src, dst, len) tuples) on `stream`,
        a stream of `rank`'s device in any form refit takes (None: torch's current stream of that
        device when torch uses CUDA, else its legacy default stream), in one kernel launch
        (refit_copy_batch). Addresses are on that device or a peer it reaches directly; every
        call checks them first (on the host backend against the process's own mappings: readable
        sources, writable destinations), and any other memory is RefitError INVALID_ARGUMENT
        naming the segment, side and address, nothing copied. `checked`
        refuses destinations written twice (RefitError OVERLAP, nothing copied). CUDA: queued on
        the stream, returns without waiting; a stream being captured into a CUDA graph is RefitError
        UNSUPPORTED, nothing queued (capture a PreparedCopy's launch() instead); host backend:
        complete on return. Any thread, also rank callbacks."""
        copy_batch(self, rank, segments, stream, checked)

    def prepare_copy(self, rank: int, segments: Iterable[SegmentLike], checked: bool = False) -> PreparedCopy:
        """A PreparedCopy of `segments` for `rank`'s device, to launch() many times. The caller owns
        it (close it, or use `with`); it does not keep the group alive."""
        return PreparedCopy(self, rank, segments, checked)

    # --- digests ---

    def digest(self, rank: int, addr: int, length: int, stream: object = None) -> int:
        """The refit digest (an int, 64 bits) of the `length` bytes at `addr` on `rank`'s device,
        computed on `stream` (None: torch's current stream of that device when torch uses CUDA, else
        its legacy default stream) after the work queued there; waits for it (refit_digest: the
        header defines the digest and what it detects). 0 bytes digest to 1 at any address. The
        value to pass as refit_table_add_offer's digest. Memory the device cannot read is RefitError
        INVALID_ARGUMENT (checked as copy_batch checks a source). Any thread."""
        return digest(self, rank, addr, length, stream)

    def digest_many(self, rank: int, ranges: Sequence[Tuple[int, int]], stream: object = None) -> list[int]:
        """The refit digest of each of `ranges`, (addr, length) pairs on `rank`'s device, in order,
        computed in one pass on `stream` (as for digest()) and waited for (refit_digest_many); each
        equals digest() of that range. For a publisher digesting every shard it offers. No ranges:
        an empty list, nothing queued. Any thread."""
        return digest_many(self, rank, ranges, stream)

    def _counts(self, counts: Sequence[int]) -> ctypes.Array[c_size_t]:
        counts = integers(counts, "counts", 8 * ctypes.sizeof(c_size_t))
        self._check_per_rank(counts, "counts")
        return (c_size_t * len(counts))(*counts)

    def _check_per_rank(self, values: Sized, what: str) -> None:
        # The C API reads exactly size() entries: a shorter list would be read past its end.
        same_length(values, self._size, what, f"the group has {self._size} ranks (one entry each)")

    def __repr__(self) -> str:
        if self.closed:
            return "<refit.Group closed>"
        return f"<refit.Group {self.backend.name} devices={self.devices}>"
