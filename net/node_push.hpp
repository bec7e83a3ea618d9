// Pushing a round: for each owned chunk, Δ = params − base (+ the lossy codecs'
// error feedback) encoded into a PushChunk frame, then PushDone. Chunks are
// idempotent per (round, node), so a push cut short is simply sent again.
//
// Encoding costs more than sending, so it runs on `threads` threads, one chunk each,
// a bank of frames ahead of the socket: while this thread sends bank b, the workers
// build bank b^1. Small chunks (tests, tiny models) are encoded inline: a thread
// costs more than they do.
#pragma once
#include <array>
#include <cstdint>
#include <vector>

#include "net/frame.hpp"
#include "net/node_link.hpp"
#include "net/node_state.hpp"
#include "net/sync_client.hpp"

namespace spes::net {

class PushPipeline {
 public:
  PushPipeline(NodeLink& link, const SyncClientParams& node, int threads);

  // Pushes round held.round + 1 from params at optimizer step `step`; the error
  // feedback it leaves goes to held.pending; PushDone carries `figures` and `ask_stop`
  // (the node asks the run to end at this round). Throws NetError (final) when a
  // chunk holds a non-finite value, before that chunk is sent.
  void push(const NodeGrid& grid, HeldRound& held, const float* params, int64_t step, const TrainFigures& figures,
            bool ask_stop);

 private:
  void write(const FrameView& v);
  NodeLink& link_;
  const SyncClientParams& node_;
  const int threads_;
  std::array<std::vector<FrameWriter>, 2> banks_;  // a frame writer per thread, twice
};

}  // namespace spes::net
