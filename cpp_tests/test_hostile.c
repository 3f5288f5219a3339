/* A hostile C caller on the host backend: every argument C can express without undefined behaviour of
 * its own. NULL for each pointer, option and stats structs of the wrong size (also a caller built
 * against a shorter struct that passes only that many bytes), garbage in bool fields and padding,
 * enum values out of range, counts and shapes whose products overflow, empty and scalar tensors,
 * odd names, tensors described differently by two tables, executors called in the wrong order,
 * rebinds that make no sense, a communicator far larger than a machine can hold, calls from
 * several threads at once, and handles used after their destroy, destroyed twice, cast to another
 * handle type or made up. Every refusal must carry its own status and a message naming the
 * argument; what succeeds must move the right bytes. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS under -std=c11 */
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "check.h"

static uint64_t addr(const void *p) { return (uint64_t)(uintptr_t)p; }

/* A refusal: the exact status, and a message that is not empty and names what was wrong. */
#define CHECK_FAILS(call, expected, needle)                                                  \
  do {                                                                                       \
    CHECK_STATUS(call, expected);                                                            \
    const char *check_message_ = refit_last_error_message();                                 \
    if (check_message_ == NULL || strstr(check_message_, (needle)) == NULL) {                \
      fprintf(stderr, "%s:%d: message \"%s\" does not mention \"%s\"\n", __FILE__, __LINE__, \
              check_message_ ? check_message_ : "(NULL)", (needle));                         \
      printf("%d passed, 1 failed\n", check_passed);                                         \
      exit(1);                                                                               \
    }                                                                                        \
    check_passed++;                                                                          \
  } while (0)

static refit_group *host_group(uint32_t devices) {
  const int32_t ordinals[2] = {0, 1};
  return check_host_group(ordinals, devices);
}

/* A host communicator of one rank. */
static refit_comm *host_comm(void) {
  refit_comm_id id;
  CHECK_OK(refit_comm_get_unique_id(REFIT_BACKEND_HOST, &id));
  refit_comm *comm = NULL;
  CHECK_OK(refit_comm_create(&id, 1, 0, 0, NULL, &comm));
  return comm;
}

/* One tensor "w" of `count` u32 elements, offered whole on (0, 0) at `src`, needed whole on (0, dev)
 * at `dst`. */
static refit_plan *copy_plan(const uint32_t *src, uint32_t *dst, uint64_t count, uint32_t dev) {
  refit_table *table = NULL;
  CHECK_OK(refit_table_create(&table));
  const uint64_t shape[1] = {count}, zero[1] = {0}, unit[1] = {1};
  uint32_t w = 99;
  CHECK_OK(refit_table_add_tensor(table, "w", 7, 4, shape, 1, &w));
  CHECK_OK(refit_table_add_offer(table, w, 0, 0, addr(src), zero, shape, NULL, 1, NULL));
  CHECK_OK(refit_table_add_need(table, w, 0, dev, addr(dst), zero, shape, NULL, unit, 1));
  const refit_table *tables[1] = {table};
  refit_plan *plan = NULL;
  CHECK_OK(refit_plan_build(tables, 1, NULL, &plan));
  refit_table_destroy(table);
  return plan;
}

static void last_error_on_a_fresh_thread_is_empty(void);
static void null_pointers_one_at_a_time(void);
static void destroy_accepts_null(void);
static void struct_sizes(void);
static void garbage_in_option_fields(void);
static void enums_out_of_range(void);
static void overflowing_shapes_and_boxes(void);
static void empty_and_scalar_tensors(void);
static void names(void);
static void tables_that_disagree(void);
static void executor_call_order(void);
static void rebinds(void);
static void communicator_sizes(void);
static void threads_on_distinct_handles(void);
static void a_group_driven_by_another_thread(void);
static void batch_outlives_its_group(void);
static void stale_foreign_and_made_up_handles(void);
static void a_group_destroyed_from_another_groups_callback(void);
static void a_stream_of_another_device(void);
static void memory_that_is_not_the_callers(void);

int main(void) {
  last_error_on_a_fresh_thread_is_empty();
  null_pointers_one_at_a_time();
  destroy_accepts_null();
  struct_sizes();
  garbage_in_option_fields();
  enums_out_of_range();
  overflowing_shapes_and_boxes();
  empty_and_scalar_tensors();
  names();
  tables_that_disagree();
  executor_call_order();
  rebinds();
  communicator_sizes();
  threads_on_distinct_handles();
  a_group_driven_by_another_thread();
  batch_outlives_its_group();
  stale_foreign_and_made_up_handles();
  a_group_destroyed_from_another_groups_callback();
  a_stream_of_another_device();
  memory_that_is_not_the_callers();
  CHECK_DONE();
}

/* ---- the thread-local message ---------------------------------------------------------------- */

static void *read_message(void *result) {
  const char *message = refit_last_error_message();
  *(int *)result = message != NULL && message[0] == '\0';
  return NULL;
}

static void last_error_on_a_fresh_thread_is_empty(void) {
  /* A failure on this thread is not another thread's message. */
  CHECK_FAILS(refit_table_create(NULL), REFIT_STATUS_NULL_ARGUMENT, "table is NULL");
  int empty = 0;
  pthread_t thread;
  CHECK(pthread_create(&thread, NULL, read_message, &empty) == 0);
  CHECK(pthread_join(thread, NULL) == 0);
  CHECK(empty);
  /* And successful calls leave this thread's message alone. */
  refit_table *table = NULL;
  CHECK_OK(refit_table_create(&table));
  CHECK(strstr(refit_last_error_message(), "refit_table_create: table is NULL") != NULL);
  refit_table_destroy(table);
}

/* ---- NULL, one pointer at a time ------------------------------------------------------------- */

static void null_pointers_one_at_a_time(void) {
  refit_table *table = NULL;
  CHECK_OK(refit_table_create(&table));
  const uint64_t shape[2] = {4, 4}, zero[2] = {0, 0}, strides[2] = {4, 1};
  uint32_t t = 0;
  CHECK_OK(refit_table_add_tensor(table, "w", 1, 4, shape, 2, &t));
  CHECK_FAILS(refit_table_add_offer(table, t, 0, 0, 64, zero, NULL, NULL, 2, NULL), REFIT_STATUS_NULL_ARGUMENT,
              "extent is NULL");
  CHECK_FAILS(refit_table_add_need(table, t, 1, 0, 64, NULL, shape, NULL, strides, 2), REFIT_STATUS_NULL_ARGUMENT,
              "offset is NULL");
  CHECK_FAILS(refit_table_add_need(table, t, 1, 0, 64, zero, NULL, NULL, strides, 2), REFIT_STATUS_NULL_ARGUMENT,
              "extent is NULL");
  CHECK_FAILS(refit_table_add_need(table, t, 1, 0, 64, zero, shape, NULL, NULL, 2), REFIT_STATUS_NULL_ARGUMENT,
              "strides is NULL");
  /* A NULL buffer with a capacity is a NULL buffer, whether or not the capacity would be enough. */
  size_t written = 77;
  CHECK_FAILS(refit_table_encode(table, NULL, 1, &written), REFIT_STATUS_NULL_ARGUMENT, "buffer is NULL");
  CHECK_FAILS(refit_table_encode(table, NULL, SIZE_MAX, &written), REFIT_STATUS_NULL_ARGUMENT, "buffer is NULL");
  CHECK(written == 77);
  CHECK_FAILS(refit_table_encode(table, NULL, 0, NULL), REFIT_STATUS_NULL_ARGUMENT, "written is NULL");
  refit_table *decoded = (refit_table *)0x1;
  CHECK_FAILS(refit_table_decode(NULL, SIZE_MAX, &decoded), REFIT_STATUS_NULL_ARGUMENT, "bytes is NULL");
  CHECK(decoded == (refit_table *)0x1);

  const refit_table *tables[1] = {table};
  refit_plan *plan = NULL;
  CHECK_OK(refit_plan_build(tables, 1, NULL, &plan));
  refit_plan *none = (refit_plan *)0x1;
  const refit_table *null_entry[3] = {table, table, NULL};
  CHECK_FAILS(refit_plan_build_share(null_entry, 3, 0, NULL, &none), REFIT_STATUS_NULL_ARGUMENT, "tables[2]");
  CHECK_FAILS(refit_plan_build_share(tables, 1, 0, NULL, NULL), REFIT_STATUS_NULL_ARGUMENT, "plan is NULL");
  CHECK(none == (refit_plan *)0x1);
  size_t count = 0;
  uint64_t fingerprint = 0;
  CHECK_FAILS(refit_plan_route_count(NULL, &count), REFIT_STATUS_NULL_ARGUMENT, "plan is NULL");
  CHECK_FAILS(refit_plan_fingerprint(NULL, &fingerprint), REFIT_STATUS_NULL_ARGUMENT, "plan is NULL");

  refit_group *group = host_group(1);
  size_t size = 0;
  void *stream = NULL;
  CHECK_FAILS(refit_group_device(NULL, 0, &(int32_t){0}), REFIT_STATUS_NULL_ARGUMENT, "group is NULL");
  CHECK_FAILS(refit_group_device(group, 0, NULL), REFIT_STATUS_NULL_ARGUMENT, "device is NULL");
  CHECK_FAILS(refit_group_stream(NULL, 0, &stream), REFIT_STATUS_NULL_ARGUMENT, "group is NULL");
  CHECK_FAILS(refit_group_stream(group, 0, NULL), REFIT_STATUS_NULL_ARGUMENT, "stream is NULL");
  CHECK_FAILS(refit_group_peer_access(NULL, 0, 0, &(bool){false}), REFIT_STATUS_NULL_ARGUMENT, "group is NULL");
  CHECK_FAILS(refit_group_peer_access(group, 0, 0, NULL), REFIT_STATUS_NULL_ARGUMENT, "direct is NULL");
  CHECK_FAILS(refit_group_backend(NULL, &(uint32_t){0}), REFIT_STATUS_NULL_ARGUMENT, "group is NULL");
  CHECK_FAILS(refit_group_backend(group, NULL), REFIT_STATUS_NULL_ARGUMENT, "backend is NULL");
  CHECK_FAILS(refit_group_enter(NULL, NULL), REFIT_STATUS_NULL_ARGUMENT, "group is NULL");
  CHECK_FAILS(refit_group_exit(NULL, REFIT_EXIT_SYNC), REFIT_STATUS_NULL_ARGUMENT, "group is NULL");
  CHECK_FAILS(refit_host_stream_create(NULL), REFIT_STATUS_NULL_ARGUMENT, "stream is NULL");
  CHECK_OK(refit_group_size(group, &size));
  CHECK(size == 1);
  CHECK_FAILS(refit_group_allgather_rank(NULL, 0, 8, 16, &size, REFIT_ALLGATHER_AUTO, NULL),
              REFIT_STATUS_NULL_ARGUMENT, "group is NULL");
  CHECK_FAILS(refit_group_allgather_rank(group, 0, 8, 16, NULL, REFIT_ALLGATHER_AUTO, NULL),
              REFIT_STATUS_NULL_ARGUMENT, "counts is NULL");
  CHECK_FAILS(refit_copy_batch_prepare(group, 0, NULL, 1, 0, NULL), REFIT_STATUS_NULL_ARGUMENT, "batch is NULL");

  /* The empty plan names no process: an executor of it would move nothing. */
  refit_executor *executor = (refit_executor *)0x1;
  CHECK_FAILS(refit_executor_create(plan, group, 0, NULL, &executor), REFIT_STATUS_INVALID_ARGUMENT,
              "names no route or receiver");
  CHECK(executor == (refit_executor *)0x1);
  static uint32_t moved_src[4] = {1, 2, 3, 4}, moved_dst[4];
  refit_plan *moving = copy_plan(moved_src, moved_dst, 4, 0);
  CHECK_OK(refit_executor_create(moving, group, 0, NULL, &executor));
  refit_plan_destroy(moving);
  CHECK_FAILS(refit_executor_create_across(NULL, group, NULL, NULL, &executor), REFIT_STATUS_NULL_ARGUMENT,
              "plan is NULL");
  CHECK_FAILS(refit_executor_create_across(plan, NULL, NULL, NULL, &executor), REFIT_STATUS_NULL_ARGUMENT,
              "group is NULL");
  CHECK_FAILS(refit_executor_create_across(plan, group, NULL, NULL, NULL), REFIT_STATUS_NULL_ARGUMENT,
              "executor is NULL");
  CHECK_FAILS(refit_executor_rebind(NULL, 0, 8, 16, 8), REFIT_STATUS_NULL_ARGUMENT, "executor is NULL");

  refit_comm *comm = host_comm();
  uint32_t value = 0;
  int32_t device = 0;
  CHECK_FAILS(refit_comm_size(comm, NULL), REFIT_STATUS_NULL_ARGUMENT, "size is NULL");
  CHECK_FAILS(refit_comm_rank(NULL, &value), REFIT_STATUS_NULL_ARGUMENT, "comm is NULL");
  CHECK_FAILS(refit_comm_device(NULL, &device), REFIT_STATUS_NULL_ARGUMENT, "comm is NULL");
  CHECK_FAILS(refit_comm_backend(comm, NULL), REFIT_STATUS_NULL_ARGUMENT, "backend is NULL");
  CHECK_FAILS(refit_comm_adopt(NULL, NULL, &comm), REFIT_STATUS_NULL_ARGUMENT, "NULL");
  /* A NULL buffer with bytes to move; none to move is fine. */
  uint8_t byte = 5;
  size_t one = 1, nothing = 0;
  CHECK_FAILS(refit_comm_allgather(comm, addr(&byte), 0, &one, NULL), REFIT_STATUS_NULL_ARGUMENT, "recv");
  CHECK_OK(refit_comm_allgather(comm, 0, 0, &nothing, NULL));
  CHECK_OK(refit_comm_synchronize(comm, NULL));
  refit_comm_destroy(comm);

  refit_executor_destroy(executor);
  refit_group_destroy(group);
  refit_plan_destroy(plan);
  refit_table_destroy(table);
}

