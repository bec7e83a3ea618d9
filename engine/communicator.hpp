// Data parallel inside a node (engine/README.md, "Training on GPUs"):
// the ranks of one node — one thread each — average their owned gradients before
// clipping and the optimizer step, and take θ from rank 0 after a sync round.
// Communicator is what they need; ThreadCommunicator implements it for CPU ranks
// in one process (so the logic is tested without GPUs), the NCCL one for GPUs
// (engine/gpu_backend.cu).
#pragma once
#include <cstddef>
#include <memory>
#include <span>

namespace spes {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int size() const = 0;
  // Called by every rank, each from its own thread, with its own buffer of the same
  // length: afterwards every buffer holds the element-wise mean (the same bits on
  // every rank).
  virtual void all_reduce_mean(int rank, std::span<float> data) = 0;
  // Every rank's buffer receives root's bytes.
  virtual void broadcast(int rank, std::span<std::byte> data, int root) = 0;
  // A rank failed: every rank waiting in (or later entering) a collective gets an
  // Error instead of waiting forever. Callable from any thread.
  virtual void abort() = 0;
};

// Ranks are threads of this process and buffers host memory. The mean is summed in
// rank order (deterministic whatever the thread timing); each rank reduces one
// slice of the elements into every buffer.
std::unique_ptr<Communicator> make_thread_communicator(int ranks);

}  // namespace spes
