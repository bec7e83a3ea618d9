// Embedding forward / backward.
//
// forward: one thread per 16-byte vector (8 channels) of the output; reads the
//   table row and writes the output once: 4 B/channel/token, a copy.
// backward: (1) keys = tokens as uint32 (out-of-range → V, sorted last), values =
//   positions; (2) stable CUB radix sort over ⌈log2(V+1)⌉ bits; (3) one block per
//   sorted position, exiting at once unless it starts a run of equal tokens; the
//   run's first block walks the run in token order, each thread owning 8
//   channels, and adds the rows onto dtable. Reads dout once, dtable rows once.
//   A very frequent token is summed serially by its run's threads (loads issued
//   4 rows ahead); at 16k tokens that is a few hundred rows at worst.
#include <algorithm>
#include <cub/device/device_radix_sort.cuh>

#include "cuda/check.cuh"
#include "cuda/device_common.cuh"
#include "cuda/embedding.cuh"
#include "cuda/launch.cuh"

namespace spes::cuda {

namespace {

__global__ void embedding_forward_kernel(bf16* __restrict__ out, const int32_t* __restrict__ tokens,
                                         const bf16* __restrict__ table, int64_t N, int C, int64_t V) {
  const int c8 = C / 8;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * c8) return;
  const int64_t n = idx / c8;
  const int v = static_cast<int>(idx - n * c8);
  const int32_t tok = tokens[n];
  int4 val;
  if (tok >= 0 && tok < V) {
    val = reinterpret_cast<const int4*>(table + static_cast<int64_t>(tok) * C)[v];
  } else {
    const int nan2 = 0x7fc07fc0;  // two bf16 quiet NaNs
    val = make_int4(nan2, nan2, nan2, nan2);
  }
  reinterpret_cast<int4*>(out + n * C)[v] = val;
}

__global__ void embedding_keys_kernel(uint32_t* __restrict__ keys, int32_t* __restrict__ positions,
                                      const int32_t* __restrict__ tokens, int64_t N, int64_t V) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const int32_t t = tokens[n];
  keys[n] = (t >= 0 && t < V) ? static_cast<uint32_t>(t) : static_cast<uint32_t>(V);
  positions[n] = static_cast<int32_t>(n);
}

// grid (N, ⌈C/8 / blockDim.x⌉): block (i, y) covers sorted position i, channel
// vectors y·blockDim.x + threadIdx.x.
__global__ void embedding_backward_kernel(float* __restrict__ dtable, const bf16* __restrict__ dout,
                                          const uint32_t* __restrict__ keys, const int32_t* __restrict__ positions,
                                          int64_t N, int C, uint32_t V) {
  const int64_t i = blockIdx.x;
  const uint32_t key = keys[i];
  if (key >= V || (i > 0 && keys[i - 1] == key)) return;  // only a run's first position works
  const int v = blockIdx.y * blockDim.x + threadIdx.x;
  if (v >= C / 8) return;
  float* dst = dtable + static_cast<int64_t>(key) * C + v * 8;
  float acc[8];
  load8(acc, dst);
  int64_t j = i;
  // Keys are sorted: keys[j] == key and keys[j+3] == key imply the 4 rows between
  // all belong to the run. Issue their loads together, add them in token order.
  for (; j + 4 <= N && keys[j + 3] == key; j += 4) {
    float t[4][8];
#pragma unroll
    for (int u = 0; u < 4; ++u) load8_stream(t[u], dout + static_cast<int64_t>(positions[j + u]) * C + v * 8);
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += t[u][e];
  }
  for (; j < N && keys[j] == key; ++j) {
    float t[8];
    load8_stream(t, dout + static_cast<int64_t>(positions[j]) * C + v * 8);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] += t[e];
  }
  store8(dst, acc);
}

int key_bits(int64_t V) {  // keys lie in [0, V]
  int bits = 1;
  while ((int64_t(1) << bits) <= V) ++bits;
  return bits;
}

struct Workspace {
  uint32_t* keys_in;
  uint32_t* keys_out;
  int32_t* pos_in;
  int32_t* pos_out;
  void* temp;
  size_t temp_bytes;
};

