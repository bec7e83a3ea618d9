// Grouped expert GEMMs (contract: grouped_gemm.cuh), the Hopper path: warpgroup MMA
// (wgmma.mma_async m64n256k16 bf16, fp32 accumulators in registers) on operands that
// a cp.async pipeline stages in shared memory in the layout wgmma reads through its
// matrix descriptors. sm_90a only: this file is compiled for sm_90a where the build
// targets compute capability 9.0 (CMakeLists.txt), and its kernel bodies are empty in
// every other pass (SPES_SM90A_DEVICE_CODE, cuda/ptx_sm90.cuh; the host emulator,
// tests/emu/, runs them with wgmma emulated). The launchers in grouped_gemm.cu pick
// this family or the portable one (mma.sync, grouped_gemm.cu).
//
// Tiles. One CTA of two warpgroups (256 threads) computes a 128 × 256 output tile;
// warpgroup w owns rows 64w.. and all 256 columns, one m64n256 accumulator (128 fp32
// registers per thread). Each k-step of 64 is 4 wgmma k16 per warpgroup on a stage of
// shared memory holding A (128 × 64, 16 KB) and B (256 × 64, 32 KB); 4 stages (192 KB,
// one CTA per SM). Why so: wgmma's operands come from shared memory, so the tile's
// size sets the shared-memory and L2 traffic per FLOP: 128 × 256 reads 48 KB per 4.2
// MFLOP, 1.33× the FLOP per byte of 128 × 128, and an n256 wgmma is the widest, the
// fewest instructions per FLOP. 128 accumulators leave room under the 255-register cap
// for the copy addressing (__launch_bounds__(256, 1)).
//
// Shared layout: 128-byte swizzle, the one wgmma layout where a 64-element k-step row
// (128 bytes) is one swizzle row. Every line of 128 bytes holds 8 chunks of 16 bytes,
// chunk c of line l stored at chunk position c ^ (l % 8) (wgmma un-swizzles on the
// address bits: 4-6 XOR 7-9, so every 8-line atom starts 1024-byte aligned). Which
// line is which depends on the operand's major-ness (Major), so that no operand is
// ever transposed in memory:
//   K-major (inp, dout as the A of forward / backward-input; W_e as the B of forward):
//     line = one m (or n) row of the k-step, 64 k values; atoms of 8 rows stacked at
//     1024 B (the descriptor's stride offset); k16 step kk starts 32·kk bytes in (its
//     leading offset is unused for a swizzled K-major operand).
//   MN-major (W_e as the B of backward-input; doutᵀ and inp in the weight gradient):
//     line = one k of the k-step, 64 consecutive m (or n) values; the tile is MN/64
//     blocks of 64 lines (8 KB, the descriptor's leading offset between blocks), each
//     8 k-lines an atom (1024 B, its stride offset); k16 step kk starts 2 KB in.
// The wgmma's transpose bits say which (trans-a, trans-b = 1: MN-major).
//
// Pipeline. cp.async of 16 bytes, predicated with zero fill for tails as on the
// portable path (rows past an expert's end, columns past N, k past K read as 0 without
// a read), issued by all 256 threads, each into a fixed swizzle phase. k-step kt: each
// thread waits for its own copies of kt, fences them to the async proxy
// (fence.proxy.async: wgmma reads through it), and a barrier makes everyone's visible;
// then each warpgroup issues its 4 wgmma of kt as one group, refills the stage of
// kt − 2 with k-step kt + 2 and waits until only that group is running. So the tensor
// cores always have the next group queued behind the running one, and two k-steps of
// copies are in flight behind them; the barrier of step kt is what proves both
// warpgroups done with the stage of kt − 2 (their wait at the end of step kt − 1).
// The copies do not stop at a tile's end: a CTA's k-steps are one stream through the
// stages, tile after tile, and the last two steps of a tile's main loop load the
// first two k-steps of the CTA's next tile, so that they are in flight while the tile
// ends and is stored, and its main loop starts on landed data (a tile's short K,
// 768 = 12 k-steps at the gate|up forward, would otherwise pay for the fill each time).
// Two k-steps of copies in flight (about a microsecond of wgmma) may not cover a
// read that misses L2; so a CTA also asks L2 for the operands it streams from DRAM a
// few k-steps (l2_ahead) before it copies them (prefetch.global.L2, one per 128-byte
// line): the per-row activation (forward, backward-input; the weights are shared by
// every row tile and stay in L2) or both operands (weight gradient).
//
// Scheduling: a persistent grid, one CTA per SM. Forward / backward-input: each CTA
// walks tiles t = blockIdx.x, + gridDim.x, … in the portable path's order (row tiles
// expert by expert, column tiles fastest), all about the same cost; the row-tile
// starts of all experts are scanned once per CTA into shared memory (a block scan of
// the device offsets, one thread per expert) and each tile finds its expert there by
// binary search. Weight gradient: a tile costs its expert's row count, so the tiles
// are ranked by cost (experts with the most rows first) and each CTA draws its next
// tile from a counter as it is about to come free (WgradProblem). Every output
// element is written by one CTA and summed in a fixed k order: the counter only picks
// which CTA, so the bits are the same every run (no atomics in any sum).
//
// Stores. bf16 outputs go through shared memory (the two stages the next tile's first
// copies leave alone) so that each warp writes whole 512-byte row segments; the rows
// are written out from there behind the next tile's first wgmma. The SwiGLU
// epilogues (Epilogue) compute on the way out: the gate|up forward, whose column tile
// is 128 columns of gate beside the same 128 of up (B's rows paired so), writes h
// beside gate|up; the down backward-input computes SwiGLU's backward from the staged
// dh and the tile's gate and up, which it asks L2 for as the tile starts. The weight
// gradient's fp32 dW += tile reads dW, which each tile asks L2 for as it starts; at
// its end all of the tile's dW is read at once, three quarters copied into those two
// stages and the rest loaded into registers, so the read-modify-write waits for one
// round trip to L2.
#include "cuda/grouped_gemm_sm90.cuh"
#include "cuda/grouped_gemm_common.cuh"
#include "cuda/grouped_gemm_wgrad_schedule.cuh"

#include <algorithm>
#include <atomic>
#include <string>

#include "cuda/check.cuh"
#include "cuda/common.cuh"
#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "cuda/ptx_sm90.cuh"
#include "cuda/sm90a_device.cuh"
#include "cuda/swiglu_math.cuh"

