// The seam between the grouped GEMMs' launchers (cuda/grouped_gemm.cu) and their
// Hopper family (cuda/grouped_gemm_sm90.cu): that family is a translation unit of its
// own because it alone is compiled for sm_90a (wgmma exists on no other target; see
// CMakeLists.txt), while the rest of cuda/ is built for the plain architectures.
// Internal to cuda/: the public contract is cuda/grouped_gemm.cuh, whose launchers
// check every argument before calling these.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/common.cuh"

namespace spes::cuda::grouped_sm90 {

// Whether the current device can run this family: a compute capability 9.0 GPU, and a
// build whose code for it is sm_90a (CMake defines SPES_SM90A_KERNELS for
// grouped_gemm_sm90.cu when it compiles it so) and whose kernels the driver loaded as
// that code. Asked of the runtime once per device, then cached.
bool available();
// Why not, when !available() (else empty).
std::string unavailable_reason();

// How many k-steps (of 64) before copying them each CTA asks L2 for the lines it
// streams from DRAM (grouped_gemm_sm90.cu, "Pipeline"); 0 asks for none. A setting of
// the process, read at each launch; bench_grouped_gemm times the choices side by side.
constexpr int kDefaultL2PrefetchKSteps = 4, kMaxL2PrefetchKSteps = 64;
int l2_prefetch_k_steps();
void set_l2_prefetch_k_steps(int k_steps);  // throws spes::Error outside [0, kMaxL2PrefetchKSteps]

// Each weight-gradient kernel deals its tiles out from a counter in device memory, one
// of this many slots per launch, taken in turn (cuda/grouped_gemm_wgrad_schedule.cuh).
constexpr int kTileTicketSlots = 16;

// The weight gradient's two kernels: `threads` (grouped_gemm_sm90.cu, whose threads
// copy the operands) and `tma` (grouped_gemm_tma_sm90.cu, fed by the copy engine; each
// file's comment says how it is shaped). A setting of the process, read at each
// launch; bench_grouped_gemm times both. `tma` where it cannot run
// (wgrad_tma_unavailable_reason) makes the weight gradient throw spes::Error.
enum class WgradKernel { threads, tma };
WgradKernel wgrad_kernel();
void set_wgrad_kernel(WgradKernel kernel);
// Sets the kernel until destroyed, then puts the one before back (tests, benches).
class ScopedWgradKernel {
 public:
  explicit ScopedWgradKernel(WgradKernel kernel) : before_(wgrad_kernel()) { set_wgrad_kernel(kernel); }
  ~ScopedWgradKernel() { set_wgrad_kernel(before_); }
  ScopedWgradKernel(const ScopedWgradKernel&) = delete;
  ScopedWgradKernel& operator=(const ScopedWgradKernel&) = delete;

 private:
  WgradKernel before_;
};
// Empty when the `tma` kernel can run on the current device: the sm_90a build and GPU,
// its shared memory, and the device's copies as cuda/tma.cuh's check finds them.
std::string wgrad_tma_unavailable_reason();

// The three products, same arguments and contract as grouped_matmul_* (already
// checked); S > 0 and, for the weight gradient, n_trained > 0.
void forward(bf16* out, const bf16* inp, const bf16* const* weights, const int32_t* offsets, int64_t S, int64_t E,
             int64_t C, int64_t OC, cudaStream_t stream);
void backward_input(bf16* dinp, const bf16* dout, const bf16* const* weights, const int32_t* offsets, int64_t S,
                    int64_t E, int64_t C, int64_t OC, cudaStream_t stream);
// grouped_matmul_forward_swiglu: forward's product (OC = 2H) with SwiGLU in its store.
void forward_swiglu(bf16* gate_up, bf16* h, const bf16* inp, const bf16* const* weights, const int32_t* offsets,
                    int64_t S, int64_t E, int64_t C, int64_t H, cudaStream_t stream);
// grouped_matmul_backward_input_swiglu: backward_input's product (C = H) with SwiGLU's
// backward in its store.
void backward_input_swiglu(bf16* dgate_up, bf16* h, const bf16* dout, const bf16* const* weights,
                           const bf16* gate_up, const int32_t* offsets, int64_t S, int64_t E, int64_t H, int64_t OC,
                           cudaStream_t stream);
// The weight gradient on the kernel wgrad_kernel() names.
void backward_weight(float* const* dweights, const bf16* dout, const bf16* inp, const int32_t* offsets,
                     const int32_t* trained_experts, int64_t n_trained, int64_t S, int64_t E, int64_t C, int64_t OC,
                     cudaStream_t stream);

// The `tma` kernel itself (backward_weight's contract).
void backward_weight_tma(float* const* dweights, const bf16* dout, const bf16* inp, const int32_t* offsets,
                         const int32_t* trained_experts, int64_t n_trained, int64_t S, int64_t E, int64_t C,
                         int64_t OC, cudaStream_t stream);

}  // namespace spes::cuda::grouped_sm90
