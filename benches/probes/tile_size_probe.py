"""Does the tile size set the batched kernel's speed on a large batch, and do cache hints or more loads
in flight bring its copy closer to torch's?

refit's kernel (src/kernels/batched_copy.cu, compiled here as refit compiles it) cuts long runs into
tiles and gives each warp a contiguous share of them; every tile costs a fixed setup (its descriptor,
its place in the segment, in the verifying modes a digest). For tiles of 8 to 64 KiB, over one large
contiguous segment and one strided segment (rows of 3 KiB every 4 KiB, the column split of a
tensor-parallel weight), this times:
- the copy, the copy that records tile digests, and the check that re-reads the destinations;
- beside them in the same run: torch's copy_ of the same bytes (the ceiling of a copy) and a plain
  grid-stride read kernel (the ceiling of a read).
Then variants of the kernel's source, copying the contiguous segment in 64 KiB tiles: eight 16-byte
loads in flight per lane instead of four (at two blocks per SM, where its registers fit), and
streaming (evict-first) cache hints on stores, or on loads and stores.
Writes $REFIT_BENCH_RESULTS/tile_size_probe.json.
"""

import cupy as cp
import numpy as np
import torch

from probe_util import median_ms, print_table, refit_source, write_results

GIB = 1 << 30
THREADS = 256
READ = cp.RawKernel(
    r"""
struct __align__(16) V { unsigned long long lo, hi; };
extern "C" __global__ void __launch_bounds__(256) read_xor(const V* p, long long n, unsigned long long* out) {
    unsigned long long x = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        V a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
        x ^= a.lo ^ a.hi ^ b.lo ^ b.hi ^ c.lo ^ c.hi ^ d.lo ^ d.hi;
    }
    for (; i < n; i += stride) x ^= p[i].lo ^ p[i].hi;
    if (x == 0x1234567) atomicXor(out, x);
}
""",
    "read_xor",
)


def kernel_source():
    return refit_source("batched_copy.cu")

HINTS = r"""
template <typename V> __device__ __forceinline__ V probe_load(const V* p) { return *p; }
template <typename V> __device__ __forceinline__ void probe_store(V* p, const V& v) { *p = v; }
"""
LOAD_CS = r"""
template <> __device__ __forceinline__ V16 probe_load<V16>(const V16* p) {
    V16 v; asm("ld.global.cs.v2.u64 {%0, %1}, [%2];" : "=l"(v.lo), "=l"(v.hi) : "l"(p)); return v; }
"""
STORE_CS = r"""
template <> __device__ __forceinline__ void probe_store<V16>(V16* p, const V16& v) {
    asm volatile("st.global.cs.v2.u64 [%0], {%1, %2};" :: "l"(p), "l"(v.lo), "l"(v.hi) : "memory"); }
"""


def variant(source, name):
    """The kernel's source changed as variant `name` says (the probe's own edits, never shipped)."""
    if name.startswith("unroll 8"):  # at three blocks per SM its registers spill; at two they fit
        return source.replace("#define UNROLL 4u", "#define UNROLL 8u").replace(
            "__launch_bounds__(256, 3)", "__launch_bounds__(256, 2)")
    hints = HINTS + (STORE_CS if "store" in name else "") + (LOAD_CS if "load" in name else "")
    source = source.replace("#define WARP 32u", "#define WARP 32u\n" + hints)
    source = source.replace("        v = s[k];", "        v = probe_load(s + k);")
    return source.replace("d[k] = v;", "probe_store(d + k, v);")


def module(source=None):
    return cp.RawModule(code=source or kernel_source(), options=("--std=c++17",))