namespace spes::cuda::grouped_sm90 {

// The weight gradient's tile tickets (cuda/grouped_gemm_wgrad_schedule.cuh). Declared
// in every compilation pass, not only where the kernels have bodies, since nvcc
// registers a device variable through its host-side shadow.
__device__ grouped::TileTickets g_tile_tickets[kTileTicketSlots];  // zero when the module loads

namespace {

using namespace grouped;

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr int kWarpgroup = 128, kWarpgroups = 2, kThreads = kWarpgroups * kWarpgroup;
constexpr int kWgRows = kBM / kWarpgroups;  // 64: one wgmma's m
constexpr int kWgmmaK = 16;
constexpr int kAcc = kWgRows * kBN / kWarpgroup;  // fp32 accumulators per thread: 128
static_assert(kMaxExperts <= kThreads, "the tile scan gives each expert one thread");
static_assert(kWgRows == 64 && kBN == 256 && kWgmmaK == 16 && kAcc == 128,
              "one m64n256k16 wgmma (128 accumulators per thread) per warpgroup and k16 step");

// The 128-byte swizzle's units (see the file comment).
constexpr uint32_t kLineBytes = kBK * sizeof(bf16);   // 128: one swizzle line
constexpr uint32_t kAtomBytes = 8 * kLineBytes;       // 1024: one swizzle atom
constexpr uint32_t kBlockBytes = kBK * kLineBytes;    // 8 KB: an MN-major block of 64 k-lines
constexpr uint32_t kTileABytes = kBM * kBK * sizeof(bf16);
constexpr uint32_t kTileBBytes = kBN * kBK * sizeof(bf16);
constexpr uint32_t kStageBytes = kTileABytes + kTileBBytes;
static_assert(kStages >= 3, "the pipeline keeps kStages − 2 k-steps of copies in flight");
static_assert(2 * kStageBytes >= kBM * kBN * sizeof(bf16), "the bf16 output tile is staged in two stages");
static_assert(kTileABytes % kAtomBytes == 0 && kStageBytes % kAtomBytes == 0 && kBlockBytes % kAtomBytes == 0,
              "atoms stay 1024-byte aligned");

// A column tile's width in output columns: swiglu_forward's is kBN / 2 columns of gate
// beside the same columns of up.
constexpr int column_tile_width(Epilogue epi) { return epi == Epilogue::swiglu_forward ? kBN / 2 : kBN; }

// The row-tile scan's results (forward, backward-input), at the start of dynamic
// shared memory.
struct Sched {
  int tile_end[kMaxExperts];  // inclusive prefix of the experts' row-tile counts
  int start[kMaxExperts];     // each expert's rows [start, end), clamped to [0, S]
  int end[kMaxExperts];
  int warp_total[kThreads / kWarp];
};
// The weight gradient's in its place: the trained experts ranked by rows, and the tile
// this CTA drew for after its current one.
struct WgradSched : RankedExperts {
  int drawn;
};
// The stages start at the first 1024-byte boundary after the larger of the two.
constexpr size_t kSchedBytes = sizeof(Sched) > sizeof(WgradSched) ? sizeof(Sched) : sizeof(WgradSched);
constexpr size_t kSmemBytes = kSchedBytes + kAtomBytes + size_t(kStages) * kStageBytes;

#if SPES_SM90A_DEVICE_CODE

// ---- global → shared -----------------------------------------------------------------

// One thread's share of copying an operand tile (MN × kBK of a k-step) into its swizzled
// shared layout. The tile is cut into lines of 8 chunks (K-major: an m/n row; MN-major:
// a k row of MN/8 chunks); thread `tid` copies chunk `tid % chunks-per-line` of lines
// line0, line0 + kLinesPerPass, …, whose swizzle phase (line % 8) is the same for every
// pass, so its shared offsets are one base plus a multiple of kPassBytes.
// Element (i, k), i < MN, is at src[i·ld + k] (K-major) or src[k·ld + i] (MN-major);
// i ≥ mn_valid and k ≥ K are zero-filled without a read (the address given for them is
// `base`, which the caller keeps inside its buffer). PAIRED (K-major): the tile's two
// halves are two windows of the operand, lines [0, MN/2) from `tile` and [MN/2, MN)
// from `second` (its line 0 being line MN/2), each with mn_valid lines inside; the
// gate|up forward with SwiGLU puts gate rows beside the up rows of the same columns so.
template <Major MAJ, int MN, bool PAIRED = false>
struct TileCopy {
  static_assert(!PAIRED || MAJ == Major::k, "paired halves are windows of a K-major operand's rows");
  static constexpr int kLineChunks = MAJ == Major::k ? kBK / 8 : MN / 8;
  static constexpr int kLinesPerPass = kThreads / kLineChunks;
  static constexpr int kPasses = (MAJ == Major::k ? MN : kBK) / kLinesPerPass;
  static constexpr uint32_t kPassBytes = kLinesPerPass * kLineBytes;
  static constexpr int kHalfLines = MN / 2;
  static_assert(kThreads % kLineChunks == 0 && kLinesPerPass % 8 == 0, "a thread keeps one swizzle phase");
  static_assert(!PAIRED || kHalfLines % kLinesPerPass == 0, "a pass lies in one half");

  const bf16* base;  // element (0, 0) of the tile
  const bf16* src;   // this thread's first chunk at k-step 0
  int64_t ld;
  int64_t second_jump;   // PAIRED: elements from where line MN/2 would be after line 0 to where it is
  uint32_t smem_offset;  // this thread's first chunk in the tile, bytes
  int line0, col;        // its first line and its column (K-major: k; MN-major: m or n)
  int mn_valid, K;

  __device__ __forceinline__ TileCopy(const bf16* tile, int64_t ld_, int mn_valid_, int K_,
                                      const bf16* second = nullptr)
      : base(tile), ld(ld_), second_jump(PAIRED ? second - (tile + kHalfLines * ld_) : 0), mn_valid(mn_valid_),
        K(K_) {
    const int tid = static_cast<int>(threadIdx.x), chunk = tid % kLineChunks;
    line0 = tid / kLineChunks;
    col = chunk * 8;
    src = tile + int64_t(line0) * ld + col;
    const uint32_t swizzled = ((chunk & 7) ^ (line0 & 7)) << 4;
    smem_offset = (MAJ == Major::k ? 0u : uint32_t(chunk / 8) * kBlockBytes) + uint32_t(line0) * kLineBytes + swizzled;
  }

  // Whether this thread's chunk of `line` at k-step offset k0 lies inside the operand.
  __device__ __forceinline__ bool inside(int line, int k0) const {
    if constexpr (PAIRED) line %= kHalfLines;
    return MAJ == Major::k ? (line < mn_valid && k0 + col < K) : (k0 + line < K && col < mn_valid);
  }

  // Issues this thread's copies of k-step kt into the tile at shared address `tile`.
  __device__ __forceinline__ void issue(uint32_t tile, int kt) const {
    const int k0 = kt * kBK;
    const int64_t pass_step = int64_t(kLinesPerPass) * ld;
    const bf16* p = MAJ == Major::k ? src + k0 : src + int64_t(k0) * ld;
#pragma unroll
    for (int i = 0; i < kPasses; ++i, p += pass_step) {
      if (PAIRED && i * kLinesPerPass == kHalfLines) p += second_jump;
      const bool ok = inside(line0 + i * kLinesPerPass, k0);
      cp_async_16(tile + smem_offset + i * kPassBytes, ok ? p : base, ok);
    }
  }

  // The tile's k-step in global memory, in 128-byte lines of 64 elements: K-major, one
  // per m (or n) row (its 64 k values); MN-major, MN / 64 per k.
  static constexpr int kGlobalLines = MAJ == Major::k ? MN : kBK * (MN / 64);

