//! The quantizing copy kernel (`quantize.cu`) on a CUDA device: a batch of [`QuantJob`]s quantized to
//! FP8 with their scales in one launch of each of its entry points the batch needs (two for those
//! whose jobs share amaxes), bit for bit as [`crate::quant::reference`]; or, riding a copy stage, in
//! the same launch as the batched copy ([`PreparedQuantize::launch_with_copy`], `copy_quantize.cu`).

use super::module;
use super::upload::UploadSlots;
use crate::error::{Error, Result, Status};
use crate::quant::job::{check_jobs, Amaxes, Granularity, QuantJob, ScaleKind};
use crate::quant::{Fp8, SourceType};
use crate::sync::lock;
use crate::transport::driver::{check, CurrentContext};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// The CUDA C source, compiled by NVRTC at first use on each device.
pub const SOURCE: &str = include_str!("quantize.cu");
/// The launch that also copies; compiled after the batched copy's source and [`SOURCE`].
pub const COPY_QUANTIZE_SOURCE: &str = include_str!("copy_quantize.cu");
const KERNEL_NAME: &std::ffi::CStr = c"refit_quantize";
const NARROW_KERNEL_NAME: &std::ffi::CStr = c"refit_quantize_narrow";
const ROWS_KERNEL_NAME: &std::ffi::CStr = c"refit_quantize_rows";
const GROUPS_KERNEL_NAME: &std::ffi::CStr = c"refit_quantize_groups";
const COPY_KERNEL_NAME: &std::ffi::CStr = c"refit_copy_quantize";
const AMAX_KERNEL_NAME: &std::ffi::CStr = c"refit_quantize_amax";
/// Threads per block (QUANT_THREADS in the source).
pub const THREADS: u32 = 256;
/// Vectors a thread keeps in block mode, in shared memory (QUANT_CACHE).
pub const CACHE: u64 = 8;
/// Thread blocks of the wide entry point each SM must be able to hold at once
/// (QUANT_WIDE_MIN_BLOCKS, its launch bounds): 64 registers per thread; its tiles' vectors wait in
/// shared memory (32 KiB a block), so four tiles are in flight per SM.
pub const WIDE_MIN_BLOCKS_PER_SM: u32 = 4;
/// The same for the launch that also copies (QUANT_WITH_COPY_MIN_BLOCKS): the batched copy's, so that
/// it keeps the copy's registers and occupancy (at four it would spill).
pub const WITH_COPY_MIN_BLOCKS_PER_SM: u32 = 3;
/// The narrow entry point's vectors per thread (QUANT_NARROW_CACHE) and blocks per SM
/// (QUANT_NARROW_MIN_BLOCKS): for scale blocks of at most NARROW_CACHE vectors per thread, and group
/// mode, where more tiles in flight beat a cache that would sit unused.
pub const NARROW_CACHE: u64 = 4;
pub const NARROW_MIN_BLOCKS_PER_SM: u32 = 4;
/// Vectors each thread of refit_quantize_amax (per-tensor jobs' phase 1) loads before using them
/// (QUANT_AMAX_LOADS), and its blocks per SM (QUANT_AMAX_MIN_BLOCKS): nothing is kept in shared
/// memory, so twice the wide entry point's.
pub const AMAX_LOADS: u64 = 4;
pub const AMAX_MIN_BLOCKS_PER_SM: u32 = 6;
/// Consecutive tiles each block of refit_quantize_amax takes (QUANT_AMAX_TILES).
pub const AMAX_TILES: u64 = 8;
/// Rounds of blocks per tile in group mode (QUANT_GROUP_ROUNDS).
pub const GROUP_ROUNDS: u64 = 4;
/// Blocks per SM of refit_quantize_groups, the group-mode entry point (QUANT_GROUP_MIN_BLOCKS).
pub const GROUP_MIN_BLOCKS_PER_SM: u32 = 6;
/// Blocks per SM of refit_quantize_rows, per-row jobs sharing each row's amax
/// (QUANT_ROWS_MIN_BLOCKS): the wide entry point's cache at one block more per SM.
pub const ROWS_MIN_BLOCKS_PER_SM: u32 = 5;
/// The width in vectors of a per-tensor job's tiles (rows at least that wide): THREADS / 16 rows
/// of them per pass of a block's threads, CACHE passes per tile.
pub const TENSOR_TILE_VECTORS: u64 = 16;
/// Tiles per entry of a batch's tile index (2^QUANT_INDEX_SHIFT): see [`Layout::index`].
pub const INDEX_SHIFT: u32 = 8;

/// A job as the kernel reads it (`struct QuantDesc` in the source; 136 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuantDesc {
    pub src: u64,
    pub dst: u64,
    pub scales: u64,
    pub rows: u64,
    pub cols: u64,
    pub src_stride: u64,
    pub dst_stride: u64,
    pub scale_stride: u64,
    pub first_tile: u64,
    pub grid_cols: u64,
    pub blocks: u64,
    pub block_rows: u32,
    pub block_cols: u32,
    pub source: u32,
    pub target: u32,
    pub scale_kind: u32,
    pub mode: u32,
    pub group_shift: u32,
    /// f32 bits: the floor under a block's amax ([`crate::quant::Arithmetic::min_amax`]).
    pub min_amax: u32,
    /// 1 where quotients are x * RN(1 / scale) ([`crate::quant::Arithmetic::by_reciprocal`]).
    pub by_reciprocal: u32,
    /// 1 where finite fp32 scales round up to powers of two
    /// ([`crate::quant::Arithmetic::power_of_two_scales`]).
    pub pow2_scales: u32,
    /// Per tensor: the amax word the job reduces into and reads, shared by every job sharing its
    /// amax ([`crate::quant::job::amax_owners`]: that of the first of them); per row with a shared
    /// amax, the first of its rows' words (row r's is amax_slot + r).
    pub amax_slot: u32,
    /// The code a NaN quotient takes: 0x7f, or the target's +FP8_MAX code where the arithmetic
    /// says so ([`crate::quant::Arithmetic::nan_to_max`]).
    pub nan_code: u32,
}

const MODE_BLOCK: u32 = 0;
const MODE_GROUP: u32 = 1;
const SCALE_F32: u32 = 0;
const SCALE_E8M0: u32 = 1;
const SCALE_TENSOR: u32 = 2;
const SCALE_ROWS_SHARED: u32 = 3;

