"""What holds same-device copy-engine copies in lockstep with a bf16 GEMM's kernels?

Beside cuBLAS's 8192^3 bf16 GEMM, 64 MiB copies run at full speed except every third, which waits
a GEMM's time (ce_beside_load_probe), while beside a kernel that holds every SM they run freely. The
GEMM (nvjet) launches in clusters of two and loads through TMA. Here the same timeline of copies
runs beside loads that differ in one of those at a time:
- a kernel holding every SM for 1 ms, launched without clusters, and the same in clusters of two;
- every SM re-reading a buffer that fits in L2, and a product that streams its weight from HBM;
- an fp32 GEMM with TF32 off (cuBLAS's SIMT kernels, no clusters, no TMA);
- the bf16 GEMM itself (the control).
Per load: the copies' times (median, p90), their rate, and the load's time per call.
Writes $REFIT_BENCH_RESULTS/lockstep_probe.json.
"""

import cupy as cp
import torch

from ce_beside_load_probe import REREAD, bf16_gemm, timeline
from probe_util import MIB, print_table, write_results

SOURCE = r"""
typedef unsigned long long u64;
__device__ __forceinline__ void hold_for(u64 ns) {
    u64 start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
extern "C" __global__ void hold(u64 ns) { hold_for(ns); }
extern "C" __global__ void __cluster_dims__(2, 1, 1) hold_clustered(u64 ns) { hold_for(ns); }
"""


def holding(name, sms, smem):
    """Every SM held 1 ms per call by one block each (the shared memory keeps other blocks off)."""
    kernel = cp.RawKernel(SOURCE, name, options=("--std=c++17",))
    kernel.max_dynamic_shared_size_bytes = smem

    def call():
        stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        kernel((sms,), (1024,), (cp.uint64(1_000_000),), stream=stream, shared_mem=smem)
    return call


def l2_reread(sms):
    """Every SM re-reading a 24 MiB buffer (it fits in L2) 300 times: memory traffic, no HBM."""
    buf = torch.empty(24 * MIB, dtype=torch.uint8, device="cuda")
    sink = torch.zeros(1, dtype=torch.int64, device="cuda")

    def call():
        stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        REREAD((2 * sms,), (1024,), (buf.data_ptr(), cp.int64(buf.numel() // 16), cp.int32(300), sink.data_ptr()),
               stream=stream)
    return call


def hbm_read():
    """A bf16 16 x 8192 by 8192 x 28672 product: it streams a 470 MB weight from HBM per call."""
    x, w, y = (torch.randn(*shape, dtype=torch.bfloat16, device="cuda") for shape in ((16, 8192), (8192, 28672), (16, 28672)))
    return lambda: torch.matmul(x, w, out=y)


def fp32_gemm():
    """A 4096^3 fp32 GEMM with TF32 off: cuBLAS's SIMT kernels."""
    torch.backends.cuda.matmul.allow_tf32 = False
    a, b, c = (torch.randn(4096, 4096, dtype=torch.float32, device="cuda") for _ in range(3))
    return lambda: torch.matmul(a, b, out=c)


def main():
    torch.cuda.init()
    props = cp.cuda.runtime.getDeviceProperties(0)
    sms, smem = props["multiProcessorCount"], props["sharedMemPerBlockOptin"]
    step = 2 << 30
    src = torch.randint(0, 255, (step,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(step, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    loads = [("hold every SM 1 ms, no clusters", holding("hold", sms, smem)),
             ("hold every SM 1 ms, clusters of 2", holding("hold_clustered", sms, smem)),
             ("re-read a 24 MiB buffer from L2, every SM", l2_reread(sms)),
             ("bf16 16x8192 by 8192x28672 (streams HBM)", hbm_read()),
             ("fp32 GEMM 4096^3, TF32 off", fp32_gemm()),
             ("bf16 GEMM 8192^3 (control)", bf16_gemm())]
    rows = []
    for name, call in loads:
        line = timeline(src, dst, side, call)
        rows.append({"load": name, "load_ms_per_call": line["gemm_ms_during"] or line["gemm_ms_before"],
                     "piece_ms_p50": line["piece_ms_p50"], "piece_ms_p90": line["piece_ms_p90"],
                     "piece_ms_max": line["piece_ms_max"], "copies_gbps": line["copies_gbps"],
                     "piece_ms": line["piece_ms"]})
    torch.cuda.synchronize()
    print(f"\nlockstep_probe: 64 MiB copies beside each load, {torch.cuda.get_device_name(0)}")
    print_table(["load", "load ms per call", "copy ms median", "p90", "max", "copies GB/s"],
                [[r["load"], f"{r['load_ms_per_call'] or 0:.3f}", f"{r['piece_ms_p50']:.3f}", f"{r['piece_ms_p90']:.3f}",
                  f"{r['piece_ms_max']:.3f}", f"{r['copies_gbps']:.0f}"] for r in rows])
    write_results("lockstep_probe", {"probe": "lockstep_probe", "device": torch.cuda.get_device_name(0),
                                     "piece_bytes": 64 << 20, "rows": rows})


if __name__ == "__main__":
    main()
