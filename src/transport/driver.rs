//! The CUDA driver facts shared by the CUDA backend and the batched copy kernel: loading libcuda
//! safely, turning a CUresult into an [`Error`], device handles and primary contexts, and making a
//! context current for the length of a call.

use crate::error::{Error, Result, Status};
use cudarc::driver::sys::{self, CUcontext, CUresult};
use std::ffi::{c_char, CStr};
use std::sync::OnceLock;

/// Loads libcuda and calls cuInit once. `CudaUnavailable` when libcuda is missing (cudarc would panic
/// on the first call otherwise), when cuInit fails (no driver) or when there is no device.
pub fn init() -> Result<()> {
    static INIT: OnceLock<Result<()>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only probes whether the library opens.
        if !unsafe { sys::is_culib_present() } {
            let tried = cudarc::get_lib_name_candidates("cuda");
            return Err(Error::new(
                Status::CudaUnavailable,
                format!(
                    "libcuda could not be loaded (tried {}); is the NVIDIA driver installed?",
                    tried.join(", ")
                ),
            ));
        }
        // SAFETY: cuInit(0) is always a legal first call.
        let code = unsafe { sys::cuInit(0) };
        if code == CUresult::CUDA_ERROR_NO_DEVICE {
            return Err(Error::new(Status::CudaUnavailable, "cuInit: no CUDA device is present"));
        }
        check("cuInit", code).map_err(|e| Error::new(Status::CudaUnavailable, e.message))
    })
    .clone()
}

/// `Ok` for CUDA_SUCCESS, else an error naming `call` and the CUresult (OutOfMemory for an allocation
/// failure, CudaError otherwise).
pub fn check(call: &str, code: CUresult) -> Result<()> {
    if code == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let status =
        if code == CUresult::CUDA_ERROR_OUT_OF_MEMORY { Status::OutOfMemory } else { Status::CudaError };
    Err(Error::new(status, format!("{call} failed: {}", error_name(code))))
}

/// "CUDA_ERROR_X (code)" for a CUresult.
pub fn error_name(code: CUresult) -> String {
    let mut name: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a static string pointer or leaves it NULL.
    let known = unsafe { sys::cuGetErrorName(code, &mut name) } == CUresult::CUDA_SUCCESS;
    if known && !name.is_null() {
        // SAFETY: non-NULL static NUL-terminated string.
        format!("{} ({})", unsafe { CStr::from_ptr(name) }.to_string_lossy(), code as i32)
    } else {
        format!("CUresult {}", code as i32)
    }
}

/// Number of CUDA devices (after [`init`]).
pub fn device_count() -> Result<i32> {
    init()?;
    let mut count = 0;
    // SAFETY: valid output slot.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut count) })?;
    Ok(count)
}

/// The device handle of ordinal `device`, or `InvalidDevice`.
pub fn device_handle(device: i32) -> Result<sys::CUdevice> {
    let count = device_count()?;
    if device < 0 || device >= count {
        return Err(Error::new(
            Status::InvalidDevice,
            format!("device {device} does not exist ({count} CUDA devices)"),
        ));
    }
    let mut handle = 0;
    // SAFETY: valid ordinal and output slot.
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut handle, device) })?;
    Ok(handle)
}

/// The primary context of `device`, retained for the life of the process (never released: modules
/// and prepared batches live in it).
pub fn primary_context(device: i32) -> Result<sys::CUcontext> {
    let handle = device_handle(device)?;
    let mut context = std::ptr::null_mut();
    // SAFETY: valid device handle and output slot.
    check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, handle) })?;
    Ok(context)
}

/// An integer attribute of `device`.
pub fn attribute(device: i32, attribute: sys::CUdevice_attribute) -> Result<i32> {
    let handle = device_handle(device)?;
    let mut value = 0;
    // SAFETY: valid device handle and output slot.
    check("cuDeviceGetAttribute", unsafe { sys::cuDeviceGetAttribute(&mut value, attribute, handle) })?;
    Ok(value)
}

/// Makes a context current on this thread until dropped, then restores whatever was current before,
/// so a caller's `cudaSetDevice` state is never disturbed. Not `Send`: the restore must happen on the
/// thread that changed it.
pub struct CurrentContext {
    previous: CUcontext,
    changed: bool,
}

impl CurrentContext {
    /// Makes `context` current (a no-op, apart from one query, when it already is).
    ///
    /// # Safety
    /// `context` must be a live (e.g. retained primary) context.
    pub unsafe fn enter(context: CUcontext) -> Result<CurrentContext> {
        let previous = current()?;
        if previous == context {
            return Ok(CurrentContext { previous, changed: false });
        }
        // SAFETY: the caller's promise.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(context) })?;
        Ok(CurrentContext { previous, changed: true })
    }

    /// Restores the current context when dropped, for calls that switch contexts themselves (NCCL).
    pub fn preserve() -> Result<CurrentContext> {
        Ok(CurrentContext { previous: current()?, changed: true })
    }
}

fn current() -> Result<CUcontext> {
    let mut context: CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut context) })?;
    Ok(context)
}

impl Drop for CurrentContext {
    fn drop(&mut self) {
        if self.changed {
            // SAFETY: restoring a context that was current before (or NULL).
            let code = unsafe { sys::cuCtxSetCurrent(self.previous) };
            if code != CUresult::CUDA_SUCCESS {
                log::warn!("cuCtxSetCurrent (restoring the caller's context) failed: {}", error_name(code));
            }
        }
    }
}
