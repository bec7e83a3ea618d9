// Causal attention, FlashAttention-2 style (Dao 2023, "FlashAttention-2: Faster
// Attention with Better Parallelism and Work Partitioning"), on mma.sync m16n8k16
// bf16 tensor cores with fp32 accumulation. Written from the paper's algorithm.
//
// Forward (one CTA per 128-query block × head × batch, one warp per 16 query rows):
// Q stays in registers; K/V blocks stream through double-buffered shared memory with
// cp.async; S = Q·Kᵀ and the online softmax (running max m, running sum l, rescale
// of O by 2^(m_old − m_new)) stay in registers; P is reused as the A operand of P·V
// straight from the accumulator registers. Key blocks entirely above the causal
// diagonal are never loaded; the diagonal blocks are masked. lse = m + log l.
//
// Backward, three kernels, all deterministic (no atomics):
//   dsum: D_i = Σ_d dO_id·O_id per query row (scratch [B,H,T] fp32);
//   dkv:  one CTA per key block × kv head × batch, one warp per 16 keys. It loops
//         over the query heads of the GQA group and the query blocks at or below the
//         diagonal (Q, dO, lse, D double-buffered), recomputes Pᵀ = exp(K·Qᵀ·scale −
//         lse) and dPᵀ = V·dOᵀ, and accumulates dV += Pᵀ·dO, dK += dSᵀ·Q in
//         registers, dS = P∘(dP − D). Each warp owns its keys: no cross-warp sums.
//   dq:   one CTA per query block × head × batch, like the forward: loops over key
//         blocks, recomputes P and dP = dO·Vᵀ, accumulates dQ += dS·K.
// Recomputing S and dP in the dq kernel costs 2 extra GEMMs over FlashAttention-2's
// atomic-add dQ (7 instead of 5): the price of bit-reproducible gradients.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 .bf16; g = lane/4, t = lane%4):
//   A 16×16 (row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B 16×8  (k × n):     b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C 16×8  (fp32):      c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
// So the C fragments of two adjacent n-tiles of S are exactly the A fragment of one
// 16-wide k-step of P·V (FlashAttention's register reuse).
//
// Shared tiles are [rows][D+8] bf16: the 16-byte pad staggers rows across banks so
// that ldmatrix (8 rows × 16 bytes per matrix) is conflict-free: the row pitches,
// 80, 144, 272 bytes for D = 32, 64, 128, are odd multiples of 16 bytes, so the 8 row
// addresses of one matrix land in the 8 distinct 16-byte slots of the 128-byte bank
// window (D = 32: offsets 0, 80, 32, 112, 64, 16, 96, 48 mod 128).
//
// Head dims: the kernels are templates on D and need only D % 16 == 0 (whole k16 mma
// steps over D, pairs of n8 tiles over D in P·V / dS·K) plus the copy loops dividing
// evenly, which is static_asserted. For D = 32 (the demo configs' d_model 128 / 4
// heads): KD = D/16 = 2 mma k-steps for Q·Kᵀ, K·Qᵀ, V·dOᵀ, dO·Vᵀ; DT = D/8 = 4 n8
// accumulator tiles (2 ldmatrix.x4.trans pairs) for P·V, dS·K, Pᵀ·dO, dSᵀ·Q; rows
// are D/8 = 4 chunks of 16 bytes, so load_tile issues 128·4/256 = 2 (forward Q),
// 64·4/256 = 1 (forward K/V), 64·4/128 = 2 (backward tiles) cp.async per thread, and
// store_rows moves 16·4 = 64 chunks per warp, 2 per lane. The dsum kernel reads
// D/2 = 16 bf16 pairs per row: lanes 16-31 add nothing.
//
// On a Hopper GPU the forward, dkv and dq kernels of D = 64 and 128 give way to their
// wgmma twins (cuda/attention_sm90.cu, chosen by the launchers, AttentionPath); the
// dsum kernel serves both backwards.
//
// Shared memory per CTA (D=64 / D=128): forward 54 / 102 KB, dkv 55 / 103 KB, dq
// 54 / 102 KB, above the 48 KB default (allow_dynamic_smem opts in); D=32 (the D=64 tiles):
// forward 30 KB, dkv 31 KB, dq 30 KB. bench/bench_attention.cu measures the kernels,
// bench/RESULTS.md holds the figures and the register counts.
#include "cuda/attention.cuh"

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "cuda/attention_sm90.cuh"
#include "cuda/check.cuh"
#include "cuda/common.cuh"
#include "cuda/ptx.cuh"

namespace spes::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Two floats → packed bf16x2, `lo` in the low half (the lower column of a fragment pair).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// ---- shared-memory tiles ---------------------------------------------------------

// Copies rows [row0, row0 + ROWS) of one head into a [ROWS][D+8] shared tile; row r
// of the head is at src + r·stride (D contiguous elements). Rows ≥ T are zero-filled
// so that products with them stay finite (they are masked, and 0·NaN would not be).
template <int ROWS, int D, int THREADS>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* src, int64_t stride, int row0, int T) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static_assert((ROWS * kChunks) % THREADS == 0, "tile copy must divide evenly over the CTA");
#pragma unroll
  for (int i = 0; i < ROWS * kChunks / THREADS; ++i) {
    const int idx = i * THREADS + static_cast<int>(threadIdx.x);
    const int r = idx / kChunks, c = idx % kChunks;
    const bool ok = row0 + r < T;
    const bf16* p = src + (ok ? int64_t(row0 + r) * stride : 0) + c * 8;
    cp_async_16(smem_addr(dst + r * (D + 8) + c * 8), p, ok);
  }
}

