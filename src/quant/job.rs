//! What a quantization is ([`Quantization`]: a target format and a granularity) and what one
//! quantization job covers ([`QuantJob`]: a source matrix, its FP8 destination and its scales), with the
//! checks every implementation applies ([`check_jobs`]) and the shape of the scale grid.

use super::fp8::{Fp8, SourceType};
use crate::error::{Error, Result, Status};
use crate::segment::{check::check_destinations, Segment};
use std::collections::HashMap;

/// Which elements share one scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Granularity {
    /// One fp32 scale for the whole matrix.
    Tensor,
    /// One fp32 scale per row (per output channel of a weight stored rows x in-features).
    Row,
    /// One fp32 scale per block of `rows x cols` elements (DeepSeek-V3 / Qwen3 FP8: 128 x 128); the
    /// blocks tile the matrix from (0, 0), the last ones in each direction may be partial.
    Block { rows: u32, cols: u32 },
    /// OCP MX: one e8m0 scale (a power of two) per 32 consecutive elements of a row.
    Mx,
}

/// The default block shape of [`Granularity::Block`] (DeepSeek-V3's).
pub const DEFAULT_BLOCK: u32 = 128;
/// Elements per MX block.
pub const MX_BLOCK: u32 = 32;
/// Block columns must be a multiple of this: the kernel reads and writes 8 elements at a time, each
/// group inside one block.
pub const BLOCK_COLS_MULTIPLE: u32 = 8;
/// The most elements a block may hold (one thread block quantizes one block).
pub const MAX_BLOCK_ELEMENTS: u64 = 1 << 24;

/// How a block's fp32 scale and its elements' quotients are computed. The quantizers users compare
/// with agree on the amax, the cast and the saturation of finite quotients, and differ in three
/// places only: the floor under the amax that a scale is computed from, whether a quotient is one
/// IEEE division or the product by the scale's rounded reciprocal, and what a NaN quotient becomes.
/// Each variant is one such choice, named after who uses it (`super` has the arithmetic;
/// [`Arithmetic::min_amax`], [`Arithmetic::by_reciprocal`], [`Arithmetic::nan_to_max`]).
/// MX scales are powers of two, where both quotients agree and no floor applies: MX takes
/// [`Arithmetic::Divide`] only.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Arithmetic {
    /// scale = max(amax, 1e-10) / FP8_MAX, quotient x / scale: vLLM's and SGLang's per-token-group
    /// CUDA quantizers (their default eps) and torch's `clamp(x / s, -MAX, MAX).to(fp8)`.
    #[default]
    Divide,
    /// scale = max(amax, 1e-4) / FP8_MAX, quotient x * RN(1 / scale): DeepGEMM's
    /// `per_block_cast_to_fp8`, which vLLM 0.33 runs to quantize BF16 weights to FP8 blocks online.
    DeepGemm,
    /// scale = max(amax, 2^-9) / FP8_MAX, quotient x / scale: vLLM 0.33's online per-channel
    /// weights, whose scale floor 1 / (FP8_MAX * 512) is this amax floor divided by FP8_MAX.
    VllmChannel,
    /// As [`Arithmetic::DeepGemm`], each finite scale then rounded up to a power of two (2^-126 ..
    /// 2^127, stored as fp32): DeepGEMM's UE8M0 scales (`ceil_to_ue8m0`), with which vLLM and SGLang
    /// quantize for DeepGEMM on Blackwell, and which DeepSeek-V3.1's checkpoints carry.
    DeepGemmUe8m0,
    /// scale = amax / FP8_MAX (no floor), quotient x * RN(1 / scale), a NaN quotient to +FP8_MAX:
    /// vLLM 0.33's online per-tensor weights (`static_scaled_fp8_quant`, whose clamp
    /// `fmaxf(-MAX, fminf(q, MAX))` takes a NaN to +MAX). An all-zero block gets scale 0 and every
    /// code +FP8_MAX (0 * inf is NaN), which dequantizes to 0.
    VllmTensor,
}

