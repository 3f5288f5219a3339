/* Quantized needs through the C API on the host backend: a [130, 136] bf16 tensor offered as two row
 * shards on device 0, needed whole as e4m3 codes and 128 x 128 block scales on device 1, in place
 * (shards cut at row 128, a block boundary) and through the need's staging (cut at row 65), under
 * direct and staged commit with verify, and under REFIT_ARITHMETIC_DEEPGEMM_UE8M0 as well as the
 * default arithmetic. Every code and scale equals refit_quantize_batch's over the whole matrix
 * (which test_quant.c checks against the header's arithmetic). The same shards in
 * another process take the sender path, which needs a communicator. Then every bad argument
 * of refit_table_add_quantized_need gets its status and message. Last, the tensor's rows split between
 * devices 0 and 1 as two per-tensor needs, each with its own scale, both given one amax key
 * (refit_table_share_amax): both scales are the whole tensor's, and the calls' bad arguments are
 * refused. */
#include <stdint.h>

#include "check.h"

#define ROWS 130
#define COLS 136

static uint64_t addr(const void *p) { return (uint64_t)(uintptr_t)p; }

static uint16_t tensor[ROWS * COLS] __attribute__((aligned(16)));
static uint16_t top[ROWS * COLS] __attribute__((aligned(16)));
static uint16_t bottom[ROWS * COLS] __attribute__((aligned(16)));
static uint16_t staging[ROWS * COLS] __attribute__((aligned(16)));
static uint8_t codes[ROWS * COLS] __attribute__((aligned(16)));
static float scales[4] __attribute__((aligned(16)));
static uint8_t want_codes[ROWS * COLS] __attribute__((aligned(16)));
static float want_scales[4] __attribute__((aligned(16)));

static refit_need_quantization block_quantization(uint64_t staging_addr) {
  refit_need_quantization q;
  memset(&q, 0, sizeof q); /* arithmetic 0: REFIT_ARITHMETIC_DIVIDE */
  q.quantization.target = REFIT_FP8_E4M3FN;
  q.quantization.granularity = REFIT_QUANT_BLOCK;
  q.quantization.block_rows = 128;
  q.quantization.block_cols = 128;
  q.source_type = REFIT_SOURCE_BF16;
  q.scales = addr(scales);
  q.scale_row_stride = 2;
  q.scale_matrix_stride = 4;
  q.staging = staging_addr;
  return q;
}

static const uint64_t shape[2] = {ROWS, COLS}, origin[2] = {0, 0}, code_strides[2] = {COLS, 1};

/* The plan of the tensor offered by process `owner` (device 0) as two row shards cut at row `cut`,
 * needed whole by process 0's device 1 as `q` says; its table in *table, its stats in *stats. */
static refit_plan *plan_shards(refit_table **table, uint32_t owner, uint64_t cut, const refit_need_quantization *q,
                               refit_plan_stats *stats) {
  uint32_t t = 0;
  CHECK_OK(refit_table_create(table));
  CHECK_OK(refit_table_add_tensor(*table, "w", 1, 2, shape, 2, &t));
  const uint64_t top_extent[2] = {cut, COLS}, bottom_origin[2] = {cut, 0}, bottom_extent[2] = {ROWS - cut, COLS};
  CHECK_OK(refit_table_add_offer(*table, t, owner, 0, addr(top), origin, top_extent, NULL, 2, NULL));
  CHECK_OK(refit_table_add_offer(*table, t, owner, 0, addr(bottom), bottom_origin, bottom_extent, NULL, 2, NULL));
  CHECK_OK(refit_table_add_quantized_need(*table, t, 0, 1, addr(codes), origin, shape, code_strides, 2, q));
  refit_plan *plan = NULL;
  const refit_table *tables[1] = {*table};
  CHECK_OK(refit_plan_build(tables, 1, NULL, &plan));
  stats->size = sizeof *stats;
  CHECK_OK(refit_plan_get_stats(plan, stats));
  return plan;
}

/* The codes and scales refit_quantize_batch gives the whole tensor under `arithmetic` (test_quant.c
 * checks that against the header's arithmetic), into want_codes and want_scales. */
static void want(refit_group *group, uint32_t arithmetic) {
  refit_quantize_job job;
  memset(&job, 0, sizeof job);
  job.quantization = block_quantization(0).quantization;
  job.arithmetic = arithmetic;
  job.source_type = REFIT_SOURCE_BF16;
  job.src = addr(tensor);
  job.rows = ROWS;
  job.cols = COLS;
  job.src_row_stride = COLS;
  job.dst = addr(want_codes);
  job.dst_row_stride = COLS;
  job.scales = addr(want_scales);
  job.scale_row_stride = 2;
  CHECK_OK(refit_quantize_batch(group, 0, NULL, &job, 1, 0));
}

