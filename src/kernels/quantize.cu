// refit's quantizing copy: bf16 / f16 / f32 matrices to FP8 (e4m3fn, e5m2) codes and their scales,
// per tensor, per row, per block or MX, for a batch of matrices in one launch of each entry point
// the batch's jobs need (see Occupancy; per-tensor jobs add a phase: see below). The arithmetic is src/quant/mod.rs's, bit for bit: amax as the maximum of the
// f32 bit patterns of |x| (NaN propagates), fp32 scale = max(amax, the job's floor) / FP8_MAX or
// MX's 2^e, each element the f32 quotient (the IEEE x / scale, or under the reciprocal arithmetic
// x * RN(1 / scale)) cast to FP8 with round-to-nearest-even and saturation, NaN to 0x7f (or to
// +FP8_MAX under the arithmetic that clamps with fminf / fmaxf: QuantDesc::nan_code). (The IEEE
// quotient comes from the block's reciprocal, exactly where it matters: see quotient below.)
//
// Compiled at run time by NVRTC (no headers), and built as host C++ by tests/emulate to check it
// against the Rust reference without a GPU: everything here is plain C++ but for the few intrinsics
// chosen under __CUDA_ARCH__.
//
// How the work is split. Each job is a matrix cut into scale blocks (the elements sharing a scale);
// the host lays the jobs out as a table of descriptors, each with its first tile, followed by the
// tile index (the job of every 2^QUANT_INDEX_SHIFT-th tile), and every thread block takes one tile,
// finding its job between two index entries. Sources are read as aligned 16-byte vectors
// (8 bf16 / f16 or 4 f32), which the host has checked row starts allow; a row's last vector may
// extend up to 15 bytes past its last element, within its aligned 16 bytes, and those bytes are
// ignored. Two modes:
// - MODE_BLOCK: a tile is one scale block (per-tensor jobs: a tile of 16 vectors by 128 rows, or a
//   slab of whole rows where rows are narrower). The block's
//   threads read its vectors, each keeping the first CACHE (see Occupancy; all CACHE loads issued
//   before the first is used, so that many are in flight per thread), reduce the amax
//   across the block (warp shuffles, then shared memory), compute the scale, and quantize what they
//   hold (vectors beyond the cache are read again, from L2). Per-tensor jobs take two launches:
//   phase 1 (refit_quantize_amax, a pass that only reads) reduces each tile and combines the tiles'
//   amax with atomicMax on its bits into the job's word of `amax` (zeroed by the host; jobs sharing
//   one scale share one word, amax_slot, and each writes the scale, atomically); phase 2 quantizes
//   with it. So a per-tensor job reads its
//   source twice: its memory bound is 5 bytes per 16-bit element, not the other granularities' 3.
//   Per-row jobs that share each row's amax with other jobs (a row-parallel weight's column shards,
//   one job per receiver: SCALE_ROWS_SHARED) take the same two phases over slabs of whole rows
//   (quantize_shared_rows), row r's word at amax_slot + r, each job writing its own scales.
//
// Occupancy: the memory system needs tens of KiB of loads in flight per SM, which here means tiles in
// flight (each holds its loads until its reduction). Two entry points: refit_quantize keeps
// QUANT_CACHE vectors per thread (a 128 x 128 block of 16-bit elements whole; per-tensor slabs) in
// shared memory, where they arrive without occupying registers (cp.async), at QUANT_WIDE_MIN_BLOCKS
// blocks per SM; refit_quantize_narrow keeps QUANT_NARROW_CACHE in registers at
// QUANT_NARROW_MIN_BLOCKS (scale blocks of at most 4 vectors per thread, such as a row of 8192 bf16),
// where shared memory measured no faster (benches/probes/quant_occupancy_probe.py); group mode
// (below) has an entry point of its own, refit_quantize_groups, at QUANT_GROUP_MIN_BLOCKS (one
// vector per round in registers: more blocks per SM are more loads in flight). The host lays the
// group-mode tiles out first, then the other narrow ones, the wide ones, and the shared rows'
// (refit_quantize_rows) last, and launches each entry point over its own tiles.
// Instructions matter as much as bytes in flight: a 128 x 128 bf16 block is about 21 instructions
// per element in the general loops below, so a tile that is exactly the cache (a 128 x 128 block
// at the wide entry point, a row of 8192 bf16 at the narrow one) takes a path without their row
// and partial-vector bookkeeping; a job of such rows skips quantize_block's position arithmetic too
// (quantize_row: its tile is half a block's, so the fixed part weighs double).
// - MODE_GROUP: for one-row blocks of at most 32 vectors (MX, short rows, 1 x n blocks): each
//   scale block is taken by a group of 2^group_shift lanes of a warp (one vector per lane), reduced
//   with shuffles within the group; a tile is QUANT_GROUP_ROUNDS rounds of the block's groups. A job
//   that is one flat array of whole groups counts its vectors instead (quantize_flat_groups).

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

#define QUANT_THREADS 256u
#define QUANT_WARPS (QUANT_THREADS / 32u)
#define QUANT_CACHE 8u
#define QUANT_WIDE_MIN_BLOCKS 4u
#define QUANT_WITH_COPY_MIN_BLOCKS 3u  // refit_copy_quantize's: the batched copy's own (copy_quantize.cu)
#define QUANT_NARROW_CACHE 4u
#define QUANT_NARROW_MIN_BLOCKS 4u
#define QUANT_GROUP_ROUNDS 4u
#define QUANT_GROUP_MIN_BLOCKS 6u
#define QUANT_ROWS_MIN_BLOCKS 5u
#define QUANT_AMAX_LOADS 4u
#define QUANT_AMAX_MIN_BLOCKS 6u
#define QUANT_AMAX_TILES 8u
#define QUANT_INDEX_SHIFT 8u
#define QUANT_CANONICAL_NAN 0x7fffffffu
#define QUANT_DESC_BYTES 136u

// Codes shared with src/kernels/quantize.rs.
#define SRC_BF16 0u
#define SRC_F16 1u
#define SRC_F32 2u
#define FP8_E4M3 0u
#define FP8_E5M2 1u
#define SCALE_F32 0u
#define SCALE_E8M0 1u
#define SCALE_TENSOR 2u
#define SCALE_ROWS_SHARED 3u  // f32 per-row scales whose amax jobs share: row r's word is amax_slot + r
#define MODE_BLOCK 0u
#define MODE_GROUP 1u

struct QuantDesc {
    u64 src, dst, scales;
    u64 rows, cols;
    u64 src_stride;    // elements
    u64 dst_stride;    // bytes
    u64 scale_stride;  // scales
    u64 first_tile;    // tiles of the descriptors before this one
    u64 grid_cols;     // scale blocks per grid row (MODE_BLOCK per-tensor: 1)
    u64 blocks;        // scale blocks (two-phase jobs: slabs of whole rows)
    u32 block_rows, block_cols;
    u32 source, target, scale_kind, mode;
    u32 group_shift;
    u32 min_amax;       // f32 bits: the floor under a block's amax before its fp32 scale
    u32 by_reciprocal;  // 1: quotients are x * RN(1 / scale) (else x / scale)
    u32 pow2_scales;    // 1: each finite fp32 scale rounded up to a power of two (UE8M0)
    u32 amax_slot;      // per tensor: the amax word of every job sharing this one's scale
    u32 nan_code;       // the code a NaN quotient takes: 0x7f, or +FP8_MAX's (the clamping arithmetic)
};
static_assert(sizeof(QuantDesc) == QUANT_DESC_BYTES, "QuantDesc must match the host's layout");

