//! The batched copy on a CUDA device: the compiled kernel per device ([`BatchedCopy`]), a one-shot
//! copy ([`copy_segments`]) and a batch uploaded once and launched many times ([`PreparedBatch`]).

use super::device_memory::DeviceMemory;
use super::layout::{BatchLayout, DeviceSegment};
use super::module;
use super::rendezvous::RankRendezvous;
use super::upload::UploadSlots;
use crate::error::{Result, Status};
use crate::segment::check::{check_destinations, validate};
use crate::segment::Segment;
use crate::sync::lock;
use crate::transport::driver::{self, check, CurrentContext};
use crate::transport::nvrtc::{self, Output};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// The CUDA C source of the kernel, compiled by NVRTC at first use on each device.
pub const SOURCE: &str = include_str!("batched_copy.cu");
const KERNEL_NAME: &std::ffi::CStr = c"refit_batched_copy";
/// The group-synchronized entry point (see [`super::rendezvous`]).
const SYNCED_KERNEL_NAME: &std::ffi::CStr = c"refit_batched_copy_synced";
/// Threads per block; must match `__launch_bounds__` in the source.
const BLOCK_THREADS: u32 = 256;
const WARPS_PER_BLOCK: u64 = BLOCK_THREADS as u64 / 32;

/// Compiles the kernel source for compute capability `major.minor` without touching a GPU (a dev aid
/// and what [`BatchedCopy::for_device`] does first). `extra` NVRTC options are appended.
pub fn compile_for(major: i32, minor: i32, output: Output, extra: &[&str]) -> Result<nvrtc::Compiled> {
    nvrtc::compile(SOURCE, "batched_copy.cu", major, minor, output, extra)
}

/// The kernel loaded into one device's primary context, with its launch geometry. Loaded once per
/// device and kept for the life of the process. `Send + Sync`: a CUfunction may be launched from any
/// thread once its context is current.
pub struct BatchedCopy {
    device: i32,
    context: sys::CUcontext,
    function: sys::CUfunction,
    synced: sys::CUfunction,
    copy_digest: sys::CUfunction,
    check: sys::CUfunction,
    compare: sys::CUfunction,
    record: sys::CUfunction,
    pause: sys::CUfunction,
    /// Blocks that fit on the device at once (SMs x resident blocks per SM): the persistent grid.
    max_blocks: u32,
    /// The same for the compare entry point, which has fewer resident blocks per SM.
    compare_max_blocks: u32,
    /// How the kernel was built, for logs and bench output.
    pub build: String,
    /// Where one-shot copies ([`copy_segments`]) upload their descriptors.
    uploads: UploadSlots,
}

// SAFETY: the context and function handles are process-wide driver objects, usable from any thread.
unsafe impl Send for BatchedCopy {}
unsafe impl Sync for BatchedCopy {}

impl BatchedCopy {
    /// The kernel on `device` (an ordinal), compiled and loaded at the first call for that device.
    /// Errors: CudaUnavailable (no libcuda / driver), InvalidDevice, NvrtcUnavailable (no libnvrtc,
    /// message lists the paths tried), KernelLoadFailed (with NVRTC's log or the driver's error).
    /// A failure is not cached: a later call tries again.
    pub fn for_device(device: i32) -> Result<Arc<BatchedCopy>> {
        static CACHE: Mutex<Option<HashMap<i32, Arc<BatchedCopy>>>> = Mutex::new(None);
        driver::device_handle(device)?;
        // Holding the lock while compiling keeps two threads from compiling the same device twice.
        let mut cache = lock(&CACHE);
        let map = cache.get_or_insert_with(HashMap::new);
        if let Some(kernel) = map.get(&device) {
            return Ok(kernel.clone());
        }
        let kernel = Arc::new(BatchedCopy::load(device)?);
        map.insert(device, kernel.clone());
        Ok(kernel)
    }

