//! Run-time loading of optional shared libraries (NCCL, NVRTC): the first candidate that opens wins,
//! and failure is a status whose message lists every path tried, never a crash.

use crate::error::{Error, Result, Status};
use std::ffi::{c_void, CStr, CString};

/// An opened shared library. It is never closed: symbols taken from it may be cached for the life of
/// the process.
pub struct Library {
    handle: *mut c_void,
    path: String,
}

// SAFETY: a dlopen handle may be used from any thread; we never close it.
unsafe impl Send for Library {}
unsafe impl Sync for Library {}

impl Library {
    /// Opens `$env_var` if it is set (and only that file), else the first of `candidates` that opens.
    /// `unavailable` is the status returned when none does, e.g. `Status::NcclUnavailable`.
    pub fn open_first(env_var: &str, candidates: &[&str], unavailable: Status) -> Result<Library> {
        let explicit = std::env::var(env_var).ok().filter(|v| !v.is_empty());
        let tried: Vec<String> = match &explicit {
            Some(path) => vec![path.clone()],
            None => candidates.iter().map(|c| c.to_string()).collect(),
        };
        let mut failures = Vec::with_capacity(tried.len());
        for name in &tried {
            let Ok(c_name) = CString::new(name.as_str()) else { continue };
            // SAFETY: dlopen with a valid NUL-terminated path; the handle is kept for the process.
            let handle = unsafe { libc::dlopen(c_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if !handle.is_null() {
                log::info!("loaded {name}");
                return Ok(Library { handle, path: name.clone() });
            }
            failures.push(format!("{name} ({})", last_dl_error()));
        }
        let how =
            if explicit.is_some() { format!("{env_var} names") } else { format!("{env_var} unset; tried") };
        Err(Error::new(unavailable, format!("cannot load library: {how} {}", failures.join(", "))))
    }

    /// The path this library was opened from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Address of symbol `name`, as a function pointer type `F`.
    ///
    /// # Safety
    /// `F` must be a function pointer type matching the symbol's real signature.
    pub unsafe fn symbol<F: Copy>(&self, name: &CStr, unavailable: Status) -> Result<F> {
        debug_assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
        let address = libc::dlsym(self.handle, name.as_ptr());
        if address.is_null() {
            return Err(Error::new(
                unavailable,
                format!("{} has no symbol {}", self.path, name.to_string_lossy()),
            ));
        }
        Ok(std::mem::transmute_copy::<*mut c_void, F>(&address))
    }
}

fn last_dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated thread-local string.
    let message = unsafe { libc::dlerror() };
    if message.is_null() {
        "unknown error".to_string()
    } else {
        // SAFETY: non-NULL, NUL-terminated.
        unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_lists_every_candidate() {
        let err = Library::open_first(
            "REFIT_TEST_UNSET_VARIABLE",
            &["libdoes-not-exist-1.so", "/nowhere/libdoes-not-exist-2.so"],
            Status::NcclUnavailable,
        )
        .err()
        .expect("no such library");
        assert_eq!(err.status, Status::NcclUnavailable);
        assert!(err.message.contains("libdoes-not-exist-1.so"), "{}", err.message);
        assert!(err.message.contains("/nowhere/libdoes-not-exist-2.so"), "{}", err.message);
    }

    #[test]
    fn symbols_resolve_and_missing_symbols_are_errors() {
        let libc_so = Library::open_first("REFIT_TEST_UNSET_VARIABLE", &["libc.so.6"], Status::Unsupported)
            .expect("libc is always there");
        type Strlen = unsafe extern "C" fn(*const std::ffi::c_char) -> usize;
        let strlen: Strlen = unsafe { libc_so.symbol(c"strlen", Status::Unsupported) }.unwrap();
        assert_eq!(unsafe { strlen(c"four".as_ptr()) }, 4);
        let missing = unsafe { libc_so.symbol::<Strlen>(c"refit_no_such_symbol", Status::Unsupported) };
        assert_eq!(missing.err().unwrap().status, Status::Unsupported);
    }
}
