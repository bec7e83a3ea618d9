// Grouped expert GEMMs (contract: grouped_gemm.cuh), the portable tensor-core path:
// mma.sync m16n8k16 bf16 with fp32 accumulators, ldmatrix(.trans) from shared memory,
// a cp.async multi-stage pipeline of 16-byte copies. Runs on sm_80 and sm_90.
//
// Tiles. One CTA computes a 128 × 128 output tile, 8 warps as 2 (M) × 4 (N), each warp
// 64 × 32 (4 m16 × 4 n8 accumulator tiles, 64 fp32 registers), over k-steps of 32
// staged through 4 shared-memory buffers (3 copies in flight while one is computed).
// Why so: a 128 × 128 tile uses each operand element it loads 128 times (16 KB from
// L2 per k-step for 1 MFLOP), and a 64 × 32 warp tile issues 6 ldmatrix.x4 per 16 mma
// while its 64 accumulators keep the thread within 128 registers; 8 warps give each
// SM sub-partition two warps of a CTA to alternate between. A 128 × 256 tile would
// cut the L2 traffic per FLOP by a quarter but needs 64 × 64 warp tiles at ~240
// registers, one CTA per SM. 64 KB of shared memory and ≤ 128 registers per thread
// (__launch_bounds__(256, 2)) let two CTAs share an SM on both A100 (164 KB) and
// H100 (228 KB), so one CTA's epilogue or pipeline fill overlaps the other's main
// loop. Shared tiles are unpadded with the 16-byte chunks XOR-swizzled
// (SwizzledTile): ldmatrix's 8 row addresses of a matrix then fall in 8 distinct
// 16-byte bank groups, and 4 stages fit where padded rows would take 20 % more.
//
// The three products are one main loop over operand layouts (Major): an operand is
// K-major (its k index contiguous: inp and dout as the A of forward / backward-input,
// W_e as the B of forward), loaded into a [128][32] tile and read by ldmatrix; or
// MN-major (its m or n index contiguous: W_e as the B of backward-input, doutᵀ and inp
// in the weight gradient), loaded into a [32][128] tile and read by ldmatrix.trans.
// No operand is ever transposed in memory.
//
// Scheduling. Forward and backward-input: row tiles are numbered expert by expert
// (expert e has ceil(m_e / 128) of them, m_e = offsets[e+1] − offsets[e]); the grid
// is an upper bound, (ceil(S/128) + E) row tiles × ceil(N/128) column tiles, since
// Σ_e ceil(m_e/128) ≤ S/128 + E. Each CTA finds its expert from the device offsets by
// a block-wide scan of the tile counts (one thread per expert, E ≤ 256 = the CTA's
// threads) and exits when past the last tile. Column tiles vary fastest, so the CTAs
// resident at once share a few row tiles of activations and one expert's weights in
// L2. Weight gradient: one CTA per (trained expert, OC tile, C tile), each reducing
// over all of that expert's rows in k-steps of 32 rows, then dW += tile; experts not
// in the trained list get no CTA, an expert with no rows returns before touching dW.
// Every output element is owned by one CTA and summed in k order: no atomics, the
// same bits every run.
//
// SwiGLU. The gate|up forward can end in SwiGLU (grouped_matmul_forward_swiglu): its
// column tile is then 64 columns of gate beside the same 64 of up (B's rows loaded
// from the two windows of W_e), so that h forms in the tile; the warps holding up
// hand it to those holding gate through shared memory. The down product's
// backward-input can end in SwiGLU's backward instead of a store of dh
// (grouped_matmul_backward_input_swiglu): each output pair, rounded to bf16 as if
// stored, meets its gate and up, read from gate_up, and the gate and up gradients and
// the recomputed h are stored in its place. Either way the MoE layer saves a pass over
// memory: the forward never reads gate|up back for h, the backward never writes dh
// nor reads it back.
//
// Tails. Rows past an expert's end, output columns past N and reduction columns past
// K (C or OC not a multiple of the tile) are zero-filled by predicated cp.async
// (src-size 0: nothing read) and masked at the store; C and OC multiples of 8 keep
// every 16-byte chunk wholly inside or outside.
//
// Paths. The launchers check the arguments, then pick a kernel family per call
// (GroupedGemmPath): this file's portable mma.sync one, or the Hopper wgmma one of
// grouped_gemm_sm90.cu (same contract and tile order; its own file because it alone is
// compiled for sm_90a), wherever that can run.
#include "cuda/grouped_gemm.cuh"

#include <climits>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>

#include "cuda/check.cuh"
#include "cuda/grouped_gemm_common.cuh"
#include "cuda/grouped_gemm_sm90.cuh"
#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "cuda/swiglu_math.cuh"

