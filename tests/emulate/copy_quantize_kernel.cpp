// Builds the quantize kernel's module as src/kernels/quantize.rs compiles it (batched_copy.cu's device
// functions, then quantize.cu, then copy_quantize.cu) as plain host C++, and runs a copy and quantize launch on the CPU
// (see runtime.hpp), for tests/copy_quantize_emulated.rs: phase 1 of jobs sharing amaxes first, as
// launches of their own, then refit_copy_quantize over the copy's blocks and every narrow and wide
// quantizing tile, then refit_quantize_rows's phase 2.
#include "runtime.hpp"

// atomicMax and atomicExch as the other emulated atomics: only one coroutine runs at a time.
template <typename T>
inline T atomicMax(T* p, T v) {
    T old = *p;
    if (v > old) *p = v;
    return old;
}
template <typename T>
inline T atomicExch(T* p, T v) {
    T old = *p;
    *p = v;
    return old;
}

#define REFIT_COPY_TILES_ONLY
#include "../../src/kernels/batched_copy.cu"
#include "../../src/kernels/quantize.cu"
#include "../../src/kernels/copy_quantize.cu"

extern "C" void refit_emulate_copy_quantize(const void* copy, u64 nseg, u64 ntiles, u32 tile_shift, u32 group_shift,
                                            u32 copy_blocks, const void* quant, u32 njobs, u64 narrow_tiles,
                                            u64 rows_tiles, u64 tiles, u32 amax_words, bool tensor_phase) {
    std::vector<u32> amax(amax_words, 0u);  // the words the host zeroes
    const Desc* c = static_cast<const Desc*>(copy);
    const QuantDesc* q = static_cast<const QuantDesc*>(quant);
    const unsigned riding = (unsigned)(tiles - rows_tiles), rows = (unsigned)rows_tiles;
    if (tensor_phase && riding > narrow_tiles) {
        emu::launch((riding - (unsigned)narrow_tiles + QUANT_AMAX_TILES - 1) / QUANT_AMAX_TILES, QUANT_THREADS,
                    [&] { refit_quantize_amax(q, njobs, narrow_tiles, riding, amax.data()); });
    }
    if (rows > 0) emu::launch(rows, QUANT_THREADS, [&] { refit_quantize_rows(q, njobs, riding, 1, amax.data()); });
    emu::launch(copy_blocks + riding, QUANT_THREADS, [&] {
        refit_copy_quantize(c, nseg, ntiles, tile_shift, group_shift, copy_blocks, q, njobs, narrow_tiles, amax.data());
    });
    if (rows > 0) emu::launch(rows, QUANT_THREADS, [&] { refit_quantize_rows(q, njobs, riding, 2, amax.data()); });
}
