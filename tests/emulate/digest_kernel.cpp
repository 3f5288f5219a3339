// Builds src/kernels/digest.cu as plain host C++ and runs a launch of either entry point on the CPU
// (see runtime.hpp), for tests/digest_emulated.rs.
#include "runtime.hpp"

#include "../../src/kernels/digest.cu"

extern "C" void refit_emulate_digest(u64 addr, u64 len, u32 span_shift, const u64* constants, u64* out,
                                     u32 blocks) {
    *out = 0;  // the memset the host queues before the kernel
    emu::launch(blocks, DIGEST_THREADS, [&] { refit_digest(addr, len, span_shift, constants, out); });
}

extern "C" void refit_emulate_digest_many(const DigestRange* ranges, u32 count, u64 total_chunks, u64 span,
                                          const u64* constants, u64* out, u32 blocks) {
    for (u32 r = 0; r < count; ++r) out[r] = 0;  // the memset the host queues before the kernel
    emu::launch(blocks, DIGEST_THREADS,
                [&] { refit_digest_many(ranges, count, total_chunks, span, constants, out); });
}

// One warp's piece_factor(c0, delta) as lane 0 holds it: the many-range kernel's factor for a piece
// starting at chunk c0 of a range at alignment delta, including the high bits of c0 no test buffer
// reaches.
extern "C" void refit_emulate_piece_factor(u64 c0, u64 delta, const u64* constants, u64* out) {
    emu::launch(1, WARP, [&] {
        const u64 factor = piece_factor(c0, delta, threadIdx.x % WARP, constants);
        if (threadIdx.x == 0) *out = factor;
    });
}