/* One refit of the whole tensor from shards cut at row `cut` under `arithmetic`: planned, executed,
 * compared with refit_quantize_batch's codes and scales. */
static void refit_cut_at(refit_group *group, uint64_t cut, uint32_t commit, int staged_path, uint32_t arithmetic) {
  want(group, arithmetic);
  memcpy(top, tensor, sizeof(uint16_t) * cut * COLS);
  memcpy(bottom, tensor + cut * COLS, sizeof(uint16_t) * (ROWS - cut) * COLS);
  memset(codes, 0xab, sizeof codes);
  memset(scales, 0xab, sizeof scales);
  refit_table *table = NULL;
  refit_need_quantization q = block_quantization(staged_path ? addr(staging) : 0);
  q.arithmetic = arithmetic;
  refit_plan_stats stats;
  refit_plan *plan = plan_shards(&table, 0, cut, &q, &stats);
  CHECK(stats.quantized_needs == 1);
  CHECK(stats.quantized_elements == ROWS * COLS);
  CHECK(stats.quantized_direct_bytes == (staged_path ? 0 : 2 * ROWS * COLS));
  CHECK(stats.quantized_staged_bytes == (staged_path ? 2 * ROWS * COLS : 0));
  CHECK(stats.quantized_sent_bytes == 0);
  /* The plan says which path the need took and which device quantizes: both shards' device (0) in
   * place, the receiver (1) staged. */
  size_t routes = 0;
  CHECK_OK(refit_plan_quant_route_count(plan, &routes));
  CHECK(routes == 1);
  refit_quant_route_info info;
  info.size = sizeof info;
  CHECK_OK(refit_plan_quant_route(plan, 0, &info));
  CHECK(strcmp(info.tensor, "w") == 0);
  CHECK(info.path == (staged_path ? REFIT_PATH_STAGED : REFIT_PATH_IN_PLACE));
  CHECK(info.receiver_rank == 0 && info.receiver_device == 1);
  CHECK(info.runner_device == (staged_path ? 1u : 0u));
  CHECK(info.elements == ROWS * COLS && info.source_bytes == 2 * ROWS * COLS && info.need == 0);
  CHECK(info.jobs == (staged_path ? 1u : 2u));
  /* Blocks share no amax: nothing to exchange (test_quant.py's shards on two devices do). */
  CHECK(info.amax_exchanged == 0);
  CHECK_STATUS(refit_plan_quant_route(plan, 1, &info), REFIT_STATUS_NOT_FOUND);
  info.size = 8;
  CHECK_STATUS(refit_plan_quant_route(plan, 0, &info), REFIT_STATUS_INVALID_ARGUMENT);

  refit_executor_options options;
  CHECK_OK(refit_executor_options_init(&options));
  options.commit = commit;
  options.verify = true;
  refit_executor *executor = NULL;
  CHECK_OK(refit_executor_create(plan, group, 0, &options, &executor));
  /* Memory beside staging_limit: the verify's scratch (every job quantized once more) and, staged
   * commit in place, the codes and scales staged until the commit; each job's region is its codes,
   * rows 16-byte aligned, then its scales, each part padded to 16 bytes. */
  refit_executor_info held;
  held.size = sizeof held;
  CHECK_OK(refit_executor_get_info(executor, &held));
  const uint64_t copies = 1 + (commit == REFIT_COMMIT_STAGED && !staged_path);
  const uint64_t codes_and_scales = sizeof codes + sizeof scales;
  CHECK(held.quantization_bytes >= copies * codes_and_scales);
  CHECK(held.quantization_bytes <= copies * (ROWS * ((COLS + 15) / 16 * 16) + sizeof scales + 32 * info.jobs));
  CHECK(held.landing_bytes == 0);
  refit_run_stats run;
  run.size = sizeof run;
  CHECK_OK(refit_executor_run(executor, group, &run));
  CHECK(run.verified);
  uint64_t quantized = run.quantized_elements;
  if (commit == REFIT_COMMIT_STAGED) {
    for (size_t i = 0; i < sizeof codes; i++) CHECK(codes[i] == 0xab); /* nothing live before the commit */
    refit_run_stats committed;
    committed.size = sizeof committed;
    CHECK_OK(refit_executor_commit(executor, group, &committed));
    CHECK(committed.verified);
    quantized += committed.quantized_elements;
  }
  CHECK(quantized == ROWS * COLS);
  CHECK(memcmp(codes, want_codes, sizeof codes) == 0);
  CHECK(memcmp(scales, want_scales, sizeof scales) == 0);
  refit_executor_destroy(executor);
  refit_plan_destroy(plan);
  refit_table_destroy(table);
}

