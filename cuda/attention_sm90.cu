// Causal attention (contract: attention.cuh), the Hopper path for D = 64 and 128: the
// forward, dK/dV and dQ kernels of attention.cu rewritten on warpgroup MMA (wgmma,
// sm_90a), same algorithms, same blocking, same determinism (no atomics, every output
// element summed by one thread in a fixed order). sm_90a only: compiled for sm_90a
// where the build targets compute capability 9.0 (CMakeLists.txt), its kernel bodies
// empty in every other pass (SPES_SM90A_DEVICE_CODE, cuda/ptx_sm90.cuh; the host
// emulator, tests/emu/, runs them with wgmma emulated). attention.cu's launchers pick
// these kernels or their own mma.sync ones (AttentionPath); its backward computes the
// row sums D_i = Σ_d dO·O (its dsum kernel) for either.
//
// Warpgroups. Every kernel runs 2 warpgroups (256 threads), each owning 64 rows, the M
// of every wgmma (m64nNk16), and the fp32 accumulators of those rows' outputs in
// registers for the whole kernel; shared memory holds the operand tiles the two share.
//
// forward: one CTA per 128-query block × head × batch (heaviest first), FlashAttention-2
// as in attention.cu: Q stays in shared memory, K/V blocks of 64 keys double-buffered;
// per key block, warpgroup w: S = Q_w·Kᵀ (shared A and B, N = 64), the online softmax
// (running max, running sum, rescale of O) on the accumulator fragment in registers,
// O += P·V (A = P from registers, the accumulator fragment packed to bf16 being
// wgmma's A fragment; B = V N-major, N = D). Key blocks wholly above the diagonal are
// not loaded; a warpgroup whose queries all come before a block's keys skips it.
//
// dkv: one CTA per 128-key block × kv head × batch (block 0, which every query sees,
// launched first). K and V of the block stay in shared memory; the CTA loops over the
// query heads of the GQA group and, for each, the 64-query blocks at or below the
// diagonal, Q, dO, lse and D double-buffered by cp.async. Per query block, warpgroup w
// (keys 64w..64w+63 of the block):
//   Sᵀ  = K_w·Qᵀ            wgmma, A = K_w and B = Q both from shared memory, N = 64
//   dPᵀ = V_w·dOᵀ           likewise, issued right behind, so it runs while
//   Pᵀ  = exp(Sᵀ·scale − lse[query]) (masked) is computed from the first;
//   dSᵀ = Pᵀ∘(dPᵀ − D[query])
//   dV += Pᵀ·dO             A = Pᵀ from registers (as O += P·V above), B = dO
//                           N-major, N = D;
//   dK += dSᵀ·Q             likewise (scale applied once at the end); one group.
// dSᵀ is computed before dV is issued, not while it runs: with Pᵀ in fp32 still live
// for it beside both accumulators, D = 128 would need more than 255 registers.
// A warpgroup whose 64 keys all come after every query of the block skips it (causal).
// dq: one CTA per 128-query block × head × batch (heaviest first). Q and dO stay in
// shared memory; the CTA loops over the 64-key blocks at or below the diagonal, K and
// V double-buffered. Per key block, warpgroup w (queries 64w..): S = Q_w·Kᵀ and
// dP = dO_w·Vᵀ (shared A and B, N = 64), P and dS in registers, dQ += dS·K (A from
// registers, K N-major, N = D). Recomputing S and dP here rather than adding dQ from
// the dkv kernel atomically is the price of bit-reproducible gradients, as on the
// portable path.
//
// Shared layout: the 128-byte swizzle that wgmma reads. A tile of R rows × D columns
// (bf16) is D/64 panels, each R lines of 128 bytes (row r's columns 64p..64p+63),
// panel after panel; chunk c (16 bytes) of line r is stored at chunk position
// c ^ (r % 8), and every panel starts 1024-byte aligned (wgmma un-swizzles on address
// bits 4-6 XOR 7-9). One tile serves both ways a product reads it, untransposed:
//   K-major (Q, K, dO, V as operands of Sᵀ/S and dPᵀ/dP, the reduction over D): line =
//     one row, atoms of 8 lines 1024 B apart (stride offset); k16 step kk of D starts
//     in panel kk/4, 32·(kk % 4) bytes in;
//   N-major (dO, Q, K as the B of dV, dK, dQ, the reduction over rows): line = one k
//     (row), 64 consecutive n (columns of D) per panel, the panels R·128 B apart (the
//     leading offset), 8 k an atom 1024 B apart (stride offset); k16 step kk starts
//     16 lines (2 KB) in.
//
// Ordering. Step it: each thread waits for its own cp.async of it, fences them to
// the async proxy (wgmma reads through it), and a barrier makes everyone's visible;
// each warpgroup waits for all its wgmma before the barrier that ends the step, after
// which the step's buffers may be refilled. Registers: wgmma.fence orders the
// warpgroup's earlier accesses of a wgmma's accumulators and A fragment before it, but
// the compiler sees no register in that fence; the operand fences (fence_accumulators,
// fence_registers) in front of it keep the rescale of O and the packing of P and dS
// from being scheduled past it, and behind each wait keep reads from moving above it.
// Outputs are staged through shared memory (the resident tiles, free by then; chunks
// swizzled by row as above) so that each row leaves in 16-byte stores.
#include "cuda/attention_sm90.cuh"

