// No poisoned θ (issue 13, finding 1): finite deltas that would walk θ past the
// float range are refused before they reach the merge, naming the node and the
// range; the round goes on without those nodes; a merged update that would still
// not be finite is not applied; nothing non-finite is persisted or loaded.
#include <doctest/doctest.h>

#include <cfloat>
#include <cmath>
#include <fstream>
#include <limits>

#include "engine/base/checksum.hpp"
#include "engine/base/error.hpp"
#include "net/finite_guard.hpp"
#include "net/publication.hpp"
#include "net/state_file.hpp"
#include "net_test_util.hpp"

using namespace spes;
using namespace spes::net;
using namespace spes::net::testing;

namespace {

bool all_finite(const std::vector<float>& x) { return first_non_finite(x.data(), int64_t(x.size())) < 0; }

// Every node trains; nodes [0, hostile) get `huge` into their error-feedback
// residual at packed index `at` (so the client itself encodes it); then all sync
// concurrently. st and err: each node's stats and error ("" when it synced).
void poisoned_sync(std::vector<std::unique_ptr<TestNode>>& nodes, int hostile, int64_t at, float huge,
                   std::vector<RoundReport>& st, std::vector<std::string>& err) {
  st.assign(nodes.size(), {});
  err.assign(nodes.size(), "");
  std::vector<std::thread> ts;
  for (size_t p = 0; p < nodes.size(); ++p) {
    nodes[p]->train();
    if (int(p) < hostile) {
      SyncState s = nodes[p]->client->state();
      s.residual[size_t(at)] = huge;
      nodes[p]->client->restore(s);
    }
    ts.emplace_back([&, p] {
      try {
        st[p] = nodes[p]->sync();
      } catch (const std::exception& e) {
        err[p] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
}

// Nodes 0 and 1 push Δ = `huge` at a shared parameter every round (through their
// error-feedback residual, so the client itself encodes it); node 2 is honest.
// Rounds go on until the hostile pushes are refused, at the latest after 6; returns
// that round.
int poisoned_rounds(Codec codec, float huge) {
  Config cfg = tiny_config(3, codec);
  cfg.spes.update_bound = 0;  // the finite guard alone (the bound would refuse these pushes first)
  cfg.spes.round_timeout_s = 2;  // the refused round closes without the refused nodes
  CoordinatorOptions opt;
  opt.log = std::getenv("SPES_NET_TEST_LOG") != nullptr;
  CoordThread co(cfg, opt);
  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int p = 0; p < 3; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
  const int64_t target = 5;  // a shared parameter (embeddings): every node owns it
  REQUIRE(nodes[0]->own.space.ranges()[0].begin == 0);

  int refused_round = 0;
  for (int r = 1; r <= 6 && !refused_round; ++r) {
    std::vector<RoundReport> st;
    std::vector<std::string> err;
    poisoned_sync(nodes, 2, target, huge, st, err);  // the owned space starts with the shared block
    REQUIRE_MESSAGE(err[2] == "", err[2]);
    CHECK(st[2].round == r);
    CHECK(all_finite(nodes[2]->params));
    CHECK(st[2].state_hash == co.c->stats().state_hash);
    if (err[0].empty() && err[1].empty()) {
      CHECK(st[0].state_hash == st[2].state_hash);
      continue;
    }
    // The first round that would overflow: each hostile node is refused by name
    // (one may still fit, by its quantisation noise, and is merged).
    refused_round = r;
    int refused = 0, late = 0;
    for (int p = 0; p < 2; ++p) {
      late += err[size_t(p)].empty() && st[size_t(p)].resynced;  // a loaded machine: pushed after the timeout
      if (err[size_t(p)].empty()) continue;
      ++refused;
      INFO(err[size_t(p)]);
      CHECK(err[size_t(p)].find("node " + std::to_string(p) + ": push for round " + std::to_string(r)) !=
            std::string::npos);
      CHECK(err[size_t(p)].find("would make θ non-finite in [0, 1024)") != std::string::npos);
    }
    CHECK(st[2].participants == 3 - refused - late);
    CHECK(("\n" + co.c->stats().csv_rows).find("\n" + std::to_string(r) + ",") != std::string::npos);
  }
  REQUIRE(refused_round >= 1);
  // The honest node goes on from a finite θ (alone: the round closes on its timeout).
  nodes[2]->train();
  const RoundReport s = nodes[2]->sync();
  CHECK(s.round == refused_round + 1);
  CHECK(all_finite(nodes[2]->params));
  CHECK(s.state_hash == co.c->stats().state_hash);
  return refused_round;
}

}  // namespace

TEST_CASE("finite: bf16 deltas that would overflow θ over rounds are refused, naming the node") {
  CHECK(poisoned_rounds(Codec::bf16, 1.5e38f) >= 2);  // two such pushes fit one round; θ overflows later
}

TEST_CASE("finite: int8 deltas that would overflow θ over rounds are refused, naming the node") {
  CHECK(poisoned_rounds(Codec::int8, 1.2e38f) >= 2);  // int8 carries at most 127 · 1e36 per round
}

TEST_CASE("finite: two finite pushes whose sum passes the float range are merged; θ overflows later and is refused") {
  CHECK(poisoned_rounds(Codec::bf16, 2.0e38f) >= 2);  // the accumulator is pre-scaled: the sum cannot overflow
}

TEST_CASE("finite: a refused push is refused as a whole: nothing it pushed before the bad chunk is merged") {
  // Node 0 walks one parameter of its own expert (its last chunk) towards +inf;
  // nodes 1 and 2 are honest. In the round its push is refused, the chunks it
  // pushed before (the shared block, its expert's first chunks) must not move.
  Config cfg = tiny_config(3, Codec::bf16);
  cfg.spes.round_timeout_s = 2;
  cfg.spes.update_bound = 0;  // the finite guard alone
  CoordinatorOptions opt;
  opt.log = std::getenv("SPES_NET_TEST_LOG") != nullptr;
  CoordThread co(cfg, opt);
  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int p = 0; p < 3; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
  const std::vector<Range>& own0 = nodes[0]->own.space.ranges();
  const int64_t target = own0.back().end - 1;  // the last parameter it pushes
  const int64_t target_packed = nodes[0]->own.space.packed_index(target);
  REQUIRE(target_packed == nodes[0]->own.space.size() - 1);
  for (int r = 1; r <= 6; ++r) {
    const std::vector<float> before = nodes[2]->params;  // θ of round r − 1 (node 2 is in sync)
    std::vector<RoundReport> st;
    std::vector<std::string> err;
    poisoned_sync(nodes, 1, target_packed, 1.5e38f, st, err);
    const std::string honest_errors = err[1] + err[2];
    REQUIRE_MESSAGE(honest_errors.empty(), honest_errors);
    if (err[0].empty()) continue;
    INFO(err[0]);
    CHECK(err[0].find("node 0: push for round " + std::to_string(r) + " would make θ non-finite") != std::string::npos);
    CHECK(err[0].find("(parameter " + std::to_string(target) + ")") != std::string::npos);
    REQUIRE(target >= 1024);  // its bad chunk is not its first: it had pushed others before
    const std::vector<float>& after = nodes[2]->params;
    CHECK(st[2].state_hash == co.c->stats().state_hash);
    // Nothing of node 0's push: every range it owns, the shared block included, is θ_old.
    int64_t moved = 0;
    for (const Range& g : own0)
      for (int64_t i = g.begin; i < g.end; ++i) moved += after[size_t(i)] != before[size_t(i)];
    CHECK(moved == 0);
    // Node 1's own expert (pushed by it alone) is merged, unless it was late on a loaded machine.
    const Range e1 = nodes[1]->own.space.ranges().back();
    int64_t changed = 0;
    for (int64_t i = e1.begin; i < e1.end; ++i) changed += after[size_t(i)] != before[size_t(i)];
    if (!st[1].resynced) CHECK(changed > 0);
    return;
  }
  FAIL("node 0's push was never refused");
}

TEST_CASE("finite: a merged update that is not finite is not applied nor published") {
  for (Codec codec : {Codec::fp32, Codec::bf16, Codec::int8}) {
    CAPTURE(codec_name(codec));
    ParamLayout layout;
    layout.total = layout.shared_count = 2 * kInt8Block;
    const ChunkGrid grid = make_grid(layout, 0, kInt8Block);
    REQUIRE(grid.chunks.size() == 2);
    std::vector<float> theta(size_t(layout.total), 1.0f), residual(theta.size(), 0.0f);
    theta[3] = -3.0e38f;
    std::vector<float> target(theta.size(), 2.0f);
    target[3] = codec == Codec::fp32 ? INFINITY : 3.0e38f;  // fp32: not finite; lossy: Δ = 6e38 is not a float
    RoundFiles files(theta, codec_is_lossy(codec) ? &residual : nullptr);
    const auto pub = build_publication(codec, grid, {true, true}, target.data(), *files.old, *files.next, files.dir, 1,
                                       5, 2, 0);
    CHECK(pub->refused == std::vector<int>{0});
    CHECK(pub->chunks == std::vector<int>{1});
    files.commit();
    const std::vector<float> after = files.read();
    CHECK(std::equal(after.begin(), after.begin() + kInt8Block, theta.begin()));  // chunk 0 kept
    CHECK(after[kInt8Block] == doctest::Approx(2.0).epsilon(1e-3));              // chunk 1 applied
    CHECK(all_finite(after));
    if (codec_is_lossy(codec)) CHECK(all_finite(files.read(Section::residual)));
    CHECK(files.old->info().state_hash == state_hash(after.data(), layout.total));
  }
}

TEST_CASE("finite: a state file is never written with, nor loaded from, a non-finite value") {
  const std::string dir = temp_dir("finite-state");
  const std::string path = dir + "/coordinator_state.bin";
  std::vector<float> theta(300, 0.5f);
  PersistedState ps;
  ps.run_id = "r";
  ps.round = 3;
  ps.state_hash = state_hash(theta.data(), int64_t(theta.size()));
  save_state_file(path, ps, theta, nullptr);

  std::vector<float> bad = theta;
  bad[7] = INFINITY;
  CHECK_THROWS_WITH_AS(save_state_file(path, ps, bad, nullptr), doctest::Contains("refusing to persist a non-finite θ"),
                       NetError);
  std::vector<float> back(theta.size());
  CHECK(load_state_file(path, back, nullptr).round == 3);  // the old file is intact
  CHECK(back == theta);

  // A file that holds an inf with valid checksums (written by hand) is refused on
  // load, naming the file: the inf patched into θ, θ's hash in the header and the
  // header's CRC32C (its last 4 of 4096 bytes) made to match.
  std::vector<float> with_inf = theta;
  with_inf[7] = INFINITY;
  const std::string want = path + ": holds a non-finite θ";
  std::vector<uint8_t> bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  REQUIRE(bytes.size() == 4096 + theta.size() * 4);
  std::memcpy(bytes.data() + 4096, with_inf.data(), with_inf.size() * 4);
  const uint64_t h = state_hash(with_inf.data(), int64_t(with_inf.size()));
  std::memcpy(bytes.data() + 48, &h, 8);  // the θ hash field
  const uint32_t crc = crc32c(bytes.data(), 4092);
  std::memcpy(bytes.data() + 4092, &crc, 4);
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  }
  CHECK_THROWS_WITH_AS(load_state_file(path, back, nullptr), doctest::Contains(want.c_str()), NetError);
  std::filesystem::remove_all(dir);
}
