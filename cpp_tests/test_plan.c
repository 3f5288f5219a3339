/* The reshard plan API from C11: tables built entry by entry and from bytes, a plan executed on host
 * memory (addresses are host pointers) and compared with the expected bytes, stats, routes,
 * fingerprints, and every bad-argument status. */
#include <stddef.h>
#include <stdint.h>

#include "check.h"

#define ROWS 4
#define COLS 8
#define HALF 4

static uint64_t addr(const void *p) { return (uint64_t)(uintptr_t)p; }

/* Runs every segment of every route with memcpy (all endpoints share this process's memory). */
static void execute(const refit_plan *plan) {
  size_t routes = 0;
  CHECK_OK(refit_plan_route_count(plan, &routes));
  for (size_t r = 0; r < routes; r++) {
    refit_route_info info;
    info.size = sizeof(info);
    CHECK_OK(refit_plan_route(plan, r, &info));
    for (size_t s = 0; s < info.segment_count; s++) {
      const refit_segment *g = &info.segments[s];
      for (uint64_t j = 0; j < g->count[1]; j++)
        for (uint64_t i = 0; i < g->count[0]; i++)
          memcpy((void *)(uintptr_t)(g->dst + j * g->dst_stride[1] + i * g->dst_stride[0]),
                 (const void *)(uintptr_t)(g->src + j * g->src_stride[1] + i * g->src_stride[0]), g->len);
    }
  }
}

static float weight[ROWS][COLS];         /* rank 0's copy */
static float replica[ROWS][COLS];        /* rank 1's copy */
static float received[2][ROWS][HALF];    /* ranks 2 and 3: the column halves (TP column split) */

/* Publisher tables (ranks 0 and 1, both the whole tensor) and one receiver table. */
static void fill_tables(refit_table *pub0, refit_table *pub1, refit_table *recv, uint64_t digest1) {
  const uint64_t shape[2] = {ROWS, COLS};
  const uint64_t zero[2] = {0, 0};
  const uint64_t digest0 = 42;
  uint32_t t = 99;
  CHECK_OK(refit_table_add_tensor(pub0, "w", 1, sizeof(float), shape, 2, &t));
  CHECK(t == 0);
  CHECK_OK(refit_table_add_offer(pub0, t, 0, 0, addr(weight), zero, shape, NULL, 2, &digest0));
  CHECK_OK(refit_table_add_tensor(pub1, "w", 1, sizeof(float), shape, 2, &t));
  CHECK_OK(refit_table_add_offer(pub1, t, 1, 0, addr(replica), zero, shape, NULL, 2, &digest1));
  /* The receiver names an unrelated tensor first, so "w" has another index in its table. */
  const uint64_t other_shape[1] = {3};
  CHECK_OK(refit_table_add_tensor(recv, "other", 1, 2, other_shape, 1, &t));
  CHECK_OK(refit_table_add_tensor(recv, "w", 1, sizeof(float), shape, 2, &t));
  CHECK(t == 1);
  const uint64_t extent[2] = {ROWS, HALF};
  const uint64_t strides[2] = {HALF, 1};
  for (uint32_t r = 0; r < 2; r++) {
    const uint64_t offset[2] = {0, r * HALF};
    CHECK_OK(refit_table_add_need(recv, t, 2 + r, 0, addr(received[r]), offset, extent, NULL, strides, 2));
  }
}

static refit_plan *build3(refit_table *a, refit_table *b, refit_table *c, uint32_t policy, refit_status expected) {
  const refit_table *tables[3] = {a, b, c};
  refit_plan_options options;
  CHECK_OK(refit_plan_options_init(&options));
  CHECK(options.size == sizeof(options) && options.policy == REFIT_POLICY_LOCAL && options.coalesce);
  options.policy = policy;
  refit_plan *plan = NULL;
  CHECK_STATUS(refit_plan_build(tables, 3, &options, &plan), expected);
  CHECK((plan != NULL) == (expected == REFIT_STATUS_SUCCESS));
  return plan;
}