#include <string>

#include "cuda/check.cuh"
#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "cuda/ptx_sm90.cuh"
#include "cuda/sm90a_device.cuh"

namespace spes::cuda::attention_sm90 {
namespace {

constexpr int kThreads = 256;   // two warpgroups
constexpr int kWarpgroup = 128;
constexpr int kWgRows = 64;     // rows per warpgroup: the wgmma M
constexpr int kBlockRows = 128; // dkv: keys per CTA; forward, dq: queries per CTA
constexpr int kStepRows = 64;   // dkv: queries per step; forward, dq: keys per step
constexpr uint32_t kLineBytes = 128, kAtomBytes = 1024;
constexpr float kLog2e = 1.4426950408889634f;
static_assert(kBlockRows == 2 * kWgRows && kThreads == 2 * kWarpgroup, "a warpgroup per 64 rows of the block");

// The swizzled tile of R rows × D columns (see the file comment).
template <int R, int D>
struct Tile {
  static_assert(D % 64 == 0 && R % 8 == 0, "whole panels of whole atoms");
  static constexpr uint32_t kPanelBytes = R * kLineBytes;
  static constexpr uint32_t kBytes = (D / 64) * kPanelBytes;
  // Byte offset of 16-byte chunk c (columns 8c..8c+7) of row r.
  __device__ __forceinline__ static uint32_t chunk(int r, int c) {
    return uint32_t(c / 8) * kPanelBytes + uint32_t(r) * kLineBytes + (uint32_t((c & 7) ^ (r & 7)) << 4);
  }
#if SPES_SM90A_DEVICE_CODE
  // Descriptor of k16 step kk of D for the 64 rows from r0 (a multiple of 8), K-major.
  __device__ __forceinline__ static uint64_t k_major(uint32_t tile, int r0, int kk) {
    return sw128_descriptor(tile + uint32_t(kk / 4) * kPanelBytes + uint32_t(r0) * kLineBytes + uint32_t(kk % 4) * 32,
                            16, kAtomBytes);
  }
  // Descriptor of k16 step kk of the rows (rows 16kk..16kk+15 as k, all D columns as n), N-major.
  __device__ __forceinline__ static uint64_t n_major(uint32_t tile, int kk) {
    return sw128_descriptor(tile + uint32_t(kk) * 16 * kLineBytes, kPanelBytes, kAtomBytes);
  }
#endif
};

template <int D>
struct Smem {  // byte offsets from the 1024-aligned base; the kernels share one shape
  using Block = Tile<kBlockRows, D>;
  using Step = Tile<kStepRows, D>;
  // dkv: K, V (block), Q[2], dO[2] (step), lse[2], dsum[2]; dq: Q, dO (block), K[2], V[2]
  // (step); forward: Q (block 0), K[2], V[2] (its block 1 and the vectors unused).
  static constexpr uint32_t kBlock0 = 0, kBlock1 = Block::kBytes, kStep0 = 2 * Block::kBytes,
                            kStep1 = kStep0 + 2 * Step::kBytes, kVec = kStep1 + 2 * Step::kBytes,
                            kBytes = kVec + 4 * kStepRows * sizeof(float);
  static constexpr size_t kAlloc = kBytes + kAtomBytes;  // room to align the base
  static_assert(kBlock0 % kAtomBytes == 0 && kBlock1 % kAtomBytes == 0 && kStep0 % kAtomBytes == 0 &&
                    kStep1 % kAtomBytes == 0 && Step::kBytes % kAtomBytes == 0,
                "tiles stay 1024-aligned");
};

#if SPES_SM90A_DEVICE_CODE

constexpr float kLn2 = 0.6931471805599453f;

// Two floats → packed bf16x2, `lo` in the low half (the lower column of a fragment pair).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Copies rows [row0, row0 + R) of one head into a swizzled tile; row r of the head is
// at src + r·stride. Rows ≥ T are zero-filled without a read (their address is row 0's).
template <int R, int D>
__device__ __forceinline__ void load_tile(uint32_t dst, const bf16* src, int64_t stride, int row0, int T) {
  constexpr int kChunks = D / 8;
  static_assert((R * kChunks) % kThreads == 0, "tile copy must divide evenly over the CTA");
#pragma unroll
  for (int i = 0; i < R * kChunks / kThreads; ++i) {
    const int idx = i * kThreads + static_cast<int>(threadIdx.x);
    const int r = idx / kChunks, c = idx % kChunks;
    const bool ok = row0 + r < T;
    cp_async_16(dst + Tile<R, D>::chunk(r, c), src + (ok ? int64_t(row0 + r) * stride : 0) + c * 8, ok);
  }
}

// dst[r] = src[row0 + r] for r < kStepRows (0 past T).
__device__ __forceinline__ void load_rowvec(float* dst, const float* src, int row0, int T) {
  const int r = static_cast<int>(threadIdx.x);
  if (r < kStepRows) {
    const bool ok = row0 + r < T;
    cp_async_4(smem_addr(dst + r), src + (ok ? row0 + r : 0), ok);
  }
}

// acc[N/2] → A fragments of N/16 k16 steps (see wgmma_rs), rounded to bf16.
template <int N>
__device__ __forceinline__ void pack_a(uint32_t (&a)[N / 16][4], const float (&acc)[N / 2]) {
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) a[kk][i] = pack_bf16(acc[8 * kk + 2 * i], acc[8 * kk + 2 * i + 1]);
}

// Writes the 128 × D block whose accumulators the warpgroups hold (this thread's acc,
// D/2 values, its rows r0 and r0 + 8 times mul_lo and mul_hi) as bf16 to rows
// [row0, row0 + 128) ∩ [0, T) of dst (row r at dst + r·stride), through `stage` (a
// free 128 × D shared tile, generic pointer). The caller has a barrier behind every
// use of `stage` before; this one has one between the staging and the stores.
template <int D>
__device__ __forceinline__ void store_block(bf16* dst, int64_t stride, int row0, int T, const float (&acc)[D / 2],
                                            float mul_lo, float mul_hi, unsigned char* stage) {
  constexpr int kChunks = D / 8;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32;
  const int r0 = (tid / kWarpgroup) * kWgRows + ((tid % kWarpgroup) / 32) * 16 + lane / 4, c0 = 2 * (lane % 4);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    const float mul = h ? mul_hi : mul_lo;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<uint32_t*>(stage + (r * kChunks + (j ^ (r & 7))) * 16 + c0 * 2) =
          pack_bf16(acc[4 * j + 2 * h] * mul, acc[4 * j + 2 * h + 1] * mul);
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kBlockRows * kChunks / kThreads; ++i) {
    const int idx = i * kThreads + tid;
    const int r = idx / kChunks, c = idx % kChunks;
    if (row0 + r < T)
      *reinterpret_cast<int4*>(dst + int64_t(row0 + r) * stride + c * 8) =
          *reinterpret_cast<const int4*>(stage + (r * kChunks + (c ^ (r & 7))) * 16);
  }
}

