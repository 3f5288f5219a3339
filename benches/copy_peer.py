"""The peer column of benches/gpu_copy.rs: torch._foreach_copy_ over the same segment sets.

Same GPU and GPU0 -> GPU1, segments of 256 B .. 16 MiB (256 MiB total up to 512 B, 1 GiB above; the
destination order shuffled, as in the Rust bench) and the tensor-parallel column split (2,048 rows of
768 B out of rows of 1,536 B, 256 MiB of payload). Same-GPU times are CUDA-event medians after
warm-up; GPU0 -> GPU1 times are wall-clock medians around the call with both devices synchronized
(torch copies across devices through its own stream synchronization). Writes
$REFIT_BENCH_RESULTS/copy_peer.json and prints a markdown table.
"""

import json
import os
import statistics
import time

import torch

MIB = 1 << 20


def timed(fn, reps, devices, warm=None):
    (warm or fn)()
    for d in devices:
        torch.cuda.synchronize(d)
    times = []
    for _ in range(reps):
        if len(devices) == 1:
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            for d in devices:
                torch.cuda.synchronize(d)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    torch.manual_seed(2026)
    two = torch.cuda.device_count() >= 2
    src = torch.randint(0, 256, ((1 << 30) + 512 * MIB,), dtype=torch.uint8, device="cuda:0")
    rows = []
    paths = [("GPU0", "cuda:0")] + ([("GPU0->GPU1", "cuda:1")] if two else [])
    for path, dst_device in paths:
        dst = torch.empty(1 << 30, dtype=torch.uint8, device=dst_device)
        devices = sorted({0, torch.device(dst_device).index})
        cases = []
        for size in [256, 512, 4096, 64 << 10, MIB, 16 * MIB]:
            total = 256 * MIB if size <= 512 else 1 << 30
            n = total // size
            srcs = list(src[:total].view(n, size).unbind(0))
            dst_rows = dst[:total].view(n, size).unbind(0)
            order = torch.randperm(n).tolist()
            dsts = [dst_rows[k] for k in order]
            cases.append((f"{size} B", srcs, dsts, total))
        # Column split: 170 tensors of 2048 x 1536 bytes, left halves into contiguous 2048 x 768.
        tensors = 256 * MIB // (2048 * 768)
        shard = src[: tensors * 2048 * 1536].view(tensors, 2048, 1536)
        out = dst[: tensors * 2048 * 768].view(tensors, 2048, 768)
        cases.append(
            ("column split 2048x768 of 1536", [shard[t, :, :768] for t in range(tensors)], list(out.unbind(0)),
             tensors * 2048 * 768)
        )
        for name, srcs, dsts, total in cases:
            reps = 3 if len(srcs) > 10000 else 10
            warm = None
            if len(devices) > 1 and len(srcs) > 100000:
                # Across devices torch may copy tensor by tensor (seconds per call at this count):
                # warm up on a prefix and time one call, to stay within the bench's time budget.
                reps = 1
                warm = lambda: torch._foreach_copy_(dsts[:1000], srcs[:1000])  # noqa: E731
            ms = timed(lambda: torch._foreach_copy_(dsts, srcs), reps, devices, warm)
            ok = all(torch.equal(dsts[k], srcs[k].to(dsts[k].device)) for k in (0, len(srcs) // 2, len(srcs) - 1))
            rows.append({"case": name, "path": path, "segments": len(srcs), "bytes": total,
                         "foreach_copy": total / (ms * 1e-3) / 1e9, "ms": ms, "checked": ok})
            assert ok, f"_foreach_copy_ result differs for {name} {path}"
        del cases, dst

    print("| case | path | segments | MiB | torch._foreach_copy_ GB/s | ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['path']} | {r['segments']} | {r['bytes'] // MIB} | {r['foreach_copy']:.1f} | {r['ms']:.2f} |")
    out_dir = os.environ.get("REFIT_BENCH_RESULTS", "benches/results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "copy_peer.json"), "w") as f:
        json.dump({"bench": "copy_peer", "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                   "gpus": torch.cuda.device_count(), "units": "GB/s of payload", "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
