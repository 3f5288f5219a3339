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

    /// Nanoseconds from `start` to this mark, 0 when this one came first (both recorded on the same
    /// device; waits for them).
    pub fn since(&self, start: &Mark) -> Result<u64> {
        Ok(self.offset_from(start)?.max(0) as u64)
    }

    /// Nanoseconds from `reference` to this mark, negative when this one came first (both recorded
    /// on the same device, possibly on different streams; waits for them).
    pub fn offset_from(&self, reference: &Mark) -> Result<i64> {
        self.wait()?;
        reference.wait()?;
        match (self, reference) {
            (Mark::Cuda { context, event }, Mark::Cuda { event: first, .. }) => {
                let mut ms = 0f32;
                // SAFETY: as in record; both events have completed. The driver gives a negative
                // time when `event` completed before `first`.
                let _current = unsafe { CurrentContext::enter(*context) }?;
                check("cuEventElapsedTime", unsafe { sys::cuEventElapsedTime_v2(&mut ms, *first, *event) })?;
                Ok((f64::from(ms) * 1e6) as i64)
            }
            (Mark::Host { stamp, .. }, Mark::Host { stamp: first, .. }) => {
                // Set by the waits above unless another record came between (one thread uses a mark).
                let unset = || crate::error::Error::invalid_state("a stamp was recorded again while read");
                // One lock at a time: a mark may be its own reference.
                let at = lock(&stamp.at).ok_or_else(unset)?;
                let begin = lock(&first.at).ok_or_else(unset)?;
                Ok(match at.checked_duration_since(begin) {
                    Some(after) => after.as_nanos() as i64,
                    None => -(begin.duration_since(at).as_nanos() as i64),
                })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::host::HostBackend;

    #[test]
    fn host_marks_give_signed_offsets_and_a_mark_is_its_own_reference() {
        let backend = HostBackend::new(1).unwrap();
        let stream = backend.create_stream(0).unwrap();
        let (first, second) = (Mark::new(&backend, 0).unwrap(), Mark::new(&backend, 0).unwrap());
        first.record(stream).unwrap();
        crate::transport::host::host_stream(stream)
            .unwrap()
            .enqueue(|| std::thread::sleep(std::time::Duration::from_millis(2)))
            .unwrap();
        second.record(stream).unwrap();
        assert_eq!(first.offset_from(&first).unwrap(), 0);
        let later = second.offset_from(&first).unwrap();
        assert!(later >= 2_000_000, "{later}");
        assert_eq!(first.offset_from(&second).unwrap(), -later);
        assert_eq!((first.since(&second).unwrap(), second.since(&first).unwrap()), (0, later as u64));
        backend.destroy_stream(0, stream);
    }
}
