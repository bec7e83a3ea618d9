// The coordinator's round state machine (net/round) without sockets or clocks:
// transitions and their log lines, quorum with and without the timeout, min_nodes,
// stale / future / not-in-sync pushes, idempotent resends, an early PushDone,
// membership changes, and a timer that fires after its round closed.
#include <doctest/doctest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "net/round.hpp"

using namespace spes::net;

namespace {

// Grid of 4 chunks: chunk 0 is shared (everyone pushes it); node p also owns chunk 1 + p.
RoundRules rules(int n_nodes, int min_nodes) {
  RoundRules r;
  r.n_nodes = n_nodes;
  r.min_nodes = min_nodes;
  r.round_timeout_s = 30;
  r.n_chunks = 1 + n_nodes;
  for (int p = 0; p < n_nodes; ++p) r.node_chunks.push_back({0, 1 + p});
  return r;
}

struct Fixture {
  std::vector<std::string> lines;
  RoundMachine m;
  Fixture(int n_nodes, int min_nodes, int64_t completed = 0)
      : m(rules(n_nodes, min_nodes), completed, [this](const std::string& s) { lines.push_back(s); }) {
    for (int p = 0; p < n_nodes; ++p) REQUIRE(m.node_joined(p, completed, true));
  }
  bool logged(const std::string& s) const {
    for (const auto& l : lines)
      if (l == s) return true;
    return false;
  }
  // Every owned chunk, each passing the checks the glue makes first; returns the
  // decision of the first chunk (it may arm the timer).
  RoundDecision push_chunks(int node, uint32_t crc_seed = 0) {
    RoundDecision first;
    bool have_first = false;
    for (int c : {0, 1 + node}) {
      REQUIRE(m.check_push(node, m.open_round()).ok());
      REQUIRE(m.owns(node, c));
      const uint32_t crc = crc_seed + 100 * uint32_t(node) + uint32_t(c);
      REQUIRE(m.check_chunk(node, c, crc) == ChunkCheck::fresh);
      RoundDecision d = m.on_chunk(node, c, crc);
      CHECK(d.refuse.empty());
      if (!have_first) first = d, have_first = true;
    }
    return first;
  }
  RoundDecision done(int node) {
    REQUIRE(m.check_push(node, m.open_round()).ok());
    return m.on_push_done(node);
  }
};

}  // namespace

TEST_CASE("round: waiting -> collecting -> merging -> publishing -> waiting, each transition logged") {
  Fixture f(2, 2);
  CHECK(f.lines.empty());  // waiting
  CHECK(f.m.open_round() == 1);

  const RoundDecision first = f.push_chunks(1);
  REQUIRE(first.arm_timer);
  CHECK(*first.arm_timer == 1);
  CHECK(f.logged("round 1: waiting -> collecting (first push, from node 1)"));
  // Later chunks do not re-arm the timer.
  CHECK_FALSE(f.push_chunks(0).arm_timer);

  CHECK_FALSE(f.done(0).close);
  CHECK(f.lines.size() == 1);  // still collecting
  const RoundDecision d = f.done(1);
  REQUIRE(d.close);
  CHECK(d.close->round == 1);
  CHECK(d.close->participants == 2);
  CHECK(d.close->missing == "");
  CHECK(d.close->why == "all 2 nodes pushed");
  CHECK(f.m.open_round() == 1);  // not completed before it is published
  CHECK(f.logged("round 1: collecting -> merging (all 2 nodes pushed)"));

  const std::vector<int> to = f.m.publish("2 recipient(s)");
  CHECK(to == std::vector<int>{0, 1});
  CHECK(f.m.open_round() == 2);
  CHECK(f.logged("round 1: merging -> publishing (2 recipient(s))"));

  f.m.next_round();
  CHECK(f.m.open_round() == 2);
  CHECK(f.m.done_count() == 0);
  CHECK(f.logged("round 2: publishing -> waiting (round 1 published)"));
  CHECK(f.lines.size() == 4);
  // The recipients hold round 1 now: their next pushes count.
  CHECK(f.m.check_push(0, 2).ok());
}

TEST_CASE("round: quorum after the timeout needs min_nodes; without the timeout it needs every node") {
  Fixture f(3, 2);
  REQUIRE(f.push_chunks(0).arm_timer == 1);
  CHECK_FALSE(f.done(0).close);  // 1 of 3, no timeout
  // Timer with 1 done < min_nodes 2: logged, the round stays open.
  CHECK_FALSE(f.m.on_timer(1).close);
  CHECK(f.logged("round 1: timeout after 30.0 s with 1 of 3 nodes done (min_nodes 2)"));
  // Node 2 pushed chunks but never PushDone.
  f.push_chunks(2);
  // The second PushDone reaches the quorum: closes at once, node 2 missing.
  f.push_chunks(1);
  const RoundDecision d = f.done(1);
  REQUIRE(d.close);
  CHECK(d.close->participants == 2);
  CHECK(d.close->missing == "2");
  CHECK(d.close->why == "timeout, quorum 2 of 3");
  CHECK(f.m.publish("2 recipient(s)") == std::vector<int>{0, 1});
  f.m.next_round();
  // Node 2 missed round 1: it no longer holds the completed θ.
  CHECK(f.m.check_push(2, 2).check == PushCheck::must_snapshot);
  // Round 2 starts without round 1's timeout: two of three nodes done is no quorum yet.
  f.push_chunks(0);
  f.done(0);
  f.push_chunks(1);
  CHECK_FALSE(f.done(1).close);
}

