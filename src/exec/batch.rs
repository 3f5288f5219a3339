//! One prepared copy stage of one rank: its segments (current addresses), moved by the batched kernel
//! (descriptors uploaded once), by the copy engine, or split between them by run length, and
//! relocatable in place when a buffer it reads or writes moves (see `rebind`).

use super::options::{Arm, Method};
use crate::error::Result;
use crate::group::Group;
use crate::kernels::layout::BatchLayout;
use crate::kernels::{BatchedCopy, PreparedBatch};
use crate::plan::RouteKind;
use crate::segment::{Segment, Side};
use crate::transport::host::host_stream;
use crate::transport::host_copy::copy_runs;
use crate::transport::verify::PreparedVerify;
use crate::transport::{Backend, BackendKind, Event, PreparedQuantize, Stream};
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
    /// than the same bytes in pieces (docs/decisions.md, "The copy engine beside a GEMM").
    const PIECE: u64 = 64 << 20;
    /// Payload one SM copies at best, bytes per second, by TMA bulk copies or register copies alike
    /// (benches/probes/README.md, bulk_overlap_probe): an SM budget of n paces the copy engine to n
    /// times this.
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

/// Where one segment of a batch goes: its index in the kernel's layout, or in the copy engine's list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    Kernel(usize),
    Engine(usize),
}

/// The copy engine's own stream in a split stage, forked from the caller's stream before the copies
/// and joined back after them, so that its copies run while the kernel runs: queued one after the
/// other on one stream, the two would take turns (benches/probes/split_copy_probe.py measured them
/// together). Created with the batch, destroyed with it.
struct Beside {
    stream: Stream,
    forked: Event,
    joined: Event,
}

impl Beside {
    fn new(backend: &dyn Backend, device: i32) -> Result<Beside> {
        let stream = backend.create_stream(device)?;
        let forked = backend.create_event(device).inspect_err(|_| backend.destroy_stream(device, stream))?;
        let joined = backend.create_event(device).inspect_err(|_| {
            backend.destroy_event(device, forked);
            backend.destroy_stream(device, stream);
        })?;
        Ok(Beside { stream, forked, joined })
    }

    fn release(&self, backend: &dyn Backend, device: i32) {
        backend.destroy_event(device, self.forked);
        backend.destroy_event(device, self.joined);
        backend.destroy_stream(device, self.stream);
    }
}

/// The copy engine's part of a batch beside other work: its pace, and the kernel module whose
/// `refit_pause` makes the pauses (None where it cannot load: the pieces then run unpaced).
struct Paced {
    pace: Pace,
    pauser: Option<Arc<BatchedCopy>>,
}

pub(crate) struct Batch {
    backend: Arc<dyn Backend>,
    device: i32,
    /// Non-empty, validated segments; shared with host-backend work still queued.
    segments: Arc<Vec<Segment>>,
    bytes: u64,
    /// CUDA backend: where each segment goes (empty on the host backend, where one memmove loop
    /// runs every method).
    place: Vec<Place>,
    /// The segments the kernel copies (all of them, or a split's short runs).
    kernel: Option<KernelBatch>,
    /// The segments the copy engine copies (current addresses), one copy per run.
    engine: Vec<Segment>,
    /// Under an SM budget: the copy engine's copies cut into paced pieces.
    paced: Option<Paced>,
    /// A split stage (unpaced): the copy engine's stream beside the kernel's.
    beside: Option<Beside>,
    /// Kernel descriptor indices relocated since the last [`Batch::flush`].
    dirty: Vec<usize>,
    /// Quantization jobs the kernel's launch also runs ([`Batch::carry`]).
    rider: Option<Arc<dyn PreparedQuantize>>,
}

