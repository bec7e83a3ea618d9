// The sm90a grouped weight gradient fed by the copy engine (contract: grouped_gemm.cuh,
// grouped_matmul_backward_weight; picked by grouped_sm90::set_wgrad_kernel):
// dweights[e][m, n] += Σ_s dout[s, m]·inp[s, n] over the rows s of each trained expert e,
// M = OC, N = C, K = the expert's rows; A = doutᵀ and B = inp, both MN-major (k, the
// row, is the strided index of both). sm_90a only, like grouped_gemm_sm90.cu (see its
// file comment for the shared-memory layout the wgmma descriptors read, which the
// copy engine's 128-byte swizzle writes).
//
// Roles. A CTA is three warpgroups (384 threads). Thread 0 produces: it draws the CTA's
// tiles (cuda/grouped_gemm_wgrad_schedule.cuh), posts each in a ring of kTileSlots tile
// slots, and copies each tile's k-steps (64 of the expert's rows) into a ring of kStages
// stages by bulk tensor copies (TMA, cuda/tma.cuh), each stage's `full` mbarrier
// counting its bytes. The rest of its warpgroup has nothing to do: it gives its
// registers up and leaves. Warpgroups 1 and 2 consume: they take the CTA's tiles in
// turn (slots 0, 2, 4, … and 1, 3, 5, …), each computing a whole 128 × 128 tile (two
// wgmma m64n128k16 per k16 step, rows 0-63 and 64-127; 128 fp32 accumulators a thread)
// and adding it into dW, and giving each stage back on its `empty` mbarrier once the
// wgmma that read it are done.
//
// Why so, against the threads' copies of grouped_gemm_sm90.cu (both warpgroups on one
// 128 × 256 tile, dW read into the threads, added and written back while the tensor
// cores wait): here a consumer's store hands its 64 KB of fp32 sums to the L2, which
// adds them into dW (red), and it is the other consumer's main loop that keeps the
// tensor cores busy meanwhile: its tile follows in the stage ring, whose copies ran
// ahead as stages came free. The consumers neither issue copies nor compute their
// addresses, and no __syncthreads paces a main loop: each stage is waited for on its
// own barrier. The two main loops take turns: a consumer starts its tile once every
// thread of the other has seen its tile's last stage full (the `turn` barriers).
// Besides keeping the tensor cores to one tile at a time, that is what makes the
// consumers' waits sound: every wait names its phase by parity (mbarrier_wait_phase),
// which tells only the barrier's current phase from the one before (PTX ISA), and a
// consumer skips the stage phases of the other's tiles; after its turn, every phase
// before its tile's has been seen complete. Every thread of a consumer arrives on the
// other's turn barrier, so that a slow warp's wait there cannot fall two phases behind.
// Registers: 128 accumulators beside the main loop's descriptors are more than the 168
// a thread of 384 may have, so the producer's warpgroup gives all but 56 back
// (setmaxnreg; fewer spill its copy loop) and the consumers take 224.
//
// Tails. A copy reads zeros outside the tensor (columns past OC or C, rows past S), and
// a box wholly outside it is not copied (its stage holds stale bytes that reach only
// outputs that are never stored). A tile's last k-step may reach past its expert's
// rows into the next expert's: the consumer zeroes those k-lines of the stage in both
// operands before its wgmma read it, so that they add 0·0 whatever the rows hold.
#include "cuda/grouped_gemm_sm90.cuh"

#include <algorithm>
#include <atomic>
#include <string>

#include "cuda/check.cuh"
#include "cuda/common.cuh"
#include "cuda/grouped_gemm_common.cuh"
#include "cuda/grouped_gemm_wgrad_schedule.cuh"
#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "cuda/ptx_sm90.cuh"
#include "cuda/sm90a_device.cuh"
#include "cuda/tma.cuh"

