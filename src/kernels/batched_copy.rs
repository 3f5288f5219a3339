//! The batched copy on a CUDA device: the compiled kernel per device ([`BatchedCopy`]), a one-shot
//! copy ([`copy_segments`]) and a batch uploaded once and launched many times ([`PreparedBatch`]).

use super::layout::BatchLayout;
use super::module;
use super::rendezvous::RankRendezvous;
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
    /// Blocks that fit on the device at once (SMs x resident blocks per SM): the persistent grid.
    max_blocks: u32,
    /// How the kernel was built, for logs and bench output.
    pub build: String,
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
        let per_sm = module::blocks_per_sm(function, BLOCK_THREADS)?;
        let max_blocks = loaded.sms * per_sm;
        let build = format!("{} x {per_sm} blocks of {BLOCK_THREADS}", loaded.build);
        log::info!("batched copy kernel on device {device}: {build}");
        Ok(BatchedCopy { device, context: loaded.context, function, synced, max_blocks, build })
    }

    /// The device ordinal this kernel runs on.
    pub fn device(&self) -> i32 {
        self.device
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
        self.enqueue_entry(stream, launch, None)
    }

    /// Enqueues `launch` through the plain entry point, or through the group-synchronized one when
    /// `synced` gives the rank's rendezvous and the call's epoch. The caller has this device's context
    /// current.
    fn enqueue_entry(
        &self,
        stream: sys::CUstream,
        launch: &Launch,
        synced: Option<(RankRendezvous, u64)>,
    ) -> Result<()> {
        let Launch { mut descriptors, mut segments, mut tiles, mut tile_shift, mut group_shift, blocks } =
            *launch;
        let (mut table, mut rank, mut ranks, mut epoch) = match synced {
            Some((r, epoch)) => (r.table, r.rank, r.ranks, epoch),
            None => (0, 0, 0, 0),
        };
        let mut params: [*mut c_void; 9] = [
            (&mut descriptors as *mut u64).cast(),
            (&mut segments as *mut u64).cast(),
            (&mut tiles as *mut u64).cast(),
            (&mut tile_shift as *mut u32).cast(),
            (&mut group_shift as *mut u32).cast(),
            (&mut table as *mut u64).cast(),
            (&mut rank as *mut u32).cast(),
            (&mut ranks as *mut u32).cast(),
            (&mut epoch as *mut u64).cast(),
        ];
        let function = if synced.is_some() { self.synced } else { self.function };
        // SAFETY: the parameter list starts with the plain kernel's signature and is the synced one's
        // (the driver reads only as many parameters as the function has); the descriptors stay
        // allocated until the launch completes (freed stream-ordered after it, or owned by a
        // PreparedBatch).
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                function,
                blocks,
                1,
                1,
                BLOCK_THREADS,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

/// Everything one launch passes to the kernel: the descriptor table (device address, real segment
/// count, tile count), the tiling, and the grid.
#[derive(Clone, Copy, Debug, Default)]
struct Launch {
    descriptors: u64,
    segments: u64,
    tiles: u64,
    tile_shift: u32,
    group_shift: u32,
    blocks: u32,
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

fn prepare(segments: &[Segment], checked: bool, tile_shift: u32) -> Result<BatchLayout> {
    validate(segments)?;
    if checked {
        check_destinations(segments)?;
    }
    BatchLayout::with_tile_shift(segments, tile_shift)
}

/// Copies every segment in one kernel launch on `stream` (a CUstream of `device`'s primary context,
/// or NULL for its legacy default stream). Source and destination addresses may be on this device or,
/// with peer access enabled from this device, on a peer (UVA). Asynchronous: returns once the work is
/// enqueued; the bytes are copied when the stream reaches it.
///
/// Descriptors travel without a host sync: a stream-ordered allocation (`cuMemAllocAsync` from the
/// device's default pool), an asynchronous upload from pageable memory (the driver stages it before
/// returning, so nothing here must outlive the call), the launch, then `cuMemFreeAsync`. Because of the
/// pageable upload, this call must not be captured into a CUDA graph: capture a [`PreparedBatch`].
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
    let layout = prepare(segments, checked, BatchLayout::DEFAULT_TILE_SHIFT)?;
    if layout.tiles == 0 {
        return Ok(());
    }
    let kernel = BatchedCopy::for_device(device)?;
    let blocks = kernel.grid_for(layout.tiles)?;
    // SAFETY: a retained primary context.
    let _current = unsafe { CurrentContext::enter(kernel.context) }?;
    let bytes = layout.as_bytes();
    let mut table: sys::CUdeviceptr = 0;
    // SAFETY: valid output slot; the stream belongs to the current context.
    check("cuMemAllocAsync", unsafe { sys::cuMemAllocAsync(&mut table, bytes.len(), stream) })?;
    // SAFETY: `bytes` is valid for its length; pageable memory is staged before the call returns.
    let mut result = check("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(table, bytes.as_ptr().cast(), bytes.len(), stream)
    });
    if result.is_ok() {
        result = kernel.enqueue(stream, &Launch::new(&layout, table, blocks));
    }
    // SAFETY: allocated above on this stream; freed after the launch in stream order.
    let freed = check("cuMemFreeAsync", unsafe { sys::cuMemFreeAsync(table, stream) });
    result.and(freed)
}

