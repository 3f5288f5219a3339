"""Probe: how fast can SMs push bytes into the peer GPU over NVLink, against the copy engine?

GPU0 -> GPU1 alone and both directions at once (as in a 2-GPU allgather or refit), 64 and 256 MiB
per direction, back to back on non-blocking streams, GPU-timed after a spin gate:
- the copy engine (cudaMemcpyPeerAsync issued by the sender): the reference;
- a plain kernel: every thread loads `unroll` 16-byte words of the local source, then stores them
  into the peer's memory (the access pattern of refit's batched copy kernel);
- a bulk-copy (TMA) kernel: one thread per block moves `chunk`-byte pieces through shared memory
  with cp.async.bulk (local global -> shared, then shared -> the peer's global), `stages` pieces in
  flight per block.
Every variant's destination is checked byte for byte. Prints a markdown table of GB/s per
direction; JSON to $REFIT_BENCH_RESULTS/sm_push_probe.json.
"""


import cupy as cp
from cupy.cuda import runtime as rt
from probe_util import MIB, enable_peers, timed, write_results

SOURCE = r"""
typedef unsigned long long u64;
typedef unsigned int u32;

template <int UNROLL>
__device__ void push_words(const int4* __restrict__ src, int4* __restrict__ dst, u64 words) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + (UNROLL - 1) * stride < words; i += UNROLL * stride) {
        int4 v[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) v[k] = src[i + k * stride];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) dst[i + k * stride] = v[k];
    }
    for (; i < words; i += stride) dst[i] = src[i];
}

extern "C" __global__ void push_plain1(const int4* src, int4* dst, u64 words) { push_words<1>(src, dst, words); }
extern "C" __global__ void push_plain4(const int4* src, int4* dst, u64 words) { push_words<4>(src, dst, words); }
extern "C" __global__ void push_plain8(const int4* src, int4* dst, u64 words) { push_words<8>(src, dst, words); }

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void wait_parity(u32 bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
}

__device__ __forceinline__ void load_piece(u32 buf, const char* src, u32 bytes, u32 bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(buf), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Pieces c = blockIdx.x, blockIdx.x + gridDim.x, ... of `bytes` (a multiple of `chunk`, itself a
// multiple of 16): loaded `stages` ahead into shared memory, stored into the peer as they arrive.
extern "C" __global__ void push_bulk(const char* src, char* dst, u64 bytes, u32 chunk, u32 stages) {
    extern __shared__ __align__(128) unsigned char buffers[];
    __shared__ __align__(8) u64 bars[8];
    if (threadIdx.x != 0) return;
    for (u32 s = 0; s < stages; ++s) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&bars[s])) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    const u64 pieces = bytes / chunk;
    const u64 mine = pieces > blockIdx.x ? (pieces - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    auto piece = [&](u64 i) { return (blockIdx.x + i * gridDim.x) * (u64)chunk; };
    for (u64 i = 0; i < mine && i < stages; ++i) {
        load_piece(smem_addr(buffers + i * chunk), src + piece(i), chunk, smem_addr(&bars[i]));
    }
    for (u64 i = 0; i < mine; ++i) {
        const u32 s = i % stages;
        wait_parity(smem_addr(&bars[s]), (u32)((i / stages) & 1));
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     :: "l"(dst + piece(i)), "r"(smem_addr(buffers + s * chunk)), "r"(chunk) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        // Refill the previous piece's buffer once its store has read it (this one may still run).
        if (i >= 1 && i - 1 + stages < mine) {
            const u32 p = (i - 1) % stages;
            asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
            load_piece(smem_addr(buffers + p * chunk), src + piece(i - 1 + stages), chunk, smem_addr(&bars[p]));
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""


class Side:
    def __init__(self, device, size):
        self.device = device
        with cp.cuda.Device(device):
            self.module = cp.RawModule(code=SOURCE, options=("-std=c++17",))
            self.src = cp.random.randint(0, 256, size, dtype=cp.uint8)
            self.dst = cp.zeros(size, dtype=cp.uint8)
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.sms = cp.cuda.Device(device).attributes["MultiProcessorCount"]

    def fn(self, name):
        return self.module.get_function(name)


def issue(sides, src, dst, size, variant):
    a, b = sides[src], sides[dst]
    kind = variant[0]
    with cp.cuda.Device(a.device):
        if kind == "ce":
            rt.memcpyPeerAsync(b.dst.data.ptr, b.device, a.src.data.ptr, a.device, size, a.stream.ptr)
        elif kind == "plain":
            _, unroll, blocks_per_sm, threads = variant
            a.fn(f"push_plain{unroll}")(
                (a.sms * blocks_per_sm,), (threads,), (a.src.data.ptr, b.dst.data.ptr, cp.uint64(size // 16)),
                stream=a.stream,
            )
        else:
            _, chunk, stages, blocks_per_sm = variant
            f = a.fn("push_bulk")
            smem = chunk * stages
            f.max_dynamic_shared_size_bytes = smem
            f(
                (a.sms * blocks_per_sm,), (32,),
                (a.src.data.ptr, b.dst.data.ptr, cp.uint64(size), cp.uint32(chunk), cp.uint32(stages)),
                stream=a.stream, shared_mem=smem,
            )


def measure(sides, directions, size, variant, iters):
    """GB/s per direction of `iters` iterations back to back, timed on the senders' streams."""
    streams = [(s, sides[s].stream) for s in sorted({s for s, _ in directions})]

    def batch():
        for _ in range(iters):
            for s, t in directions:
                issue(sides, s, t, size, variant)

    return size * iters / timed(streams, batch) / 1e9


