// A host emulator of the CUDA execution model, just wide enough to run the real
// source of the hand-written kernels of cuda/ on a CPU (test_emu): every
// CTA of a launch runs as one cooperative fiber per thread on one OS thread;
// __syncthreads, __syncwarp and the warp collectives (ldmatrix, mma, shfl, match)
// are barriers among those fibers.
//
// What it checks, each as one "EMU: ..." line and an abort (a GPU would fault or
// silently compute garbage; neither can be unwound through the fibers):
//   - shared memory: ldmatrix rows and cp.async destinations inside the launch's
//     dynamic allocation; a canary past its end (plain stores); NaN-filled (0xFF)
//     at the start of every CTA, so data read before it landed shows as NaN;
//   - 16-byte alignment of ldmatrix row addresses and of cp.async (both ends);
//   - cp.async sources inside a device buffer (in_device_buffer), even with
//     src-size 0 (attention.cu relies on a valid address there);
//   - cp.async landing: when the issuing thread's wait_group retires its group
//     (Landing::at_wait: finds reads before the wait / the __syncthreads), or at
//     issue (Landing::at_issue: finds prefetches into a buffer other warps still read);
//   - warp collectives: all 32 lanes arrive at the same kind of collective (the
//     .sync.aligned rule: every thread of the warp executes the same instruction);
//     __syncthreads: all threads of the CTA; a round in which no fiber can move is
//     reported as a deadlock (a barrier some thread never reaches);
//   - launch: block ≤ 1024 threads in whole warps, grid limits, dynamic shared
//     memory ≤ 227 KB (sm_90) and above 48 KB only after cudaFuncSetAttribute opted in
//     (static __shared__ arrays are not counted: their size is unknown here);
//   - thread-block clusters (launch_ex with a cluster dimension): each cluster's CTAs
//     run at once, each on its own OS thread; cluster.sync is a barrier over the
//     cluster's threads (one that cannot reach it is a deadlock, reported as above);
//     map_shared_rank takes a rank inside the cluster, an address in the caller's
//     shared memory (static or dynamic), and a CTA that has not exited yet (its
//     shared memory goes with it). A grid that is not a whole number of clusters, or
//     a cluster above the portable 8 CTAs, is refused as CUDA refuses it
//     (cudaErrorInvalidClusterSize);
//   - a kernel's pointer arguments point into device memory or pinned host memory
//     (device_reachable), not pageable host memory, which a GPU cannot read;
//   - global buffers (GlobalBuffer): a canary past the end, checked when freed;
//   - arenas (one cudaMalloc carved into buffers, which cuda/runtime.cu registers as
//     an NVTX memory pool): after every launch, the guard after each buffer unchanged
//     (the failure names the buffer written past); cp.async sources, cuBLAS operands
//     NCCL buffers and CUB sort operands inside one of the pool's buffers, as memcheck
//     holds them.
// Outside the emulator proper, the kernel files are compiled with
// -fsanitize=alignment: a vector access (int4, float4, Bf16x8, ...) off the alignment
// of its type aborts with UBSan's "runtime error: ... misaligned address" line, where
// a GPU faults with "misaligned address".
#pragma once
#include <cuda.h>  // CUtensorMap and its enums (types only: nothing of the driver is linked)
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>