// Shared address of the 1024-aligned base, and its generic pointer.
__device__ __forceinline__ uint32_t aligned_base(unsigned char*& generic) {
  unsigned char* smem = dynamic_smem<unsigned char>;
  const uint32_t raw = smem_addr(smem), base = (raw + kAtomBytes - 1) & ~(kAtomBytes - 1);
  generic = smem + (base - raw);
  return base;
}

#endif  // SPES_SM90A_DEVICE_CODE

// ---- forward -------------------------------------------------------------------------

template <int D>
__global__ void __launch_bounds__(kThreads, 1)
    forward_kernel(bf16* __restrict__ out, float* __restrict__ lse, const bf16* __restrict__ q,
                   const bf16* __restrict__ k, const bf16* __restrict__ v, int T, int H, int group, float scale_log2) {
#if SPES_SM90A_DEVICE_CODE
  using L = Smem<D>;
  using QT = typename L::Block;
  using KV = typename L::Step;
  constexpr int BN = kStepRows, KD = D / 16, KN = BN / 16;
  unsigned char* gsmem;
  const uint32_t base = aligned_base(gsmem);
  const uint32_t sQ = base + L::kBlock0, sK = base + L::kStep0, sV = base + L::kStep1;

  const int m0 = (gridDim.x - 1 - blockIdx.x) * kBlockRows;  // heaviest first
  const int h = blockIdx.y, b = blockIdx.z, Hkv = H / group, hk = h / group;
  const int tid = static_cast<int>(threadIdx.x), wg = tid / kWarpgroup, lane = tid % 32;
  const int t = lane % 4;
  const int64_t q_stride = int64_t(H) * D, kv_stride = int64_t(Hkv) * D;
  const int64_t q_off = (int64_t(b) * T * H + h) * D;
  const bf16* kg = k + (int64_t(b) * T * Hkv + hk) * D;
  const bf16* vg = v + (int64_t(b) * T * Hkv + hk) * D;
  // Keys < min(T, m0 + 128): blocks beyond the last query row are all masked, not loaded.
  const int n_blocks = (min(T, m0 + kBlockRows) + BN - 1) / BN;

  load_tile<kBlockRows, D>(sQ, q + q_off, q_stride, m0, T);
  load_tile<BN, D>(sK, kg, kv_stride, 0, T);
  load_tile<BN, D>(sV, vg, kv_stride, 0, T);
  cp_async_commit();

  const int wr0 = m0 + wg * kWgRows;  // this warpgroup's first query
  const int row0 = wr0 + ((tid % kWarpgroup) / 32) * 16 + lane / 4;
  const int rows[2] = {row0, row0 + 8};
  float o[D / 2] = {};
  float m_run[2] = {-INFINITY, -INFINITY};  // running max of the scores, log2 units
  float l_run[2] = {0.0f, 0.0f};            // this thread's part of the running sum

  for (int nb = 0; nb < n_blocks; ++nb) {
    const int buf = nb & 1;
    if (nb + 1 < n_blocks) {  // prefetch the next K/V block into the other buffer
      load_tile<BN, D>(sK + (buf ^ 1) * KV::kBytes, kg, kv_stride, (nb + 1) * BN, T);
      load_tile<BN, D>(sV + (buf ^ 1) * KV::kBytes, vg, kv_stride, (nb + 1) * BN, T);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    fence_proxy_async_shared();
    __syncthreads();
    const int n0 = nb * BN;
    // Warpgroup-uniform skip: every key of the block is after every query of this
    // warpgroup, or its queries are all past T. Key 0 is visible to every query, so
    // a warpgroup with a query < T never skips block 0.
    if (n0 <= wr0 + kWgRows - 1 && wr0 < T) {
      const uint32_t k_s = sK + buf * KV::kBytes, v_s = sV + buf * KV::kBytes;
      float s[BN / 2];
      uint32_t pa[KN][4];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < KD; ++kk)
        wgmma_ss<BN, 0, 0>(s, QT::k_major(sQ, wg * kWgRows, kk), KV::k_major(k_s, 0, kk), kk > 0);  // S = Q·Kᵀ
      wgmma_commit();
      wgmma_wait<0>();
      fence_accumulators(s);

      if (n0 + BN - 1 > wr0 || n0 + BN > T) {  // diagonal or tail block: mask
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = n0 + 8 * j + 2 * t + (e & 1);
            if (col > rows[e >> 1] || col >= T) s[4 * j + e] = -INFINITY;
          }
      }
      // Online softmax, per accumulator row r (rows[r]); a row lives in the 4 lanes of
      // a quad, so reductions are two xor-shuffles.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[r], mx * scale_log2);
        // A row with no visible key yet keeps m = -inf; subtract 0 so that exp gives 0, not NaN.
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;
        const float alpha = ex2(m_run[r] - m_use);
        m_run[r] = m_new;
        l_run[r] *= alpha;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          o[4 * j + 2 * r] *= alpha;
          o[4 * j + 2 * r + 1] *= alpha;
        }
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          s[4 * j + 2 * r] = ex2(fmaf(s[4 * j + 2 * r], scale_log2, -m_use));
          s[4 * j + 2 * r + 1] = ex2(fmaf(s[4 * j + 2 * r + 1], scale_log2, -m_use));
          l_run[r] += s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
        }
      }
      pack_a<BN>(pa, s);
      fence_accumulators(o);  // the rescale and the packing stay before the fence
      fence_registers(pa);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < KN; ++kk) wgmma_rs<D, 1>(o, pa[kk], KV::n_major(v_s, kk), 1);  // O += P·V
      wgmma_commit();
      wgmma_wait<0>();
      fence_accumulators(o);
      fence_registers(pa);
    }
    __syncthreads();  // every warpgroup is done with buffer `buf` before it is refilled
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
  // Q is no longer read (every wgmma was waited for before the last barrier).
  store_block<D>(out + q_off, q_stride, m0, T, o, inv[0], inv[1], gsmem + L::kBlock0);
