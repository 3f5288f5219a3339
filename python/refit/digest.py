"""The refit digest of device memory (refit_digest): see Group.digest."""

from ctypes import byref, c_uint64

from ._handle import borrow
from ._lib import check, check_range, lib, stream_value


def digest(group, rank, addr, length, stream=None):
    """refit_digest: see Group.digest."""
    value = c_uint64()
    arguments = (
        check_range(rank, 32, "rank"),
        check_range(addr, 64, "addr"),
        check_range(length, 64, "length"),
        stream_value(stream),
    )
    with borrow(group, "group", "group") as handle:
        check(lib.refit_digest(handle, *arguments, byref(value)))
    return value.value
