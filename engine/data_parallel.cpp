#include "engine/data_parallel.hpp"

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include "engine/base/error.hpp"

namespace spes {

namespace {

// One thread per rank, each running whatever run() hands it; run() returns when
// every rank is done, rethrowing the first error.
class RankThreads {
 public:
  explicit RankThreads(int n) : errors_(size_t(n)) {
    for (int r = 0; r < n; ++r) threads_.emplace_back([this, r] { loop(r); });
  }
  ~RankThreads() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
      ++generation_;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  // on_error runs (once, on the failing rank's thread) when a rank throws: it must
  // release ranks that wait for the failed one in a collective.
  void run(const std::function<void(int)>& f, const std::function<void()>& on_error) {
    std::unique_lock lk(mu_);
    job_ = &f;
    on_error_ = &on_error;
    pending_ = int(threads_.size());
    ++generation_;
    cv_.notify_all();
    done_cv_.wait(lk, [&] { return pending_ == 0; });
    job_ = nullptr;
    on_error_ = nullptr;
    std::exception_ptr first;
    for (auto& e : errors_)
      if (e && !first) first = std::exchange(e, nullptr);
      else e = nullptr;
    if (first) std::rethrow_exception(first);
  }

 private:
  void loop(int r) {
    uint64_t seen = 0;
    for (;;) {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return generation_ != seen; });
      seen = generation_;
      if (stop_) return;
      const std::function<void(int)>* f = job_;
      const std::function<void()>* on_error = on_error_;
      lk.unlock();
      try {
        (*f)(r);
      } catch (...) {
        errors_[size_t(r)] = std::current_exception();
        if (!aborted_.exchange(true)) (*on_error)();
      }
      lk.lock();
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }
  std::vector<std::thread> threads_;
  std::vector<std::exception_ptr> errors_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  const std::function<void()>* on_error_ = nullptr;
  std::atomic<bool> aborted_{false};  // after a failure the communicator is unusable: once
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

class DataParallelBackend final : public TrainBackend {
 public:
  DataParallelBackend(std::vector<std::unique_ptr<RankBackend>> ranks, std::unique_ptr<Communicator> comm,
                      int64_t micro_batch, int64_t seq_len)
      : ranks_(checked(std::move(ranks), comm.get(), micro_batch)), comm_(std::move(comm)), G_(int(ranks_.size())),
        T_(seq_len), slice_(micro_batch / G_), threads_(G_) {}

  std::string describe() const override {
    return "data parallel over " + std::to_string(G_) + " ranks of " + ranks_[0]->describe();
  }
  void zero_grads() override {
    on_every_rank([&](int r) { ranks_[size_t(r)]->zero_grads(); });
    reduced_ = false;
  }
  // Rank r takes sequences [r·slice, (r+1)·slice) of the micro-batch.
  LossParts forward_backward(const int32_t* inputs, const int32_t* targets, float aux_factor,
                             float grad_scale) override {
    std::vector<LossParts> parts(static_cast<size_t>(G_));
    on_every_rank([&](int r) {
      const int64_t off = int64_t(r) * slice_ * T_;
      parts[size_t(r)] = ranks_[size_t(r)]->forward_backward(inputs + off, targets + off, aux_factor, grad_scale);
    });
    reduced_ = false;
    return combine(parts, std::vector<int64_t>(size_t(G_), slice_ * T_));
  }
  double grad_sum_squares() override {
    reduce_grads();
    return ranks_[0]->grad_sum_squares();  // every rank holds the same gradients now
  }
  void optimizer_step(const AdamWStep& s) override {
    reduce_grads();
    on_every_rank([&](int r) { ranks_[size_t(r)]->optimizer_step(s); });
  }
  // Evaluation: the rows spread over the ranks the same way (the last ones may get none).
  LossParts forward(const int32_t* inputs, const int32_t* targets, int64_t rows) override {
    std::vector<LossParts> parts(static_cast<size_t>(G_));
    std::vector<int64_t> tokens(static_cast<size_t>(G_), 0);
    on_every_rank([&](int r) {
      const int64_t first = int64_t(r) * slice_, n = std::min(slice_, rows - first);
      if (n <= 0) return;
      tokens[size_t(r)] = n * T_;
      parts[size_t(r)] = ranks_[size_t(r)]->forward(inputs + first * T_, targets + first * T_, n);
    });
    return combine(parts, tokens);
  }
  std::span<float> host_theta() override { return ranks_[0]->host_theta(); }
  void pull_theta() override { ranks_[0]->pull_theta(); }
  // Rank 0 takes the host θ, then hands its buffers to every rank.
  void push_theta() override {
    ranks_[0]->push_theta();
    on_every_rank([&](int r) {
      for (std::span<std::byte> b : ranks_[size_t(r)]->theta_buffers()) comm_->broadcast(r, b, 0);
    });
  }
  void read_moments(std::span<float> m, std::span<float> v) override { ranks_[0]->read_moments(m, v); }
  void write_moments(std::span<const float> m, std::span<const float> v) override {
    on_every_rank([&](int r) { ranks_[size_t(r)]->write_moments(m, v); });
  }
  int64_t optimizer_state_bytes() const override { return int64_t(G_) * ranks_[0]->optimizer_state_bytes(); }
  PeakFlops peak_flops() const override {
    const PeakFlops rank = ranks_[0]->peak_flops();
    return {double(G_) * rank.flops, std::to_string(G_) + " × " + rank.source};
  }

