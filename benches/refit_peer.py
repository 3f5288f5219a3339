"""The peer columns of benches/gpu_refit.rs, and the overlap curve, on one GPU.

Reads the tables benches/gpu_refit.rs wrote (the demo's Qwen3-30B-A3B refit, EP1 -> TP1 on one
device, at arena-relative addresses) from the temporary directory, allocates the two arenas with
torch, and measures in one run:
- torch, one `copy_` per needed slice (the slices of the uncoalesced plan, as BF16 views);
- torch, `_foreach_copy_` of the same slices; and staging plus `_foreach_copy_` (whole publisher
  buffers pulled into a 4 GiB staging buffer chunk by chunk, then re-sliced from there);
- one large `copy_` of the same number of bytes (the ceiling);
- refit's executor through the Python binding on the same tables (rebound from the fake arena
  bases to torch's arenas);
- the overlap curve: a bf16 8192^3 GEMM loop on one stream, and beside it on another stream
  refit's executor at several SM budgets, or a torch `copy_` loop: refit's payload GB/s against
  the GEMM's slowdown.
Times are CUDA-event medians after warm-up (the per-slice loop includes its host issue time, as a
caller would see it). Sampled slices are compared byte-exact after every method. Writes
$REFIT_BENCH_RESULTS/refit_peer.json and prints markdown tables.
"""

import bisect
import json
import math
import os
import statistics
import sys
import tempfile

import torch

import refit
from refit import Arm, Backend, Group, Plan, Table

GIB = 1 << 30
STAGING = 4 * GIB


