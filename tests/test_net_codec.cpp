// Delta codecs: round trips within each codec's error bound, the int8 exactness
// that makes decoding bit-deterministic, error feedback, malformed payloads.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "net/codec.hpp"

using namespace spes::net;

namespace {
std::vector<float> random_vec(size_t n, float scale, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}
}  // namespace

TEST_CASE("codec: payload sizes") {
  CHECK(encoded_bytes(Codec::fp32, 1000) == 4000);
  CHECK(encoded_bytes(Codec::bf16, 1000) == 2000);
  CHECK(encoded_bytes(Codec::int8, 1000) == 8 * 4 + 1000);  // ceil(1000/128) scales
  CHECK(parse_codec("int8") == Codec::int8);
  CHECK_THROWS(parse_codec("fp8"));
}

TEST_CASE("codec: fp32 is lossless, bf16 within half an ulp of bf16") {
  const auto x = random_vec(1000, 1e-3f, 1);
  std::vector<uint8_t> buf(encoded_bytes(Codec::bf16, 1000));
  std::vector<float> y(1000), r(1000);
  std::vector<uint8_t> fbuf(encoded_bytes(Codec::fp32, 1000));
  encode_delta(Codec::fp32, x.data(), 1000, fbuf.data(), nullptr);
  REQUIRE(decode(Codec::fp32, fbuf.data(), 1000, y.data()));
  CHECK(y == x);
  encode_delta(Codec::bf16, x.data(), 1000, buf.data(), r.data());
  REQUIRE(decode(Codec::bf16, buf.data(), 1000, y.data()));
  for (size_t i = 0; i < x.size(); ++i) {
    CHECK(std::fabs(y[i] - x[i]) <= std::fabs(x[i]) * (1.0f / 256));
    CHECK(r[i] == x[i] - y[i]);
  }
}

TEST_CASE("codec: int8 block-wise error bound, and q*scale is exact in fp32") {
  auto x = random_vec(1000, 1e-2f, 2);
  x[5] = 0.5f;  // one block with a large outlier
  std::vector<uint8_t> buf(encoded_bytes(Codec::int8, 1000));
  std::vector<float> y(1000), r(1000);
  encode_delta(Codec::int8, x.data(), 1000, buf.data(), r.data());
  REQUIRE(decode(Codec::int8, buf.data(), 1000, y.data()));
  for (int64_t b = 0; b * kInt8Block < 1000; ++b) {
    float s;
    std::memcpy(&s, buf.data() + 4 * b, 4);
    CHECK((std::bit_cast<uint32_t>(s) & 0x7Fu) == 0u);  // ≤ 17 significant bits
    float amax = 0;
    for (int64_t i = b * kInt8Block; i < std::min<int64_t>(1000, (b + 1) * kInt8Block); ++i)
      amax = std::max(amax, std::fabs(x[i]));
    CHECK(s >= amax / 127.0f);
    CHECK(s <= amax / 127.0f * 1.0001f);
    const auto* q = reinterpret_cast<const int8_t*>(buf.data() + 4 * 8);
    for (int64_t i = b * kInt8Block; i < std::min<int64_t>(1000, (b + 1) * kInt8Block); ++i) {
      CHECK(std::fabs(y[i] - x[i]) <= s * 0.5f * 1.0001f);
      CHECK(double(y[i]) == double(q[i]) * double(s));  // the product is exact
      CHECK(r[i] == x[i] - y[i]);
    }
  }
}

TEST_CASE("codec: int3 is ≤ 1/8 of fp32's bytes, codes in [-3, 3], q*scale exact, error ≤ scale/2") {
  const int64_t n = 1000 + 5;  // a partial last block and a partial last group
  CHECK(encoded_bytes(Codec::int3, n) == size_t(8 * 4 + 126 * 3));  // ceil(n/128) scales, ceil(n/8) groups
  CHECK(encoded_bytes(Codec::int3, n) * 8 <= size_t(n) * 4);
  CHECK(parse_codec("int3") == Codec::int3);
  auto x = random_vec(size_t(n), 1e-2f, 7);
  x[5] = 0.5f, x[130] = -0.3f, x[1004] = 0.2f;  // outliers, one in the last group
  std::vector<uint8_t> buf(encoded_bytes(Codec::int3, n));
  std::vector<float> y(static_cast<size_t>(n)), r(static_cast<size_t>(n));
  REQUIRE(encode_delta(Codec::int3, x.data(), n, buf.data(), r.data()));
  REQUIRE(decode(Codec::int3, buf.data(), n, y.data()));
  double worst = 0;
  for (int64_t b = 0; b * kInt8Block < n; ++b) {
    float s;
    std::memcpy(&s, buf.data() + 4 * b, 4);
    CHECK((std::bit_cast<uint32_t>(s) & 0x7Fu) == 0u);
    for (int64_t i = b * kInt8Block; i < std::min<int64_t>(n, (b + 1) * kInt8Block); ++i) {
      const double q = double(y[size_t(i)]) / double(s);
      CHECK(q == std::nearbyint(q));  // an integer code times the scale, exactly
      CHECK(std::fabs(q) <= 3);
      worst = std::max(worst, std::fabs(double(y[size_t(i)]) - x[size_t(i)]) / (0.5 * s));
      CHECK(r[size_t(i)] == x[size_t(i)] - y[size_t(i)]);
    }
  }
  MESSAGE("int3 worst error / (scale/2): " << worst);
  CHECK(worst <= 1.0001);
  CHECK(y[5] == doctest::Approx(0.5).epsilon(1e-4));  // the block maximum survives
  CHECK(y[1004] == doctest::Approx(0.2).epsilon(1e-4));
}

