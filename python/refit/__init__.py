"""ctypes binding for librefit (see include/refit.h for the C API it wraps).

The library is found at $REFIT_LIBRARY, else next to this package, else in the repository's
target/release or target/debug. Every failing call raises RefitError carrying the status and the
library's message. Pointers are ints: device addresses, or host addresses on the host backend
(ctypes.addressof of a ctypes buffer). Handle objects own their handle and release it exactly once:
close(), the end of a `with` block, or garbage collection as a fallback.

refit.torch (importable only where torch is) adds tensor pointer and stream helpers.
"""

from ._lib import (
    ABI_VERSION,
    COMM_ID_BYTES,
    MAX_DIMS,
    PLAN_SIZE_BUCKETS,
    Algorithm,
    Backend,
    CopyFlag,
    ExitMode,
    Policy,
    RefitError,
    RouteKind,
    Status,
    abi_version,
    last_error_message,
    lib,
    set_log_callback,
    version,
)
from .comm import Communicator, unique_id
from .copy import PreparedCopy
from .group import Group, HostStream
from .plan import Plan, PlanStats, Route, Table
from .segment import Segment

__all__ = [
    "ABI_VERSION",
    "COMM_ID_BYTES",
    "Communicator",
    "MAX_DIMS",
    "PLAN_SIZE_BUCKETS",
    "Algorithm",
    "Backend",
    "CopyFlag",
    "ExitMode",
    "Group",
    "HostStream",
    "Plan",
    "PlanStats",
    "PreparedCopy",
    "Policy",
    "RefitError",
    "Route",
    "RouteKind",
    "Segment",
    "Status",
    "Table",
    "abi_version",
    "last_error_message",
    "lib",
    "set_log_callback",
    "unique_id",
    "version",
]