// dst[r] = src[row0 + r] for r < ROWS (0 past T).
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_rowvec(float* dst, const float* src, int row0, int T) {
  for (int r = static_cast<int>(threadIdx.x); r < ROWS; r += THREADS) {
    const bool ok = row0 + r < T;
    cp_async_4(smem_addr(dst + r), src + (ok ? row0 + r : 0), ok);
  }
}

// A fragment of the 16×16 block at rows [r0, r0+16), cols [c0, c0+16) of a row-major
// tile. Lanes 0-15 address rows r0..r0+15 at c0, lanes 16-31 the same rows at c0+8:
// matrices (rows 0-7, c0), (8-15, c0), (0-7, c0+8), (8-15, c0+8) = a0, a1, a2, a3.
template <int S>
__device__ __forceinline__ void ldsm_a(uint32_t (&a)[4], const bf16* tile, int r0, int c0, int lane) {
  ldmatrix_x4(a, smem_addr(tile + (r0 + (lane & 15)) * S + c0 + (lane >> 4) * 8));
}

// B fragments of two n8 tiles from a tile stored [n][k] (row n of the tile is column n
// of B, e.g. K for Q·Kᵀ): n rows [n0, n0+16), k cols [k0, k0+16). Non-transposed
// ldmatrix gives lane (g, t) the pair (row g, cols 2t, 2t+1) = B(k 2t..2t+1, n g).
// Matrices: (n0..+7, k0) b0 of n-tile n0; (n0..+7, k0+8) b1; (n0+8.., k0) b0 of n-tile
// n0+8; (n0+8.., k0+8) b1. Output b[0], b[1] → n-tile n0; b[2], b[3] → n-tile n0+8.
template <int S>
__device__ __forceinline__ void ldsm_b_nk(uint32_t (&b)[4], const bf16* tile, int n0, int k0, int lane) {
  ldmatrix_x4(b, smem_addr(tile + (n0 + (lane & 7) + ((lane >> 4) << 3)) * S + k0 + (((lane >> 3) & 1) << 3)));
}

// B fragments of two n8 tiles from a tile stored [k][n] (row k of the tile is row k of
// B, e.g. V for P·V): k rows [k0, k0+16), n cols [n0, n0+16). Transposed ldmatrix
// gives lane (g, t) the pair (rows 2t, 2t+1, col g) = B(k 2t..2t+1, n g).
// Matrices: (k0..+7, n0) b0 of n-tile n0; (k0+8.., n0) b1; (k0..+7, n0+8) b0 of n-tile
// n0+8; (k0+8.., n0+8) b1. Output b[0], b[1] → n-tile n0; b[2], b[3] → n-tile n0+8.
template <int S>
__device__ __forceinline__ void ldsm_b_kn(uint32_t (&b)[4], const bf16* tile, int k0, int n0, int lane) {
  ldmatrix_x4_trans(b, smem_addr(tile + (k0 + (lane & 7) + (((lane >> 3) & 1) << 3)) * S + n0 + ((lane >> 4) << 3)));
}

// acc[NT][4] += A(16×16·KD, from registers) · B, B's tile stored [n][k] (see ldsm_b_nk),
// n from n_base over NT n8-tiles.
template <int S, int KD, int NT>
__device__ __forceinline__ void mma_a_regs_b_nk(float (&acc)[NT][4], const uint32_t (&a)[KD][4],
                                                const bf16* tile, int lane) {
  static_assert(NT % 2 == 0, "n8 tiles are loaded in pairs");
#pragma unroll
  for (int kd = 0; kd < KD; ++kd) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t bb[4];
      ldsm_b_nk<S>(bb, tile, np * 16, kd * 16, lane);
      mma_bf16(acc[2 * np], a[kd], bb[0], bb[1]);
      mma_bf16(acc[2 * np + 1], a[kd], bb[2], bb[3]);
    }
  }
}

// acc[DT][4] += P · B where P (16 × 16·KN) is given as fp32 C fragments p[2·KN][4]
// (rounded to bf16 here) and B's tile is stored [k][n] (see ldsm_b_kn), k rows from 0.
template <int S, int KN, int DT>
__device__ __forceinline__ void mma_c_regs_b_kn(float (&acc)[DT][4], const float (&p)[2 * KN][4],
                                                const bf16* tile, int lane) {
  static_assert(DT % 2 == 0, "n8 tiles are loaded in pairs");
#pragma unroll
  for (int kk = 0; kk < KN; ++kk) {
    const uint32_t a[4] = {pack_bf16(p[2 * kk][0], p[2 * kk][1]), pack_bf16(p[2 * kk][2], p[2 * kk][3]),
                           pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                           pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int dp = 0; dp < DT / 2; ++dp) {
      uint32_t bb[4];
      ldsm_b_kn<S>(bb, tile, kk * 16, dp * 16, lane);
      mma_bf16(acc[2 * dp], a, bb[0], bb[1]);
      mma_bf16(acc[2 * dp + 1], a, bb[2], bb[3]);
    }
  }
}