/* The shards in another process (rank 1), blocks whole in each: that process quantizes them (the
 * sender path), the plan says so, and an executor without a communicator refuses the plan, naming
 * the tensor, since the codes would cross processes. */
static void sender_path(refit_group *group) {
  refit_table *table = NULL;
  refit_need_quantization q = block_quantization(0);
  refit_plan_stats stats;
  refit_plan *plan = plan_shards(&table, 1, 128, &q, &stats);
  CHECK(stats.quantized_needs == 1 && stats.quantized_sent_bytes == 2 * ROWS * COLS);
  CHECK(stats.quantized_direct_bytes == 0 && stats.quantized_staged_bytes == 0);
  refit_quant_route_info info;
  info.size = sizeof info;
  CHECK_OK(refit_plan_quant_route(plan, 0, &info));
  CHECK(info.path == REFIT_PATH_SENDER && info.runner_rank == 1 && info.receiver_rank == 0);
  refit_executor *executor = (refit_executor *)0x1;
  CHECK_STATUS(refit_executor_create(plan, group, 0, NULL, &executor), REFIT_STATUS_UNSUPPORTED);
  CHECK(strstr(refit_last_error_message(), "'w'") != NULL);
  CHECK(strstr(refit_last_error_message(), "communicator") != NULL);
  CHECK(executor == (refit_executor *)0x1);
  refit_plan_destroy(plan);
  refit_table_destroy(table);
}

/* `q` changed by the caller, refused with `status` and a message containing `word`. */
static void refused(refit_table *table, uint32_t t, const refit_need_quantization *q, const uint64_t *strides,
                    refit_status status, const char *word) {
  CHECK_STATUS(refit_table_add_quantized_need(table, t, 0, 1, addr(codes), origin, shape, strides, 2, q), status);
  if (strstr(refit_last_error_message(), word) == NULL) {
    fprintf(stderr, "message \"%s\" does not mention \"%s\"\n", refit_last_error_message(), word);
    CHECK(0);
  }
}

/* Per-tensor needs of rows [0, SPLIT) on device 0 and [SPLIT, ROWS) on device 1, the whole tensor
 * offered on device 1, their two scales given one amax key: both scales and every code equal
 * refit_quantize_batch's over the whole tensor (whose amax lies in device 1's rows only). */
#define SPLIT 64
static uint8_t split_want_codes[ROWS * COLS] __attribute__((aligned(16)));
static float split_scales[2][4] __attribute__((aligned(16)));

static void per_tensor_job(refit_quantize_job *job, const uint16_t *src, uint64_t rows, uint8_t *dst, float *scale) {
  memset(job, 0, sizeof *job);
  job->quantization.target = REFIT_FP8_E4M3FN;
  job->quantization.granularity = REFIT_QUANT_TENSOR;
  job->arithmetic = REFIT_ARITHMETIC_VLLM_TENSOR;
  job->source_type = REFIT_SOURCE_BF16;
  job->src = addr(src);
  job->rows = rows;
  job->cols = COLS;
  job->src_row_stride = COLS;
  job->dst = addr(dst);
  job->dst_row_stride = COLS;
  job->scales = addr(scale);
  job->scale_row_stride = 1;
}

