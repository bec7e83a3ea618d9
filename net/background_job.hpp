// One job at a time on a helper thread, so a node can compute (encode the next
// frames, apply the last received chunk) while its own thread waits on the socket.
// wait() joins and rethrows what the job threw; the destructor joins, so a job
// never outlives the buffers it works on (declare the job after them).
#pragma once
#include <exception>
#include <thread>
#include <utility>

namespace spes::net {

class BackgroundJob {
 public:
  BackgroundJob() = default;
  BackgroundJob(const BackgroundJob&) = delete;
  BackgroundJob& operator=(const BackgroundJob&) = delete;
  ~BackgroundJob() {
    if (thread_.joinable()) thread_.join();
  }

  // Starts f after the previous job has finished (its exception is rethrown here).
  template <class F>
  void start(F&& f) {
    wait();
    thread_ = std::thread([this, f = std::forward<F>(f)]() mutable {
      try {
        f();
      } catch (...) {
        error_ = std::current_exception();
      }
    });
  }

  void wait() {
    if (thread_.joinable()) thread_.join();
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  std::thread thread_;
  std::exception_ptr error_;
};

}  // namespace spes::net
