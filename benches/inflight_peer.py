"""An update in flight on one GPU: a decode-like loop keeps running while refit receives a large model
into staging beside it, then the commit stalls the loop only for a local copy.

- The engine: a loop on its own stream of memory-bound bf16 small-batch products (8 x 8192 by
  8192 x 8192, cycling through REFIT_INFLIGHT_LOOP_GIB of weights so every step streams HBM, as
  decoding does).
- The update: a synthetic model of REFIT_INFLIGHT_GIB of bf16 tensors (8192 x 8192 each), offered as
  two ranks' row shards (all of shard 0, then all of shard 1, in one arena) and needed whole by the
  receiver (another arena), planned with refit's Python API (Table, Plan, Executor) and run with
  staged commit on a second stream at several SM budgets (none: Arm.AUTO; the copy engine; the kernel
  capped at 66, 33, 16 and 8 SMs).
- Per budget: the receive's duration and the loop's time per step during it against the loop alone
  just before (its slowdown). Then the commit, enqueued on the engine's stream between two loop
  steps: the stall (the commit's span on that stream) against one device copy of the same installed
  bytes measured in the same run (the target: stall <= 1.1x that copy).
- Every commit is checked: the receiver's arena equals the shards, byte for byte.

GPU (gpu/run.sh runs benches/*_peer.py): `python3 benches/inflight_peer.py`; writes
$REFIT_BENCH_RESULTS/inflight.json (default benches/results). `--dry` runs the same harness on the
host backend with tiny sizes and no torch (ctypes buffers; the loop is a host memory copy): what
benches/tests/test_inflight.py exercises.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import refit
from refit import Arm, Backend, Commit, Group, Plan, Table

GIB = 1 << 30
BF16 = 2
TARGET_STALL_RATIO = 1.1


# --- the arithmetic (device-agnostic; benches/tests/test_inflight.py checks it) ---------------------


def step_time_inside(ends_ms: Sequence[float], begin_ms: float, end_ms: float) -> Optional[float]:
    """The loop's time per step inside [begin_ms, end_ms]: from the step ends that fall inside, the
    span between the first and the last over the steps between them (None: fewer than two)."""
    inside = [t for t in ends_ms if begin_ms <= t <= end_ms]
    if len(inside) < 2:
        return None
    return (inside[-1] - inside[0]) / (len(inside) - 1)


def slowdown(alone_ms: float, during_ms: Optional[float]) -> Optional[float]:
    """The loop's slowdown beside the receive, as a fraction (0.25: each step took 25% longer)."""
    return None if during_ms is None else during_ms / alone_ms - 1.0


def model_layout(tensors: int, rows: int, cols: int) -> List[Dict[str, int]]:
    """Each tensor's byte offsets: its two row shards in the source arena (shard 0 of every tensor
    first, then shard 1), the whole tensor in the receiver's arena."""
    size, half = rows * cols * BF16, rows * cols * BF16 // 2
    return [
        {"dst": t * size, "src0": t * half, "src1": tensors * half + t * half, "bytes": size}
        for t in range(tensors)
    ]