namespace spes::cuda::grouped_sm90 {

// This kernel's tile tickets (cuda/grouped_gemm_wgrad_schedule.cuh), declared in every
// compilation pass (nvcc registers a device variable through its host-side shadow).
__device__ grouped::TileTickets g_tma_tile_tickets[kTileTicketSlots];  // zero when the module loads

namespace {

using namespace grouped;

constexpr int kBM = 128, kBN = 128, kBK = 64, kStages = 6, kTileSlots = 8;
constexpr int kWarpgroup = 128, kConsumers = 2, kThreads = (1 + kConsumers) * kWarpgroup;
constexpr int kProducerRegisters = 56, kConsumerRegisters = 224;
// setmaxnreg moves registers within what the CTA was launched with, 168 a thread (64 K
// over 384 threads, in steps of 8): an inc beyond that waits for ever.
constexpr int kLaunchRegisters = (65536 / kThreads) & ~7;
static_assert(kWarpgroup * (kProducerRegisters + kConsumers * kConsumerRegisters) <= kThreads * kLaunchRegisters,
              "the warpgroups' registers fit the CTA's launch allocation");
static_assert(kMaxExperts <= kThreads, "the ranking gives each trained-list entry one thread");
constexpr int kWgmmaK = 16, kHalfRows = 64;  // one wgmma: m64 n128 k16
constexpr int kAcc = kHalfRows * kBN / kWarpgroup;  // accumulators per thread per half: 64

// A k-step of an operand tile is 2 blocks of 64 k-lines, each line 64 elements of m (or
// n), 128 bytes, swizzled; one box of the copy each.
constexpr uint32_t kLineBytes = 128, kBlockBytes = kBK * kLineBytes, kAtomBytes = 8 * kLineBytes;
constexpr int kBlockElems = kLineBytes / sizeof(bf16);  // 64
constexpr uint32_t kTileABytes = 2 * kBlockBytes, kStageBytes = kTileABytes + 2 * kBlockBytes;
static_assert(kBM == 2 * kBlockElems && kBN == 2 * kBlockElems, "two blocks per operand tile");

// The draw for a tile's successor comes this many k-steps before the producer's last
// copy of it: the counter's answer (a round trip to L2) is back before it is needed,
// and the stages already queued keep the consumers busy meanwhile.
constexpr int kDrawLead = 2;

// The start of dynamic shared memory; the stages follow at the next 1024-byte boundary.
struct Shared {
  RankedExperts ranked;
  uint64_t full[kStages], empty[kStages];         // the stage ring's mbarriers
  uint64_t posted[kTileSlots], read[kTileSlots];  // the tile ring's
  uint64_t zeroed[kConsumers];                    // each consumer's, after it zeroes a tail
  uint64_t turn[kConsumers];                      // each consumer's, when its main loop may start
  int tile_of[kTileSlots];                        // the tile posted in each slot; −1: no more
};
constexpr size_t kSmemBytes = sizeof(Shared) + kAtomBytes + size_t(kStages) * kStageBytes;

#if SPES_SM90A_DEVICE_CODE

__device__ __forceinline__ uint32_t bar(const uint64_t& b) { return smem_addr(&b); }

struct Problem {
  const CUtensorMap* dout_map;  // [S, OC], boxes of 64 rows × 64 columns
  const CUtensorMap* inp_map;   // [S, C], the same boxes
  float* const* dweights;
  const RankedExperts* ranked;
  TileTickets* tickets;
  int C, OC, n_tiles, per_expert, n_work;

  struct Job {
    int expert, start, rows, m0, n0;
    __device__ __forceinline__ int ktiles() const { return (rows + kBK - 1) / kBK; }
  };

  // Tile t of the ranked experts' tiles (each one's m_tiles × n_tiles, (OC tile, C tile)
  // order); t < n_work.
  __device__ __forceinline__ Job find(int t) const {
    const int r = t / per_expert, rem = t % per_expert;
    return {ranked->expert[r], ranked->start[r], ranked->rows[r], (rem / n_tiles) * kBM, (rem % n_tiles) * kBN};
  }

  // Copies k-step kt of job j into the stage at shared address `stage`, its bytes
  // counted on the mbarrier `full`: the blocks that start inside the tensor.
  __device__ __forceinline__ void load_kstep(const Job& j, int kt, uint32_t stage, uint32_t full) const {
    const int row = j.start + kt * kBK;
    uint32_t bytes = 0;
    for (int b = 0; b < 2; ++b) {
      bytes += j.m0 + b * kBlockElems < OC ? kBlockBytes : 0;
      bytes += j.n0 + b * kBlockElems < C ? kBlockBytes : 0;
    }
    mbarrier_arrive_expect_tx(full, bytes);
    for (int b = 0; b < 2; ++b) {
      if (j.m0 + b * kBlockElems < OC)
        tma_load_2d(stage + b * kBlockBytes, dout_map, j.m0 + b * kBlockElems, row, full);
      if (j.n0 + b * kBlockElems < C)
        tma_load_2d(stage + kTileABytes + b * kBlockBytes, inp_map, j.n0 + b * kBlockElems, row, full);
    }
  }

