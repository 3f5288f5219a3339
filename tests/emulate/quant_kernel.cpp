// Builds src/kernels/quantize.cu as plain host C++ and runs its launches on the CPU (see runtime.hpp),
// for tests/quant_emulated.rs, as src/kernels/quantize.rs queues them: the narrow entry point over
// tiles [0, narrow_tiles), then the wide one's phase-1 launch when a job is per tensor and its
// phase-2 launch over [narrow_tiles, tiles).
#include "runtime.hpp"

// atomicMax as the other emulated atomics: only one coroutine runs at a time.
template <typename T>
inline T atomicMax(T* p, T v) {
    T old = *p;
    if (v > old) *p = v;
    return old;
}

// Every L2 prefetch the launches ask for, to be checked against the jobs' sources.
#include <utility>
#include <vector>
// (Per thread: tests launch from several threads at once.)
static thread_local std::vector<std::pair<const unsigned char*, unsigned long long>> prefetched;
#define QUANT_EMULATED_PREFETCH(p, bytes) prefetched.emplace_back((p), (bytes))
// The prefetch knob on (the library's kernel has it off), so that what it asks for is checked.
#define QUANT_PREFETCH_WAVES 1u

#include "../../src/kernels/quantize.cu"

// The bytes a job's rows span in its source, each row's last vector read whole (as the kernel reads).
static bool within_a_source(const QuantDesc* d, u32 njobs, const unsigned char* p, u64 bytes) {
    for (u32 j = 0; j < njobs; ++j) {
        if (d[j].rows == 0 || d[j].cols == 0) continue;
        const u64 size = d[j].source == SRC_F32 ? 4u : 2u;
        const unsigned char* start = reinterpret_cast<const unsigned char*>(d[j].src);
        const u64 span = ((d[j].rows - 1) * d[j].src_stride * size) + ((d[j].cols * size + 15u) & ~15ull);
        if (p >= start && p + bytes <= start + span) return true;
    }
    return false;
}

// Runs the launches; *prefetches counts the L2 prefetches they asked for and *stray those reaching
// outside every job's source.
extern "C" void refit_emulate_quantize(const void* descs, u32 njobs, u64 narrow_tiles, u64 tiles, u32 per_tensor,
                                       u64* prefetches, u64* stray) {
    std::vector<u32> amax(njobs, 0u);  // the words the host zeroes
    const QuantDesc* d = static_cast<const QuantDesc*>(descs);
    prefetched.clear();
    if (narrow_tiles > 0) {
        emu::launch((unsigned)narrow_tiles, QUANT_THREADS, [&] { refit_quantize_narrow(d, njobs, 0, 2, amax.data()); });
    }
    const unsigned wide = (unsigned)(tiles - narrow_tiles);
    if (wide > 0) {
        if (per_tensor) emu::launch(wide, QUANT_THREADS, [&] { refit_quantize(d, njobs, narrow_tiles, 1, amax.data()); });
        emu::launch(wide, QUANT_THREADS, [&] { refit_quantize(d, njobs, narrow_tiles, 2, amax.data()); });
    }
    *prefetches = prefetched.size();
    *stray = 0;
    for (const auto& [p, bytes] : prefetched) *stray += within_a_source(d, njobs, p, bytes) ? 0 : 1;
}