namespace spes::cuda {
namespace {

using namespace grouped;

constexpr int kBM = 128, kBN = 128, kBK = 32, kStages = 4;
constexpr int kWarpsM = 2, kWarpsN = 4, kWarps = kWarpsM * kWarpsN, kThreads = kWarps * kWarp;
constexpr int kWarpTileM = kBM / kWarpsM, kWarpTileN = kBN / kWarpsN;
constexpr int kMT = kWarpTileM / 16, kNT = kWarpTileN / 8;  // m16 and n8 accumulator tiles per warp
static_assert(kMaxExperts <= kThreads, "the tile scan gives each expert one thread");
static_assert(kBK % 16 == 0 && kNT % 2 == 0, "whole k16 steps; n8 tiles loaded in pairs");

// A ROWS × COLS bf16 shared tile, rows COLS elements apart, each row's 16-byte chunks
// permuted by XOR with a few row bits: ldmatrix reads 8 consecutive rows at one
// logical chunk, and those land in 8 different 16-byte slots of the 128-byte bank
// window. Rows of 4 chunks (64 B, two rows per window): chunk ^ ((row / 2) % 4);
// rows of 8 or more chunks: chunk ^ (row % 8).
template <int ROWS, int COLS>
struct SwizzledTile {
  static constexpr int kRows = ROWS, kChunks = COLS / 8, kElems = ROWS * COLS;
  static_assert(kChunks == 4 || kChunks == 8 || kChunks == 16, "swizzle written for 64-, 128- and 256-byte rows");
  // Element offset of (row r, column c), c a multiple of 8.
  __device__ __forceinline__ static int offset(int r, int c) {
    const int sw = kChunks == 4 ? (r >> 1) & 3 : r & 7;
    return r * COLS + (((c >> 3) ^ sw) << 3);
  }
};

// The shared tile of one operand whose non-reduction extent is MN.
template <Major MAJ, int MN>
using OperandTile = std::conditional_t<MAJ == Major::k, SwizzledTile<MN, kBK>, SwizzledTile<kBK, MN>>;

template <Major A_MAJ, Major B_MAJ>
struct Config {
  using TileA = OperandTile<A_MAJ, kBM>;
  using TileB = OperandTile<B_MAJ, kBN>;
  static constexpr int kStageElems = TileA::kElems + TileB::kElems;
  static constexpr int kSchedInts = 16;  // the row-tile scan's scratch, after the stages
  static constexpr size_t kSmem = size_t(kStages) * kStageElems * sizeof(bf16) + kSchedInts * sizeof(int);
};

// ---- global → shared ----------------------------------------------------------------

// Copies the ROWS × COLS window whose row r starts at src + r·ld into a Tile; rows
// ≥ rows_valid and chunks at columns ≥ cols_valid are zero-filled without a read (the
// address given for them is src itself, which the caller keeps inside its buffer).
// PAIRED: rows [ROWS/2, ROWS) come from `second` (its row 0 being row ROWS/2), and
// rows_valid counts the rows inside each half.
template <class Tile, bool PAIRED = false>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* src, int64_t ld, int rows_valid, int cols_valid,
                                          const bf16* second = nullptr) {
  constexpr int kCopies = Tile::kRows * Tile::kChunks, kHalf = Tile::kRows / 2;
  static_assert(kCopies % kThreads == 0, "tile copy must divide evenly over the CTA");
#pragma unroll
  for (int i = 0; i < kCopies / kThreads; ++i) {
    const int idx = i * kThreads + static_cast<int>(threadIdx.x);
    const int r = idx / Tile::kChunks, c = (idx % Tile::kChunks) * 8;
    const bool in_second = PAIRED && r >= kHalf;
    const bool ok = (in_second ? r - kHalf : r) < rows_valid && c < cols_valid;
    const bf16* from = in_second ? second + (r - kHalf) * ld + c : src + r * ld + c;
    cp_async_16(smem_addr(dst + Tile::offset(r, c)), ok ? from : src, ok);
  }
}

// k-step [k0, k0 + kBK) of an operand whose element (i, k), i in [0, MN), is at
// src[i·ld + k] (Major::k) or src[k·ld + i] (Major::mn); i ≥ mn_valid and k ≥ K read as 0.
// PAIRED (Major::k): i in [MN/2, MN) at second[(i − MN/2)·ld + k], mn_valid per half.
template <Major MAJ, int MN, bool PAIRED = false>
__device__ __forceinline__ void load_operand(bf16* dst, const bf16* src, int64_t ld, int mn_valid, int k0, int K,
                                             const bf16* second = nullptr) {
  static_assert(!PAIRED || MAJ == Major::k, "paired halves are windows of a K-major operand's rows");
  using Tile = OperandTile<MAJ, MN>;
  if constexpr (MAJ == Major::k)
    load_tile<Tile, PAIRED>(dst, src + k0, ld, mn_valid, K - k0, PAIRED ? second + k0 : nullptr);
  else
    load_tile<Tile>(dst, src + int64_t(k0) * ld, ld, K - k0, mn_valid);
}

// ---- shared → registers (fragment layouts: see attention.cu's file comment) ----------

// A fragment of the 16 × 16 block at m0, k0. K-major tile [m][k]: matrices (m0, k0),
// (m0+8, k0), (m0, k0+8), (m0+8, k0+8) = a0..a3, lanes 0-15 rows m0.., lanes 16-31 the
// same rows at k0+8. MN-major tile [k][m]: the same four matrices transposed, each
// stored as 8 k-rows × 8 m-columns: a0 (k0, m0), a1 (k0, m0+8), a2 (k0+8, m0),
// a3 (k0+8, m0+8), where .trans gives lane (g, t) rows 2t, 2t+1 of column g = A(m g, k 2t..).
template <Major MAJ, class Tile>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* tile, int m0, int k0, int lane) {
  if constexpr (MAJ == Major::k)
    ldmatrix_x4(a, smem_addr(tile + Tile::offset(m0 + (lane & 15), k0 + ((lane >> 4) << 3))));
  else
    ldmatrix_x4_trans(a, smem_addr(tile + Tile::offset(k0 + (lane & 7) + ((lane >> 4) << 3),
                                                       m0 + (((lane >> 3) & 1) << 3))));
}

