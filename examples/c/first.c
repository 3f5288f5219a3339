/* A first refit program in C: device 0 holds a [4, 6] float weight; device 1 needs its right half
 * (columns 3..6, a tensor-parallel shard) in a [4, 3] buffer of its own. Plan it, run the plan's
 * routes, check the bytes. Runs on the host backend (host memory standing in for two GPUs); with
 * GPUs, pass device pointers and REFIT_BACKEND_CUDA.
 *   cc first.c $(pkg-config --cflags --libs refit) -o first && ./first */
#include <refit.h>
#include <stdint.h>
#include <stdio.h>

#define TRY(call)                                                                    \
  do {                                                                               \
    refit_status s_ = (call);                                                        \
    if (s_ != REFIT_STATUS_SUCCESS) {                                                \
      fprintf(stderr, "%s: %s\n", refit_status_string(s_), refit_last_error_message()); \
      return 1;                                                                      \
    }                                                                                \
  } while (0)

int main(void) {
  float weight[4][6], shard[4][3] = {{0}};
  for (int r = 0; r < 4; r++)
    for (int c = 0; c < 6; c++) weight[r][c] = (float)(10 * r + c);

  refit_table *publisher, *receiver;
  uint32_t t;
  const uint64_t shape[2] = {4, 6}, whole[2] = {0, 0}, right[2] = {0, 3}, half[2] = {4, 3}, strides[2] = {3, 1};
  TRY(refit_table_create(&publisher));
  TRY(refit_table_add_tensor(publisher, "w", 0, sizeof(float), shape, 2, &t));
  TRY(refit_table_add_offer(publisher, t, 0, 0, (uint64_t)(uintptr_t)weight, whole, shape, NULL, 2, NULL));
  TRY(refit_table_create(&receiver));
  TRY(refit_table_add_tensor(receiver, "w", 0, sizeof(float), shape, 2, &t));
  TRY(refit_table_add_need(receiver, t, 0, 1, (uint64_t)(uintptr_t)shard, right, half, NULL, strides, 2));

  const refit_table *tables[2] = {publisher, receiver};
  refit_plan *plan;
  TRY(refit_plan_build(tables, 2, NULL, &plan));

  refit_group_options options;
  TRY(refit_group_options_init(&options));
  options.backend = REFIT_BACKEND_HOST;
  const int32_t devices[2] = {0, 1};
  refit_group *group;
  TRY(refit_group_create(devices, 2, &options, &group));
  size_t routes;
  TRY(refit_plan_route_count(plan, &routes));
  for (size_t i = 0; i < routes; i++) {
    refit_route_info route = {.size = sizeof(route)};
    TRY(refit_plan_route(plan, i, &route));
    /* The receiving device's rank copies (device d is rank d in this group). */
    TRY(refit_copy_batch(group, route.dst_device, NULL, route.segments, route.segment_count, 0));
  }
  for (int r = 0; r < 4; r++)
    for (int c = 0; c < 3; c++)
      if (shard[r][c] != weight[r][c + 3]) return fprintf(stderr, "wrong element [%d][%d]\n", r, c), 1;
  printf("refit %s: %zu route(s) moved the right half of w to device 1\n", refit_version(), routes);
  refit_group_destroy(group);
  refit_plan_destroy(plan);
  refit_table_destroy(receiver);
  refit_table_destroy(publisher);
  return 0;
}
