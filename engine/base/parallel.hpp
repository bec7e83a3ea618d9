// A plain thread fan-out (the coordinator's per-round work, the tokenize tool). Not OpenMP on
// purpose: libgomp's idle workers spin after each parallel region, stealing the
// cores the network threads (and, in `spes-engine local`, the trainers) need.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace spes {

// Calls f(i) for i in [0, n) on up to max_threads threads (0: hardware_concurrency;
// dynamic scheduling, one index at a time). If f throws (an I/O error), no new index
// starts and the first exception is rethrown here once every thread has stopped.
template <class F>
void parallel_for(int64_t n, int64_t max_threads, F&& f) {
  const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  const int64_t threads = std::min<int64_t>(n, max_threads > 0 ? max_threads : cores);
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mu;
  auto work = [&] {
    try {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) f(i);
    } catch (...) {
      next.store(n, std::memory_order_relaxed);
      std::lock_guard<std::mutex> lk(error_mu);
      if (!error) error = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

template <class F>
void parallel_for(int64_t n, F&& f) {
  parallel_for(n, 0, std::forward<F>(f));
}

}  // namespace spes
