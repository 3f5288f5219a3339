// refit's batched copy kernel: one launch copies any number of segments (see src/segment.rs).
//
// Compiled at run time by NVRTC for the exact device (src/kernels/nvrtc.rs); no headers, so it builds
// with nothing but libnvrtc. The host side (src/kernels/layout.rs) turns each segment into a `Desc`
// and splits its payload into tiles; this file must agree with that layout byte for byte.
//
// Work split: the batch is a sequence of tiles (each at most 2^tile_shift bytes, or a group of whole
// short runs). Every warp of the persistent grid takes one contiguous range of tiles, finds the segment
// of its first tile by binary search over `tile_first`, then walks forward. A warp copies one piece
// (a contiguous byte range) at a time, all 32 lanes together, with several 16-byte loads in flight per
// lane before the matching stores. There is no inter-block communication, no atomics and no state
// kept between launches, so a launch can be replayed (CUDA graphs) as is. (The group-synchronized
// entry point at the end adds a rendezvous with the other ranks' launches around the same copy.)

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// Must match `DeviceSegment` in src/kernels/layout.rs (12 x u64, 96 bytes, 16-byte aligned).
struct __align__(16) Desc {
    u64 src;
    u64 dst;
    u64 len;          // bytes per contiguous run (never 0 here: empty segments are dropped on the host)
    u64 count0;       // runs per outer repetition
    u64 src_stride0;
    u64 dst_stride0;
    u64 src_stride1;
    u64 dst_stride1;
    u64 runs;         // count0 * count1
    u64 tile_first;   // index of this segment's first tile in the batch
    u64 run_tiles;    // tiles per run when a run is longer than a tile, else 1
    u64 tile_runs;    // whole runs per tile when runs are at most a tile long, else 1
};

struct __align__(16) V16 {
    u64 lo;
    u64 hi;
};

// The type an element is hashed and compared as: 16-byte vectors as they are, narrower ones as u64.
template <typename V>
struct Wide {
    typedef u64 type;
};
template <>
struct Wide<V16> {
    typedef V16 type;
};

#define WARP 32u
// Vectors in flight per lane before the first store: 2 KiB per 32 lanes per step with 16-byte vectors.
#define UNROLL 4u

// What a walk over the tiles does with each element (a template parameter, so the plain copy compiles
// exactly as if the others did not exist). The other modes exist for verifying a copy: they take the
// same walk, so every element is handled by the same lane, in the same order, as in the copy.
#define MODE_COPY 0u         // read the source, write the destination
#define MODE_COPY_DIGEST 1u  // the same, and record a digest of each tile's source bytes as read
#define MODE_CHECK 2u        // read the destination, digest each tile, compare with the recorded digest
#define MODE_COMPARE 3u      // read the source and the destination, note any difference
#define MODE_RECORD 4u       // read the source, record the digests MODE_COPY_DIGEST would (write nothing)

// A lane's view of the tile it is walking: a hash of the elements it read (the digest modes)
// and the OR of all differences it saw (MODE_COMPARE).
struct Probe {
    u64 hash;
    u64 diff;
};

// A bijection of 64-bit words (an odd multiplier, then an xorshift): hash = mix(hash ^ element) changes
// whenever one element changes, so a tile digest (the sum of its lanes' hashes) always changes with a
// single changed element. Other differences are found with a chance of about 1 - 2^-64.
__device__ __forceinline__ u64 mix(u64 x) {
    x *= 0x9E3779B97F4A7C15ull;
    return x ^ (x >> 29);
}

__device__ __forceinline__ void absorb(Probe& p, u64 x) { p.hash = mix(p.hash ^ x); }
__device__ __forceinline__ void absorb(Probe& p, V16 v) {
    absorb(p, v.lo);
    absorb(p, v.hi);
}
__device__ __forceinline__ u64 difference(u64 a, u64 b) { return a ^ b; }
__device__ __forceinline__ u64 difference(V16 a, V16 b) { return (a.lo ^ b.lo) | (a.hi ^ b.hi); }

// One element at index k of the lane's run: read what the mode reads, then write, hash or compare.
template <u32 MODE, typename V>
__device__ __forceinline__ void load_element(V& v, V& w, const V* s, const V* d, u32 k) {
    if (MODE == MODE_CHECK) {
        v = d[k];
    } else {
        v = s[k];
        if (MODE == MODE_COMPARE) w = d[k];
    }
}