TEST_CASE("codec: apply_update is θ_old + decoded, bit-deterministic") {
  for (Codec c : {Codec::fp32, Codec::bf16, Codec::int8, Codec::int3}) {
    CAPTURE(codec_name(c));
    const auto base = random_vec(3000, 0.02f, 3);
    const auto d = random_vec(3000, 1e-3f, 4);
    std::vector<uint8_t> buf(encoded_bytes(c, 3000));
    if (c == Codec::fp32) {
      std::vector<float> v(3000);
      for (size_t i = 0; i < v.size(); ++i) v[i] = base[i] + d[i];
      encode_delta(c, v.data(), 3000, buf.data(), nullptr);  // fp32 carries values
    } else {
      encode_delta(c, d.data(), 3000, buf.data(), nullptr);
    }
    std::vector<float> dec(3000), a(3000), b = base;
    REQUIRE(decode(c, buf.data(), 3000, dec.data()));
    REQUIRE(apply_update(c, buf.data(), 3000, base.data(), a.data()));
    REQUIRE(apply_update(c, buf.data(), 3000, b.data(), b.data()));  // in place
    CHECK(std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
    for (size_t i = 0; i < a.size(); ++i) {
      const float expect = c == Codec::fp32 ? dec[i] : base[i] + dec[i];
      CHECK(std::bit_cast<uint32_t>(a[i]) == std::bit_cast<uint32_t>(expect));
    }
  }
}

TEST_CASE("codec: error feedback carries the quantisation error to later rounds") {
  for (Codec c : {Codec::bf16, Codec::int8, Codec::int3}) {
    CAPTURE(codec_name(c));
    const int64_t n = 512;
    std::vector<float> base(n, 0.0f), params(n), res(n, 0.0f), res2(n);
    std::vector<double> sent(n, 0.0), truth(n, 0.0);
    std::vector<uint8_t> buf(encoded_bytes(c, n));
    std::vector<float> dec(n);
    for (int round = 0; round < 50; ++round) {
      const auto delta = random_vec(size_t(n), 1e-3f, 100 + round);
      for (int64_t i = 0; i < n; ++i) params[i] = base[i] + delta[i], truth[i] += double(params[i]) - double(base[i]);
      REQUIRE(encode_update(c, params.data(), base.data(), res.data(), res2.data(), n, buf.data()));
      REQUIRE(decode(c, buf.data(), n, dec.data()));
      for (int64_t i = 0; i < n; ++i) sent[i] += dec[i];
      res.swap(res2);
    }
    // Σ sent = Σ truth − final residual (up to fp32 rounding of the additions).
    double worst = 0, worst_res = 0;
    for (int64_t i = 0; i < n; ++i) {
      worst = std::max(worst, std::fabs(sent[i] + double(res[i]) - truth[i]));
      worst_res = std::max(worst_res, double(std::fabs(res[i])));
    }
    CHECK(worst < 1e-7);
    CHECK(worst_res < (c == Codec::int3 ? 1.5e-3 : c == Codec::int8 ? 3e-5 : 2e-5));  // bounded, not growing
  }
}

TEST_CASE("codec: malformed payloads and non-finite inputs are refused") {
  const int64_t n = 256;
  std::vector<float> out(n), x(n, 1e-3f), base(n, 0.0f);
  std::vector<uint8_t> buf(encoded_bytes(Codec::int8, n), 0);
  float bad = std::nanf("");
  std::memcpy(buf.data(), &bad, 4);
  CHECK_FALSE(decode(Codec::int8, buf.data(), n, out.data()));
  float neg = -1.0f;
  std::memcpy(buf.data(), &neg, 4);
  CHECK_FALSE(decode(Codec::int8, buf.data(), n, out.data()));
  CHECK_FALSE(apply_update(Codec::int8, buf.data(), n, base.data(), out.data()));
  std::vector<uint8_t> b16(encoded_bytes(Codec::bf16, n), 0);
  b16[2 * 7] = 0xC0, b16[2 * 7 + 1] = 0x7F;  // 0x7FC0: NaN
  CHECK_FALSE(decode(Codec::bf16, b16.data(), n, out.data()));
  std::vector<uint8_t> f32(encoded_bytes(Codec::fp32, n), 0);
  const float inf = INFINITY;
  std::memcpy(f32.data() + 12, &inf, 4);
  CHECK_FALSE(decode(Codec::fp32, f32.data(), n, out.data()));
  x[9] = std::nanf("");
  std::vector<uint8_t> enc(encoded_bytes(Codec::int8, n));
  CHECK_FALSE(encode_update(Codec::int8, x.data(), base.data(), nullptr, nullptr, n, enc.data()));
  CHECK_FALSE(encode_update(Codec::fp32, x.data(), base.data(), nullptr, nullptr, n, f32.data()));
}

TEST_CASE("codec: encode, decode, apply and accumulate on several threads equal one thread bitwise") {
  const int64_t n = 300000 + 77;  // several slices, a partial last block
  const auto params = random_vec(size_t(n), 0.02f, 11), base = random_vec(size_t(n), 0.02f, 12);
  const auto res_in = random_vec(size_t(n), 1e-5f, 13);
  for (Codec c : {Codec::fp32, Codec::bf16, Codec::int8, Codec::int3}) {
    CAPTURE(codec_name(c));
    const size_t bytes = encoded_bytes(c, n);
    std::vector<uint8_t> out1(bytes), outT(bytes);
    std::vector<float> res1(static_cast<size_t>(n)), resT(static_cast<size_t>(n));
    REQUIRE(encode_update(c, params.data(), base.data(), res_in.data(), res1.data(), n, out1.data(), 1));
    for (int threads : {2, 3, 8}) {
      CAPTURE(threads);
      REQUIRE(encode_update(c, params.data(), base.data(), res_in.data(), resT.data(), n, outT.data(), threads));
      CHECK(out1 == outT);
      CHECK(std::memcmp(res1.data(), resT.data(), res1.size() * 4) == 0);
      std::vector<float> d1(static_cast<size_t>(n)), dT(static_cast<size_t>(n)), a1 = base, aT = base, s1 = base, sT = base;
      REQUIRE(decode(c, out1.data(), n, d1.data(), 1));
      REQUIRE(decode(c, out1.data(), n, dT.data(), threads));
      CHECK(std::memcmp(d1.data(), dT.data(), d1.size() * 4) == 0);
      REQUIRE(apply_update(c, out1.data(), n, a1.data(), a1.data(), 1));
      REQUIRE(apply_update(c, out1.data(), n, aT.data(), aT.data(), threads));
      CHECK(std::memcmp(a1.data(), aT.data(), a1.size() * 4) == 0);
      accumulate(c, out1.data(), n, s1.data(), false, 1);
      accumulate(c, out1.data(), n, sT.data(), false, threads);
      CHECK(std::memcmp(s1.data(), sT.data(), s1.size() * 4) == 0);
      for (int64_t i = 0; i < n; i += 9973) CHECK(s1[size_t(i)] == base[size_t(i)] + d1[size_t(i)]);
    }
  }
}

TEST_CASE("codec sparse: top-k of |x|, what was sent round-trips exactly, ≤ 1/16 of the fp32 bytes") {
  const int64_t n = 100000 + 5;
  const auto params = random_vec(size_t(n), 1e-3f, 21);
  const std::vector<float> base(size_t(n), 0.0f);
  const auto res_in = random_vec(size_t(n), 1e-4f, 22);
  std::vector<uint8_t> buf(encoded_bytes(Codec::sparse, n));
  std::vector<float> res(static_cast<size_t>(n)), dec(static_cast<size_t>(n));
  REQUIRE(encode_update(Codec::sparse, params.data(), base.data(), res_in.data(), res.data(), n, buf.data()));
  const size_t bytes = payload_bytes(Codec::sparse, buf.data(), n);
  MESSAGE("sparse payload: " << bytes << " bytes for " << n << " values, 1/" << double(n) * 4 / double(bytes)
                             << " of fp32");
  CHECK(bytes * 16 <= size_t(n) * 4);
  CHECK(payload_size_ok(Codec::sparse, buf.data(), bytes, n));
  CHECK_FALSE(payload_size_ok(Codec::sparse, buf.data(), bytes + 1, n));
  REQUIRE(decode(Codec::sparse, buf.data(), n, dec.data()));
  int64_t sent = 0;
  float min_sent = INFINITY, max_kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float x = params[size_t(i)] + res_in[size_t(i)];
    CHECK(dec[size_t(i)] + res[size_t(i)] == x);  // exact: sent + residual = x, bit for bit
    if (dec[size_t(i)] != 0.0f) ++sent, min_sent = std::min(min_sent, std::fabs(x));
    else max_kept = std::max(max_kept, res[size_t(i)] == x ? std::fabs(x) : 0.0f);
  }
  CHECK(sent <= (n + 31) / 32);
  CHECK(sent > (n + 31) / 32 * 9 / 10);  // few selected entries quantise to 0
  // Selection by the top 12 bits of |x|: what stays is at most one bucket above what is sent.
  CHECK(max_kept <= min_sent * 1.07f);
  // The coordinator's apply and accumulate see the same decoded values.
  std::vector<float> applied(static_cast<size_t>(n)), acc(size_t(n), 1.0f);
  REQUIRE(apply_update(Codec::sparse, buf.data(), n, base.data(), applied.data()));
  accumulate(Codec::sparse, buf.data(), n, acc.data(), true);
  CHECK(std::memcmp(applied.data(), dec.data(), dec.size() * 4) == 0);
  CHECK(std::memcmp(acc.data(), dec.data(), dec.size() * 4) == 0);
}

