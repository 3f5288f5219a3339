//! Verifying copies for one rank of a device group: after the copies, check on the device (on its
//! stream) that every segment's destination bytes are its source bytes, and report the first segment
//! that is not. The executor's verify stage is built on it.
//!
//! Two forms, on both backends:
//! - [`PreparedVerify::new`]: compare every destination byte with its source byte. Exact; reads both
//!   sides (on CUDA about as much memory traffic as the copy itself).
//! - [`PreparedVerify::for_copy`]: for a [`PreparedCopy::recording_digests`] copy, digest the
//!   destinations and compare with the digests the copy recorded of the sources it read. Reads only the
//!   destinations (about half the copy's traffic); a difference is missed only when it leaves a digest
//!   unchanged: never for one changed element (a byte up to 16 bytes, as the copy moved it), about one
//!   chance in 2^64 otherwise. This is the form that keeps verify within 60% of a copy step.
//!
//! CUDA: `kernels::verify::VerifyBatch` (the batched copy kernel's walk). Host backend: the same checks
//! in Rust, queued on the host stream (not complete on return), so stream ordering is as real as on a
//! GPU.

use crate::backend::host::host_stream;
use crate::backend::{Backend, BackendKind, Stream};
use crate::copy::PreparedCopy;
use crate::error::{Error, Result};
use crate::group::Group;
use crate::kernels::check::validate;
use crate::kernels::gf64;
use crate::kernels::verify::VerifyBatch;
use crate::segment::Segment;
use std::sync::{Arc, Mutex};

/// A verify prepared for one rank's device: built once (descriptors uploaded once on CUDA), launched
/// on a stream after each copy it verifies, its outcome read after that stream has been synchronized.
/// The launch's host work does not depend on the number of segments. Launches of one verify must not
/// overlap in time (they share the result).
pub enum PreparedVerify {
    Cuda(VerifyBatch),
    Host(HostVerify),
}

/// The host backend's verify: the segments, what to compare them with, and the last launch's result.
pub struct HostVerify {
    backend: Arc<dyn Backend>,
    device: usize,
    segments: Arc<Vec<Segment>>,
    /// For [`PreparedVerify::for_copy`]: the copy's record of its sources' digests.
    recorded: Option<Arc<Mutex<Vec<u64>>>>,
    /// The last launch's outcome, once its stream has run it.
    result: Arc<Mutex<Option<Option<usize>>>>,
}

impl PreparedVerify {
    /// A verify comparing the destination of every segment with its source on `rank`'s device.
    /// Addresses as for `copy::copy_batch` (the rank's device, or a peer it reaches directly).
    /// Errors: InvalidArgument (rank, a segment whose size or addresses overflow or that has a zero
    /// address), those of loading the kernel on CUDA (NvrtcUnavailable, KernelLoadFailed), CudaError.
    pub fn new(group: &Group, rank: usize, segments: &[Segment]) -> Result<PreparedVerify> {
        let device = group.device(rank)?;
        match group.backend_kind() {
            BackendKind::Cuda => Ok(PreparedVerify::Cuda(VerifyBatch::compare(device as i32, segments)?)),
            BackendKind::Host => {
                validate(segments)?;
                Ok(PreparedVerify::Host(HostVerify {
                    backend: Arc::clone(group.backend()),
                    device,
                    segments: Arc::new(segments.to_vec()),
                    recorded: None,
                    result: Arc::new(Mutex::new(None)),
                }))
            }
        }
    }

    /// A verify of `copy`'s destinations against the digests of the sources it read, which `copy` must
    /// record ([`PreparedCopy::recording_digests`], else InvalidArgument). Launch it after each launch
    /// of the copy, ordered after it (the same stream, or an event). Shares the copy's descriptors.
    pub fn for_copy(copy: &PreparedCopy) -> Result<PreparedVerify> {
        match copy {
            PreparedCopy::Cuda(batch) => Ok(PreparedVerify::Cuda(VerifyBatch::check(batch)?)),
            PreparedCopy::Host { backend, device, segments, source_digests } => {
                let recorded = source_digests.as_ref().ok_or_else(|| {
                    Error::invalid_argument(
                        "the copy does not record source digests (prepare it with PreparedCopy::recording_digests)",
                    )
                })?;
                Ok(PreparedVerify::Host(HostVerify {
                    backend: Arc::clone(backend),
                    device: *device,
                    segments: Arc::clone(segments),
                    recorded: Some(Arc::clone(recorded)),
                    result: Arc::new(Mutex::new(None)),
                }))
            }
        }
    }

