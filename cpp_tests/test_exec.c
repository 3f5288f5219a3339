/* The executor's C API on the host backend (CI has no GPU): a plan executed through
 * refit_executor_*, direct and staged (in slices too), verified, rebound to moved buffers, with its
 * stats and the arm AUTO picked (per run, under verify, under an SM budget); received bytes are compared with ones computed element by element here. Then every bad
 * argument with its status and message. */
#include <stddef.h>
#include <stdint.h>

#include "check.h"

#define ROWS 48
#define COLS 64
#define HALF (COLS / 2)
#define ELEM 4
#define POISON 0xEE

static uint64_t addr(const void *p) { return (uint64_t)(uintptr_t)p; }

/* Rank 0 holds w [ROWS, COLS] on device 0; it receives w's right column half on device 0 (a
 * local route) and all of w, transposed, on device 1 (a peer route). */
static uint32_t w_src[ROWS * COLS];
static uint32_t half[ROWS * HALF];
static uint32_t whole_t[COLS * ROWS];

static refit_plan *plan_into(uint32_t *half_dst, uint32_t *whole_dst, uint32_t half_device, bool coalesce) {
  refit_table *table = NULL;
  CHECK_OK(refit_table_create(&table));
  uint32_t w = 0;
  const uint64_t shape[2] = {ROWS, COLS};
  CHECK_OK(refit_table_add_tensor(table, "w", 1, ELEM, shape, 2, &w));
  const uint64_t zero[2] = {0, 0};
  CHECK_OK(refit_table_add_offer(table, w, 0, 0, addr(w_src), zero, shape, NULL, 2, NULL));
  const uint64_t half_offset[2] = {0, HALF}, half_extent[2] = {ROWS, HALF}, half_strides[2] = {HALF, 1};
  CHECK_OK(refit_table_add_need(table, w, 0, half_device, addr(half_dst), half_offset, half_extent, NULL,
                                half_strides, 2));
  const uint32_t perm[2] = {1, 0};
  const uint64_t t_strides[2] = {ROWS, 1};
  CHECK_OK(refit_table_add_need(table, w, 0, 1, addr(whole_dst), zero, shape, perm, t_strides, 2));
  refit_plan_options options;
  CHECK_OK(refit_plan_options_init(&options));
  options.coalesce = coalesce;
  refit_plan *plan = NULL;
  const refit_table *tables[1] = {table};
  CHECK_OK(refit_plan_build(tables, 1, &options, &plan));
  refit_table_destroy(table);
  return plan;
}

static void fill_source(uint32_t seed) {
  for (int i = 0; i < ROWS * COLS; i++) w_src[i] = seed * 1000003u + (uint32_t)i * 7919u;
}

static void poison(void *p, size_t n) { memset(p, POISON, n); }

static int all_poison(const void *p, size_t n) {
  const uint8_t *b = (const uint8_t *)p;
  for (size_t i = 0; i < n; i++)
    if (b[i] != POISON) return 0;
  return 1;
}

/* Whether half_dst and whole_dst hold what w_src says they should. */
static int received(const uint32_t *half_dst, const uint32_t *whole_dst) {
  for (int r = 0; r < ROWS; r++)
    for (int c = 0; c < HALF; c++)
      if (half_dst[r * HALF + c] != w_src[r * COLS + HALF + c]) return 0;
  for (int c = 0; c < COLS; c++)
    for (int r = 0; r < ROWS; r++)
      if (whole_dst[c * ROWS + r] != w_src[r * COLS + c]) return 0;
  return 1;
}

static refit_executor *make(const refit_plan *plan, const refit_group *group, uint32_t arm, bool verify,
                            uint32_t commit, uint64_t staging_limit) {
  refit_executor_options options;
  CHECK_OK(refit_executor_options_init(&options));
  options.arm = arm;
  options.verify = verify;
  options.commit = commit;
  options.staging_limit = staging_limit;
  refit_executor *executor = NULL;
  CHECK_OK(refit_executor_create(plan, group, 0, &options, &executor));
  CHECK(executor != NULL);
  return executor;
}