  // Asks L2 for line threadIdx.x of k-step kt of the tile, where it starts inside the
  // operand (one request per line, no wait; a K-major line at the end of K may reach
  // past it, into the next row: asked for, never copied). Not for a paired tile: its
  // second half's lines are elsewhere (no streamed operand is paired).
  __device__ __forceinline__ void prefetch(int kt) const {
    static_assert(!PAIRED, "prefetch knows one window of lines");
    const int l = static_cast<int>(threadIdx.x), k0 = kt * kBK;
    if (l >= kGlobalLines) return;
    if constexpr (MAJ == Major::k) {
      if (l < mn_valid && k0 < K) prefetch_l2(base + int64_t(l) * ld + k0);
    } else {
      const int k = k0 + l / (MN / 64), i = 64 * (l % (MN / 64));
      if (k < K && i < mn_valid) prefetch_l2(base + int64_t(k) * ld + i);
    }
  }
};

// The descriptor of k16 step kk of an operand tile at shared address `tile` (see the
// file comment for the two layouts).
template <Major MAJ>
__device__ __forceinline__ uint64_t operand_descriptor(uint32_t tile, int kk) {
  if constexpr (MAJ == Major::k)
    return sw128_descriptor(tile + kk * kWgmmaK * uint32_t(sizeof(bf16)), 16, kAtomBytes);
  else
    return sw128_descriptor(tile + kk * kWgmmaK * kLineBytes, kBlockBytes, kAtomBytes);
}

// ---- the main loop ---------------------------------------------------------------------

// Both operands of one output tile: A (kBM × K) and B (kBN × K) with their copy plans.
template <Major A_MAJ, Major B_MAJ, bool B_PAIRED = false>
struct Operands {
  static constexpr Major kAMajor = A_MAJ, kBMajor = B_MAJ;
  TileCopy<A_MAJ, kBM> a;
  TileCopy<B_MAJ, kBN, B_PAIRED> b;
  int ktiles;
};

// A CTA's k-steps, tile after tile, are one stream: position n (counted from its first
// tile's k-step 0) is staged in stage n % kStages, whose shared address this is.
__device__ __forceinline__ uint32_t stage_of(uint32_t stages, int n) {
  return stages + (uint32_t(n) % kStages) * kStageBytes;
}

// Issues k-step kt of op into the stage at shared address `stage`.
template <class Op>
__device__ __forceinline__ void load_stage(const Op& op, uint32_t stage, int kt) {
  op.a.issue(stage, kt);
  op.b.issue(stage + kTileABytes, kt);
}

// Asks L2 for k-step kt of op (if it has one) of the operands the problem streams: A
// always, B where Problem::kStreamsB.
template <class Problem, class Op>
__device__ __forceinline__ void prefetch_kstep(const Op& op, int kt) {
  static_assert(decltype(op.a)::kGlobalLines <= kThreads && decltype(op.b)::kGlobalLines <= kThreads,
                "one line of each operand per thread");
  if (kt >= op.ktiles) return;
  op.a.prefetch(kt);
  if constexpr (Problem::kStreamsB) op.b.prefetch(kt);
}

// A new tile's L2 requests: the k-steps that follow its first kStages − 2 (copied at
// once) up to the first its main loop asks for (see mainloop).
template <class Problem, class Op>
__device__ __forceinline__ void prefetch_start(const Problem& problem, const Op& op) {
  for (int kt = kStages - 2; kt < kStages - 2 + problem.l2_ahead; ++kt) prefetch_kstep<Problem>(op, kt);
}

// The first kStages − 2 k-steps of op in flight at stream positions n0, n0 + 1, …,
// one commit group each (empty past K, so that the group count, and with it the main
// loop's wait, is the same every step).
template <class Op>
__device__ __forceinline__ void prologue(const Op& op, uint32_t stages, int n0) {
#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) {
    if (s < op.ktiles) load_stage(op, stage_of(stages, n0 + s), s);
    cp_async_commit();
  }
}

// The store's scratch: the stages of two stream positions, kStageBytes each and not
// always adjacent, as one area of 2 · kStageBytes (an access never straddles them).
struct Staging {
  uint32_t first, second;  // shared addresses
  unsigned char* smem;     // the dynamic shared memory, at shared address smem_base
  uint32_t smem_base;

  __device__ __forceinline__ uint32_t address(uint32_t offset) const {
    return offset < kStageBytes ? first + offset : second + (offset - kStageBytes);
  }
  template <class T>
  __device__ __forceinline__ T* pointer(uint32_t offset) const {
    return reinterpret_cast<T*>(smem + (address(offset) - smem_base));
  }
};

// A bf16 store left half done (see run_tiles): its tile, and the scratch its rows wait
// in, which the next main loop's first refill overwrites.
template <class Job>
struct UnfinishedStore {
  bool pending;
  Job job;
  Staging staging;
};

// acc = A·B over the tile's K (the first k16 step overwrites acc), its k-step kt at
// stream position n + kt, after its first kStages − 2 k-steps were put in flight.
// Warpgroup w multiplies rows 64w.. of A (its 8 KB slice of the A tile in either layout)
// by all of B. Each step refills the stage that k-step kt − 2 left (free since the
// barrier) with the stream position kStages − 2 ahead: a k-step of this tile, or, in
// the last kStages − 2 steps, of the next one, so that its copies are in flight while
// this tile ends and is stored. For that the main loop moves the cursor on (at the
// first of those steps, if the cursor can tell the next tile there), sets `next` and
// `op` to the next tile and returns true; it returns false if it left that to the
// caller (a tile of one k-step, or a cursor that could not tell). On return every
// wgmma has completed. The cursor (the CTA's walk over its tiles, see run_tiles) is
// told of each k-step once its wgmma and copies are issued (a thread that waits there
// on memory keeps the tensor cores waiting only if it outlasts the queued group), and
// after its wait; and of the loop's end. A store the last tile left unfinished is
// finished in the first step, behind its wgmma and before its refill writes the
// store's scratch.
template <class Problem, class Op>
__device__ __forceinline__ bool mainloop(float (&acc)[kAcc], const Problem& problem, typename Problem::Cursor& cursor,
                                         Op& op, typename Problem::Job& next, uint32_t stages, int n,
                                         UnfinishedStore<typename Problem::Job>& unfinished) {
  constexpr int kTransA = Op::kAMajor == Major::mn, kTransB = Op::kBMajor == Major::mn;
  const uint32_t wg_a = uint32_t(threadIdx.x / kWarpgroup) * (kWgRows * kLineBytes);
  static_assert(kWgRows * kLineBytes == kBlockBytes, "a warpgroup's A slice is 8 KB in both layouts");
  const int ktiles = op.ktiles;
  bool moved_on = false;
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<kStages - 3>();  // this thread's copies of k-step kt have landed
    fence_proxy_async_shared();    // … and are ordered before the tensor cores' reads
    __syncthreads();               // everyone's have; both warpgroups are done with kt − 2
    const uint32_t stage = stage_of(stages, n + kt);
    fence_accumulators(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / kWgmmaK; ++kk)
      wgmma_m64n256k16_bf16<kTransA, kTransB>(acc, operand_descriptor<Op::kAMajor>(stage + wg_a, kk),
                                               operand_descriptor<Op::kBMajor>(stage + kTileABytes, kk),
                                               kt > 0 || kk > 0);
    wgmma_commit();
    if constexpr (Problem::kFinishLater) {
      if (kt == 0 && unfinished.pending) {
        problem.finish_store(unfinished.job, unfinished.staging);
        unfinished.pending = false;
        __syncthreads();  // every warp is done with the scratch, which the refill below may write
      }
    }
    const int fill = kt + kStages - 2;  // the k-step loaded now, counted from this tile's first
    if (fill == ktiles && cursor.next_known(ktiles)) {
      cursor.advance();
      next = problem.find(cursor.tile);
      moved_on = true;
      if (next.valid) {
        op = problem.operands(next);  // this tile's copies are all issued
        problem.prefetch(next);
        prefetch_start(problem, op);
      }
    }
    if (fill < ktiles) {
      load_stage(op, stage_of(stages, n + fill), fill);
      if (problem.l2_ahead > 0) prefetch_kstep<Problem>(op, fill + problem.l2_ahead);  // copied l2_ahead steps on
    } else if (moved_on && next.valid && fill - ktiles < op.ktiles) {
      load_stage(op, stage_of(stages, n + fill), fill - ktiles);
    }
    cp_async_commit();
    cursor.at_kstep(kt, ktiles);
    wgmma_wait<1>();  // k-step kt − 1's group is done: only kt's may still run
    fence_accumulators(acc);
    cursor.after_kstep(kt, ktiles);
  }
  wgmma_wait<0>();
  fence_accumulators(acc);
  cursor.after_mainloop(ktiles);
  return moved_on;
}

