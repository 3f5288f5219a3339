"""Probe: does splitting one peer copy over several copy-engine streams ("lanes") beat one stream?

For GPU0 <-> GPU1 at once (both directions, as in a 2-GPU allgather) and one direction alone, per
block size: the block is cut into `lanes` equal chunks, each on its own non-blocking stream forked
from and joined back into the issuing device's main stream every iteration (what the allgather does),
pulled (issued by the receiver), pushed (issued by the sender), or mixed (even chunks pushed, odd
chunks pulled: both GPUs' copy engines on each direction). GPU-timed with events on the main
streams after a spin gate, so the host has queued every iteration before the copies start.
Prints a markdown table of GB/s per direction; JSON to $REFIT_BENCH_RESULTS/ce_lanes_probe.json.
"""


import cupy as cp
from cupy.cuda import runtime as rt
from probe_util import MIB, enable_peers, timed, write_results


class Side:
    """One device's buffers, main stream and lanes."""

    def __init__(self, device, size, max_lanes):
        self.device = device
        with cp.cuda.Device(device):
            self.src = cp.random.randint(0, 256, size, dtype=cp.uint8)
            self.dst = cp.zeros(size, dtype=cp.uint8)
            self.main = cp.cuda.Stream(non_blocking=True)
            self.lanes = [cp.cuda.Stream(non_blocking=True) for _ in range(max_lanes)]
            self.fork = cp.cuda.Event(disable_timing=True)
            self.joins = [cp.cuda.Event(disable_timing=True) for _ in range(max_lanes)]


def issuer_of(src, dst, chunk, mode):
    if mode == "mixed":
        return src if chunk % 2 == 0 else dst
    return src if mode == "push" else dst


def issue(sides, directions, size, lanes, mode):
    """One iteration: every direction's block cut into `lanes` chunks on lane streams. Every issuer
    forks once before any copy and joins once after all of them, so that directions never wait on
    each other."""
    chunk = size // lanes
    issuers = sorted({issuer_of(s, d, i, mode) for s, d in directions for i in range(lanes)})
    for device in issuers:
        with cp.cuda.Device(device):
            sides[device].fork.record(sides[device].main)
    joins = []
    for src, dst in directions:
        for i in range(lanes):
            issuer = sides[issuer_of(src, dst, i, mode)]
            # Lane index i of direction (src, dst): no two copies of one issuer share a lane.
            k = i if (src, dst) == directions[0] else lanes + i
            with cp.cuda.Device(issuer.device):
                lane = issuer.lanes[k]
                lane.wait_event(issuer.fork)
                off = i * chunk
                rt.memcpyPeerAsync(
                    sides[dst].dst.data.ptr + off,
                    dst,
                    sides[src].src.data.ptr + off,
                    src,
                    chunk,
                    lane.ptr,
                )
                issuer.joins[k].record(lane)
                joins.append((issuer, k))
    for issuer, k in joins:
        with cp.cuda.Device(issuer.device):
            issuer.main.wait_event(issuer.joins[k])


def measure(sides, directions, size, lanes, mode, iters):
    """GB/s per direction of `iters` iterations back to back, timed on the issuers' main streams."""
    issuers = sorted({issuer_of(s, d, i, mode) for s, d in directions for i in range(lanes)})
    streams = [(dev, sides[dev].main) for dev in issuers]
    seconds = timed(streams, lambda: [issue(sides, directions, size, lanes, mode) for _ in range(iters)])
    return size * iters / seconds / 1e9


def main():
    if cp.cuda.runtime.getDeviceCount() < 2:
        print("ce_lanes_probe: needs two GPUs")
        return
    enable_peers()
    top = 1024 * MIB
    max_lanes = 8
    sides = [Side(0, top, 2 * max_lanes), Side(1, top, 2 * max_lanes)]
    rows = []
    for both in (True, False):
        directions = [(0, 1), (1, 0)] if both else [(0, 1)]
        for size in (16 * MIB, 64 * MIB, 256 * MIB, 1024 * MIB):
            iters = max(5, min(40, (4096 * MIB) // size))
            for mode in ("pull", "push", "mixed"):
                for lanes in (1, 2, 4, 8):
                    if mode == "mixed" and lanes == 1:
                        continue
                    gbps = measure(sides, directions, size, lanes, mode, iters)
                    rows.append(
                        {
                            "directions": "both" if both else "0->1",
                            "size_mib": size // MIB,
                            "mode": mode,
                            "lanes": lanes,
                            "gbps_per_direction": round(gbps, 1),
                        }
                    )
    # Correctness of the last copy (one direction, 8 lanes or whichever ran last): bytes match.
    with cp.cuda.Device(1):
        assert bool((sides[1].dst == cp.asarray(sides[0].src.get(), dtype=cp.uint8)).all()), "copy mismatch"
    print("| directions | MiB | mode | lanes=1 | 2 | 4 | 8 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    keyed = {}
    for r in rows:
        keyed.setdefault((r["directions"], r["size_mib"], r["mode"]), {})[r["lanes"]] = r["gbps_per_direction"]
    for (dirs, mib, mode), by_lanes in keyed.items():
        cells = " | ".join(f"{by_lanes[k]:.1f}" if k in by_lanes else "-" for k in (1, 2, 4, 8))
        print(f"| {dirs} | {mib} | {mode} | {cells} |")
    write_results("ce_lanes_probe", {"rows": rows})


if __name__ == "__main__":
    main()
