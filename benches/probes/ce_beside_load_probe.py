"""Why does the copy engine move so little beside a GEMM, and what would move 600 GB/s beside it at a
cost of 10% or less?

Beside a CUDA-graph loop of cuBLAS's 8192^3 bf16 GEMM, same-device copies in 64 MiB pieces moved
about 118 GB/s (1,850 alone), though such a copy needs no SM (copy_needs_sms_probe). Three parts:

1. A timeline: 64 MiB pieces with an event after each, beside a loop of GEMMs with an event after
   each. Are the pieces uniformly slow (the engine starved of bandwidth while a GEMM runs), or fast in
   some places and stalled in others (waiting for something between GEMMs)?
2. 64 MiB pieces beside loads that stress one resource each: a kernel that holds every SM and touches
   no memory, one that reads a buffer that fits in L2 over and over, one that streams from HBM (as
   decoding does), and the GEMM. Which resource starves the engine?
3. Beside the GEMM, copy variants: piece sizes; pieces spread over 2 and 4 streams (more engines);
   the pieces in one cuMemcpyBatchAsync, with and without the prefer-overlap-with-compute hint; a copy
   kernel of 48 blocks of 512 threads (the best kernel shape at 10% or less in overlap_probe) on a
   normal and a high-priority stream (priority orders blocks waiting for an SM; CUDA says it does not
   apply to copies); and that kernel and the copy engine together, on two streams.

Rates count only the steps that ended inside the load's loop (benches/side_by_side.py). Writes
$REFIT_BENCH_RESULTS/ce_beside_load_probe.json.
"""

import ctypes
import statistics

import cupy as cp
import torch

from probe_util import MIB, print_table, write_results
from side_by_side import Load, beside, decode_load, gemm_load, timing_event

GIB = 1 << 30
STEP = 2 * GIB
SOURCE = r"""
typedef unsigned long long u64;
struct __align__(16) V16 { u64 lo, hi; };

// Holds its SM for `ns` nanoseconds and touches no memory (launched with enough shared memory that
// no other block fits beside it).
extern "C" __global__ void hold(u64 ns) {
    u64 start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}

// Reads `n` vectors `rounds` times over (a buffer that fits in L2), keeping an XOR so the loads stay;
// it writes only if the XOR is all ones, which the caller's data never gives.
extern "C" __global__ void reread(const V16* __restrict__ s, long long n, int rounds, u64* sink) {
    u64 acc = 0;
    for (int r = 0; r < rounds; ++r)
        for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
            V16 v = s[i];
            acc ^= v.lo ^ v.hi;
        }
    if (acc == ~0ull) sink[0] = acc;
}

extern "C" __global__ void copy16(const V16* __restrict__ s, V16* __restrict__ d, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        d[i] = s[i];
}
"""
HOLD, REREAD, COPY16 = (cp.RawKernel(SOURCE, name) for name in ("hold", "reread", "copy16"))


def on_current_stream():
    """The torch stream current now, as a cupy stream (cupy kernels queued where torch would queue)."""
    return cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)


def hold_load(sms, smem):
    """Every SM held 1 ms per call by one block each, no memory touched."""
    HOLD.max_dynamic_shared_size_bytes = smem
    return Load("hold every SM, no memory (1 ms)",
                lambda: HOLD((sms,), (1024,), (cp.uint64(1_000_000),), stream=on_current_stream(), shared_mem=smem),
                graph_ms=None)


def l2_load(sms):
    """Every SM re-reading a 24 MiB buffer 300 times per call (it fits in the 50 MB L2): traffic that
    stays between the SMs and L2."""
    buf = torch.empty(24 * MIB, dtype=torch.uint8, device="cuda")
    sink = torch.zeros(1, dtype=torch.int64, device="cuda")
    n = buf.numel() // 16

    def call():
        REREAD((2 * sms,), (1024,), (buf.data_ptr(), cp.int64(n), cp.int32(300), sink.data_ptr()),
               stream=on_current_stream())
    return Load("re-read a 24 MiB buffer from L2, every SM", call, graph_ms=None)