/// The descriptors of a batch and its tiles (one thread block each). Group-mode jobs come first
/// (refit_quantize_groups takes tiles [0, group_tiles)), then the narrow entry point's other jobs
/// ([group_tiles, narrow_tiles)); the wide one takes [narrow_tiles, tiles - rows_tiles),
/// refit_quantize_rows (per-row jobs sharing each row's amax) the last rows_tiles. The launch that
/// also copies takes every narrow tile, group mode included, through its narrow code.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    pub descs: Vec<QuantDesc>,
    /// Entry c: the descriptor of tile c x 2^INDEX_SHIFT (of the last tile past the end), so that
    /// tile t's descriptor lies between entries t >> INDEX_SHIFT and the one after, inclusive: a
    /// thread block finds its tile's job in a few loads instead of a binary search over every job
    /// (a step's thousands of tensors would cost a dozen dependent loads per tile).
    pub index: Vec<u32>,
    pub tiles: u64,
    pub group_tiles: u64,
    pub narrow_tiles: u64,
    pub rows_tiles: u64,
    /// Whether a (wide) job is per tensor, so that the wide entry point's phase 1 runs.
    pub tensor_phase: bool,
    /// The amax words the two-phase jobs reduce into (per tensor: one per set of jobs sharing it;
    /// per row with a shared amax: one per row of each set), after the table; 0: no job takes two
    /// phases (then phase 1 does not run; two-phase jobs are wide).
    pub amax_words: u32,
    /// The amax word of each (key, row) that keyed jobs take (`QuantJob::amax_key`; row 0 per
    /// tensor), sorted: where amaxes exchanged between devices are read and seeded.
    pub keyed_words: Vec<((u64, u64), u32)>,
}

impl Layout {
    /// Bytes of the amax words after the table ([`Layout::amax_words`]).
    pub fn amax_bytes(&self) -> usize {
        self.amax_words as usize * 4
    }

    /// Whether phase 1 runs (a job is per tensor, or per row with a shared amax).
    pub fn two_phase(&self) -> bool {
        self.amax_words > 0
    }

    /// refit_quantize_groups's tiles (group-mode jobs).
    pub fn groups_range(&self) -> std::ops::Range<u64> {
        0..self.group_tiles
    }

    /// The narrow entry point's tiles, but for group mode's.
    pub fn narrow_range(&self) -> std::ops::Range<u64> {
        self.group_tiles..self.narrow_tiles
    }

    /// The wide entry point's tiles.
    pub fn wide_range(&self) -> std::ops::Range<u64> {
        self.narrow_tiles..self.tiles - self.rows_tiles
    }

    /// refit_quantize_rows's tiles (per-row jobs sharing each row's amax).
    pub fn rows_range(&self) -> std::ops::Range<u64> {
        self.tiles - self.rows_tiles..self.tiles
    }

    /// The table the kernel reads: the descriptors, then the tile index (amax words follow it on
    /// the device).
    pub fn to_bytes(&self) -> Vec<u8> {
        // SAFETY: QuantDesc is plain old data without padding (11 u64 then 12 u32).
        let descs = unsafe {
            std::slice::from_raw_parts(
                self.descs.as_ptr().cast::<u8>(),
                std::mem::size_of_val(self.descs.as_slice()),
            )
        };
        let mut bytes = Vec::with_capacity(self.table_len());
        bytes.extend_from_slice(descs);
        bytes.extend(self.index.iter().flat_map(|entry| entry.to_le_bytes()));
        bytes
    }

    /// Bytes of [`Layout::to_bytes`].
    pub fn table_len(&self) -> usize {
        std::mem::size_of_val(self.descs.as_slice()) + self.index.len() * 4
    }
}

/// Checks `jobs` ([`check_jobs`]) and lays them out for the kernel, the narrow entry point's first;
/// empty jobs get no descriptor. Unsupported when the batch needs more thread blocks than one launch
/// has.
pub fn layout(jobs: &[QuantJob]) -> Result<Layout> {
    check_jobs(jobs)?;
    let owners = crate::quant::job::amax_owners(jobs);
    let (mut groups, mut narrow, mut wide, mut rows) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (index, job) in jobs.iter().enumerate().filter(|(_, job)| job.elements() > 0) {
        let (mut desc, tiles) = describe(job);
        // The job's number for now; its owner's descriptor number below.
        desc.amax_slot = index as u32;
        let vectors_per_thread = u64::from(desc.block_rows)
            * u64::from(desc.block_cols).min(job.cols).div_ceil(job.vector_elements());
        let vectors_per_thread = vectors_per_thread.div_ceil(u64::from(THREADS));
        let fits_narrow = desc.scale_kind < SCALE_TENSOR && vectors_per_thread <= NARROW_CACHE;
        if desc.scale_kind == SCALE_ROWS_SHARED {
            rows.push((desc, tiles));
        } else if desc.mode == MODE_GROUP {
            groups.push((desc, tiles));
        } else if fits_narrow {
            narrow.push((desc, tiles));
        } else {
            wide.push((desc, tiles));
        }
    }
    let mut layout = Layout {
        group_tiles: groups.iter().map(|&(_, tiles)| tiles).sum(),
        narrow_tiles: groups.iter().chain(&narrow).map(|&(_, tiles)| tiles).sum(),
        rows_tiles: rows.iter().map(|&(_, tiles)| tiles).sum(),
        tensor_phase: wide.iter().any(|(desc, _)| desc.scale_kind == SCALE_TENSOR),
        ..Layout::default()
    };
    if jobs.len() > u32::MAX as usize {
        return Err(Error::new(
            Status::Unsupported,
            format!("the batch has {} jobs, more than one launch indexes ({})", jobs.len(), u32::MAX),
        ));
    }
    // Each set of jobs sharing an amax gets its words (one, or one per row) at its first job's.
    let mut words_of_job: Vec<Option<u32>> = vec![None; jobs.len()];
    let mut words = 0u64;
    for (mut desc, tiles) in groups.into_iter().chain(narrow).chain(wide).chain(rows) {
        let job = desc.amax_slot as usize;
        if desc.scale_kind >= SCALE_TENSOR && owners[job] == job {
            words_of_job[job] = Some(words as u32);
            words += if desc.scale_kind == SCALE_ROWS_SHARED { jobs[job].rows } else { 1 };
            if words > u64::from(u32::MAX) {
                return Err(Error::new(
                    Status::Unsupported,
                    format!("the batch's shared amaxes need {words} words, more than one launch indexes"),
                ));
            }
        }
        desc.first_tile = layout.tiles;
        layout.tiles += tiles;
        layout.descs.push(desc);
    }
    for desc in &mut layout.descs {
        desc.amax_slot = match desc.scale_kind >= SCALE_TENSOR {
            true => words_of_job[owners[desc.amax_slot as usize]].expect("every set's first job has words"),
            false => 0,
        };
    }
    layout.amax_words = words as u32;
    let keyed = jobs.iter().enumerate().filter(|(_, job)| job.amax_key != 0);
    let mut keyed_words: Vec<((u64, u64), u32)> = keyed
        .filter_map(|(index, job)| Some((job, words_of_job[owners[index]]?)))
        .flat_map(|(job, word)| {
            let rows = if job.quantization.granularity == Granularity::Row { job.rows } else { 1 };
            (0..rows).map(move |row| ((job.amax_key, row), word + row as u32))
        })
        .collect();
    keyed_words.sort_unstable();
    keyed_words.dedup();
    layout.keyed_words = keyed_words;
    layout.index = tile_index(&layout.descs, layout.tiles);
    if layout.tiles > i32::MAX as u64 {
        return Err(Error::new(
            Status::Unsupported,
            format!(
                "the batch needs {} thread blocks, more than one launch has ({})",
                layout.tiles,
                i32::MAX
            ),
        ));
    }
    Ok(layout)
}

