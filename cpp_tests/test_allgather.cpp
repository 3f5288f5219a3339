// Allgather from C++17 on the host backend: equal, uneven with a zero block, in place, and 200 calls
// in a row, each checked byte for byte against blocks concatenated with std::vector.
#include <cstdint>
#include <numeric>
#include <vector>

#include "check.h"

namespace {

std::vector<uint8_t> block(size_t rank, size_t call, size_t len) {
  std::vector<uint8_t> out(len);
  uint32_t x = static_cast<uint32_t>(rank * 2654435761u + call * 40503u + 1u);
  for (auto &b : out) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(x >> 24);
  }
  return out;
}

uint64_t address(const void *p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); }

// One whole-group allgather; `in_place` puts every block in its slot first and passes the slot as send.
bool gather_once(refit_group *group, const std::vector<size_t> &counts, size_t call, bool in_place,
                 uint32_t algo) {
  const size_t n = counts.size();
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  std::vector<std::vector<uint8_t>> blocks;
  std::vector<uint8_t> expected;
  std::vector<size_t> offsets;
  for (size_t r = 0; r < n; r++) {
    offsets.push_back(expected.size());
    blocks.push_back(block(r, call, counts[r]));
    expected.insert(expected.end(), blocks[r].begin(), blocks[r].end());
  }
  std::vector<std::vector<uint8_t>> recv(n, std::vector<uint8_t>(total + 1, 0xAB));
  std::vector<uint64_t> send_ptr(n), recv_ptr(n);
  for (size_t r = 0; r < n; r++) {
    recv_ptr[r] = address(recv[r].data());
    if (in_place) {
      std::copy(blocks[r].begin(), blocks[r].end(), recv[r].begin() + static_cast<long>(offsets[r]));
      send_ptr[r] = recv_ptr[r] + offsets[r];
    } else {
      send_ptr[r] = address(blocks[r].data());
    }
  }
  if (refit_allgather(group, send_ptr.data(), recv_ptr.data(), counts.data(), algo, nullptr) !=
      REFIT_STATUS_SUCCESS) {
    fprintf(stderr, "allgather: %s\n", refit_last_error_message());
    return false;
  }
  for (size_t r = 0; r < n; r++) {
    if (!std::equal(expected.begin(), expected.end(), recv[r].begin())) return false;
    if (recv[r][total] != 0xAB) return false;  // nothing written past the end
  }
  return true;
}

}  // namespace

int main() {
  refit_group_options options;
  CHECK_OK(refit_group_options_init(&options));
  options.backend = REFIT_BACKEND_HOST;
  const int32_t devices[4] = {3, 1, 0, 2};
  refit_group *group = nullptr;
  CHECK_OK(refit_group_create(devices, 4, &options, &group));

  for (uint32_t algo : {REFIT_ALLGATHER_AUTO, REFIT_ALLGATHER_PEER, REFIT_ALLGATHER_HOST}) {
    CHECK(gather_once(group, {256, 256, 256, 256}, 0, false, algo));
    CHECK(gather_once(group, {3, 0, 1000, 77}, 1, false, algo));
    CHECK(gather_once(group, {3, 0, 1000, 77}, 2, true, algo));
    CHECK(gather_once(group, {0, 0, 0, 0}, 3, false, algo));
  }
  // Outside a scope each call is complete on return (inside one it would only be queued).
  bool all = true;
  for (size_t call = 0; call < 200; call++) all = all && gather_once(group, {64, 1, 0, 31}, call, false, 0);
  CHECK(all);
  refit_group_destroy(group);
  CHECK_DONE();
}
