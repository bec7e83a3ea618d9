#include "engine/communicator.hpp"

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "engine/base/error.hpp"

namespace spes {

namespace {

// std::barrier, but abortable: a failed rank must not leave the others waiting.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void arrive_and_wait() {
    std::unique_lock lk(mu_);
    if (aborted_) throw Error("data parallel: another rank failed");
    const uint64_t gen = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lk, [&] { return generation_ != gen || aborted_; });
    if (generation_ == gen) throw Error("data parallel: another rank failed");
  }
  void abort() {
    std::lock_guard lk(mu_);
    aborted_ = true;
    cv_.notify_all();
  }

 private:
  int n_, arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
};

class ThreadCommunicator final : public Communicator {
 public:
  explicit ThreadCommunicator(int ranks) : n_(ranks), spans_(size_t(ranks)), sync_(ranks) {}
  int size() const override { return n_; }

  void all_reduce_mean(int rank, std::span<float> data) override {
    spans_[size_t(rank)] = {reinterpret_cast<std::byte*>(data.data()), data.size_bytes()};
    sync_.arrive_and_wait();  // every rank has published its buffer
    const size_t n = data.size();
    for (const auto& s : spans_)  // every rank sees the same spans: all throw, or none
      if (s.size() != spans_[0].size()) throw Error("all_reduce_mean: ranks disagree on the size");
    const size_t begin = n * size_t(rank) / size_t(n_), end = n * size_t(rank + 1) / size_t(n_);
    const float inv = 1.0f / float(n_);
    for (size_t i = begin; i < end; ++i) {
      float sum = 0;
      for (int r = 0; r < n_; ++r) sum += as_floats(r)[i];
      const float mean = sum * inv;
      for (int r = 0; r < n_; ++r) as_floats(r)[i] = mean;
    }
    sync_.arrive_and_wait();  // every slice is written everywhere
  }

  void broadcast(int rank, std::span<std::byte> data, int root) override {
    spans_[size_t(rank)] = data;
    sync_.arrive_and_wait();
    if (rank != root) std::memcpy(data.data(), spans_[size_t(root)].data(), data.size());
    sync_.arrive_and_wait();  // root's buffer may change again only after every copy
  }

  void abort() override { sync_.abort(); }

 private:
  float* as_floats(int r) { return reinterpret_cast<float*>(spans_[size_t(r)].data()); }
  int n_;
  std::vector<std::span<std::byte>> spans_;
  Barrier sync_;
};

}  // namespace

std::unique_ptr<Communicator> make_thread_communicator(int ranks) {
  if (ranks < 1) throw std::invalid_argument("make_thread_communicator: ranks must be ≥ 1");
  return std::make_unique<ThreadCommunicator>(ranks);
}

}  // namespace spes
