/* Device 0 holds a [4, 6] float weight; device 1 needs its right half (columns 3..6, a tensor-parallel
 * shard) in a [4, 3] buffer of its own. Plan, run the routes, check. Host backend: host memory stands
 * in for two GPUs (with GPUs: device pointers, REFIT_BACKEND_CUDA). */
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
  refit_group_options options;
  refit_status status;
  uint32_t t;
  size_t routes = 0;

  TRY(refit_table_create(&tables[0]));  /* the publisher: all of w, on device 0 */
  TRY(refit_table_add_tensor(tables[0], "w", 0, sizeof(float), shape, 2, &t));
  TRY(refit_table_add_offer(tables[0], t, 0, 0, (uint64_t)(uintptr_t)weight, origin, shape, NULL, 2, NULL));
  TRY(refit_table_create(&tables[1]));  /* the receiver: columns 3..6, on device 1 */
  TRY(refit_table_add_tensor(tables[1], "w", 0, sizeof(float), shape, 2, &t));
  TRY(refit_table_add_need(tables[1], t, 0, 1, (uint64_t)(uintptr_t)shard, right, half, NULL, strides, 2));
  TRY(refit_plan_build((const refit_table *const *)tables, 2, NULL, &plan));

  TRY(refit_group_options_init(&options));
  options.backend = REFIT_BACKEND_HOST;
  TRY(refit_group_create(devices, 2, &options, &group));
  TRY(refit_plan_route_count(plan, &routes));
  for (size_t i = 0; i < routes; i++) {
    refit_route_info route = {.size = sizeof(route)};
    TRY(refit_plan_route(plan, i, &route));  /* the receiving device's rank copies the segments */
    TRY(refit_copy_batch(group, route.dst_device, NULL, route.segments, route.segment_count, 0));
  }
  for (int i = 0; i < 12; i++)
    if (shard[i / 3][i % 3] != weight[i / 3][i % 3 + 3]) return fprintf(stderr, "wrong element %d\n", i), 1;
  printf("refit %s: %zu route(s) moved the right half of w to device 1\n", refit_version(), routes);
fail:
  if (status != REFIT_STATUS_SUCCESS) fprintf(stderr, "%s: %s\n", refit_status_string(status), refit_last_error_message());
  refit_group_destroy(group);
  refit_plan_destroy(plan);
  refit_table_destroy(tables[1]);
  refit_table_destroy(tables[0]);
  return status != REFIT_STATUS_SUCCESS;
}
