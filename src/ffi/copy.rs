//! The batched copy's C API: one-shot and prepared batches for one rank of a group.

// Raw pointers are the C ABI: handles are looked up (`live`), other pointers checked for NULL by
// `slice`/`out` and their validity is the caller's documented promise, so these safe `extern "C"`
// functions pass them on by design.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::handles::{destroy, live, publish};
use super::{boundary, out, slice};
use crate::error::Status;
use crate::error::{Error, Result};
use crate::ffi::group::refit_group;
use crate::group::Group;
use crate::segment::check::validate;
use crate::segment::{Segment, Side};
use crate::transport::access::first_unusable;
use crate::transport::{PreparedCopy, Stream};
use std::ffi::c_void;

/// refit_copy_batch* flag: before copying anything, check that no destination byte is written twice
/// and fail with REFIT_STATUS_OVERLAP if one is. Without it, overlapping destinations are the caller's
/// error (on a GPU which write lands is undefined), except within one segment that surely writes a
/// byte twice (a level repeated at destination stride 0, or runs closer than their length): that is
/// REFIT_STATUS_OVERLAP with or without the flag, found in constant time per segment.
pub const REFIT_COPY_CHECKED: u32 = 1;

/// A batch of segments prepared for one device (refit_copy_batch_prepare): launched any number of times
/// with no host work proportional to its size.
///
/// Thread-safety: refit_copy_batch_launch may be called from several threads at once (on streams of
/// the batch's device); refit_copy_batch_destroy must not race with a launch.
pub struct refit_prepared_copy {
    batch: Box<dyn PreparedCopy>,
}

fn checked_flag(flags: u32) -> Result<bool> {
    if flags & !REFIT_COPY_CHECKED != 0 {
        return Err(Error::invalid_argument(format!(
            "flags = {flags:#x} has bits other than REFIT_COPY_CHECKED"
        )));
    }
    Ok(flags & REFIT_COPY_CHECKED != 0)
}

/// INVALID_ARGUMENT unless every byte `segments` read or write is memory `device` can use (see
/// `Backend::inaccessible`: on CUDA, its own memory or a peer's it accesses directly).
fn check_memory(group: &Group, device: i32, segments: &[Segment]) -> Result<()> {
    validate(segments)?;
    let owners = |_| (Some(device), Some(device));
    let Some(bad) = first_unusable(group.backend().as_ref(), segments, owners, true)? else { return Ok(()) };
    let side = if bad.side == Side::Source { "source" } else { "destination" };
    let (addr, len) = bad.range;
    crate::bail!(
        Status::InvalidArgument,
        "segment {}: its {side} [{addr:#x}, +{len:#x}) is not memory device {device} can use: {:#x} {}",
        bad.segment,
        bad.refusal.at,
        bad.refusal.why
    )
}