def fork_join(side, lanes, queue):
    """Queues `queue()` on streams `lanes`, which start after what `side` has queued so far and which
    `side` then waits for: a step of several streams that is one step on `side`."""
    go = timing_event()
    go.record(side)
    for lane in lanes:
        lane.wait_event(go)
    queue()
    for lane in lanes:
        done = timing_event()
        done.record(lane)
        side.wait_event(done)


class Pieces:
    """`nbytes` from `src` to `dst` by cudaMemcpyAsync (torch `copy_`) in pieces of `piece` bytes, dealt
    round-robin over the streams `lanes`."""

    def __init__(self, src, dst, piece, lanes):
        self.src, self.dst, self.piece, self.lanes = src, dst, piece, lanes

    def queue(self, nbytes=STEP, first=0):
        for k, off in enumerate(range(first, first + nbytes, self.piece)):
            n = min(self.piece, first + nbytes - off)
            with torch.cuda.stream(self.lanes[k % len(self.lanes)]):
                self.dst[off:off + n].copy_(self.src[off:off + n])


class KernelCopy:
    """`nbytes` by the plain copy kernel of `blocks` x `threads` on stream `lane`."""

    def __init__(self, src, dst, blocks, threads, lane):
        self.src, self.dst, self.shape, self.lanes = src, dst, (blocks, threads), [lane]

    def queue(self, nbytes=STEP, first=0):
        blocks, threads = self.shape
        COPY16((blocks,), (threads,),
               (self.src.data_ptr() + first, self.dst.data_ptr() + first, cp.int64(nbytes // 16)),
               stream=cp.cuda.ExternalStream(self.lanes[0].cuda_stream))


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes of CUDA 13.0's cuda.h."""
    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_hint", MemLocation), ("dst_loc_hint", MemLocation),
                ("flags", ctypes.c_uint)]


SRC_ACCESS_ORDER_STREAM, LOCATION_DEVICE, PREFER_OVERLAP_WITH_COMPUTE = 1, 1, 1


class BatchPieces:
    """`nbytes` in pieces of `piece` bytes, all in one cuMemcpyBatchAsync on stream `lane`, with the
    prefer-overlap-with-compute hint or without (NVIDIA/nccl#2177 reports about 87 GiB/s for
    device-local copies with the hint, on no SM)."""

    def __init__(self, src, dst, piece, lane, prefer_overlap):
        self.src, self.dst, self.piece, self.lanes = src, dst, piece, [lane]
        self.call = ctypes.CDLL("libcuda.so.1").cuMemcpyBatchAsync_v2
        size_p = ctypes.POINTER(ctypes.c_size_t)
        self.call.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), size_p, ctypes.c_size_t,
                              ctypes.POINTER(MemcpyAttributes), size_p, ctypes.c_size_t, ctypes.c_void_p]
        self.call.restype = ctypes.c_int
        device = torch.cuda.current_device()
        here = MemLocation(LOCATION_DEVICE, device)
        self.attrs = MemcpyAttributes(SRC_ACCESS_ORDER_STREAM, here, here,
                                      PREFER_OVERLAP_WITH_COMPUTE if prefer_overlap else 0)

    def queue(self, nbytes=STEP, first=0):
        offs = range(first, first + nbytes, self.piece)
        sizes = [min(self.piece, first + nbytes - off) for off in offs]
        count = len(sizes)
        dsts = (ctypes.c_uint64 * count)(*(self.dst.data_ptr() + off for off in offs))
        srcs = (ctypes.c_uint64 * count)(*(self.src.data_ptr() + off for off in offs))
        lens = (ctypes.c_size_t * count)(*sizes)
        index = (ctypes.c_size_t * 1)(0)
        status = self.call(dsts, srcs, lens, count, ctypes.byref(self.attrs), index, 1,
                           ctypes.c_void_p(self.lanes[0].cuda_stream))
        if status != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed: CUresult {status}")


