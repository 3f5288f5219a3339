// One stage's copy and its in-place quantizing copies in one launch. Compiled after batched_copy.cu and
// quantize.cu, in the quantize kernel's module (src/kernels/quantize.rs).
//
// Blocks [0, copy_blocks) are the batched copy's persistent grid, as refit_batched_copy would launch
// it; the blocks after them are the quantize kernel's phase-2 tiles, narrow ones (QUANT_NARROW_CACHE
// vectors per thread) then wide ones (QUANT_CACHE), as its two entry points would take them. Blocks
// start in index order, so the quantizing tiles take the SMs as the copy's blocks finish: the stage
// ends with one launch's tail instead of waiting for a second launch behind the first. The two parts
// touch disjoint memory (the executor checked the codes and scales against every copy's destination),
// so no order between them is needed. Per-tensor jobs' phase 1 runs before, as its own launch.

extern "C" __global__ void __launch_bounds__(QUANT_THREADS, QUANT_WITH_COPY_MIN_BLOCKS)
    refit_copy_quantize(const Desc* __restrict__ descs, u64 nseg, u64 ntiles, u32 tile_shift, u32 group_shift,
                        u32 copy_blocks, const QuantDesc* __restrict__ quant, u32 njobs, u64 narrow_tiles,
                        u32* job_amax) {
    if (blockIdx.x < copy_blocks) {
        copy_tiles<MODE_COPY>(descs, nseg, ntiles, tile_shift, group_shift, nullptr, nullptr, blockIdx.x, copy_blocks);
        return;
    }
    __shared__ Vec cache[QUANT_CACHE * QUANT_THREADS];  // the wide tiles' cache (quantize.cu)
    const u32 block = blockIdx.x - copy_blocks;
    if (block < narrow_tiles) {
        quantize_tiles<QUANT_NARROW_CACHE, false>(quant, njobs, 0, job_amax, block, nullptr);
    } else {
        quantize_tiles<QUANT_CACHE, true>(quant, njobs, narrow_tiles, job_amax, block - (u32)narrow_tiles, cache);
    }
}