struct __align__(16) Vec {
    u32 w[4];
};

// A 16-byte source vector (read-only for the kernel's life: the non-coherent path on the GPU).
__device__ __forceinline__ Vec load_vector(const unsigned char* p) {
#ifdef __CUDA_ARCH__
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    Vec v;
    v.w[0] = u.x;
    v.w[1] = u.y;
    v.w[2] = u.z;
    v.w[3] = u.w;
    return v;
#else
    return *reinterpret_cast<const Vec*>(p);
#endif
}

// A 16-byte source vector into a thread's cache slot: with SHARED, a slot in shared memory, copied
// there without passing through registers (cp.async, sm_80 and later), visible to the thread once it
// has called wait_cached; else a register (a plain load).
template <bool SHARED>
__device__ __forceinline__ void load_cached(Vec* slot, const unsigned char* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if (SHARED) {
        const u32 at = (u32)__cvta_generic_to_shared(slot);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(at), "l"(p) : "memory");
        return;
    }
#endif
    *slot = load_vector(p);
}

template <bool SHARED>
__device__ __forceinline__ void wait_cached() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if (SHARED) asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// Codes are written once and not read again by the kernel: streaming stores on the GPU.
template <typename T>
__device__ __forceinline__ void store_streaming(T* p, T value) {
#ifdef __CUDA_ARCH__
    __stcs(p, value);
#else
    *p = value;
#endif
}

struct Scale {
    u32 stored;
    float divisor;
    float reciprocal;  // RN(1 / divisor), for the quotients of a finite divisor
    // A quotient is the one product x * reciprocal: MX's powers of two, whose reciprocal is exact
    // (so the product is x / divisor), and finite scales under the reciprocal arithmetic, which
    // defines it so.
    bool by_product;
};

__device__ __forceinline__ float from_bits(u32 b) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(b);
#else
    float f;
    memcpy(&f, &b, 4);
    return f;
#endif
}

__device__ __forceinline__ u32 to_bits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    u32 b;
    memcpy(&b, &f, 4);
    return b;
#endif
}

__device__ __forceinline__ int leading_zeros(u32 x) {
#ifdef __CUDA_ARCH__
    return __clz((int)x);
#else
    return x == 0 ? 32 : __builtin_clz(x);
#endif
}

// IEEE binary16 bits to f32 bits (exact).
__device__ __forceinline__ u32 f16_bits_to_f32(u32 h) {
    const u32 sign = (h & 0x8000u) << 16;
    const u32 field = (h >> 10) & 0x1fu;
    const u32 mantissa = h & 0x3ffu;
    if (field == 0) {
        if (mantissa == 0) return sign;
        const int top = 31 - leading_zeros(mantissa);
        return sign | ((u32)(top - 24 + 127) << 23) | ((mantissa << (23 - top)) & 0x7fffffu);
    }
    if (field == 0x1f) return sign | 0x7f800000u | (mantissa << 13);
    return sign | ((field + 112u) << 23) | (mantissa << 13);
}

// An f16 as f32 bits: the hardware's exact conversion on the GPU, the integer one on the host.
__device__ __forceinline__ u32 f16_to_f32_bits(u32 h) {
#ifdef __CUDA_ARCH__
    float f;
    const unsigned short half = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(half));
    return __float_as_uint(f);
#else
    return f16_bits_to_f32(h);
#endif
}

// Element e of a vector, as f32 bits.
template <u32 SRC>
__device__ __forceinline__ u32 element_bits(const Vec& v, u32 e) {
    if (SRC == SRC_F32) return v.w[e];
    const u32 h = (v.w[e >> 1] >> ((e & 1u) * 16u)) & 0xffffu;
    return SRC == SRC_BF16 ? h << 16 : f16_to_f32_bits(h);
}

// The larger of each 16-bit half of a and b (unsigned).
__device__ __forceinline__ u32 max_u16x2(u32 a, u32 b) {
#ifdef __CUDA_ARCH__
    return __vmaxu2(a, b);
#else
    const u32 lo = (a & 0xffffu) > (b & 0xffffu) ? (a & 0xffffu) : (b & 0xffffu);
    const u32 hi = (a >> 16) > (b >> 16) ? (a >> 16) : (b >> 16);
    return lo | (hi << 16);
#endif
}

template <u32 SRC>
struct Elements {
    static constexpr u32 per_vector = SRC == SRC_F32 ? 4u : 8u;
    static constexpr u32 size = SRC == SRC_F32 ? 4u : 2u;
};

// The saturating round-to-nearest-even cast of an f32 (given by its bits) to FP8, in integer
// arithmetic: the mirror of Fp8::encode in src/quant/fp8.rs, a NaN giving `nan_code`.
__device__ __forceinline__ u32 encode_software(u32 bits, u32 target, u32 nan_code) {
    const u32 magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return nan_code;
    const u32 sign = (bits >> 24) & 0x80u;
    const bool e4m3 = target == FP8_E4M3;
    if (magnitude >= (e4m3 ? 0x43e00000u : 0x47600000u)) return sign | (e4m3 ? 0x7eu : 0x7bu);
    const int field = (int)(magnitude >> 23);
    if (field == 0) return sign;
    const int m = e4m3 ? 3 : 2;
    const int min_normal = e4m3 ? -6 : -14;
    const int exponent = field - 127 > min_normal ? field - 127 : min_normal;
    const u32 significand = (magnitude & 0x7fffffu) | 0x800000u;
    const int shift = (exponent - m) - (field - 150);
    if (shift >= 25) return sign;  // below half the smallest subnormal
    const u32 kept = significand >> shift;
    const u32 rest = significand & ((1u << shift) - 1u);
    const u32 half = 1u << (shift - 1);
    const u32 units = kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
    return sign | (((u32)(exponent - min_normal) << m) + units);
}

// Two quotients to two codes (a in the low byte). On sm_89 and later the hardware's saturating
// conversion (round to nearest even, +-inf and out-of-range values to +-max, sign of zero kept) takes
// the finite and infinite ones; NaN quotients, which it need not encode as 0x7f, take `nan_code`
// here. FINITE: no quotient is NaN (exact_divisor), and no check is needed.
template <bool FINITE>
__device__ __forceinline__ u32 encode_pair(float a, float b, u32 target, u32 nan_code) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short pair;
    if (target == FP8_E4M3) {
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(b), "f"(a));
    } else {
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(b), "f"(a));
    }
    u32 codes = pair;
    if (!FINITE) {
        if ((to_bits(a) & 0x7fffffffu) > 0x7f800000u) codes = (codes & 0xff00u) | nan_code;
        if ((to_bits(b) & 0x7fffffffu) > 0x7f800000u) codes = (codes & 0x00ffu) | (nan_code << 8);
    }
    return codes;
#else
    return encode_software(to_bits(a), target, nan_code) | (encode_software(to_bits(b), target, nan_code) << 8);
#endif
}

__device__ __forceinline__ int floor_log2(u32 bits) {
    const int field = (int)(bits >> 23);
    const u32 mantissa = bits & 0x7fffffu;
    if (field != 0) return field - 127;
    if (mantissa == 0) return -1000;
    return (31 - leading_zeros(mantissa)) - 149;
}