/// Copies `n` segments (see refit_segment) on `stream`, a stream of `rank`'s device (NULL: its legacy
/// default stream), in one kernel launch on the CUDA backend. Source and destination addresses are
/// device pointers of that device or of a peer the rank's device accesses directly
/// (refit_group_peer_access); any sizes and byte offsets, zero-length segments allowed. `flags`:
/// 0 or REFIT_COPY_CHECKED. Every call checks every segment's memory first (host work per segment
/// and per allocation touched; prepare a batch to pay it once): on CUDA every byte must lie in a
/// live allocation of the rank's device or of a device it accesses directly (a range may run from
/// one allocation into the next where they meet); host memory from malloc, page-locked host memory
/// and unmapped or freed addresses are INVALID_ARGUMENT naming the segment, side and address. On
/// the host backend every byte must lie in memory the process has mapped (its mappings read from
/// /proc/self/maps at each check), readable for a source and writable for a destination: unmapped
/// and freed addresses, guard pages, read-only memory written and the first page (below 4096) are
/// refused alike.
///
/// Stream ordering (CUDA): queued on `stream`; returns without waiting for the copy. The descriptors
/// are uploaded stream-ordered (no host sync) into memory that later calls reuse, so a stream being
/// captured into a CUDA graph is refused (UNSUPPORTED, nothing queued: capture refit_copy_batch_launch).
/// Host backend: complete on return.
///
/// Thread-safety: may be called from any thread, including rank callbacks, concurrently with other
/// copies. No source may overlap a destination.
///
/// Errors: NULL_ARGUMENT (group, or segments with n > 0), INVALID_ARGUMENT (rank not below the group
/// size, unknown flag bits, a segment whose size or address range overflows 64 bits or has a zero
/// address, memory that is not the device's (above), on the host backend a stream that is not a host stream or is another simulated
/// device's), OVERLAP (REFIT_COPY_CHECKED and two destination runs share a byte; a segment that surely
/// writes a byte twice, with or without it), UNSUPPORTED (checked mode over more interleaved runs
/// than it visits; a stream under graph capture), NVRTC_UNAVAILABLE / KERNEL_LOAD_FAILED (the kernel could not be compiled or
/// loaded at first use on the device), CUDA_ERROR, OUT_OF_MEMORY.
#[no_mangle]
pub extern "C" fn refit_copy_batch(
    group: *const refit_group,
    rank: u32,
    stream: *mut c_void,
    segments: *const Segment,
    n: usize,
    flags: u32,
) -> crate::error::Status {
    boundary("refit_copy_batch", || {
        let handle = live(group, "group")?;
        let group = &handle.group;
        // SAFETY: NULL or n readable segments (the caller's promise).
        let segments = unsafe { slice(segments, n, "segments") }?;
        let checked = checked_flag(flags)?;
        let device = group.device(rank as usize)?;
        check_memory(group, device, segments)?;
        // SAFETY: the caller's promise on addresses and stream, documented above.
        unsafe { group.backend().copy_batch(device, Stream::from_ptr(stream), segments, checked) }
    })
}

/// Prepares `n` segments for repeated copies on `rank`'s device: checks them (as refit_copy_batch, with
/// `flags`, their memory included: once, here, never at a launch), lays them out and uploads the descriptors to device memory. Blocking; not ordered with any
/// stream. The addresses are fixed from now on; the bytes are read at each launch. The batch does not
/// keep the group alive but must be destroyed before the device's memory it names is freed.
/// Thread-safety: as refit_copy_batch.
///
/// Errors: as refit_copy_batch (NULL_ARGUMENT also for `batch`).
#[no_mangle]
pub extern "C" fn refit_copy_batch_prepare(
    group: *const refit_group,
    rank: u32,
    segments: *const Segment,
    n: usize,
    flags: u32,
    batch: *mut *mut refit_prepared_copy,
) -> crate::error::Status {
    boundary("refit_copy_batch_prepare", || {
        let slot = out(batch, "batch")?;
        let handle = live(group, "group")?;
        let group = &handle.group;
        // SAFETY: NULL or n readable segments (the caller's promise).
        let segments = unsafe { slice(segments, n, "segments") }?;
        let checked = checked_flag(flags)?;
        let device = group.device(rank as usize)?;
        check_memory(group, device, segments)?;
        let prepared = group.backend().prepare_batch(device, segments, checked)?;
        slot.write(publish(refit_prepared_copy { batch: prepared }));
        Ok(())
    })
}

/// Queues a prepared batch on `stream`, a stream of the batch's device (NULL: its legacy default
/// stream). CUDA backend: one kernel launch and nothing else (no allocation, no host-to-device copy,
/// no synchronization, constant host time whatever the batch size), so it may be captured into a CUDA
/// graph; returns without waiting. Host backend: complete on return.
///
/// Errors: NULL_ARGUMENT (batch), INVALID_ARGUMENT (on the host backend, a stream that is not a host
/// stream), CUDA_ERROR (e.g. a stream of another device).
#[no_mangle]
pub extern "C" fn refit_copy_batch_launch(
    batch: *const refit_prepared_copy,
    stream: *mut c_void,
) -> crate::error::Status {
    boundary("refit_copy_batch_launch", || {
        let batch = live(batch, "batch")?;
        // SAFETY: the caller keeps the named memory valid and passes a stream of the batch's device.
        unsafe { batch.batch.launch(Stream::from_ptr(stream)) }
    })
}

/// Releases a prepared batch (NULL is ignored). On CUDA the descriptor memory is freed at once: call it
/// only when no launch of the batch (or a graph replaying one) can still run.
#[no_mangle]
pub extern "C" fn refit_copy_batch_destroy(batch: *mut refit_prepared_copy) {
    destroy(batch, "refit_copy_batch_destroy")
}
