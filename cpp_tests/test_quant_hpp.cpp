// refit::Group::quantize_batch and refit::quantization (include/refit.hpp) on the host backend: a
// 128 x 128 block whose amax is 448 gets scale 1 and the elements' own codes; a bad job throws
// refit::Error with its status and the library's message. Then the same block as a quantized need
// (refit::Table::add_quantized_need) through a plan and an executor: the plan says it is quantized in
// place, and the codes equal quantize_batch's; a bad need throws; offered by another process, it
// takes the sender path, which an executor without a communicator refuses.
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
  bool threw = false;

  // The same block as a quantized need of a plan, quantized in place from its one offer.
  refit::Table table;
  uint32_t t = table.add_tensor("w", {128, 128}, 2);
  table.add_offer(t, 0, 0, addr(source), {0, 0}, {128, 128});
  std::vector<uint8_t> planned(128 * 128, 0xab);
  float planned_scale = 0.0f;
  refit_need_quantization need{};
  need.quantization = refit::quantization(REFIT_FP8_E4M3FN, REFIT_QUANT_BLOCK);
  need.source_type = REFIT_SOURCE_BF16;
  need.scales = addr(&planned_scale);
  need.scale_row_stride = 1;
  table.add_quantized_need(t, 0, 0, addr(planned.data()), {0, 0}, {128, 128}, {128, 1}, need);
  refit::Plan plan = refit::Plan::build({&table});
  std::vector<refit::QuantRoute> routes = plan.quant_routes();
  CHECK(routes.size() == 1 && routes[0].tensor == "w" && routes[0].path == REFIT_PATH_IN_PLACE);
  CHECK(routes[0].elements == 128 * 128 && plan.stats().quantized_needs == 1);
  refit::Executor executor(plan, group);
  CHECK(executor.run(group).quantized_elements == 128 * 128);
  CHECK(planned == codes && planned_scale == 1.0f);
  need.arithmetic = 5;
  threw = false;
  try {
    table.add_quantized_need(t, 0, 0, addr(planned.data()), {0, 0}, {128, 128}, {128, 1}, need);
  } catch (const refit::Error &e) {
    threw = true;
    CHECK(e.status() == REFIT_STATUS_INVALID_ARGUMENT);
    CHECK(e.message().find("arithmetic is 5") != std::string::npos);
  }
  CHECK(threw);

  job.quantization.block_cols = 100;
  threw = false;
  try {
    group.quantize_batch(0, {job});
  } catch (const refit::Error &e) {
    threw = true;
    CHECK(e.status() == REFIT_STATUS_INVALID_ARGUMENT);
    CHECK(e.message().find("multiple of 8") != std::string::npos);
  }
  CHECK(threw);

  // The same block offered by another process (rank 1): that process quantizes it (the sender
  // path), and an executor without a communicator throws UNSUPPORTED naming the tensor.
  refit::Table elsewhere;
  uint32_t u = elsewhere.add_tensor("w", {128, 128}, 2);
  elsewhere.add_offer(u, 1, 0, addr(source), {0, 0}, {128, 128});
  need.arithmetic = REFIT_ARITHMETIC_DIVIDE;
  elsewhere.add_quantized_need(u, 0, 0, addr(planned.data()), {0, 0}, {128, 128}, {128, 1}, need);
  refit::Plan sent = refit::Plan::build({&elsewhere});
  routes = sent.quant_routes();
  CHECK(routes.size() == 1 && routes[0].path == REFIT_PATH_SENDER && routes[0].runner_rank == 1);
  CHECK(sent.stats().quantized_sent_bytes == 2 * 128 * 128);
  threw = false;
  try {
    refit::Executor across(sent, group);
  } catch (const refit::Error &e) {
    threw = true;
    CHECK(e.status() == REFIT_STATUS_UNSUPPORTED);
    CHECK(e.message().find("'w'") != std::string::npos);
  }
  CHECK(threw);

  // refit::Table::share_amax: a key reaches the table (it travels with its encoding, which grows by
  // the entry), and key 0 throws INVALID_ARGUMENT.
  std::size_t before = elsewhere.encode().size();
  elsewhere.share_amax(0, addr(planned.data()) + 128 * 128, 42);
  CHECK(elsewhere.encode().size() > before);
  threw = false;
  try {
    elsewhere.share_amax(0, addr(planned.data()), 0);
  } catch (const refit::Error &e) {
    threw = true;
    CHECK(e.status() == REFIT_STATUS_INVALID_ARGUMENT);
  }
  CHECK(threw);
  CHECK_DONE();
}
