"""The ctypes layer: loads librefit, mirrors include/refit.h (constants, structs, callback types,
every function's argtypes/restype) and turns statuses into exceptions.

Nothing here owns a handle; the wrappers in group.py and plan.py do. python/tests/test_header.py
parses the header and fails when a declaration here differs from it or is missing.
"""

from __future__ import annotations

import atexit
import ctypes
import enum
import os
import sys
import traceback
from ctypes import POINTER, c_bool, c_char_p, c_int32, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p
from pathlib import Path
from typing import Any, Callable, Iterator, Optional


_FIX = (
    "Install the package with `pip install ./python` from a clone of the refit repository (it builds "
    "librefit.so into the package), or build it there with `cargo build --release` and run with "
    "PYTHONPATH=<clone>/python, or set REFIT_LIBRARY to the path of a librefit.so."
)


def _candidates() -> Iterator[Path]:
    """Where librefit.so may be, in order: $REFIT_LIBRARY alone when set; else inside this package
    (an installed wheel), then the repository's target/release and target/debug (a clone)."""
    explicit = os.environ.get("REFIT_LIBRARY")
    if explicit:
        yield Path(explicit)
        return
    here = Path(__file__).resolve().parent
    yield here / "librefit.so"
    root = here.parent.parent
    for profile in ("release", "debug"):
        yield root / "target" / profile / "librefit.so"


def _load() -> ctypes.CDLL:
    tried = []
    for path in _candidates():
        if path.exists():
            try:
                return ctypes.CDLL(str(path))
            except OSError as error:  # present but not loadable: say which file and why
                raise OSError(f"refit: {path} exists but cannot be loaded ({error}). {_FIX}") from None
        tried.append(str(path))
    where = "REFIT_LIBRARY" if os.environ.get("REFIT_LIBRARY") else "the package and the repository"
    raise OSError(f"refit: librefit.so not found in {where}; looked at {', '.join(tried)}. {_FIX}")


lib = _load()


# --- statuses and errors ------------------------------------------------------------------------


class Status(enum.IntEnum):
    """refit_status. python/tests/test_header.py checks these against the header and the library."""

    SUCCESS = 0
    INVALID_ARGUMENT = 1
    NULL_ARGUMENT = 2
    INTERNAL_ERROR = 3
    CUDA_UNAVAILABLE = 4
    NCCL_UNAVAILABLE = 5
    NVRTC_UNAVAILABLE = 6
    CUDA_ERROR = 7
    NCCL_ERROR = 8
    INVALID_DEVICE = 9
    DUPLICATE_DEVICE = 10
    EMPTY_DEVICE_LIST = 11
    INVALID_STATE = 12
    CALLBACK_FAILED = 13
    ABORTED = 14
    TENSOR_MISMATCH = 15
    REPLICA_MISMATCH = 16
    COVERAGE_GAP = 17
    OVERLAP = 18
    DECODE_ERROR = 19
    VERSION_MISMATCH = 20
    OUT_OF_MEMORY = 21
    KERNEL_LOAD_FAILED = 22
    UNSUPPORTED = 23
    BUFFER_TOO_SMALL = 24
    NOT_FOUND = 25
    VERIFY_MISMATCH = 26
    PLAN_STALE = 27
    TIMEOUT = 28


class RefitError(Exception):
    """A call returned a status other than SUCCESS, or the binding refused an argument the library
    would have refused the same way (the status says which). `status` is a Status, or the plain int
    of a status newer than this binding."""

    def __init__(self, status: int, message: str) -> None:
        self.status: Status | int
        try:
            self.status = Status(status)
            name = self.status.name
        except ValueError:
            self.status = int(status)
            name = lib.refit_status_string(self.status).decode()
        self.message = message
        super().__init__(f"{name}: {message}")


def last_error_message() -> str:
    """The message of the last failing call on this thread ("" if none has failed)."""
    return str(lib.refit_last_error_message().decode(errors="replace"))


def check(status: int) -> None:
    """Raises RefitError (with this thread's last error message) unless `status` is SUCCESS."""
    if status != Status.SUCCESS:
        raise RefitError(status, last_error_message())


