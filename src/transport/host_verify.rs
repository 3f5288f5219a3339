//! The host backend's verify: the checks of `kernels::verify` in Rust, queued on a host stream like any
//! other host-backend work (not complete on return), so stream ordering is as real as on a GPU.

use super::host::stream_for;
use super::{PreparedCheck, PreparedDigestCheck, PreparedRecord, Stream};
use crate::error::{Error, Result};
use crate::kernels::gf64;
use crate::segment::{Segment, Side};
use crate::sync::lock;
use std::sync::{Arc, Mutex};

/// What a [`HostCheck`] compares each segment's destination with.
#[derive(Clone)]
pub(crate) enum Reference {
    /// Its source bytes.
    Sources,
    /// The digests a recording batch made of its source bytes at its last launch.
    Recorded(Arc<Mutex<Vec<u64>>>),
}

/// A prepared verify on the host backend.
pub(crate) struct HostCheck {
    /// What a NULL stream stands for: the prepared device's default stream.
    pub default_stream: Stream,
    pub segments: Arc<Vec<Segment>>,
    pub reference: Reference,
    /// The last launch's outcome, once its stream has run it.
    pub result: Arc<Mutex<Option<Option<usize>>>>,
}

impl PreparedCheck for HostCheck {
    unsafe fn launch(&self, stream: Stream) -> Result<()> {
        let queue = stream_for(self.default_stream, stream)?;
        *lock(&self.result) = None;
        let (segments, reference, result) =
            (Arc::clone(&self.segments), self.reference.clone(), Arc::clone(&self.result));
        queue.enqueue(move || {
            let first_bad = match reference {
                Reference::Recorded(recorded) => {
                    let recorded = lock(&recorded);
                    segments.iter().enumerate().position(|(i, s)| {
                        recorded.get(i).is_none_or(|&digest| digest != segment_digest(s, Side::Destination))
                    })
                }
                Reference::Sources => segments.iter().position(|s| !segment_matches(s)),
            };
            *lock(&result) = Some(first_bad);
        })
    }

    fn outcome(&self) -> Result<Option<usize>> {
        lock(&self.result).take().ok_or_else(|| {
            Error::invalid_state(
                "no verify result: launch the verify and synchronize its stream before asking for the outcome",
            )
        })
    }
}

/// The bytes of a run at `addr`.
///
/// # Safety
/// `len` bytes at `addr` are readable host memory (the host backend's promise for the side read).
unsafe fn run_bytes<'a>(addr: u64, len: u64) -> &'a [u8] {
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts(addr as usize as *const u8, len as usize) }
}

/// A digest of one side of a segment: its runs' digests (`gf64::digest`) folded in order through a
/// bijection, so one changed run always changes it. Reads only that side (the other may be another
/// process's addresses).
pub(crate) fn segment_digest(segment: &Segment, side: Side) -> u64 {
    let mut digest = 0u64;
    segment.for_each_run(|src, dst, len| {
        let at = if side == Side::Source { src } else { dst };
        // SAFETY: host-backend segments name host memory on the side read, validated when prepared.
        let run = unsafe { run_bytes(at, len) };
        digest = (digest ^ gf64::digest(run)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        digest ^= digest >> 29;
    });
    digest
}

/// Whether every destination byte of `segment` equals its source byte.
fn segment_matches(segment: &Segment) -> bool {
    let mut equal = true;
    // SAFETY: as in segment_digest, both sides.
    segment.for_each_run(|src, dst, len| equal &= unsafe { run_bytes(src, len) == run_bytes(dst, len) });
    equal
}

/// The host backend's source digests for a check elsewhere: one per segment, as a recording batch
/// takes them, queued on a host stream.
pub(crate) struct HostRecord {
    pub default_stream: Stream,
    pub segments: Arc<Vec<Segment>>,
    /// The last launch's digests, once its stream has run it.
    pub digests: Arc<Mutex<Option<Vec<u64>>>>,
}

impl PreparedRecord for HostRecord {
    unsafe fn launch(&self, stream: Stream) -> Result<()> {
        let queue = stream_for(self.default_stream, stream)?;
        *lock(&self.digests) = None;
        let (segments, digests) = (Arc::clone(&self.segments), Arc::clone(&self.digests));
        queue.enqueue(move || {
            let taken = segments.iter().map(|s| segment_digest(s, Side::Source)).collect();
            *lock(&digests) = Some(taken);
        })
    }

    fn digests(&self) -> Result<Vec<u64>> {
        lock(&self.digests).clone().ok_or_else(|| {
            Error::invalid_state("no digests: launch the record and synchronize its stream first")
        })
    }
}

impl PreparedDigestCheck for HostCheck {
    fn expect(&self, digests: &[u64]) -> Result<()> {
        let Reference::Recorded(expected) = &self.reference else {
            return Err(Error::invalid_state("this check compares with the sources, not with digests"));
        };
        if digests.len() != self.segments.len() {
            return Err(Error::invalid_argument(format!(
                "{} digests for a check of {} segments: they were not recorded from the same segments",
                digests.len(),
                self.segments.len()
            )));
        }
        *lock(expected) = digests.to_vec();
        Ok(())
    }
}
