// Sync rounds over loopback: nodes and coordinator agree bit for bit (state
// hashes), the merge rules match an independent computation, one node owning
// everything equals local training, and the faults of issue 3 (a node killed
// mid-round, a restarted node, a restarted coordinator) leave a consistent run.
#include <doctest/doctest.h>

#include <cmath>

#include "engine/base/error.hpp"
#include "engine/commands.hpp"
#include "model/hf_export.hpp"
#include "net/streaming_merge.hpp"
#include "model/expert_merge.hpp"
#include "net/state_file.hpp"
#include "net_test_util.hpp"

using namespace spes;
using namespace spes::net;
using namespace spes::net::testing;

namespace {

// θ_new the merge rules give for fp32 pushes: shared = mean over all nodes,
// expert e = mean over its owners (double sum, rounded once).
std::vector<float> expected_merge(const std::vector<std::unique_ptr<TestNode>>& nodes, const std::vector<float>& theta_old,
                                  const std::vector<int>& participants) {
  const TestNode& n0 = *nodes[0];
  std::vector<float> out = theta_old;
  std::vector<double> sum(out.size(), 0.0);
  std::vector<int> count(out.size(), 0);
  for (int p : participants)
    for (const Range& r : nodes[p]->own.space.ranges())
      for (int64_t i = r.begin; i < r.end; ++i) sum[i] += double(nodes[p]->params[i]), ++count[i];
  for (size_t i = 0; i < out.size(); ++i)
    if (count[i]) out[i] = float(sum[i] / count[i]);
  (void)n0;
  return out;
}

void check_all_equal(const std::vector<std::unique_ptr<TestNode>>& nodes, const std::vector<RoundReport>& st,
                     const CoordThread& co) {
  const uint64_t h = co.c->stats().state_hash;
  for (size_t i = 0; i < nodes.size(); ++i) {
    CHECK(st[i].state_hash == h);
    CHECK(state_hash(nodes[i]->params.data(), int64_t(nodes[i]->params.size())) == h);
    CHECK(std::memcmp(nodes[i]->params.data(), nodes[0]->params.data(), nodes[0]->params.size() * 4) == 0);
  }
}

}  // namespace

TEST_CASE("sync: 4 nodes x 3 rounds, fp32: hashes agree and θ follows the merge rules (experts bitwise, shared within 4 ulps)") {
  const Config cfg = tiny_config(4, Codec::fp32);
  CoordThread co(cfg);
  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int p = 0; p < 4; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
  std::vector<float> theta = nodes[0]->params;
  for (int r = 1; r <= 3; ++r) {
    for (auto& n : nodes) n->train();
    const auto expect = expected_merge(nodes, theta, {0, 1, 2, 3});
    const int64_t shared = nodes[0]->layout.shared_count;
    std::vector<double> mag(size_t(shared), 0.0);  // largest value added, per shared param
    for (const auto& n : nodes)
      for (int64_t i = 0; i < shared; ++i) mag[size_t(i)] = std::max(mag[size_t(i)], std::fabs(double(n->params[size_t(i)])));
    const auto st = sync_all(nodes, false);
    for (const auto& s : st) {
      CHECK(s.round == r);
      CHECK(s.participants == 4);
      CHECK(s.bytes_up > 0);
      CHECK(s.bytes_down > 0);
      CHECK_FALSE(s.resynced);
    }
    check_all_equal(nodes, st, co);
    // Experts (one owner each) exactly; shared params (4 contributors, summed in fp32 in
    // arrival order) within a few ulps of the exact mean.
    CHECK(std::memcmp(nodes[0]->params.data() + shared, expect.data() + shared, (expect.size() - shared) * 4) == 0);
    double worst_ulps = 0;
    for (int64_t i = 0; i < shared; ++i)
      if (mag[size_t(i)] > 0)
        worst_ulps = std::max(worst_ulps, std::fabs(double(nodes[0]->params[size_t(i)]) - expect[size_t(i)]) /
                                              (mag[size_t(i)] * std::ldexp(1.0, -23)));
    CHECK(worst_ulps <= 4);
    theta = nodes[0]->params;
  }
  // One CSV row per round, naming every participant and no missing node.
  const std::string csv = co.c->stats().csv_rows;
  CHECK(std::count(csv.begin(), csv.end(), '\n') == 3);
  CHECK(csv.find("3,15,4,,0,") != std::string::npos);
}