  __device__ __forceinline__ float* dw_tile(const Job& j) const {
    return dweights[j.expert] + int64_t(j.m0) * C + j.n0;
  }
};

// ---- the producer ------------------------------------------------------------------------

// Thread 0: posts tile after tile (the CTA's first, then the drawn ones) and copies
// each one's k-steps into the stages in order, each stage once its last reader gave it
// back; at the end posts −1 and returns the CTA's tickets.
__device__ __forceinline__ void produce(const Problem& p, Shared& sh, uint32_t stages) {
  int tile = static_cast<int>(blockIdx.x), n = 0;  // n: the stage-ring position of the next copy
  for (int seq = 0;; ++seq) {
    const int q = seq % kTileSlots;
    mbarrier_wait_phase(bar(sh.read[q]), seq / kTileSlots - 1);  // both consumers read its last post
    const bool valid = tile < p.n_work;
    sh.tile_of[q] = valid ? tile : -1;
    mbarrier_arrive(bar(sh.posted[q]));
    if (!valid) break;
    const Problem::Job j = p.find(tile);
    const int ktiles = j.ktiles(), draw_at = ktiles > kDrawLead ? ktiles - kDrawLead : 0;
    int drawn = 0;
    for (int kt = 0; kt < ktiles; ++kt, ++n) {
      const int s = n % kStages;
      if (kt == draw_at) drawn = static_cast<int>(gridDim.x) + atomicAdd(&p.tickets->next, 1);
      mbarrier_wait_phase(bar(sh.empty[s]), n / kStages - 1);  // its last use is given back
      p.load_kstep(j, kt, stages + s * kStageBytes, bar(sh.full[s]));
    }
    tile = drawn;
  }
  return_tickets(*p.tickets);
}

// ---- the consumers -----------------------------------------------------------------------

// The descriptors of k16 step kk: A's rows 64·half.. (block `half`), B's 128 columns
// (both blocks, 8 KB apart: the leading offset of an MN-major operand).
__device__ __forceinline__ uint64_t a_descriptor(uint32_t stage, int half, int kk) {
  return sw128_descriptor(stage + half * kBlockBytes + kk * kWgmmaK * kLineBytes, kBlockBytes, kAtomBytes);
}
__device__ __forceinline__ uint64_t b_descriptor(uint32_t stage, int kk) {
  return sw128_descriptor(stage + kTileABytes + kk * kWgmmaK * kLineBytes, kBlockBytes, kAtomBytes);
}

// One consumer warpgroup (thread t of it, `c` its index).
struct Consumer {
  Shared& sh;
  uint32_t stages;  // shared address of the first stage
  int c, t;
  int tails = 0;  // tails zeroed so far: the next `zeroed` phase
  int turns = 0;  // turns waited for so far: the next `turn` phase

  // Zeroes k-lines [valid, 64) of every block of the stage, then (fence: the wgmma read
  // through the async proxy) waits until the whole warpgroup has.
  __device__ __forceinline__ void zero_tail(uint32_t stage, int valid) {
    const int chunks = (kBK - valid) * int(kLineBytes / 16);  // per block
    for (int i = t; i < 4 * chunks; i += kWarpgroup) {
      const int block = i / chunks, r = i % chunks;
      st_shared_zero16(stage + block * kBlockBytes + (valid + r / 8) * kLineBytes + (r % 8) * 16);
    }
    fence_proxy_async_shared();
    mbarrier_arrive(bar(sh.zeroed[c]));
    mbarrier_wait_phase(bar(sh.zeroed[c]), tails++);
  }

  // Gives stage position n back to the producer: one arrival per warp, after the
  // warp's wait for the wgmma that read it.
  __device__ __forceinline__ void give_back(int n) const {
    if (t % kWarp == 0) mbarrier_arrive(bar(sh.empty[n % kStages]));
  }

