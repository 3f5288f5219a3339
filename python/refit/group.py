"""Device groups (refit_group), their scopes, per-rank runs and allgather; host streams."""

import contextlib
import ctypes
import threading
from ctypes import byref, c_bool, c_int32, c_size_t, c_uint32, c_void_p

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
    check_range,
    invalid_argument,
    last_error_message,
    lib,
    stream_value,
    u64_array,
)
from .copy import PreparedCopy, copy_batch
from .digest import digest


class HostStream(Handle):
    """A caller-side stream of the host backend (refit_host_stream_create): a FIFO queue with its own
    worker thread, usable as a caller stream of any host-backend group. Owned by this object;
    close() destroys it after its queued work has run. Any thread may use it."""

    _what = "host stream"

    def __init__(self):
        pointer = c_void_p()
        check(lib.refit_host_stream_create(byref(pointer)))
        super().__init__(pointer.value)

    def _release(self, pointer):
        check(lib.refit_host_stream_destroy(pointer))


class Group(Handle):
    """One rank per device, each with its own stream and thread (refit_group).

    Owns the group: close() (or leaving a `with` block) destroys it, draining its streams. Use it
    from one thread at a time; inside run(), the rank callbacks may call allgather_rank(),
    copy_batch() and the queries concurrently, but nothing else (not run, allgather, scopes or
    close).
    """

    _what = "group"

    def __init__(self, devices, backend=Backend.AUTO, host_devices=0):
        """Creates a group whose rank r is `devices[r]`. `backend` is a Backend; `host_devices` is
        how many devices the host backend simulates (0: the largest listed + 1)."""
        devices = [int(device) for device in devices]
        for device in devices:
            if not -(1 << 31) <= device < (1 << 31):
                raise RefitError(Status.INVALID_DEVICE, f"device {device} is not a 32-bit ordinal")
        options = GroupOptions()
        check(lib.refit_group_options_init(byref(options)))
        options.backend = check_range(backend, 32, "backend")
        options.host_devices = check_range(host_devices, 32, "host_devices")
        array = (c_int32 * len(devices))(*devices)
        pointer = c_void_p()
        check(lib.refit_group_create(array, len(devices), byref(options), byref(pointer)))
        super().__init__(pointer.value)
        self._size = len(devices)

    def _release(self, pointer):
        lib.refit_group_destroy(pointer)

    # --- queries (any thread, including rank callbacks) ---

    @property
    def size(self):
        """The number of ranks."""
        size = c_size_t()
        check(lib.refit_group_size(self.handle, byref(size)))
        return size.value

    def __len__(self):
        return self.size

    def device(self, rank):
        """The device ordinal of `rank`."""
        device = c_int32()
        check(lib.refit_group_device(self.handle, check_range(rank, 32, "rank"), byref(device)))
        return device.value

    @property
    def devices(self):
        """Every rank's device, in rank order."""
        return [self.device(rank) for rank in range(self.size)]

    def stream(self, rank):
        """The group's own stream of `rank` as an int (CUstream, or host-stream handle)."""
        stream = c_void_p()
        check(lib.refit_group_stream(self.handle, check_range(rank, 32, "rank"), byref(stream)))
        return stream.value or 0

    def peer_access(self, rank, peer):
        """Whether `rank` reaches `peer`'s memory directly."""
        direct = c_bool()
        check(
            lib.refit_group_peer_access(
                self.handle, check_range(rank, 32, "rank"), check_range(peer, 32, "peer"), byref(direct)
            )
        )
        return direct.value

    @property
    def backend(self):
        """Backend.CUDA or Backend.HOST (never AUTO)."""
        backend = c_uint32()
        check(lib.refit_group_backend(self.handle, byref(backend)))
        return Backend(backend.value)

    # --- scopes ---

    def enter(self, caller_streams=None):
        """Opens a scope (refit_group_enter): each rank's stream waits for the work queued so far
        on `caller_streams[rank]` (None: every device's legacy default stream)."""
        if caller_streams is None:
            check(lib.refit_group_enter(self.handle, None))
            return
        streams = [stream_value(stream) for stream in caller_streams]
        self._check_per_rank(streams, "caller_streams")
        check(lib.refit_group_enter(self.handle, (c_void_p * len(streams))(*streams)))

    def exit(self, mode=ExitMode.SYNC):
        """Closes the open scope (refit_group_exit); ExitMode.SYNC blocks until the group's work is
        done, ExitMode.ASYNC makes the caller streams wait for it instead. The scope is closed even
        when this raises."""
        check(lib.refit_group_exit(self.handle, check_range(mode, 32, "mode")))

    @contextlib.contextmanager
    def scope(self, caller_streams=None, mode=ExitMode.SYNC):
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

    def run(self, fn):
        """Calls `fn(rank, stream)` for every rank at once, each on the group's thread for that rank
        with its device current; returns when all have returned (refit_group_run).

        An exception raised by `fn` fails that rank (other ranks waiting in allgather_rank are
        released with RefitError(ABORTED)); once every rank has returned, the first exception
        raised is re-raised here. The group stays usable.
        """
        raised = []
        lock = threading.Lock()

        def body(rank, stream, _user_data):
            try:
                fn(rank, stream or 0)
                return 0
            except BaseException as error:  # nothing may unwind into the library
                with lock:
                    raised.append(error)
                # The library's message names this code: a refit status if that is what failed.
                return int(error.status) if isinstance(error, RefitError) else int(Status.CALLBACK_FAILED)

        callback = RankCallback(body)  # alive until refit_group_run returns
        status = lib.refit_group_run(self.handle, callback, None)
        if status == Status.SUCCESS:
            return
        message = RefitError(status, last_error_message())
        if raised:
            raise raised[0] from message
        raise message

    def allgather(self, send_ptrs, recv_ptrs, counts, algorithm=Algorithm.AUTO):
        """Gathers every rank's block into every rank's receive buffer in rank order
        (refit_allgather): rank r sends `counts[r]` bytes at `send_ptrs[r]`; `recv_ptrs[r]` holds
        sum(counts) bytes. Pointers are ints (host addresses on the host backend). Queued in the
        open scope, else complete on return. Returns the Algorithm that ran."""
        send = u64_array(send_ptrs, "send_ptrs")
        recv = u64_array(recv_ptrs, "recv_ptrs")
        sizes = self._counts(counts)
        for array, what in ((send, "send_ptrs"), (recv, "recv_ptrs")):
            self._check_per_rank(array, what)
        picked = c_uint32()
        check(
            lib.refit_allgather(
                self.handle, send, recv, sizes, check_range(algorithm, 32, "algorithm"), byref(picked)
            )
        )
        return Algorithm(picked.value)

    def allgather_rank(self, rank, send_ptr, recv_ptr, counts, algorithm=Algorithm.AUTO):
        """The per-rank allgather, only from a run() callback: every rank calls it with its own
        rank, buffers, and the same counts and algorithm (refit_group_allgather_rank). Returns the
        Algorithm that ran. Ranks that disagree all raise RefitError(INVALID_ARGUMENT) and copy
        nothing; the next call works."""
        sizes = self._counts(counts)
        picked = c_uint32()
        check(
            lib.refit_group_allgather_rank(
                self.handle,
                check_range(rank, 32, "rank"),
                check_range(send_ptr, 64, "send_ptr"),
                check_range(recv_ptr, 64, "recv_ptr"),
                sizes,
                check_range(algorithm, 32, "algorithm"),
                byref(picked),
            )
        )
        return Algorithm(picked.value)

    # --- batched copies ---

    def copy_batch(self, rank, segments, stream=None, checked=False):
        """Copies `segments` (Segments, e.g. a plan Route's, or (src, dst, len) tuples) on `stream`,
        a stream of `rank`'s device (None: its legacy default stream), in one kernel launch
        (refit_copy_batch). Addresses are on that device or a peer it reaches directly. `checked`
        refuses destinations written twice (RefitError OVERLAP, nothing copied). CUDA: queued on
        the stream, returns without waiting; host backend: complete on return. Any thread, also
        rank callbacks."""
        copy_batch(self, rank, segments, stream, checked)

    def prepare_copy(self, rank, segments, checked=False):
        """A PreparedCopy of `segments` for `rank`'s device, to launch() many times. The caller owns
        it (close it, or use `with`); it does not keep the group alive."""
        return PreparedCopy(self, rank, segments, checked)

    # --- digests ---

    def digest(self, rank, addr, length, stream=None):
        """The refit digest (an int, 64 bits) of the `length` bytes at `addr` on `rank`'s device,
        computed on `stream` (None: the device's legacy default stream) after the work queued there;
        waits for it (refit_digest: the header defines the digest and what it detects). The value to
        pass as refit_table_add_offer's digest. Any thread."""
        return digest(self, rank, addr, length, stream)

    def _counts(self, counts):
        counts = [check_range(count, 8 * ctypes.sizeof(c_size_t), "counts[i]") for count in counts]
        self._check_per_rank(counts, "counts")
        return (c_size_t * len(counts))(*counts)

    def _check_per_rank(self, values, what):
        # The C API reads exactly size() entries: a shorter list would be read past its end.
        if len(values) != self._size:
            raise invalid_argument(f"{what} has {len(values)} entries; the group has {self._size} ranks")

    def __repr__(self):
        if self.closed:
            return "<refit.Group closed>"
        return f"<refit.Group {self.backend.name} devices={self.devices}>"