// Walks this CTA's tiles (Problem: Cursor, cursor, find, operands, prefetch,
// begin_store, store, kFinishLater, finish_store; see the two below). The cursor holds
// the tile index: the CTA's first, then its next, which the main loop moves to (see
// mainloop) or else run_tiles after the barrier behind it (a tile past the last ends
// the walk). `smem` is the dynamic shared memory, `stages` the shared address of the
// first stage. The store may use as scratch the two stages that the next tile's first
// kStages − 2 k-steps leave alone (Staging, from begin_store on): its main loop
// refills them only after its first barrier, which every thread reaches after its
// store. begin_store may issue one cp.async group, before the next tile's first
// copies where run_tiles issues them (store is told so: their kStages − 2 groups came
// after it), after them where the main loop did. Where Problem::kFinishLater, the
// store leaves its tile in the scratch, done with the accumulators, and finish_store
// writes it out: in the next main loop's first step (its wgmma already running on
// the accumulators), or at once after the last tile.
template <class Problem>
__device__ __forceinline__ void run_tiles(const Problem& problem, unsigned char* smem, uint32_t stages) {
  float acc[kAcc] = {};  // every tile's first wgmma overwrites it; zeroed once so it is never read undefined
  auto cursor = problem.cursor();
  auto job = problem.find(cursor.tile);
  if (!job.valid) return;  // uniform: every thread computed the same job
  auto op = problem.operands(job);
  int n = 0;  // the stream position of the tile's k-step 0
  prologue(op, stages, n);
  problem.prefetch(job);
  prefetch_start(problem, op);
  UnfinishedStore<typename Problem::Job> unfinished{false, job, {}};
  while (true) {
    const int ktiles = op.ktiles;
    auto next = job;
    const bool moved_on = mainloop(acc, problem, cursor, op, next, stages, n, unfinished);
    __syncthreads();  // both warpgroups' wgmma are done with every stage: the next tile may refill them
    const int after = n + ktiles + kStages - 2;  // the first position the next tile's start leaves alone
    const Staging staging{stage_of(stages, after), stage_of(stages, after + 1), smem, smem_addr(smem)};
    problem.begin_store(job, staging);
    if (!moved_on) {
      cursor.advance();
      next = problem.find(cursor.tile);
      if (next.valid) {
        op = problem.operands(next);
        prologue(op, stages, n + ktiles);  // in flight while this tile is stored
        problem.prefetch(next);
        prefetch_start(problem, op);
      }
    }
    problem.store(job, acc, staging, !moved_on && next.valid);
    if constexpr (Problem::kFinishLater) {
      if (next.valid)
        unfinished = {true, job, staging};
      else
        problem.finish_store(job, staging);
    }
    if (!next.valid) break;
    job = next;
    n += ktiles;
  }
}

// Shared address of the first stage: the first 1024-byte boundary after the schedule.
__device__ __forceinline__ uint32_t stages_address(unsigned char* smem) {
  return (smem_addr(smem + kSchedBytes) + kAtomBytes - 1) & ~(kAtomBytes - 1);
}

// Thread (row, column) of accumulator pair acc[4j + 2h], acc[4j + 2h + 1]: row
// 64·warpgroup + 16·warp + lane / 4 + 8h, columns 8j + 2·(lane % 4) and the next
// (cuda/ptx_sm90.cuh, wgmma's D fragment).
__device__ __forceinline__ int fragment_row() {
  const int tid = static_cast<int>(threadIdx.x);
  return (tid / kWarpgroup) * kWgRows + ((tid % kWarpgroup) / kWarp) * 16 + (tid % kWarp) / 4;
}
__device__ __forceinline__ int fragment_col() { return 2 * (static_cast<int>(threadIdx.x) % 4); }

// A CTA's walk over tiles blockIdx.x, + gridDim.x, … (forward and backward-input, whose
// tiles cost about the same).
struct StridedCursor {
  int tile = static_cast<int>(blockIdx.x);
  __device__ __forceinline__ bool next_known(int) const { return true; }
  __device__ __forceinline__ void at_kstep(int, int) {}
  __device__ __forceinline__ void after_kstep(int, int) {}
  __device__ __forceinline__ void after_mainloop(int) {}
  __device__ __forceinline__ void advance() { tile += static_cast<int>(gridDim.x); }
};

// ---- forward and backward-input ----------------------------------------------------------

// Fills Sched: per expert its clamped rows and the inclusive prefix of row-tile counts
// (ceil(rows / kBM)), by a block scan, one thread per expert. Returns the row-tile total.
__device__ __forceinline__ int scan_row_tiles(Sched& s, const int32_t* offsets, int E, int S) {
  const int tid = static_cast<int>(threadIdx.x), lane = tid % kWarp, warp = tid / kWarp;
  int tiles = 0;
  if (tid < E) {
    const int start = clamp_int(offsets[tid], 0, S), end = clamp_int(offsets[tid + 1], start, S);
    s.start[tid] = start;
    s.end[tid] = end;
    tiles = (end - start + kBM - 1) / kBM;
  }
  int incl = tiles;  // inclusive prefix within the warp
#pragma unroll
  for (int o = 1; o < kWarp; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == kWarp - 1) s.warp_total[warp] = incl;
  __syncthreads();
  int total = 0;
#pragma unroll
  for (int w = 0; w < kThreads / kWarp; ++w) {
    if (w < warp) incl += s.warp_total[w];
    total += s.warp_total[w];
  }
  if (tid < E) s.tile_end[tid] = incl;
  __syncthreads();
  return total;
}

