#include "net/codec.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "engine/base/error.hpp"

namespace spes::net {

namespace {

inline uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }
inline float float_of(uint32_t u) { return std::bit_cast<float>(u); }

inline uint16_t to_bf16(float f) {  // round to nearest even; callers pass finite values
  const uint32_t u = bits_of(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float from_bf16(uint16_t b) { return float_of(uint32_t(b) << 16); }

// Deltas below this are flushed to zero so q·scale never reaches subnormals.
constexpr float kInt8MinAmax = 1e-30f;

// Scale for a block with max |x| = amax: amax/127 rounded *up* to 17 significant
// bits (see the header: exact dequantisation).
inline float int8_scale(float amax) {
  if (!(amax >= kInt8MinAmax)) return 0.0f;
  uint32_t u = bits_of(amax / 127.0f);
  if (u & 0x7Fu) u = (u | 0x7Fu) + 1u;
  return float_of(u);
}
// What a decoder accepts as a scale: the low mantissa bits are masked so the
// product stays exact whatever the sender wrote.
inline float canonical_scale(float s) { return float_of(bits_of(s) & ~0x7Fu); }
// A scale no encoder produces (127·s would overflow, or it is negative/NaN).
inline bool bad_scale(float s) { return !(s >= 0.0f && s <= 1e36f); }

inline int8_t quantise(float x, float scale) {
  const float q = std::nearbyint(x / scale);
  return static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
}

// int8 layout: [n_blocks fp32 scales][n int8 values].
inline int64_t n_blocks(int64_t n) { return (n + kInt8Block - 1) / kInt8Block; }

// Quantises x[0, n) into one int8 payload; dq (may be null) receives the decoded values.
void int8_encode(const float* x, int64_t n, uint8_t* out, float* dq) {
  const int64_t nb = n_blocks(n);
  auto* q = reinterpret_cast<int8_t*>(out + 4 * nb);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * kInt8Block, i1 = std::min(n, i0 + kInt8Block);
    float amax = 0.0f;
    for (int64_t i = i0; i < i1; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float s = int8_scale(amax);
    std::memcpy(out + 4 * b, &s, 4);
    if (s == 0.0f) {
      for (int64_t i = i0; i < i1; ++i) q[i] = 0;
      if (dq) std::fill(dq + i0, dq + i1, 0.0f);
      continue;
    }
    for (int64_t i = i0; i < i1; ++i) q[i] = quantise(x[i], s);
    if (dq)
      for (int64_t i = i0; i < i1; ++i) dq[i] = float(q[i]) * s;
  }
}

bool int8_decode(const uint8_t* in, int64_t n, float* out) {
  const int64_t nb = n_blocks(n);
  const auto* q = reinterpret_cast<const int8_t*>(in + 4 * nb);
  for (int64_t b = 0; b < nb; ++b) {
    float s;
    std::memcpy(&s, in + 4 * b, 4);
    if (bad_scale(s)) return false;
    s = canonical_scale(s);
    const int64_t i0 = b * kInt8Block, i1 = std::min(n, i0 + kInt8Block);
    for (int64_t i = i0; i < i1; ++i) out[i] = float(q[i]) * s;
  }
  return true;
}

bool all_finite(const float* x, int64_t n) {
  // Branch-free OR of "exponent all ones" so the loop vectorises.
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= uint32_t((bits_of(x[i]) & 0x7F800000u) == 0x7F800000u);
  return bad == 0;
}

}  // namespace

Codec parse_codec(const std::string& name) {
  if (name == "fp32") return Codec::fp32;
  if (name == "bf16") return Codec::bf16;
  if (name == "int8") return Codec::int8;
  throw ConfigError("[spes] codec: expected \"fp32\", \"bf16\" or \"int8\", got \"" + name + "\"");
}

const char* codec_name(Codec c) {
  switch (c) {
    case Codec::fp32: return "fp32";
    case Codec::bf16: return "bf16";
    case Codec::int8: return "int8";
  }
  return "?";
}

bool codec_is_lossy(Codec c) { return c != Codec::fp32; }

size_t encoded_bytes(Codec c, int64_t n) {
  switch (c) {
    case Codec::fp32: return size_t(n) * 4;
    case Codec::bf16: return size_t(n) * 2;
    case Codec::int8: return size_t(n_blocks(n)) * 4 + size_t(n);
  }
  return 0;
}

bool encode_update(Codec c, const float* params, const float* base, const float* residual_in,
                   float* residual_out, int64_t n, uint8_t* out) {
  if (c == Codec::fp32) {
    if (!all_finite(params, n)) return false;
    std::memcpy(out, params, size_t(n) * 4);
    return true;
  }
  // x = (params − base) + residual, one block at a time so x stays in cache.
  float x[kInt8Block], dq[kInt8Block];
  for (int64_t i0 = 0; i0 < n; i0 += kInt8Block) {
    const int64_t m = std::min(kInt8Block, n - i0);
    for (int64_t i = 0; i < m; ++i) {
      const float d = params[i0 + i] - base[i0 + i];
      x[i] = residual_in ? d + residual_in[i0 + i] : d;
    }
    if (!all_finite(x, m)) return false;
    if (c == Codec::bf16) {
      auto* o = out + 2 * i0;
      for (int64_t i = 0; i < m; ++i) {
        const uint16_t b = to_bf16(x[i]);
        std::memcpy(o + 2 * i, &b, 2);
        dq[i] = from_bf16(b);
      }
    } else {
      // Blocks of the payload are kInt8Block wide, so block i0/kInt8Block of the
      // chunk is encoded here; scales first, values after.
      const int64_t b = i0 / kInt8Block;
      const int64_t nb = n_blocks(n);
      float amax = 0.0f;
      for (int64_t i = 0; i < m; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float s = int8_scale(amax);
      std::memcpy(out + 4 * b, &s, 4);
      auto* q = reinterpret_cast<int8_t*>(out + 4 * nb) + i0;
      for (int64_t i = 0; i < m; ++i) {
        q[i] = s == 0.0f ? int8_t(0) : quantise(x[i], s);
        dq[i] = float(q[i]) * s;
      }
    }
    if (residual_out)
      for (int64_t i = 0; i < m; ++i) residual_out[i0 + i] = x[i] - dq[i];
  }
  return true;
}

void encode_delta(Codec c, const float* x, int64_t n, uint8_t* out, float* residual_out) {
  switch (c) {
    case Codec::fp32:
      std::memcpy(out, x, size_t(n) * 4);
      if (residual_out) std::fill(residual_out, residual_out + n, 0.0f);
      return;
    case Codec::bf16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t b = to_bf16(x[i]);
        std::memcpy(out + 2 * i, &b, 2);
        if (residual_out) residual_out[i] = x[i] - from_bf16(b);
      }
      return;
    case Codec::int8: {
      if (!residual_out) {
        int8_encode(x, n, out, nullptr);
        return;
      }
      int8_encode(x, n, out, residual_out);  // residual_out first holds the decoded values
      for (int64_t i = 0; i < n; ++i) residual_out[i] = x[i] - residual_out[i];
      return;
    }
  }
}

bool decode(Codec c, const uint8_t* in, int64_t n, float* out) {
  switch (c) {
    case Codec::fp32:
      std::memcpy(out, in, size_t(n) * 4);
      return all_finite(out, n);
    case Codec::bf16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, in + 2 * i, 2);
        out[i] = from_bf16(b);
      }
      return all_finite(out, n);
    case Codec::int8:
      return int8_decode(in, n, out);
  }
  return false;
}

