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
