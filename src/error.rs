//! One error type for the whole crate, and the status codes it maps to across the C boundary.
//!
//! An [`Error`] is a [`Status`] plus a message. Inside the crate errors are values (`Result<T>`); at the
//! boundary the status is returned and the message is kept per thread for `refit_last_error_message()`.

use std::cell::RefCell;
use std::ffi::CString;
use std::fmt;

/// Result of every fallible call. Values are part of the ABI: new codes are appended, never renumbered.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    /// The call succeeded.
    Success = 0,
    /// An argument is out of its documented range (message names it).
    InvalidArgument = 1,
    /// A required pointer argument was NULL (message names it).
    NullArgument = 2,
    /// A bug inside the library (a caught panic). The handle involved may be unusable.
    InternalError = 3,
    /// libcuda could not be loaded, or no CUDA device is present (message lists what was searched).
    CudaUnavailable = 4,
    /// libnccl could not be loaded or lacks a symbol (message lists what was searched).
    NcclUnavailable = 5,
    /// libnvrtc could not be loaded (message lists what was searched).
    NvrtcUnavailable = 6,
    /// A CUDA driver call failed (message names the call and the CUresult).
    CudaError = 7,
    /// An NCCL call failed (message names the call and the ncclResult_t).
    NcclError = 8,
    /// A device ordinal is negative or not below the number of devices.
    InvalidDevice = 9,
    /// The same device appears twice in a device list.
    DuplicateDevice = 10,
    /// A device list is empty.
    EmptyDeviceList = 11,
    /// The call is not valid in the handle's current state (e.g. exit without enter).
    InvalidState = 12,
    /// A per-rank callback returned a failure; the message names the rank and its code.
    CallbackFailed = 13,
    /// This rank stopped because another rank of the same operation failed first.
    Aborted = 14,
    /// A tensor was described inconsistently (shape, element size, dtype), or a box is out of bounds.
    TensorMismatch = 15,
    /// Two replica offers of the same box carry different digests.
    ReplicaMismatch = 16,
    /// Some needed bytes are offered by no publisher (message names the first uncovered region).
    CoverageGap = 17,
    /// Two writes target the same destination bytes.
    Overlap = 18,
    /// Encoded bytes are truncated, corrupted or hostile.
    DecodeError = 19,
    /// Encoded bytes use a format version this library does not read.
    VersionMismatch = 20,
    /// Host or device memory could not be allocated.
    OutOfMemory = 21,
    /// The batched copy kernel could not be compiled or loaded (message carries the log).
    KernelLoadFailed = 22,
    /// The operation is not supported by this backend, topology or build.
    Unsupported = 23,
    /// A caller-provided output buffer is too small; the size needed is reported where documented.
    BufferTooSmall = 24,
    /// An index, rank or name is not present.
    NotFound = 25,
    /// Installed bytes differ from their sources (an executor's verify stage); the message names the
    /// tensor, box and element.
    VerifyMismatch = 26,
    /// The memory a plan was built for changed in a way its executor cannot follow (e.g. a rebind that
    /// cuts through a buffer the plan reads or writes): build a new plan.
    PlanStale = 27,
}

impl Status {
    /// Every status, in code order. Used to validate codes coming back from callers.
    const ALL: [Status; 28] = [
        Status::Success,
        Status::InvalidArgument,
        Status::NullArgument,
        Status::InternalError,
        Status::CudaUnavailable,
        Status::NcclUnavailable,
        Status::NvrtcUnavailable,
        Status::CudaError,
        Status::NcclError,
        Status::InvalidDevice,
        Status::DuplicateDevice,
        Status::EmptyDeviceList,
        Status::InvalidState,
        Status::CallbackFailed,
        Status::Aborted,
        Status::TensorMismatch,
        Status::ReplicaMismatch,
        Status::CoverageGap,
        Status::Overlap,
        Status::DecodeError,
        Status::VersionMismatch,
        Status::OutOfMemory,
        Status::KernelLoadFailed,
        Status::Unsupported,
        Status::BufferTooSmall,
        Status::NotFound,
        Status::VerifyMismatch,
        Status::PlanStale,
    ];

    /// The status with this code, if there is one.
    pub fn from_code(code: i64) -> Option<Status> {
        usize::try_from(code).ok().and_then(|i| Status::ALL.get(i).copied())
    }

