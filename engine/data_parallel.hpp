// A node with several devices: DataParallelBackend is a TrainBackend
// over G rank backends (one per GPU, or CPU ranks in tests), each driven by its own
// thread. The trainer sees one backend: a micro-batch of B sequences is split into
// G slices of B/G, one per rank; before the gradient norm the ranks' owned
// gradients are averaged (Communicator), so every rank clips and updates the same
// way and holds bit-identical parameters; θ for sync rounds and checkpoints is
// rank 0's, and after it changes it is broadcast to every rank.
#pragma once
#include <memory>
#include <vector>

#include "engine/backend.hpp"
#include "engine/communicator.hpp"

namespace spes {

// ranks[r] runs slices of micro_batch / G sequences (micro_batch must divide).
std::unique_ptr<TrainBackend> make_data_parallel_backend(std::vector<std::unique_ptr<RankBackend>> ranks,
                                                         std::unique_ptr<Communicator> comm, int64_t micro_batch,
                                                         int64_t seq_len);

}  // namespace spes
