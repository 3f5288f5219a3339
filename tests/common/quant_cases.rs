//! Quantization cases shared by the emulated kernel, host backend and GPU tests: matrices of every
//! source type holding what the arithmetic must get right (zero blocks, infinities, NaNs, subnormals,
//! exact rounding ties, values beyond FP8's range), in odd shapes, with their expected bytes from the
//! Rust reference.

#![allow(dead_code)]

#[path = "random_batch.rs"]
pub mod random_batch;

pub use random_batch::Rng;
use refit::quant::job::MX_BLOCK;
use refit::quant::reference::{quantize, SourceMatrix};
use refit::quant::{Arithmetic, Fp8, Granularity, QuantJob, Quantization, SourceType};

/// Bytes of destination and scale buffers that no job position covers: they must stay as they were.
pub const SENTINEL: u8 = 0xab;

/// 16-byte aligned bytes.
pub struct Aligned {
    words: Vec<u128>,
    len: usize,
}

impl Aligned {
    pub fn new(len: usize, fill: u8) -> Aligned {
        let mut a = Aligned { words: vec![0; len.div_ceil(16) + 1], len };
        a.bytes_mut().fill(fill);
        a
    }
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: u128 storage viewed as bytes, within its length.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.len) }
    }
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast(), self.len) }
    }
    pub fn addr(&self) -> u64 {
        self.words.as_ptr() as u64
    }
}

pub struct Case {
    pub name: String,
    pub quantization: Quantization,
    pub source: SourceType,
    pub rows: u64,
    pub cols: u64,
    pub src_stride: u64,
    pub dst_stride: u64,
    pub scale_stride: u64,
    /// The source matrix (rows x src_stride elements, padded to 16 bytes).
    pub data: Aligned,
}

impl Case {
    pub fn src_len(&self) -> usize {
        (self.rows * self.src_stride * self.source.size()).next_multiple_of(16) as usize
    }
    pub fn dst_len(&self) -> usize {
        (self.rows * self.dst_stride) as usize
    }
    pub fn scale_len(&self) -> usize {
        let (grid_rows, _) = self.quantization.scale_grid(self.rows, self.cols);
        (grid_rows * self.scale_stride * self.quantization.scale_kind().size()) as usize
    }

    /// The job over the given addresses.
    pub fn job(&self, src: u64, dst: u64, scales: u64) -> QuantJob {
        QuantJob {
            quantization: self.quantization,
            source: self.source,
            src,
            rows: self.rows,
            cols: self.cols,
            src_stride: self.src_stride,
            dst,
            dst_stride: self.dst_stride,
            scales,
            scale_stride: self.scale_stride,
            amax_key: 0,
        }
    }

    /// The reference's destination and scale buffers (starting from [`SENTINEL`] everywhere).
    pub fn expected(&self) -> (Vec<u8>, Vec<u8>) {
        let mut dst = vec![SENTINEL; self.dst_len()];
        let mut scales = vec![SENTINEL; self.scale_len()];
        let source = SourceMatrix {
            bytes: self.data.bytes(),
            source: self.source,
            rows: self.rows,
            cols: self.cols,
            stride: self.src_stride,
        };
        quantize(self.quantization, &source, &mut dst, self.dst_stride, &mut scales, self.scale_stride);
        (dst, scales)
    }
}

/// Each case's codes and scales buffers (the sentinel everywhere) and its job writing them.
pub fn outputs_and_jobs(cases: &[Case]) -> (Vec<(Aligned, Aligned)>, Vec<QuantJob>) {
    let outputs: Vec<(Aligned, Aligned)> = cases
        .iter()
        .map(|c| (Aligned::new(c.dst_len(), SENTINEL), Aligned::new(c.scale_len(), SENTINEL)))
        .collect();
    let jobs =
        cases.iter().zip(&outputs).map(|(c, (d, s))| c.job(c.data.addr(), d.addr(), s.addr())).collect();
    (outputs, jobs)
}

/// Encodes f32 `x` as `source` (bf16 and f16 by truncation of an already representable value, or the
/// nearest for f16), little-endian.
fn put(source: SourceType, bytes: &mut [u8], x: f32) {
    match source {
        SourceType::Bf16 => bytes[..2].copy_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes()),
        SourceType::F16 => bytes[..2].copy_from_slice(&f32_to_f16_bits(x).to_le_bytes()),
        SourceType::F32 => bytes[..4].copy_from_slice(&x.to_le_bytes()),
    }
}

