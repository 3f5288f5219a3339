"""ctypes binding for librefit (see include/refit.h for the C API it wraps).

Installed with `pip install ./python` (distribution refit-gpu), the library sits inside this package.
It is otherwise found at $REFIT_LIBRARY, or in the repository's target/release or target/debug.
Every failing call raises RefitError carrying the status and the library's message; an argument the
binding refuses before calling the library raises ArgumentTypeError (also a TypeError: a float or bool
for an integer, a string for a flag) or ArgumentError (also a ValueError: out of range, wrong length),
both RefitErrors naming the argument, the value and what is accepted. Pointers are
ints: device addresses, or host addresses on the host backend (ctypes.addressof of a ctypes
buffer). Streams are ints, torch or CuPy streams, objects with __cuda_stream__, or HostStreams;
None is torch's current stream once torch uses CUDA. Handle objects own their handle and release it
exactly once: close(), the end of a `with` block, or garbage collection as a fallback; never while a
call on another thread uses it (close() then raises INVALID_STATE, as does a call the library takes
from one thread at a time while another thread's is in progress). They cannot be copied or pickled.

refit.tensor turns tensors (torch's or look-alikes) into offers and needs; refit.torch (importable
only where torch is) adds torch stream helpers; refit.integrations maps Megatron and vLLM
parameters onto tables.
"""

from ._lib import (
    ABI_VERSION,
    COMM_ID_BYTES,
    MAX_DIMS,
    PLAN_SIZE_BUCKETS,
    Algorithm,
    ArgumentError,
    ArgumentTypeError,
    Arithmetic,
    Arm,
    Backend,
    Commit,
    CopyFlag,
    ExitMode,
    Fp8,
    Granularity,
    Policy,
    RefitError,
    RouteKind,
    SourceType,
    Status,
    abi_version,
    last_error_message,
    lib,
    set_log_callback,
    version,
)
from .comm import Communicator, unique_id
from .copy import PreparedCopy
from .digest import digest, digest_many
from .executor import Executor, RunStats
from .group import Group, HostStream
from .plan import Plan, PlanStats, QuantPath, QuantRoute, Route, Table
from .quant import Quantization, QuantizeJob, quantize_batch, tensor_job
from .segment import Segment

__all__ = [
    "ABI_VERSION",
    "COMM_ID_BYTES",
    "Communicator",
    "MAX_DIMS",
    "PLAN_SIZE_BUCKETS",
    "Algorithm",
    "ArgumentError",
    "ArgumentTypeError",
    "Arithmetic",
    "Arm",
    "Backend",
    "Commit",
    "CopyFlag",
    "Executor",
    "ExitMode",
    "Fp8",
    "Granularity",
    "Group",
    "HostStream",
    "Plan",
    "PlanStats",
    "PreparedCopy",
    "Policy",
    "QuantPath",
    "QuantRoute",
    "Quantization",
    "QuantizeJob",
    "RefitError",
    "Route",
    "RouteKind",
    "RunStats",
    "Segment",
    "SourceType",
    "Status",
    "Table",
    "abi_version",
    "digest",
    "digest_many",
    "last_error_message",
    "quantize_batch",
    "lib",
    "set_log_callback",
    "tensor_job",
    "unique_id",
    "version",
]
