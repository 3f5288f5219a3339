//! The tables of one-shot launches (a batch's descriptors, laid out anew at every call), uploaded
//! into slots of device memory that are reused once the launches reading them have run.
//!
//! Allocating the table at every call with `cuMemAllocAsync` and filling it from pageable memory cost
//! a one-shot call tens of microseconds more than a prepared batch on the GPU's timeline: the device's
//! default memory pool gives its memory back at every synchronization (its release threshold is 0),
//! so the next allocation maps pages again, and a copy from pageable memory is staged through the
//! driver's buffers. A slot is device memory with a page-locked host image of the same size and an
//! event: the call writes the table into the image, queues one copy from it, queues its launches,
//! and records the event behind them; the slot serves the next call once that event has completed.
//!
//! A one-shot call is refused (`Unsupported`) on a stream being captured into a CUDA graph: the
//! graph would keep reading a slot that later calls rewrite. Prepared batches are what graphs take.
//!
//! A call finding no idle slot large enough takes a new one, up to [`MAX_SLOTS`] per device and
//! kernel of at most [`MAX_SLOT_BYTES`] each, and beyond that (many calls in flight at once, or a
//! larger table) allocates its table as before, so that no call ever waits for another's launches.

use super::device_memory::{DeviceMemory, PinnedBytes};
use crate::error::{Error, Result, Status};
use crate::sync::lock;
use crate::transport::driver::{check, CurrentContext};
use cudarc::driver::sys;
use std::sync::Mutex;

/// Slots kept per device and kernel: calls in flight at once beyond this allocate their tables.
pub const MAX_SLOTS: usize = 8;
/// The largest slot; a larger table is allocated for its call.
pub const MAX_SLOT_BYTES: usize = 4 << 20;
/// The smallest slot, so that tables of a few descriptors more share one size.
const MIN_SLOT_BYTES: usize = 64 << 10;

/// One reusable table: device memory, its host image, and the event behind its last launches.
struct Slot {
    device: DeviceMemory,
    host: PinnedBytes,
    /// Recorded on the stream after the launches that read the slot; complete: the slot is idle (an
    /// event never recorded is complete).
    done: sys::CUevent,
}

// SAFETY: driver objects of a retained primary context, usable from any thread; the host image is
// written only by the one call holding the slot.
unsafe impl Send for Slot {}

