// A plain thread fan-out for the coordinator's per-round work. Not OpenMP on
// purpose: libgomp's idle workers spin after each parallel region, stealing the
// cores the network threads (and, in `spes-engine local`, the trainers) need.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace spes {

// Calls f(i) for i in [0, n) on up to hardware_concurrency threads (dynamic
// scheduling, one index at a time). f must not throw.
template <class F>
void parallel_for(int64_t n, F&& f) {
  const int64_t threads = std::min<int64_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) f(i);
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

}  // namespace spes
