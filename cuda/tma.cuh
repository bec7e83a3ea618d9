// Tensor maps for the Hopper bulk tensor copy (TMA, `cp.async.bulk.tensor`, sm_90):
// the copy engine moves a whole box of a tensor from global into shared memory,
// zero-filling what lies outside the tensor and laying it out in a wgmma swizzle,
// and reports its bytes on an mbarrier (cuda/ptx_sm90.cuh). What it copies is
// described once on the host by a CUtensorMap, passed to the kernel by value
// (`const __grid_constant__ CUtensorMap`).
//
// The map is made by the driver's cuTensorMapEncodeTiled, reached through the
// runtime's cudaGetDriverEntryPointByVersion so that nothing links libcuda itself
// (the emulator, tests/emu/, hands out its own encoder there).
#pragma once
#include <cuda.h>

#include <cstdint>
#include <string>

namespace spes::cuda {

// A map of a row-major bf16 matrix of rows × cols elements, ld elements from one row
// to the next (ld · 2 bytes a multiple of 16, base 16-byte aligned), copied in boxes of
// box_rows × box_cols; with a swizzle, box_cols · 2 bytes is its span (128 bytes:
// 64 columns, the layout the wgmma operands of cuda/grouped_gemm_sm90.cu use).
// Throws spes::Error naming the shape when the driver refuses it.
CUtensorMap bf16_matrix_map(const void* base, uint64_t rows, uint64_t cols, uint64_t ld, uint32_t box_rows,
                            uint32_t box_cols, CUtensorMapSwizzle swizzle);

// Empty when the current device can run the bulk tensor copy's sm_90a code (as
// sm90a_unavailable_reason, cuda/sm90a_device.cuh), else why not.
std::string tma_unavailable_reason();
// Empty when the device's copies, barriers and a wgmma on copied boxes give what the
// emulator's do (cuda/tma_check.cu: run once per device and process), or when it cannot
// run them; else what differed. A kernel family built on TMA asks it before its first
// run on a device, as the attention launchers ask theirs.
std::string tma_check_failure();

}  // namespace spes::cuda
