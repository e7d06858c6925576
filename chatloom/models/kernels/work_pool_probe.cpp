// A probe of the work pool (work_pool.h) for the tests: which thread ran each item of a loop.
#include "kernels.h"

#include <atomic>
#include <chrono>
#include <thread>

std::vector<int64_t> work_pool_probe(int64_t items, int64_t stall_ns) {
  TORCH_CHECK(items >= 1 && stall_ns >= 0, "items must be >= 1 and stall_ns >= 0");
  const auto caller = std::this_thread::get_id();
  std::vector<std::atomic<int64_t>> runs(items);
  std::vector<int64_t> owner(items, -1);
  std::atomic<bool> stalled{false};
  chatloom_kernels::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    const bool worker = std::this_thread::get_id() != caller;
    // The first time a worker gets items it stops as if the OS had taken its core away.
    if (worker && stall_ns > 0 && !stalled.exchange(true))
      std::this_thread::sleep_for(std::chrono::nanoseconds(stall_ns));
    for (int64_t i = begin; i < end; ++i) {
      runs[i].fetch_add(1);
      owner[i] = worker ? 1 : 0;
    }
  });
  for (int64_t i = 0; i < items; ++i) TORCH_CHECK(runs[i].load() == 1, "item ", i, " ran ", runs[i].load(), " times");
  return owner;
}