#endif
}

// ---- dK, dV ------------------------------------------------------------------------

template <int D>
__global__ void __launch_bounds__(kThreads, 1)
    dkv_kernel(bf16* __restrict__ dk, bf16* __restrict__ dv, const bf16* __restrict__ q, const bf16* __restrict__ k,
               const bf16* __restrict__ v, const bf16* __restrict__ dout, const float* __restrict__ lse,
               const float* __restrict__ dsum, int T, int H, int group, float scale, float scale_log2) {
#if SPES_SM90A_DEVICE_CODE
  using L = Smem<D>;
  using KV = typename L::Block;
  using QT = typename L::Step;
  constexpr int BM = kStepRows, KD = D / 16, KM = BM / 16;
  unsigned char* gsmem;
  const uint32_t base = aligned_base(gsmem);
  const uint32_t sK = base + L::kBlock0, sV = base + L::kBlock1, sQ = base + L::kStep0, sdO = base + L::kStep1;
  float* sL = reinterpret_cast<float*>(gsmem + L::kVec);  // [2][BM] lse
  float* sD = sL + 2 * BM;                                // [2][BM] dsum

  const int n0 = blockIdx.x * kBlockRows;
  const int hk = blockIdx.y, b = blockIdx.z, Hkv = H / group;
  const int tid = static_cast<int>(threadIdx.x), wg = tid / kWarpgroup, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t q_stride = int64_t(H) * D, kv_stride = int64_t(Hkv) * D;
  const int64_t kv_off = (int64_t(b) * T * Hkv + hk) * D;

  // Query blocks from the one holding key n0 to the end, for each query head of the
  // group: iteration it → (head, query block).
  const int m_begin = n0 / BM;
  const int n_mblocks = (T + BM - 1) / BM - m_begin;
  const int iters = group * n_mblocks;
  auto head_of = [&](int it) { return hk * group + it / n_mblocks; };
  auto m0_of = [&](int it) { return (m_begin + it % n_mblocks) * BM; };
  auto prefetch = [&](int it, int buf) {
    const int h = head_of(it), m0 = m0_of(it);
    const int64_t q_off = (int64_t(b) * T * H + h) * D;
    load_tile<BM, D>(sQ + buf * QT::kBytes, q + q_off, q_stride, m0, T);
    load_tile<BM, D>(sdO + buf * QT::kBytes, dout + q_off, q_stride, m0, T);
    load_rowvec(sL + buf * BM, lse + (int64_t(b) * H + h) * T, m0, T);
    load_rowvec(sD + buf * BM, dsum + (int64_t(b) * H + h) * T, m0, T);
  };

  load_tile<kBlockRows, D>(sK, k + kv_off, kv_stride, n0, T);
  load_tile<kBlockRows, D>(sV, v + kv_off, kv_stride, n0, T);
  prefetch(0, 0);
  cp_async_commit();

  const int wk0 = n0 + wg * kWgRows;  // this warpgroup's first key
  const int key0 = wk0 + ((tid % kWarpgroup) / 32) * 16 + g;
  const int keys[2] = {key0, key0 + 8};  // this thread's accumulator rows
  float dk_acc[D / 2] = {};
  float dv_acc[D / 2] = {};

  for (int it = 0; it < iters; ++it) {
    const int buf = it & 1;
    if (it + 1 < iters) {
      prefetch(it + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    fence_proxy_async_shared();
    __syncthreads();
    const int m0 = m0_of(it);
    // Warpgroup-uniform skip: every query of the block is before every key of this
    // warpgroup, or its keys are all past T.
    if (m0 + BM - 1 >= wk0 && wk0 < T) {
      const uint32_t q_s = sQ + buf * QT::kBytes, do_s = sdO + buf * QT::kBytes;
      const float* l_s = sL + buf * BM;
      const float* d_s = sD + buf * BM;
      float st[BM / 2], dpt[BM / 2];
      uint32_t pa[KM][4], dsa[KM][4];

      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < KD; ++kk)
        wgmma_ss<BM, 0, 0>(st, KV::k_major(sK, wg * kWgRows, kk), QT::k_major(q_s, 0, kk), kk > 0);
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < KD; ++kk)
        wgmma_ss<BM, 0, 0>(dpt, KV::k_major(sV, wg * kWgRows, kk), QT::k_major(do_s, 0, kk), kk > 0);
      wgmma_commit();

      // Pᵀ = exp(Sᵀ·scale − lse[query]), masked (key after query, or either past T).
      const bool need_mask = m0 < wk0 + kWgRows - 1 || m0 + BM > T || wk0 + kWgRows > T;
      wgmma_wait<1>();
      fence_accumulators(st);
#pragma unroll
      for (int j = 0; j < BM / 8; ++j) {
        const int c = 8 * j + 2 * t;  // block-local query of elements p = 0 (p = 1: c + 1)
        const float2 lq = *reinterpret_cast<const float2*>(l_s + c);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float p = ex2(fmaf(st[4 * j + e], scale_log2, -((e & 1) ? lq.y : lq.x) * kLog2e));
          if (need_mask) {
            const int query = m0 + c + (e & 1), key = keys[e >> 1];
            if (key > query || query >= T || key >= T) p = 0.0f;
          }
          st[4 * j + e] = p;
        }
      }
      // dSᵀ = Pᵀ∘(dPᵀ − D[query]).
      wgmma_wait<0>();
      fence_accumulators(dpt);
#pragma unroll
      for (int j = 0; j < BM / 8; ++j) {
        const float2 dq = *reinterpret_cast<const float2*>(d_s + 8 * j + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) dpt[4 * j + e] = st[4 * j + e] * (dpt[4 * j + e] - ((e & 1) ? dq.y : dq.x));
      }
      pack_a<BM>(pa, st);
      pack_a<BM>(dsa, dpt);
      fence_accumulators(dv_acc);  // the packing stays before the fence
      fence_accumulators(dk_acc);
      fence_registers(pa);
      fence_registers(dsa);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < KM; ++kk) wgmma_rs<D, 1>(dv_acc, pa[kk], QT::n_major(do_s, kk), 1);  // dV += Pᵀ·dO
#pragma unroll
      for (int kk = 0; kk < KM; ++kk) wgmma_rs<D, 1>(dk_acc, dsa[kk], QT::n_major(q_s, kk), 1);  // dK += dSᵀ·Q
      wgmma_commit();
      wgmma_wait<0>();
      fence_accumulators(dv_acc);
      fence_accumulators(dk_acc);
      fence_registers(pa);
      fence_registers(dsa);
    }
    __syncthreads();  // every warpgroup is done with buffer `buf` before it is refilled
  }

  // K and V are no longer read (every wgmma was waited for before the last barrier).
  store_block<D>(dk + kv_off, kv_stride, n0, T, dk_acc, scale, scale, gsmem + L::kBlock0);
  store_block<D>(dv + kv_off, kv_stride, n0, T, dv_acc, 1.0f, 1.0f, gsmem + L::kBlock1);