/// [`Layout::index`] of descriptors laid out over `tiles` tiles (none without tiles).
fn tile_index(descs: &[QuantDesc], tiles: u64) -> Vec<u32> {
    if tiles == 0 {
        return Vec::new();
    }
    let chunks = tiles.div_ceil(1 << INDEX_SHIFT);
    (0..=chunks)
        .map(|chunk| {
            let tile = (chunk << INDEX_SHIFT).min(tiles - 1);
            (descs.partition_point(|d| d.first_tile <= tile) - 1) as u32
        })
        .collect()
}

/// One non-empty job's descriptor (its first tile still to be set) and its tiles.
fn describe(job: &QuantJob) -> (QuantDesc, u64) {
    let vector = job.vector_elements();
    let q = &job.quantization;
    let (grid_rows, grid_cols) = q.scale_grid(job.rows, job.cols);
    let mut desc = QuantDesc {
        src: job.src,
        dst: job.dst,
        scales: job.scales,
        rows: job.rows,
        cols: job.cols,
        src_stride: job.src_stride,
        dst_stride: job.dst_stride,
        scale_stride: job.scale_stride,
        grid_cols,
        blocks: grid_rows * grid_cols,
        source: match job.source {
            SourceType::Bf16 => 0,
            SourceType::F16 => 1,
            SourceType::F32 => 2,
        },
        target: match q.target {
            Fp8::E4m3fn => 0,
            Fp8::E5m2 => 1,
        },
        min_amax: q.arithmetic.min_amax().to_bits(),
        by_reciprocal: u32::from(q.arithmetic.by_reciprocal()),
        pow2_scales: u32::from(q.arithmetic.power_of_two_scales()),
        nan_code: u32::from(if q.arithmetic.nan_to_max() { q.target.max_code() } else { Fp8::NAN }),
        ..QuantDesc::default()
    };
    let tiles;
    let shared_rows = q.granularity == Granularity::Row && job.amax_key != 0;
    let per_row = job.cols.div_ceil(vector);
    if q.granularity == Granularity::Tensor && per_row >= TENSOR_TILE_VECTORS {
        // Two phases over tiles of TENSOR_TILE_VECTORS vectors by as many rows as the wide entry
        // point's cache holds: the shape of a 128 x 128 bf16 block, which takes the kernel's path
        // without row and partial-vector bookkeeping wherever the tile lies whole in the matrix
        // (slabs of whole rows never do: a row of 8192 bf16 is 1024 vectors, more than a block's
        // threads). One scale for the job: the tiles are not scale blocks.
        let tile_rows = u64::from(THREADS) * CACHE / TENSOR_TILE_VECTORS;
        desc.block_rows = tile_rows as u32;
        desc.block_cols = (TENSOR_TILE_VECTORS * vector) as u32;
        desc.grid_cols = per_row.div_ceil(TENSOR_TILE_VECTORS);
        desc.blocks = job.rows.div_ceil(tile_rows) * desc.grid_cols;
        desc.scale_kind = SCALE_TENSOR;
        desc.mode = MODE_BLOCK;
        tiles = desc.blocks;
    } else if shared_rows || q.granularity == Granularity::Tensor {
        // Two phases over slabs of whole rows, as many as the wide entry point's cache holds: per
        // tensor (rows narrower than TENSOR_TILE_VECTORS), each slab a tile; per row with each
        // row's amax shared with other jobs, each row its own.
        let slab = (u64::from(THREADS) * CACHE / per_row).clamp(1, job.rows);
        desc.block_rows = slab as u32;
        desc.block_cols = job.cols as u32;
        desc.grid_cols = 1;
        desc.blocks = job.rows.div_ceil(slab);
        desc.scale_kind = if shared_rows { SCALE_ROWS_SHARED } else { SCALE_TENSOR };
        desc.mode = MODE_BLOCK;
        tiles = desc.blocks;
    } else {
        let (block_rows, block_cols) = q.block_shape(job.rows, job.cols);
        desc.block_rows = block_rows as u32;
        desc.block_cols = block_cols as u32;
        desc.scale_kind = match q.scale_kind() {
            ScaleKind::F32 => SCALE_F32,
            ScaleKind::E8m0 => SCALE_E8M0,
        };
        let per_row = block_cols.min(job.cols).div_ceil(vector);
        if block_rows == 1 && per_row <= 32 {
            desc.mode = MODE_GROUP;
            desc.group_shift = per_row.next_power_of_two().trailing_zeros();
            let groups = u64::from(THREADS >> desc.group_shift);
            tiles = desc.blocks.div_ceil(groups * GROUP_ROUNDS);
        } else {
            desc.mode = MODE_BLOCK;
            tiles = desc.blocks;
        }
    }
    (desc, tiles)
}

