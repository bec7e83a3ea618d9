// Delta codecs for sync payloads: fp32, bf16, int8 and int3 block-wise (the sparse
// codec is net/codec_sparse.hpp).
//
// A payload carries one chunk of a parameter range. The lossy codecs (bf16, int8, int3)
// carry a *delta* against a base both sides hold (upload: the node's θ at the last
// round; download: the coordinator's θ_old); fp32 is lossless and carries the new
// values themselves, which makes "1 node + coordinator" equal plain local training
// bit for bit (base + (x − base) is not always x in fp32).
//
// Decoding is bit-deterministic: bf16 widens exactly, and the int8 / int3 per-block
// scale keeps at most 17 significant bits, so q·scale (|q| ≤ 127, 7 bits) is exact
// in fp32 and "base + q·scale" rounds once whether or not the compiler fuses it.
//
// int3: q ∈ [−3, 3] in 3-bit two's complement, eight to three bytes, one fp32 scale
// per 128: 0.41 bytes per value, 1/9.8 of fp32. Its error feedback carries the rest.
// So the node and the coordinator apply the very same update.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "engine/base/enum_names.hpp"

namespace spes::net {

enum class Codec : uint8_t { fp32 = 0, bf16 = 1, int8 = 2, sparse = 3, int3 = 4 };  // = wire::Codec values
inline constexpr EnumName<Codec> kCodecNames[] = {{Codec::fp32, "fp32"},
                                                  {Codec::bf16, "bf16"},
                                                  {Codec::int8, "int8"},
                                                  {Codec::sparse, "sparse"},
                                                  {Codec::int3, "int3"}};

constexpr int64_t kInt8Block = 128;  // elements per int8 / int3 scale

Codec parse_codec(const std::string& name);  // throws ConfigError
const char* codec_name(Codec c);
bool codec_is_lossy(Codec c);

// Payload bytes for n elements (int8: one fp32 scale per block, then n int8; int3: the
// scales, then 3 bytes per 8 values; sparse:
// the most a payload can take, its real size is payload_bytes).
size_t encoded_bytes(Codec c, int64_t n);
// The size of an encoded payload: encoded_bytes, or what a sparse header declares.
size_t payload_bytes(Codec c, const uint8_t* in, int64_t n);
// Whether `bytes` received bytes are a whole payload of n elements (check before decoding).
bool payload_size_ok(Codec c, const uint8_t* in, size_t bytes, int64_t n);

// `threads` (encode_update, decode, apply_update, accumulate): the work of one payload
// is cut into slices of whole int8 blocks, one per thread; every element's result
// depends only on its own block, so the bytes are the same for any thread count.
// The sparse codec (net/codec_sparse.hpp) selects over the whole chunk and runs on
// one thread (nodes encode chunks in parallel).

// Lossy codecs (every codec but fp32), node side: x = (params − base) + residual (the error feedback of
// earlier rounds) is quantised into out; residual_out = x − decoded(out).
// residual_in / residual_out may alias. Returns false when x is not finite.
// fp32: out = params (values, lossless); base and residuals are not read.
bool encode_update(Codec c, const float* params, const float* base, const float* residual_in,
                   float* residual_out, int64_t n, uint8_t* out, int threads = 1);

// Quantises a delta x (no error feedback; the coordinator keeps its own residual).
// residual_out (may be null) = x − decoded(out). False when x is not finite.
bool encode_delta(Codec c, const float* x, int64_t n, uint8_t* out, float* residual_out);

// Decodes a delta payload into out (n floats). Returns false when the payload is
// malformed (non-finite value or scale, negative scale). fp32: out = the values.
bool decode(Codec c, const uint8_t* in, int64_t n, float* out, int threads = 1);

// Whether a payload decodes to finite values (what decode checks), without decoding.
bool payload_valid(Codec c, const uint8_t* in, int64_t n);

// The coordinator's streaming sum: acc = scale·decoded (first contribution) or
// acc += scale·decoded (scale: a power of two, see net/streaming_merge.hpp).
// The payload must be valid (payload_valid): nothing is checked here.
void accumulate(Codec c, const uint8_t* in, int64_t n, float* acc, bool first, int threads = 1, float scale = 1.0f);

// The same sum in double, unscaled: what a chunk with three or more contributors
// uses (net/streaming_merge.hpp).
void accumulate(Codec c, const uint8_t* in, int64_t n, double* acc, bool first, int threads = 1);

// Applies a decoded payload to a base: fp32 → x = values; lossy → x = base + delta.
// x may alias base. Returns false on a malformed payload (x then undefined).
bool apply_update(Codec c, const uint8_t* in, int64_t n, const float* base, float* x, int threads = 1);

}  // namespace spes::net