#endif
}

// ---- dQ ------------------------------------------------------------------------------

template <int D>
__global__ void __launch_bounds__(kThreads, 1)
    dq_kernel(bf16* __restrict__ dq, const bf16* __restrict__ q, const bf16* __restrict__ k,
              const bf16* __restrict__ v, const bf16* __restrict__ dout, const float* __restrict__ lse,
              const float* __restrict__ dsum, int T, int H, int group, float scale, float scale_log2) {
#if SPES_SM90A_DEVICE_CODE
  using L = Smem<D>;
  using QT = typename L::Block;
  using KV = typename L::Step;
  constexpr int BN = kStepRows, KD = D / 16, KN = BN / 16;
  unsigned char* gsmem;
  const uint32_t base = aligned_base(gsmem);
  const uint32_t sQ = base + L::kBlock0, sdO = base + L::kBlock1, sK = base + L::kStep0, sV = base + L::kStep1;

  const int m0 = (gridDim.x - 1 - blockIdx.x) * kBlockRows;  // heaviest first
  const int h = blockIdx.y, b = blockIdx.z, Hkv = H / group, hk = h / group;
  const int tid = static_cast<int>(threadIdx.x), wg = tid / kWarpgroup, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t q_stride = int64_t(H) * D, kv_stride = int64_t(Hkv) * D;
  const int64_t q_off = (int64_t(b) * T * H + h) * D;
  const bf16* kg = k + (int64_t(b) * T * Hkv + hk) * D;
  const bf16* vg = v + (int64_t(b) * T * Hkv + hk) * D;
  const int n_blocks = (min(T, m0 + kBlockRows) + BN - 1) / BN;

  load_tile<kBlockRows, D>(sQ, q + q_off, q_stride, m0, T);
  load_tile<kBlockRows, D>(sdO, dout + q_off, q_stride, m0, T);
  load_tile<BN, D>(sK, kg, kv_stride, 0, T);
  load_tile<BN, D>(sV, vg, kv_stride, 0, T);
  cp_async_commit();

  const int wr0 = m0 + wg * kWgRows;  // this warpgroup's first query
  const int row0 = wr0 + ((tid % kWarpgroup) / 32) * 16 + g;
  const int rows[2] = {row0, row0 + 8};
  float lse2[2], dd[2];  // lse in log2 units and D_i of this thread's two rows
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = (int64_t(b) * H + h) * T + rows[r];
    lse2[r] = rows[r] < T ? lse[i] * kLog2e : 0.0f;
    dd[r] = rows[r] < T ? dsum[i] : 0.0f;
  }
  float dq_acc[D / 2] = {};

  for (int nb = 0; nb < n_blocks; ++nb) {
    const int buf = nb & 1;
    if (nb + 1 < n_blocks) {
      load_tile<BN, D>(sK + (buf ^ 1) * KV::kBytes, kg, kv_stride, (nb + 1) * BN, T);
      load_tile<BN, D>(sV + (buf ^ 1) * KV::kBytes, vg, kv_stride, (nb + 1) * BN, T);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    fence_proxy_async_shared();
    __syncthreads();
    const int n0 = nb * BN;
    if (n0 <= wr0 + kWgRows - 1 && wr0 < T) {  // warpgroup-uniform causal skip
      const uint32_t k_s = sK + buf * KV::kBytes, v_s = sV + buf * KV::kBytes;
      float s[BN / 2], dp[BN / 2];
      uint32_t dsa[KN][4];

      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < KD; ++kk)
        wgmma_ss<BN, 0, 0>(s, QT::k_major(sQ, wg * kWgRows, kk), KV::k_major(k_s, 0, kk), kk > 0);  // S = Q·Kᵀ
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < KD; ++kk)
        wgmma_ss<BN, 0, 0>(dp, QT::k_major(sdO, wg * kWgRows, kk), KV::k_major(v_s, 0, kk), kk > 0);  // dP = dO·Vᵀ
      wgmma_commit();

      const bool need_mask = n0 + BN - 1 > wr0 || n0 + BN > T;
      wgmma_wait<1>();
      fence_accumulators(s);
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float p = ex2(fmaf(s[4 * j + e], scale_log2, -lse2[e >> 1]));
          if (need_mask) {
            const int col = n0 + 8 * j + 2 * t + (e & 1);
            if (col > rows[e >> 1] || col >= T) p = 0.0f;
          }
          s[4 * j + e] = p;
        }
      wgmma_wait<0>();
      fence_accumulators(dp);
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[4 * j + e] = s[4 * j + e] * (dp[4 * j + e] - dd[e >> 1]);  // dS
      pack_a<BN>(dsa, dp);
      fence_accumulators(dq_acc);  // the packing stays before the fence
      fence_registers(dsa);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < KN; ++kk) wgmma_rs<D, 1>(dq_acc, dsa[kk], KV::n_major(k_s, kk), 1);  // dQ += dS·K
      wgmma_commit();
      wgmma_wait<0>();
      fence_accumulators(dq_acc);
      fence_registers(dsa);
    }
    __syncthreads();
  }

  // Q is no longer read (every wgmma was waited for before the last barrier).
  store_block<D>(dq + q_off, q_stride, m0, T, dq_acc, scale, scale, gsmem + L::kBlock0);
