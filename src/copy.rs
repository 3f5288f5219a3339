//! The batched copy for one rank of a device group: the batched copy kernel (`kernels`) on the CUDA
//! backend, per-run memmove on the host backend. This is what the C API's `refit_copy_batch*` calls.
//!
//! Host backend: the copy is queued on the host stream like any other host-backend work and the call
//! waits for that stream, so it is complete on return (as every host-backend operation).

use crate::backend::host::host_stream;
use crate::backend::{Backend, BackendKind, Stream};
use crate::error::Result;
use crate::group::Group;
use crate::kernels::check::{check_destinations, validate};
use crate::kernels::{self, PreparedBatch};
use crate::segment::Segment;
use std::sync::{Arc, Mutex};

fn as_cuda_stream(stream: Stream) -> cudarc::driver::sys::CUstream {
    stream.as_ptr().cast()
}

fn device_ordinal(group: &Group, rank: usize) -> Result<(usize, i32)> {
    let device = group.device(rank)?;
    Ok((device, device as i32))
}

/// Copies `segments` on `stream` (a stream of `rank`'s device; `Stream::NULL` for its legacy default
/// stream), with `checked` as in [`kernels::copy_segments`].
///
/// # Safety
/// Every run must name memory that stays valid until the copy has run (device memory on the CUDA
/// backend, reachable from the rank's device; host memory on the host backend), and `stream` must be
/// a live stream of the rank's device.
pub unsafe fn copy_batch(
    group: &Group,
    rank: usize,
    stream: Stream,
    segments: &[Segment],
    checked: bool,
) -> Result<()> {
    let (device, ordinal) = device_ordinal(group, rank)?;
    match group.backend_kind() {
        BackendKind::Cuda => kernels::copy_segments(ordinal, as_cuda_stream(stream), segments, checked),
        BackendKind::Host => {
            validate(segments)?;
            if checked {
                check_destinations(segments)?;
            }
            host_copy(group.backend().as_ref(), device, stream, segments)
        }
    }
}

unsafe fn host_copy(
    backend: &dyn Backend,
    device: usize,
    stream: Stream,
    segments: &[Segment],
) -> Result<()> {
    backend.copy_segments(device, stream, segments)?;
    backend.sync_stream(device, stream)
}

/// A batch prepared for one rank's device and launched any number of times (see
/// [`kernels::PreparedBatch`]). It holds no reference to the group, only to its backend and device.
pub enum PreparedCopy {
    Cuda(PreparedBatch),
    Host {
        backend: Arc<dyn Backend>,
        device: usize,
        segments: Arc<Vec<Segment>>,
        /// With [`PreparedCopy::recording_digests`]: one digest per segment of the source bytes the
        /// last launch read (see `verify::host_digest`).
        source_digests: Option<Arc<Mutex<Vec<u64>>>>,
    },
}

impl PreparedCopy {
    /// Validates (and with `checked`, checks destinations of) `segments` and prepares them for
    /// `rank`'s device: uploaded descriptors on CUDA, a kept copy of the list on the host backend.
    pub fn new(group: &Group, rank: usize, segments: &[Segment], checked: bool) -> Result<PreparedCopy> {
        PreparedCopy::prepare(group, rank, segments, checked, false)
    }

    /// As [`PreparedCopy::new`], and every launch also records digests of the source bytes it reads,
    /// against which [`crate::verify::PreparedVerify::for_copy`] checks the destinations without
    /// reading the sources again (on CUDA: per tile of the batched copy, from the elements in
    /// registers, no extra memory traffic).
    pub fn recording_digests(
        group: &Group,
        rank: usize,
        segments: &[Segment],
        checked: bool,
    ) -> Result<PreparedCopy> {
        PreparedCopy::prepare(group, rank, segments, checked, true)
    }

    fn prepare(
        group: &Group,
        rank: usize,
        segments: &[Segment],
        checked: bool,
        digests: bool,
    ) -> Result<PreparedCopy> {
        let (device, ordinal) = device_ordinal(group, rank)?;
        match (group.backend_kind(), digests) {
            (BackendKind::Cuda, false) => {
                Ok(PreparedCopy::Cuda(PreparedBatch::new(ordinal, segments, checked)?))
            }
            (BackendKind::Cuda, true) => {
                Ok(PreparedCopy::Cuda(PreparedBatch::recording_digests(ordinal, segments, checked)?))
            }
            (BackendKind::Host, _) => {
                validate(segments)?;
                if checked {
                    check_destinations(segments)?;
                }
                Ok(PreparedCopy::Host {
                    backend: Arc::clone(group.backend()),
                    device,
                    segments: Arc::new(segments.to_vec()),
                    source_digests: digests.then(|| Arc::new(Mutex::new(Vec::new()))),
                })
            }
        }
    }

    /// Queues the batch on `stream` (a stream of the prepared device). On CUDA: one kernel launch,
    /// graph-capturable. On the host backend: complete on return.
    ///
    /// # Safety
    /// As for [`copy_batch`], at every launch.
    pub unsafe fn launch(&self, stream: Stream) -> Result<()> {
        match self {
            PreparedCopy::Cuda(batch) => batch.launch(as_cuda_stream(stream)),
            PreparedCopy::Host { backend, device, segments, source_digests } => {
                if let Some(slot) = source_digests {
                    let (segments, slot) = (Arc::clone(segments), Arc::clone(slot));
                    let queue = host_stream(if stream == Stream::NULL {
                        backend.null_stream(*device)
                    } else {
                        stream
                    })?;
                    // Queued before the copy on the same stream: the digests are of what the copy reads.
                    queue.enqueue(move || {
                        let digests = segments.iter().map(|s| crate::verify::host_digest(s, false)).collect();
                        *slot.lock().unwrap_or_else(|p| p.into_inner()) = digests;
                    })?;
                }
                host_copy(backend.as_ref(), *device, stream, segments)
            }
        }
    }
}
