// The reshard plan API from C++17: RAII ownership of tables and plans, a TP-style column split of
// stacked experts planned and executed on host memory, and a built plan read from several threads
// at once (a plan is immutable and documented as safe to share).
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "check.h"

namespace {

struct TableDeleter {
  void operator()(refit_table *t) const { refit_table_destroy(t); }
};
struct PlanDeleter {
  void operator()(refit_plan *p) const { refit_plan_destroy(p); }
};
using Table = std::unique_ptr<refit_table, TableDeleter>;
using Plan = std::unique_ptr<refit_plan, PlanDeleter>;

Table make_table() {
  refit_table *raw = nullptr;
  CHECK_OK(refit_table_create(&raw));
  return Table(raw);
}

uint64_t addr(const void *p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); }

constexpr uint64_t kExperts = 8, kRows = 6, kCols = 4;

}  // namespace

int main() {
  // The publisher keeps every expert's [kRows, kCols] weight back to back in one buffer.
  std::vector<uint16_t> experts(kExperts * kRows * kCols);
  for (size_t i = 0; i < experts.size(); i++) experts[i] = static_cast<uint16_t>(i * 7 + 1);
  // The receiver takes rows 3..6 of each expert into a stacked [kExperts, 3, kCols] weight.
  std::vector<uint16_t> stacked(kExperts * 3 * kCols, 0xEEEE);

  Table pub = make_table(), recv = make_table();
  const uint64_t shape[2] = {kRows, kCols}, zero[2] = {0, 0};
  const uint64_t lower[2] = {3, 0}, half[2] = {3, kCols}, strides[2] = {kCols, 1};
  for (uint64_t e = 0; e < kExperts; e++) {
    std::string name = "experts." + std::to_string(e) + ".w";
    uint32_t t = 0;
    CHECK_OK(refit_table_add_tensor(pub.get(), name.c_str(), 5, 2, shape, 2, &t));
    CHECK_OK(refit_table_add_offer(pub.get(), t, 0, 0, addr(&experts[e * kRows * kCols]), zero, shape, nullptr, 2,
                                   nullptr));
    CHECK_OK(refit_table_add_tensor(recv.get(), name.c_str(), 5, 2, shape, 2, &t));
    CHECK_OK(refit_table_add_need(recv.get(), t, 0, 1, addr(&stacked[e * 3 * kCols]), lower, half, nullptr, strides, 2));
  }
  const refit_table *tables[2] = {pub.get(), recv.get()};
  refit_plan *raw = nullptr;
  CHECK_OK(refit_plan_build(tables, 2, nullptr, &raw));
  Plan plan(raw);

  // One route (rank 0 device 0 -> rank 0 device 1: a peer copy) holding one segment: the 3-row
  // slice of consecutive experts, 48 bytes from each, repeated with the experts' strides.
  size_t routes = 0;
  CHECK_OK(refit_plan_route_count(plan.get(), &routes));
  CHECK(routes == 1);
  refit_route_info info{};
  info.size = sizeof(info);
  CHECK_OK(refit_plan_route(plan.get(), 0, &info));
  CHECK(info.kind == REFIT_ROUTE_PEER);
  CHECK(info.segment_count == 1);
  const refit_segment &s = info.segments[0];
  CHECK(s.len == 3 * kCols * 2 && s.count[0] * s.count[1] == kExperts);
  for (uint64_t j = 0; j < s.count[1]; j++)
    for (uint64_t i = 0; i < s.count[0]; i++)
      memcpy(reinterpret_cast<void *>(s.dst + j * s.dst_stride[1] + i * s.dst_stride[0]),
             reinterpret_cast<const void *>(s.src + j * s.src_stride[1] + i * s.src_stride[0]), s.len);
  for (uint64_t e = 0; e < kExperts; e++)
    for (uint64_t r = 0; r < 3; r++)
      for (uint64_t c = 0; c < kCols; c++)
        CHECK(stacked[(e * 3 + r) * kCols + c] == experts[(e * kRows + 3 + r) * kCols + c]);

  // Readers on several threads see the same plan.
  uint64_t fingerprint = 0;
  CHECK_OK(refit_plan_fingerprint(plan.get(), &fingerprint));
  std::vector<std::thread> readers;
  std::vector<int> agreed(4, 0);
  for (int k = 0; k < 4; k++) {
    readers.emplace_back([&, k] {
      bool same = true;
      for (int round = 0; round < 200; round++) {
        uint64_t f = 0;
        refit_plan_stats stats{};
        stats.size = sizeof(stats);
        refit_route_info r{};
        r.size = sizeof(r);
        same = same && refit_plan_fingerprint(plan.get(), &f) == REFIT_STATUS_SUCCESS && f == fingerprint;
        same = same && refit_plan_get_stats(plan.get(), &stats) == REFIT_STATUS_SUCCESS &&
               stats.needed_bytes == stacked.size() * 2 && stats.ranges_coalesced == 1;
        same = same && refit_plan_route(plan.get(), 0, &r) == REFIT_STATUS_SUCCESS && r.segments == info.segments;
      }
      agreed[k] = same ? 1 : 0;
    });
  }
  for (auto &t : readers) t.join();
  for (int k = 0; k < 4; k++) CHECK(agreed[k] == 1);

  // Coalescing off (the A/B arm) moves the same bytes as one segment per expert.
  refit_plan_options options;
  CHECK_OK(refit_plan_options_init(&options));
  options.coalesce = false;
  options.policy = REFIT_POLICY_FIRST;
  CHECK_OK(refit_plan_build(tables, 2, &options, &raw));
  Plan flat(raw);
  refit_plan_stats stats{};
  stats.size = sizeof(stats);
  CHECK_OK(refit_plan_get_stats(flat.get(), &stats));
  CHECK(stats.ranges_coalesced == kExperts && stats.needed_bytes == stacked.size() * 2);
  CHECK(stats.bytes_peer == stats.needed_bytes);
  CHECK_DONE();
}