impl Arithmetic {
    /// The floor under a block's amax before its fp32 scale is computed.
    pub fn min_amax(self) -> f32 {
        match self {
            Arithmetic::Divide => 1e-10,
            Arithmetic::DeepGemm | Arithmetic::DeepGemmUe8m0 => 1e-4,
            Arithmetic::VllmChannel => 1.0 / 512.0,
            Arithmetic::VllmTensor => 0.0,
        }
    }

    /// Whether a quotient is x * RN(1 / scale) (else the IEEE quotient x / scale).
    pub fn by_reciprocal(self) -> bool {
        matches!(self, Arithmetic::DeepGemm | Arithmetic::DeepGemmUe8m0 | Arithmetic::VllmTensor)
    }

    /// Whether a NaN quotient encodes as +FP8_MAX (else as the NaN code 0x7f).
    pub fn nan_to_max(self) -> bool {
        matches!(self, Arithmetic::VllmTensor)
    }

    /// Whether each finite fp32 scale is rounded up to a power of two.
    pub fn power_of_two_scales(self) -> bool {
        matches!(self, Arithmetic::DeepGemmUe8m0)
    }

    /// The C API's REFIT_ARITHMETIC_* number.
    pub fn code(self) -> u32 {
        match self {
            Arithmetic::Divide => 0,
            Arithmetic::DeepGemm => 1,
            Arithmetic::VllmChannel => 2,
            Arithmetic::DeepGemmUe8m0 => 3,
            Arithmetic::VllmTensor => 4,
        }
    }

    pub fn from_code(code: u32) -> Option<Arithmetic> {
        [
            Arithmetic::Divide,
            Arithmetic::DeepGemm,
            Arithmetic::VllmChannel,
            Arithmetic::DeepGemmUe8m0,
            Arithmetic::VllmTensor,
        ]
        .into_iter()
        .find(|a| a.code() == code)
    }
}

/// A quantization: a target FP8 format, a granularity and the arithmetic of its fp32 scales. A
/// plan's quantized need carries one; the quantizing copy (`refit_quantize_batch`) takes one per job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Quantization {
    pub target: Fp8,
    pub granularity: Granularity,
    pub arithmetic: Arithmetic,
}

/// How scales are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScaleKind {
    /// fp32, the dequantization factor (x ~ q * scale): DeepSeek's `weight_scale_inv`.
    F32,
    /// e8m0: one byte, the scale 2^(byte - 127); 0xff is NaN (OCP MX).
    E8m0,
}

impl ScaleKind {
    pub const fn size(self) -> u64 {
        match self {
            ScaleKind::F32 => 4,
            ScaleKind::E8m0 => 1,
        }
    }
}

impl Quantization {
    /// `target` at `granularity` with the default arithmetic ([`Arithmetic::Divide`]).
    pub const fn new(target: Fp8, granularity: Granularity) -> Quantization {
        Quantization { target, granularity, arithmetic: Arithmetic::Divide }
    }

    /// This quantization with `arithmetic`.
    pub const fn with(self, arithmetic: Arithmetic) -> Quantization {
        Quantization { arithmetic, ..self }
    }

    pub fn scale_kind(&self) -> ScaleKind {
        match self.granularity {
            Granularity::Mx => ScaleKind::E8m0,
            _ => ScaleKind::F32,
        }
    }

    /// The rows and columns of the elements sharing one scale, for a `rows x cols` matrix.
    pub fn block_shape(&self, rows: u64, cols: u64) -> (u64, u64) {
        match self.granularity {
            Granularity::Tensor => (rows.max(1), cols.max(1)),
            Granularity::Row => (1, cols.max(1)),
            Granularity::Block { rows, cols } => (u64::from(rows), u64::from(cols)),
            Granularity::Mx => (1, u64::from(MX_BLOCK)),
        }
    }

