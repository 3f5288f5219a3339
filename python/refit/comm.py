"""Communicators between processes (refit_comm): one rank per (process, device), created from an id
that one process makes (unique_id) and the caller hands to the others by its own means (an id forms
one communicator, and every join checks its secret); allgather over them; plans built across
processes.

On the CUDA backend the communicator is NCCL; on the host backend it is a test-only simulation of
NCCL between the processes of one machine (Unix sockets, host memory), for machines without GPUs.
Every call waits for peers at most the communicator's timeout: past it, or when a peer exits or
aborts, calls raise RefitError with Status.TIMEOUT or Status.ABORTED, and keep doing so.
"""

import ctypes
from ctypes import byref, c_int32, c_size_t, c_uint32, c_void_p

from ._args import boolean, byte_string, check_range, choice, device_ordinal, integers, same_length, stream_value
from ._handle import Handle, borrow
from ._lib import COMM_ID_BYTES, Backend, CommId, CommOptions, PlanOptions, Policy, check, invalid_argument, lib
from .plan import Plan


def unique_id(backend=Backend.AUTO):
    """A new communicator id, as bytes (refit_comm_get_unique_id), good for one communicator: NCCL's
    for Backend.CUDA, a random key (a rendezvous name and a secret) for Backend.HOST; AUTO picks CUDA
    when a GPU is present. This process runs the id's rendezvous root and must live until every rank
    has joined. Pass the same bytes, unchanged, to every rank's Communicator: an id with any byte
    changed is refused."""
    raw = CommId()
    check(lib.refit_comm_get_unique_id(choice(backend, Backend, "backend"), byref(raw)))
    return bytes(raw.internal)


def _options(timeout_ms, staging_bytes, ipc=True, check_counts=True):
    options = CommOptions()
    check(lib.refit_comm_options_init(byref(options)))
    if timeout_ms is not None:
        options.timeout_ms = check_range(timeout_ms, 64, "timeout_ms")
    if staging_bytes is not None:
        options.staging_bytes = check_range(staging_bytes, 64, "staging_bytes")
    options.ipc = boolean(ipc, "ipc")
    options.check_counts = boolean(check_counts, "check_counts")
    return options