TEST_CASE("round: min_nodes = n_nodes waits for everyone even after the timeout; min_nodes is clamped") {
  {
    Fixture f(2, 2);
    f.push_chunks(0);
    f.done(0);
    CHECK_FALSE(f.m.on_timer(1).close);
    f.push_chunks(1);
    const RoundDecision d = f.done(1);
    REQUIRE(d.close);
    CHECK(d.close->why == "all 2 nodes pushed");  // every node, not a timeout quorum
  }
  {
    Fixture f(2, 0);  // clamped to 1
    f.push_chunks(0);
    f.done(0);
    const RoundDecision d = f.m.on_timer(1);
    REQUIRE(d.close);
    CHECK(d.close->why == "timeout, quorum 1 of 2");
    CHECK(f.logged("round 1: timeout after 30.0 s with 1 of 2 nodes done (min_nodes 1)"));
  }
  {
    Fixture f(2, 9);  // clamped to 2
    f.push_chunks(0);
    f.done(0);
    CHECK_FALSE(f.m.on_timer(1).close);
    CHECK(f.logged("round 1: timeout after 30.0 s with 1 of 2 nodes done (min_nodes 2)"));
  }
}

TEST_CASE("round: a timer that fires after its round closed, or for an older round, changes nothing") {
  Fixture f(2, 1);
  for (int p = 0; p < 2; ++p) f.push_chunks(p);
  f.done(0);
  REQUIRE(f.done(1).close);  // closed by "everyone pushed" before the timer
  f.m.publish("2 recipient(s)");
  f.m.next_round();
  const size_t logged = f.lines.size();
  // Round 1's timer fires late: waiting for round 2, nothing happens.
  RoundDecision d = f.m.on_timer(1);
  CHECK_FALSE(d.close);
  CHECK(f.lines.size() == logged);
  // Round 2 collecting, round 1's timer again: still ignored; round 2's own timer closes it.
  REQUIRE(f.push_chunks(0).arm_timer == 2);
  f.done(0);
  CHECK_FALSE(f.m.on_timer(1).close);
  d = f.m.on_timer(2);
  REQUIRE(d.close);
  CHECK(d.close->round == 2);
  CHECK(d.close->missing == "1");
  // A timer during merging (the glue cancels it, but a fired handler may still run).
  CHECK_FALSE(f.m.on_timer(2).close);
}

TEST_CASE("round: stale pushes are refused and counted; pushes for a future round are bad pushes") {
  Fixture f(2, 1);
  for (int p = 0; p < 2; ++p) f.push_chunks(p), f.done(p);
  f.m.publish("2 recipient(s)");
  f.m.next_round();  // round 1 completed, round 2 open

  PushVerdict v = f.m.check_push(0, 1);
  CHECK(v.check == PushCheck::stale);
  CHECK(v.reason == "stale round: round 1 is closed (coordinator at round 1); resync from a snapshot");
  CHECK(f.m.check_push(1, 0).check == PushCheck::stale);
  v = f.m.check_push(0, 3);
  CHECK(v.check == PushCheck::future);
  CHECK(v.reason == "push for round 3 but the open round is 2");
  // The two stale pushes appear in round 2's row; the future one does not.
  f.push_chunks(0);
  CHECK_FALSE(f.done(0).close);
  const RoundDecision d = f.m.on_timer(2);
  REQUIRE(d.close);
  CHECK(d.close->late_pushes == 2);
  f.m.publish("1 recipient(s)");
  f.m.next_round();
  // ... and are forgotten for round 3.
  f.push_chunks(0);
  f.done(0);
  const RoundDecision d3 = f.m.on_timer(3);
  REQUIRE(d3.close);
  CHECK(d3.close->late_pushes == 0);
}

TEST_CASE("round: resent chunks are idempotent; a resend with another checksum is a conflict") {
  Fixture f(2, 1);
  f.push_chunks(0);
  CHECK(f.m.check_chunk(0, 0, 0) == ChunkCheck::duplicate);     // crc of node 0, chunk 0
  CHECK(f.m.check_chunk(0, 1, 1) == ChunkCheck::duplicate);     // crc of node 0, chunk 1
  CHECK(f.m.check_chunk(0, 1, 999) == ChunkCheck::conflict);
  CHECK(f.m.check_chunk(1, 0, 100) == ChunkCheck::fresh);       // node 1 has sent nothing
  // Even if the glue passed a resend on, it is not counted twice.
  CHECK(f.m.on_chunk(0, 1, 1).refuse.empty());
  CHECK(f.m.on_chunk(0, 1, 999).refuse == "resent chunk differs from the first push");
  // Two chunks, not three: PushDone is accepted.
  const RoundDecision d = f.done(0);
  CHECK(d.refuse.empty());
  CHECK(f.m.done_count() == 1);
}

