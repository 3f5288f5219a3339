//! Verifying copies on a CUDA device with the batched copy kernel's verifying entry points: a batch
//! prepared once and launched at every step, reporting the first segment whose destination bytes are
//! not its source bytes.
//!
//! Two ways, both walking the batch's tiles exactly as the copy does:
//! - [`VerifyBatch::compare`]: read every source and destination byte and compare them. Exact; reads
//!   twice what the copy reads.
//! - [`VerifyBatch::check`]: for a [`PreparedBatch`] that records the digests of the source tiles it
//!   reads ([`PreparedBatch::recording_digests`]), read only the destinations, digest each tile
//!   the same way, compare with the recorded digests. Reads half what `compare` reads; a difference is
//!   missed only if it leaves a tile digest unchanged, which one changed element never does (chance
//!   about 2^-64 otherwise).

use super::batched_copy::{BatchedCopy, Entry, Launch};
use super::device_memory::{DeviceMemory, PinnedWord};
use super::PreparedBatch;
use crate::error::{Error, Result};
use crate::segment::Segment;
use crate::transport::driver::{check, CurrentContext};
use cudarc::driver::sys;
use std::sync::Arc;

/// The result word's value when no tile differed (the kernel lowers it to a segment index).
const ALL_MATCH: u64 = u64::MAX;
/// The host's mark in the result word until a launch's result has been copied back.
const NO_RESULT: u64 = u64::MAX - 1;

/// A verify prepared for one device: launched on a stream after the copy it verifies, then
/// [`VerifyBatch::outcome`] once that stream has been synchronized. `Send + Sync`; launches of one
/// verify must not overlap (they share the result word).
pub struct VerifyBatch {
    kernel: Arc<BatchedCopy>,
    launch: Launch,
    /// Kept alive for the launches (shared with the batch being checked, if any).
    _descriptors: Option<Arc<DeviceMemory>>,
    /// The recorded source digests ([`VerifyBatch::check`]), or None to compare bytes.
    tile_digests: Option<Arc<DeviceMemory>>,
    first_bad: DeviceMemory,
    result: PinnedWord,
    /// The caller's segment index of each descriptor, when empty segments (which have none) shift them.
    segment_of: Option<Arc<Vec<usize>>>,
}

/// The caller's index of each non-empty segment, or None when no segment is empty (indices agree).
pub(crate) fn segment_indices(segments: &[Segment]) -> Option<Vec<usize>> {
    if segments.iter().all(|s| s.runs() > 0) {
        return None;
    }
    Some(segments.iter().enumerate().filter(|(_, s)| s.runs() > 0).map(|(i, _)| i).collect())
}

impl VerifyBatch {
    /// A verify that compares every destination byte of `segments` with its source byte on `device`
    /// (addresses as for [`super::copy_segments`]). Validates and uploads the descriptors once.
    /// Errors as for [`PreparedBatch::new`].
    pub fn compare(device: i32, segments: &[Segment]) -> Result<VerifyBatch> {
        let batch = PreparedBatch::new(device, segments, false)?;
        let parts = batch.parts();
        let descriptors = parts.descriptors.cloned();
        VerifyBatch::with_parts(
            Arc::clone(parts.kernel),
            parts.kernel.for_compare(parts.launch),
            descriptors,
            None,
            segment_indices(segments).map(Arc::new),
        )
    }

    /// A verify of `batch`'s destinations against the source digests its launches record (launch it
    /// after each launch of the batch). InvalidArgument when the batch does not record digests.
    pub fn check(batch: &PreparedBatch) -> Result<VerifyBatch> {
        let parts = batch.parts();
        if parts.launch.tiles > 0 && parts.tile_digests.is_none() {
            return Err(Error::invalid_argument(
                "the batch does not record source digests (prepare it with PreparedBatch::recording_digests)",
            ));
        }
        VerifyBatch::with_parts(
            Arc::clone(parts.kernel),
            parts.launch,
            parts.descriptors.cloned(),
            parts.tile_digests.cloned(),
            parts.segment_of.cloned(),
        )
    }

    fn with_parts(
        kernel: Arc<BatchedCopy>,
        launch: Launch,
        descriptors: Option<Arc<DeviceMemory>>,
        tile_digests: Option<Arc<DeviceMemory>>,
        segment_of: Option<Arc<Vec<usize>>>,
    ) -> Result<VerifyBatch> {
        let first_bad = DeviceMemory::alloc(kernel.context(), 8)?;
        let result = PinnedWord::new(kernel.context(), NO_RESULT)?;
        Ok(VerifyBatch {
            kernel,
            launch,
            _descriptors: descriptors,
            tile_digests,
            first_bad,
            result,
            segment_of,
        })
    }

