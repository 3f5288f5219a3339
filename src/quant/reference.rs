//! The reference quantizer: the arithmetic of `super` (module docs) in plain Rust, over host memory.
//! The host backend runs it; the kernel's tests compare every byte with it.

use super::fp8::{Fp8, SourceType};
use super::job::{Arithmetic, QuantJob, ScaleKind};

/// The f32 bit pattern of the canonical NaN (the one a GPU's arithmetic produces), written as the
/// fp32 scale of a block that holds a NaN.
pub const CANONICAL_NAN: u32 = 0x7fff_ffff;

/// The e8m0 byte that means NaN.
pub const E8M0_NAN: u8 = 0xff;

/// The amax of a block as the bit pattern of an f32 magnitude: the maximum of `bits(|x|)` over the
/// elements. Non-negative f32s order as their bit patterns, and every NaN pattern lies above
/// infinity's, so this is the largest |x|, infinity if one is infinite, and a NaN if one is a NaN.
pub fn magnitude_bits(x: f32) -> u32 {
    x.to_bits() & 0x7fff_ffff
}

/// One block's scale, as stored, and how its elements' quotients are taken from it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockScale {
    /// fp32 scales: the f32's bits; e8m0: the byte.
    pub stored: u32,
    pub divisor: f32,
    /// Quotients are x * RN(1 / divisor) rather than x / divisor ([`Arithmetic::by_reciprocal`]).
    pub by_reciprocal: bool,
    /// A NaN quotient encodes as +FP8_MAX rather than NaN ([`Arithmetic::nan_to_max`]).
    pub nan_to_max: bool,
}

impl BlockScale {
    /// The f32 quotient of element `x`, before its cast.
    pub fn quotient(&self, x: f32) -> f32 {
        if self.by_reciprocal {
            x * (1.0 / self.divisor)
        } else {
            x / self.divisor
        }
    }
}

/// The scale of a block whose amax has the bit pattern `amax_bits` ([`magnitude_bits`]), under
/// `arithmetic` (fp32 scales; MX's are OCP's).
pub fn block_scale(target: Fp8, kind: ScaleKind, arithmetic: Arithmetic, amax_bits: u32) -> BlockScale {
    let amax = f32::from_bits(amax_bits);
    match kind {
        ScaleKind::F32 => {
            let (by_reciprocal, nan_to_max) = (arithmetic.by_reciprocal(), arithmetic.nan_to_max());
            if amax.is_nan() {
                let nan = f32::from_bits(CANONICAL_NAN);
                return BlockScale { stored: CANONICAL_NAN, divisor: nan, by_reciprocal, nan_to_max };
            }
            let mut scale = amax.max(arithmetic.min_amax()) / target.max();
            if arithmetic.power_of_two_scales() && scale.is_finite() {
                scale = ceil_to_power_of_two(scale);
            }
            BlockScale { stored: scale.to_bits(), divisor: scale, by_reciprocal, nan_to_max }
        }
        ScaleKind::E8m0 => {
            if !amax.is_finite() {
                let divisor = f32::from_bits(CANONICAL_NAN);
                return BlockScale {
                    stored: u32::from(E8M0_NAN),
                    divisor,
                    by_reciprocal: false,
                    nan_to_max: false,
                };
            }
            let exponent = (floor_log2(amax_bits) - target.max_exponent()).clamp(-127, 127);
            BlockScale {
                stored: (exponent + 127) as u32,
                divisor: power_of_two(exponent),
                by_reciprocal: false,
                nan_to_max: false,
            }
        }
    }
}

/// The least power of two at or above a finite non-negative `x`, within 2^-126 ..= 2^127: its
/// exponent field, plus one when a mantissa bit is set, clamped to 1 ..= 254 (DeepGEMM's
/// `ceil_to_ue8m0`).
pub fn ceil_to_power_of_two(x: f32) -> f32 {
    let bits = x.to_bits();
    let field = (bits >> 23) + u32::from(bits & 0x7f_ffff != 0);
    f32::from_bits(field.clamp(1, 254) << 23)
}

