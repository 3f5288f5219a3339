"""Where does the quantizing copy lose to its memory bound, and what brings it closer? (Issue 29: at
least 0.8 of 3 bytes per element at the copy's rate.)

refit's quantize kernel (src/kernels/quantize.cu) keeps QUANT_CACHE vectors per thread of a block-mode
tile in shared memory at QUANT_WIDE_MIN_BLOCKS thread blocks per SM (refit_quantize), and
QUANT_NARROW_CACHE in registers at QUANT_NARROW_MIN_BLOCKS (refit_quantize_narrow, for rows and MX).
Earlier runs of this probe set those, and found an L2 prefetch of the tile a wave ahead slower at
every granularity (docs/decisions.md, "Quantizing copy"). This run
asks how many wide blocks per SM the shared-memory cache should allow (3, as in the launch that also
copies, 4, 5), and whether the narrow entry point gains from more blocks. A 1 GiB bf16 matrix
(65536 x 8192) to e4m3 per 128 x 128 block, per row and MXFP8, in one run; each variant's codes and
scales are compared byte for byte with the library's kernel as it is, and a bf16 copy of the same
tensor sets the bound. QUANT_PROBE_VARIANTS (names, comma-separated) and QUANT_PROBE_GRANULARITIES
narrow a run, e.g. under ncu. Writes $REFIT_BENCH_RESULTS/quant_occupancy_probe.json.
"""

import os

import cupy as cp
import numpy as np
import torch

from probe_util import median_ms, print_table, refit_source, write_results

ROWS, COLS = 65536, 8192
DESC = np.dtype([("src", "<u8"), ("dst", "<u8"), ("scales", "<u8"), ("rows", "<u8"), ("cols", "<u8"),
                 ("src_stride", "<u8"), ("dst_stride", "<u8"), ("scale_stride", "<u8"), ("first_tile", "<u8"),
                 ("grid_cols", "<u8"), ("blocks", "<u8"), ("block_rows", "<u4"), ("block_cols", "<u4"),
                 ("source", "<u4"), ("target", "<u4"), ("scale_kind", "<u4"), ("mode", "<u4"),
                 ("group_shift", "<u4"), ("min_amax", "<u4"), ("by_reciprocal", "<u4"), ("pow2_scales", "<u4")])
assert DESC.itemsize == 128
AS_IS = {"QUANT_CACHE": 8, "QUANT_WIDE_MIN_BLOCKS": 4, "QUANT_GROUP_ROUNDS": 4, "QUANT_NARROW_MIN_BLOCKS": 4}


def source(defines):
    text = refit_source("quantize.cu")
    for name, value in defines.items():
        old = f"#define {name} {AS_IS[name]}u"
        assert old in text, old
        text = text.replace(old, f"#define {name} {value}u")
    return text