static void destroy_accepts_null(void) {
  refit_table_destroy(NULL);
  refit_plan_destroy(NULL);
  refit_group_destroy(NULL);
  refit_executor_destroy(NULL);
  refit_copy_batch_destroy(NULL);
  refit_comm_destroy(NULL);
  CHECK_FAILS(refit_host_stream_destroy(NULL), REFIT_STATUS_NULL_ARGUMENT, "stream is NULL");
}

/* ---- sizes of structs ------------------------------------------------------------------------ */

/* A caller built against a shorter struct passes a pointer to just its `size` field's bytes: the
 * library must refuse it before reading a byte more (valgrind reports any read past the block). */
static void *short_struct(void) {
  size_t *bytes = malloc(sizeof(size_t));
  CHECK(bytes != NULL);
  *bytes = sizeof(size_t);
  return bytes;
}

static void struct_sizes(void) {
  static uint32_t src[4] = {1, 2, 3, 4}, dst[4];
  refit_plan *plan = copy_plan(src, dst, 4, 0);
  refit_group *group = host_group(1);
  const size_t wrong[5] = {0, 1, sizeof(size_t), SIZE_MAX / 2, SIZE_MAX};

  refit_executor_options exec_options;
  refit_group_options group_options;
  refit_plan_options plan_options;
  refit_comm_options comm_options;
  refit_comm_id id;
  CHECK_OK(refit_comm_get_unique_id(REFIT_BACKEND_HOST, &id));
  refit_executor *executor = (refit_executor *)0x1;
  refit_group *no_group = (refit_group *)0x1;
  refit_plan *no_plan = (refit_plan *)0x1;
  refit_comm *no_comm = (refit_comm *)0x1;
  const int32_t device0 = 0;
  for (int i = 0; i < 6; i++) {
    size_t bad = i < 5 ? wrong[i] : 0;
    CHECK_OK(refit_executor_options_init(&exec_options));
    CHECK_OK(refit_group_options_init(&group_options));
    CHECK_OK(refit_plan_options_init(&plan_options));
    CHECK_OK(refit_comm_options_init(&comm_options));
    /* One byte short and one byte long of each struct too. */
    exec_options.size = i < 5 ? bad : sizeof exec_options - 1;
    group_options.size = i < 5 ? bad : sizeof group_options + 1;
    plan_options.size = i < 5 ? bad : sizeof plan_options - 1;
    comm_options.size = i < 5 ? bad : sizeof comm_options + 1;
    CHECK_FAILS(refit_executor_create(plan, group, 0, &exec_options, &executor), REFIT_STATUS_INVALID_ARGUMENT,
                "options.size");
    CHECK_FAILS(refit_group_create(&device0, 1, &group_options, &no_group), REFIT_STATUS_INVALID_ARGUMENT,
                "options.size");
    CHECK_FAILS(refit_plan_build(NULL, 0, &plan_options, &no_plan), REFIT_STATUS_INVALID_ARGUMENT,
                "options.size");
    CHECK_FAILS(refit_comm_create(&id, 1, 0, 0, &comm_options, &no_comm), REFIT_STATUS_INVALID_ARGUMENT,
                "options.size");
  }
  void *exec_short = short_struct(), *group_short = short_struct(), *plan_short = short_struct();
  void *comm_short = short_struct(), *stats_short = short_struct(), *route_short = short_struct();
  CHECK_FAILS(refit_executor_create(plan, group, 0, exec_short, &executor), REFIT_STATUS_INVALID_ARGUMENT,
              "options.size is 8");
  CHECK_FAILS(refit_group_create(&device0, 1, group_short, &no_group), REFIT_STATUS_INVALID_ARGUMENT,
              "options.size is 8");
  CHECK_FAILS(refit_plan_build(NULL, 0, plan_short, &no_plan), REFIT_STATUS_INVALID_ARGUMENT, "options.size is 8");
  CHECK_FAILS(refit_plan_build_share(NULL, 0, 0, plan_short, &no_plan), REFIT_STATUS_INVALID_ARGUMENT,
              "options.size is 8");
  CHECK_FAILS(refit_comm_create(&id, 1, 0, 0, comm_short, &no_comm), REFIT_STATUS_INVALID_ARGUMENT,
              "options.size is 8");
  CHECK(executor == (refit_executor *)0x1 && no_group == (refit_group *)0x1);
  CHECK(no_plan == (refit_plan *)0x1 && no_comm == (refit_comm *)0x1);

  /* Output structs: the size must be exactly the struct's. */
  CHECK_OK(refit_executor_create(plan, group, 0, NULL, &executor));
  refit_run_stats run_stats;
  refit_plan_stats plan_stats;
  refit_route_info route;
  for (int i = 0; i < 5; i++) {
    memset(&run_stats, 0xA5, sizeof run_stats);
    run_stats.size = i < 4 ? wrong[i + 1] : sizeof run_stats + 1;
    CHECK_FAILS(refit_executor_run(executor, group, &run_stats), REFIT_STATUS_INVALID_ARGUMENT, "stats.size");
    CHECK_FAILS(refit_executor_commit(executor, group, &run_stats), REFIT_STATUS_INVALID_ARGUMENT, "stats.size");
    plan_stats.size = run_stats.size;
    route.size = run_stats.size;
    CHECK_FAILS(refit_plan_get_stats(plan, &plan_stats), REFIT_STATUS_INVALID_ARGUMENT, "stats.size");
    CHECK_FAILS(refit_plan_route(plan, 0, &route), REFIT_STATUS_INVALID_ARGUMENT, "route.size");
  }
  /* Nothing ran: the refused runs did not copy (the destination is still zero). */
  CHECK(dst[0] == 0);
  CHECK_FAILS(refit_executor_stats(executor, stats_short), REFIT_STATUS_INVALID_ARGUMENT, "stats.size is 8");
  CHECK_FAILS(refit_plan_get_receiver_stats(plan, 0, 0, stats_short), REFIT_STATUS_INVALID_ARGUMENT,
              "stats.size is 8");
  CHECK_FAILS(refit_plan_route(plan, 0, route_short), REFIT_STATUS_INVALID_ARGUMENT, "route.size is 8");
  free(exec_short);
  free(group_short);
  free(plan_short);
  free(comm_short);
  free(stats_short);
  free(route_short);

  refit_executor_destroy(executor);
  refit_group_destroy(group);
  refit_plan_destroy(plan);
}

/* ---- bytes C writes without a compiler's help -------------------------------------------------- */

static void set_byte(void *object, size_t offset, unsigned char value) { ((unsigned char *)object)[offset] = value; }