    fn load(device: i32) -> Result<BatchedCopy> {
        let loaded = module::load(device, SOURCE, "batched_copy.cu")?;
        let function = module::function(loaded.module, KERNEL_NAME)?;
        let synced = module::function(loaded.module, SYNCED_KERNEL_NAME)?;
        let copy_digest = module::function(loaded.module, c"refit_batched_copy_digest")?;
        let check = module::function(loaded.module, c"refit_batched_check")?;
        let compare = module::function(loaded.module, c"refit_batched_compare")?;
        let record = module::function(loaded.module, c"refit_batched_record")?;
        let pause = module::function(loaded.module, c"refit_pause")?;
        let per_sm = loaded.blocks_per_sm(function, BLOCK_THREADS)?;
        let max_blocks = loaded.sms * per_sm;
        let compare_max_blocks = loaded.sms * loaded.blocks_per_sm(compare, BLOCK_THREADS)?;
        let build = format!("{} x {per_sm} blocks of {BLOCK_THREADS}", loaded.build);
        log::info!("batched copy kernel on device {device}: {build}");
        Ok(BatchedCopy {
            device,
            context: loaded.context,
            function,
            synced,
            copy_digest,
            check,
            compare,
            record,
            pause,
            max_blocks,
            compare_max_blocks,
            build,
            uploads: UploadSlots::new(loaded.context),
        })
    }

    /// The device ordinal this kernel runs on.
    pub fn device(&self) -> i32 {
        self.device
    }

    /// The device's primary context (retained for the life of the process).
    pub(crate) fn context(&self) -> sys::CUcontext {
        self.context
    }

    /// Queues on `stream` (a CUstream of this device's primary context, or NULL) a pause of `ns`
    /// nanoseconds: one sleeping warp (`refit_pause`), which paces copy-engine copies queued around
    /// it without holding an SM from other work.
    ///
    /// # Safety
    /// `stream` must be a live stream of this device's primary context (or NULL).
    pub unsafe fn pause(&self, stream: sys::CUstream, ns: u64) -> Result<()> {
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(self.context) }?;
        let mut ns = ns;
        let mut params: [*mut c_void; 1] = [(&mut ns as *mut u64).cast()];
        // SAFETY: refit_pause takes one u64, passed by value.
        unsafe { module::launch(self.pause, 1, 32, stream, &mut params) }
    }

    /// `launch` on a grid the compare entry point keeps resident (any grid walks every tile).
    pub(crate) fn for_compare(&self, mut launch: Launch) -> Launch {
        launch.blocks = launch.blocks.min(self.compare_max_blocks).max(1);
        launch
    }

    /// Blocks for `tiles` tiles: the persistent grid, or fewer when there is less work than warps.
    fn grid_for(&self, tiles: u64) -> Result<u32> {
        let blocks = tiles.div_ceil(WARPS_PER_BLOCK).min(self.max_blocks as u64).max(1) as u32;
        // The kernel computes tiles * warp / warps in 64 bits.
        let warps = blocks as u64 * WARPS_PER_BLOCK;
        if tiles.checked_mul(warps + 1).is_none() {
            crate::bail!(Status::Unsupported, "a batch of {tiles} tiles is too large for one launch");
        }
        Ok(blocks)
    }

    /// Enqueues the kernel described by `launch` on `stream`. The caller has this device's context
    /// current.
    fn enqueue(&self, stream: sys::CUstream, launch: &Launch) -> Result<()> {
        self.enqueue_entry(stream, launch, Entry::Copy)
    }

    /// Enqueues `launch` through `entry`'s entry point. The caller has this device's context current.
    pub(crate) fn enqueue_entry(&self, stream: sys::CUstream, launch: &Launch, entry: Entry) -> Result<()> {
        let Launch { mut descriptors, mut segments, mut tiles, mut tile_shift, mut group_shift, blocks } =
            *launch;
        // The parameters after the common five: (table, rank, ranks, epoch) for the synced entry,
        // (digests, first_bad) for the verifying ones.
        let (mut word5, mut rank, mut ranks, mut word8) = (0u64, 0u32, 0u32, 0u64);
        let (mut digests, mut first_bad) = (0u64, 0u64);
        let function = match entry {
            Entry::Copy => self.function,
            Entry::Synced(r, epoch) => {
                (word5, rank, ranks, word8) = (r.table, r.rank, r.ranks, epoch);
                self.synced
            }
            Entry::CopyDigest { digests: d } => {
                digests = d;
                self.copy_digest
            }
            Entry::Check { digests: d, first_bad: f } => {
                (digests, first_bad) = (d, f);
                self.check
            }
            Entry::Compare { first_bad: f } => {
                first_bad = f;
                self.compare
            }
            Entry::Record { digests: d } => {
                digests = d;
                self.record
            }
        };
        let mut params: [*mut c_void; 9] = [
            (&mut descriptors as *mut u64).cast(),
            (&mut segments as *mut u64).cast(),
            (&mut tiles as *mut u64).cast(),
            (&mut tile_shift as *mut u32).cast(),
            (&mut group_shift as *mut u32).cast(),
            (&mut word5 as *mut u64).cast(),
            (&mut rank as *mut u32).cast(),
            (&mut ranks as *mut u32).cast(),
            (&mut word8 as *mut u64).cast(),
        ];
        if !matches!(entry, Entry::Copy | Entry::Synced(..)) {
            params[5] = (&mut digests as *mut u64).cast();
            params[6] = (&mut first_bad as *mut u64).cast();
        }
        // SAFETY: `params` starts with the chosen entry point's parameters (the driver reads only as
        // many as the function has); the descriptors, digest and result words stay allocated until the
        // launch completes (freed stream-ordered after it, or owned by a prepared batch or verify).
        unsafe { module::launch(function, blocks, BLOCK_THREADS, stream, &mut params) }
    }
}