static void test_plan_moves_the_right_bytes(void) {
  for (int r = 0; r < ROWS; r++)
    for (int c = 0; c < COLS; c++) weight[r][c] = replica[r][c] = (float)(r * 100 + c);
  memset(received, 0xEE, sizeof(received));
  refit_table *pub0, *pub1, *recv;
  CHECK_OK(refit_table_create(&pub0));
  CHECK_OK(refit_table_create(&pub1));
  CHECK_OK(refit_table_create(&recv));
  fill_tables(pub0, pub1, recv, 42);

  refit_plan *plan = build3(pub0, pub1, recv, REFIT_POLICY_FIRST, REFIT_STATUS_SUCCESS);
  size_t routes = 0;
  CHECK_OK(refit_plan_route_count(plan, &routes));
  CHECK(routes == 2);
  refit_route_info info;
  info.size = sizeof(info);
  CHECK_OK(refit_plan_route(plan, 0, &info));
  CHECK(info.src_rank == 0 && info.dst_rank == 2 && info.kind == REFIT_ROUTE_REMOTE);
  /* A column half of a row-major weight is one strided segment: 4 rows of 16 bytes, 32 apart. */
  CHECK(info.segment_count == 1);
  CHECK(info.segments[0].src == addr(weight) && info.segments[0].dst == addr(received[0]));
  CHECK(info.segments[0].len == HALF * sizeof(float) && info.segments[0].count[0] == ROWS);
  CHECK(info.segments[0].src_stride[0] == COLS * sizeof(float));
  CHECK(info.segments[0].dst_stride[0] == HALF * sizeof(float));
  execute(plan);
  for (int h = 0; h < 2; h++)
    for (int r = 0; r < ROWS; r++)
      for (int c = 0; c < HALF; c++) CHECK(received[h][r][c] == weight[r][h * HALF + c]);

  refit_plan_stats stats;
  stats.size = sizeof(stats);
  CHECK_OK(refit_plan_get_stats(plan, &stats));
  CHECK(stats.offers_in == 2 && stats.offers_kept == 1 && stats.replica_sets == 1);
  CHECK(stats.needs == 2 && stats.needed_bytes == sizeof(received));
  CHECK(stats.bytes_all_replicas == 2 * sizeof(received));
  CHECK(stats.duplicate_bytes_dropped == sizeof(received));
  CHECK(stats.ranges_all_replicas == 4 * ROWS && stats.ranges_deduped == 2 * ROWS);
  CHECK(stats.ranges_coalesced == 2 && stats.flat_runs_coalesced == 2 * ROWS);
  CHECK(stats.bytes_remote == sizeof(received) && stats.bytes_local == 0 && stats.bytes_peer == 0);
  CHECK(stats.size_histogram[6] == 2); /* 64-byte segments */
  CHECK(stats.routes == 2);
  CHECK_OK(refit_plan_get_receiver_stats(plan, 3, 0, &stats));
  CHECK(stats.needed_bytes == sizeof(received[1]) && stats.routes == 1);
  CHECK_OK(refit_plan_get_receiver_stats(plan, 9, 9, &stats));
  CHECK(stats.needed_bytes == 0 && stats.offers_in == 2);

    /* Each process's share: the routes from or to it, as in the whole plan; the inputs agree. */
  {
    const refit_table *all[3] = {pub0, pub1, recv};
    refit_plan_options first;
    CHECK_OK(refit_plan_options_init(&first));
    first.policy = REFIT_POLICY_FIRST;
    uint64_t whole_inputs = 0, share_inputs = 1;
    CHECK_OK(refit_plan_inputs_fingerprint(plan, &whole_inputs));
    const size_t expected_routes[4] = {2, 0, 1, 1}; /* process 0 serves both receivers */
    for (uint32_t process = 0; process < 4; process++) {
      refit_plan *share = NULL;
      CHECK_OK(refit_plan_build_share(all, 3, process, &first, &share));
      size_t count = 99;
      CHECK_OK(refit_plan_route_count(share, &count));
      CHECK(count == expected_routes[process]);
      for (size_t r = 0; r < count; r++) {
        refit_route_info mine, whole;
        mine.size = whole.size = sizeof(mine);
        CHECK_OK(refit_plan_route(share, r, &mine));
        /* The whole plan's routes are ordered by destination: receiver 2's, then 3's. */
        CHECK_OK(refit_plan_route(plan, process == 3 ? 1 : process == 2 ? 0 : r, &whole));
        CHECK(mine.src_rank == whole.src_rank && mine.dst_rank == whole.dst_rank);
        CHECK(mine.segment_count == whole.segment_count);
        CHECK(memcmp(mine.segments, whole.segments, mine.segment_count * sizeof(refit_segment)) == 0);
      }
      CHECK_OK(refit_plan_inputs_fingerprint(share, &share_inputs));
      CHECK(share_inputs == whole_inputs);
      refit_plan_destroy(share);
    }
    refit_plan *none = NULL;
    CHECK_STATUS(refit_plan_build_share(all, 3, 0, &first, NULL), REFIT_STATUS_NULL_ARGUMENT);
    CHECK_STATUS(refit_plan_build_share(NULL, 3, 0, &first, &none), REFIT_STATUS_NULL_ARGUMENT);
    first.policy = 7;
    CHECK_STATUS(refit_plan_build_share(all, 3, 0, &first, &none), REFIT_STATUS_INVALID_ARGUMENT);
    CHECK(none == NULL);
    CHECK_STATUS(refit_plan_inputs_fingerprint(plan, NULL), REFIT_STATUS_NULL_ARGUMENT);
    CHECK_STATUS(refit_plan_inputs_fingerprint(NULL, &share_inputs), REFIT_STATUS_NULL_ARGUMENT);
  }

  /* BALANCED spreads the two halves over the two replicas. */
  refit_plan *balanced = build3(pub0, pub1, recv, REFIT_POLICY_BALANCED, REFIT_STATUS_SUCCESS);
  CHECK_OK(refit_plan_get_stats(balanced, &stats));
  CHECK(stats.offers_kept == 2);

  /* Same tables in another order, and through the wire format: the same fingerprint. */
  uint64_t f1 = 0, f2 = 1, f3 = 2, f4 = 3;
  CHECK_OK(refit_plan_fingerprint(plan, &f1));
  refit_plan *reordered = build3(recv, pub1, pub0, REFIT_POLICY_FIRST, REFIT_STATUS_SUCCESS);
  CHECK_OK(refit_plan_fingerprint(reordered, &f2));
  CHECK(f1 == f2);
  CHECK_OK(refit_plan_fingerprint(balanced, &f4));
  CHECK(f4 != f1);
  size_t size = 0, written = 0;
  CHECK_OK(refit_table_encoded_size(recv, &size));
  unsigned char *bytes = malloc(size);
  CHECK_STATUS(refit_table_encode(recv, bytes, size - 1, &written), REFIT_STATUS_BUFFER_TOO_SMALL);
  CHECK(strstr(refit_last_error_message(), "bytes") != NULL);
  CHECK_OK(refit_table_encode(recv, bytes, size, &written));
  CHECK(written == size);
  refit_table *decoded = NULL;
  CHECK_OK(refit_table_decode(bytes, size, &decoded));
  refit_plan *from_wire = build3(pub0, pub1, decoded, REFIT_POLICY_FIRST, REFIT_STATUS_SUCCESS);
  CHECK_OK(refit_plan_fingerprint(from_wire, &f3));
  CHECK(f3 == f1);

  /* Hostile bytes: truncated, corrupted, another version. */
  refit_table *bad = NULL;
  CHECK_STATUS(refit_table_decode(bytes, size - 1, &bad), REFIT_STATUS_DECODE_ERROR);
  bytes[size / 2] ^= 0x40;
  CHECK_STATUS(refit_table_decode(bytes, size, &bad), REFIT_STATUS_DECODE_ERROR);
  bytes[size / 2] ^= 0x40;
  bytes[4] = 99;
  CHECK_STATUS(refit_table_decode(bytes, size, &bad), REFIT_STATUS_VERSION_MISMATCH);
  CHECK_STATUS(refit_table_decode(NULL, 0, &bad), REFIT_STATUS_DECODE_ERROR);
  CHECK_STATUS(refit_table_decode(NULL, 5, &bad), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_table_decode(bytes, size, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK(bad == NULL);
  free(bytes);

  /* Reading a plan: bad arguments. */
  CHECK_STATUS(refit_plan_route(plan, routes, &info), REFIT_STATUS_NOT_FOUND);
  info.size = 3;
  CHECK_STATUS(refit_plan_route(plan, 0, &info), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_plan_route(plan, 0, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_plan_route(NULL, 0, &info), REFIT_STATUS_NULL_ARGUMENT);
  stats.size = 0;
  CHECK_STATUS(refit_plan_get_stats(plan, &stats), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "stats.size") != NULL);
  CHECK_STATUS(refit_plan_get_stats(plan, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_plan_get_stats(NULL, &stats), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_plan_get_receiver_stats(plan, 0, 0, &stats), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "stats.size") != NULL);
  CHECK_STATUS(refit_plan_get_receiver_stats(plan, 0, 0, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_plan_get_receiver_stats(NULL, 0, 0, &stats), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_plan_fingerprint(plan, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_plan_route_count(plan, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_table_encoded_size(NULL, &size), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_table_encoded_size(recv, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_table_encode(recv, NULL, 0, &written), REFIT_STATUS_BUFFER_TOO_SMALL);
  uint8_t one_byte;
  CHECK_STATUS(refit_table_encode(NULL, &one_byte, 1, &written), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_table_encode(recv, &one_byte, 1, NULL), REFIT_STATUS_NULL_ARGUMENT);

  /* Building: bad options and table lists. */
  const refit_table *tables[3] = {pub0, pub1, recv};
  refit_plan_options options;
  refit_plan *none = NULL;
  CHECK_OK(refit_plan_options_init(&options));
  options.policy = 3;
  CHECK_STATUS(refit_plan_build(tables, 3, &options, &none), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "policy") != NULL);
  /* coalesce is a byte that must be 0 or 1 (written through the bytes, as a caller with another
   * idea of the field would). */
  CHECK_OK(refit_plan_options_init(&options));
  ((unsigned char *)&options)[offsetof(refit_plan_options, coalesce)] = 0x7f;
  CHECK_STATUS(refit_plan_build(tables, 3, &options, &none), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "coalesce") != NULL);
  ((unsigned char *)&options)[offsetof(refit_plan_options, coalesce)] = 0;
  CHECK_OK(refit_plan_build(tables, 3, &options, &none));
  refit_plan_destroy(none);
  none = NULL;
  CHECK_OK(refit_plan_options_init(&options));
  options.size = 1;
  CHECK_STATUS(refit_plan_build(tables, 3, &options, &none), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_plan_build(tables, 3, NULL, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_plan_build(NULL, 3, NULL, &none), REFIT_STATUS_NULL_ARGUMENT);
  const refit_table *with_null[2] = {pub0, NULL};
  CHECK_STATUS(refit_plan_build(with_null, 2, NULL, &none), REFIT_STATUS_NULL_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "tables[1]") != NULL);
  CHECK_STATUS(refit_plan_options_init(NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK(none == NULL);
  /* Defaults (NULL options) plan too; no needs at all is an empty plan. */
  CHECK_OK(refit_plan_build(tables, 3, NULL, &none));
  refit_plan_destroy(none);
  CHECK_OK(refit_plan_build(tables, 2, NULL, &none));
  CHECK_OK(refit_plan_route_count(none, &routes));
  CHECK(routes == 0);
  refit_plan_destroy(none);

  refit_plan_destroy(plan);
  refit_plan_destroy(balanced);
  refit_plan_destroy(reordered);
  refit_plan_destroy(from_wire);
  refit_table_destroy(decoded);
  refit_table_destroy(pub0);
  refit_table_destroy(pub1);
  refit_table_destroy(recv);
  refit_plan_destroy(NULL);
  refit_table_destroy(NULL);
}

static void test_planning_failures(void) {
  refit_table *pub0, *pub1, *recv;
  /* Replicas whose digests differ. */
  CHECK_OK(refit_table_create(&pub0));
  CHECK_OK(refit_table_create(&pub1));
  CHECK_OK(refit_table_create(&recv));
  fill_tables(pub0, pub1, recv, 43);
  CHECK(build3(pub0, pub1, recv, REFIT_POLICY_FIRST, REFIT_STATUS_REPLICA_MISMATCH) == NULL);
  CHECK(strstr(refit_last_error_message(), "'w'") != NULL);
  /* A receiver table asking for rows nobody offers: COVERAGE_GAP naming the region. */
  const uint64_t shape[2] = {ROWS, COLS};
  const uint64_t tall[2] = {ROWS + 2, COLS};
  const uint64_t zero[2] = {0, 0};
  const uint64_t rows[2] = {2, COLS};
  const uint64_t strides[2] = {COLS, 1};
  uint32_t t;
  refit_table *gap;
  CHECK_OK(refit_table_create(&gap));
  CHECK_OK(refit_table_add_tensor(gap, "v", 1, 4, tall, 2, &t));
  CHECK_OK(refit_table_add_offer(gap, t, 0, 0, addr(weight), zero, rows, NULL, 2, NULL));
  CHECK_OK(refit_table_add_need(gap, t, 1, 0, addr(received), zero, shape, NULL, strides, 2));
  const refit_table *one[1] = {gap};
  refit_plan *none = NULL;
  CHECK_STATUS(refit_plan_build(one, 1, NULL, &none), REFIT_STATUS_COVERAGE_GAP);
  CHECK(strstr(refit_last_error_message(), "offset [2, 0] extent [2, 8]") != NULL);
  CHECK_STATUS(refit_table_add_offer(gap, t, 0, 0, addr(weight), tall, rows, NULL, 2, NULL),
               REFIT_STATUS_TENSOR_MISMATCH);
  const uint64_t lower[2] = {2, 0};
  CHECK_OK(refit_table_add_offer(gap, t, 0, 0, addr(replica), lower, rows, NULL, 2, NULL));
  CHECK_OK(refit_plan_build(one, 1, NULL, &none));
  refit_plan_destroy(none);
  none = NULL;
  /* Two needs writing the same bytes. */
  CHECK_OK(refit_table_add_need(gap, t, 1, 0, addr(received) + 16, zero, rows, NULL, strides, 2));
  CHECK_STATUS(refit_plan_build(one, 1, NULL, &none), REFIT_STATUS_OVERLAP);
  /* A tensor described two ways across tables. */
  refit_table *other;
  CHECK_OK(refit_table_create(&other));
  CHECK_OK(refit_table_add_tensor(other, "v", 1, 2, tall, 2, &t));
  const refit_table *two[2] = {gap, other};
  CHECK_STATUS(refit_plan_build(two, 2, NULL, &none), REFIT_STATUS_TENSOR_MISMATCH);
  CHECK(strstr(refit_last_error_message(), "element size 4") != NULL);
  CHECK(strstr(refit_last_error_message(), "2") != NULL);
  CHECK(none == NULL);
  refit_table_destroy(other);
  refit_table_destroy(gap);
  refit_table_destroy(pub0);
  refit_table_destroy(pub1);
  refit_table_destroy(recv);
}

static void test_table_bad_arguments(void) {
  refit_table *table;
  CHECK_STATUS(refit_table_create(NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_OK(refit_table_create(&table));
  const uint64_t shape[2] = {ROWS, COLS};
  const uint64_t other[2] = {ROWS, COLS + 1};
  const uint64_t zero[2] = {0, 0};
  const uint64_t big[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  const uint64_t strides[2] = {COLS, 1};
  const uint32_t perm_bad[2] = {0, 0};
  const uint32_t perm_swap[2] = {1, 0};
  uint32_t t = 7;
  CHECK_STATUS(refit_table_add_tensor(NULL, "w", 1, 4, shape, 2, &t), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_table_add_tensor(table, NULL, 1, 4, shape, 2, &t), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_table_add_tensor(table, "w", 1, 4, NULL, 2, &t), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_table_add_tensor(table, "w", 1, 4, shape, 2, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_table_add_tensor(table, "", 1, 4, shape, 2, &t), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_table_add_tensor(table, "w", 1, 0, shape, 2, &t), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_table_add_tensor(table, "w", 1, 4, big, 9, &t), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_table_add_tensor(table, "\xff", 1, 4, shape, 2, &t), REFIT_STATUS_INVALID_ARGUMENT);
  const uint64_t huge[2] = {UINT64_MAX / 2, 3};
  CHECK_STATUS(refit_table_add_tensor(table, "w", 1, 4, huge, 2, &t), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(t == 7);
  CHECK_OK(refit_table_add_tensor(table, "w", 1, 4, shape, 2, &t));
  CHECK_OK(refit_table_add_tensor(table, "w", 1, 4, shape, 2, &t));
  CHECK(t == 0);
  CHECK_STATUS(refit_table_add_tensor(table, "w", 1, 4, other, 2, &t), REFIT_STATUS_TENSOR_MISMATCH);
  CHECK(strstr(refit_last_error_message(), "[4, 8]") != NULL && strstr(refit_last_error_message(), "[4, 9]") != NULL);
  CHECK_STATUS(refit_table_add_tensor(table, "w", 2, 4, shape, 2, &t), REFIT_STATUS_TENSOR_MISMATCH);

  CHECK_STATUS(refit_table_add_offer(NULL, 0, 0, 0, 64, zero, shape, NULL, 2, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_table_add_offer(table, 1, 0, 0, 64, zero, shape, NULL, 2, NULL), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_table_add_offer(table, 0, 0, 0, 64, NULL, shape, NULL, 2, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_table_add_offer(table, 0, 0, 0, 64, zero, shape, NULL, 1, NULL), REFIT_STATUS_TENSOR_MISMATCH);
  CHECK_STATUS(refit_table_add_offer(table, 0, 0, 0, 64, zero, other, NULL, 2, NULL), REFIT_STATUS_TENSOR_MISMATCH);
  CHECK_STATUS(refit_table_add_offer(table, 0, 0, 0, UINT64_MAX - 8, zero, shape, NULL, 2, NULL),
               REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_table_add_offer(table, 0, 0, 0, 64, big, big, NULL, 9, NULL), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_OK(refit_table_add_offer(table, 0, 0, 0, 64, zero, shape, strides, 2, NULL));

  CHECK_STATUS(refit_table_add_need(NULL, 0, 1, 0, 64, zero, shape, NULL, strides, 2), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_table_add_need(table, 0, 1, 0, 64, zero, shape, NULL, NULL, 2), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_table_add_need(table, 5, 1, 0, 64, zero, shape, NULL, strides, 2), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_table_add_need(table, 0, 1, 0, 64, zero, shape, perm_bad, strides, 2),
               REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "permutation") != NULL);
  CHECK_STATUS(refit_table_add_need(table, 0, 1, 0, 64, zero, other, NULL, strides, 2), REFIT_STATUS_TENSOR_MISMATCH);
  CHECK_OK(refit_table_add_need(table, 0, 1, 0, 4096, zero, shape, perm_swap, strides, 2));
  refit_table_destroy(table);
}

int main(void) {
  test_plan_moves_the_right_bytes();
  test_planning_failures();
  test_table_bad_arguments();
  CHECK_DONE();
}
