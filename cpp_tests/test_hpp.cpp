// include/refit.hpp, the C++17 wrapper: owning move-only handles, errors as refit::Error carrying the
// status and message, a plan built from wrapped tables and executed on the host backend (by copy
// batches and by refit::Executor: direct, staged, scoped, rebound), run() with a throwing rank,
// communicators of two processes (allgather) and of one rank (allgather, plan and executor across,
// abort), digests, and the argument checks the wrapper adds.
#include "refit.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"

namespace {

static_assert(!std::is_copy_constructible_v<refit::Table> && !std::is_copy_assignable_v<refit::Table>);
static_assert(!std::is_copy_constructible_v<refit::Plan> && !std::is_copy_constructible_v<refit::Group>);
static_assert(!std::is_copy_constructible_v<refit::PreparedCopy> && !std::is_copy_constructible_v<refit::HostStream>);
static_assert(std::is_nothrow_move_constructible_v<refit::Table> && std::is_nothrow_move_assignable_v<refit::Plan>);
static_assert(std::is_nothrow_move_constructible_v<refit::Group>);
static_assert(!std::is_copy_constructible_v<refit::Executor> && !std::is_copy_assignable_v<refit::Executor>);
static_assert(!std::is_copy_constructible_v<refit::Comm> && !std::is_copy_assignable_v<refit::Comm>);
static_assert(std::is_nothrow_move_constructible_v<refit::Executor> &&
              std::is_nothrow_move_assignable_v<refit::Executor>);
static_assert(std::is_nothrow_move_constructible_v<refit::Comm> && std::is_nothrow_move_assignable_v<refit::Comm>);

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
  CHECK(message == "extent has 1 entries; the box has 2 dimensions");
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
  CHECK(group.rank_of(1) == 1 && group.rank_of(0) == 0);
  try {
    group.rank_of(5);
    CHECK(false);
  } catch (const refit::Error &e) {
    CHECK(e.status() == REFIT_STATUS_INVALID_ARGUMENT && std::string(e.what()).find("device 5") != std::string::npos);
  }
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
  std::string message =
      expect_error([&] { group.allgather({addr(&send[0])}, {addr(&recv[0])}, {8}); }, REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(message == "send has 1 entries; the group has 2 ranks");
}

// Process 0 holds w [ROWS, COLS] (u32) on device 0 and receives w's right column half on device 0 (a
// local route) and all of w, transposed, on device 1 (a peer route). Coalescing is off so that each
// destination buffer keeps segments of its own (rebind moves whole buffers).
constexpr uint32_t ROWS = 12, COLS = 10, HALF = COLS / 2;
constexpr uint8_t POISON = 0xEE;

struct Buffers {
  std::vector<uint32_t> w = std::vector<uint32_t>(ROWS * COLS);
  std::vector<uint32_t> half = std::vector<uint32_t>(ROWS * HALF);
  std::vector<uint32_t> whole_t = std::vector<uint32_t>(COLS * ROWS);

