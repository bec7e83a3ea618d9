// The coordinator's state is the run's (issue 13, findings 3 and 5): without
// --fresh a missing or unreadable state file refuses to start (no silent reset of
// every node to the seed); a node ahead of the coordinator refuses to be reset to
// an older θ; a round's step comes from the schedule, never from a node's word.
// Before, the coordinator started from the seed, the nodes took its snapshot, and α
// followed the highest step a node claimed.
#include <doctest/doctest.h>

#include <sys/wait.h>

#include <cmath>
#include <cstring>
#include <fstream>

#include "engine/base/error.hpp"
#include "model/expert_merge.hpp"
#include "net/finite_guard.hpp"
#include "net/global_state.hpp"
#include "net/publication.hpp"
#include "net/streaming_merge.hpp"
#include "net_test_util.hpp"

using namespace spes;
using namespace spes::net;
using namespace spes::net::testing;

namespace {

CoordinatorOptions quiet(bool fresh) {
  CoordinatorOptions o;
  o.log = std::getenv("SPES_NET_TEST_LOG") != nullptr;
  o.fresh = fresh;
  return o;
}

}  // namespace

TEST_CASE("state: without --fresh a missing or unreadable state refuses to start; a node ahead refuses a reset") {
  Config cfg = tiny_config(2, Codec::bf16);
  cfg.spes.state_dir = temp_dir("state-missing");
  const std::string state = cfg.spes.state_dir + "/coordinator_state.bin";
  auto start = [&](bool fresh) { return std::make_unique<CoordThread>(test_coordinator_params(cfg), quiet(fresh)); };
  const std::string missing = state + ": no coordinator state";
  CHECK_THROWS_WITH_AS(start(false), doctest::Contains(missing.c_str()), NetError);
  CHECK_THROWS_WITH_AS(start(false), doctest::Contains("--fresh"), NetError);

  // A run of 3 rounds.
  auto co = start(true);
  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int p = 0; p < 2; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co->address()));
  for (int r = 1; r <= 3; ++r) sync_all(nodes);
  const uint16_t port = co->port();
  co.reset();

  // The state is lost or damaged: the coordinator refuses, naming the file and the flag.
  std::filesystem::copy_file(state, state + ".keep");
  std::filesystem::remove(state);
  CHECK_THROWS_WITH_AS(start(false), doctest::Contains(missing.c_str()), NetError);
  {
    std::ofstream(state, std::ios::binary) << "not a state file";
  }
  CHECK_THROWS_WITH_AS(start(false), doctest::Contains("--fresh"), NetError);

  // An operator who restarts it --fresh anyway: the nodes hold round 3 and refuse to
  // be reset to round 0, keeping their θ and their round.
  CoordinatorOptions opt = quiet(true);
  opt.port = port;
  co = std::make_unique<CoordThread>(test_coordinator_params(cfg), opt);
  for (auto& n : nodes) {
    n->train();
    const std::vector<float> before = n->params;
    CHECK_THROWS_WITH_AS(n->sync(), doctest::Contains("ahead of the coordinator"), NetError);
    CHECK(n->params == before);
    CHECK(n->client->state().round == 3);
  }
  CHECK(co->c->stats().round == 0);
  co.reset();

  // The right state back: the nodes carry on from round 3.
  std::filesystem::rename(state + ".keep", state);
  opt.fresh = false;
  co = std::make_unique<CoordThread>(test_coordinator_params(cfg), opt);
  const auto st = sync_all(nodes);
  CHECK(st[0].round == 4);
  CHECK_FALSE(st[0].resynced);
  CHECK(st[0].state_hash == co->c->stats().state_hash);
  CHECK(st[1].state_hash == co->c->stats().state_hash);
  co.reset();
  std::filesystem::remove_all(cfg.spes.state_dir);
}