namespace emu {

// Emulated GPUs, all H100s (so a data-parallel node's NCCL path runs on the host):
// sm_90 (CUDA C programming guide, "Compute Capabilities"), H100 SXM5's SM count.
constexpr int kDevices = 2;
constexpr int kSms = 132;
constexpr int kSmemOptinLimit = 227 * 1024;  // cudaDevAttrMaxSharedMemoryPerBlockOptin

[[noreturn]] void fail(const std::string& what);

// When a cp.async's bytes reach shared memory (see above). Both are legal hardware
// behaviours; a race-free kernel gives bit-identical results under either.
enum class Landing { at_wait, at_issue };
void set_landing(Landing landing);

// The order in which a CTA's threads run between barriers. round_robin: each thread in
// turn until it waits, so the warps move almost in step. warps_ascending / descending:
// one warp (its lanes in that order) runs until all of them wait at __syncthreads,
// then the next: each warp as far ahead of the others as the barriers let it, which
// shows a missing barrier between warps (a read before another warp's write, or a
// write over data another warp has yet to read) in one direction or the other. A
// race-free kernel gives bit-identical results under all three.
// The CTAs of a cluster follow suit: round_robin runs them all at once; the other two
// run one CTA at a time, in ascending or descending rank, each until it waits at
// cluster.sync or exits, so that one CTA gets as far ahead of the others as the
// cluster barriers let it (a read of another CTA's shared memory before it was
// written, or after that CTA exited, shows every time, not by the OS's timing).
// last_warp_starved: the CTA's last warp runs only in a round where no other thread can
// move, so it falls as far behind the others as their barriers let it: a barrier whose
// phases run ahead of a slow warp's wait shows (not among the schedules every rerun
// check takes; a test asks for it).
enum class Schedule { round_robin, warps_ascending, warps_descending, last_warp_starved };
void set_schedule(Schedule schedule);

// Runs `body` once per thread of each CTA of `grid`; CTAs spread over worker threads.
// `kernel` identifies the kernel for the dynamic-shared-memory opt-in check.
void launch(const void* kernel, dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& body);

// A launch with attributes (spes::cuda::launch_ex, cudaLaunchKernelEx): with a cluster
// dimension, clusters of CTAs as described above; without, as launch(). Returns what
// CUDA returns for a configuration it refuses; fails on an attribute not emulated.
cudaError_t launch_ex(const void* kernel, const cudaLaunchConfig_t& config, const std::function<void()>& body);
// The launches with a cluster dimension so far: which kernel a launcher chose.
uint64_t cluster_launches();

// The running CTA's dynamic shared memory (thread_local: a CTA lives on one thread).
extern thread_local unsigned char* dynamic_smem;

// ---- what the shadow cuda/ptx.cuh and the built-ins below call ----------------
uint32_t shared_address(const void* p);  // byte offset in the CTA's dynamic smem
void cp_async(uint32_t dst, const void* src, int size, int src_size);
void cp_async_commit();
void cp_async_wait(int n);
void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr, bool trans);
void mma_m16n8k16_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
// What the shadow cuda/ptx_sm90.cuh calls: one thread's part of wgmma m64nNk16 bf16
// (d: its n/2 accumulators), the group commit and wait (see emu.cpp).
void wgmma_bf16(float* d, int n, uint64_t desc_a, uint64_t desc_b, bool accumulate, bool trans_a, bool trans_b);
// The same with A from registers: a, the thread's part of the A fragment (cuda/ptx_sm90.cuh, wgmma_rs).
void wgmma_bf16_rs(float* d, int n, const uint32_t (&a)[4], uint64_t desc_b, bool accumulate, bool trans_b);
void wgmma_fence();
void wgmma_commit();
void wgmma_wait(int n);
// fence.proxy.async.shared::cta: the shared bytes this thread wrote through the generic
// proxy (landed cp.async, st_shared_zero16) become readable by wgmma (which reads
// shared memory through the async proxy; see emu.cpp).
void fence_proxy_async_shared();
// st.shared.v4 of zeros at shared offset addr (16-byte aligned), tracked as cp.async's
// bytes are for fence_proxy_async_shared.
void st_shared_zero16(uint32_t addr);
// The wgmma issued so far, by every thread of every launch: which kernel family a
// launcher chose (the two families of a product may well give the same bits here).
uint64_t wgmma_issued();
// From now on (true) wgmma with A from registers reads registers 1 and 2 of the A
// fragment swapped: a GPU whose fragment layout is not the one we decoded, for the
// test of the attention launchers' check of their sm90a kernels (false: as decoded).
void set_wgmma_a_misread(bool misread);
// red.global.add.v2.f32: dst[0] += a, dst[1] += b (dst 8-byte aligned, in a device
// buffer), subnormal inputs and results flushed to sign-preserving zero.
void red_add_f32x2(float* dst, float a, float b);
// The mbarrier and the bulk tensor copy (sm_90; see emu.cpp): init with the arrival
// count; arrive, after adding expect_tx_bytes to the phase's transaction count;
// try_wait.parity (false: the phase of that parity has not completed; the thread
// yields); a copy of the box at coords (innermost first) of a tensor map into shared
// memory at dst, its bytes completed on the mbarrier at mbar.
void mbarrier_init(uint32_t addr, uint32_t count);
void fence_mbarrier_init();
void mbarrier_arrive(uint32_t addr, uint32_t expect_tx_bytes);
bool mbarrier_try_wait_parity(uint32_t addr, uint32_t parity);
// Before a wait for the completion of phase `phase` (counted from 0 at init; −1: the
// one before the first, complete): fails unless the barrier is in that phase or the
// next, the only two a parity can tell apart.
void mbarrier_check_phase(uint32_t addr, int64_t phase);
void tma_load(uint32_t dst, const void* tensor_map, const int32_t* coords, uint32_t rank, uint32_t mbar);
// The bulk tensor copies issued so far, by every launch: whether a launcher took a
// kernel fed by them.
uint64_t tma_copies();
// cuTensorMapEncodeTiled, as the emulated runtime's cudaGetDriverEntryPointByVersion
// hands it out: the driver's checks, and a map only the emulated copy reads.
CUresult encode_tensor_map_tiled(CUtensorMap* map, CUtensorMapDataType type, uint32_t rank, void* global,
                            const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                            const uint32_t* element_strides, CUtensorMapInterleave interleave,
                            CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill fill);