// Writes a warp's 16×D accumulator (C fragments) as bf16 to global rows [row0, row0+16)
// (row r at dst + r·stride), rows ≥ T skipped; fragment row g is scaled by mul_lo, row
// g+8 by mul_hi. Goes through `stage`, the warp's own 16-row slice of a [·][D+8] shared
// tile that no other warp reads, so that global stores are whole 16-byte chunks.
template <int D>
__device__ __forceinline__ void store_rows(bf16* dst, int64_t stride, int row0, int T, const float (&acc)[D / 8][4],
                                           float mul_lo, float mul_hi, bf16* stage, int lane) {
  constexpr int S = D + 8, kChunks = D / 8;
  static_assert((16 * kChunks) % 32 == 0, "a warp's 16 rows must be whole rounds of 32 chunks");
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    *reinterpret_cast<uint32_t*>(stage + g * S + 8 * j + 2 * t) = pack_bf16(acc[j][0] * mul_lo, acc[j][1] * mul_lo);
    *reinterpret_cast<uint32_t*>(stage + (g + 8) * S + 8 * j + 2 * t) =
        pack_bf16(acc[j][2] * mul_hi, acc[j][3] * mul_hi);
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 16 * kChunks / 32; ++i) {
    const int idx = i * 32 + lane;
    const int r = idx / kChunks, c = idx % kChunks;
    if (row0 + r < T)
      *reinterpret_cast<int4*>(dst + int64_t(row0 + r) * stride + c * 8) =
          *reinterpret_cast<const int4*>(stage + r * S + c * 8);
  }
}

// ---- forward ---------------------------------------------------------------------

template <int D, int BM, int BN>
struct FwdConfig {
  static constexpr int kWarps = BM / 16;  // one warp per 16 query rows
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStride = D + 8;
  // sQ [BM][S], sK [2][BN][S], sV [2][BN][S]
  static constexpr size_t kSmem = size_t(BM + 4 * BN) * kStride * sizeof(bf16);
};

template <int D, int BM, int BN>
__global__ void __launch_bounds__(FwdConfig<D, BM, BN>::kThreads)
    attention_forward_kernel(bf16* __restrict__ out, float* __restrict__ lse, const bf16* __restrict__ q,
                             const bf16* __restrict__ k, const bf16* __restrict__ v, int T, int H, int group,
                             float scale_log2) {
  using Cfg = FwdConfig<D, BM, BN>;
  constexpr int S = Cfg::kStride, NT = BN / 8, DT = D / 8, KD = D / 16, KN = BN / 16;
  static_assert(BM % 16 == 0 && BN % 16 == 0 && D % 16 == 0, "tiles are whole mma tiles");
  unsigned char* smem = dynamic_smem<unsigned char>;
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sK = sQ + BM * S;
  bf16* sV = sK + 2 * BN * S;

  // Causal work grows with the query block: launch the heaviest blocks first.
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;
  const int h = blockIdx.y, b = blockIdx.z, Hkv = H / group, hk = h / group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t q_stride = int64_t(H) * D, kv_stride = int64_t(Hkv) * D;
  const bf16* qg = q + (int64_t(b) * T * H + h) * D;
  const bf16* kg = k + (int64_t(b) * T * Hkv + hk) * D;
  const bf16* vg = v + (int64_t(b) * T * Hkv + hk) * D;
  // Keys < min(T, m0 + BM): blocks beyond the last query row are all masked, not loaded.
  const int n_blocks = (min(T, m0 + BM) + BN - 1) / BN;

  load_tile<BM, D, Cfg::kThreads>(sQ, qg, q_stride, m0, T);
  load_tile<BN, D, Cfg::kThreads>(sK, kg, kv_stride, 0, T);
  load_tile<BN, D, Cfg::kThreads>(sV, vg, kv_stride, 0, T);
  cp_async_commit();

  const int wr0 = m0 + warp * 16;  // this warp's first query row
  const int rows[2] = {wr0 + g, wr0 + g + 8};
  uint32_t qf[KD][4];
  float o[DT][4] = {};
  float m_run[2] = {-INFINITY, -INFINITY};  // running max of the scores, log2 units
  float l_run[2] = {0.0f, 0.0f};            // this thread's part of the running sum

  for (int nb = 0; nb < n_blocks; ++nb) {
    const int buf = nb & 1;
    if (nb + 1 < n_blocks) {  // prefetch the next K/V block into the other buffer
      load_tile<BN, D, Cfg::kThreads>(sK + (buf ^ 1) * BN * S, kg, kv_stride, (nb + 1) * BN, T);
      load_tile<BN, D, Cfg::kThreads>(sV + (buf ^ 1) * BN * S, vg, kv_stride, (nb + 1) * BN, T);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // block nb (and at nb = 0, Q) visible to every warp
    if (nb == 0) {
#pragma unroll
      for (int kd = 0; kd < KD; ++kd) ldsm_a<S>(qf[kd], sQ, warp * 16, kd * 16, lane);
    }
    const int n0 = nb * BN;
    // Warp-uniform skip (fully masked for this warp): every key of the block is after
    // every row of the warp, or all the warp's rows are past T. Key 0 is visible to
    // every row, so a warp with a row < T never skips block 0.
    if (n0 <= wr0 + 15 && wr0 < T) {
      const bf16* k_s = sK + buf * BN * S;
      const bf16* v_s = sV + buf * BN * S;
      float s[NT][4] = {};
      mma_a_regs_b_nk<S, KD, NT>(s, qf, k_s, lane);

      if (n0 + BN - 1 > wr0 || n0 + BN > T) {  // diagonal or tail block: mask
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = n0 + 8 * j + 2 * t + (e & 1);
            if (col > rows[e >> 1] || col >= T) s[j][e] = -INFINITY;
          }
      }

      // Online softmax, per fragment row r (rows g and g+8); a row lives in the 4
      // lanes of a quad, so reductions are two xor-shuffles.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < NT; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[r], mx * scale_log2);
        // A row with no visible key yet keeps m = -inf; subtract 0 so that exp gives 0, not NaN.
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;
        const float alpha = ex2(m_run[r] - m_use);
        m_run[r] = m_new;
        l_run[r] *= alpha;
#pragma unroll
        for (int j = 0; j < DT; ++j) {
          o[j][2 * r] *= alpha;
          o[j][2 * r + 1] *= alpha;
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          s[j][2 * r] = ex2(fmaf(s[j][2 * r], scale_log2, -m_use));
          s[j][2 * r + 1] = ex2(fmaf(s[j][2 * r + 1], scale_log2, -m_use));
          l_run[r] += s[j][2 * r] + s[j][2 * r + 1];
        }
      }

      mma_c_regs_b_kn<S, KN, DT>(o, s, v_s, lane);
    }
    __syncthreads();  // every warp is done with buffer `buf` before it is refilled
  }

  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[r] = l > 0.0f ? 1.0f / l : 0.0f;
    if (t == 0 && rows[r] < T)
      lse[(int64_t(b) * H + h) * T + rows[r]] = l > 0.0f ? m_run[r] * kLn2 + logf(l) : -INFINITY;
  }
  // The warp's own 16 rows of sQ were read only by it (into qf at nb = 0).
  store_rows<D>(out + (int64_t(b) * T * H + h) * D, q_stride, wr0, T, o, inv[0], inv[1], sQ + warp * 16 * S, lane);
}

