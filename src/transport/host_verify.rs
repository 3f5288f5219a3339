//! The host backend's verify: the checks of `kernels::verify` in Rust, queued on a host stream like any
//! other host-backend work (not complete on return), so stream ordering is as real as on a GPU.

use super::host::host_stream;
use super::{PreparedCheck, Stream};
use crate::error::{Error, Result};
use crate::kernels::gf64;
use crate::segment::Segment;
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
        let queue = host_stream(if stream == Stream::NULL { self.default_stream } else { stream })?;
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

/// Which side of a segment to read.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Source,
    Destination,
}

/// Every contiguous run of `segment` as (side's bytes, other side's bytes).
///
/// # Safety
/// The runs are readable host memory (the host backend's promise) and the segment was validated.
unsafe fn for_each_run(segment: &Segment, side: Side, mut f: impl FnMut(&[u8], &[u8])) {
    segment.for_each_run(|src, dst, len| {
        // SAFETY: the caller's promise.
        let (s, d) = unsafe {
            (
                std::slice::from_raw_parts(src as usize as *const u8, len as usize),
                std::slice::from_raw_parts(dst as usize as *const u8, len as usize),
            )
        };
        match side {
            Side::Source => f(s, d),
            Side::Destination => f(d, s),
        }
    });
}

/// A digest of one side of a segment: its runs' digests (`gf64::digest`) folded in order through a
/// bijection, so one changed run always changes it.
pub(crate) fn segment_digest(segment: &Segment, side: Side) -> u64 {
    let mut digest = 0u64;
    // SAFETY: host-backend segments name host memory and were validated when prepared.
    unsafe {
        for_each_run(segment, side, |run, _| {
            digest = (digest ^ gf64::digest(run)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            digest ^= digest >> 29;
        })
    };
    digest
}

/// Whether every destination byte of `segment` equals its source byte.
fn segment_matches(segment: &Segment) -> bool {
    let mut equal = true;
    // SAFETY: as in segment_digest.
    unsafe { for_each_run(segment, Side::Source, |src, dst| equal &= src == dst) };
    equal
}
