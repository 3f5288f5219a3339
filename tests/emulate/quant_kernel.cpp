// Builds src/kernels/quantize.cu as plain host C++ and runs its launches on the CPU (see runtime.hpp),
// for tests/quant_emulated.rs: the phase-1 launch when a job is per tensor, then the phase-2 launch,
// as src/kernels/quantize.rs queues them.
#include "runtime.hpp"

// atomicMax as the other emulated atomics: only one coroutine runs at a time.
template <typename T>
inline T atomicMax(T* p, T v) {
    T old = *p;
    if (v > old) *p = v;
    return old;
}

#include "../../src/kernels/quantize.cu"

extern "C" void refit_emulate_quantize(const void* descs, u32 njobs, u64 tiles, u32 per_tensor) {
    std::vector<u32> amax(njobs, 0u);  // the words the host zeroes
    const QuantDesc* d = static_cast<const QuantDesc*>(descs);
    if (per_tensor) emu::launch((unsigned)tiles, QUANT_THREADS, [&] { refit_quantize(d, njobs, 1, amax.data()); });
    emu::launch((unsigned)tiles, QUANT_THREADS, [&] { refit_quantize(d, njobs, 2, amax.data()); });
}