class ArgumentError(RefitError, ValueError):
    """An argument the binding refused before calling the library (the status says how the library
    would have refused it: INVALID_ARGUMENT, or INVALID_DEVICE): a value of the right type that is
    out of range, of the wrong length, or not one of the accepted values. Also a ValueError."""

    def __init__(self, message: str, status: int = Status.INVALID_ARGUMENT) -> None:
        super().__init__(status, message)


class ArgumentTypeError(RefitError, TypeError):
    """An argument of a type the binding does not take (a float or a bool for an integer, a string
    for a flag, a non-sequence for a sequence); status INVALID_ARGUMENT. Also a TypeError."""

    def __init__(self, message: str) -> None:
        super().__init__(Status.INVALID_ARGUMENT, message)


def invalid_argument(message: str) -> ArgumentError:
    """The error the binding raises for an argument it cannot pass on safely (wrong length, range);
    the checks themselves are in _args."""
    return ArgumentError(message)


# --- constants (the header's #defines, grouped) ---------------------------------------------------


class CopyFlag(enum.IntFlag):
    """REFIT_COPY_*: flags of refit_copy_batch*."""

    CHECKED = 1


class Backend(enum.IntEnum):
    """REFIT_BACKEND_*."""

    AUTO = 0
    CUDA = 1
    HOST = 2


class Algorithm(enum.IntEnum):
    """REFIT_ALLGATHER_*."""

    AUTO = 0
    NCCL = 1
    PEER = 2
    HOST = 3


class ExitMode(enum.IntEnum):
    """REFIT_EXIT_*: how refit_group_exit closes a scope."""

    SYNC = 0
    ASYNC = 1


class Policy(enum.IntEnum):
    """REFIT_POLICY_*: which replica serves each replica set."""

    FIRST = 0
    LOCAL = 1
    BALANCED = 2


class RouteKind(enum.IntEnum):
    """REFIT_ROUTE_*."""

    LOCAL = 0
    PEER = 1
    REMOTE = 2


class Arm(enum.IntEnum):
    """REFIT_ARM_*: how an executor moves bytes (NONE and SPLIT appear in run stats only)."""

    AUTO = 0
    KERNEL = 1
    COPY_ENGINE = 2
    NONE = 3
    SPLIT = 4


class Commit(enum.IntEnum):
    """REFIT_COMMIT_*: how an executor's bytes reach the live buffers."""

    DIRECT = 0
    STAGED = 1


MAX_DIMS = 8
PLAN_SIZE_BUCKETS = 64
ABI_VERSION = 1
COMM_ID_BYTES = 136


# --- structs --------------------------------------------------------------------------------------


class CommOptions(ctypes.Structure):
    """refit_comm_options."""

    _fields_ = [
        ("size", c_size_t),
        ("timeout_ms", c_uint64),
        ("staging_bytes", c_uint64),
        ("ipc", c_bool),
        ("check_counts", c_bool),
    ]


class CommId(ctypes.Structure):
    """refit_comm_id: the bytes every rank of one communicator is created from."""

    _fields_ = [("internal", c_uint8 * COMM_ID_BYTES)]


class GroupOptions(ctypes.Structure):
    """refit_group_options."""

    _fields_ = [("size", c_size_t), ("backend", c_uint32), ("host_devices", c_uint32)]


class PlanOptions(ctypes.Structure):
    """refit_plan_options."""

    _fields_ = [("size", c_size_t), ("policy", c_uint32), ("coalesce", c_uint8)]


class PlanStatsStruct(ctypes.Structure):
    """refit_plan_stats."""

    _fields_ = [("size", c_size_t)] + [  # type: ignore[assignment]
        (name, c_uint64)
        for name in (
            "offers_in",
            "offers_kept",
            "replica_sets",
            "needs",
            "needed_bytes",
            "ranges_all_replicas",
            "bytes_all_replicas",
            "duplicate_bytes_dropped",
            "ranges_deduped",
            "segments_deduped",
            "ranges_coalesced",
            "flat_runs_coalesced",
            "bytes_local",
            "bytes_peer",
            "bytes_remote",
            "routes",
        )
    ] + [("size_histogram", c_uint64 * PLAN_SIZE_BUCKETS), ("build_ns", c_uint64)] + [
        (name, c_uint64)
        for name in (
            "quantized_needs",
            "quantized_elements",
            "quantized_direct_bytes",
            "quantized_staged_bytes",
            "quantized_sent_bytes",
        )
    ]


