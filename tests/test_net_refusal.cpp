// Refusals: wrong secret, protocol version, fingerprint, run id, codec, node id,
// duplicate node id → a clean Error frame with a plain reason, the connection
// closes, and the coordinator keeps serving (real nodes complete a round after).
#include <doctest/doctest.h>

#include "engine/base/error.hpp"
#include "net_test_util.hpp"

using namespace spes;
using namespace spes::net;
using namespace spes::net::testing;

namespace {

// Sends a Hello built by `edit` and returns the coordinator's reply.
template <class Edit>
Reply hello_reply(const CoordThread& co, const Config& cfg, Edit&& edit, uint16_t header_version = kProtocolVersion,
                  uint16_t hello_version = kProtocolVersion) {
  RawConn c;
  REQUIRE(c.connect(co.port()));
  std::array<uint8_t, kNonceBytes> nonce;
  REQUIRE(read_challenge(c, nonce));
  HelloFields h = make_hello(cfg, 0, nonce);
  edit(h, nonce);
  std::vector<uint8_t> f = hello_frame(h, hello_version);
  f[4] = uint8_t(header_version);  // the header's version (u16 little-endian at offset 4)
  REQUIRE(c.send_all(f.data(), f.size()));
  Reply r = read_reply(c);
  CHECK(c.wait_closed());  // refused → closed
  return r;
}

void expect_error(const Reply& r, wire::ErrorCode code, const char* words) {
  CHECK(r.error);
  CHECK(r.code == code);
  CHECK_MESSAGE(r.reason.find(words) != std::string::npos, r.reason);
}

}  // namespace

TEST_CASE("refusals: each mismatch gets an Error with a plain reason; the coordinator keeps serving") {
  const Config cfg = tiny_config(2, Codec::int8);
  CoordinatorOptions opt;
  opt.log = false;
  CoordThread co(cfg, opt);

  expect_error(hello_reply(co, cfg, [](HelloFields& h, auto&) { h.proof[0] ^= 1; }), wire::ErrorCode_auth,
               "authentication failed");
  expect_error(hello_reply(co, cfg, [&](HelloFields& h, auto& n) {
                 h.proof = hmac_sha256("wrong-secret-0123456789", hello_proof_message(n, h.run_id, 0, h.fingerprint));
               }),
               wire::ErrorCode_auth, "authentication failed");
  expect_error(hello_reply(co, cfg, [](HelloFields&, auto&) {}, kProtocolVersion, kProtocolVersion + 1),
               wire::ErrorCode_protocol_version, "protocol version mismatch");
  expect_error(hello_reply(co, cfg, [](HelloFields&, auto&) {}, 7), wire::ErrorCode_protocol_version,
               "protocol version mismatch");
  expect_error(hello_reply(co, cfg, [](HelloFields& h, auto& n) {
                 h.fingerprint ^= 0x100;
                 h.proof = hmac_sha256("test-secret-0123456789", hello_proof_message(n, h.run_id, 0, h.fingerprint));
               }),
               wire::ErrorCode_fingerprint, "fingerprint mismatch");
  expect_error(hello_reply(co, cfg, [](HelloFields& h, auto& n) {
                 h.run_id = "another-run";
                 h.proof = hmac_sha256("test-secret-0123456789", hello_proof_message(n, h.run_id, 0, h.fingerprint));
               }),
               wire::ErrorCode_run_id, "run id mismatch");
  expect_error(hello_reply(co, cfg, [](HelloFields& h, auto&) { h.codec = Codec::fp32; }), wire::ErrorCode_codec,
               "codec mismatch");
  expect_error(hello_reply(co, cfg, [](HelloFields& h, auto& n) {
                 h.node_id = 9;
                 h.proof = hmac_sha256("test-secret-0123456789", hello_proof_message(n, h.run_id, 9, h.fingerprint));
               }),
               wire::ErrorCode_bad_node, "outside this run");

  // Duplicate node id: a live authenticated node 0, then a second Hello as node 0.
  {
    RawConn first;
    REQUIRE(first.connect(co.port()));
    std::array<uint8_t, kNonceBytes> nonce;
    REQUIRE(read_challenge(first, nonce));
    FrameWriter w;
    REQUIRE(first.send_frame(w.hello(make_hello(cfg, 0, nonce))));
    REQUIRE(read_reply(first).welcome);
    expect_error(hello_reply(co, cfg, [](HelloFields&, auto&) {}), wire::ErrorCode_duplicate_node,
                 "already connected");
  }  // first disconnects

  // A message other than Hello first, and a push from a node that is not in sync.
  {
    RawConn c;
    REQUIRE(c.connect(co.port()));
    std::array<uint8_t, kNonceBytes> nonce;
    REQUIRE(read_challenge(c, nonce));
    FrameWriter w;
    REQUIRE(c.send_frame(w.snapshot_request()));
    expect_error(read_reply(c), wire::ErrorCode_unexpected, "expected Hello");
  }
  CHECK(wait_until([&] { return co.c->stats().refused >= 10; }));

  // SyncClient surfaces a refusal as one clear NetError line.
  {
    TestNode bad(cfg, 1, co.address(), {}, "wrong-secret-0123456789");
    bad.train();
    CHECK_THROWS_WITH_AS(bad.sync(), doctest::Contains("authentication failed"), NetError);
  }

  // Still serving: two real nodes complete a round (node 0's earlier session is gone).
  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int p = 0; p < 2; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
  const auto st = sync_all(nodes);
  CHECK(st[0].round == 1);
  CHECK(st[1].state_hash == st[0].state_hash);
  CHECK(co.c->stats().state_hash == st[0].state_hash);
}

TEST_CASE("refusals: a node refuses a coordinator that cannot prove the secret") {
  // A fake coordinator: correct framing, but its Welcome proof is not HMAC(secret, ...).
  const Config cfg = tiny_config(1, Codec::fp32, OwnershipMode::all);
  int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(lfd, 4) == 0);
  socklen_t len = sizeof a;
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len);
  const uint16_t port = ntohs(a.sin_port);
  std::thread fake([&] {
    RawConn c;
    c.fd = ::accept(lfd, nullptr, nullptr);
    FrameWriter w;
    std::array<uint8_t, kNonceBytes> nonce{};
    c.send_frame(w.challenge(nonce));
    std::vector<uint8_t> p;
    c.read_frame(p);
    WelcomeFields wf;
    wf.chunk_elems = 1024;
    wf.n_nodes = 1;
    wf.in_sync = true;  // proof left zero
    c.send_frame(w.welcome(wf));
    c.wait_closed(5);
  });
  SyncClientOptions o;
  TestNode node(cfg, 0, "127.0.0.1:" + std::to_string(port), o);
  node.train();
  CHECK_THROWS_WITH_AS(node.sync(), doctest::Contains("failed to prove the shared secret"), NetError);
  fake.join();
  ::close(lfd);
}
