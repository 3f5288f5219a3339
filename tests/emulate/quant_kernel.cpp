// Builds src/kernels/quantize.cu as plain host C++ and runs its launches on the CPU (see runtime.hpp),
// for tests/quant_emulated.rs, as src/kernels/quantize.rs queues them: the narrow entry point over
// tiles [0, narrow_tiles), then the wide one's phase-1 launch when a job is per tensor and its
// phase-2 launch over [narrow_tiles, tiles).
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
extern "C" void refit_emulate_quantize(const void* descs, u32 njobs, u64 narrow_tiles, u64 tiles, u32 amax_words) {
    std::vector<u32> amax(amax_words, 0u);  // the words the host zeroes
    const QuantDesc* d = static_cast<const QuantDesc*>(descs);
    if (narrow_tiles > 0) {
        emu::launch((unsigned)narrow_tiles, QUANT_THREADS, [&] { refit_quantize_narrow(d, njobs, 0, 2, amax.data()); });
    }
    const unsigned wide = (unsigned)(tiles - narrow_tiles);
    if (wide > 0) {
        if (amax_words) emu::launch(wide, QUANT_THREADS, [&] { refit_quantize(d, njobs, narrow_tiles, 1, amax.data()); });
        emu::launch(wide, QUANT_THREADS, [&] { refit_quantize(d, njobs, narrow_tiles, 2, amax.data()); });
    }
}