impl Batch {
    /// Prepares `segments` (non-empty, validated) of route kind `kind` for `rank`'s device: each
    /// goes to the kernel or the copy engine as `method` says (the split method gives the copy
    /// engine the segments [`Arm::engine_segments`] chooses, on a stream of its own beside the
    /// kernel). The kernel's descriptors
    /// are uploaded now, and with `record_digests` its launches record digests of what they read
    /// for [`Batch::recorded_verify`]. `max_blocks` > 0 (an SM budget: work runs beside the
    /// copies) caps the kernel's blocks and paces the copy engine ([`Pace::for_budget`]).
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
        let place = match group.backend_kind() {
            BackendKind::Host => Vec::new(),
            BackendKind::Cuda => places(&segments, method, kind),
        };
        let on = |to_engine: bool| -> Vec<Segment> {
            segments
                .iter()
                .zip(&place)
                .filter(|(_, p)| matches!(p, Place::Engine(_)) == to_engine)
                .map(|(segment, _)| *segment)
                .collect()
        };
        let (short, engine) = (on(false), on(true));
        let kernel = if short.is_empty() {
            None
        } else {
            let layout = BatchLayout::new(&short)?;
            let mut prepared = PreparedBatch::from_layout(device, &layout, record_digests)?;
            if max_blocks > 0 {
                prepared.limit_blocks(max_blocks);
            }
            Some(KernelBatch { layout, prepared })
        };
        let paced = (max_blocks > 0 && !engine.is_empty()).then(|| {
            let pace = Pace::for_budget(max_blocks);
            let pauser = match pace.pause_ns {
                0 => None,
                _ => BatchedCopy::for_device(device)
                    .map_err(|err| log::warn!("copy-engine copies run unpaced: no pause kernel ({err})"))
                    .ok(),
            };
            Paced { pace, pauser }
        });
        let beside = match (&kernel, engine.is_empty(), &paced) {
            (Some(_), false, None) => Some(Beside::new(group.backend().as_ref(), device)?),
            _ => None,
        };
        Ok(Batch {
            backend: Arc::clone(group.backend()),
            device,
            segments: Arc::new(segments),
            bytes,
            place,
            kernel,
            engine,
            paced,
            beside,
            dirty: Vec::new(),
            rider: None,
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
        match &self.kernel {
            Some(kernel) if self.engine.is_empty() => PreparedVerify::for_copy(&kernel.prepared).map(Some),
            _ => Ok(None),
        }
    }

    /// Has the kernel's launch also run `jobs` (prepared by the CUDA backend on this batch's
    /// device), in its blocks after the copy's, so that the stage ends with one launch (where one
    /// launch cannot do both, `launch_with_copy` queues two). Returns whether this batch took them:
    /// it needs a kernel part, and carries one set of jobs at most. The jobs must write nothing the
    /// batch reads or writes, and read nothing it writes.
    pub fn carry(&mut self, jobs: &Arc<dyn PreparedQuantize>) -> bool {
        let takes = self.kernel.is_some() && self.rider.is_none() && jobs.on_cuda().is_some();
        if takes {
            self.rider = Some(Arc::clone(jobs));
        }
        takes
    }

    /// The kernel part's launch on `stream`, with the jobs it carries.
    ///
    /// # Safety
    /// As for [`Batch::launch`], and the carried jobs' memory stays valid until they have run.
    unsafe fn launch_kernel(&self, kernel: &KernelBatch, stream: Stream) -> Result<()> {
        match self.rider.as_ref().and_then(|rider| rider.on_cuda()) {
            // SAFETY: the caller's promises; `carry` took only jobs apart from the batch's memory.
            Some(jobs) => unsafe { jobs.launch_with_copy(stream.as_ptr().cast(), &kernel.prepared) },
            // SAFETY: the caller's promises.
            None => unsafe { kernel.prepared.launch(stream.as_ptr().cast()) },
        }
    }

    /// Queues the batch on `stream`, a stream of its device: the copy engine's copies (one per run,
    /// or per paced piece), then the kernel's one launch, which does no host work per segment.
    /// Host backend: one queued memmove loop.
    ///
    /// # Safety
    /// Every segment's memory must stay valid until the queued work has run.
    pub unsafe fn launch(&self, stream: Stream) -> Result<()> {
        if self.backend.kind() == BackendKind::Host {
            let stream = if stream == Stream::NULL { self.backend.null_stream(self.device) } else { stream };
            let segments = Arc::clone(&self.segments);
            // SAFETY: validated segments; the caller keeps the memory valid until this has run.
            return host_stream(stream)?.enqueue(move || unsafe { copy_runs(&segments) });
        }
        if let Some(beside) = &self.beside {
            // SAFETY: as below, on the copy engine's own stream, ordered after and before `stream`.
            return unsafe { self.launch_beside(stream, beside) };
        }
        match &self.paced {
            // SAFETY: the caller keeps every segment's memory valid until the copies have run.
            Some(paced) => unsafe { self.copy_paced(stream, paced) }?,
            None if !self.engine.is_empty() => {
                unsafe { self.backend.copy_segments(self.device, stream, &self.engine) }?
            }
            None => {}
        }
        match &self.kernel {
            // SAFETY: the caller's promises.
            Some(kernel) => unsafe { self.launch_kernel(kernel, stream) },
            None => Ok(()),
        }
    }

    /// A split stage: the kernel's launch on `stream`, the copy engine's copies on `beside`'s stream
    /// after what `stream` held before that launch, and `stream` then waiting for the copies. The
    /// kernel is queued first: issuing the copies takes the host microseconds each, which the
    /// kernel would otherwise wait for.
    ///
    /// # Safety
    /// As for [`Batch::launch`].
    unsafe fn launch_beside(&self, stream: Stream, beside: &Beside) -> Result<()> {
        let (backend, device) = (&self.backend, self.device);
        backend.record(device, beside.forked, stream)?;
        if let Some(kernel) = &self.kernel {
            // SAFETY: the caller's promises.
            unsafe { self.launch_kernel(kernel, stream) }?;
        }
        backend.wait(device, beside.stream, beside.forked)?;
        // SAFETY: the caller keeps every segment's memory valid until the copies have run.
        unsafe { backend.copy_segments(device, beside.stream, &self.engine) }?;
        backend.record(device, beside.joined, beside.stream)?;
        backend.wait(device, stream, beside.joined)
    }

    /// One copy-engine copy per piece of every run, each full piece followed by the pace's pause.
    ///
    /// # Safety
    /// As for [`Batch::launch`].
    unsafe fn copy_paced(&self, stream: Stream, paced: &Paced) -> Result<()> {
        let piece = paced.pace.piece;
        let mut result = Ok(());
        for segment in &self.engine {
            segment.for_each_run(|src, dst, len| {
                let mut at = 0;
                while result.is_ok() && at < len {
                    let n = piece.min(len - at);
                    let one = [Segment::contiguous(src + at, dst + at, n)];
                    // SAFETY: a piece of a run of this batch; the caller keeps its memory valid.
                    result = unsafe { self.backend.copy_segments(self.device, stream, &one) };
                    if let (true, Some(pauser)) = (result.is_ok() && n == piece, &paced.pauser) {
                        // SAFETY: a stream of this batch's device.
                        result = unsafe { pauser.pause(stream.as_ptr().cast(), paced.pace.pause_ns) };
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
        match (self.place.get(index), &mut self.kernel) {
            (Some(&Place::Engine(e)), _) => self.engine[e] = *segment,
            (Some(&Place::Kernel(k)), Some(kernel)) => {
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

impl Drop for Batch {
    fn drop(&mut self) {
        if let Some(beside) = &self.beside {
            beside.release(self.backend.as_ref(), self.device);
        }
    }
}

/// Where `method` puts each of `segments` (of route kind `kind`): the split method gives the copy
/// engine what [`Arm::engine_segments`] chooses, the kernel the others.
fn places(segments: &[Segment], method: Method, kind: RouteKind) -> Vec<Place> {
    fn next(counter: &mut usize) -> usize {
        *counter += 1;
        *counter - 1
    }
    let (mut kernel, mut engine) = (0, 0);
    let to_engine = match method {
        Method::Kernel => vec![false; segments.len()],
        Method::CopyEngine => vec![true; segments.len()],
        Method::Split => Arm::engine_segments(kind, segments.iter()),
    };
    to_engine
        .into_iter()
        .map(|to_engine| match to_engine {
            true => Place::Engine(next(&mut engine)),
            false => Place::Kernel(next(&mut kernel)),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_paces_pieces_to_what_its_sms_would_copy() {
        // 8 SMs' pace: a 64 MiB piece every 167,772 ns, of which the copy engine's own rate takes 36,275.
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
        let (k, e) = (Place::Kernel, Place::Engine);
        let local = RouteKind::Local;
        assert_eq!(places(&segments, Method::Split, local), [k(0), e(0), k(1), e(1)]);
        assert_eq!(places(&segments, Method::Kernel, local), [k(0), k(1), k(2), k(3)]);
        assert_eq!(places(&segments, Method::CopyEngine, local), [e(0), e(1), e(2), e(3)]);
        // Ten 64 MiB runs on one GPU: the copy engine takes three (a share of 0.3), the longest first
        // (ties in order); between GPUs every one.
        let mut runs: Vec<Segment> =
            (0..10u64).map(|i| Segment::contiguous(i << 30, (i + 16) << 30, 64 << 20)).collect();
        runs[7].len = 65 << 20;
        let engine = |kind| {
            places(&runs, Method::Split, kind).iter().filter(|p| matches!(p, Place::Engine(_))).count()
        };
        let split = places(&runs, Method::Split, local);
        assert_eq!((split[7], split[0], split[1], split[2]), (e(2), e(0), e(1), k(0)));
        assert_eq!((engine(local), engine(RouteKind::Peer)), (3, 10));
    }
}
