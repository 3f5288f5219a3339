"""refit_segment as a Python value, and arrays of them for the C API."""

from __future__ import annotations

import collections.abc
import ctypes
import dataclasses
from typing import Iterable, Iterator, Tuple, Union

from ._args import check_range, items, wrong_type
from ._lib import SegmentStruct


@dataclasses.dataclass(frozen=True)
class Segment:
    """A strided box of bytes (refit_segment): `len` contiguous bytes, repeated count[0] times with
    strides src_stride[0]/dst_stride[0], that pattern repeated count[1] times with the [1] strides.
    Segment(src, dst, len) is a plain contiguous copy."""

    src: int
    dst: int
    len: int
    count: Tuple[int, int] = (1, 1)
    src_stride: Tuple[int, int] = (0, 0)
    dst_stride: Tuple[int, int] = (0, 0)

    @property
    def bytes(self) -> int:
        """Payload bytes."""
        return self.len * self.count[0] * self.count[1]

    def runs(self) -> Iterator[Tuple[int, int, int]]:
        """Every contiguous run as (src, dst, len), inner level fastest (Segment::for_each_run)."""
        if self.len == 0:
            return
        for j in range(self.count[1]):
            for i in range(self.count[0]):
                yield (
                    self.src + j * self.src_stride[1] + i * self.src_stride[0],
                    self.dst + j * self.dst_stride[1] + i * self.dst_stride[0],
                    self.len,
                )

    @classmethod
    def from_struct(cls, raw: SegmentStruct) -> Segment:
        return cls(raw.src, raw.dst, raw.len, tuple(raw.count), tuple(raw.src_stride), tuple(raw.dst_stride))


SegmentLike = Union[Segment, Tuple[int, int, int]]


def _pair(values: object, what: str) -> list[int]:
    if not isinstance(values, collections.abc.Sequence) or isinstance(values, (str, bytes)) or len(values) != 2:
        raise wrong_type(what, values, "a pair of integers (one per level)")
    return [check_range(value, 64, f"{what}[{level}]") for level, value in enumerate(values)]


def _segment(value: object, index: int) -> Segment:
    if isinstance(value, Segment):
        return value
    try:
        return Segment(*value)  # type: ignore[misc]
    except TypeError:
        raise wrong_type(f"segments[{index}]", value, "a Segment or a (src, dst, len) tuple") from None


def segment_array(segments: Iterable[SegmentLike]) -> tuple[ctypes.Array[SegmentStruct], int]:
    """A ctypes array of refit_segment from Segments (or (src, dst, len) tuples), every field
    range-checked; and its length."""
    values = [_segment(segment, index) for index, segment in enumerate(items(segments, "segments"))]
    array = (SegmentStruct * len(values))()
    for index, (raw, segment) in enumerate(zip(array, values)):
        what = f"segments[{index}]"
        raw.src = check_range(segment.src, 64, f"{what}.src")
        raw.dst = check_range(segment.dst, 64, f"{what}.dst")
        raw.len = check_range(segment.len, 64, f"{what}.len")
        raw.count[:] = _pair(segment.count, f"{what}.count")
        raw.src_stride[:] = _pair(segment.src_stride, f"{what}.src_stride")
        raw.dst_stride[:] = _pair(segment.dst_stride, f"{what}.dst_stride")
    return array, len(values)
