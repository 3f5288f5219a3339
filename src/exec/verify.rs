//! The verify stage of one receiving rank: every segment copied into it (into its live buffers, or
//! into its staging) compared with its source on the device, and a mismatch turned into a status
//! naming the tensor, box and element, found by reading the first differing segment back.

use super::batch::Side;
use super::compare::PreparedVerify;
use crate::error::{Error, Result, Status};
use crate::group::Group;
use crate::plan::{Destinations, Endpoint};
use crate::segment::Segment;
use crate::transport::{Backend, Stream};

/// Runs read back, at most, to find the first differing byte of a mismatched segment.
const MAX_RUNS_READ: u64 = 1 << 16;

pub(crate) struct VerifyBatch {
    pub rank: usize,
    /// What is compared: each segment's source with its destination, at current addresses.
    segments: Vec<Segment>,
    /// The same segments as planned (destination in the live buffer, before any rebind): what a
    /// mismatch is reported against.
    origins: Vec<Segment>,
    bytes: u64,
    /// Prepared for the addresses of the last refresh; its outcome is the last launch's.
    prepared: PreparedVerify,
    /// Segments were relocated since `prepared` was made.
    stale: bool,
}

impl VerifyBatch {
    pub fn new(
        group: &Group,
        rank: usize,
        segments: Vec<Segment>,
        origins: Vec<Segment>,
    ) -> Result<VerifyBatch> {
        let prepared = PreparedVerify::new(group, rank, &segments)?;
        let bytes = segments.iter().map(|s| s.bytes().unwrap_or(0)).sum();
        Ok(VerifyBatch { rank, segments, origins, bytes, prepared, stale: false })
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Adds `delta` to one address of segment `index`; the prepared form is rebuilt by the next
    /// [`VerifyBatch::refresh`].
    pub fn relocate(&mut self, index: usize, side: Side, delta: u64) {
        let segment = &mut self.segments[index];
        let address = match side {
            Side::Src => &mut segment.src,
            Side::Dst => &mut segment.dst,
        };
        *address = address.wrapping_add(delta);
        self.stale = true;
    }

    /// Rebuilds the prepared form after relocations; returns whether it had to.
    pub fn refresh(&mut self, group: &Group) -> Result<bool> {
        if !self.stale {
            return Ok(false);
        }
        self.prepared = PreparedVerify::new(group, self.rank, &self.segments)?;
        self.stale = false;
        Ok(true)
    }

    /// Queues the comparison on `stream` (the receiving rank's).
    ///
    /// # Safety
    /// Every segment's memory must stay valid until the comparison has run.
    pub unsafe fn launch(&self, stream: Stream) -> Result<()> {
        if self.stale {
            return Err(Error::invalid_state("verify descriptors were not rebuilt after a rebind"));
        }
        self.prepared.launch(stream)
    }

    /// After the stream has passed the launch: Ok when every byte matched, else VerifyMismatch naming
    /// what differs. `receiver` is this rank's plan endpoint; reads go through `backend` on `device`.
    pub fn check(
        &self,
        backend: &dyn Backend,
        device: usize,
        receiver: Endpoint,
        destinations: &Destinations,
    ) -> Result<()> {
        let Some(index) = self.prepared.outcome()? else { return Ok(()) };
        let (segment, origin) = (&self.segments[index], &self.origins[index]);
        let Some((run, byte)) = first_difference(backend, device, segment)? else {
            return Err(Error::new(
                Status::VerifyMismatch,
                format!(
                    "{} bytes into device {} at {:#x} differed from their source when verified (they match \
                     now: source or destination changed during the step)",
                    origin.bytes().unwrap_or(0),
                    receiver.device,
                    origin.dst
                ),
            ));
        };
        let (i, j) = (run % origin.count[0], run / origin.count[0]);
        let at = origin.dst + j * origin.dst_stride[1] + i * origin.dst_stride[0] + byte;
        let what = match destinations.locate(receiver, at) {
            Some(found) => format!(
                "tensor '{}' box offset {:?} extent {:?}: element {:?}",
                found.tensor, found.offset, found.extent, found.element
            ),
            None => format!("the segment into {:#x}", origin.dst),
        };
        Err(Error::new(
            Status::VerifyMismatch,
            format!(
                "{what} differs from its source after the copy (device {}, destination byte {at:#x})",
                receiver.device
            ),
        ))
    }
}

/// The first run (in the segment's run order) and byte where destination and source differ, read
/// back through `backend`; None when none does within the first [`MAX_RUNS_READ`] runs.
fn first_difference(backend: &dyn Backend, device: usize, segment: &Segment) -> Result<Option<(u64, u64)>> {
    let mut found = None;
    let mut failed = None;
    let mut run = 0u64;
    let (mut src_bytes, mut dst_bytes) = (Vec::new(), Vec::new());
    segment.for_each_run(|src, dst, len| {
        if found.is_some() || failed.is_some() || run >= MAX_RUNS_READ {
            return;
        }
        src_bytes.resize(len as usize, 0);
        dst_bytes.resize(len as usize, 0);
        // SAFETY: the runs were just compared on the device: live memory reachable from `device`.
        let read = unsafe {
            backend.read(device, src, &mut src_bytes).and_then(|()| backend.read(device, dst, &mut dst_bytes))
        };
        match read {
            Ok(()) => {
                if let Some(b) = src_bytes.iter().zip(&dst_bytes).position(|(a, b)| a != b) {
                    found = Some((run, b as u64));
                }
            }
            Err(err) => failed = Some(err),
        }
        run += 1;
    });
    match failed {
        Some(err) => Err(err.context("reading a mismatched segment back")),
        None => Ok(found),
    }
}