/// f32 to binary16 by truncation (inputs here are mostly representable; the test needs any f16).
fn f32_to_f16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    if x.is_nan() {
        return sign | 0x7e00;
    }
    let a = x.abs();
    if a >= 65520.0 {
        return sign | 0x7c00;
    }
    if a < 2f32.powi(-24) {
        return sign;
    }
    if a < 2f32.powi(-14) {
        return sign | (a / 2f32.powi(-24)) as u16;
    }
    let e = ((bits >> 23) & 0xff) as i32 - 127;
    sign | (((e + 15) as u16) << 10) | ((bits >> 13) & 0x3ff) as u16
}

/// An element: mostly random magnitudes across `spread` binades around 2^center, with zeros,
/// negative zeros, subnormals, FP8 rounding ties (at amax 448 the scale is 1 and the quotient is the
/// element) and, when `special`, infinities and NaNs.
fn element(rng: &mut Rng, center: i32, special: bool) -> f32 {
    let sign = if rng.chance(50) { -1.0 } else { 1.0 };
    match rng.range(0, 100) {
        0..=3 => 0.0 * sign,
        4..=6 => sign * f32::from_bits(rng.range(1, 0x7f_ffff) as u32 & 0x7f_0000), // bf16 subnormal
        7..=14 => {
            // A tie between two e4m3 codes near 1..448, exact in bf16.
            let code = rng.range(0x08, 0x7d) as u8;
            let (lo, hi) = (Fp8::E4m3fn.decode(code), Fp8::E4m3fn.decode(code + 1));
            sign * (lo + hi) / 2.0
        }
        15 if special => sign * f32::INFINITY,
        16 if special => f32::NAN,
        _ => {
            let exponent = center + rng.range(0, 12) as i32 - 6;
            sign * (1.0 + rng.range(0, 1 << 20) as f32 / (1 << 20) as f32) * 2f32.powi(exponent)
        }
    }
}

/// The reference quantizer over a whole row-major bf16 matrix (`rows` x `cols`, its bytes
/// `bf16`): its codes, row-major, and its scale grid, row-major.
pub fn reference_bf16(quantization: Quantization, bf16: &[u8], rows: u64, cols: u64) -> (Vec<u8>, Vec<u8>) {
    let (grid_rows, grid_cols) = quantization.scale_grid(rows, cols);
    let mut codes = vec![0u8; (rows * cols) as usize];
    let mut scales = vec![0u8; (grid_rows * grid_cols * quantization.scale_kind().size()) as usize];
    let source = SourceMatrix { bytes: bf16, source: SourceType::Bf16, rows, cols, stride: cols };
    quantize(quantization, &source, &mut codes, cols, &mut scales, grid_cols);
    (codes, scales)
}

/// A case with random data: `kind` picks the scenario of each block row (0: ordinary, 1: all zero,
/// 2: with specials, 3: amax exactly 448 so that ties stay ties).
#[allow(clippy::too_many_arguments)]
pub fn case(
    rng: &mut Rng,
    name: &str,
    target: Fp8,
    granularity: Granularity,
    source: SourceType,
    rows: u64,
    cols: u64,
    pad: u64,
) -> Case {
    let quantization = Quantization::new(target, granularity);
    let vector = 16 / source.size();
    let src_stride = cols.next_multiple_of(vector) + pad * vector;
    let dst_stride = cols.next_multiple_of(vector) + pad * 16;
    let (_, grid_cols) = quantization.scale_grid(rows, cols);
    let scale_stride = grid_cols + pad;
    let mut c = Case {
        name: format!("{name} ({target:?}, {granularity:?}, {source:?}, {rows} x {cols})"),
        quantization,
        source,
        rows,
        cols,
        src_stride,
        dst_stride,
        scale_stride,
        data: Aligned::new(0, 0),
    };
    let mut data = Aligned::new(c.src_len(), 0);
    let (block_rows, _) = quantization.block_shape(rows, cols);
    let size = source.size() as usize;
    for r in 0..rows {
        // The scenario of this row's blocks: by block row, so that 2-D blocks share it.
        let block_row = r / block_rows;
        let scenario = (block_row.wrapping_mul(0x9e37_79b9) >> 3) % 5;
        let center = (block_row % 40) as i32 - 20;
        for col in 0..src_stride {
            let at = ((r * src_stride + col) as usize) * size;
            let x = if col >= cols {
                // Padding past the row: garbage the kernel must ignore.
                f32::NAN
            } else {
                match scenario {
                    1 => 0.0,
                    2 => {
                        let special = rng.chance(20);
                        element(rng, center, special)
                    }
                    3 if col == 0 => 448.0,
                    3 => element(rng, 4, false).clamp(-448.0, 448.0),
                    _ => element(rng, center, false),
                }
            };
            put(source, &mut data.bytes_mut()[at..], x);
        }
    }
    c.data = data;
    c
}

