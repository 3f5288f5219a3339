//! The C ABI and nothing else: every export converts and checks its arguments, calls the Rust core,
//! and writes outputs. Each export runs inside [`boundary`], which turns errors into a status plus a
//! thread-local message and turns a panic into `REFIT_STATUS_INTERNAL_ERROR`.
//!
//! One file per area. Enums that C passes *in* are taken as integers and converted with a check, so
//! an out-of-range value is an error, never undefined behaviour. Handles are ids that every call
//! looks up ([`handles`]), so a stale, foreign or mistyped handle is an error too.

#![allow(non_camel_case_types)]

pub mod allgather;
pub mod comm;
pub mod copy;
pub mod digest;
pub mod exec;
pub mod group;
mod handles;
pub mod plan;
pub mod quantize;
pub mod status;

use crate::error::{set_last_error, Error, Result, Status};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs one export's body. `name` is the exported function's name, prefixed to the failure message.
///
/// Never panics and never unwinds into C, also when called during thread or process exit (from a
/// thread-key destructor or an atexit handler): the body runs under `catch_unwind`, and recording the
/// failure (a log record, the thread's last error message) is panic-free by construction and guarded
/// once more, so the status is returned whatever happens there.
pub(crate) fn boundary(name: &str, body: impl FnOnce() -> Result<()>) -> Status {
    // Handles are only touched through &/&mut inside the body; a panic leaves them as Rust left them,
    // and every handle's own state is kept consistent by its methods, so asserting unwind safety holds.
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        crate::logging::init();
        body()
    }));
    let (status, message) = match outcome {
        Ok(Ok(())) => return Status::Success,
        Ok(Err(err)) => (err.status, err.message),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            (Status::InternalError, format!("internal error (please report): {what}"))
        }
    };
    let _ = catch_unwind(AssertUnwindSafe(|| {
        if status == Status::InternalError {
            log::error!("{name}: {message}");
        } else {
            log::debug!("{name} failed: {}: {message}", status.name().to_string_lossy());
        }
        set_last_error(status, &format!("{name}: {message}"));
    }));
    status
}

/// A required input pointer, as a reference.
///
/// # Safety
/// `ptr` must be NULL or point to a valid `T` for the duration of the call.
pub(crate) unsafe fn arg<'a, T>(ptr: *const T, what: &str) -> Result<&'a T> {
    ptr.as_ref().ok_or_else(|| Error::new(Status::NullArgument, format!("{what} is NULL")))
}

/// The refusal of a call on a handle that C may use from one thread at a time (or, for reading,
/// from many while none changes it) while another thread's call holds it: a status instead of a
/// data race.
pub(crate) fn in_use(what: &str) -> Error {
    Error::invalid_state(format!(
        "the {what} is in use by a call on another thread; the header says which of its calls may overlap"
    ))
}

/// A required output slot; checked before any work so that nothing is done for a call that cannot
/// report its result.
pub(crate) fn out<'a, T>(ptr: *mut T, what: &str) -> Result<&'a mut std::mem::MaybeUninit<T>> {
    // SAFETY: a non-NULL output pointer is the caller's promise of a writable T.
    unsafe { (ptr as *mut std::mem::MaybeUninit<T>).as_mut() }
        .ok_or_else(|| Error::new(Status::NullArgument, format!("{what} is NULL")))
}

/// A required output struct whose leading `size` field the caller sets to sizeof(T) before the call
/// (refit_plan_stats, refit_route_info): checked before any work, like [`out`].
///
/// # Safety
/// A non-NULL `ptr` points to a writable T whose first field, a `usize`, is initialized.
pub(crate) unsafe fn sized_out<'a, T>(ptr: *mut T, what: &str) -> Result<&'a mut std::mem::MaybeUninit<T>> {
    let slot = out(ptr, what)?;
    let size = std::ptr::read(slot.as_ptr() as *const usize);
    let full = std::mem::size_of::<T>();
    if size != full {
        return Err(Error::invalid_argument(format!(
            "{what}.size is {size}; set it to sizeof the struct ({full}) before the call"
        )));
    }
    Ok(slot)
}

