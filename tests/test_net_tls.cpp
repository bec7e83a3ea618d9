// TLS 1.3 with node certificates (issue 13): the certificates `spes-engine certs`
// makes; a round over TLS equals one without; impersonation, a foreign CA, an
// expired certificate and plaintext against TLS (either way) are refused with a
// clear reason.
#include <doctest/doctest.h>

#include <sys/stat.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "engine/base/error.hpp"
#include "net/certs.hpp"
#include "net_test_util.hpp"

using namespace spes;
using namespace spes::net;
using namespace spes::net::testing;

namespace {

// The run's certificates, made once per process.
const std::string& run_certs() {
  static const std::string dir = [] {
    const std::string d = temp_dir("tls-run");
    CertRequest r;
    r.out_dir = d;
    r.n_nodes = 4;
    make_run_certs(r);
    return d;
  }();
  return dir;
}

Config tls_config(int n_nodes) {
  Config cfg = tiny_config(n_nodes);
  cfg.spes.tls_ca = run_certs() + "/ca.crt";
  return cfg;
}

CoordinatorOptions quiet() {
  CoordinatorOptions o;
  o.log = std::getenv("SPES_NET_TEST_LOG") != nullptr;
  return o;
}

// Node `id` of cfg presenting the certificate `dir`/`name`.{crt,key} (and dir/ca.crt).
std::unique_ptr<TestNode> node_with_cert(const Config& cfg, int id, const std::string& address,
                                         const std::string& dir, const std::string& name) {
  auto n = std::make_unique<TestNode>(cfg, id, address);
  SyncClientParams p = sync_client_params(n->cfg, n->layout, n->own, n->params);
  p.coordinator = address;
  p.secret = "test-secret-0123456789";
  p.tls = {dir + "/ca.crt", dir + "/" + name + ".crt", dir + "/" + name + ".key"};
  SyncClientOptions o;
  o.backoff_min_s = 0.02, o.backoff_max_s = 0.3, o.retry_for_s = 3, o.log = false;
  n->client = std::make_unique<SyncClient>(p, o);
  n->train();
  return n;
}

}  // namespace

