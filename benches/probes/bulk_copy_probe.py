"""Can an SM kernel copy within one GPU's memory as fast as the copy engine does (about 2,124 GB/s of
payload on an H200), where refit's batched kernel reaches about 1,945 (benches/results/gpu_sweep.json)?
Issue 29 asks AUTO for 0.95 of one large copy at every run size from 64 KiB, and below 256 MiB runs
only the kernel is fast enough per run.

Over one contiguous buffer (2 GiB and 8 GiB), in the same run:
- the ceiling: one `cudaMemcpyAsync` of the whole buffer (what torch's `copy_` issues);
- refit's kernel as it is (src/kernels/batched_copy.cu), in 64 KiB tiles;
- a plain grid-stride copy of 16-byte vectors with 4 or 8 loads in flight per lane;
- TMA bulk copies (`cp.async.bulk`, global -> shared -> global): one thread per block moves chunks
  through a ring of shared-memory stages, waiting for a chunk's load on its mbarrier and refilling a
  stage once the store that drained it has read it; several chunk sizes, stage counts and blocks
  per SM.
Each variant's destination is compared with the source byte for byte. Writes
$REFIT_BENCH_RESULTS/bulk_copy_probe.json.
"""

import cupy as cp
import numpy as np
import torch

from probe_util import median_ms, print_table, refit_source, write_results

GIB = 1 << 30
KIB = 1 << 10

PLAIN = r"""
struct __align__(16) V { unsigned long long lo, hi; };
template <int U>
__device__ void copy(const V* __restrict__ s, V* __restrict__ d, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    for (; i + (U - 1) * stride < n; i += U * stride) {
        V v[U];
#pragma unroll
        for (int k = 0; k < U; ++k) v[k] = s[i + k * stride];
#pragma unroll
        for (int k = 0; k < U; ++k) d[i + k * stride] = v[k];
    }
    for (; i < n; i += stride) d[i] = s[i];
}
extern "C" __global__ void __launch_bounds__(256) plain4(const V* s, V* d, long long n) { copy<4>(s, d, n); }
extern "C" __global__ void __launch_bounds__(256) plain8(const V* s, V* d, long long n) { copy<8>(s, d, n); }
"""

