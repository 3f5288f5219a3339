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
- the overlap curves: a load in a loop on one stream (a bf16 8192^3 GEMM, compute-bound; a bf16
  16 x 8192 by 8192 x 28672 product, memory-bound like decoding), and beside it on another stream
  refit's executor at several SM budgets, or a torch `copy_` loop: refit's payload GB/s against
  the load's slowdown, measured against the same loop alone just before.
Times are CUDA-event medians after warm-up (the per-slice loop includes its host issue time, as a
caller would see it). Sampled slices are compared bit for bit after every method; a difference is
classified (benches/copy_support/bf16_bits.py: NaN payloads only, or other bytes). Writes
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
from copy_support import bf16_bits
from refit import Arm, Backend, Group, Plan, Table
from side_by_side import beside, copy_in_pieces, decode_load, gemm_load

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


def slices_table(slices, pub_base, recv_base):
    """One table offering and needing every slice (byte tensors of shape (count[1], count[0], len))
    at its arena offset from `pub_base` / `recv_base`: the same segments as the bench's plan, at real
    device addresses. Process 0, device 0 on both sides (a local route)."""

    def strides(side):
        inner = side["len"]
        outer = side["stride"][0] if side["count"][0] > 1 else inner
        return [side["stride"][1] if side["count"][1] > 1 else outer * side["count"][0], outer, 1]

    table = Table()
    for i, (so, do, a, b) in enumerate(slices):
        extent = [a["count"][1], a["count"][0], a["len"]]
        t = table.add_tensor(f"slice{i}", extent, 1)
        table.add_offer(t, 0, 0, pub_base + so, [0, 0, 0], extent, strides(a))
        table.add_need(t, 0, 0, recv_base + do, [0, 0, 0], extent, strides(b))
    return table


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

    def exact():
        """What the sampled slices hold against their sources, bit for bit (random bf16 bits include
        NaNs, which never equal themselves as values): bf16_bits.EXACT, NAN_PAYLOADS or WRONG. The
        differing elements' bits come to the host; the others are compared on the GPU."""
        differing = []
        for k in sample:
            got, want = dsts[k].view(torch.int16), srcs[k].view(torch.int16)
            where = got != want
            differing += zip(got[where].tolist(), want[where].tolist())
        return bf16_bits.verdict(differing)

    def check(what):
        found = exact()
        assert found == bf16_bits.EXACT, f"{what}: sampled slices differ from their sources: {found}"

    rows = []

    def row(what, ms, segments, bytes_check=bf16_bits.EXACT):
        """One timed way of moving the slices; a peer whose bytes differ is kept in the table, with
        how they differ, so its time is never read as an exact transfer's."""
        rows.append({"what": what, "ms": ms, "gbps": payload / (ms * 1e6), "segments": segments,
                     "correct": bytes_check == bf16_bits.EXACT, "bytes_check": bytes_check})

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

    # refit through the Python binding, on the same slices placed in torch's arenas. An executor
    # is created over memory of the device only (its addresses are checked against the driver's
    # allocations), so the bench's tables, written with made-up arena bases, are replanned as one
    # table whose every slice is a tensor at its real address; the planner coalesces them as it
    # coalesces the original tensors (adjacent in memory on both sides).
    group = Group([0], backend=Backend.CUDA)
    plan = Plan.build([slices_table(slices, pub.data_ptr(), recv.data_ptr())])

    def executor(**options):
        return plan.executor(group, 0, **options)

    with executor() as ex:
        recv.fill_(0xAB)
        ex.run()
        check("refit executor")
        steps = [ex.run() for _ in range(5)]
        refit_ms = statistics.median(s.device_ns for s in steps) / 1e6
        segments = sum(steps[0].segments)
    row("refit executor via the Python binding (AUTO)", refit_ms, segments)

    # Overlap: a load's loop on one stream, a refit or a copy loop beside it on another.
    side = torch.cuda.Stream()

    curve = []

    def point(work, what, budget, alone_gbps, step_ms, step_bytes, enqueue_step):
        m = beside(work, side, step_ms, step_bytes, enqueue_step)
        curve.append({"load": work.name, "what": what, "sm_budget": budget, "alone_gbps": alone_gbps,
                      "beside_gbps": m["gbps"], "load_baseline_ms": m["baseline_ms"],
                      "beside_gbps_is_bound": m["gbps_bound"], "load_slowdown": m["slowdown"]})

    def control(work):
        """The method's own noise: a second of the load against the second just before it."""
        calls = math.ceil(1000 / work.short_ms)
        first = work.ms_per_call(calls)
        curve.append({"load": work.name, "what": "nothing (control: the loop against itself)", "sm_budget": None,
                      "alone_gbps": 0.0, "beside_gbps": 0.0, "load_baseline_ms": first,
                      "beside_gbps_is_bound": False, "load_slowdown": work.ms_per_call(calls) / first - 1})

    def refit_beside(work, what, budget, **options):
        with executor(sm_budget=budget, **options) as ex:
            ex.run()
            step_ms = statistics.median(ex.run().device_ns for _ in range(2)) / 1e6
            point(work, what, budget, payload / (step_ms * 1e6), step_ms, payload, lambda: ex.run(stream=side))

    chunk = min(payload, 2 * GIB)

    def torch_copy_in(piece):
        """One step: `chunk` bytes by torch `copy_` on `side`, in copies of `piece` bytes."""
        return copy_in_pieces(recv, pub, side, chunk, piece)

    pieces = [64 << 20, 256 << 20, 1 << 30, chunk]
    with torch.cuda.stream(side):  # timed_ms's events on the stream the steps use
        pieces_ms = {piece: timed_ms(torch_copy_in(piece)) for piece in pieces}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gemm, gemm_eager, decode = gemm_load(), gemm_load(graphed=False), decode_load()
    # Per load: the kernel's SM budgets (0: none), AUTO's (every run by the copy engine, in 64 MiB
    # copies paced to budget x 50 GB/s), and torch's piece sizes.
    plans = [
        (gemm, (0, sms, sms // 2, sms // 4, sms // 8, sms // 16), (8, 16, 24, 32, 48), pieces),
        (gemm_eager, (sms // 4, sms // 8), (8, 24, 48), (64 << 20, chunk)),
        (decode, (0, sms // 8), (8, 16, 24, 48), (64 << 20, chunk)),
    ]
    for work, kernel_budgets, auto_budgets, torch_pieces in plans:
        control(work)
        for budget in kernel_budgets:
            refit_beside(work, "refit executor, KERNEL", budget, arm=Arm.KERNEL)
        for budget in auto_budgets:
            refit_beside(work, "refit executor, AUTO (paced copy engine)", budget)
        for piece in torch_pieces:
            what = "torch copy_ (2 GiB)" if piece == chunk else f"torch copy_, 2 GiB in {piece >> 20} MiB pieces"
            point(work, what, None, chunk / (pieces_ms[piece] * 1e6), pieces_ms[piece], chunk, torch_copy_in(piece))
    plan.close()
    group.close()

    print(f"refit_peer: {len(slices)} slices, {payload} bytes of payload, torch {torch.__version__}, "
          f"refit {refit.version()}")
    print("\n| what | segments | ms | GB/s of payload | vs one large copy |")
    print("|---|---|---|---|---|")
    for r in rows:
        what = r["what"] if r["correct"] else f"{r['what']} (bytes: {r['bytes_check']})"
        print(f"| {what} | {r['segments']} | {r['ms']:.2f} | {r['gbps']:.0f} | {r['gbps'] / rows[0]['gbps']:.3f} |")
    for work, *_ in plans:
        print(f"\nOverlap beside {work.name} in a loop on another stream ({work.short_ms:.3f} ms per call in a"
              " short loop); GB/s of the steps that ended inside the loop (< : a bound, fewer than two did); the"
              " load's slowdown against the same loop alone just before:")
        print("| beside it | SM budget | GB/s alone | GB/s beside it | load ms per call alone | load slowdown |")
        print("|---|---|---|---|---|---|")
        for p in curve:
            if p["load"] != work.name:
                continue
            budget = "-" if p["sm_budget"] is None else ("none" if p["sm_budget"] == 0 else p["sm_budget"])
            rate = ("< " if p["beside_gbps_is_bound"] else "") + f"{p['beside_gbps']:.0f}"
            print(f"| {p['what']} | {budget} | {p['alone_gbps']:.0f} | {rate} | "
                  f"{p['load_baseline_ms']:.3f} | {100 * p['load_slowdown']:.1f}% |")

    out_dir = os.environ.get("REFIT_BENCH_RESULTS", "benches/results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "refit_peer.json"), "w") as f:
        json.dump({"bench": "refit_peer", "torch": torch.__version__, "units": "GB/s of payload",
                   "device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                   "slices": len(slices), "payload_bytes": payload, "rows": rows,
                   "overlap": curve}, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