template <u32 MODE, typename V>
__device__ __forceinline__ void use_element(const V& v, const V& w, V* d, u32 k, Probe& p) {
    if (MODE == MODE_COPY || MODE == MODE_COPY_DIGEST) d[k] = v;
    if (MODE == MODE_COPY_DIGEST || MODE == MODE_CHECK || MODE == MODE_RECORD)
        absorb(p, (typename Wide<V>::type)v);
    if (MODE == MODE_COMPARE) p.diff |= difference((typename Wide<V>::type)v, (typename Wide<V>::type)w);
}

// A tile is copied by a group of `width` lanes (32, 16 or 8; chosen per batch on the host): for small
// tiles, several groups of one warp copy several tiles at once, so that more memory round trips are in
// flight per warp. `lane` below is the lane's index within its group.

// Copies n elements of type V, lane-strided so that each group access is coalesced. All loads of a
// step are issued before any store of it (predicated, so a short piece still gets one round trip).
// Pieces are at most one tile (<= 1 MiB), so 32-bit indices suffice.
template <u32 MODE, typename V>
__device__ __forceinline__ void copy_elements(u64 dst, u64 src, u32 n, u32 lane, u32 width, Probe& p) {
    V* d = reinterpret_cast<V*>(dst) + lane;
    const V* s = reinterpret_cast<const V*>(src) + lane;
    for (u32 i = lane; i < n; i += UNROLL * width) {
        V v[UNROLL];
        V w[MODE == MODE_COMPARE ? UNROLL : 1];
#pragma unroll
        for (u32 k = 0; k < UNROLL; ++k) {
            if (i + k * width < n) load_element<MODE>(v[k], w[MODE == MODE_COMPARE ? k : 0], s, d, k * width);
        }
#pragma unroll
        for (u32 k = 0; k < UNROLL; ++k) {
            if (i + k * width < n) use_element<MODE>(v[k], w[MODE == MODE_COMPARE ? k : 0], d, k * width, p);
        }
        s += UNROLL * width;
        d += UNROLL * width;
    }
}

// Copies bytes [from, to) one per lane (heads and tails shorter than 16 bytes).
template <u32 MODE>
__device__ __forceinline__ void copy_bytes(u64 dst, u64 src, u32 from, u32 to, u32 lane, u32 width, Probe& p) {
    for (u32 b = from + lane; b < to; b += width) {
        u8 v, w;
        load_element<MODE>(v, w, reinterpret_cast<const u8*>(src), reinterpret_cast<const u8*>(dst), b);
        use_element<MODE>(v, w, reinterpret_cast<u8*>(dst), b, p);
    }
}

// Copies n bytes where src and dst agree modulo W: a byte head up to W-alignment of dst (< W <= 16
// bytes), a body of W-byte elements, a byte tail (< W bytes).
template <u32 MODE, typename V, u32 W>
__device__ __forceinline__ void copy_coaligned(u64 dst, u64 src, u32 n, u32 lane, u32 width, Probe& p) {
    u32 head = (W - ((u32)dst & (W - 1))) & (W - 1);
    if (head > n) head = n;
    copy_bytes<MODE>(dst, src, 0, head, lane, width, p);
    const u32 body = (n - head) / W;
    copy_elements<MODE, V>(dst + head, src + head, body, lane, width, p);
    copy_bytes<MODE>(dst, src, head + body * W, n, lane, width, p);
}

// One contiguous piece of at most one tile, copied by the lane group with the widest access both
// sides allow.
template <u32 MODE>
__device__ __forceinline__ void copy_piece(u64 dst, u64 src, u32 n, u32 lane, u32 width, Probe& p) {
    const u32 skew = (u32)(dst ^ src);
    if ((skew & 15u) == 0) {
        copy_coaligned<MODE, V16, 16>(dst, src, n, lane, width, p);
    } else if ((skew & 7u) == 0) {
        copy_coaligned<MODE, u64, 8>(dst, src, n, lane, width, p);
    } else if ((skew & 3u) == 0) {
        copy_coaligned<MODE, u32, 4>(dst, src, n, lane, width, p);
    } else if ((skew & 1u) == 0) {
        copy_coaligned<MODE, u16, 2>(dst, src, n, lane, width, p);
    } else {
        copy_elements<MODE, u8>(dst, src, n, lane, width, p);
    }
}

