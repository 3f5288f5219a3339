// Builds src/kernels/quantize.cu as plain host C++ and runs its launches on the CPU (see runtime.hpp),
// for tests/quant_emulated.rs, as src/kernels/quantize.rs queues them: the group-mode entry point
// over tiles [0, group_tiles), the narrow one over [group_tiles, narrow_tiles); the phase-1 launches of jobs sharing amaxes (refit_quantize_amax over the wide entry
// point's tiles [narrow_tiles, tiles - rows_tiles) when a job is per tensor, refit_quantize_rows's over the last
// rows_tiles); then both of those entry points' phase-2 launches.
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

#include "../../src/kernels/quantize.cu"

// Runs the launches.
extern "C" void refit_emulate_quantize(const void* descs, u32 njobs, u64 group_tiles, u64 narrow_tiles, u64 rows_tiles,
                                       u64 tiles, u32 amax_words, bool tensor_phase) {
    std::vector<u32> amax(amax_words, 0u);  // the words the host zeroes
    const QuantDesc* d = static_cast<const QuantDesc*>(descs);
    if (group_tiles > 0) {
        emu::launch((unsigned)group_tiles, QUANT_THREADS, [&] { refit_quantize_groups(d, njobs, 0, 2, amax.data()); });
    }
    if (narrow_tiles > group_tiles) {
        emu::launch((unsigned)(narrow_tiles - group_tiles), QUANT_THREADS,
                    [&] { refit_quantize_narrow(d, njobs, group_tiles, 2, amax.data()); });
    }
    const unsigned wide = (unsigned)(tiles - rows_tiles - narrow_tiles), rows = (unsigned)rows_tiles;
    const u64 rows_first = tiles - rows_tiles;
    if (wide > 0 && tensor_phase) {
        emu::launch((wide + QUANT_AMAX_TILES - 1) / QUANT_AMAX_TILES, QUANT_THREADS,
                    [&] { refit_quantize_amax(d, njobs, narrow_tiles, narrow_tiles + wide, amax.data()); });
    }
    if (rows > 0) emu::launch(rows, QUANT_THREADS, [&] { refit_quantize_rows(d, njobs, rows_first, 1, amax.data()); });
    if (wide > 0) emu::launch(wide, QUANT_THREADS, [&] { refit_quantize(d, njobs, narrow_tiles, 2, amax.data()); });
    if (rows > 0) emu::launch(rows, QUANT_THREADS, [&] { refit_quantize_rows(d, njobs, rows_first, 2, amax.data()); });
}