impl Slot {
    fn new(context: sys::CUcontext, bytes: usize) -> Result<Slot> {
        let device = DeviceMemory::alloc(context, bytes)?;
        let host = PinnedBytes::new(context, bytes)?;
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(context) }?;
        let mut done: sys::CUevent = std::ptr::null_mut();
        // SAFETY: valid output slot in the current context.
        check("cuEventCreate(CU_EVENT_DISABLE_TIMING)", unsafe {
            sys::cuEventCreate(&mut done, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        Ok(Slot { device, host, done })
    }

    fn idle(&self) -> bool {
        // SAFETY: a live event (NOT_READY and errors alike: not idle, the slot is left alone).
        let state = unsafe { sys::cuEventQuery(self.done) };
        state == sys::CUresult::CUDA_SUCCESS
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // SAFETY: created in new, destroyed once; a pending record still completes.
        let result = unsafe { sys::cuEventDestroy_v2(self.done) };
        if result != sys::CUresult::CUDA_SUCCESS {
            log::warn!("cuEventDestroy of an upload slot: {result:?}");
        }
    }
}

/// The upload slots of one kernel on one device.
pub(crate) struct UploadSlots {
    context: sys::CUcontext,
    /// Idle or busy slots not held by a call, and how many exist in all (held ones included).
    slots: Mutex<(Vec<Slot>, usize)>,
}

// SAFETY: the context is a process-wide driver object; the slots are behind the mutex.
unsafe impl Send for UploadSlots {}
unsafe impl Sync for UploadSlots {}

impl UploadSlots {
    pub fn new(context: sys::CUcontext) -> UploadSlots {
        UploadSlots { context, slots: Mutex::new((Vec::new(), 0)) }
    }

    /// Queues on `stream` the upload of `table` into device memory of at least `table.len() + extra`
    /// bytes (the extra bytes follow the table, uninitialized), then `launch(address)`, then what
    /// frees that memory once the launches have run. The context is current during `launch`.
    ///
    /// # Safety
    /// `stream` is NULL or a live stream of the slots' context; `launch` queues only work on
    /// `stream` that reads and writes the table within its bytes.
    pub unsafe fn with_table(
        &self,
        stream: sys::CUstream,
        table: &[u8],
        extra: usize,
        launch: impl FnOnce(sys::CUdeviceptr) -> Result<()>,
    ) -> Result<()> {
        let bytes = table.len() + extra;
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(self.context) }?;
        refuse_capture(
            stream,
            "a one-shot call cannot be captured into a CUDA graph: its descriptors are uploaded into memory \
             that later calls reuse (capture a prepared batch: refit_copy_batch_launch)",
        )?;
        let Some(slot) = self.take(bytes)? else {
            // SAFETY: the caller's promises.
            return unsafe { allocated_table(stream, table, extra, launch) };
        };
        // SAFETY: an idle slot of at least `bytes`, held by this call alone.
        unsafe { std::ptr::copy_nonoverlapping(table.as_ptr(), slot.host.ptr, table.len()) };
        // SAFETY: page-locked source and device destination of the slot, both of `bytes` or more.
        let mut result = check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(slot.device.ptr, slot.host.ptr.cast(), table.len(), stream)
        });
        if result.is_ok() {
            result = launch(slot.device.ptr);
        }
        // SAFETY: a live event and stream of the current context.
        let recorded = check("cuEventRecord", unsafe { sys::cuEventRecord(slot.done, stream) });
        if recorded.is_err() {
            // The event cannot tell when the slot is idle again: wait for the stream instead.
            // SAFETY: as above.
            let _ = unsafe { sys::cuStreamSynchronize(stream) };
        }
        lock(&self.slots).0.push(slot);
        result.and(recorded)
    }

    /// An idle slot of at least `bytes`, taken out of the pool; a new one while there are fewer than
    /// [`MAX_SLOTS`]; None for a table above [`MAX_SLOT_BYTES`] or when every slot is busy or small.
    fn take(&self, bytes: usize) -> Result<Option<Slot>> {
        if bytes > MAX_SLOT_BYTES {
            return Ok(None);
        }
        let mut guard = lock(&self.slots);
        let (free, count) = &mut *guard;
        if let Some(at) = free.iter().position(|slot| slot.host.len >= bytes && slot.idle()) {
            return Ok(Some(free.swap_remove(at)));
        }
        if *count >= MAX_SLOTS {
            return Ok(None);
        }
        *count += 1;
        drop(guard);
        let size = bytes.next_power_of_two().clamp(MIN_SLOT_BYTES, MAX_SLOT_BYTES);
        Slot::new(self.context, size).map(Some).inspect_err(|_| lock(&self.slots).1 -= 1)
    }
}

/// Unsupported, saying `why`, when `stream` is being captured into a CUDA graph (queuing nothing,
/// so that the capture goes on).
pub(super) fn refuse_capture(stream: sys::CUstream, why: &str) -> Result<()> {
    let mut capturing = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: valid output slot; a live stream of the current context (the caller's promise).
    check("cuStreamIsCapturing", unsafe { sys::cuStreamIsCapturing(stream, &mut capturing) })?;
    if capturing != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Err(Error::new(Status::Unsupported, why));
    }
    Ok(())
}

/// The table in memory allocated for this call alone, freed in stream order after `launch`.
///
/// # Safety
/// As for [`UploadSlots::with_table`], with the context current.
unsafe fn allocated_table(
    stream: sys::CUstream,
    table: &[u8],
    extra: usize,
    launch: impl FnOnce(sys::CUdeviceptr) -> Result<()>,
) -> Result<()> {
    let mut memory: sys::CUdeviceptr = 0;
    // SAFETY: valid output slot; the stream belongs to the current context.
    check("cuMemAllocAsync", unsafe { sys::cuMemAllocAsync(&mut memory, table.len() + extra, stream) })?;
    // SAFETY: `table` is valid for its length; pageable memory is staged before the call returns.
    let mut result = check("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(memory, table.as_ptr().cast(), table.len(), stream)
    });
    if result.is_ok() {
        result = launch(memory);
    }
    // SAFETY: allocated above on this stream; freed after the launches in stream order.
    let freed = check("cuMemFreeAsync", unsafe { sys::cuMemFreeAsync(memory, stream) });
    result.and(freed)
}