/// floor(log2(x)) of a finite non-negative f32 given by its bits; zero gives -1000 (below any
/// clamp).
pub fn floor_log2(bits: u32) -> i32 {
    let field = (bits >> 23) as i32;
    let mantissa = bits & 0x7f_ffff;
    match (field, mantissa) {
        (0, 0) => -1000,
        (0, m) => (31 - m.leading_zeros() as i32) - 149,
        (f, _) => f - 127,
    }
}

/// 2^e as f32, for e in -149..=127 (exact, subnormal below -126).
pub fn power_of_two(e: i32) -> f32 {
    if e >= -126 {
        f32::from_bits(((e + 127) as u32) << 23)
    } else {
        f32::from_bits(1u32 << (e + 149))
    }
}

/// The code of element `x` of a block with `scale`: its f32 quotient ([`BlockScale::quotient`]),
/// encoded with saturation ([`Fp8::encode`]), a NaN quotient as +FP8_MAX where the arithmetic says
/// so ([`BlockScale::nan_to_max`]).
pub fn quantize_element(target: Fp8, x: f32, scale: &BlockScale) -> u8 {
    let quotient = scale.quotient(x);
    if quotient.is_nan() && scale.nan_to_max {
        return target.max_code();
    }
    target.encode(quotient)
}

/// A source matrix in host memory: `bytes` holds element (r, c) at `(r * stride + c) * size`.
#[derive(Clone, Copy, Debug)]
pub struct SourceMatrix<'a> {
    pub bytes: &'a [u8],
    pub source: SourceType,
    pub rows: u64,
    pub cols: u64,
    pub stride: u64,
}

impl SourceMatrix<'_> {
    pub fn get(&self, row: u64, col: u64) -> f32 {
        let at = ((row * self.stride + col) * self.source.size()) as usize;
        self.source.decode(&self.bytes[at..])
    }
}

/// The amax of every element of `source`, as f32 bits ([`magnitude_bits`]; NaN propagates).
pub fn amax_of(source: &SourceMatrix) -> u32 {
    let mut amax = 0u32;
    for r in 0..source.rows {
        for c in 0..source.cols {
            amax = amax.max(magnitude_bits(source.get(r, c)));
        }
    }
    amax
}

/// Quantizes `source` into `dst` (element (r, c) at `r * dst_stride + c`) and `scales` (scale (i, j)
/// at `(i * scale_stride + j) * size(scale)`, f32 little-endian or e8m0 bytes). Bytes of `dst` and
/// `scales` outside those positions are left alone. The slices must hold every position (panics
/// otherwise: callers size them from the job).
pub fn quantize(
    quantization: super::job::Quantization,
    source: &SourceMatrix,
    dst: &mut [u8],
    dst_stride: u64,
    scales: &mut [u8],
    scale_stride: u64,
) {
    quantize_with(quantization, source, dst, dst_stride, Some(scales), scale_stride, None);
}

