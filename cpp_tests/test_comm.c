/* Communicators between processes from C11, on the host backend (CI has no GPU): three processes
 * (this one and two forked children) join one communicator, allgather uneven blocks (checked against
 * the blocks each process computes for every rank), build one plan from their own tables (checked
 * against a plan built here from all three tables; a table naming another process is refused on
 * every rank), and a rank that aborts ends a peer's call; a rank that passes other counts is refused
 * on every rank, naming it, and the communicator stays usable; a rank claimed after the communicator
 * formed, and a spent id, are refused at once; then every bad argument of the communicator API with
 * its status (an id with any byte changed among them), on a communicator of one rank. */
#include <stdint.h>
#include <time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"

#define RANKS 3

static uint64_t addr(const void *p) { return (uint64_t)(uintptr_t)p; }

static uint8_t byte_of(uint32_t rank, size_t i) { return (uint8_t)(rank * 59 + i * 7 + (i >> 9)); }

static const size_t counts[RANKS] = {1000, 0, 70001};

static double seconds(void) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

/* Claiming `rank` of `id` (nranks RANKS) is refused with INVALID_ARGUMENT whose message holds `why`,
 * without waiting (the timeout is a minute). */
static void refused_at_once(const refit_comm_id *id, uint32_t rank, const char *why) {
  refit_comm_options options;
  CHECK_OK(refit_comm_options_init(&options));
  options.timeout_ms = 60000;
  refit_comm *comm = NULL;
  double started = seconds();
  CHECK_STATUS(refit_comm_create(id, RANKS, rank, 0, &options, &comm), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(seconds() - started < 5.0);
  CHECK(comm == NULL && strstr(refit_last_error_message(), why) != NULL);
}

/* Rank 1 passes other counts: every rank's allgather is refused, naming rank 1, and nothing moves. */
static void other_counts(refit_comm *comm, uint32_t rank) {
  const size_t odd[RANKS] = {1000, 1, 70001};
  const size_t *mine = rank == 1 ? odd : counts;
  uint8_t *send = calloc(70001, 1), *recv = malloc(71002);
  memset(recv, 0xEE, 71002);
  CHECK_OK(refit_comm_allgather(comm, addr(send), addr(recv), mine, NULL));
  CHECK_STATUS(refit_comm_synchronize(comm, NULL), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "counts: ranks [1] differ") != NULL);
  CHECK_OK(refit_comm_synchronize(comm, NULL));
  int untouched = 1;
  for (size_t i = 0; i < 71002; i++) untouched &= recv[i] == 0xEE;
  CHECK(untouched);
  free(send);
  free(recv);
}

/* Joins communicator `id` as `rank`; `ipc` false sends every pair's bytes through staging. */
static refit_comm *join(const refit_comm_id *id, uint32_t rank, bool ipc) {
  refit_comm_options options;
  CHECK_OK(refit_comm_options_init(&options));
  CHECK(options.size == sizeof options && options.timeout_ms == 600000 && options.staging_bytes == 256u << 20);
  CHECK(options.ipc && options.check_counts);
  options.timeout_ms = 60000;
  options.ipc = ipc;
  /* The host backend compares allgather counts whatever check_counts says (other_counts). */
  options.check_counts = false;
  refit_comm *comm = NULL;
  CHECK_OK(refit_comm_create(id, RANKS, rank, 0, &options, &comm));
  uint32_t got = 99, size = 0, backend = 0;
  int32_t device = -1;
  CHECK_OK(refit_comm_rank(comm, &got));
  CHECK_OK(refit_comm_size(comm, &size));
  CHECK_OK(refit_comm_device(comm, &device));
  CHECK_OK(refit_comm_backend(comm, &backend));
  CHECK(got == rank && size == RANKS && device == 0 && backend == REFIT_BACKEND_HOST);
  return comm;
}

