//! The quantizing copy's C API (`refit_quantize_batch`): bf16 / f16 / f32 matrices to FP8 with their
//! scales, for one rank of a group. Converts and checks; the arithmetic is `crate::quant`'s.

// Raw pointers are the C ABI: the group is looked up (`live`), the job array checked by `slice`, and
// the addresses a job names are the caller's documented promise.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::handles::live;
use super::{boundary, slice};
use crate::error::Status;
use crate::error::{Error, Result};
use crate::ffi::group::refit_group;
use crate::group::Group;
use crate::quant::{check_jobs, Arithmetic, QuantJob, Quantization, SourceType};
use crate::transport::access::first_unusable;
use crate::transport::Stream;
use std::ffi::c_void;

/// refit_quantization.target: OCP FP8 E4M3 without infinities (torch.float8_e4m3fn), largest finite
/// 448.
pub const REFIT_FP8_E4M3FN: u32 = 1;
/// refit_quantization.target: OCP FP8 E5M2 (torch.float8_e5m2), largest finite 57344.
pub const REFIT_FP8_E5M2: u32 = 2;

/// refit_quantization.granularity: no quantization (what a need that keeps its dtype will carry);
/// refit_quantize_batch refuses it.
pub const REFIT_QUANT_NONE: u32 = 0;
/// One fp32 scale for the whole matrix.
pub const REFIT_QUANT_TENSOR: u32 = 1;
/// One fp32 scale per row (output channel).
pub const REFIT_QUANT_ROW: u32 = 2;
/// One fp32 scale per block_rows x block_cols block (DeepSeek-V3: 128 x 128).
pub const REFIT_QUANT_BLOCK: u32 = 3;
/// OCP MXFP8: one e8m0 scale byte per 32 consecutive elements of a row.
pub const REFIT_QUANT_MXFP8: u32 = 4;

/// refit_quantize_job.arithmetic, refit_need_quantization.arithmetic: how fp32 scales and quotients
/// are computed (refit_quantize_batch gives each exactly). The default: scale = max(amax, 1e-10) /
/// FP8_MAX, quotient x / scale, as vLLM's and SGLang's per-token-group CUDA quantizers compute them.
pub const REFIT_ARITHMETIC_DIVIDE: u32 = 0;
/// scale = max(amax, 1e-4) / FP8_MAX, quotient x * RN(1 / scale): DeepGEMM's per_block_cast_to_fp8,
/// with which vLLM 0.33 quantizes BF16 weights to 128 x 128 FP8 blocks online.
pub const REFIT_ARITHMETIC_DEEPGEMM: u32 = 1;
/// scale = max(amax, 2^-9) / FP8_MAX, quotient x / scale: vLLM 0.33's online per-channel FP8 weights
/// (its scale floor 1 / (FP8_MAX * 512)).
pub const REFIT_ARITHMETIC_VLLM_CHANNEL: u32 = 2;
/// As REFIT_ARITHMETIC_DEEPGEMM, each finite scale then rounded up to a power of two (2^-126 ..
/// 2^127, still fp32): DeepGEMM's UE8M0 scales (ceil_to_ue8m0), which vLLM and SGLang use with
/// DeepGEMM on Blackwell and DeepSeek-V3.1's checkpoints carry.
pub const REFIT_ARITHMETIC_DEEPGEMM_UE8M0: u32 = 3;
/// scale = amax / FP8_MAX (no floor), quotient x * RN(1 / scale), a NaN quotient to +FP8_MAX: vLLM
/// 0.33's online per-tensor FP8 weights (static_scaled_fp8_quant, whose fminf / fmaxf clamp takes a
/// NaN to +MAX). An all-zero block gets scale 0 and codes +FP8_MAX, which dequantize to 0.
pub const REFIT_ARITHMETIC_VLLM_TENSOR: u32 = 4;

/// refit_quantize_job.source_type: bfloat16.
pub const REFIT_SOURCE_BF16: u32 = 1;
/// refit_quantize_job.source_type: IEEE binary16.
pub const REFIT_SOURCE_F16: u32 = 2;
/// refit_quantize_job.source_type: IEEE binary32.
pub const REFIT_SOURCE_F32: u32 = 3;

/// A quantization: a target FP8 format (REFIT_FP8_*) and a granularity (REFIT_QUANT_*).
/// `block_rows` x `block_cols` is the block of REFIT_QUANT_BLOCK (both at least 1, block_cols a
/// multiple of 8, at most 2^24 elements; 128 x 128 is DeepSeek-V3's) and must be 0 x 0 for every
/// other granularity. The arithmetic of fp32 scales (REFIT_ARITHMETIC_*) is given beside it, in the
/// job or need that holds it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct refit_quantization {
    pub target: u32,
    pub granularity: u32,
    pub block_rows: u32,
    pub block_cols: u32,
}