// Forward (B_MAJ = k) and backward-input (B_MAJ = mn): out[s, 0:N] = a[s, 0:K] · B_e for
// the rows s of each expert; forward N = OC, K = C, W_e is [N][K]; backward-input
// N = C, K = OC, W_e is [K][N]. Tile t is row tile t / n_col_tiles, column tile
// t % n_col_tiles. EPI says what the store writes (Epilogue).
template <Major B_MAJ, Epilogue EPI>
struct RowsProblem {
  static_assert(EPI != Epilogue::swiglu_forward || B_MAJ == Major::k, "SwiGLU's forward follows the forward");
  static_assert(EPI != Epilogue::swiglu_backward || B_MAJ == Major::mn,
                "SwiGLU's backward follows the backward-input product");
  static constexpr bool kPaired = EPI == Epilogue::swiglu_forward;
  static constexpr int kColTile = column_tile_width(EPI);
  bf16* out;
  const bf16* a;
  const bf16* const* weights;
  const Sched* sched;
  int E, N, K, n_col_tiles, n_tiles;
  int l2_ahead;  // k-steps ahead of its copy each streamed line is asked of L2 (0: none)
  SwigluOperands swiglu;
  // A, the rows' activation, is streamed from DRAM; B, the expert's weights, is read
  // by every row tile of the expert and stays in L2.
  static constexpr bool kStreamsB = false;

  struct Job {
    bool valid;
    int expert, row0, rows, n0;
  };

  using Cursor = StridedCursor;
  __device__ __forceinline__ Cursor cursor() const { return {}; }

  __device__ __forceinline__ Job find(int t) const {
    if (t >= n_tiles) return {false, 0, 0, 0, 0};
    const int rt = t / n_col_tiles;
    int lo = 0, hi = E - 1;  // the first expert whose tiles end past rt (empty ones end where the last did)
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (sched->tile_end[mid] > rt)
        hi = mid;
      else
        lo = mid + 1;
    }
    const int first_tile = lo > 0 ? sched->tile_end[lo - 1] : 0;
    const int row0 = sched->start[lo] + (rt - first_tile) * kBM;
    return {true, lo, row0, min(kBM, sched->end[lo] - row0), (t % n_col_tiles) * kColTile};
  }

  // Paired (swiglu_forward): B's lines [0, kBN/2) are W_e's gate rows n0.., the rest its
  // up rows N + n0.. (W_e is [2N][K]).
  __device__ __forceinline__ Operands<Major::k, B_MAJ, kPaired> operands(const Job& j) const {
    const bf16* w = weights[j.expert];
    const bf16* b = B_MAJ == Major::k ? w + int64_t(j.n0) * K : w + j.n0;
    const bf16* up = kPaired ? w + (int64_t(N) + j.n0) * K : nullptr;
    return {TileCopy<Major::k, kBM>(a + int64_t(j.row0) * K, K, j.rows, K),
            TileCopy<B_MAJ, kBN, kPaired>(b, B_MAJ == Major::k ? K : N, N - j.n0, K, up), (K + kBK - 1) / kBK};
  }

  // The SwiGLU store reads the tile's gate and up: asked of L2 as the tile starts, they
  // are there when the store comes, a main loop later. 128 rows of gate and of up, 4
  // lines of 128 bytes each: thread tid takes row tid / 2 of gate (tid even) or up.
  __device__ __forceinline__ void prefetch(const Job& j) const {
    if constexpr (EPI == Epilogue::swiglu_backward) {
      const int tid = static_cast<int>(threadIdx.x), r = tid / 2;
      if (r >= j.rows) return;
      const bf16* row = swiglu.gate_up + (int64_t(j.row0) + r) * 2 * N + (tid % 2) * N + j.n0;
      constexpr int kLineElems = 128 / sizeof(bf16);
#pragma unroll
      for (int l = 0; l < kBN / kLineElems; ++l)
        if (j.n0 + l * kLineElems < N) prefetch_l2(row + l * kLineElems);
    }
  }
  __device__ __forceinline__ void begin_store(const Job&, const Staging&) const {}

  // bf16 out through shared memory, so that each warp writes whole 512-byte row
  // segments with 16-byte stores (written straight from the accumulator fragment, a
  // warp's store would cover 8 rows × 16 bytes). The [128][256] bf16 tile is staged
  // with its 16-byte chunks XOR-swizzled by row % 8: the fragment's 8 rows of one
  // column chunk then fall in 8 different bank groups, and the read back of one row's
  // 32 chunks is conflict-free too. store stages the tile and ends with a barrier
  // (everyone's rows staged); finish_store, later (kFinishLater, see run_tiles), writes
  // the rows out. Rows past the expert's end and columns past N are not written
  // (N % 8 == 0: a chunk is wholly inside or outside).
  static constexpr bool kFinishLater = true;
  static constexpr int kRowChunks = kBN / 8;
  static constexpr uint32_t kRowBytes = kRowChunks * 16;
  static_assert(kStageBytes % kRowBytes == 0, "a staged row lies in one stage");

  __device__ __forceinline__ void store(const Job&, const float (&acc)[kAcc], const Staging& staging, bool) const {
    const int r0 = fragment_row(), c0 = fragment_col();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h;
      __nv_bfloat162* row = staging.pointer<__nv_bfloat162>(uint32_t(r) * kRowBytes);
#pragma unroll
      for (int jn = 0; jn < kRowChunks; ++jn)
        row[(jn ^ (r & 7)) * 4 + c0 / 2] = __floats2bfloat162_rn(acc[4 * jn + 2 * h], acc[4 * jn + 2 * h + 1]);
    }
    __syncthreads();
  }

  __device__ __forceinline__ void finish_store(const Job& j, const Staging& staging) const {
    if constexpr (EPI == Epilogue::swiglu_forward) {
      finish_swiglu_forward_store(j, staging);
      return;
    } else if constexpr (EPI == Epilogue::swiglu_backward) {
      finish_swiglu_backward_store(j, staging);
      return;
    }
    const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
    const bool col_ok = j.n0 + lane * 8 < N;
#pragma unroll 4
    for (int r = warp; r < kBM; r += kThreads / kWarp) {
      const int4 v = staging.pointer<const int4>(uint32_t(r) * kRowBytes)[lane ^ (r & 7)];
      if (r < j.rows && col_ok) *reinterpret_cast<int4*>(out + int64_t(j.row0 + r) * N + j.n0 + lane * 8) = v;
    }
  }

  // The gate|up product with SwiGLU: the staged tile's chunks 0..15 of a row are its
  // gate columns n0.., 16..31 the same columns of up; lanes 0-15 write gate and h, the
  // others up (h from the staged, bf16, gate and up, as swiglu_forward reads them).
  static constexpr int kWarps = kThreads / kWarp;
  __device__ __forceinline__ void finish_swiglu_forward_store(const Job& j, const Staging& staging) const {
    const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
    const int half = lane / (kRowChunks / 2), c = j.n0 + 8 * (lane % (kRowChunks / 2));
    if (c >= N) return;
#pragma unroll 4
    for (int r = warp; r < kBM; r += kWarps) {
      if (r >= j.rows) break;
      const int4* staged = staging.pointer<const int4>(uint32_t(r) * kRowBytes);
      const int4 v = staged[lane ^ (r & 7)];
      *reinterpret_cast<int4*>(out + (int64_t(j.row0) + r) * 2 * N + half * N + c) = v;
      if (half == 0)
        *reinterpret_cast<int4*>(swiglu.h + (int64_t(j.row0) + r) * N + c) =
            swiglu_value8(v, staged[(lane + kRowChunks / 2) ^ (r & 7)]);
    }
  }

  // SwiGLU's backward on the staged dh (bf16, as a stored dh would be), row by row as
  // finish_store writes them: each lane's 8 columns of gate and up loaded 16 bytes at
  // a time, kSwigluRows rows' worth in flight before the first is used (the compiler
  // cannot move them past the stores: it cannot tell gate_up from dgate_up), then dgate,
  // dup and h written 16 bytes at a time.
  static constexpr int kSwigluRows = 4;
  static_assert(kBM % (kSwigluRows * kWarps) == 0, "whole batches of rows per warp");

  __device__ __forceinline__ void finish_swiglu_backward_store(const Job& j, const Staging& staging) const {
    const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
    const int c = j.n0 + lane * 8;
    const bool col_ok = c < N;
    for (int r0 = warp; r0 < kBM; r0 += kSwigluRows * kWarps) {
      int4 g[kSwigluRows] = {}, u[kSwigluRows] = {};
#pragma unroll
      for (int b = 0; b < kSwigluRows; ++b) {
        const int r = r0 + b * kWarps;
        if (r < j.rows && col_ok) {
          const bf16* gu = swiglu.gate_up + (int64_t(j.row0) + r) * 2 * N + c;
          g[b] = *reinterpret_cast<const int4*>(gu);
          u[b] = *reinterpret_cast<const int4*>(gu + N);
        }
      }
#pragma unroll
      for (int b = 0; b < kSwigluRows; ++b) {
        const int r = r0 + b * kWarps;
        if (r >= j.rows || !col_ok) continue;
        const int4 dh = staging.pointer<const int4>(uint32_t(r) * kRowBytes)[lane ^ (r & 7)];
        const SwigluGrad8 x = swiglu_grad8(dh, g[b], u[b]);
        bf16* dgu = swiglu.dgate_up + (int64_t(j.row0) + r) * 2 * N + c;
        *reinterpret_cast<int4*>(dgu) = x.dgate;
        *reinterpret_cast<int4*>(dgu + N) = x.dup;
        *reinterpret_cast<int4*>(out + (int64_t(j.row0) + r) * N + c) = x.h;
      }
    }
  }
};

