"""The torch column of benches/gpu_sweep.rs (issue 29, the plain copy at every run size).

Over the same run sizes (4 KiB .. 1 GiB by powers of 4) and the same payload per point
(REFIT_SWEEP_BYTES, default 4 GiB) as the Rust bench, on one GPU, in the same process:
- `torch._foreach_copy_` over the runs, and a per-run `copy_` loop (what a torch user writes);
- for the strided shape also one `copy_` per column block (two strided copies);
- one large `copy_` of the same payload (the ceiling).

Shapes, laid out as in the Rust bench: `contiguous` (run i of the source lands at run n-1-i of the
destination) and `strided` (a [rows, 2 run] byte matrix; its left and right column halves land in
the two halves of the destination, so every run is a row read with a stride of 2 run).

Every method is checked byte-exact before it is timed: the destination is poisoned, copied once and
compared whole with the expected bytes (torch.equal on uint8 views). Times are CUDA-event medians
after warm-up (3 timed calls above 65,536 runs, else 10 after 2). REFIT_SWEEP_SIZES (comma-separated
bytes) narrows the sizes. Writes $REFIT_BENCH_RESULTS/sweep_peer.json and prints a markdown table; when
gpu_sweep.json of the same payload is there (gpu/run.sh runs the Rust benches first), also AUTO beside
the best peer of every point (the per-run cuMemcpyAsync loop there, the torch methods here).
"""

import json
import os
import statistics

import torch

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
POISON = 0xAB
MANY_RUNS = 65536


def sizes():
    listed = os.environ.get("REFIT_SWEEP_SIZES")
    if listed:
        return [int(s) for s in listed.split(",")]
    return [4 * KIB << (2 * k) for k in range(11) if 4 * KIB << (2 * k) <= GIB]


def label(run):
    for unit, name in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if run >= unit:
            return f"{run // unit} {name}"
    return f"{run} B"


