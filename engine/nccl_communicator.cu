#include "engine/nccl_communicator.hpp"

#include <nccl.h>

#include <atomic>
#include <string>

#include "cuda/check.cuh"
#include "engine/base/error.hpp"

namespace spes {
namespace {

// The ranks of a node on their GPUs, in one process with one thread per rank
// (ncclCommInitAll). Rank r's collectives run on rank r's stream, then it waits for
// them: the rank's next kernels would be ordered after them anyway, and the host
// needs the reduced gradient norm right after.
class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const std::vector<int>& devices, const std::vector<cudaStream_t>& streams)
      : comms_(devices.size()), devices_(devices), streams_(streams) {
    // ncclAvg (the mean in one collective) came with NCCL 2.10; the library is the
    // machine's own, so an older one is named here rather than failing every step.
    int version = 0;
    nccl_check(ncclGetVersion(&version));
    if (version < NCCL_VERSION(2, 10, 0))
      throw Error("data parallel needs NCCL 2.10 or newer; this machine's libnccl is " + std::to_string(version));
    if (devices.size() != streams.size()) throw Error("NcclCommunicator: one stream per device");
    nccl_check(ncclCommInitAll(comms_.data(), int(devices_.size()), devices_.data()));
  }
  ~NcclCommunicator() override {
    if (aborted_) return;  // ncclCommAbort freed them
    for (ncclComm_t c : comms_) ncclCommDestroy(c);  // destructor path: nothing useful to do on error
  }
  // A rank failed: abort every communicator, which ends the collectives other ranks
  // wait in (their NCCL calls or stream syncs then fail and their threads return).
  void abort() override {
    if (aborted_.exchange(true)) return;
    for (ncclComm_t c : comms_) ncclCommAbort(c);  // error path: the run ends with the rank's own error
  }
  int size() const override { return int(comms_.size()); }
  void all_reduce_mean(int rank, std::span<float> data) override {
    cuda_check(cudaSetDevice(devices_[size_t(rank)]));
    refuse_if_aborted();
    nccl_check(ncclAllReduce(data.data(), data.data(), data.size(), ncclFloat, ncclAvg, comms_[size_t(rank)],
                             streams_[size_t(rank)]));
    cuda_check(cudaStreamSynchronize(streams_[size_t(rank)]));
  }
  void broadcast(int rank, std::span<std::byte> data, int root) override {
    cuda_check(cudaSetDevice(devices_[size_t(rank)]));
    refuse_if_aborted();
    nccl_check(ncclBroadcast(data.data(), data.data(), data.size(), ncclUint8, root, comms_[size_t(rank)],
                             streams_[size_t(rank)]));
    cuda_check(cudaStreamSynchronize(streams_[size_t(rank)]));
  }

 private:
  // abort() freed the communicators: a rank that reaches a collective afterwards
  // (one that had not yet got there, or push_theta's next buffer) gets an Error
  // instead of using a freed communicator.
  void refuse_if_aborted() const {
    if (aborted_) throw Error("data parallel: another rank failed; this collective was not run");
  }
  std::vector<ncclComm_t> comms_;
  std::vector<int> devices_;
  std::vector<cudaStream_t> streams_;
  std::atomic<bool> aborted_{false};
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<int>& devices,
                                                     const std::vector<CUstream_st*>& streams) {
  return std::make_unique<NcclCommunicator>(devices, streams);
}

}  // namespace spes
