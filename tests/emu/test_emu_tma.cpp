// The emulator's mbarrier and bulk tensor copy (TMA, sm_90; emu.hpp, the shadow
// cuda/ptx_sm90.cuh) as the Hopper kernels to come will use them: a producer thread
// copies boxes of a bf16 matrix into a ring of shared-memory stages, each stage's
// "full" barrier told the bytes, and consumers release a stage on its "empty" barrier.
// Checked: the copy gives the matrix back, its 128-byte swizzle undone and what lies
// outside the matrix zero, under both landings and every schedule (the same copy once,
// and a wgmma on copied boxes, are cuda/tma_check.cu's, which test_cuda_tma runs on
// the emulator and on a GPU); and each misuse that a GPU would punish (a read before
// the wait, a stage refilled before its release, a wrong byte count, a misaligned
// stage, a barrier overwritten or used unfenced, a copy never waited for, a box the
// driver refuses) fails the run or the check, as a GPU would.
#include "tests/emu/builtins.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "cuda/ptx_sm90.cuh"
#include "cuda/tma.cuh"
#include "tests/emu/emu.hpp"
#include "tests/emu/emu_test.hpp"

namespace {

using spes::test::has;
using spes::test::run_in_child;

enum Variant : int {
  correct,
  read_before_wait,  // the consumers read a stage, then wait for it
  no_release_wait,   // the producer refills a stage without waiting for its release
  short_expect_tx,   // the producer expects 16 bytes more than its box
  misaligned_stage,  // the stages 128 bytes off the swizzle's 1024-byte repeat
  barrier_overwritten,
  copy_not_waited,  // one more box issued, nobody waits for it
  no_init_fence,    // the barriers used by the copy engine without fence.mbarrier_init
};

constexpr int kBox = 64;  // rows and columns of a box: 64 bf16 = one 128-byte swizzle row
constexpr uint32_t kBoxBytes = kBox * kBox * 2;
constexpr int kStages = 2;
constexpr unsigned kConsumers = 64, kThreads = 32 + kConsumers;  // warp 0 produces (its lane 0)
constexpr size_t kSmem = 1024 + kStages * kBoxBytes + 2 * kStages * 8 + 1024;

// Copies a rows × cols bf16 matrix through the stages, box by box (this CTA's row
// boxes blockIdx.x, + gridDim.x, …, each row of boxes left to right); out gets the
// boxes' in-matrix part, and `outside` counts the elements of a box outside the matrix
// that did not read as zero.
void copy_kernel(const __grid_constant__ CUtensorMap map, uint16_t* out, int rows, int cols, int* outside, int variant) {
  using namespace spes::cuda;
  unsigned char* smem = dynamic_smem<unsigned char>;
  const uint32_t base = (smem_addr(smem) + 1023) & ~1023u;
  const uint32_t stages = base + (variant == misaligned_stage ? 128 : 0);
  const uint32_t bars = stages + kStages * kBoxBytes;
  auto full_bar = [&](int s) { return bars + 8 * s; };
  auto empty_bar = [&](int s) { return bars + 8 * (kStages + s); };
  const uint32_t unwatched_bar = bars + 8 * 2 * kStages;  // copy_not_waited's
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full_bar(s), 1);
      mbarrier_init(empty_bar(s), kConsumers);
    }
    mbarrier_init(unwatched_bar, 1);
    if (variant != no_init_fence) fence_mbarrier_init();
  }
  __syncthreads();
  const int col_boxes = (cols + kBox - 1) / kBox, row_boxes = (rows + kBox - 1) / kBox;
  int n = 0;  // boxes of this CTA so far: stage n % kStages, its use n / kStages
  for (int rb = blockIdx.x; rb < row_boxes; rb += gridDim.x)
    for (int cb = 0; cb < col_boxes; ++cb, ++n) {
      const int s = n % kStages;
      const uint32_t phase = uint32_t(n / kStages) & 1;
      const uint32_t stage = stages + s * kBoxBytes;
      if (threadIdx.x == 0) {
        if (variant != no_release_wait) mbarrier_wait_parity(empty_bar(s), phase ^ 1);
        mbarrier_arrive_expect_tx(full_bar(s), kBoxBytes + (variant == short_expect_tx ? 16 : 0));
        tma_load_2d(stage, &map, cb * kBox, rb * kBox, full_bar(s));
        if (variant == copy_not_waited && n == 0) {  // on a barrier nobody waits on
          mbarrier_arrive_expect_tx(unwatched_bar, kBoxBytes);
          tma_load_2d(stage, &map, cb * kBox, rb * kBox, unwatched_bar);
        }
      } else if (threadIdx.x >= 32) {
        const unsigned c = threadIdx.x - 32;
        if (variant != read_before_wait) mbarrier_wait_parity(full_bar(s), phase);
        const unsigned char* box = smem + (stage - smem_addr(smem));
        for (int r = int(c); r < kBox; r += int(kConsumers))
          for (int chunk = 0; chunk < 8; ++chunk) {
            uint16_t v[8];
            std::memcpy(v, box + r * 128 + ((chunk ^ (r % 8)) * 16), 16);
            for (int i = 0; i < 8; ++i) {
              const int row = rb * kBox + r, col = cb * kBox + chunk * 8 + i;
              if (row < rows && col < cols)
                out[int64_t(row) * cols + col] = v[i];
              else if (v[i] != 0)
                ++*outside;  // one thread per element: no two write it at once
            }
          }
        if (variant == read_before_wait) mbarrier_wait_parity(full_bar(s), phase);
        if (variant == barrier_overwritten && c == 0 && n == 0) std::memset(smem + (full_bar(1) - smem_addr(smem)), 0, 8);
        mbarrier_arrive(empty_bar(s));
      }
    }
}