/// Which entry point of `batched_copy.cu` a launch goes through, with its extra parameters.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Entry {
    /// refit_batched_copy.
    Copy,
    /// refit_batched_copy_synced: the rank's rendezvous and the call's epoch.
    Synced(RankRendezvous, u64),
    /// refit_batched_copy_digest: one device word per tile for the source digests.
    CopyDigest { digests: u64 },
    /// refit_batched_check: the recorded tile digests and the result word.
    Check { digests: u64, first_bad: u64 },
    /// refit_batched_compare: the result word.
    Compare { first_bad: u64 },
    /// refit_batched_record: one device word per tile for the source digests.
    Record { digests: u64 },
}

/// Everything one launch passes to the kernel: the descriptor table (device address, real segment
/// count, tile count), the tiling, and the grid.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Launch {
    pub(crate) descriptors: u64,
    pub(crate) segments: u64,
    pub(crate) tiles: u64,
    pub(crate) tile_shift: u32,
    pub(crate) group_shift: u32,
    pub(crate) blocks: u32,
}

impl Launch {
    fn new(layout: &BatchLayout, descriptors: u64, blocks: u32) -> Launch {
        Launch {
            descriptors,
            segments: layout.segments(),
            tiles: layout.tiles,
            tile_shift: layout.tile_shift,
            group_shift: layout.group_shift,
            blocks,
        }
    }
}

/// Validates `segments` (and with `checked`, their destinations) and lays them out with tiles of
/// `2^tile_shift` bytes, or (None) the size [`BatchLayout::new`] picks.
fn prepare(segments: &[Segment], checked: bool, tile_shift: Option<u32>) -> Result<BatchLayout> {
    validate(segments)?;
    if checked {
        check_destinations(segments)?;
    }
    match tile_shift {
        Some(shift) => BatchLayout::with_tile_shift(segments, shift),
        None => BatchLayout::new(segments),
    }
}

