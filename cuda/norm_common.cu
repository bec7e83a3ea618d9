// The resident-block cache behind norm::partial_blocks (norm_common.cuh).
#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "cuda/norm_common.cuh"

namespace spes::cuda::norm {

int resident_blocks(const void* kernel, int tx, int ty, size_t smem) {
  // (device, kernel, block shape, dynamic smem) → SMs × blocks per SM. One mutex for
  // all devices: one host thread per GPU, a few lookups per step.
  using Key = std::tuple<int, const void*, int, int, size_t>;
  static std::mutex mu;
  static std::map<Key, int> cache;
  int dev = 0;
  cuda_check(cudaGetDevice(&dev));  // the calling thread's current device: no device query
  const Key key{dev, kernel, tx, ty, smem};
  std::lock_guard<std::mutex> lock(mu);
  if (const auto it = cache.find(key); it != cache.end()) return it->second;
  int sms = 0, per_sm = 0;
  cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cuda_check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, tx * ty, smem));
  // Nothing is stored on a throw. A kernel that cannot be resident at all still gets
  // one block per SM here; its launch then reports the real error.
  return cache.emplace(key, std::max(per_sm, 1) * std::max(sms, 1)).first->second;
}

}  // namespace spes::cuda::norm