    /// The scale grid of a `rows x cols` matrix: ceil(rows / block rows) x ceil(cols / block cols).
    pub fn scale_grid(&self, rows: u64, cols: u64) -> (u64, u64) {
        let (block_rows, block_cols) = self.block_shape(rows, cols);
        (rows.div_ceil(block_rows), cols.div_ceil(block_cols))
    }
}

/// One matrix to quantize. Addresses are device pointers (host addresses on the host backend).
///
/// Element (r, c) is read at `src + (r * src_stride + c) * size(source)` and its FP8 code written at
/// `dst + r * dst_stride + c`. The scale of block (i, j) of the scale grid
/// ([`Quantization::scale_grid`]) is at `scales + (i * scale_stride + j) * size(scale)`: row-major,
/// `scale_stride` scales from one grid row to the next (per tensor: one scale; per row: `rows` x 1,
/// so `scale_stride` 1 makes a vector; per block: DeepSeek's `[ceil(rows/128), ceil(cols/128)]`
/// with `scale_stride` = ceil(cols/128); MX: `rows x ceil(cols/32)` bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QuantJob {
    pub quantization: Quantization,
    pub source: SourceType,
    pub src: u64,
    pub rows: u64,
    pub cols: u64,
    /// Elements from one source row to the next.
    pub src_stride: u64,
    pub dst: u64,
    /// Bytes (= FP8 elements) from one destination row to the next.
    pub dst_stride: u64,
    pub scales: u64,
    /// Scales from one scale-grid row to the next.
    pub scale_stride: u64,
    /// Per tensor: jobs naming the same nonzero key share one amax (that of all their elements) as
    /// jobs naming the same `scales` do, each writing it to its own scale: one value for the shards
    /// of a weight that several receivers hold, each with its own copy of the scale. Per row: jobs
    /// naming the same nonzero key (and having the same rows) share each row's amax, each writing
    /// its own scales: a row-parallel weight's column shards. Other granularities ignore it. 0: none.
    pub amax_key: u64,
}

impl QuantJob {
    pub fn elements(&self) -> u64 {
        self.rows.saturating_mul(self.cols)
    }

    /// Source elements per 16-byte vector (the kernel's unit of reading).
    pub fn vector_elements(&self) -> u64 {
        16 / self.source.size()
    }

    /// The sides of region `index` of [`QuantJob::regions`] (regions of several jobs laid end to
    /// end, or the first `per_job` of each) that must be memory of `device`, as
    /// `transport::access::Owners`: the source matrix is read (its source side), the destination and
    /// the scales written (their destination sides).
    pub fn region_owners(index: usize, per_job: usize, device: i32) -> (Option<i32>, Option<i32>) {
        if index % per_job == 0 {
            (Some(device), None)
        } else {
            (None, Some(device))
        }
    }

    /// The memory the job touches as three segments, each the same region on both sides: the source
    /// matrix as the kernel reads it (whole 16-byte vectors per row), the destination matrix and the
    /// scale grid. Empty segments for a job of no elements. For the check that the memory is the
    /// device's (`transport::access`); the job must have passed [`check_job`].
    pub fn regions(&self) -> [Segment; 3] {
        let [matrix, scales] = self.written();
        if self.elements() == 0 {
            return [Segment::default(), matrix, scales];
        }
        let size = self.source.size();
        let row = (self.cols * size).next_multiple_of(16);
        let stride = self.src_stride * size;
        let source = Segment {
            src: self.src,
            dst: self.src,
            len: row,
            count: [self.rows, 1],
            src_stride: [stride, 0],
            dst_stride: [stride, 0],
        };
        [source, matrix, scales]
    }

