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