TEST_CASE("codec sparse: error feedback over 50 rounds loses nothing (Σ sent + residual = Σ Δ)") {
  const int64_t n = 4096;
  std::vector<float> base(size_t(n), 0.0f), params(static_cast<size_t>(n)), res(size_t(n), 0.0f), dec(static_cast<size_t>(n));
  std::vector<double> sent(size_t(n), 0.0), truth(size_t(n), 0.0);
  std::vector<uint8_t> buf(encoded_bytes(Codec::sparse, n));
  for (int round = 0; round < 50; ++round) {
    const auto delta = random_vec(size_t(n), 1e-3f, 300 + round);
    for (int64_t i = 0; i < n; ++i) {
      params[size_t(i)] = base[size_t(i)] + delta[size_t(i)];
      truth[size_t(i)] += double(params[size_t(i)]) - double(base[size_t(i)]);
    }
    REQUIRE(encode_update(Codec::sparse, params.data(), base.data(), res.data(), res.data(), n, buf.data()));
    REQUIRE(decode(Codec::sparse, buf.data(), n, dec.data()));
    for (int64_t i = 0; i < n; ++i) sent[size_t(i)] += dec[size_t(i)], base[size_t(i)] = params[size_t(i)];
  }
  // Each round's x = Δ + residual is formed in fp32 (one rounding of the sum); the split
  // of x into sent + residual is exact. Tolerance: 50 roundings of values ≤ ~1e-2.
  double worst = 0, worst_res = 0;
  for (int64_t i = 0; i < n; ++i) {
    worst = std::max(worst, std::fabs(sent[size_t(i)] + double(res[size_t(i)]) - truth[size_t(i)]));
    worst_res = std::max(worst_res, double(std::fabs(res[size_t(i)])));
  }
  MESSAGE("sparse error feedback, 50 rounds: worst |Σ sent + residual − Σ Δ| = " << worst << " (tolerance 1e-7), "
          "largest residual " << worst_res);
  CHECK(worst < 1e-7);
  CHECK(worst_res < 0.05);  // carried, not growing without bound (Δ ~ 1e-3 per round)
}