// ---- backward: D_i = dO_i · O_i ------------------------------------------------------

// One warp per row (b, t, h) of out; writes dsum[(b·H + h)·T + t].
__global__ void attention_backward_dsum_kernel(float* __restrict__ dsum, const bf16* __restrict__ dout,
                                               const bf16* __restrict__ out, int64_t n_rows, int T, int H,
                                               int D) {
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (row >= n_rows) return;  // whole warps leave together
  const bf16* a = dout + row * D;
  const bf16* o = out + row * D;
  float acc = 0.0f;
  for (int i = 2 * lane; i < D; i += 64) {
    const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(a + i));
    const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(o + i));
    acc = fmaf(x.x, y.x, acc);
    acc = fmaf(x.y, y.y, acc);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) {
    const int64_t bt = row / H;
    const int h = static_cast<int>(row % H), tt = static_cast<int>(bt % T);
    const int64_t b = bt / T;
    dsum[(b * H + h) * T + tt] = acc;
  }
}

// ---- backward: dK, dV --------------------------------------------------------------

template <int D, int BM, int BN>
struct BwdKvConfig {
  static constexpr int kWarps = BN / 16;  // one warp per 16 keys
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStride = D + 8;
  // sK [BN][S], sV [BN][S], sQ [2][BM][S], sdO [2][BM][S], sL [2][BM], sD [2][BM]
  static constexpr size_t kSmem = size_t(2 * BN + 4 * BM) * kStride * sizeof(bf16) + 4 * BM * sizeof(float);
};