/// The kernel's module as it is compiled: the batched copy's device functions (not its entry points,
/// which its own module has), the quantize kernel's source, then the entry point doing both (each
/// file's names are its own).
pub fn module_source() -> String {
    ["#define REFIT_COPY_TILES_ONLY", super::batched_copy::SOURCE, SOURCE, COPY_QUANTIZE_SOURCE].join("\n")
}

/// The kernel loaded into one device's primary context; loaded once per device and kept.
pub struct QuantizeKernel {
    device: i32,
    context: sys::CUcontext,
    /// refit_quantize (wide), refit_quantize_narrow, refit_quantize_groups, refit_quantize_rows,
    /// refit_quantize_amax (per-tensor jobs' phase 1) and refit_copy_quantize.
    wide: sys::CUfunction,
    narrow: sys::CUfunction,
    groups: sys::CUfunction,
    rows: sys::CUfunction,
    amax: sys::CUfunction,
    copying: sys::CUfunction,
    /// How the kernel was built, for logs and bench output.
    pub build: String,
    /// Where one-shot batches ([`QuantizeKernel::enqueue`]) upload their tables.
    uploads: UploadSlots,
}

// SAFETY: process-wide driver handles.
unsafe impl Send for QuantizeKernel {}
unsafe impl Sync for QuantizeKernel {}

impl QuantizeKernel {
    /// The kernel on `device`, compiled and loaded at the first call for that device (errors as for
    /// [`super::BatchedCopy::for_device`]; a failure is not cached).
    pub fn for_device(device: i32) -> Result<Arc<QuantizeKernel>> {
        static CACHE_BY_DEVICE: Mutex<Option<HashMap<i32, Arc<QuantizeKernel>>>> = Mutex::new(None);
        let mut cache = lock(&CACHE_BY_DEVICE);
        let map = cache.get_or_insert_with(HashMap::new);
        if let Some(kernel) = map.get(&device) {
            return Ok(kernel.clone());
        }
        let loaded = module::load(device, &module_source(), "copy_quantize.cu")?;
        let wide = module::function(loaded.module, KERNEL_NAME)?;
        let narrow = module::function(loaded.module, NARROW_KERNEL_NAME)?;
        let rows = module::function(loaded.module, ROWS_KERNEL_NAME)?;
        let groups = module::function(loaded.module, GROUPS_KERNEL_NAME)?;
        let copying = module::function(loaded.module, COPY_KERNEL_NAME)?;
        let amax = module::function(loaded.module, AMAX_KERNEL_NAME)?;
        // Their wide tiles keep their vectors in shared memory (32 KiB a block).
        loaded.prefer_shared_memory(wide)?;
        loaded.prefer_shared_memory(rows)?;
        loaded.prefer_shared_memory(copying)?;
        let (wide_per_sm, narrow_per_sm, groups_per_sm, rows_per_sm, amax_per_sm, copying_per_sm) = (
            loaded.blocks_per_sm(wide, THREADS)?,
            loaded.blocks_per_sm(narrow, THREADS)?,
            loaded.blocks_per_sm(groups, THREADS)?,
            loaded.blocks_per_sm(rows, THREADS)?,
            loaded.blocks_per_sm(amax, THREADS)?,
            loaded.blocks_per_sm(copying, THREADS)?,
        );
        let build = format!(
            "{} x {wide_per_sm} (narrow: {narrow_per_sm}, group mode: {groups_per_sm}, shared rows: {rows_per_sm}, per-tensor amax: {amax_per_sm}, with a copy: {copying_per_sm}) blocks of {THREADS}",
            loaded.build
        );
        log::info!("quantize kernel on device {device}: {build}");
        let kernel = Arc::new(QuantizeKernel {
            device,
            context: loaded.context,
            wide,
            narrow,
            groups,
            rows,
            amax,
            copying,
            build,
            uploads: UploadSlots::new(loaded.context),
        });
        map.insert(device, kernel.clone());
        Ok(kernel)
    }

    /// Queues the quantization of a batch laid out by [`layout`] on `stream`: its table uploaded
    /// stream-ordered through a reusable upload slot (`upload`), then the launches
    /// ([`QuantizeKernel::launches`]). Asynchronous; refused (`Unsupported`) on a stream being
    /// captured into a CUDA graph. An empty layout queues nothing. Errors: CudaError / OutOfMemory
    /// from the driver.
    ///
    /// # Safety
    /// `stream` is NULL or a live stream of this kernel's device; every laid-out job's source is device memory
    /// readable from it (whole 16-byte vectors: up to 15 bytes past each row) and its destination and
    /// scales writable, until the work has run; no source overlaps a destination.
    pub unsafe fn enqueue(&self, stream: sys::CUstream, layout: &Layout) -> Result<()> {
        if layout.tiles == 0 {
            return Ok(());
        }
        // SAFETY: the table holds the layout's descriptors, then room for its amax words; the
        // caller's promises cover the jobs.
        unsafe {
            self.uploads.with_table(stream, &layout.to_bytes(), layout.amax_bytes(), |table| {
                self.launches(stream, table, layout, None)
            })
        }
    }

    /// Queues the launches of a batch whose table ([`Layout::to_bytes`], then its amax words) is at
    /// `table` on the device: the narrow entry point over its tiles, the phase-1 launches of jobs
    /// sharing amaxes ([`QuantizeKernel::first_phase`]), then the wide entry point's and
    /// refit_quantize_rows's phase-2 launches. Nothing else (but the upload of a `seed`), so a
    /// prepared batch without one may be captured into a graph.
    ///
    /// # Safety
    /// As for [`QuantizeKernel::enqueue`]; `table` holds `layout` as described until the work has run.
    unsafe fn launches(
        &self,
        stream: sys::CUstream,
        table: u64,
        layout: &Layout,
        seed: Option<&Seed>,
    ) -> Result<()> {
        let first = amax_words(table, layout);
        self.launch(stream, table, layout, (self.groups, layout.groups_range()), 2, first)?;
        self.launch(stream, table, layout, (self.narrow, layout.narrow_range()), 2, first)?;
        // SAFETY: the caller's promises.
        let amax = unsafe { self.first_phase(stream, table, layout, seed) }?;
        self.launch(stream, table, layout, (self.wide, layout.wide_range()), 2, amax)?;
        self.launch(stream, table, layout, (self.rows, layout.rows_range()), 2, amax)
    }