/// Copies every segment in one kernel launch on `stream` (a CUstream of `device`'s primary context,
/// or NULL for its legacy default stream). Source and destination addresses may be on this device or,
/// with peer access enabled from this device, on a peer (UVA). Asynchronous: returns once the work is
/// enqueued; the bytes are copied when the stream reaches it.
///
/// Descriptors travel without a host sync, through a reusable upload slot (`upload`): written into
/// its page-locked image, copied to its device memory, read by the launch, and the slot free again
/// once the launch has run. Refused (`Unsupported`) on a stream being captured into a CUDA graph,
/// which would keep reading a slot that later calls rewrite: capture a [`PreparedBatch`].
///
/// `checked`: reject the batch with `Overlap` when two destination runs share a byte. Unchecked, such a
/// batch is the caller's error: which write wins is undefined. Sources overlapping destinations are
/// always the caller's error. An empty batch (or one of only empty segments) enqueues nothing.
///
/// Errors: InvalidArgument (a segment whose size or addresses overflow, or a zero address), Overlap,
/// Unsupported (checked mode over too many interleaved runs), and those of [`BatchedCopy::for_device`];
/// CudaError / OutOfMemory from the driver.
///
/// # Safety
/// `stream` must be NULL or a live stream of `device`'s primary context. Every run must lie in device
/// memory (of `device`, or of a peer whose access is enabled) that stays allocated until the copy has
/// run, with sources readable and destinations writable; no destination may overlap a source.
pub unsafe fn copy_segments(
    device: i32,
    stream: sys::CUstream,
    segments: &[Segment],
    checked: bool,
) -> Result<()> {
    let layout = prepare(segments, checked, None)?;
    if layout.tiles == 0 {
        return Ok(());
    }
    let kernel = BatchedCopy::for_device(device)?;
    let blocks = kernel.grid_for(layout.tiles)?;
    // SAFETY: the caller's promises; the launch reads the table within its bytes.
    unsafe {
        kernel.uploads.with_table(stream, layout.as_bytes(), 0, |table| {
            kernel.enqueue(stream, &Launch::new(&layout, table, blocks))
        })
    }
}

/// What a verify of a prepared batch shares with it (see [`PreparedBatch::parts`]).
pub(crate) struct BatchParts<'a> {
    pub kernel: &'a Arc<BatchedCopy>,
    pub launch: Launch,
    pub descriptors: Option<&'a Arc<DeviceMemory>>,
    pub tile_digests: Option<&'a Arc<DeviceMemory>>,
    pub segment_of: Option<&'a Arc<Vec<usize>>>,
}

/// A batch whose descriptors (and tile split) live in device memory, launched any number of times.
///
/// `launch` does no host work that grows with the batch (one `cuLaunchKernel`), allocates nothing,
/// copies nothing from the host and never synchronizes, so it may be captured into a CUDA graph and
/// replayed. The segments' addresses are fixed at preparation; the bytes they point to are read at
/// each launch. `Send + Sync`: launch from any thread, on streams of the same device.
///
/// Drop frees the descriptor memory with `cuMemFree` (once no verify made from the batch holds it);
/// drop only once no launch (or graph replay) using it can still run.
pub struct PreparedBatch {
    kernel: Arc<BatchedCopy>,
    /// `launch.descriptors` is `descriptors`' address, 0 for an empty batch.
    launch: Launch,
    descriptors: Option<Arc<DeviceMemory>>,
    /// One word per tile: the digests of the source bytes each launch read (see
    /// [`PreparedBatch::recording_digests`]).
    tile_digests: Option<Arc<DeviceMemory>>,
    /// With `tile_digests`: the caller's index of each descriptor, when empty segments shift them.
    segment_of: Option<Arc<Vec<usize>>>,
    bytes: u64,
}

// SAFETY: only device memory owned by this value and process-wide driver handles.
unsafe impl Send for PreparedBatch {}
unsafe impl Sync for PreparedBatch {}

impl PreparedBatch {
    /// Validates (and with `checked`, checks for overlapping destinations, see [`copy_segments`]),
    /// lays out and uploads the batch to `device`. Synchronous: returns once the descriptors are on the
    /// device. Errors as for [`copy_segments`].
    pub fn new(device: i32, segments: &[Segment], checked: bool) -> Result<PreparedBatch> {
        let layout = prepare(segments, checked, None)?;
        PreparedBatch::from_layout(device, &layout, false)
    }