  void fill(uint32_t seed) {
    for (uint32_t i = 0; i < ROWS * COLS; i++) w[i] = seed * 1000003u + i * 7919u;
  }
};

void poison(std::vector<uint32_t> &v) { std::memset(v.data(), POISON, v.size() * 4); }

bool all_poison(const std::vector<uint32_t> &v) {
  return std::all_of(v.begin(), v.end(), [](uint32_t x) { return x == 0xEEEEEEEEu; });
}

// Whether `half` and `whole_t` hold what `w` says, element by element.
bool received(const std::vector<uint32_t> &w, const std::vector<uint32_t> &half, const std::vector<uint32_t> &whole_t) {
  for (uint32_t r = 0; r < ROWS; r++)
    for (uint32_t c = 0; c < HALF; c++)
      if (half[r * HALF + c] != w[r * COLS + HALF + c]) return false;
  for (uint32_t c = 0; c < COLS; c++)
    for (uint32_t r = 0; r < ROWS; r++)
      if (whole_t[c * ROWS + r] != w[r * COLS + c]) return false;
  return true;
}

refit::Table table_into(const Buffers &b, const uint32_t *half, const uint32_t *whole_t) {
  refit::Table table;
  uint32_t w = table.add_tensor("w", {ROWS, COLS}, 4, 1);
  table.add_offer(w, 0, 0, addr(b.w.data()), {0, 0}, {ROWS, COLS});
  table.add_need(w, 0, 0, addr(half), {0, HALF}, {ROWS, HALF}, {HALF, 1});
  table.add_need(w, 0, 1, addr(whole_t), {0, 0}, {ROWS, COLS}, {ROWS, 1}, {1, 0});
  return table;
}

void executor_runs_direct_staged_scoped_and_rebound() {
  Buffers b;
  refit::Table table = table_into(b, b.half.data(), b.whole_t.data());
  refit::Plan plan = refit::Plan::build({&table}, REFIT_POLICY_LOCAL, false);
  refit::Group group({0, 1}, REFIT_BACKEND_HOST);
  const uint64_t half_bytes = b.half.size() * 4, whole_bytes = b.whole_t.size() * 4;

  // Direct, verified, outside a scope: complete on return; sources are read again at every run.
  refit_executor_options options = refit::executor_options();
  CHECK(options.size == sizeof(options) && options.arm == REFIT_ARM_AUTO && options.commit == REFIT_COMMIT_DIRECT);
  options.verify = true;
  refit::Executor direct(plan, group, 0, options);
  for (uint32_t round = 0; round < 2; round++) {
    b.fill(round + 1);
    poison(b.half);
    poison(b.whole_t);
    refit_run_stats stats = direct.run(group);
    CHECK(received(b.w, b.half, b.whole_t));
    CHECK(stats.bytes[REFIT_ROUTE_LOCAL] == half_bytes && stats.bytes[REFIT_ROUTE_PEER] == whole_bytes);
    CHECK(stats.bytes[REFIT_ROUTE_REMOTE] == 0 && stats.arm[REFIT_ROUTE_REMOTE] == REFIT_ARM_NONE);
    CHECK(stats.installed_bytes == half_bytes + whole_bytes && stats.verified && stats.device_timed);
  }
  std::string message = expect_error([&] { direct.commit(group); }, REFIT_STATUS_INVALID_STATE);
  CHECK(message.find("commits directly") != std::string::npos);

  // Inside a scope the run is only queued; stats() waits for it and adds the device times.
  refit::HostStream s0, s1;
  b.fill(7);
  poison(b.half);
  {
    auto scope = group.scope({s0.get(), s1.get()});
    CHECK(!direct.run(group).device_timed);
  }
  CHECK(received(b.w, b.half, b.whole_t));
  refit_run_stats later = direct.stats();
  CHECK(later.device_timed && later.bytes[REFIT_ROUTE_PEER] == whole_bytes);

  // Staged: run leaves the live buffers alone, commit installs every byte, once.
  refit_executor_options staged_options = refit::executor_options();
  staged_options.commit = REFIT_COMMIT_STAGED;
  staged_options.verify = true;
  refit::Executor staged(plan, group, 0, staged_options);
  refit_executor_info info = staged.info();  // known before any run
  CHECK(info.slices == 1 && info.staging_bytes >= half_bytes + whole_bytes);
  expect_error([&] { staged.commit(group); }, REFIT_STATUS_INVALID_STATE);  // nothing staged yet
  b.fill(11);
  poison(b.half);
  poison(b.whole_t);
  refit_run_stats ran = staged.run(group);
  CHECK(ran.slices == 1 && ran.installed_bytes == 0);
  CHECK(all_poison(b.half) && all_poison(b.whole_t));
  refit_run_stats committed = staged.commit(group);
  CHECK(committed.installed_bytes == half_bytes + whole_bytes && committed.verified);
  CHECK(received(b.w, b.half, b.whole_t));
  expect_error([&] { staged.commit(group); }, REFIT_STATUS_INVALID_STATE);

  // Rebind: the half buffer moved; the next run writes the new place and not the old one.
  std::vector<uint32_t> moved(b.half.size());
  direct.rebind(0, addr(b.half.data()), addr(moved.data()), half_bytes);
  b.fill(13);
  poison(b.half);
  poison(moved);
  refit_run_stats rebound = direct.run(group);
  CHECK(received(b.w, moved, b.whole_t) && all_poison(b.half) && !rebound.descriptors_reused);
  expect_error([&] { direct.rebind(0, addr(b.half.data()), addr(moved.data()), half_bytes); }, REFIT_STATUS_NOT_FOUND);
  expect_error([&] { direct.rebind(2, addr(moved.data()), addr(b.half.data()), half_bytes); },
               REFIT_STATUS_INVALID_DEVICE);

  // Bad options, another group, a moved-from plan: each its status; no executor is made.
  refit_executor_options bad = refit::executor_options();
  bad.staging_limit = 1 << 20;  // staged commit only
  message = expect_error([&] { refit::Executor e(plan, group, 0, bad); }, REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(message.find("staged commit only") != std::string::npos);
  refit::Group other({0, 1}, REFIT_BACKEND_HOST);
  message = expect_error([&] { direct.run(other); }, REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(message.find("another group") != std::string::npos);
  refit::Group one({0}, REFIT_BACKEND_HOST);
  expect_error([&] { refit::Executor e(plan, one); }, REFIT_STATUS_NOT_FOUND);  // device 1 is missing
  refit::Plan gone = std::move(plan);
  expect_error([&] { refit::Executor e(plan, group); }, REFIT_STATUS_NULL_ARGUMENT);

  // Moves: the moved-from executor holds nothing; move-assignment releases the target's own.
  refit_executor *raw = direct.get();
  refit::Executor taken(std::move(direct));
  CHECK(direct.get() == nullptr && taken.get() == raw);
  expect_error([&] { direct.run(group); }, REFIT_STATUS_INVALID_STATE);
  expect_error([&] { direct.stats(); }, REFIT_STATUS_INVALID_STATE);
  staged = std::move(taken);  // staged's own executor is destroyed (valgrind would see a leak)
  CHECK(staged.get() == raw && taken.get() == nullptr);
  b.fill(17);
  poison(moved);
  staged.run(group);
  CHECK(received(b.w, moved, b.whole_t));
}

// A communicator of one rank on the host backend: its queries, an allgather (its own block copied
// into place), a plan across equal to the plan built here, an executor across moving real bytes,
// abort, and the error paths.
void communicator_of_one_rank() {
  expect_error([] { refit::Comm::unique_id(7); }, REFIT_STATUS_INVALID_ARGUMENT);
  refit_comm_id id = refit::Comm::unique_id(REFIT_BACKEND_HOST);
  expect_error([&] { refit::Comm c(id, 0, 0, 0); }, REFIT_STATUS_INVALID_ARGUMENT);  // nranks 0
  expect_error([&] { refit::Comm c(id, 1, 0, -1); }, REFIT_STATUS_INVALID_DEVICE);
  refit_comm_options bad = refit::comm_options();
  bad.timeout_ms = 0;
  expect_error([&] { refit::Comm c(id, 1, 0, 0, bad); }, REFIT_STATUS_INVALID_ARGUMENT);
  expect_error([] { refit::Comm::adopt(nullptr); }, REFIT_STATUS_NULL_ARGUMENT);

  refit_comm_options options = refit::comm_options();
  CHECK(options.size == sizeof(options) && options.timeout_ms == 600000);
  options.timeout_ms = 60000;
  refit::Comm comm(id, 1, 0, 1, options);
  CHECK(comm.rank() == 0 && comm.size() == 1 && comm.device() == 1 && comm.backend() == REFIT_BACKEND_HOST);

  // Allgather on the communicator's own stream, then on a host stream.
  std::vector<uint8_t> send(37), recv(37, 0);
  for (std::size_t i = 0; i < send.size(); i++) send[i] = static_cast<uint8_t>(i * 13 + 5);
  comm.allgather(addr(send.data()), addr(recv.data()), {send.size()});
  comm.synchronize();
  CHECK(recv == send);
  refit::HostStream stream;
  std::fill(recv.begin(), recv.end(), 0);
  comm.allgather(addr(send.data()), addr(recv.data()), {send.size()}, stream.get());
  comm.synchronize(stream.get());
  CHECK(recv == send);
  std::string message = expect_error([&] { comm.allgather(addr(send.data()), addr(recv.data()), {4, 4}); },
                                     REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(message == "counts has 2 entries; the communicator has 1 ranks");
  expect_error([&] { comm.allgather(addr(send.data() + 1), addr(send.data()), {8}); }, REFIT_STATUS_OVERLAP);

  // The plan across one rank is the whole plan: same routes, same inputs fingerprint.
  Buffers b;
  refit::Table table = table_into(b, b.half.data(), b.whole_t.data());
  refit::Plan across = refit::Plan::build_across(comm, table);
  refit::Plan whole = refit::Plan::build({&table});
  refit::Plan share = refit::Plan::build_share({&table}, 0);
  CHECK(across.inputs_fingerprint() == whole.inputs_fingerprint());
  CHECK(share.inputs_fingerprint() == whole.inputs_fingerprint());
  CHECK(refit::Plan::build({&table}, REFIT_POLICY_BALANCED).inputs_fingerprint() != whole.inputs_fingerprint());
  std::vector<refit::Route> expected = whole.routes();
  CHECK(expected.size() == 2);
  for (const refit::Plan *p : {&across, &share}) {
    std::vector<refit::Route> got = p->routes();
    CHECK(got.size() == expected.size());
    for (std::size_t i = 0; i < got.size(); i++) {
      CHECK(got[i].kind == expected[i].kind && got[i].dst_device == expected[i].dst_device);
      CHECK(got[i].segments.size() == expected[i].segments.size());
      CHECK(std::memcmp(got[i].segments.data(), expected[i].segments.data(),
                        got[i].segments.size() * sizeof(refit_segment)) == 0);
    }
  }
  expect_error([&] { refit::Plan::build_across(comm, table, 9); }, REFIT_STATUS_INVALID_ARGUMENT);

  // An executor across the communicator moves the bytes like a local one.
  refit::Group group({0, 1}, REFIT_BACKEND_HOST);
  refit::Executor executor = refit::Executor::across(across, group, comm);
  b.fill(23);
  poison(b.half);
  poison(b.whole_t);
  refit_run_stats stats = executor.run(group);
  CHECK(received(b.w, b.half, b.whole_t));
  CHECK(stats.bytes[REFIT_ROUTE_PEER] == b.whole_t.size() * 4 && stats.remote_received_bytes == 0);

  // Moves, then abort: every later call fails with ABORTED.
  refit_comm *raw = comm.get();
  refit::Comm moved(std::move(comm));
  CHECK(comm.get() == nullptr && moved.get() == raw);
  expect_error([&] { comm.rank(); }, REFIT_STATUS_INVALID_STATE);
  expect_error([&] { comm.abort(); }, REFIT_STATUS_INVALID_STATE);
  expect_error([&] { refit::Plan::build_across(comm, table); }, REFIT_STATUS_NULL_ARGUMENT);
  expect_error([&] { refit::Executor::across(across, group, comm); }, REFIT_STATUS_NULL_ARGUMENT);
  moved.abort();
  moved.abort();  // harmless
  expect_error([&] { moved.allgather(addr(send.data()), addr(recv.data()), {send.size()}); }, REFIT_STATUS_ABORTED);
  expect_error([&] { moved.synchronize(); }, REFIT_STATUS_ABORTED);
}

uint8_t byte_of(uint32_t rank, std::size_t i) { return static_cast<uint8_t>(rank * 59 + i * 7 + (i >> 5)); }

// Two processes (this one and a forked child) join one communicator and allgather uneven blocks,
// each checked against the bytes computed here for every rank. Runs before anything else starts
// library threads (a fork copies only the calling thread).
// The child is forked before the id exists and reads it from a pipe: the id's maker runs its
// rendezvous root on a thread, which a process forked after it would copy without the thread.
void communicator_of_two_processes() {
  int pipe_fds[2];
  CHECK(pipe(pipe_fds) == 0);
  std::fflush(stdout);
  pid_t child = fork();
  CHECK(child >= 0);
  const uint32_t rank = child == 0 ? 1 : 0;
  refit_comm_id id;
  if (child == 0) {
    close(pipe_fds[1]);
    std::size_t got = 0;
    while (got < sizeof id) {
      ssize_t n = read(pipe_fds[0], reinterpret_cast<char *>(&id) + got, sizeof id - got);
      if (n <= 0) _exit(3);
      got += static_cast<std::size_t>(n);
    }
    close(pipe_fds[0]);
  } else {
    close(pipe_fds[0]);
    id = refit::Comm::unique_id(REFIT_BACKEND_HOST);
    CHECK(write(pipe_fds[1], &id, sizeof id) == static_cast<ssize_t>(sizeof id));
    close(pipe_fds[1]);
  }
  {
    refit_comm_options options = refit::comm_options();
    options.timeout_ms = 60000;
    refit::Comm comm(id, 2, rank, 0, options);
    CHECK(comm.rank() == rank && comm.size() == 2);
    const std::vector<std::size_t> counts = {5, 300};
    std::vector<uint8_t> send(counts[rank]), recv(counts[0] + counts[1], 0xEE);
    for (std::size_t i = 0; i < send.size(); i++) send[i] = byte_of(rank, i);
    comm.allgather(addr(send.data()), addr(recv.data()), counts);
    comm.synchronize();
    for (std::size_t i = 0; i < recv.size(); i++)
      CHECK(recv[i] == (i < counts[0] ? byte_of(0, i) : byte_of(1, i - counts[0])));
  }
  if (child == 0) std::exit(0);  // the child's checks passed; the parent reports the total
  int status = 0;
  CHECK(waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

// The header's definition of the digest: the bits as a polynomial over GF(2), plus x^(8 len), mod g.
uint64_t reference_digest(const uint8_t *bytes, uint64_t len) {
  const uint64_t g = 0x41aa24523c3d140full;
  uint64_t sum = 0, power = 1;  // x^k mod g
  for (uint64_t k = 0; k <= 8 * len; k++) {
    bool bit = k == 8 * len || ((bytes[k / 8] >> (k % 8)) & 1);
    if (bit) sum ^= power;
    power = (power << 1) ^ ((power >> 63) ? g : 0);
  }
  return sum;
}

void group_digests_bytes() {
  refit::Group group({0, 1}, REFIT_BACKEND_HOST);
  std::vector<uint8_t> bytes(200);
  for (std::size_t i = 0; i < bytes.size(); i++) bytes[i] = static_cast<uint8_t>(i * 37 + 11);
  for (uint64_t offset = 0; offset < 9; offset += 4)
    for (uint64_t len = 0; len < 180; len += 29)
      CHECK(group.digest(1, addr(bytes.data() + offset), len, group.stream(1)) ==
            reference_digest(bytes.data() + offset, len));
  uint64_t original = group.digest(0, addr(bytes.data()), 64);
  bytes[9] ^= 0x04;
  CHECK(group.digest(0, addr(bytes.data()), 64) != original);
  std::string message = expect_error([&] { group.digest(2, addr(bytes.data()), 8); }, REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(message.find("rank 2") != std::string::npos);
  expect_error([&] { group.digest(0, 0, 8); }, REFIT_STATUS_INVALID_ARGUMENT);
  std::vector<uint64_t> addrs, lens;
  for (uint64_t i = 0; i < 30; i++) {
    addrs.push_back(addr(bytes.data() + i % 13));
    lens.push_back(i * 5 % 150);
  }
  addrs.push_back(UINT64_MAX);  // 0 bytes at the last address digest to 1
  lens.push_back(0);
  std::vector<uint64_t> many = group.digest_many(1, addrs, lens, group.stream(1));
  CHECK(many.size() == addrs.size());
  for (std::size_t i = 0; i < many.size(); i++) CHECK(many[i] == group.digest(1, addrs[i], lens[i]));
  CHECK(many.back() == 1);
  CHECK(group.digest_many(0, {}, {}).empty());
  message = expect_error([&] { group.digest_many(0, addrs, {8}); }, REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(message.find("lens has 1 entries") != std::string::npos);
  message = expect_error([&] { group.digest_many(0, {addrs[0], 0}, {8, 8}); }, REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(message.find("range 1: address is 0") != std::string::npos);
  refit::Group gone(std::move(group));
  expect_error([&] { group.digest(0, addr(bytes.data()), 8); }, REFIT_STATUS_INVALID_STATE);
  expect_error([&] { group.digest_many(0, addrs, lens); }, REFIT_STATUS_INVALID_STATE);
}

}  // namespace

int main() {
  CHECK(refit::version() == REFIT_VERSION_STRING);
  CHECK(refit::abi_version() == REFIT_ABI_VERSION);
  communicator_of_two_processes();
  errors_carry_status_and_message();
  moved_from_handles_hold_nothing();
  plan_executes_on_host_backend();
  run_rethrows_the_rank_exception_and_gathers();
  executor_runs_direct_staged_scoped_and_rebound();
  communicator_of_one_rank();
  group_digests_bytes();
  CHECK_DONE();
}