TEST_CASE("codec sparse: malformed payloads are refused") {
  const int64_t n = 1000;
  auto x = random_vec(size_t(n), 1e-3f, 5);
  x[998] = x[999] = 1.0f;  // sent: the last gap is one byte (0)
  std::vector<uint8_t> buf(encoded_bytes(Codec::sparse, n));
  std::vector<float> out(static_cast<size_t>(n));
  encode_delta(Codec::sparse, x.data(), n, buf.data(), nullptr);
  const size_t bytes = payload_bytes(Codec::sparse, buf.data(), n);
  REQUIRE(decode(Codec::sparse, buf.data(), n, out.data()));
  CHECK_FALSE(decode(Codec::sparse, buf.data(), n - 40, out.data()));  // k does not fit n
  auto bad = buf;
  REQUIRE(buf[bytes - 1] == 0);
  bad[bytes - 1] = 0x7F;  // the last index becomes 998 + 128: past n
  CHECK_FALSE(decode(Codec::sparse, bad.data(), n, out.data()));
  bad = buf;
  const float nan = std::nanf("");
  std::memcpy(bad.data() + 8, &nan, 4);  // a NaN scale
  CHECK_FALSE(decode(Codec::sparse, bad.data(), n, out.data()));
  bad = buf;
  bad[bytes - 1] |= 0x80;  // a varint running past the gap bytes
  CHECK_FALSE(decode(Codec::sparse, bad.data(), n, out.data()));
}