# One thread per block drives a ring of `stages` shared-memory buffers of `chunk` bytes. Chunk i of
# this block is blockIdx.x + i * gridDim.x. Loads complete on the stage's mbarrier (expect_tx);
# stores are bulk groups, and a stage is refilled once the store that drained it has read it
# (wait_group.read 1 after the next store is issued, so one store stays in flight).
BULK = r"""
typedef unsigned long long u64;
typedef unsigned int u32;
extern "C" __global__ void __launch_bounds__(32) bulk(const char* __restrict__ src, char* __restrict__ dst,
                                                      u64 chunks, u32 chunk, u32 stages) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ __align__(8) u64 bars[16];
    if (threadIdx.x != 0) return;
    const u32 sring = (u32)__cvta_generic_to_shared(ring);
    const u32 sbar = (u32)__cvta_generic_to_shared(bars);
    for (u32 s = 0; s < stages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sbar + 8 * s));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    const u64 mine = chunks > blockIdx.x ? (chunks - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    for (u64 i = 0; i < stages && i < mine; ++i) {
        const u32 s = (u32)i;
        const u64 c = blockIdx.x + i * gridDim.x;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sbar + 8 * s), "r"(chunk) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(sring + s * chunk), "l"(src + c * chunk), "r"(chunk), "r"(sbar + 8 * s) : "memory");
    }
    for (u64 i = 0; i < mine; ++i) {
        const u32 s = (u32)(i % stages);
        const u32 parity = (u32)((i / stages) & 1);
        asm volatile("{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                     " @!p bra WAIT_%=;\n}" ::"r"(sbar + 8 * s), "r"(parity) : "memory");
        const u64 c = blockIdx.x + i * gridDim.x;
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     ::"l"(dst + c * chunk), "r"(sring + s * chunk), "r"(chunk) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        // Refill the stage of chunk i - 1 with chunk i - 1 + stages once its store has read it.
        if (i >= 1 && i - 1 + stages < mine) {
            asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
            const u64 j = i - 1 + stages;
            const u32 t = (u32)((i - 1) % stages);
            const u64 cj = blockIdx.x + j * gridDim.x;
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sbar + 8 * t), "r"(chunk) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         ::"r"(sring + t * chunk), "l"(src + cj * chunk), "r"(chunk), "r"(sbar + 8 * t) : "memory");
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""




def main():
    torch.cuda.init()
    sms = cp.cuda.Device(0).attributes["MultiProcessorCount"]
    plain = cp.RawModule(code=PLAIN, options=("--std=c++17",))
    bulk = cp.RawKernel(BULK, "bulk", options=("--std=c++17",))
    bulk.max_dynamic_shared_size_bytes = 200 * KIB
    refit = cp.RawModule(code=refit_source("batched_copy.cu"), options=("--std=c++17",)).get_function(
        "refit_batched_copy")
    rows = []
    for payload in (2 * GIB, 8 * GIB):
        src = torch.empty(payload, dtype=torch.uint8, device="cuda")
        dst = torch.empty(payload, dtype=torch.uint8, device="cuda")
        src.random_(0, 256)

        def exact():
            ok = bool(torch.equal(src, dst))
            dst.zero_()
            return ok

        ceiling = median_ms(lambda: dst.copy_(src))
        ceiling_gbps = payload / ceiling / 1e6
        exact()

        def add(name, ms, ok, **extra):
            rows.append({"payload": payload, "variant": name, "ms": ms, "gbps": payload / ms / 1e6,
                         "vs_copy_engine": ceiling / ms, "exact": ok, **extra})
            print(rows[-1], flush=True)

        add("cudaMemcpyAsync (copy_)", ceiling, True)
        tile_shift = 16
        tiles = payload >> tile_shift
        d = np.zeros((2, 12), dtype=np.uint64)
        d[0] = [src.data_ptr(), dst.data_ptr(), payload, 1, 0, 0, 0, 0, 1, 0, tiles, 1]
        d[1, 9] = tiles
        descs = cp.asarray(d)
        args = (descs.data.ptr, cp.uint64(1), cp.uint64(tiles), cp.uint32(tile_shift), cp.uint32(5))
        ms = median_ms(lambda: refit((sms * 3,), (256,), args))
        add("refit kernel, 64 KiB tiles", ms, exact())
        n = cp.int64(payload // 16)
        for name, per_sm in (("plain4", 4), ("plain8", 2), ("plain8", 4)):
            fn = plain.get_function(name)
            ms = median_ms(lambda: fn((sms * per_sm,), (256,), (src.data_ptr(), dst.data_ptr(), n)))
            add(f"{name}, {per_sm} blocks/SM", ms, exact())
        for chunk_kib, stages, per_sm in ((16, 4, 3), (16, 6, 2), (32, 3, 2), (32, 6, 1), (64, 3, 1),
                                          (8, 8, 3), (16, 12, 1), (4, 16, 3)):
            chunk = chunk_kib * KIB
            smem = chunk * stages
            ms = median_ms(lambda: bulk((sms * per_sm,), (32,), (src.data_ptr(), dst.data_ptr(),
                                        cp.uint64(payload // chunk), cp.uint32(chunk), cp.uint32(stages)),
                                        shared_mem=smem))
            add(f"bulk {chunk_kib} KiB x {stages} stages, {per_sm} blocks/SM", ms, exact(),
                chunk=chunk, stages=stages, blocks_per_sm=per_sm)
        del src, dst
        torch.cuda.empty_cache()
        print_table(["variant", f"{payload / GIB:.0f} GiB ms", "GB/s", "vs one cudaMemcpy", "byte-exact"],
                    [[r["variant"], f"{r['ms']:.3f}", f"{r['gbps']:.0f}", f"{r['vs_copy_engine']:.3f}", r["exact"]]
                     for r in rows if r["payload"] == payload])
        print(f"(one cudaMemcpy: {ceiling_gbps:.0f} GB/s)")
    write_results("bulk_copy_probe", {"probe": "bulk_copy_probe", "sms": sms, "rows": rows})


if __name__ == "__main__":
    main()