def alone_ms(side, step, reps=3):
    """Median ms of `step()` on `side` with nothing beside it."""
    step()
    samples = []
    for _ in range(reps):
        start, stop = timing_event(), timing_event()
        start.record(side)
        step()
        stop.record(side)
        stop.synchronize()
        samples.append(start.elapsed_time(stop))
    return statistics.median(samples)


def bf16_gemm():
    """cuBLAS's 8192^3 bf16 GEMM as one call (torch.matmul), launched one by one."""
    a, b, c = (torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    return lambda: torch.matmul(a, b, out=c)


def timeline(src, dst, side, call, calls=100, pieces=150, piece=64 * MIB):
    """Part 1: `calls` calls of `call` launched one by one with an event after each; from the fifth on,
    `pieces` copies of `piece` bytes on `side` with an event after each. Returns per-piece and
    per-call times."""
    load = torch.cuda.Stream()
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    origin = timing_event()
    origin.record(load)
    call_ends = []
    with torch.cuda.stream(load):
        for i in range(calls):
            call()
            call_ends.append(timing_event())
            call_ends[-1].record(load)
            if i == 4:
                side.wait_event(call_ends[-1])
    piece_ends = [timing_event()]
    piece_ends[0].record(side)
    with torch.cuda.stream(side):
        for k in range(pieces):
            off = (k % (src.numel() // piece)) * piece
            dst[off:off + piece].copy_(src[off:off + piece])
            piece_ends.append(timing_event())
            piece_ends[-1].record(side)
    torch.cuda.synchronize()
    call_t = [origin.elapsed_time(e) for e in call_ends]
    piece_t = [origin.elapsed_time(e) for e in piece_ends]
    piece_ms = [later - earlier for earlier, later in zip(piece_t, piece_t[1:])]
    call_ms = [later - earlier for earlier, later in zip(call_t, call_t[1:])]
    # Calls wholly before the copies began, and those wholly inside them.
    before = [ms for ms, end in zip(call_ms, call_t[1:]) if end <= piece_t[0]]
    during = [ms for ms, (start, end) in zip(call_ms, zip(call_t, call_t[1:])) if piece_t[0] <= start and end <= piece_t[-1]]
    q = statistics.quantiles(piece_ms, n=10)
    result = {"piece_bytes": piece, "pieces": pieces, "piece_ms_p10": q[0], "piece_ms_p50": statistics.median(piece_ms),
              "piece_ms_p90": q[-1], "piece_ms_max": max(piece_ms), "piece_ms_min": min(piece_ms),
              "copies_gbps": pieces * piece / ((piece_t[-1] - piece_t[0]) * 1e6),
              "gemm_ms_before": statistics.median(before) if before else None,
              "gemm_ms_during": statistics.median(during) if during else None,
              "gemms_during": len(during), "piece_ms": piece_ms}
    print({k: v for k, v in result.items() if k != "piece_ms"}, flush=True)
    return result


def main():
    torch.cuda.init()
    props = cp.cuda.runtime.getDeviceProperties(0)
    sms, smem = props["multiProcessorCount"], props["sharedMemPerBlockOptin"]
    src = torch.randint(0, 255, (STEP,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(STEP, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()

    line = timeline(src, dst, side, bf16_gemm())

    rows = []

    def point(load, what, copiers):
        """`copiers` (Pieces and KernelCopy, each with the bytes it moves, laid end to end from offset
        0) as one step on `side`, beside `load`."""
        lanes = [lane for copier, _ in copiers for lane in copier.lanes]
        firsts = [sum(n for _, n in copiers[:k]) for k in range(len(copiers))]

        def queue():
            for (copier, n), first in zip(copiers, firsts):
                copier.queue(n, first)

        def step():
            fork_join(side, lanes, queue)
        ms = alone_ms(side, step)
        m = beside(load, side, ms, STEP, step)
        row = {"load": load.name, "copy": what, "alone_gbps": STEP / (ms * 1e6), "beside_gbps": m["gbps"],
               "beside_gbps_is_bound": m["gbps_bound"], "load_ms_alone": m["baseline_ms"],
               "load_slowdown": m["slowdown"]}
        rows.append(row)
        print(row, flush=True)
        return row

    streams = [torch.cuda.Stream() for _ in range(4)]
    pieces64 = Pieces(src, dst, 64 * MIB, streams[:1])
    gemm = gemm_load()
    for load in (hold_load(sms, smem), l2_load(sms), decode_load(), gemm):
        point(load, "64 MiB pieces", [(pieces64, STEP)])
    for piece in (4 * MIB, 16 * MIB, 256 * MIB):
        point(gemm, f"{piece >> 20} MiB pieces", [(Pieces(src, dst, piece, streams[:1]), STEP)])
    for lanes in (2, 4):
        point(gemm, f"64 MiB pieces over {lanes} streams", [(Pieces(src, dst, 64 * MIB, streams[:lanes]), STEP)])
    for prefer in (False, True):
        what = "64 MiB pieces in one cuMemcpyBatchAsync" + (", prefer overlap with compute" if prefer else "")
        point(gemm, what, [(BatchPieces(src, dst, 64 * MIB, streams[0], prefer), STEP)])

    kernel = KernelCopy(src, dst, 48, 512, streams[0])
    k_row = point(gemm, "copy kernel 48 x 512", [(kernel, STEP)])
    high = KernelCopy(src, dst, 48, 512, torch.cuda.Stream(priority=-1))
    point(gemm, "copy kernel 48 x 512, high-priority stream", [(high, STEP)])
    # Both at once, each on its own stream, the kernel taking the share their rates beside the GEMM
    # give it, so that they end together.
    ce_rate = next(r["beside_gbps"] for r in rows if r["load"] == gemm.name and r["copy"] == "64 MiB pieces")
    share = k_row["beside_gbps"] / (k_row["beside_gbps"] + ce_rate)
    k_bytes = min(STEP - 64 * MIB, max(64 * MIB, int(STEP * share) // (64 * MIB) * (64 * MIB)))
    point(gemm, f"copy kernel 48 x 512 on {k_bytes >> 20} MiB, 64 MiB pieces on the rest",
          [(kernel, k_bytes), (Pieces(src, dst, 64 * MIB, streams[1:2]), STEP - k_bytes)])

    torch.cuda.synchronize()
    exact = bool(torch.equal(src, dst))
    print(f"\nce_beside_load_probe: {sms} SMs, torch {torch.__version__}; last copy byte-exact: {exact}")
    print("\nTimeline beside GEMMs launched one by one (ms per 64 MiB piece):")
    print_table(["piece p10", "p50", "p90", "max", "copies GB/s", "GEMM ms before", "GEMM ms during"],
                [[f"{line['piece_ms_p10']:.3f}", f"{line['piece_ms_p50']:.3f}", f"{line['piece_ms_p90']:.3f}",
                  f"{line['piece_ms_max']:.3f}", f"{line['copies_gbps']:.0f}", f"{line['gemm_ms_before'] or 0:.3f}",
                  f"{line['gemm_ms_during'] or 0:.3f}"]])
    print_table(["load", "copy", "GB/s alone", "GB/s beside", "load ms alone", "load slowdown"],
                [[r["load"], r["copy"], f"{r['alone_gbps']:.0f}",
                  ("< " if r["beside_gbps_is_bound"] else "") + f"{r['beside_gbps']:.0f}",
                  f"{r['load_ms_alone']:.3f}", f"{100 * r['load_slowdown']:.1f}%"] for r in rows])
    write_results("ce_beside_load_probe", {"probe": "ce_beside_load_probe", "device": torch.cuda.get_device_name(0),
                                           "sms": sms, "copy_exact": exact, "timeline": line, "rows": rows})


if __name__ == "__main__":
    main()