class SegmentStruct(ctypes.Structure):
    """refit_segment."""

    _fields_ = [
        ("src", c_uint64),
        ("dst", c_uint64),
        ("len", c_uint64),
        ("count", c_uint64 * 2),
        ("src_stride", c_uint64 * 2),
        ("dst_stride", c_uint64 * 2),
    ]


class Fp8(enum.IntEnum):
    """REFIT_FP8_*: the target of a quantization."""

    E4M3FN = 1
    E5M2 = 2


class Granularity(enum.IntEnum):
    """REFIT_QUANT_*: which elements share a scale."""

    NONE = 0
    TENSOR = 1
    ROW = 2
    BLOCK = 3
    MXFP8 = 4


class Arithmetic(enum.IntEnum):
    """REFIT_ARITHMETIC_*: how fp32 scales and quotients are computed (the header's
    refit_quantize_batch gives each exactly)."""

    DIVIDE = 0  # max(amax, 1e-10) / MAX, x / s: vLLM's per-token-group CUDA quantizer
    DEEPGEMM = 1  # max(amax, 1e-4) / MAX, x * (1 / s): per_block_cast_to_fp8, vLLM's online blocks
    VLLM_CHANNEL = 2  # max(amax, 2^-9) / MAX, x / s: vLLM's online per-channel weights
    DEEPGEMM_UE8M0 = 3  # DEEPGEMM with scales rounded up to powers of two (UE8M0, Blackwell)
    VLLM_TENSOR = 4  # amax / MAX (no floor), x * (1 / s), NaN to +MAX: vLLM's online per-tensor weights


class SourceType(enum.IntEnum):
    """REFIT_SOURCE_*: the element type of a quantization's source."""

    BF16 = 1
    F16 = 2
    F32 = 3


class QuantizationStruct(ctypes.Structure):
    """refit_quantization."""

    _fields_ = [
        ("target", c_uint32),
        ("granularity", c_uint32),
        ("block_rows", c_uint32),
        ("block_cols", c_uint32),
    ]


class QuantizeJobStruct(ctypes.Structure):
    """refit_quantize_job."""

    _fields_ = [
        ("quantization", QuantizationStruct),
        ("source_type", c_uint32),
        ("arithmetic", c_uint32),
        ("src", c_uint64),
        ("rows", c_uint64),
        ("cols", c_uint64),
        ("src_row_stride", c_uint64),
        ("dst", c_uint64),
        ("dst_row_stride", c_uint64),
        ("scales", c_uint64),
        ("scale_row_stride", c_uint64),
    ]


class NeedQuantizationStruct(ctypes.Structure):
    """refit_need_quantization."""

    _fields_ = [
        ("quantization", QuantizationStruct),
        ("source_type", c_uint32),
        ("arithmetic", c_uint32),
        ("scales", c_uint64),
        ("scale_row_stride", c_uint64),
        ("scale_matrix_stride", c_uint64),
        ("staging", c_uint64),
    ]


class QuantRouteInfo(ctypes.Structure):
    """refit_quant_route_info."""

    _fields_ = [
        ("size", c_size_t),
        ("tensor", ctypes.c_char_p),
        ("receiver_rank", c_uint32),
        ("receiver_device", c_uint32),
        ("runner_rank", c_uint32),
        ("runner_device", c_uint32),
        ("path", c_uint32),
        ("amax_exchanged", c_uint32),
        ("need", c_uint64),
        ("jobs", c_uint64),
        ("elements", c_uint64),
        ("source_bytes", c_uint64),
    ]


class RouteInfo(ctypes.Structure):
    """refit_route_info."""

    _fields_ = [
        ("size", c_size_t),
        ("src_rank", c_uint32),
        ("src_device", c_uint32),
        ("dst_rank", c_uint32),
        ("dst_device", c_uint32),
        ("kind", c_uint32),
        ("segment_count", c_size_t),
        ("segments", POINTER(SegmentStruct)),
    ]