    /// The destination matrix and the scale grid as two segments (their destination sides; the source
    /// sides repeat them), for the overlap check.
    fn written(&self) -> [Segment; 2] {
        // A job of no elements has its strides unchecked (nothing is read or written through them),
        // so they are not multiplied here.
        if self.elements() == 0 {
            return [Segment::default(), Segment::default()];
        }
        let (grid_rows, grid_cols) = self.quantization.scale_grid(self.rows, self.cols);
        let scale_bytes = self.quantization.scale_kind().size();
        let matrix = Segment {
            src: self.dst,
            dst: self.dst,
            len: self.cols,
            count: [self.rows, 1],
            src_stride: [self.dst_stride, 0],
            dst_stride: [self.dst_stride, 0],
        };
        let scales = Segment {
            src: self.scales,
            dst: self.scales,
            len: grid_cols * scale_bytes,
            count: [grid_rows, 1],
            src_stride: [self.scale_stride * scale_bytes, 0],
            dst_stride: [self.scale_stride * scale_bytes, 0],
        };
        [matrix, scales]
    }
}

fn invalid(index: usize, message: String) -> Error {
    Error::invalid_argument(format!("jobs[{index}]: {message}"))
}

/// One past the last byte of `rows` rows of `len` bytes, `stride` bytes apart from `base`, or None on
/// overflow.
fn end_of(base: u64, rows: u64, stride: u64, len: u64) -> Option<u64> {
    rows.checked_sub(1)?.checked_mul(stride)?.checked_add(len)?.checked_add(base)
}

/// Checks one job (`index` names it in messages). Every number is checked before the kernel relies on
/// it: block shape, strides, alignment, address ranges.
pub fn check_job(index: usize, job: &QuantJob) -> Result<()> {
    let q = &job.quantization;
    if let Granularity::Block { rows, cols } = q.granularity {
        if rows == 0 || cols == 0 {
            return Err(invalid(index, format!("block shape is {rows} x {cols}; both must be at least 1")));
        }
        if cols % BLOCK_COLS_MULTIPLE != 0 {
            return Err(invalid(
                index,
                format!("block columns are {cols}; they must be a multiple of {BLOCK_COLS_MULTIPLE}"),
            ));
        }
        if u64::from(rows) * u64::from(cols) > MAX_BLOCK_ELEMENTS {
            return Err(invalid(
                index,
                format!("a {rows} x {cols} block holds more than {MAX_BLOCK_ELEMENTS} elements"),
            ));
        }
    }
    if q.granularity == Granularity::Mx && q.arithmetic != Arithmetic::Divide {
        return Err(invalid(
            index,
            format!(
                "arithmetic {} for MXFP8, whose scales are powers of two: it takes REFIT_ARITHMETIC_DIVIDE (0) only",
                q.arithmetic.code()
            ),
        ));
    }
    if job.elements() == 0 {
        return Ok(());
    }
    // The kernel counts a row's elements and vectors in 32 bits, its last vector's padding included.
    if job.rows > u64::from(u32::MAX) * 64 || job.cols > u64::from(u32::MAX - 15) {
        return Err(invalid(
            index,
            format!("{} x {} is too large (rows up to 2^38, columns up to 2^32 - 16)", job.rows, job.cols),
        ));
    }
    let size = job.source.size();
    if job.rows > 1 && job.src_stride < job.cols {
        return Err(invalid(index, format!("src_row_stride {} is below cols {}", job.src_stride, job.cols)));
    }
    if job.rows > 1 && job.dst_stride < job.cols {
        return Err(invalid(index, format!("dst_row_stride {} is below cols {}", job.dst_stride, job.cols)));
    }
    let (grid_rows, grid_cols) = q.scale_grid(job.rows, job.cols);
    if grid_rows > 1 && job.scale_stride < grid_cols {
        return Err(invalid(
            index,
            format!(
                "scale_row_stride {} is below the {grid_cols} scales of a scale-grid row ({grid_rows} x {grid_cols} scales)",
                job.scale_stride
            ),
        ));
    }
    for (what, address) in [("src", job.src), ("dst", job.dst), ("scales", job.scales)] {
        if address == 0 {
            return Err(invalid(index, format!("{what} is 0")));
        }
    }
    let src_row_bytes = job.src_stride.checked_mul(size);
    if job.src % 16 != 0 || (job.rows > 1 && src_row_bytes.is_none_or(|b| b % 16 != 0)) {
        return Err(invalid(
            index,
            format!(
                "misaligned source rows: src {:#x} and src_row_stride {} elements of {size} bytes must make every \
                 row start a multiple of 16 bytes",
                job.src, job.src_stride
            ),
        ));
    }
    let vector = job.vector_elements();
    if job.dst % vector != 0 || (job.rows > 1 && job.dst_stride % vector != 0) {
        return Err(invalid(
            index,
            format!(
                "misaligned destination rows: dst {:#x} and dst_row_stride {} must be multiples of {vector} bytes \
                 (the FP8 codes of one 16-byte source vector)",
                job.dst, job.dst_stride
            ),
        ));
    }
    let scale_bytes = q.scale_kind().size();
    if job.scales % scale_bytes != 0 {
        return Err(invalid(
            index,
            format!("scales {:#x} is not a multiple of {scale_bytes} bytes", job.scales),
        ));
    }
    // Every range read or written fits in the address space (the source is read in whole 16-byte
    // vectors, so up to 15 bytes past each row's last element).
    let src_end = src_row_bytes.and_then(|stride| {
        let row = job.cols.checked_mul(size)?.checked_next_multiple_of(16)?;
        end_of(job.src, job.rows, stride, row)
    });
    let dst_end = end_of(job.dst, job.rows, job.dst_stride, job.cols);
    let scale_end = job
        .scale_stride
        .checked_mul(scale_bytes)
        .and_then(|stride| end_of(job.scales, grid_rows, stride, grid_cols * scale_bytes));
    for (what, end) in [("source", src_end), ("destination", dst_end), ("scales", scale_end)] {
        if end.is_none() {
            return Err(invalid(index, format!("the {what} runs past the end of the 64-bit address space")));
        }
    }
    Ok(())
}