#endif  // SPES_SM90A_DEVICE_CODE

template <Major B_MAJ, Epilogue EPI>
__global__ void __launch_bounds__(kThreads, 1)
    rows_kernel(bf16* __restrict__ out, const bf16* __restrict__ a, const bf16* const* __restrict__ weights,
                const int32_t* __restrict__ offsets, int S, int E, int N, int K, int n_col_tiles, int l2_ahead,
                SwigluOperands swiglu) {
#if SPES_SM90A_DEVICE_CODE
  unsigned char* smem = dynamic_smem<unsigned char>;
  Sched& sched = *reinterpret_cast<Sched*>(smem);
  const int row_tiles = scan_row_tiles(sched, offsets, E, S);
  const RowsProblem<B_MAJ, EPI> problem{out, a, weights, &sched, E, N, K, n_col_tiles, row_tiles * n_col_tiles,
                                        l2_ahead, swiglu};
  run_tiles(problem, smem, stages_address(smem));
#endif
}

#if SPES_SM90A_DEVICE_CODE

// How many k-steps before the end of its main loop a CTA draws its next tile: late,
// so that the CTAs about to be free draw first, and early enough that the counter's
// answer (one round trip to L2) is back a k-step later, where it is handed to the
// other threads, before the main loop's last kStages − 2 steps load the next tile.
constexpr int kDrawLead = kStages;

// Weight gradient: dweights[e][m, n] += Σ_s dout[s, m]·inp[s, n] over the rows s of
// expert e = trained[i], M = OC, N = C, K = the expert's row count; A = doutᵀ and
// B = inp, both MN-major. The tiles are numbered most costly first (the ranked experts,
// each one's m_tiles × n_tiles tiles in (OC tile, C tile) order) and drawn from the
// launch's ticket counter a few k-steps before a CTA's current main loop ends
// (cuda/grouped_gemm_wgrad_schedule.cuh). Trained experts without rows get no tile
// (their dW is not even read).
struct WgradProblem {
  float* const* dweights;
  const bf16* dout;
  const bf16* inp;
  WgradSched* sched;
  TileTickets* tickets;
  int C, OC, n_tiles, per_expert, n_work;
  int l2_ahead;  // as RowsProblem's
  static constexpr bool kStreamsB = true;  // both operands are per-row activations

  struct Job {
    bool valid;
    int expert, start, rows, m0, n0;
  };

  // The CTA's walk: tile blockIdx.x, then the drawn ones. Thread 0 draws (the
  // tickets past the first gridDim.x tiles are numbered from 0) kDrawLead k-steps
  // before the end of the main loop (at its first step in a shorter one) and hands the
  // tile to the others through shared memory, written at the end of the step
  // kStages − 1 before the last and read after the barrier of the next (the main loop
  // moves on there, see mainloop); in a main loop shorter than that, written at its
  // end and read after the barrier behind it. The next write comes in the next main
  // loop, after its first barrier, which every thread reaches after its read.
  struct Cursor {
    static constexpr int kHandover = kStages - 1;  // k-steps before the end
    int tile;
    int drawn_here;  // thread 0: the tile it drew, from its draw to its handover
    TileTickets* tickets;
    int* drawn;
    __device__ __forceinline__ bool next_known(int ktiles) const { return ktiles >= kHandover; }
    __device__ __forceinline__ void at_kstep(int kt, int ktiles) {
      if (threadIdx.x == 0 && kt == (ktiles > kDrawLead ? ktiles - kDrawLead : 0))
        drawn_here = static_cast<int>(gridDim.x) + atomicAdd(&tickets->next, 1);
    }
    __device__ __forceinline__ void after_kstep(int kt, int ktiles) {
      if (threadIdx.x == 0 && next_known(ktiles) && kt == ktiles - kHandover) *drawn = drawn_here;
    }
    __device__ __forceinline__ void after_mainloop(int ktiles) {
      if (threadIdx.x == 0 && !next_known(ktiles)) *drawn = drawn_here;
    }
    __device__ __forceinline__ void advance() { tile = *drawn; }
  };

  __device__ __forceinline__ Cursor cursor() const {
    return {static_cast<int>(blockIdx.x), 0, tickets, &sched->drawn};
  }

  __device__ __forceinline__ Job find(int t) const {
    if (t >= n_work) return {false, 0, 0, 0, 0, 0};
    const int r = t / per_expert, rem = t % per_expert;
    return {true, sched->expert[r], sched->start[r], sched->rows[r], (rem / n_tiles) * kBM, (rem % n_tiles) * kBN};
  }

