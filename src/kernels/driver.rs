//! The few CUDA driver facts the kernel needs: loading libcuda safely, turning a CUresult into an
//! [`Error`], and making a device's primary context current for the length of a call.

use crate::error::{Error, Result, Status};
use cudarc::driver::sys;
use std::ffi::CStr;
use std::sync::OnceLock;

/// Loads libcuda and calls cuInit once. `CudaUnavailable` when libcuda is missing (cudarc would panic
/// on the first call otherwise) or cuInit fails (no driver, no device).
pub fn init() -> Result<()> {
    static INIT: OnceLock<Result<()>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only probes whether the library opens.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::new(
                Status::CudaUnavailable,
                "libcuda could not be loaded (tried libcuda.so and its versioned names)",
            ));
        }
        // SAFETY: cuInit(0) is always a legal first call.
        let code = unsafe { sys::cuInit(0) };
        check("cuInit", code).map_err(|e| Error::new(Status::CudaUnavailable, e.message))
    })
    .clone()
}

/// `Ok` for CUDA_SUCCESS, else an error naming `call` and the CUresult (OutOfMemory for an allocation
/// failure, CudaError otherwise).
pub fn check(call: &str, code: sys::CUresult) -> Result<()> {
    if code == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a static string pointer or leaves it NULL.
    unsafe { sys::cuGetErrorName(code, &mut name) };
    let name = if name.is_null() {
        format!("{code:?}")
    } else {
        // SAFETY: non-NULL static NUL-terminated string.
        unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
    };
    let status =
        if code == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY { Status::OutOfMemory } else { Status::CudaError };
    Err(Error::new(status, format!("{call} failed: {name}")))
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

/// Makes `context` current on this thread until dropped, then restores whatever was current before.
/// Not `Send`: the pop must happen on the thread that pushed.
pub struct CurrentContext(std::marker::PhantomData<*const ()>);

impl CurrentContext {
    /// # Safety
    /// `context` must be a live (e.g. retained primary) context.
    pub unsafe fn push(context: sys::CUcontext) -> Result<CurrentContext> {
        // SAFETY: the caller's promise.
        check("cuCtxPushCurrent", unsafe { sys::cuCtxPushCurrent_v2(context) })?;
        Ok(CurrentContext(std::marker::PhantomData))
    }
}

impl Drop for CurrentContext {
    fn drop(&mut self) {
        let mut popped = std::ptr::null_mut();
        // SAFETY: pops the context pushed by `push` on this thread.
        let code = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
        if code != sys::CUresult::CUDA_SUCCESS {
            log::warn!("cuCtxPopCurrent failed: {code:?}");
        }
    }
}
