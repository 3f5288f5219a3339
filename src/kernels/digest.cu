// refit's digest kernel: the digest defined in src/kernels/gf64.rs (a CRC over GF(2) with a primitive
// degree-64 polynomial g and a marker bit after the data) of one byte range of device memory, or of
// many ranges in one launch, in one pass at memory speed.
//
// Compiled at run time by NVRTC (no headers), and built as host C++ by tests/emulate to check it
// against the Rust implementation without a GPU.
//
// How the work is split. The range is read as aligned 16-byte vectors from `addr & ~15`; the bytes
// before `addr` and after the range read as zero, and the marker bit is set in the byte just past it.
// Reading from the aligned base multiplies the polynomial by x^(8 delta) (delta = addr & 15), which a
// factor x^(-8 delta) undoes at the end, so any alignment takes the same fast path. So the kernel may
// read up to 15 bytes before and after the range, within the aligned 16-byte blocks that hold its first
// and last bytes (never another page; compute-sanitizer's memcheck may still report them); an empty
// range reads nothing, wherever it is. Vectors form chunks
// of 32 (one per lane: 512 bytes); each warp takes 2^span_shift consecutive chunks and each lane keeps
// two accumulators (the vector's low and high word) over its chunks, walking them downwards with
// Horner's rule: a = a * x^4096 + word, since consecutive chunks are 4096 bits apart. As
// x^4096 = x^6 + x^3 mod g, that step is two shifts and one lookup of the 6 overflow bits in a 64-entry
// table. At the end each lane multiplies its accumulators by x^(128 lane) and x^(128 lane + 64), the
// warp adds its lanes and multiplies by x^(4096 c0 - 8 delta) (c0: its first chunk), built from a table
// of x^(2^b) by a product over the lanes, and each block adds its warps into *out with one atomic XOR.
// The terms are added in GF(2^64) (XOR), so blocks may finish in any order.
//
// Many ranges in one launch (refit_digest_many). The ranges' chunks are numbered one after another
// (a descriptor per range holds its first chunk's number) and the launch's warps take equal
// consecutive spans of that numbering, so a few huge ranges and many tiny ones keep every warp equally
// busy. A warp finds the range of its first chunk by binary search and walks forward; where its span
// crosses into the next range it finishes the piece it holds (the same steps as above, with the factor
// x^(4096 c0 - 8 delta) built from the bits of c0, the piece's first chunk within its range) and XORs
// it into that range's output word. Every range has at least one chunk (its marker's), so the
// descriptors' first chunks strictly increase.

typedef unsigned long long u64;
typedef unsigned int u32;

// Offsets in the constant table made by gf64::kernel_constants (must match it):
#define C_FOLD 0u     // [8][256]: fold[j][v] = v(x) x^(64 + 8j) mod g
#define C_POW2 2048u  // [64]: x^(2^b)
#define C_NEG 2112u   // [16]: x^(-8d)
#define C_LANE 2128u  // [64]: x^(64 s)
#define C_WORDS 2192u

// The table itself, filled by the host once the module is loaded: memory of the module, so it goes
// with the module rather than being an allocation of its own.
__device__ u64 refit_digest_constants[C_WORDS];

#define WARP 32u
#define DIGEST_THREADS 256u
#define DIGEST_WARPS (DIGEST_THREADS / WARP)
// Chunks (one 16-byte load per lane each) in flight per lane in the main loop.
#define DIGEST_UNROLL 4u
// log2 of the bits between consecutive chunks: 32 lanes x 128 bits.
#define CHUNK_BITS_SHIFT 12u

struct __align__(16) Vec2 {
    u64 lo;
    u64 hi;
};

__device__ __forceinline__ u64 constant(const u64* __restrict__ c, u32 index) { return __ldg(c + index); }