template <int D, int BM, int BN>
__global__ void __launch_bounds__(BwdKvConfig<D, BM, BN>::kThreads)
    attention_backward_dkv_kernel(bf16* __restrict__ dk, bf16* __restrict__ dv, const bf16* __restrict__ q,
                                  const bf16* __restrict__ k, const bf16* __restrict__ v,
                                  const bf16* __restrict__ dout, const float* __restrict__ lse,
                                  const float* __restrict__ dsum, int T, int H, int group, float scale,
                                  float scale_log2) {
  using Cfg = BwdKvConfig<D, BM, BN>;
  constexpr int S = Cfg::kStride, NT = BM / 8, DT = D / 8, KD = D / 16, KM = BM / 16;
  static_assert(BM % 16 == 0 && BN % 16 == 0 && D % 16 == 0, "tiles are whole mma tiles");
  unsigned char* smem = dynamic_smem<unsigned char>;
  bf16* sK = reinterpret_cast<bf16*>(smem);
  bf16* sV = sK + BN * S;
  bf16* sQ = sV + BN * S;       // [2][BM][S]
  bf16* sdO = sQ + 2 * BM * S;  // [2][BM][S]
  float* sL = reinterpret_cast<float*>(sdO + 2 * BM * S);  // [2][BM] lse
  float* sD = sL + 2 * BM;                                 // [2][BM] dsum

  // Key block 0 sees every query: launch in block order, heaviest first.
  const int n0 = blockIdx.x * BN;
  const int hk = blockIdx.y, b = blockIdx.z, Hkv = H / group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t q_stride = int64_t(H) * D, kv_stride = int64_t(Hkv) * D;
  const int64_t kv_off = (int64_t(b) * T * Hkv + hk) * D;

  // Query blocks from the one holding key n0 (earlier queries see none of these keys)
  // to the end, for each query head of the group: iteration it → (head, query block).
  const int m_begin = n0 / BM;
  const int n_mblocks = (T + BM - 1) / BM - m_begin;
  const int iters = group * n_mblocks;
  auto head_of = [&](int it) { return hk * group + it / n_mblocks; };
  auto m0_of = [&](int it) { return (m_begin + it % n_mblocks) * BM; };
  auto prefetch = [&](int it, int buf) {
    const int h = head_of(it), m0 = m0_of(it);
    const int64_t q_off = (int64_t(b) * T * H + h) * D;
    load_tile<BM, D, Cfg::kThreads>(sQ + buf * BM * S, q + q_off, q_stride, m0, T);
    load_tile<BM, D, Cfg::kThreads>(sdO + buf * BM * S, dout + q_off, q_stride, m0, T);
    load_rowvec<BM, Cfg::kThreads>(sL + buf * BM, lse + (int64_t(b) * H + h) * T, m0, T);
    load_rowvec<BM, Cfg::kThreads>(sD + buf * BM, dsum + (int64_t(b) * H + h) * T, m0, T);
  };

  load_tile<BN, D, Cfg::kThreads>(sK, k + kv_off, kv_stride, n0, T);
  load_tile<BN, D, Cfg::kThreads>(sV, v + kv_off, kv_stride, n0, T);
  prefetch(0, 0);
  cp_async_commit();

  const int wk0 = n0 + warp * 16;  // this warp's first key
  const int keys[2] = {wk0 + g, wk0 + g + 8};
  float dk_acc[DT][4] = {};
  float dv_acc[DT][4] = {};

  for (int it = 0; it < iters; ++it) {
    const int buf = it & 1;
    if (it + 1 < iters) {
      prefetch(it + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int m0 = m0_of(it);
    // Warp-uniform skip: every query of the tile is before every key of this warp,
    // or the warp's keys are all past T.
    if (m0 + BM - 1 >= wk0 && wk0 < T) {
      const bf16* q_s = sQ + buf * BM * S;
      const bf16* do_s = sdO + buf * BM * S;
      const float* l_s = sL + buf * BM;
      const float* d_s = sD + buf * BM;

      // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for this warp's 16 keys × BM queries.
      float st[NT][4] = {};
      float dpt[NT][4] = {};
#pragma unroll
      for (int kd = 0; kd < KD; ++kd) {
        uint32_t ka[4], va[4];
        ldsm_a<S>(ka, sK, warp * 16, kd * 16, lane);
        ldsm_a<S>(va, sV, warp * 16, kd * 16, lane);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t bq[4], bo[4];
          ldsm_b_nk<S>(bq, q_s, np * 16, kd * 16, lane);
          mma_bf16(st[2 * np], ka, bq[0], bq[1]);
          mma_bf16(st[2 * np + 1], ka, bq[2], bq[3]);
          ldsm_b_nk<S>(bo, do_s, np * 16, kd * 16, lane);
          mma_bf16(dpt[2 * np], va, bo[0], bo[1]);
          mma_bf16(dpt[2 * np + 1], va, bo[2], bo[3]);
        }
      }

      // Pᵀ = exp(Sᵀ·scale − lse[query]), masked; dSᵀ = Pᵀ∘(dPᵀ − D[query]).
      const bool need_mask = m0 < wk0 + 15 || m0 + BM > T || wk0 + 16 > T;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int c = 8 * j + 2 * t;  // tile-local query of elements e = 0, 2 (e = 1, 3: c + 1)
        const float2 lq = *reinterpret_cast<const float2*>(l_s + c);
        const float2 dq = *reinterpret_cast<const float2*>(d_s + c);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float l = (e & 1) ? lq.y : lq.x;
          const float dd = (e & 1) ? dq.y : dq.x;
          float p = ex2(fmaf(st[j][e], scale_log2, -l * kLog2e));
          if (need_mask) {
            const int query = m0 + c + (e & 1), key = keys[e >> 1];
            if (key > query || query >= T || key >= T) p = 0.0f;
          }
          st[j][e] = p;
          dpt[j][e] = p * (dpt[j][e] - dd);
        }
      }

      // dV += Pᵀ·dO, dK += dSᵀ·Q (scale applied at the end); k runs over the queries.
      mma_c_regs_b_kn<S, KM, DT>(dv_acc, st, do_s, lane);
      mma_c_regs_b_kn<S, KM, DT>(dk_acc, dpt, q_s, lane);
    }
    __syncthreads();  // every warp is done with buffer `buf` before it is refilled
  }

  // sK/sV rows of this warp were read only by it.
  store_rows<D>(dk + kv_off, kv_stride, wk0, T, dk_acc, scale, scale, sK + warp * 16 * S, lane);
  store_rows<D>(dv + kv_off, kv_stride, wk0, T, dv_acc, 1.0f, 1.0f, sV + warp * 16 * S, lane);
}

// ---- backward: dQ -------------------------------------------------------------------

template <int D, int BM, int BN>
struct BwdQConfig {
  static constexpr int kWarps = BM / 16;  // one warp per 16 query rows
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStride = D + 8;
  // sQ [BM][S], sdO [BM][S], sK [2][BN][S], sV [2][BN][S]
  static constexpr size_t kSmem = size_t(2 * BM + 4 * BN) * kStride * sizeof(bf16);
};

