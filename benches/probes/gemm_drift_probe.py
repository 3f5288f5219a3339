"""Does a bf16 GEMM loop keep its speed over a second of work, and so which baseline must an overlap
bench divide by?

benches/refit_peer.py timed the GEMM alone over 50 GEMMs (about 70 ms) and beside a copy over about a
second, and found every copy, however slow, cost the GEMM about 14%; paced_copy_probe.py, whose
baseline is 100 GEMMs, found 1-5% for the same kind of copy. If the GPU runs a long GEMM loop slower
than a short one (clocks falling to the power limit), a short baseline charges that drift to the copy.
This probe runs the same 8192^3 bf16 GEMM loop alone for three seconds, with an event every ~10 ms,
while `nvidia-smi` samples the SM clock, power and clock-limit reasons every 50 ms (read only), then
times loops of 50, 100, 200, 700 and again 50 GEMMs alone back to back. Writes
$REFIT_BENCH_RESULTS/gemm_drift_probe.json.
"""

import os
import subprocess
import tempfile
import time

import torch

from probe_util import write_results
from side_by_side import gemm_load

SAMPLED = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"


def sample_clocks(path):
    """Starts nvidia-smi writing SAMPLED every 50 ms to `path`; the caller terminates it."""
    return subprocess.Popen(
        ["nvidia-smi", "-i", "0", f"--query-gpu={SAMPLED}", "--format=csv,noheader,nounits", "-lms", "50"],
        stdout=open(path, "w"),
        stderr=subprocess.DEVNULL,
    )


def parse_samples(path):
    rows = []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 6:
            continue
        try:
            rows.append({"sm_mhz": float(parts[1]), "mem_mhz": float(parts[2]), "watts": float(parts[3]),
                         "celsius": float(parts[4]), "reasons": parts[5]})
        except ValueError:
            continue
    return rows


def main():
    torch.cuda.init()
    gemm = gemm_load()
    scratch = tempfile.mkdtemp()
    idle_path, busy_path = os.path.join(scratch, "idle.csv"), os.path.join(scratch, "busy.csv")

    # The GPU idle for a second: the clocks it starts a loop from.
    torch.cuda.synchronize()
    sampler = sample_clocks(idle_path)
    time.sleep(1.0)
    sampler.terminate()
    sampler.wait()

    # Three seconds of GEMMs, an event after every graph of them (about 10 ms).
    per_event = gemm.per_graph
    events = int(3000 / (gemm.short_ms * per_event))
    sampler = sample_clocks(busy_path)
    time.sleep(0.2)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(events + 1)]
    with torch.cuda.stream(gemm.stream):
        marks[0].record()
        for k in range(events):
            gemm.graph.replay()
            marks[k + 1].record()
    marks[-1].synchronize()
    sampler.terminate()
    sampler.wait()
    per_gemm = [marks[k].elapsed_time(marks[k + 1]) / per_event for k in range(events)]
    elapsed = [marks[0].elapsed_time(marks[k + 1]) for k in range(events)]

    def at(ms):
        """Per-GEMM ms of the graph of GEMMs running at `ms` into the loop."""
        k = min(range(events), key=lambda i: abs(elapsed[i] - ms))
        return per_gemm[k]

    drift = [{"ms_into_loop": t, "per_gemm_ms": at(t)} for t in (10, 50, 100, 250, 500, 1000, 2000, 2900)]
    print("per-GEMM ms at a time into a 3 s loop:", drift, flush=True)

    # Back-to-back loops of n GEMMs: the baselines the two harnesses used, and one of a second.
    torch.cuda.synchronize()
    time.sleep(1.0)
    loops = [{"gemms": n, "per_gemm_ms": gemm.ms_per_call(n)} for n in (50, 100, 200, 700, 50)]
    print("per-GEMM ms of back-to-back loops of n GEMMs (after 1 s idle):", loops, flush=True)

    idle, busy = parse_samples(idle_path), parse_samples(busy_path)

    def summary(phase, rows):
        if not rows:
            return {"phase": phase, "samples": 0}
        return {"phase": phase, "samples": len(rows), "sm_mhz_min": min(r["sm_mhz"] for r in rows),
                "sm_mhz_max": max(r["sm_mhz"] for r in rows),
                "sm_mhz_mean": sum(r["sm_mhz"] for r in rows) / len(rows),
                "watts_max": max(r["watts"] for r in rows), "celsius_max": max(r["celsius"] for r in rows),
                "clock_limit_reasons": " ".join(sorted({r["reasons"] for r in rows}))}

    clocks = [summary("1 s idle", idle), summary("3 s GEMM loop", busy)]
    series = [[r["sm_mhz"], r["watts"]] for r in busy]
    print("clocks:", clocks, flush=True)
    print("SM MHz, W every 50 ms of the GEMM loop:", series, flush=True)
    write_results("gemm_drift_probe", {"probe": "gemm_drift_probe", "device": torch.cuda.get_device_name(0),
                                       "gemm_short_loop_ms": gemm.short_ms, "per_gemm_ms_at": drift,
                                       "back_to_back_loops": loops, "clocks": clocks,
                                       "sm_mhz_watts_series": series, "per_gemm_ms_series": per_gemm})


if __name__ == "__main__":
    main()