/// One matrix to quantize: `rows` x `cols` elements of `source_type` (REFIT_SOURCE_*) at device
/// address `src`, `src_row_stride` elements from one row to the next; FP8 codes written to `dst`,
/// `dst_row_stride` bytes from row to row; scales written to `scales` as a row-major grid of
/// ceil(rows / R) x ceil(cols / C) scales for blocks of R x C elements (per tensor: R x C is the whole
/// matrix, 1 scale; per row: 1 x cols, a column of `rows` scales; per block: the block; MXFP8:
/// 1 x 32), `scale_row_stride` scales from one grid row to the next. Scales are fp32 (little-endian),
/// the dequantization factor (x ~ code * scale, DeepSeek's `weight_scale_inv`), or for MXFP8 e8m0
/// bytes (scale 2^(byte - 127), 0xff NaN). `arithmetic` (REFIT_ARITHMETIC_*) says how fp32 scales
/// and quotients are computed; MXFP8 takes REFIT_ARITHMETIC_DIVIDE (0), the value of a zeroed field.
///
/// Alignment: every source row starts on 16 bytes (`src` and `src_row_stride` x element size
/// multiples of 16), `dst` and `dst_row_stride` are multiples of 8 (bf16, f16) or 4 (f32) bytes,
/// `scales` of the scale's size. A job with no elements is skipped (nothing is written).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct refit_quantize_job {
    pub quantization: refit_quantization,
    pub source_type: u32,
    pub arithmetic: u32,
    pub src: u64,
    pub rows: u64,
    pub cols: u64,
    pub src_row_stride: u64,
    pub dst: u64,
    pub dst_row_stride: u64,
    pub scales: u64,
    pub scale_row_stride: u64,
}

/// The Rust quantization of a C one and the arithmetic beside it, `what` and `arithmetic_field`
/// naming them in messages ("jobs[3].quantization", "jobs[3].arithmetic"). The numbers are mapped in
/// one place (`Quantization::from_codes`, which the table's wire format uses too); this says which
/// field made a refused one. Whether the granularity takes the arithmetic is checked with the rest
/// of the job (`quant::check_jobs`).
pub(crate) fn quantization(
    what: &str,
    q: &refit_quantization,
    arithmetic_field: &str,
    arithmetic: u32,
) -> Result<Quantization> {
    let Some(arithmetic) = Arithmetic::from_code(arithmetic) else {
        return Err(Error::invalid_argument(format!(
            "{arithmetic_field} is {arithmetic}; expected REFIT_ARITHMETIC_DIVIDE (0), _DEEPGEMM (1), _VLLM_CHANNEL (2), \
             _DEEPGEMM_UE8M0 (3) or _VLLM_TENSOR (4)"
        )));
    };
    if let Some(quantization) =
        Quantization::from_codes([q.target, q.granularity, q.block_rows, q.block_cols, 0])
    {
        return Ok(quantization.with(arithmetic));
    }
    let why = if !matches!(q.target, REFIT_FP8_E4M3FN | REFIT_FP8_E5M2) {
        format!(
            "target is {}; expected REFIT_FP8_E4M3FN ({REFIT_FP8_E4M3FN}) or REFIT_FP8_E5M2 ({REFIT_FP8_E5M2})",
            q.target
        )
    } else if q.granularity == REFIT_QUANT_NONE {
        "granularity is REFIT_QUANT_NONE: there is nothing to quantize to; pick REFIT_QUANT_TENSOR, _ROW, _BLOCK or \
         _MXFP8"
            .to_string()
    } else if !(REFIT_QUANT_TENSOR..=REFIT_QUANT_MXFP8).contains(&q.granularity) {
        format!("granularity is {}; expected a REFIT_QUANT_* value from 1 to 4", q.granularity)
    } else {
        format!(
            "block is {} x {}; only REFIT_QUANT_BLOCK takes a block shape (pass 0 x 0)",
            q.block_rows, q.block_cols
        )
    };
    Err(Error::invalid_argument(format!("{what}.{why}")))
}

/// The source type of a C code, `what` naming the field in messages.
pub(crate) fn source_type(what: &str, code: u32) -> Result<SourceType> {
    SourceType::from_code(code).ok_or_else(|| {
        Error::invalid_argument(format!(
            "{what} is {code}; expected REFIT_SOURCE_BF16 (1), _F16 (2) or _F32 (3)"
        ))
    })
}