    /// The name C callers see, as a NUL-terminated static string.
    pub fn name(self) -> &'static std::ffi::CStr {
        match self {
            Status::Success => c"REFIT_STATUS_SUCCESS",
            Status::InvalidArgument => c"REFIT_STATUS_INVALID_ARGUMENT",
            Status::NullArgument => c"REFIT_STATUS_NULL_ARGUMENT",
            Status::InternalError => c"REFIT_STATUS_INTERNAL_ERROR",
            Status::CudaUnavailable => c"REFIT_STATUS_CUDA_UNAVAILABLE",
            Status::NcclUnavailable => c"REFIT_STATUS_NCCL_UNAVAILABLE",
            Status::NvrtcUnavailable => c"REFIT_STATUS_NVRTC_UNAVAILABLE",
            Status::CudaError => c"REFIT_STATUS_CUDA_ERROR",
            Status::NcclError => c"REFIT_STATUS_NCCL_ERROR",
            Status::InvalidDevice => c"REFIT_STATUS_INVALID_DEVICE",
            Status::DuplicateDevice => c"REFIT_STATUS_DUPLICATE_DEVICE",
            Status::EmptyDeviceList => c"REFIT_STATUS_EMPTY_DEVICE_LIST",
            Status::InvalidState => c"REFIT_STATUS_INVALID_STATE",
            Status::CallbackFailed => c"REFIT_STATUS_CALLBACK_FAILED",
            Status::Aborted => c"REFIT_STATUS_ABORTED",
            Status::TensorMismatch => c"REFIT_STATUS_TENSOR_MISMATCH",
            Status::ReplicaMismatch => c"REFIT_STATUS_REPLICA_MISMATCH",
            Status::CoverageGap => c"REFIT_STATUS_COVERAGE_GAP",
            Status::Overlap => c"REFIT_STATUS_OVERLAP",
            Status::DecodeError => c"REFIT_STATUS_DECODE_ERROR",
            Status::VersionMismatch => c"REFIT_STATUS_VERSION_MISMATCH",
            Status::OutOfMemory => c"REFIT_STATUS_OUT_OF_MEMORY",
            Status::KernelLoadFailed => c"REFIT_STATUS_KERNEL_LOAD_FAILED",
            Status::Unsupported => c"REFIT_STATUS_UNSUPPORTED",
            Status::BufferTooSmall => c"REFIT_STATUS_BUFFER_TOO_SMALL",
            Status::NotFound => c"REFIT_STATUS_NOT_FOUND",
            Status::VerifyMismatch => c"REFIT_STATUS_VERIFY_MISMATCH",
            Status::PlanStale => c"REFIT_STATUS_PLAN_STALE",
        }
    }
}

/// A failure: the status C callers get, and the message that explains it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(status: Status, message: impl Into<String>) -> Error {
        debug_assert!(status != Status::Success, "an Error never carries REFIT_STATUS_SUCCESS");
        Error { status, message: message.into() }
    }

    pub fn invalid_argument(message: impl Into<String>) -> Error {
        Error::new(Status::InvalidArgument, message)
    }

    pub fn invalid_state(message: impl Into<String>) -> Error {
        Error::new(Status::InvalidState, message)
    }

    pub fn unsupported(message: impl Into<String>) -> Error {
        Error::new(Status::Unsupported, message)
    }

    /// The same error with `context` in front of its message ("context: message").
    pub fn context(mut self, context: impl fmt::Display) -> Error {
        self.message = format!("{context}: {}", self.message);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status.name().to_string_lossy(), self.message)
    }
}

impl std::error::Error for Error {}

/// Shorthand for `Err(Error::new(status, format!(...)))`.
#[macro_export]
macro_rules! bail {
    ($status:expr, $($fmt:tt)+) => {
        return Err($crate::error::Error::new($status, format!($($fmt)+)))
    };
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Keeps `message` as this thread's last error message (interior NULs are replaced).
pub fn set_last_error(message: &str) {
    let text = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|slot| *slot.borrow_mut() = text);
}

/// Pointer to this thread's last error message; valid until the next failing call on this thread.
pub fn last_error_ptr() -> *const std::ffi::c_char {
    LAST_ERROR.with(|slot| slot.borrow().as_ptr())
}

/// This thread's last error message, copied (for Rust callers and tests).
pub fn last_error() -> String {
    LAST_ERROR.with(|slot| slot.borrow().to_string_lossy().into_owned())
}
