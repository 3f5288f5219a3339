//! One prepared copy stage of one rank: its segments (current addresses), moved by the batched kernel
//! (descriptors uploaded once), by the copy engine, or split between them by run length, and
//! relocatable in place when a buffer it reads or writes moves (see `rebind`).

use super::options::{Arm, Method};
use crate::error::Result;
use crate::group::Group;
use crate::kernels::layout::BatchLayout;
use crate::kernels::{self, PreparedBatch};
use crate::plan::RouteKind;
use crate::segment::{Segment, Side};
use crate::transport::host::host_stream;
use crate::transport::host_copy::copy_runs;
use crate::transport::verify::PreparedVerify;
use crate::transport::{Backend, BackendKind, Stream};
use std::sync::Arc;

/// The kernel's form of a batch: the host copy of its layout (rewritten in place on relocation) and
/// the uploaded descriptors.
struct KernelBatch {
    layout: BatchLayout,
    prepared: PreparedBatch,
}

/// Copy-engine copies beside other work: pieces of at most `piece` bytes, each followed by a pause of
/// `pause_ns` (see [`Pace::for_budget`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pace {
    piece: u64,
    pause_ns: u64,
}

impl Pace {
    /// The longest copy-engine copy beside other work: one long copy costs work beside it far more
    /// than the same bytes in pieces (docs/decisions.md, "The copy engine, in pieces and paced").
    const PIECE: u64 = 64 << 20;
    /// Payload one SM copies, bytes per second, whichever way it copies (docs/decisions.md, "A copy
    /// that holds fewer SMs"): an SM budget of n paces the copy engine to n times this.
    const PER_SM: u64 = 50_000_000_000;
    /// The copy engine's own rate for back-to-back pieces on one H200, bytes per second, which a
    /// pause adds to (benches/refit_peer.py, "torch copy_, 2 GiB in 64 MiB pieces").
    const ENGINE: u64 = 1_850_000_000_000;

    /// Pieces paced to `budget` SMs' worth of copying: a piece, then a pause for the rest of the time
    /// that many SMs would take over it.
    fn for_budget(budget: u32) -> Pace {
        let ns = |rate: u64| (u128::from(Pace::PIECE) * 1_000_000_000 / u128::from(rate.max(1))) as u64;
        let pause_ns = ns(u64::from(budget).saturating_mul(Pace::PER_SM)).saturating_sub(ns(Pace::ENGINE));
        Pace { piece: Pace::PIECE, pause_ns }
    }
}

/// Where each segment of a [`Method::Split`] batch goes.
struct Split {
    /// Per segment: its index in the kernel's layout, or in `engine`.
    place: Vec<Place>,
    /// The long runs' segments (current addresses), one copy-engine copy per run.
    engine: Vec<Segment>,
}

#[derive(Clone, Copy)]
enum Place {
    Kernel(usize),
    Engine(usize),
}

pub(crate) struct Batch {
    backend: Arc<dyn Backend>,
    device: i32,
    /// Non-empty, validated segments; shared with host-backend work still queued.
    segments: Arc<Vec<Segment>>,
    bytes: u64,
    /// CUDA backend, kernel and split methods: the segments the kernel copies (all of them, or the
    /// short runs of a split).
    kernel: Option<KernelBatch>,
    /// CUDA backend, split method only.
    split: Option<Split>,
    /// CUDA backend, copy-engine method under an SM budget: how its copies are cut and paced.
    pace: Option<Pace>,
    /// Kernel descriptor indices relocated since the last [`Batch::flush`].
    dirty: Vec<usize>,
}

