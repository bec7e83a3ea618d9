// Tensor maps (see tma.cuh).
#include "cuda/tma.cuh"

#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "engine/base/error.hpp"

namespace spes::cuda {

namespace {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled (its 12.0 ABI), looked up once.
EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t e =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found);
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr)
      throw Error("the CUDA driver has no cuTensorMapEncodeTiled (a driver for CUDA 12.0 or later is needed for "
                  "the Hopper kernels' bulk tensor copies)");
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}

}  // namespace

CUtensorMap bf16_matrix_map(const void* base, uint64_t rows, uint64_t cols, uint64_t ld, uint32_t box_rows,
                            uint32_t box_cols, CUtensorMapSwizzle swizzle) {
  // Encoded in a local of this frame, which the compiler aligns as the type asks (128
  // bytes; the driver requires 64), then copied out: the caller's slot the result would
  // otherwise be built in need not be (GCC 12 leaves a discarded call's temporary
  // misaligned).
  CUtensorMap encoded{};
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {ld * 2};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode_tiled()(&encoded, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims,
                                    strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error("cuTensorMapEncodeTiled refused a bf16 matrix of " + std::to_string(rows) + " × " +
                std::to_string(cols) + " (ld " + std::to_string(ld) + ", base " +
                std::to_string(reinterpret_cast<uintptr_t>(base) % 16) + " bytes past 16-byte alignment) in boxes of " +
                std::to_string(box_rows) + " × " + std::to_string(box_cols) + ": error " + std::to_string(int(r)));
  CUtensorMap map;
  std::memcpy(&map, &encoded, sizeof map);
  return map;
}

}  // namespace spes::cuda