static void garbage_in_option_fields(void) {
  static uint32_t src[4] = {5, 6, 7, 8}, dst[4];
  refit_plan *plan = copy_plan(src, dst, 4, 0);
  refit_group *group = host_group(1);
  refit_executor *executor = (refit_executor *)0x1;
  refit_executor_options options;
  /* A bool byte that is neither 0 nor 1 (memset, memcpy from elsewhere): refused, never read as a
   * bool. */
  const unsigned char bad_bools[3] = {2, 0x7f, 0xff};
  for (int i = 0; i < 3; i++) {
    CHECK_OK(refit_executor_options_init(&options));
    set_byte(&options, offsetof(refit_executor_options, verify), bad_bools[i]);
    CHECK_FAILS(refit_executor_create(plan, group, 0, &options, &executor), REFIT_STATUS_INVALID_ARGUMENT,
                "options.verify");
    CHECK_OK(refit_executor_options_init(&options));
    options.commit = REFIT_COMMIT_STAGED;
    set_byte(&options, offsetof(refit_executor_options, single_slice), bad_bools[i]);
    CHECK_FAILS(refit_executor_create(plan, group, 0, &options, &executor), REFIT_STATUS_INVALID_ARGUMENT,
                "options.single_slice");
  }
  CHECK(executor == (refit_executor *)0x1);
  /* Addresses no memory can have (the first page, where an offer at 0 plans its segments) are
   * refused at create, never read by a run: the planner takes them, the executor names them. */
  refit_plan *near_zero = copy_plan((const uint32_t *)(uintptr_t)0x40, dst, 4, 0);
  CHECK_FAILS(refit_executor_create(near_zero, group, 0, NULL, &executor), REFIT_STATUS_INVALID_ARGUMENT,
              "tensor 'w' box offset [0] extent [4]: its source [0x40, +0x10)");
  refit_plan_destroy(near_zero);
  near_zero = copy_plan(src, (uint32_t *)(uintptr_t)0xffc, 4, 0);
  CHECK_FAILS(refit_executor_create(near_zero, group, 0, NULL, &executor), REFIT_STATUS_INVALID_ARGUMENT,
              "its destination [0xffc, +0x10)");
  refit_plan_destroy(near_zero);
  CHECK(executor == (refit_executor *)0x1);
  /* Padding is nobody's field: garbage there changes nothing. */
  CHECK_OK(refit_executor_options_init(&options));
  options.verify = true;
  for (size_t b = offsetof(refit_executor_options, verify) + 1; b < offsetof(refit_executor_options, commit); b++)
    set_byte(&options, b, 0xA5);
  CHECK_OK(refit_executor_create(plan, group, 0, &options, &executor));
  refit_run_stats stats;
  stats.size = sizeof stats;
  CHECK_OK(refit_executor_run(executor, group, &stats));
  CHECK(stats.verified && memcmp(src, dst, sizeof src) == 0);
  refit_executor_destroy(executor);

  refit_comm_options comm_options;
  refit_comm_id id;
  CHECK_OK(refit_comm_get_unique_id(REFIT_BACKEND_HOST, &id));
  refit_comm *comm = (refit_comm *)0x1;
  CHECK_OK(refit_comm_options_init(&comm_options));
  set_byte(&comm_options, offsetof(refit_comm_options, ipc), 3);
  CHECK_FAILS(refit_comm_create(&id, 1, 0, 0, &comm_options, &comm), REFIT_STATUS_INVALID_ARGUMENT, "options.ipc");
  CHECK(comm == (refit_comm *)0x1);
  CHECK_OK(refit_comm_options_init(&comm_options));
  set_byte(&comm_options, offsetof(refit_comm_options, check_counts), 2);
  CHECK_FAILS(refit_comm_create(&id, 1, 0, 0, &comm_options, &comm), REFIT_STATUS_INVALID_ARGUMENT,
              "options.check_counts");
  CHECK(comm == (refit_comm *)0x1);
  CHECK_OK(refit_comm_options_init(&comm_options));
  for (size_t b = offsetof(refit_comm_options, check_counts) + 1; b < sizeof comm_options; b++)
    set_byte(&comm_options, b, 0xA5);
  CHECK_OK(refit_comm_create(&id, 1, 0, 0, &comm_options, &comm));
  refit_comm_destroy(comm);

  refit_plan_options plan_options;
  CHECK_OK(refit_plan_options_init(&plan_options));
  for (size_t b = offsetof(refit_plan_options, coalesce) + 1; b < sizeof plan_options; b++) set_byte(&plan_options, b, 0xA5);
  refit_plan *again = NULL;
  CHECK_OK(refit_plan_build(NULL, 0, &plan_options, &again));
  refit_plan_destroy(again);

  /* The largest values of plain number fields are numbers, not nonsense: they work. */
  CHECK_OK(refit_executor_options_init(&options));
  options.commit = REFIT_COMMIT_STAGED;
  options.staging_limit = UINT64_MAX;
  options.sm_budget = UINT32_MAX;
  CHECK_OK(refit_executor_create(plan, group, 0, &options, &executor));
  memset(dst, 0, sizeof dst);
  CHECK_OK(refit_executor_run(executor, group, NULL));
  CHECK(dst[0] == 0);
  CHECK_OK(refit_executor_commit(executor, group, NULL));
  CHECK(memcmp(src, dst, sizeof src) == 0);
  refit_executor_destroy(executor);

  refit_group_destroy(group);
  refit_plan_destroy(plan);
}

/* ---- enums ----------------------------------------------------------------------------------- */

static void enums_out_of_range(void) {
  static uint32_t src[2] = {1, 2}, dst[2];
  refit_plan *plan = copy_plan(src, dst, 2, 0);
  refit_group *group = host_group(1);
  refit_executor *executor = (refit_executor *)0x1;
  refit_executor_options exec_options;
  const uint32_t arms[3] = {REFIT_ARM_NONE, 0x80000000u, UINT32_MAX};
  for (int i = 0; i < 3; i++) {
    CHECK_OK(refit_executor_options_init(&exec_options));
    exec_options.arm = arms[i];
    CHECK_FAILS(refit_executor_create(plan, group, 0, &exec_options, &executor), REFIT_STATUS_INVALID_ARGUMENT,
                "options.arm");
    CHECK_OK(refit_executor_options_init(&exec_options));
    exec_options.commit = arms[i];
    CHECK_FAILS(refit_executor_create(plan, group, 0, &exec_options, &executor), REFIT_STATUS_INVALID_ARGUMENT,
                "options.commit");
  }
  CHECK(executor == (refit_executor *)0x1);
  refit_plan_options plan_options;
  CHECK_OK(refit_plan_options_init(&plan_options));
  plan_options.policy = UINT32_MAX;
  refit_plan *none = NULL;
  CHECK_FAILS(refit_plan_build(NULL, 0, &plan_options, &none), REFIT_STATUS_INVALID_ARGUMENT, "options.policy");
  CHECK_OK(refit_plan_options_init(&plan_options));
  plan_options.coalesce = 2;
  CHECK_FAILS(refit_plan_build_share(NULL, 0, 0, &plan_options, &none), REFIT_STATUS_INVALID_ARGUMENT,
              "options.coalesce");
  refit_group_options group_options;
  CHECK_OK(refit_group_options_init(&group_options));
  group_options.backend = UINT32_MAX;
  const int32_t device0 = 0;
  refit_group *no_group = NULL;
  CHECK_FAILS(refit_group_create(&device0, 1, &group_options, &no_group), REFIT_STATUS_INVALID_ARGUMENT,
              "options.backend");
  CHECK_FAILS(refit_group_exit(group, UINT32_MAX), REFIT_STATUS_INVALID_ARGUMENT, "mode");
  CHECK_OK(refit_group_enter(group, NULL));
  CHECK_FAILS(refit_group_exit(group, 0x80000000u), REFIT_STATUS_INVALID_ARGUMENT, "mode");
  CHECK_OK(refit_group_exit(group, REFIT_EXIT_SYNC)); /* the refused exit left the scope open */
  uint64_t send = addr(src), recv = addr(dst);
  size_t counts[1] = {4};
  CHECK_FAILS(refit_allgather(group, &send, &recv, counts, UINT32_MAX, NULL), REFIT_STATUS_INVALID_ARGUMENT,
              "algorithm");
  refit_comm_id id;
  CHECK_FAILS(refit_comm_get_unique_id(UINT32_MAX, &id), REFIT_STATUS_INVALID_ARGUMENT, "backend");
  CHECK_FAILS(refit_set_log_callback(UINT32_MAX, NULL, NULL), REFIT_STATUS_INVALID_ARGUMENT, "level");
  CHECK(strcmp(refit_status_string(INT32_MIN), "REFIT_STATUS_UNKNOWN") == 0);
  CHECK(strcmp(refit_status_string(INT32_MAX), "REFIT_STATUS_UNKNOWN") == 0);
  CHECK(strcmp(refit_status_string(REFIT_STATUS_TIMEOUT + 1), "REFIT_STATUS_UNKNOWN") == 0);
  for (int32_t s = 0; s <= REFIT_STATUS_TIMEOUT; s++) CHECK(strncmp(refit_status_string(s), "REFIT_STATUS_", 13) == 0);
  CHECK_FAILS(refit_copy_batch(group, 0, NULL, NULL, 0, 0x80000000u), REFIT_STATUS_INVALID_ARGUMENT, "flags");
  refit_group_destroy(group);
  refit_plan_destroy(plan);
}

/* ---- arithmetic that overflows --------------------------------------------------------------- */

