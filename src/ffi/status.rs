//! Version, status names, the last error message, and logging hooks.

use super::boundary;
use crate::error::{last_error_ptr, Status};
use crate::logging::{self, refit_log_callback};
use std::ffi::{c_char, c_void};
use std::panic::catch_unwind;

/// ABI version of this header and library. Bumped only when an existing declaration changes
/// incompatibly; appending functions, statuses or option fields does not bump it.
pub const REFIT_ABI_VERSION: u32 = 1;

/// The library's version string ("MAJOR.MINOR.PATCH"), static and NUL-terminated.
/// Thread-safe; never fails.
#[no_mangle]
pub extern "C" fn refit_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// REFIT_ABI_VERSION of the loaded library. A caller built against another ABI version should not use
/// it. Thread-safe; never fails.
#[no_mangle]
pub extern "C" fn refit_abi_version() -> u32 {
    REFIT_ABI_VERSION
}

/// The name of a status code (e.g. "REFIT_STATUS_INVALID_ARGUMENT"), static and NUL-terminated;
/// "REFIT_STATUS_UNKNOWN" for a value that is not a status. Thread-safe; never fails.
#[no_mangle]
pub extern "C" fn refit_status_string(status: i32) -> *const c_char {
    match Status::from_code(status.into()) {
        Some(status) => status.name().as_ptr(),
        None => c"REFIT_STATUS_UNKNOWN".as_ptr(),
    }
}

/// The message of the last call on this thread that failed, NUL-terminated; "" if none has failed.
/// Successful calls leave it unchanged. The pointer stays valid until the next failing call on this
/// thread or the thread's exit. Thread-safe (each thread has its own message); never fails.
///
/// Every refit function may be called while a thread or the process exits (from a thread-key
/// destructor or an atexit handler). Once the exiting thread's message storage has been released,
/// the message of a call that fails then is its status name (e.g. "REFIT_STATUS_NULL_ARGUMENT"), and
/// before any such failure a fixed text saying the message was released.
#[no_mangle]
pub extern "C" fn refit_last_error_message() -> *const c_char {
    // last_error_ptr never panics; the guard keeps that promise for any future change too.
    catch_unwind(last_error_ptr).unwrap_or(c"(the last error message could not be read)".as_ptr())
}

/// Installs a log sink. `level` is the most verbose level delivered: 0 off, 1 error, 2 warn, 3 info,
/// 4 debug, 5 trace. `callback(level, message, user_data)` receives each record with a NUL-terminated
/// message valid only during the call; it may be called from any thread, including the group's rank
/// threads, and from several threads at once. NULL `callback` restores the default sink: stderr at the
/// level named by the environment variable REFIT_LOG (off, error, warn, info, debug, trace), warn by
/// default, which is also the sink before any call.
///
/// Once this call returns, the callback it replaced is never entered again and has returned on every
/// thread, so its user_data may be freed. To keep that promise the call waits for calls of the old
/// callback running on other threads: a callback must not wait for the thread that calls this
/// function. The callback and the level change together: every record goes to the sink installed
/// with its level, never to one sink at another's level.
///
/// A callback may call refit functions. Records those calls emit on the callback's thread while it is
/// inside the callback are dropped (so a failing call does not call the callback again).
///
/// Thread-safe; concurrent calls take effect one after the other. Errors: REFIT_STATUS_INVALID_ARGUMENT
/// for a level above 5; REFIT_STATUS_INVALID_STATE when called from inside the log callback (nothing
/// is changed).
#[no_mangle]
pub extern "C" fn refit_set_log_callback(
    level: u32,
    callback: refit_log_callback,
    user_data: *mut c_void,
) -> Status {
    boundary("refit_set_log_callback", || logging::set_callback(level, callback, user_data))
}
