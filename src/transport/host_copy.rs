//! The host backend's batched copy: the same semantics as the CUDA kernel
//! (`kernels::copy_segments`), with host addresses and `memmove` per contiguous run.

use crate::error::Result;
use crate::segment::check::{check_destinations, validate};
use crate::segment::Segment;

/// Copies every run of every segment, inner level fastest, segments in order.
///
/// `checked`: fail with `Status::Overlap` (copying nothing) when two destination runs share a byte.
/// Unchecked, overlapping destinations are the caller's error: on this backend the later run wins, on
/// the GPU which write wins is undefined. Errors before any byte moves: InvalidArgument for a segment
/// whose size or address range overflows or that has a zero address; Unsupported when the checked mode
/// would have to expand too many interleaved runs.
///
/// # Safety
/// Every source run must be readable and every destination run writable host memory for its `len`
/// bytes, and no destination run may overlap a source run of another segment.
pub unsafe fn copy_segments(segments: &[Segment], checked: bool) -> Result<()> {
    validate(segments)?;
    if checked {
        check_destinations(segments)?;
    }
    copy_runs(segments);
    Ok(())
}

/// The copy itself, for segments already validated (the host backend queues it on a stream).
///
/// # Safety
/// As for [`copy_segments`], and every segment must have passed `validate`.
pub(crate) unsafe fn copy_runs(segments: &[Segment]) {
    for segment in segments {
        segment.for_each_run(|src, dst, len| {
            // SAFETY: the caller's promise; `copy` (memmove) so that a run copied onto itself or an
            // overlapping one is still defined.
            unsafe { std::ptr::copy(src as usize as *const u8, dst as usize as *mut u8, len as usize) };
        });
    }
}
