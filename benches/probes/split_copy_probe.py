"""Does the copy engine running beside refit's kernel, each on its own share of a batch, copy within one
GPU faster than either alone, and why does the executor not gain what this probe's first form found?
Issue 29 asks AUTO for 0.95 of one large copy at every run size from 64 KiB; no SM kernel variant
passes 0.94 (bulk_copy_probe), and the copy engine alone needs runs of 256 MiB (gpu_sweep). The first
form of this probe (one kernel segment, two streams each timed from its own start) found copy-engine
shares of 0.2 of 16 MiB runs and 0.3 of 64 MiB runs at 0.966 and 0.996 of one large copy; the
executor's split of the same runs measured 0.90-0.93 (docs/decisions.md).

For runs of 1 to 64 MiB (2 GiB in all), in one run, each variant copies the first (1 - f) of the runs
with a kernel and the rest with one `cudaMemcpyAsync` per run, f from 0 (the kernel alone) to 0.3:
- `one segment, streams gated`: the first form. The probe's own build of refit's kernel copies its
  bytes as one segment (64 KiB tiles) on stream A; the copy engine works on stream B; each stream is
  held by a spin kernel until the host has queued everything, and each is timed from its own start,
  the slower one counting; its `wall span` row times the same batch from the earlier stream's start
  to the later one's end (with the spread of the two starts).
- `per-run segments, streams gated`: the same timing, but the executor's work: run i lands at run
  n-1-i of the destination (as gpu_sweep's `contiguous` shape), and the kernel is refit's own
  prepared copy (refit_copy_batch_prepare: its tile size and grid) of one segment per run.
- `per-run segments, fork-join`: the same work timed as the executor's stage is: stream B waits for an
  event recorded on A, the kernel goes on A, the copies on B, and A waits for B's last copy; one span
  on A, from before the fork to after the join.
- `executor AUTO` (and `executor KERNEL`): refit's executor over the same reversed runs planned from
  tables, run on stream A behind the spin (events around it, as the variants above), and its own
  RunStats.device_ns (`device_ns` rows). AUTO's share is its rule's (docs/decisions.md).
Beside them, one `cudaMemcpyAsync` of the whole 2 GiB. Every byte is compared with where it should land
after each configuration. Writes $REFIT_BENCH_RESULTS/split_copy_probe.json.
"""

import statistics

import cupy as cp
import numpy as np
import torch
from cupy.cuda import runtime as rt

import refit
from probe_util import print_table, refit_source, timed, timed_spans, write_results

GIB = 1 << 30
MIB = 1 << 20
PAYLOAD = 2 * GIB
RUNS = (1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB)
SHARES = (0.0, 0.1, 0.2, 0.3)
GATE = 400_000_000


class Buffers:
    """The source (random bytes) and destination of every variant."""

    def __init__(self):
        self.src = torch.empty(PAYLOAD, dtype=torch.uint8, device="cuda")
        self.dst = torch.empty(PAYLOAD, dtype=torch.uint8, device="cuda")
        self.src.random_(0, 256)

    def runs(self, run, reversed_rows):
        """(source, destination) address of each run, run i landing at n-1-i when `reversed_rows`."""
        n = PAYLOAD // run
        s, d = self.src.data_ptr(), self.dst.data_ptr()
        return [(s + i * run, d + ((n - 1 - i) if reversed_rows else i) * run) for i in range(n)]

    def exact(self, run, reversed_rows):
        n = PAYLOAD // run
        want = self.src.view(n, run).flip(0) if reversed_rows else self.src.view(n, run)
        return bool(torch.equal(want, self.dst.view(n, run)))


def engine_copies(runs, run, stream):
    for s, d in runs:
        rt.memcpyAsync(d, s, run, rt.memcpyDeviceToDevice, stream.ptr)


def one_segment_kernel(sms):
    """The probe's build of refit's kernel over `nbytes` from the start of both buffers, one segment."""
    kernel = cp.RawModule(code=refit_source("batched_copy.cu"), options=("--std=c++17",)).get_function(
        "refit_batched_copy")

    def launcher(buffers, nbytes, stream):
        if not nbytes:
            return lambda: None
        tiles = -(-nbytes >> 16)
        d = np.zeros((2, 12), dtype=np.uint64)
        d[0] = [buffers.src.data_ptr(), buffers.dst.data_ptr(), nbytes, 1, 0, 0, 0, 0, 1, 0, tiles, 1]
        d[1, 9] = tiles
        descs = cp.asarray(d)
        args = (descs.data.ptr, cp.uint64(1), cp.uint64(tiles), cp.uint32(16), cp.uint32(5))
        return lambda: kernel((sms * 3,), (256,), args, stream=stream)

    return launcher


