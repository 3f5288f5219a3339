// Device 0 holds a [4, 6] float weight; device 1 needs its right half (columns 3..6, a tensor-parallel
// shard) in a [4, 3] buffer of its own. Plan, run the routes, check. Host backend: host memory stands
// in for two GPUs (with GPUs: device pointers, REFIT_BACKEND_CUDA).
#include <refit.hpp>

#include <iostream>

int main() try {
  float weight[4][6], shard[4][3] = {};
  for (int i = 0; i < 24; i++) weight[i / 6][i % 6] = float(i);
  auto addr = [](const void *p) { return uint64_t(uintptr_t(p)); };

  refit::Table publisher, receiver;
  uint32_t t = publisher.add_tensor("w", {4, 6}, sizeof(float));
  publisher.add_offer(t, /*rank*/ 0, /*device*/ 0, addr(weight), /*offset*/ {0, 0}, /*extent*/ {4, 6});
  t = receiver.add_tensor("w", {4, 6}, sizeof(float));
  receiver.add_need(t, 0, 1, addr(shard), {0, 3}, {4, 3}, /*strides*/ {3, 1});
  refit::Plan plan = refit::Plan::build({&publisher, &receiver});

  refit::Group group({0, 1}, REFIT_BACKEND_HOST);
  for (const refit::Route &route : plan.routes()) group.copy_batch(route.dst_device, route.segments);
  for (int i = 0; i < 12; i++)
    if (shard[i / 3][i % 3] != weight[i / 3][i % 3 + 3]) throw std::runtime_error("wrong element");
  std::cout << "refit " << refit::version() << ": " << plan.route_count()
            << " route(s) moved the right half of w to device 1\n";
} catch (const refit::Error &e) {
  std::cerr << e.what() << '\n';  // the status name and the library's message
  return 1;
}