class ExecutorOptions(ctypes.Structure):
    """refit_executor_options."""

    _fields_ = [
        ("size", c_size_t),
        ("arm", c_uint32),
        ("sm_budget", c_uint32),
        ("verify", c_bool),
        ("commit", c_uint32),
        ("staging_limit", c_uint64),
        ("single_slice", c_bool),
    ]


class ExecutorInfoStruct(ctypes.Structure):
    """refit_executor_info."""

    _fields_ = [
        ("size", c_size_t),
        ("slices", c_uint32),
        ("staging_bytes", c_uint64),
        ("address_check_ns", c_uint64),
        ("quantization_bytes", c_uint64),
        ("landing_bytes", c_uint64),
    ]


class RunStatsStruct(ctypes.Structure):
    """refit_run_stats."""

    _fields_ = [
        ("size", c_size_t),
        ("descriptors_reused", c_bool),
        ("device_timed", c_bool),
        ("verified", c_bool),
        ("slices", c_uint32),
        ("arm", c_uint32 * 3),
        ("bytes", c_uint64 * 3),
        ("segments", c_uint64 * 3),
    ] + [
        (name, c_uint64)
        for name in (
            "installed_bytes",
            "verified_bytes",
            "wall_ns",
            "prepare_ns",
            "enqueue_ns",
            "wait_ns",
            "local_ns",
            "peer_ns",
            "verify_ns",
            "commit_ns",
            "device_ns",
            "remote_received_bytes",
            "remote_ipc_bytes",
            "remote_wire_bytes",
        )
    ] + [("remote_ipc_peers", c_uint32), ("remote_staged_peers", c_uint32), ("quantized_elements", c_uint64)]


# refit_rank_callback and refit_log_callback.
RankCallback = ctypes.CFUNCTYPE(c_int32, c_uint32, c_void_p, c_void_p)
LogCallback = ctypes.CFUNCTYPE(None, c_uint32, c_char_p, c_void_p)


# --- functions ------------------------------------------------------------------------------------

status_t = c_int32  # refit_status as a return type: compared with Status by check()
_handle = c_void_p  # refit_group*, refit_table*, refit_plan*, refit_comm*, refit_executor*, ...: opaque
_u64p = POINTER(c_uint64)
_u32p = POINTER(c_uint32)