static void overflowing_shapes_and_boxes(void) {
  refit_table *table = NULL;
  CHECK_OK(refit_table_create(&table));
  uint32_t t = 77;
  const uint64_t cube[3] = {1ull << 22, 1ull << 22, 1ull << 21};  /* 2^65 elements */
  const uint64_t almost[2] = {1ull << 31, 1ull << 31};           /* 2^62 elements of 8 bytes */
  const uint64_t max1[1] = {UINT64_MAX};
  CHECK_FAILS(refit_table_add_tensor(table, "cube", 1, 1, cube, 3, &t), REFIT_STATUS_INVALID_ARGUMENT, "2^64");
  CHECK_FAILS(refit_table_add_tensor(table, "almost", 1, 8, almost, 2, &t), REFIT_STATUS_INVALID_ARGUMENT, "2^64");
  CHECK_FAILS(refit_table_add_tensor(table, "max", 1, 2, max1, 1, &t), REFIT_STATUS_INVALID_ARGUMENT, "2^64");
  CHECK_FAILS(refit_table_add_tensor(table, "deep", 1, 1, cube, SIZE_MAX, &t), REFIT_STATUS_INVALID_ARGUMENT, "ndim");
  CHECK_FAILS(refit_table_add_tensor(table, "deep", 1, 1, cube, REFIT_MAX_DIMS + 1, &t), REFIT_STATUS_INVALID_ARGUMENT,
              "ndim");
  CHECK(t == 77);
  /* One byte per element over the whole 64-bit range is the largest tensor. */
  CHECK_OK(refit_table_add_tensor(table, "max", 1, 1, max1, 1, &t));
  const uint64_t shape[2] = {1ull << 32, 1ull << 20}, zero[2] = {0, 0}, unit[2] = {1, 1};
  uint32_t big = 0;
  CHECK_OK(refit_table_add_tensor(table, "big", 1, 2, shape, 2, &big));
  /* Boxes: offset + extent past 2^64, or past the shape. */
  const uint64_t far[2] = {UINT64_MAX, 0}, two[2] = {2, 1}, rest[2] = {1, 1ull << 20};
  CHECK_FAILS(refit_table_add_offer(table, big, 0, 0, 4096, far, two, NULL, 2, NULL), REFIT_STATUS_TENSOR_MISMATCH,
              "outside tensor 'big'");
  CHECK_FAILS(refit_table_add_need(table, big, 1, 0, 4096, far, two, NULL, unit, 2), REFIT_STATUS_TENSOR_MISMATCH,
              "outside tensor 'big'");
  const uint64_t last_row[2] = {(1ull << 32) - 1, 1};
  CHECK_FAILS(refit_table_add_offer(table, big, 0, 0, 4096, last_row, rest, NULL, 2, NULL),
              REFIT_STATUS_TENSOR_MISMATCH, "outside");
  /* Strides and addresses whose span passes 2^64. */
  const uint64_t wild[2] = {UINT64_MAX / 2, 1};
  CHECK_FAILS(refit_table_add_offer(table, big, 0, 0, 4096, zero, two, wild, 2, NULL), REFIT_STATUS_INVALID_ARGUMENT,
              "address space");
  CHECK_FAILS(refit_table_add_need(table, big, 1, 0, 4096, zero, two, NULL, wild, 2), REFIT_STATUS_INVALID_ARGUMENT,
              "address space");
  CHECK_FAILS(refit_table_add_offer(table, big, 0, 0, UINT64_MAX - 1, zero, two, NULL, 2, NULL),
              REFIT_STATUS_INVALID_ARGUMENT, "address space");
  CHECK_FAILS(refit_table_add_offer(table, big, 0, 0, UINT64_MAX - (1ull << 52), zero, shape, NULL, 2, NULL),
              REFIT_STATUS_INVALID_ARGUMENT, "address space");
  /* Dimension counts: above the limit, and other than the tensor's. */
  CHECK_FAILS(refit_table_add_offer(table, big, 0, 0, 4096, zero, two, NULL, SIZE_MAX, NULL),
              REFIT_STATUS_INVALID_ARGUMENT, "ndim");
  CHECK_FAILS(refit_table_add_need(table, big, 1, 0, 4096, zero, two, NULL, unit, REFIT_MAX_DIMS + 1),
              REFIT_STATUS_INVALID_ARGUMENT, "ndim");
  CHECK_FAILS(refit_table_add_offer(table, big, 0, 0, 4096, NULL, NULL, NULL, 0, NULL), REFIT_STATUS_TENSOR_MISMATCH,
              "2 dimensions");
  /* Tensor indices past the table, and a permutation naming no dimension. */
  CHECK_FAILS(refit_table_add_offer(table, UINT32_MAX, 0, 0, 4096, zero, two, NULL, 2, NULL),
              REFIT_STATUS_INVALID_ARGUMENT, "tensor index 4294967295");
  const uint32_t perm[2] = {0, UINT32_MAX};
  CHECK_FAILS(refit_table_add_need(table, big, 1, 0, 4096, zero, two, perm, unit, 2), REFIT_STATUS_INVALID_ARGUMENT,
              "permutation");

  /* Table lists whose byte size overflows. */
  refit_plan *plan = (refit_plan *)0x1;
  const refit_table *tables[1] = {table};
  CHECK_FAILS(refit_plan_build(tables, SIZE_MAX / sizeof(void *) + 1, NULL, &plan), REFIT_STATUS_INVALID_ARGUMENT,
              "tables length");
  CHECK(plan == (refit_plan *)0x1);
  refit_table_destroy(table);

  /* Segments, allgather counts and digests whose ends pass 2^64. */
  refit_group *group = host_group(2);
  static uint8_t a[64], b[64];
  refit_segment segment;
  memset(&segment, 0, sizeof segment);
  segment.src = addr(a);
  segment.dst = addr(b);
  segment.len = 8;
  segment.count[0] = UINT64_MAX / 4;
  segment.count[1] = 1;
  segment.src_stride[0] = 8;
  segment.dst_stride[0] = 8;
  CHECK_FAILS(refit_copy_batch(group, 0, NULL, &segment, 1, 0), REFIT_STATUS_INVALID_ARGUMENT, "segment 0");
  segment.count[0] = 2;
  segment.count[1] = 2;
  segment.dst_stride[1] = UINT64_MAX;
  CHECK_FAILS(refit_copy_batch(group, 0, NULL, &segment, 1, REFIT_COPY_CHECKED), REFIT_STATUS_INVALID_ARGUMENT,
              "segment 0");
  CHECK_FAILS(refit_copy_batch(group, 0, NULL, &segment, SIZE_MAX / 8, 0), REFIT_STATUS_INVALID_ARGUMENT,
              "segments length");
  /* A zero-length segment, or one repeated zero times, moves nothing wherever it points. */
  segment.len = 0;
  segment.src = segment.dst = 0;
  CHECK_OK(refit_copy_batch(group, 1, NULL, &segment, 1, REFIT_COPY_CHECKED));
  segment.len = 8;
  segment.count[1] = 0;
  CHECK_OK(refit_copy_batch(group, 1, NULL, &segment, 1, REFIT_COPY_CHECKED));
  uint64_t sends[2] = {addr(a), addr(a + 32)}, recvs[2] = {addr(b), addr(b + 1)};
  size_t counts[2] = {SIZE_MAX, 1};
  CHECK_FAILS(refit_allgather(group, sends, recvs, counts, REFIT_ALLGATHER_HOST, NULL), REFIT_STATUS_INVALID_ARGUMENT,
              "overflow");
  counts[0] = counts[1] = (SIZE_MAX >> 1) + 1;
  CHECK_FAILS(refit_allgather(group, sends, recvs, counts, REFIT_ALLGATHER_PEER, NULL), REFIT_STATUS_INVALID_ARGUMENT,
              "overflow");
  uint64_t digest = 9;
  CHECK_FAILS(refit_digest(group, 0, addr(a), UINT64_MAX, NULL, &digest), REFIT_STATUS_INVALID_ARGUMENT,
              "address space");
  CHECK_FAILS(refit_digest(group, UINT32_MAX, addr(a), 1, NULL, &digest), REFIT_STATUS_INVALID_ARGUMENT,
              "rank 4294967295");
  CHECK(digest == 9);
  refit_group_destroy(group);
}

/* ---- empty boxes, scalars ------------------------------------------------------------------- */

static void empty_and_scalar_tensors(void) {
  static uint32_t scalar_src = 0xC0FFEE, scalar_dst, empty_src[1], empty_dst[1], w_src[8], w_dst[8];
  for (int i = 0; i < 8; i++) w_src[i] = (uint32_t)(i * 11 + 3);
  refit_table *table = NULL;
  CHECK_OK(refit_table_create(&table));
  uint32_t scalar = 9, empty = 9, w = 9;
  const uint64_t empty_shape[2] = {0, 5}, zero2[2] = {0, 0}, empty_strides[2] = {5, 1};
  const uint64_t w_shape[1] = {8}, zero1[1] = {0}, unit[1] = {1}, three[1] = {3}, five[1] = {5};
  /* A scalar: ndim 0, shape NULL, one element. */
  CHECK_OK(refit_table_add_tensor(table, "scalar", 1, 4, NULL, 0, &scalar));
  CHECK_OK(refit_table_add_tensor(table, "empty", 1, 4, empty_shape, 2, &empty));
  CHECK_OK(refit_table_add_tensor(table, "w", 1, 4, w_shape, 1, &w));
  CHECK(scalar == 0 && empty == 1 && w == 2);
  CHECK_OK(refit_table_add_offer(table, scalar, 0, 0, addr(&scalar_src), NULL, NULL, NULL, 0, NULL));
  CHECK_OK(refit_table_add_need(table, scalar, 0, 1, addr(&scalar_dst), NULL, NULL, NULL, unit, 0));
  /* A box of a tensor with no elements, and an empty box of a tensor with some. */
  CHECK_OK(refit_table_add_offer(table, empty, 0, 0, addr(empty_src), zero2, empty_shape, NULL, 2, NULL));
  CHECK_OK(refit_table_add_need(table, empty, 0, 1, addr(empty_dst), zero2, empty_shape, NULL, empty_strides, 2));
  CHECK_OK(refit_table_add_offer(table, w, 0, 0, addr(w_src), zero1, w_shape, NULL, 1, NULL));
  CHECK_OK(refit_table_add_need(table, w, 0, 0, addr(w_dst + 3), three, zero1, NULL, unit, 1));
  CHECK_OK(refit_table_add_need(table, w, 0, 0, addr(w_dst + 3), three, five, NULL, unit, 1));
  const refit_table *tables[1] = {table};
  refit_plan *plan = NULL;
  CHECK_OK(refit_plan_build(tables, 1, NULL, &plan));
  refit_plan_stats stats;
  stats.size = sizeof stats;
  CHECK_OK(refit_plan_get_stats(plan, &stats));
  CHECK(stats.needs == 4 && stats.needed_bytes == 4 + 5 * 4);
  refit_group *group = host_group(2);
  refit_executor *executor = NULL;
  CHECK_OK(refit_executor_create(plan, group, 0, NULL, &executor));
  refit_run_stats run;
  run.size = sizeof run;
  CHECK_OK(refit_executor_run(executor, group, &run));
  CHECK(scalar_dst == 0xC0FFEE);
  CHECK(memcmp(w_dst + 3, w_src + 3, 5 * 4) == 0 && w_dst[0] == 0 && w_dst[2] == 0);
  CHECK(run.bytes[REFIT_ROUTE_PEER] == 4 && run.bytes[REFIT_ROUTE_LOCAL] == 20);
  /* A process the plan does not mention: an executor for it would move nothing, so it is refused,
   * naming the process and the plan's processes. Its own share names it: that one moves no byte. */
  refit_executor *idle = (refit_executor *)0x1;
  CHECK_FAILS(refit_executor_create(plan, group, UINT32_MAX, NULL, &idle), REFIT_STATUS_INVALID_ARGUMENT,
              "process 4294967295: the plan names no route or receiver of it (its processes are [0])");
  CHECK(idle == (refit_executor *)0x1);
  refit_plan *idle_share = NULL;
  CHECK_OK(refit_plan_build_share(tables, 1, UINT32_MAX, NULL, &idle_share));
  CHECK_OK(refit_executor_create(idle_share, group, UINT32_MAX, NULL, &idle));
  CHECK_OK(refit_executor_run(idle, group, &run));
  CHECK(run.bytes[0] + run.bytes[1] + run.bytes[2] == 0 && run.installed_bytes == 0);
  refit_executor_destroy(idle);
  refit_plan_destroy(idle_share);
  refit_executor_destroy(executor);

  /* No tables at all: an empty plan with no route to read. */
  refit_plan *empty_plan = NULL;
  CHECK_OK(refit_plan_build(NULL, 0, NULL, &empty_plan));
  refit_route_info route;
  route.size = sizeof route;
  CHECK_FAILS(refit_plan_route(empty_plan, 0, &route), REFIT_STATUS_NOT_FOUND, "route 0");
  CHECK_FAILS(refit_plan_route(empty_plan, SIZE_MAX, &route), REFIT_STATUS_NOT_FOUND, "0 routes");
  refit_plan *empty_share = NULL;
  CHECK_OK(refit_plan_build_share(NULL, 0, UINT32_MAX, NULL, &empty_share));
  uint64_t f1 = 1, f2 = 2;
  CHECK_OK(refit_plan_inputs_fingerprint(empty_plan, &f1));
  CHECK_OK(refit_plan_inputs_fingerprint(empty_share, &f2));
  CHECK(f1 == f2);
  refit_plan_destroy(empty_share);
  refit_plan_destroy(empty_plan);

  refit_group_destroy(group);
  refit_plan_destroy(plan);
  refit_table_destroy(table);
}

/* ---- names ----------------------------------------------------------------------------------- */

