// Fuzz: ≥ 10,000 random, truncated, bit-flipped, oversized and semantically bad
// frames at a running coordinator, one connection each. Every one is refused (the
// refusal counter moves by exactly one per connection), nothing crashes, memory
// stays bounded, and real nodes complete a round afterwards.
#include <doctest/doctest.h>

#include <random>

#include "net/grid.hpp"
#include "net_test_util.hpp"

using namespace spes;
using namespace spes::net;
using namespace spes::net::testing;

namespace {

std::vector<uint8_t> frame_bytes(const FrameView& v) {
  std::vector<uint8_t> b(v.size());
  std::memcpy(b.data(), v.header, kHeaderBytes);
  std::memcpy(b.data() + kHeaderBytes, v.body, v.body_size);
  return b;
}

// A Hello with a proof no secret produces.
std::vector<uint8_t> bad_hello(const Config& cfg, std::mt19937_64& g) {
  std::array<uint8_t, kNonceBytes> nonce{};
  HelloFields h = make_hello(cfg, int(g() % 2), nonce);
  for (auto& b : h.proof) b = uint8_t(g());
  FrameWriter w;
  return frame_bytes(w.hello(h));
}

}  // namespace

TEST_CASE("fuzz: 10,000 hostile frames are refused; the coordinator keeps serving with bounded memory") {
  const Config cfg = tiny_config(2, Codec::int8);
  CoordinatorOptions opt;
  opt.log = false;
  CoordThread co(cfg, opt);
  const ParamLayout layout = make_layout(cfg.model);
  const ChunkGrid grid = make_grid(layout, cfg.model.n_experts, 1024);
  std::mt19937_64 g(20240601);
  const long rss0 = rss_kib();
  const int64_t refused0 = co.c->stats().refused;
  const int kFrames = 10000;
  int welcomed = 0, no_close = 0;
  std::vector<int> per_kind(8, 0);
  FrameWriter w(1 << 16);

  for (int i = 0; i < kFrames; ++i) {
    const int kind = i % 8;
    ++per_kind[kind];
    RawConn c;
    REQUIRE(c.connect(co.port()));
    std::vector<uint8_t> out;
    switch (kind) {
      case 0: {  // random bytes
        out.resize(g() % 65);
        for (auto& b : out) b = uint8_t(g());
        break;
      }
      case 1: {  // good header, random payload with a matching CRC
        std::vector<uint8_t> p(8 + g() % 1000);
        for (auto& b : p) b = uint8_t(g());
        out.resize(kHeaderBytes + p.size());
        write_header(out.data(), uint32_t(p.size()), crc32c(p.data(), p.size()));
        std::memcpy(out.data() + kHeaderBytes, p.data(), p.size());
        break;
      }
      case 2: {  // bit flips anywhere, CRC not fixed
        out = bad_hello(cfg, g);
        for (int f = 0, nf = 1 + int(g() % 4); f < nf; ++f) out[g() % out.size()] ^= uint8_t(1u << (g() % 8));
        break;
      }
      case 3: {  // bit flips in the payload with the CRC fixed: the verifier's turn
        out = bad_hello(cfg, g);
        for (int f = 0, nf = 1 + int(g() % 4); f < nf; ++f)
          out[kHeaderBytes + g() % (out.size() - kHeaderBytes)] ^= uint8_t(1u << (g() % 8));
        write_header(out.data(), uint32_t(out.size() - kHeaderBytes), crc32c(out.data() + kHeaderBytes, out.size() - kHeaderBytes));
        break;
      }
      case 4: {  // truncated
        out = bad_hello(cfg, g);
        out.resize(g() % out.size());
        break;
      }
      case 5: {  // oversized: refused before anything is allocated
        out.resize(kHeaderBytes);
        const uint32_t len = kMaxHandshakeFrameBytes + 1 + uint32_t(g() % (0xFFFFFFFFu - kMaxHandshakeFrameBytes));
        write_header(out.data(), len, uint32_t(g()));
        break;
      }
      case 6: {  // well-formed Hello with out-of-bounds or random fields
        flatbuffers::FlatBufferBuilder b;
        std::string run(g() % 300, 'x');
        std::vector<uint8_t> nn(g() % 64), pr(g() % 64);
        auto run_o = b.CreateString(run);
        auto nn_o = b.CreateVector(nn);
        auto pr_o = b.CreateVector(pr);
        auto m = wire::CreateHello(b, uint16_t(g() % 3), run_o, int32_t(g()), g(), wire::Codec(g() % 4),
                                   int64_t(g()), g(), nn_o, pr_o);
        out = envelope_frame(b, wire::Message_Hello, m.Union());
        break;
      }
      case 7: {  // authenticated node, then a bad message
        std::array<uint8_t, kNonceBytes> nonce;
        REQUIRE(read_challenge(c, nonce));
        const int node = int(g() % 2);
        HelloFields h = make_hello(cfg, node, nonce);
        h.state_hash = co.c->stats().state_hash;  // in sync: pushes reach the range/payload checks
        REQUIRE(c.send_frame(w.hello(h)));
        const Reply r = read_reply(c);
        REQUIRE(r.welcome);
        ++welcomed;
        const Ownership own = make_ownership(cfg.model, layout, node, 2, cfg.spes.ownership, cfg.spes.experts_per_node);
        const auto chunks = grid.chunks_in(own.space.ranges()[g() % own.space.ranges().size()]);
        const GridChunk ch = grid.chunks[chunks[g() % chunks.size()]];
        ChunkTag t{1, 5, node, ch.begin, ch.end, Codec::int8};
        size_t bytes = encoded_bytes(Codec::int8, ch.size());
        bool nan_scale = false, bad_crc = false;
        switch (g() % 9) {
          case 0: t.begin += 1 + int64_t(g() % 100); break;               // not a grid chunk
          case 1: t.begin = -int64_t(g() % 1000000), t.end = int64_t(g()); break;
          case 2: bytes += (g() % 2) ? 1 : -1; break;                     // wrong payload size
          case 3: t.codec = Codec::bf16; break;                           // codec mismatch
          case 4: t.round = 2 + int64_t(g() % 1000); break;               // a future round
          case 5: t.node_id = 1 - node; break;                            // someone else's push
          case 6: nan_scale = true; break;                                // NaN in the payload
          case 7: bad_crc = true; break;                                  // chunk checksum wrong
          case 8: {
            const int t8 = int(g() % 3);
            if (t8 == 0) out = frame_bytes(w.welcome(WelcomeFields{}));  // not a node's message
            else if (t8 == 1) out = frame_bytes(w.round_done(1, 5, 0, 0, 1, 0.0));
            else {  // 1 MiB of garbage under a valid header and CRC
              std::vector<uint8_t> p(1 << 20);
              for (auto& x : p) x = uint8_t(g());
              out.resize(kHeaderBytes + p.size());
              write_header(out.data(), uint32_t(p.size()), crc32c(p.data(), p.size()));
              std::memcpy(out.data() + kHeaderBytes, p.data(), p.size());
            }
            break;
          }
        }
        if (out.empty()) {
          out = frame_bytes(w.push_chunk(t, bytes, [&](uint8_t* p) {
            std::memset(p, 0, bytes);
            if (nan_scale) {
              const float nan = std::nanf("");
              std::memcpy(p, &nan, 4);
            }
          }));
          if (bad_crc) {
            // Flip the chunk checksum and re-seal the frame: only the chunk check can catch it.
            flatbuffers::FlatBufferBuilder b;
            std::vector<uint8_t> payload(bytes, 0);
            auto pv = b.CreateVector(payload);
            auto m = wire::CreatePushChunk(b, t.round, t.node_id, t.step, t.begin, t.end, wire::Codec(t.codec),
                                           crc32c(payload.data(), payload.size()) ^ 1u, pv);
            out = envelope_frame(b, wire::Message_PushChunk, m.Union());
          }
        }
        break;
      }
    }
    if (!out.empty()) out = c.sealed(std::move(out));  // sealed once welcomed: the push checks are reached
    if (!out.empty()) c.send_all(out.data(), out.size());
    ::shutdown(c.fd, SHUT_WR);
    if (!c.wait_closed(10)) ++no_close;
  }
  CHECK(no_close == 0);
  CHECK(welcomed == kFrames / 8);
  // Exactly one refusal per connection.
  CHECK(wait_until([&] { return co.c->stats().refused - refused0 == kFrames; }));
  CHECK(co.c->stats().refused - refused0 == kFrames);
  CHECK(co.c->stats().round == 0);  // nothing got merged
  CHECK(wait_until([&] { return co.c->stats().live_sessions == 0; }));
  const long grown_mib = (rss_kib() - rss0) / 1024;
  MESSAGE("RSS grew by " << grown_mib << " MiB over " << kFrames << " hostile connections");
#if !defined(__SANITIZE_ADDRESS__)  // ASan's quarantine keeps freed memory resident
  CHECK(grown_mib < 64);
#endif

  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int p = 0; p < 2; ++p) nodes.push_back(std::make_unique<TestNode>(cfg, p, co.address()));
  const auto st = sync_all(nodes);
  CHECK(st[0].round == 1);
  CHECK(st[0].state_hash == st[1].state_hash);
  CHECK(st[0].state_hash == co.c->stats().state_hash);
}
