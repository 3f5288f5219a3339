// include/refit.hpp, the C++17 wrapper: owning move-only handles, errors as refit::Error carrying the
// status and message, a plan built from wrapped tables and executed on the host backend, run() with a
// throwing rank, and the argument checks the wrapper adds.
#include "refit.hpp"

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "check.h"

namespace {

static_assert(!std::is_copy_constructible_v<refit::Table> && !std::is_copy_assignable_v<refit::Table>);
static_assert(!std::is_copy_constructible_v<refit::Plan> && !std::is_copy_constructible_v<refit::Group>);
static_assert(!std::is_copy_constructible_v<refit::PreparedCopy> && !std::is_copy_constructible_v<refit::HostStream>);
static_assert(std::is_nothrow_move_constructible_v<refit::Table> && std::is_nothrow_move_assignable_v<refit::Plan>);
static_assert(std::is_nothrow_move_constructible_v<refit::Group>);

uint64_t addr(const void *p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); }

// Runs `fn`, which must throw refit::Error with `status`; returns its message.
template <typename Fn>
std::string expect_error(Fn fn, refit_status status) {
  try {
    fn();
  } catch (const refit::Error &e) {
    CHECK(e.status() == status);
    CHECK(std::string(e.what()).find(refit_status_string(status)) == 0);
    return e.message();
  }
  CHECK(!"no refit::Error thrown");
  return "";
}