  // acc = the tile's A·B over its k-steps at stage positions n0, n0 + 1, …: each k-step's
  // 8 wgmma one group, issued behind the previous group, whose stage is given back once
  // it is done (so one group is always queued behind the running one).
  __device__ __forceinline__ void mainloop(float (&acc)[2][kAcc], const Problem::Job& j, int n0) {
    const int ktiles = j.ktiles(), tail = j.rows % kBK;
    for (int kt = 0; kt < ktiles; ++kt) {
      const int n = n0 + kt, s = n % kStages;
      const uint32_t stage = stages + s * kStageBytes;
      mbarrier_wait_phase(bar(sh.full[s]), n / kStages);
      if (kt == ktiles - 1) mbarrier_arrive(bar(sh.turn[c ^ 1]));  // this thread saw every stage of the tile full
      if (kt == ktiles - 1 && tail != 0) zero_tail(stage, tail);
      fence_accumulators(acc[0]);
      fence_accumulators(acc[1]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / kWgmmaK; ++kk)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          wgmma_ss<kBN, 1, 1>(acc[half], a_descriptor(stage, half, kk), b_descriptor(stage, kk), kt > 0 || kk > 0);
      wgmma_commit();
      wgmma_wait<1>();
      fence_accumulators(acc[0]);
      fence_accumulators(acc[1]);
      if (kt > 0) give_back(n - 1);
    }
    wgmma_wait<0>();
    fence_accumulators(acc[0]);
    fence_accumulators(acc[1]);
    give_back(n0 + ktiles - 1);
  }

  // dW += acc, each float pair added by the L2 (red_add_f32x2: nothing to wait for, so
  // the warpgroup goes on to its next tile at once). acc[half][4j + 2h + e] is the tile's
  // element (64·half + 16·warp + lane / 4 + 8h, 8j + 2·(lane % 4) + e) (wgmma's D
  // fragment, cuda/ptx_sm90.cuh). Rows past OC and columns past C are skipped (C % 8 ==
  // 0: a pair lies wholly inside or outside); a tile wholly inside tests nothing.
  template <bool kWhole>
  __device__ __forceinline__ void add_to_dw(const Problem& p, const Problem::Job& j,
                                            const float (&acc)[2][kAcc]) const {
    const int lane = t % kWarp, r0 = (t / kWarp) * 16 + lane / 4, c0 = 2 * (lane % 4);
    float* tile = p.dw_tile(j);
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = kHalfRows * half + r0 + 8 * h;
        if (!kWhole && j.m0 + r >= p.OC) continue;
        float* row = tile + int64_t(r) * p.C + c0;
#pragma unroll
        for (int jn = 0; jn < kAcc / 4; ++jn)
          if (kWhole || j.n0 + 8 * jn + c0 < p.C)
            red_add_f32x2(row + 8 * jn, acc[half][4 * jn + 2 * h], acc[half][4 * jn + 2 * h + 1]);
      }
  }

  // Reads every posted tile in order (each to follow the stage ring's positions) and
  // computes its own: the posts of turn c, c + 2, …
  __device__ __forceinline__ void run(const Problem& p) {
    float acc[2][kAcc] = {};  // every tile's first wgmma overwrites it; zeroed so it is never read undefined
    int n = 0;                // the stage-ring position of the posted tile's first k-step
    for (int seq = 0;; ++seq) {
      const int q = seq % kTileSlots;
      mbarrier_wait_phase(bar(sh.posted[q]), seq / kTileSlots);
      const int tile = sh.tile_of[q];
      mbarrier_arrive(bar(sh.read[q]));
      if (tile < 0) return;
      const Problem::Job j = p.find(tile);
      if (seq % kConsumers == c) {
        if (seq > 0) mbarrier_wait_phase(bar(sh.turn[c]), turns++);
        mainloop(acc, j, n);
        if (j.m0 + kBM <= p.OC && j.n0 + kBN <= p.C)
          add_to_dw<true>(p, j, acc);
        else
          add_to_dw<false>(p, j, acc);
      }
      n += j.ktiles();
    }
  }
};

#endif  // SPES_SM90A_DEVICE_CODE

__global__ void __launch_bounds__(kThreads, 1)
    wgrad_tma_kernel(const __grid_constant__ CUtensorMap dout_map, const __grid_constant__ CUtensorMap inp_map,
                     float* const* __restrict__ dweights, const int32_t* __restrict__ offsets,
                     const int32_t* __restrict__ trained, int n_trained, int S, int E, int C, int OC, int m_tiles,
                     int n_tiles, int ticket_slot) {
#if SPES_SM90A_DEVICE_CODE
  unsigned char* smem = dynamic_smem<unsigned char>;
  Shared& sh = *reinterpret_cast<Shared*>(smem);
  const int experts = rank_trained_experts(sh.ranked, offsets, trained, n_trained, E, S);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(bar(sh.full[s]), 1);                    // the producer's arrival, and the bytes
      mbarrier_init(bar(sh.empty[s]), kWarpgroup / kWarp);  // each warp of the reader
    }
    for (int q = 0; q < kTileSlots; ++q) {
      mbarrier_init(bar(sh.posted[q]), 1);
      mbarrier_init(bar(sh.read[q]), kConsumers * kWarpgroup);
    }
    for (int c = 0; c < kConsumers; ++c) {
      mbarrier_init(bar(sh.zeroed[c]), kWarpgroup);
      mbarrier_init(bar(sh.turn[c]), kWarpgroup);  // every thread of the other consumer
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  const int per_expert = m_tiles * n_tiles;
  const Problem p{&dout_map, &inp_map, dweights, &sh.ranked, &g_tma_tile_tickets[ticket_slot],
                  C, OC, n_tiles, per_expert, experts * per_expert};
  const uint32_t stages = (smem_addr(smem + sizeof(Shared)) + kAtomBytes - 1) & ~(kAtomBytes - 1);
  const int warpgroup = static_cast<int>(threadIdx.x) / kWarpgroup;
  if (warpgroup == 0) {
    setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x == 0) produce(p, sh, stages);
    return;
  }
  setmaxnreg_inc<kConsumerRegisters>();
  Consumer consumer{sh, stages, warpgroup - 1, static_cast<int>(threadIdx.x) % kWarpgroup};
  consumer.run(p);
#endif
}

