// NCCL for one rank on the emulated device (tests/emu/runtime_emu.cpp): what the
// data-parallel backend's NcclCommunicator (engine/gpu_backend.cu) calls when a node
// runs on one GPU. With one rank an all-reduce (sum or average) and a broadcast leave
// the data as it is; the buffers must still be device memory, as NCCL requires. More
// ranks would need several emulated devices: refused (ncclInvalidUsage).
#include <nccl.h>

#include <cstring>
#include <string>

#include "tests/emu/emu.hpp"

namespace {

struct Comm {
  bool aborted = false;
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

// One rank's collective: sendbuff → recvbuff (in place: nothing to move).
ncclResult_t one_rank_copy(const char* op, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t type,
                           ncclComm_t comm) {
  if (comm == nullptr || reinterpret_cast<Comm*>(comm)->aborted) return ncclInvalidArgument;
  const size_t bytes = count * type_bytes(type);
  if (bytes == 0) return ncclSuccess;
  if (!emu::in_global_buffer(sendbuff, bytes) || !emu::in_global_buffer(recvbuff, bytes))
    emu::fail(std::string(op) + ": a buffer outside every device allocation");
  if (sendbuff != recvbuff) std::memmove(recvbuff, sendbuff, bytes);
  return ncclSuccess;
}

}  // namespace

ncclResult_t ncclGetVersion(int* version) {
  *version = NCCL_VERSION_CODE;  // the headers' version: what the real library would report
  return ncclSuccess;
}

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  if (ndev != 1 || (devlist != nullptr && devlist[0] != 0)) return ncclInvalidUsage;
  comms[0] = reinterpret_cast<ncclComm_t>(new Comm);
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete reinterpret_cast<Comm*>(comm);
  return ncclSuccess;
}

// Frees the communicator, as NCCL's does: a later call with it is the caller's bug
// (the backend refuses collectives after abort()).
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  delete reinterpret_cast<Comm*>(comm);
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t) {
  if (op != ncclSum && op != ncclAvg) emu::fail("ncclAllReduce: only sum and avg are emulated");
  return one_rank_copy("ncclAllReduce", sendbuff, recvbuff, count, type, comm);
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t type, int root,
                           ncclComm_t comm, cudaStream_t) {
  if (root != 0) return ncclInvalidArgument;
  return one_rank_copy("ncclBroadcast", sendbuff, recvbuff, count, type, comm);
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclInvalidArgument: return "invalid argument (emulated NCCL)";
    case ncclInvalidUsage: return "invalid usage (emulated NCCL: one rank on device 0 only)";
    default: return "error (emulated NCCL)";
  }
}