struct Matrix {
  int rows, cols;
  emu::GlobalBuffer in, out, outside;
  std::vector<uint16_t> values;
  Matrix(int r, int c)
      : rows(r), cols(c), in(size_t(r) * c * 2), out(size_t(r) * c * 2), outside(sizeof(int)), values(size_t(r) * c) {
    for (size_t i = 0; i < values.size(); ++i) values[i] = uint16_t(0x3c00 + i % 4093);  // no zero, no NaN
    std::memcpy(in.as<uint16_t>(), values.data(), values.size() * 2);
  }
  CUtensorMap map() const {
    return spes::cuda::bf16_matrix_map(in.as<uint16_t>(), uint64_t(rows), uint64_t(cols), uint64_t(cols), kBox, kBox,
                                       CU_TENSOR_MAP_SWIZZLE_128B);
  }
  void run(int variant, unsigned grid = 2) const {
    out.poison();
    outside.zero();
    spes::cuda::launch(copy_kernel, dim3(grid), dim3(kThreads), kSmem, nullptr, map(), out.as<uint16_t>(), rows, cols,
                       outside.as<int>(), variant);
  }
  // Elements of out that differ from the matrix.
  int64_t wrong() const {
    int64_t n = 0;
    for (size_t i = 0; i < values.size(); ++i) n += out.as<uint16_t>()[i] != values[i];
    return n;
  }
};

}  // namespace

TEST_CASE("emulated TMA: boxes through a ring of stages give the matrix back, zeros outside it") {
  const Matrix m(200, 136);  // 4 row boxes × 3 column boxes, tails in both
  m.run(correct);
  CHECK(m.wrong() == 0);
  CHECK(*m.outside.as<int>() == 0);
  // the other schedules, and copies landing at issue (a stage then fills before its wait)
  spes::test::check_rerun_identical("TMA copy", {&m.out, &m.outside}, [&] { m.run(correct); });
}

TEST_CASE("emulated TMA: a read before the wait, or a stage refilled before its release, gives wrong bytes") {
  const Matrix m(256, 128);  // 2 boxes per CTA row, 2 CTAs: each stage is used twice
  emu::set_landing(emu::Landing::at_wait);
  m.run(read_before_wait);
  CHECK(m.wrong() > 0);  // the consumers read the poison the stage held before its copy landed
  const std::string msg = run_in_child([&] {
    emu::set_landing(emu::Landing::at_issue);
    emu::set_schedule(emu::Schedule::warps_ascending);  // the producer's warp first: it refills at once
    m.run(no_release_wait);
    if (m.wrong() == 0) std::exit(0);
    std::fprintf(stderr, "wrong bytes: %lld\n", static_cast<long long>(m.wrong()));
  });
  CHECK_MESSAGE(msg != "[returned]", msg);  // wrong bytes, or phases run past the consumers' waits (a deadlock)
  emu::set_landing(emu::Landing::at_wait);
}

