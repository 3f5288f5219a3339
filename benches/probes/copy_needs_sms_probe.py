"""Does a same-device copy queued with cudaMemcpyAsync (what torch `copy_` and refit's copy-engine arm
queue) need an SM to run, or does it run while kernels hold every SM?

Beside a CUDA-graph loop of cuBLAS's 8192^3 bf16 GEMM, 64 MiB copies moved about 116 GB/s, against
about 1,900 alone (benches/refit_peer.py). A copy engine needs no SM, so a copy slowed that much would
be waiting for something the GEMM holds. Here a "wall" kernel holds every SM for 100 ms (one block
per SM, forced by its shared memory, each spinning on the global timer); 20 ms after it starts,
another stream queues a device-to-device copy, then a copy kernel as the control that must wait.
Per copy: its time alone, its time beside the wall, and whether it ended before the wall did. The
same with a wall over half the SMs. Writes $REFIT_BENCH_RESULTS/copy_needs_sms_probe.json.
"""

import time

import cupy as cp
from cupy.cuda import runtime as rt

from probe_util import MIB, print_table, write_results

WALL = cp.RawKernel(
    r"""
extern "C" __global__ void wall(unsigned long long ns) {
    extern __shared__ unsigned char hold[];
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
    if (threadIdx.x == 0 && ns == 0) hold[0] = 1;
}
""",
    "wall",
)
COPY = cp.RawKernel(
    r"""
extern "C" __global__ void copy16(const uint4* __restrict__ s, uint4* __restrict__ d, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        d[i] = s[i];
}
""",
    "copy16",
)
D2D = 3  # cudaMemcpyDeviceToDevice


def main():
    props = rt.getDeviceProperties(0)
    sms, smem = props["multiProcessorCount"], props["sharedMemPerBlockOptin"]
    WALL.max_dynamic_shared_size_bytes = smem
    size = 1 << 30
    src, dst = cp.random.randint(0, 255, size, dtype=cp.uint8), cp.zeros(size, dtype=cp.uint8)
    wall_stream, copy_stream = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)

    def by_memcpy(n):
        def issue():
            rt.memcpyAsync(dst.data.ptr, src.data.ptr, n, D2D, copy_stream.ptr)
        return issue

    def by_kernel(n):
        def issue():
            COPY((sms,), (512,), (src, dst, cp.int64(n // 16)), stream=copy_stream)
        return issue

    def timed(issue):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(copy_stream)
        issue()
        stop.record(copy_stream)
        return start, stop

    rows = []
    wall_ns = 100_000_000
    for name, make in (("cudaMemcpyAsync D2D", by_memcpy), ("copy kernel (control)", by_kernel)):
        for n in (64 * MIB, size):
            issue = make(n)
            issue()
            copy_stream.synchronize()
            start, stop = timed(issue)
            stop.synchronize()
            alone_ms = cp.cuda.get_elapsed_time(start, stop)
            for wall_blocks in (sms, sms // 2):
                w0, w1 = cp.cuda.Event(), cp.cuda.Event()
                w0.record(wall_stream)
                WALL((wall_blocks,), (1024,), (cp.uint64(wall_ns),), stream=wall_stream, shared_mem=smem)
                w1.record(wall_stream)
                time.sleep(0.02)
                start, stop = timed(issue)
                stop.synchronize()
                w1.synchronize()
                # Times from the wall's start; the copy's events come later, so none is negative.
                began, ended = cp.cuda.get_elapsed_time(w0, start), cp.cuda.get_elapsed_time(w0, stop)
                wall_ms = cp.cuda.get_elapsed_time(w0, w1)
                row = {"copy": name, "bytes": n, "wall_sms": wall_blocks, "alone_ms": alone_ms,
                       "beside_wall_ms": ended - began, "ended_before_wall": ended < wall_ms,
                       "wall_ms": wall_ms}
                rows.append(row)
                print(row, flush=True)
    exact = bool((src == dst).all())
    print_table(["copy", "size", "wall over SMs", "ms alone", "ms beside the wall", "ended before the wall"],
                [[r["copy"], f"{r['bytes'] >> 20} MiB", f"{r['wall_sms']} of {sms}", f"{r['alone_ms']:.3f}",
                  f"{r['beside_wall_ms']:.3f}", r["ended_before_wall"]] for r in rows])
    print(f"last copy byte-exact: {exact}")
    write_results("copy_needs_sms_probe", {"probe": "copy_needs_sms_probe", "sms": sms, "wall_ms_asked": wall_ns / 1e6,
                                           "copy_exact": exact, "rows": rows})


if __name__ == "__main__":
    main()