/// For each job, the job whose per-tensor scale it writes: the first of `jobs` that is per tensor
/// and names the same `scales` as it (itself when none comes before it; every job that is not per
/// tensor, or has no elements, is its own). That first job owns the scale: only its scale grid is
/// checked for overlaps, and only it writes the scale where one writer is wanted (the host
/// reference; the GPU's jobs each write the same bits atomically). Jobs sharing a scale share its
/// amax too ([`amax_owners`]).
pub fn scale_owners(jobs: &[QuantJob]) -> Vec<usize> {
    let mut first: HashMap<u64, usize> = HashMap::new();
    jobs.iter()
        .enumerate()
        .map(|(index, job)| match shares_amax(job) {
            true => *first.entry(job.scales).or_insert(index),
            false => index,
        })
        .collect()
}

/// For each job, the first job of those it shares its amax with: per-tensor jobs joined through a
/// common `scales` or a common nonzero `amax_key`, per-row jobs through a common nonzero `amax_key`
/// (row r of each takes the amax of row r of all), transitively (every other job, or one with no
/// elements, is its own). A per-tensor scale is that of all their elements: one scale for a fused
/// `qkv` whose q, k and v arrive as separate jobs, one value for the scales of a weight's shards; a
/// per-row scale is that of the whole row, whose column shards several jobs quantize.
pub fn amax_owners(jobs: &[QuantJob]) -> Vec<usize> {
    let mut owner: Vec<usize> = (0..jobs.len()).collect();
    fn root(owner: &mut [usize], mut i: usize) -> usize {
        while owner[i] != i {
            owner[i] = owner[owner[i]];
            i = owner[i];
        }
        i
    }
    let (mut by_scale, mut by_key) = (HashMap::new(), HashMap::new());
    for (index, job) in jobs.iter().enumerate().filter(|(_, job)| job.elements() > 0) {
        let mut joined = Vec::with_capacity(2);
        if shares_amax(job) {
            joined.push(*by_scale.entry(job.scales).or_insert(index));
        }
        let keyed = matches!(job.quantization.granularity, Granularity::Tensor | Granularity::Row);
        if keyed && job.amax_key != 0 {
            joined.push(*by_key.entry(job.amax_key).or_insert(index));
        }
        for other in joined {
            let (a, b) = (root(&mut owner, index), root(&mut owner, other));
            owner[a.max(b)] = a.min(b);
        }
    }
    (0..jobs.len()).map(|index| root(&mut owner, index)).collect()
}

