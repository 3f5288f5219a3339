"""Timing a copy beside other work on the same GPU: what benches/refit_peer.py and the overlap probes in
benches/probes/ share.

A load (a GEMM, a product as memory-bound as decoding) runs in a loop on its own stream while copy steps
run on another. The harness avoids three traps, each of which it once fell into:
- the GPU runs a second of GEMMs about 14% slower than a short loop (its clocks fall to the power
  limit: benches/probes/gemm_drift_probe.py), so the load's slowdown is against a loop as long,
  alone, just before;
- steps that outlast the load's loop move part of their bytes alone, so the copy's rate beside the
  load counts only the steps that ended inside the loop; and a load that outlasts the steps runs
  partly alone, so the loop starts only once steps run and the steps go on until it has ended;
- a loop of thousands of short launches fills CUDA's launch queue, and the host then waits for the
  load to drain before it can queue a single step; so the load loops are CUDA graphs of about 10 ms.
"""

import math

import torch


def timing_event():
    return torch.cuda.Event(enable_timing=True)


class Load:
    """`call` (a closure over device tensors) in a loop on its own stream: replayed from CUDA graphs of
    about `graph_ms` each, as CUDA-graphed serving engines run their steps, or launched one by one from
    Python when `graph_ms` is None (only for calls long enough that a loop of them stays short of the
    launch queue). `short_ms` is one call's time in a short loop alone, to size loops with;
    `ms_per_call(n)` is the baseline a loop of n calls beside a copy is compared with."""

    def __init__(self, name, call, graph_ms=10.0):
        # A graph holds raw pointers into `call`'s tensors: keeping `call` keeps them alive.
        self.name, self.call, self.stream = name, call, torch.cuda.Stream()
        self.per_graph, self.graph = 1, None
        if graph_ms is not None:
            self.per_graph = max(1, round(graph_ms / self.ms_per_call(10)))
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=self.stream):
                for _ in range(self.per_graph):
                    call()
        self.loop(self.per_graph)
        self.short_ms = self.ms_per_call(max(50, self.per_graph))

    def loop(self, calls):
        """Queues at least `calls` calls (whole graphs) between two timing events on the load's stream;
        returns the events and the number of calls queued."""
        graphs = max(1, math.ceil(calls / self.per_graph))
        start, stop = timing_event(), timing_event()
        with torch.cuda.stream(self.stream):
            start.record()
            for _ in range(graphs):
                if self.graph is None:
                    self.call()
                else:
                    self.graph.replay()
            stop.record()
        return start, stop, graphs * self.per_graph

    def ms_per_call(self, calls):
        """Per-call ms of a loop of about `calls` calls with nothing beside it, timed now."""
        torch.cuda.synchronize()
        start, stop, calls = self.loop(calls)
        stop.synchronize()
        return start.elapsed_time(stop) / calls


def beside(load, side, step_ms, step_bytes, enqueue_step, window_ms=1000.0):
    """Runs copy steps on stream `side`, and once a quarter window of them has run, `load`'s loop for
    about one window (at least five steps' time) beside them; the steps go on until the loop has ended.
    `enqueue_step()` queues one step of `step_bytes` on `side`; `step_ms` is its time alone. The host
    keeps two steps in flight, so that it sees the loop end and stops within a step.
    Returns a dict: `gbps`, the steps' rate beside the loop, over the steps that ended inside it; when
    fewer than two did, `gbps` is the bound `(k + 1) * step_bytes / loop time` for the k that did and
    `gbps_bound` is True; `slowdown`, the load's per-call time against the same loop alone just before,
    minus one; `baseline_ms`, that per-call time alone."""
    window = max(window_ms, 5 * step_ms)
    calls = math.ceil(window / load.short_ms)
    baseline = load.ms_per_call(calls)
    lead = max(1, math.ceil(0.25 * window / step_ms))
    marks = [timing_event()]
    marks[0].record(side)
    load_stop = None
    ended = False
    while not ended:
        if len(marks) == lead + 1:
            go = timing_event()
            go.record(side)
            load.stream.wait_event(go)
            load_start, load_stop, calls = load.loop(calls)
        # The step queued after the host saw the loop end ends after it: the steps cover the loop.
        ended = load_stop is not None and load_stop.query()
        if len(marks) >= 3:
            marks[-2].synchronize()
        enqueue_step()
        marks.append(timing_event())
        marks[-1].record(side)
    torch.cuda.synchronize()
    # Every time from the first mark, which precedes everything else: a difference never goes negative.
    begin, end = marks[0].elapsed_time(load_start), marks[0].elapsed_time(load_stop)
    gbps, bound = rate_inside([marks[0].elapsed_time(m) for m in marks[1:]], begin, end, step_bytes)
    return {"gbps": gbps, "gbps_bound": bound, "slowdown": (end - begin) / calls / baseline - 1,
            "baseline_ms": baseline}


def rate_inside(step_ends_ms, begin_ms, end_ms, step_bytes):
    """GB/s of steps of `step_bytes` beside a load that ran from `begin_ms` to `end_ms`, given the time
    each step ended: over the steps that ended inside the load, from the first such end to the last.
    With fewer than two inside, no interval between ends lies inside, so it returns the bound
    `(k + 1) * step_bytes / (end_ms - begin_ms)` for the k that did (at most k + 1 steps' bytes moved
    while the load ran), and True as its second value."""
    inside = [t for t in step_ends_ms if begin_ms <= t <= end_ms]
    if len(inside) >= 2:
        return (len(inside) - 1) * step_bytes / ((inside[-1] - inside[0]) * 1e6), False
    return (len(inside) + 1) * step_bytes / ((end_ms - begin_ms) * 1e6), True


def copy_in_pieces(dst, src, stream, nbytes, piece):
    """A step: the first `nbytes` of `src` into `dst` (byte tensors) by torch `copy_` on `stream`, in
    copies of `piece` bytes (same-device `cudaMemcpyAsync`s: the copy engine)."""
    def step():
        with torch.cuda.stream(stream):
            for off in range(0, nbytes, piece):
                dst[off:off + piece].copy_(src[off:off + piece])
    return step


def bf16(*shape):
    return torch.randn(*shape, dtype=torch.bfloat16, device="cuda")


def gemm_load(graphed=True):
    """cuBLAS's 8192^3 bf16 GEMM (torch.matmul): compute-bound, the load of the overlap target; in CUDA
    graphs, or launched one by one (`graphed=False`)."""
    a, b, c = bf16(8192, 8192), bf16(8192, 8192), bf16(8192, 8192)
    name = "bf16 GEMM 8192^3 (compute-bound)" + ("" if graphed else ", launched one by one")
    return Load(name, lambda: torch.matmul(a, b, out=c), 10.0 if graphed else None)


def decode_load():
    """A bf16 16 x 8192 by 8192 x 28672 product: it reads a 470 MB weight per call and little else, as
    memory-bound as a decoding step's projections."""
    x, w, y = bf16(16, 8192), bf16(8192, 28672), bf16(16, 28672)
    return Load("bf16 16x8192 by 8192x28672 (memory-bound, like decoding)", lambda: torch.matmul(x, w, out=y))
