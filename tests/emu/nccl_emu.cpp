// NCCL on the emulated devices (tests/emu/runtime_emu.cpp): what the data-parallel
// backend's NcclCommunicator (engine/gpu_backend.cu) calls, one host thread per rank
// (ncclCommInitAll). A collective is a rendezvous: each rank's call waits until every
// rank of the communicator has called, the last one to arrive computes the result
// for all (into every recvbuff, from every sendbuff as they were at the rendezvous),
// and then all return — the stream has nothing left to wait for. The sum runs in rank
// order in float, the average divides the sum by the rank count; NCCL documents
// neither order, so callers may rely on neither (the ranks all get the same bits,
// which NCCL does guarantee). Buffers must be device memory, as NCCL requires.
#include <nccl.h>

#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tests/emu/emu.hpp"

namespace {

// The ranks of one ncclCommInitAll, and the collective they are meeting in.
struct Clique {
  explicit Clique(int n) : send(size_t(n)), recv(size_t(n)) {}
  std::mutex mutex;
  std::condition_variable done;
  std::vector<const void*> send;
  std::vector<void*> recv;
  int arrived = 0;
  uint64_t generation = 0;  // collectives completed
  bool aborted = false;
};

struct Comm {
  std::shared_ptr<Clique> clique;
  int rank;
};

size_t type_bytes(ncclDataType_t type) {
  switch (type) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: emu::fail("NCCL: data type " + std::to_string(int(type)) + " is not emulated");
  }
}

// Rank `comm`'s part of one collective over `bytes` bytes: registers its buffers,
// waits for the others; the last rank to arrive runs `combine` over all of them.
template <class Combine>
ncclResult_t rendezvous(const char* op, const void* sendbuff, void* recvbuff, size_t bytes, ncclComm_t handle,
                        Combine combine) {
  if (handle == nullptr) return ncclInvalidArgument;
  Comm& comm = *reinterpret_cast<Comm*>(handle);
  emu::require_device_buffer(sendbuff, bytes, std::string(op) + ", sendbuff");
  emu::require_device_buffer(recvbuff, bytes, std::string(op) + ", recvbuff");
  // Held here: another rank's ncclCommAbort may free this rank's Comm while it waits.
  const std::shared_ptr<Clique> keep = comm.clique;
  Clique& c = *keep;
  std::unique_lock lock(c.mutex);
  if (c.aborted) return ncclInvalidUsage;
  c.send[size_t(comm.rank)] = sendbuff;
  c.recv[size_t(comm.rank)] = recvbuff;
  if (++c.arrived == int(c.send.size())) {
    if (bytes != 0) combine(c);
    c.arrived = 0;
    ++c.generation;
    c.done.notify_all();
    return ncclSuccess;
  }
  const uint64_t generation = c.generation;
  c.done.wait(lock, [&] { return c.generation != generation || c.aborted; });
  return c.generation != generation ? ncclSuccess : ncclSystemError;
}

}  // namespace

ncclResult_t ncclGetVersion(int* version) {
  *version = NCCL_VERSION_CODE;  // the headers' version: what the real library would report
  return ncclSuccess;
}

// One communicator per device of devlist, all in this process (NCCL refuses a device
// listed twice, and so does this).
ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  if (ndev < 1 || ndev > emu::kDevices) return ncclInvalidArgument;
  for (int i = 0; i < ndev; ++i) {
    const int d = devlist ? devlist[i] : i;
    if (d < 0 || d >= emu::kDevices) return ncclInvalidArgument;
    for (int j = 0; j < i; ++j)
      if (devlist && devlist[j] == d) return ncclInvalidUsage;
  }
  auto clique = std::make_shared<Clique>(ndev);
  for (int r = 0; r < ndev; ++r) comms[r] = reinterpret_cast<ncclComm_t>(new Comm{clique, r});
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete reinterpret_cast<Comm*>(comm);
  return ncclSuccess;
}

// Ends the collectives other ranks wait in (they fail), then frees the communicator,
// as NCCL's does: a later call with it is the caller's bug (the backend refuses
// collectives after abort()).
ncclResult_t ncclCommAbort(ncclComm_t handle) {
  auto* comm = reinterpret_cast<Comm*>(handle);
  {
    std::lock_guard lock(comm->clique->mutex);
    comm->clique->aborted = true;
  }
  comm->clique->done.notify_all();
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t) {
  if (op != ncclSum && op != ncclAvg) emu::fail("ncclAllReduce: only sum and avg are emulated");
  if (type != ncclFloat32) emu::fail("ncclAllReduce: only float is emulated");
  return rendezvous("ncclAllReduce", sendbuff, recvbuff, count * sizeof(float), comm, [&](Clique& c) {
    std::vector<float> result(count, 0.0f);
    for (const void* s : c.send)
      for (size_t i = 0; i < count; ++i) result[i] += static_cast<const float*>(s)[i];
    if (op == ncclAvg)
      for (float& x : result) x /= float(c.send.size());
    for (void* r : c.recv) std::memcpy(r, result.data(), count * sizeof(float));
  });
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t type, int root,
                           ncclComm_t comm, cudaStream_t) {
  const size_t bytes = count * type_bytes(type);
  return rendezvous("ncclBroadcast", sendbuff, recvbuff, bytes, comm, [&](Clique& c) {
    if (root < 0 || root >= int(c.send.size())) emu::fail("ncclBroadcast: root outside the communicator");
    for (size_t r = 0; r < c.recv.size(); ++r)
      if (c.recv[r] != c.send[size_t(root)]) std::memmove(c.recv[r], c.send[size_t(root)], bytes);
  });
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclInvalidArgument: return "invalid argument (emulated NCCL)";
    case ncclInvalidUsage: return "invalid usage (emulated NCCL)";
    case ncclSystemError: return "the communicator was aborted (emulated NCCL)";
    default: return "error (emulated NCCL)";
  }
}