enum class Shuffle { bfly, up, idx };
uint64_t shuffle(Shuffle mode, uint64_t value, int b);  // the value of another lane
uint32_t match_any(uint64_t value);                     // the lanes holding the same value
void syncthreads();
void syncwarp();

// ---- what the shadow <cooperative_groups.h> calls (cluster launches only) -----
unsigned cluster_block_rank();
unsigned cluster_num_blocks();
void cluster_sync();
void* map_shared_rank(const void* p, int rank);  // p's twin in CTA `rank` of the cluster

// The calling thread's current device (cudaSetDevice), and a check that `stream`
// belongs to it (tests/emu/runtime_emu.cpp): fails like a launch CUDA would refuse.
int current_device();
void require_current_device(cudaStream_t stream, const char* what);
// Work enqueued on `stream` (a launch, a library call, a memset or a copy): done now,
// or, while the stream captures a graph (cudaStreamBeginCapture), kept for every
// cudaGraphLaunch of it. `work` owns copies of what it reads from the call.
void on_stream(cudaStream_t stream, std::function<void()> work);
// Whether `stream` is capturing: calls a capture cannot hold (a synchronization, a
// copy to or from host memory) refuse with cudaErrorStreamCaptureUnsupported then.
bool capturing(cudaStream_t stream);

// Whether [p, p + bytes) lies inside one registered global buffer (a GlobalBuffer);
// require_device fails (naming `what`) unless it does or bytes is 0.
bool in_global_buffer(const void* p, size_t bytes);
void require_device(const void* p, size_t bytes, const std::string& what);

// As in_global_buffer, and where the range lies in an NVTX memory pool (the arena,
// registered by cuda/runtime.cu; tests/emu/nvtx_emu.cpp), inside one of its regions:
// what memcheck holds a kernel's or a library's accesses to. require_device_buffer
// fails (naming `what`) unless it does or bytes is 0.
bool in_device_buffer(const void* p, size_t bytes);
void require_device_buffer(const void* p, size_t bytes, const std::string& what);
// Fails (naming the launch that `after` describes, called only then) if a byte of a
// pool outside its regions (an arena's guard) changed since the regions were
// registered: run after every kernel launch.
void check_pool_guards(const std::function<std::string()>& after);
// Fails if an NVTX heap is still registered in [p, p + bytes): cudaFree calls it.
void require_no_pool_in(const void* p, size_t bytes);

// Whether a GPU kernel could dereference p: it points into a device allocation (into
// or just past one buffer of an arena) or into pinned host memory (which a GPU
// reaches through unified addressing). A pointer into pageable host memory — a
// std::vector's data(), a stack variable — faults on a GPU and works here.
bool device_reachable(const void* p);
// A kernel's pointer arguments must be null or device_reachable: checked at launch,
// before the kernel runs, naming the kernel and the argument's position (from 1).
[[noreturn]] void fail_kernel_argument(const void* kernel, int position, const void* p);
template <class... Args>
void require_device_pointers(const void* kernel, const Args&... args) {
  int position = 0;
  auto check = [&](const auto& arg) {
    if constexpr (std::is_pointer_v<std::decay_t<decltype(arg)>>)
      if (arg != nullptr && !device_reachable(arg)) fail_kernel_argument(kernel, position, arg);
    ++position;
  };
  (check(args), ...);
}

// A "device" allocation: host memory the kernels may read by cp.async, with a canary
// past its end that is checked when it is destroyed.
class GlobalBuffer {
 public:
  explicit GlobalBuffer(size_t bytes);
  ~GlobalBuffer();
  GlobalBuffer(GlobalBuffer&& other) noexcept;  // other is left empty
  GlobalBuffer& operator=(GlobalBuffer&&) = delete;
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }
  void poison() const;  // all bits set: NaN as fp32 and as bf16
  void zero() const;

 private:
  unsigned char* data_;
  size_t bytes_;
};

}  // namespace emu