# name -> (restype, argtypes), in header order.
FUNCTIONS = {
    "refit_allgather": (status_t, [_handle, _u64p, _u64p, POINTER(c_size_t), c_uint32, _u32p]),
    "refit_group_allgather_rank": (
        status_t,
        [_handle, c_uint32, c_uint64, c_uint64, POINTER(c_size_t), c_uint32, _u32p],
    ),
    "refit_comm_options_init": (status_t, [POINTER(CommOptions)]),
    "refit_comm_get_unique_id": (status_t, [c_uint32, POINTER(CommId)]),
    "refit_comm_create": (
        status_t,
        [POINTER(CommId), c_uint32, c_uint32, c_int32, POINTER(CommOptions), POINTER(_handle)],
    ),
    "refit_comm_adopt": (status_t, [c_void_p, POINTER(CommOptions), POINTER(_handle)]),
    "refit_comm_destroy": (None, [_handle]),
    "refit_comm_abort": (status_t, [_handle]),
    "refit_comm_rank": (status_t, [_handle, _u32p]),
    "refit_comm_size": (status_t, [_handle, _u32p]),
    "refit_comm_device": (status_t, [_handle, POINTER(c_int32)]),
    "refit_comm_backend": (status_t, [_handle, _u32p]),
    "refit_comm_allgather": (status_t, [_handle, c_uint64, c_uint64, POINTER(c_size_t), c_void_p]),
    "refit_comm_synchronize": (status_t, [_handle, c_void_p]),
    "refit_plan_build_across": (
        status_t,
        [_handle, _handle, POINTER(PlanOptions), POINTER(_handle)],
    ),
    "refit_copy_batch": (
        status_t,
        [_handle, c_uint32, c_void_p, POINTER(SegmentStruct), c_size_t, c_uint32],
    ),
    "refit_copy_batch_prepare": (
        status_t,
        [_handle, c_uint32, POINTER(SegmentStruct), c_size_t, c_uint32, POINTER(_handle)],
    ),
    "refit_copy_batch_launch": (status_t, [_handle, c_void_p]),
    "refit_copy_batch_destroy": (None, [_handle]),
    "refit_digest": (status_t, [_handle, c_uint32, c_uint64, c_uint64, c_void_p, _u64p]),
    "refit_digest_many": (status_t, [_handle, c_uint32, _u64p, _u64p, c_size_t, c_void_p, _u64p]),
    "refit_quantize_batch": (
        status_t,
        [_handle, c_uint32, c_void_p, POINTER(QuantizeJobStruct), c_size_t, c_uint32],
    ),
    "refit_executor_options_init": (status_t, [POINTER(ExecutorOptions)]),
    "refit_executor_create": (
        status_t,
        [_handle, _handle, c_uint32, POINTER(ExecutorOptions), POINTER(_handle)],
    ),
    "refit_executor_create_across": (
        status_t,
        [_handle, _handle, _handle, POINTER(ExecutorOptions), POINTER(_handle)],
    ),
    "refit_executor_run": (status_t, [_handle, _handle, POINTER(RunStatsStruct)]),
    "refit_executor_commit": (status_t, [_handle, _handle, POINTER(RunStatsStruct)]),
    "refit_executor_stats": (status_t, [_handle, POINTER(RunStatsStruct)]),
    "refit_executor_get_info": (status_t, [_handle, POINTER(ExecutorInfoStruct)]),
    "refit_executor_rebind": (status_t, [_handle, c_uint32, c_uint64, c_uint64, c_uint64]),
    "refit_executor_destroy": (None, [_handle]),
    "refit_group_options_init": (status_t, [POINTER(GroupOptions)]),
    "refit_group_create": (
        status_t,
        [POINTER(c_int32), c_size_t, POINTER(GroupOptions), POINTER(_handle)],
    ),
    "refit_group_destroy": (None, [_handle]),
    "refit_group_size": (status_t, [_handle, POINTER(c_size_t)]),
    "refit_group_device": (status_t, [_handle, c_uint32, POINTER(c_int32)]),
    "refit_group_rank_of": (status_t, [_handle, c_int32, POINTER(c_uint32)]),
    "refit_group_stream": (status_t, [_handle, c_uint32, POINTER(c_void_p)]),
    "refit_group_peer_access": (status_t, [_handle, c_uint32, c_uint32, POINTER(c_bool)]),
    "refit_group_backend": (status_t, [_handle, _u32p]),
    "refit_group_enter": (status_t, [_handle, POINTER(c_void_p)]),
    "refit_group_exit": (status_t, [_handle, c_uint32]),
    "refit_group_run": (status_t, [_handle, RankCallback, c_void_p]),
    "refit_host_stream_create": (status_t, [POINTER(c_void_p)]),
    "refit_host_stream_destroy": (status_t, [c_void_p]),
    "refit_table_create": (status_t, [POINTER(_handle)]),
    "refit_table_destroy": (None, [_handle]),
    "refit_table_add_tensor": (status_t, [_handle, c_char_p, c_uint32, c_uint32, _u64p, c_size_t, _u32p]),
    "refit_table_add_offer": (
        status_t,
        [_handle, c_uint32, c_uint32, c_uint32, c_uint64, _u64p, _u64p, _u64p, c_size_t, _u64p],
    ),
    "refit_table_add_need": (
        status_t,
        [_handle, c_uint32, c_uint32, c_uint32, c_uint64, _u64p, _u64p, _u32p, _u64p, c_size_t],
    ),
    "refit_table_add_quantized_need": (
        status_t,
        [_handle, c_uint32, c_uint32, c_uint32, c_uint64, _u64p, _u64p, _u64p, c_size_t, POINTER(NeedQuantizationStruct)],
    ),
    "refit_table_share_amax": (status_t, [_handle, c_uint32, c_uint64, c_uint64]),
    "refit_table_encoded_size": (status_t, [_handle, POINTER(c_size_t)]),
    "refit_table_encode": (status_t, [_handle, POINTER(c_uint8), c_size_t, POINTER(c_size_t)]),
    "refit_table_decode": (status_t, [POINTER(c_uint8), c_size_t, POINTER(_handle)]),
    "refit_plan_options_init": (status_t, [POINTER(PlanOptions)]),
        "refit_plan_build": (status_t, [POINTER(_handle), c_size_t, POINTER(PlanOptions), POINTER(_handle)]),
    "refit_plan_build_share": (
        status_t,
        [POINTER(_handle), c_size_t, c_uint32, POINTER(PlanOptions), POINTER(_handle)],
    ),
    "refit_plan_destroy": (None, [_handle]),
    "refit_plan_get_stats": (status_t, [_handle, POINTER(PlanStatsStruct)]),
    "refit_plan_get_receiver_stats": (status_t, [_handle, c_uint32, c_uint32, POINTER(PlanStatsStruct)]),
        "refit_plan_fingerprint": (status_t, [_handle, _u64p]),
    "refit_plan_inputs_fingerprint": (status_t, [_handle, _u64p]),
    "refit_plan_route_count": (status_t, [_handle, POINTER(c_size_t)]),
    "refit_plan_route": (status_t, [_handle, c_size_t, POINTER(RouteInfo)]),
    "refit_plan_quant_route_count": (status_t, [_handle, POINTER(c_size_t)]),
    "refit_plan_quant_route": (status_t, [_handle, c_size_t, POINTER(QuantRouteInfo)]),
    "refit_version": (c_char_p, []),
    "refit_abi_version": (c_uint32, []),
    "refit_status_string": (c_char_p, [c_int32]),
    "refit_last_error_message": (c_char_p, []),
    "refit_set_log_callback": (status_t, [c_uint32, LogCallback, c_void_p]),
}


