//! Stand-in for the verify primitive (`PreparedVerify`, from the kernel work on `wip/kernels`), with
//! its interface: prepared once for a rank's segments, launched on a stream, its outcome read after
//! the stream has passed it. This one compares on the host backend only; on CUDA it is Unsupported
//! until the device primitive replaces it (the executor uses nothing else of it).

use crate::error::{Error, Result};
use crate::group::Group;
use crate::segment::Segment;
use crate::transport::host::host_stream;
use crate::transport::{BackendKind, Stream};
use std::sync::{Arc, Mutex};

/// `None` until a launch has run; then the index of the first segment whose destination differs
/// from its source, if any.
type Outcome = Arc<Mutex<Option<Option<usize>>>>;

pub(crate) struct PreparedVerify {
    segments: Arc<Vec<Segment>>,
    null_stream: Stream,
    outcome: Outcome,
}

impl PreparedVerify {
    pub fn new(group: &Group, rank: usize, segments: &[Segment]) -> Result<PreparedVerify> {
        let device = group.device(rank)?;
        if group.backend_kind() == BackendKind::Cuda {
            return Err(Error::unsupported(
                "verify on the GPU needs the device verify primitive, which this build does not have yet",
            ));
        }
        Ok(PreparedVerify {
            segments: Arc::new(segments.to_vec()),
            null_stream: group.backend().null_stream(device),
            outcome: Arc::default(),
        })
    }

    /// Queues the comparison of every destination run with its source run on `stream`.
    ///
    /// # Safety
    /// Every segment's memory must stay valid until the comparison has run.
    pub unsafe fn launch(&self, stream: Stream) -> Result<()> {
        *self.outcome.lock().unwrap_or_else(|p| p.into_inner()) = None;
        let (segments, outcome) = (Arc::clone(&self.segments), Arc::clone(&self.outcome));
        let stream = if stream == Stream::NULL { self.null_stream } else { stream };
        host_stream(stream)?.enqueue(move || {
            let first_bad = segments.iter().position(|segment| {
                let mut differs = false;
                segment.for_each_run(|src, dst, len| {
                    // SAFETY: the caller keeps both runs valid until this has run.
                    let (a, b) = unsafe {
                        (
                            std::slice::from_raw_parts(src as usize as *const u8, len as usize),
                            std::slice::from_raw_parts(dst as usize as *const u8, len as usize),
                        )
                    };
                    differs |= a != b;
                });
                differs
            });
            *outcome.lock().unwrap_or_else(|p| p.into_inner()) = Some(first_bad);
        })
    }

    /// After the stream has passed the launch: the first segment whose bytes differ, if any.
    pub fn outcome(&self) -> Result<Option<usize>> {
        self.outcome
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .ok_or_else(|| Error::invalid_state("the verify stage has not run yet"))
    }
}