TEST_CASE("state: the coordinator owns the step; a node reporting a wrong or backwards step moves nothing") {
  Config cfg = tiny_config(2, Codec::fp32);
  cfg.spes.merge_alpha = 0.5;
  cfg.spes.merge_interval = 5;  // = sync_steps: every round is a merge round
  cfg.spes.merge_decay_steps = 100;
  CoordThread co(test_coordinator_params(cfg), quiet(true));
  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int p = 0; p < 2; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
  // Round 1: node 0 claims step 1000 (α would be 0); round 2: both claim step 3 (not
  // a merge step); round 3: node 1 goes backwards to step 0.
  const std::vector<std::array<int64_t, 2>> claims = {{1000, 5}, {3, 3}, {15, 0}};
  for (size_t k = 0; k < claims.size(); ++k) {
    const int64_t r = int64_t(k) + 1;
    for (int p = 0; p < 2; ++p) {
      nodes[size_t(p)]->train();
      nodes[size_t(p)]->step = claims[k][size_t(p)];
    }
    const auto st = sync_all(nodes, false);
    const double want = merge_alpha_at(0.5, 5, 100, 5 * r);
    CHECK(want > 0);
    CHECK(st[0].merge_alpha == doctest::Approx(want).epsilon(1e-12));
    CHECK(st[1].merge_alpha == st[0].merge_alpha);
    CHECK(co.c->stats().step == 5 * r);
    CHECK(st[0].state_hash == co.c->stats().state_hash);
  }
  CHECK(co.c->stats().csv_rows.find("\n3,15,2,") != std::string::npos);
}

TEST_CASE("state: `spes-engine coordinator` without a state, or with one of another format, exits 1 with one line") {
  test::TempDir dir("coordinator-no-state");
  const Config c = test::small_config(dir.path, {"spes.n_nodes=2", "spes.sync_steps=2", "spes.coordinator=\"127.0.0.1:29999\"",
                                                 "spes.state_dir=\"" + (dir / "coordinator") + "\""});
  const std::string config = dir / "c.toml";
  std::ofstream(config) << config_to_toml(c);
  const std::string state = dir / "coordinator/coordinator_state.bin";
  // The one line on stderr of a coordinator that must exit 1.
  auto error_line = [&] {
    const std::string cmd = std::string(SPES_ENGINE_BIN) + " coordinator " + config + " > " + (dir / "out") + " 2> " +
                            (dir / "err");
    const int status = std::system(cmd.c_str());
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 1);
    std::ifstream in(dir / "err");
    std::vector<std::string> lines;
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    REQUIRE(lines.size() == 1);
    return lines[0];
  };
  std::string line = error_line();
  CHECK(line.find(state) != std::string::npos);
  CHECK(line.find("--fresh") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(state));

  // A state file of format 2: its magic and format are all the coordinator reads.
  std::filesystem::create_directories(dir / "coordinator");
  {
    std::ofstream out(state, std::ios::binary);
    const uint32_t format = 2;
    out << "SPESCOOR";
    out.write(reinterpret_cast<const char*>(&format), 4);
  }
  line = error_line();
  CHECK(line.find(state + ": format 2, but this build reads only format 3") != std::string::npos);
}

TEST_CASE("state: a state file of another format refuses the start in one line naming the file and both formats") {
  const std::string dir = temp_dir("state-format");
  const int64_t n = 3000;
  std::vector<float> theta(static_cast<size_t>(n), 0.25f);
  PersistedState ps;
  ps.run_id = "format";
  ps.fingerprint = 77;
  ps.round = 12;
  const std::string path = dir + "/coordinator_state.bin";
  save_state_file(path, ps, theta, nullptr);
  set_state_file_format(path, 2);
  const LineLog log("[test]", false);
  StatePersistence persistence(PersistRules{dir, "format", 77, Codec::fp32, n, false}, log);
  const std::string want = "coordinator state " + path +
                           ": format 2, but this build reads only format 3; --rollback-to ROUND restarts the run "
                           "from a round kept in its state_dir's rounds/ folder (--fresh would start a new run from "
                           "the seed instead)";
  CHECK_THROWS_WITH_AS(persistence.open(false, nullptr, ""), want.c_str(), NetError);
  CHECK(state_file_format(path) == 2);  // left as it was
  std::filesystem::remove_all(dir);
}

