#include "net/codec.hpp"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "engine/base/error.hpp"
#include "engine/base/parallel.hpp"
#include "net/codec_sparse.hpp"

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

// The largest code of a block codec: int8 ±127, int3 ±3.
inline float qmax_of(Codec c) { return c == Codec::int3 ? 3.0f : 127.0f; }

// Scale for a block with max |x| = amax: amax/qmax rounded *up* to 17 significant
// bits (see the header: exact dequantisation).
inline float block_scale(float amax, float qmax) {
  if (!(amax >= kInt8MinAmax)) return 0.0f;
  uint32_t u = bits_of(amax / qmax);
  if (u & 0x7Fu) u = (u | 0x7Fu) + 1u;
  return float_of(u);
}
// What a decoder accepts as a scale: the low mantissa bits are masked so the
// product stays exact whatever the sender wrote.
inline float canonical_scale(float s) { return float_of(bits_of(s) & ~0x7Fu); }
// A scale no encoder produces (127·s would overflow, or it is negative/NaN).
inline bool bad_scale(float s) { return !(s >= 0.0f && s <= 1e36f); }

// int8 layout: [n_blocks fp32 scales][n int8 values]; int3: [scales][ceil(n/8) groups
// of 3 bytes], value 8g + j in bits 3j..3j+2 of group g (little-endian), 0-padded.
inline int64_t n_blocks(int64_t n) { return (n + kInt8Block - 1) / kInt8Block; }
inline int64_t int3_groups(int64_t n) { return (n + 7) / 8; }

void int3_pack(const int32_t* q, int64_t m, uint8_t* out) {  // m ≤ 8 codes into 3 bytes
  uint32_t v = 0;
  for (int64_t j = 0; j < m; ++j) v |= uint32_t(q[j] & 7) << (3 * j);
  out[0] = uint8_t(v), out[1] = uint8_t(v >> 8), out[2] = uint8_t(v >> 16);
}
inline int32_t int3_code(const uint8_t* group, int64_t j) {
  const uint32_t v = uint32_t(group[0]) | uint32_t(group[1]) << 8 | uint32_t(group[2]) << 16;
  return int32_t(((v >> (3 * j)) & 7u) ^ 4u) - 4;
}

bool all_finite(const float* x, int64_t n) {
  // Branch-free OR of "exponent all ones" so the loop vectorises.
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= uint32_t((bits_of(x[i]) & 0x7F800000u) == 0x7F800000u);
  return bad == 0;
}

// The same test on payload bytes (payloads are not float-aligned).
bool all_finite_bytes(const uint8_t* in, int64_t n) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, in + 4 * i, 4);
    bad |= uint32_t((u & 0x7F800000u) == 0x7F800000u);
  }
  return bad == 0;
}

inline float load_f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}
inline float load_bf16(const uint8_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
  return from_bf16(b);
}
// The decoder's scale of int8 block b (nullopt-like: false when the scale is bad).
inline bool int8_block_scale(const uint8_t* in, int64_t b, float* s) {
  *s = load_f32(in + 4 * b);
  if (bad_scale(*s)) return false;
  *s = canonical_scale(*s);
  return true;
}

// The sent entries of a valid sparse payload, in index order.
template <class F>
void for_each_sparse(const uint8_t* in, int64_t n, F&& f) {
  thread_local std::vector<int64_t> idx;
  thread_local std::vector<float> val;
  idx.resize(size_t(sparse_k(n)));
  val.resize(size_t(sparse_k(n)));
  sparse_decode(in, n, idx.data(), val.data());
  for (size_t j = 0; j < idx.size(); ++j) f(idx[j], val[j]);
}

// Calls f(i0, i1) over [0, n) cut into slices of whole int8 blocks, one per thread.
// Small payloads stay on the calling thread: starting a thread costs ~20 µs.
template <class F>
void over_slices(int64_t n, int threads, F&& f) {
  constexpr int64_t kMinSlice = 32 * 1024;
  const int64_t t = std::clamp<int64_t>(std::min<int64_t>(threads, n / kMinSlice), 1, 256);
  if (t <= 1) {
    f(int64_t(0), n);
    return;
  }
  const int64_t per = (n_blocks(n) + t - 1) / t * kInt8Block;
  parallel_for(t, t, [&](int64_t k) {
    const int64_t i0 = k * per, i1 = std::min(n, i0 + per);
    if (i0 < i1) f(i0, i1);
  });
}