    /// Queues the verify on `stream` (a stream of the rank's device; `Stream::NULL`: its legacy default
    /// stream): it compares what the memory holds when the stream reaches it. Returns without waiting.
    /// CUDA: a memset, one kernel, an 8-byte copy to page-locked memory; no allocation, no
    /// synchronization (graph-capturable). Errors: CudaError; on the host backend InvalidArgument for a
    /// stream that is not a host stream.
    ///
    /// # Safety
    /// Every segment's source and destination must be readable until the verify has run; `stream` is
    /// a live stream of the device.
    pub unsafe fn launch(&self, stream: Stream) -> Result<()> {
        match self {
            PreparedVerify::Cuda(verify) => verify.launch(stream.as_ptr().cast()),
            PreparedVerify::Host(verify) => {
                let stream =
                    if stream == Stream::NULL { verify.backend.null_stream(verify.device) } else { stream };
                let queue = host_stream(stream)?;
                *verify.result.lock().unwrap_or_else(|p| p.into_inner()) = None;
                let (segments, recorded, result) =
                    (Arc::clone(&verify.segments), verify.recorded.clone(), Arc::clone(&verify.result));
                queue.enqueue(move || {
                    let first_bad = match recorded {
                        Some(recorded) => {
                            let recorded = recorded.lock().unwrap_or_else(|p| p.into_inner());
                            segments.iter().enumerate().position(|(i, s)| {
                                recorded.get(i).is_none_or(|&digest| digest != host_digest(s, true))
                            })
                        }
                        None => segments.iter().position(|s| !host_matches(s)),
                    };
                    *result.lock().unwrap_or_else(|p| p.into_inner()) = Some(first_bad);
                })
            }
        }
    }

    /// After the stream of the last launch has been synchronized: the index of the first segment whose
    /// destination differs from its source, or None when all match. Resets for the next launch.
    /// InvalidState when no launch has completed since the last outcome (not launched, or its stream
    /// not synchronized yet).
    pub fn outcome(&self) -> Result<Option<usize>> {
        match self {
            PreparedVerify::Cuda(verify) => verify.outcome(),
            PreparedVerify::Host(verify) => verify.result.lock().unwrap_or_else(|p| p.into_inner()).take().ok_or_else(
                || {
                    Error::invalid_state(
                        "no verify result: launch the verify and synchronize its stream before asking for the outcome",
                    )
                },
            ),
        }
    }
}

/// Every contiguous run of `segment` on one side, as host bytes.
///
/// # Safety
/// The runs are readable host memory (the host backend's promise) and the segment was validated.
unsafe fn for_each_host_run(segment: &Segment, destination: bool, mut f: impl FnMut(&[u8], &[u8])) {
    segment.for_each_run(|src, dst, len| {
        // SAFETY: the caller's promise.
        let (s, d) = unsafe {
            (
                std::slice::from_raw_parts(src as usize as *const u8, len as usize),
                std::slice::from_raw_parts(dst as usize as *const u8, len as usize),
            )
        };
        if destination {
            f(d, s)
        } else {
            f(s, d)
        }
    });
}

/// The host backend's digest of one side of a segment: the runs' digests (`gf64::digest`) folded in
/// order through a bijection, so one changed run always changes it.
pub(crate) fn host_digest(segment: &Segment, destination: bool) -> u64 {
    let mut digest = 0u64;
    // SAFETY: host-backend segments name host memory and were validated when prepared.
    unsafe {
        for_each_host_run(segment, destination, |run, _| {
            digest = (digest ^ gf64::digest(run)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            digest ^= digest >> 29;
        })
    };
    digest
}

/// Whether every destination byte of `segment` equals its source byte (host backend).
fn host_matches(segment: &Segment) -> bool {
    let mut equal = true;
    // SAFETY: as in host_digest.
    unsafe { for_each_host_run(segment, false, |src, dst| equal &= src == dst) };
    equal
}
