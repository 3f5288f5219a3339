"""Can a same-device copy beside a bf16 GEMM move 600 GB/s of payload with the GEMM at most 10% slower?

overlap_probe.py found that a copy block keeps a GEMM block off its SM, so every SM a copy holds costs
the GEMM that SM, and that register-bound copy kernels move about 15-50 GB/s of payload per SM. This
probe asks two further questions, beside the same cuBLAS 8192^3 bf16 GEMM loop:
1. Which blocks can share an SM with a GEMM block? Spin kernels of one warp per block on every SM,
   with 0 .. 32 KiB of shared memory: the GEMM's slowdown says whether they displaced it.
2. How much does one SM move when the copy needs no registers in flight: TMA bulk copies
   (cp.async.bulk, global -> shared -> global) by one thread, through a ring of stages in shared
   memory. Per block count (one block per SM, forced by its shared memory), GB/s of payload alone and
   beside the GEMM, and the GEMM's slowdown; and small rings on one warp per SM on every SM.
Writes $REFIT_BENCH_RESULTS/bulk_overlap_probe.json.
"""

import cupy as cp
import torch

from probe_util import print_table, write_results
from side_by_side import beside, gemm_load

GIB = 1 << 30
SOURCE = r"""
typedef unsigned long long u64;
typedef unsigned int u32;

extern "C" __global__ void hold(long long cycles) {
    extern __shared__ unsigned char unused[];
    long long start = clock64();
    while (clock64() - start < cycles) {}
    if (cycles < 0) unused[threadIdx.x] = 1;
}

__device__ __forceinline__ u32 smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Block b copies chunks b, b + grid, ... of `chunk` bytes; thread 0 alone drives a ring of `stages`
// buffers: loads run ahead, and a stage is reloaded once fewer than `writes` stores still read it.
extern "C" __global__ void bulk_copy(const char* src, char* dst, u64 nchunks, u32 chunk, u32 stages, u32 writes) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ __align__(8) u64 bars[64];
    if (threadIdx.x != 0) return;
    for (u32 s = 0; s < stages; ++s)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem(&bars[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    const u64 mine = nchunks > blockIdx.x ? (nchunks - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    auto load = [&](u64 k) {
        const u32 s = (u32)(k % stages);
        const u64 c = blockIdx.x + k * gridDim.x;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem(&bars[s])), "r"(chunk)
                     : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(smem(ring + (u64)s * chunk)), "l"(src + c * chunk), "r"(chunk), "r"(smem(&bars[s]))
                     : "memory");
    };
    for (u64 k = 0; k < mine && k < stages; ++k) load(k);
    for (u64 k = 0; k < mine; ++k) {
        const u32 s = (u32)(k % stages);
        const u32 parity = (u32)((k / stages) & 1);
        u32 done = 0;
        while (!done) {
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(smem(&bars[s])), "r"(parity) : "memory");
        }
        const u64 c = blockIdx.x + k * gridDim.x;
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     ::"l"(dst + c * chunk), "r"(smem(ring + (u64)s * chunk)), "r"(chunk) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        // Stores up to k - writes have read their stage: reload it with the chunk `stages` later.
        if (writes == 1) asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
        else if (writes == 2) asm volatile("cp.async.bulk.wait_group.read 2;" ::: "memory");
        else asm volatile("cp.async.bulk.wait_group.read 4;" ::: "memory");
        const u32 w = writes == 1 ? 1 : writes == 2 ? 2 : 4;
        if (k >= w && k - w + stages < mine) load(k - w + stages);
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""


def main():
    torch.cuda.init()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    mod = cp.RawModule(code=SOURCE, options=("--std=c++17",))
    hold, bulk = mod.get_function("hold"), mod.get_function("bulk_copy")
    max_smem = cp.cuda.runtime.getDeviceProperties(0)["sharedMemPerBlockOptin"]
    for k in (hold, bulk):  # the bulk kernel's barriers take static shared memory from the same limit
        k.max_dynamic_shared_size_bytes = max_smem - 1024
    size = 4 * GIB
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    src.random_(0, 256)
    side = torch.cuda.Stream()
    side_cp = cp.cuda.ExternalStream(side.cuda_stream)

    gemm = gemm_load()

    def launch(v):
        if v["kind"] == "hold":
            hold((v["blocks"],), (v["threads"],), (cp.int64(20_000_000),), stream=side_cp, shared_mem=v["smem"])
        else:
            n = size // v["chunk"]
            bulk((v["blocks"],), (32,), (src.data_ptr(), dst.data_ptr(), cp.uint64(n), cp.uint32(v["chunk"]),
                                         cp.uint32(v["stages"]), cp.uint32(v["writes"])),
                 stream=side_cp, shared_mem=v["stages"] * v["chunk"])

    def alone_ms(v):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        launch(v)
        start.record(side)
        for _ in range(3):
            launch(v)
        stop.record(side)
        stop.synchronize()
        return start.elapsed_time(stop) / 3

    variants = [{"kind": "hold", "blocks": sms, "threads": 32, "smem": sm} for sm in (0, 8 << 10, 16 << 10, 32 << 10)]
    variants += [{"kind": "hold", "blocks": sms, "threads": 128, "smem": 0}]
    for blocks in (2, 4, 6, 8, 12, 16, 24, 33):
        variants.append({"kind": "bulk", "blocks": blocks, "chunk": 16 << 10, "stages": 12, "writes": 4})
    for chunk, stages, writes in ((32 << 10, 6, 2), (8 << 10, 24, 4), (4 << 10, 48, 4)):
        variants.append({"kind": "bulk", "blocks": 8, "chunk": chunk, "stages": stages, "writes": writes})
    for chunk, stages, writes in ((4 << 10, 4, 2), (8 << 10, 2, 1), (8 << 10, 4, 2), (16 << 10, 2, 1)):
        variants.append({"kind": "bulk", "blocks": sms, "chunk": chunk, "stages": stages, "writes": writes})

    # Correctness of the bulk copy before any timing.
    check = {"kind": "bulk", "blocks": 7, "chunk": 16 << 10, "stages": 12, "writes": 4}
    dst.zero_()
    launch(check)
    torch.cuda.synchronize()
    exact = bool(torch.equal(src, dst))
    print(f"bulk_overlap_probe: {sms} SMs, GEMM alone {gemm.short_ms:.3f} ms; bulk copy byte-exact: {exact}",
          flush=True)

    rows = []
    window_ms = 400.0
    for v in variants:
        per_launch = alone_ms(v) if v["kind"] == "bulk" else 20_000_000 / 1.98e6
        step_bytes = size if v["kind"] == "bulk" else 0
        m = beside(gemm, side, per_launch, step_bytes, lambda: launch(v), window_ms)
        row = dict(v, gemm_baseline_ms=m["baseline_ms"], gemm_slowdown=m["slowdown"],
                   beside_gbps_is_bound=m["gbps_bound"])
        if v["kind"] == "bulk":
            row["alone_gbps"] = size / (per_launch * 1e6)
            row["beside_gbps"] = m["gbps"]
        rows.append(row)
        print(row, flush=True)
    def ring(r):
        if r["kind"] == "bulk":
            return f"{r['stages']} x {r['chunk'] >> 10} KiB, {r['writes']} stores"
        return f"{r['smem'] >> 10} KiB smem"

    print_table(["kind", "blocks x threads", "ring", "GB/s payload alone", "beside GEMM", "GEMM slowdown"],
                [[r["kind"], f"{r['blocks']} x {r.get('threads', 32)}", ring(r), f"{r.get('alone_gbps', 0):.0f}",
                  f"{r.get('beside_gbps', 0):.0f}", f"{100 * r['gemm_slowdown']:.1f}%"] for r in rows])
    write_results("bulk_overlap_probe", {"probe": "bulk_overlap_probe", "device": torch.cuda.get_device_name(0),
                                         "gemm_alone_ms": gemm.short_ms, "bulk_copy_exact": exact, "rows": rows})


if __name__ == "__main__":
    main()
