// The coordinator's round state machine (README, Architecture: Sync round), after
// PCCL's explicit states and transitions: pure — no sockets, no Asio, no clock. The
// glue (net/coordinator.cpp) feeds it events and acts on the decisions it returns;
// every transition is logged through the LineSink it is given.
//
//   waiting    no accepted push yet for the open round r = completed + 1
//   collecting a first chunk was accepted: the glue arms the round timer; chunks
//              and PushDones accumulate
//   merging    every node sent PushDone, or the timer fired and ≥ min_nodes had:
//              the glue merges, hashes and persists θ (on_push_done / on_timer
//              return the RoundClose)
//   publishing publish(): r is the completed round; the nodes waiting for it get it
//   waiting    next_round(): r + 1 opens
//
// Membership is explicit, by node id: node_joined (authenticated; in sync when it
// holds the completed round's θ), node_snapshot (it is being sent that θ),
// node_left. A node's pushes count only while it holds the completed round's θ —
// a Δ against any other θ would be merged against the wrong base.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "net/line_log.hpp"

namespace spes::net {

enum class RoundPhase { waiting, collecting, merging, publishing };

struct RoundRules {
  int n_nodes = 1;
  int min_nodes = 1;                          // quorum after the timeout (clamped to 1..n_nodes)
  double round_timeout_s = 600;               // only logged here: the glue owns the timer
  std::vector<std::vector<int>> node_chunks;  // per node id: the grid chunks it owns and pushes
  int n_chunks = 0;                           // chunks in the grid
};

// Where a push (chunk or PushDone) for round r stands.
enum class PushCheck {
  ok,
  stale,          // r ≤ the completed round: closed; the node resyncs from a snapshot
  future,         // r > the open round: a bad push
  must_snapshot,  // the node does not hold the completed round's θ
};
struct PushVerdict {
  PushCheck check = PushCheck::ok;
  std::string reason;  // the refusal's plain reason when not ok
  bool ok() const { return check == PushCheck::ok; }
};

enum class ChunkCheck { fresh, duplicate, conflict };  // conflict: resent with another checksum

// A round that just closed (collecting → merging): what the glue merges and reports.
struct RoundClose {
  int64_t round = 0;        // its step is the coordinator's (round × sync_steps), not the nodes'
  int participants = 0;     // nodes that sent PushDone
  std::string missing;      // the others, "1;3"
  int64_t late_pushes = 0;  // stale pushes refused while this round was open
  std::string why;
};

// What the glue does after an event.
struct RoundDecision {
  std::string refuse;                   // non-empty: a bad push; refuse the node with this reason
  std::optional<int64_t> arm_timer;     // start the round timer (round_timeout_s) for this round
  std::optional<RoundClose> close;      // the round closed: merge and persist it, then publish()
};

class RoundMachine {
 public:
  // completed_round: the round θ holds at start (0 for a fresh run, else the persisted one).
  RoundMachine(RoundRules rules, int64_t completed_round, LineSink log = {});

  int64_t open_round() const { return completed_ + 1; }
  int done_count() const;

  // ---- membership -------------------------------------------------------------
  // Node authenticated holding θ of node_round; hash_matches: its state hash equals
  // the coordinator's. Returns whether it is in sync (else it must take a snapshot).
  bool node_joined(int node, int64_t node_round, bool hash_matches);
  void node_snapshot(int node);  // it is being sent θ of the completed round
  void node_left(int node);      // its pushes so far stay in the round; it gets no result

  // ---- pushes ------------------------------------------------------------------
  // Checked first for every PushChunk and PushDone; stale ones count as late pushes.
  PushVerdict check_push(int node, int64_t round);
  bool owns(int node, int chunk) const;
  // Before decoding a chunk: new, an identical resend (idempotent: ignore it), or a
  // resend that differs from the first push.
  ChunkCheck check_chunk(int node, int chunk, uint32_t crc) const;
  // A chunk decoded and accepted into the merge (precondition: check_push ok and
  // check_chunk fresh). The first one of a round starts collecting.
  RoundDecision on_chunk(int node, int chunk, uint32_t crc);
  // A bad push is refused as a whole: returns the chunks `node` pushed into the open
  // round (the glue withdraws them from the merge) and forgets them, so that a later
  // push of this node id in the round (a reconnect, or the real node after a
  // hostile connection with its credentials) starts afresh.
  std::vector<int> refuse_push(int node);
  // Precondition: check_push ok. Refused unless every owned chunk arrived; may close.
  RoundDecision on_push_done(int node);
  // The timer armed for `round` fired. Ignored when that round is no longer collecting.
  RoundDecision on_timer(int64_t round);

  // ---- closing -------------------------------------------------------------------
  // merging → publishing: the round is completed; returns the nodes waiting for its
  // result (they now hold it). `recipients_note` is logged with the transition.
  std::vector<int> publish(const std::string& recipients_note);
  // publishing → waiting: forget the round's pushes; the next round opens.
  void next_round();

 private:
  struct Node {
    int64_t synced_round = -1;  // the round whose θ it holds (or is being sent); -1 = unknown
    int64_t awaiting = 0;       // round whose result it waits for (0 = none)
    std::vector<uint8_t> got;   // this round: chunks received
    std::vector<uint32_t> crc;
    int got_n = 0;
    bool done = false;
  };

  void set_phase(RoundPhase p, int64_t round, const std::string& why);
  void expect_open(const char* event) const;
  std::optional<RoundClose> maybe_close();
  void log(const std::string& s) const {
    if (log_) log_(s);
  }

  RoundRules rules_;
  LineSink log_;
  RoundPhase phase_ = RoundPhase::waiting;
  int64_t completed_ = 0;
  bool timed_out_ = false;
  int64_t late_ = 0;
  std::vector<Node> nodes_;
  std::vector<std::vector<uint8_t>> owns_;  // [node][chunk]
};

}  // namespace spes::net