/* Runs one AUTO step of `plan` with `sm_budget` and `verify`; returns the peer route's arm. */
static uint32_t auto_peer_arm(const refit_plan *plan, refit_group *group, uint32_t sm_budget, bool verify) {
  refit_executor_options options;
  CHECK_OK(refit_executor_options_init(&options));
  options.sm_budget = sm_budget;
  options.verify = verify;
  refit_executor *executor = NULL;
  CHECK_OK(refit_executor_create(plan, group, 0, &options, &executor));
  refit_run_stats stats;
  stats.size = sizeof stats;
  CHECK_OK(refit_executor_run(executor, group, &stats));
  refit_executor_destroy(executor);
  return stats.arm[REFIT_ROUTE_PEER];
}

/* AUTO picks per run: a 16 MiB tensor and a 256-byte one, both from device 0 to device 1, put a run
 * long enough for the copy engine between devices beside one for the kernel (REFIT_ARM_SPLIT); a
 * verified step keeps both on the kernel; an SM budget gives both to the copy engine. Every byte is
 * checked after each. */
static void auto_picks_per_run(refit_group *group) {
  const uint64_t big_count = (16u << 20) / ELEM, small_count = 64;
  uint32_t *big_src = malloc(big_count * ELEM), *big_dst = malloc(big_count * ELEM);
  uint32_t small_src[64], small_dst[64];
  CHECK(big_src != NULL && big_dst != NULL);
  for (uint64_t i = 0; i < big_count; i++) big_src[i] = (uint32_t)(i * 2654435761u);
  for (uint64_t i = 0; i < small_count; i++) small_src[i] = (uint32_t)(i + 17);
  refit_table *table = NULL;
  CHECK_OK(refit_table_create(&table));
  const uint64_t zero[1] = {0}, big_shape[1] = {big_count}, small_shape[1] = {small_count}, unit[1] = {1};
  uint32_t big = 0, small = 0;
  CHECK_OK(refit_table_add_tensor(table, "big", 1, ELEM, big_shape, 1, &big));
  CHECK_OK(refit_table_add_tensor(table, "small", 1, ELEM, small_shape, 1, &small));
  CHECK_OK(refit_table_add_offer(table, big, 0, 0, addr(big_src), zero, big_shape, NULL, 1, NULL));
  CHECK_OK(refit_table_add_offer(table, small, 0, 0, addr(small_src), zero, small_shape, NULL, 1, NULL));
  CHECK_OK(refit_table_add_need(table, big, 0, 1, addr(big_dst), zero, big_shape, NULL, unit, 1));
  CHECK_OK(refit_table_add_need(table, small, 0, 1, addr(small_dst), zero, small_shape, NULL, unit, 1));
  refit_plan *plan = NULL;
  const refit_table *tables[1] = {table};
  CHECK_OK(refit_plan_build(tables, 1, NULL, &plan));
  const struct {
    uint32_t sm_budget;
    bool verify;
    uint32_t arm;
  } cases[3] = {{0, false, REFIT_ARM_SPLIT}, {0, true, REFIT_ARM_KERNEL}, {8, false, REFIT_ARM_COPY_ENGINE}};
  for (int c = 0; c < 3; c++) {
    poison(big_dst, big_count * ELEM);
    poison(small_dst, sizeof small_dst);
    CHECK(auto_peer_arm(plan, group, cases[c].sm_budget, cases[c].verify) == cases[c].arm);
    CHECK(memcmp(big_dst, big_src, big_count * ELEM) == 0 && memcmp(small_dst, small_src, sizeof small_src) == 0);
  }
  refit_plan_destroy(plan);
  refit_table_destroy(table);
  free(big_src);
  free(big_dst);
}