// Lossy encode of elements [i0, i1) of an n-element payload (i0 on a block boundary).
bool encode_slice(Codec c, const float* params, const float* base, const float* residual_in, float* residual_out,
                  int64_t n, int64_t i0, int64_t i1, uint8_t* out) {
  // x = (params − base) + residual, one block at a time so x stays in cache.
  float x[kInt8Block], dq[kInt8Block];
  const int64_t nb = n_blocks(n);
  for (int64_t j0 = i0; j0 < i1; j0 += kInt8Block) {
    const int64_t m = std::min(kInt8Block, i1 - j0);
    for (int64_t i = 0; i < m; ++i) {
      const float d = base ? params[j0 + i] - base[j0 + i] : params[j0 + i];
      x[i] = residual_in ? d + residual_in[j0 + i] : d;
    }
    if (!all_finite(x, m)) return false;
    if (c == Codec::bf16) {
      auto* o = out + 2 * j0;
      for (int64_t i = 0; i < m; ++i) {
        const uint16_t b = to_bf16(x[i]);
        std::memcpy(o + 2 * i, &b, 2);
        dq[i] = from_bf16(b);
      }
    } else {
      // Scales first, values after; block j0/kInt8Block of the payload is this one.
      // Loops written to vectorise: |x| ordered by its bits (x is finite), the codes
      // through int32, and a zero scale (|x| < 1e-30) divides by 1, which rounds to 0.
      uint32_t amax_bits = 0;
      for (int64_t i = 0; i < m; ++i) amax_bits = std::max(amax_bits, bits_of(x[i]) & 0x7FFFFFFFu);
      const float qmax = qmax_of(c);
      const float s = block_scale(float_of(amax_bits), qmax);
      std::memcpy(out + 4 * (j0 / kInt8Block), &s, 4);
      const float divisor = s == 0.0f ? 1.0f : s;
      int32_t qi[kInt8Block];
      for (int64_t i = 0; i < m; ++i) qi[i] = int32_t(std::min(qmax, std::max(-qmax, std::nearbyint(x[i] / divisor))));
      for (int64_t i = 0; i < m; ++i) dq[i] = float(qi[i]) * s;
      if (c == Codec::int8) {
        auto* q = reinterpret_cast<int8_t*>(out + 4 * nb) + j0;
        for (int64_t i = 0; i < m; ++i) q[i] = int8_t(qi[i]);
      } else {  // a block starts on a group: kInt8Block is a multiple of 8
        uint8_t* g = out + 4 * nb + 3 * (j0 / 8);
        for (int64_t i = 0; i < m; i += 8) int3_pack(qi + i, std::min<int64_t>(8, m - i), g + 3 * (i / 8));
      }
    }
    if (residual_out)
      for (int64_t i = 0; i < m; ++i) residual_out[j0 + i] = x[i] - dq[i];
  }
  return true;
}

// Decoded delta (lossy) or value (fp32) of elements [i0, i1) handed to sink(i, v) one
// block at a time; false on a bad int8 scale (nothing of that block is handed over).
template <class Sink>
bool decode_slice(Codec c, const uint8_t* in, int64_t n, int64_t i0, int64_t i1, Sink&& sink) {
  switch (c) {
    case Codec::fp32:
      for (int64_t i = i0; i < i1; ++i) sink(i, load_f32(in + 4 * i));
      return true;
    case Codec::bf16:
      for (int64_t i = i0; i < i1; ++i) sink(i, load_bf16(in + 2 * i));
      return true;
    case Codec::int8: {
      const auto* q = reinterpret_cast<const int8_t*>(in + 4 * n_blocks(n));
      for (int64_t j0 = i0; j0 < i1; j0 += kInt8Block) {
        float s;
        if (!int8_block_scale(in, j0 / kInt8Block, &s)) return false;
        const int64_t j1 = std::min(i1, j0 + kInt8Block);
        for (int64_t i = j0; i < j1; ++i) sink(i, float(q[i]) * s);
      }
      return true;
    }
    case Codec::int3: {
      const uint8_t* groups = in + 4 * n_blocks(n);
      for (int64_t j0 = i0; j0 < i1; j0 += kInt8Block) {
        float s;
        if (!int8_block_scale(in, j0 / kInt8Block, &s)) return false;
        const int64_t j1 = std::min(i1, j0 + kInt8Block);
        for (int64_t i = j0; i < j1; ++i) sink(i, float(int3_code(groups + 3 * (i / 8), i % 8)) * s);
      }
      return true;
    }
    case Codec::sparse: break;  // not sliced: see for_each_sparse
  }
  return false;
}

}  // namespace

Codec parse_codec(const std::string& name) {
  if (const auto c = enum_from_name(kCodecNames, name)) return *c;
  throw ConfigError("[spes] codec: expected " + join_names(kCodecNames, "\"", ", ", " or ") + ", got \"" + name + "\"");
}

const char* codec_name(Codec c) { return name_of(kCodecNames, c); }

bool codec_is_lossy(Codec c) { return c != Codec::fp32; }

size_t encoded_bytes(Codec c, int64_t n) {
  switch (c) {
    case Codec::fp32: return size_t(n) * 4;
    case Codec::bf16: return size_t(n) * 2;
    case Codec::int8: return size_t(n_blocks(n)) * 4 + size_t(n);
    case Codec::int3: return size_t(n_blocks(n)) * 4 + size_t(int3_groups(n)) * 3;
    case Codec::sparse: return sparse_max_bytes(n);
  }
  return 0;
}