def build_table(layout: List[Dict[str, int]], rows: int, cols: int, src: int, dst: int, device: int) -> Table:
    table = Table()
    for t, entry in enumerate(layout):
        index = table.add_tensor(f"layers.{t}.weight", (rows, cols), BF16, dtype=2)
        table.add_offer(index, 0, device, src + entry["src0"], (0, 0), (rows // 2, cols))
        table.add_offer(index, 0, device, src + entry["src1"], (rows // 2, 0), (rows // 2, cols))
        table.add_need(index, 0, device, dst + entry["dst"], (0, 0), (rows, cols), (cols, 1))
    return table


# --- devices -------------------------------------------------------------------------------------


class CudaDevice:
    """The GPU, through torch: two streams, CUDA events as marks (ms)."""

    backend = Backend.CUDA

    def __init__(self, loop_gib: float) -> None:
        import torch

        self.torch = torch
        self.engine, self.side = torch.cuda.Stream(), torch.cuda.Stream()
        count = max(2, int(loop_gib * GIB // (8192 * 8192 * BF16)))
        self.weights = [torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(count)]
        self.x = torch.randn(8, 8192, dtype=torch.bfloat16, device="cuda")
        self.y = torch.empty(8, 8192, dtype=torch.bfloat16, device="cuda")
        self.calls = 0
        self.name = torch.cuda.get_device_name()

    def arena(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device="cuda")

    def addr(self, arena: Any) -> int:
        return int(arena.data_ptr())

    def fill(self, arena: Any, seed: int) -> None:
        generator = self.torch.Generator(device="cuda").manual_seed(seed)
        arena.random_(0, 256, generator=generator)

    def clear(self, arena: Any) -> None:
        arena.zero_()

    def same(self, a: Any, a_at: int, b: Any, b_at: int, nbytes: int) -> bool:
        return bool(self.torch.equal(a[a_at : a_at + nbytes], b[b_at : b_at + nbytes]))

    def step(self) -> None:
        self.torch.matmul(self.x, self.weights[self.calls % len(self.weights)], out=self.y)
        self.calls += 1

    def mark(self, stream: Any) -> Any:
        event = self.torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def ms(self, first: Any, second: Any) -> float:
        return first.elapsed_time(second)

    def sync(self) -> None:
        self.torch.cuda.synchronize()

    def loop_alone(self, steps: int) -> float:
        """ms per loop step alone."""
        with self.torch.cuda.stream(self.engine):
            for _ in range(8):
                self.step()
            start = self.mark(self.engine)
            for _ in range(steps):
                self.step()
            stop = self.mark(self.engine)
        self.sync()
        return self.ms(start, stop) / steps

    def beside(self, enqueue_side: Callable[[Any], Any], poll: int = 8) -> Tuple[float, List[float], Any]:
        """Runs the loop on the engine stream while `enqueue_side(side stream)` runs on the side one;
        returns (side's ms, each loop step's end in ms from the side's start, enqueue_side's result).
        The host polls the side's end every `poll` steps; the loop outlasts it by `poll` steps."""
        with self.torch.cuda.stream(self.engine):
            for _ in range(poll):
                self.step()
        begin = self.mark(self.side)
        result = enqueue_side(self.side)
        end = self.mark(self.side)
        ends = []
        with self.torch.cuda.stream(self.engine):
            while not end.query():
                for _ in range(poll):
                    self.step()
                    ends.append(self.mark(self.engine))
            for _ in range(poll):
                self.step()
                ends.append(self.mark(self.engine))
        self.sync()
        return self.ms(begin, end), [self.ms(begin, event) for event in ends], result

    def on_engine(self, enqueue: Callable[[Any], Any], before: int = 8, after: int = 8) -> Tuple[float, Any]:
        """`enqueue(engine stream)` between loop steps on the engine stream: (its span there, ms; result)."""
        with self.torch.cuda.stream(self.engine):
            for _ in range(before):
                self.step()
            start = self.mark(self.engine)
            result = enqueue(self.engine)
            stop = self.mark(self.engine)
            for _ in range(after):
                self.step()
        self.sync()
        return self.ms(start, stop), result

    def copy_ms(self, dst: Any, src: Any, nbytes: int) -> float:
        def enqueue(stream: Any) -> None:
            dst[:nbytes].copy_(src[:nbytes])

        return self.on_engine(enqueue, 0, 0)[0]

    def stream_arg(self, stream: Any) -> Any:
        return stream


class HostDevice:
    """The host backend standing in (--dry): ctypes arenas, the loop a host memory copy on a thread,
    perf_counter marks (ms)."""

    backend = Backend.HOST
    name = "host (dry run)"

    def __init__(self, loop_bytes: int = 1 << 20) -> None:
        self.weights = (ctypes.c_uint8 * loop_bytes)()
        self.scratch = (ctypes.c_uint8 * loop_bytes)()
        self.loop_bytes = loop_bytes

    def arena(self, nbytes: int) -> Any:
        return (ctypes.c_uint8 * nbytes)()

    def addr(self, arena: Any) -> int:
        return ctypes.addressof(arena)

    def fill(self, arena: Any, seed: int) -> None:
        for i in range(len(arena)):
            arena[i] = (i * 131 + seed * 17 + (i >> 8)) & 0xFF

    def clear(self, arena: Any) -> None:
        ctypes.memset(arena, 0, len(arena))

    def same(self, a: Any, a_at: int, b: Any, b_at: int, nbytes: int) -> bool:
        return ctypes.string_at(self.addr(a) + a_at, nbytes) == ctypes.string_at(self.addr(b) + b_at, nbytes)

    def step(self) -> None:
        ctypes.memmove(self.scratch, self.weights, self.loop_bytes)

    @staticmethod
    def now() -> float:
        return time.perf_counter() * 1e3

    def loop_alone(self, steps: int) -> float:
        start = self.now()
        for _ in range(steps):
            self.step()
        return (self.now() - start) / steps

    def beside(self, enqueue_side: Callable[[Any], Any], chunk: int = 8) -> Tuple[float, List[float], Any]:
        ends: List[float] = []
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                self.step()
                ends.append(self.now())

        thread = threading.Thread(target=loop)
        thread.start()
        begin = self.now()
        result = enqueue_side(None)
        end = self.now()
        stop.set()
        thread.join()
        return end - begin, [t - begin for t in ends], result

    def on_engine(self, enqueue: Callable[[Any], Any], before: int = 8, after: int = 8) -> Tuple[float, Any]:
        for _ in range(before):
            self.step()
        start = self.now()
        result = enqueue(None)
        span = self.now() - start
        for _ in range(after):
            self.step()
        return span, result

    def copy_ms(self, dst: Any, src: Any, nbytes: int) -> float:
        start = self.now()
        ctypes.memmove(dst, src, nbytes)
        return self.now() - start

    def stream_arg(self, stream: Any) -> Any:
        return None


# --- the bench -------------------------------------------------------------------------------------


def budgets(dry: bool) -> List[Tuple[str, int, int]]:
    if dry:
        return [("none (auto)", Arm.AUTO, 0), ("8 SMs", Arm.KERNEL, 8)]
    return [("none (auto)", Arm.AUTO, 0), ("copy engine", Arm.COPY_ENGINE, 0)] + [
        (f"{n} SMs", Arm.KERNEL, n) for n in (66, 33, 16, 8)
    ]


def check_installed(device: Any, layout: List[Dict[str, int]], src: Any, dst: Any) -> None:
    for t, entry in enumerate(layout):
        half = entry["bytes"] // 2
        if not (device.same(dst, entry["dst"], src, entry["src0"], half) and device.same(dst, entry["dst"] + half, src, entry["src1"], half)):
            raise SystemExit(f"inflight: tensor {t} differs from its shards after the commit")


def run(device: Any, tensors: int, rows: int, cols: int, loop_steps: int, reps: int, dry: bool) -> Dict[str, Any]:
    layout = model_layout(tensors, rows, cols)
    total = sum(entry["bytes"] for entry in layout)
    src, dst = device.arena(total), device.arena(total)
    device.fill(src, 1)
    group = Group([0], backend=device.backend)
    with build_table(layout, rows, cols, device.addr(src), device.addr(dst), 0) as table:
        plan = Plan.build([table])
    rows_out = []
    stalls: List[float] = []
    installed = 0
    for label, arm, sm_budget in budgets(dry):
        with plan.executor(group, 0, arm=arm, sm_budget=sm_budget, commit=Commit.STAGED) as executor:
            device.clear(dst)
            executor.run(None)  # warm-up: complete on return
            executor.commit(None)
            alone = device.loop_alone(loop_steps)
            device.clear(dst)
            receive_ms, ends, stats = device.beside(lambda stream: executor.run(device.stream_arg(stream)))
            during = step_time_inside(ends, 0.0, receive_ms)
            stall_ms, commit_stats = device.on_engine(lambda stream: executor.commit(device.stream_arg(stream)))
            check_installed(device, layout, src, dst)
            installed = commit_stats.installed_bytes or total
            stalls.append(stall_ms)
            for _ in range(reps - 1):
                executor.run(None)
                stalls.append(device.on_engine(lambda stream: executor.commit(device.stream_arg(stream)))[0])
            rows_out.append(
                {
                    "budget": label,
                    "arm": int(arm),
                    "sm_budget": sm_budget,
                    "receive_ms": receive_ms,
                    "receive_gb_s": total / receive_ms / 1e6 if receive_ms > 0 else None,
                    "loop_ms_per_step_alone": alone,
                    "loop_ms_per_step_during": during,
                    "loop_slowdown": slowdown(alone, during),
                    "loop_steps_inside": sum(1 for t in ends if 0.0 <= t <= receive_ms),
                    "commit_stall_ms": stall_ms,
                }
            )
            print(
                f"{label:>12}: receive {receive_ms:9.2f} ms, loop {alone:.4f} ms/step alone, "
                + (f"{during:.4f} during ({100 * slowdown(alone, during):+.1f}%)" if during else "too few steps inside")
                + f", commit stall {stall_ms:.2f} ms",
                flush=True,
            )
    copies = [device.copy_ms(dst, src, installed) for _ in range(reps)]
    copy_ms, stall_ms = statistics.median(copies), statistics.median(stalls)
    group.close()
    plan.close()
    ratio = stall_ms / copy_ms if copy_ms > 0 else None
    print(
        f"commit stall {stall_ms:.2f} ms (median of {len(stalls)}) against one device copy of the "
        f"{installed / GIB:.2f} GiB installed, {copy_ms:.2f} ms: {ratio:.2f}x (target <= {TARGET_STALL_RATIO}x)"
    )
    return {
        "model_bytes": total,
        "tensors": tensors,
        "tensor_shape": [rows, cols],
        "installed_bytes": installed,
        "budgets": rows_out,
        "commit": {
            "stall_ms": stall_ms,
            "stalls_ms": stalls,
            "copy_ms": copy_ms,
            "copies_ms": copies,
            "ratio": ratio,
            "target_ratio": TARGET_STALL_RATIO,
            "met": ratio is not None and ratio <= TARGET_STALL_RATIO,
        },
    }


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="host backend, tiny sizes, no torch")
    args = parser.parse_args(argv)
    if args.dry:
        device: Any = HostDevice()
        tensors, rows, cols, loop_steps, reps = 4, 64, 64, 16, 2
    else:
        gib = float(os.environ.get("REFIT_INFLIGHT_GIB", "24"))
        device = CudaDevice(float(os.environ.get("REFIT_INFLIGHT_LOOP_GIB", "4")))
        rows = cols = 8192
        tensors, loop_steps, reps = max(2, int(gib * GIB // (rows * cols * BF16))), 2000, 3
    result = {
        "bench": "inflight",
        "machine": {"device": device.name, "host": platform.node(), "python": platform.python_version()},
        "versions": {"refit": refit.version(), "torch": getattr(getattr(device, "torch", None), "__version__", None)},
        "dry": args.dry,
    }
    result.update(run(device, tensors, rows, cols, loop_steps, reps, args.dry))
    out_dir = os.environ.get("REFIT_BENCH_RESULTS", "benches/results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "inflight_dry.json" if args.dry else "inflight.json")
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
