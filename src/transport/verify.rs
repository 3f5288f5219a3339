//! Verifying copies on one device: after the copies, check on the device (on its stream) that every
//! segment's destination bytes are its source bytes, and report the first segment that is not. The
//! executor's verify stage is built on it.
//!
//! Two forms, on both backends:
//! - [`PreparedVerify::new`]: compare every destination byte with its source byte. Exact; reads both
//!   sides (on CUDA about as much memory traffic as the copy itself).
//! - [`PreparedVerify::for_copy`]: for a batch from [`Backend::prepare_recording_batch`], digest the
//!   destinations and compare with the digests the copy recorded of the sources it read. Reads only the
//!   destinations (about half the copy's traffic); a difference is missed only when it leaves a digest
//!   unchanged: never for one changed element (one to 16 bytes, as the copy moved them), about one
//!   chance in 2^64 otherwise. This is the form that keeps a verified step within 60% of a plain one.
//!
//! CUDA: `kernels::verify::VerifyBatch` (the batched copy kernel's walk); host backend:
//! [`super::host_verify`], queued on the host stream (not complete on return).
//!
//! [`Backend::prepare_recording_batch`]: super::Backend::prepare_recording_batch

use super::{Backend, PreparedCheck, PreparedCopy, Stream};
use crate::error::Result;
use crate::segment::Segment;

/// A verify prepared for one device: built once (descriptors uploaded once on CUDA), launched
/// on a stream after each copy it verifies, its outcome read after that stream has been synchronized.
/// The launch's host work does not depend on the number of segments. Launches of one verify must not
/// overlap in time (they share the outcome).
pub struct PreparedVerify {
    check: Box<dyn PreparedCheck>,
}

impl PreparedVerify {
    /// A verify comparing the destination of every segment with its source on `backend`'s `device`
    /// (a group's rank: `group.backend()` and `group.device(rank)`). Addresses as for the batched
    /// copy (the device, or a peer it reaches directly). Errors: InvalidDevice, InvalidArgument (a
    /// segment whose size or addresses overflow or that has a zero address), those of loading the
    /// kernel on CUDA (NvrtcUnavailable, KernelLoadFailed), CudaError.
    pub fn new(backend: &dyn Backend, device: i32, segments: &[Segment]) -> Result<PreparedVerify> {
        Ok(PreparedVerify { check: backend.prepare_compare(device, segments)? })
    }

    /// A verify of `copy`'s destinations against the digests of the sources it read; `copy` must come
    /// from `Backend::prepare_recording_batch` (else InvalidArgument). Launch it after each launch of
    /// the copy, ordered after it (the same stream, or an event). Shares the copy's descriptors.
    pub fn for_copy(copy: &dyn PreparedCopy) -> Result<PreparedVerify> {
        Ok(PreparedVerify { check: copy.verify_destinations()? })
    }

    /// Queues the verify on `stream` (a stream of the device; `Stream::NULL`: its legacy default
    /// stream): it checks what the memory holds when the stream reaches it, and returns without
    /// waiting. CUDA: a memset, one kernel, an 8-byte copy to page-locked memory; no allocation, no
    /// synchronization (graph-capturable). Errors: CudaError; on the host backend InvalidArgument for
    /// a stream that is not a host stream.
    ///
    /// # Safety
    /// Every segment's source (for [`PreparedVerify::new`]) and destination is readable until the
    /// verify has run; `stream` is a live stream of the device.
    pub unsafe fn launch(&self, stream: Stream) -> Result<()> {
        self.check.launch(stream)
    }

    /// After the stream of the last launch has been synchronized: the index of the first segment whose
    /// destination differs from its source, or None when all match. Resets for the next launch.
    /// InvalidState when no launch has completed since the last outcome (not launched, or its stream
    /// not synchronized yet).
    pub fn outcome(&self) -> Result<Option<usize>> {
        self.check.outcome()
    }
}
