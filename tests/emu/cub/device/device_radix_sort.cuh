// The emulator's twin of CUB's DeviceRadixSort::SortPairs (the one CUB call of the
// project, cuda/embedding.cu): same signature and contract, on the host. tests/emu/
// leads the emulated build's include path, so <cub/device/device_radix_sort.cuh>
// finds this file. The contract as CUB documents it: a stable sort of the pairs by
// the key bits [begin_bit, end_bit); called with d_temp_storage == nullptr it only
// sets temp_storage_bytes; the temporary storage is scratch, overwritten (filled
// with 0xFF here, so a caller that lets it overlap the inputs or outputs sees
// garbage); all arrays are device memory.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "tests/emu/emu.hpp"

namespace cub {

struct DeviceRadixSort {
  template <typename Key, typename Value>
  static cudaError_t SortPairs(void* d_temp_storage, size_t& temp_storage_bytes, const Key* d_keys_in,
                               Key* d_keys_out, const Value* d_values_in, Value* d_values_out, int num_items,
                               int begin_bit = 0, int end_bit = int(sizeof(Key) * 8), cudaStream_t stream = nullptr) {
    // What a radix sort of this size might need: a copy of the pairs plus histograms.
    const size_t need = size_t(num_items) * (sizeof(Key) + sizeof(Value)) + 4096;
    if (d_temp_storage == nullptr) {
      temp_storage_bytes = need;
      return cudaSuccess;
    }
    if (num_items < 0 || begin_bit < 0 || end_bit > int(sizeof(Key) * 8) || begin_bit >= end_bit ||
        temp_storage_bytes < need)
      return cudaErrorInvalidValue;
    const size_t n = size_t(num_items);
    const std::string api = "cub::DeviceRadixSort::SortPairs, ";
    emu::require_device_buffer(d_temp_storage, need, api + "d_temp_storage");
    if (n == 0) return cudaSuccess;
    emu::require_device_buffer(d_keys_in, n * sizeof(Key), api + "d_keys_in");
    emu::require_device_buffer(d_keys_out, n * sizeof(Key), api + "d_keys_out");
    emu::require_device_buffer(d_values_in, n * sizeof(Value), api + "d_values_in");
    emu::require_device_buffer(d_values_out, n * sizeof(Value), api + "d_values_out");

    // On the stream: in a graph capture, at each replay (the keys are then the replay's).
    emu::on_stream(stream, [=] {
      const std::vector<Key> keys(d_keys_in, d_keys_in + n);
      const std::vector<Value> values(d_values_in, d_values_in + n);
      std::memset(d_temp_storage, 0xFF, need);
      const uint64_t mask = (end_bit - begin_bit == 64 ? ~uint64_t(0) : (uint64_t(1) << (end_bit - begin_bit)) - 1);
      auto digit = [&](size_t i) { return (uint64_t(keys[i]) >> begin_bit) & mask; };
      std::vector<size_t> order(n);
      std::iota(order.begin(), order.end(), size_t(0));
      std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return digit(a) < digit(b); });
      for (size_t i = 0; i < n; ++i) {
        d_keys_out[i] = keys[order[i]];
        d_values_out[i] = values[order[i]];
      }
    });
    return cudaSuccess;
  }
};

}  // namespace cub