/// [`quantize`], with a per-tensor scale shared with other matrices: `tensor_amax` (f32 bits), when
/// given, is the amax of all of them (this one's included), and `scales` None leaves the scale to
/// the one that writes it. Other granularities ignore `tensor_amax`.
pub fn quantize_with(
    quantization: super::job::Quantization,
    source: &SourceMatrix,
    dst: &mut [u8],
    dst_stride: u64,
    mut scales: Option<&mut [u8]>,
    scale_stride: u64,
    shared_amax: Option<&[u32]>,
) {
    let (rows, cols) = (source.rows, source.cols);
    if rows == 0 || cols == 0 {
        return;
    }
    let (block_rows, block_cols) = quantization.block_shape(rows, cols);
    let (grid_rows, grid_cols) = quantization.scale_grid(rows, cols);
    let kind = quantization.scale_kind();
    // A shared amax: the one of a per-tensor scale, or each row's of per-row scales.
    let given = |i: u64| match quantization.granularity {
        super::Granularity::Tensor => shared_amax.and_then(|a| a.first().copied()),
        super::Granularity::Row => shared_amax.and_then(|a| a.get(i as usize).copied()),
        _ => None,
    };
    for i in 0..grid_rows {
        for j in 0..grid_cols {
            let row_range = i * block_rows..((i + 1) * block_rows).min(rows);
            let col_range = j * block_cols..((j + 1) * block_cols).min(cols);
            let amax = given(i).unwrap_or_else(|| {
                let mut amax = 0u32;
                for r in row_range.clone() {
                    for c in col_range.clone() {
                        amax = amax.max(magnitude_bits(source.get(r, c)));
                    }
                }
                amax
            });
            let scale = block_scale(quantization.target, kind, quantization.arithmetic, amax);
            for r in row_range.clone() {
                for c in col_range.clone() {
                    let code = quantize_element(quantization.target, source.get(r, c), &scale);
                    dst[(r * dst_stride + c) as usize] = code;
                }
            }
            let Some(scales) = scales.as_deref_mut() else { continue };
            let at = ((i * scale_stride + j) * kind.size()) as usize;
            match kind {
                ScaleKind::F32 => scales[at..at + 4].copy_from_slice(&scale.stored.to_le_bytes()),
                ScaleKind::E8m0 => scales[at] = scale.stored as u8,
            }
        }
    }
}

/// The source matrix `job` reads, over host memory.
///
/// # Safety
/// The job has passed [`super::job::check_jobs`] and its source rows are host memory valid for `'a`.
pub unsafe fn host_source<'a>(job: &QuantJob) -> SourceMatrix<'a> {
    let size = job.source.size();
    let src_len =
        if job.elements() == 0 { 0 } else { (job.rows - 1) * job.src_stride * size + job.cols * size };
    // SAFETY: the caller's promise; the length is what check_jobs found to fit.
    let bytes = unsafe { std::slice::from_raw_parts(job.src as usize as *const u8, src_len as usize) };
    SourceMatrix { bytes, source: job.source, rows: job.rows, cols: job.cols, stride: job.src_stride }
}

/// The amax `job` shares with other jobs ([`super::job::amax_owners`]): per tensor, the amax of all
/// of them (one value); per row, each row's amax over all of them. And whether this job writes its
/// scale (the first job naming a per-tensor scale does; every per-row job writes its own).
#[derive(Clone, Debug)]
pub struct SharedScale {
    pub amax: std::sync::Arc<[u32]>,
    pub writes: bool,
}

/// Runs `job` over host memory: the host backend's quantizing copy. `shared` is its amax's, when
/// other jobs share it.
///
/// # Safety
/// The job has passed [`super::job::check_jobs`], and every byte it reads (the source rows, rounded up
/// to 16 bytes) and writes is host memory valid for the call; no written byte is read.
pub unsafe fn quantize_host_job(job: &QuantJob, shared: Option<&SharedScale>) {
    if job.elements() == 0 {
        return;
    }
    let dst_len = (job.rows - 1) * job.dst_stride + job.cols;
    let (grid_rows, grid_cols) = job.quantization.scale_grid(job.rows, job.cols);
    let scale_bytes = job.quantization.scale_kind().size();
    let scale_len = ((grid_rows - 1) * job.scale_stride + grid_cols) * scale_bytes;
    // SAFETY: the caller's promise; the lengths are those check_jobs found to fit.
    let (source, dst) = unsafe {
        (host_source(job), std::slice::from_raw_parts_mut(job.dst as usize as *mut u8, dst_len as usize))
    };
    let scales = match shared {
        Some(SharedScale { writes: false, .. }) => None,
        // SAFETY: as above; only the owner of a shared scale writes it.
        _ => Some(unsafe {
            std::slice::from_raw_parts_mut(job.scales as usize as *mut u8, scale_len as usize)
        }),
    };
    let amax = shared.map(|s| &s.amax[..]);
    quantize_with(job.quantization, &source, dst, job.dst_stride, scales, job.scale_stride, amax);
}