/// Amaxes shared under keys, by (key, row): f32 magnitude bits (the maximum of the bit patterns of
/// |x|, as [`super::reference::amax_of`]) of the elements of the jobs naming
/// [`QuantJob::amax_key`] `key`: per tensor row 0, the whole matrices'; per row, row `row` of
/// theirs (jobs sharing per-row amaxes have the same rows). What devices quantizing parts of one
/// set exchange ([`crate::plan::AmaxExchange`]).
pub type Amaxes = HashMap<(u64, u64), u32>;

/// Merges `from` into `into`, keeping each entry's maximum (a NaN's bits above any number's).
pub fn merge_amaxes(into: &mut Amaxes, from: &Amaxes) {
    for (&place, &bits) in from {
        let entry = into.entry(place).or_insert(bits);
        *entry = (*entry).max(bits);
    }
}

/// Whether `job` takes a keyed amax that `keys` (sorted) lists: per tensor, or per row with a key.
pub fn exchanges_amax(job: &QuantJob, keys: &[u64]) -> bool {
    matches!(job.quantization.granularity, Granularity::Tensor | Granularity::Row)
        && job.amax_key != 0
        && job.elements() > 0
        && keys.binary_search(&job.amax_key).is_ok()
}

/// Whether jobs naming a job's scale share it: per tensor, with elements.
fn shares_amax(job: &QuantJob) -> bool {
    job.quantization.granularity == Granularity::Tensor && job.elements() > 0
}

/// Checks every job ([`check_job`]) and that no byte is written twice: no destination matrix or scale
/// grid overlaps another or itself (`Overlap`, naming the jobs), but for per-tensor jobs naming the
/// same scale ([`scale_owners`]). Jobs sharing an amax ([`amax_owners`]) must quantize alike (target
/// and arithmetic; `InvalidArgument` otherwise). Sources are only read; a source that overlaps a destination is the
/// caller's error (what is read is then undefined).
pub fn check_jobs(jobs: &[QuantJob]) -> Result<()> {
    for (index, job) in jobs.iter().enumerate() {
        check_job(index, job)?;
    }
    for (index, &owner) in amax_owners(jobs).iter().enumerate() {
        let (job, first) = (&jobs[index], &jobs[owner]);
        if job.quantization != first.quantization {
            let shared = match (job.scales == first.scales, first.quantization.granularity) {
                (true, _) => format!("per-tensor scale at {:#x}", job.scales),
                (false, Granularity::Row) => format!("per-row amaxes (amax key {})", job.amax_key),
                (false, _) => format!("per-tensor amax (amax key {})", job.amax_key),
            };
            return Err(invalid(
                index,
                format!(
                    "it shares jobs[{owner}]'s {shared} but quantizes differently (target {:?}, granularity {:?}, \
                     arithmetic {} against {:?}, {:?}, {}): jobs sharing an amax take one quantization",
                    job.quantization.target,
                    job.quantization.granularity,
                    job.quantization.arithmetic.code(),
                    first.quantization.target,
                    first.quantization.granularity,
                    first.quantization.arithmetic.code()
                ),
            ));
        }
        if job.quantization.granularity == Granularity::Row && job.rows != first.rows {
            return Err(invalid(
                index,
                format!(
                    "it shares jobs[{owner}]'s per-row amaxes (amax key {}) but has {} rows, not {}: jobs sharing \
                     per-row amaxes have the same rows",
                    job.amax_key, job.rows, first.rows
                ),
            ));
        }
    }
    // A shared scale is written once (by its owner): only the owner's scale segment is checked.
    let owners = scale_owners(jobs);
    let written: Vec<Segment> = jobs
        .iter()
        .zip(&owners)
        .enumerate()
        .flat_map(|(index, (job, &owner))| {
            let [matrix, scales] = job.written();
            [matrix, if owner == index { scales } else { Segment::default() }]
        })
        .collect();
    check_destinations(&written).map_err(|err| {
        if err.status != Status::Overlap {
            return err;
        }
        Error::new(Status::Overlap, format!("{}: {}", overlapping_regions(&err.message), err.message))
    })
}

