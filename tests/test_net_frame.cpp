// Framing, verification, checksums, hashes, HMAC and the chunk grid.
#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <string>

#include "net/digest.hpp"
#include "net/frame.hpp"
#include "net/grid.hpp"
#include "net_test_util.hpp"

using namespace spes;
using namespace spes::net;

TEST_CASE("digest: CRC32C, HMAC-SHA256 test vectors; streaming state hash") {
  const char* s = "123456789";
  CHECK(crc32c(s, 9) == 0xE3069283u);
  CHECK(crc32c(s + 4, 5, crc32c(s, 4)) == 0xE3069283u);  // incremental
  // The interleaved fast path (long buffers) against a plain bitwise CRC32C.
  std::vector<uint8_t> big(100003);
  std::mt19937 g(1);
  for (auto& b : big) b = uint8_t(g());
  for (size_t n : {size_t(0), size_t(1), size_t(24575), size_t(24576), size_t(24583), size_t(60000), big.size()}) {
    uint32_t ref = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; ++i) {
      ref ^= big[i];
      for (int k = 0; k < 8; ++k) ref = (ref & 1) ? (ref >> 1) ^ 0x82F63B78u : ref >> 1;
    }
    CHECK(crc32c(big.data(), n) == ~ref);
  }
  CHECK(crc32c(big.data() + 30000, big.size() - 30000, crc32c(big.data(), 30000)) == crc32c(big.data(), big.size()));
  const std::string data = "what do ya want for nothing?";
  const Digest d = hmac_sha256("Jefe", std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(data.data()), data.size()));
  std::string hex;
  for (uint8_t b : d) {
    char x[3];
    std::snprintf(x, 3, "%02x", b);
    hex += x;
  }
  CHECK(hex == "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");  // RFC 4231 case 2

  std::vector<float> v(10007);
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(i) * 0.25f;
  const uint64_t h = state_hash(v.data(), int64_t(v.size()));
  for (size_t split : {size_t(1), size_t(7), size_t(8), size_t(5000), size_t(10006)}) {
    StateHasher sh;
    sh.update(v.data(), int64_t(split));
    sh.update(v.data() + split, int64_t(v.size() - split));
    CHECK(sh.digest() == h);
  }
  // Known answers: the state hash proves θ is the same on every node and the
  // coordinator, so no build or CPU may change it (the AVX2 and the portable path
  // both give these).
  CHECK(h == 0xdbc4f01328768a70ull);
  const std::vector<std::pair<size_t, uint64_t>> known = {
      {0, 0x59939875c9e6dfcdull},    {3, 0x5ff836e666cdb5d6ull},    {64, 0x7f74ffaa41e2ed79ull},
      {1024, 0x330867c3d9357d60ull}, {1030, 0x55b15e86063182d2ull}, {40000, 0xde4f4eac31ff8441ull}};
  for (const auto& [n, want] : known) {
    StateHasher sh;
    sh.update(static_cast<const void*>(v.data()), n);
    CHECK(sh.digest() == want);
  }
  {  // swapping two 64-byte stripes inside one block changes the hash
    std::vector<float> w = v;
    std::swap_ranges(w.begin(), w.begin() + 16, w.begin() + 16);
    CHECK(state_hash(w.data(), int64_t(w.size())) != h);
  }
  v[1234] = std::nextafter(v[1234], 1e9f);  // one ulp anywhere changes the hash
  CHECK(state_hash(v.data(), int64_t(v.size())) != h);
  float z = 0.0f, nz = -0.0f;
  CHECK(state_hash(&z, 1) != state_hash(&nz, 1));  // bits, not values
}