def _declare() -> None:
    missing = [name for name in FUNCTIONS if not hasattr(lib, name)]
    if missing:
        raise OSError(f"{lib._name} lacks {', '.join(missing)}: an older librefit than this binding")
    for name, (restype, argtypes) in FUNCTIONS.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes


_declare()


# --- torch, when loaded ---------------------------------------------------------------------------


def torch_cuda_in_use() -> bool:
    """Whether torch is imported and has initialized CUDA (without importing or initializing it)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    return cuda is not None and bool(cuda.is_initialized())


def torch_current_stream(device: Optional[int] = None) -> int:
    """torch's current CUDA stream on `device` (None: torch's current device) as an int."""
    return int(sys.modules["torch"].cuda.current_stream(device).cuda_stream)


# --- version and logging --------------------------------------------------------------------------


def version() -> str:
    """The library's "MAJOR.MINOR.PATCH"."""
    return str(lib.refit_version().decode())


def abi_version() -> int:
    """REFIT_ABI_VERSION of the loaded library."""
    return int(lib.refit_abi_version())


# Every log callback ever installed: a record may still be in flight on a rank thread when the
# sink is replaced, so an old callback is never freed.
_log_callbacks: list[Any] = []


def set_log_callback(callback: Optional[Callable[[int, str], object]], level: int = 2) -> None:
    """Sends the library's log records at `level` (0 off .. 5 trace) and below to
    `callback(level, message)`, or back to stderr when `callback` is None.

    The callback may run on any thread, including rank threads, and must not call into refit;
    exceptions it raises are printed and dropped. Any thread may call this.
    """
    level = check_range(level, 32, "level")
    callable_or_none(callback, "callback")
    if callback is None:
        check(lib.refit_set_log_callback(level, LogCallback(), None))
        return

    def deliver(record_level: int, message: bytes, _user_data: object) -> None:
        try:
            callback(record_level, message.decode(errors="replace"))
        except BaseException:  # an exception must not unwind into the library
            traceback.print_exc()

    wrapped = LogCallback(deliver)
    check(lib.refit_set_log_callback(level, wrapped, None))
    _log_callbacks.append(wrapped)
    if len(_log_callbacks) == 1:
        # Rank threads may outlive the interpreter's teardown: hand logging back to stderr first.
        atexit.register(lambda: lib.refit_set_log_callback(2, LogCallback(), None))


# The argument checks live in _args; these names stay importable from here for the modules that
# import them with the ctypes layer.
from ._args import (  # noqa: E402  (after everything _args imports from here)
    byte_string,
    callable_or_none,
    check_range,
    integer,
    items,
    stream_value,
    u64_array,
)
