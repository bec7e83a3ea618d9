// The sparse codec: top-k selection, 4-bit values, delta-coded positions (see codec_sparse.hpp).
#include "net/codec_sparse.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

namespace spes::net {

namespace {

constexpr float kMaxCode = 7.0f;

inline uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }
inline float float_of(uint32_t u) { return std::bit_cast<float>(u); }

int64_t n_groups(int64_t k) { return (k + kSparseGroup - 1) / kSparseGroup; }
size_t fixed_bytes(int64_t k) { return 8 + size_t(n_groups(k)) * 4 + size_t(k + 1) / 2; }

// amax/7 rounded up to 17 significant bits: q·scale (|q| ≤ 7) is exact in fp32, and
// |x| ≤ 7·scale, so x − q·scale is exact too (Sterbenz: q·scale is within x/2..2x or 0).
float group_scale(float amax) {
  if (!(amax >= 1e-30f)) return 0.0f;
  uint32_t u = bits_of(amax / kMaxCode);
  if (u & 0x7Fu) u = (u | 0x7Fu) + 1u;
  return float_of(u);
}
bool bad_scale(float s) { return !(s >= 0.0f && s <= 1e36f) || (bits_of(s) & 0x7Fu) != 0; }

uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Which k entries of x to send: the largest |x|, by a 4096-bucket histogram of the top
// 12 bits of |x| (exponent and 4 mantissa bits); the boundary bucket's entries are
// taken in index order. Exactly k, deterministic, two passes.
void select_top_k(const float* x, int64_t n, int64_t k, std::vector<int64_t>& idx) {
  std::array<int64_t, 4096> hist{};
  for (int64_t i = 0; i < n; ++i) ++hist[(bits_of(x[i]) & 0x7FFFFFFFu) >> 19];
  int64_t above = 0, tb = 4095;
  for (; tb > 0 && above + hist[size_t(tb)] < k; --tb) above += hist[size_t(tb)];
  int64_t take_at_boundary = k - above;
  idx.clear();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = int64_t((bits_of(x[i]) & 0x7FFFFFFFu) >> 19);
    if (b > tb || (b == tb && take_at_boundary-- > 0)) idx.push_back(i);
  }
}

}  // namespace

size_t sparse_max_bytes(int64_t n) { return fixed_bytes(sparse_k(n)) + size_t(sparse_k(n)) * 5; }

size_t sparse_declared_bytes(const uint8_t* in, size_t available) {
  if (available < 8) return 0;
  const int64_t k = load_u32(in);
  return fixed_bytes(k) + load_u32(in + 4);
}

size_t sparse_encode(const float* params, const float* base, const float* residual_in, float* residual_out,
                     int64_t n, uint8_t* out) {
  thread_local std::vector<float> x;
  thread_local std::vector<int64_t> idx;
  x.resize(size_t(n));
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float d = base ? params[i] - base[i] : params[i];
    x[size_t(i)] = residual_in ? d + residual_in[i] : d;
    bad |= uint32_t((bits_of(x[size_t(i)]) & 0x7F800000u) == 0x7F800000u);
  }
  if (bad) return 0;
  const int64_t k = sparse_k(n);
  select_top_k(x.data(), n, k, idx);
  if (residual_out) std::copy(x.begin(), x.end(), residual_out);  // what is not sent stays
  const uint32_t k32 = uint32_t(k);
  std::memcpy(out, &k32, 4);
  uint8_t* scales = out + 8;
  uint8_t* codes = scales + n_groups(k) * 4;
  uint8_t* gaps = codes + (k + 1) / 2;
  std::memset(codes, 0, size_t(k + 1) / 2);
  for (int64_t g = 0; g < n_groups(k); ++g) {
    const int64_t j0 = g * kSparseGroup, j1 = std::min(k, j0 + kSparseGroup);
    float amax = 0.0f;
    for (int64_t j = j0; j < j1; ++j) amax = std::max(amax, std::fabs(x[size_t(idx[size_t(j)])]));
    const float s = group_scale(amax);
    std::memcpy(scales + 4 * g, &s, 4);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t i = idx[size_t(j)];
      const float q = s == 0.0f ? 0.0f : std::clamp(std::nearbyint(x[size_t(i)] / s), -kMaxCode, kMaxCode);
      codes[j / 2] |= uint8_t((uint32_t(int32_t(q)) & 0xFu) << (4 * (j % 2)));
      if (residual_out) residual_out[i] = x[size_t(i)] - q * s;
    }
  }
  uint8_t* g = gaps;
  int64_t prev = -1;
  for (int64_t j = 0; j < k; ++j) {
    uint64_t gap = uint64_t(idx[size_t(j)] - prev - 1);
    prev = idx[size_t(j)];
    do {
      *g++ = uint8_t((gap & 0x7F) | (gap >= 0x80 ? 0x80 : 0));
      gap >>= 7;
    } while (gap);
  }
  const uint32_t gap_bytes = uint32_t(g - gaps);
  std::memcpy(out + 4, &gap_bytes, 4);
  return size_t(g - out);
}

bool sparse_valid(const uint8_t* in, int64_t n) {
  const int64_t k = load_u32(in);
  if (k != sparse_k(n)) return false;
  for (int64_t g = 0; g < n_groups(k); ++g) {
    float s;
    std::memcpy(&s, in + 8 + 4 * g, 4);
    if (bad_scale(s)) return false;
  }
  const uint8_t* p = in + fixed_bytes(k);
  const uint8_t* end = p + load_u32(in + 4);
  int64_t prev = -1;
  for (int64_t j = 0; j < k; ++j) {
    uint64_t gap = 0;
    for (int shift = 0;; shift += 7) {
      if (p == end || shift > 28) return false;
      const uint8_t b = *p++;
      gap |= uint64_t(b & 0x7F) << shift;
      if (!(b & 0x80)) break;
    }
    prev += int64_t(gap) + 1;
    if (prev >= n) return false;
  }
  return p == end;
}

void sparse_decode(const uint8_t* in, int64_t n, int64_t* idx, float* val) {
  (void)n;
  const int64_t k = load_u32(in);
  const uint8_t* codes = in + 8 + n_groups(k) * 4;
  const uint8_t* p = in + fixed_bytes(k);
  int64_t prev = -1;
  for (int64_t j = 0; j < k; ++j) {
    uint64_t gap = 0;
    for (int shift = 0;; shift += 7) {
      const uint8_t b = *p++;
      gap |= uint64_t(b & 0x7F) << shift;
      if (!(b & 0x80)) break;
    }
    prev += int64_t(gap) + 1;
    idx[j] = prev;
    float s;
    std::memcpy(&s, in + 8 + 4 * (j / kSparseGroup), 4);
    const int32_t nib = (codes[j / 2] >> (4 * (j % 2))) & 0xF;
    val[j] = float(nib >= 8 ? nib - 16 : nib) * s;
  }
}

}  // namespace spes::net
