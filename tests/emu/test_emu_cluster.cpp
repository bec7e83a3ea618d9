// The emulator's thread-block clusters (emu.hpp), on small kernels of this file, before
// a real kernel relies on them (test_cuda_crossentropy.cu runs crossentropy.cu's
// cluster kernel): ranks and block indices of a 2-D cluster, distributed shared
// memory through map_shared_rank (a static __shared__ variable and dynamic shared
// memory, each CTA's own), cluster.sync under every schedule, the launch checks and
// the cluster occupancy, and, in child processes, the misuses a GPU would fault on or
// hang at.

// First: the shadow cuda/launch.cuh and <cooperative_groups.h> use the built-ins.
#include "tests/emu/builtins.hpp"

#include <cooperative_groups.h>
#include <doctest/doctest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "cuda/launch.cuh"
#include "tests/emu/emu.hpp"
#include "tests/emu/emu_test.hpp"

namespace {

namespace cg = cooperative_groups;
using emu::GlobalBuffer;
using spes::test::has;
using spes::test::run_in_child;

constexpr unsigned kThreads = 64;  // two warps a CTA
constexpr int kFields = 3;         // per thread: its CTA's rank, and a peer's two ids

int linear_block() { return int(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)); }

// Each CTA publishes its linear block index b in a static __shared__ variable and
// −b − 1 in its dynamic shared memory; after cluster.sync, thread t reads those of
// CTA t mod (cluster size) through map_shared_rank. The second cluster.sync keeps
// every CTA, and its shared memory, alive until all have read.
void exchange_kernel(int* out) {
  __shared__ int s_block;
  int* d_block = spes::cuda::dynamic_smem<int>;
  const cg::cluster_group cluster = cg::this_cluster();
  if (threadIdx.x == 0) {
    s_block = linear_block();
    d_block[3] = -linear_block() - 1;  // not at offset 0: the offset must carry over
  }
  cluster.sync();
  const int peer = int(threadIdx.x % cluster.num_blocks());
  int* o = out + (linear_block() * kThreads + threadIdx.x) * kFields;
  o[0] = int(cluster.block_rank());
  o[1] = *cluster.map_shared_rank(&s_block, peer);
  o[2] = cluster.map_shared_rank(d_block, peer)[3];
  cluster.sync();
}

// The expected fields: clusters of `dims` tile the grid, ranks x fastest.
std::vector<int> expected_exchange(dim3 grid, dim3 dims) {
  std::vector<int> e(size_t(grid.x) * grid.y * kThreads * kFields);
  for (unsigned y = 0; y < grid.y; ++y)
    for (unsigned x = 0; x < grid.x; ++x)
      for (unsigned t = 0; t < kThreads; ++t) {
        const unsigned peer = t % (dims.x * dims.y);
        const unsigned px = x - x % dims.x + peer % dims.x, py = y - y % dims.y + peer / dims.x;
        const int b = int(x + grid.x * y), pb = int(px + grid.x * py);
        int* f = &e[(size_t(b) * kThreads + t) * kFields];
        f[0] = int(x % dims.x + y % dims.y * dims.x);
        f[1] = pb;
        f[2] = -pb - 1;
      }
  return e;
}

cudaError_t launch_clusters(void (*kernel)(int*), dim3 grid, dim3 dims, size_t smem, int* out) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = dims.x;
  attr.val.clusterDim.y = dims.y;
  attr.val.clusterDim.z = dims.z;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return spes::cuda::launch_ex(cfg, kernel, out);
}

// Odd threads exit before cluster.sync: barrier.cluster waits for the non-exited
// threads only, so the even ones pass.
void early_exit_kernel(int* out) {
  if (threadIdx.x % 2 == 1) return;
  cg::this_cluster().sync();
  out[linear_block() * kThreads + threadIdx.x] = 1;
}

// Misuses. Rank 0 reads the others' variable without the second cluster.sync: they
// may have exited (one CTA at a time, some have, whichever the order).
void read_after_exit_kernel(int*) {
  __shared__ int s_value;
  const cg::cluster_group cluster = cg::this_cluster();
  s_value = 1;
  cluster.sync();
  if (threadIdx.x == 0)
    for (unsigned r = 0; r < cluster.num_blocks(); ++r) (void)*cluster.map_shared_rank(&s_value, int(r));
}
void rank_out_of_range_kernel(int*) {
  __shared__ int s_value;
  const cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  if (threadIdx.x == 0) (void)*cluster.map_shared_rank(&s_value, int(cluster.num_blocks()));
  cluster.sync();
}
void not_shared_kernel(int* out) {
  const cg::cluster_group cluster = cg::this_cluster();
  (void)cluster.map_shared_rank(out, 0);
}
// Thread 0 skips cluster.sync and waits at __syncthreads, which the others reach only
// after cluster.sync: a hang on a GPU.
void deadlock_kernel(int*) {
  if (threadIdx.x != 0) cg::this_cluster().sync();
  __syncthreads();
}

}  // namespace