class Communicator(Handle):
    """One rank of a communicator between processes. Owns its handle: close() (or leaving a `with`
    block) destroys it, after this rank's queued calls (at most the timeout). Calls are made by one
    thread at a time, in the same order on every rank; abort() may come from any thread."""

    _what = "communicator"

    def __init__(
        self,
        comm_id,
        nranks,
        rank,
        device=0,
        timeout_ms=None,
        staging_bytes=None,
        ipc=True,
        check_counts=True,
        _pointer=None,
    ):
        """Joins communicator `comm_id` (bytes from unique_id) as `rank` of `nranks` on CUDA device
        `device`; blocks until every rank has joined (at most `timeout_ms`, default ten minutes).
        Raises INVALID_ARGUMENT at once for an id with any byte changed, a rank another process holds
        (while the communicator forms or after), and on the host backend an id with another secret or
        a spent one (its communicator formed, also if destroyed since).
        `staging_bytes` bounds the staging of executors across processes; `ipc` False sends every
        pair's bytes through staging instead of CUDA IPC. `check_counts` (CUDA): allgather compares
        the ranks' counts first, with a blocking exchange (see refit_comm_options.check_counts)."""
        if _pointer is None:
            comm_id = byte_string(comm_id, "comm_id")
            if len(comm_id) != COMM_ID_BYTES:
                raise invalid_argument(
                    f"comm_id has {len(comm_id)} bytes; a communicator id from unique_id() has {COMM_ID_BYTES}"
                )
            raw = CommId()
            ctypes.memmove(raw.internal, comm_id, COMM_ID_BYTES)
            device = device_ordinal(device, "device")
            options = _options(timeout_ms, staging_bytes, ipc, check_counts)
            pointer = c_void_p()
            check(
                lib.refit_comm_create(
                    byref(raw),
                    check_range(nranks, 32, "nranks"),
                    check_range(rank, 32, "rank"),
                    device,
                    byref(options),
                    byref(pointer),
                )
            )
            _pointer = pointer.value
        super().__init__(_pointer)

    @classmethod
    def adopt(cls, nccl_comm, timeout_ms=None, staging_bytes=None, check_counts=True):
        """Wraps an ncclComm_t (an int) the caller keeps owning, e.g. a framework's process group's,
        from the same libnccl refit loads. close() does not destroy it; a timeout or abort() revokes
        it (then its owner must destroy it)."""
        options = _options(timeout_ms, staging_bytes, check_counts=check_counts)
        pointer = c_void_p()
        check(lib.refit_comm_adopt(check_range(nccl_comm, 64, "nccl_comm"), byref(options), byref(pointer)))
        return cls(None, 0, 0, _pointer=pointer.value)

    def _release(self, pointer):
        lib.refit_comm_destroy(pointer)

    def _query(self, function, value):
        with self._borrow() as handle:
            check(function(handle, byref(value)))
        return value.value

    @property
    def rank(self):
        return self._query(lib.refit_comm_rank, c_uint32())

    @property
    def size(self):
        return self._query(lib.refit_comm_size, c_uint32())

    @property
    def device(self):
        return self._query(lib.refit_comm_device, c_int32())

    @property
    def backend(self):
        """Backend.CUDA (NCCL) or Backend.HOST."""
        return Backend(self._query(lib.refit_comm_backend, c_uint32()))

    def abort(self):
        """Ends this rank's part: pending and later calls raise ABORTED here, and the peers' calls
        waiting for this rank fail too. Any thread, any time."""
        with self._borrow() as handle:
            check(lib.refit_comm_abort(handle))

    def allgather(self, send, recv, counts, stream=None):
        """This rank's part of an allgather (refit_comm_allgather): `counts[r]` bytes from every rank
        r, gathered in rank order into `recv` (sum(counts) bytes); in place when `send` is this
        rank's slot of `recv`. `send`/`recv` are device addresses (host addresses on the host
        backend). Queued on `stream`; call synchronize() before reading `recv`. Ranks that pass other
        counts are refused before anything moves, naming the ranks that differ, and the communicator
        stays usable: on the host backend the next synchronize() raises INVALID_ARGUMENT, once; on
        CUDA (check_counts, the default) this call raises it on every rank."""
        counts = integers(counts, "counts", 64)
        size = self.size
        same_length(counts, size, "counts", f"the communicator has {size} ranks (one count each)")
        array = (c_size_t * size)(*counts)
        arguments = (check_range(send, 64, "send"), check_range(recv, 64, "recv"), array, stream_value(stream))
        with self._borrow(exclusive=True) as handle:
            check(lib.refit_comm_allgather(handle, *arguments))

    def synchronize(self, stream=None):
        """Waits for the work queued on `stream`, then raises the communicator's failure, if any."""
        stream = stream_value(stream)
        with self._borrow(exclusive=True) as handle:
            check(lib.refit_comm_synchronize(handle, stream))

    def build_plan(self, table, policy=Policy.LOCAL, coalesce=True):
        """One plan from every rank's table (refit_plan_build_across): each rank passes its own
        Table (entries naming its own process only) and the same options; every rank gets its share
        of the same plan, or every rank raises."""
        options = PlanOptions()
        check(lib.refit_plan_options_init(byref(options)))
        options.policy = choice(policy, Policy, "policy")
        options.coalesce = boolean(coalesce, "coalesce")
        pointer = c_void_p()
        with self._borrow(exclusive=True) as handle, borrow(table, "table", "table", exclusive=True) as table_handle:
            check(lib.refit_plan_build_across(handle, table_handle, byref(options), byref(pointer)))
        return Plan(pointer.value)


__all__ = ["Communicator", "unique_id"]