def name(variant):
    if variant[0] == "ce":
        return "copy engine"
    if variant[0] == "plain":
        _, unroll, per_sm, threads = variant
        return f"plain kernel, {unroll} x 16 B in flight per thread, {per_sm} x {threads} threads per SM"
    _, chunk, stages, per_sm = variant
    return f"bulk copy (TMA), {chunk >> 10} KiB pieces, {stages} in flight, {per_sm} block(s) per SM"


def main():
    if rt.getDeviceCount() < 2:
        print("sm_push_probe: needs two GPUs")
        return
    enable_peers()
    top = 256 * MIB
    sides = [Side(0, top), Side(1, top)]
    variants = [("ce",)]
    variants += [("plain", u, per_sm, 512) for u in (1, 4, 8) for per_sm in (2, 4)]
    variants += [("bulk", c << 10, st, per_sm) for c, st, per_sm in [
        (16, 4, 1), (16, 4, 2), (32, 4, 1), (32, 3, 2), (64, 3, 1), (8, 8, 2), (16, 8, 1),
    ]]
    rows = []
    for both in (True, False):
        directions = [(0, 1), (1, 0)] if both else [(0, 1)]
        for size in (64 * MIB, 256 * MIB):
            iters = max(5, min(40, 4096 * MIB // size))
            for variant in variants:
                for _, t in directions:
                    with cp.cuda.Device(t):
                        sides[t].dst.fill(0)
                gbps = measure(sides, directions, size, variant, iters)
                for s, t in directions:
                    with cp.cuda.Device(t):
                        ok = bool((sides[t].dst[:size] == cp.asarray(sides[s].src[:size].get())).all())
                    assert ok, f"{name(variant)}: GPU{s} -> GPU{t} bytes differ"
                rows.append({"directions": "both" if both else "0->1", "size_mib": size // MIB,
                             "variant": name(variant), "gbps_per_direction": round(gbps, 1)})
    keyed = {}
    for r in rows:
        keyed.setdefault(r["variant"], {})[(r["directions"], r["size_mib"])] = r["gbps_per_direction"]
    cols = [("both", 64), ("both", 256), ("0->1", 64), ("0->1", 256)]
    print("| variant (GB/s per direction, all bytes checked) | both, 64 MiB | both, 256 MiB | one way, 64 MiB | one way, 256 MiB |")
    print("| --- | --- | --- | --- | --- |")
    for v, by in keyed.items():
        print(f"| {v} | " + " | ".join(f"{by[c]:.1f}" for c in cols) + " |")
    write_results("sm_push_probe", {"rows": rows})


if __name__ == "__main__":
    main()