TEST_CASE("emulated clusters: ranks, distributed shared memory and cluster.sync under every schedule") {
  // A 2-D cluster; the portable maximum of 8; clusters of one CTA.
  for (const auto& [grid, dims] :
       {std::pair{dim3(4, 4), dim3(2, 2)}, std::pair{dim3(16), dim3(8)}, std::pair{dim3(3), dim3(1)}}) {
    const std::string shape = "grid " + std::to_string(grid.x) + "×" + std::to_string(grid.y) + ", clusters " +
                              std::to_string(dims.x) + "×" + std::to_string(dims.y);
    INFO(shape);
    const std::vector<int> want = expected_exchange(grid, dims);
    const GlobalBuffer out = spes::test::device_buffer<int>(int64_t(want.size()));
    out.poison();
    auto run = [&] { REQUIRE(launch_clusters(exchange_kernel, grid, dims, 64, out.as<int>()) == cudaSuccess); };
    run();
    CHECK(spes::test::download<int>(out, int64_t(want.size())) == want);
    spes::test::check_rerun_identical("cluster exchange " + shape, {&out}, run);
  }
  const GlobalBuffer out = spes::test::device_buffer<int>(8 * kThreads);
  out.zero();
  REQUIRE(launch_clusters(early_exit_kernel, dim3(8), dim3(4), 0, out.as<int>()) == cudaSuccess);
  const std::vector<int> written = spes::test::download<int>(out, 8 * kThreads);
  for (unsigned i = 0; i < written.size(); ++i) CHECK(written[i] == (i % 2 == 0 ? 1 : 0));
}

TEST_CASE("emulated clusters: launches and occupancy queries CUDA refuses") {
  const GlobalBuffer out = spes::test::device_buffer<int>(64 * kThreads * kFields);
  // A grid that is not a whole number of clusters; a cluster above the portable 8.
  CHECK(launch_clusters(exchange_kernel, dim3(6), dim3(4), 64, out.as<int>()) == cudaErrorInvalidClusterSize);
  CHECK(launch_clusters(exchange_kernel, dim3(4, 3), dim3(2, 2), 64, out.as<int>()) == cudaErrorInvalidClusterSize);
  CHECK(launch_clusters(exchange_kernel, dim3(32), dim3(16), 64, out.as<int>()) == cudaErrorInvalidClusterSize);

  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim = {8, 1, 1};
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(8);
  cfg.blockDim = dim3(512);
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int clusters = -1;
  const void* kernel = reinterpret_cast<const void*>(&early_exit_kernel);
  cfg.dynamicSmemBytes = 40 * 1024;
  REQUIRE(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess);
  CHECK(clusters > 0);
  // Above 48 KB only once the kernel opted in, as its launch.
  cfg.dynamicSmemBytes = 100 * 1024;
  REQUIRE(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess);
  CHECK(clusters == 0);
  REQUIRE(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024) == cudaSuccess);
  REQUIRE(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess);
  CHECK(clusters > 0);
  attr.val.clusterDim = {16, 1, 1};
  CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaErrorInvalidClusterSize);
}

// Each in a child process, which must abort with the reason (emu::fail).
TEST_CASE("emulated clusters: where a GPU would fault or hang, the emulator aborts and says why") {
  const GlobalBuffer out = spes::test::device_buffer<int>(8 * kThreads);
  auto child = [&](void (*kernel)(int*), emu::Schedule schedule) {
    return run_in_child([&] {
      emu::set_schedule(schedule);
      (void)launch_clusters(kernel, dim3(8), dim3(4), 0, out.as<int>());
    });
  };
  for (emu::Schedule s : {emu::Schedule::warps_ascending, emu::Schedule::warps_descending}) {
    const std::string msg = child(read_after_exit_kernel, s);
    CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, "of the cluster has exited")), msg);
  }
  std::string msg = child(rank_out_of_range_kernel, emu::Schedule::round_robin);
  CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, "rank 4 outside the cluster of 4 CTAs")), msg);
  msg = child(not_shared_kernel, emu::Schedule::round_robin);
  CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, "outside the CTA's shared memory")), msg);
  msg = child(deadlock_kernel, emu::Schedule::round_robin);
  CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, "deadlock in CTA") && has(msg, "63 at cluster.sync") &&
                 has(msg, "1 at __syncthreads")),
                msg);
  // The cluster API in a launch without a cluster dimension.
  msg = run_in_child([&] {
    spes::cuda::launch(early_exit_kernel, dim3(1), dim3(kThreads), 0, nullptr, out.as<int>());
  });
  CHECK_MESSAGE((has(msg, "[aborted]") && has(msg, "without a cluster dimension")), msg);
}
