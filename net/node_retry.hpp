// How a node gets through a round while the coordinator restarts, is busy, or
// cannot be reached: what each failed attempt means for the next one, and the
// exponential backoff with jitter between attempts, for up to retry_for_s a round.
// A restarted coordinator is picked up without user action: pushes are resent
// safely (idempotent per round and node).
#pragma once
#include <chrono>
#include <random>

#include "net/address.hpp"
#include "net/line_log.hpp"
#include "net/node_link.hpp"
#include "net/sync_client.hpp"

namespace spes::net {

class RoundRetry {
 public:
  RoundRetry(const SyncClientOptions& opt, int node, const HostPort& coordinator, const LineLog& log);

  // A round begins: the next backoff is the shortest, and retry_for_s counts from now.
  void begin_round();
  // After a failed attempt (its connection closed): returns when the next attempt
  // may start, at once or after a backoff; throws NetError when the failure is final.
  //   stale_round        at once: reconnecting finds the node behind, and it resyncs
  //   busy, timeout, duplicate_node, shutting_down, bad_frame, and any Transient:
  //                      after a backoff, until retry_for_s has passed (duplicate_node:
  //                      the node's previous connection may not be gone yet)
  //   another refusal    final: its secret, run id, fingerprint, codec... do not fit
  void after(const Refused& e);
  void after(const Transient& e);

 private:
  using Clock = std::chrono::steady_clock;
  void back_off(const char* why);
  std::string coordinator_name() const;
  const SyncClientOptions& opt_;
  const int node_;
  const HostPort& coordinator_;
  const LineLog& log_;
  std::mt19937_64 rng_;
  Clock::time_point give_up_{};
  int attempt_ = 0;
};

}  // namespace spes::net