 private:
  static std::vector<std::unique_ptr<RankBackend>> checked(std::vector<std::unique_ptr<RankBackend>> ranks,
                                                            const Communicator* comm, int64_t micro_batch) {
    const int64_t G = int64_t(ranks.size());
    if (G < 1 || !comm || comm->size() != G) throw Error("data parallel: needs ranks and a communicator of as many");
    if (micro_batch % G)
      throw ConfigError("[train] micro_batch = " + std::to_string(micro_batch) + " must be a multiple of the " +
                        std::to_string(G) + " devices of this node (each runs micro_batch / devices sequences)");
    return ranks;
  }
  // A rank that fails releases the others from any collective they wait in (the
  // communicator is unusable afterwards; the error ends the run).
  void on_every_rank(const std::function<void(int)>& f) { threads_.run(f, [this] { comm_->abort(); }); }
  void reduce_grads() {
    if (reduced_) return;
    // Also with one rank: the mean of one is itself, and the NCCL path runs (and is
    // measured) on a one-GPU machine as on eight.
    on_every_rank([&](int r) { comm_->all_reduce_mean(r, ranks_[size_t(r)]->grad_buffer()); });
    reduced_ = true;
  }
  // Token-weighted means of the loss parts; expert counts summed.
  LossParts combine(const std::vector<LossParts>& parts, const std::vector<int64_t>& tokens) const {
    LossParts out;
    int64_t total = 0;
    for (int64_t t : tokens) total += t;
    for (size_t r = 0; r < parts.size(); ++r) {
      if (tokens[r] == 0) continue;
      const double w = double(tokens[r]) / double(total);
      out.ce += w * parts[r].ce;
      out.lb += w * parts[r].lb;
      out.router_z += w * parts[r].router_z;
      out.lm_z += w * parts[r].lm_z;
      if (out.expert_counts.empty()) out.expert_counts.assign(parts[r].expert_counts.size(), 0);
      for (size_t k = 0; k < parts[r].expert_counts.size(); ++k) out.expert_counts[k] += parts[r].expert_counts[k];
    }
    return out;
  }

  std::vector<std::unique_ptr<RankBackend>> ranks_;
  std::unique_ptr<Communicator> comm_;
  int G_;
  int64_t T_, slice_;
  RankThreads threads_;
  bool reduced_ = false;
};

}  // namespace

std::unique_ptr<TrainBackend> make_data_parallel_backend(std::vector<std::unique_ptr<RankBackend>> ranks,
                                                         std::unique_ptr<Communicator> comm, int64_t micro_batch,
                                                         int64_t seq_len) {
  return std::make_unique<DataParallelBackend>(std::move(ranks), std::move(comm), micro_batch, seq_len);
}

}  // namespace spes