#endif
}

// ---- host side -----------------------------------------------------------------------

// What this family needs to know about a device, asked once per device.
struct DeviceInfo {
  bool sm90a = false;
  std::string why_not;  // when !sm90a: the first requirement that failed
};

DeviceInfo query_device(int dev) {
  DeviceInfo d;
  // one module: dkv_kernel<64> answers for all
  d.why_not = sm90a_unavailable_reason(dev, kBuiltForSm90a, Smem<128>::kAlloc, dkv_kernel<64>);
  d.sm90a = d.why_not.empty();
  return d;
}

const DeviceInfo& device_info() { return per_device<DeviceInfo>(query_device); }

template <int D>
void forward_impl(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int B, int T, int H, int Hkv,
                  cudaStream_t stream) {
  const float scale_log2 = kLog2e / sqrtf(static_cast<float>(D));
  const unsigned blocks = static_cast<unsigned>((T + kBlockRows - 1) / kBlockRows);
  constexpr size_t smem = Smem<D>::kAlloc;
  allow_dynamic_smem("attention_forward", forward_kernel<D>, smem);
  launch(forward_kernel<D>, dim3(blocks, H, B), kThreads, smem, stream, out, lse, q, k, v, T, H, H / Hkv, scale_log2);
  cuda_check_launch();
}