// B fragments of the two n8 tiles n0.., n0+8.. at k0: b[0], b[1] → n-tile n0; b[2],
// b[3] → n-tile n0+8. K-major tile [n][k] (W_e in the forward): matrices (n0, k0),
// (n0, k0+8), (n0+8, k0), (n0+8, k0+8), non-transposed (lane (g, t) gets row g, columns
// 2t, 2t+1 = B(k 2t.., n g)). MN-major tile [k][n]: matrices (k0, n0), (k0+8, n0),
// (k0, n0+8), (k0+8, n0+8), transposed.
template <Major MAJ, class Tile>
__device__ __forceinline__ void load_b(uint32_t (&b)[4], const bf16* tile, int n0, int k0, int lane) {
  if constexpr (MAJ == Major::k)
    ldmatrix_x4(b, smem_addr(tile + Tile::offset(n0 + (lane & 7) + ((lane >> 4) << 3),
                                                 k0 + (((lane >> 3) & 1) << 3))));
  else
    ldmatrix_x4_trans(b, smem_addr(tile + Tile::offset(k0 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                                       n0 + ((lane >> 4) << 3))));
}

// ---- the main loop ---------------------------------------------------------------------

// acc += A·B over k in [0, K) for the CTA's 128 × 128 tile: A's element (m, k) at
// a[m·lda + k] (Major::k) or a[k·lda + m] (Major::mn), m < m_valid; B's (n, k) likewise
// from b, n < n_valid (B_PAIRED: n in [64, 128) from b_second, n_valid per half; see
// load_operand). Warp w computes rows (w / 4)·64.., columns (w % 4)·32.. of it.
template <Major A_MAJ, Major B_MAJ, bool B_PAIRED = false>
__device__ __forceinline__ void mainloop(float (&acc)[kMT][kNT][4], bf16* smem, const bf16* a, int64_t lda,
                                         int m_valid, const bf16* b, int64_t ldb, int n_valid, int K,
                                         const bf16* b_second = nullptr) {
  using Cfg = Config<A_MAJ, B_MAJ>;
  using TileA = typename Cfg::TileA;
  using TileB = typename Cfg::TileB;
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int wm = (warp / kWarpsN) * kWarpTileM, wn = (warp % kWarpsN) * kWarpTileN;
  const int ktiles = (K + kBK - 1) / kBK;

  auto load_stage = [&](int stage, int kt) {
    bf16* sa = smem + stage * Cfg::kStageElems;
    load_operand<A_MAJ, kBM>(sa, a, lda, m_valid, kt * kBK, K);
    load_operand<B_MAJ, kBN, B_PAIRED>(sa + TileA::kElems, b, ldb, n_valid, kt * kBK, K, b_second);
  };

  // Prologue: k-steps 0 .. kStages-2 in flight, one commit group each (empty past K,
  // so that the group count, and with it the wait below, is the same every step).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    cp_async_commit();
  }

  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<kStages - 2>();  // this thread's copies of k-step kt have landed
    __syncthreads();               // everyone's have; and everyone is done with k-step kt-1
    // Refill the buffer of k-step kt-1 (free since the barrier) with k-step kt + kStages-1.
    const int next = kt + kStages - 1;
    if (next < ktiles) load_stage(next % kStages, next);
    cp_async_commit();

    const bf16* sa = smem + (kt % kStages) * Cfg::kStageElems;
    const bf16* sb = sa + TileA::kElems;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t af[kMT][4], bfr[kNT / 2][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) load_a<A_MAJ, TileA>(af[mt], sa, wm + mt * 16, kk, lane);
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) load_b<B_MAJ, TileB>(bfr[np], sb, wn + np * 16, kk, lane);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
          mma_bf16(acc[mt][2 * np], af[mt], bfr[np][0], bfr[np][1]);
          mma_bf16(acc[mt][2 * np + 1], af[mt], bfr[np][2], bfr[np][3]);
        }
    }
  }
  // Every group left is empty (k-steps past K): nothing is in flight at exit.
}

// ---- scheduling ----------------------------------------------------------------------