def layout(src, dst, run_len, count, src_stride, dst_stride, tile_shift):
    """The one-segment layout refit's kernels::layout builds (DeviceSegment, then the sentinel)."""
    tile = 1 << tile_shift
    if run_len > tile:
        run_tiles, tile_runs = -(-run_len // tile), 1
        tiles = count * run_tiles
    else:
        run_tiles, tile_runs = 1, min(max(tile // run_len, 1), 32)
        tiles = -(-count // tile_runs)
    d = np.zeros((2, 12), dtype=np.uint64)
    d[0] = [src, dst, run_len, count, src_stride, dst_stride, 0, 0, count, 0, run_tiles, tile_runs]
    d[1, 9] = tiles
    return cp.asarray(d), tiles



def main():
    torch.cuda.init()
    dev = cp.cuda.Device(0)
    sms = dev.attributes["MultiProcessorCount"]
    mod = module()
    copy = mod.get_function("refit_batched_copy")
    copy_digest = mod.get_function("refit_batched_copy_digest")
    check = mod.get_function("refit_batched_check")
    per_sm = 3
    blocks = sms * per_sm
    payload = 24 * GIB
    src = torch.empty(payload + (8 << 20), dtype=torch.uint8, device="cuda")
    dst = torch.empty(payload + (8 << 20), dtype=torch.uint8, device="cuda")
    src.random_(0, 256)
    first_bad = cp.zeros(1, dtype=cp.uint64)
    # Two shapes of the same payload: one contiguous run; rows of 3 KiB every 4 KiB on both sides.
    shapes = {"contiguous": (payload, 1, 0, 0), "rows 3 KiB of 4 KiB": (3072, payload // 3072, 4096, 3072)}
    rows = []
    ceiling_ms = median_ms(lambda: dst[:payload].copy_(src[:payload]))
    read_ms = median_ms(lambda: READ((blocks,), (THREADS,), (dst.data_ptr(), cp.int64(payload // 16), first_bad)))
    print(f"tile_size_probe: {sms} SMs, {blocks} blocks of {THREADS}; payload {payload / 1e9:.2f} GB")
    print(f"ceiling: torch copy_ {ceiling_ms:.2f} ms = {payload / ceiling_ms / 1e6:.0f} GB/s of payload; "
          f"read kernel {read_ms:.2f} ms = {payload / read_ms / 1e6:.0f} GB/s read")
    for shape, (run_len, count, src_stride, dst_stride) in shapes.items():
        payload_shape = run_len * count
        if src_stride:  # strided shapes cover more address space than their payload
            count = min(count, (payload + (8 << 20) - run_len) // src_stride)
            payload_shape = run_len * count
        for tile_shift in (13, 14, 15, 16):
            descs, tiles = layout(src.data_ptr(), dst.data_ptr(), run_len, count, src_stride, dst_stride, tile_shift)
            digests = cp.zeros(tiles, dtype=cp.uint64)
            base = (descs.data.ptr, cp.uint64(1), cp.uint64(tiles), cp.uint32(tile_shift), cp.uint32(5))
            grid, block = (blocks,), (THREADS,)
            c = median_ms(lambda: copy(grid, block, base))
            cd = median_ms(lambda: copy_digest(grid, block, base + (digests.data.ptr,)))
            first_bad.fill(~np.uint64(0))
            k = median_ms(lambda: check(grid, block, base + (digests.data.ptr, first_bad.data.ptr)))
            ok = int(first_bad.get()[0]) == 2**64 - 1
            row = {"shape": shape, "tile_shift": tile_shift, "payload": payload_shape,
                   "copy_ms": c, "copy_digest_ms": cd, "check_ms": k, "check_passed": ok,
                   "copy_gbps": payload_shape / c / 1e6, "check_read_gbps": payload_shape / k / 1e6,
                   "verify_overhead": (cd + k) / c - 1}
            rows.append(row)
            print(row, flush=True)
    variants = []
    descs, tiles = layout(src.data_ptr(), dst.data_ptr(), payload, 1, 0, 0, 16)
    for name in ("as is", "unroll 8, two blocks per SM", "streaming stores", "streaming loads and stores"):
        grid = (sms * 2 if name.startswith("unroll 8") else blocks,)
        m = module(variant(kernel_source(), name) if name != "as is" else None)
        fn = m.get_function("refit_batched_copy")
        args = (descs.data.ptr, cp.uint64(1), cp.uint64(tiles), cp.uint32(16), cp.uint32(5))
        dst.zero_()
        ms = median_ms(lambda: fn(grid, (THREADS,), args))
        exact = bool(torch.equal(src[:payload], dst[:payload]))
        digests = cp.zeros(tiles, dtype=cp.uint64)
        cd = median_ms(lambda: m.get_function("refit_batched_copy_digest")(grid, (THREADS,), args + (digests.data.ptr,)))
        first_bad.fill(~np.uint64(0))
        k = median_ms(lambda: m.get_function("refit_batched_check")(
            grid, (THREADS,), args + (digests.data.ptr, first_bad.data.ptr)))
        variants.append({"variant": name, "copy_ms": ms, "copy_gbps": payload / ms / 1e6, "exact": exact,
                         "copy_digest_ms": cd, "check_ms": k,
                         "check_passed": int(first_bad.get()[0]) == 2**64 - 1,
                         "verify_overhead": (cd + k) / ms - 1,
                         "registers": fn.num_regs, "local_bytes": fn.local_size_bytes})
        print(variants[-1], flush=True)
    torch_gbps = payload / ceiling_ms / 1e6
    print_table(["shape", "tile", "copy GB/s", "vs torch copy_", "copy+digest ms", "check ms (read GB/s)",
                 "verify adds"],
                [[r["shape"], f"{1 << r['tile_shift'] >> 10} KiB", f"{r['copy_gbps']:.0f}",
                  f"{r['copy_gbps'] / torch_gbps:.3f}", f"{r['copy_digest_ms']:.2f}",
                  f"{r['check_ms']:.2f} ({r['check_read_gbps']:.0f})", f"{100 * r['verify_overhead']:.0f}%"]
                 for r in rows])
    print_table(["kernel variant (contiguous, 64 KiB tiles)", "copy GB/s", "vs torch copy_", "registers",
                 "byte-exact", "copy+digest ms", "check ms", "verify adds"],
                [[v["variant"], f"{v['copy_gbps']:.0f}", f"{v['copy_gbps'] / torch_gbps:.3f}", v["registers"],
                  v["exact"], f"{v['copy_digest_ms']:.2f}",
                  f"{v['check_ms']:.2f} ({'passed' if v['check_passed'] else 'FAILED'})",
                  f"{100 * v['verify_overhead']:.0f}%"] for v in variants])
    write_results("tile_size_probe", {"variants": variants,
        "probe": "tile_size_probe", "device": torch.cuda.get_device_name(0), "blocks": blocks,
        "payload": payload, "torch_copy_ms": ceiling_ms, "torch_copy_gbps": payload / ceiling_ms / 1e6,
        "read_kernel_ms": read_ms, "read_kernel_gbps": payload / read_ms / 1e6, "rows": rows,
        "registers": {n: mod.get_function(n).num_regs for n in
                      ("refit_batched_copy", "refit_batched_copy_digest", "refit_batched_check")},
        "local_bytes": {n: mod.get_function(n).local_size_bytes for n in
                        ("refit_batched_copy", "refit_batched_copy_digest", "refit_batched_check")}})


if __name__ == "__main__":
    main()