static void shared_amax(refit_group *group) {
  memcpy(top, tensor, sizeof tensor);
  top[(ROWS - 1) * COLS + 3] = (uint16_t)(134 << 7); /* 2^7, above every other element */
  refit_quantize_job job;
  float whole_scale = 0, top_scale = 0;
  per_tensor_job(&job, top, ROWS, split_want_codes, &whole_scale);
  CHECK_OK(refit_quantize_batch(group, 0, NULL, &job, 1, 0));
  per_tensor_job(&job, top, SPLIT, want_codes, &top_scale);
  CHECK_OK(refit_quantize_batch(group, 0, NULL, &job, 1, 0));
  CHECK(top_scale != whole_scale); /* not vacuous: device 0's rows alone have another scale */

  refit_table *table = NULL;
  uint32_t t = 0;
  CHECK_OK(refit_table_create(&table));
  CHECK_OK(refit_table_add_tensor(table, "w", 1, 2, shape, 2, &t));
  CHECK_OK(refit_table_add_offer(table, t, 0, 1, addr(top), origin, shape, NULL, 2, NULL));
  memset(codes, 0xab, sizeof codes);
  memset(split_scales, 0xab, sizeof split_scales);
  for (uint32_t device = 0; device < 2; device++) {
    refit_need_quantization q;
    memset(&q, 0, sizeof q);
    q.quantization.target = REFIT_FP8_E4M3FN;
    q.quantization.granularity = REFIT_QUANT_TENSOR;
    q.arithmetic = REFIT_ARITHMETIC_VLLM_TENSOR;
    q.source_type = REFIT_SOURCE_BF16;
    q.scales = addr(split_scales[device]);
    q.scale_row_stride = 1;
    const uint64_t lo[2] = {device ? SPLIT : 0, 0}, extent[2] = {device ? ROWS - SPLIT : SPLIT, COLS};
    CHECK_OK(refit_table_add_quantized_need(table, t, 0, device, addr(codes + lo[0] * COLS), lo, extent,
                                            code_strides, 2, &q));
    CHECK_OK(refit_table_share_amax(table, 0, addr(split_scales[device]), 0x5ca1e));
  }
  /* Giving a scale its key again is accepted; another key, key 0 and a NULL table are refused. */
  CHECK_OK(refit_table_share_amax(table, 0, addr(split_scales[0]), 0x5ca1e));
  CHECK_STATUS(refit_table_share_amax(table, 0, addr(split_scales[0]), 7), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "already shares its amax under key") != NULL);
  CHECK_STATUS(refit_table_share_amax(table, 0, addr(split_scales[1]) + 8, 0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "key 0") != NULL);
  CHECK_STATUS(refit_table_share_amax(NULL, 0, addr(split_scales[0]), 1), REFIT_STATUS_NULL_ARGUMENT);

  refit_plan *plan = NULL;
  const refit_table *tables[1] = {table};
  CHECK_OK(refit_plan_build(tables, 1, NULL, &plan));
  size_t routes = 0;
  CHECK_OK(refit_plan_quant_route_count(plan, &routes));
  CHECK(routes == 2);
  for (size_t i = 0; i < routes; i++) {
    refit_quant_route_info info;
    info.size = sizeof info;
    CHECK_OK(refit_plan_quant_route(plan, i, &info));
    CHECK(info.path == REFIT_PATH_IN_PLACE && info.runner_device == 1);
  }
  refit_executor *executor = NULL;
  CHECK_OK(refit_executor_create(plan, group, 0, NULL, &executor));
  CHECK_OK(refit_executor_run(executor, group, NULL));
  CHECK(memcmp(&split_scales[0][0], &whole_scale, 4) == 0);
  CHECK(memcmp(&split_scales[1][0], &whole_scale, 4) == 0);
  CHECK(memcmp(codes, split_want_codes, sizeof codes) == 0);
  refit_executor_destroy(executor);
  refit_plan_destroy(plan);

  /* A key on a scale that no need writes is refused at planning. */
  CHECK_OK(refit_table_share_amax(table, 0, addr(split_scales[1]) + 8, 9));
  plan = (refit_plan *)0x1;
  CHECK_STATUS(refit_plan_build(tables, 1, NULL, &plan), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "no quantized need with elements") != NULL);
  CHECK(plan == (refit_plan *)0x1);
  refit_table_destroy(table);
}