/// The standard set: every target, granularity and source type, in shapes that are and are not
/// multiples of the blocks, with padded strides.
pub fn standard_cases(seed: u64, large: bool) -> Vec<Case> {
    let mut rng = Rng::new(seed);
    let mut cases = Vec::new();
    // (rows, columns, padding of every row): 40 x 256 unpadded makes flat group-mode jobs (MX, 1 x 64
    // blocks and rows as one flat array) of several tiles, 6 x 128 padded the same blocks in rows;
    // per row, 4 x 8192 padded (bf16, f16) and 3 x 4096 (f32) are the narrow entry point's whole rows.
    let shapes: &[(u64, u64, u64)] = if large {
        &[
            (1, 8, 0),
            (3, 37, 1),
            (130, 264, 0),
            (257, 1000, 1),
            (64, 20_000, 0),
            (40, 256, 0),
            (6, 128, 1),
            (4, 8192, 8),
            (3, 4096, 0),
        ]
    } else {
        &[(1, 8, 0), (3, 37, 1), (130, 264, 0), (40, 256, 0), (6, 128, 1), (4, 8192, 8), (3, 4096, 0)]
    };
    for target in [Fp8::E4m3fn, Fp8::E5m2] {
        for source in [SourceType::Bf16, SourceType::F16, SourceType::F32] {
            for granularity in [
                Granularity::Tensor,
                Granularity::Row,
                Granularity::Block { rows: 128, cols: 128 },
                Granularity::Block { rows: 1, cols: 64 },
                Granularity::Block { rows: 3, cols: 8 },
                Granularity::Mx,
            ] {
                for &(rows, cols, pad) in shapes {
                    cases.push(case(&mut rng, "standard", target, granularity, source, rows, cols, pad));
                }
            }
        }
    }
    // The other arithmetics of fp32 scales, where they part from the default: their floors under
    // the small amaxes (block rows centred on exponents down to 2^-20), the reciprocal's two
    // roundings, and (VllmTensor) no floor, NaN quotients to +FP8_MAX in all-zero and special blocks.
    for arithmetic in
        [Arithmetic::DeepGemm, Arithmetic::VllmChannel, Arithmetic::DeepGemmUe8m0, Arithmetic::VllmTensor]
    {
        for source in [SourceType::Bf16, SourceType::F32] {
            for granularity in [
                Granularity::Tensor,
                Granularity::Row,
                Granularity::Block { rows: 128, cols: 128 },
                Granularity::Block { rows: 1, cols: 64 },
            ] {
                for &(rows, cols, pad) in shapes {
                    let mut c = case(&mut rng, "standard", Fp8::E4m3fn, granularity, source, rows, cols, pad);
                    c.quantization = c.quantization.with(arithmetic);
                    c.name = format!("{} under {arithmetic:?}", c.name);
                    cases.push(c);
                }
            }
        }
    }
    let _ = MX_BLOCK;
    cases
}

/// Per-tensor cases for jobs that share one scale (a fused `qkv` whose parts arrive as separate
/// jobs): bf16, f32 and f16 matrices of different shapes, one of several slabs (so several thread
/// blocks reduce it), padded strides, of the target and arithmetic given. The magnitudes differ from
/// case to case, so that each case alone gets a scale of its own.
pub fn shared_scale_cases(seed: u64, target: Fp8, arithmetic: Arithmetic) -> Vec<Case> {
    let mut rng = Rng::new(seed);
    let shapes = [(SourceType::Bf16, 130, 264, 0), (SourceType::F32, 5, 24, 1), (SourceType::F16, 13, 40, 1)];
    shapes
        .iter()
        .enumerate()
        .map(|(i, &(source, rows, cols, pad))| {
            let mut c =
                case(&mut rng, &format!("shared {i}"), target, Granularity::Tensor, source, rows, cols, pad);
            c.quantization = c.quantization.with(arithmetic);
            // Ordinary values scaled by 4^i: each case's amax its own.
            for r in 0..rows {
                for col in 0..cols {
                    let at = ((r * c.src_stride + col) * source.size()) as usize;
                    let x = element(&mut rng, 2 * i as i32, false);
                    put(source, &mut c.data.bytes_mut()[at..], x);
                }
            }
            c
        })
        .collect()
}