def job(granularity, src, codes, scales, rounds):
    """The descriptor src/kernels/quantize.rs lays out for one whole-matrix e4m3 job, and its tiles."""
    d = np.zeros(1, dtype=DESC)
    d["src"], d["dst"], d["scales"] = src.data_ptr(), codes.data_ptr(), scales.data_ptr()
    d["rows"], d["cols"], d["src_stride"], d["dst_stride"] = ROWS, COLS, COLS, COLS
    d["min_amax"] = np.float32(1e-10).view(np.uint32)  # the default arithmetic's floor
    if granularity == "block 128 x 128":
        d["block_rows"], d["block_cols"], d["grid_cols"], d["scale_stride"] = 128, 128, COLS // 128, COLS // 128
        d["blocks"] = (ROWS // 128) * (COLS // 128)
        tiles = int(d["blocks"][0])
    elif granularity == "row":
        d["block_rows"], d["block_cols"], d["grid_cols"], d["scale_stride"] = 1, COLS, 1, 1
        d["blocks"] = ROWS
        tiles = ROWS
    else:  # MX: 1 x 32 blocks, e8m0 scales, group mode with 4 lanes per block
        d["block_rows"], d["block_cols"], d["grid_cols"], d["scale_stride"] = 1, 32, COLS // 32, COLS // 32
        d["blocks"] = ROWS * (COLS // 32)
        d["scale_kind"], d["mode"], d["group_shift"] = 1, 1, 2
        tiles = -(-int(d["blocks"][0]) // (64 * rounds))
    # The tile index after the descriptor (src/kernels/quantize.rs, Layout::index): one job, so every
    # entry, one per 256 tiles and one past the end, is job 0.
    index = np.zeros(-(-tiles // 256) + 1, dtype=np.uint32)
    return cp.asarray(np.concatenate([d.view(np.uint8), index.view(np.uint8)])), tiles


def main():
    torch.cuda.init()
    src = torch.randn(ROWS, COLS, dtype=torch.bfloat16, device="cuda")
    copy = torch.empty_like(src)
    copy_ms = median_ms(lambda: copy.copy_(src), reps=9)
    bound_ms = copy_ms * 3 / 4
    del copy
    codes = torch.empty(ROWS, COLS, dtype=torch.uint8, device="cuda")
    scales = torch.empty(ROWS * (COLS // 32) * 4 // 4 + 4096, dtype=torch.int32, device="cuda")
    amax = cp.zeros(1, dtype=cp.uint32)
    variants = [("as is", {}), ("narrow entry point", {}),
                ("3 wide blocks per SM", {"QUANT_WIDE_MIN_BLOCKS": 3}),
                ("5 wide blocks per SM", {"QUANT_WIDE_MIN_BLOCKS": 5}),
                ("narrow, 5 blocks per SM", {"QUANT_NARROW_MIN_BLOCKS": 5}),
                ("narrow, 6 blocks per SM", {"QUANT_NARROW_MIN_BLOCKS": 6})]
    only = os.environ.get("QUANT_PROBE_VARIANTS")  # names, comma-separated: e.g. for one run under ncu
    if only:
        variants = [v for v in variants if v[0] in only.split(",")]
    granularities = os.environ.get("QUANT_PROBE_GRANULARITIES", "block 128 x 128,row,MX").split(",")
    reference = {}
    rows = []
    for name, defines in variants:
        entry = "refit_quantize_narrow" if name.startswith("narrow") else "refit_quantize"
        fn = cp.RawModule(code=source(defines), options=("--std=c++17",)).get_function(entry)
        rounds = defines.get("QUANT_GROUP_ROUNDS", AS_IS["QUANT_GROUP_ROUNDS"])
        fn.preferred_shared_memory_carveout = 100  # as the library asks (kernels/module.rs)
        for granularity in granularities:
            descs, tiles = job(granularity, src, codes, scales, rounds)
            codes.zero_()
            scales.zero_()
            ms = median_ms(reps=9, fn=lambda: fn((tiles,), (256,), (descs.data.ptr, cp.uint32(1), cp.uint64(0), cp.uint32(2), amax.data.ptr)))
            out = (codes.clone(), scales.clone())
            if name == "as is":
                reference[granularity] = out
            same = granularity in reference and bool(
                torch.equal(out[0], reference[granularity][0]) and torch.equal(out[1], reference[granularity][1]))
            rows.append({"variant": name, "granularity": granularity, "ms": ms, "of_bound": bound_ms / ms,
                         "same_as_is": same, "registers": fn.num_regs, "local_bytes": fn.local_size_bytes})
            print(rows[-1], flush=True)
    print(f"bf16 copy {copy_ms:.3f} ms; bound at 3 B/element {bound_ms:.3f} ms")
    print_table(["variant", "granularity", "ms", "of bound", "same bytes as is", "registers", "spills"],
                [[r["variant"], r["granularity"], f"{r['ms']:.3f}", f"{r['of_bound']:.2f}", r["same_as_is"],
                  r["registers"], r["local_bytes"]] for r in rows])
    write_results("quant_occupancy_probe", {"probe": "quant_occupancy_probe", "copy_ms": copy_ms,
                                            "bound_ms": bound_ms, "rows": rows})


if __name__ == "__main__":
    main()