static void allgather_uneven(refit_comm *comm, uint32_t rank) {
  size_t total = 0, offset = 0;
  for (uint32_t p = 0; p < RANKS; p++) {
    if (p < rank) offset += counts[p];
    total += counts[p];
  }
  uint8_t *send = malloc(counts[rank] + 1);
  uint8_t *recv = malloc(total);
  for (size_t i = 0; i < counts[rank]; i++) send[i] = byte_of(rank, i);
  memset(recv, 0xEE, total);
  CHECK_OK(refit_comm_allgather(comm, addr(send), addr(recv), counts, NULL));
  CHECK_OK(refit_comm_synchronize(comm, NULL));
  size_t at = 0;
  int same = 1;
  for (uint32_t p = 0; p < RANKS; p++)
    for (size_t i = 0; i < counts[p]; i++) same &= recv[at++] == byte_of(p, i);
  CHECK(same);
  /* In place: this rank's block already sits in its slot. */
  memset(recv, 0xEE, total);
  memcpy(recv + offset, send, counts[rank]);
  CHECK_OK(refit_comm_allgather(comm, addr(recv + offset), addr(recv), counts, NULL));
  CHECK_OK(refit_comm_synchronize(comm, NULL));
  at = 0;
  for (uint32_t p = 0; p < RANKS; p++)
    for (size_t i = 0; i < counts[p]; i++) same &= recv[at++] == byte_of(p, i);
  CHECK(same);
  free(send);
  free(recv);
}

/* Rank `rank`'s table: ranks 0 and 1 publish replicas of "w" (4 x 8 floats), rank 2 receives its
 * column halves into two buffers. Addresses are numbers only here: planning reads no memory. */
/* Memory for table_of's offers and needs: an executor checks that its own addresses are memory. */
static float offered[2][32], needed[32];

static refit_table *table_of(uint32_t rank) {
  refit_table *table = NULL;
  CHECK_OK(refit_table_create(&table));
  const uint64_t shape[2] = {4, 8}, zero[2] = {0, 0}, extent[2] = {4, 4}, strides[2] = {4, 1};
  uint32_t t = 9;
  CHECK_OK(refit_table_add_tensor(table, "w", 1, 4, shape, 2, &t));
  if (rank < 2) CHECK_OK(refit_table_add_offer(table, t, rank, 0, addr(offered[rank]), zero, shape, NULL, 2, NULL));
  if (rank == 2)
    for (uint64_t half = 0; half < 2; half++) {
      const uint64_t offset[2] = {0, 4 * half};
      CHECK_OK(refit_table_add_need(table, t, 2, 0, addr(needed) + 64 * half, offset, extent, NULL, strides, 2));
    }
  return table;
}

/* Whether routes `a` and `b` are the same, segment for segment. */
static int same_route(const refit_route_info *a, const refit_route_info *b) {
  return a->src_rank == b->src_rank && a->src_device == b->src_device && a->dst_rank == b->dst_rank &&
         a->dst_device == b->dst_device && a->kind == b->kind && a->segment_count == b->segment_count &&
         memcmp(a->segments, b->segments, a->segment_count * sizeof(refit_segment)) == 0;
}