    /// As [`PreparedBatch::new`] with tiles of `2^tile_shift` bytes instead of the default and, unless
    /// `lanes_per_tile` is 0 (automatic), that many lanes (8, 16 or 32) copying each tile. A tuning
    /// knob for benches; InvalidArgument for a tile shift outside 10..=20 or another lane count.
    pub fn tuned(
        device: i32,
        segments: &[Segment],
        checked: bool,
        tile_shift: u32,
        lanes_per_tile: u32,
    ) -> Result<PreparedBatch> {
        let mut layout = prepare(segments, checked, Some(tile_shift))?;
        layout.group_shift = match lanes_per_tile {
            0 => layout.group_shift,
            8 => 3,
            16 => 4,
            32 => 5,
            other => {
                crate::bail!(Status::InvalidArgument, "lanes_per_tile = {other}; expected 0, 8, 16 or 32")
            }
        };
        PreparedBatch::from_layout(device, &layout, false)
    }

    /// A batch of `layout` uploaded to `device`, recording source digests as
    /// [`PreparedBatch::recording_digests`] does when `record_digests`. For callers that keep the
    /// layout to [`PreparedBatch::rewrite`] its descriptors later. The layout must come from segments
    /// that passed [`crate::segment::check::validate`] and are all non-empty (so that descriptor and
    /// segment indices agree). Errors as for [`copy_segments`].
    pub fn from_layout(device: i32, layout: &BatchLayout, record_digests: bool) -> Result<PreparedBatch> {
        let kernel = BatchedCopy::for_device(device)?;
        // An empty batch still launches one block when it takes part in a group-synchronized call.
        let blocks = if layout.tiles == 0 { 1 } else { kernel.grid_for(layout.tiles)? };
        let descriptors = match layout.tiles {
            0 => None,
            _ => Some(Arc::new(DeviceMemory::upload(kernel.context, layout.as_bytes())?)),
        };
        let launch = Launch::new(layout, descriptors.as_ref().map_or(0, |d| d.ptr), blocks);
        let mut batch = PreparedBatch {
            kernel,
            launch,
            descriptors,
            tile_digests: None,
            segment_of: None,
            bytes: layout.bytes,
        };
        if record_digests {
            batch.record_digests()?;
        }
        Ok(batch)
    }

    /// Allocates the per-tile digest words every launch records from now on.
    fn record_digests(&mut self) -> Result<()> {
        if self.launch.tiles > 0 {
            let bytes = usize::try_from(self.launch.tiles.saturating_mul(8))
                .map_err(|_| crate::error::Error::invalid_argument("too many tiles to record digests for"))?;
            self.tile_digests = Some(Arc::new(DeviceMemory::alloc(self.kernel.context, bytes)?));
        }
        Ok(())
    }

    /// Overwrites descriptors `first..first + descriptors.len()` on the device with `descriptors`,
    /// synchronously: for a caller whose segments moved (same sizes and strides, new addresses), so
    /// that the next launch copies from and to the new places with nothing else rebuilt (a verify
    /// made by `super::verify::VerifyBatch::check` shares them, and follows). Each descriptor must be
    /// the layout's own with only `src` and `dst` changed (the tiling stays). InvalidArgument when
    /// the range is not within the batch.
    ///
    /// # Safety
    /// No launch of this batch (or of a verify sharing its descriptors) may be running or queued to
    /// run during the call.
    pub unsafe fn rewrite(&self, first: usize, descriptors: &[DeviceSegment]) -> Result<()> {
        let end = first.checked_add(descriptors.len());
        if end.is_none_or(|end| end as u64 > self.launch.segments) {
            crate::bail!(
                Status::InvalidArgument,
                "descriptors {first}..{} are not within the batch's {}",
                first.saturating_add(descriptors.len()),
                self.launch.segments
            );
        }
        let Some(memory) = self.descriptors.as_ref().filter(|_| !descriptors.is_empty()) else {
            return Ok(());
        };
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(self.kernel.context) }?;
        let size = std::mem::size_of_val(descriptors);
        let at = memory.ptr + (first * std::mem::size_of::<DeviceSegment>()) as u64;
        // SAFETY: within the allocation (checked above); the caller's promise that nothing reads it.
        check("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(at, descriptors.as_ptr().cast(), size) })
    }