size_t payload_bytes(Codec c, const uint8_t* in, int64_t n) {
  return c == Codec::sparse ? sparse_declared_bytes(in, encoded_bytes(c, n)) : encoded_bytes(c, n);
}

bool payload_size_ok(Codec c, const uint8_t* in, size_t bytes, int64_t n) {
  if (c != Codec::sparse) return bytes == encoded_bytes(c, n);
  return bytes <= encoded_bytes(c, n) && sparse_declared_bytes(in, bytes) == bytes;
}

bool encode_update(Codec c, const float* params, const float* base, const float* residual_in,
                   float* residual_out, int64_t n, uint8_t* out, int threads) {
  if (c == Codec::sparse) return sparse_encode(params, base, residual_in, residual_out, n, out) > 0;
  std::atomic<bool> ok{true};
  over_slices(n, threads, [&](int64_t i0, int64_t i1) {
    if (c == Codec::fp32) {
      if (!all_finite(params + i0, i1 - i0)) ok = false;
      std::memcpy(out + 4 * i0, params + i0, size_t(i1 - i0) * 4);
    } else if (!encode_slice(c, params, base, residual_in, residual_out, n, i0, i1, out)) {
      ok = false;
    }
  });
  return ok;
}

bool encode_delta(Codec c, const float* x, int64_t n, uint8_t* out, float* residual_out) {
  if (c == Codec::fp32) {
    if (residual_out) std::fill(residual_out, residual_out + n, 0.0f);
    return encode_update(c, x, nullptr, nullptr, nullptr, n, out);
  }
  return encode_update(c, x, nullptr, nullptr, residual_out, n, out);  // base null: x is the delta
}

bool decode(Codec c, const uint8_t* in, int64_t n, float* out, int threads) {
  if (!payload_valid(c, in, n)) return false;
  if (c == Codec::sparse) {
    std::fill(out, out + n, 0.0f);
    for_each_sparse(in, n, [out](int64_t i, float v) { out[i] = v; });
    return true;
  }
  over_slices(n, threads, [&](int64_t i0, int64_t i1) {
    decode_slice(c, in, n, i0, i1, [out](int64_t i, float v) { out[i] = v; });
  });
  return true;
}

bool payload_valid(Codec c, const uint8_t* in, int64_t n) {
  switch (c) {
    case Codec::fp32:
      return all_finite_bytes(in, n);
    case Codec::bf16: {
      uint32_t bad = 0;  // exponent all ones: Inf or NaN
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, in + 2 * i, 2);
        bad |= uint32_t((b & 0x7F80u) == 0x7F80u);
      }
      return bad == 0;
    }
    case Codec::int8:
    case Codec::int3:
      for (int64_t b = 0; b < n_blocks(n); ++b)
        if (bad_scale(load_f32(in + 4 * b))) return false;
      return true;
    case Codec::sparse:
      return sparse_valid(in, n);
  }
  return false;
}

void accumulate(Codec c, const uint8_t* in, int64_t n, float* acc, bool first, int threads, float scale) {
  if (c == Codec::sparse) {
    if (first) std::fill(acc, acc + n, 0.0f);
    for_each_sparse(in, n, [acc, scale](int64_t i, float v) { acc[i] += v * scale; });
    return;
  }
  over_slices(n, threads, [&](int64_t i0, int64_t i1) {
    if (first) decode_slice(c, in, n, i0, i1, [acc, scale](int64_t i, float v) { acc[i] = v * scale; });
    else decode_slice(c, in, n, i0, i1, [acc, scale](int64_t i, float v) { acc[i] += v * scale; });
  });
}

void accumulate(Codec c, const uint8_t* in, int64_t n, double* acc, bool first, int threads) {
  if (c == Codec::sparse) {
    if (first) std::fill(acc, acc + n, 0.0);
    for_each_sparse(in, n, [acc](int64_t i, float v) { acc[i] += double(v); });
    return;
  }
  over_slices(n, threads, [&](int64_t i0, int64_t i1) {
    if (first) decode_slice(c, in, n, i0, i1, [acc](int64_t i, float v) { acc[i] = double(v); });
    else decode_slice(c, in, n, i0, i1, [acc](int64_t i, float v) { acc[i] += double(v); });
  });
}

bool apply_update(Codec c, const uint8_t* in, int64_t n, const float* base, float* x, int threads) {
  if (!payload_valid(c, in, n)) return false;
  if (c == Codec::sparse) {
    if (x != base) std::copy(base, base + n, x);
    for_each_sparse(in, n, [x, base](int64_t i, float v) { x[i] = base[i] + v; });
    return true;
  }
  over_slices(n, threads, [&](int64_t i0, int64_t i1) {
    if (c == Codec::fp32) decode_slice(c, in, n, i0, i1, [x](int64_t i, float v) { x[i] = v; });
    else decode_slice(c, in, n, i0, i1, [x, base](int64_t i, float v) { x[i] = base[i] + v; });
  });
  return true;
}

}  // namespace spes::net