// The row tile `t` of the expert-major numbering (expert e's ceil(m_e / kBM) tiles,
// then e+1's): its expert, first row and number of rows (1..kBM); expert −1 past the
// last tile. Thread e < E reads expert e's range, clamped to [0, S]; the tile counts
// are scanned over the CTA (shuffles within a warp, warp totals through `scratch`,
// kWarps + 3 ints). Called by every thread; the result is the same in all of them.
struct RowTile {
  int expert, row0, rows;
};
__device__ __forceinline__ RowTile find_row_tile(const int32_t* __restrict__ offsets, int E, int S, int t,
                                                 int* scratch) {
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  int start = 0, end = 0;
  if (tid < E) {
    start = clamp_int(offsets[tid], 0, S);
    end = clamp_int(offsets[tid + 1], start, S);
  }
  const int tiles = (end - start + kBM - 1) / kBM;
  int incl = tiles;  // inclusive prefix of the tile counts within the warp
#pragma unroll
  for (int o = 1; o < kWarp; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == kWarp - 1) scratch[warp] = incl;
  if (tid == 0) scratch[kWarps] = -1;
  __syncthreads();
  for (int w = 0; w < warp; ++w) incl += scratch[w];
  const int excl = incl - tiles;
  if (excl <= t && t < incl) {  // exactly one thread, unless t is past the last tile
    const int row0 = start + (t - excl) * kBM;
    scratch[kWarps] = tid;
    scratch[kWarps + 1] = row0;
    scratch[kWarps + 2] = min(kBM, end - row0);
  }
  __syncthreads();
  return {scratch[kWarps], scratch[kWarps + 1], scratch[kWarps + 2]};
}

// ---- kernels ---------------------------------------------------------------------------

// A column tile's width in output columns: swiglu_forward's is kBN / 2 columns of gate
// beside the same columns of up.
constexpr int column_tile_width(Epilogue epi) { return epi == Epilogue::swiglu_forward ? kBN / 2 : kBN; }