    /// As [`PreparedBatch::new`], and every launch also records, for each tile (a piece of the batch
    /// of at most a few KiB, see `layout`), a digest of the source bytes it read, in device memory
    /// owned by the batch (8 bytes per tile): what [`super::verify::VerifyBatch::check`] compares the
    /// destinations with, without reading the sources again. The digests come from the elements the
    /// copy holds in registers, so they cost no extra memory traffic, only arithmetic
    /// (benches/gpu_digest.rs measures what that costs the copy).
    pub fn recording_digests(device: i32, segments: &[Segment], checked: bool) -> Result<PreparedBatch> {
        let mut batch = PreparedBatch::new(device, segments, checked)?;
        batch.record_digests()?;
        batch.segment_of = super::verify::segment_indices(segments).map(Arc::new);
        Ok(batch)
    }

    /// The batch's kernel, launch and device memory, for verifying it (`super::verify`).
    pub(crate) fn parts(&self) -> BatchParts<'_> {
        BatchParts {
            kernel: &self.kernel,
            launch: self.launch,
            descriptors: self.descriptors.as_ref(),
            tile_digests: self.tile_digests.as_ref(),
            segment_of: self.segment_of.as_ref(),
        }
    }

    /// Enqueues the batch on `stream` (a stream of this batch's device, NULL for its legacy default
    /// stream). Errors: CudaError when the launch fails (e.g. a stream of another device).
    ///
    /// # Safety
    /// As for [`copy_segments`], at every launch: `stream` is NULL or a live stream of this device, and
    /// the memory the segments name is still allocated and accessible when the launch runs.
    pub unsafe fn launch(&self, stream: sys::CUstream) -> Result<()> {
        if self.launch.tiles == 0 {
            return Ok(());
        }
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(self.kernel.context) }?;
        let entry = match &self.tile_digests {
            Some(digests) => Entry::CopyDigest { digests: digests.ptr },
            None => Entry::Copy,
        };
        self.kernel.enqueue_entry(stream, &self.launch, entry)
    }

    /// Enqueues the batch as one rank's part of a group-synchronized call (see [`super::rendezvous`]):
    /// the launch waits on the GPU until every rank's launch of `epoch` has started, copies, and ends
    /// once every rank has finished reading. Every rank of the rendezvous must launch with the same
    /// `epoch`, an empty batch included (it then only takes part in the rendezvous), or the others
    /// wait forever (see [`super::rendezvous::Rendezvous::release`]).
    ///
    /// # Safety
    /// As for [`PreparedBatch::launch`]; `rendezvous` belongs to a live rendezvous of this device.
    pub unsafe fn launch_synced(
        &self,
        stream: sys::CUstream,
        rendezvous: RankRendezvous,
        epoch: u64,
    ) -> Result<()> {
        if u64::from(self.launch.blocks) >= super::rendezvous::DEPARTURE_UNITS {
            crate::bail!(
                Status::Unsupported,
                "{} blocks are too many for a synchronized launch",
                self.launch.blocks
            );
        }
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(self.kernel.context) }?;
        self.kernel.enqueue_entry(stream, &self.launch, Entry::Synced(rendezvous, epoch))
    }

    /// Launches this batch on at most `blocks` blocks (at least one) from now on. Fewer blocks copy
    /// more slowly and leave the rest of the GPU's memory bandwidth to concurrent work: for a copy
    /// that runs beside a longer one and should not slow it.
    pub fn limit_blocks(&mut self, blocks: u32) {
        self.launch.blocks = self.launch.blocks.min(blocks).max(1);
    }

    /// Non-empty segments in the batch.
    pub fn segments(&self) -> u64 {
        self.launch.segments
    }

    /// Payload bytes one launch copies.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Tiles one launch runs, the blocks it launches, and the lanes copying each tile.
    pub fn geometry(&self) -> (u64, u32, u32) {
        (self.launch.tiles, self.launch.blocks, 1 << self.launch.group_shift)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_counts_departures_in_the_same_units_as_the_rendezvous() {
        let define = format!("#define DEPARTURE_UNITS {}ull", super::super::rendezvous::DEPARTURE_UNITS);
        assert!(SOURCE.contains(&define), "batched_copy.cu lacks `{define}`");
    }
}