/// What jobs over `cases` sharing one per-tensor scale write: each case's codes (its destination
/// buffer, from [`SENTINEL`]) and the one scale, from the amax of every element of all of them,
/// taken here element by element.
pub fn expected_shared(cases: &[Case]) -> (Vec<Vec<u8>>, [u8; 4]) {
    use refit::quant::reference::{block_scale, magnitude_bits, quantize_element};
    fn matrix(c: &Case) -> SourceMatrix<'_> {
        SourceMatrix {
            bytes: c.data.bytes(),
            source: c.source,
            rows: c.rows,
            cols: c.cols,
            stride: c.src_stride,
        }
    }
    let mut amax = 0u32;
    for c in cases {
        let m = matrix(c);
        for r in 0..c.rows {
            for col in 0..c.cols {
                amax = amax.max(magnitude_bits(m.get(r, col)));
            }
        }
    }
    let q = cases[0].quantization;
    let scale = block_scale(q.target, q.scale_kind(), q.arithmetic, amax);
    let codes = cases
        .iter()
        .map(|c| {
            let (m, mut dst) = (matrix(c), vec![SENTINEL; c.dst_len()]);
            for r in 0..c.rows {
                for col in 0..c.cols {
                    dst[(r * c.dst_stride + col) as usize] =
                        quantize_element(q.target, m.get(r, col), &scale);
                }
            }
            dst
        })
        .collect();
    (codes, scale.stored.to_le_bytes())
}

/// Checks what jobs over `cases` sharing one per-tensor scale wrote (`codes` by case, `scale`)
/// against [`expected_shared`], and that the sharing mattered: some case alone gets another scale.
pub fn check_shared(cases: &[Case], codes: &[Vec<u8>], scale: &[u8], by: &str) {
    let (want_codes, want_scale) = expected_shared(cases);
    assert_eq!(scale, want_scale.as_slice(), "{by}: the shared scale");
    for ((c, got), want) in cases.iter().zip(codes).zip(&want_codes) {
        if let Some(at) = (0..want.len()).find(|&i| got[i] != want[i]) {
            let (row, col) = (at as u64 / c.dst_stride, at as u64 % c.dst_stride);
            panic!("{by}: {}: element ({row}, {col}): {:#04x}, expected {:#04x}", c.name, got[at], want[at]);
        }
    }
    assert!(cases.iter().any(|c| c.expected().1 != want_scale), "every case alone has the shared scale");
}

/// Makes jobs over [`shared_scale_cases`] share one per-tensor amax without one scale: the first
/// writes `scale_a`, the second `scale_a` too and gives an amax key, the rest write `scale_b` and
/// give the same key (joined to the first through the second). Both scales must then hold
/// [`expected_shared`]'s (check with [`check_shared`] on each).
pub fn key_jobs(jobs: &mut [QuantJob], scale_a: u64, scale_b: u64) {
    for (i, job) in jobs.iter_mut().enumerate() {
        job.amax_key = if i == 0 { 0 } else { 0x006b_6579 };
        job.scales = if i < 2 { scale_a } else { scale_b };
    }
}

/// A row-parallel weight's column shards, each quantized per row by its own job with its own codes
/// and scales, the jobs sharing each row's amax through one amax key: the whole matrix (bf16, rows
/// in every scenario, the magnitudes of each shard's columns scaled apart so that no shard alone has
/// a row's amax, 100 x 200 padded) and the shards' first columns and widths (multiples of 8, so that
/// every shard's rows start on 16 bytes; the last ends inside a vector).
pub struct RowShards {
    pub whole: Case,
    pub shards: Vec<(u64, u64)>,
}

pub const ROW_SHARDS_KEY: u64 = 0x726f_7773;

impl RowShards {
    /// 100 x 200 as shards of 64, 96 and 40 columns: rows of 8, 12 and 5 vectors, many to a slab,
    /// a warp's vectors over several rows.
    pub fn new(seed: u64, target: Fp8, arithmetic: Arithmetic) -> RowShards {
        RowShards::with(seed, target, arithmetic, SourceType::Bf16, 100, vec![(0, 64), (64, 96), (160, 40)])
    }

    /// 10 x 18,968 as shards of 2,048, 256, 16,640 and 24 columns: rows of whole warps' vectors
    /// (a row per round of the thread block, 8 rows to a slab of the wide entry point's cache, so
    /// two slabs; a row per warp and round), a row longer than the cache (2,080 vectors: a slab of
    /// one row, the rest read again), and a shard of 3 vectors.
    pub fn wide(seed: u64, target: Fp8, arithmetic: Arithmetic) -> RowShards {
        let shards = vec![(0, 2048), (2048, 256), (2304, 16_640), (18_944, 24)];
        RowShards::with(seed, target, arithmetic, SourceType::Bf16, 10, shards)
    }