impl Batch {
    /// Prepares `segments` (non-empty, validated) of route kind `kind` for `rank`'s device. The
    /// kernel method uploads the descriptors now, and with `record_digests` records digests of what
    /// it reads for [`Batch::recorded_verify`]; `max_blocks` (0: no cap) limits the blocks of its
    /// launches. The split method gives runs of at least [`Arm::copy_engine_min_run`] of `kind` to
    /// the copy engine and the others to the kernel. The copy-engine method under a budget
    /// (`max_blocks` > 0: work runs beside the copies) issues paced pieces ([`Pace::for_budget`]).
    pub fn new(
        group: &Group,
        rank: usize,
        segments: Vec<Segment>,
        (method, kind): (Method, RouteKind),
        max_blocks: u32,
        record_digests: bool,
    ) -> Result<Batch> {
        let device = group.device(rank)?;
        let bytes = segments.iter().map(|s| s.bytes().unwrap_or(0)).sum();
        let prepare_kernel = |segments: &[Segment]| -> Result<KernelBatch> {
            let layout = BatchLayout::new(segments)?;
            let mut prepared = PreparedBatch::from_layout(device, &layout, record_digests)?;
            if max_blocks > 0 {
                prepared.limit_blocks(max_blocks);
            }
            Ok(KernelBatch { layout, prepared })
        };
        let (kernel, split) = match (group.backend_kind(), method) {
            (BackendKind::Cuda, Method::Kernel) => (Some(prepare_kernel(&segments)?), None),
            (BackendKind::Cuda, Method::Split) => {
                let split = Split::of(&segments, Arm::copy_engine_min_run(kind));
                let short: Vec<Segment> = segments
                    .iter()
                    .zip(&split.place)
                    .filter(|(_, place)| matches!(place, Place::Kernel(_)))
                    .map(|(segment, _)| *segment)
                    .collect();
                let kernel = if short.is_empty() { None } else { Some(prepare_kernel(&short)?) };
                (kernel, Some(split))
            }
            // The copy engine issues one copy per run at each launch; on the host backend every
            // method is the same memmove loop, queued on the stream's worker.
            _ => (None, None),
        };
        let budgeted_engine =
            group.backend_kind() == BackendKind::Cuda && method == Method::CopyEngine && max_blocks > 0;
        Ok(Batch {
            backend: Arc::clone(group.backend()),
            device,
            segments: Arc::new(segments),
            bytes,
            kernel,
            split,
            pace: budgeted_engine.then(|| Pace::for_budget(max_blocks)),
            dirty: Vec::new(),
        })
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// The verify of what this batch wrote: against the source digests its launches record (a
    /// kernel batch made with `record_digests`: reads only the destinations, shares the
    /// descriptors, so it follows [`Batch::relocate`]), else comparing both sides (`None`: the
    /// caller builds that one, it needs the group).
    pub fn recorded_verify(&self) -> Result<Option<PreparedVerify>> {
        match (&self.kernel, &self.split) {
            (Some(kernel), None) => PreparedVerify::for_copy(&kernel.prepared).map(Some),
            _ => Ok(None),
        }
    }

    /// Queues the batch on `stream`, a stream of its device. CUDA kernel: one launch, no host work
    /// per segment. Copy engine: one copy per contiguous run. Split: one copy per long run, then
    /// one launch. Host backend: one queued memmove loop.
    ///
    /// # Safety
    /// Every segment's memory must stay valid until the queued work has run.
    pub unsafe fn launch(&self, stream: Stream) -> Result<()> {
        if let Some(split) = &self.split {
            self.backend.copy_segments(self.device, stream, &split.engine)?;
        }
        if let Some(kernel) = &self.kernel {
            return kernel.prepared.launch(stream.as_ptr().cast());
        }
        if self.split.is_some() {
            return Ok(());
        }
        if let Some(pace) = self.pace {
            return self.copy_paced(stream, pace);
        }
        match self.backend.kind() {
            BackendKind::Cuda => self.backend.copy_segments(self.device, stream, &self.segments),
            BackendKind::Host => {
                let stream =
                    if stream == Stream::NULL { self.backend.null_stream(self.device) } else { stream };
                let segments = Arc::clone(&self.segments);
                // SAFETY: validated segments; the caller keeps the memory valid until this has run.
                host_stream(stream)?.enqueue(move || unsafe { copy_runs(&segments) })
            }
        }
    }

    /// One copy-engine copy per piece of every run, each full piece followed by the pace's pause.
    ///
    /// # Safety
    /// As for [`Batch::launch`].
    unsafe fn copy_paced(&self, stream: Stream, pace: Pace) -> Result<()> {
        let mut result = Ok(());
        for segment in self.segments.iter() {
            segment.for_each_run(|src, dst, len| {
                let mut at = 0;
                while result.is_ok() && at < len {
                    let n = pace.piece.min(len - at);
                    let one = [Segment::contiguous(src + at, dst + at, n)];
                    // SAFETY: a piece of a run of this batch; the caller keeps its memory valid.
                    result = unsafe { self.backend.copy_segments(self.device, stream, &one) };
                    if result.is_ok() && n == pace.piece && pace.pause_ns > 0 {
                        // SAFETY: a stream of this batch's device.
                        result =
                            unsafe { kernels::pause(self.device, stream.as_ptr().cast(), pace.pause_ns) };
                    }
                    at += n;
                }
            });
            result.clone()?;
        }
        result
    }

    /// Adds `delta` (wrapping) to one address of segment `index`; the device copy follows at the
    /// next [`Batch::flush`].
    pub fn relocate(&mut self, index: usize, side: Side, delta: u64) {
        let segment = &mut Arc::make_mut(&mut self.segments)[index];
        let address = segment.address_mut(side);
        *address = address.wrapping_add(delta);
        let place = match &mut self.split {
            Some(split) => split.place[index],
            None => Place::Kernel(index),
        };
        match (place, &mut self.kernel, &mut self.split) {
            (Place::Engine(e), _, Some(split)) => split.engine[e] = *segment,
            (Place::Kernel(k), Some(kernel), _) => {
                let descriptor = &mut kernel.layout.descriptors[k];
                descriptor.src = segment.src;
                descriptor.dst = segment.dst;
                self.dirty.push(k);
            }
            _ => {}
        }
    }

    /// Uploads the descriptors relocated since the last flush: one copy per contiguous range.
    ///
    /// # Safety
    /// No launch of this batch may be queued or running.
    pub unsafe fn flush(&mut self) -> Result<()> {
        let Some(kernel) = &self.kernel else { return Ok(()) };
        self.dirty.sort_unstable();
        self.dirty.dedup();
        let mut at = 0;
        while at < self.dirty.len() {
            let first = self.dirty[at];
            let mut end = at + 1;
            while end < self.dirty.len() && self.dirty[end] == first + (end - at) {
                end += 1;
            }
            let count = end - at;
            kernel.prepared.rewrite(first, &kernel.layout.descriptors[first..first + count])?;
            at = end;
        }
        self.dirty.clear();
        Ok(())
    }
}

impl Split {
    /// Runs of at least `min_run` bytes to the copy engine, the others to the kernel.
    fn of(segments: &[Segment], min_run: u64) -> Split {
        let (mut kernel, mut engine) = (0, Vec::new());
        let place = segments
            .iter()
            .map(|segment| {
                if segment.len >= min_run {
                    engine.push(*segment);
                    Place::Engine(engine.len() - 1)
                } else {
                    kernel += 1;
                    Place::Kernel(kernel - 1)
                }
            })
            .collect();
        Split { place, engine }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_paces_pieces_to_what_its_sms_would_copy() {
        // 8 SMs: 400 GB/s, 64 MiB every 167.8 us, of which the copy engine takes 36.3 us.
        assert_eq!(Pace::for_budget(8), Pace { piece: 64 << 20, pause_ns: 167_772 - 36_275 });
        assert_eq!(Pace::for_budget(12).pause_ns, 111_848 - 36_275);
        assert_eq!(Pace::for_budget(37).pause_ns, 0); // past the copy engine's own rate
        assert_eq!(Pace::for_budget(u32::MAX).pause_ns, 0);
    }

    #[test]
    fn a_split_sends_long_runs_to_the_copy_engine_and_keeps_every_index() {
        let segments = [
            Segment::contiguous(0, 1 << 40, 100),
            Segment::contiguous(1 << 30, 1 << 41, 300 << 20),
            Segment {
                src: 0,
                dst: 1 << 42,
                len: 4096,
                count: [3, 2],
                src_stride: [4096, 1 << 20],
                dst_stride: [4096, 3 << 12],
            },
            Segment::contiguous(2 << 30, 1 << 43, 256 << 20),
        ];
        let split = Split::of(&segments, 256 << 20);
        let places: Vec<String> = split
            .place
            .iter()
            .map(|p| match p {
                Place::Kernel(k) => format!("k{k}"),
                Place::Engine(e) => format!("e{e}"),
            })
            .collect();
        assert_eq!(places, ["k0", "e0", "k1", "e1"]);
        assert_eq!(split.engine, [segments[1], segments[3]]);
    }
}
