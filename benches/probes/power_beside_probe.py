"""Is what a copy costs a GEMM beside it the power it draws?

An 8192^3 bf16 GEMM loop on the H200 runs at its 700 W limit (gemm_drift_probe). A copy beside it
moves bytes through HBM, which draws power too; if the board then lowers the SM clock to stay at the
limit, the GEMM slows by about as much as its clock fell, whichever engine copies. Per copy variant
(copy-engine copies of 64 MiB and 1 GiB, a copy kernel of 48 blocks of 512 threads), the GEMM's
slowdown and the copy's rate beside it (benches/side_by_side.py), with the SM clock, power draw
and clock-limit reasons nvidia-smi reports every 50 ms while the GEMM runs alone and beside the copy.
Writes $REFIT_BENCH_RESULTS/power_beside_probe.json.
"""

import statistics
import subprocess
import threading
import time

import cupy as cp
import torch

from ce_beside_load_probe import COPY16
from probe_util import MIB, print_table, write_results
from side_by_side import beside, copy_in_pieces, gemm_load, timing_event

STEP = 2 << 30


class Sampler:
    """nvidia-smi every 50 ms in the background: (host time, SM MHz, watts, clock-limit reasons)."""

    def __init__(self):
        self.samples = []
        self.process = subprocess.Popen(
            ["nvidia-smi", "-i", "0", "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active",
             "--format=csv,noheader,nounits", "-lms", "50"],
            stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.process.stdout:
            fields = [f.strip() for f in line.split(",")]
            try:
                self.samples.append((time.monotonic(), float(fields[0]), float(fields[1]), fields[2]))
            except (ValueError, IndexError):
                pass

    def between(self, start, end):
        return [s for s in self.samples if start <= s[0] <= end]

    def stop(self):
        self.process.terminate()
        self.process.wait()


def summary(samples):
    if not samples:
        return {"samples": 0}
    return {"samples": len(samples), "sm_mhz": statistics.median(s[1] for s in samples),
            "watts": statistics.median(s[2] for s in samples),
            "reasons": sorted({s[3] for s in samples})}


def main():
    torch.cuda.init()
    src = torch.randint(0, 255, (STEP,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(STEP, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side_cp = cp.cuda.ExternalStream(side.cuda_stream)
    gemm = gemm_load()
    sampler = Sampler()

    def kernel():
        COPY16((48,), (512,), (src.data_ptr(), dst.data_ptr(), cp.int64(STEP // 16)), stream=side_cp)

    def alone_ms(step):
        step()
        start, stop = timing_event(), timing_event()
        start.record(side)
        for _ in range(3):
            step()
        stop.record(side)
        stop.synchronize()
        return start.elapsed_time(stop) / 3

    window_ms = 1500.0
    rows = []
    for what, step in (("copy engine, 64 MiB pieces", copy_in_pieces(dst, src, side, STEP, 64 * MIB)),
                       ("copy engine, 1 GiB pieces", copy_in_pieces(dst, src, side, STEP, 1024 * MIB)),
                       ("copy kernel 48 x 512", kernel)):
        ms = alone_ms(step)
        # The baseline loop comes first inside beside(): sample it, then the loop beside the copy.
        begun = time.monotonic()
        m = beside(gemm, side, ms, STEP, step, window_ms)
        ended = time.monotonic()
        # beside() runs: the baseline (about one window), a lead of a quarter window, the loop (one
        # window) beside the copy. Samples well inside each part.
        w = window_ms / 1000
        alone = summary(sampler.between(begun + 0.2 * w, begun + 0.9 * w))
        with_copy = summary(sampler.between(ended - 0.9 * w, ended - 0.1 * w))
        row = {"copy": what, "alone_gbps": STEP / (ms * 1e6), "beside_gbps": m["gbps"],
               "beside_gbps_is_bound": m["gbps_bound"], "gemm_ms_alone": m["baseline_ms"],
               "gemm_slowdown": m["slowdown"], "gemm_alone": alone, "gemm_beside_copy": with_copy}
        if alone.get("sm_mhz") and with_copy.get("sm_mhz"):
            row["sm_clock_change"] = with_copy["sm_mhz"] / alone["sm_mhz"] - 1
        rows.append(row)
        print(row, flush=True)
    sampler.stop()
    print(f"\npower_beside_probe: {torch.cuda.get_device_name(0)}, GEMM alone {gemm.short_ms:.3f} ms per call (short loop)")
    print_table(["copy beside the GEMM", "GB/s beside", "GEMM slowdown", "SM MHz alone / beside", "W alone / beside",
                 "SM clock change", "clock-limit reasons beside"],
                [[r["copy"], ("< " if r["beside_gbps_is_bound"] else "") + f"{r['beside_gbps']:.0f}",
                  f"{100 * r['gemm_slowdown']:.1f}%",
                  f"{r['gemm_alone'].get('sm_mhz', 0):.0f} / {r['gemm_beside_copy'].get('sm_mhz', 0):.0f}",
                  f"{r['gemm_alone'].get('watts', 0):.0f} / {r['gemm_beside_copy'].get('watts', 0):.0f}",
                  f"{100 * r.get('sm_clock_change', float('nan')):.1f}%",
                  " ".join(r["gemm_beside_copy"].get("reasons", []))] for r in rows])
    write_results("power_beside_probe", {"probe": "power_beside_probe", "device": torch.cuda.get_device_name(0),
                                         "window_ms": window_ms, "rows": rows})


if __name__ == "__main__":
    main()