int main(void) {
  const int32_t devices[2] = {0, 1};
  refit_group *group = check_host_group(devices, 2);
  refit_plan *plan = plan_into(half, whole_t, 0, true);

  refit_executor_options defaults;
  memset(&defaults, 0x5A, sizeof defaults);
  CHECK_OK(refit_executor_options_init(&defaults));
  CHECK(defaults.size == sizeof defaults && defaults.arm == REFIT_ARM_AUTO && defaults.sm_budget == 0);
  CHECK(!defaults.verify && defaults.commit == REFIT_COMMIT_DIRECT && defaults.staging_limit == 0);

  /* Direct, every arm, outside a scope: complete on return; sources are read at every run. */
  const uint32_t arms[3] = {REFIT_ARM_AUTO, REFIT_ARM_KERNEL, REFIT_ARM_COPY_ENGINE};
  for (int a = 0; a < 3; a++) {
    refit_executor *executor = make(plan, group, arms[a], a == 0, REFIT_COMMIT_DIRECT, 0);
    for (uint32_t round = 0; round < 2; round++) {
      fill_source(round + 10 * (uint32_t)a);
      poison(half, sizeof half);
      poison(whole_t, sizeof whole_t);
      refit_run_stats stats;
      stats.size = sizeof stats;
      CHECK_OK(refit_executor_run(executor, group, &stats));
      CHECK(received(half, whole_t));
      CHECK(stats.bytes[REFIT_ROUTE_LOCAL] == sizeof half && stats.bytes[REFIT_ROUTE_PEER] == sizeof whole_t);
      CHECK(stats.bytes[REFIT_ROUTE_REMOTE] == 0 && stats.arm[REFIT_ROUTE_REMOTE] == REFIT_ARM_NONE);
      CHECK(stats.arm[REFIT_ROUTE_LOCAL] == (a == 2 ? REFIT_ARM_COPY_ENGINE : REFIT_ARM_KERNEL));
      CHECK(stats.slices == 1 && stats.installed_bytes == sizeof half + sizeof whole_t);
      CHECK(stats.device_timed && stats.descriptors_reused && stats.verified == (a == 0));
      CHECK(stats.prepare_ns == 0); /* descriptors reused: nothing was prepared */
      CHECK(stats.verified_bytes == (a == 0 ? sizeof half + sizeof whole_t : 0));
      CHECK(stats.prepare_ns + stats.enqueue_ns + stats.wait_ns <= stats.wall_ns);
    }
    CHECK_STATUS(refit_executor_commit(executor, group, NULL), REFIT_STATUS_INVALID_STATE);
    CHECK(strstr(refit_last_error_message(), "commits directly") != NULL);
    refit_executor_destroy(executor);
  }

  auto_picks_per_run(group);

  /* Inside a scope the run is only queued; refit_executor_stats waits and adds device times. */
  void *callers[2] = {NULL, NULL};
  CHECK_OK(refit_host_stream_create(&callers[0]));
  CHECK_OK(refit_host_stream_create(&callers[1]));
  refit_executor *scoped = make(plan, group, REFIT_ARM_AUTO, false, REFIT_COMMIT_DIRECT, 0);
  fill_source(77);
  poison(half, sizeof half);
  CHECK_OK(refit_group_enter(group, callers));
  refit_run_stats queued;
  queued.size = sizeof queued;
  CHECK_OK(refit_executor_run(scoped, group, &queued));
  CHECK(!queued.device_timed);
  CHECK_OK(refit_group_exit(group, REFIT_EXIT_SYNC));
  CHECK(received(half, whole_t));
  refit_run_stats later;
  later.size = sizeof later;
  CHECK_OK(refit_executor_stats(scoped, &later));
  CHECK(later.device_timed && later.device_ns > 0 && later.bytes[REFIT_ROUTE_PEER] == queued.bytes[REFIT_ROUTE_PEER]);
  refit_executor_destroy(scoped);

  /* Staged: a run leaves the live buffers alone; commit installs; in slices when over the limit. */
  const uint64_t limits[2] = {0, 4096};
  for (int l = 0; l < 2; l++) {
    refit_executor *staged = make(plan, group, REFIT_ARM_AUTO, true, REFIT_COMMIT_STAGED, limits[l]);
    CHECK_STATUS(refit_executor_commit(staged, group, NULL), REFIT_STATUS_INVALID_STATE);
    CHECK(strstr(refit_last_error_message(), "run first") != NULL);
    fill_source(5 + (uint32_t)l);
    poison(half, sizeof half);
    poison(whole_t, sizeof whole_t);
    refit_run_stats ran, committed;
    ran.size = committed.size = sizeof ran;
    CHECK_OK(refit_executor_run(staged, group, &ran));
    if (limits[l] == 0) {
      CHECK(ran.slices == 1 && ran.installed_bytes == 0);
      CHECK(all_poison(half, sizeof half) && all_poison(whole_t, sizeof whole_t));
    } else {
      /* Every slice but the last was installed by the run. */
      CHECK(ran.slices >= 3 && ran.installed_bytes > 0 && ran.installed_bytes < sizeof half + sizeof whole_t);
    }
    CHECK_OK(refit_executor_commit(staged, group, &committed));
    CHECK(committed.slices == 0 && committed.verified && committed.verified_bytes > 0);
    CHECK(committed.prepare_ns == 0);
    CHECK(ran.installed_bytes + committed.installed_bytes == sizeof half + sizeof whole_t);
    CHECK(received(half, whole_t));
    CHECK_STATUS(refit_executor_commit(staged, group, NULL), REFIT_STATUS_INVALID_STATE);
    refit_executor_destroy(staged);
  }

  /* Rebind: the receivers moved (a plan without coalescing keeps each buffer apart). */
  static uint32_t half_b[ROWS * HALF], whole_b[COLS * ROWS];
  refit_plan *apart = plan_into(half, whole_t, 0, false);
  refit_executor *moving = make(apart, group, REFIT_ARM_AUTO, true, REFIT_COMMIT_DIRECT, 0);
  CHECK_OK(refit_executor_run(moving, group, NULL));
  CHECK_OK(refit_executor_rebind(moving, 0, addr(half), addr(half_b), sizeof half));
  CHECK_OK(refit_executor_rebind(moving, 1, addr(whole_t), addr(whole_b), sizeof whole_t));
  fill_source(99);
  poison(half, sizeof half);
  poison(whole_t, sizeof whole_t);
  refit_run_stats rebound;
  rebound.size = sizeof rebound;
  CHECK_OK(refit_executor_run(moving, group, &rebound));
  CHECK(received(half_b, whole_b) && rebound.verified && !rebound.descriptors_reused);
  CHECK(all_poison(half, sizeof half) && all_poison(whole_t, sizeof whole_t));
  /* Bad rebinds change nothing. */
  CHECK_STATUS(refit_executor_rebind(moving, 0, addr(half_b), addr(half), sizeof half / 2), REFIT_STATUS_PLAN_STALE);
  CHECK(strstr(refit_last_error_message(), "new plan") != NULL);
  CHECK_STATUS(refit_executor_rebind(moving, 0, addr(half), addr(half_b), sizeof half), REFIT_STATUS_NOT_FOUND);
  CHECK_STATUS(refit_executor_rebind(moving, 2, addr(half_b), addr(half), sizeof half), REFIT_STATUS_INVALID_DEVICE);
  CHECK_STATUS(refit_executor_rebind(moving, 0, addr(half_b), addr(half), 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_executor_rebind(moving, 0, addr(half_b), 0, sizeof half), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_executor_rebind(moving, 0, addr(half_b), UINT64_MAX - 4, sizeof half), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_executor_rebind(NULL, 0, 1, 2, 3), REFIT_STATUS_NULL_ARGUMENT);
  /* A range that has not moved: refused, and later runs still install. */
  CHECK_STATUS(refit_executor_rebind(moving, 0, addr(half_b), addr(half_b), sizeof half), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "has not moved") != NULL);
  /* A new place in the first page is no memory: refused, changing nothing. */
  CHECK_STATUS(refit_executor_rebind(moving, 0, addr(half_b), 0x40, sizeof half), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "first page") != NULL);
  fill_source(100);
  CHECK_OK(refit_executor_run(moving, group, NULL));
  CHECK(received(half_b, whole_b));
  refit_executor_destroy(moving);
  refit_plan_destroy(apart);

  /* Bad arguments, each with its status and a message naming it. */
  refit_executor_options options;
  refit_executor *executor = (refit_executor *)0x1;
  CHECK_STATUS(refit_executor_options_init(NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_executor_create(NULL, group, 0, NULL, &executor), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_executor_create(plan, NULL, 0, NULL, &executor), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_executor_create(plan, group, 0, NULL, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "executor is NULL") != NULL);
  CHECK_OK(refit_executor_options_init(&options));
  options.size = 8;
  CHECK_STATUS(refit_executor_create(plan, group, 0, &options, &executor), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "options.size") != NULL);
  CHECK_OK(refit_executor_options_init(&options));
  options.arm = 7;
  CHECK_STATUS(refit_executor_create(plan, group, 0, &options, &executor), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "options.arm") != NULL);
  options.arm = REFIT_ARM_SPLIT; /* an outcome in the stats, not an arm to ask for */
  CHECK_STATUS(refit_executor_create(plan, group, 0, &options, &executor), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "options.arm") != NULL);
  CHECK_OK(refit_executor_options_init(&options));
  options.commit = 2;
  CHECK_STATUS(refit_executor_create(plan, group, 0, &options, &executor), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "options.commit") != NULL);
  CHECK_OK(refit_executor_options_init(&options));
  options.arm = REFIT_ARM_COPY_ENGINE;
  options.sm_budget = 16;
  CHECK_STATUS(refit_executor_create(plan, group, 0, &options, &executor), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "sm_budget") != NULL);
  CHECK_OK(refit_executor_options_init(&options));
  options.staging_limit = 1 << 20;
  CHECK_STATUS(refit_executor_create(plan, group, 0, &options, &executor), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "staged commit only") != NULL);
  options.commit = REFIT_COMMIT_STAGED;
  options.staging_limit = 100;
  CHECK_STATUS(refit_executor_create(plan, group, 0, &options, &executor), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "4096") != NULL);
  CHECK(executor == (refit_executor *)0x1); /* outputs are written only on success */

  /* A plan whose devices the group lacks; a route from another process. */
  const int32_t device0[1] = {0};
  refit_group *one = check_host_group(device0, 1);
  CHECK_STATUS(refit_executor_create(plan, one, 0, NULL, &executor), REFIT_STATUS_NOT_FOUND);
  CHECK(strstr(refit_last_error_message(), "device 1") != NULL);
  refit_table *remote = NULL;
  CHECK_OK(refit_table_create(&remote));
  uint32_t w = 0;
  const uint64_t shape[2] = {ROWS, COLS}, zero[2] = {0, 0}, strides[2] = {COLS, 1};
  CHECK_OK(refit_table_add_tensor(remote, "w", 1, ELEM, shape, 2, &w));
  CHECK_OK(refit_table_add_offer(remote, w, 1, 0, addr(w_src), zero, shape, NULL, 2, NULL));
  CHECK_OK(refit_table_add_need(remote, w, 0, 0, addr(whole_t), zero, shape, NULL, strides, 2));
  refit_plan *across = NULL;
  const refit_table *remote_tables[1] = {remote};
  CHECK_OK(refit_plan_build(remote_tables, 1, NULL, &across));
  CHECK_STATUS(refit_executor_create(across, group, 0, NULL, &executor), REFIT_STATUS_UNSUPPORTED);
  CHECK(strstr(refit_last_error_message(), "crosses processes") != NULL);
  refit_plan_destroy(across);
  /* Process 2 takes part in nothing: its share holds none of process 0's routes, and would move
   * nothing for it. */
  refit_plan *idle_share = NULL;
  CHECK_OK(refit_plan_build_share(remote_tables, 1, 2, NULL, &idle_share));
  CHECK_STATUS(refit_executor_create(idle_share, group, 0, NULL, &executor), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "process 2's share") != NULL);
  refit_plan_destroy(idle_share);
  refit_table_destroy(remote);
  /* An offer at address 0 plans (the planner checks no address), and the executor refuses it at
   * create, naming the tensor, the box and the address: no run ever reads the first page. */
  {
    refit_table *bad = NULL;
    CHECK_OK(refit_table_create(&bad));
    uint32_t t = 0;
    CHECK_OK(refit_table_add_tensor(bad, "w", 1, ELEM, shape, 2, &t));
    CHECK_OK(refit_table_add_offer(bad, t, 0, 0, 0, zero, shape, NULL, 2, NULL));
    const uint64_t half_offset[2] = {0, HALF}, half_extent[2] = {ROWS, HALF}, half_strides[2] = {HALF, 1};
    CHECK_OK(refit_table_add_need(bad, t, 0, 0, addr(half), half_offset, half_extent, NULL, half_strides, 2));
    refit_plan *at_zero = NULL;
    const refit_table *bad_tables[1] = {bad};
    CHECK_OK(refit_plan_build(bad_tables, 1, NULL, &at_zero));
    poison(half, sizeof half);
    CHECK_STATUS(refit_executor_create(at_zero, group, 0, NULL, &executor), REFIT_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(refit_last_error_message(), "tensor 'w' box offset [0, 32] extent [48, 32]") != NULL);
    CHECK(strstr(refit_last_error_message(), "its source") != NULL);
    CHECK(strstr(refit_last_error_message(), "first page") != NULL);
    CHECK(all_poison(half, sizeof half));
    refit_plan_destroy(at_zero);
    refit_table_destroy(bad);
  }

  /* Staging: a payload within staging_limit is staged in one slice; refit_executor_get_info says how
   * many slices a run takes before any run; single_slice refuses a step that needs more. */
  {
    refit_executor_info info;
    info.size = sizeof info;
    refit_executor *unlimited = make(plan, group, REFIT_ARM_AUTO, false, REFIT_COMMIT_STAGED, 0);
    CHECK_OK(refit_executor_get_info(unlimited, &info));
    CHECK(info.slices == 1 && info.staging_bytes >= sizeof half + sizeof whole_t);
    CHECK(info.quantization_bytes == 0 && info.landing_bytes == 0); /* no quantized need, one process */
    /* A caller built against the header before quantization_bytes passes the shorter struct (a heap
     * block of exactly that size: a write past it is a bug valgrind sees) and gets its fields. */
    const size_t info_before = offsetof(refit_executor_info, quantization_bytes);
    refit_executor_info *short_info = malloc(info_before);
    CHECK(short_info != NULL);
    short_info->size = info_before;
    CHECK_OK(refit_executor_get_info(unlimited, short_info));
    CHECK(short_info->size == info_before && short_info->slices == 1 &&
          short_info->staging_bytes == info.staging_bytes);
    short_info->size = info_before + 8;
    CHECK_STATUS(refit_executor_get_info(unlimited, short_info), REFIT_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(refit_last_error_message(), "info.size is 40") != NULL);
    CHECK(strstr(refit_last_error_message(), "or 32 as an earlier version") != NULL);
    free(short_info);
    refit_executor_destroy(unlimited);
    refit_executor *sliced = make(plan, group, REFIT_ARM_AUTO, false, REFIT_COMMIT_STAGED, 4096);
    CHECK_OK(refit_executor_get_info(sliced, &info));
    CHECK(info.slices >= 3);
    info.size = 4;
    CHECK_STATUS(refit_executor_get_info(sliced, &info), REFIT_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(refit_executor_get_info(sliced, NULL), REFIT_STATUS_NULL_ARGUMENT);
    CHECK_STATUS(refit_executor_get_info(NULL, &info), REFIT_STATUS_NULL_ARGUMENT);
    refit_executor_destroy(sliced);
    refit_executor_options one;
    CHECK_OK(refit_executor_options_init(&one));
    CHECK(!one.single_slice);
    one.commit = REFIT_COMMIT_STAGED;
    one.staging_limit = 4096;
    one.single_slice = true;
    CHECK_STATUS(refit_executor_create(plan, group, 0, &one, &executor), REFIT_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(refit_last_error_message(), "single_slice") != NULL);
    one.staging_limit = 0;
    refit_executor *whole = NULL;
    CHECK_OK(refit_executor_create(plan, group, 0, &one, &whole));
    refit_executor_destroy(whole);
    one.commit = REFIT_COMMIT_DIRECT;
    CHECK_STATUS(refit_executor_create(plan, group, 0, &one, &executor), REFIT_STATUS_INVALID_ARGUMENT);
    memset(&one.single_slice, 2, 1);
    CHECK_STATUS(refit_executor_create(plan, group, 0, &one, &executor), REFIT_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(refit_last_error_message(), "options.single_slice") != NULL);
    /* A caller built against the header before single_slice passes the shorter struct, exactly as
     * long as it knew it (a heap block of that size: a read past it is a bug the sanitizers see);
     * the fields it does not know take their defaults. */
    const size_t older = offsetof(refit_executor_options, single_slice);
    refit_executor_options full;
    CHECK_OK(refit_executor_options_init(&full));
    full.commit = REFIT_COMMIT_STAGED;
    full.staging_limit = 4096;
    full.size = older;
    void *prefix = malloc(older);
    CHECK(prefix != NULL);
    memcpy(prefix, &full, older);
    refit_executor *old_caller = NULL;
    CHECK_OK(refit_executor_create(plan, group, 0, (const refit_executor_options *)prefix, &old_caller));
    refit_executor_info sliced_info;
    sliced_info.size = sizeof sliced_info;
    CHECK_OK(refit_executor_get_info(old_caller, &sliced_info));
    CHECK(sliced_info.slices >= 3); /* single_slice took its default, false */
    refit_executor_destroy(old_caller);
    ((unsigned char *)prefix)[offsetof(refit_executor_options, verify)] = 7;
    CHECK_STATUS(refit_executor_create(plan, group, 0, (const refit_executor_options *)prefix, &executor),
                 REFIT_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(refit_last_error_message(), "options.verify") != NULL);
    free(prefix);
  }

  /* A process the plan never names: refused, naming it and the plan's processes. */
  CHECK_STATUS(refit_executor_create(plan, group, 5, NULL, &executor), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "process 5") != NULL);
  CHECK(strstr(refit_last_error_message(), "[0]") != NULL);

  /* Any failed run or commit disarms the commit until a run succeeds: the step staged before the
   * failure is never installed. */
  {
    refit_executor *staged = make(plan, group, REFIT_ARM_AUTO, false, REFIT_COMMIT_STAGED, 0);
    refit_run_stats bad;
    bad.size = 3;
    fill_source(200);
    poison(half, sizeof half);
    poison(whole_t, sizeof whole_t);
    CHECK_OK(refit_executor_run(staged, group, NULL));
    CHECK_STATUS(refit_executor_run(staged, one, NULL), REFIT_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(refit_executor_commit(staged, group, NULL), REFIT_STATUS_INVALID_STATE);
    CHECK(strstr(refit_last_error_message(), "another group") != NULL);
    CHECK_OK(refit_executor_run(staged, group, NULL));
    CHECK_STATUS(refit_executor_run(staged, group, &bad), REFIT_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(refit_executor_commit(staged, group, NULL), REFIT_STATUS_INVALID_STATE);
    CHECK_OK(refit_executor_run(staged, group, NULL));
    CHECK_STATUS(refit_executor_commit(staged, NULL, NULL), REFIT_STATUS_NULL_ARGUMENT);
    CHECK_STATUS(refit_executor_commit(staged, group, NULL), REFIT_STATUS_INVALID_STATE);
    CHECK_OK(refit_executor_run(staged, group, NULL));
    CHECK_STATUS(refit_executor_commit(staged, group, &bad), REFIT_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(refit_executor_commit(staged, group, NULL), REFIT_STATUS_INVALID_STATE);
    CHECK(all_poison(half, sizeof half) && all_poison(whole_t, sizeof whole_t));
    /* A run that succeeds arms it again. */
    CHECK_OK(refit_executor_run(staged, group, NULL));
    CHECK_OK(refit_executor_commit(staged, group, NULL));
    CHECK(received(half, whole_t));
    refit_executor_destroy(staged);
  }

  executor = make(plan, group, REFIT_ARM_AUTO, false, REFIT_COMMIT_DIRECT, 0);
  refit_run_stats stats;
  stats.size = sizeof stats;
  CHECK_STATUS(refit_executor_stats(executor, &stats), REFIT_STATUS_INVALID_STATE);
  CHECK_STATUS(refit_executor_run(NULL, group, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_executor_run(executor, NULL, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_executor_run(executor, one, NULL), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "another group") != NULL);
  stats.size = 3;
  CHECK_STATUS(refit_executor_run(executor, group, &stats), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "stats.size") != NULL);
  CHECK_STATUS(refit_executor_commit(NULL, group, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_executor_commit(executor, NULL, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_executor_commit(executor, group, &stats), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_executor_stats(NULL, &stats), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_executor_stats(executor, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_executor_stats(executor, &stats), REFIT_STATUS_INVALID_ARGUMENT);
  refit_executor_destroy(executor);
  refit_executor_destroy(NULL);

  refit_group_destroy(one);
  refit_plan_destroy(plan);
  refit_group_destroy(group);
  CHECK_OK(refit_host_stream_destroy(callers[0]));
  CHECK_OK(refit_host_stream_destroy(callers[1]));
  CHECK_DONE();
}
