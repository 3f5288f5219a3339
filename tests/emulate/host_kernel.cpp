// Builds src/kernels/batched_copy.cu as plain host C++ and runs a launch on the CPU (see runtime.hpp:
// every thread a coroutine, switching only where threads wait for each other), so a sequential run
// computes what the GPU computes. Used by tests/kernel_emulated.rs to test the kernel's indexing in CI,
// without a GPU.
#include "runtime.hpp"

#include "../../src/kernels/batched_copy.cu"

extern "C" void refit_emulate_launch(const void* descs, u64 nseg, u64 ntiles, u32 tile_shift,
                                     u32 group_shift, u32 blocks, u32 threads) {
    emu::launch(blocks, threads, [&] {
        refit_batched_copy(static_cast<const Desc*>(descs), nseg, ntiles, tile_shift, group_shift);
    });
}

// The verifying entry points: mode 1 copies and records tile digests, 2 checks destinations against
// them, 3 compares destinations with sources. *first_bad is set to ~0 first, as the host does.
extern "C" void refit_emulate_verify(u32 mode, const void* descs, u64 nseg, u64 ntiles, u32 tile_shift,
                                     u32 group_shift, u32 blocks, u64* digests, u64* first_bad) {
    const Desc* d = static_cast<const Desc*>(descs);
    *first_bad = ~0ull;
    emu::launch(blocks, 256, [&] {
        if (mode == 1) refit_batched_copy_digest(d, nseg, ntiles, tile_shift, group_shift, digests);
        if (mode == 2) refit_batched_check(d, nseg, ntiles, tile_shift, group_shift, digests, first_bad);
        if (mode == 3) refit_batched_compare(d, nseg, ntiles, tile_shift, group_shift, digests, first_bad);
    });
}
