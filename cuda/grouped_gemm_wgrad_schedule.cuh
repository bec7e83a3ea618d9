// How the sm90a family's two weight-gradient kernels (cuda/grouped_gemm_sm90.cu, whose
// threads copy the operands; cuda/grouped_gemm_tma_sm90.cu, where the copy engine does)
// deal out their tiles. A tile's main loop takes its expert's rows / 64 k-steps, and
// routings are skewed (an expert may have tens of times the rows of another), so tiles
// dealt in a fixed stride would leave some CTAs far more work than others. Instead the
// tiles are numbered most costly first (the trained experts ranked by rows, each one's
// tiles together), CTA b starts at tile b, and each CTA draws its next tile from the
// launch's ticket counter as it is about to come free: a list schedule, which ends
// within about one of the last, smallest tiles of even. Which CTA computes a tile does
// not change its bits: each dW element is summed by one CTA in one fixed order.
// Internal to those two files.
#pragma once
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/grouped_gemm_common.cuh"

namespace spes::cuda::grouped {

// A launch's tile tickets: `next` counts the tiles drawn so far past the first
// gridDim.x, `done` the CTAs finished; the last CTA to finish puts both back to 0 for
// the next launch on the same counter. Each kernel keeps kTileTicketSlots of them in
// device memory (zero when the module loads), and its launches take them in turn, so
// two launches share one only that many launches apart: ones that never run at once (a
// stream runs its launches in order; a captured graph replays its launches' slots, one
// replay at a time).
struct TileTickets {
  int next, done;
};

// The trained experts that have rows, most rows first (ties in list order).
struct RankedExperts {
  int rows_of_entry[kMaxExperts];  // rows of trained-list entry i (0: none, or not an expert)
  int expert[kMaxExperts];         // by rank: the expert, its first row and its rows
  int start[kMaxExperts];
  int rows[kMaxExperts];
};

// Fills s with the trained experts that have rows, one thread per entry of the trained
// list (the block has at least kMaxExperts threads); returns how many. An entry outside
// [0, E) counts as an expert without rows. Every thread of the block calls it.
__device__ __forceinline__ int rank_trained_experts(RankedExperts& s, const int32_t* offsets, const int32_t* trained,
                                                    int n_trained, int E, int S) {
  const int tid = static_cast<int>(threadIdx.x);
  int e = 0, start = 0, rows = 0;
  if (tid < n_trained) {
    e = trained[tid];
    if (e >= 0 && e < E) {
      start = clamp_int(offsets[e], 0, S);
      rows = clamp_int(offsets[e + 1], start, S) - start;
    }
  }
  if (tid < kMaxExperts) s.rows_of_entry[tid] = rows;
  __syncthreads();
  int rank = 0, ranked = 0;
  for (int j = 0; j < n_trained; ++j) {
    const int r = s.rows_of_entry[j];
    rank += r > rows || (r == rows && j < tid);
    ranked += r > 0;
  }
  if (rows > 0) {
    s.expert[rank] = e;
    s.start[rank] = start;
    s.rows[rank] = rows;
  }
  __syncthreads();
  return ranked;
}

// One thread of each CTA, after its last draw: the launch's last CTA to get here puts
// the counter back to zero (every CTA has drawn its last ticket by then). The fence
// before `done` releases this CTA's draws; the one after it acquires the others', so
// that in the memory model (not only on today's L2) every draw comes before the reset.
__device__ __forceinline__ void return_tickets(TileTickets& t) {
  __threadfence();
  if (atomicAdd(&t.done, 1) == static_cast<int>(gridDim.x) - 1) {
    __threadfence();
    atomicExch(&t.next, 0);
    atomicExch(&t.done, 0);
  }
}

}  // namespace spes::cuda::grouped
