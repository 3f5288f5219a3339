// Device 0 holds a [4, 6] float weight; device 1 needs its right half (columns 3..6, a tensor-parallel
// shard) in a [4, 3] buffer of its own. Plan once, prepare an executor once, then each step: run
// (into staging, verified), commit (into the live buffer). Host backend: host memory stands in for
// two GPUs (with GPUs: device pointers, REFIT_BACKEND_CUDA or AUTO).
#include <refit.hpp>

#include <iostream>

int main() try {
  float weight[4][6], shard[4][3] = {};
  for (int i = 0; i < 24; i++) weight[i / 6][i % 6] = float(i);
  auto addr = [](const void *p) { return uint64_t(uintptr_t(p)); };

  // 1. Plan: what each side holds and needs, by device ordinal.
  refit::Table publisher, receiver;
  uint32_t t = publisher.add_tensor("w", {4, 6}, sizeof(float));
  publisher.add_offer(t, /*process rank*/ 0, /*device*/ 0, addr(weight), /*offset*/ {0, 0}, /*extent*/ {4, 6});
  t = receiver.add_tensor("w", {4, 6}, sizeof(float));
  receiver.add_need(t, 0, 1, addr(shard), {0, 3}, {4, 3}, /*strides*/ {3, 1});
  refit::Plan plan = refit::Plan::build({&publisher, &receiver});

  // 2. Executor: this process's share of the plan on a group of its devices, prepared once.
  refit::Group group({0, 1}, REFIT_BACKEND_HOST);
  refit_executor_options options = refit::executor_options();
  options.verify = true;                 // compare every copied byte with its source
  options.commit = REFIT_COMMIT_STAGED;  // run lands the bytes in staging; commit installs them
  refit::Executor executor(plan, group, /*process*/ 0, options);

  // 3. One step (repeat it whenever the weights change): run, then commit.
  refit_run_stats run = executor.run(group);
  if (shard[0][0] != 0.0f) throw std::runtime_error("a staged run changed the live buffer");
  refit_run_stats commit = executor.commit(group);
  for (int i = 0; i < 12; i++)
    if (shard[i / 3][i % 3] != weight[i / 3][i % 3 + 3]) throw std::runtime_error("wrong element");
  std::cout << "refit " << refit::version() << ": " << run.verified_bytes << " bytes verified in staging, "
            << commit.installed_bytes << " installed by the commit\n";
} catch (const refit::Error &e) {
  std::cerr << e.what() << '\n';  // the status name and the library's message
  return 1;
}