def split_rows(buffers, group, sms, whole):
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    launch_one_segment = one_segment_kernel(sms)
    rows = []

    def record(variant, run, share, seconds, reversed_rows):
        exact = buffers.exact(run, reversed_rows)
        # Gated variants: the slower stream from its own start, and the wall span from the earlier
        # start to the later end (the streams' spins need not end together).
        spans = seconds if isinstance(seconds, dict) else {"slowest": seconds}
        for name, key in ((variant, "slowest"), (variant + ", wall span", "wall")):
            if spans.get(key) is None:
                continue
            rows.append({"variant": name, "run_bytes": run, "engine_share": share, "seconds": spans[key],
                         "gbps": PAYLOAD / spans[key] / 1e9, "vs_one_copy": whole / spans[key], "exact": exact,
                         "start_spread_s": spans.get("start_spread")})
            print(rows[-1], flush=True)

    for run in RUNS:
        n = PAYLOAD // run
        for share in SHARES:
            engine_runs = int(round(n * share))
            kernel_runs = n - engine_runs
            # The first form: one segment, each stream timed from its own start.
            straight = buffers.runs(run, False)
            kernel = launch_one_segment(buffers, kernel_runs * run, a)

            def gated_one():
                kernel()
                engine_copies(straight[kernel_runs:], run, b)

            buffers.dst.zero_()
            torch.cuda.synchronize()
            record("one segment, streams gated", run, share,
                   timed_spans([(0, a), (0, b)], gated_one, gate_cycles=GATE), False)

            # The executor's work: reversed runs, refit's prepared copy of one segment per run.
            reversed_runs = buffers.runs(run, True)
            prepared = group.prepare_copy(0, [(s, d, run) for s, d in reversed_runs[:kernel_runs]]) \
                if kernel_runs else None

            def gated_per_run():
                if prepared:
                    prepared.launch(a)
                engine_copies(reversed_runs[kernel_runs:], run, b)

            buffers.dst.zero_()
            torch.cuda.synchronize()
            record("per-run segments, streams gated", run, share,
                   timed_spans([(0, a), (0, b)], gated_per_run, gate_cycles=GATE), True)

            forked, joined = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)

            def fork_join():
                forked.record(a)
                b.wait_event(forked)
                if prepared:
                    prepared.launch(a)
                engine_copies(reversed_runs[kernel_runs:], run, b)
                joined.record(b)
                a.wait_event(joined)

            buffers.dst.zero_()
            torch.cuda.synchronize()
            record("per-run segments, fork-join", run, share, timed([(0, a)], fork_join, gate_cycles=GATE), True)
            if prepared:
                prepared.close()
    return rows


def executor_rows(buffers, group, whole):
    """The executor over reversed runs (one tensor per run, as gpu_sweep's contiguous shape)."""
    a = cp.cuda.Stream(non_blocking=True)
    rows = []
    for run in RUNS:
        table = refit.Table()
        for i, (s, d) in enumerate(buffers.runs(run, True)):
            t = table.add_tensor(f"run.{i}", [1, run], 1)
            table.add_offer(t, 0, 0, s, [0, 0], [1, run])
            table.add_need(t, 0, 0, d, [0, 0], [1, run], [run, 1])
        plan = refit.Plan.build([table])
        for arm_name, arm in (("AUTO", refit.Arm.AUTO), ("KERNEL", refit.Arm.KERNEL)):
            with plan.executor(group, 0, arm=arm) as ex:
                buffers.dst.zero_()
                torch.cuda.synchronize()
                seconds = timed([(0, a)], lambda: ex.run(a), gate_cycles=GATE)
                exact = buffers.exact(run, True)
                device = []
                for _ in range(5):
                    ex.run(a)
                    a.synchronize()
                    device.append(ex.stats().device_ns / 1e9)
                method = ex.stats().arm[refit.RouteKind.LOCAL]
                for variant, s in ((f"executor {arm_name}, events", seconds),
                                   (f"executor {arm_name}, device_ns", statistics.median(device))):
                    rows.append({"variant": variant, "run_bytes": run, "engine_share": None,
                                 "method": int(method), "seconds": s, "gbps": PAYLOAD / s / 1e9,
                                 "vs_one_copy": whole / s, "exact": exact})
                    print(rows[-1], flush=True)
        plan.close()
        table.close()
    return rows


def main():
    torch.cuda.init()
    sms = cp.cuda.Device(0).attributes["MultiProcessorCount"]
    buffers = Buffers()
    group = refit.Group([0], backend=refit.Backend.CUDA)
    a = cp.cuda.Stream(non_blocking=True)
    whole = timed([(0, a)], lambda: rt.memcpyAsync(buffers.dst.data_ptr(), buffers.src.data_ptr(), PAYLOAD,
                                                   rt.memcpyDeviceToDevice, a.ptr))
    rows = split_rows(buffers, group, sms, whole) + executor_rows(buffers, group, whole)
    print_table(["variant", "run", "copy-engine share", "GB/s", "vs one cudaMemcpy", "byte-exact"],
                [[r["variant"], f"{r['run_bytes'] // MIB} MiB",
                  "-" if r["engine_share"] is None else f"{r['engine_share']:.1f}", f"{r['gbps']:.0f}",
                  f"{r['vs_one_copy']:.3f}", r["exact"]] for r in rows])
    print(f"(one cudaMemcpy of 2 GiB: {PAYLOAD / whole / 1e9:.0f} GB/s)")
    write_results("split_copy_probe", {"probe": "split_copy_probe", "payload": PAYLOAD,
                                       "one_copy_gbps": PAYLOAD / whole / 1e9, "rows": rows})


if __name__ == "__main__":
    main()
