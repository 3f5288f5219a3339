"""Probe: GPU-side latency of ordering one GPU's stream after another's, events against stream
memory operations (cuStreamWriteValue64 into the waiter's memory, cuStreamWaitValue64 polling it).

1. Ping-pong chains of 2,000 round trips between GPU0's and GPU1's streams (and, for reference,
   between two streams of GPU0): time per round trip, GPU-timed after a spin gate.
2. The 2-GPU copy-engine push allgather at 16 / 64 / 256 MiB per rank, with its cross-GPU orderings
   made of events, of stream memory operations, or of flags that one-thread kernels on the rank
   streams poll (the ready hop a kernel that writes the peer's flag and polls its own, the landed
   hop a memory-op or kernel write after the copy): GB/s received per GPU. Also the copies alone
   (no ordering) and a staged push (the peer writes a staging buffer without waiting, the receiver
   copies each landed piece into place: one cross-GPU hop per call instead of two, for twice the
   block's memory). benches/gpu_allgather.rs prints the bound the hops set on an in-place call.
Prints markdown; JSON to $REFIT_BENCH_RESULTS/cross_gpu_sync_probe.json.
"""

import ctypes

import cupy as cp
from cupy.cuda import runtime as rt
from probe_util import MIB, enable_peers, timed, write_results

# The chains queue thousands of operations from Python: a long gate lets the host finish first.
GATE = 300_000_000
cuda = ctypes.CDLL("libcuda.so.1")
cuda.cuStreamWaitValue64_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
cuda.cuStreamWriteValue64_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
# One thread. Writes `epoch` into the peer's word (if any), then polls its own until it reaches
# `epoch`; gives up after about two seconds and leaves 1 in `failed` (a probe must not hang).
FLAG_KERNELS = cp.RawModule(
    code=r"""
extern "C" __global__ void signal_then_wait(unsigned long long* peer_word, const unsigned long long* own_word,
                                            unsigned long long epoch, unsigned int* failed) {
    if (peer_word) asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(peer_word), "l"(epoch) : "memory");
    if (!own_word) return;
    long long start = clock64();
    unsigned long long seen;
    do {
        asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(seen) : "l"(own_word) : "memory");
        if (clock64() - start > 4000000000LL) { *failed = 1; return; }
    } while (seen < epoch);
}
""",
)


def ck(code, what):
    if code != 0:
        raise RuntimeError(f"{what} failed: CUresult {code}")


def write(stream, addr, value):
    ck(cuda.cuStreamWriteValue64_v2(stream.ptr, addr, value, 0), "cuStreamWriteValue64")


def wait(stream, addr, value):
    ck(cuda.cuStreamWaitValue64_v2(stream.ptr, addr, value, 0), "cuStreamWaitValue64")  # GEQ


class Counter:
    value = 0

    def next(self):
        self.value += 1
        return self.value


