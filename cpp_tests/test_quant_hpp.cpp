// refit::Group::quantize_batch and refit::quantization (include/refit.hpp) on the host backend: a
// 128 x 128 block whose amax is 448 gets scale 1 and the elements' own codes; a bad job throws
// refit::Error with its status and the library's message.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "refit.hpp"

#include "check.h"

static uint64_t addr(const void *p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); }

static uint16_t bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return static_cast<uint16_t>(bits >> 16);
}

int main() {
  refit::Group group({0}, REFIT_BACKEND_HOST);
  alignas(16) static uint16_t source[128 * 128];
  for (int i = 0; i < 128 * 128; i++) source[i] = bf16(i % 3 == 0 ? 1.0f : -2.0f);
  source[77] = bf16(448.0f);
  std::vector<uint8_t> codes(128 * 128, 0xab);
  float scale = 0.0f;

  refit_quantize_job job{};
  job.quantization = refit::quantization(REFIT_FP8_E4M3FN, REFIT_QUANT_BLOCK);
  job.source_type = REFIT_SOURCE_BF16;
  job.src = addr(source);
  job.rows = 128;
  job.cols = 128;
  job.src_row_stride = 128;
  job.dst = addr(codes.data());
  job.dst_row_stride = 128;
  job.scales = addr(&scale);
  job.scale_row_stride = 1;
  group.quantize_batch(0, {job});
  CHECK(scale == 1.0f);
  CHECK(codes[0] == 0x38 && codes[1] == 0xc0 && codes[77] == 0x7e); /* 1.0, -2.0, 448 */
  CHECK(refit::quantization(REFIT_FP8_E5M2, REFIT_QUANT_MXFP8).block_rows == 0);

  job.quantization.block_cols = 100;
  bool threw = false;
  try {
    group.quantize_batch(0, {job});
  } catch (const refit::Error &e) {
    threw = true;
    CHECK(e.status() == REFIT_STATUS_INVALID_ARGUMENT);
    CHECK(e.message().find("multiple of 8") != std::string::npos);
  }
  CHECK(threw);
  CHECK_DONE();
}