static void names(void) {
  refit_table *table = NULL;
  CHECK_OK(refit_table_create(&table));
  const uint64_t shape[1] = {4};
  uint32_t t = 5;
  CHECK_FAILS(refit_table_add_tensor(table, "", 1, 4, shape, 1, &t), REFIT_STATUS_INVALID_ARGUMENT, "empty name");
  /* Not UTF-8: a lone continuation byte, a truncated sequence, an overlong NUL, a surrogate. */
  const char *invalid[4] = {"\x80", "ab\xe2\x82", "\xc0\x80", "\xed\xa0\x80"};
  for (int i = 0; i < 4; i++)
    CHECK_FAILS(refit_table_add_tensor(table, invalid[i], 1, 4, shape, 1, &t), REFIT_STATUS_INVALID_ARGUMENT,
                "name is not valid UTF-8");
  CHECK(t == 5);
  /* A name of 64 KiB is a name: found again by the same bytes, not by a prefix. */
  size_t length = 64 * 1024;
  char *longest = malloc(length + 1);
  CHECK(longest != NULL);
  memset(longest, 'x', length);
  longest[length] = '\0';
  uint32_t first = 9, again = 9, prefix = 9;
  CHECK_OK(refit_table_add_tensor(table, longest, 1, 4, shape, 1, &first));
  CHECK_OK(refit_table_add_tensor(table, longest, 1, 4, shape, 1, &again));
  longest[length - 1] = '\0';
  CHECK_OK(refit_table_add_tensor(table, longest, 1, 4, shape, 1, &prefix));
  CHECK(first == 0 && again == 0 && prefix == 1);
  /* UTF-8 beyond ASCII is a name like any other. */
  uint32_t greek = 9;
  CHECK_OK(refit_table_add_tensor(table, "\xce\xb1\xce\xb2", 1, 4, shape, 1, &greek));
  CHECK(greek == 2);
  /* The same name described another way, each field in turn. */
  const uint64_t other_shape[1] = {5}, two_dims[2] = {2, 2};
  CHECK_FAILS(refit_table_add_tensor(table, "\xce\xb1\xce\xb2", 2, 4, shape, 1, &t), REFIT_STATUS_TENSOR_MISMATCH,
              "dtype 1 in one table and 2");
  CHECK_FAILS(refit_table_add_tensor(table, "\xce\xb1\xce\xb2", 1, 8, shape, 1, &t), REFIT_STATUS_TENSOR_MISMATCH,
              "element size 4 in one table and 8");
  CHECK_FAILS(refit_table_add_tensor(table, "\xce\xb1\xce\xb2", 1, 4, other_shape, 1, &t),
              REFIT_STATUS_TENSOR_MISMATCH, "shape [4] in one table and [5]");
  CHECK_FAILS(refit_table_add_tensor(table, "\xce\xb1\xce\xb2", 1, 4, two_dims, 2, &t), REFIT_STATUS_TENSOR_MISMATCH,
              "[2, 2]");
  /* The table round-trips through its encoding with every name intact. */
  size_t size = 0, written = 0;
  CHECK_OK(refit_table_encoded_size(table, &size));
  CHECK(size > length);
  uint8_t *bytes = malloc(size);
  CHECK(bytes != NULL);
  CHECK_OK(refit_table_encode(table, bytes, size, &written));
  refit_table *decoded = NULL;
  CHECK_OK(refit_table_decode(bytes, written, &decoded));
  longest[length - 1] = 'x';
  CHECK_OK(refit_table_add_tensor(decoded, longest, 1, 4, shape, 1, &again));
  CHECK(again == 0);
  free(bytes);
  free(longest);
  refit_table_destroy(decoded);
  refit_table_destroy(table);
}

/* ---- tables that disagree ------------------------------------------------------------------- */

static void tables_that_disagree(void) {
  const uint64_t shape[1] = {4}, zero[1] = {0}, unit[1] = {1};
  const struct {
    uint32_t dtype, elem_size;
    uint64_t length;
    const char *needle;
  } variants[3] = {{2, 4, 4, "dtype"}, {1, 2, 4, "element size"}, {1, 4, 5, "shape"}};
  for (int v = 0; v < 3; v++) {
    refit_table *publisher = NULL, *receiver = NULL;
    CHECK_OK(refit_table_create(&publisher));
    CHECK_OK(refit_table_create(&receiver));
    uint32_t t = 0;
    CHECK_OK(refit_table_add_tensor(publisher, "w", 1, 4, shape, 1, &t));
    CHECK_OK(refit_table_add_offer(publisher, t, 0, 0, 4096, zero, shape, NULL, 1, NULL));
    const uint64_t other_shape[1] = {variants[v].length};
    CHECK_OK(refit_table_add_tensor(receiver, "w", variants[v].dtype, variants[v].elem_size, other_shape, 1, &t));
    CHECK_OK(refit_table_add_need(receiver, t, 1, 0, 8192, zero, shape, NULL, unit, 1));
    const refit_table *both[2] = {publisher, receiver};
    refit_plan *plan = (refit_plan *)0x1;
    CHECK_FAILS(refit_plan_build(both, 2, NULL, &plan), REFIT_STATUS_TENSOR_MISMATCH, variants[v].needle);
    CHECK(strstr(refit_last_error_message(), "'w'") != NULL);
    CHECK_FAILS(refit_plan_build_share(both, 2, 1, NULL, &plan), REFIT_STATUS_TENSOR_MISMATCH, variants[v].needle);
    CHECK(plan == (refit_plan *)0x1);
    refit_table_destroy(publisher);
    refit_table_destroy(receiver);
  }
  /* The same table twice: every offer and need twice, so destinations are written twice. */
  refit_table *table = NULL;
  CHECK_OK(refit_table_create(&table));
  uint32_t t = 0;
  CHECK_OK(refit_table_add_tensor(table, "w", 1, 4, shape, 1, &t));
  CHECK_OK(refit_table_add_offer(table, t, 0, 0, 4096, zero, shape, NULL, 1, NULL));
  CHECK_OK(refit_table_add_need(table, t, 1, 0, 8192, zero, shape, NULL, unit, 1));
  const refit_table *twice[2] = {table, table};
  refit_plan *plan = NULL;
  CHECK_FAILS(refit_plan_build(twice, 2, NULL, &plan), REFIT_STATUS_OVERLAP, "written by");
  /* A need whose strides write one element over another. */
  const uint64_t flat[1] = {0};
  CHECK_OK(refit_table_add_need(table, t, 2, 0, 8192, zero, shape, NULL, flat, 1));
  const refit_table *once[1] = {table};
  CHECK_FAILS(refit_plan_build(once, 1, NULL, &plan), REFIT_STATUS_OVERLAP, "process 2 device 0");
  CHECK(plan == NULL);
  refit_table_destroy(table);
}

/* ---- executors: calls in the wrong order ----------------------------------------------------- */

struct from_callback {
  refit_executor *executor;
  refit_group *group;
  refit_status run[2], commit[2];
  int named[2]; /* the run's message says why */
};

static int32_t step_from_callback(uint32_t rank, void *stream, void *user_data) {
  struct from_callback *call = (struct from_callback *)user_data;
  (void)stream;
  call->run[rank] = refit_executor_run(call->executor, call->group, NULL);
  /* Both ranks call at once: one may find the executor held by the other's call, and be refused
   * for that (also INVALID_STATE) before reaching the callback's own refusal. */
  const char *message = refit_last_error_message();
  call->named[rank] = strstr(message, "rank callback") != NULL || strstr(message, "in use") != NULL;
  call->commit[rank] = refit_executor_commit(call->executor, call->group, NULL);
  return 0;
}

/* Destroys the group from inside its own run: refused (the run holds it, and the rank threads would
 * wait for themselves). */
static int32_t destroy_from_callback(uint32_t rank, void *stream, void *user_data) {
  (void)stream;
  refit_group_destroy((refit_group *)user_data);
  return strstr(refit_last_error_message(), "in use by a call in progress") != NULL ? 0 : (int32_t)(100 + rank);
}

static void executor_call_order(void) {
  static uint32_t src[16], dst[16];
  for (int i = 0; i < 16; i++) src[i] = (uint32_t)(1000 + i);
  refit_plan *plan = copy_plan(src, dst, 16, 1);
  refit_group *group = host_group(2), *other = host_group(2);
  refit_executor_options options;
  CHECK_OK(refit_executor_options_init(&options));
  options.commit = REFIT_COMMIT_STAGED;
  options.verify = true;
  refit_executor *staged = NULL;
  CHECK_OK(refit_executor_create(plan, group, 0, &options, &staged));
  refit_run_stats stats;
  stats.size = sizeof stats;
  CHECK_FAILS(refit_executor_stats(staged, &stats), REFIT_STATUS_INVALID_STATE, "no run");
  CHECK_FAILS(refit_executor_commit(staged, group, NULL), REFIT_STATUS_INVALID_STATE, "nothing is staged");
  /* Another group of the same shape is still another group: nothing runs. */
  CHECK_FAILS(refit_executor_run(staged, other, NULL), REFIT_STATUS_INVALID_ARGUMENT, "another group");
  CHECK_FAILS(refit_executor_commit(staged, other, NULL), REFIT_STATUS_INVALID_ARGUMENT, "another group");
  /* Run twice: the second replaces the first; one commit installs it, a second finds nothing. */
  CHECK_OK(refit_executor_run(staged, group, NULL));
  src[0] = 4242;
  CHECK_OK(refit_executor_run(staged, group, NULL));
  CHECK(dst[0] == 0);
  CHECK_OK(refit_executor_commit(staged, group, &stats));
  CHECK(dst[0] == 4242 && memcmp(src, dst, sizeof src) == 0 && stats.verified);
  CHECK_FAILS(refit_executor_commit(staged, group, NULL), REFIT_STATUS_INVALID_STATE, "nothing is staged");
  /* A commit inside a scope, after a run outside it, and the reverse. */
  memset(dst, 0, sizeof dst);
  CHECK_OK(refit_executor_run(staged, group, NULL));
  CHECK_OK(refit_group_enter(group, NULL));
  CHECK_OK(refit_executor_commit(staged, group, NULL));
  CHECK_OK(refit_group_exit(group, REFIT_EXIT_SYNC));
  CHECK(memcmp(src, dst, sizeof src) == 0);
  memset(dst, 0, sizeof dst);
  CHECK_OK(refit_group_enter(group, NULL));
  CHECK_OK(refit_executor_run(staged, group, NULL));
  CHECK_OK(refit_group_exit(group, REFIT_EXIT_ASYNC));
  CHECK_OK(refit_executor_commit(staged, group, NULL));
  CHECK(memcmp(src, dst, sizeof src) == 0);
  /* From inside a rank callback (each rank's at once, on the group's own threads) nothing is
   * queued: every rank's call used to run the same executor concurrently. */
  static struct from_callback call;
  call.executor = staged;
  call.group = group;
  memset(dst, 0, sizeof dst);
  CHECK_OK(refit_group_run(group, step_from_callback, &call));
  for (int r = 0; r < 2; r++) {
    CHECK(call.run[r] == REFIT_STATUS_INVALID_STATE && call.named[r]);
    CHECK(call.commit[r] == REFIT_STATUS_INVALID_STATE);
  }
  /* ...nor from a callback of another group, to this executor's group. */
  CHECK_OK(refit_group_run(other, step_from_callback, &call));
  for (int r = 0; r < 2; r++) CHECK(call.run[r] == REFIT_STATUS_INVALID_STATE && call.named[r]);
  CHECK(dst[0] == 0);
  /* A group destroyed from its own callback is left alive, and still runs. */
  CHECK_OK(refit_group_run(group, destroy_from_callback, group));
  /* The refused calls changed nothing: the executor still runs and commits. */
  CHECK_OK(refit_executor_run(staged, group, NULL));
  CHECK_OK(refit_executor_commit(staged, group, NULL));
  CHECK(memcmp(src, dst, sizeof src) == 0);
  refit_executor_destroy(staged);

  /* A direct executor has nothing to commit, ever. */
  refit_executor *direct = NULL;
  CHECK_OK(refit_executor_create(plan, group, 0, NULL, &direct));
  CHECK_FAILS(refit_executor_commit(direct, group, NULL), REFIT_STATUS_INVALID_STATE, "commits directly");
  CHECK_OK(refit_executor_run(direct, group, NULL));
  CHECK_FAILS(refit_executor_commit(direct, group, NULL), REFIT_STATUS_INVALID_STATE, "commits directly");
  /* Destroyed with its group gone: allowed. */
  refit_group_destroy(group);
  refit_executor_destroy(direct);

  /* Executors for a group lacking the plan's devices, or for another process's routes. */
  refit_executor *none = (refit_executor *)0x1;
  refit_group *small = host_group(1);
  CHECK_FAILS(refit_executor_create(plan, small, 0, NULL, &none), REFIT_STATUS_NOT_FOUND, "device 1");
  CHECK(none == (refit_executor *)0x1);
  refit_group_destroy(small);
  refit_group_destroy(other);
  refit_plan_destroy(plan);
}