// Calls f(r, c, v0, v1) for each accumulator pair of this thread: the CTA tile's row r,
// columns c and c + 1. Warp w holds rows (w / 4)·64.., columns (w % 4)·32.. (see
// mainloop); within it, mma's C fragment: pair (g, 2t..2t+1) and (g+8, 2t..) of each
// m16 × n8 tile, g = lane / 4, t = lane % 4.
template <class F>
__device__ __forceinline__ void for_each_acc_pair(const float (&acc)[kMT][kNT][4], F&& f) {
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int wm = (warp / kWarpsN) * kWarpTileM, wn = (warp % kWarpsN) * kWarpTileN;
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
        f(wm + mt * 16 + g + 8 * h, wn + nt * 8 + 2 * tq, acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
}

// Output pair (c, c + 1) of row `row` of the SwiGLU-backward epilogue: dh from the
// accumulators, rounded to bf16 as a stored dh would be; gate and up read from gate_up
// (row stride 2N, up N columns after gate), their gradients written likewise into
// dgate_up, the recomputed h into h_row (see grouped_matmul_backward_input_swiglu).
__device__ __forceinline__ void swiglu_backward_pair(bf16* h_row, const bf16* gate_up_row, bf16* dgate_up_row, int c,
                                                     int N, float dh0, float dh1) {
  const __nv_bfloat162 dh = __floats2bfloat162_rn(dh0, dh1);
  const __nv_bfloat162 g = *reinterpret_cast<const __nv_bfloat162*>(gate_up_row + c);
  const __nv_bfloat162 u = *reinterpret_cast<const __nv_bfloat162*>(gate_up_row + N + c);
  const SwigluGrad x0 = swiglu_grad(__low2float(dh), __low2float(g), __low2float(u));
  const SwigluGrad x1 = swiglu_grad(__high2float(dh), __high2float(g), __high2float(u));
  *reinterpret_cast<__nv_bfloat162*>(dgate_up_row + c) = __floats2bfloat162_rn(x0.dgate, x1.dgate);
  *reinterpret_cast<__nv_bfloat162*>(dgate_up_row + N + c) = __floats2bfloat162_rn(x0.dup, x1.dup);
  *reinterpret_cast<__nv_bfloat162*>(h_row + c) = __floats2bfloat162_rn(x0.h, x1.h);
}

// The gate|up forward's store with SwiGLU (a paired tile: columns [0, 64) are gate
// columns n0.., [64, 128) the same columns of up). The warps holding up put it, rounded
// to bf16, in shared memory (the stages, free after the main loop); the warps holding
// the same gate columns read it back to form h from the bf16 gate and up, as
// swiglu_forward would from the stored ones. out = gate|up, row stride 2N.
__device__ __forceinline__ void swiglu_forward_store(const float (&acc)[kMT][kNT][4], bf16* smem, bf16* out, bf16* h,
                                                     const RowTile& rt, int n0, int N) {
  constexpr int kHalf = kBN / 2, kPitch = kHalf + 8;  // 8 columns of padding: row r's pairs 4 banks on from r − 1's
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const bool holds_up = (warp % kWarpsN) * kWarpTileN >= kHalf;  // every pair of this warp is up's
  __nv_bfloat162* up_tile = reinterpret_cast<__nv_bfloat162*>(smem);  // [kBM][kPitch / 2] pairs
  static_assert(kBM * kPitch <= kStages * Config<Major::k, Major::k>::kStageElems, "the up tile fits in the stages");
  __syncthreads();  // every warp is done reading the stages
  if (holds_up)
    for_each_acc_pair(acc, [&](int r, int c, float v0, float v1) {
      up_tile[(r * kPitch + c - kHalf) / 2] = __floats2bfloat162_rn(v0, v1);
    });
  __syncthreads();
  for_each_acc_pair(acc, [&](int r, int tile_c, float v0, float v1) {
    const int c = holds_up ? tile_c - kHalf : tile_c;  // column within gate (or up)
    if (r >= rt.rows || n0 + c >= N) return;
    const int64_t row = int64_t(rt.row0) + r;
    const __nv_bfloat162 v = __floats2bfloat162_rn(v0, v1);
    *reinterpret_cast<__nv_bfloat162*>(out + row * 2 * N + (holds_up ? N : 0) + n0 + c) = v;
    if (!holds_up) {
      const __nv_bfloat162 u = up_tile[(r * kPitch + c) / 2];
      *reinterpret_cast<__nv_bfloat162*>(h + row * N + n0 + c) =
          __floats2bfloat162_rn(swiglu_value(__low2float(v), __low2float(u)),
                                swiglu_value(__high2float(v), __high2float(u)));
    }
  });
}

// Forward (B_MAJ = k) and backward-input (B_MAJ = mn): out[s, 0:N] = a[s, 0:K] · B_e for
// the rows s of each expert, B_e from W_e = weights[e]: forward N = OC, K = C, W_e is
// [N][K] (element (n, k) at w[n·K + k]); backward-input N = C, K = OC, W_e is [K][N]
// (element (n, k) at w[k·N + n]). One CTA per (row tile, column tile), blockIdx.x =
// row tile · n_col_tiles + column tile. EPI says what the store writes (Epilogue):
// swiglu_forward's tile is 64 columns of gate (W_e's rows n0..) beside the same 64 of
// up (rows N + n0.., W_e being [2N][K]), N the width of h.
template <Major B_MAJ, Epilogue EPI = Epilogue::plain>
__global__ void __launch_bounds__(kThreads, 2)
    grouped_rows_kernel(bf16* __restrict__ out, const bf16* __restrict__ a, const bf16* const* __restrict__ weights,
                        const int32_t* __restrict__ offsets, int S, int E, int N, int K, int n_col_tiles,
                        SwigluOperands swiglu) {
  static_assert(EPI != Epilogue::swiglu_forward || B_MAJ == Major::k, "SwiGLU's forward follows the forward");
  static_assert(EPI != Epilogue::swiglu_backward || B_MAJ == Major::mn,
                "SwiGLU's backward follows the backward-input product");
  constexpr bool kPaired = EPI == Epilogue::swiglu_forward;
  using Cfg = Config<Major::k, B_MAJ>;
  unsigned char* raw = dynamic_smem<unsigned char>;
  bf16* smem = reinterpret_cast<bf16*>(raw);
  int* sched = reinterpret_cast<int*>(smem + kStages * Cfg::kStageElems);
  const int t = static_cast<int>(blockIdx.x) / n_col_tiles;
  const int n0 = (static_cast<int>(blockIdx.x) % n_col_tiles) * column_tile_width(EPI);
  const RowTile rt = find_row_tile(offsets, E, S, t, sched);
  if (rt.expert < 0) return;  // uniform: every thread read the same scratch

  const bf16* w = weights[rt.expert];
  const bf16* b = B_MAJ == Major::k ? w + int64_t(n0) * K : w + n0;
  const int64_t ldb = B_MAJ == Major::k ? K : N;
  float acc[kMT][kNT][4] = {};
  mainloop<Major::k, B_MAJ, kPaired>(acc, smem, a + int64_t(rt.row0) * K, K, rt.rows, b, ldb, N - n0, K,
                                     kPaired ? w + (int64_t(N) + n0) * K : nullptr);
  if constexpr (kPaired) {
    swiglu_forward_store(acc, smem, out, swiglu.h, rt, n0, N);
    return;
  }

  // bf16 pairs, rows past the expert's end and columns past N skipped (N % 8 == 0: a
  // pair is wholly inside or outside).
  for_each_acc_pair(acc, [&](int r, int c, float v0, float v1) {
    if (r >= rt.rows || n0 + c >= N) return;
    bf16* row = out + (int64_t(rt.row0) + r) * N + n0;
    if constexpr (EPI == Epilogue::swiglu_backward) {
      const int64_t gate_up_row = (int64_t(rt.row0) + r) * 2 * N + n0;
      swiglu_backward_pair(row, swiglu.gate_up + gate_up_row, swiglu.dgate_up + gate_up_row, c, N, v0, v1);
    } else {
      *reinterpret_cast<__nv_bfloat162*>(row + c) = __floats2bfloat162_rn(v0, v1);
    }
  });
}

// Weight gradient: dweights[e][m, n] += Σ_s dout[s, m]·inp[s, n] over the rows s of
// expert e = trained[i], M = OC, N = C, the reduction over the expert's rows. A = doutᵀ
// (element (m, k) at dout[(start + k)·OC + m]) and B = inp (element (n, k) at
// inp[(start + k)·C + n]) are both MN-major. blockIdx.x = (i · m_tiles + OC tile) ·
// n_tiles + C tile.
__global__ void __launch_bounds__(kThreads, 2)
    grouped_wgrad_kernel(float* const* __restrict__ dweights, const bf16* __restrict__ dout,
                         const bf16* __restrict__ inp, const int32_t* __restrict__ offsets,
                         const int32_t* __restrict__ trained, int S, int E, int C, int OC, int m_tiles, int n_tiles) {
  unsigned char* raw = dynamic_smem<unsigned char>;
  bf16* smem = reinterpret_cast<bf16*>(raw);
  const int per_expert = m_tiles * n_tiles, id = static_cast<int>(blockIdx.x);
  const int i = id / per_expert, rem = id % per_expert;
  const int m0 = (rem / n_tiles) * kBM, n0 = (rem % n_tiles) * kBN;
  const int e = trained[i];
  if (e < 0 || e >= E) return;
  const int start = clamp_int(offsets[e], 0, S), end = clamp_int(offsets[e + 1], start, S);
  if (end == start) return;  // no rows: dW unchanged, not even read

  float acc[kMT][kNT][4] = {};
  mainloop<Major::mn, Major::mn>(acc, smem, dout + int64_t(start) * OC + m0, OC, OC - m0,
                                 inp + int64_t(start) * C + n0, C, C - n0, end - start);

  float* dw_tile = dweights[e] + int64_t(m0) * C + n0;
  for_each_acc_pair(acc, [&](int r, int c, float v0, float v1) {
    if (m0 + r >= OC || n0 + c >= C) return;
    float2* pair = reinterpret_cast<float2*>(dw_tile + int64_t(r) * C + c);
    float2 v = *pair;
    v.x += v0;
    v.y += v1;
    *pair = v;
  });
}

// ---- launchers ---------------------------------------------------------------------------

// SPES_GROUPED_GEMM=portable keeps the automatic choice on the portable path (read
// once): a way around the Hopper kernels on a machine where they misbehave, and how a
// bench times the whole step on each path in one run.
bool portable_forced(const char* op) {
  static const char* const value = std::getenv("SPES_GROUPED_GEMM");
  require(value == nullptr || *value == '\0' || std::string(value) == "portable", op,
          std::string("SPES_GROUPED_GEMM is \"") + (value ? value : "") + "\"; it may only be \"portable\" or unset");
  return value != nullptr && std::string(value) == "portable";
}

// The kernel family a call runs on: `requested` resolved for the current device.
GroupedGemmPath choose_path(const char* op, GroupedGemmPath requested) {
  switch (requested) {
    case GroupedGemmPath::portable:
      return requested;
    case GroupedGemmPath::sm90a:
      require(grouped_sm90::available(), op, "the sm90a path cannot run here: " + grouped_sm90::unavailable_reason());
      return requested;
    default:
      return grouped_sm90::available() && !portable_forced(op) ? GroupedGemmPath::sm90a : GroupedGemmPath::portable;
  }
}

std::string sizes(int64_t S, int64_t E, int64_t C, int64_t OC) {
  return " (S=" + std::to_string(S) + " E=" + std::to_string(E) + " C=" + std::to_string(C) +
         " OC=" + std::to_string(OC) + ")";
}

void check_sizes(const char* op, int64_t S, int64_t E, int64_t C, int64_t OC) {
  require(C > 0 && C % 8 == 0 && C <= INT32_MAX, op,
          "C must be a positive multiple of 8 (16-byte rows)" + sizes(S, E, C, OC));
  require(OC > 0 && OC % 8 == 0 && OC <= INT32_MAX, op,
          "OC must be a positive multiple of 8 (16-byte rows)" + sizes(S, E, C, OC));
  require(S >= 0 && S <= INT32_MAX, op, "S must be in [0, INT32_MAX]" + sizes(S, E, C, OC));
  require(E >= 1 && E <= kMaxExperts, op, "E must be in [1, 256]" + sizes(S, E, C, OC));
}

// The SwiGLU products' hidden width H (the C or the half of OC that check_sizes checks).
void check_hidden(const char* op, int64_t H) {
  require(H > 0 && H % 8 == 0 && H <= INT32_MAX / 2, op,
          "H must be a positive multiple of 8 (16-byte rows), got " + std::to_string(H));
}

// The grids are 1-D (blockIdx.x up to 2^31 − 1): forward and backward-input launch
// (ceil(S/128) + E) row tiles × ceil(N/128) column tiles, N the output width.
void check_row_grid(const char* op, int64_t S, int64_t E, int64_t C, int64_t OC, int64_t N) {
  require((ceil_div(S, kBM) + E) * ceil_div(N, kBN) <= INT32_MAX, op,
          "too many tiles for one launch" + sizes(S, E, C, OC));
}

// Forward and backward-input: `a` [S, K] per-row operand, out [S, N].
// The portable family (the sm90a one has its own launchers, grouped_gemm_sm90.cu).
// EPI: what the store writes (Epilogue), with the tensors it needs beside out in swiglu.
template <Major B_MAJ, Epilogue EPI = Epilogue::plain>
void rows_impl(const char* op, bf16* out, const bf16* a, const bf16* const* weights, const int32_t* offsets,
               int64_t S, int64_t E, int64_t N, int64_t K, cudaStream_t stream, SwigluOperands swiglu = {}) {
  const int64_t n_col_tiles = ceil_div(N, column_tile_width(EPI)), row_tiles = ceil_div(S, kBM) + E;
  using Cfg = Config<Major::k, B_MAJ>;
  auto kernel = grouped_rows_kernel<B_MAJ, EPI>;
  allow_dynamic_smem(op, kernel, Cfg::kSmem);
  launch(kernel, static_cast<unsigned>(row_tiles * n_col_tiles), kThreads, Cfg::kSmem, stream, out, a, weights,
         offsets, static_cast<int>(S), static_cast<int>(E), static_cast<int>(N), static_cast<int>(K),
         static_cast<int>(n_col_tiles), swiglu);
  cuda_check_launch();
}

}  // namespace