static void plan_across(refit_comm *comm, uint32_t rank) {
  refit_table *tables[RANKS];
  for (uint32_t r = 0; r < RANKS; r++) tables[r] = table_of(r);
  refit_plan *alone = NULL, *across = NULL;
  CHECK_OK(refit_plan_build((const refit_table *const *)tables, RANKS, NULL, &alone));
  CHECK_OK(refit_plan_build_across(comm, tables[rank], NULL, &across));
  /* This rank's share: exactly the whole plan's routes from or to this rank, in order. */
  size_t routes = 0, alone_routes = 0, matched = 0;
  CHECK_OK(refit_plan_route_count(across, &routes));
  CHECK_OK(refit_plan_route_count(alone, &alone_routes));
  for (size_t i = 0; i < alone_routes; i++) {
    refit_route_info whole, share;
    whole.size = share.size = sizeof whole;
    CHECK_OK(refit_plan_route(alone, i, &whole));
    if (whole.src_rank != rank && whole.dst_rank != rank) continue;
    CHECK(matched < routes);
    CHECK_OK(refit_plan_route(across, matched++, &share));
    CHECK(same_route(&whole, &share) && share.kind == REFIT_ROUTE_REMOTE);
  }
  CHECK(matched == routes && (rank == 1 || routes > 0));
  /* Rank 1 asks for another owner policy: every rank fails, and nothing is written. */
  refit_plan_options options;
  CHECK_OK(refit_plan_options_init(&options));
  if (rank == 1) options.policy = REFIT_POLICY_BALANCED;
  refit_plan *none = NULL;
  CHECK_STATUS(refit_plan_build_across(comm, tables[rank], &options, &none), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(none == NULL);
  CHECK(strstr(refit_last_error_message(), "different plan options") != NULL);
  /* Rank 1 passes rank 0's table, whose offer names process 0: every rank refuses it alike. */
  CHECK_STATUS(refit_plan_build_across(comm, tables[rank == 1 ? 0 : rank], NULL, &none),
               REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(none == NULL);
  CHECK(strstr(refit_last_error_message(), "rank 1's table has an offer of tensor 'w' on process 0") != NULL);
  refit_plan_destroy(alone);
  refit_plan_destroy(across);
  for (uint32_t r = 0; r < RANKS; r++) refit_table_destroy(tables[r]);
}

/* An executor across the processes moving real bytes: ranks 0 and 1 hold replicas of "w" (4 x 8
 * floats), rank 2 receives its column halves into two buffers; every received element is checked
 * against the value computed here, direct and then staged and verified (nothing live before the
 * commit). Through the host's stand-in for CUDA IPC or, with `ipc` false, through staging, where
 * processes that ask for verify differently are refused first. */
static float weight[4][8];
static float halves[2][4][4];

static void executor_across(refit_comm *comm, uint32_t rank, bool ipc) {
  for (int r = 0; r < 4; r++)
    for (int c = 0; c < 8; c++) weight[r][c] = (float)(r * 100 + c + 1);
  refit_table *table = NULL;
  CHECK_OK(refit_table_create(&table));
  const uint64_t shape[2] = {4, 8}, zero[2] = {0, 0}, extent[2] = {4, 4}, strides[2] = {4, 1};
  uint32_t t = 9;
  CHECK_OK(refit_table_add_tensor(table, "w", 1, 4, shape, 2, &t));
  if (rank < 2) CHECK_OK(refit_table_add_offer(table, t, rank, 0, addr(weight), zero, shape, NULL, 2, NULL));
  if (rank == 2)
    for (uint64_t half = 0; half < 2; half++) {
      const uint64_t offset[2] = {0, 4 * half};
      CHECK_OK(refit_table_add_need(table, t, 2, 0, addr(halves[half]), offset, extent, NULL, strides, 2));
    }
  refit_plan *share = NULL;
  CHECK_OK(refit_plan_build_across(comm, table, NULL, &share));
  refit_group_options group_options;
  CHECK_OK(refit_group_options_init(&group_options));
  group_options.backend = REFIT_BACKEND_HOST;
  const int32_t device = 0;
  refit_group *group = NULL;
  CHECK_OK(refit_group_create(&device, 1, &group_options, &group));
  const size_t one[RANKS] = {1, 1, 1};
  uint8_t token = 1, tokens[RANKS];
  if (!ipc) {
    /* Through staging, processes that ask for verify differently: every rank's create is refused. */
    refit_executor_options mixed;
    CHECK_OK(refit_executor_options_init(&mixed));
    mixed.verify = rank != 2;
    refit_executor *refused = NULL;
    CHECK_STATUS(refit_executor_create_across(share, group, comm, &mixed, &refused), REFIT_STATUS_INVALID_ARGUMENT);
    CHECK(refused == NULL);
  }
  for (uint32_t commit = REFIT_COMMIT_DIRECT; commit <= REFIT_COMMIT_STAGED; commit++) {
    refit_executor_options options;
    CHECK_OK(refit_executor_options_init(&options));
    options.commit = commit;
    options.verify = commit == REFIT_COMMIT_STAGED;
    refit_executor *executor = NULL;
    CHECK_OK(refit_executor_create_across(share, group, comm, &options, &executor));
    memset(halves, 0xEE, sizeof halves);
    refit_run_stats stats;
    stats.size = sizeof stats;
    CHECK_OK(refit_executor_run(executor, group, &stats));
    CHECK(stats.bytes[REFIT_ROUTE_REMOTE] == (rank == 0 ? sizeof halves : 0));
    CHECK(stats.remote_received_bytes == (rank == 2 ? sizeof halves : 0));
    CHECK(stats.remote_ipc_bytes + stats.remote_wire_bytes == stats.bytes[REFIT_ROUTE_REMOTE]);
    CHECK(stats.remote_wire_bytes == (ipc ? 0 : stats.bytes[REFIT_ROUTE_REMOTE]));
    /* Every rank has run: rank 2 holds the step (staged: not yet in its live buffers). */
    CHECK_OK(refit_comm_allgather(comm, addr(&token), addr(tokens), one, NULL));
    CHECK_OK(refit_comm_synchronize(comm, NULL));
    if (rank == 2 && commit == REFIT_COMMIT_STAGED) CHECK(((const uint8_t *)halves)[0] == 0xEE);
    if (commit == REFIT_COMMIT_STAGED) CHECK_OK(refit_executor_commit(executor, group, NULL));
    if (rank == 2) {
      int same = 1;
      for (int half = 0; half < 2; half++)
        for (int r = 0; r < 4; r++)
          for (int c = 0; c < 4; c++) same &= halves[half][r][c] == weight[r][4 * half + c];
      CHECK(same);
    }
    CHECK_STATUS(refit_executor_rebind(executor, 0, addr(weight), addr(weight) + 4096, 16), REFIT_STATUS_UNSUPPORTED);
    CHECK_OK(refit_comm_allgather(comm, addr(&token), addr(tokens), one, NULL));
    CHECK_OK(refit_comm_synchronize(comm, NULL));
    refit_executor_destroy(executor);
  }
  refit_group_destroy(group);
  refit_plan_destroy(share);
  refit_table_destroy(table);
}

/* One process's whole part; returns only on success. */
static void rank_main(const refit_comm_id *id, const refit_comm_id *staged_id, uint32_t rank) {
  refit_comm *staged = join(staged_id, rank, false);
  executor_across(staged, rank, false);
  refit_comm_destroy(staged);
  refit_comm *comm = join(id, rank, true);
  allgather_uneven(comm, rank);
  /* Every rank took part, so every rank has registered with the id's root: the id is spent, and a
   * claim of another process's rank is refused at once. */
  if (rank == 0) refused_at_once(id, 2, "the id is spent");
  /* ... and a correct allgather follows a refused one on the same communicator. */
  other_counts(comm, rank);
  allgather_uneven(comm, rank);
  plan_across(comm, rank);
  executor_across(comm, rank, true);
  /* Rank 2 aborts; rank 0's next call then fails at once (not at its one-minute timeout). */
  if (rank == 2) {
    CHECK_OK(refit_comm_abort(comm));
    CHECK_OK(refit_comm_abort(comm));
    CHECK_STATUS(refit_comm_synchronize(comm, NULL), REFIT_STATUS_ABORTED);
  } else {
    size_t one[RANKS] = {1, 1, 1};
    uint8_t send = 1, recv[RANKS];
    refit_status first = refit_comm_allgather(comm, addr(&send), addr(recv), one, NULL);
    refit_status then = first == REFIT_STATUS_SUCCESS ? refit_comm_synchronize(comm, NULL) : first;
    CHECK(then == REFIT_STATUS_ABORTED);
  }
  refit_comm_destroy(comm);
}

static void bad_arguments(void) {
  refit_comm_options options;
  CHECK_STATUS(refit_comm_options_init(NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_OK(refit_comm_options_init(&options));
  refit_comm_id id;
  CHECK_STATUS(refit_comm_get_unique_id(REFIT_BACKEND_HOST, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_comm_get_unique_id(7, &id), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_OK(refit_comm_get_unique_id(REFIT_BACKEND_HOST, &id));
  refit_comm *comm = NULL;
  CHECK_STATUS(refit_comm_create(NULL, 1, 0, 0, NULL, &comm), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_comm_create(&id, 1, 0, 0, NULL, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_comm_create(&id, 0, 0, 0, NULL, &comm), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_comm_create(&id, 2, 2, 0, NULL, &comm), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_comm_create(&id, 1, 0, -1, NULL, &comm), REFIT_STATUS_INVALID_DEVICE);
  refit_comm_id garbage;
  memset(&garbage, 0x5A, sizeof garbage);
  CHECK_STATUS(refit_comm_create(&garbage, 1, 0, 0, NULL, &comm), REFIT_STATUS_INVALID_ARGUMENT);
  refit_comm_options bad = options;
  bad.size = 8;
  CHECK_STATUS(refit_comm_create(&id, 1, 0, 0, &bad, &comm), REFIT_STATUS_INVALID_ARGUMENT);
  bad = options;
  bad.timeout_ms = 0;
  CHECK_STATUS(refit_comm_create(&id, 1, 0, 0, &bad, &comm), REFIT_STATUS_INVALID_ARGUMENT);
  bad = options;
  bad.staging_bytes = 4096;
  CHECK_STATUS(refit_comm_create(&id, 1, 0, 0, &bad, &comm), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(comm == NULL);
  CHECK_STATUS(refit_comm_adopt(NULL, NULL, &comm), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_comm_adopt(&id, NULL, NULL), REFIT_STATUS_NULL_ARGUMENT);
  /* Every byte of an id matters: any one changed is refused, and the id itself still forms. */
  for (size_t at = 0; at < sizeof id.internal; at++) {
    refit_comm_id changed = id;
    changed.internal[at] ^= 0x01;
    CHECK_STATUS(refit_comm_create(&changed, 1, 0, 0, &options, &comm), REFIT_STATUS_INVALID_ARGUMENT);
    CHECK(comm == NULL);
  }

  CHECK_OK(refit_comm_create(&id, 1, 0, 3, &options, &comm));
  uint32_t value;
  int32_t device;
  CHECK_STATUS(refit_comm_rank(NULL, &value), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_comm_rank(comm, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_comm_size(NULL, &value), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_comm_device(comm, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_OK(refit_comm_device(comm, &device));
  CHECK(device == 3);
  CHECK_STATUS(refit_comm_backend(NULL, &value), REFIT_STATUS_NULL_ARGUMENT);

  uint8_t buffer[16];
  size_t four = 4, huge = SIZE_MAX;
  CHECK_STATUS(refit_comm_allgather(NULL, addr(buffer), addr(buffer), &four, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_comm_allgather(comm, addr(buffer), addr(buffer), NULL, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_comm_allgather(comm, 0, addr(buffer), &four, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_comm_allgather(comm, addr(buffer + 1), addr(buffer), &four, NULL), REFIT_STATUS_OVERLAP);
  CHECK_STATUS(refit_comm_allgather(comm, addr(buffer), addr(buffer + 8), &huge, NULL), REFIT_STATUS_INVALID_ARGUMENT);
  /* One rank: the allgather is its own block copied into place. */
  memcpy(buffer, "abcd", 4);
  CHECK_OK(refit_comm_allgather(comm, addr(buffer), addr(buffer + 8), &four, NULL));
  CHECK_STATUS(refit_comm_synchronize(NULL, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_comm_synchronize(comm, (void *)(uintptr_t)0x1230), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_OK(refit_comm_synchronize(comm, NULL));
  CHECK(memcmp(buffer + 8, "abcd", 4) == 0);

  refit_table *table = table_of(0);
  refit_plan *plan = NULL;
  refit_plan_options plan_options;
  CHECK_OK(refit_plan_options_init(&plan_options));
  plan_options.policy = 9;
  CHECK_STATUS(refit_plan_build_across(NULL, table, NULL, &plan), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_plan_build_across(comm, NULL, NULL, &plan), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_plan_build_across(comm, table, NULL, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_plan_build_across(comm, table, &plan_options, &plan), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(plan == NULL);
  refit_table_destroy(table);

  /* An executor across: a NULL communicator, and a plan naming processes the communicator lacks. */
  refit_table *tables[RANKS];
  for (uint32_t r = 0; r < RANKS; r++) tables[r] = table_of(r);
  refit_plan *whole = NULL;
  CHECK_OK(refit_plan_build((const refit_table *const *)tables, RANKS, NULL, &whole));
  refit_group_options group_options;
  CHECK_OK(refit_group_options_init(&group_options));
  group_options.backend = REFIT_BACKEND_HOST;
  const int32_t device0 = 0;
  refit_group *group = NULL;
  CHECK_OK(refit_group_create(&device0, 1, &group_options, &group));
  refit_executor *executor = NULL;
  CHECK_STATUS(refit_executor_create_across(whole, group, NULL, NULL, &executor), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_executor_create_across(whole, group, comm, NULL, &executor), REFIT_STATUS_NOT_FOUND);
  CHECK(executor == NULL);
  refit_group_destroy(group);
  refit_plan_destroy(whole);
  for (uint32_t r = 0; r < RANKS; r++) refit_table_destroy(tables[r]);

  CHECK_STATUS(refit_comm_abort(NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_OK(refit_comm_abort(comm));
  CHECK_STATUS(refit_comm_allgather(comm, addr(buffer), addr(buffer + 8), &four, NULL), REFIT_STATUS_ABORTED);
  refit_comm_destroy(comm);
  refit_comm_destroy(NULL);
  /* The id formed its communicator: it is spent. */
  comm = NULL;
  CHECK_STATUS(refit_comm_create(&id, 1, 0, 0, &options, &comm), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(comm == NULL && strstr(refit_last_error_message(), "the id is spent") != NULL);
}

/* Reads exactly `len` bytes from `fd`; 0 on success. */
static int read_all(int fd, void *data, size_t len) {
  for (size_t got = 0; got < len;) {
    ssize_t n = read(fd, (char *)data + got, len - got);
    if (n <= 0) return -1;
    got += (size_t)n;
  }
  return 0;
}

int main(void) {
  refit_comm_id id, staged_id;
  /* The ranks are forked first and handed the ids through pipes: an id's maker runs its rendezvous
   * root on a thread, and a process forked after that would hold a copy of the thread's memory
   * without the thread (which valgrind rightly calls lost in the child). */
  int pipes[RANKS - 1][2];
  fflush(stdout);
  pid_t children[RANKS - 1];
  for (uint32_t rank = 1; rank < RANKS; rank++) {
    CHECK(pipe(pipes[rank - 1]) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
      check_passed = 0;
      close(pipes[rank - 1][1]);
      if (read_all(pipes[rank - 1][0], &id, sizeof id) != 0 ||
          read_all(pipes[rank - 1][0], &staged_id, sizeof staged_id) != 0)
        _exit(3);
      close(pipes[rank - 1][0]);
      rank_main(&id, &staged_id, rank);
      exit(0);
    }
    close(pipes[rank - 1][0]);
    children[rank - 1] = pid;
  }
  CHECK_OK(refit_comm_get_unique_id(REFIT_BACKEND_HOST, &id));
  CHECK_OK(refit_comm_get_unique_id(REFIT_BACKEND_HOST, &staged_id));
  for (uint32_t rank = 1; rank < RANKS; rank++) {
    CHECK(write(pipes[rank - 1][1], &id, sizeof id) == (ssize_t)sizeof id);
    CHECK(write(pipes[rank - 1][1], &staged_id, sizeof staged_id) == (ssize_t)sizeof staged_id);
    close(pipes[rank - 1][1]);
  }
  rank_main(&id, &staged_id, 0);
  for (uint32_t i = 0; i < RANKS - 1; i++) {
    int status = 0;
    CHECK(waitpid(children[i], &status, 0) == children[i]);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  /* Every rank destroyed the communicator: its id joins nothing, here or in any process. */
  for (uint32_t rank = 0; rank < RANKS; rank++) refused_at_once(&id, rank, "the id is spent");
  bad_arguments();
  CHECK_DONE();
}
