// Resyncing a node that is behind — it restarted from an older checkpoint, its
// push came after the round closed ("stale round"), or its θ failed a state hash:
// params become the coordinator's θ of its completed round and the local work since
// the node's own round is dropped.
//
// Changed-only when params still hold θ of the held round outside the owned ranges
// (and base inside): the coordinator then sends only the chunks changed since, so
// the experts of nodes that missed rounds do not travel. A wrong guess shows in the
// state hash; force_snapshot stays set, so the next attempt asks for everything.
#pragma once
#include <cstdint>

#include "net/line_log.hpp"
#include "net/node_link.hpp"
#include "net/node_state.hpp"
#include "net/sync_client.hpp"

namespace spes::net {

class SnapshotReceiver {
 public:
  SnapshotReceiver(NodeLink& link, const SyncClientParams& node, const LineLog& log)
      : link_(link), node_(node), log_(log) {}

  // Asks for the coordinator's θ and takes it: held becomes its round with a zero
  // error feedback; report gets the round, its hash and resynced, and stop when that
  // round ended the run and is the one after the node's own (it missed that round's
  // result; a node further behind, resumed from an older checkpoint, goes on).
  // Throws NetError (final) when the coordinator is behind this node; Transient on a
  // bad snapshot. A coordinator rolled back (rolled_back_to ≥ 0) below this node's
  // round is an operator's decision, not a lost state: the node takes its snapshot.
  void resync(const NodeGrid& grid, int64_t coordinator_round, HeldRound& held, float* params, RoundReport& report,
              int64_t rolled_back_to = -1);

 private:
  void refuse_reset_if_ahead(int64_t coordinator_round, const HeldRound& held, int64_t rolled_back_to);
  NodeLink& link_;
  const SyncClientParams& node_;
  const LineLog& log_;
};

}  // namespace spes::net