namespace {
// One copy on a fresh barrier, then a wait for parity 1 (the phase before the barrier's
// current one) while the copy is in flight, then the proper wait for parity 0: *early
// gets whether the first passed, *landed whether the box had landed by then.
void skipped_phase_kernel(const __grid_constant__ CUtensorMap map, int* early, int* landed) {
  using namespace spes::cuda;
  if (threadIdx.x != 0) return;  // one warp, lane 0 alone
  unsigned char* smem = dynamic_smem<unsigned char>;
  const uint32_t stage = (smem_addr(smem) + 1023) & ~1023u, bar = stage + kBoxBytes;
  unsigned char* box = smem + (stage - smem_addr(smem));
  mbarrier_init(bar, 1);
  fence_mbarrier_init();
  std::memset(box, 0xFF, kBoxBytes);
  mbarrier_arrive_expect_tx(bar, kBoxBytes);
  tma_load_2d(stage, &map, 0, 0, bar);
  *early = mbarrier_try_wait_parity(bar, 1);
  uint16_t first;  // element (0, 0): the first 2 bytes in the 128-byte swizzle too
  std::memcpy(&first, box, 2);
  *landed = first != 0xFFFF;
  mbarrier_wait_parity(bar, 0);
}
}  // namespace

// A thread that skips a phase (waits for a stage's second use without waiting for its
// first) asks for parity 1 while the barrier is still in phase 0: PTX's parity names
// the current phase or the one before, so it passes at once, before the copy landed.
// The emulator answers so (a wrong parity protocol fails on it as on a GPU); with the
// copy landed at issue, phase 0 is complete and parity 1 names the open one.
TEST_CASE("emulated TMA: a wait for the phase before the current one passes at once, copies in flight") {
  const Matrix m(64, 64);
  for (const emu::Landing landing : {emu::Landing::at_wait, emu::Landing::at_issue}) {
    emu::set_landing(landing);
    emu::GlobalBuffer early(sizeof(int)), landed(sizeof(int));
    spes::cuda::launch(skipped_phase_kernel, dim3(1), dim3(32), kSmem, nullptr, m.map(), early.as<int>(),
                       landed.as<int>());
    if (landing == emu::Landing::at_wait) {  // the copy in flight: the wait passes, and lands nothing
      CHECK(*early.as<int>() == 1);
      CHECK(*landed.as<int>() == 0);
    } else {  // landed at issue, phase 0 complete: parity 1 is now the current phase's, open
      CHECK(*early.as<int>() == 0);
      CHECK(*landed.as<int>() == 1);
    }
  }
  emu::set_landing(emu::Landing::at_wait);
}

TEST_CASE("emulated TMA: a wrong byte count, a misaligned stage, an overwritten or unfenced barrier, or a copy left "
          "behind fail") {
  const Matrix m(128, 64);
  const std::string count = run_in_child([&] { m.run(short_expect_tx); });
  CHECK_MESSAGE((has(count, "[aborted]") && has(count, "deadlock") && has(count, "mbarrier.try_wait")), count);
  const std::string aligned = run_in_child([&] { m.run(misaligned_stage); });
  CHECK_MESSAGE((has(aligned, "[aborted]") && has(aligned, "not 1024-byte aligned")), aligned);
  const std::string overwritten = run_in_child([&] { m.run(barrier_overwritten, 1); });
  CHECK_MESSAGE((has(overwritten, "[aborted]") && has(overwritten, "was overwritten")), overwritten);
  const std::string left = run_in_child([&] { m.run(copy_not_waited); });
  CHECK_MESSAGE((has(left, "[aborted]") && has(left, "bulk tensor copies in flight")), left);
  const std::string unfenced = run_in_child([&] { m.run(no_init_fence); });
  CHECK_MESSAGE((has(unfenced, "[aborted]") && has(unfenced, "before its initializing thread ran fence.mbarrier_init")),
                unfenced);
}

TEST_CASE("emulated TMA: the driver's refusals reach the caller, naming the shape") {
  const emu::GlobalBuffer buf(64 * 200 * 2);
  auto map = [&](uint64_t ld, uint32_t box_cols, CUtensorMapSwizzle swizzle) {
    return spes::cuda::bf16_matrix_map(buf.as<uint16_t>(), 64, 100, ld, 64, box_cols, swizzle);
  };
  CHECK_NOTHROW(map(104, 64, CU_TENSOR_MAP_SWIZZLE_128B));
  CHECK_THROWS_WITH(map(100, 64, CU_TENSOR_MAP_SWIZZLE_NONE), doctest::Contains("(ld 100"));  // 200-byte rows
  CHECK_THROWS_WITH(map(104, 128, CU_TENSOR_MAP_SWIZZLE_128B), doctest::Contains("boxes of 64 × 128"));  // 256 > 128
  CHECK_THROWS_WITH(map(104, 4, CU_TENSOR_MAP_SWIZZLE_NONE), doctest::Contains("boxes of 64 × 4"));  // 8 bytes
}