__device__ __forceinline__ float power_of_two(int e) {
    return e >= -126 ? from_bits((u32)(e + 127) << 23) : from_bits(1u << (e + 149));
}

// A block's scale from its amax bits (block_scale in src/quant/reference.rs), without its reciprocal;
// fp32 scales floor the amax at `min_amax` (f32 bits).
__device__ __forceinline__ Scale block_scale_only(u32 target, u32 kind, u32 amax_bits, u32 min_amax,
                                                  u32 pow2_scales) {
    Scale s;
    if (kind != SCALE_E8M0) {
        if (amax_bits > 0x7f800000u) {
            s.stored = QUANT_CANONICAL_NAN;
            s.divisor = from_bits(QUANT_CANONICAL_NAN);
            return s;
        }
        const float amax = from_bits(amax_bits), floor = from_bits(min_amax);
        const float clamped = amax > floor ? amax : floor;
        s.divisor = clamped / (target == FP8_E4M3 ? 448.0f : 57344.0f);
        const u32 bits = to_bits(s.divisor);
        if (pow2_scales && bits < 0x7f800000u) {
            // ceil_to_power_of_two (src/quant/reference.rs): the field, plus one for a mantissa,
            // clamped to 1..254.
            u32 field = (bits >> 23) + ((bits & 0x7fffffu) != 0u ? 1u : 0u);
            field = field < 1u ? 1u : (field > 254u ? 254u : field);
            s.divisor = from_bits(field << 23);
        }
        s.stored = to_bits(s.divisor);
        return s;
    }
    if (amax_bits >= 0x7f800000u) {
        s.stored = 0xffu;
        s.divisor = from_bits(QUANT_CANONICAL_NAN);
        return s;
    }
    int e = floor_log2(amax_bits) - (target == FP8_E4M3 ? 8 : 15);
    e = e < -127 ? -127 : (e > 127 ? 127 : e);
    s.stored = (u32)(e + 127);
    s.divisor = power_of_two(e);
    return s;
}

// The scale of a block of `d` from its amax bits. Under the reciprocal arithmetic a scale of +inf or
// NaN keeps the division: x / inf and x * RN(1 / inf) = x * 0 are the same signed zero (NaN for an
// infinite x), and NaN scales give NaN either way.
__device__ __forceinline__ Scale block_scale(const QuantDesc& d, u32 amax_bits) {
    Scale s = block_scale_only(d.target, d.scale_kind, amax_bits, d.min_amax, d.pow2_scales);
    const bool mx = d.scale_kind == SCALE_E8M0;
    s.by_product = mx ? s.stored != 0xffu
                      : d.by_reciprocal != 0 && (to_bits(s.divisor) & 0x7fffffffu) < 0x7f800000u;
    // 2^e's reciprocal is 2^-e, a normal or subnormal f32 for every e in [-127, 127].
    s.reciprocal = mx && s.by_product ? power_of_two(127 - (int)s.stored) : 1.0f / s.divisor;
    if (s.by_product && (to_bits(s.reciprocal) & 0x7fffffffu) >= 0x7f800000u) {
        // The floorless arithmetic's scale of 0, or one whose reciprocal overflows: every quotient
        // is x * inf, which equals x / 0 for every x (+-inf, NaN for +-0), so the block divides by
        // 0 instead, on the path that looks for NaN quotients. The stored scale stays.
        s.by_product = false;
        s.divisor = 0.0f;
    }
    return s;
}

// Whether a block's quotients come from its reciprocal as IEEE quotients (quotient below): a
// finite divisor other than 0, so that every quotient is finite and none is NaN.
__device__ __forceinline__ bool exact_divisor(const Scale& s) {
    return (to_bits(s.divisor) & 0x7fffffffu) - 1u < 0x7f7fffffu;
}

__device__ __forceinline__ float fma_rn(float a, float b, float c) {
#ifdef __CUDA_ARCH__
    return __fmaf_rn(a, b, c);
#else
    return __builtin_fmaf(a, b, c);
#endif
}

// x / s rounded to nearest even, for s finite and at least 2^-50 (every fp32 scale; MX's 2^e
// multiplies exactly) and |x / s| at most about FP8_MAX, from y = RN(1 / s): q0 = RN(x y) is within
// 1.5 ulp of x / s, one correction with the exact remainder makes it faithful, and a second one
// correctly rounded (Markstein's theorem: y within half an ulp of 1 / s, q within one ulp). The
// remainders are exact unless |x| < 2^-100, where |x / s| < 2^-50 and any result encodes as a
// signed zero; the sign is that of x (s > 0), set explicitly so that -0.0 stays -0.0. The
// division's own sequence would take a reciprocal per element; this takes one per block. Checked
// against IEEE division over every bf16 element and scales across the range (kernels/quantize.rs).
__device__ __forceinline__ float quotient(float x, float s, float y) {
    const float q0 = x * y;
    const float q1 = fma_rn(fma_rn(-q0, s, x), y, q0);
    const float q2 = fma_rn(fma_rn(-q1, s, x), y, q1);
    return from_bits((to_bits(q2) & 0x7fffffffu) | (to_bits(x) & 0x80000000u));
}

// The amax of the first `count` elements of a vector, as f32 bits. For 16-bit sources the
// maximum is taken over the elements' own magnitude bits, two at a time, and converted once:
// magnitudes order as their bits in bf16 and f16 as in f32 (NaNs above infinity), and the
// conversion to f32 keeps that order, so this is the maximum of the f32 bits of |x|.
template <u32 SRC>
__device__ __forceinline__ u32 vector_amax(const Vec& v, u32 count) {
    if (SRC == SRC_F32) {
        u32 amax = 0;
#pragma unroll
        for (u32 e = 0; e < 4; ++e) {
            const u32 m = v.w[e] & 0x7fffffffu;
            if (e < count && m > amax) amax = m;
        }
        return amax;
    }
    u32 pairs = 0;
    if (count == 8) {
#pragma unroll
        for (u32 w = 0; w < 4; ++w) pairs = max_u16x2(pairs, v.w[w] & 0x7fff7fffu);
    } else {
        // The row's last vector: elements past the row are left out (constant indices only, so the
        // vector stays in registers).
#pragma unroll
        for (u32 e = 0; e < 8; ++e) {
            if (e < count) pairs = max_u16x2(pairs, (v.w[e >> 1] >> ((e & 1u) * 16u)) & 0x7fffu);
        }
    }
    const u32 lo = pairs & 0xffffu, hi = pairs >> 16;
    const u32 amax16 = lo > hi ? lo : hi;
    return SRC == SRC_BF16 ? amax16 << 16 : f16_to_f32_bits(amax16);
}