bool grouped_gemm_sm90a_available() { return grouped_sm90::available(); }
std::string grouped_gemm_sm90a_unavailable_reason() { return grouped_sm90::unavailable_reason(); }
std::string grouped_gemm_automatic_path_description() {
  const char* op = "grouped GEMM";
  if (choose_path(op, GroupedGemmPath::automatic) == GroupedGemmPath::sm90a) return "sm90a (wgmma)";
  if (!grouped_sm90::available()) return "portable: " + grouped_sm90::unavailable_reason();
  return "portable (SPES_GROUPED_GEMM=portable)";
}

void grouped_matmul_forward(bf16* out, const bf16* inp, const bf16* const* weights, const int32_t* offsets,
                            int64_t S, int64_t E, int64_t C, int64_t OC, cudaStream_t stream, GroupedGemmPath path) {
  const char* op = "grouped_matmul_forward";
  check_sizes(op, S, E, C, OC);
  check_row_grid(op, S, E, C, OC, OC);
  require_ptr(out, 16, op, "out");
  require_ptr(inp, 16, op, "inp");
  require_ptr(weights, sizeof(void*), op, "weights");
  require_ptr(offsets, sizeof(int32_t), op, "offsets");
  require_disjoint(out, size_t(S * OC) * sizeof(bf16), inp, size_t(S * C) * sizeof(bf16), op,
                   "out must not overlap inp");
  if (S == 0) return;
  if (choose_path(op, path) == GroupedGemmPath::sm90a)
    grouped_sm90::forward(out, inp, weights, offsets, S, E, C, OC, stream);
  else
    rows_impl<Major::k>(op, out, inp, weights, offsets, S, E, OC, C, stream);
}