TEST_CASE("certs: a CA, the coordinator and one certificate per node; keys 0600") {
  const std::string d = run_certs();
  for (const char* f : {"ca.crt", "ca.key", "coordinator.crt", "coordinator.key", "node-0.crt", "node-3.key"})
    CHECK_MESSAGE(std::filesystem::is_regular_file(d + "/" + f), f);
  struct stat st {};
  REQUIRE(::stat((d + "/node-0.key").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  CHECK(node_id_from_name("node-12") == 12);
  CHECK(node_id_from_name("node-") == -1);
  CHECK(node_id_from_name("coordinator") == -1);
  CHECK(node_id_from_name("node-1x") == -1);
}

// The coordinator's merge does not depend on arrival order (net/streaming_merge.hpp),
// so two runs compare bit for bit.
TEST_CASE("tls: 4 nodes over TLS reach the same state hashes as without TLS") {
  std::vector<uint64_t> hashes[2];
  for (int tls = 0; tls < 2; ++tls) {
    Config cfg = tls ? tls_config(4) : tiny_config(4);
    CoordThread co(cfg, quiet());
    std::vector<std::unique_ptr<TestNode>> nodes;
    for (int p = 0; p < 4; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
    for (int r = 0; r < 2; ++r) {
      const auto st = sync_all(nodes);
      for (const auto& s : st) CHECK(s.state_hash == co.c->stats().state_hash);
      hashes[tls].push_back(st[0].state_hash);
    }
  }
  CHECK(hashes[0] == hashes[1]);
}

TEST_CASE("tls: impersonation, a foreign CA, an expired certificate and plaintext are refused with a reason") {
  const Config cfg = tls_config(2);
  CoordinatorOptions opt = quiet();
  opt.handshake_timeout_s = 1;
  CoordThread co(test_coordinator_params(cfg), opt);
  const std::string d = run_certs();

  SUBCASE("a valid certificate for node 1 claiming node 0") {
    auto n = node_with_cert(cfg, 0, co.address(), d, "node-1");
    CHECK_THROWS_WITH_AS(n->sync(), doctest::Contains("certificate names node 1, Hello claims node 0"), NetError);
  }
  SUBCASE("a certificate from another CA") {
    const std::string other = temp_dir("tls-other-ca");
    CertRequest r;
    r.out_dir = other;
    r.n_nodes = 1;
    make_run_certs(r);
    auto n = node_with_cert(cfg, 0, co.address(), other, "node-0");
    CHECK_THROWS_WITH_AS(n->sync(), doctest::Contains("TLS"), NetError);  // the coordinator's cert is foreign too
  }
  SUBCASE("an expired certificate") {
    const std::string old = temp_dir("tls-expired");
    std::filesystem::copy_file(d + "/ca.crt", old + "/ca.crt");
    make_node_cert(d, old, 0, -30, -1);  // valid from 30 days ago until yesterday
    auto n = node_with_cert(cfg, 0, co.address(), old, "node-0");
    CHECK_THROWS_WITH_AS(n->sync(), doctest::Contains("TLS"), NetError);
  }
  SUBCASE("a plaintext node against the TLS coordinator") {
    TestNode n(tiny_config(2), 0, co.address());
    n.train();
    CHECK_THROWS_WITH_AS(n.sync(), doctest::Contains("requires TLS"), NetError);
  }
  CHECK(wait_until([&] { return co.c->stats().refused >= 1; }, 3));
  // The coordinator keeps serving real nodes.
  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int p = 0; p < 2; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
  CHECK(sync_all(nodes)[0].round == 1);
}

TEST_CASE("tls: a corrupt certificate file is a clear error naming it, before any connection") {
  const Config cfg = tls_config(2);
  CoordThread co(test_coordinator_params(cfg), quiet());
  const std::string d = run_certs();
  const std::string bad = temp_dir("tls-corrupt");
  std::filesystem::copy_file(d + "/ca.crt", bad + "/ca.crt");
  std::filesystem::copy_file(d + "/node-0.key", bad + "/node-0.key");
  std::ofstream(bad + "/node-0.crt") << "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n";
  const std::string path = bad + "/node-0.crt";
  CHECK_THROWS_WITH_AS(node_with_cert(cfg, 0, co.address(), bad, "node-0")->sync(), doctest::Contains(path.c_str()),
                       NetError);
  CHECK(co.c->stats().refused == 0);  // it never got as far as the coordinator
  std::filesystem::remove_all(bad);
}

TEST_CASE("tls: a TLS node against a plaintext coordinator is refused with a reason") {
  CoordThread co(tiny_config(1, Codec::fp32, OwnershipMode::all), quiet());
  Config cfg = tls_config(1);
  cfg.spes.ownership = OwnershipMode::all;
  cfg.spes.experts_per_node = 0;
  auto n = node_with_cert(cfg, 0, co.address(), run_certs(), "node-0");
  CHECK_THROWS_WITH_AS(n->sync(), doctest::Contains("TLS handshake with the coordinator failed"), NetError);
}

namespace {

// `spes-engine local` with n nodes (sync every 2 steps, 4 steps), over TLS with
// certificates made by `spes-engine certs`, or in plaintext. Checks that every
// node reports the coordinator's state hash after each round; returns the
// coordinator's hashes (rounds.csv) in order.
std::vector<std::string> local_run_hashes(const std::string& name, int n_nodes, bool tls) {
  test::TempDir dir(name);
  std::mt19937 g(std::random_device{}());
  const int port = 20000 + int(g() % 12000);
  std::vector<std::string> sets = {"spes.n_nodes=" + std::to_string(n_nodes), "spes.ownership=\"partitioned\"",
                                   "spes.sync_steps=2", "train.steps=4", "spes.run_id=\"local-tls\"",
                                   "spes.round_timeout_s=60",
                                   "spes.coordinator=\"127.0.0.1:" + std::to_string(port) + "\"",
                                   "spes.state_dir=\"" + (dir / "coordinator") + "\""};
  if (tls) sets.push_back("spes.tls_ca=\"" + (dir / "certs/ca.crt") + "\"");
  const Config c = test::small_config(dir.path, sets);
  std::ofstream(dir / "local.toml") << config_to_toml(c);
  const std::string bin = SPES_ENGINE_BIN;
  if (tls)  // the certificates come from the command a user runs
    REQUIRE(std::system((bin + " certs " + (dir / "local.toml") + " --out " + (dir / "certs") + " 2> " +
                         (dir / "certs.log")).c_str()) == 0);
  const int status = std::system((bin + " local " + (dir / "local.toml") + " > " + (dir / "out.csv") + " 2> " +
                                  (dir / "err.log")).c_str());
  INFO("stderr of local:\n" << test::read_text(dir / "err.log"));
  REQUIRE((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  std::vector<std::string> hashes;
  std::istringstream rounds(test::read_text(dir / "coordinator/rounds.csv"));
  std::string line;
  std::getline(rounds, line);  // header
  while (std::getline(rounds, line)) hashes.push_back(line.substr(line.rfind(',') + 1));
  // Every node's CSV rows with a state hash name one of the coordinator's.
  std::istringstream out(test::read_text(dir / "out.csv"));
  std::getline(out, line);
  std::vector<std::string> header;
  for (std::istringstream h(line); std::getline(h, line, ',');) header.push_back(line);
  const size_t col = size_t(std::find(header.begin(), header.end(), "state_hash") - header.begin());
  REQUIRE(col < header.size());
  int reported = 0;
  while (std::getline(out, line)) {
    std::vector<std::string> row;
    for (std::istringstream r(line); std::getline(r, line, ',');) row.push_back(line);
    if (row.size() <= col || row[col].empty()) continue;
    ++reported;
    CHECK(std::find(hashes.begin(), hashes.end(), row[col]) != hashes.end());
  }
  CHECK(reported == n_nodes * 2);
  return hashes;
}

}  // namespace

TEST_CASE("tls: a 4-node `local` run over TLS (certificates from `spes-engine certs`) gives the same hashes as without") {
  const auto plain = local_run_hashes("local-plain", 4, false);
  const auto tls = local_run_hashes("local-tls", 4, true);
  CHECK(plain.size() == 2);
  CHECK(plain == tls);
}

TEST_CASE("tls: config keys are validated and resolved beside tls_ca") {
  Config c = tiny_config(2);
  c.spes.tls_cert = "node.crt";
  CHECK_THROWS_WITH_AS(parse_config_text(config_to_toml(c), "x.toml"), doctest::Contains("need tls_ca"), ConfigError);
  c.spes.tls_cert = "";
  c.spes.tls_ca = run_certs() + "/ca.crt";
  const CoordinatorParams p = coordinator_params(c);
  CHECK(p.tls.cert == run_certs() + "/coordinator.crt");
  CHECK(p.tls.key == run_certs() + "/coordinator.key");
}
