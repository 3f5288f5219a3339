//! FP8 quantization: BF16 (or f16, f32) matrices to FP8 codes and scales, bit for bit as the
//! quantizers users compare with. Pure Rust, no CUDA: the encodings ([`fp8`]), what a quantization
//! and a job are ([`job`]), and the reference quantizer ([`reference`]) that the host backend runs
//! and the kernel (`kernels/quantize.cu`) is tested against.
//!
//! # The arithmetic
//!
//! Elements are decoded to f32 exactly. Each block (the elements sharing a scale: the whole matrix,
//! a row, a `rows x cols` block, or 32 consecutive elements of a row for MX) is quantized on its own:
//!
//! - amax = max |x| over the block, taken as the maximum of the f32 bit patterns of |x|: the largest
//!   magnitude, +inf when an element is infinite, a NaN when an element is a NaN (NaN propagates,
//!   as torch's `amax` does; a GPU's `fmaxf` would drop it).
//! - fp32 scales (per tensor, row, block): scale = max(amax, FLOOR) / FP8_MAX, one IEEE f32
//!   division rounded to nearest even; FP8_MAX = 448 (e4m3fn) or 57344 (e5m2). FLOOR is the
//!   quantization's arithmetic's ([`Arithmetic`]): 1e-10 (as f32; vLLM's `per_token_group_quant_fp8`
//!   default `eps`, the default), 1e-4 (DeepGEMM's `per_block_cast_to_fp8`), 2^-9 (vLLM's online
//!   per-channel weights, whose floor 1 / (FP8_MAX * 512) is on the scale: the same f32) or 0
//!   (vLLM's online per-tensor weights). So an all-zero block gets scale f32(FLOOR) / FP8_MAX and
//!   codes 0x00 (0x80 for -0.0), or under [`Arithmetic::VllmTensor`] scale 0 and codes +FP8_MAX
//!   (below). Under
//!   [`Arithmetic::DeepGemmUe8m0`] a finite scale is then rounded up to a power of two
//!   ([`reference::ceil_to_power_of_two`]).
//!   A block with a NaN gets the scale NaN (bits 0x7fffffff); a block with an infinity (and no NaN)
//!   gets +inf.
//! - MX (OCP Microscaling v1.0): e = floor(log2(amax)) - emax, emax = 8 (e4m3) or 15 (e5m2),
//!   clamped to -127..=127; the e8m0 scale byte is e + 127 and the divisor 2^e. An all-zero block
//!   gets e = -127 (byte 0). A block with a NaN or an infinity gets the byte 0xff (NaN).
//! - Each element: q = encode(quotient), the quotient x / divisor (one IEEE f32 division rounded
//!   to nearest even; divisor = the fp32 scale or 2^e) or, under [`Arithmetic::DeepGemm`],
//!   [`Arithmetic::DeepGemmUe8m0`] and [`Arithmetic::VllmTensor`], x * RN(1 / scale) (two
//!   roundings, as DeepGEMM's `x * (1.0 / sf)`; a scale of 0 or one whose reciprocal overflows
//!   multiplies by +inf), and encode the saturating
//!   round-to-nearest-even cast ([`fp8::Fp8::encode`]): finite quotients beyond +-FP8_MAX saturate to
//!   +-FP8_MAX (so do infinite ones), a NaN quotient gives 0x7f, or +FP8_MAX under
//!   [`Arithmetic::VllmTensor`] (vLLM's `fmaxf(-MAX, fminf(q, MAX))` drops the NaN). Below FP8_MAX this equals torch's
//!   `.to(torch.float8_e4m3fn / float8_e5m2)` of the f32 quotient: `clamp(x / s, -MAX,
//!   MAX).to(fp8)` of vLLM's quantizers, `(x * (1.0 / s)).to(fp8)` of DeepGEMM's.
//! - Consequences: in a block with an infinity (scale +inf), finite elements give +-0 and the
//!   infinities NaN (inf / inf); in a block with a NaN every element gives 0x7f (each of those NaN
//!   codes +FP8_MAX under [`Arithmetic::VllmTensor`]).
//!
//! The GPU kernel (`kernels/quantize.cu`) gets the same codes: for a finite scale it computes the
//! quotient from the block's correctly rounded reciprocal with two exact-remainder corrections, which
//! equals the IEEE quotient wherever an FP8 code can tell the difference (tested over every bf16
//! element against scales across the exponent range), and for a scale of +inf or NaN it divides.

pub mod fp8;
pub mod job;
pub mod reference;

pub use fp8::{Fp8, SourceType};
pub use job::{check_jobs, Arithmetic, Granularity, QuantJob, Quantization, ScaleKind};
