"""Batched copies of segments on one rank's device: one-shot (Group.copy_batch) or prepared once and
launched many times (PreparedCopy)."""

from __future__ import annotations

from ctypes import byref, c_void_p
from typing import TYPE_CHECKING, Iterable

from ._args import boolean
from ._handle import Handle, borrow
from ._lib import Backend, CopyFlag, check, check_range, lib, stream_value
from .segment import SegmentLike, segment_array

if TYPE_CHECKING:
    from .group import Group


def _flags(checked: bool) -> int:
    return int(CopyFlag.CHECKED) if boolean(checked, "checked") else 0


def copy_batch(
    group: Group, rank: int, segments: Iterable[SegmentLike], stream: object = None, checked: bool = False
) -> None:
    """refit_copy_batch: see Group.copy_batch."""
    with borrow(group, "group", "group") as handle:
        array, n = segment_array(segments)
        rank = check_range(rank, 32, "rank")
        stream_handle = stream_value(stream, group.device(rank), host=group.backend == Backend.HOST)
        check(lib.refit_copy_batch(handle, rank, stream_handle, array, n, _flags(checked)))


class PreparedCopy(Handle):
    """A batch of segments prepared for one rank's device (refit_prepared_copy): checked and laid
    out once, launched any number of times with no host work proportional to its size. The check
    includes the memory: every byte must be memory of the rank's device (or of a peer it accesses
    directly) when prepared, else RefitError INVALID_ARGUMENT names the segment, side and address.

    Owns the prepared batch; close() frees it, which must happen only when no launch can still run
    and before the memory its segments name is freed. launch() may be called from several threads
    at once; close() must not race with a launch.
    """

    _what = "prepared copy"

    def __init__(self, group: Group, rank: int, segments: Iterable[SegmentLike], checked: bool = False) -> None:
        """Prepares `segments` for `rank` of `group` (blocking; see Group.prepare_copy)."""
        array, n = segment_array(segments)
        rank = check_range(rank, 32, "rank")
        pointer = c_void_p()
        with borrow(group, "group", "group") as handle:
            check(lib.refit_copy_batch_prepare(handle, rank, array, n, _flags(checked), byref(pointer)))
            super().__init__(pointer.value)
            self._device = group.device(rank)
            self._host = group.backend == Backend.HOST

    def _release(self, pointer: int) -> None:
        lib.refit_copy_batch_destroy(pointer)

    def launch(self, stream: object = None) -> None:
        """Queues the batch on `stream`, a stream of the batch's device (any form refit takes; None:
        torch's current stream of that device when torch uses CUDA, else its legacy default stream);
        the sources are read at each launch. Host backend: complete on return."""
        stream = stream_value(stream, self._device, host=self._host)
        with self._borrow() as handle:
            check(lib.refit_copy_batch_launch(handle, stream))