/* ---- rebinds ----------------------------------------------------------------------------------- */

static void rebinds(void) {
  static uint32_t src[16], a[8], b[8], c[8], d[8];
  for (int i = 0; i < 16; i++) src[i] = (uint32_t)(500 + i);
  refit_table *table = NULL;
  CHECK_OK(refit_table_create(&table));
  const uint64_t shape[1] = {16}, half[1] = {8}, zero[1] = {0}, unit[1] = {1};
  uint32_t w = 0;
  CHECK_OK(refit_table_add_tensor(table, "w", 1, 4, shape, 1, &w));
  CHECK_OK(refit_table_add_offer(table, w, 0, 0, addr(src), zero, shape, NULL, 1, NULL));
  CHECK_OK(refit_table_add_need(table, w, 0, 0, addr(a), zero, half, NULL, unit, 1));
  CHECK_OK(refit_table_add_need(table, w, 0, 0, addr(b), half, half, NULL, unit, 1));
  refit_plan_options plan_options;
  CHECK_OK(refit_plan_options_init(&plan_options));
  plan_options.coalesce = 0; /* every buffer in segments of its own */
  const refit_table *tables[1] = {table};
  refit_plan *plan = NULL;
  CHECK_OK(refit_plan_build(tables, 1, &plan_options, &plan));
  refit_group *group = host_group(1);
  refit_executor *executor = NULL;
  CHECK_OK(refit_executor_create(plan, group, 0, NULL, &executor));
  CHECK_OK(refit_executor_run(executor, group, NULL));
  CHECK(memcmp(a, src, sizeof a) == 0 && memcmp(b, src + 8, sizeof b) == 0);

  /* Ranges that overflow, are empty, name no device of the group, or hold nothing of the plan. */
  CHECK_FAILS(refit_executor_rebind(executor, 0, UINT64_MAX - 8, addr(c), 32), REFIT_STATUS_INVALID_ARGUMENT,
              "past 2^64");
  CHECK_FAILS(refit_executor_rebind(executor, 0, addr(a), addr(c), UINT64_MAX), REFIT_STATUS_INVALID_ARGUMENT,
              "past 2^64");
  CHECK_FAILS(refit_executor_rebind(executor, 0, addr(a), addr(c), 0), REFIT_STATUS_INVALID_ARGUMENT, "length");
  CHECK_FAILS(refit_executor_rebind(executor, UINT32_MAX, addr(a), addr(c), sizeof a), REFIT_STATUS_INVALID_DEVICE,
              "device 4294967295");
  CHECK_FAILS(refit_executor_rebind(executor, 1, addr(a), addr(c), sizeof a), REFIT_STATUS_INVALID_DEVICE,
              "device 1");
  CHECK_FAILS(refit_executor_rebind(executor, 0, addr(c), addr(d), sizeof c), REFIT_STATUS_NOT_FOUND,
              "nothing to rebind");
  CHECK_FAILS(refit_executor_rebind(executor, 0, addr(a) + 4, addr(c), 8), REFIT_STATUS_PLAN_STALE, "new plan");

  /* A moves where B is and B stays: the next run, and every run after it, refuses to write both
   * into one place (the second run once wrote both buffers' bytes into B). */
  CHECK_OK(refit_executor_rebind(executor, 0, addr(a), addr(b), sizeof a));
  memset(b, 0, sizeof b);
  CHECK_FAILS(refit_executor_run(executor, group, NULL), REFIT_STATUS_PLAN_STALE, "overlap");
  CHECK_FAILS(refit_executor_run(executor, group, NULL), REFIT_STATUS_PLAN_STALE, "overlap");
  refit_run_stats stats;
  stats.size = sizeof stats;
  CHECK_FAILS(refit_executor_run(executor, group, &stats), REFIT_STATUS_PLAN_STALE, "overlap");
  for (int i = 0; i < 8; i++) CHECK(b[i] == 0);
  refit_executor_destroy(executor);

  /* A buffer moved by less than its length (the new place overlaps the old) is a move like any
   * other; then buffers trade places through a third address. */
  CHECK_OK(refit_executor_create(plan, group, 0, NULL, &executor));
  static uint32_t wide[12];
  memset(c, 0, sizeof c);
  CHECK_OK(refit_executor_rebind(executor, 0, addr(a), addr(wide), sizeof a));
  CHECK_OK(refit_executor_run(executor, group, NULL));
  CHECK_OK(refit_executor_rebind(executor, 0, addr(wide), addr(wide + 2), sizeof a));
  memset(wide, 0, sizeof wide);
  CHECK_OK(refit_executor_run(executor, group, NULL));
  CHECK(wide[0] == 0 && wide[1] == 0 && memcmp(wide + 2, src, sizeof a) == 0 && wide[10] == 0);
  CHECK_OK(refit_executor_rebind(executor, 0, addr(wide + 2), addr(c), sizeof a));
  CHECK_OK(refit_executor_rebind(executor, 0, addr(b), addr(wide + 2), sizeof b));
  CHECK_OK(refit_executor_rebind(executor, 0, addr(c), addr(b), sizeof a));
  memset(b, 0, sizeof b);
  memset(wide, 0, sizeof wide);
  CHECK_OK(refit_executor_run(executor, group, NULL));
  CHECK(memcmp(b, src, sizeof b) == 0 && memcmp(wide + 2, src + 8, sizeof b) == 0);
  refit_executor_destroy(executor);

  refit_group_destroy(group);
  refit_plan_destroy(plan);
  refit_table_destroy(table);
}

/* ---- a prepared batch after its group ------------------------------------------------------- */

static void batch_outlives_its_group(void) {
  static uint8_t from[32], to[32];
  for (int i = 0; i < 32; i++) from[i] = (uint8_t)(i + 1);
  refit_group *group = host_group(2);
  refit_segment segment = check_contiguous(from, to, sizeof from);
  refit_prepared_copy *batch = NULL;
  CHECK_OK(refit_copy_batch_prepare(group, 1, &segment, 1, REFIT_COPY_CHECKED, &batch));
  refit_group_destroy(group);
  /* The simulated device went with the group: NULL names no stream any more, and says so. */
  CHECK_FAILS(refit_copy_batch_launch(batch, NULL), REFIT_STATUS_INVALID_ARGUMENT, "stream is NULL");
  CHECK(to[0] == 0);
  void *stream = NULL;
  CHECK_OK(refit_host_stream_create(&stream));
  CHECK_OK(refit_copy_batch_launch(batch, stream));
  CHECK(memcmp(from, to, sizeof from) == 0);
  CHECK_OK(refit_host_stream_destroy(stream));
  CHECK_FAILS(refit_copy_batch_launch(batch, stream), REFIT_STATUS_INVALID_ARGUMENT, "not a host stream");
  refit_copy_batch_destroy(batch);
}

/* ---- communicators larger than a machine ----------------------------------------------------- */

static void communicator_sizes(void) {
  refit_comm_options options;
  CHECK_OK(refit_comm_options_init(&options));
  options.timeout_ms = 1;
  refit_comm_id id;
  CHECK_OK(refit_comm_get_unique_id(REFIT_BACKEND_HOST, &id));
  refit_comm *comm = (refit_comm *)0x1;
  CHECK_FAILS(refit_comm_create(&id, UINT32_MAX, 0, 0, &options, &comm), REFIT_STATUS_INVALID_ARGUMENT,
              "nranks 4294967295");
  /* Every rank of a host communicator holds a connection to every other: more ranks than this
   * process may open files is refused at once (it once tried to allocate for 2^31 ranks and
   * aborted the process when that failed). */
  CHECK_FAILS(refit_comm_create(&id, INT32_MAX, 0, 0, &options, &comm), REFIT_STATUS_INVALID_ARGUMENT,
              "nranks 2147483647");
  CHECK_FAILS(refit_comm_create(&id, INT32_MAX, INT32_MAX - 1, 0, &options, &comm), REFIT_STATUS_INVALID_ARGUMENT,
              "nranks 2147483647");
  /* Ranks that never come: TIMEOUT naming some of them, in a message of bounded length. Long enough
   * for the id's root (a thread of this process) to answer on a loaded machine: with 1 ms the
   * TIMEOUT may be the root's answer not arriving instead. */
  options.timeout_ms = 500;
  CHECK_FAILS(refit_comm_create(&id, 200, 0, 0, &options, &comm), REFIT_STATUS_TIMEOUT, "did not join");
  CHECK(strlen(refit_last_error_message()) < 1024);
  CHECK(strstr(refit_last_error_message(), "199 ranks") != NULL);
  CHECK(comm == (refit_comm *)0x1);
  /* The id is not used up by the failures. */
  CHECK_OK(refit_comm_create(&id, 1, 0, INT32_MAX, NULL, &comm));
  int32_t device = 0;
  CHECK_OK(refit_comm_device(comm, &device));
  CHECK(device == INT32_MAX);
  refit_comm_destroy(comm);
}

/* ---- threads --------------------------------------------------------------------------------- */

#define THREADS 4

struct worker {
  uint32_t index;
  uint32_t src[64], dst[64];
  int ok;
};

/* Each thread builds, runs and destroys its own table, plan, group and executor, and fails its own
 * calls: the other threads' calls and messages do not leak into its own. */
