#include "net/node_snapshot.hpp"

#include <algorithm>
#include <cinttypes>
#include <cstring>

#include "net/digest.hpp"

namespace spes::net {

void SnapshotReceiver::resync(const NodeGrid& grid, int64_t coordinator_round, HeldRound& held, float* params,
                              RoundReport& report, int64_t rolled_back_to) {
  refuse_reset_if_ahead(coordinator_round, held, rolled_back_to);
  const int64_t syncing_to = held.round + 1;
  const bool partial = !held.force_snapshot;  // after a failed snapshot it stays set: everything next time
  link_.write(FrameWriter(256).snapshot_request(partial ? held.round : -1));
  if (partial) node_.space.scatter(held.base.data(), params);  // θ of our round: the local work is dropped
  held.force_snapshot = true;  // params are overwritten from here on
  uint32_t got = 0;
  for (;;) {
    const wire::Envelope* env = link_.read(kMaxFrameBytes, link_.io_timeout_s());
    if (env->msg_type() == wire::Message_SnapshotChunk) {
      const auto* m = env->msg_as_SnapshotChunk();
      const int c = grid.grid.find(m->begin(), m->end());
      if (c < 0 || vec_size(m->payload()) != size_t(m->end() - m->begin()) * 4 ||
          crc32c(m->payload()->data(), vec_size(m->payload())) != m->checksum())
        throw Transient("bad snapshot chunk from the coordinator");
      std::memcpy(params + m->begin(), m->payload()->data(), vec_size(m->payload()));
      ++got;
      continue;
    }
    if (env->msg_type() != wire::Message_SnapshotDone) throw Transient("unexpected message during a snapshot");
    const auto* d = env->msg_as_SnapshotDone();
    const uint64_t h = state_hash(params, node_.layout.total);
    if ((!partial && got != grid.grid.chunks.size()) || d->chunks() != got || h != d->state_hash())
      throw Transient("snapshot incomplete or its hash does not match");
    held.round = d->round();
    node_.space.gather(params, held.base.data());
    std::fill(held.residual.begin(), held.residual.end(), 0.0f);
    held.force_snapshot = false;
    report.round = held.round;
    report.state_hash = h;
    report.resynced = true;
    report.stop = d->stop() && held.round == syncing_to;
    log_("resynced from a snapshot of round %" PRId64 " (%u of %zu chunks, state %s)%s", held.round, got,
         grid.grid.chunks.size(), hash_hex(h).c_str(),
         report.stop ? "; that round ended the run, and this node stops there too" : "");
    return;
  }
}

// A coordinator behind this node lost rounds the node has seen (restored from an
// old state, or restarted --fresh): its snapshot would silently reset the node.
// The node stops instead, θ and round untouched, so the operator can restart the
// coordinator from the right state (or start a new run on purpose).
void SnapshotReceiver::refuse_reset_if_ahead(int64_t coordinator_round, const HeldRound& held,
                                             int64_t rolled_back_to) {
  if (coordinator_round >= held.round) return;
  if (rolled_back_to >= 0 && held.round > rolled_back_to) {
    log_("node %d holds round %" PRId64 "; the coordinator was rolled back to round %" PRId64
         " (--rollback-to): taking its θ",
         node_.node_id, held.round, rolled_back_to);
    return;
  }
  link_.disconnect();
  throw NetError("node " + std::to_string(node_.node_id) + " holds round " + std::to_string(held.round) +
                 ", ahead of the coordinator at round " + std::to_string(coordinator_round) +
                 " (it lost published rounds: restarted from an old state or with --fresh?); refusing to be reset "
                 "to an older θ; restart the coordinator from this run's state, or start a new run (no --resume)");
}

}  // namespace spes::net