TEST_CASE("sync: lossy codecs keep every node and the coordinator bit-identical") {
  for (const Codec codec : {Codec::bf16, Codec::int8, Codec::int3}) {
    CAPTURE(codec_name(codec));
    const Config cfg = tiny_config(2, codec);
    CoordThread co(cfg);
    std::vector<std::unique_ptr<TestNode>> nodes;
    for (int p = 0; p < 2; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
    std::vector<float> theta = nodes[0]->params;
    int64_t fp32_bytes = 0;
    for (int r = 1; r <= 3; ++r) {
      for (auto& n : nodes) n->train();
      const auto expect = expected_merge(nodes, theta, {0, 1});
      const auto st = sync_all(nodes, false);
      check_all_equal(nodes, st, co);
      // Close to the exact merge (the residuals carry the rest to later rounds).
      double worst = 0;
      for (size_t i = 0; i < expect.size(); ++i)
        worst = std::max(worst, double(std::fabs(nodes[0]->params[i] - expect[i])));
      CHECK(worst < (codec == Codec::int3 ? 2e-3 : 2e-4));
      theta = nodes[0]->params;
      fp32_bytes = int64_t(nodes[0]->own.space.size()) * 4;
      // int3: 0.41 bytes a value, and the frames of this test's small chunks (1024 values)
      CHECK(st[0].bytes_up < fp32_bytes * (codec == Codec::int3 ? 0.15 : codec == Codec::int8 ? 0.3 : 0.55));
    }
  }
}

TEST_CASE("sync: sparse codec: hashes agree every round, bytes up and down ≤ 1/16 of fp32") {
  const Config cfg = tiny_config(2, Codec::sparse);
  CoordThread co(cfg);
  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int p = 0; p < 2; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
  const int64_t total = nodes[0]->layout.total;
  for (int r = 1; r <= 4; ++r) {
    for (auto& n : nodes) n->train();
    const auto st = sync_all(nodes, false);
    check_all_equal(nodes, st, co);
    for (int p = 0; p < 2; ++p) {
      const int64_t fp32_up = nodes[size_t(p)]->own.space.size() * 4;
      MESSAGE("round " << r << " node " << p << ": up " << st[size_t(p)].bytes_up << " B (fp32 " << fp32_up
                       << "), down " << st[size_t(p)].bytes_down << " B (fp32 " << total * 4 << ")");
      CHECK(st[size_t(p)].bytes_up * 16 <= fp32_up);
      CHECK(st[size_t(p)].bytes_down * 16 <= total * 4);
    }
  }
}

TEST_CASE("sync: one node owning every expert equals local training (fp32, bitwise)") {
  Config cfg = tiny_config(1, Codec::fp32, OwnershipMode::all);
  CoordThread co(cfg);
  TestNode node(cfg, 0, co.address());
  TestNode local(cfg, 0, co.address());  // never syncs
  for (int r = 1; r <= 3; ++r) {
    node.train();
    local.train();
    const RoundReport s = node.sync();
    CHECK(s.round == r);
    CHECK(std::memcmp(node.params.data(), local.params.data(), node.params.size() * 4) == 0);
  }
}

TEST_CASE("overlap: one node owning every parameter equals local training (fp32, bitwise)") {
  Config cfg = tiny_config(1, Codec::fp32, OwnershipMode::all);
  CoordThread co(cfg);
  TestNode node(cfg, 0, co.address());
  TestNode local(cfg, 0, co.address());  // never syncs
  for (int r = 1; r <= 3; ++r) {
    node.train();
    local.train();
    const std::vector<float> pushed = node.params;
    node.client->start_round(node.params.data(), node.step);
    CHECK(node.client->round_in_flight());
    CHECK(std::memcmp(node.params.data(), pushed.data(), pushed.size() * 4) == 0);  // c = 1: no stand-in
    node.train();  // training goes on while the round is in flight
    local.train();
    const RoundReport s = node.client->finish_round(node.params.data());
    CHECK_FALSE(node.client->round_in_flight());
    CHECK(s.round == r);
    // One node's fp32 push comes back bit for bit: θ_global = θ_pushed, whose hash
    // the coordinator published.
    CHECK(s.state_hash == state_hash(pushed.data(), int64_t(pushed.size())));
    CHECK(s.state_hash == co.c->stats().state_hash);
    CHECK(std::memcmp(node.params.data(), local.params.data(), local.params.size() * 4) == 0);
  }
}

TEST_CASE("overlap: 2 nodes: owned parameters keep the progress since the push, frozen ones take θ_global; settled with no training since, every node holds the coordinator's θ") {
  const Config cfg = tiny_config(2, Codec::fp32);
  CoordThread co(cfg);
  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int p = 0; p < 2; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
  for (int r = 1; r <= 3; ++r) {
    std::vector<std::vector<float>> pushed, local;
    for (auto& n : nodes) {
      n->train();
      pushed.push_back(n->params);
      n->client->start_round(n->params.data(), n->step);
      if (r < 3) n->train();  // the last round is settled with no training since its push
      local.push_back(n->params);
    }
    std::vector<RoundReport> st;
    for (auto& n : nodes) st.push_back(n->client->finish_round(n->params.data()));
    CHECK(st[0].state_hash == co.c->stats().state_hash);
    CHECK(st[1].state_hash == co.c->stats().state_hash);
    // θ_global, element by element (fp32, two nodes: shared = (a + b) / 2, an expert =
    // its owner's push); then owned: θ_global + (θ − θ_pushed) (θ_global where nothing
    // was trained since the push), frozen: θ_global.
    std::vector<float> global(pushed[0].size());
    for (int64_t i = 0; i < nodes[0]->layout.total; ++i) {
      const bool a = nodes[0]->own.space.packed_index(i) >= 0, b = nodes[1]->own.space.packed_index(i) >= 0;
      const size_t k = size_t(i);
      global[k] = a && b ? (pushed[0][k] + pushed[1][k]) / 2 : a ? pushed[0][k] : pushed[1][k];
    }
    CHECK(state_hash(global.data(), int64_t(global.size())) == co.c->stats().state_hash);
    for (int p = 0; p < 2; ++p) {
      const TestNode& n = *nodes[size_t(p)];
      int64_t wrong = 0;
      for (int64_t i = 0; i < n.layout.total; ++i) {
        const size_t k = size_t(i);
        const float x = local[size_t(p)][k], s = pushed[size_t(p)][k], g = global[k];
        auto same = [](float u, float v) { return std::memcmp(&u, &v, 4) == 0; };
        float expect = g;
        if (n.own.space.packed_index(i) >= 0 && !same(x, s)) expect = same(g, s) ? x : g + (x - s);
        wrong += std::memcmp(&expect, &n.params[k], 4) != 0;
      }
      CHECK(wrong == 0);
    }
    if (r == 3)  // every node at θ_global, bit for bit
      for (auto& n : nodes) CHECK(std::memcmp(n->params.data(), global.data(), global.size() * 4) == 0);
  }
}

TEST_CASE("sync: expert-merging warm-up at merge steps matches the standalone merge") {
  Config cfg = tiny_config(2, Codec::fp32);
  cfg.spes.merge_alpha = 0.5;
  cfg.spes.merge_interval = 10;  // rounds at steps 5, 10, 15: merging at 10
  cfg.spes.merge_decay_steps = 40;
  cfg.spes.merge_topk = 2;
  CoordThread co(cfg);
  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int p = 0; p < 2; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
  std::vector<float> theta = nodes[0]->params;
  for (int r = 1; r <= 3; ++r) {
    for (auto& n : nodes) n->train();
    auto expect = expected_merge(nodes, theta, {0, 1});
    const int64_t step = nodes[0]->step;
    const double alpha = merge_alpha_at(0.5, 10, 40, step);
    CHECK(alpha == (step == 10 ? doctest::Approx(0.5 * 0.75) : doctest::Approx(0.0)));
    if (alpha > 0) merge_experts_flat(expect.data(), nodes[0]->layout, alpha, 2);
    const auto st = sync_all(nodes, false);
    check_all_equal(nodes, st, co);
    CHECK(st[0].merge_alpha == doctest::Approx(alpha));
    CHECK(std::memcmp(nodes[0]->params.data(), expect.data(), expect.size() * 4) == 0);
    theta = nodes[0]->params;
  }
}

TEST_CASE("faults: a node killed mid-round -> the round closes on timeout with quorum; restarted, it rejoins") {
  Config cfg = tiny_config(3, Codec::int8);
  cfg.model.n_experts = 3;
  cfg.spes.experts_per_node = 1;
  cfg.spes.min_nodes = 2;
  cfg.spes.round_timeout_s = 0.5;
  CoordThread co(cfg);
  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int p = 0; p < 3; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
  auto st = sync_all(nodes);  // round 1, everyone
  check_all_equal(nodes, st, co);
  const SyncState ckpt2 = nodes[2]->client->state();  // node 2's checkpoint after round 1
  const std::vector<float> params2 = nodes[2]->params;
  const int64_t step2 = nodes[2]->step;

  // Round 2: node 2 dies after pushing part of its chunks (a raw connection that
  // authenticates as node 2, pushes two chunks and vanishes).
  nodes[2]->client.reset();
  {
    RawConn c;
    REQUIRE(c.connect(co.port()));
    std::array<uint8_t, kNonceBytes> nonce;
    REQUIRE(read_challenge(c, nonce));
    HelloFields h = make_hello(cfg, 2, nonce);
    h.sync_round = 1;
    h.state_hash = state_hash(params2.data(), int64_t(params2.size()));  // = θ of round 1 (frozen + base)
    FrameWriter w;
    REQUIRE(c.send_frame(w.hello(h)));
    REQUIRE(read_reply(c).welcome);
    const ChunkGrid grid = make_grid(nodes[2]->layout, cfg.model.n_experts, 1024);
    int sent = 0;
    for (const Range& r : nodes[2]->own.space.ranges())
      for (int ch : grid.chunks_in(r)) {
        if (sent == 2) break;
        const GridChunk& g = grid.chunks[ch];
        ChunkTag t{2, 10, 2, g.begin, g.end, Codec::int8};
        std::vector<float> zero(size_t(g.size()), 0.0f);
        REQUIRE(c.send_frame(w.push_chunk(t, encoded_bytes(Codec::int8, g.size()), [&](uint8_t* dst) {
          encode_delta(Codec::int8, zero.data(), g.size(), dst, nullptr);
        })));
        ++sent;
      }
  }  // killed: the socket closes without PushDone
  std::vector<std::unique_ptr<TestNode>> alive;
  alive.push_back(std::move(nodes[0]));
  alive.push_back(std::move(nodes[1]));
  const auto t0 = std::chrono::steady_clock::now();
  st = sync_all(alive);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(waited >= 0.4);  // closed by the timer, not by "everyone pushed"
  CHECK(st[0].round == 2);
  CHECK(st[0].participants == 2);
  check_all_equal(alive, st, co);
  CHECK(co.c->stats().csv_rows.find("\n2,10,2,2,") != std::string::npos);  // row: missing node 2

  // Node 2 restarts from its round-1 checkpoint: it is behind, gets a snapshot, and
  // after the next round its hash matches everyone's.
  nodes[2] = std::make_unique<TestNode>(cfg, 2, co.address());
  nodes[2]->params = params2;
  nodes[2]->step = step2;
  nodes[2]->client->restore(ckpt2);
  nodes[2]->train();
  const RoundReport s2 = nodes[2]->sync();
  CHECK(s2.resynced);
  CHECK(s2.round == 2);
  CHECK(std::memcmp(nodes[2]->params.data(), alive[0]->params.data(), alive[0]->params.size() * 4) == 0);
  nodes[0] = std::move(alive[0]);
  nodes[1] = std::move(alive[1]);
  nodes[2]->step = nodes[0]->step;
  st = sync_all(nodes);  // round 3, all three
  CHECK(st[0].round == 3);
  CHECK(st[0].participants == 3);
  check_all_equal(nodes, st, co);
}

TEST_CASE("faults: a late push gets 'stale round' and the node resyncs from a snapshot") {
  Config cfg = tiny_config(2, Codec::bf16);
  cfg.spes.min_nodes = 1;
  cfg.spes.round_timeout_s = 0.2;
  CoordThread co(cfg);
  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int p = 0; p < 2; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
  check_all_equal(nodes, sync_all(nodes), co);  // round 1: both, connections stay open
  nodes[0]->train();
  const RoundReport a = nodes[0]->sync();  // round 2 closes alone after the timeout
  CHECK(a.round == 2);
  CHECK(a.participants == 1);
  nodes[1]->train();
  const RoundReport b = nodes[1]->sync();  // pushes round 2, which is closed
  CHECK(b.resynced);
  CHECK(b.round == 2);
  CHECK(b.state_hash == a.state_hash);
  CHECK(std::memcmp(nodes[0]->params.data(), nodes[1]->params.data(), nodes[0]->params.size() * 4) == 0);
  CHECK(co.c->stats().late_pushes >= 1);
  auto st = sync_all(nodes);
  check_all_equal(nodes, st, co);
  CHECK(st[0].participants == 2);
}

TEST_CASE("changed-only download: a missing node's experts do not travel, and it catches up on what changed") {
  Config cfg = tiny_config(4, Codec::fp32);
  cfg.spes.min_nodes = 3;
  cfg.spes.round_timeout_s = 0.3;
  CoordThread co(cfg);
  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int p = 0; p < 4; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
  const auto st1 = sync_all(nodes);  // round 1: everyone
  check_all_equal(nodes, st1, co);
  const ChunkGrid grid = make_grid(nodes[0]->layout, cfg.model.n_experts, 1024);
  auto frame_bytes = [&](const std::vector<int>& chunks) {  // RoundChunk/SnapshotChunk frames: 4 B a value + < 160 B
    int64_t values = 0;
    for (int c : chunks) values += grid.chunks[size_t(c)].size();
    return std::make_pair(values * 4, int64_t(chunks.size()) * 160);
  };
  std::vector<int> node3_experts, others;
  for (size_t c = 0; c < grid.chunks.size(); ++c) {
    const bool n3 = nodes[3]->own.space.packed_offset({grid.chunks[c].begin, grid.chunks[c].end}) >= 0 &&
                    grid.chunks[c].segment > 0;
    (n3 ? node3_experts : others).push_back(int(c));
  }
  REQUIRE(!node3_experts.empty());

  // Round 2 without node 3: closes on the timeout; the others download everything but its experts.
  std::vector<std::unique_ptr<TestNode>> three;
  for (int p = 0; p < 3; ++p) three.push_back(std::move(nodes[size_t(p)]));
  const auto st2 = sync_all(three);
  CHECK(st2[0].participants == 3);
  const auto [payload2, overhead2] = frame_bytes(others);
  MESSAGE("round 2 without node 3: " << st2[0].bytes_down << " bytes down per node; round 1: " << st1[0].bytes_down
                                     << "; node 3's experts: " << frame_bytes(node3_experts).first << " bytes");
  for (const auto& s : st2) {
    CHECK(s.bytes_down >= payload2);
    CHECK(s.bytes_down <= payload2 + overhead2 + 256);
  }
  for (int p = 0; p < 3; ++p) nodes[size_t(p)] = std::move(three[size_t(p)]);

  // Node 3 comes back: its late push is refused, and it downloads only what changed after
  // its round (round 2's changes: not its own experts), then is bit-identical again.
  nodes[3]->train();
  const RoundReport s3 = nodes[3]->sync();
  CHECK(s3.resynced);
  CHECK(s3.round == 2);
  CHECK(s3.state_hash == co.c->stats().state_hash);
  CHECK(std::memcmp(nodes[3]->params.data(), nodes[0]->params.data(), nodes[0]->params.size() * 4) == 0);
  MESSAGE("node 3 catching up: " << s3.bytes_down << " bytes down (a full snapshot: "
                                 << frame_bytes(others).first + frame_bytes(node3_experts).first << " bytes of values)");
  CHECK(s3.bytes_down <= payload2 + overhead2 + 1024);  // + the refusal, Welcome and SnapshotDone
  const auto st3 = sync_all(nodes);  // round 3: all four again
  CHECK(st3[0].participants == 4);
  check_all_equal(nodes, st3, co);
}

TEST_CASE("faults: coordinator restart (in-process) -> nodes continue, no round lost") {
  Config cfg = tiny_config(2, Codec::int8);
  cfg.spes.state_dir = temp_dir("restart");
  CoordinatorOptions first;
  first.fresh = true;  // the first start of a run
  auto co = std::make_unique<CoordThread>(cfg, first);
  const uint16_t port = co->port();
  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int p = 0; p < 2; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co->address()));
  for (int r = 1; r <= 2; ++r) check_all_equal(nodes, sync_all(nodes), *co);
  const uint64_t h2 = co->c->stats().state_hash;

  // Restart between rounds: the nodes' connections break and they reconnect.
  co.reset();
  CoordinatorOptions opt;
  opt.port = port;
  co = std::make_unique<CoordThread>(cfg, opt);
  CHECK(co->c->stats().round == 2);
  CHECK(co->c->stats().state_hash == h2);
  auto st = sync_all(nodes);
  CHECK(st[0].round == 3);
  CHECK_FALSE(st[0].resynced);
  check_all_equal(nodes, st, *co);

  // Restart mid-round: node 0 has pushed round 4 and waits; the coordinator dies;
  // node 1 pushes to the new one; node 0 reconnects and resends. Round 4 completes.
  for (auto& n : nodes) n->train();
  RoundReport s0;
  const int64_t in0 = co->c->stats().bytes_in;
  std::thread t0([&] { s0 = nodes[0]->sync(); });
  // Node 0's whole push (≈ 1 byte per owned parameter with int8) has arrived.
  const bool pushed = wait_until([&] { return co->c->stats().bytes_in - in0 >= nodes[0]->own.space.size(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(co->c->stats().round == 3);
  co.reset();
  co = std::make_unique<CoordThread>(cfg, opt);
  const RoundReport s1 = nodes[1]->sync();
  t0.join();
  CHECK(pushed);
  CHECK(s0.round == 4);
  CHECK(s1.round == 4);
  CHECK_FALSE(s0.resynced);
  CHECK_FALSE(s1.resynced);
  check_all_equal(nodes, {s0, s1}, *co);
  // --fresh: a new run in the same state_dir starts from the seed, not from round 4.
  co.reset();
  opt.fresh = true;
  co = std::make_unique<CoordThread>(cfg, opt);
  CHECK(co->c->stats().round == 0);
  const TestNode fresh_node(cfg, 0, co->address());  // holds the seeded init θ
  CHECK(co->c->stats().state_hash == state_hash(fresh_node.params.data(), int64_t(fresh_node.params.size())));
  std::filesystem::remove_all(cfg.spes.state_dir);
}

TEST_CASE("persistence: state file round trip and corruption detected") {
  const std::string dir = temp_dir("state");
  const std::string path = dir + "/coordinator_state.bin";
  std::vector<float> theta(1000), res(1000);
  for (size_t i = 0; i < theta.size(); ++i) theta[i] = float(i) * 0.5f, res[i] = -float(i);
  PersistedState ps;
  ps.run_id = "r";
  ps.fingerprint = 42;
  ps.round = 7;
  ps.step = 70;
  ps.state_hash = state_hash(theta.data(), 1000);
  ps.codec = 2;
  save_state_file(path, ps, theta, &res);
  std::vector<float> t2(1000), r2;
  const PersistedState back = load_state_file(path, t2, &r2);
  CHECK(back.round == 7);
  CHECK(back.step == 70);
  CHECK(back.run_id == "r");
  CHECK(t2 == theta);
  CHECK(r2 == res);
  {
    std::FILE* f = std::fopen(path.c_str(), "r+b");
    std::fseek(f, 200, SEEK_SET);
    std::fputc(0x5A, f);
    std::fclose(f);
  }
  CHECK_THROWS_WITH_AS(load_state_file(path, t2, &r2), doctest::Contains("checksum"), NetError);
  std::vector<float> wrong(10);
  save_state_file(path, ps, theta, nullptr);
  CHECK_THROWS_WITH_AS(load_state_file(path, wrong, nullptr), doctest::Contains("parameters"), NetError);
  std::filesystem::remove_all(dir);
}

TEST_CASE("persistence: a 40 MiB state (several write calls) loads back bit for bit; a flipped byte is caught") {
  const std::string dir = temp_dir("state-big");
  const std::string path = dir + "/coordinator_state.bin";
  const size_t n = size_t(10) << 20;  // 40 MiB per array
  std::vector<float> theta(n), res(n);
  for (size_t i = 0; i < n; ++i) theta[i] = float(i % 9973) * 0.25f, res[i] = -float(i % 7919);
  PersistedState ps;
  ps.run_id = "big";
  ps.round = 3;
  ps.state_hash = state_hash(theta.data(), int64_t(n));
  ps.codec = 1;
  save_state_file(path, ps, theta, &res);
  const auto bytes = std::filesystem::file_size(path);
  CHECK(bytes > 2 * n * 4);
  std::vector<float> t2(n), r2;
  load_state_file(path, t2, &r2);
  CHECK(t2 == theta);
  CHECK(r2 == res);
  {  // a flipped byte near the end of θ
    std::FILE* f = std::fopen(path.c_str(), "r+b");
    std::fseek(f, long(bytes - n * 4 - 1000), SEEK_SET);
    std::fputc(0xA5, f);
    std::fclose(f);
  }
  CHECK_THROWS_WITH_AS(load_state_file(path, t2, &r2), doctest::Contains("checksum"), NetError);
  std::filesystem::remove_all(dir);
}

TEST_CASE("coordinator: --dump-state writes the global θ as an HF export at the chosen rounds") {
  const Config cfg = tiny_config(2, Codec::bf16);
  const std::string dump_dir = temp_dir("dump");
  CoordinatorParams params = test_coordinator_params(cfg);
  params.on_round = coordinator_hf_dump(cfg, dump_dir, 2);
  CoordThread co(std::move(params), {});
  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int p = 0; p < 2; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
  sync_all(nodes);
  CHECK_FALSE(std::filesystem::exists(dump_dir + "/round-00000001"));
  sync_all(nodes);
  const HfModel hf = import_hf(dump_dir + "/round-00000002");
  CHECK(hf.config.n_experts == cfg.model.n_experts);
  CHECK(hf.params == nodes[0]->params);
  std::filesystem::remove_all(dump_dir);
}