int main(void) {
  const int32_t devices[2] = {0, 1};
  refit_group *group = check_host_group(devices, 2);

  uint32_t seed = 777;
  for (int i = 0; i < ROWS * COLS; i++) {
    seed = seed * 1103515245u + 12345u;
    /* finite bf16: sign and mantissa from the seed, exponent 118..133 */
    tensor[i] = (uint16_t)(((seed >> 16) & 0x807f) | ((118 + (seed >> 8) % 16) << 7));
  }
  for (int staged = 0; staged < 2; staged++) {
    refit_cut_at(group, 128, staged ? REFIT_COMMIT_STAGED : REFIT_COMMIT_DIRECT, 0, REFIT_ARITHMETIC_DIVIDE);
    refit_cut_at(group, 65, staged ? REFIT_COMMIT_STAGED : REFIT_COMMIT_DIRECT, 1, REFIT_ARITHMETIC_DIVIDE);
  }
  /* A need's arithmetic reaches its codes and scales, in place and staged: UE8M0's scales are powers
   * of two, unlike the default arithmetic's for these blocks. */
  float divide_scales[4];
  memcpy(divide_scales, want_scales, sizeof want_scales);
  refit_cut_at(group, 128, REFIT_COMMIT_DIRECT, 0, REFIT_ARITHMETIC_DEEPGEMM_UE8M0);
  refit_cut_at(group, 65, REFIT_COMMIT_STAGED, 1, REFIT_ARITHMETIC_DEEPGEMM_UE8M0);
  for (int i = 0; i < 4; i++) CHECK(want_scales[i] != divide_scales[i]);
  sender_path(group);
  shared_amax(group);

  /* Bad arguments: each refused with its status, naming what is wrong; the table takes nothing. */
  refit_table *table = NULL;
  uint32_t t = 0;
  CHECK_OK(refit_table_create(&table));
  CHECK_OK(refit_table_add_tensor(table, "w", 1, 2, shape, 2, &t));
  refit_need_quantization q = block_quantization(0);
  CHECK_STATUS(refit_table_add_quantized_need(table, t, 0, 1, addr(codes), origin, shape, code_strides, 2, NULL),
               REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_table_add_quantized_need(table, t, 0, 1, addr(codes), origin, shape, NULL, 2, &q),
               REFIT_STATUS_NULL_ARGUMENT);
  q.arithmetic = 9;
  refused(table, t, &q, code_strides, REFIT_STATUS_INVALID_ARGUMENT, "quantization->arithmetic is 9");
  q = block_quantization(0);
  q.quantization.granularity = REFIT_QUANT_MXFP8;
  q.quantization.block_rows = q.quantization.block_cols = 0;
  q.arithmetic = REFIT_ARITHMETIC_DEEPGEMM;
  refused(table, t, &q, code_strides, REFIT_STATUS_INVALID_ARGUMENT, "arithmetic 1 for MXFP8");
  q = block_quantization(0);
  q.quantization.granularity = 9;
  refused(table, t, &q, code_strides, REFIT_STATUS_INVALID_ARGUMENT, "granularity");
  q = block_quantization(0);
  q.quantization.target = 0;
  refused(table, t, &q, code_strides, REFIT_STATUS_INVALID_ARGUMENT, "target");
  q = block_quantization(0);
  q.quantization.block_rows = 0;
  refused(table, t, &q, code_strides, REFIT_STATUS_INVALID_ARGUMENT, "block");
  q = block_quantization(0);
  q.source_type = REFIT_SOURCE_F32;
  refused(table, t, &q, code_strides, REFIT_STATUS_INVALID_ARGUMENT, "4 bytes");
  q = block_quantization(0);
  q.source_type = 99;
  refused(table, t, &q, code_strides, REFIT_STATUS_INVALID_ARGUMENT, "source_type");
  q = block_quantization(0);
  q.scale_row_stride = 1;
  refused(table, t, &q, code_strides, REFIT_STATUS_INVALID_ARGUMENT, "scale_row_stride");
  q = block_quantization(addr(staging) + 2);
  refused(table, t, &q, code_strides, REFIT_STATUS_INVALID_ARGUMENT, "staging");
  q = block_quantization(0);
  q.scales = UINT64_MAX - 4;
  refused(table, t, &q, code_strides, REFIT_STATUS_INVALID_ARGUMENT, "scales");
  const uint64_t spread[2] = {COLS, 2};
  refused(table, t, &q, spread, REFIT_STATUS_INVALID_ARGUMENT, "contiguous");
  const uint64_t outside[2] = {ROWS + 1, COLS};
  q = block_quantization(0);
  CHECK_STATUS(refit_table_add_quantized_need(table, t, 0, 1, addr(codes), origin, outside, code_strides, 2, &q),
               REFIT_STATUS_TENSOR_MISMATCH);
  CHECK_STATUS(refit_table_add_quantized_need(table, 7, 0, 1, addr(codes), origin, shape, code_strides, 2, &q),
               REFIT_STATUS_INVALID_ARGUMENT);
  /* No offer and no staging: planning says why, naming the tensor. */
  CHECK_OK(refit_table_add_quantized_need(table, t, 0, 1, addr(codes), origin, shape, code_strides, 2, &q));
  refit_plan *plan = (refit_plan *)0x1;
  const refit_table *tables[1] = {table};
  CHECK_STATUS(refit_plan_build(tables, 1, NULL, &plan), REFIT_STATUS_UNSUPPORTED);
  CHECK(strstr(refit_last_error_message(), "'w'") != NULL);
  CHECK(plan == (refit_plan *)0x1);
  refit_table_destroy(table);
  refit_group_destroy(group);
  CHECK_DONE();
}