template <int D>
void backward_impl(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                   const float* lse, const float* dsum, int B, int T, int H, int Hkv, cudaStream_t stream) {
  const float scale = 1.0f / sqrtf(static_cast<float>(D));
  const float scale_log2 = scale * kLog2e;
  const int group = H / Hkv;
  const unsigned blocks = static_cast<unsigned>((T + kBlockRows - 1) / kBlockRows);
  constexpr size_t smem = Smem<D>::kAlloc;
  allow_dynamic_smem("attention_backward", dkv_kernel<D>, smem);
  launch(dkv_kernel<D>, dim3(blocks, Hkv, B), kThreads, smem, stream, dk, dv, q, k, v, dout, lse, dsum, T, H, group,
         scale, scale_log2);
  cuda_check_launch();
  allow_dynamic_smem("attention_backward", dq_kernel<D>, smem);
  launch(dq_kernel<D>, dim3(blocks, H, B), kThreads, smem, stream, dq, q, k, v, dout, lse, dsum, T, H, group, scale,
         scale_log2);
  cuda_check_launch();
}

}  // namespace

bool available() { return device_info().sm90a; }

std::string unavailable_reason() { return device_info().why_not; }

void forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int B, int T, int H, int Hkv, int D,
             cudaStream_t stream) {
  if (D == 64)
    forward_impl<64>(out, lse, q, k, v, B, T, H, Hkv, stream);
  else
    forward_impl<128>(out, lse, q, k, v, B, T, H, Hkv, stream);
}

void backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
              const float* lse, const float* dsum, int B, int T, int H, int Hkv, int D, cudaStream_t stream) {
  if (D == 64)
    backward_impl<64>(dq, dk, dv, dout, q, k, v, lse, dsum, B, T, H, Hkv, stream);
  else
    backward_impl<128>(dq, dk, dv, dout, q, k, v, lse, dsum, B, T, H, Hkv, stream);
}

}  // namespace spes::cuda::attention_sm90
