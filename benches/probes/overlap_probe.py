"""Why does a copy beside a bf16 GEMM on the same GPU slow the GEMM more than its share of memory
bandwidth, and which launch shape moves the most bytes at a given GEMM slowdown?

A cuBLAS 8192^3 bf16 GEMM loop runs on one stream; beside it, on another, one of:
- a spin kernel of B blocks that holds SMs and moves nothing, with no shared memory or with enough
  shared memory that a GEMM block cannot share its SM: does holding SMs alone cost the GEMM?
- a plain grid-stride copy kernel (16-byte vectors) of B blocks of T threads, with or without shared
  memory reserved: GB/s of payload against the GEMM's slowdown, per launch shape.
It also prints the registers per thread of refit's batched copy kernels (compiled here from
src/kernels/batched_copy.cu), which set how many of their blocks fit beside a GEMM block.
Writes $REFIT_BENCH_RESULTS/overlap_probe.json.
"""

import os

import cupy as cp
import torch

from probe_util import SPIN, print_table, write_results
from side_by_side import beside, gemm_load

GIB = 1 << 30
COPY = cp.RawKernel(
    r"""
struct __align__(16) V16 { unsigned long long lo, hi; };
extern "C" __global__ void copy16(const V16* __restrict__ s, V16* __restrict__ d, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        d[i] = s[i];
}
""",
    "copy16",
)


def refit_registers():
    """Registers per thread of refit's kernels, compiled as refit compiles them (NVRTC, this GPU)."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "src", "kernels", "batched_copy.cu")
    with open(path) as f:
        module = cp.RawModule(code=f.read(), options=("--std=c++17",))
    out = {}
    for name in ("refit_batched_copy", "refit_batched_copy_digest", "refit_batched_check"):
        try:
            out[name] = module.get_function(name).num_regs
        except Exception as err:  # a name this revision does not have
            out[name] = str(err)
    return out


def main():
    torch.cuda.init()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    src = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side_cp = cp.cuda.ExternalStream(side.cuda_stream)
    vectors = src.numel() // 16
    max_smem = cp.cuda.runtime.getDeviceProperties(0)["sharedMemPerBlockOptin"]

    gemm = gemm_load()

    def launch(kind, blocks, threads, smem):
        if kind == "copy":
            COPY((blocks,), (threads,), (src.data_ptr(), dst.data_ptr(), cp.int64(vectors)),
                 stream=side_cp, shared_mem=smem)
        else:
            SPIN((blocks,), (threads,), (cp.int64(20_000_000),), stream=side_cp, shared_mem=smem)

    def copy_alone_ms(blocks, threads, smem):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        launch("copy", blocks, threads, smem)
        start.record(side)
        for _ in range(3):
            launch("copy", blocks, threads, smem)
        stop.record(side)
        stop.synchronize()
        return start.elapsed_time(stop) / 3

    rows = []
    variants = [("hold", 4, 256, 0), ("hold", 33, 256, 0), ("hold", 4, 256, max_smem), ("hold", 33, 256, max_smem)]
    for threads in (64, 128, 256, 512):
        for blocks in (4, 16, 33, 48, 66, 132):
            variants.append(("copy", blocks, threads, 0))
    variants += [("copy", 33, 256, max_smem), ("copy", 66, 256, max_smem)]
    window_ms = 400.0
    for kind, blocks, threads, smem in variants:
        if smem:
            for k in (COPY, SPIN):
                k.max_dynamic_shared_size_bytes = smem
        per_launch = copy_alone_ms(blocks, threads, smem) if kind == "copy" else 20_000_000 / 1.98e6
        step_bytes = src.numel() if kind == "copy" else 0
        m = beside(gemm, side, per_launch, step_bytes, lambda: launch(kind, blocks, threads, smem), window_ms)
        row = {"kind": kind, "blocks": blocks, "threads": threads, "smem": smem, "gemm_baseline_ms": m["baseline_ms"],
               "gemm_slowdown": m["slowdown"], "beside_gbps_is_bound": m["gbps_bound"]}
        if kind == "copy":
            row["alone_gbps"] = src.numel() / (per_launch * 1e6)
            row["beside_gbps"] = m["gbps"]
        rows.append(row)
        print(row, flush=True)
    regs = refit_registers()
    print(f"\noverlap_probe: {sms} SMs, GEMM alone {gemm.short_ms:.3f} ms, refit kernels' registers per thread {regs}")
    print_table(["kind", "blocks", "threads", "smem", "GB/s payload alone", "beside GEMM", "GEMM slowdown"],
                [[r["kind"], r["blocks"], r["threads"], r["smem"], f"{r.get('alone_gbps', 0):.0f}",
                  f"{r.get('beside_gbps', 0):.0f}", f"{100 * r['gemm_slowdown']:.1f}%"] for r in rows])
    write_results("overlap_probe", {"probe": "overlap_probe", "device": torch.cuda.get_device_name(0),
                                    "gemm_alone_ms": gemm.short_ms, "refit_registers": regs, "rows": rows})


if __name__ == "__main__":
    main()