def timed(fn, warm, reps):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def cases(src, dst, run, total):
    """(shape, source runs, destination runs, expected(): the whole destination as it must end up)."""
    n = total // run
    if n >= 1:
        rows = src.view(n, run)
        srcs = list(rows.unbind(0))
        dsts = list(dst.view(n, run).unbind(0))[::-1]
        yield "contiguous", srcs, dsts, lambda: rows.flip(0).reshape(-1)
    if total % (2 * run) == 0:
        rows = total // (2 * run)
        matrix = src.view(rows, 2 * run)
        halves = [dst[: total // 2].view(rows, run), dst[total // 2 :].view(rows, run)]
        srcs = list(matrix[:, :run].unbind(0)) + list(matrix[:, run:].unbind(0))
        dsts = list(halves[0].unbind(0)) + list(halves[1].unbind(0))

        def expected():
            return torch.cat([matrix[:, :run].reshape(-1), matrix[:, run:].reshape(-1)])

        yield "strided", srcs, dsts, expected, (matrix, halves)


TORCH_METHODS = ("_foreach_copy_", "per-run copy_", "column-block copy_")


def combine(sweep, peer_rows, payload):
    """AUTO of benches/gpu_sweep.rs (its JSON, `sweep`) against the best peer of each point: the best of
    its per-run cuMemcpyAsync loop and the torch methods here, at the same shape, run size and payload.
    Points of the other bench's that this one lacks (its `receivers` shape) compare with its loop only.
    Empty when the payloads differ (the points would not be the same)."""
    if sweep.get("payload_bytes") != payload:
        return []
    torch_at = {(r["shape"], r["run_bytes"]): r for r in peer_rows}
    out = []
    for p in sweep["points"]:
        peers = {"per-run cuMemcpyAsync": p["per_run_loop"]["gbps"]}
        mine = torch_at.get((p["shape"], p["run_bytes"]), {})
        peers.update({f"torch {k}": mine[k]["gbps"] for k in TORCH_METHODS if k in mine})
        best = max(peers, key=peers.get)
        auto = p["auto"]["gbps"]
        out.append({"shape": p["shape"], "run_bytes": p["run_bytes"], "auto_gbps": auto,
                    "auto_method": p["auto"]["method"], "ceiling_gbps": p["ceiling"]["gbps"],
                    "best_peer": best, "best_peer_gbps": peers[best],
                    "auto_vs_ceiling": auto / p["ceiling"]["gbps"], "auto_vs_best_peer": auto / peers[best]})
    return out


def main():
    total = int(os.environ.get("REFIT_SWEEP_BYTES", 4 * GIB))
    torch.manual_seed(2026)
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(total, dtype=torch.uint8, device="cuda:0")
    device = torch.cuda.get_device_name(0)
    print(f"sweep_peer: {device} ({torch.cuda.device_count()} GPUs), torch {torch.__version__}, "
          f"{total // MIB} MiB per point")

    def checked(name, call, expected):
        dst.fill_(POISON)
        call()
        torch.cuda.synchronize()
        assert torch.equal(dst, expected), f"{name} did not copy byte-exact"

    def per_run_loop(srcs, dsts):
        def call():
            for d, s in zip(dsts, srcs):
                d.copy_(s)
        return call

    rows = []
    for run in sizes():
        for case in cases(src, dst, run, total):
            shape, srcs, dsts, expected = case[:4]
            want = expected()
            warm, reps = (0, 3) if len(srcs) > MANY_RUNS else (2, 10)
            methods = [
                ("_foreach_copy_", lambda: torch._foreach_copy_(dsts, srcs)),
                ("per-run copy_", per_run_loop(srcs, dsts)),
            ]
            if shape == "strided":
                matrix, halves = case[4]

                def blocks():
                    halves[0].copy_(matrix[:, :run])
                    halves[1].copy_(matrix[:, run:])

                methods.append(("column-block copy_", blocks))
            row = {"shape": shape, "run_bytes": run, "runs": len(srcs), "checked": True}
            for name, call in methods:
                checked(f"{shape} {run} B {name}", call, want)
                ms = timed(call, warm, reps)
                row[name] = {"device_ms": ms, "gbps": total / (ms * 1e6)}
            del want
            ms = timed(lambda: dst.copy_(src), 2, 10)
            row["ceiling"] = {"device_ms": ms, "gbps": total / (ms * 1e6)}
            rows.append(row)
            print(f"{shape} runs of {run} B x {len(srcs)}: checked; "
                  + ", ".join(f"{k} {v['gbps']:.0f} GB/s" for k, v in row.items() if isinstance(v, dict)))
            del srcs, dsts, methods

    out_dir = os.environ.get("REFIT_BENCH_RESULTS", "benches/results")
    os.makedirs(out_dir, exist_ok=True)
    # gpu/run.sh runs the Rust benches first: set AUTO beside the best peer of each point.
    combined = []
    sweep_path = os.path.join(out_dir, "gpu_sweep.json")
    if os.path.exists(sweep_path):
        with open(sweep_path) as f:
            combined = combine(json.load(f), rows, total)
    path = os.path.join(out_dir, "sweep_peer.json")
    with open(path, "w") as f:
        json.dump({"bench": "sweep_peer", "torch": torch.__version__, "device": device,
                   "gpus": torch.cuda.device_count(), "payload_bytes": total, "units": "GB/s of payload",
                   "timing": "CUDA events; medians (3 timed calls above 65536 runs, else 10 after 2 warm-up)",
                   "points": rows, "auto_vs_best_peer": combined}, f, indent=2)
    print(f"\nwrote {path}\n")
    if combined:
        print("| shape | run | AUTO GB/s (method) | one large copy | best peer | its GB/s | AUTO / ceiling "
              "| AUTO / best peer |")
        print("|---|---|---|---|---|---|---|---|")
        for c in combined:
            print(f"| {c['shape']} | {label(c['run_bytes'])} | {c['auto_gbps']:.0f} ({c['auto_method']}) "
                  f"| {c['ceiling_gbps']:.0f} | {c['best_peer']} | {c['best_peer_gbps']:.0f} "
                  f"| {c['auto_vs_ceiling']:.3f} | {c['auto_vs_best_peer']:.3f} |")
        print()
    print("| shape | run | runs | torch._foreach_copy_ | per-run copy_ | column-block copy_ | one large copy_ "
          "| best torch / ceiling |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        def rate(name):
            return f"{r[name]['gbps']:.0f}" if name in r else "-"
        best = max(r[k]["gbps"] for k in TORCH_METHODS if k in r)
        print(f"| {r['shape']} | {label(r['run_bytes'])} | {r['runs']} | {rate('_foreach_copy_')} "
              f"| {rate('per-run copy_')} | {rate('column-block copy_')} | {rate('ceiling')} "
              f"| {best / r['ceiling']['gbps']:.3f} |")


if __name__ == "__main__":
    main()