static void *work(void *argument) {
  struct worker *w = (struct worker *)argument;
  w->ok = 0;
  for (int i = 0; i < 64; i++) w->src[i] = w->index * 1000 + (uint32_t)i;
  for (int round = 0; round < 3; round++) {
    char expected[64];
    snprintf(expected, sizeof expected, "tensor index %u but", 1000 + w->index);
    refit_table *table = NULL;
    if (refit_table_create(&table) != REFIT_STATUS_SUCCESS) return NULL;
    const uint64_t shape[1] = {64}, zero[1] = {0}, unit[1] = {1};
    uint32_t t = 0;
    int fine = refit_table_add_tensor(table, "w", 1, 4, shape, 1, &t) == REFIT_STATUS_SUCCESS &&
               refit_table_add_offer(table, t, 0, 0, addr(w->src), zero, shape, NULL, 1, NULL) == REFIT_STATUS_SUCCESS &&
               refit_table_add_need(table, t, 0, 0, addr(w->dst), zero, shape, NULL, unit, 1) == REFIT_STATUS_SUCCESS;
    fine = fine && refit_table_add_offer(table, 1000 + w->index, 0, 0, 64, zero, shape, NULL, 1, NULL) ==
                       REFIT_STATUS_INVALID_ARGUMENT;
    fine = fine && strstr(refit_last_error_message(), expected) != NULL;
    const refit_table *tables[1] = {table};
    refit_plan *plan = NULL;
    fine = fine && refit_plan_build(tables, 1, NULL, &plan) == REFIT_STATUS_SUCCESS;
    refit_group_options options;
    refit_group *group = NULL;
    const int32_t device0 = 0;
    fine = fine && refit_group_options_init(&options) == REFIT_STATUS_SUCCESS;
    options.backend = REFIT_BACKEND_HOST;
    fine = fine && refit_group_create(&device0, 1, &options, &group) == REFIT_STATUS_SUCCESS;
    refit_executor *executor = NULL;
    fine = fine && refit_executor_create(plan, group, 0, NULL, &executor) == REFIT_STATUS_SUCCESS;
    memset(w->dst, 0, sizeof w->dst);
    fine = fine && refit_executor_run(executor, group, NULL) == REFIT_STATUS_SUCCESS;
    fine = fine && memcmp(w->src, w->dst, sizeof w->src) == 0;
    fine = fine && strstr(refit_last_error_message(), expected) != NULL;
    refit_executor_destroy(executor);
    refit_group_destroy(group);
    refit_plan_destroy(plan);
    refit_table_destroy(table);
    if (!fine) return NULL;
  }
  w->ok = 1;
  return NULL;
}

static void threads_on_distinct_handles(void) {
  static struct worker workers[THREADS];
  pthread_t threads[THREADS];
  for (uint32_t i = 0; i < THREADS; i++) {
    workers[i].index = i;
    CHECK(pthread_create(&threads[i], NULL, work, &workers[i]) == 0);
  }
  for (int i = 0; i < THREADS; i++) CHECK(pthread_join(threads[i], NULL) == 0);
  for (int i = 0; i < THREADS; i++) CHECK(workers[i].ok);
}

/* ---- a group another thread is driving --------------------------------------------------------- */

struct intruder {
  refit_group *group;
  refit_executor *executor;
  atomic_int inside, done;
  refit_status enter, run, allgather, step;
  int named;
};

/* Rank 0's callback holds the group's run open until the intruding thread has made its calls. */
static int32_t hold_run_open(uint32_t rank, void *stream, void *user_data) {
  struct intruder *in = (struct intruder *)user_data;
  (void)stream;
  if (rank != 0) return 0;
  atomic_store(&in->inside, 1);
  while (!atomic_load(&in->done)) sched_yield();
  return 0;
}

static int32_t nothing(uint32_t rank, void *stream, void *user_data) {
  (void)rank, (void)stream, (void)user_data;
  return 0;
}

/* Whole-group calls from a thread that is not driving the group, while its run is in progress. */
static void *intrude(void *argument) {
  struct intruder *in = (struct intruder *)argument;
  while (!atomic_load(&in->inside)) sched_yield();
  in->enter = refit_group_enter(in->group, NULL);
  in->named = strstr(refit_last_error_message(), "another thread") != NULL;
  in->run = refit_group_run(in->group, nothing, NULL);
  uint64_t bytes[2] = {0, 0};
  const uint64_t send[2] = {addr(&bytes[0]), addr(&bytes[1])}, recv[2] = {addr(&bytes[0]), addr(&bytes[1])};
  const size_t counts[2] = {0, 0};
  uint32_t picked = 0;
  in->allgather = refit_allgather(in->group, send, recv, counts, REFIT_ALLGATHER_AUTO, &picked);
  in->step = refit_executor_run(in->executor, in->group, NULL);
  atomic_store(&in->done, 1);
  return NULL;
}

static void a_group_driven_by_another_thread(void) {
  static uint32_t src[16], dst[16];
  for (int i = 0; i < 16; i++) src[i] = (uint32_t)(7 * i + 1);
  refit_plan *plan = copy_plan(src, dst, 16, 1);
  static struct intruder in;
  in.group = host_group(2);
  CHECK_OK(refit_executor_create(plan, in.group, 0, NULL, &in.executor));
  pthread_t thread;
  CHECK(pthread_create(&thread, NULL, intrude, &in) == 0);
  CHECK_OK(refit_group_run(in.group, hold_run_open, &in));
  CHECK(pthread_join(thread, NULL) == 0);
  CHECK(in.enter == REFIT_STATUS_INVALID_STATE && in.named);
  CHECK(in.run == REFIT_STATUS_INVALID_STATE);
  CHECK(in.allgather == REFIT_STATUS_INVALID_STATE);
  CHECK(in.step == REFIT_STATUS_INVALID_STATE);
  /* Refused calls changed nothing: no scope was left open, and the driving thread's step runs. */
  CHECK(dst[0] == 0);
  CHECK_FAILS(refit_group_exit(in.group, REFIT_EXIT_SYNC), REFIT_STATUS_INVALID_STATE, "no scope is open");
  CHECK_OK(refit_executor_run(in.executor, in.group, NULL));
  CHECK(memcmp(src, dst, sizeof src) == 0);
  refit_executor_destroy(in.executor);
  refit_group_destroy(in.group);
  refit_plan_destroy(plan);
}

/* ---- handles that are not live ---------------------------------------------------------------- */

static void stale_foreign_and_made_up_handles(void) {
  static uint32_t src[8], dst[8];
  for (int i = 0; i < 8; i++) src[i] = (uint32_t)(70 + i);
  refit_group *group = host_group(2);
  refit_plan *plan = copy_plan(src, dst, 8, 1);
  refit_table *table = NULL;
  CHECK_OK(refit_table_create(&table));
  refit_executor *executor = NULL;
  CHECK_OK(refit_executor_create(plan, group, 0, NULL, &executor));
  refit_segment segment = check_contiguous(src, dst, sizeof src);
  refit_prepared_copy *batch = NULL;
  CHECK_OK(refit_copy_batch_prepare(group, 1, &segment, 1, 0, &batch));
  refit_comm *comm = host_comm();

  /* A handle cast to another handle type: refused by calls and by destroy, which releases nothing. */
  size_t count = 0;
  uint32_t rank = 9;
  CHECK_FAILS(refit_plan_route_count((const refit_plan *)table, &count), REFIT_STATUS_INVALID_ARGUMENT,
              "plan is a refit_table, not a refit_plan");
  CHECK_FAILS(refit_group_size((const refit_group *)plan, &count), REFIT_STATUS_INVALID_ARGUMENT,
              "group is a refit_plan, not a refit_group");
  CHECK_FAILS(refit_executor_run((refit_executor *)group, group, NULL), REFIT_STATUS_INVALID_ARGUMENT,
              "executor is a refit_group, not a refit_executor");
  CHECK_FAILS(refit_executor_run(executor, (refit_group *)executor, NULL), REFIT_STATUS_INVALID_ARGUMENT,
              "group is a refit_executor, not a refit_group");
  CHECK_FAILS(refit_comm_rank((const refit_comm *)batch, &rank), REFIT_STATUS_INVALID_ARGUMENT,
              "is a refit_prepared_copy, not a refit_comm");
  const refit_table *wrong_tables[1] = {(const refit_table *)plan};
  refit_plan *none = (refit_plan *)0x1;
  CHECK_FAILS(refit_plan_build(wrong_tables, 1, NULL, &none), REFIT_STATUS_INVALID_ARGUMENT,
              "tables[0] is a refit_plan, not a refit_table");
  CHECK_FAILS(refit_plan_build_across(comm, (const refit_table *)comm, NULL, &none), REFIT_STATUS_INVALID_ARGUMENT,
              "table is a refit_comm, not a refit_table");
  CHECK(none == (refit_plan *)0x1 && count == 0 && rank == 9);
  refit_plan_destroy((refit_plan *)table);
  CHECK(strstr(refit_last_error_message(), "is a refit_table, not a refit_plan; nothing was released") != NULL);
  refit_group_destroy((refit_group *)comm);
  CHECK(strstr(refit_last_error_message(), "is a refit_comm, not a refit_group") != NULL);
  /* ...and every handle still works. */
  CHECK_OK(refit_table_encoded_size(table, &count));
  CHECK_OK(refit_comm_rank(comm, &rank));
  CHECK(rank == 0);
  CHECK_OK(refit_executor_run(executor, group, NULL));
  CHECK(memcmp(src, dst, sizeof src) == 0);

  /* Values refit never returned: small numbers, the address of caller memory, all ones. */
  int caller_memory = 0;
  void *made_up[3] = {(void *)0x10, &caller_memory, (void *)UINTPTR_MAX};
  for (int i = 0; i < 3; i++) {
    CHECK_FAILS(refit_group_size((const refit_group *)made_up[i], &count), REFIT_STATUS_INVALID_ARGUMENT,
                "is not a live refit_group");
    CHECK_FAILS(refit_executor_stats((refit_executor *)made_up[i], NULL), REFIT_STATUS_INVALID_ARGUMENT,
                "is not a live refit_executor");
    refit_table_destroy((refit_table *)made_up[i]);
    CHECK(strstr(refit_last_error_message(), "is not a live refit_table") != NULL);
  }
  CHECK(caller_memory == 0);

  /* Used after destroy, and destroyed twice: refused every time, whatever was created since (a
   * handle is never reused, so the old value cannot name a new object). */
  refit_copy_batch_destroy(batch);
  refit_comm_destroy(comm);
  refit_executor_destroy(executor);
  refit_plan_destroy(plan);
  refit_table_destroy(table);
  refit_group_destroy(group);
  refit_table *fresh_table = NULL;
  CHECK_OK(refit_table_create(&fresh_table));
  refit_group *fresh_group = host_group(2);
  CHECK(fresh_table != table && fresh_group != group);
  CHECK_FAILS(refit_table_encoded_size(table, &count), REFIT_STATUS_INVALID_ARGUMENT,
              "table (0x");
  CHECK(strstr(refit_last_error_message(), "is not a live refit_table: destroyed already") != NULL);
  CHECK_FAILS(refit_plan_route_count(plan, &count), REFIT_STATUS_INVALID_ARGUMENT, "not a live refit_plan");
  CHECK_FAILS(refit_group_size(group, &count), REFIT_STATUS_INVALID_ARGUMENT, "not a live refit_group");
  CHECK_FAILS(refit_executor_run(executor, fresh_group, NULL), REFIT_STATUS_INVALID_ARGUMENT,
              "not a live refit_executor");
  CHECK_FAILS(refit_copy_batch_launch(batch, NULL), REFIT_STATUS_INVALID_ARGUMENT, "not a live refit_prepared_copy");
  CHECK_FAILS(refit_comm_rank(comm, &rank), REFIT_STATUS_INVALID_ARGUMENT, "not a live refit_comm");
  refit_executor_destroy(executor);
  CHECK(strstr(refit_last_error_message(), "destroyed already, or never returned by refit; nothing was released") != NULL);
  refit_group_destroy(group);
  refit_comm_destroy(comm);
  refit_copy_batch_destroy(batch);
  refit_plan_destroy(plan);
  refit_table_destroy(table);
  CHECK(strstr(refit_last_error_message(), "is not a live refit_table") != NULL);
  /* The new handles were untouched by all of it. */
  CHECK_OK(refit_group_size(fresh_group, &count));
  CHECK(count == 2);
  CHECK_OK(refit_table_encoded_size(fresh_table, &count));
  refit_table_destroy(fresh_table);
  refit_group_destroy(fresh_group);
}