// Copies `rows` rows of `per_row` 16-byte vectors (rows * per_row <= one tile of vectors), each lane
// taking vectors across row boundaries so that UNROLL loads per lane are in flight whatever the row
// length. Every address is 16-byte aligned (checked by the caller).
template <u32 MODE>
__device__ __forceinline__ void copy_rows16(u64 dst, u64 src, u32 per_row, u32 rows, u64 src_stride,
                                            u64 dst_stride, u32 lane, u32 width, Probe& p) {
    const u32 total = per_row * rows;
    for (u32 e = lane; e < total; e += UNROLL * width) {
        V16 v[UNROLL];
        V16 w[MODE == MODE_COMPARE ? UNROLL : 1];
        u32 row[UNROLL];
#pragma unroll
        for (u32 k = 0; k < UNROLL; ++k) {
            const u32 idx = e + k * width;
            row[k] = idx / per_row;
            if (idx < total) {
                load_element<MODE>(
                    v[k], w[MODE == MODE_COMPARE ? k : 0],
                    reinterpret_cast<const V16*>(src + row[k] * src_stride + (u64)(idx - row[k] * per_row) * 16),
                    reinterpret_cast<const V16*>(dst + row[k] * dst_stride + (u64)(idx - row[k] * per_row) * 16), 0);
            }
        }
#pragma unroll
        for (u32 k = 0; k < UNROLL; ++k) {
            const u32 idx = e + k * width;
            if (idx < total) {
                use_element<MODE>(
                    v[k], w[MODE == MODE_COMPARE ? k : 0],
                    reinterpret_cast<V16*>(dst + row[k] * dst_stride + (u64)(idx - row[k] * per_row) * 16), 0, p);
            }
        }
    }
}

// Copies tile `local` (the tile index within segment `d`). Every case is a list of pieces of equal
// length: one piece for a tile of a long run, up to tile_runs whole runs otherwise. A single call site
// of copy_piece keeps the kernel small (and its register count low).
// `d` is read through L1 at each tile rather than held in registers across the loop: the kernel needs
// its registers for loads in flight.
template <u32 MODE>
__device__ __forceinline__ void copy_tile(const Desc* __restrict__ dp, u64 local, u32 tile_shift, u32 lane,
                                          u32 width, Probe& probe) {
    const Desc& d = *dp;
    u64 r;       // first run of the tile
    u64 off;     // byte offset of the piece within its run
    u64 n;       // bytes per piece
    u64 pieces;  // pieces in this tile
    if (d.run_tiles > 1 || d.runs == 1) {
        // A run cut into tiles (a contiguous segment is one run): one piece.
        const u64 per = d.run_tiles;
        r = per == 1 ? 0 : local / per;
        off = (local - r * per) << tile_shift;
        const u64 rest = d.len - off;
        const u64 tile = 1ull << tile_shift;
        n = rest < tile ? rest : tile;
        pieces = 1;
    } else {
        // Short runs: the tile is up to tile_runs whole runs.
        r = local * d.tile_runs;
        off = 0;
        n = d.len;
        pieces = (d.runs - r < d.tile_runs) ? d.runs - r : d.tile_runs;
    }
    u64 i = r, j = 0;
    if (d.runs != 1) {
        j = r / d.count0;
        i = r - j * d.count0;
    }
    u64 src = d.src + j * d.src_stride1 + i * d.src_stride0 + off;
    u64 dst = d.dst + j * d.dst_stride1 + i * d.dst_stride0 + off;
    if (pieces > 1 && i + pieces <= d.count0 &&
        ((src | dst | d.len | d.src_stride0 | d.dst_stride0) & 15u) == 0) {
        // Rows of whole 16-byte vectors within one outer repetition (the tensor-parallel column split):
        // spread the lanes over all rows at once instead of one row after the other.
        copy_rows16<MODE>(dst, src, (u32)(d.len / 16), (u32)pieces, d.src_stride0, d.dst_stride0, lane, width,
                          probe);
        return;
    }
    for (u64 p = 0;;) {
        copy_piece<MODE>(dst, src, (u32)n, lane, width, probe);
        if (++p == pieces) break;
        if (++i == d.count0) {
            i = 0;
            ++j;
            src = d.src + j * d.src_stride1;
            dst = d.dst + j * d.dst_stride1;
        } else {
            src += d.src_stride0;
            dst += d.dst_stride0;
        }
    }
}