TEST_CASE("round: PushDone before every owned chunk arrived is refused and the node is not done") {
  Fixture f(2, 1);
  REQUIRE(f.m.check_push(0, 1).ok());
  REQUIRE(f.m.on_chunk(0, 0, 7).arm_timer == 1);
  const RoundDecision d = f.done(0);
  CHECK(d.refuse == "PushDone after 1 of 2 chunks");
  CHECK_FALSE(d.close);
  CHECK(f.m.done_count() == 0);
  // Even after a timeout: no participant, no quorum.
  CHECK_FALSE(f.m.on_timer(1).close);
  // A PushDone with no chunk at all.
  CHECK(f.done(1).refuse == "PushDone after 0 of 2 chunks");
}

TEST_CASE("round: chunk ownership") {
  Fixture f(3, 1);
  CHECK(f.m.owns(0, 0));
  CHECK(f.m.owns(0, 1));
  CHECK_FALSE(f.m.owns(0, 2));  // node 1's expert chunk
  CHECK(f.m.owns(2, 3));
  CHECK_FALSE(f.m.owns(2, 4));  // outside the grid
  CHECK_FALSE(f.m.owns(2, -1));
}

TEST_CASE("round: a node that does not hold the completed θ must snapshot before its pushes count") {
  std::vector<std::string> lines;
  RoundMachine m(rules(2, 1), 4, [&](const std::string& s) { lines.push_back(s); });
  CHECK(m.open_round() == 5);
  // Before joining, and after joining behind (round 3) or with another state hash.
  CHECK(m.check_push(0, 5).check == PushCheck::must_snapshot);
  CHECK_FALSE(m.node_joined(0, 3, true));
  CHECK_FALSE(m.node_joined(1, 4, false));
  const PushVerdict v = m.check_push(0, 5);
  CHECK(v.check == PushCheck::must_snapshot);
  CHECK(v.reason == "node does not hold round 4's state; resync from a snapshot");
  CHECK(m.check_push(1, 5).check == PushCheck::must_snapshot);
  // A snapshot of round 4 brings it in sync.
  m.node_snapshot(0);
  CHECK(m.check_push(0, 5).ok());
  // Rejoining in sync works directly.
  CHECK(m.node_joined(1, 4, true));
  CHECK(m.check_push(1, 5).ok());
  // A node that leaves forgets what it held: a new connection says again.
  m.node_left(1);
  CHECK(m.check_push(1, 5).check == PushCheck::must_snapshot);
  CHECK(lines.empty());  // membership changes are the glue's log lines, not transitions
}

TEST_CASE("round: a node that left after its PushDone is a participant but gets no result") {
  Fixture f(2, 2);
  for (int p = 0; p < 2; ++p) f.push_chunks(p);
  f.done(0);
  f.m.node_left(0);  // its connection broke while waiting
  const RoundDecision d = f.done(1);
  REQUIRE(d.close);
  CHECK(d.close->participants == 2);  // its Δ was merged
  CHECK(f.m.publish("2 recipient(s)") == std::vector<int>{1});
  f.m.next_round();
  // Reconnecting with its old round, it is behind and takes a snapshot.
  CHECK_FALSE(f.m.node_joined(0, 0, true));
  CHECK(f.m.check_push(0, 2).check == PushCheck::must_snapshot);
}

TEST_CASE("round: the glue may not feed pushes between close and publish") {
  Fixture f(1, 1);
  f.push_chunks(0);
  REQUIRE(f.done(0).close);
  CHECK_THROWS_AS(f.m.check_push(0, 1), std::logic_error);
  CHECK_THROWS_AS(f.m.on_chunk(0, 0, 1), std::logic_error);
  CHECK_THROWS_AS(f.m.next_round(), std::logic_error);  // publish first
  f.m.publish("1 recipient(s)");
  CHECK_THROWS_AS(f.m.publish("again"), std::logic_error);
  f.m.next_round();
  CHECK(f.m.check_push(0, 2).ok());
}

TEST_CASE("round: a refused push is withdrawn; the node id may push afresh in the round") {
  Fixture f(3, 1);
  (void)f.m.on_chunk(0, 0, 11);
  (void)f.m.on_chunk(0, 1, 12);
  (void)f.m.on_chunk(1, 0, 13);
  CHECK(f.m.refuse_push(0) == std::vector<int>{0, 1});
  CHECK(f.logged("round 1: node 0's push refused as a whole (2 chunk(s) withdrawn)"));
  CHECK(f.m.refuse_push(0).empty());  // nothing left to withdraw
  CHECK(f.m.check_push(0, 1).ok());
  CHECK(f.m.check_chunk(0, 0, 99) == ChunkCheck::fresh);  // its got list is gone: no conflict
  CHECK(f.m.on_push_done(0).refuse == "PushDone after 0 of 2 chunks");
  f.push_chunks(0);
  CHECK(f.m.on_push_done(0).refuse.empty());
}