TEST_CASE("frame: header checks happen before the payload is read") {
  uint8_t h[kHeaderBytes];
  FrameHeader fh;
  write_header(h, 100, 0xABCD);
  CHECK(parse_header(h, 1024, &fh) == HeaderCheck::ok);
  CHECK(fh.length == 100);
  CHECK(fh.crc == 0xABCDu);
  CHECK(parse_header(h, 99, &fh) == HeaderCheck::too_large);
  write_header(h, 0xFFFFFFF0u, 0);
  CHECK(parse_header(h, kMaxFrameBytes, &fh) == HeaderCheck::too_large);
  CHECK(header_problem(HeaderCheck::too_large, fh, kMaxFrameBytes).find("outside") != std::string::npos);
  write_header(h, 4, 0);
  CHECK(parse_header(h, 1024, &fh) == HeaderCheck::too_large);  // shorter than any envelope
  write_header(h, 100, 0, kProtocolVersion + 1);
  CHECK(parse_header(h, 1024, &fh) == HeaderCheck::bad_version);
  CHECK(header_problem(HeaderCheck::bad_version, fh, 1024).find("protocol version mismatch") != std::string::npos);
  write_header(h, 100, 0);
  h[0] ^= 1;
  CHECK(parse_header(h, 1024, &fh) == HeaderCheck::bad_magic);
}

TEST_CASE("frame: built frames open; checksum and verifier catch corruption") {
  FrameWriter w;
  std::vector<float> vals(300);
  for (size_t i = 0; i < vals.size(); ++i) vals[i] = float(i);
  ChunkTag t{3, 30, 1, 1000, 1300, Codec::fp32};
  const FrameView v = w.push_chunk(t, 1200, [&](uint8_t* p) { std::memcpy(p, vals.data(), 1200); });
  FrameHeader fh;
  REQUIRE(parse_header(v.header, kMaxFrameBytes, &fh) == HeaderCheck::ok);
  REQUIRE(fh.length == v.body_size);
  std::string why;
  std::vector<uint8_t> body(v.body, v.body + v.body_size);
  const wire::Envelope* env = open_payload(body.data(), body.size(), fh.crc, &why);
  REQUIRE(env);
  REQUIRE(env->msg_type() == wire::Message_PushChunk);
  const auto* m = env->msg_as_PushChunk();
  CHECK(m->round() == 3);
  CHECK(m->begin() == 1000);
  CHECK(m->end() == 1300);
  CHECK(m->checksum() == crc32c(m->payload()->data(), 1200));
  CHECK(std::memcmp(m->payload()->data(), vals.data(), 1200) == 0);

  body[body.size() / 2] ^= 0x10;
  CHECK(open_payload(body.data(), body.size(), fh.crc, &why) == nullptr);
  CHECK(why.find("checksum") != std::string::npos);

  // Structural damage with a matching CRC: the verifier refuses it.
  std::mt19937 g(5);
  int refused = 0;
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<uint8_t> b(v.body, v.body + std::min<size_t>(v.body_size, 64));
    for (auto& x : b) x = uint8_t(g());
    if (!open_payload(b.data(), b.size(), crc32c(b.data(), b.size()), &why)) ++refused;
  }
  CHECK(refused == 200);
  std::vector<uint8_t> trunc(v.body, v.body + v.body_size - 700);
  CHECK(open_payload(trunc.data(), trunc.size(), crc32c(trunc.data(), trunc.size()), &why) == nullptr);
}

TEST_CASE("grid: chunks cover the buffer, never straddle segments, and are found by range") {
  const Config cfg = testing::tiny_config(2);
  const ParamLayout L = make_layout(cfg.model);
  const ChunkGrid g = make_grid(L, cfg.model.n_experts, 1024);
  int64_t at = 0;
  for (const GridChunk& c : g.chunks) {
    CHECK(c.begin == at);
    CHECK(c.size() <= 1024);
    CHECK(c.size() > 0);
    if (c.segment == 0) CHECK(c.end <= L.shared_count);
    else CHECK((c.begin >= L.expert_begin(c.segment - 1) && c.end <= L.expert_begin(c.segment - 1) + L.expert_block));
    CHECK(g.find(c.begin, c.end) == int(&c - g.chunks.data()));
    at = c.end;
  }
  CHECK(at == L.total);
  CHECK(g.find(0, 5) == -1);
  CHECK(g.find(-5, 0) == -1);
  const Ownership own = make_ownership(cfg.model, L, 1, 2, OwnershipMode::partitioned, 0);
  int64_t covered = 0;
  for (const Range& r : own.space.ranges())
    for (int c : g.chunks_in(r)) covered += g.chunks[c].size();
  CHECK(covered == own.space.size());
}