// Asks for a descriptor's cache lines ahead of use, so that moving to the next segment does not wait
// a full memory round trip. No registers held, unlike loading it early.
__device__ __forceinline__ void prefetch_desc(const Desc* d) {
#if defined(__CUDA_ARCH__)  // absent when tests/kernel_emulated.rs builds this file as host C++
    asm volatile("prefetch.global.L1 [%0];" ::"l"(d));
    asm volatile("prefetch.global.L1 [%0];" ::"l"(reinterpret_cast<const char*>(d) + 64));
#else
    (void)d;
#endif
}

// The end of one tile in the verifying modes. MODE_COPY_DIGEST and MODE_CHECK add the lanes' hashes
// (seeded with the lane's index, so that the same values in other lanes give another sum) over the
// tile's lane group; its first lane records the sum in digests[t] or compares it with what is recorded
// there. A difference lowers *first_bad to the tile's segment index s.
template <u32 MODE>
__device__ __forceinline__ void finish_tile(const Probe& p, u64 t, u64 s, u32 lane, u32 width, u64* digests,
                                            u64* first_bad) {
    if (MODE == MODE_COMPARE) {
        if (p.diff != 0) atomicMin(first_bad, s);
    } else if (MODE == MODE_COPY_DIGEST || MODE == MODE_CHECK || MODE == MODE_RECORD) {
        const u32 in_warp = threadIdx.x & (WARP - 1);
        const u32 mask = width == WARP ? 0xffffffffu : ((1u << width) - 1) << (in_warp & ~(width - 1));
        u64 sum = p.hash;
        for (u32 offset = width / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(mask, sum, offset, width);
        if (lane == 0) {
            if (MODE == MODE_COPY_DIGEST || MODE == MODE_RECORD) digests[t] = sum;
            else if (digests[t] != sum) atomicMin(first_bad, s);
        }
    }
}

// This thread's share of a launch, as thread block `block` of `blocks` copying (a launch's own grid,
// or the first blocks of a launch that also quantizes: copy_quantize.cu). descs: nseg descriptors
// followed by one sentinel whose tile_first is ntiles. group_shift: log2 of the lanes per tile (3, 4
// or 5). The host guarantees nseg >= 1, ntiles >= 1 and ntiles * (total warps + 1) < 2^64. `digests`
// (one word per tile) and `first_bad` are used by the verifying modes only.
template <u32 MODE>
__device__ __forceinline__ void copy_tiles(const Desc* __restrict__ descs, u64 nseg, u64 ntiles, u32 tile_shift,
                                           u32 group_shift, u64* digests, u64* first_bad, u32 block, u32 blocks) {
    const u32 width = 1u << group_shift;
    const u32 lane = threadIdx.x & (width - 1);
    const u32 group = (threadIdx.x & (WARP - 1)) >> group_shift;
    const u32 groups = WARP >> group_shift;
    const u64 warps_per_block = blockDim.x / WARP;
    const u64 nwarps = (u64)blocks * warps_per_block;
    const u64 warp = (u64)block * warps_per_block + threadIdx.x / WARP;
    // The warp's tiles are [t_first, t_end); group g takes t_first + g, then every groups-th tile.
    const u64 t_first = ntiles * warp / nwarps;
    const u64 t_end = ntiles * (warp + 1) / nwarps;
    u64 t = t_first + group;
    if (t >= t_end) return;

    // The segment holding tile t: the last s with descs[s].tile_first <= t.
    u64 lo = 0, hi = nseg - 1;
    while (lo < hi) {
        const u64 mid = lo + (hi - lo + 1) / 2;
        if (descs[mid].tile_first <= t) lo = mid;
        else hi = mid - 1;
    }
    u64 s = lo;
    u64 seg_first = descs[s].tile_first;
    u64 seg_end = descs[s + 1].tile_first;
    prefetch_desc(descs + s + 1);
    for (;;) {
        Probe probe = {lane + 1ull, 0};
        copy_tile<MODE>(descs + s, t - seg_first, tile_shift, lane, width, probe);
        finish_tile<MODE>(probe, t, s, lane, width, digests, first_bad);
        t += groups;
        if (t >= t_end) break;
        // With several groups a step can cross several (one-tile) segments; their descriptors are
        // adjacent and shared with the warp's other groups, so these reads mostly hit L1.
        while (t >= seg_end) {
            ++s;
            seg_first = seg_end;
            seg_end = descs[s + 1].tile_first;
        }
        prefetch_desc(descs + (s + groups <= nseg ? s + groups : nseg));
    }
}

// The entry points. A module that only calls copy_tiles (the quantize kernel's, whose launch also
// copies: copy_quantize.cu) defines REFIT_COPY_TILES_ONLY and compiles none of them.
#ifndef REFIT_COPY_TILES_ONLY
extern "C" __global__ void __launch_bounds__(256, 3) refit_batched_copy(const Desc* __restrict__ descs, u64 nseg,
                                                                     u64 ntiles, u32 tile_shift, u32 group_shift) {
    copy_tiles<MODE_COPY>(descs, nseg, ntiles, tile_shift, group_shift, nullptr, nullptr, blockIdx.x, gridDim.x);
}

// The copy, also recording in digests[t] a digest of the source bytes that tile t read (one word per
// tile), for refit_batched_check to verify the destinations against without reading the sources again.
extern "C" __global__ void __launch_bounds__(256, 3)
    refit_batched_copy_digest(const Desc* __restrict__ descs, u64 nseg, u64 ntiles, u32 tile_shift,
                              u32 group_shift, u64* digests) {
    copy_tiles<MODE_COPY_DIGEST>(descs, nseg, ntiles, tile_shift, group_shift, digests, nullptr, blockIdx.x, gridDim.x);
}

// Verifies a refit_batched_copy_digest launch of the same batch: digests every tile's destination
// bytes with the same walk and lowers *first_bad to the index of the first descriptor whose tile
// digests differ (the host sets it to ~0 before).
extern "C" __global__ void __launch_bounds__(256, 3)
    refit_batched_check(const Desc* __restrict__ descs, u64 nseg, u64 ntiles, u32 tile_shift, u32 group_shift,
                        u64* digests, u64* first_bad) {
    copy_tiles<MODE_CHECK>(descs, nseg, ntiles, tile_shift, group_shift, digests, first_bad, blockIdx.x, gridDim.x);
}

// Records the digests refit_batched_copy_digest would of the same batch, reading the sources only: for
// bytes that reach their destinations by other means (through staging, from another process), which a
// refit_batched_check of the same batch (same segments, any device) then verifies where they landed.
extern "C" __global__ void __launch_bounds__(256, 3)
    refit_batched_record(const Desc* __restrict__ descs, u64 nseg, u64 ntiles, u32 tile_shift, u32 group_shift,
                         u64* digests) {
    copy_tiles<MODE_RECORD>(descs, nseg, ntiles, tile_shift, group_shift, digests, nullptr, blockIdx.x, gridDim.x);
}

// Compares every destination byte with its source byte and lowers *first_bad to the index of the first
// descriptor with a difference (the host sets it to ~0 before). Exact, but reads both sides. Two blocks
// per SM rather than three: it holds twice the loads in flight, which spill at the 80-register cap.
extern "C" __global__ void __launch_bounds__(256, 2)
    refit_batched_compare(const Desc* __restrict__ descs, u64 nseg, u64 ntiles, u32 tile_shift, u32 group_shift,
                          u64* digests, u64* first_bad) {
    copy_tiles<MODE_COMPARE>(descs, nseg, ntiles, tile_shift, group_shift, digests, first_bad, blockIdx.x, gridDim.x);
}

#if defined(__CUDA_ARCH__)
// The group-synchronized launch: every rank of a device group launches it at once on its own stream
// (a whole-group peer allgather's pushes), and the launches meet through flags in device memory
// instead of cross-GPU stream events, whose GPU-side latency is the whole cost of a small call
// (benches/probes/cross_gpu_sync_probe.py prices an event round trip).
//
// Rank r's flag block (u64 words in r's memory, written by its peers over NVLink, zeroed at creation;
// must match src/kernels/rendezvous.rs): arrived[p] at word p, the epoch of p's latest arrival, and
// departed[p] at word n + p, which p's launches raise by DEPARTURE_UNITS each. `flag_blocks[p]` is the
// address of rank p's block; `epoch` grows by one per call, so nothing is ever reset.
//
// 1. Arrival: every block tells every peer that this launch has started (idempotent stores: no block
//    waits for another block of its own grid, so the grid need not be co-resident), then waits until
//    every peer's launch has started. A launch starts only after everything queued before it on its
//    stream, so the peers' buffers are free for this call.
// 2. The copies (a whole-group allgather pushes: this rank's block into every rank's buffer).
// 3. Departure: every block, once its copies are done, adds its share to departed[rank] in every
//    peer's block with release semantics (its reads and writes are over before the count shows it).
//    The shares of one launch sum to DEPARTURE_UNITS whatever its grid (block 0 adds DEPARTURE_UNITS -
//    (blocks - 1), every other block 1), so a count reaches epoch * DEPARTURE_UNITS exactly when
//    every block of every launch up to this epoch has departed. Block 0 then waits for that count
//    from every peer. The launch therefore ends only when every copy into or out of this rank's
//    memory is over: work queued after it on the stream may read what arrived and reuse what was
//    sent. Counting per block, rather than finding the grid's last block with a local counter and a
//    second fence, shortens every call (benches/probes/leader_launch_probe.cu measured both;
//    benches/gpu_allgather.rs measures the call).
#define DEPARTURE_UNITS 65536ull

__device__ __forceinline__ void store_release(u64 addr, u64 value) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(value) : "memory");
}