def main():
    if rt.getDeviceCount() < 2:
        print("cross_gpu_sync_probe: needs two GPUs")
        return
    enable_peers()
    streams, flags, events = [], [], []
    for d in (0, 1):
        with cp.cuda.Device(d):
            streams.append(cp.cuda.Stream(non_blocking=True))
            flags.append(cp.zeros(64, dtype=cp.uint64))
            events.append(cp.cuda.Event(disable_timing=True))
    with cp.cuda.Device(0):
        s0b = cp.cuda.Stream(non_blocking=True)
        e0b = cp.cuda.Event(disable_timing=True)
    counter = Counter()
    trips = 2000
    rows = {}

    def events_chain(a, ea, da, b, eb, db):
        def issue():
            for _ in range(trips):
                with cp.cuda.Device(da):
                    ea.record(a)
                with cp.cuda.Device(db):
                    b.wait_event(ea)
                    eb.record(b)
                with cp.cuda.Device(da):
                    a.wait_event(eb)
        return issue

    def memops_chain():
        def issue():
            for _ in range(trips):
                v = counter.next()
                with cp.cuda.Device(0):
                    write(streams[0], flags[1].data.ptr, v)  # into GPU1's memory
                with cp.cuda.Device(1):
                    wait(streams[1], flags[1].data.ptr, v)
                    write(streams[1], flags[0].data.ptr, v)
                with cp.cuda.Device(0):
                    wait(streams[0], flags[0].data.ptr, v)
        return issue

    pair = [(0, streams[0]), (1, streams[1])]

    def per_trip_us(streams_timed, chain):
        return timed(streams_timed, chain, gate_cycles=GATE) / trips * 1e6

    rows["round trip GPU0<->GPU1, events (us)"] = per_trip_us(
        pair, events_chain(streams[0], events[0], 0, streams[1], events[1], 1)
    )
    rows["round trip GPU0<->GPU1, stream memory ops (us)"] = per_trip_us(pair, memops_chain())
    rows["round trip GPU0 stream<->stream, events (us)"] = per_trip_us(
        [(0, streams[0]), (0, s0b)], events_chain(streams[0], events[0], 0, s0b, e0b, 0)
    )

    # The push allgather, G = 2: lane[p] pushes p's block into recv[r]; own block on the rank stream.
    size_max = 256 * MIB
    send, recv, lanes, lane_ev, ready_ev, fork_ev, flag = [], [], [], [], [], [], []
    for d in (0, 1):
        with cp.cuda.Device(d):
            send.append(cp.random.randint(0, 256, size_max, dtype=cp.uint8))
            recv.append(cp.zeros(2 * size_max, dtype=cp.uint8))
            lanes.append(cp.cuda.Stream(non_blocking=True))
            lane_ev.append(cp.cuda.Event(disable_timing=True))
            ready_ev.append(cp.cuda.Event(disable_timing=True))
            fork_ev.append(cp.cuda.Event(disable_timing=True))
            # Flags live in the waiter's memory: flag[d][0] = "the peer's recv is ready for d's push"
            # (written by the peer's stream), flag[d][1] = "the peer's push into recv[d] landed".
            flag.append(cp.zeros(64, dtype=cp.uint64))

    copy_kernel = cp.RawKernel(
        r"""
extern "C" __global__ void copy16(const int4* src, int4* dst, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) dst[i] = src[i];
}
""",
        "copy16",
    )

    def record_ready():
        """Each rank stream records `ready`: its earlier work is done, its buffers free for the call."""
        for r in (0, 1):
            with cp.cuda.Device(r):
                ready_ev[r].record(streams[r])

    def variant_call(size, own, ready_hop, join_hop, own_blocks=264):
        """The push allgather with parts switched off, to see what each costs (not all are safe)."""
        record_ready()
        for p in (0, 1):
            r = 1 - p
            with cp.cuda.Device(p):
                lanes[p].wait_event(ready_ev[p])
                if ready_hop:
                    lanes[p].wait_event(ready_ev[r])
                rt.memcpyAsync(recv[r].data.ptr + p * size, send[p].data.ptr, size, 4, lanes[p].ptr)
                lane_ev[p].record(lanes[p])
                if own == "ce":
                    rt.memcpyAsync(recv[p].data.ptr + p * size, send[p].data.ptr, size, 4, streams[p].ptr)
                elif own == "sm":
                    n16 = size // 16
                    copy_kernel(
                        (own_blocks,), (512,),
                        (send[p].data.ptr, recv[p].data.ptr + p * size, cp.uint64(n16)),
                        stream=streams[p],
                    )
                streams[p].wait_event(lane_ev[p])
        for r in (0, 1):
            p = 1 - r
            with cp.cuda.Device(r):
                if join_hop:
                    streams[r].wait_event(lane_ev[p])

    def pull_deferred_call(size):
        """The old pull: each rank waits for the other's ready and pulls on a lane; no join back."""
        record_ready()
        for r in (0, 1):
            p = 1 - r
            with cp.cuda.Device(r):
                streams[r].wait_event(ready_ev[p])
                fork_ev[r].record(streams[r])
                lanes[r].wait_event(fork_ev[r])
                rt.memcpyAsync(recv[r].data.ptr + p * size, send[p].data.ptr, size, 4, lanes[r].ptr)
                lane_ev[r].record(lanes[r])
                rt.memcpyAsync(recv[r].data.ptr + r * size, send[r].data.ptr, size, 4, streams[r].ptr)
                streams[r].wait_event(lane_ev[r])

    def push_call(size, memops):
        v = counter.next()
        for r in (0, 1):
            with cp.cuda.Device(r):
                ready_ev[r].record(streams[r])
                if memops:
                    write(streams[r], flag[1 - r][0:1].data.ptr, v)  # tell the pusher: recv[r] ready
        for p in (0, 1):
            r = 1 - p
            with cp.cuda.Device(p):
                lanes[p].wait_event(ready_ev[p])
                if memops:
                    wait(lanes[p], flag[p][0:1].data.ptr, v)
                else:
                    lanes[p].wait_event(ready_ev[r])
                rt.memcpyAsync(recv[r].data.ptr + p * size, send[p].data.ptr, size, 4, lanes[p].ptr)
                lane_ev[p].record(lanes[p])
                if memops:
                    write(lanes[p], flag[r][1:2].data.ptr, v)  # tell the receiver: block landed
                rt.memcpyAsync(recv[p].data.ptr + p * size, send[p].data.ptr, size, 4, streams[p].ptr)
                streams[p].wait_event(lane_ev[p])
        for r in (0, 1):
            p = 1 - r
            with cp.cuda.Device(r):
                if memops:
                    wait(streams[r], flag[r][1:2].data.ptr, v)
                else:
                    streams[r].wait_event(lane_ev[p])

    signal_then_wait = [None, None]
    failed = []
    for d in (0, 1):
        with cp.cuda.Device(d):
            signal_then_wait[d] = FLAG_KERNELS.get_function("signal_then_wait")
            failed.append(cp.zeros(1, dtype=cp.uint32))

    def flag_call(size, landed_by_kernel):
        """Every cross-GPU hop a flag: rank r's stream runs a kernel that tells its pusher "recv[r] is
        ready" and waits to hear the same from it; the lane, after that kernel (a local event),
        pushes and then writes "landed" into the receiver's flag (a memory op or a kernel); the
        rank's stream, after its own copy and its lane, runs a kernel that waits for "landed"."""
        v = counter.next()
        null = cp.uint64(0)
        for r in (0, 1):
            p = 1 - r
            with cp.cuda.Device(r):
                signal_then_wait[r](
                    (1,), (1,), (flag[p][2:3].data.ptr, flag[r][2:3].data.ptr, cp.uint64(v), failed[r].data.ptr),
                    stream=streams[r],
                )
                ready_ev[r].record(streams[r])
        for p in (0, 1):
            r = 1 - p
            with cp.cuda.Device(p):
                lanes[p].wait_event(ready_ev[p])
                rt.memcpyAsync(recv[r].data.ptr + p * size, send[p].data.ptr, size, 4, lanes[p].ptr)
                if landed_by_kernel:
                    signal_then_wait[p](
                        (1,), (1,), (flag[r][3:4].data.ptr, null, cp.uint64(v), failed[p].data.ptr), stream=lanes[p]
                    )
                else:
                    write(lanes[p], flag[r][3:4].data.ptr, v)
                lane_ev[p].record(lanes[p])
                rt.memcpyAsync(recv[p].data.ptr + p * size, send[p].data.ptr, size, 4, streams[p].ptr)
                streams[p].wait_event(lane_ev[p])
                signal_then_wait[p](
                    (1,), (1,), (null, flag[p][3:4].data.ptr, cp.uint64(v), failed[p].data.ptr), stream=streams[p]
                )

    # Staging: rank p pushes into a second buffer on r (two slots, alternating calls) without
    # waiting for r; r's stream waits for each piece to land and copies it into recv[r] with a
    # kernel. One cross-GPU hop per call instead of two, for an extra 2 x block of memory per peer.
    stage, piece_ev, free_ev = [], [], []
    for d in (0, 1):
        with cp.cuda.Device(d):
            stage.append(cp.zeros(2 * size_max, dtype=cp.uint8))
            piece_ev.append([cp.cuda.Event(disable_timing=True) for _ in range(8)])
            free_ev.append([cp.cuda.Event(disable_timing=True) for _ in range(2)])
    slot_used = [False, False]
    staged_calls = Counter()

    def staged_call(size, pieces, copy_out_blocks=132):
        slot = staged_calls.next() % 2
        piece = size // pieces
        record_ready()
        for p in (0, 1):
            r = 1 - p
            with cp.cuda.Device(p):
                lanes[p].wait_event(ready_ev[p])
                if slot_used[slot]:
                    lanes[p].wait_event(free_ev[r][slot])  # r copied this slot out two calls ago
                for i in range(pieces):
                    dst = stage[r].data.ptr + slot * size_max + i * piece
                    rt.memcpyAsync(dst, send[p].data.ptr + i * piece, piece, 4, lanes[p].ptr)
                    piece_ev[p][i].record(lanes[p])
                streams[p].wait_event(piece_ev[p][pieces - 1])  # send[p] free
        for r in (0, 1):
            p = 1 - r
            with cp.cuda.Device(r):
                for i in range(pieces):
                    streams[r].wait_event(piece_ev[p][i])
                    src = stage[r].data.ptr + slot * size_max + i * piece
                    copy_kernel(
                        (copy_out_blocks,), (512,),
                        (src, recv[r].data.ptr + p * size + i * piece, cp.uint64(piece // 16)),
                        stream=streams[r],
                    )
                free_ev[r][slot].record(streams[r])
        slot_used[slot] = True

    def copies_only_call(size):
        """Both pushes on their lanes back to back, nothing between them (the copy engines'
        ceiling): the lanes wait for the gate once per batch (batch), not per call."""
        for p in (0, 1):
            with cp.cuda.Device(p):
                rt.memcpyAsync(recv[1 - p].data.ptr + p * size, send[p].data.ptr, size, 4, lanes[p].ptr)

    def batch(call, size, iters):
        """`iters` calls, the lanes forked from the rank streams (after the gate) before the first
        and joined back after the last, so the timing covers them."""
        for p in (0, 1):
            with cp.cuda.Device(p):
                fork_ev[p].record(streams[p])
                lanes[p].wait_event(fork_ev[p])
        for _ in range(iters):
            call(size)
        for p in (0, 1):
            with cp.cuda.Device(p):
                lane_ev[p].record(lanes[p])
                streams[p].wait_event(lane_ev[p])

    push_rows = []
    variants = {
        "copies only, no events (unsafe)": copies_only_call,
        "push, own CE (refit)": lambda size: variant_call(size, "ce", True, True),
        "push, own SM kernel": lambda size: variant_call(size, "sm", True, True),
        "push, no own copy": lambda size: variant_call(size, None, True, True),
        "push, no own copy, no ready hop (unsafe)": lambda size: variant_call(size, None, False, True),
        "push, no own copy, no hops (unsafe)": lambda size: variant_call(size, None, False, False),
        "pull, deferred join (old)": pull_deferred_call,
        "push, stream memory ops": lambda size: push_call(size, True),
        "push, flag kernels, landed by memory op": lambda size: flag_call(size, False),
        "push, flag kernels, landed by kernel": lambda size: flag_call(size, True),
        "push, own CE, no hops (unsafe)": lambda size: variant_call(size, "ce", False, False),
        "push, own SM kernel, 8 blocks": lambda size: variant_call(size, "sm", True, True, 8),
        "push, own SM kernel, 16 blocks": lambda size: variant_call(size, "sm", True, True, 16),
        "push, own SM kernel, 32 blocks": lambda size: variant_call(size, "sm", True, True, 32),
        "staged push, 1 piece (one hop)": lambda size: staged_call(size, 1),
        "staged push, 2 pieces (one hop)": lambda size: staged_call(size, 2),
        "staged push, 4 pieces (one hop)": lambda size: staged_call(size, 4),
        "staged push, 8 pieces (one hop)": lambda size: staged_call(size, 8),
    }
    # Every variant moves the right bytes (ordering aside): poisoned recv, one call, compared.
    size = 16 * MIB
    for name, call in variants.items():
        if name.startswith("copies only"):
            continue  # moves the peer's block only
        for r in (0, 1):
            with cp.cuda.Device(r):
                recv[r].fill(0xA5)
                cp.cuda.Device(r).synchronize()
        call(size)
        for r in (0, 1):
            with cp.cuda.Device(r):
                streams[r].synchronize()
                lanes[r].synchronize()
        for r in (0, 1):
            p = 1 - r
            got = cp.asnumpy(recv[r][p * size : (p + 1) * size])
            assert (got == cp.asnumpy(send[p][:size])).all(), f"{name}: recv[{r}] block {p} wrong"
    for size in (16 * MIB, 64 * MIB, 256 * MIB):
        iters = max(5, min(40, 2048 * MIB // size))
        out = {"size_mib": size // MIB}
        for name, call in variants.items():
            t = timed(pair, lambda: batch(call, size, iters), gate_cycles=GATE) / iters
            out[name] = size / t / 1e9
        push_rows.append(out)
    # Correctness of the last call: both recv buffers hold the peer's block.
    for r in (0, 1):
        with cp.cuda.Device(r):
            streams[r].synchronize()
    assert all(int(f.get()[0]) == 0 for f in failed), "a flag kernel gave up waiting"
    size = 256 * MIB
    for r in (0, 1):
        p = 1 - r
        got = cp.asnumpy(recv[r][p * size : (p + 1) * size])
        assert (got == cp.asnumpy(send[p][:size])).all(), f"recv[{r}] block {p} wrong"

    print("| ordering | us |")
    print("| --- | --- |")
    for k, v in rows.items():
        print(f"| {k} | {v:.2f} |")
    print()
    print("| 2-GPU allgather variant, GB/s per GPU | " + " | ".join(f"{r['size_mib']} MiB" for r in push_rows) + " |")
    print("| --- |" + " --- |" * len(push_rows))
    for name in variants:
        print(f"| {name} | " + " | ".join(f"{r[name]:.1f}" for r in push_rows) + " |")
    write_results("cross_gpu_sync_probe", {"round_trips_us": rows, "push_allgather_gbps": push_rows})


if __name__ == "__main__":
    main()