    /// For jobs sharing amaxes, the zeroing of their words (or their upload from `seed`) and the
    /// phase-1 launches: refit_quantize_amax over the wide entry point's tiles for per-tensor jobs,
    /// refit_quantize_rows's for per-row ones; nothing otherwise, nor where `seed` holds every word. Returns the amax words' address (0
    /// without such jobs).
    ///
    /// # Safety
    /// As for [`QuantizeKernel::launches`]; `seed` was made for `layout`.
    unsafe fn first_phase(
        &self,
        stream: sys::CUstream,
        table: u64,
        layout: &Layout,
        seed: Option<&Seed>,
    ) -> Result<u64> {
        let amax = amax_words(table, layout);
        if layout.two_phase() {
            // SAFETY: the amax words lie in the table (the caller's promise). A copy from pageable
            // memory returns once the driver holds the bytes, so the seed may change after it.
            let words = layout.amax_words as usize;
            match seed {
                Some(seed) => check("cuMemcpyHtoDAsync", unsafe {
                    sys::cuMemcpyHtoDAsync_v2(amax, seed.words.as_ptr().cast(), words * 4, stream)
                })?,
                None => check("cuMemsetD32Async", unsafe { sys::cuMemsetD32Async(amax, 0, words, stream) })?,
            }
            if seed.is_some_and(|seed| seed.complete) {
                // Every amax is already the whole set's, over every device's jobs.
                return Ok(amax);
            }
            if layout.tensor_phase {
                self.launch_amax(stream, table, layout, amax)?;
            }
            self.launch(stream, table, layout, (self.rows, layout.rows_range()), 1, amax)?;
        }
        Ok(amax)
    }

    /// One launch of refit_copy_quantize: `copy` (a plain copy's launch, of this kernel's device)
    /// in its first blocks, then the phase-2 tiles of the batch at `table` of both block entry points.
    /// Phase 1 of jobs sharing amaxes is queued before it, and refit_quantize_rows's phase 2 after.
    ///
    /// # Safety
    /// As for [`QuantizeKernel::launches`], and for the copy's launch: its descriptors and the memory
    /// its segments name stay valid until the work has run.
    unsafe fn launch_with_copy(
        &self,
        stream: sys::CUstream,
        table: u64,
        layout: &Layout,
        copy: &super::batched_copy::Launch,
        seed: Option<&Seed>,
    ) -> Result<()> {
        let riding = layout.tiles - layout.rows_tiles;
        let blocks = u32::try_from(u64::from(copy.blocks) + riding)
            .ok()
            .filter(|&blocks| blocks <= i32::MAX as u32)
            .ok_or_else(|| {
                Error::new(
                    Status::Unsupported,
                    format!("{riding} quantizing tiles are too many for one launch"),
                )
            })?;
        // SAFETY: the caller's promises.
        let amax = unsafe { self.first_phase(stream, table, layout, seed) }?;
        let super::batched_copy::Launch {
            mut descriptors,
            mut segments,
            mut tiles,
            mut tile_shift,
            mut group_shift,
            ..
        } = *copy;
        let (mut copy_blocks, mut quant, mut njobs, mut narrow_tiles, mut amax) =
            (copy.blocks, table, layout.descs.len() as u32, layout.narrow_tiles, amax);
        let mut params: [*mut c_void; 10] = [
            (&mut descriptors as *mut u64).cast(),
            (&mut segments as *mut u64).cast(),
            (&mut tiles as *mut u64).cast(),
            (&mut tile_shift as *mut u32).cast(),
            (&mut group_shift as *mut u32).cast(),
            (&mut copy_blocks as *mut u32).cast(),
            (&mut quant as *mut u64).cast(),
            (&mut njobs as *mut u32).cast(),
            (&mut narrow_tiles as *mut u64).cast(),
            (&mut amax as *mut u64).cast(),
        ];
        // SAFETY: the parameters match refit_copy_quantize's signature; the caller's promises cover
        // the memory both parts name.
        unsafe { module::launch(self.copying, blocks, THREADS, stream, &mut params) }?;
        self.launch(stream, table, layout, (self.rows, layout.rows_range()), 2, amax)
    }

    /// refit_quantize_amax over the wide entry point's tiles, AMAX_TILES to a block, reducing
    /// per-tensor jobs' amaxes into the words at `amax`.
    fn launch_amax(&self, stream: sys::CUstream, table: u64, layout: &Layout, amax: u64) -> Result<()> {
        let tiles = layout.wide_range();
        if tiles.is_empty() {
            return Ok(());
        }
        let (mut descs, mut njobs, mut first_tile, mut end_tile, mut amax) =
            (table, layout.descs.len() as u32, tiles.start, tiles.end, amax);
        let mut params: [*mut c_void; 5] = [
            (&mut descs as *mut u64).cast(),
            (&mut njobs as *mut u32).cast(),
            (&mut first_tile as *mut u64).cast(),
            (&mut end_tile as *mut u64).cast(),
            (&mut amax as *mut u64).cast(),
        ];
        let blocks = (tiles.end - tiles.start).div_ceil(AMAX_TILES) as u32;
        // SAFETY: the parameters match refit_quantize_amax's signature; the caller's promises cover
        // the sources the jobs name, and the table holds the descriptors, tile index and amax words.
        unsafe { module::launch(self.amax, blocks, THREADS, stream, &mut params) }
    }

    /// One launch of `function` (an entry point) over `tiles`; nothing when they are none.
    fn launch(
        &self,
        stream: sys::CUstream,
        table: u64,
        layout: &Layout,
        (function, tiles): (sys::CUfunction, std::ops::Range<u64>),
        phase: u32,
        amax: u64,
    ) -> Result<()> {
        if tiles.is_empty() {
            return Ok(());
        }
        let (mut descs, mut njobs, mut first_tile, mut phase, mut amax) =
            (table, layout.descs.len() as u32, tiles.start, phase, amax);
        let mut params: [*mut c_void; 5] = [
            (&mut descs as *mut u64).cast(),
            (&mut njobs as *mut u32).cast(),
            (&mut first_tile as *mut u64).cast(),
            (&mut phase as *mut u32).cast(),
            (&mut amax as *mut u64).cast(),
        ];
        // SAFETY: the parameters match both entry points' signature; the caller's promises cover the
        // memory the jobs name, and the table holds the descriptors, tile index (and amax words).
        unsafe { module::launch(function, (tiles.end - tiles.start) as u32, THREADS, stream, &mut params) }
    }
}