fn job(index: usize, c: &refit_quantize_job) -> Result<QuantJob> {
    let quantization = quantization(
        &format!("jobs[{index}].quantization"),
        &c.quantization,
        &format!("jobs[{index}].arithmetic"),
        c.arithmetic,
    )?;
    let source = source_type(&format!("jobs[{index}].source_type"), c.source_type)?;
    Ok(QuantJob {
        quantization,
        source,
        src: c.src,
        rows: c.rows,
        cols: c.cols,
        src_stride: c.src_row_stride,
        dst: c.dst,
        dst_stride: c.dst_row_stride,
        scales: c.scales,
        scale_stride: c.scale_row_stride,
        amax_key: 0,
    })
}

/// INVALID_ARGUMENT unless every byte the jobs read or write is memory `device` can use (see
/// `Backend::inaccessible`), as refit_copy_batch checks its segments: a job over host memory or an
/// unmapped address must be refused here, not fault in the kernel and end the process's context.
fn check_memory(group: &Group, device: i32, jobs: &[QuantJob]) -> Result<()> {
    let regions: Vec<_> = jobs.iter().flat_map(QuantJob::regions).collect();
    let owners = |i| QuantJob::region_owners(i, 3, device);
    let Some(bad) = first_unusable(group.backend().as_ref(), &regions, owners, true)? else { return Ok(()) };
    let what = ["source", "destination", "scales"][bad.segment % 3];
    let (addr, len) = bad.range;
    crate::bail!(
        Status::InvalidArgument,
        "jobs[{}]: its {what} [{addr:#x}, +{len:#x}) is not memory device {device} can use: {:#x} {}",
        bad.segment / 3,
        bad.refusal.at,
        bad.refusal.why
    )
}

