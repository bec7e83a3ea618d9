// A host emulator of the CUDA execution model, just wide enough to run the real
// source of cuda/attention.cu on a CPU (test_emu_attention): every CTA of a launch
// runs as blockDim.x cooperative fibers on one OS thread; __syncthreads, __syncwarp
// and the warp collectives (ldmatrix, mma, shfl) are barriers among those fibers.
//
// What it checks, each as one "EMU: ..." line and an abort (a GPU would fault or
// silently compute garbage; neither can be unwound through the fibers):
//   - shared memory: ldmatrix rows and cp.async destinations inside the launch's
//     dynamic allocation; a canary past its end (plain stores); NaN-filled (0xFF)
//     at the start of every CTA, so data read before it landed shows as NaN;
//   - 16-byte alignment of ldmatrix row addresses and of cp.async (both ends);
//   - cp.async sources inside a registered global buffer (GlobalBuffer), even with
//     src-size 0 (attention.cu relies on a valid address there);
//   - cp.async landing: when the issuing thread's wait_group retires its group
//     (Landing::at_wait: finds reads before the wait / the __syncthreads), or at
//     issue (Landing::at_issue: finds prefetches into a buffer other warps still read);
//   - warp collectives: all 32 lanes arrive at the same kind of collective (the
//     .sync.aligned rule: every thread of the warp executes the same instruction);
//     __syncthreads: all threads of the CTA; a round in which no fiber can move is
//     reported as a deadlock (a barrier some thread never reaches);
//   - launch: block ≤ 1024 threads (1-D only), grid limits, dynamic shared memory
//     ≤ 227 KB (sm_90) and above 48 KB only after cudaFuncSetAttribute opted in.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace emu {

[[noreturn]] void fail(const std::string& what);

// When a cp.async's bytes reach shared memory (see above). Both are legal hardware
// behaviours; a race-free kernel gives bit-identical results under either.
enum class Landing { at_wait, at_issue };
void set_landing(Landing landing);

// Runs `body` once per thread of each CTA of `grid`; CTAs spread over worker threads.
// `kernel` identifies the kernel for the dynamic-shared-memory opt-in check.
void launch(const void* kernel, dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& body);

// The running CTA's dynamic shared memory (thread_local: a CTA lives on one thread).
extern thread_local unsigned char* dynamic_smem;

// ---- what the shadow cuda/ptx.cuh and the built-ins below call ----------------
uint32_t shared_address(const void* p);  // byte offset in the CTA's dynamic smem
void cp_async(uint32_t dst, const void* src, int size, int src_size);
void cp_async_commit();
void cp_async_wait(int n);
void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr, bool trans);
void mma_m16n8k16_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
uint64_t shfl_xor(uint64_t value, int lane_mask);
void syncthreads();
void syncwarp();

// A "device" allocation: host memory the kernels may read by cp.async, with a canary
// past its end that is checked when it is destroyed.
class GlobalBuffer {
 public:
  explicit GlobalBuffer(size_t bytes);
  ~GlobalBuffer();
  GlobalBuffer(const GlobalBuffer&) = delete;
  GlobalBuffer& operator=(const GlobalBuffer&) = delete;
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(data_);
  }
  void poison() const;  // all bits set: NaN as fp32 and as bf16

 private:
  unsigned char* data_;
  size_t bytes_;
};

}  // namespace emu