/* Destroys the group passed as user data from a rank callback of another group (rank 0 only). */
static int32_t destroy_other_group(uint32_t rank, void *stream, void *user_data) {
  (void)stream;
  if (rank == 0) refit_group_destroy((refit_group *)user_data);
  return 0;
}

static void a_group_destroyed_from_another_groups_callback(void) {
  /* Only a call in progress on a group holds it: from another group's callback it goes at once. */
  refit_group *runner = host_group(2), *doomed = host_group(2);
  size_t size = 0;
  CHECK_OK(refit_group_run(doomed, destroy_other_group, NULL)); /* its threads have started */
  CHECK_OK(refit_group_run(runner, destroy_other_group, doomed));
  CHECK_FAILS(refit_group_size(doomed, &size), REFIT_STATUS_INVALID_ARGUMENT, "not a live refit_group");
  CHECK_OK(refit_group_size(runner, &size));
  CHECK(size == 2);
  refit_group_destroy(runner);
}

/* A simulated device's stream serves only that device, as a CUDA stream serves only its context;
 * a caller's host stream serves any. */
static void a_stream_of_another_device(void) {
  static uint8_t from[16], to[16];
  memset(from, 5, sizeof from);
  refit_group *group = host_group(2);
  void *of_rank0 = NULL, *mine = NULL;
  CHECK_OK(refit_group_stream(group, 0, &of_rank0));
  CHECK_OK(refit_host_stream_create(&mine));
  refit_segment segment = check_contiguous(from, to, sizeof from);
  CHECK_FAILS(refit_copy_batch(group, 1, of_rank0, &segment, 1, 0), REFIT_STATUS_INVALID_ARGUMENT,
              "a stream of simulated device 0, and this work is on device 1");
  uint64_t digest = 0;
  CHECK_FAILS(refit_digest(group, 1, addr(from), sizeof from, of_rank0, &digest), REFIT_STATUS_INVALID_ARGUMENT,
              "simulated device 0");
  CHECK(to[0] == 0 && digest == 0);
  /* A segment that repeats its destination (2^61 copies of the same 4 bytes) is refused at once,
   * checked or not, instead of being run. */
  refit_segment repeated = check_contiguous(from, to, 4);
  repeated.count[1] = (uint64_t)1 << 61;
  for (uint32_t flags = 0; flags <= REFIT_COPY_CHECKED; flags++)
    CHECK_FAILS(refit_copy_batch(group, 0, NULL, &repeated, 1, flags), REFIT_STATUS_OVERLAP,
                "writes its destination bytes more than once");
  CHECK(to[0] == 0);
  CHECK_OK(refit_copy_batch(group, 0, of_rank0, &segment, 1, 0));
  CHECK(memcmp(from, to, sizeof from) == 0);
  memset(to, 0, sizeof to);
  CHECK_OK(refit_copy_batch(group, 1, mine, &segment, 1, 0));
  CHECK(memcmp(from, to, sizeof from) == 0);
  CHECK_OK(refit_host_stream_destroy(mine));
  refit_group_destroy(group);
}

/* ---- addresses that are no memory of the caller ------------------------------------------------ */

/* Every call that reads or writes caller memory on the host backend, given an address of memory
 * unmapped since (a freed buffer), of a guard page, or of read-only memory to write: each is
 * INVALID_ARGUMENT naming the argument and why, and nothing faults. The same calls over the
 * caller's own memory then succeed. */
static void memory_that_is_not_the_callers(void) {
  const size_t page = 4096;
  unsigned char *pages = mmap(NULL, 3 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(pages != MAP_FAILED);
  memset(pages, 0x3f, 3 * page); /* bf16 0x3f3f, about 0.75, for the quantizing copy */
  CHECK(mprotect(pages + page, page, PROT_NONE) == 0);
  CHECK(mprotect(pages + 2 * page, page, PROT_READ) == 0);
  const uint64_t guard = addr(pages + page), read_only = addr(pages + 2 * page);
  unsigned char *freed = mmap(NULL, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(freed != MAP_FAILED);
  CHECK(munmap(freed, page) == 0);
  const uint64_t gone = addr(freed);
  static uint32_t mine[64], other[64];
  refit_group *group = host_group(1);

  /* One copy per bad side; a run that starts in good memory and runs into the guard page. */
  refit_segment copy = {.src = gone, .dst = addr(other), .len = 16, .count = {1, 1}};
  CHECK_FAILS(refit_copy_batch(group, 0, NULL, &copy, 1, 0), REFIT_STATUS_INVALID_ARGUMENT, "is not mapped");
  copy.src = guard - 8;
  CHECK_FAILS(refit_copy_batch(group, 0, NULL, &copy, 1, 0), REFIT_STATUS_INVALID_ARGUMENT,
              "without read permission");
  copy.src = addr(mine);
  copy.dst = read_only;
  CHECK_FAILS(refit_copy_batch(group, 0, NULL, &copy, 1, 0), REFIT_STATUS_INVALID_ARGUMENT, "read-only");
  refit_prepared_copy *prepared = NULL;
  CHECK_FAILS(refit_copy_batch_prepare(group, 0, &copy, 1, 0, &prepared), REFIT_STATUS_INVALID_ARGUMENT,
              "its destination");
  CHECK(prepared == NULL);
  copy.src = read_only; /* read-only memory may be read */
  copy.dst = addr(other);
  CHECK_OK(refit_copy_batch(group, 0, NULL, &copy, 1, 0));
  CHECK(other[0] == 0x3f3f3f3fu);

  /* Digests read: unmapped and guard pages are refused, read-only memory is read. */
  uint64_t digest = 0;
  CHECK_FAILS(refit_digest(group, 0, gone, 8, NULL, &digest), REFIT_STATUS_INVALID_ARGUMENT, "the range");
  const uint64_t addrs[3] = {addr(mine), read_only, guard}, lens[3] = {8, 8, 8};
  uint64_t digests[3] = {0, 0, 0};
  CHECK_FAILS(refit_digest_many(group, 0, addrs, lens, 3, NULL, digests), REFIT_STATUS_INVALID_ARGUMENT,
              "range 2");
  CHECK(digests[0] == 0);
  CHECK_OK(refit_digest_many(group, 0, addrs, lens, 2, NULL, digests));
  CHECK_OK(refit_digest(group, 0, read_only, 8, NULL, &digest));
  CHECK(digest == digests[1]);

  /* The allgather reads its send buffer and writes its receive buffer. */
  size_t count = 16;
  uint64_t send = gone, recv = addr(other);
  CHECK_FAILS(refit_allgather(group, &send, &recv, &count, REFIT_ALLGATHER_AUTO, NULL),
              REFIT_STATUS_INVALID_ARGUMENT, "send[0]");
  send = addr(mine);
  recv = read_only;
  CHECK_FAILS(refit_allgather(group, &send, &recv, &count, REFIT_ALLGATHER_HOST, NULL),
              REFIT_STATUS_INVALID_ARGUMENT, "recv[0]");
  refit_comm *comm = host_comm();
  CHECK_FAILS(refit_comm_allgather(comm, addr(mine), guard, &count, NULL), REFIT_STATUS_INVALID_ARGUMENT,
              "recv[0]");
  CHECK_OK(refit_comm_allgather(comm, addr(mine), addr(other), &count, NULL));
  refit_comm_destroy(comm);

  /* An executor checks every address once, at creation. */
  refit_executor *executor = NULL;
  refit_plan *plan = copy_plan((const uint32_t *)(uintptr_t)gone, other, 16, 0);
  CHECK_FAILS(refit_executor_create(plan, group, 0, NULL, &executor), REFIT_STATUS_INVALID_ARGUMENT,
              "its source");
  CHECK(executor == NULL);
  refit_plan_destroy(plan);
  plan = copy_plan(mine, (uint32_t *)(uintptr_t)read_only, 16, 0);
  CHECK_FAILS(refit_executor_create(plan, group, 0, NULL, &executor), REFIT_STATUS_INVALID_ARGUMENT,
              "read-only");
  refit_plan_destroy(plan);

  /* The quantizing copy: its codes written into a guard page. */
  static uint16_t bf16[16 * 16];
  static float scale;
  refit_quantize_job job;
  memset(&job, 0, sizeof job);
  job.quantization.target = REFIT_FP8_E4M3FN;
  job.quantization.granularity = REFIT_QUANT_TENSOR;
  job.source_type = REFIT_SOURCE_BF16;
  job.src = addr(bf16);
  job.rows = 16;
  job.cols = 16;
  job.src_row_stride = 16;
  job.dst = guard;
  job.dst_row_stride = 16;
  job.scales = addr(&scale);
  CHECK_FAILS(refit_quantize_batch(group, 0, NULL, &job, 1, 0), REFIT_STATUS_INVALID_ARGUMENT,
              "without read permission");
  /* Its source may be read-only memory (it is only read); its codes may not be. */
  static uint8_t codes[16 * 16];
  job.src = read_only;
  job.dst = addr(codes);
  CHECK_OK(refit_quantize_batch(group, 0, NULL, &job, 1, 0));
  CHECK(codes[0] != 0 && scale > 0.0f);
  job.src = addr(bf16);
  job.dst = read_only;
  CHECK_FAILS(refit_quantize_batch(group, 0, NULL, &job, 1, 0), REFIT_STATUS_INVALID_ARGUMENT,
              "its destination");

  refit_group_destroy(group);
  CHECK(munmap(pages, 3 * page) == 0);
}
