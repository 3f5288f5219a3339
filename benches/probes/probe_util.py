"""What the cupy probes in benches/probes/ share: peer access, a spin kernel to gate streams, timing, and
writing results; and the path to benches/side_by_side.py, the harness that times a copy beside a load."""

import json
import os
import statistics
import sys

import cupy as cp
from cupy.cuda import runtime as rt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MIB = 1 << 20
SPIN = cp.RawKernel(
    r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}
""",
    "spin",
)


def enable_peers():
    """Peer access both ways between GPU0 and GPU1 (already enabled is fine)."""
    for d in (0, 1):
        with cp.cuda.Device(d):
            try:
                rt.deviceEnablePeerAccess(1 - d)
            except rt.CUDARuntimeError:
                pass


def timed(streams, issue, reps=5, gate_cycles=40_000_000):
    """Median seconds of one `issue()` batch, the slowest of `streams` ((device, stream) pairs):
    each stream first runs a spin kernel of `gate_cycles`, so that the host has queued the whole
    batch before the GPUs start; CUDA events around the batch; one warm-up batch."""
    return timed_spans(streams, issue, reps, gate_cycles)["slowest"]


def timed_spans(streams, issue, reps=5, gate_cycles=40_000_000):
    """`timed`'s batch, medians of: `slowest`, the longest of the streams each timed from its own
    start; `wall`, from the earliest start to the latest end (streams of one device); and
    `start_spread`, seconds between the first and the last stream's start."""
    starts = [None] * len(streams)
    ends = [None] * len(streams)
    samples, walls, spreads = [], [], []
    for rep in range(reps + 1):
        for k, (dev, s) in enumerate(streams):
            with cp.cuda.Device(dev):
                SPIN((1,), (1,), (cp.int64(gate_cycles),), stream=s)
                starts[k] = cp.cuda.Event()
                starts[k].record(s)
        issue()
        for k, (dev, s) in enumerate(streams):
            with cp.cuda.Device(dev):
                ends[k] = cp.cuda.Event()
                ends[k].record(s)
        worst = 0.0
        for k in range(len(streams)):
            ends[k].synchronize()
            worst = max(worst, cp.cuda.get_elapsed_time(starts[k], ends[k]) / 1e3)
        one_device = len({dev for dev, _ in streams}) == 1
        if rep:
            samples.append(worst)
            if one_device:
                elapsed = cp.cuda.get_elapsed_time
                walls.append(max(elapsed(s, e) for s in starts for e in ends) / 1e3)
                spreads.append(max(elapsed(s, t) for s in starts for t in starts) / 1e3)
    median = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"slowest": median(samples), "wall": median(walls), "start_spread": median(spreads)}


def median_ms(fn, reps=7):
    """Median milliseconds of `fn()` over `reps` calls (after one warm-up), CUDA events around each
    call on the current stream: for work that queues faster than it runs."""
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    fn()
    samples = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, stop))
    return statistics.median(samples)


def refit_source(name):
    """The text of refit's kernel source src/kernels/<name> (compiled by the probes as refit compiles it)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src", "kernels", name)
    with open(path) as f:
        return f.read()


def print_table(headers, rows):
    """Prints a markdown table after a blank line: `headers`, then each row's cells (already text)."""
    print("\n| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for cells in rows:
        print("| " + " | ".join(str(c) for c in cells) + " |")


def write_results(name, results):
    """Writes `results` as $REFIT_BENCH_RESULTS/<name>.json (default benches/results/), with the
    machine it ran on (`device`, `gpus`) unless the probe recorded them itself: benches/report.py
    names each table's machine from these fields."""
    try:
        import torch
    except ImportError:  # a cupy-only machine: report.py then says the machine was not recorded
        torch = None
    if torch is not None and torch.cuda.is_available():
        results = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), **results}
    out = os.environ.get("REFIT_BENCH_RESULTS", "benches/results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(results, f, indent=1)
