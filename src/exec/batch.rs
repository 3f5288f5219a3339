//! One prepared copy stage of one rank: its segments (current addresses), moved by the batched kernel
//! (descriptors uploaded once) or by the copy engine, and relocatable in place when a buffer it
//! reads or writes moves (see `rebind`).

use super::options::Method;
use crate::error::Result;
use crate::group::Group;
use crate::kernels::layout::BatchLayout;
use crate::kernels::PreparedBatch;
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

pub(crate) struct Batch {
    backend: Arc<dyn Backend>,
    device: i32,
    /// Non-empty, validated segments; shared with host-backend work still queued.
    segments: Arc<Vec<Segment>>,
    bytes: u64,
    /// CUDA backend, kernel method only.
    kernel: Option<KernelBatch>,
    /// Indices relocated since the last [`Batch::flush`].
    dirty: Vec<usize>,
}

impl Batch {
    /// Prepares `segments` (non-empty, validated) for `rank`'s device. The kernel method uploads the
    /// descriptors now, and with `record_digests` records digests of what it reads for
    /// [`Batch::recorded_verify`]; `max_blocks` (0: no cap) limits the blocks of its launches.
    pub fn new(
        group: &Group,
        rank: usize,
        segments: Vec<Segment>,
        method: Method,
        max_blocks: u32,
        record_digests: bool,
    ) -> Result<Batch> {
        let device = group.device(rank)?;
        let bytes = segments.iter().map(|s| s.bytes().unwrap_or(0)).sum();
        let kernel = match (group.backend_kind(), method) {
            (BackendKind::Cuda, Method::Kernel) => {
                let layout = BatchLayout::new(&segments)?;
                let mut prepared = PreparedBatch::from_layout(device, &layout, record_digests)?;
                if max_blocks > 0 {
                    prepared.limit_blocks(max_blocks);
                }
                Some(KernelBatch { layout, prepared })
            }
            // The copy engine issues one copy per run at each launch; on the host backend both
            // methods are the same memmove loop, queued on the stream's worker.
            _ => None,
        };
        Ok(Batch {
            backend: Arc::clone(group.backend()),
            device,
            segments: Arc::new(segments),
            bytes,
            kernel,
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
        match &self.kernel {
            Some(kernel) => PreparedVerify::for_copy(&kernel.prepared).map(Some),
            None => Ok(None),
        }
    }

    /// Queues the batch on `stream`, a stream of its device. CUDA kernel: one launch, no host work
    /// per segment. Copy engine: one copy per contiguous run. Host backend: one queued memmove loop.
    ///
    /// # Safety
    /// Every segment's memory must stay valid until the queued work has run.
    pub unsafe fn launch(&self, stream: Stream) -> Result<()> {
        if let Some(kernel) = &self.kernel {
            return kernel.prepared.launch(stream.as_ptr().cast());
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
        if let Some(kernel) = &mut self.kernel {
            let descriptor = &mut kernel.layout.descriptors[index];
            descriptor.src = segment.src;
            descriptor.dst = segment.dst;
            self.dirty.push(index);
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