// Quantizes the first `count` elements of a vector and stores their codes at `out`.
// FINITE: the divisor is finite and not 0 (exact_divisor), the quotients come from its reciprocal
// ([quotient]), and none is NaN; otherwise (+inf, NaN or 0) they are IEEE divisions, as the
// arithmetic defines them, and NaN quotients take `nan_code` (store_codes_checked). PRODUCT: a
// quotient is one product by the reciprocal (Scale::by_product), sign of zero included.
template <u32 SRC, bool FINITE, bool PRODUCT = false>
__device__ __forceinline__ void store_codes_as(const Vec& v, u32 count, const Scale& scale, u32 target,
                                               unsigned char* out, u32 nan_code = 0x7fu) {
    constexpr u32 n = Elements<SRC>::per_vector;
    u32 codes[n / 4];
    float q[n];
#pragma unroll
    for (u32 e = 0; e < n; ++e) {
        const float x = from_bits(element_bits<SRC>(v, e));
        q[e] = PRODUCT ? x * scale.reciprocal
                     : (FINITE ? quotient(x, scale.divisor, scale.reciprocal) : x / scale.divisor);
    }
#pragma unroll
    for (u32 e = 0; e < n; e += 4) {
        codes[e / 4] = encode_pair<FINITE>(q[e], q[e + 1], target, nan_code) |
                       (encode_pair<FINITE>(q[e + 2], q[e + 3], target, nan_code) << 16);
    }
    if (count == n) {
        if (n == 8) {
            store_streaming(reinterpret_cast<u64*>(out), (u64)codes[0] | ((u64)codes[n / 4 - 1] << 32));
        } else {
            store_streaming(reinterpret_cast<u32*>(out), codes[0]);
        }
    } else {
#pragma unroll
        for (u32 e = 0; e < n; ++e) {
            if (e < count) out[e] = (unsigned char)(codes[e / 4] >> (8u * (e % 4u)));
        }
    }
}

// The codes of a vector of a block whose quotients may be NaN (not exact_divisor: a block holding
// an infinity or a NaN, or under the floorless arithmetic an all-zero or subnormal one), each NaN
// quotient taking d's nan_code. Such blocks are rare, so this is out of line: the common paths
// keep their registers, and the kernel one copy of it per source type.
template <u32 SRC>
__device__ __noinline__ void store_codes_checked(Vec v, u32 count, float divisor, u32 target, u32 nan_code,
                                                 unsigned char* out) {
    Scale scale;
    scale.divisor = divisor;
    store_codes_as<SRC, false>(v, count, scale, target, out, nan_code);
}

// Quantizes the first `count` elements of a vector with `scale` (a block of d) and stores their
// codes at `out`.
template <u32 SRC>
__device__ __forceinline__ void store_codes(const QuantDesc& d, const Vec& v, u32 count, const Scale& scale,
                                            unsigned char* out) {
    if (scale.by_product) {
        store_codes_as<SRC, true, true>(v, count, scale, d.target, out);
    } else if (exact_divisor(scale)) {
        store_codes_as<SRC, true>(v, count, scale, d.target, out);
    } else {
        store_codes_checked<SRC>(v, count, scale.divisor, d.target, d.nan_code, out);
    }
}

__device__ __forceinline__ void store_scale(const QuantDesc& d, u64 grid_row, u64 grid_col, u32 stored) {
    const u64 index = grid_row * d.scale_stride + grid_col;
    if (d.scale_kind == SCALE_E8M0) {
        reinterpret_cast<unsigned char*>(d.scales)[index] = (unsigned char)stored;
    } else {
        reinterpret_cast<u32*>(d.scales)[index] = stored;
    }
}

__device__ __forceinline__ u32 warp_max(u32 value, u32 lanes) {
    for (u32 offset = lanes / 2; offset > 0; offset /= 2) {
        const u32 other = __shfl_xor_sync(0xffffffffu, value, offset);
        value = other > value ? other : value;
    }
    return value;
}

// The grid row and column of scale block `block` (32-bit division when the grid allows).
__device__ __forceinline__ void grid_position(const QuantDesc& d, u64 block, u64& row, u64& col) {
    if ((d.blocks >> 32) == 0) {
        const u32 b = (u32)block, n = (u32)d.grid_cols;
        row = b / n;
        col = b - (u32)row * n;
    } else {
        row = block / d.grid_cols;
        col = block % d.grid_cols;
    }
}

// Stores the codes of a thread's CACHE cached vectors (STRIDE slots apart), all whole, `dstep` bytes
// apart from `out`, with the scale's case chosen once for all of them (and the target a constant in
// each loop).
template <u32 SRC, u32 CACHE, u32 STRIDE, bool PRODUCT>
__device__ __forceinline__ void store_cached_as(const Vec* cache, const Scale& scale, u32 target, unsigned char* out,
                                                u64 dstep) {
    constexpr u32 VE = Elements<SRC>::per_vector;
    if (target == FP8_E4M3) {
#pragma unroll
        for (u32 k = 0; k < CACHE; ++k) {
            store_codes_as<SRC, true, PRODUCT>(cache[k * STRIDE], VE, scale, FP8_E4M3, out + k * dstep);
        }
    } else {
#pragma unroll
        for (u32 k = 0; k < CACHE; ++k) {
            store_codes_as<SRC, true, PRODUCT>(cache[k * STRIDE], VE, scale, FP8_E5M2, out + k * dstep);
        }
    }
}

// As store_cached_as, for any scale of a block of d: its case chosen once.
template <u32 SRC, u32 CACHE, u32 STRIDE>
__device__ __forceinline__ void store_cached(const QuantDesc& d, const Vec* cache, const Scale& scale, unsigned char* out,
                                             u64 dstep) {
    if (scale.by_product) {
        store_cached_as<SRC, CACHE, STRIDE, true>(cache, scale, d.target, out, dstep);
    } else if (exact_divisor(scale)) {
        store_cached_as<SRC, CACHE, STRIDE, false>(cache, scale, d.target, out, dstep);
    } else {
        for (u32 k = 0; k < CACHE; ++k) {
            store_codes_checked<SRC>(cache[k * STRIDE], Elements<SRC>::per_vector, scale.divisor, d.target, d.nan_code,
                                     out + k * dstep);
        }
    }
}

// The largest of every thread's `amax` in the thread block (every thread gets it).
__device__ __forceinline__ u32 block_max(u32 amax) {
    __shared__ u32 warp_amax[QUANT_WARPS];
    amax = warp_max(amax, 32);
    if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
    __syncthreads();
    amax = 0;
    for (u32 w = 0; w < QUANT_WARPS; ++w) amax = warp_amax[w] > amax ? warp_amax[w] : amax;
    return amax;
}