  __device__ __forceinline__ Operands<Major::mn, Major::mn> operands(const Job& j) const {
    return {TileCopy<Major::mn, kBM>(dout + int64_t(j.start) * OC + j.m0, OC, OC - j.m0, j.rows),
            TileCopy<Major::mn, kBN>(inp + int64_t(j.start) * C + j.n0, C, C - j.n0, j.rows),
            (j.rows + kBK - 1) / kBK};
  }

  // The store reads the tile's dW: asked of L2 as the tile starts, it is there (not
  // in DRAM) when the store comes, a whole main loop later. 128 rows of up to 8
  // lines of 128 bytes: thread tid takes row tid / 2, lines 4·(tid % 2)...
  __device__ __forceinline__ void prefetch(const Job& j) const {
    const int tid = static_cast<int>(threadIdx.x), r = tid / 2;
    if (j.m0 + r >= OC) return;
    const float* row = dweights[j.expert] + int64_t(j.m0 + r) * C + j.n0;
    constexpr int kLineFloats = 128 / sizeof(float);
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const int c = ((tid % 2) * 4 + l) * kLineFloats;
      if (j.n0 + c < C) prefetch_l2(row + c);
    }
  }

  // The store adds this thread's accumulator pairs q < kPairs (acc[2q], acc[2q + 1]:
  // row fragment_row() + 8·(q % 2), columns 8·(q / 2) + fragment_col() and the next)
  // to dW, reading the tile's dW in one round trip, all of it in flight at once: the
  // first kStagedPairs are copied into this thread's slots of the staging area as the
  // main loop ends (begin_store; slot q at (q·kThreads + tid)·8 bytes, so a warp's
  // slots are 256 consecutive bytes), the rest loaded into registers by store, which
  // then waits for both. (Loaded into registers alone, they would not all fit beside
  // the accumulators; and a load written after a dW store waits for it, the compiler
  // being unable to tell the addresses apart.)
  static constexpr bool kFinishLater = false;  // the store needs the accumulators to its end

  static constexpr int kPairs = kAcc / 2;
  static constexpr int kStagedPairs = 2 * kStageBytes / (kThreads * sizeof(float2));
  static constexpr int kLoadedPairs = kPairs - kStagedPairs;
  static_assert(kStagedPairs > 0 && kStagedPairs % 2 == 0 && kLoadedPairs >= 0, "pairs of both rows staged together");
  static_assert(kStageBytes % (kThreads * sizeof(float2)) == 0, "a slot lies in one stage");

  // The tile's dW, element (0, 0).
  __device__ __forceinline__ float* dw_tile(const Job& j) const {
    return dweights[j.expert] + int64_t(j.m0) * C + j.n0;
  }

  // Pair q of this thread: its dW element pair in the tile at `tile`, and whether it
  // lies inside dW (rows past OC and columns past C do not: C % 8 == 0, so a pair lies
  // wholly inside or outside). Every pair does in a tile that lies wholly inside dW,
  // which the two functions below take apart (kWhole) so that theirs test nothing.
  __device__ __forceinline__ float* pair_address(float* tile, int q) const {
    return tile + int64_t(fragment_row() + 8 * (q % 2)) * C + 8 * (q / 2) + fragment_col();
  }
  template <bool kWhole>
  __device__ __forceinline__ bool pair_inside(const Job& j, int q) const {
    return kWhole || (j.m0 + fragment_row() + 8 * (q % 2) < OC && j.n0 + 8 * (q / 2) + fragment_col() < C);
  }
  __device__ __forceinline__ bool whole(const Job& j) const { return j.m0 + kBM <= OC && j.n0 + kBN <= C; }

  template <bool kWhole>
  __device__ __forceinline__ void copy_staged_pairs(const Job& j, const Staging& staging) const {
    float* tile = dw_tile(j);
#pragma unroll
    for (int q = 0; q < kStagedPairs; ++q)
      if (pair_inside<kWhole>(j, q)) cp_async_8(staging.address(slot_offset(q)), pair_address(tile, q), true);
  }

  // Slot q of this thread in the staging area (its byte offset there).
  __device__ __forceinline__ static uint32_t slot_offset(int q) {
    return (uint32_t(q) * kThreads + threadIdx.x) * uint32_t(sizeof(float2));
  }

  // One cp.async group: dW of pairs q < kStagedPairs into this thread's slots of the
  // staging area.
  __device__ __forceinline__ void begin_store(const Job& j, const Staging& staging) const {
    if (whole(j))
      copy_staged_pairs<true>(j, staging);
    else
      copy_staged_pairs<false>(j, staging);
    cp_async_commit();
  }

  template <bool kWhole>
  __device__ __forceinline__ void add_pairs(const Job& j, const float (&acc)[kAcc], const Staging& staging,
                                            bool prologue_after) const {
    float* tile = dw_tile(j);
    float2 loaded[kLoadedPairs > 0 ? kLoadedPairs : 1];
#pragma unroll
    for (int b = 0; b < kLoadedPairs; ++b)
      if (pair_inside<kWhole>(j, kStagedPairs + b))
        loaded[b] = *reinterpret_cast<const float2*>(pair_address(tile, kStagedPairs + b));
    if (prologue_after)
      cp_async_wait<kStages - 2>();
    else
      cp_async_wait<0>();
#pragma unroll
    for (int q = 0; q < kPairs; ++q) {
      if (!pair_inside<kWhole>(j, q)) continue;
      float2 v = q < kStagedPairs ? *staging.pointer<const float2>(slot_offset(q)) : loaded[q - kStagedPairs];
      v.x += acc[2 * q];
      v.y += acc[2 * q + 1];
      *reinterpret_cast<float2*>(pair_address(tile, q)) = v;
    }
  }

  // dW += acc (see above); `prologue_after`: the next tile's prologue groups were
  // committed after begin_store's.
  __device__ __forceinline__ void store(const Job& j, const float (&acc)[kAcc], const Staging& staging,
                                        bool prologue_after) const {
    if (whole(j))
      add_pairs<true>(j, acc, staging, prologue_after);
    else
      add_pairs<false>(j, acc, staging, prologue_after);
  }
};

#endif  // SPES_SM90A_DEVICE_CODE

__global__ void __launch_bounds__(kThreads, 1)
    wgrad_kernel(float* const* __restrict__ dweights, const bf16* __restrict__ dout, const bf16* __restrict__ inp,
                 const int32_t* __restrict__ offsets, const int32_t* __restrict__ trained, int n_trained, int S,
                 int E, int C, int OC, int m_tiles, int n_tiles, int ticket_slot, int l2_ahead) {
#if SPES_SM90A_DEVICE_CODE
  unsigned char* smem = dynamic_smem<unsigned char>;
  WgradSched& sched = *reinterpret_cast<WgradSched*>(smem);
  const int experts = rank_trained_experts(sched, offsets, trained, n_trained, E, S);
  TileTickets& tickets = g_tile_tickets[ticket_slot];
  const int per_expert = m_tiles * n_tiles;
  const WgradProblem problem{dweights, dout, inp, &sched, &tickets, C, OC, n_tiles, per_expert, experts * per_expert,
                             l2_ahead};
  run_tiles(problem, smem, stages_address(smem));
  if (threadIdx.x == 0) return_tickets(tickets);
#endif
}