size_t cub_temp_bytes(int64_t N, int64_t V) {
  size_t bytes = 0;
  cuda_check(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint32_t*>(nullptr),
                                             static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), static_cast<int>(N), 0, key_bits(V)));
  return bytes;
}

size_t array_bytes(int64_t N) { return static_cast<size_t>(round_up(N * 4, 256)); }

Workspace carve(void* base, int64_t N, size_t temp_bytes) {
  char* p = static_cast<char*>(base);
  const size_t a = array_bytes(N);
  return {reinterpret_cast<uint32_t*>(p), reinterpret_cast<uint32_t*>(p + a), reinterpret_cast<int32_t*>(p + 2 * a),
          reinterpret_cast<int32_t*>(p + 3 * a), p + 4 * a, temp_bytes};
}

}  // namespace

void embedding_forward(bf16* out, const int32_t* tokens, const bf16* table, int64_t N, int64_t C, int64_t V,
                       cudaStream_t stream) {
  const char* op = "embedding_forward";
  require(C > 0 && C % 8 == 0 && C < (int64_t(1) << 31), op, "channels C must be a positive multiple of 8");
  require(N >= 0 && V > 0, op, "need N ≥ 0 and V > 0");
  // One 16-byte vector (8 channels) per thread: rows of C % 8 == 0 bf16 values stay
  // 16-byte aligned when the base pointers are.
  require_ptr(out, 16, op, "out");
  require_ptr(tokens, 4, op, "tokens");
  require_ptr(table, 16, op, "table");
  if (N == 0) return;
  const int64_t total = N * (C / 8);
  const int threads = 256;
  launch(embedding_forward_kernel, static_cast<unsigned>(ceil_div(total, threads)), threads, 0, stream, out, tokens,
         table, N, static_cast<int>(C), V);
  cuda_check_launch();
}

size_t embedding_backward_workspace_bytes(int64_t N, int64_t V) {
  require(N >= 0 && N < (int64_t(1) << 31) && V > 0 && V < (int64_t(1) << 31) - 1, "embedding_backward",
          "N and V must fit in int32");
  if (N == 0) return 0;
  return 4 * array_bytes(N) + cub_temp_bytes(N, V);
}

void embedding_backward(float* dtable, const bf16* dout, const int32_t* tokens, int64_t N, int64_t C, int64_t V,
                        void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const char* op = "embedding_backward";
  require(C > 0 && C % 8 == 0 && C < (int64_t(1) << 31), op, "channels C must be a positive multiple of 8");
  require(N >= 0, op, "N must be ≥ 0");
  require_ptr(dtable, 16, op, "dtable");  // fp32 rows read and written as float4 pairs
  require_ptr(dout, 16, op, "dout");
  require_ptr(tokens, 4, op, "tokens");
  if (N == 0) return;
  const size_t need = embedding_backward_workspace_bytes(N, V);
  require(workspace != nullptr && workspace_bytes >= need && aligned(workspace, 256), op,
          "workspace must be 256-byte aligned and hold embedding_backward_workspace_bytes(N, V) = " +
              std::to_string(need) + " bytes");
  Workspace ws = carve(workspace, N, need - 4 * array_bytes(N));

  launch(embedding_keys_kernel, static_cast<unsigned>(ceil_div(N, 256)), 256, 0, stream, ws.keys_in, ws.pos_in, tokens,
         N, V);
  cuda_check_launch();
  size_t temp = ws.temp_bytes;
  cuda_check(cub::DeviceRadixSort::SortPairs(ws.temp, temp, ws.keys_in, ws.keys_out, ws.pos_in, ws.pos_out,
                                             static_cast<int>(N), 0, key_bits(V), stream));
  const int c8 = static_cast<int>(C / 8);
  const int threads = static_cast<int>(std::min<int64_t>(128, round_up(c8, kWarp)));
  const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>(ceil_div(c8, threads)));
  launch(embedding_backward_kernel, grid, threads, 0, stream, dtable, dout, ws.keys_out, ws.pos_out, N,
         static_cast<int>(C), static_cast<uint32_t>(V));
  cuda_check_launch();
}

}  // namespace spes::cuda