/// Names the regions of an overlap the segment check reports as "segments A and B ..." (segment 2i
/// is jobs[i]'s destination, 2i + 1 its scales).
fn overlapping_regions(message: &str) -> String {
    let region = |segment: usize| {
        let what = if segment % 2 == 0 { "destination" } else { "scales" };
        format!("jobs[{}]'s {what}", segment / 2)
    };
    let numbers: Vec<usize> =
        message.split(|c: char| !c.is_ascii_digit()).filter_map(|word| word.parse().ok()).take(2).collect();
    match (message.starts_with("segments "), numbers.as_slice()) {
        (true, [a, b]) => format!("{} and {} overlap", region(*a), region(*b)),
        _ => "the bytes written overlap (segment 2i is jobs[i]'s destination, 2i + 1 its scales)".to_string(),
    }
}

/// The numbers the C API and the table's wire format give a quantization: target (1 e4m3fn, 2 e5m2),
/// granularity (1 tensor, 2 row, 3 block, 4 MX), block rows and columns (0 but for blocks), and the
/// arithmetic ([`Arithmetic::code`]; which granularity takes which is [`check_job`]'s to say).
impl Quantization {
    pub fn codes(&self) -> [u32; 5] {
        let target = match self.target {
            Fp8::E4m3fn => 1,
            Fp8::E5m2 => 2,
        };
        let arithmetic = self.arithmetic.code();
        match self.granularity {
            Granularity::Tensor => [target, 1, 0, 0, arithmetic],
            Granularity::Row => [target, 2, 0, 0, arithmetic],
            Granularity::Block { rows, cols } => [target, 3, rows, cols, arithmetic],
            Granularity::Mx => [target, 4, 0, 0, arithmetic],
        }
    }

    /// The quantization [`Quantization::codes`] gives, None for numbers no quantization has.
    pub fn from_codes([target, granularity, rows, cols, arithmetic]: [u32; 5]) -> Option<Quantization> {
        let target = match target {
            1 => Fp8::E4m3fn,
            2 => Fp8::E5m2,
            _ => return None,
        };
        let granularity = match (granularity, rows, cols) {
            (1, 0, 0) => Granularity::Tensor,
            (2, 0, 0) => Granularity::Row,
            (3, rows, cols) => Granularity::Block { rows, cols },
            (4, 0, 0) => Granularity::Mx,
            _ => return None,
        };
        let arithmetic = Arithmetic::from_code(arithmetic)?;
        Some(Quantization { target, granularity, arithmetic })
    }
}

impl SourceType {
    /// 1 bf16, 2 f16, 3 f32 (the C API's REFIT_SOURCE_*).
    pub fn code(self) -> u32 {
        match self {
            SourceType::Bf16 => 1,
            SourceType::F16 => 2,
            SourceType::F32 => 3,
        }
    }

    pub fn from_code(code: u32) -> Option<SourceType> {
        match code {
            1 => Some(SourceType::Bf16),
            2 => Some(SourceType::F16),
            3 => Some(SourceType::F32),
            _ => None,
        }
    }
}