// MODE_BLOCK: one scale block (or per-tensor slab) `block` of descriptor `job`. Thread t takes
// vectors t, t + QUANT_THREADS, ... of the block in row-major order; their (row, vector) positions
// advance by a fixed step, so no division per vector. The first CACHE of them wait until the block's
// amax is known: with SHARED in `cache`, the block's shared memory (CACHE x QUANT_THREADS vectors,
// thread t's k-th at cache[k * QUANT_THREADS + t]), where they arrive without passing through
// registers, so that registers do not bound the tiles in flight per SM; else in registers.
template <u32 SRC, u32 CACHE, bool SHARED>
__device__ void quantize_block(const QuantDesc& d, u32 amax_slot, u64 block, const u32* job_amax, Vec* cache) {
    constexpr u32 VE = Elements<SRC>::per_vector;
    constexpr u32 SIZE = Elements<SRC>::size;
    u64 grid_row, grid_col;
    grid_position(d, block, grid_row, grid_col);
    const u64 r0 = grid_row * d.block_rows, c0 = grid_col * d.block_cols;
    const u32 rows = (u32)(d.rows - r0 < d.block_rows ? d.rows - r0 : d.block_rows);
    const u32 cols = (u32)(d.cols - c0 < d.block_cols ? d.cols - c0 : d.block_cols);
    const u32 per_row = (cols + VE - 1) / VE;
    const u32 t = threadIdx.x;
    const u32 row_step = QUANT_THREADS / per_row, vector_step = QUANT_THREADS % per_row;
    const unsigned char* src = reinterpret_cast<const unsigned char*>(d.src) + (r0 * d.src_stride + c0) * SIZE;
    unsigned char* dst = reinterpret_cast<unsigned char*>(d.dst) + r0 * d.dst_stride + c0;
    const u64 src_row_bytes = d.src_stride * SIZE;
    constexpr u32 STRIDE = SHARED ? QUANT_THREADS : 1u;  // between a thread's slots
    Vec registers[SHARED ? 1u : CACHE];
    Vec* mine = SHARED ? cache + t : registers;

    // A tile that is exactly the cache: whole vectors, each thread's CACHE of them a fixed distance
    // apart, a fixed number of rows (a 128 x 128 block of 16-bit elements at CACHE 8) or, at the
    // narrow entry point, QUANT_THREADS vectors along one row (a row of 8192 bf16 at CACHE 4). None
    // then needs the row and partial-vector bookkeeping below, which costs more instructions than
    // quantizing it. (Rows at the wide entry point measured the 128 x 128 blocks 3-4% slower there.)
    constexpr bool ALONG_A_ROW = !SHARED;
    // (Each entry point's condition is written as it was measured: the compiled code of both is
    // sensitive to its form, and a rewrite of one changed its register allocation.)
    const bool whole = ALONG_A_ROW ? cols % VE == 0 && (vector_step == 0 ? rows == CACHE * row_step
                                                                          : rows == 1 && per_row == CACHE * QUANT_THREADS)
                                   : vector_step == 0 && cols % VE == 0 && rows == CACHE * row_step;
    const u32 first_row = t / per_row, first_col = (t % per_row) * VE;
    u32 amax = 0;
    if (whole) {
        const unsigned char* p = src + first_row * src_row_bytes + first_col * SIZE;
        const u64 step = row_step * src_row_bytes + (ALONG_A_ROW ? vector_step * VE * SIZE : 0u);
#pragma unroll
        for (u32 k = 0; k < CACHE; ++k) load_cached<SHARED>(mine + k * STRIDE, p + k * step);
        wait_cached<SHARED>();
#pragma unroll
        for (u32 k = 0; k < CACHE; ++k) {
            const u32 m = vector_amax<SRC>(mine[k * STRIDE], VE);
            amax = m > amax ? m : amax;
        }
    }
    u32 row = first_row, v = t % per_row;
    if (!whole) {
        // All CACHE loads are issued before any of their data is used (a use between two loads
        // would make each wait for the one before).
#pragma unroll
        for (u32 k = 0; k < CACHE; ++k) {
            if (row < rows) load_cached<SHARED>(mine + k * STRIDE, src + row * src_row_bytes + (u64)v * VE * SIZE);
            row += row_step;
            v += vector_step;
            if (v >= per_row) {
                v -= per_row;
                ++row;
            }
        }
        wait_cached<SHARED>();
        u32 r = first_row, w = t % per_row;
#pragma unroll
        for (u32 k = 0; k < CACHE; ++k) {
            if (r < rows) {
                const u32 m = vector_amax<SRC>(mine[k * STRIDE], cols - w * VE < VE ? cols - w * VE : VE);
                amax = m > amax ? m : amax;
            }
            r += row_step;
            w += vector_step;
            if (w >= per_row) {
                w -= per_row;
                ++r;
            }
        }
    }
    const u32 rest_row = whole ? rows : row, rest_v = v;  // the first vector not cached
    row = rest_row;
    v = rest_v;
    for (; row < rows;) {
        const Vec x = load_vector(src + row * src_row_bytes + (u64)v * VE * SIZE);
        const u32 m = vector_amax<SRC>(x, cols - v * VE < VE ? cols - v * VE : VE);
        amax = m > amax ? m : amax;
        row += row_step;
        v += vector_step;
        if (v >= per_row) {
            v -= per_row;
            ++row;
        }
    }
    amax = block_max(amax);
    // Per tensor: the amax of every job sharing it, which phase 1 (refit_quantize_amax) reduced.
    if (d.scale_kind == SCALE_TENSOR) amax = job_amax[amax_slot];
    const Scale scale = block_scale(d, amax);
    if (t == 0 && d.scale_kind == SCALE_TENSOR && block == 0) {
        // Every job sharing this scale writes it, the same bits: atomically, so that they do not race.
        atomicExch(reinterpret_cast<u32*>(d.scales), scale.stored);
    } else if (t == 0 && d.scale_kind != SCALE_TENSOR) {
        store_scale(d, grid_row, grid_col, scale.stored);
    }
    if (whole) {
        unsigned char* out = dst + first_row * d.dst_stride + first_col;
        const u64 dstep = row_step * d.dst_stride + (ALONG_A_ROW ? vector_step * VE : 0u);
        store_cached<SRC, CACHE, STRIDE>(d, mine, scale, out, dstep);
        return;
    }
    row = first_row;
    v = t % per_row;
#pragma unroll
    for (u32 k = 0; k < CACHE; ++k) {
        if (row < rows) {
            store_codes<SRC>(d, mine[k * STRIDE], cols - v * VE < VE ? cols - v * VE : VE, scale, dst + row * d.dst_stride + v * VE);
        }
        row += row_step;
        v += vector_step;
        if (v >= per_row) {
            v -= per_row;
            ++row;
        }
    }
    for (row = rest_row, v = rest_v; row < rows;) {
        const Vec x = load_vector(src + row * src_row_bytes + (u64)v * VE * SIZE);
        store_codes<SRC>(d, x, cols - v * VE < VE ? cols - v * VE : VE, scale, dst + row * d.dst_stride + v * VE);
        row += row_step;
        v += vector_step;
        if (v >= per_row) {
            v -= per_row;
            ++row;
        }
    }
}

// Whether a group-mode job is one flat array of whole groups: rows contiguous in source, codes and
// scales alike, and each block exactly its group's vectors. Then round r of tile t is the
// QUANT_THREADS vectors from ((t * QUANT_GROUP_ROUNDS + r) * QUANT_THREADS) on, thread by thread,
// and a group's scale is its block's number: no row, column or partial-vector bookkeeping (what the
// general loop below spends most of its instructions on).
template <u32 SRC>
__device__ __forceinline__ bool flat_groups(const QuantDesc& d) {
    return d.src_stride == d.cols && d.dst_stride == d.cols && d.scale_stride == d.grid_cols &&
           d.block_cols == (Elements<SRC>::per_vector << d.group_shift) && d.cols % d.block_cols == 0;
}

