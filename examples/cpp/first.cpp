// A first refit program in C++17: device 0 holds a [4, 6] float weight; device 1 needs its right
// half (columns 3..6, a tensor-parallel shard) in a [4, 3] buffer of its own. Plan it, run the
// plan's routes, check the bytes. Runs on the host backend (host memory standing in for two GPUs);
// with GPUs, pass device pointers and REFIT_BACKEND_CUDA. Build: see CMakeLists.txt beside it.
#include <refit.hpp>

#include <cstdint>
#include <iostream>

int main() try {
  float weight[4][6], shard[4][3] = {};
  for (int r = 0; r < 4; r++)
    for (int c = 0; c < 6; c++) weight[r][c] = float(10 * r + c);
  auto addr = [](const void *p) { return uint64_t(uintptr_t(p)); };

  refit::Table publisher, receiver;
  uint32_t t = publisher.add_tensor("w", {4, 6}, sizeof(float));
  publisher.add_offer(t, /*rank*/ 0, /*device*/ 0, addr(weight), {0, 0}, {4, 6});
  t = receiver.add_tensor("w", {4, 6}, sizeof(float));
  receiver.add_need(t, 0, 1, addr(shard), /*offset*/ {0, 3}, /*extent*/ {4, 3}, /*strides*/ {3, 1});
  refit::Plan plan = refit::Plan::build({&publisher, &receiver});

  refit::Group group({0, 1}, REFIT_BACKEND_HOST);
  for (const refit::Route &route : plan.routes()) group.copy_batch(route.dst_device, route.segments);

  for (int r = 0; r < 4; r++)
    for (int c = 0; c < 3; c++)
      if (shard[r][c] != weight[r][c + 3]) throw std::runtime_error("wrong element");
  std::cout << "refit " << refit::version() << ": " << plan.route_count()
            << " route(s) moved the right half of w to device 1\n";
} catch (const refit::Error &e) {
  std::cerr << e.what() << '\n';  // the status name and the library's message
  return 1;
}
