"""The refit digest of device memory: of one range (refit_digest, Group.digest) or of many in one pass
(refit_digest_many, Group.digest_many)."""

from __future__ import annotations

import collections.abc
from ctypes import byref, c_uint64
from typing import TYPE_CHECKING, Any, Sequence, Tuple

from ._args import check_range, items, stream_value, wrong_type
from ._handle import borrow
from ._lib import Backend, check, lib

if TYPE_CHECKING:
    from .group import Group


def _stream(group: Group, rank: int, stream: object) -> int:
    """`stream` for `rank`'s device (None: torch's current stream of that device when torch uses
    CUDA and the group is a CUDA group, else its legacy default stream)."""
    return stream_value(stream, group.device(rank), host=group.backend == Backend.HOST)


def digest(group: Group, rank: int, addr: int, length: int, stream: object = None) -> int:
    """refit_digest: see Group.digest."""
    value = c_uint64()
    arguments = (
        check_range(rank, 32, "rank"),
        check_range(addr, 64, "addr"),
        check_range(length, 64, "length"),
    )
    with borrow(group, "group", "group") as handle:
        check(lib.refit_digest(handle, *arguments, _stream(group, arguments[0], stream), byref(value)))
    return value.value


def _pair(value: Any, index: int) -> Tuple[int, int]:
    what = f"ranges[{index}]"
    if not isinstance(value, collections.abc.Sequence) or isinstance(value, (str, bytes)) or len(value) != 2:
        raise wrong_type(what, value, "an (addr, length) pair of integers")
    return check_range(value[0], 64, f"{what} addr"), check_range(value[1], 64, f"{what} length")


def digest_many(group: Group, rank: int, ranges: Sequence[Tuple[int, int]], stream: object = None) -> list[int]:
    """refit_digest_many: see Group.digest_many."""
    rank = check_range(rank, 32, "rank")
    pairs = [_pair(value, index) for index, value in enumerate(items(ranges, "ranges"))]
    count = len(pairs)
    addrs = (c_uint64 * count)(*(addr for addr, _ in pairs))
    lens = (c_uint64 * count)(*(length for _, length in pairs))
    values = (c_uint64 * count)()
    with borrow(group, "group", "group") as handle:
        check(lib.refit_digest_many(handle, rank, addrs, lens, count, _stream(group, rank, stream), values))
    return list(values)