// MODE_GROUP over a flat job (flat_groups): as quantize_groups, with the vectors' places counted.
template <u32 SRC>
__device__ void quantize_flat_groups(const QuantDesc& d, u64 tile) {
    constexpr u32 VE = Elements<SRC>::per_vector;
    const u32 lanes = 1u << d.group_shift;
    const u64 vectors = d.rows * d.cols / VE;
    const u64 first = tile * QUANT_GROUP_ROUNDS * QUANT_THREADS + threadIdx.x;
    const unsigned char* src = reinterpret_cast<const unsigned char*>(d.src);
    unsigned char* dst = reinterpret_cast<unsigned char*>(d.dst);
    Vec x[QUANT_GROUP_ROUNDS] = {};
#pragma unroll
    for (u32 round = 0; round < QUANT_GROUP_ROUNDS; ++round) {
        const u64 v = first + round * QUANT_THREADS;
        if (v < vectors) x[round] = load_vector(src + v * VE * Elements<SRC>::size);
    }
#pragma unroll
    for (u32 round = 0; round < QUANT_GROUP_ROUNDS; ++round) {
        const u64 v = first + round * QUANT_THREADS;
        // Whole groups: a group's lanes are all in or all out, but every lane of the warp shuffles.
        const u32 amax = warp_max(v < vectors ? vector_amax<SRC>(x[round], VE) : 0u, lanes);
        if (v < vectors) {
            const Scale scale = block_scale(d, amax);
            if ((threadIdx.x & (lanes - 1u)) == 0) store_scale(d, 0, v >> d.group_shift, scale.stored);
            store_codes<SRC>(d, x[round], VE, scale, dst + v * VE);
        }
    }
}

// MODE_GROUP: tile `tile` of descriptor `d`, whose scale blocks are one row high and at most 32
// vectors wide; 2^group_shift lanes per block. Each thread loads its vector of every round first, so
// that QUANT_GROUP_ROUNDS loads are in flight, then reduces and writes round by round.
template <u32 SRC>
__device__ void quantize_groups(const QuantDesc& d, u64 tile) {
    if (flat_groups<SRC>(d)) {
        quantize_flat_groups<SRC>(d, tile);
        return;
    }
    constexpr u32 VE = Elements<SRC>::per_vector;
    const u32 lanes = 1u << d.group_shift;
    const u32 groups = QUANT_THREADS >> d.group_shift;
    const u32 lane = threadIdx.x & (lanes - 1u);
    const unsigned char* src = reinterpret_cast<const unsigned char*>(d.src);
    unsigned char* dst = reinterpret_cast<unsigned char*>(d.dst);
    Vec x[QUANT_GROUP_ROUNDS] = {};
    u32 count[QUANT_GROUP_ROUNDS];
    u64 row[QUANT_GROUP_ROUNDS], col[QUANT_GROUP_ROUNDS];
#pragma unroll
    for (u32 round = 0; round < QUANT_GROUP_ROUNDS; ++round) {
        const u64 block = (tile * QUANT_GROUP_ROUNDS + round) * groups + (threadIdx.x >> d.group_shift);
        count[round] = 0;
        row[round] = 0;
        col[round] = 0;
        if (block < d.blocks) {
            grid_position(d, block, row[round], col[round]);
            const u64 c0 = col[round] * d.block_cols;
            const u64 end = c0 + d.block_cols < d.cols ? c0 + d.block_cols : d.cols;
            const u64 c = c0 + (u64)lane * VE;
            if (c < end) {
                count[round] = end - c < VE ? (u32)(end - c) : VE;
                x[round] = load_vector(src + (row[round] * d.src_stride + c) * Elements<SRC>::size);
            }
        }
    }
#pragma unroll
    for (u32 round = 0; round < QUANT_GROUP_ROUNDS; ++round) {
        const u64 block = (tile * QUANT_GROUP_ROUNDS + round) * groups + (threadIdx.x >> d.group_shift);
        const u32 amax = warp_max(count[round] > 0 ? vector_amax<SRC>(x[round], count[round]) : 0u, lanes);
        if (block < d.blocks) {
            const Scale scale = block_scale(d, amax);
            if (lane == 0) store_scale(d, row[round], col[round], scale.stored);
            if (count[round] > 0) {
                const u64 c = col[round] * d.block_cols + (u64)lane * VE;
                store_codes<SRC>(d, x[round], count[round], scale, dst + row[round] * d.dst_stride + c);
            }
        }
    }
}

// Whether every scale block of `d` is one whole row of exactly CACHE x QUANT_THREADS vectors (per
// row over rows of 8192 bf16 or f16, 4096 f32, at the narrow entry point): then block b is row b.
template <u32 SRC, u32 CACHE>
__device__ __forceinline__ bool whole_rows(const QuantDesc& d) {
    return d.block_rows == 1 && d.grid_cols == 1 && d.cols == (u64)CACHE * QUANT_THREADS * Elements<SRC>::per_vector;
}

// Row `row` of a job whose blocks are whole rows (whole_rows): thread t's CACHE vectors are
// t, t + QUANT_THREADS, ... of the row. A row is the narrow entry point's whole cache, as a
// 128 x 128 block is the wide one's, but quantize_block would still spend its divisions and
// position bookkeeping on a tile half the size: here the tile number is the row.
template <u32 SRC, u32 CACHE>
__device__ void quantize_row(const QuantDesc& d, u64 row) {
    constexpr u32 VE = Elements<SRC>::per_vector;
    constexpr u32 SIZE = Elements<SRC>::size;
    constexpr u64 STEP = (u64)QUANT_THREADS * VE;  // elements from one of a thread's vectors to the next
    const u32 t = threadIdx.x;
    const unsigned char* src = reinterpret_cast<const unsigned char*>(d.src) + (row * d.src_stride + t * VE) * SIZE;
    Vec mine[CACHE];
#pragma unroll
    for (u32 k = 0; k < CACHE; ++k) mine[k] = load_vector(src + k * STEP * SIZE);
    u32 amax = 0;
#pragma unroll
    for (u32 k = 0; k < CACHE; ++k) {
        const u32 m = vector_amax<SRC>(mine[k], VE);
        amax = m > amax ? m : amax;
    }
    const Scale scale = block_scale(d, block_max(amax));
    if (t == 0) store_scale(d, row, 0, scale.stored);
    unsigned char* out = reinterpret_cast<unsigned char*>(d.dst) + row * d.dst_stride + t * VE;
    store_cached<SRC, CACHE, 1>(d, mine, scale, out, STEP);
}

// The amax `a` of a thread's vectors of row `row` of a shared-rows slab into that row's word. Where
// a round's vectors of a warp lie in one row (`warp_rows`: rows a whole number of warps' vectors),
// the warp reduces first and one lane folds it in; else each lane does. A zero amax changes no word.
__device__ __forceinline__ void fold_row_amax(u32* words, u32 row, u32 a, bool warp_rows) {
    if (warp_rows) {
        a = warp_max(a, 32);
        if (threadIdx.x % 32 != 0) return;
    }
    if (a != 0) atomicMax(words + row, a);
}