/// Each of `jobs`' shared amax: Some for a job that shares its amax with another
/// ([`super::job::amax_owners`]), with whether it writes its scale ([`super::job::scale_owners`]);
/// None for a job whose amax is its own.
///
/// # Safety
/// The jobs have passed [`super::job::check_jobs`] and their source rows are host memory valid for
/// the call.
pub unsafe fn shared_scales(jobs: &[QuantJob]) -> Vec<Option<SharedScale>> {
    let (amax_owners, writers) = (super::job::amax_owners(jobs), super::job::scale_owners(jobs));
    let mut members = vec![0usize; jobs.len()];
    amax_owners.iter().for_each(|&owner| members[owner] += 1);
    let mut amax: Vec<Vec<u32>> = vec![Vec::new(); jobs.len()];
    for (job, &owner) in jobs.iter().zip(&amax_owners).filter(|(_, &owner)| members[owner] > 1) {
        // One value per tensor, one per row (check_jobs found every job of a per-row set alike).
        // SAFETY: the caller's promise.
        let values = unsafe { own_amaxes(job) };
        let into = &mut amax[owner];
        into.resize(values.len(), 0);
        into.iter_mut().zip(values).for_each(|(a, v)| *a = (*a).max(v));
    }
    let amax: Vec<std::sync::Arc<[u32]>> = amax.into_iter().map(Into::into).collect();
    let shared = |(index, &owner): (usize, &usize)| {
        let writes = writers[index] == index;
        (members[owner] > 1).then(|| SharedScale { amax: std::sync::Arc::clone(&amax[owner]), writes })
    };
    amax_owners.iter().enumerate().map(shared).collect()
}

/// The amaxes of the jobs whose key `keys` (sorted) lists ([`super::job::exchanges_amax`]), over
/// their own elements: what the host backend's phase 1 reduces.
///
/// # Safety
/// As for [`shared_scales`].
pub unsafe fn keyed_amaxes(jobs: &[QuantJob], keys: &[u64]) -> super::job::Amaxes {
    let mut out = super::job::Amaxes::new();
    for job in jobs.iter().filter(|job| super::job::exchanges_amax(job, keys)) {
        // SAFETY: the caller's promise.
        let values = unsafe { own_amaxes(job) };
        let mine =
            values.into_iter().enumerate().map(|(row, bits)| ((job.amax_key, row as u64), bits)).collect();
        super::job::merge_amaxes(&mut out, &mine);
    }
    out
}

/// [`shared_scales`], where a job whose key `seed` holds (exchanged between devices) takes the
/// maximum of its set's amax and the seed's: per tensor `(key, 0)`, per row `(key, row)`. Such a
/// job shares its amax even when no other job of the batch does.
///
/// # Safety
/// As for [`shared_scales`].
pub unsafe fn seeded_scales(jobs: &[QuantJob], seed: &super::job::Amaxes) -> Vec<Option<SharedScale>> {
    // SAFETY: the caller's promise.
    let mut shared = unsafe { shared_scales(jobs) };
    if seed.is_empty() {
        return shared;
    }
    let writers = super::job::scale_owners(jobs);
    for (index, job) in jobs.iter().enumerate() {
        let keyed =
            matches!(job.quantization.granularity, super::Granularity::Tensor | super::Granularity::Row);
        if !keyed || job.amax_key == 0 || job.elements() == 0 {
            continue;
        }
        let (set, writes) = match &shared[index] {
            Some(s) => (s.amax.to_vec(), s.writes),
            // SAFETY: the caller's promise.
            None => (unsafe { own_amaxes(job) }, writers[index] == index),
        };
        let amax: Vec<u32> = set
            .iter()
            .enumerate()
            .map(|(row, &bits)| bits.max(seed.get(&(job.amax_key, row as u64)).copied().unwrap_or(0)))
            .collect();
        shared[index] = Some(SharedScale { amax: amax.into(), writes });
    }
    shared
}

/// A job's amax over its own elements: one value per tensor, one per row.
///
/// # Safety
/// As for [`shared_scales`].
unsafe fn own_amaxes(job: &QuantJob) -> Vec<u32> {
    // SAFETY: the caller's promise.
    let source = unsafe { host_source(job) };
    match job.quantization.granularity {
        super::Granularity::Row => (0..job.rows).map(|r| row_amax(&source, r)).collect(),
        _ => vec![amax_of(&source)],
    }
}

