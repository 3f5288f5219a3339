"""Batched copies of segments on one rank's device: one-shot (Group.copy_batch) or prepared once and
launched many times (PreparedCopy)."""

from ctypes import byref, c_void_p

from ._handle import Handle
from ._lib import CopyFlag, check, check_range, lib, stream_value
from .segment import segment_array


def _flags(checked):
    return int(CopyFlag.CHECKED) if checked else 0


def copy_batch(group, rank, segments, stream=None, checked=False):
    """refit_copy_batch: see Group.copy_batch."""
    array, n = segment_array(segments)
    check(
        lib.refit_copy_batch(
            group.handle, check_range(rank, 32, "rank"), stream_value(stream), array, n, _flags(checked)
        )
    )


class PreparedCopy(Handle):
    """A batch of segments prepared for one rank's device (refit_prepared_copy): checked and laid
    out once, launched any number of times with no host work proportional to its size.

    Owns the prepared batch; close() frees it, which must happen only when no launch can still run
    and before the memory its segments name is freed. launch() may be called from several threads
    at once; close() must not race with a launch.
    """

    _what = "prepared copy"

    def __init__(self, group, rank, segments, checked=False):
        """Prepares `segments` for `rank` of `group` (blocking; see Group.prepare_copy)."""
        array, n = segment_array(segments)
        pointer = c_void_p()
        check(
            lib.refit_copy_batch_prepare(
                group.handle, check_range(rank, 32, "rank"), array, n, _flags(checked), byref(pointer)
            )
        )
        super().__init__(pointer.value)

    def _release(self, pointer):
        lib.refit_copy_batch_destroy(pointer)

    def launch(self, stream=None):
        """Queues the batch on `stream`, a stream of the batch's device (None: its legacy default
        stream); the sources are read at each launch. Host backend: complete on return."""
        check(lib.refit_copy_batch_launch(self.handle, stream_value(stream)))