/// Writes `value` into a caller's output struct whose leading `size` field says which version of T
/// the caller was built against: sizeof(T), or one of `older` (prefixes of T, earlier versions of
/// the struct), which get the fields they hold. INVALID_ARGUMENT for any other size, NULL_ARGUMENT
/// for NULL; nothing is written then. `value`'s own size field is set to the caller's.
///
/// # Safety
/// A non-NULL `ptr` points to at least `size` writable bytes, the first a `usize` `size`, initialized.
pub(crate) unsafe fn write_versioned<T: Copy>(
    ptr: *mut T,
    what: &str,
    older: &[usize],
    mut value: T,
) -> Result<()> {
    if ptr.is_null() {
        return Err(Error::new(Status::NullArgument, format!("{what} is NULL")));
    }
    // No reference to a T: an older caller's struct is shorter.
    let size = std::ptr::read(ptr.cast::<usize>());
    let full = std::mem::size_of::<T>();
    if size != full && !older.contains(&size) {
        return Err(Error::invalid_argument(format!(
            "{what}.size is {size}; set it to sizeof the struct ({full}{}) before the call",
            older.iter().map(|s| format!(", or {s} as an earlier version")).collect::<String>()
        )));
    }
    // SAFETY: T's first field is its size (the callers' structs are all so).
    std::ptr::write((&mut value as *mut T).cast::<usize>(), size);
    // SAFETY: `size` bytes are writable at `ptr` (the caller's promise) and `size` <= sizeof(T).
    std::ptr::copy_nonoverlapping((&value as *const T).cast::<u8>(), ptr.cast::<u8>(), size);
    Ok(())
}

/// A caller array of `len` elements. NULL is accepted only when `len` is 0.
///
/// # Safety
/// When `len > 0`, `ptr` must point to `len` valid, initialized `T`s for the duration of the call.
pub(crate) unsafe fn slice<'a, T>(ptr: *const T, len: usize, what: &str) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(Error::new(Status::NullArgument, format!("{what} is NULL but its length is {len}")));
    }
    if len.checked_mul(std::mem::size_of::<T>()).is_none_or(|bytes| bytes > isize::MAX as usize) {
        return Err(Error::invalid_argument(format!("{what} length {len} is too large")));
    }
    Ok(std::slice::from_raw_parts(ptr, len))
}

/// A caller string (NUL-terminated UTF-8).
///
/// # Safety
/// `ptr` must be NULL or point to a NUL-terminated string.
pub(crate) unsafe fn c_str<'a>(ptr: *const std::ffi::c_char, what: &str) -> Result<&'a str> {
    if ptr.is_null() {
        return Err(Error::new(Status::NullArgument, format!("{what} is NULL")));
    }
    std::ffi::CStr::from_ptr(ptr)
        .to_str()
        .map_err(|_| Error::invalid_argument(format!("{what} is not valid UTF-8")))
}

/// A C options struct led by its `size` field.
pub(crate) trait OptionsStruct: Sized {
    /// Checks, through the raw pointer, every field whose bit patterns Rust restricts (a `bool`), so
    /// that no reference to a struct holding an invalid value is ever formed.
    ///
    /// # Safety
    /// `ptr` points to a whole, readable `Self`.
    unsafe fn check_fields(_ptr: *const Self) -> Result<()> {
        Ok(())
    }
}

/// A caller's options struct (NULL: `None`) whose leading `size` field must be sizeof(T). The size is
/// read and checked before anything else: a caller built against a shorter struct passes only that
/// many bytes, and reading the rest would read past its memory. Then the fields Rust restricts are
/// checked ([`OptionsStruct::check_fields`]).
///
/// # Safety
/// `ptr` is NULL or points to at least a readable `usize`, and to a whole `T` when that `usize`
/// equals sizeof(T).
pub(crate) unsafe fn options_in<'a, T: OptionsStruct>(ptr: *const T, what: &str) -> Result<Option<&'a T>> {
    if ptr.is_null() {
        return Ok(None);
    }
    let (size, full) = (std::ptr::read(ptr.cast::<usize>()), std::mem::size_of::<T>());
    if size != full {
        return Err(Error::invalid_argument(format!(
            "{what}.size is {size}; expected {full} (fill it with the *_init function)"
        )));
    }
    T::check_fields(ptr)?;
    Ok(Some(&*ptr))
}

/// Checks a `bool` field of a caller struct as the byte it is: C only ever stores 0 or 1 there, but
/// bytes set with memset or copied from elsewhere may hold anything, and such a byte read as a Rust
/// `bool` is undefined behaviour.
///
/// # Safety
/// `field` points to a readable byte.
pub(crate) unsafe fn check_bool(field: *const bool, what: &str) -> Result<()> {
    match std::ptr::read(field.cast::<u8>()) {
        0 | 1 => Ok(()),
        other => Err(Error::invalid_argument(format!("{what} is {other}; expected 0 (false) or 1 (true)"))),
    }
}
