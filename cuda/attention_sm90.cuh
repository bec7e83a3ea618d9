// The seam between the attention launchers (cuda/attention.cu) and their Hopper
// kernels (cuda/attention_sm90.cu): a translation unit of its own because it alone
// is compiled for sm_90a (wgmma exists on no other target; see CMakeLists.txt), while
// the rest of cuda/ is built for the plain architectures. Internal to cuda/: the
// public contract is cuda/attention.cuh, whose launchers check every argument before
// calling these.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/common.cuh"

namespace spes::cuda::attention_sm90 {

// Whether the current device can run these kernels: a compute capability 9.0 GPU, a
// build whose code for it is sm_90a (CMake defines SPES_SM90A_KERNELS for
// attention_sm90.cu when it compiles it so) and whose kernels the driver loaded as
// that code, and enough shared memory per block. Asked of the runtime once per
// device, then cached.
bool available();
// Why not, when !available() (else empty).
std::string unavailable_reason();

// attention_forward (already checked; B, T > 0, D = 64 or 128).
void forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int B, int T, int H, int Hkv, int D,
             cudaStream_t stream);

// dK, dV and dQ of attention_backward (already checked; B, T > 0, D = 64 or 128),
// given dsum, the row sums D_i = Σ_d dout·out that attention.cu's dsum kernel wrote.
void backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
              const float* lse, const float* dsum, int B, int T, int H, int Hkv, int D, cudaStream_t stream);

}  // namespace spes::cuda::attention_sm90
