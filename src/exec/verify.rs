//! The verify of one copy batch: after the batch, on its stream, every segment it copied (into live
//! buffers, or into staging) checked on the device (`transport::verify`): a kernel batch's
//! destinations against the digests it recorded of the sources it read, a copy-engine batch's (and
//! the host backend's) byte by byte against the sources. A mismatch becomes a status naming the
//! tensor, box and element, found by reading the first differing segment back.

use super::batch::Batch;
use crate::error::{Error, Result, Status};
use crate::group::Group;
use crate::plan::{Destinations, Endpoint};
use crate::segment::{Segment, Side};
use crate::transport::verify::PreparedVerify;
use crate::transport::{Backend, Stream};

/// Runs read back, at most, to find the first differing byte of a mismatched segment.
const MAX_RUNS_READ: u64 = 1 << 16;

pub(crate) struct CopyCheck {
    /// The rank whose stream runs the copy and its verify.
    rank: usize,
    /// What is compared: each segment's source with its destination, at current addresses.
    segments: Vec<Segment>,
    /// The same segments as planned (destination in the live buffer, before any rebind), with the
    /// rank receiving each: what a mismatch is reported against.
    planned: Vec<(Segment, usize)>,
    bytes: u64,
    /// Its outcome is the last launch's.
    prepared: PreparedVerify,
    /// `prepared` shares the copy batch's descriptors (and follows its relocations); otherwise it
    /// has its own, rebuilt after a relocation.
    shared: bool,
    /// Segments were relocated since `prepared` was made (never when shared).
    stale: bool,
}

impl CopyCheck {
    /// The verify of `batch`, a batch of `rank`; `planned` gives each of its segments as planned and
    /// the rank receiving it.
    pub fn new(
        group: &Group,
        rank: usize,
        batch: &Batch,
        planned: Vec<(Segment, usize)>,
    ) -> Result<CopyCheck> {
        let segments = batch.segments().to_vec();
        let (prepared, shared) = match batch.recorded_verify()? {
            Some(recorded) => (recorded, true),
            None => (PreparedVerify::new(group.backend().as_ref(), group.device(rank)?, &segments)?, false),
        };
        Ok(CopyCheck { rank, segments, planned, bytes: batch.bytes(), prepared, shared, stale: false })
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Adds `delta` to one address of segment `index`; the prepared form is rebuilt by the next
    /// [`CopyCheck::refresh`].
    pub fn relocate(&mut self, index: usize, side: Side, delta: u64) {
        let segment = &mut self.segments[index];
        let address = segment.address_mut(side);
        *address = address.wrapping_add(delta);
        self.stale = !self.shared;
    }

    /// Rebuilds the prepared form after relocations; returns whether it had to.
    pub fn refresh(&mut self, group: &Group) -> Result<bool> {
        if !self.stale {
            return Ok(false);
        }
        self.prepared =
            PreparedVerify::new(group.backend().as_ref(), group.device(self.rank)?, &self.segments)?;
        self.stale = false;
        Ok(true)
    }

    /// Queues the comparison on `stream` (the copy's).
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
    /// what differs. `devices` maps ranks to devices; receivers are endpoints of process `process`.
    pub fn check(
        &self,
        backend: &dyn Backend,
        devices: &[i32],
        process: u32,
        destinations: &Destinations,
    ) -> Result<()> {
        let Some(index) = self.prepared.outcome()? else { return Ok(()) };
        let segment = &self.segments[index];
        let (planned, receiver) = self.planned[index];
        let receiver = Endpoint { process, device: devices[receiver] as u32 };
        let Some((run, byte)) = first_difference(backend, devices[self.rank], segment)? else {
            return Err(Error::new(
                Status::VerifyMismatch,
                format!(
                    "{} bytes into device {} at {:#x} differed from their source when verified (they match \
                     now: source or destination changed during the step)",
                    planned.bytes().unwrap_or(0),
                    receiver.device,
                    planned.dst
                ),
            ));
        };
        let (i, j) = (run % planned.count[0], run / planned.count[0]);
        let at = planned.dst + j * planned.dst_stride[1] + i * planned.dst_stride[0] + byte;
        let what = match destinations.locate(receiver, at) {
            Some(found) => format!(
                "tensor '{}' box offset {:?} extent {:?}: element {:?}",
                found.tensor, found.offset, found.extent, found.element
            ),
            None => format!("the segment into {:#x}", planned.dst),
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
fn first_difference(backend: &dyn Backend, device: i32, segment: &Segment) -> Result<Option<(u64, u64)>> {
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