TEST_CASE("state: a state_dir holding the old name state.bin is picked up once; a state.bin of another kind is not") {
  const std::string dir = temp_dir("state-old-name");
  const int64_t n = 3000;
  std::vector<float> theta(static_cast<size_t>(n), 0.25f);
  PersistedState ps;
  ps.run_id = "old-name";
  ps.fingerprint = 77;
  ps.round = 12;
  ps.step = 120;
  save_state_file(dir + "/state.bin", ps, theta, nullptr);
  std::ofstream(dir + "/state.bin.next") << "the previous round's scratch";
  const LineLog log("[test]", false);
  const PersistRules rules{dir, "old-name", 77, Codec::fp32, n, false};
  {
    StatePersistence persistence(rules, log);
    const GlobalState s = persistence.open(false, nullptr, "");
    CHECK(s.round == 12);
    CHECK(s.hash == state_hash(theta.data(), n));
  }
  CHECK_FALSE(std::filesystem::exists(dir + "/state.bin"));
  CHECK_FALSE(std::filesystem::exists(dir + "/state.bin.next"));
  CHECK(std::filesystem::exists(dir + "/coordinator_state.bin"));
  CHECK(std::filesystem::exists(dir + "/coordinator_state.bin.next"));
  StatePersistence again(rules, log);
  CHECK(again.open(false, nullptr, "").round == 12);

  // A node's checkpoint file of the same name is no coordinator state: left alone.
  const std::string other = temp_dir("state-old-name-other");
  std::ofstream(other + "/state.bin") << "SPESCKPT and a node's checkpoint";
  StatePersistence none(PersistRules{other, "old-name", 77, Codec::fp32, n, false}, log);
  CHECK_THROWS_WITH_AS(none.open(false, nullptr, ""), doctest::Contains("no coordinator state"), NetError);
  CHECK(std::filesystem::exists(other + "/state.bin"));
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(other);
}

TEST_CASE("state: a round's close writes every element of the next file (a NaN-filled .next leaves no trace)") {
  // The next state file is the previous round's, overwritten in place: whatever a
  // close did not write would survive from an older round. Filled with NaN first, it
  // must commit (the read-back refuses any NaN) with untouched chunks bit for bit.
  const ModelConfig mc = tiny_config(1).model;
  const ParamLayout L = make_layout(mc);
  const ChunkGrid g = make_grid(L, mc.n_experts, 256);
  const size_t count = static_cast<size_t>(L.total);
  std::vector<float> theta(count), residual(count), momentum(count);
  for (size_t i = 0; i < count; ++i)
    theta[i] = noise(1, 0, i), residual[i] = noise(2, 0, i) * 1e-3f, momentum[i] = noise(3, 0, i) * 1e-2f;
  RoundFiles files(theta, &residual, &momentum);
  {
    const std::vector<float> nan(3 * count, std::nanf(""));
    std::fstream f(files.dir + "/coordinator_state.bin.next", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4096);
    f.write(reinterpret_cast<const char*>(nan.data()), std::streamsize(nan.size() * 4));
  }
  StreamingMerge sm(g, Codec::int8, 1, 1);
  sm.begin_round();
  const int skipped = 1;
  for (size_t c = 0; c < g.chunks.size(); ++c) {
    if (int(c) == skipped) continue;
    const GridChunk& ch = g.chunks[c];
    std::vector<float> delta(size_t(ch.size()));
    for (int64_t i = 0; i < ch.size(); ++i) delta[size_t(i)] = noise(4, c, uint64_t(i)) * 1e-2f;
    std::vector<uint8_t> payload(encoded_bytes(Codec::int8, ch.size()));
    REQUIRE(encode_delta(Codec::int8, delta.data(), ch.size(), payload.data(), nullptr));
    sm.add(int(c), payload.data());
  }
  const std::vector<bool> changed = sm.close(*files.old, *files.next, L, 0.0, 4, {OuterKind::nesterov, 0.7, 0.9});
  const auto pub = build_publication(Codec::int8, g, changed, sm.target(), *files.old, *files.next, files.dir, 1, 1, 1, 0);
  CHECK(pub->refused.empty());
  REQUIRE_NOTHROW(files.commit());
  const GridChunk& u = g.chunks[skipped];
  for (auto [section, old] : {std::pair{Section::theta, &theta}, std::pair{Section::residual, &residual},
                              std::pair{Section::momentum, &momentum}}) {
    const std::vector<float> now = files.read(section);
    CHECK(std::memcmp(now.data() + u.begin, old->data() + u.begin, size_t(u.size()) * 4) == 0);
    CHECK(first_non_finite(now.data(), int64_t(now.size())) < 0);
    CHECK(std::memcmp(now.data(), old->data(), count * 4) != 0);  // the other chunks did move
  }
}