/// The address of a batch's amax words at `table` (after its descriptors and tile index); 0 without
/// per-tensor jobs.
fn amax_words(table: u64, layout: &Layout) -> u64 {
    if layout.two_phase() {
        table + layout.table_len() as u64
    } else {
        0
    }
}

/// A batch laid out and uploaded once ([`crate::transport::Backend::prepare_quantize`] on CUDA):
/// each launch queues the kernel only.
pub struct PreparedQuantize {
    kernel: Arc<QuantizeKernel>,
    layout: Layout,
    /// The descriptors, then the amax words (`cuMemAlloc`, freed on drop); 0 for an empty batch.
    table: sys::CUdeviceptr,
    /// What launches start the amax words from instead of zeros
    /// ([`crate::transport::PreparedQuantize::seed_amaxes`]).
    seed: Mutex<Option<Seed>>,
}

/// Amax words a prepared batch's launches start from: amaxes exchanged between devices.
struct Seed {
    /// One per amax word of the layout; 0 where nothing was exchanged.
    words: Vec<u32>,
    /// Every word holds an exchanged amax (the whole set's, every device's jobs included), so that
    /// phase 1 has nothing to add and is skipped.
    complete: bool,
}

// SAFETY: a device allocation and process-wide driver handles.
unsafe impl Send for PreparedQuantize {}
unsafe impl Sync for PreparedQuantize {}

impl PreparedQuantize {
    /// `jobs` checked and laid out ([`layout`]) for `device`, the table uploaded.
    pub fn new(device: i32, jobs: &[QuantJob]) -> Result<PreparedQuantize> {
        let layout = layout(jobs)?;
        let kernel = QuantizeKernel::for_device(device)?;
        let mut prepared = PreparedQuantize { kernel, layout, table: 0, seed: Mutex::default() };
        if prepared.layout.tiles == 0 {
            return Ok(prepared);
        }
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(prepared.kernel.context) }?;
        let bytes = prepared.layout.to_bytes();
        // SAFETY: valid output slot, context current.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut prepared.table, bytes.len() + prepared.layout.amax_bytes())
        })?;
        // SAFETY: the allocation above holds `bytes`.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(prepared.table, bytes.as_ptr().cast(), bytes.len())
        })?;
        Ok(prepared)
    }

    /// Queues `copy`'s launch and these jobs as one launch (`copy_quantize.cu`) on `stream`: the copy
    /// in its first blocks, the quantizing tiles after them (per-tensor jobs' first phase before it).
    /// Two launches, one after the other, where one launch cannot do both: a copy recording digests
    /// for a verify, a copy of another device, an empty side.
    ///
    /// # Safety
    /// As for [`crate::transport::PreparedQuantize::launch`] and [`super::PreparedBatch::launch`];
    /// the jobs' codes and scales share no byte with the copy's destinations, and neither side
    /// writes what the other reads.
    pub unsafe fn launch_with_copy(&self, stream: sys::CUstream, copy: &super::PreparedBatch) -> Result<()> {
        let parts = copy.parts();
        let apart = self.layout.tiles == 0
            || parts.launch.tiles == 0
            || parts.tile_digests.is_some()
            || parts.kernel.device() != self.kernel.device;
        if apart {
            // SAFETY: the caller's promises.
            unsafe { copy.launch(stream) }?;
            return unsafe {
                crate::transport::PreparedQuantize::launch(
                    self,
                    crate::transport::Stream::from_ptr(stream.cast()),
                )
            };
        }
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(self.kernel.context) }?;
        // SAFETY: the table holds the layout until drop; the caller's promises cover the rest.
        let seed = lock(&self.seed);
        // SAFETY: the table holds the layout until drop; the caller's promises cover the rest.
        unsafe {
            self.kernel.launch_with_copy(stream, self.table, &self.layout, &parts.launch, seed.as_ref())
        }
    }
}

impl crate::transport::PreparedQuantize for PreparedQuantize {
    fn on_cuda(&self) -> Option<&PreparedQuantize> {
        Some(self)
    }

    unsafe fn launch(&self, stream: crate::transport::Stream) -> Result<()> {
        if self.layout.tiles == 0 {
            return Ok(());
        }
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(self.kernel.context) }?;
        // SAFETY: the table holds the layout until drop; the caller's promises cover the jobs.
        let seed = lock(&self.seed);
        // SAFETY: the table holds the layout until drop; the caller's promises cover the jobs.
        unsafe { self.kernel.launches(stream.as_ptr().cast(), self.table, &self.layout, seed.as_ref()) }
    }

    unsafe fn partial_amaxes(&self, stream: crate::transport::Stream, keys: &[u64]) -> Result<Amaxes> {
        let wanted: Vec<((u64, u64), u32)> = self
            .layout
            .keyed_words
            .iter()
            .copied()
            .filter(|((key, _), _)| keys.binary_search(key).is_ok())
            .collect();
        if wanted.is_empty() {
            return Ok(Amaxes::new());
        }
        let stream: sys::CUstream = stream.as_ptr().cast();
        // SAFETY: a retained primary context.
        let _current = unsafe { CurrentContext::enter(self.kernel.context) }?;
        super::upload::refuse_capture(
            stream,
            "a run that exchanges amaxes between devices waits mid-run for each device's own, which a CUDA \
             graph cannot capture",
        )?;
        let mut words = vec![0u32; self.layout.amax_words as usize];
        // SAFETY: the table holds the layout and its amax words until drop; the caller's promise
        // covers the sources; the words are read back before `words` goes.
        unsafe {
            let amax = self.kernel.first_phase(stream, self.table, &self.layout, None)?;
            check(
                "cuMemcpyDtoHAsync",
                sys::cuMemcpyDtoHAsync_v2(words.as_mut_ptr().cast(), amax, words.len() * 4, stream),
            )?;
            check("cuStreamSynchronize", sys::cuStreamSynchronize(stream))?;
        }
        Ok(wanted.into_iter().map(|(place, word)| (place, words[word as usize])).collect())
    }

    fn seed_amaxes(&self, amaxes: &Amaxes) -> Result<()> {
        let mut words = vec![0u32; self.layout.amax_words as usize];
        let mut seeded = vec![false; words.len()];
        for (place, word) in &self.layout.keyed_words {
            if let Some(&bits) = amaxes.get(place) {
                words[*word as usize] = bits;
                seeded[*word as usize] = true;
            }
        }
        let complete = seeded.iter().all(|&s| s);
        *lock(&self.seed) = seeded.contains(&true).then_some(Seed { words, complete });
        Ok(())
    }
}