template <int D, int BM, int BN>
__global__ void __launch_bounds__(BwdQConfig<D, BM, BN>::kThreads)
    attention_backward_dq_kernel(bf16* __restrict__ dq, const bf16* __restrict__ q, const bf16* __restrict__ k,
                                 const bf16* __restrict__ v, const bf16* __restrict__ dout,
                                 const float* __restrict__ lse, const float* __restrict__ dsum, int T, int H,
                                 int group, float scale, float scale_log2) {
  using Cfg = BwdQConfig<D, BM, BN>;
  constexpr int S = Cfg::kStride, NT = BN / 8, DT = D / 8, KD = D / 16, KN = BN / 16;
  static_assert(BM % 16 == 0 && BN % 16 == 0 && D % 16 == 0, "tiles are whole mma tiles");
  unsigned char* smem = dynamic_smem<unsigned char>;
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sdO = sQ + BM * S;
  bf16* sK = sdO + BM * S;     // [2][BN][S]
  bf16* sV = sK + 2 * BN * S;  // [2][BN][S]

  const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;  // heaviest first
  const int h = blockIdx.y, b = blockIdx.z, Hkv = H / group, hk = h / group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t q_stride = int64_t(H) * D, kv_stride = int64_t(Hkv) * D;
  const int64_t q_off = (int64_t(b) * T * H + h) * D;
  const bf16* kg = k + (int64_t(b) * T * Hkv + hk) * D;
  const bf16* vg = v + (int64_t(b) * T * Hkv + hk) * D;
  const int n_blocks = (min(T, m0 + BM) + BN - 1) / BN;

  load_tile<BM, D, Cfg::kThreads>(sQ, q + q_off, q_stride, m0, T);
  load_tile<BM, D, Cfg::kThreads>(sdO, dout + q_off, q_stride, m0, T);
  load_tile<BN, D, Cfg::kThreads>(sK, kg, kv_stride, 0, T);
  load_tile<BN, D, Cfg::kThreads>(sV, vg, kv_stride, 0, T);
  cp_async_commit();

  const int wr0 = m0 + warp * 16;
  const int rows[2] = {wr0 + g, wr0 + g + 8};
  float lse2[2], dd[2];  // lse in log2 units and D_i of this thread's two rows
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = (int64_t(b) * H + h) * T + rows[r];
    lse2[r] = rows[r] < T ? lse[i] * kLog2e : 0.0f;
    dd[r] = rows[r] < T ? dsum[i] : 0.0f;
  }
  uint32_t qf[KD][4], dof[KD][4];
  float acc[DT][4] = {};

  for (int nb = 0; nb < n_blocks; ++nb) {
    const int buf = nb & 1;
    if (nb + 1 < n_blocks) {
      load_tile<BN, D, Cfg::kThreads>(sK + (buf ^ 1) * BN * S, kg, kv_stride, (nb + 1) * BN, T);
      load_tile<BN, D, Cfg::kThreads>(sV + (buf ^ 1) * BN * S, vg, kv_stride, (nb + 1) * BN, T);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (nb == 0) {
#pragma unroll
      for (int kd = 0; kd < KD; ++kd) {
        ldsm_a<S>(qf[kd], sQ, warp * 16, kd * 16, lane);
        ldsm_a<S>(dof[kd], sdO, warp * 16, kd * 16, lane);
      }
    }
    const int n0 = nb * BN;
    if (n0 <= wr0 + 15 && wr0 < T) {
      const bf16* k_s = sK + buf * BN * S;
      const bf16* v_s = sV + buf * BN * S;
      float s[NT][4] = {};
      float dp[NT][4] = {};
      mma_a_regs_b_nk<S, KD, NT>(s, qf, k_s, lane);   // S = Q·Kᵀ
      mma_a_regs_b_nk<S, KD, NT>(dp, dof, v_s, lane);  // dP = dO·Vᵀ
      const bool need_mask = n0 + BN - 1 > wr0 || n0 + BN > T;
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float p = ex2(fmaf(s[j][e], scale_log2, -lse2[e >> 1]));
          if (need_mask) {
            const int col = n0 + 8 * j + 2 * t + (e & 1);
            if (col > rows[e >> 1] || col >= T) p = 0.0f;
          }
          s[j][e] = p * (dp[j][e] - dd[e >> 1]);  // dS
        }
      mma_c_regs_b_kn<S, KN, DT>(acc, s, k_s, lane);  // dQ += dS·K
    }
    __syncthreads();
  }

  // The warp's own 16 rows of sQ were read only by it (into qf at nb = 0).
  store_rows<D>(dq + q_off, q_stride, wr0, T, acc, scale, scale, sQ + warp * 16 * S, lane);
}

// ---- launchers ----------------------------------------------------------------------

// Tile shapes per head dim: {forward BM, BN}, {dkv BM (queries/iter), BN (keys/CTA)},
// {dq BM, BN}. Chosen for ≤ 255 registers without spills and ≤ ~110 KB of shared memory
// (two CTAs per SM on H100); tune on a GPU with bench_attention.
template <int D>
struct Tiles;
// D = 32 keeps the D = 64 tiles: every copy loop still divides evenly (see the file
// comment), registers and shared memory only shrink (30 KB per CTA). Larger key
// blocks would amortise the per-block softmax less well than they save loads at this
// D; untuned.
template <>
struct Tiles<32> {
  static constexpr int kFwdM = 128, kFwdN = 64;
  static constexpr int kKvM = 64, kKvN = 64;
  static constexpr int kQM = 64, kQN = 64;
};
template <>
struct Tiles<64> {
  static constexpr int kFwdM = 128, kFwdN = 64;
  static constexpr int kKvM = 64, kKvN = 64;
  static constexpr int kQM = 64, kQN = 64;
};
template <>
struct Tiles<128> {
  static constexpr int kFwdM = 128, kFwdN = 64;
  static constexpr int kKvM = 64, kKvN = 64;
  static constexpr int kQM = 64, kQN = 64;
};