__device__ __forceinline__ void add_release(u64 addr, u64 value) {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(addr), "l"(value) : "memory");
}

__device__ __forceinline__ void wait_at_least(u64 addr, u64 value) {
    for (;;) {
        u64 seen;
        asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(seen) : "l"(addr) : "memory");
        if (seen >= value) return;
        asm volatile("nanosleep.u32 64;");
    }
}

extern "C" __global__ void __launch_bounds__(256, 3)
    refit_batched_copy_synced(const Desc* __restrict__ descs, u64 nseg, u64 ntiles, u32 tile_shift,
                              u32 group_shift, const u64* __restrict__ flag_blocks, u32 rank, u32 n,
                              u64 epoch) {
    const u64 mine = flag_blocks[rank];
    if (threadIdx.x == 0) {
        for (u32 p = 0; p < n; ++p) {
            if (p != rank) store_release(flag_blocks[p] + 8ull * rank, epoch);
        }
        for (u32 p = 0; p < n; ++p) {
            if (p != rank) wait_at_least(mine + 8ull * p, epoch);
        }
    }
    __syncthreads();
    if (ntiles > 0) copy_tiles<MODE_COPY>(descs, nseg, ntiles, tile_shift, group_shift, nullptr, nullptr, blockIdx.x, gridDim.x);
    // Every thread of this block has issued its accesses; thread 0's release covers them.
    __syncthreads();
    if (threadIdx.x != 0) return;
    const u64 share = blockIdx.x == 0 ? DEPARTURE_UNITS - (gridDim.x - 1) : 1;
    for (u32 p = 0; p < n; ++p) {
        if (p != rank) add_release(flag_blocks[p] + 8ull * (n + rank), share);
    }
    if (blockIdx.x != 0) return;
    for (u32 p = 0; p < n; ++p) {
        if (p != rank) wait_at_least(mine + 8ull * (n + p), epoch * DEPARTURE_UNITS);
    }
}

// A pause in a stream that uses no SM to speak of: one warp that sleeps (nanosleep, so it issues
// almost nothing and fits beside a resident block of other work) until `ns` nanoseconds after it
// started. Paces copy-engine copies queued around it (src/exec/batch.rs).
extern "C" __global__ void refit_pause(u64 ns) {
    u64 start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(2000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
#endif
#endif  // REFIT_COPY_TILES_ONLY