void grouped_matmul_forward_swiglu(bf16* gate_up, bf16* h, const bf16* inp, const bf16* const* weights,
                                   const int32_t* offsets, int64_t S, int64_t E, int64_t C, int64_t H,
                                   cudaStream_t stream, GroupedGemmPath path) {
  const char* op = "grouped_matmul_forward_swiglu";
  check_hidden(op, H);
  check_sizes(op, S, E, C, 2 * H);
  check_row_grid(op, S, E, C, 2 * H, 2 * H);
  require_ptr(gate_up, 16, op, "gate_up");
  require_ptr(h, 16, op, "h");
  require_ptr(inp, 16, op, "inp");
  require_ptr(weights, sizeof(void*), op, "weights");
  require_ptr(offsets, sizeof(int32_t), op, "offsets");
  const size_t h_bytes = size_t(S * H) * sizeof(bf16), inp_bytes = size_t(S * C) * sizeof(bf16);
  require_disjoint(gate_up, 2 * h_bytes, inp, inp_bytes, op, "gate_up must not overlap inp");
  require_disjoint(h, h_bytes, inp, inp_bytes, op, "h must not overlap inp");
  require_disjoint(h, h_bytes, gate_up, 2 * h_bytes, op, "h must not overlap gate_up");
  if (S == 0) return;
  if (choose_path(op, path) == GroupedGemmPath::sm90a)
    grouped_sm90::forward_swiglu(gate_up, h, inp, weights, offsets, S, E, C, H, stream);
  else
    rows_impl<Major::k, Epilogue::swiglu_forward>(op, gate_up, inp, weights, offsets, S, E, H, C, stream,
                                                  {nullptr, nullptr, h});
}

