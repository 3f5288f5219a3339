//! One prepared copy stage of one rank: its segments (current addresses), moved by the batched kernel
//! (descriptors uploaded once), by the copy engine, or split between them by run length, and
//! relocatable in place when a buffer it reads or writes moves (see `rebind`).

use super::options::{Arm, Method};
use crate::error::Result;
use crate::group::Group;
use crate::kernels::layout::BatchLayout;
use crate::kernels::PreparedBatch;
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
    /// Kernel descriptor indices relocated since the last [`Batch::flush`].
    dirty: Vec<usize>,
}

impl Batch {
    /// Prepares `segments` (non-empty, validated) of route kind `kind` for `rank`'s device. The
    /// kernel method uploads the descriptors now, and with `record_digests` records digests of what
    /// it reads for [`Batch::recorded_verify`]; `max_blocks` (0: no cap) limits the blocks of its
    /// launches. The split method gives runs of at least [`Arm::copy_engine_min_run`] of `kind` to
    /// the copy engine and the others to the kernel.
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
        Ok(Batch {
            backend: Arc::clone(group.backend()),
            device,
            segments: Arc::new(segments),
            bytes,
            kernel,
            split,
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