// ---- launchers -----------------------------------------------------------------------------

// What this family needs to know about a device, asked once per device.
struct DeviceInfo {
  bool sm90a = false;   // the kernels can run here (see available())
  int sms = 0;          // multiprocessors: the persistent grid's size
  std::string why_not;  // when !sm90a: the first requirement that failed
};

DeviceInfo query_device(int dev) {
  DeviceInfo d;
  cuda_check(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev));
  d.why_not = sm90a_unavailable_reason(dev, kBuiltForSm90a, kSmemBytes, rows_kernel<Major::k, Epilogue::plain>);
  d.sm90a = d.why_not.empty();
  if (d.sm90a) {  // above 48 KB of dynamic shared memory a kernel must opt in, per device
    allow_dynamic_smem("grouped_matmul (sm90a)", rows_kernel<Major::k, Epilogue::plain>, kSmemBytes);
    allow_dynamic_smem("grouped_matmul (sm90a)", rows_kernel<Major::k, Epilogue::swiglu_forward>, kSmemBytes);
    allow_dynamic_smem("grouped_matmul (sm90a)", rows_kernel<Major::mn, Epilogue::plain>, kSmemBytes);
    allow_dynamic_smem("grouped_matmul (sm90a)", rows_kernel<Major::mn, Epilogue::swiglu_backward>, kSmemBytes);
    allow_dynamic_smem("grouped_matmul (sm90a)", wgrad_kernel, kSmemBytes);
  }
  return d;
}

const DeviceInfo& device_info() { return per_device<DeviceInfo>(query_device); }

unsigned persistent_grid(int64_t tiles) {
  return static_cast<unsigned>(std::min<int64_t>(tiles, device_info().sms));
}

// Forward and backward-input: `a` [S, K] per-row operand, out [S, N]. The grid's tile
// bound (ceil(S/128) + E row tiles, Σ_e ceil(m_e/128) ≤ S/128 + E) only sizes the grid:
// the CTAs walk the real tile count, which the device finds.
// EPI: what the store writes (Epilogue), with the tensors it needs beside out in swiglu.
template <Major B_MAJ, Epilogue EPI = Epilogue::plain>
void rows(bf16* out, const bf16* a, const bf16* const* weights, const int32_t* offsets, int64_t S, int64_t E,
          int64_t N, int64_t K, cudaStream_t stream, SwigluOperands swiglu = {}) {
  const int64_t n_col_tiles = ceil_div(N, column_tile_width(EPI)), row_tiles = ceil_div(S, kBM) + E;
  launch(rows_kernel<B_MAJ, EPI>, persistent_grid(row_tiles * n_col_tiles), kThreads, kSmemBytes, stream, out, a,
         weights, offsets, static_cast<int>(S), static_cast<int>(E), static_cast<int>(N), static_cast<int>(K),
         static_cast<int>(n_col_tiles), l2_prefetch_k_steps(), swiglu);
  cuda_check_launch();
}

}  // namespace

bool available() { return device_info().sm90a; }

namespace {
std::atomic<int> g_l2_prefetch_k_steps{kDefaultL2PrefetchKSteps};
}

int l2_prefetch_k_steps() { return g_l2_prefetch_k_steps.load(std::memory_order_relaxed); }

void set_l2_prefetch_k_steps(int k_steps) {
  if (k_steps < 0 || k_steps > kMaxL2PrefetchKSteps)
    throw Error("grouped_sm90::set_l2_prefetch_k_steps: k_steps must be in [0, " +
                std::to_string(kMaxL2PrefetchKSteps) + "], got " + std::to_string(k_steps));
  g_l2_prefetch_k_steps.store(k_steps, std::memory_order_relaxed);
}

std::string unavailable_reason() { return device_info().why_not; }

namespace {
std::atomic<WgradKernel> g_wgrad_kernel{WgradKernel::threads};
}

WgradKernel wgrad_kernel() { return g_wgrad_kernel.load(std::memory_order_relaxed); }
void set_wgrad_kernel(WgradKernel kernel) { g_wgrad_kernel.store(kernel, std::memory_order_relaxed); }

// The launchers' tile bounds (grouped_gemm.cu) are for 128 × 128 tiles: every count
// here (128 × 256) is smaller, so the same checks keep these within int.
void forward(bf16* out, const bf16* inp, const bf16* const* weights, const int32_t* offsets, int64_t S, int64_t E,
             int64_t C, int64_t OC, cudaStream_t stream) {
  rows<Major::k>(out, inp, weights, offsets, S, E, OC, C, stream);
}

void backward_input(bf16* dinp, const bf16* dout, const bf16* const* weights, const int32_t* offsets, int64_t S,
                    int64_t E, int64_t C, int64_t OC, cudaStream_t stream) {
  rows<Major::mn>(dinp, dout, weights, offsets, S, E, C, OC, stream);
}

void backward_input_swiglu(bf16* dgate_up, bf16* h, const bf16* dout, const bf16* const* weights,
                           const bf16* gate_up, const int32_t* offsets, int64_t S, int64_t E, int64_t H, int64_t OC,
                           cudaStream_t stream) {
  rows<Major::mn, Epilogue::swiglu_backward>(h, dout, weights, offsets, S, E, H, OC, stream,
                                             {gate_up, dgate_up, nullptr});
}

void forward_swiglu(bf16* gate_up, bf16* h, const bf16* inp, const bf16* const* weights, const int32_t* offsets,
                    int64_t S, int64_t E, int64_t C, int64_t H, cudaStream_t stream) {
  rows<Major::k, Epilogue::swiglu_forward>(gate_up, inp, weights, offsets, S, E, H, C, stream, {nullptr, nullptr, h});
}

// The grid's tile bound (every trained expert with rows) only sizes the grid: the
// CTAs walk the tiles of the experts that have rows, which the device finds.
void backward_weight(float* const* dweights, const bf16* dout, const bf16* inp, const int32_t* offsets,
                     const int32_t* trained_experts, int64_t n_trained, int64_t S, int64_t E, int64_t C, int64_t OC,
                     cudaStream_t stream) {
  if (wgrad_kernel() == WgradKernel::tma) {
    backward_weight_tma(dweights, dout, inp, offsets, trained_experts, n_trained, S, E, C, OC, stream);
    return;
  }
  static std::atomic<unsigned> launches{0};  // the ticket slots are taken in turn (TileTickets)
  const int slot = static_cast<int>(launches.fetch_add(1, std::memory_order_relaxed) % kTileTicketSlots);
  const int64_t m_tiles = ceil_div(OC, kBM), n_tiles = ceil_div(C, kBN), n_jobs = n_trained * m_tiles * n_tiles;
  launch(wgrad_kernel, persistent_grid(n_jobs), kThreads, kSmemBytes, stream, dweights, dout, inp, offsets,
         trained_experts, static_cast<int>(n_trained), static_cast<int>(S), static_cast<int>(E), static_cast<int>(C),
         static_cast<int>(OC), static_cast<int>(m_tiles), static_cast<int>(n_tiles), slot, l2_prefetch_k_steps());
  cuda_check_launch();
}

}  // namespace spes::cuda::grouped_sm90