// Carry-less product of two 32-bit polynomials with four integer multiplies per output class: the
// operands are split into bits at positions = i mod 4, so each integer product has at most 8 terms per
// output position and its carries (< 16) stay within the three positions above it, which the masks drop.
__device__ __forceinline__ u64 clmul32(u32 x, u32 y) {
    const u32 m0 = 0x11111111u, m1 = 0x22222222u, m2 = 0x44444444u, m3 = 0x88888888u;
    const u64 x0 = x & m0, x1 = x & m1, x2 = x & m2, x3 = x & m3;
    const u64 y0 = y & m0, y1 = y & m1, y2 = y & m2, y3 = y & m3;
    const u64 z0 = (x0 * y0) ^ (x1 * y3) ^ (x2 * y2) ^ (x3 * y1);
    const u64 z1 = (x0 * y1) ^ (x1 * y0) ^ (x2 * y3) ^ (x3 * y2);
    const u64 z2 = (x0 * y2) ^ (x1 * y1) ^ (x2 * y0) ^ (x3 * y3);
    const u64 z3 = (x0 * y3) ^ (x1 * y2) ^ (x2 * y1) ^ (x3 * y0);
    return (z0 & 0x1111111111111111ull) | (z1 & 0x2222222222222222ull) | (z2 & 0x4444444444444444ull) |
           (z3 & 0x8888888888888888ull);
}

// a * b mod g: a 64 x 64 carry-less product (Karatsuba over 32-bit halves), then the high half folded
// a byte at a time with the fold tables. Only the per-warp tail uses it.
__device__ __noinline__ u64 gf_mul(u64 a, u64 b, const u64* __restrict__ c) {
    const u64 low = clmul32((u32)a, (u32)b);
    const u64 high = clmul32((u32)(a >> 32), (u32)(b >> 32));
    const u64 mid = clmul32((u32)a ^ (u32)(a >> 32), (u32)b ^ (u32)(b >> 32)) ^ low ^ high;
    const u64 lo = low ^ (mid << 32);
    const u64 hi = high ^ (mid >> 32);
    u64 r = lo;
#pragma unroll
    for (u32 j = 0; j < 8; ++j) r ^= constant(c, C_FOLD + 256u * j + (u32)((hi >> (8u * j)) & 0xffu));
    return r;
}

// a * x^4096 mod g = a (x^6 + x^3) mod g: the 6 bits shifted out are folded back with fold[0].
__device__ __forceinline__ u64 times_x4096(u64 a, const u64* fold6) {
    return (a << 6) ^ (a << 3) ^ fold6[(a >> 58) ^ (a >> 61)];
}

// The bytes of the 8-byte word at aligned offset o that lie in [delta, end), as a mask.
__device__ __forceinline__ u64 word_mask(u64 o, u64 delta, u64 end) {
    u64 m = ~0ull;
    if (delta > o) m = delta - o >= 8 ? 0 : m << (8u * (u32)(delta - o));
    if (end < o + 8) m &= end <= o ? 0 : (1ull << (8u * (u32)(end - o))) - 1;
    return m;
}

// Vector j of the aligned view: data bytes outside [delta, end) read as zero (and are not loaded when
// the vector holds none), and the marker bit is set at byte `end`.
__device__ __forceinline__ Vec2 edge_vector(u64 base, u64 j, u64 delta, u64 end) {
    const u64 first = 16 * j;
    Vec2 v = {0, 0};
    if (delta < end && first < end && first + 16 > delta) {  // holds data bytes (none when len is 0)
        v = *reinterpret_cast<const Vec2*>(base + first);
        v.lo &= word_mask(first, delta, end);
        v.hi &= word_mask(first + 8, delta, end);
    }
    if (end >= first && end < first + 16) {
        const u32 k = (u32)(end - first);
        if (k < 8) v.lo ^= 1ull << (8u * k);
        else v.hi ^= 1ull << (8u * (k - 8));
    }
    return v;
}