    /// 6 x 1,060 f32 as shards of 1,024 and 36 columns: rows of 256 vectors of 4 elements (a warp's
    /// round in one row, the slab all 6 rows) and of 9 vectors.
    pub fn f32(seed: u64, target: Fp8, arithmetic: Arithmetic) -> RowShards {
        RowShards::with(seed, target, arithmetic, SourceType::F32, 6, vec![(0, 1024), (1024, 36)])
    }

    /// `rows` rows of `source` cut into `shards` (first column, width), which cover the columns in
    /// order.
    pub fn with(
        seed: u64,
        target: Fp8,
        arithmetic: Arithmetic,
        source: SourceType,
        rows: u64,
        shards: Vec<(u64, u64)>,
    ) -> RowShards {
        let mut rng = Rng::new(seed);
        let cols = shards.last().map_or(0, |&(c0, width)| c0 + width);
        let mut whole = case(&mut rng, "row shards", target, Granularity::Row, source, rows, cols, 1);
        whole.quantization = whole.quantization.with(arithmetic);
        // Each shard's columns scaled by 4^k, rows alternating which shard is largest.
        for r in 0..whole.rows {
            for (k, &(c0, width)) in shards.iter().enumerate() {
                let scale = 4f32.powi(((k as u64 + r) % shards.len() as u64) as i32);
                for c in c0..c0 + width {
                    let size = source.size();
                    let at = ((r * whole.src_stride + c) * size) as usize;
                    let bytes = &mut whole.data.bytes_mut()[at..at + size as usize];
                    put(source, bytes, source.decode(bytes) * scale);
                }
            }
        }
        RowShards { whole, shards }
    }

    /// Shard k's job: its columns of the whole matrix, codes at `dst` (rows `width` apart), scales
    /// at `scales` (one per row), `src` the whole matrix's address (its uploaded copy on a GPU).
    pub fn job(&self, k: usize, src: u64, dst: u64, scales: u64) -> QuantJob {
        let (c0, width) = self.shards[k];
        QuantJob {
            src: src + c0 * self.whole.source.size(),
            cols: width,
            dst,
            dst_stride: width,
            scales,
            scale_stride: 1,
            amax_key: ROW_SHARDS_KEY,
            ..self.whole.job(src, dst, scales)
        }
    }

    /// Each shard's codes and scales buffers in host memory (the sentinel everywhere).
    pub fn outputs(&self) -> Vec<(Aligned, Aligned)> {
        (0..self.shards.len())
            .map(|k| {
                let (codes, scales) = self.lens(k);
                (Aligned::new(codes, SENTINEL), Aligned::new(scales, SENTINEL))
            })
            .collect()
    }

    /// Bytes of shard k's codes and of its scales.
    pub fn lens(&self, k: usize) -> (usize, usize) {
        ((self.whole.rows * self.shards[k].1) as usize, (self.whole.rows * 4) as usize)
    }

    /// Checks what shard k's job wrote against the reference over the whole matrix (its columns of
    /// the codes; every row's scale), and that sharing mattered: the shard alone has other scales.
    pub fn check(&self, k: usize, codes: &[u8], scales: &[u8], by: &str) {
        let (want_codes, want_scales) = self.whole.expected();
        let (c0, width) = self.shards[k];
        for r in 0..self.whole.rows {
            let want = &want_codes[(r * self.whole.dst_stride + c0) as usize..][..width as usize];
            let got = &codes[(r * width) as usize..][..width as usize];
            assert!(got == want, "{by}: shard {k} row {r}: codes differ from the whole matrix's");
            let want_scale = &want_scales[(r * self.whole.scale_stride * 4) as usize..][..4];
            assert_eq!(&scales[(r * 4) as usize..][..4], want_scale, "{by}: shard {k} row {r}: scale");
        }
        // Not vacuous: some row of the shard alone has another scale.
        let w = &self.whole;
        let source = SourceMatrix {
            bytes: &w.data.bytes()[(c0 * w.source.size()) as usize..],
            source: w.source,
            rows: w.rows,
            cols: width,
            stride: w.src_stride,
        };
        let (mut alone_codes, mut alone_scales) =
            (vec![0u8; (w.rows * width) as usize], vec![0u8; (w.rows * 4) as usize]);
        quantize(w.quantization, &source, &mut alone_codes, width, &mut alone_scales, 1);
        let differs = (0..w.rows as usize)
            .any(|r| alone_scales[4 * r..4 * r + 4] != want_scales[r * 4 * w.scale_stride as usize..][..4]);
        assert!(differs, "{by}: shard {k} alone has every whole row's scale");
    }
}