/// Quantizes `count` matrices (see refit_quantize_job) to FP8 with their scales, on `stream`, a stream
/// of `rank`'s device (NULL: its legacy default stream). Addresses are device pointers of that device
/// or of a peer it accesses directly (refit_group_peer_access); on the host backend, host memory.
/// `flags` must be 0.
///
/// The arithmetic, exact (the bytes are equal on every backend and GPU):
/// - Elements are decoded to f32 exactly. Per block of elements sharing a scale, amax is the largest
///   |x|, +inf if an element is infinite, NaN if an element is NaN (NaN propagates, as torch's amax).
/// - fp32 scale = max(amax, FLOOR) / FP8_MAX in f32 (IEEE division, nearest even), FP8_MAX = 448
///   (E4M3FN) or 57344 (E5M2), FLOOR the job's arithmetic's: 1e-10f (REFIT_ARITHMETIC_DIVIDE),
///   1e-4f (_DEEPGEMM, _DEEPGEMM_UE8M0), 2^-9 (_VLLM_CHANNEL) or none (_VLLM_TENSOR), so an all-zero
///   block gets scale FLOOR / FP8_MAX (0 under _VLLM_TENSOR). Under _DEEPGEMM_UE8M0 a finite scale
///   is then rounded up to a power of two: its exponent field plus one when a mantissa bit is set,
///   clamped to 1..254 (2^-126 .. 2^127). A block holding a NaN gets the scale 0x7fffffff (NaN); one
///   holding an infinity (and no NaN) gets +inf.
/// - MXFP8 (OCP MX v1.0): e = floor(log2(amax)) - 8 (E4M3FN) or - 15 (E5M2), clamped to -127..127,
///   scale byte e + 127 (e8m0), divisor 2^e; an all-zero block gets byte 0; a block holding a NaN or
///   an infinity gets 0xff (NaN).
/// - Each code: the f32 quotient rounded to the nearest FP8 value, ties to even, saturating: finite
///   or infinite quotients beyond +-FP8_MAX give +-FP8_MAX, a NaN quotient gives 0x7f (+FP8_MAX
///   under _VLLM_TENSOR: 0x7e E4M3FN, 0x7b E5M2), and the sign of zero is kept (-0.0 gives 0x80).
///   The quotient is x / scale (IEEE division, nearest even; MXFP8, _DIVIDE, _VLLM_CHANNEL) or,
///   under _DEEPGEMM, _DEEPGEMM_UE8M0 and _VLLM_TENSOR, x * r with r = 1 / scale in f32 (two
///   roundings; a scale of +inf or NaN gives the same as the division; a scale of 0, or one whose
///   reciprocal overflows, gives r = +inf). So _DIVIDE is `clamp(x / s, -MAX, MAX).to(torch.float8_e4m3fn)`
///   with vLLM's per-token-group eps, _DEEPGEMM is `(x * (1.0 / s)).to(torch.float8_e4m3fn)` of
///   DeepGEMM's per_block_cast_to_fp8 (vLLM 0.33's online block quantization), _DEEPGEMM_UE8M0 the
///   same with `use_ue8m0=True` (and SGLang's per_block_cast_to_fp8), _VLLM_CHANNEL vLLM 0.33's
///   online per-channel weights, each equal byte for byte on finite inputs (tested against vLLM's
///   and SGLang's own functions), and _VLLM_TENSOR vLLM 0.33's online per-tensor weights
///   (`fmaxf(-MAX, fminf(x * r, MAX))` of its static_scaled_fp8_quant kernel, which takes a NaN to
///   +MAX), equal to that kernel's arithmetic on every input. In a block whose scale is +inf, finite
///   elements give +-0 and infinite ones NaN (0x7f; +FP8_MAX under _VLLM_TENSOR); in a block whose
///   scale is NaN, every element gives 0x7f (+FP8_MAX under _VLLM_TENSOR); under _VLLM_TENSOR an
///   all-zero block's codes are +FP8_MAX (0 * r = NaN), which dequantize to 0 with its scale 0.
///
/// Per-tensor jobs need the whole matrix's amax first: on CUDA they take a second launch before the
/// quantizing one (every other granularity: one launch for the whole batch). Per-tensor jobs of one
/// batch naming the same `scales` share that one scale: it is computed from the amax of all their
/// elements and written once, and every code of theirs is quantized with it (a fused QKV weight
/// with one scale, from separate q, k and v matrices). They must have one target and arithmetic. The kernel reads each
/// source row in whole aligned 16-byte vectors, so up to 15 bytes past a row's last element (in the
/// same 16 bytes) are read and ignored.
///
/// Stream ordering (CUDA): queued on `stream` after the work queued on it before; returns without
/// waiting. The descriptors are uploaded stream-ordered (no host sync) into memory that later calls
/// reuse, so a stream being captured into a CUDA graph is refused (UNSUPPORTED, nothing queued).
/// Host backend: complete on return.
///
/// Thread-safety: may be called from any thread, concurrently with other calls. No source may overlap
/// a destination or scales (what is read is then undefined).
///
/// Errors: NULL_ARGUMENT (group, or jobs with count > 0), INVALID_ARGUMENT (rank not below the group
/// size, flags not 0, count too large, an unknown target, granularity or source type,
/// REFIT_QUANT_NONE, a block shape with a 0, block columns not a multiple of 8 or a block of more
/// than 2^24 elements, a block shape given for another granularity, an unknown arithmetic or one
/// MXFP8 does not take, a matrix of more than 2^38 rows or 2^32 - 16 columns, a row stride
/// below the row, a zero address for a job with elements, misaligned rows or scales, a range past the
/// end of the address space, memory that is not the device's (as refit_copy_batch checks it: on CUDA
/// every byte in a live allocation of the rank's device or of a device it accesses directly, so host
/// malloc memory and unmapped addresses are refused; on the host backend memory the process has
/// mapped, readable, and writable where written),
/// on the host backend a stream that is not a host stream or is another simulated device's; the
/// message names the job and the field or region; per-tensor jobs sharing a scale with another
/// target or arithmetic), OVERLAP (two destination matrices or scale grids, or a destination and a
/// scale grid, share a byte, but for per-tensor jobs sharing one scale; the message names them),
/// UNSUPPORTED (on CUDA a batch needing more than 2^31 - 1 thread blocks or a stream under graph
/// capture; overlap checks over more
/// interleaved rows than they visit), NVRTC_UNAVAILABLE / KERNEL_LOAD_FAILED (the kernel could not be compiled or
/// loaded at first use on the device), CUDA_ERROR, OUT_OF_MEMORY. Nothing is written when the jobs
/// are refused.
#[no_mangle]
pub extern "C" fn refit_quantize_batch(
    group: *const refit_group,
    rank: u32,
    stream: *mut c_void,
    jobs: *const refit_quantize_job,
    count: usize,
    flags: u32,
) -> crate::error::Status {
    boundary("refit_quantize_batch", || {
        let handle = live(group, "group")?;
        let group = &handle.group;
        // SAFETY: NULL or `count` readable jobs (the caller's promise).
        let jobs = unsafe { slice(jobs, count, "jobs") }?;
        if flags != 0 {
            return Err(Error::invalid_argument(format!("flags = {flags:#x}; no flag is defined, pass 0")));
        }
        let jobs = jobs.iter().enumerate().map(|(index, c)| job(index, c)).collect::<Result<Vec<_>>>()?;
        let device = group.device(rank as usize)?;
        check_jobs(&jobs)?;
        check_memory(group, device, &jobs)?;
        // SAFETY: the caller's promise on addresses and stream, documented above; every byte the
        // jobs touch was just found to be memory of the device.
        unsafe { group.backend().quantize_batch(device, Stream::from_ptr(stream), &jobs) }
    })
}