// Shapes the kernels are written for. All checks here and in check_pointers run on
// the host before any CUDA call.
void check_shape(const char* what, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D) {
  auto fail = [&](const std::string& why) {
    throw Error(std::string(what) + ": " + why + " (B=" + std::to_string(B) + " T=" + std::to_string(T) +
                " H=" + std::to_string(H) + " Hkv=" + std::to_string(Hkv) + " D=" + std::to_string(D) + ")");
  };
  if (D != 32 && D != 64 && D != 128) fail("head dim D must be 32, 64 or 128 (the kernels' tiles)");
  if (B < 0 || T < 0) fail("B and T must be ≥ 0");
  if (H < 1 || Hkv < 1 || H % Hkv != 0) fail("H must be a positive multiple of Hkv (whole GQA groups)");
  if (H > 65535 || B > 65535 || Hkv > 65535) fail("B and H must fit a grid dimension (≤ 65535)");
  if (T > (int64_t(1) << 30)) fail("T must be ≤ 2^30");
}

// cp.async moves q/k/v/dout rows into shared tiles 16 bytes at a time (ldmatrix then
// reads those tiles), store_rows writes out/dq/dk/dv as int4, and lse/dsum travel by
// 4-byte cp.async: each base pointer must have that alignment. Rows of the contiguous
// [B,T,H,D] / [B,T,Hkv,D] tensors are H·D or Hkv·D elements apart and heads D apart,
// multiples of 64 bytes for D ∈ {32, 64, 128}, so every row and head start inherits
// the base's 16-byte alignment.
void check_bf16(const char* op, const bf16* p, const char* name) { require_ptr(p, 16, op, name); }

template <int D>
void forward_impl(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int B, int T, int H,
                  int Hkv, cudaStream_t stream) {
  constexpr int BM = Tiles<D>::kFwdM, BN = Tiles<D>::kFwdN;
  using Cfg = FwdConfig<D, BM, BN>;
  auto kernel = attention_forward_kernel<D, BM, BN>;
  allow_dynamic_smem("attention_forward", kernel, Cfg::kSmem);
  const float scale_log2 = kLog2e / sqrtf(static_cast<float>(D));
  const dim3 grid((T + BM - 1) / BM, H, B);
  launch(kernel, grid, Cfg::kThreads, Cfg::kSmem, stream, out, lse, q, k, v, T, H, H / Hkv, scale_log2);
  cuda_check_launch();
}

void launch_dsum(float* dsum, const bf16* dout, const bf16* out, int B, int T, int H, int D, cudaStream_t stream) {
  const int64_t n_rows = int64_t(B) * T * H;
  constexpr int kDsumThreads = 256;
  const int64_t dsum_blocks = (n_rows * 32 + kDsumThreads - 1) / kDsumThreads;
  launch(attention_backward_dsum_kernel, static_cast<unsigned>(dsum_blocks), kDsumThreads, 0, stream, dsum, dout, out,
         n_rows, T, H, D);
  cuda_check_launch();
}

// The portable dkv and dq kernels, after launch_dsum.
template <int D>
void backward_impl(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                   const float* lse, const float* dsum, int B, int T, int H, int Hkv, cudaStream_t stream) {
  const float scale = 1.0f / sqrtf(static_cast<float>(D));
  const float scale_log2 = scale * kLog2e;
  const int group = H / Hkv;
  {
    constexpr int BM = Tiles<D>::kKvM, BN = Tiles<D>::kKvN;
    using Cfg = BwdKvConfig<D, BM, BN>;
    auto kernel = attention_backward_dkv_kernel<D, BM, BN>;
    allow_dynamic_smem("attention_backward", kernel, Cfg::kSmem);
    const dim3 grid((T + BN - 1) / BN, Hkv, B);
    launch(kernel, grid, Cfg::kThreads, Cfg::kSmem, stream, dk, dv, q, k, v, dout, lse, dsum, T, H, group, scale,
           scale_log2);
    cuda_check_launch();
  }
  {
    constexpr int BM = Tiles<D>::kQM, BN = Tiles<D>::kQN;
    using Cfg = BwdQConfig<D, BM, BN>;
    auto kernel = attention_backward_dq_kernel<D, BM, BN>;
    allow_dynamic_smem("attention_backward", kernel, Cfg::kSmem);
    const dim3 grid((T + BM - 1) / BM, H, B);
    launch(kernel, grid, Cfg::kThreads, Cfg::kSmem, stream, dq, q, k, v, dout, lse, dsum, T, H, group, scale,
           scale_log2);
    cuda_check_launch();
  }
}