/// The amax of row `r` of `source` (as [`amax_of`] over one row).
fn row_amax(source: &SourceMatrix, r: u64) -> u32 {
    (0..source.cols).map(|c| magnitude_bits(source.get(r, c))).max().unwrap_or(0)
}

/// `job` cut into bands of whole scale-block rows, about `bands` of them (one for a per-tensor job,
/// whose one scale needs the whole matrix): together they quantize exactly what `job` does, and no
/// two write the same byte, so they can run side by side.
pub fn row_bands(job: &QuantJob, bands: u64) -> Vec<QuantJob> {
    let (block_rows, _) = job.quantization.block_shape(job.rows, job.cols);
    let grid_rows = job.quantization.scale_grid(job.rows, job.cols).0;
    // A per-tensor job's one scale needs the whole matrix; a job sharing its rows' amaxes indexes
    // them from its first row.
    let shares_rows = job.quantization.granularity == super::Granularity::Row && job.amax_key != 0;
    if matches!(job.quantization.granularity, super::Granularity::Tensor)
        || shares_rows
        || grid_rows < 2
        || bands < 2
    {
        return vec![*job];
    }
    let per_band = grid_rows.div_ceil(bands) * block_rows;
    let (size, scale_size) = (job.source.size(), job.quantization.scale_kind().size());
    (0..job.rows)
        .step_by(per_band as usize)
        .map(|first| QuantJob {
            src: job.src + first * job.src_stride * size,
            rows: per_band.min(job.rows - first),
            dst: job.dst + first * job.dst_stride,
            scales: job.scales + first / block_rows * job.scale_stride * scale_size,
            ..*job
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp32_scales_follow_vllms_eps_and_propagate_nan() {
        let scale = |target, amax_bits| block_scale(target, ScaleKind::F32, Arithmetic::Divide, amax_bits);
        let zero = scale(Fp8::E4m3fn, 0);
        assert_eq!(zero.stored, (1e-10f32 / 448.0).to_bits());
        assert_eq!(scale(Fp8::E5m2, 0).divisor, 1e-10f32 / 57344.0);
        assert_eq!(scale(Fp8::E4m3fn, 448f32.to_bits()).divisor, 1.0);
        assert_eq!(scale(Fp8::E4m3fn, 0x7f80_0000).divisor, f32::INFINITY);
        assert_eq!(scale(Fp8::E4m3fn, 0x7fc0_1234).stored, CANONICAL_NAN);
        // amax just below eps still takes eps.
        assert_eq!(scale(Fp8::E4m3fn, 5e-11f32.to_bits()).stored, zero.stored);
    }

    #[test]
    fn each_arithmetic_floors_the_amax_at_its_own_eps() {
        let stored = |arithmetic, amax: f32| {
            block_scale(Fp8::E4m3fn, ScaleKind::F32, arithmetic, amax.to_bits()).stored
        };
        for (arithmetic, floor) in [
            (Arithmetic::Divide, 1e-10f32),
            (Arithmetic::DeepGemm, 1e-4),
            (Arithmetic::VllmChannel, 0.001953125),
        ] {
            assert_eq!(stored(arithmetic, 0.0), (floor / 448.0).to_bits(), "{arithmetic:?}");
            assert_eq!(stored(arithmetic, floor / 2.0), (floor / 448.0).to_bits(), "{arithmetic:?}");
            assert_eq!(stored(arithmetic, 3.0), (3.0f32 / 448.0).to_bits(), "{arithmetic:?}");
        }
        // vLLM's per-channel floor is on the scale, 1 / (448 * 512): the same f32.
        assert_eq!(stored(Arithmetic::VllmChannel, 0.0), (1.0f32 / (448.0 * 512.0)).to_bits());
    }

    #[test]
    fn ue8m0_scales_round_up_to_powers_of_two() {
        let scale =
            |amax: f32| block_scale(Fp8::E4m3fn, ScaleKind::F32, Arithmetic::DeepGemmUe8m0, amax.to_bits());
        assert_eq!(scale(448.0).divisor, 1.0); // exact powers of two stay
        assert_eq!(scale(449.0).divisor, 2.0);
        assert_eq!(scale(3.0).divisor, 2f32.powi(-7)); // 3 / 448 = 0.0067 -> 2^-7
        assert_eq!(scale(0.0).divisor, 2f32.powi(-22)); // the 1e-4 floor: 2.2e-7 -> 2^-22
        assert_eq!(scale(f32::MAX).divisor, 2f32.powi(120)); // 7.6e35 -> 2^120
        assert_eq!(ceil_to_power_of_two(f32::MAX), 2f32.powi(127)); // clamped below the infinite field
        assert_eq!(scale(f32::INFINITY).divisor, f32::INFINITY); // specials as every arithmetic's
        assert_eq!(scale(f32::NAN).stored, CANONICAL_NAN);
        assert_eq!(ceil_to_power_of_two(f32::from_bits(1)), 2f32.powi(-126));
        assert!(scale(3.0).by_reciprocal);
    }

    #[test]
    fn the_reciprocal_quotient_differs_from_the_division_where_it_rounds_twice() {
        // 1.078125 / 448 has no exact reciprocal: among the bf16 values up to it, some products by
        // RN(1 / s) land on the other side of an FP8 rounding boundary than the quotients do (15 of
        // them, all small enough to be e4m3 subnormals).
        let amax = 1.078125f32.to_bits();
        let divide = block_scale(Fp8::E4m3fn, ScaleKind::F32, Arithmetic::Divide, amax);
        let reciprocal = block_scale(Fp8::E4m3fn, ScaleKind::F32, Arithmetic::DeepGemm, amax);
        assert_eq!(divide.stored, reciprocal.stored);
        let differ = (0u32..0x3f8b)
            .map(|bits| f32::from_bits(bits << 16))
            .filter(|&x| {
                quantize_element(Fp8::E4m3fn, x, &divide) != quantize_element(Fp8::E4m3fn, x, &reciprocal)
            })
            .count();
        assert_eq!(differ, 15);
        for x in [1.5f32, -2.25, 0.0, -0.0] {
            assert_eq!(reciprocal.quotient(x).to_bits(), (x * (1.0 / (1.078125f32 / 448.0))).to_bits());
        }
    }

    #[test]
    fn mx_scales_are_the_ocp_shared_exponent() {
        let mx = |target, amax: f32| block_scale(target, ScaleKind::E8m0, Arithmetic::Divide, amax.to_bits());
        assert_eq!(mx(Fp8::E4m3fn, 448.0).stored, 127); // floor(log2 448) = 8: 2^0
        assert_eq!(mx(Fp8::E4m3fn, 511.0).stored, 127);
        assert_eq!(mx(Fp8::E4m3fn, 512.0).stored, 128);
        assert_eq!(mx(Fp8::E5m2, 1.0).stored, 127 - 15);
        assert_eq!(mx(Fp8::E4m3fn, 0.0).stored, 0);
        assert_eq!(mx(Fp8::E4m3fn, f32::from_bits(1)).stored, 0); // 2^-149 - 8 clamps to -127
        assert_eq!(mx(Fp8::E4m3fn, f32::from_bits(1)).divisor, 2f32.powi(-127));
        assert_eq!(mx(Fp8::E4m3fn, f32::MAX).stored, 127 + 127 - 8);
        assert_eq!(mx(Fp8::E4m3fn, f32::INFINITY).stored, u32::from(E8M0_NAN));
        assert!(mx(Fp8::E4m3fn, f32::INFINITY).divisor.is_nan());
        assert_eq!(floor_log2(0x0040_0000), -127); // the largest power-of-two subnormal, 2^-127
        assert_eq!(floor_log2(3.0f32.to_bits()), 1);
        for e in -149..=127 {
            assert_eq!(power_of_two(e), 2f64.powi(e) as f32, "{e}");
        }
    }

    #[test]
    fn vllm_tensor_arithmetic_is_vllms_static_kernel_specials_included() {
        // vLLM's static per-tensor kernel, as its source computes: scale = amax / 448 with no floor,
        // r = 1.0f / scale, q = x * r, then fmaxf(-448, fminf(q, 448)) (C's fminf / fmaxf return
        // the operand that is not NaN, here written out), cast to e4m3 with saturation.
        fn vllm(x: f32, amax: f32) -> u8 {
            let r = 1.0f32 / (amax / 448.0);
            let q = x * r;
            let low = if q.is_nan() { 448.0 } else { q.min(448.0) };
            Fp8::E4m3fn.encode(low.max(-448.0))
        }
        let scale =
            |amax: f32| block_scale(Fp8::E4m3fn, ScaleKind::F32, Arithmetic::VllmTensor, amax.to_bits());
        let tiny = f32::from_bits(0x0001_0000); // a bf16 subnormal: its scale's reciprocal overflows
        for amax in [3.0f32, 1.078125, 448.0, 1e-30, tiny, 0.0, f32::INFINITY] {
            let s = scale(amax);
            assert_eq!(s.stored, (amax / 448.0).to_bits(), "amax {amax}: no floor");
            for x in [0.0f32, -0.0, 1.0, -1.5, amax, -amax, amax / 3.0, f32::INFINITY, f32::NEG_INFINITY] {
                let x = if x.is_infinite() && amax.is_finite() { amax } else { x };
                assert_eq!(quantize_element(Fp8::E4m3fn, x, &s), vllm(x, amax), "x {x}, amax {amax}");
            }
        }
        // Where the others give NaN codes this gives +448: an all-zero block (scale 0, codes
        // 0 * inf), an infinity over an infinite scale, every element of a NaN block.
        assert_eq!(quantize_element(Fp8::E4m3fn, -0.0, &scale(0.0)), 0x7e);
        assert_eq!(quantize_element(Fp8::E4m3fn, f32::INFINITY, &scale(f32::INFINITY)), 0x7e);
        assert_eq!(quantize_element(Fp8::E4m3fn, 1.0, &scale(f32::INFINITY)), 0x00);
        let nan = scale(f32::NAN);
        assert_eq!((nan.stored, quantize_element(Fp8::E4m3fn, 1.0, &nan)), (CANONICAL_NAN, 0x7e));
        assert_eq!(
            quantize_element(
                Fp8::E5m2,
                0.0,
                &block_scale(Fp8::E5m2, ScaleKind::F32, Arithmetic::VllmTensor, 0)
            ),
            0x7b
        );
        // A finite block quantizes as DeepGEMM's reciprocal does.
        let deepgemm = block_scale(Fp8::E4m3fn, ScaleKind::F32, Arithmetic::DeepGemm, 3f32.to_bits());
        for bits in (0u32..0x4040).step_by(7) {
            let x = f32::from_bits(bits << 16);
            assert_eq!(
                quantize_element(Fp8::E4m3fn, x, &scale(3.0)),
                quantize_element(Fp8::E4m3fn, x, &deepgemm)
            );
        }
    }

    #[test]
    fn amax_orders_nan_above_infinity_above_finite() {
        let bits = [1.0f32, -f32::INFINITY, 3.0].map(magnitude_bits);
        assert_eq!(bits.iter().max(), Some(&0x7f80_0000));
        assert!(magnitude_bits(-f32::NAN) > magnitude_bits(f32::INFINITY));
        for arithmetic in [Arithmetic::Divide, Arithmetic::DeepGemm] {
            let infinite = block_scale(Fp8::E4m3fn, ScaleKind::F32, arithmetic, 0x7f80_0000);
            assert_eq!(quantize_element(Fp8::E4m3fn, -1.0, &infinite), 0x80);
            assert_eq!(quantize_element(Fp8::E4m3fn, f32::INFINITY, &infinite), Fp8::NAN);
        }
    }
}
