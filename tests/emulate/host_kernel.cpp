// Builds src/kernels/batched_copy.cu as plain host C++ and runs every thread of a launch one after
// the other. The kernel has no shared memory, barriers, atomics or warp shuffles, and each lane's
// work depends only on its own indices, so a sequential run over all threads computes what the GPU
// computes. Used by tests/kernel_emulated.rs to test the kernel's indexing in CI, without a GPU.
#include <cstdint>

struct refit_dim3 {
    unsigned x, y, z;
};
// thread_local: cargo runs tests on several threads at once.
static thread_local refit_dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __restrict__ __restrict

#include "../../src/kernels/batched_copy.cu"

extern "C" void refit_emulate_launch(const void* descs, u64 nseg, u64 ntiles, u32 tile_shift,
                                     u32 group_shift, u32 blocks, u32 threads) {
    gridDim = {blocks, 1, 1};
    blockDim = {threads, 1, 1};
    for (u32 b = 0; b < blocks; ++b) {
        for (u32 t = 0; t < threads; ++t) {
            blockIdx = {b, 0, 0};
            threadIdx = {t, 0, 0};
            refit_batched_copy(static_cast<const Desc*>(descs), nseg, ntiles, tile_shift, group_shift);
        }
    }
}