// SPES_ATTENTION=portable keeps the automatic choice on the portable kernels (read
// at each call, a getenv per backward): a way around the Hopper kernels on a machine
// where they misbehave, and how a bench times the whole step on each path.
bool portable_forced(const char* op) {
  const char* const value = std::getenv("SPES_ATTENTION");
  require(value == nullptr || *value == '\0' || std::string(value) == "portable", op,
          std::string("SPES_ATTENTION is \"") + (value ? value : "") + "\"; it may only be \"portable\" or unset");
  return value != nullptr && std::string(value) == "portable";
}

// The automatic choice for the current device and D: the sm90a family only once it
// has agreed with the portable one on this device.
AttentionPath automatic_path(const char* op, int64_t D) {
  return (D == 64 || D == 128) && attention_sm90::available() && !portable_forced(op) &&
                 attention_sm90a_check_failure().empty()
             ? AttentionPath::sm90a
             : AttentionPath::portable;
}

// The kernel family a call runs on: `requested` resolved for the current device and D.
AttentionPath choose_path(const char* op, AttentionPath requested, int64_t D) {
  switch (requested) {
    case AttentionPath::portable:
      return requested;
    case AttentionPath::sm90a:
      require(D == 64 || D == 128, op, "the sm90a path covers head dims 64 and 128, not " + std::to_string(D));
      require(attention_sm90::available(), op,
              "the sm90a path cannot run here: " + attention_sm90::unavailable_reason());
      return requested;
    default:
      return automatic_path(op, D);
  }
}

}  // namespace

bool attention_sm90a_available() { return attention_sm90::available(); }
AttentionPath attention_automatic_path(int64_t D) { return automatic_path("attention", D); }
std::string attention_automatic_path_description(int64_t D) {
  if (attention_automatic_path(D) == AttentionPath::sm90a)
    return "sm90a (wgmma), agreeing with the portable kernels on this GPU";
  if (D != 64 && D != 128) return "portable (the sm90a kernels cover head dims 64 and 128, not " + std::to_string(D) + ")";
  if (!attention_sm90::available()) return "portable: " + attention_sm90::unavailable_reason();
  if (portable_forced("attention")) return "portable (SPES_ATTENTION=portable)";
  return "portable: the sm90a kernels failed their check: " + attention_sm90a_check_failure();
}
std::string attention_sm90a_unavailable_reason() { return attention_sm90::unavailable_reason(); }

void attention_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int64_t B, int64_t T,
                       int64_t H, int64_t Hkv, int64_t D, cudaStream_t stream, AttentionPath path) {
  const char* op = "attention_forward";
  check_shape(op, B, T, H, Hkv, D);
  check_bf16(op, out, "out");
  check_bf16(op, q, "q");
  check_bf16(op, k, "k");
  check_bf16(op, v, "v");
  require_ptr(lse, 4, op, "lse");
  const AttentionPath chosen = choose_path(op, path, D);
  if (B == 0 || T == 0) return;
  if (chosen == AttentionPath::sm90a) {
    attention_sm90::forward(out, lse, q, k, v, int(B), int(T), int(H), int(Hkv), int(D), stream);
    return;
  }
  switch (D) {  // check_shape admitted only these
    case 32: forward_impl<32>(out, lse, q, k, v, int(B), int(T), int(H), int(Hkv), stream); break;
    case 64: forward_impl<64>(out, lse, q, k, v, int(B), int(T), int(H), int(Hkv), stream); break;
    default: forward_impl<128>(out, lse, q, k, v, int(B), int(T), int(H), int(Hkv), stream); break;
  }
}

size_t attention_backward_scratch_bytes(int64_t B, int64_t T, int64_t H) {
  const size_t bytes = size_t(B) * size_t(T) * size_t(H) * sizeof(float);
  return (bytes + 255) / 256 * 256;
}

void attention_backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k,
                        const bf16* v, const bf16* out, const float* lse, void* scratch, int64_t B, int64_t T,
                        int64_t H, int64_t Hkv, int64_t D, cudaStream_t stream, AttentionPath path) {
  const char* op = "attention_backward";
  check_shape(op, B, T, H, Hkv, D);
  check_bf16(op, dq, "dq");
  check_bf16(op, dk, "dk");
  check_bf16(op, dv, "dv");
  check_bf16(op, dout, "dout");
  check_bf16(op, q, "q");
  check_bf16(op, k, "k");
  check_bf16(op, v, "v");
  check_bf16(op, out, "out");
  require_ptr(lse, 4, op, "lse");
  require_ptr(scratch, 16, op, "scratch");
  const AttentionPath chosen = choose_path(op, path, D);
  if (B == 0 || T == 0) return;
  float* dsum = static_cast<float*>(scratch);
  launch_dsum(dsum, dout, out, int(B), int(T), int(H), int(D), stream);
  if (chosen == AttentionPath::sm90a) {
    attention_sm90::backward(dq, dk, dv, dout, q, k, v, lse, dsum, int(B), int(T), int(H), int(Hkv), int(D), stream);
    return;
  }
  switch (D) {  // check_shape admitted only these
    case 32: backward_impl<32>(dq, dk, dv, dout, q, k, v, lse, dsum, int(B), int(T), int(H), int(Hkv), stream); break;
    case 64: backward_impl<64>(dq, dk, dv, dout, q, k, v, lse, dsum, int(B), int(T), int(H), int(Hkv), stream); break;
    default:
      backward_impl<128>(dq, dk, dv, dout, q, k, v, lse, dsum, int(B), int(T), int(H), int(Hkv), stream);
      break;
  }
}

}  // namespace spes::cuda