bool apply_update(Codec c, const uint8_t* in, int64_t n, const float* base, float* x) {
  if (c == Codec::fp32) return decode(c, in, n, x);
  float d[kInt8Block * 8];
  for (int64_t i0 = 0; i0 < n; i0 += kInt8Block * 8) {
    const int64_t m = std::min<int64_t>(kInt8Block * 8, n - i0);
    bool ok;
    if (c == Codec::bf16) {
      ok = decode(c, in + 2 * i0, m, d);
    } else {
      // int8 scales sit in front of all values: decode this window block by block.
      const int64_t nb = n_blocks(n);
      const auto* q = reinterpret_cast<const int8_t*>(in + 4 * nb);
      ok = true;
      for (int64_t j0 = 0; j0 < m; j0 += kInt8Block) {
        float s;
        std::memcpy(&s, in + 4 * ((i0 + j0) / kInt8Block), 4);
        if (bad_scale(s)) return false;
        s = canonical_scale(s);
        const int64_t j1 = std::min(m, j0 + kInt8Block);
        for (int64_t j = j0; j < j1; ++j) d[j] = float(q[i0 + j]) * s;
      }
    }
    if (!ok) return false;
    for (int64_t i = 0; i < m; ++i) x[i0 + i] = base[i0 + i] + d[i];
  }
  return true;
}

}  // namespace spes::net
