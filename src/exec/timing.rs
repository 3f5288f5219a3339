//! Device-side time stamps for the executor's stages: CUDA events with timing on the CUDA backend,
//! and on the host backend a stamp taken by the stream's worker when it reaches the mark (the same
//! meaning: when the stream got there). Marks are reused call after call.

use crate::error::Result;
use crate::sync::{lock, wait};
use crate::transport::driver::{check, primary_context, CurrentContext};
use crate::transport::host::host_stream;
use crate::transport::{Backend, BackendKind, Stream};
use cudarc::driver::sys;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// A host-backend stamp: None from the record until the stream reaches it.
#[derive(Default)]
pub(crate) struct HostStamp {
    at: Mutex<Option<Instant>>,
    reached: Condvar,
}

pub(crate) enum Mark {
    Cuda { context: sys::CUcontext, event: sys::CUevent },
    Host { stamp: Arc<HostStamp>, null_stream: Stream },
}

// SAFETY: a CUevent and its context are driver handles usable from any thread.
unsafe impl Send for Mark {}
unsafe impl Sync for Mark {}

impl Mark {
    /// A mark on `device`.
    pub fn new(backend: &dyn Backend, device: i32) -> Result<Mark> {
        match backend.kind() {
            BackendKind::Cuda => {
                let context = primary_context(device)?;
                // SAFETY: a retained primary context.
                let _current = unsafe { CurrentContext::enter(context) }?;
                let mut event = std::ptr::null_mut();
                // SAFETY: valid output slot, context current. Default flags: timing enabled.
                check("cuEventCreate", unsafe { sys::cuEventCreate(&mut event, 0) })?;
                Ok(Mark::Cuda { context, event })
            }
            BackendKind::Host => {
                Ok(Mark::Host { stamp: Arc::default(), null_stream: backend.null_stream(device) })
            }
        }
    }

    /// Stamps the point `stream` (of the mark's device) has reached in its queue.
    pub fn record(&self, stream: Stream) -> Result<()> {
        match self {
            Mark::Cuda { context, event } => {
                // SAFETY: a retained primary context; an event of it; the caller's stream of it.
                let _current = unsafe { CurrentContext::enter(*context) }?;
                check("cuEventRecord", unsafe { sys::cuEventRecord(*event, stream.as_ptr().cast()) })
            }
            Mark::Host { stamp, null_stream } => {
                *lock(&stamp.at) = None;
                let stamp = Arc::clone(stamp);
                let stream = if stream == Stream::NULL { *null_stream } else { stream };
                host_stream(stream)?.enqueue(move || {
                    *lock(&stamp.at) = Some(Instant::now());
                    stamp.reached.notify_all();
                })
            }
        }
    }

    /// Blocks the host until the stream has reached the latest record.
    pub fn wait(&self) -> Result<()> {
        match self {
            Mark::Cuda { context, event } => {
                // SAFETY: as in record.
                let _current = unsafe { CurrentContext::enter(*context) }?;
                check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(*event) })
            }
            Mark::Host { stamp, .. } => {
                let mut at = lock(&stamp.at);
                while at.is_none() {
                    at = wait(&stamp.reached, at);
                }
                Ok(())
            }
        }
    }

    /// Nanoseconds from `start` to this mark (both recorded on the same device, waited for).
    pub fn since(&self, start: &Mark) -> Result<u64> {
        self.wait()?;
        start.wait()?;
        match (self, start) {
            (Mark::Cuda { context, event }, Mark::Cuda { event: first, .. }) => {
                let mut ms = 0f32;
                // SAFETY: as in record; both events have completed.
                let _current = unsafe { CurrentContext::enter(*context) }?;
                check("cuEventElapsedTime", unsafe { sys::cuEventElapsedTime_v2(&mut ms, *first, *event) })?;
                Ok((f64::from(ms.max(0.0)) * 1e6) as u64)
            }
            (Mark::Host { stamp, .. }, Mark::Host { stamp: first, .. }) => {
                // Set by the waits above unless another record came between (one thread uses a mark).
                let unset = || crate::error::Error::invalid_state("a stamp was recorded again while read");
                let end = lock(&stamp.at).ok_or_else(unset)?;
                let begin = lock(&first.at).ok_or_else(unset)?;
                Ok(end.saturating_duration_since(begin).as_nanos() as u64)
            }
            _ => Err(crate::error::Error::invalid_state("marks of different backends")),
        }
    }
}

impl Drop for Mark {
    fn drop(&mut self) {
        if let Mark::Cuda { context, event } = self {
            // SAFETY: a retained primary context and its event, destroyed once.
            if let Ok(_current) = unsafe { CurrentContext::enter(*context) } {
                let _ = unsafe { sys::cuEventDestroy_v2(*event) };
            }
        }
    }
}