// ---- launcher ------------------------------------------------------------------------------

struct DeviceInfo {
  int sms = 0;
  std::string why_not;  // empty: the kernel can run here
};

DeviceInfo query_device(int dev) {
  DeviceInfo d;
  cuda_check(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev));
  d.why_not = sm90a_unavailable_reason(dev, kBuiltForSm90a, kSmemBytes, wgrad_tma_kernel);
  // setmaxnreg hands out what the launch allocated: with fewer, the consumers' inc waits for ever.
  if (d.why_not.empty()) {
    cudaFuncAttributes fa{};
    cuda_check(cudaFuncGetAttributes(&fa, wgrad_tma_kernel));
    if (fa.numRegs < kLaunchRegisters)
      d.why_not = "its kernel was built with " + std::to_string(fa.numRegs) + " registers a thread, not the " +
                  std::to_string(kLaunchRegisters) + " its warpgroups share out";
  }
  if (d.why_not.empty()) d.why_not = tma_check_failure();
  if (d.why_not.empty())
    allow_dynamic_smem("grouped_matmul_backward_weight (sm90a, TMA)", wgrad_tma_kernel, kSmemBytes);
  return d;
}

const DeviceInfo& device_info() { return per_device<DeviceInfo>(query_device); }

}  // namespace

std::string wgrad_tma_unavailable_reason() { return device_info().why_not; }

void backward_weight_tma(float* const* dweights, const bf16* dout, const bf16* inp, const int32_t* offsets,
                         const int32_t* trained_experts, int64_t n_trained, int64_t S, int64_t E, int64_t C,
                         int64_t OC, cudaStream_t stream) {
  const DeviceInfo& device = device_info();
  if (!device.why_not.empty())
    throw Error("grouped_matmul_backward_weight: the TMA kernel cannot run here: " + device.why_not);
  static std::atomic<unsigned> launches{0};  // the ticket slots are taken in turn
  const int slot = static_cast<int>(launches.fetch_add(1, std::memory_order_relaxed) % kTileTicketSlots);
  const CUtensorMap dout_map = bf16_matrix_map(dout, uint64_t(S), uint64_t(OC), uint64_t(OC), kBK, kBlockElems,
                                               CU_TENSOR_MAP_SWIZZLE_128B);
  const CUtensorMap inp_map = bf16_matrix_map(inp, uint64_t(S), uint64_t(C), uint64_t(C), kBK, kBlockElems,
                                              CU_TENSOR_MAP_SWIZZLE_128B);
  // The grid's tile bound (every trained expert with rows) only sizes the grid: the CTAs
  // walk the tiles of the experts that have rows, which the device finds.
  const int64_t m_tiles = ceil_div(OC, kBM), n_tiles = ceil_div(C, kBN), n_jobs = n_trained * m_tiles * n_tiles;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(n_jobs, device.sms));
  launch(wgrad_tma_kernel, grid, kThreads, kSmemBytes, stream, dout_map, inp_map, dweights, offsets, trained_experts,
         static_cast<int>(n_trained), static_cast<int>(S), static_cast<int>(E), static_cast<int>(C),
         static_cast<int>(OC), static_cast<int>(m_tiles), static_cast<int>(n_tiles), slot);
  cuda_check_launch();
}

}  // namespace spes::cuda::grouped_sm90