// SCALE_ROWS_SHARED: slab `slab` of d.block_rows whole rows (as many as the cache holds), each row's
// amax shared with the other jobs of its set through its word, d.amax_slot + the row. Phase 1 folds
// the slab's vectors into their rows' words; phase 2 quantizes each row with its word, the thread
// holding a row's first vector writing its scale. No block-wide reduction: a row's amax is whole only
// across the set's jobs, so the words are its only meeting place. Thread t takes vectors t,
// t + QUANT_THREADS, ... of the slab in row-major order, advanced by a fixed step as in
// quantize_block, the first QUANT_CACHE of them through the shared-memory cache (thread t's k-th at
// cache[k * QUANT_THREADS + t]) and the rest (rows longer than the cache) read where they lie; a
// thread's consecutive vectors of one row are folded as one.
template <u32 SRC>
__device__ void quantize_shared_rows(const QuantDesc& d, u64 slab, u32 phase, u32* job_amax, Vec* cache) {
    constexpr u32 VE = Elements<SRC>::per_vector;
    constexpr u32 SIZE = Elements<SRC>::size;
    const u64 r0 = slab * d.block_rows;
    const u32 rows = (u32)(d.rows - r0 < d.block_rows ? d.rows - r0 : d.block_rows);
    const u32 cols = (u32)d.cols;
    const u32 per_row = (cols + VE - 1) / VE;
    const u32 t = threadIdx.x;
    const u32 row_step = QUANT_THREADS / per_row, vector_step = QUANT_THREADS % per_row;
    const bool warp_rows = per_row % 32 == 0;
    const unsigned char* src = reinterpret_cast<const unsigned char*>(d.src) + r0 * d.src_stride * SIZE;
    unsigned char* dst = reinterpret_cast<unsigned char*>(d.dst) + r0 * d.dst_stride;
    const u64 src_row_bytes = d.src_stride * SIZE;
    u32* words = job_amax + d.amax_slot + r0;
    Vec* mine = cache + t;

    u32 row = t / per_row, v = t % per_row;
    const auto advance = [&]() {
        row += row_step;
        v += vector_step;
        if (v >= per_row) {
            v -= per_row;
            ++row;
        }
    };
    const auto count = [&]() { return cols - v * VE < VE ? cols - v * VE : VE; };
    const auto at = [&]() { return src + row * src_row_bytes + (u64)v * VE * SIZE; };
#pragma unroll
    for (u32 k = 0; k < QUANT_CACHE; ++k) {
        if (row < rows) load_cached<true>(mine + k * QUANT_THREADS, at());
        advance();
    }
    wait_cached<true>();
    const u32 rest_row = row, rest_v = v;  // the first vector not cached (rows longer than the cache)
    row = t / per_row;
    v = t % per_row;
    if (phase == 1) {
        // Under warp_rows a round's row is its warp's, so every test of `row` agrees across the warp.
        u32 run = 0, run_row = row;
        const auto fold = [&](const Vec& x) {
            if (row != run_row) {
                fold_row_amax(words, run_row, run, warp_rows);
                run = 0;
                run_row = row;
            }
            const u32 m = vector_amax<SRC>(x, count());
            run = m > run ? m : run;
        };
#pragma unroll
        for (u32 k = 0; k < QUANT_CACHE; ++k) {
            if (row < rows) fold(mine[k * QUANT_THREADS]);
            advance();
        }
        for (row = rest_row, v = rest_v; row < rows; advance()) fold(load_vector(at()));
        if (run_row < rows) fold_row_amax(words, run_row, run, warp_rows);
        return;
    }
    Scale scale = {};
    u32 scale_row = ~0u;
    const auto store = [&](const Vec& x) {
        if (row != scale_row) {
            scale = block_scale(d, *(volatile u32*)(words + row));
            scale_row = row;
        }
        if (v == 0) store_scale(d, r0 + row, 0, scale.stored);
        store_codes<SRC>(d, x, count(), scale, dst + row * d.dst_stride + v * VE);
    };
#pragma unroll
    for (u32 k = 0; k < QUANT_CACHE; ++k) {
        if (row < rows) store(mine[k * QUANT_THREADS]);
        advance();
    }
    for (row = rest_row, v = rest_v; row < rows; advance()) store(load_vector(at()));
}

// The amax of this thread's vectors of a rectangle of a per-tensor job (phase 1:
// refit_quantize_amax), rows [r0, r0 + rows) by elements [c0, c0 + cols), folded into `amax`: the
// block's threads take its vectors in row-major order, in rounds of QUANT_AMAX_LOADS vectors per
// thread, each round's loads issued before any is used.
template <u32 SRC>
__device__ __forceinline__ u32 rectangle_amax(const QuantDesc& d, u64 r0, u32 rows, u64 c0, u32 cols, u32 amax) {
    constexpr u32 VE = Elements<SRC>::per_vector;
    constexpr u32 SIZE = Elements<SRC>::size;
    const u32 per_row = (cols + VE - 1) / VE;
    const u32 row_step = QUANT_THREADS / per_row, vector_step = QUANT_THREADS % per_row;
    const unsigned char* src = reinterpret_cast<const unsigned char*>(d.src) + (r0 * d.src_stride + c0) * SIZE;
    const u64 src_row_bytes = d.src_stride * SIZE;
    u32 row = threadIdx.x / per_row, v = threadIdx.x % per_row;
    while (row < rows) {
        Vec x[QUANT_AMAX_LOADS];
        u32 count[QUANT_AMAX_LOADS];
#pragma unroll
        for (u32 k = 0; k < QUANT_AMAX_LOADS; ++k) {
            count[k] = 0;
            if (row < rows) {
                x[k] = load_vector(src + row * src_row_bytes + (u64)v * VE * SIZE);
                count[k] = cols - v * VE < VE ? cols - v * VE : VE;
            }
            row += row_step;
            v += vector_step;
            if (v >= per_row) {
                v -= per_row;
                ++row;
            }
        }
#pragma unroll
        for (u32 k = 0; k < QUANT_AMAX_LOADS; ++k) {
            const u32 m = count[k] > 0 ? vector_amax<SRC>(x[k], count[k]) : 0u;
            amax = m > amax ? m : amax;
        }
    }
    return amax;
}

// The amax of a per-tensor job's tiles [tile, end) (of this thread) folded into `amax`: the tiles of
// each grid row as one rectangle, so that a warp's loads read consecutive bytes of a row across
// tiles (a tile's row is 256 bytes).
template <u32 SRC>
__device__ __forceinline__ u32 tiles_amax(const QuantDesc& d, u64 tile, u64 end, u32 amax) {
    for (tile -= d.first_tile, end -= d.first_tile; tile < end;) {
        u64 grid_row, grid_col;
        grid_position(d, tile, grid_row, grid_col);
        const u64 across = end - tile < d.grid_cols - grid_col ? end - tile : d.grid_cols - grid_col;
        const u64 r0 = grid_row * d.block_rows, c0 = grid_col * d.block_cols;
        const u64 width = across * d.block_cols;
        const u32 rows = (u32)(d.rows - r0 < d.block_rows ? d.rows - r0 : d.block_rows);
        const u32 cols = (u32)(d.cols - c0 < width ? d.cols - c0 : width);
        amax = rectangle_amax<SRC>(d, r0, rows, c0, cols, amax);
        tile += across;
    }
    return amax;
}

template <u32 SRC, u32 CACHE, bool SHARED>
__device__ void quantize_tile(const QuantDesc& d, u32 amax_slot, u64 tile, const u32* job_amax, Vec* cache) {
    if (d.mode == MODE_GROUP) {
        quantize_groups<SRC>(d, tile);
    } else if (!SHARED && whole_rows<SRC, CACHE>(d)) {
        quantize_row<SRC, CACHE>(d, tile);  // never per tensor: those are wide
    } else {
        quantize_block<SRC, CACHE, SHARED>(d, amax_slot, tile, job_amax, cache);
    }
}

