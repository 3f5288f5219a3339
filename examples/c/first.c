/* Device 0 holds a [4, 6] float weight; device 1 needs its right half (columns 3..6, a tensor-parallel
 * shard) in a [4, 3] buffer of its own. Plan once, prepare an executor once, then each step: run
 * (into staging, verified), commit (into the live buffer). Host backend: host memory stands in for
 * two GPUs (with GPUs: device pointers, REFIT_BACKEND_CUDA or AUTO). */
#include <refit.h>
#include <stdint.h>
#include <stdio.h>

#define TRY(call) if ((status = (call)) != REFIT_STATUS_SUCCESS) goto fail

int main(void) {
  float weight[4][6], shard[4][3] = {{0}};
  for (int i = 0; i < 24; i++) weight[i / 6][i % 6] = (float)i;
  const uint64_t shape[2] = {4, 6}, origin[2] = {0, 0}, right[2] = {0, 3}, half[2] = {4, 3}, strides[2] = {3, 1};
  const int32_t devices[2] = {0, 1};
  refit_table *tables[2] = {NULL, NULL};
  refit_plan *plan = NULL;
  refit_group *group = NULL;
  refit_executor *executor = NULL;
  refit_group_options group_options;
  refit_executor_options options;
  refit_run_stats run = {.size = sizeof(run)}, commit = {.size = sizeof(commit)};
  refit_status status;
  uint32_t t;

  /* 1. Plan: what each side holds and needs, by device ordinal. */
  TRY(refit_table_create(&tables[0]));  /* the publisher: all of w, on device 0 */
  TRY(refit_table_add_tensor(tables[0], "w", 0, sizeof(float), shape, 2, &t));
  TRY(refit_table_add_offer(tables[0], t, 0, 0, (uint64_t)(uintptr_t)weight, origin, shape, NULL, 2, NULL));
  TRY(refit_table_create(&tables[1]));  /* the receiver: columns 3..6, on device 1 */
  TRY(refit_table_add_tensor(tables[1], "w", 0, sizeof(float), shape, 2, &t));
  TRY(refit_table_add_need(tables[1], t, 0, 1, (uint64_t)(uintptr_t)shard, right, half, NULL, strides, 2));
  TRY(refit_plan_build((const refit_table *const *)tables, 2, NULL, &plan));

  /* 2. Executor: this process's share of the plan on a group of its devices, prepared once. */
  TRY(refit_group_options_init(&group_options));
  group_options.backend = REFIT_BACKEND_HOST;
  TRY(refit_group_create(devices, 2, &group_options, &group));
  TRY(refit_executor_options_init(&options));
  options.verify = true;                  /* compare every copied byte with its source */
  options.commit = REFIT_COMMIT_STAGED;   /* run lands the bytes in staging; commit installs them */
  TRY(refit_executor_create(plan, group, 0, &options, &executor));

  /* 3. One step (repeat it whenever the weights change): run, then commit. */
  TRY(refit_executor_run(executor, group, &run));
  if (shard[0][0] != 0.0f) return fprintf(stderr, "a staged run changed the live buffer\n"), 1;
  TRY(refit_executor_commit(executor, group, &commit));
  for (int i = 0; i < 12; i++)
    if (shard[i / 3][i % 3] != weight[i / 3][i % 3 + 3]) return fprintf(stderr, "wrong element %d\n", i), 1;
  printf("refit %s: %llu bytes verified in staging, %llu installed by the commit\n", refit_version(),
         (unsigned long long)run.verified_bytes, (unsigned long long)commit.installed_bytes);
fail:
  if (status != REFIT_STATUS_SUCCESS) fprintf(stderr, "%s: %s\n", refit_status_string(status), refit_last_error_message());
  refit_executor_destroy(executor);
  refit_group_destroy(group);
  refit_plan_destroy(plan);
  refit_table_destroy(tables[1]);
  refit_table_destroy(tables[0]);
  return status != REFIT_STATUS_SUCCESS;
}
