"""Does a copy-engine copy slowed to a fixed rate cost a bf16 GEMM beside it only its share of memory
bandwidth?

bulk_overlap_probe.py found that every copy block costs the GEMM (cuBLAS's persistent nvjet) a whole
SM, and that the copy engine at full speed slows it 65-75% through memory bandwidth alone. A copy
engine uses no SMs, so a copy engine held to a rate would cost the GEMM only the bandwidth it takes,
if that cost grows with the rate rather than appearing at once. Beside the same 8192^3 bf16 GEMM
loop, a side stream copies 4 GiB in chunks of C bytes (one cudaMemcpyAsync each, device to device),
each chunk followed by a pause: a one-warp kernel that sleeps (nanosleep, so it issues almost
nothing) until d microseconds after it started. Per (C, d): GB/s of payload beside the GEMM and the
GEMM's slowdown; and the pause kernel alone, to price the pacing itself.
Writes $REFIT_BENCH_RESULTS/paced_copy_probe.json.
"""

import cupy as cp
import torch

from probe_util import print_table, write_results
from side_by_side import beside, gemm_load

MIB = 1 << 20
PAUSE = cp.RawKernel(
    r"""
extern "C" __global__ void pause(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(2000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
""",
    "pause",
)


def main():
    torch.cuda.init()
    size = 4 << 30
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    src.random_(0, 256)
    side = torch.cuda.Stream()
    side_cp = cp.cuda.ExternalStream(side.cuda_stream)

    def paced_pass(chunk, pause_us, copy=True):
        """One pass over the 4 GiB on the side stream: chunk copies, each followed by a pause."""
        with torch.cuda.stream(side):
            for off in range(0, size, chunk):
                if copy:
                    dst[off:off + chunk].copy_(src[off:off + chunk])
                if pause_us:
                    PAUSE((1,), (32,), (cp.uint64(int(pause_us * 1000)),), stream=side_cp)

    gemm = gemm_load()

    dst.zero_()
    paced_pass(64 * MIB, 20)
    torch.cuda.synchronize()
    exact = bool(torch.equal(src, dst))
    print(f"paced_copy_probe: GEMM alone {gemm.short_ms:.3f} ms; paced copy byte-exact: {exact}", flush=True)

    rows = []
    variants = [(64 * MIB, 0, True)]
    for chunk in (16 * MIB, 64 * MIB):
        # A 64 MiB chunk takes about 32 us at full speed: pauses of 0.5x .. 8x that.
        for pause in (16, 32, 64, 128, 256):
            variants.append((chunk, pause * chunk // (64 * MIB), True))
    variants.append((64 * MIB, 64, False))  # the pauses alone
    for chunk, pause_us, copy in variants:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(side)
        paced_pass(chunk, pause_us, copy)
        stop.record(side)
        stop.synchronize()
        pass_ms = start.elapsed_time(stop)
        m = beside(gemm, side, pass_ms, size if copy else 0, lambda: paced_pass(chunk, pause_us, copy), window_ms=400)
        row = {"chunk": chunk, "pause_us": pause_us, "copies": copy,
               "alone_gbps": size / (pass_ms * 1e6) if copy else 0.0, "beside_gbps": m["gbps"] if copy else 0.0,
               "beside_gbps_is_bound": m["gbps_bound"], "gemm_baseline_ms": m["baseline_ms"],
               "gemm_slowdown": m["slowdown"]}
        rows.append(row)
        print(row, flush=True)
    print_table(["chunk", "pause us", "GB/s payload alone", "beside GEMM", "GEMM slowdown"],
                [[f"{r['chunk'] >> 20} MiB" if r["copies"] else "pauses only", r["pause_us"],
                  f"{r['alone_gbps']:.0f}", f"{r['beside_gbps']:.0f}", f"{100 * r['gemm_slowdown']:.1f}%"]
                 for r in rows])
    write_results("paced_copy_probe", {"probe": "paced_copy_probe", "device": torch.cuda.get_device_name(0),
                                       "gemm_alone_ms": gemm.short_ms, "paced_copy_exact": exact, "rows": rows})


if __name__ == "__main__":
    main()