// The descriptor of `tile`: the last one whose first tile is at most `tile`. The tile index after the
// descriptors brackets it (entry c: the job of tile c << QUANT_INDEX_SHIFT; the last entry, past the
// last tile, the last job), so the search runs over the few jobs of one index chunk only (none when
// the chunk lies within one job).
__device__ __forceinline__ u32 job_of(const QuantDesc* __restrict__ descs, u32 njobs, u64 tile) {
    const u32* __restrict__ index = reinterpret_cast<const u32*>(descs + njobs);
    const u64 chunk = tile >> QUANT_INDEX_SHIFT;
    u32 lo = index[chunk], hi = index[chunk + 1] + 1;
    while (hi - lo > 1) {
        const u32 mid = (lo + hi) / 2;
        if (descs[mid].first_tile <= tile) lo = mid;
        else hi = mid;
    }
    return lo;
}

// One tile per thread block: tile first_tile + block of the `njobs` descriptors, for quantizing thread
// block `block` (of a launch's own grid, or counted after a launch's copying blocks:
// copy_quantize.cu); `cache` as for quantize_block. Per-tensor jobs take their amax from job_amax,
// which refit_quantize_amax has reduced (phase 1).
template <u32 CACHE, bool SHARED>
__device__ __forceinline__ void quantize_tiles(const QuantDesc* __restrict__ descs, u32 njobs, u64 first_tile,
                                               const u32* job_amax, u32 block, Vec* cache) {
    const u64 tile = first_tile + block;
    const u32 lo = job_of(descs, njobs, tile);
    const QuantDesc d = descs[lo];
    const u64 local = tile - d.first_tile;
    // Per-tensor jobs are the wide entry point's (SHARED) only: the narrow one never reads the slot.
    const u32 slot = SHARED ? d.amax_slot : lo;
    if (d.source == SRC_BF16) quantize_tile<SRC_BF16, CACHE, SHARED>(d, slot, local, job_amax, cache);
    else if (d.source == SRC_F16) quantize_tile<SRC_F16, CACHE, SHARED>(d, slot, local, job_amax, cache);
    else quantize_tile<SRC_F32, CACHE, SHARED>(d, slot, local, job_amax, cache);
}

// The entry points share one signature (descriptors, jobs, first tile, phase, amax words); those
// with one phase ignore `phase`.
extern "C" __global__ void __launch_bounds__(QUANT_THREADS, QUANT_WIDE_MIN_BLOCKS)
    refit_quantize(const QuantDesc* __restrict__ descs, u32 njobs, u64 first_tile, u32, u32* job_amax) {
    __shared__ Vec cache[QUANT_CACHE * QUANT_THREADS];
    quantize_tiles<QUANT_CACHE, true>(descs, njobs, first_tile, job_amax, blockIdx.x, cache);
}

extern "C" __global__ void __launch_bounds__(QUANT_THREADS, QUANT_NARROW_MIN_BLOCKS)
    refit_quantize_narrow(const QuantDesc* __restrict__ descs, u32 njobs, u64 first_tile, u32, u32* job_amax) {
    quantize_tiles<QUANT_NARROW_CACHE, false>(descs, njobs, first_tile, job_amax, blockIdx.x, nullptr);
}

// Phase 1 of per-tensor jobs, over the wide entry point's tiles [first_tile, end_tile): each block
// takes QUANT_AMAX_TILES consecutive tiles, skipping those of other jobs, and folds each job's amax
// into its word with atomicMax on its bits (the words zeroed or seeded by the host), once per job it
// meets. Nothing is kept for a second use, so the vectors pass through registers and a block holds
// no cache; a block's tiles share its descriptor lookups and its reductions, which one block per
// tile would repeat for every 32 KiB read.
extern "C" __global__ void __launch_bounds__(QUANT_THREADS, QUANT_AMAX_MIN_BLOCKS)
    refit_quantize_amax(const QuantDesc* __restrict__ descs, u32 njobs, u64 first_tile, u64 end_tile, u32* job_amax) {
    u64 tile = first_tile + (u64)blockIdx.x * QUANT_AMAX_TILES;
    const u64 stop = tile + QUANT_AMAX_TILES < end_tile ? tile + QUANT_AMAX_TILES : end_tile;
    for (u32 job = job_of(descs, njobs, tile); tile < stop; ++job) {
        const QuantDesc& d = descs[job];
        const u64 end = d.first_tile + d.blocks < stop ? d.first_tile + d.blocks : stop;  // wide jobs: a tile per block
        if (d.scale_kind == SCALE_TENSOR) {
            u32 amax = 0;
            if (d.source == SRC_BF16) amax = tiles_amax<SRC_BF16>(d, tile, end, amax);
            else if (d.source == SRC_F16) amax = tiles_amax<SRC_F16>(d, tile, end, amax);
            else amax = tiles_amax<SRC_F32>(d, tile, end, amax);
            amax = block_max(amax);
            if (threadIdx.x == 0 && amax != 0) atomicMax(job_amax + d.amax_slot, amax);
            __syncthreads();  // block_max's shared words are read by all before the next job's writes
        }
        tile = end;
    }
}

// Group-mode jobs (MX, short rows, 1 x n blocks), the first tiles of a batch: quantize_groups,
// reading the descriptor where it lies, at QUANT_GROUP_MIN_BLOCKS blocks per SM. An entry point of
// their own: inside the narrow one they shared its 64 registers and its copy of the descriptor, and
// ran slower (docs/decisions.md, "Group mode on an entry point of its own"). The signature is the
// others' (group mode has one phase).
extern "C" __global__ void __launch_bounds__(QUANT_THREADS, QUANT_GROUP_MIN_BLOCKS)
    refit_quantize_groups(const QuantDesc* __restrict__ descs, u32 njobs, u64 first_tile, u32, u32*) {
    const u64 tile = first_tile + blockIdx.x;
    const QuantDesc& d = descs[job_of(descs, njobs, tile)];
    if (d.source == SRC_BF16) quantize_groups<SRC_BF16>(d, tile - d.first_tile);
    else if (d.source == SRC_F16) quantize_groups<SRC_F16>(d, tile - d.first_tile);
    else quantize_groups<SRC_F32>(d, tile - d.first_tile);
}

// Per-row jobs sharing each row's amax (SCALE_ROWS_SHARED), after the wide ones: quantize_shared_rows
// with the wide entry point's cache. An entry point of their own: inlined into refit_quantize, their
// code moved its register allocation (ptxas: 32 to 188 bytes of spill stores) and took its 128 x 128
// blocks 6% slower on one H200; out of line, its copy of the descriptor went to local memory. At
// QUANT_ROWS_MIN_BLOCKS, one block per SM more than the wide entry point (docs/decisions.md).
extern "C" __global__ void __launch_bounds__(QUANT_THREADS, QUANT_ROWS_MIN_BLOCKS)
    refit_quantize_rows(const QuantDesc* __restrict__ descs, u32 njobs, u64 first_tile, u32 phase, u32* job_amax) {
    __shared__ Vec cache[QUANT_CACHE * QUANT_THREADS];
    const u64 tile = first_tile + blockIdx.x;
    const QuantDesc d = descs[job_of(descs, njobs, tile)];
    const u64 slab = tile - d.first_tile;
    if (d.source == SRC_BF16) quantize_shared_rows<SRC_BF16>(d, slab, phase, job_amax, cache);
    else if (d.source == SRC_F16) quantize_shared_rows<SRC_F16>(d, slab, phase, job_amax, cache);
    else quantize_shared_rows<SRC_F32>(d, slab, phase, job_amax, cache);
}