void errors_carry_status_and_message() {
  std::string message = expect_error([] { refit::Group group({}); }, REFIT_STATUS_EMPTY_DEVICE_LIST);
  CHECK(!message.empty());
  expect_error([] { refit::Group group({0, 0}, REFIT_BACKEND_HOST); }, REFIT_STATUS_DUPLICATE_DEVICE);
  const uint8_t garbage[16] = {1, 2, 3};
  expect_error([&] { refit::Table::decode(garbage, sizeof(garbage)); }, REFIT_STATUS_DECODE_ERROR);
  refit::Table table;
  expect_error([&] { table.add_tensor("", {4}, 2); }, REFIT_STATUS_INVALID_ARGUMENT);
  uint32_t t = table.add_tensor("w", {4, 4}, 2);
  // Vectors whose lengths disagree are refused by the wrapper before the library reads past one.
  message = expect_error([&] { table.add_offer(t, 0, 0, 4096, {0, 0}, {4}); }, REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(message.find("extent") != std::string::npos);
  expect_error([&] { table.add_need(t, 0, 0, 4096, {0, 0}, {4, 4}, {4}); }, REFIT_STATUS_INVALID_ARGUMENT);
  expect_error([&] { table.add_need(t, 0, 0, 4096, {0, 0}, {4, 4}, {4, 1}, {0}); }, REFIT_STATUS_INVALID_ARGUMENT);
  // A box outside the tensor is the library's own TENSOR_MISMATCH.
  expect_error([&] { table.add_offer(t, 0, 0, 4096, {2, 0}, {4, 4}); }, REFIT_STATUS_TENSOR_MISMATCH);
}

void moved_from_handles_hold_nothing() {
  refit::Table a;
  a.add_tensor("w", {8}, 4);
  refit_table *raw = a.get();
  refit::Table b(std::move(a));
  CHECK(a.get() == nullptr && !a.get());
  CHECK(b.get() == raw);
  expect_error([&] { a.encode(); }, REFIT_STATUS_INVALID_STATE);
  refit::Table c;
  c = std::move(b);  // c's own table is destroyed (valgrind would report a leak otherwise)
  CHECK(c.get() == raw && b.get() == nullptr);
  CHECK(!c.encode().empty());
  expect_error([&] { refit::Plan::build({&b}); }, REFIT_STATUS_NULL_ARGUMENT);
}

// A [6, 4] u32 tensor offered whole by device 0 and needed by device 1 as two row halves in reversed
// order: rows 3..6 first, then rows 0..3.
void plan_executes_on_host_backend() {
  std::vector<uint32_t> source(24), dest(24, 0xDEADBEEF);
  for (uint32_t i = 0; i < 24; i++) source[i] = i * 2654435761u;
  refit::Table publisher, receiver;
  uint32_t t = publisher.add_tensor("layers.0.w", {6, 4}, 4, 7);
  publisher.add_offer(t, 0, 0, addr(source.data()), {0, 0}, {6, 4});
  uint32_t r = receiver.add_tensor("layers.0.w", {6, 4}, 4, 7);
  receiver.add_need(r, 0, 1, addr(&dest[12]), {0, 0}, {3, 4}, {4, 1});
  receiver.add_need(r, 0, 1, addr(&dest[0]), {3, 0}, {3, 4}, {4, 1});

  refit::Plan plan = refit::Plan::build({&publisher, &receiver});
  refit::Table decoded = refit::Table::decode(receiver.encode());
  CHECK(refit::Plan::build({&decoded, &publisher}).fingerprint() == plan.fingerprint());
  CHECK(plan.stats().needed_bytes == 24 * 4);
  std::vector<refit::Route> routes = plan.routes();
  CHECK(routes.size() == 1 && routes[0].kind == REFIT_ROUTE_PEER);
  CHECK(routes[0].src_device == 0 && routes[0].dst_device == 1);
  expect_error([&] { plan.route(1); }, REFIT_STATUS_NOT_FOUND);

  refit::Group group({0, 1}, REFIT_BACKEND_HOST);
  CHECK(group.size() == 2 && group.device(1) == 1 && group.backend() == REFIT_BACKEND_HOST);
  refit::HostStream stream;
  {
    auto scope = group.scope({stream.get(), stream.get()});
    // Rank 1 (device 1) pulls its need from the peer.
    group.copy_batch(1, routes[0].segments, group.stream(1));
  }
  for (uint32_t i = 0; i < 24; i++) CHECK(dest[i] == source[(i + 12) % 24]);

  // The same copy prepared once and launched again after the destination is poisoned.
  refit::PreparedCopy prepared = group.prepare_copy(1, routes[0].segments);
  std::memset(dest.data(), 0xAB, dest.size() * 4);
  prepared.launch();
  for (uint32_t i = 0; i < 24; i++) CHECK(dest[i] == source[(i + 12) % 24]);
  expect_error([&] { group.enter({nullptr}); }, REFIT_STATUS_INVALID_ARGUMENT);
  auto scope = group.scope();
  scope.close();
  expect_error([&] { scope.close(); }, REFIT_STATUS_INVALID_STATE);
  expect_error([&] { group.exit(); }, REFIT_STATUS_INVALID_STATE);  // no scope is open any more
}

void run_rethrows_the_rank_exception_and_gathers() {
  refit::Group group({0, 1}, REFIT_BACKEND_HOST);
  bool caught = false;
  try {
    group.run([](uint32_t rank, void *) {
      if (rank == 1) throw std::out_of_range("rank 1 failed");
    });
  } catch (const std::out_of_range &e) {
    caught = std::string(e.what()) == "rank 1 failed";
  }
  CHECK(caught);
  // A named (lvalue) callable works as well as a temporary one.
  std::vector<int> ranks_seen(2, 0);
  auto record = [&](uint32_t rank, void *) { ranks_seen[rank]++; };
  group.run(record);
  CHECK(ranks_seen[0] == 1 && ranks_seen[1] == 1);
  // The group stays usable: a per-rank allgather of 8 bytes from each rank.
  std::vector<uint64_t> send = {0x1111111111111111ull, 0x2222222222222222ull};
  std::vector<uint64_t> recv(4, 0);
  group.run([&](uint32_t rank, void *) {
    group.allgather_rank(rank, addr(&send[rank]), addr(&recv[2 * rank]), {8, 8});
  });
  CHECK(recv[0] == send[0] && recv[1] == send[1] && recv[2] == send[0] && recv[3] == send[1]);
  expect_error([&] { group.allgather({addr(&send[0])}, {addr(&recv[0])}, {8}); }, REFIT_STATUS_INVALID_ARGUMENT);
}

}  // namespace

int main() {
  CHECK(refit::version() == REFIT_VERSION_STRING);
  CHECK(refit::abi_version() == REFIT_ABI_VERSION);
  errors_carry_status_and_message();
  moved_from_handles_hold_nothing();
  plan_executes_on_host_backend();
  run_rethrows_the_rank_exception_and_gathers();
  CHECK_DONE();
}