// Adds chunks [c0, c1) of the aligned view of one range (from `base`; data at [delta, end), the
// marker at `end`) into the lane's accumulators, walking downwards with Horner's rule: on return
// a0 + a1 x^64 = sum over the chunks c of the lane's vector of chunk c times x^(4096 (c - c0)).
__device__ __forceinline__ void accumulate(u64 base, u64 delta, u64 end, u32 lane, u64 c0, u64 c1,
                                           const u64* fold6, u64& a0, u64& a1) {
    // Chunks [interior_lo, interior_hi) lie wholly inside the data: no masks, no marker.
    const u64 interior_lo = delta == 0 ? 0 : 1;
    const u64 interior_hi = end / (16 * WARP);
    a0 = 0;
    a1 = 0;
    u64 chunk = c1;
    // Downwards: the top edge chunk (the marker, maybe a partial vector), the interior, chunk 0.
    while (chunk > c0 && chunk - 1 >= interior_hi) {
        --chunk;
        const Vec2 v = edge_vector(base, chunk * WARP + lane, delta, end);
        a0 = times_x4096(a0, fold6) ^ v.lo;
        a1 = times_x4096(a1, fold6) ^ v.hi;
    }
    const u64 stop = c0 > interior_lo ? c0 : interior_lo;
    const Vec2* p = reinterpret_cast<const Vec2*>(base) + lane;
    while (chunk >= stop + DIGEST_UNROLL) {
        Vec2 v[DIGEST_UNROLL];
#pragma unroll
        for (u32 k = 0; k < DIGEST_UNROLL; ++k) v[k] = p[(chunk - 1 - k) * WARP];
#pragma unroll
        for (u32 k = 0; k < DIGEST_UNROLL; ++k) {
            a0 = times_x4096(a0, fold6) ^ v[k].lo;
            a1 = times_x4096(a1, fold6) ^ v[k].hi;
        }
        chunk -= DIGEST_UNROLL;
    }
    while (chunk > stop) {
        --chunk;
        const Vec2 v = p[chunk * WARP];
        a0 = times_x4096(a0, fold6) ^ v.lo;
        a1 = times_x4096(a1, fold6) ^ v.hi;
    }
    while (chunk > c0) {
        --chunk;
        const Vec2 v = edge_vector(base, chunk * WARP + lane, delta, end);
        a0 = times_x4096(a0, fold6) ^ v.lo;
        a1 = times_x4096(a1, fold6) ^ v.hi;
    }
}

// The warp's accumulators as one polynomial relative to its first chunk, in every lane: lane l's
// vector sits 128 l bits into each chunk, its high word 64 bits further.
__device__ __forceinline__ u64 warp_sum(u64 a0, u64 a1, u32 lane, const u64* __restrict__ c) {
    u64 sum = gf_mul(a0, constant(c, C_LANE + 2 * lane), c) ^ gf_mul(a1, constant(c, C_LANE + 2 * lane + 1), c);
#pragma unroll
    for (u32 offset = WARP / 2; offset > 0; offset /= 2) sum ^= __shfl_xor_sync(0xffffffffu, sum, offset);
    return sum;
}

// XORs the digest's terms from the bytes [addr, addr + len) into *out (which the host zeroes first).
// The launch has ceil(warps / DIGEST_WARPS) blocks of DIGEST_THREADS threads, where warps =
// ceil(chunks / 2^span_shift) < 2^15 and chunks = ceil(((delta + len) / 16 + 1) / 32).
extern "C" __global__ void __launch_bounds__(DIGEST_THREADS)
    refit_digest(u64 addr, u64 len, u32 span_shift, const u64* __restrict__ c, u64* out) {
    __shared__ u64 fold6[64];
    __shared__ u64 warp_sums[DIGEST_WARPS];
    if (threadIdx.x < 64) fold6[threadIdx.x] = constant(c, C_FOLD + threadIdx.x);
    __syncthreads();

    const u32 lane = threadIdx.x % WARP;
    const u64 warp = (u64)blockIdx.x * DIGEST_WARPS + threadIdx.x / WARP;
    const u64 base = addr & ~15ull;
    const u64 delta = addr & 15;
    const u64 end = delta + len;  // aligned offset of the marker byte
    const u64 chunks = ((end >> 4) + 1 + WARP - 1) / WARP;
    const u64 c0 = warp << span_shift;

    u64 value = 0;
    if (c0 < chunks) {  // the same for every lane of the warp
        const u64 c1 = c0 + (1ull << span_shift) < chunks ? c0 + (1ull << span_shift) : chunks;
        u64 a0, a1;
        accumulate(base, delta, end, lane, c0, c1, fold6, a0, a1);

        // The warp's factor x^(4096 c0 - 8 delta) = x^(-8 delta) * prod over the set bits b of `warp`
        // of x^(2^(12 + span_shift + b)): lanes 0-14 hold the bits' factors, lane 15 the alignment's,
        // and four butterfly steps multiply them together in every lane of each half warp.
        u64 factor = 1;
        if (lane < 15) {
            if ((warp >> lane) & 1) factor = constant(c, C_POW2 + CHUNK_BITS_SHIFT + span_shift + lane);
        } else if (lane == 15) {
            factor = constant(c, C_NEG + (u32)delta);
        }
        const u64 sum = warp_sum(a0, a1, lane, c);
#pragma unroll
        for (u32 offset = 8; offset > 0; offset /= 2) {
            factor = gf_mul(factor, __shfl_xor_sync(0xffffffffu, factor, offset), c);
        }
        value = gf_mul(sum, factor, c);
    }
    if (lane == 0) warp_sums[threadIdx.x / WARP] = value;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 total = 0;
        for (u32 w = 0; w < DIGEST_WARPS; ++w) total ^= warp_sums[w];
        if (total != 0) atomicXor(out, total);
    }
}

