//! Memory the kernels' host code owns: device allocations freed on drop ([`DeviceMemory`]) and one
//! page-locked host word that a stream copies a result into ([`PinnedWord`]), and page-locked host
//! bytes that a stream copies from ([`PinnedBytes`]).

use crate::error::Result;
use crate::transport::driver::{check, CurrentContext};
use cudarc::driver::sys;

/// `bytes` of device memory in `context`, freed with `cuMemFree` on drop: drop only once no queued
/// work can still use it.
pub(crate) struct DeviceMemory {
    context: sys::CUcontext,
    pub ptr: sys::CUdeviceptr,
}

// SAFETY: device memory and a retained primary context: process-wide driver objects.
unsafe impl Send for DeviceMemory {}
unsafe impl Sync for DeviceMemory {}

impl DeviceMemory {
    /// Allocates `bytes` (at least 1) in `context`.
    pub fn alloc(context: sys::CUcontext, bytes: usize) -> Result<DeviceMemory> {
        // SAFETY: `context` is a retained primary context (every caller's).
        let _current = unsafe { CurrentContext::enter(context) }?;
        let mut ptr = 0;
        // SAFETY: valid output slot in the current context.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) })?;
        Ok(DeviceMemory { context, ptr })
    }

    /// A device copy of `data`; synchronous.
    pub fn upload(context: sys::CUcontext, data: &[u8]) -> Result<DeviceMemory> {
        let memory = DeviceMemory::alloc(context, data.len())?;
        // SAFETY: as in alloc.
        let _current = unsafe { CurrentContext::enter(context) }?;
        // SAFETY: the allocation holds data.len() bytes.
        check("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(memory.ptr, data.as_ptr().cast(), data.len()) })?;
        Ok(memory)
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        // SAFETY: a retained primary context.
        let freed = unsafe { CurrentContext::enter(self.context) }.and_then(|_current| {
            // SAFETY: allocated by cuMemAlloc in this context, freed once.
            check("cuMemFree", unsafe { sys::cuMemFree_v2(self.ptr) })
        });
        if let Err(err) = freed {
            log::warn!("freeing kernel device memory: {err}");
        }
    }
}

/// One page-locked host word, the destination of an asynchronous device-to-host copy: read it only
/// after the stream that copies into it has been synchronized.
pub(crate) struct PinnedWord {
    bytes: PinnedBytes,
}

impl PinnedWord {
    pub fn new(context: sys::CUcontext, value: u64) -> Result<PinnedWord> {
        let word = PinnedWord { bytes: PinnedBytes::new(context, 8)? };
        word.set(value);
        Ok(word)
    }

    /// The host address, for cuMemcpyDtoHAsync.
    pub fn as_host_ptr(&self) -> *mut std::ffi::c_void {
        self.bytes.ptr.cast()
    }

    pub fn get(&self) -> u64 {
        // SAFETY: a live allocation of 8 bytes, page-aligned (cuMemHostAlloc).
        unsafe { std::ptr::read_volatile(self.bytes.ptr.cast::<u64>()) }
    }

    pub fn set(&self, value: u64) {
        // SAFETY: as in get.
        unsafe { std::ptr::write_volatile(self.bytes.ptr.cast::<u64>(), value) }
    }
}

/// `len` bytes of page-locked host memory, freed on drop: the end of asynchronous copies between
/// host and device that neither stage through the driver's buffers nor wait for the stream.
pub(crate) struct PinnedBytes {
    context: sys::CUcontext,
    pub ptr: *mut u8,
    pub len: usize,
}

// SAFETY: page-locked host memory of a retained primary context; its owner serializes the writes.
unsafe impl Send for PinnedBytes {}
unsafe impl Sync for PinnedBytes {}

impl PinnedBytes {
    pub fn new(context: sys::CUcontext, len: usize) -> Result<PinnedBytes> {
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(context) }?;
        let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: valid output slot; `len` (at least 1) bytes of page-locked memory for this context.
        check("cuMemHostAlloc", unsafe { sys::cuMemHostAlloc(&mut ptr, len.max(1), 0) })?;
        Ok(PinnedBytes { context, ptr: ptr.cast(), len })
    }
}

impl Drop for PinnedBytes {
    fn drop(&mut self) {
        // SAFETY: a retained primary context; the allocation is freed once.
        let freed = unsafe { CurrentContext::enter(self.context) }
            .and_then(|_current| check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(self.ptr.cast()) }));
        if let Err(err) = freed {
            log::warn!("freeing page-locked host memory: {err}");
        }
    }
}