def load():
    tmp = tempfile.gettempdir()
    try:
        with open(os.path.join(tmp, "refit_bench_layout.json")) as f:
            layout = json.load(f)
        with open(os.path.join(tmp, "refit_bench_tables.bin"), "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        sys.exit("refit_peer: run benches/gpu_refit first (it writes the tables this bench reads)")
    tables, at = [], 0
    while at < len(blob):
        n = int.from_bytes(blob[at : at + 8], "little")
        tables.append(Table.decode(blob[at + 8 : at + 8 + n]))
        at += 8 + n
    return layout, tables


def timed_ms(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def bf16_view(arena16, offset, segment):
    """The BF16 view of one segment side: (count[1], count[0], len / 2) at byte `offset`."""
    stride = segment["stride"]
    return arena16.as_strided(
        (segment["count"][1], segment["count"][0], segment["len"] // 2), (stride[1] // 2, stride[0] // 2, 1), offset // 2
    )


def main():
    layout, tables = load()
    fake_pub, fake_recv = layout["fake_publisher_base"], layout["fake_receiver_base"]
    pub = torch.empty(layout["publisher_arena"], dtype=torch.uint8, device="cuda")
    pub.view(torch.int32).random_()
    recv = torch.empty(layout["receiver_arena"], dtype=torch.uint8, device="cuda")
    pub16, recv16 = pub.view(torch.bfloat16), recv.view(torch.bfloat16)

    # The slices: the uncoalesced plan's segments, as arena offsets.
    slices = []
    with Plan.build(tables, coalesce=False) as uncoalesced:
        for route in uncoalesced.routes():
            for s in route.segments:
                assert all(v % 2 == 0 for v in (s.src, s.dst, s.len, *s.src_stride, *s.dst_stride)), s
                slices.append(
                    (
                        s.src - fake_pub,
                        s.dst - fake_recv,
                        {"len": s.len, "count": s.count, "stride": s.src_stride},
                        {"len": s.len, "count": s.count, "stride": s.dst_stride},
                    )
                )
    payload = sum(a["len"] * a["count"][0] * a["count"][1] for _, _, a, _ in slices)
    srcs = [bf16_view(pub16, so, a) for so, _, a, _ in slices]
    dsts = [bf16_view(recv16, do, b) for _, do, _, b in slices]
    sample = list(range(0, len(slices), max(1, len(slices) // 64)))

    def exact(sources=srcs):
        """Whether the sampled slices hold their sources' bits (random bf16 bits include NaNs,
        which never equal themselves as values)."""
        return all(torch.equal(dsts[k].view(torch.int16), sources[k].view(torch.int16)) for k in sample)

    def check(what, sources=srcs):
        assert exact(sources), f"{what}: a sampled slice differs from its source"

    rows = []

    def row(what, ms, segments, correct=True):
        """One timed way of moving the slices; a peer that installs wrong bytes is kept in the table,
        marked, so its time is never read as a correct transfer's."""
        rows.append({"what": what, "ms": ms, "gbps": payload / (ms * 1e6), "segments": segments, "correct": correct})

    recv.fill_(0xAB)
    ceiling_ms = timed_ms(lambda: recv[:payload].copy_(pub[:payload]))
    row("one large copy_ (ceiling)", ceiling_ms, 1)

    def per_slice():
        for d, s in zip(dsts, srcs):
            d.copy_(s)

    recv.fill_(0xAB)
    row("torch copy_ per slice", timed_ms(per_slice), len(slices))
    check("copy_ per slice")
    recv.fill_(0xAB)
    ms = timed_ms(lambda: torch._foreach_copy_(dsts, srcs))
    row("torch _foreach_copy_", ms, len(slices), exact())

    # Staging: whole publisher buffers, in chunks of at most STAGING bytes, then one re-slice each.
    buffers = sorted(tuple(b) for b in layout["publisher_buffers"])
    starts = [b[0] for b in buffers]
    chunks = []
    for offset, size in buffers:
        if chunks and offset + size - chunks[-1][0] <= STAGING:
            chunks[-1][1] = offset + size
        else:
            chunks.append([offset, offset + size])
    staging16 = torch.empty(STAGING, dtype=torch.uint8, device="cuda").view(torch.bfloat16)
    by_chunk = [([], []) for _ in chunks]
    chunk_starts = [c[0] for c in chunks]
    for (so, _, a, _), d in zip(slices, dsts):
        buffer = buffers[bisect.bisect_right(starts, so) - 1]
        c = bisect.bisect_right(chunk_starts, buffer[0]) - 1
        by_chunk[c][0].append(d)
        by_chunk[c][1].append(bf16_view(staging16, so - chunks[c][0], a))

    def staged():
        for (lo, hi), (chunk_dsts, chunk_srcs) in zip(chunks, by_chunk):
            staging16[: (hi - lo) // 2].copy_(pub16[lo // 2 : hi // 2])
            torch._foreach_copy_(chunk_dsts, chunk_srcs)

    recv.fill_(0xAB)
    ms = timed_ms(staged)
    row(f"staging ({STAGING >> 30} GiB chunks) + _foreach_copy_", ms, len(slices), exact())
    del staging16

    # refit through the Python binding, on the same tables moved onto torch's arenas.
    group = Group([0], backend=Backend.CUDA)
    plan = Plan.build(tables)

    def executor(**options):
        ex = plan.executor(group, 0, **options)
        ex.rebind(0, fake_pub, pub.data_ptr(), layout["publisher_arena"])
        ex.rebind(0, fake_recv, recv.data_ptr(), layout["receiver_arena"])
        return ex

    with executor() as ex:
        recv.fill_(0xAB)
        ex.run()
        check("refit executor")
        steps = [ex.run() for _ in range(5)]
        refit_ms = statistics.median(s.device_ns for s in steps) / 1e6
        segments = sum(steps[0].segments)
    row("refit executor via the Python binding (AUTO)", refit_ms, segments)

    # Overlap: a GEMM loop on one stream, a copy loop beside it on another.
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(8192, 8192, dtype=torch.bfloat16, device="cuda")
    gemm_stream, side = torch.cuda.Stream(), torch.cuda.Stream()

    def gemm_loop(n):
        with torch.cuda.stream(gemm_stream):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                torch.matmul(a, b, out=c)
            stop.record()
        return start, stop

    def gemm_alone():
        gemm_loop(5)
        torch.cuda.synchronize()
        start, stop = gemm_loop(50)
        stop.synchronize()
        return start.elapsed_time(stop) / 50

    alone = gemm_alone()

    def beside(step_ms, step_bytes, enqueue_step):
        """GEMMs and `enqueue_step` (on `side`) for about a second each, side by side."""
        steps = max(2, math.ceil(1000 / step_ms))
        gemms = max(10, math.ceil(steps * step_ms / alone))
        g_start, g_stop = gemm_loop(gemms)
        s_start, s_stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s_start.record(side)
        for _ in range(steps):
            enqueue_step()
        s_stop.record(side)
        torch.cuda.synchronize()
        per_gemm = g_start.elapsed_time(g_stop) / gemms
        return steps * step_bytes / (s_start.elapsed_time(s_stop) * 1e6), per_gemm / alone - 1

    curve = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for budget in (0, sms, sms // 2, sms // 4, sms // 8, sms // 16, 8, 4):
        with executor(arm=Arm.KERNEL, sm_budget=budget) as ex:
            ex.run()
            step_ms = statistics.median(ex.run().device_ns for _ in range(2)) / 1e6
            gbps, slowdown = beside(step_ms, payload, lambda: ex.run(stream=side))
        curve.append({"what": "refit executor", "sm_budget": budget, "alone_gbps": payload / (step_ms * 1e6),
                      "beside_gemm_gbps": gbps, "gemm_slowdown": slowdown})
    # AUTO under an SM budget: every run by the copy engine, in 64 MiB copies paced to budget x 50 GB/s.
    for budget in (8, 12, 16, 24):
        with executor(sm_budget=budget) as ex:
            ex.run()
            step_ms = statistics.median(ex.run().device_ns for _ in range(2)) / 1e6
            gbps, slowdown = beside(step_ms, payload, lambda: ex.run(stream=side))
        curve.append({"what": "refit executor, AUTO (paced copy engine)", "sm_budget": budget,
                      "alone_gbps": payload / (step_ms * 1e6), "beside_gemm_gbps": gbps, "gemm_slowdown": slowdown})
    chunk = min(payload, 2 * GIB)
    piece = 64 << 20

    def copy_pieces():
        for off in range(0, chunk, piece):
            recv[off:off + piece].copy_(pub[off:off + piece])

    def torch_pieces():
        with torch.cuda.stream(side):
            copy_pieces()

    pieces_ms = timed_ms(copy_pieces)
    gbps, slowdown = beside(pieces_ms, chunk, torch_pieces)
    curve.append({"what": "torch copy_, 2 GiB in 64 MiB pieces", "sm_budget": None,
                  "alone_gbps": chunk / (pieces_ms * 1e6), "beside_gemm_gbps": gbps, "gemm_slowdown": slowdown})

    def torch_copy():
        with torch.cuda.stream(side):
            recv[:chunk].copy_(pub[:chunk])

    copy_ms = timed_ms(lambda: recv[:chunk].copy_(pub[:chunk]))
    gbps, slowdown = beside(copy_ms, chunk, torch_copy)
    curve.append({"what": "torch copy_ (2 GiB)", "sm_budget": None, "alone_gbps": chunk / (copy_ms * 1e6),
                  "beside_gemm_gbps": gbps, "gemm_slowdown": slowdown})
    plan.close()
    group.close()

    print(f"refit_peer: {len(slices)} slices, {payload} bytes of payload, torch {torch.__version__}, "
          f"refit {refit.version()}")
    print("\n| what | segments | ms | GB/s of payload | vs one large copy |")
    print("|---|---|---|---|---|")
    for r in rows:
        what = r["what"] if r["correct"] else f"{r['what']} (WRONG BYTES: sampled slices differ)"
        print(f"| {what} | {r['segments']} | {r['ms']:.2f} | {r['gbps']:.0f} | {r['gbps'] / rows[0]['gbps']:.3f} |")
    print(f"\nOverlap: a bf16 8192^3 GEMM loop alone takes {alone:.3f} ms per GEMM; beside it on another stream:")
    print("| beside the GEMM | SM budget | GB/s alone | GB/s beside the GEMM | GEMM slowdown |")
    print("|---|---|---|---|---|")
    for p in curve:
        budget = "-" if p["sm_budget"] is None else ("none" if p["sm_budget"] == 0 else p["sm_budget"])
        print(f"| {p['what']} | {budget} | {p['alone_gbps']:.0f} | {p['beside_gemm_gbps']:.0f} | "
              f"{100 * p['gemm_slowdown']:.1f}% |")

    out_dir = os.environ.get("REFIT_BENCH_RESULTS", "benches/results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "refit_peer.json"), "w") as f:
        json.dump({"bench": "refit_peer", "torch": torch.__version__, "units": "GB/s of payload",
                   "slices": len(slices), "payload_bytes": payload, "rows": rows,
                   "gemm_alone_ms": alone, "overlap": curve}, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