impl Drop for PreparedQuantize {
    fn drop(&mut self) {
        if self.table == 0 {
            return;
        }
        // SAFETY: ours; a retained primary context. Freeing waits for work using it to end.
        let freed = unsafe { CurrentContext::enter(self.kernel.context) }
            .and_then(|_current| check("cuMemFree", unsafe { sys::cuMemFree_v2(self.table) }));
        if let Err(err) = freed {
            log::warn!("freeing a prepared quantize batch: {err}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{Arithmetic, Quantization};

    #[test]
    fn the_source_agrees_with_the_host_on_its_constants() {
        for define in [
            format!("#define QUANT_THREADS {THREADS}u"),
            format!("#define QUANT_CACHE {CACHE}u"),
            format!("#define QUANT_WIDE_MIN_BLOCKS {WIDE_MIN_BLOCKS_PER_SM}u"),
            format!("#define QUANT_WITH_COPY_MIN_BLOCKS {WITH_COPY_MIN_BLOCKS_PER_SM}u"),
            format!("#define QUANT_GROUP_ROUNDS {GROUP_ROUNDS}u"),
            format!("#define QUANT_GROUP_MIN_BLOCKS {GROUP_MIN_BLOCKS_PER_SM}u"),
            format!("#define QUANT_ROWS_MIN_BLOCKS {ROWS_MIN_BLOCKS_PER_SM}u"),
            format!("#define QUANT_NARROW_CACHE {NARROW_CACHE}u"),
            format!("#define QUANT_NARROW_MIN_BLOCKS {NARROW_MIN_BLOCKS_PER_SM}u"),
            format!("#define QUANT_AMAX_LOADS {AMAX_LOADS}u"),
            format!("#define QUANT_AMAX_MIN_BLOCKS {AMAX_MIN_BLOCKS_PER_SM}u"),
            format!("#define QUANT_AMAX_TILES {AMAX_TILES}u"),
            format!("#define QUANT_INDEX_SHIFT {INDEX_SHIFT}u"),
            format!("#define QUANT_DESC_BYTES {}u", std::mem::size_of::<QuantDesc>()),
            format!("#define QUANT_CANONICAL_NAN {:#x}u", crate::quant::reference::CANONICAL_NAN),
        ] {
            assert!(SOURCE.contains(&define), "quantize.cu lacks `{define}`");
        }
    }

    /// A job at addresses of its own (`slot`), never touched: layout reads no memory.
    /// The kernel's `quotient` (quantize.cu) in Rust: RN(x y), two corrections with the remainder,
    /// the sign of x.
    fn quotient(x: f32, s: f32, y: f32) -> f32 {
        let q0 = x * y;
        let q1 = (-q0).mul_add(s, x).mul_add(y, q0);
        let q2 = (-q1).mul_add(s, x).mul_add(y, q1);
        f32::from_bits((q2.to_bits() & 0x7fff_ffff) | (x.to_bits() & 0x8000_0000))
    }

    #[test]
    fn the_kernels_reciprocal_quotient_is_the_ieee_quotient_wherever_fp8_can_tell() {
        // Every bf16 element of a block against fp32 scales from amax over the whole exponent range
        // (and MX's powers of two): equal bits, or both quotients below 2^-20, which every FP8 format
        // encodes as the same signed zero.
        let mut amaxes: Vec<f32> = (0..40).map(|i| f32::from_bits(0x0080_0000 + i * 0x01e3_4567)).collect();
        amaxes.extend([
            0.0,
            1e-10,
            1e-4,
            1.0 / 512.0,
            448.0,
            57344.0,
            f32::MAX,
            1.0 + f32::EPSILON,
            2.0 - f32::EPSILON,
        ]);
        for amax in amaxes {
            for target in [Fp8::E4m3fn, Fp8::E5m2] {
                let scale = |kind| {
                    crate::quant::reference::block_scale(target, kind, Arithmetic::Divide, amax.to_bits())
                        .divisor
                };
                let (fp32, mx) = (scale(ScaleKind::F32), scale(ScaleKind::E8m0));
                for s in [fp32, mx] {
                    let y = 1.0 / s;
                    for bits in 0..=u16::MAX {
                        let x = f32::from_bits(u32::from(bits) << 16);
                        if !x.is_finite() || x.abs() > amax {
                            continue;
                        }
                        let (want, got) = (x / s, quotient(x, s, y));
                        assert!(
                            want.to_bits() == got.to_bits()
                                || (want.abs() < 2f32.powi(-20)
                                    && got.abs() < 2f32.powi(-20)
                                    && want.is_sign_negative() == got.is_sign_negative()),
                            "x {x:e} / s {s:e}: {want:e} != {got:e}"
                        );
                    }
                }
            }
        }
    }

    fn job(slot: u64, granularity: Granularity, rows: u64, cols: u64) -> QuantJob {
        let q = Quantization::new(Fp8::E4m3fn, granularity);
        let base = (slot + 1) << 44;
        let (_, grid_cols) = q.scale_grid(rows, cols);
        QuantJob {
            quantization: q,
            source: SourceType::Bf16,
            src: base,
            rows,
            cols,
            src_stride: cols.next_multiple_of(8),
            dst: base + (1 << 42),
            dst_stride: cols.next_multiple_of(8),
            scales: base + (1 << 43),
            scale_stride: grid_cols,
            amax_key: 0,
        }
    }

    #[test]
    fn each_granularity_takes_its_mode_and_tiles() {
        let block = job(0, Granularity::Block { rows: 128, cols: 128 }, 65536, 8192);
        let mx = job(1, Granularity::Mx, 65536, 8192);
        let row_short = job(2, Granularity::Row, 10, 200);
        let row_long = job(3, Granularity::Row, 10, 8192);
        let tensor = job(4, Granularity::Tensor, 1000, 8192);
        let row_wider = job(5, Granularity::Row, 3, 8200);
        let l = layout(&[block, mx, row_short, row_long, tensor, row_wider]).unwrap();
        let modes: Vec<(u64, u32, u32, u64)> =
            l.descs.iter().map(|d| (d.cols, d.mode, d.group_shift, d.first_tile)).collect();
        // Group mode's jobs first, in the order given: MX (4 lanes per block, 64 groups x 4 rounds
        // per tile), rows of 25 vectors (32 lanes); then the narrow entry point's rows of 1024
        // vectors (4 per thread: one block each). Then the wide one's: 512 x 64 blocks of 8 vectors
        // per thread, per tensor (8 x 64 tiles of 128 rows of 16 vectors, the last 104 rows
        // tall), rows of 1025 vectors (5 per thread).
        let mx_tiles = 65536 * 256 / 256;
        let narrow_tiles = mx_tiles + 1 + 10;
        assert_eq!(
            modes,
            vec![
                (8192, MODE_GROUP, 2, 0),
                (200, MODE_GROUP, 5, mx_tiles),
                (8192, MODE_BLOCK, 0, mx_tiles + 1),
                (8192, MODE_BLOCK, 0, narrow_tiles),
                (8192, MODE_BLOCK, 0, narrow_tiles + 32768),
                (8200, MODE_BLOCK, 0, narrow_tiles + 32768 + 512),
            ]
        );
        let tensor_tiles =
            (l.descs[4].block_rows, l.descs[4].block_cols, l.descs[4].grid_cols, l.descs[4].blocks);
        assert_eq!(tensor_tiles, (128, 128, 64, 512));
        assert_eq!((l.narrow_tiles, l.tiles), (narrow_tiles, narrow_tiles + 32768 + 512 + 3));
        // Rows narrower than a tile: per-tensor slabs of whole rows (2048 / 15 = 136 rows of 15 vectors).
        let narrow_tensor = layout(&[job(0, Granularity::Tensor, 1000, 120)]).unwrap();
        let slabs = (narrow_tensor.descs[0].block_rows, narrow_tensor.descs[0].blocks);
        assert_eq!(slabs, (136, 8));
        assert_eq!((l.groups_range(), l.narrow_range()), (0..mx_tiles + 1, mx_tiles + 1..narrow_tiles));
        // Group-mode jobs go before the narrow entry point's whatever the order given.
        let swapped = layout(&[row_long, block, mx]).unwrap();
        let order: Vec<(u64, u32)> = swapped.descs.iter().map(|d| (d.first_tile, d.mode)).collect();
        assert_eq!(order, vec![(0, MODE_GROUP), (mx_tiles, MODE_BLOCK), (mx_tiles + 10, MODE_BLOCK)]);
        assert_eq!((swapped.group_tiles, swapped.narrow_tiles), (mx_tiles, mx_tiles + 10));
        assert!(l.two_phase() && l.tensor_phase);
        // The index: an entry per 256 tiles and one past the end, each the job of its first tile.
        let chunks = l.tiles.div_ceil(256) as usize;
        assert_eq!(l.index.len(), chunks + 1);
        assert_eq!(&l.index[..3], &[0, 0, 0]);
        let first_tiles: Vec<u64> = l.descs.iter().map(|d| d.first_tile).collect();
        for (c, &job) in l.index.iter().enumerate() {
            let tile = ((c as u64) * 256).min(l.tiles - 1);
            let job = job as usize;
            assert!(
                first_tiles[job] <= tile && first_tiles.get(job + 1).is_none_or(|&next| next > tile),
                "{c}"
            );
        }
        assert_eq!(l.index[chunks], 5, "past the end: the last job");
        assert_eq!(l.to_bytes().len(), 6 * 136 + (chunks + 1) * 4);
        // A batch of wide jobs only, and one of narrow jobs only.
        let wide_only = layout(&[block]).unwrap();
        assert_eq!((wide_only.narrow_tiles, wide_only.tiles), (0, 32768));
        let narrow_only = layout(&[row_long]).unwrap();
        assert_eq!((narrow_only.narrow_tiles, narrow_only.tiles), (10, 10));
    }

    #[test]
    fn per_row_jobs_sharing_amaxes_take_slabs_of_their_own_entry_point_last() {
        let shared = |slot, cols| QuantJob { amax_key: 7, ..job(slot, Granularity::Row, 1000, cols) };
        let block = job(1, Granularity::Block { rows: 128, cols: 128 }, 256, 256);
        let row_long = job(2, Granularity::Row, 10, 8192);
        let l = layout(&[shared(0, 4096), block, row_long, shared(3, 4096)]).unwrap();
        // Narrow: 10 rows; wide: 2 x 2 blocks; rows: 1000 rows of 512 vectors, 4 to a slab, twice.
        assert_eq!((l.narrow_tiles, l.wide_range(), l.rows_range()), (10, 10..14, 14..514));
        let rows: Vec<(u64, u32, u32, u64)> =
            l.descs[2..].iter().map(|d| (d.first_tile, d.block_rows, d.scale_kind, d.blocks)).collect();
        assert_eq!(rows, vec![(14, 4, SCALE_ROWS_SHARED, 250), (264, 4, SCALE_ROWS_SHARED, 250)]);
        assert_eq!((l.descs[2].amax_slot, l.descs[3].amax_slot, l.amax_words), (0, 0, 1000));
        assert!(l.two_phase() && !l.tensor_phase);
        // Rows longer than the cache: a slab of one row.
        let long = layout(&[shared(0, 20_000)]).unwrap();
        assert_eq!((long.rows_range(), long.descs[0].block_rows), (0..1000, 1));
    }

    #[test]
    fn empty_jobs_get_no_descriptor() {
        let l = layout(&[job(0, Granularity::Row, 0, 64), job(1, Granularity::Mx, 7, 0)]).unwrap();
        assert_eq!((l.descs.len(), l.tiles, l.narrow_tiles, l.amax_words), (0, 0, 0, 0));
        assert!(l.index.is_empty() && l.to_bytes().is_empty());
    }
}