    /// Queues the verify on `stream` (a stream of the device; NULL: its legacy default stream): a
    /// 4-byte memset, one kernel launch, an 8-byte copy to page-locked host memory. No allocation, no
    /// synchronization, host work independent of the segment count; capturable into a CUDA graph.
    /// Errors: CudaError (e.g. a stream of another device).
    ///
    /// # Safety
    /// `stream` is NULL or a live stream of the device, and every address of the segments is still
    /// allocated when the work runs (for [`VerifyBatch::check`], the batch's last launch has run
    /// before on the stream, or is ordered before it).
    pub unsafe fn launch(&self, stream: sys::CUstream) -> Result<()> {
        self.result.set(NO_RESULT);
        if self.launch.tiles == 0 {
            self.result.set(ALL_MATCH);
            return Ok(());
        }
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(self.kernel.context()) }?;
        // SAFETY: the result word is owned by this verify; the stream is the caller's promise.
        check("cuMemsetD32Async", unsafe { sys::cuMemsetD32Async(self.first_bad.ptr, u32::MAX, 2, stream) })?;
        let first_bad = self.first_bad.ptr;
        let entry = match &self.tile_digests {
            Some(digests) => Entry::Check { digests: digests.ptr, first_bad },
            None => Entry::Compare { first_bad },
        };
        self.kernel.enqueue_entry(stream, &self.launch, entry)?;
        // SAFETY: 8 bytes from the result word into page-locked memory owned by this verify.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(self.result.as_host_ptr(), first_bad, 8, stream)
        })
    }

    /// After the stream of the last launch has been synchronized: the index (in the caller's segment
    /// list) of the first segment found different, or None when every segment matched. Resets for the
    /// next launch. InvalidState when no launch has completed since the last outcome.
    pub fn outcome(&self) -> Result<Option<usize>> {
        let value = self.result.get();
        if value == NO_RESULT {
            return Err(Error::invalid_state(
                "no verify result: launch the verify and synchronize its stream before asking for the outcome",
            ));
        }
        self.result.set(NO_RESULT);
        if value == ALL_MATCH {
            return Ok(None);
        }
        let index = value as usize;
        Ok(Some(self.segment_of.as_ref().map_or(index, |map| map.get(index).copied().unwrap_or(index))))
    }
}

/// Digests of a batch's source tiles, taken where the sources are, for a [`DigestCheck`] of the same
/// segments where the destinations are: the verify of bytes that reached their destinations by other
/// means (through staging, in another process). The caller carries the digests between the two
/// (8 bytes per tile); both sides tile the same segments alike, on any device.
pub struct DigestRecord {
    /// A recording batch that is only ever launched through the record entry point (it writes
    /// nothing, so its destinations may be another process's addresses).
    batch: PreparedBatch,
}

impl DigestRecord {
    /// Prepares the record of `segments`' sources on `device`. Errors as for [`PreparedBatch::new`].
    pub fn new(device: i32, segments: &[Segment]) -> Result<DigestRecord> {
        Ok(DigestRecord { batch: PreparedBatch::recording_digests(device, segments, false)? })
    }

    /// Queues the record on `stream`: reads every source byte, writes the tile digests.
    ///
    /// # Safety
    /// `stream` is NULL or a live stream of the device, and the sources are readable until it runs.
    pub unsafe fn launch(&self, stream: sys::CUstream) -> Result<()> {
        let parts = self.batch.parts();
        let Some(digests) = parts.tile_digests else { return Ok(()) };
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(parts.kernel.context()) }?;
        parts.kernel.enqueue_entry(stream, &parts.launch, Entry::Record { digests: digests.ptr })
    }

    /// The digests of the last launch, once its stream has been synchronized.
    pub fn digests(&self) -> Result<Vec<u64>> {
        let parts = self.batch.parts();
        let Some(memory) = parts.tile_digests else { return Ok(Vec::new()) };
        let mut out = vec![0u64; parts.launch.tiles as usize];
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(parts.kernel.context()) }?;
        // SAFETY: `out` holds the allocation's `tiles` words; the caller synchronized the stream.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), memory.ptr, out.len() * 8)
        })?;
        Ok(out)
    }
}

/// The check of a [`DigestRecord`]'s segments at their destinations, against the digests it
/// recorded (handed over with [`DigestCheck::expect`]).
pub struct DigestCheck {
    batch: PreparedBatch,
    check: VerifyBatch,
}

impl DigestCheck {
    /// Prepares the check of `segments`' destinations on `device` (the sources may be another
    /// process's addresses: they are not read). Errors as for [`PreparedBatch::new`].
    pub fn new(device: i32, segments: &[Segment]) -> Result<DigestCheck> {
        let batch = PreparedBatch::recording_digests(device, segments, false)?;
        let check = VerifyBatch::check(&batch)?;
        Ok(DigestCheck { batch, check })
    }

    /// Sets the digests the next launches compare with: a [`DigestRecord::digests`] of the same
    /// segments. InvalidArgument when their number is not this batch's tile count. Synchronous; no
    /// launch of this check may be queued or running.
    pub fn expect(&self, digests: &[u64]) -> Result<()> {
        let parts = self.batch.parts();
        if digests.len() as u64 != parts.launch.tiles {
            return Err(Error::invalid_argument(format!(
                "{} digests for a check of {} tiles: they were not recorded from the same segments",
                digests.len(),
                parts.launch.tiles
            )));
        }
        let Some(memory) = parts.tile_digests else { return Ok(()) };
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(parts.kernel.context()) }?;
        // SAFETY: the allocation holds `tiles` words; no launch reads them meanwhile (the caller's
        // promise).
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(memory.ptr, digests.as_ptr().cast(), digests.len() * 8)
        })
    }

    /// As [`VerifyBatch::launch`].
    ///
    /// # Safety
    /// As for [`VerifyBatch::launch`]; the destinations hold the bytes to check when it runs.
    pub unsafe fn launch(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: the caller's promise.
        unsafe { self.check.launch(stream) }
    }

    /// As [`VerifyBatch::outcome`].
    pub fn outcome(&self) -> Result<Option<usize>> {
        self.check.outcome()
    }
}
