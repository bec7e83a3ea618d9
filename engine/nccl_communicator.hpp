// The Communicator of a node's GPU ranks (engine/communicator.hpp), over NCCL: one
// process, one thread per rank, each rank's collectives on its own stream.
#pragma once
#include <memory>
#include <vector>

#include "engine/communicator.hpp"

struct CUstream_st;

namespace spes {

// devices[r] and streams[r]: rank r's CUDA device and the stream its kernels run on.
std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<int>& devices,
                                                     const std::vector<CUstream_st*>& streams);

}  // namespace spes
