//! One error type for the whole crate, and the status codes it maps to across the C boundary.
//!
//! An [`Error`] is a [`Status`] plus a message. Inside the crate errors are values (`Result<T>`); at the
//! boundary the status is returned and the message is kept per thread for `refit_last_error_message()`.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, CStr, CString};
use std::fmt;

// The one list of statuses: the header's `refit_status` (cbindgen) and, through build.rs, `Status::ALL`
// and the C names are made from this enum. Keep one `Variant = code,` per line, codes 0, 1, 2, ...
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
    /// This rank stopped because another rank of the same operation failed first, or because a peer
    /// process of a communicator exited or aborted it (message names the rank).
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
    /// A peer did not take part in a communicator's call within the communicator's timeout; the
    /// communicator is aborted (message names the call and the timeout).
    Timeout = 28,
}

// `Status::ALL` and `Status::name`, derived from the enum above by build.rs: adding a status means
// adding its variant, nothing else.
include!(concat!(env!("OUT_DIR"), "/status_table.rs"));

impl Status {
    /// The status with this code, if there is one.
    pub fn from_code(code: i64) -> Option<Status> {
        usize::try_from(code).ok().and_then(|i| Status::ALL.get(i).copied())
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

/// An empty vector with room for `capacity` elements, or OUT_OF_MEMORY instead of an abort. Every
/// allocation whose size a caller chooses (an array length, a count, a byte size) goes through this or
/// [`try_reserve`]: under a memory limit the call fails with a status and the process lives on.
pub fn try_vec<T>(capacity: usize, what: &str) -> Result<Vec<T>> {
    let mut vec = Vec::new();
    try_reserve(&mut vec, capacity, what)?;
    Ok(vec)
}

/// Room for `additional` more elements in `vec`, or OUT_OF_MEMORY (see [`try_vec`]). Grows the
/// capacity geometrically, as `push` does, so reserving before each append stays linear.
pub fn try_reserve<T>(vec: &mut Vec<T>, additional: usize, what: &str) -> Result<()> {
    vec.try_reserve(additional).map_err(|_| {
        Error::new(
            Status::OutOfMemory,
            format!("cannot allocate {what}: {additional} x {} bytes", std::mem::size_of::<T>()),
        )
    })
}

/// A copy of `items`, or OUT_OF_MEMORY (see [`try_vec`]).
pub fn try_to_vec<T: Clone>(items: &[T], what: &str) -> Result<Vec<T>> {
    let mut vec = try_vec(items.len(), what)?;
    vec.extend_from_slice(items);
    Ok(vec)
}

/// Shorthand for `Err(Error::new(status, format!(...)))`.
#[macro_export]
macro_rules! bail {
    ($status:expr, $($fmt:tt)+) => {
        return Err($crate::error::Error::new($status, format!($($fmt)+)))
    };
}

thread_local! {
    /// This thread's last error message.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// The status of this thread's latest failure after LAST_ERROR was destroyed (a call made from a
    /// thread-exit destructor or an atexit handler). It has no destructor, so it is never destroyed.
    static FAILED_AFTER_EXIT: Cell<Option<Status>> = const { Cell::new(None) };
}

/// Keeps `message` as this thread's last error message (interior NULs are replaced). During thread
/// exit, once the message storage is gone, only `status` is kept: its name becomes the message.
pub fn set_last_error(status: Status, message: &str) {
    let text = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    let kept = LAST_ERROR.try_with(|slot| slot.try_borrow_mut().map(|mut kept| *kept = text).is_ok());
    if kept != Ok(true) {
        let _ = FAILED_AFTER_EXIT.try_with(|failed| failed.set(Some(status)));
    }
}

/// Empties this thread's last error message.
pub fn clear_last_error() {
    let _ = LAST_ERROR.try_with(|slot| slot.try_borrow_mut().map(|mut kept| *kept = CString::default()));
    let _ = FAILED_AFTER_EXIT.try_with(|failed| failed.set(None));
}

/// What the last error message reads once this thread's message storage is gone.
fn message_after_exit() -> &'static CStr {
    match FAILED_AFTER_EXIT.try_with(Cell::get) {
        Ok(Some(status)) => status.name(),
        _ => c"(this thread is exiting: its last error message was released)",
    }
}

/// Pointer to this thread's last error message; valid until the next failing call on this thread or
/// the thread's exit. Never panics, also during thread exit.
pub fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|slot| slot.try_borrow().map(|kept| kept.as_ptr()).ok())
        .ok()
        .flatten()
        .unwrap_or_else(|| message_after_exit().as_ptr())
}

/// This thread's last error message, copied (for Rust callers and tests).
pub fn last_error() -> String {
    LAST_ERROR
        .try_with(|slot| slot.try_borrow().map(|kept| kept.to_string_lossy().into_owned()).ok())
        .ok()
        .flatten()
        .unwrap_or_else(|| message_after_exit().to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `REFIT_STATUS_X = n` enumerator of the checked-in header, as (name, code).
    fn header_statuses() -> Vec<(String, i64)> {
        let header =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/refit.h")).unwrap();
        header
            .lines()
            .filter_map(|line| line.trim().strip_suffix(',')?.split_once(" = "))
            .filter(|(name, _)| name.starts_with("REFIT_STATUS_"))
            .map(|(name, code)| (name.to_string(), code.parse().unwrap()))
            .collect()
    }

    #[test]
    fn names_and_codes_match_the_header() {
        let header = header_statuses();
        assert_eq!(header.len(), Status::ALL.len(), "{header:?}");
        for (name, code) in header {
            let status = Status::from_code(code).unwrap_or_else(|| panic!("{name} = {code} has no Status"));
            assert_eq!(status as i64, code);
            assert_eq!(status.name().to_str().unwrap(), name);
        }
        assert_eq!(Status::from_code(Status::ALL.len() as i64), None);
        assert_eq!(Status::from_code(-1), None);
    }

    #[test]
    fn allocations_too_large_are_out_of_memory() {
        let err = try_vec::<u64>(usize::MAX / 4, "a test list").unwrap_err();
        assert_eq!(err.status, Status::OutOfMemory);
        assert_eq!(err.message, format!("cannot allocate a test list: {} x 8 bytes", usize::MAX / 4));
        assert_eq!(try_to_vec(&[1u8, 2, 3], "bytes").unwrap(), [1, 2, 3]);
        // Reserving before each append grows geometrically, not one element at a time.
        let mut list = Vec::new();
        let mut reallocations = 0;
        for i in 0..10_000u32 {
            let capacity = list.capacity();
            try_reserve(&mut list, 1, "a test list").unwrap();
            reallocations += usize::from(list.capacity() != capacity);
            list.push(i);
        }
        assert!(reallocations < 20, "{reallocations} reallocations for 10,000 appends");
    }

    #[test]
    fn last_error_is_per_thread_and_cleared() {
        set_last_error(Status::Overlap, "first\0second");
        assert_eq!(last_error(), "first\\0second");
        let other = std::thread::spawn(|| {
            let before = last_error();
            set_last_error(Status::NotFound, "elsewhere");
            (before, last_error())
        });
        assert_eq!(other.join().unwrap(), (String::new(), "elsewhere".to_string()));
        // SAFETY: the pointer is this thread's message, valid until the next failing call.
        assert_eq!(unsafe { CStr::from_ptr(last_error_ptr()) }.to_str().unwrap(), "first\\0second");
        clear_last_error();
        assert_eq!(last_error(), "");
    }
}
