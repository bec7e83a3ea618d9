// The sparse codec (issue 14; DeMo / SparseLoCo-style): per chunk, the k = n/32
// largest-magnitude entries of x = Δ + residual, their positions delta-coded, their
// values in 4 bits with one scale per 64 selected values. Everything not sent stays
// in the node's error-feedback residual (residual = x − decoded, exactly: see
// sparse_encode), so nothing is lost over rounds, only delayed.
//
// Payload of an n-element chunk (little-endian):
//   u32 k           = sparse_k(n)
//   u32 gap_bytes
//   f32 scale[ceil(k / 64)]      ≤ 17 significant bits, so q·scale is exact in fp32
//   u8  code[ceil(k / 2)]        4-bit two's complement q ∈ [−7, 7], low nibble first
//   u8  gap[gap_bytes]           LEB128: first index, then index − previous − 1
// About 1.6 bytes per 32 elements: ~1/80 of fp32.
#pragma once
#include <cstddef>
#include <cstdint>

namespace spes::net {

constexpr int64_t kSparseDensity = 32;  // one element in 32 is sent
constexpr int64_t kSparseGroup = 64;    // selected values per scale

inline int64_t sparse_k(int64_t n) { return (n + kSparseDensity - 1) / kSparseDensity; }
size_t sparse_max_bytes(int64_t n);
// The size a sparse payload declares in its header (0 when too short to hold one).
size_t sparse_declared_bytes(const uint8_t* in, size_t available);

// x = (params − base) + residual_in (base null: x = params + residual_in), sent = its top k in 4 bits, residual_out = x − sent.
// Returns the payload bytes written to out (≤ sparse_max_bytes), 0 when x is not finite.
size_t sparse_encode(const float* params, const float* base, const float* residual_in, float* residual_out,
                     int64_t n, uint8_t* out);

// Checks a payload whose size matched its header: k, scales, and indices strictly
// increasing inside [0, n) and consuming exactly gap_bytes.
bool sparse_valid(const uint8_t* in, int64_t n);

// The sent entries of a valid payload, in index order: idx[j], val[j] for j < sparse_k(n).
void sparse_decode(const uint8_t* in, int64_t n, int64_t* idx, float* val);

}  // namespace spes::net
