// Receiving a round's result: RoundChunks — only the chunks that changed, each
// θ_new − θ_old in the run's codec, in ascending order — then RoundDone with the
// participants, α and the state hash of θ_new.
//
// params start as θ_old: the held round's θ, with base over the owned ranges (the
// local work has been pushed). Each chunk is applied on a helper thread while the
// next one is read, and since chunks come in order, θ is final up to each chunk's
// end: it is hashed as it comes, and base is refreshed from the owned chunks as
// they land. Applied that way params are bit-identical to the coordinator's θ, which
// the hash in RoundDone proves.
#pragma once
#include <array>

#include "net/frame.hpp"
#include "net/line_log.hpp"
#include "net/node_link.hpp"
#include "net/node_state.hpp"
#include "net/sync_client.hpp"

namespace spes::net {

class ResultReceiver {
 public:
  ResultReceiver(NodeLink& link, const SyncClientParams& node, int threads, const LineLog& log)
      : link_(link), node_(node), threads_(threads), log_(log) {}

  // Waits for round held.round + 1 and applies it to params; held then holds that
  // round (its error feedback is the push's). report gets the round, its hash, the
  // participants, α, and the wait and receive times. Transient when anything is
  // missing or malformed, or the hash differs (force_snapshot is then set).
  void receive(const NodeGrid& grid, HeldRound& held, float* params, RoundReport& report);

 private:
  NodeLink& link_;
  const SyncClientParams& node_;
  const int threads_;
  const LineLog& log_;
  std::array<RecvBuffer, 2> rx_;  // a chunk is applied from one while the next is read into the other
};

}  // namespace spes::net