/// A batch whose descriptors (and tile split) live in device memory, launched any number of times.
///
/// `launch` does no host work that grows with the batch (one `cuLaunchKernel`), allocates nothing,
/// copies nothing from the host and never synchronizes, so it may be captured into a CUDA graph and
/// replayed. The segments' addresses are fixed at preparation; the bytes they point to are read at
/// each launch. `Send + Sync`: launch from any thread, on streams of the same device.
///
/// Drop frees the descriptor memory with `cuMemFree`; drop only once no launch (or graph replay)
/// using it can still run.
pub struct PreparedBatch {
    kernel: Arc<BatchedCopy>,
    /// `launch.descriptors` is 0 until the descriptor memory is allocated (Drop frees it), and stays 0
    /// for an empty batch.
    launch: Launch,
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
        PreparedBatch::tuned(device, segments, checked, BatchLayout::DEFAULT_TILE_SHIFT, 0)
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
        let mut layout = prepare(segments, checked, tile_shift)?;
        layout.group_shift = match lanes_per_tile {
            0 => layout.group_shift,
            8 => 3,
            16 => 4,
            32 => 5,
            other => {
                crate::bail!(Status::InvalidArgument, "lanes_per_tile = {other}; expected 0, 8, 16 or 32")
            }
        };
        let kernel = BatchedCopy::for_device(device)?;
        // An empty batch still launches one block when it takes part in a group-synchronized call.
        let blocks = if layout.tiles == 0 { 1 } else { kernel.grid_for(layout.tiles)? };
        let mut batch =
            PreparedBatch { kernel, launch: Launch::new(&layout, 0, blocks), bytes: layout.bytes };
        if layout.tiles == 0 {
            return Ok(batch);
        }
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(batch.kernel.context) }?;
        let bytes = layout.as_bytes();
        // SAFETY: valid output slot in the current context. Once set, Drop frees the allocation.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut batch.launch.descriptors, bytes.len()) })?;
        // SAFETY: the allocation holds bytes.len() bytes.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(batch.launch.descriptors, bytes.as_ptr().cast(), bytes.len())
        })?;
        Ok(batch)
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
        self.kernel.enqueue(stream, &self.launch)
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
        self.kernel.enqueue_entry(stream, &self.launch, Some((rendezvous, epoch)))
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

impl Drop for PreparedBatch {
    fn drop(&mut self) {
        if self.launch.descriptors == 0 {
            return;
        }
        // SAFETY: a retained primary context.
        let freed = unsafe { CurrentContext::enter(self.kernel.context) }.and_then(|_current| {
            // SAFETY: allocated by cuMemAlloc in this context, freed once.
            check("cuMemFree", unsafe { sys::cuMemFree_v2(self.launch.descriptors) })
        });
        if let Err(err) = freed {
            log::warn!("freeing a prepared batch's descriptors: {err}");
        }
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