// One range of a many-range launch; must match kernels::digest::RangeDescriptor.
struct DigestRange {
    u64 addr;
    u64 len;
    u64 first_chunk;  // the number of its first chunk: the chunks of the ranges before it
};

// The most chunks of one range (log2): the factor of a piece is built from the bits of its first
// chunk, c0 < 2^52, each bit b giving x^(2^(12 + b)) from the table of x^(2^b), b < 64.
#define MANY_CHUNK_BITS 52u

// x^(4096 c0 - 8 delta) in every lane: lane l holds the factors of bits l and l + 32 of c0 (lane 31
// the alignment's instead of a second bit), and five butterfly steps multiply them together.
__device__ __forceinline__ u64 piece_factor(u64 c0, u64 delta, u32 lane, const u64* __restrict__ c) {
    u64 low = ((c0 >> lane) & 1) ? constant(c, C_POW2 + CHUNK_BITS_SHIFT + lane) : 1;
    u64 high = 1;
    if (lane + 32 < MANY_CHUNK_BITS) {
        if ((c0 >> (lane + 32)) & 1) high = constant(c, C_POW2 + CHUNK_BITS_SHIFT + 32 + lane);
    } else if (lane == WARP - 1) {
        high = constant(c, C_NEG + (u32)delta);
    }
    u64 factor = gf_mul(low, high, c);
#pragma unroll
    for (u32 offset = WARP / 2; offset > 0; offset /= 2) {
        factor = gf_mul(factor, __shfl_xor_sync(0xffffffffu, factor, offset), c);
    }
    return factor;
}

// XORs the digest's terms of every range r into out[r] (which the host zeroes first). Warp w takes
// the chunks [w span, (w + 1) span) of the numbering over all ranges (total_chunks in all); the launch
// has ceil(ceil(total_chunks / span) / DIGEST_WARPS) blocks of DIGEST_THREADS threads. A range's
// chunks are ceil(((delta + len) / 16 + 1) / 32), fewer than 2^MANY_CHUNK_BITS.
extern "C" __global__ void __launch_bounds__(DIGEST_THREADS)
    refit_digest_many(const DigestRange* __restrict__ ranges, u32 count, u64 total_chunks, u64 span,
                      const u64* __restrict__ c, u64* out) {
    __shared__ u64 fold6[64];
    if (threadIdx.x < 64) fold6[threadIdx.x] = constant(c, C_FOLD + threadIdx.x);
    __syncthreads();

    const u32 lane = threadIdx.x % WARP;
    const u64 warp = (u64)blockIdx.x * DIGEST_WARPS + threadIdx.x / WARP;
    const u64 g0 = warp * span;
    if (count == 0 || g0 >= total_chunks) return;  // the same for every lane of the warp
    const u64 g1 = total_chunks - g0 > span ? g0 + span : total_chunks;
    // The range holding chunk g0: the last whose first chunk is at most g0 (ranges[0]'s is 0).
    u32 lo = 0, hi = count;
    while (hi - lo > 1) {
        const u32 mid = lo + (hi - lo) / 2;
        if (ranges[mid].first_chunk <= g0) lo = mid;
        else hi = mid;
    }
    // Then each range the span reaches, one piece at a time.
    for (u32 r = lo; r < count; ++r) {
        const DigestRange range = ranges[r];
        const u64 next = r + 1 < count ? ranges[r + 1].first_chunk : total_chunks;
        const u64 from = g0 > range.first_chunk ? g0 : range.first_chunk;
        const u64 to = g1 < next ? g1 : next;
        if (from >= to) break;
        const u64 base = range.addr & ~15ull;
        const u64 delta = range.addr & 15;
        const u64 end = delta + range.len;
        const u64 c0 = from - range.first_chunk;
        u64 a0, a1;
        accumulate(base, delta, end, lane, c0, to - range.first_chunk, fold6, a0, a1);
        const u64 sum = warp_sum(a0, a1, lane, c);
        const u64 value = gf_mul(sum, piece_factor(c0, delta, lane, c), c);
        if (lane == 0 && value != 0) atomicXor(out + r, value);
        if (to == g1) break;
    }
}
