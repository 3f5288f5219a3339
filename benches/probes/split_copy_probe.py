"""Does the copy engine running beside refit's kernel, each on its own share of a batch, copy within one
GPU faster than either alone? Issue 29 asks AUTO for 0.95 of one large copy at every run size from
64 KiB; no SM kernel variant passes 0.94 (bulk_copy_probe), and the copy engine alone needs runs of
256 MiB (gpu_sweep). A split stage today queues its copy-engine copies and then the kernel on one
stream, one after the other.

For runs of 64 KiB to 64 MiB (2 GiB in all), in one run: the kernel copies the first (1 - f) of the
bytes (one launch, 64 KiB tiles) on one stream while the copy engine copies the rest, one
`cudaMemcpyAsync` per run, on a second stream, both started together behind a spin kernel (so the host
issuing the copies is not what is timed); f from 0 (the kernel alone) to 1 (the copy engine alone).
Beside them, one `cudaMemcpyAsync` of the whole 2 GiB. Every byte is compared with the source after
each configuration. Writes $REFIT_BENCH_RESULTS/split_copy_probe.json.
"""

import cupy as cp
import numpy as np
import torch
from cupy.cuda import runtime as rt

from probe_util import print_table, refit_source, timed, write_results

GIB = 1 << 30
KIB = 1 << 10
MIB = 1 << 20
PAYLOAD = 2 * GIB
SHARES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 1.0)



def main():
    torch.cuda.init()
    sms = cp.cuda.Device(0).attributes["MultiProcessorCount"]
    kernel = cp.RawModule(code=refit_source("batched_copy.cu"), options=("--std=c++17",)).get_function(
        "refit_batched_copy")
    src = torch.empty(PAYLOAD, dtype=torch.uint8, device="cuda")
    dst = torch.empty(PAYLOAD, dtype=torch.uint8, device="cuda")
    src.random_(0, 256)
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    whole = timed([(0, a)], lambda: rt.memcpyAsync(dst.data_ptr(), src.data_ptr(), PAYLOAD,
                                                   rt.memcpyDeviceToDevice, a.ptr))
    whole_gbps = PAYLOAD / whole / 1e9
    rows = []
    for run in (64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB):
        runs = PAYLOAD // run
        for share in SHARES:
            engine_runs = int(round(runs * share))
            kernel_bytes = (runs - engine_runs) * run
            descs = None
            if kernel_bytes:
                tiles = -(-kernel_bytes >> 16)
                d = np.zeros((2, 12), dtype=np.uint64)
                d[0] = [src.data_ptr(), dst.data_ptr(), kernel_bytes, 1, 0, 0, 0, 0, 1, 0, tiles, 1]
                d[1, 9] = tiles
                descs = cp.asarray(d)
                args = (descs.data.ptr, cp.uint64(1), cp.uint64(tiles), cp.uint32(16), cp.uint32(5))

            def issue():
                if descs is not None:
                    kernel((sms * 3,), (256,), args, stream=a)
                for r in range(runs - engine_runs, runs):
                    rt.memcpyAsync(dst.data_ptr() + r * run, src.data_ptr() + r * run, run,
                                   rt.memcpyDeviceToDevice, b.ptr)

            dst.zero_()
            torch.cuda.synchronize()
            seconds = timed([(0, a), (0, b)], issue, gate_cycles=400_000_000)
            exact = bool(torch.equal(src, dst))
            rows.append({"run_bytes": run, "engine_share": share, "engine_runs": engine_runs,
                         "seconds": seconds, "gbps": PAYLOAD / seconds / 1e9,
                         "vs_one_copy": whole / seconds, "exact": exact})
            print(rows[-1], flush=True)
    print_table(["run", "copy-engine share", "GB/s", "vs one cudaMemcpy", "byte-exact"],
                [[f"{r['run_bytes'] // KIB} KiB", f"{r['engine_share']:.1f}", f"{r['gbps']:.0f}",
                  f"{r['vs_one_copy']:.3f}", r["exact"]] for r in rows])
    print(f"(one cudaMemcpy of 2 GiB: {whole_gbps:.0f} GB/s)")
    write_results("split_copy_probe", {"probe": "split_copy_probe", "payload": PAYLOAD,
                                       "one_copy_gbps": whole_gbps, "rows": rows})


if __name__ == "__main__":
    main()