void grouped_matmul_backward_input(bf16* dinp, const bf16* dout, const bf16* const* weights,
                                   const int32_t* offsets, int64_t S, int64_t E, int64_t C, int64_t OC,
                                   cudaStream_t stream, GroupedGemmPath path) {
  const char* op = "grouped_matmul_backward_input";
  check_sizes(op, S, E, C, OC);
  check_row_grid(op, S, E, C, OC, C);
  require_ptr(dinp, 16, op, "dinp");
  require_ptr(dout, 16, op, "dout");
  require_ptr(weights, sizeof(void*), op, "weights");
  require_ptr(offsets, sizeof(int32_t), op, "offsets");
  require_disjoint(dinp, size_t(S * C) * sizeof(bf16), dout, size_t(S * OC) * sizeof(bf16), op,
                   "dinp must not overlap dout");
  if (S == 0) return;
  if (choose_path(op, path) == GroupedGemmPath::sm90a)
    grouped_sm90::backward_input(dinp, dout, weights, offsets, S, E, C, OC, stream);
  else
    rows_impl<Major::mn>(op, dinp, dout, weights, offsets, S, E, C, OC, stream);
}

void grouped_matmul_backward_input_swiglu(bf16* dgate_up, bf16* h, const bf16* dout, const bf16* const* weights,
                                          const bf16* gate_up, const int32_t* offsets, int64_t S, int64_t E,
                                          int64_t H, int64_t OC, cudaStream_t stream, GroupedGemmPath path) {
  const char* op = "grouped_matmul_backward_input_swiglu";
  check_hidden(op, H);
  check_sizes(op, S, E, H, OC);
  check_row_grid(op, S, E, H, OC, H);
  require_ptr(dgate_up, 16, op, "dgate_up");
  require_ptr(h, 16, op, "h");
  require_ptr(dout, 16, op, "dout");
  require_ptr(weights, sizeof(void*), op, "weights");
  require_ptr(gate_up, 16, op, "gate_up");
  require_ptr(offsets, sizeof(int32_t), op, "offsets");
  const size_t h_bytes = size_t(S * H) * sizeof(bf16), gate_up_bytes = 2 * h_bytes;
  const size_t dout_bytes = size_t(S * OC) * sizeof(bf16);
  require_disjoint(h, h_bytes, dout, dout_bytes, op, "h must not overlap dout");
  require_disjoint(h, h_bytes, gate_up, gate_up_bytes, op, "h must not overlap gate_up");
  require_disjoint(h, h_bytes, dgate_up, gate_up_bytes, op, "h must not overlap dgate_up");
  require_disjoint(dgate_up, gate_up_bytes, dout, dout_bytes, op, "dgate_up must not overlap dout");
  require_disjoint(dgate_up, gate_up_bytes, gate_up, gate_up_bytes, op, "dgate_up must not overlap gate_up");
  if (S == 0) return;
  if (choose_path(op, path) == GroupedGemmPath::sm90a)
    grouped_sm90::backward_input_swiglu(dgate_up, h, dout, weights, gate_up, offsets, S, E, H, OC, stream);
  else
    rows_impl<Major::mn, Epilogue::swiglu_backward>(op, h, dout, weights, offsets, S, E, H, OC, stream,
                                                    {gate_up, dgate_up, nullptr});
}

void grouped_matmul_backward_weight(float* const* dweights, const bf16* dout, const bf16* inp,
                                    const int32_t* offsets, const int32_t* trained_experts, int64_t n_trained,
                                    int64_t S, int64_t E, int64_t C, int64_t OC, cudaStream_t stream,
                                    GroupedGemmPath path) {
  const char* op = "grouped_matmul_backward_weight";
  check_sizes(op, S, E, C, OC);
  require(n_trained >= 0 && n_trained <= E, op,
          "n_trained must be in [0, E] (got " + std::to_string(n_trained) + ")" + sizes(S, E, C, OC));
  const int64_t m_tiles = ceil_div(OC, kBM), n_tiles = ceil_div(C, kBN);
  require(n_trained * m_tiles * n_tiles <= INT32_MAX, op, "too many tiles for one launch" + sizes(S, E, C, OC));
  require_ptr(dweights, sizeof(void*), op, "dweights");
  require_ptr(dout, 16, op, "dout");
  require_ptr(inp, 16, op, "inp");
  require_ptr(offsets, sizeof(int32_t), op, "offsets");
  require_ptr(trained_experts, sizeof(int32_t), op, "trained_experts");
  if (S == 0 || n_trained == 0) return;
  if (choose_path(op, path) == GroupedGemmPath::sm90a) {
    grouped_sm90::backward_weight(dweights, dout, inp, offsets, trained_experts, n_trained, S, E, C, OC, stream);
    return;
  }
  using Cfg = Config<Major::mn, Major::mn>;
  allow_dynamic_smem(op, grouped_wgrad_kernel, Cfg::kSmem);
  launch(grouped_wgrad_kernel, static_cast<unsigned>(n_trained * m_tiles * n_tiles), kThreads, Cfg::kSmem, stream,
         dweights, dout, inp, offsets, trained_experts, static_cast<int>(S), static_cast<int>(E), static_cast<int>(C),
         static_cast<int>(OC), static_cast<int>(m_tiles), static_cast<int>(n_tiles));
  cuda_check_launch();
}

}  // namespace spes::cuda
