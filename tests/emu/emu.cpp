// The emulator's runtime (see emu.hpp): fibers and the per-CTA scheduler, barriers
// and warp collectives, cp.async, launch, and the few CUDA runtime calls the
// launchers make. This executable does not link libcudart: a call to any other
// runtime function fails to link, so the emulated surface is exactly the one the
// kernels use.
#include "tests/emu/emu.hpp"

#include <cxxabi.h>
#include <elf.h>
#include <link.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda/check.cuh"
#include "tests/emu/builtins.hpp"

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

namespace emu {

thread_local unsigned char* dynamic_smem = nullptr;

void fail(const std::string& what) {
  std::fprintf(stderr, "EMU: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

namespace {

constexpr unsigned kWarpSize = 32;
// The rest of the H100 (kSms, kSmemOptinLimit in emu.hpp): what the runtime calls
// below answer and the launches are checked against.
constexpr size_t kDefaultSmemLimit = 48 * 1024;  // without cudaFuncSetAttribute
constexpr size_t kSmemPerSm = 228 * 1024;
constexpr size_t kSmemReservedPerBlock = 1024;  // by the system, per resident block
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr int kMaxThreadsPerSm = 2048;
constexpr int kMaxBlocksPerSm = 32;
constexpr unsigned kMaxClusterSize = 8;  // portable (without cudaFuncAttributeNonPortableClusterSizeAllowed)
// A cluster's CTAs share one GPC. An H100 SXM5's 132 SMs lie in GPCs of different
// sizes; counted here as 8 GPCs of 16 SMs (the cluster occupancy below).
constexpr int kGpcs = 8;
constexpr int kSmsPerGpc = 16;
constexpr unsigned kMaxWorkers = 8;
// Canary bytes past each allocation, wide enough that an overrun lands in them, not
// in the heap: a store_rows without its T guard writes up to 15 rows of H·D bf16
// past a tensor (30 KB at H = 8, D = 128).
constexpr size_t kSmemCanaryBytes = 1024;
constexpr size_t kGlobalCanaryBytes = 64 * 1024;
constexpr unsigned char kCanary = 0xA5;
constexpr unsigned char kPoison = 0xFF;  // NaN as fp32 and as bf16
// A fiber's deepest stack measured 4 KB (-O3) and 5 KB (-O0); the rest is margin,
// checked by a canary word at the stack's low end.
constexpr size_t kFiberStackWords = 8 * 1024;  // 64 KB
constexpr uint64_t kStackCanary = 0x5a5a5a5a5a5a5a5aull;

Landing g_landing = Landing::at_wait;
Schedule g_schedule = Schedule::round_robin;
// cudaFuncSetAttribute(kernel, MaxDynamicSharedMemorySize, bytes), per kernel. The
// ranks of a data-parallel node launch from their own host threads: locked.
std::mutex g_smem_optin_mutex;
std::map<const void*, int> g_smem_optin;
std::atomic<uint64_t> g_cluster_launches{0};
std::atomic<uint64_t> g_wgmma_issued{0};
std::atomic<uint64_t> g_tma_copies{0};
std::atomic<bool> g_wgmma_a_misread{false};  // see set_wgmma_a_misread

// cudaFuncAttributeMaxDynamicSharedMemorySize of `kernel`.
int dynamic_smem_limit(const void* kernel) {
  std::lock_guard lock(g_smem_optin_mutex);
  const auto it = g_smem_optin.find(kernel);
  return it != g_smem_optin.end() ? it->second : int(kDefaultSmemLimit);
}

struct Range {
  uintptr_t begin;
  size_t bytes;
};
// Read by every launch's workers, changed by GlobalBuffer (cudaMalloc/cudaFree), which
// another host thread (a data-parallel rank) may call during a launch: locked.
std::shared_mutex g_global_buffers_mutex;
std::vector<Range> g_global_buffers;

unsigned threads_of(const dim3& block) { return block.x * block.y * block.z; }

std::string str(const dim3& d) {
  char s[48];
  std::snprintf(s, sizeof s, "(%u,%u,%u)", d.x, d.y, d.z);
  return s;
}

// ---- fiber switch ----------------------------------------------------------------
// swapcontext saves and restores the signal mask, a system call per switch, which
// was 90 % of the emulator's time. This switch keeps only what the SysV x86-64 ABI
// has a callee preserve: rbx, rbp, r12-r15, the MXCSR and the x87 control word. It
// pushes them on the current stack, stores the stack pointer in *from, loads `to`
// and pops the other side's. (No shadow-stack support: Linux leaves it off unless a
// program asks for it.)
#if !defined(__x86_64__)
#error "the emulator's fiber switch is x86-64 assembly"
#endif
extern "C" void emu_switch_fiber(void** from, void* to);
asm(R"(
  .text
  .globl emu_switch_fiber
  .type emu_switch_fiber, @function
emu_switch_fiber:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_switch_fiber, .-emu_switch_fiber
)");

// ---- CTA state -----------------------------------------------------------------

struct Copy {
  uint32_t dst;
  const void* src;
  int size, src_size;
  uint64_t group;
};

// One thread's part of a wgmma.mma_async (sm_90a): its fragment of D, to be computed
// from shared memory when the emulator runs it (see wgmma_bf16).
struct Wgmma {
  float* d;
  int n;
  uint64_t desc_a, desc_b;
  bool accumulate, trans_a, trans_b;
  uint64_t group;
  bool a_in_registers = false;  // wgmma_bf16_rs: A is a_rows, not desc_a
  float a_rows[2][16] = {};     // rows row0 and row0 + 8 of A (see run_wgmma)
};

struct Fiber {  // one CUDA thread
  void* stack_pointer = nullptr;  // while switched out
  bool exited = false;
  const char* waiting_at = "";  // for the deadlock report
  std::vector<Copy> in_flight;  // cp.async issued and not landed, in issue order
  uint64_t committed_groups = 0;  // also the number of the open group
  std::vector<Wgmma> wgmma_pending;  // wgmma issued and not run, in issue order
  uint64_t wgmma_groups = 0;         // committed wgmma groups; also the open one's number
  uint64_t wgmma_count = 0;          // wgmma issued by this thread so far
  bool wgmma_fenced = false;         // a wgmma.fence since its last wgmma.wait_group (or its start)
  // Its wgmma with A from registers not yet waited for: the group, the caller's
  // registers and their values at issue (see wgmma_wait).
  struct RegisterA {
    uint64_t group;
    const uint32_t* registers;
    uint32_t at_issue[4];
  };
  std::vector<RegisterA> register_a;
  // Its landed cp.async (destination, bytes) not yet behind a fence.proxy.async.
  std::vector<std::pair<uint32_t, int>> unfenced;
};

// What every thread of a warpgroup must give its k-th wgmma alike (PTX ISA, wgmma:
// one instruction for the warpgroup, .aligned; the matrix descriptors the same across
// its warps): the first of its 128 threads to issue it records this, the others
// compare (see require_warpgroup_uniform).
struct WgmmaIssue {
  int n;
  uint64_t desc_a, desc_b;  // desc_a 0 with A from registers
  bool accumulate, trans_a, trans_b, a_in_registers;
  bool operator==(const WgmmaIssue&) const = default;
};

enum class Collective : uint8_t { syncwarp, ldmatrix, ldmatrix_trans, mma, shfl_bfly, shfl_up, shfl_idx, match_any };

const char* name(Collective c) {
  switch (c) {
    case Collective::syncwarp: return "__syncwarp";
    case Collective::ldmatrix: return "ldmatrix";
    case Collective::ldmatrix_trans: return "ldmatrix.trans";
    case Collective::mma: return "mma";
    case Collective::shfl_bfly: return "shfl.bfly";
    case Collective::shfl_up: return "shfl.up";
    case Collective::shfl_idx: return "shfl.idx";
    case Collective::match_any: return "match.any";
  }
  return "?";
}

// A warp-wide operation: every lane deposits its operands in `in` and arrives; the
// last to arrive computes all 32 lanes' results into `out`. One barrier suffices:
// no lane can deposit the next operation's operands before every lane has arrived
// there, i.e. has read its result of this one.
struct Warp {
  unsigned arrived = 0;
  uint64_t generation = 0;
  Collective kind[kWarpSize];
  uint32_t in[kWarpSize][10];
  uint32_t out[kWarpSize][4];
};

// A bulk tensor copy (TMA, sm_90) issued and not landed: the bytes it puts at dst of
// the shared memory, as the box lies there (zero fill and swizzle applied), read from
// global memory at issue.
struct TensorCopy {
  uint32_t dst;
  std::vector<unsigned char> bytes;
};

// An mbarrier object (PTX ISA, "Parallel Synchronization and Communication
// Instructions: mbarrier"): the arrivals a phase expects, those still pending, the
// transaction count (bytes expected and not yet delivered; it may go below zero when a
// copy completes before its expect_tx), the phases completed, and the bulk copies that
// will complete bytes on it.
struct Mbarrier {
  uint32_t expected = 0, pending = 0;
  int64_t tx = 0;
  uint64_t phase = 0;
  std::vector<TensorCopy> in_flight;
  unsigned unfenced_by = 0;  // 1 + the thread that initialized it, until it runs fence.mbarrier_init
};

struct Cluster;

struct Cta {
  size_t smem_bytes = 0;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  unsigned current = 0;  // the running fiber
  unsigned exited = 0;   // fibers whose thread returned
  unsigned barrier_arrived = 0;
  uint64_t barrier_generation = 0;
  uint64_t progress = 0;  // barriers completed + threads exited: the deadlock check
  // The wgmma some thread of a warpgroup issued and not all 128 have: (warpgroup, k) →
  // the first one's operands and how many threads issued it so far.
  std::map<std::pair<unsigned, uint64_t>, std::pair<WgmmaIssue, unsigned>> wgmma_issues;
  // Per byte of dynamic shared memory: 1 + the thread whose landed cp.async wrote it
  // last, while that thread has not run fence.proxy.async since; else 0. Sized at the
  // CTA's first cp.async.
  std::vector<uint16_t> unfenced_by;
  // The mbarriers (sm_90) initialized in its shared memory, by address (see the
  // mbarrier section).
  std::map<uint32_t, Mbarrier> mbarriers;
  void* scheduler_stack_pointer = nullptr;
  const std::function<void()>* body = nullptr;
  // In a cluster launch (else null): this CTA's rank, its fibers waiting at
  // cluster.sync, and the cluster barriers completed as it last saw them.
  Cluster* cluster = nullptr;
  unsigned rank = 0;
  unsigned cluster_arrived = 0;
  uint64_t cluster_generation = 0;
};

// One cluster being run: its CTAs, one per OS thread of a team (run_clusters), and
// what cluster.sync and map_shared_rank need of one another. Locked: the CTAs run at
// once (or, in the sequential schedules, hand the turn over from thread to thread).
struct Cluster {
  enum class State : uint8_t { running, blocked, finished };  // blocked: at cluster.sync
  struct Member {
    unsigned char* smem = nullptr;  // its dynamic shared memory
    uintptr_t thread_pointer = 0;   // locates its static __shared__ (map_shared_rank)
    State state = State::running;
  };
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<Member> members;  // by rank
  std::vector<unsigned> order;  // sequential schedules: the ranks in turn order; empty: all at once
  unsigned turn = 0;            // sequential schedules: the rank that runs
  uint64_t generation = 0;      // cluster barriers completed
};

thread_local Cta* t_cta = nullptr;

Fiber& this_fiber() { return t_cta->fibers[t_cta->current]; }

void yield(const char* waiting_at) {
  Fiber& f = this_fiber();
  f.waiting_at = waiting_at;
  emu_switch_fiber(&f.stack_pointer, t_cta->scheduler_stack_pointer);
}

[[noreturn]] void fiber_main() {
  (*t_cta->body)();
  if (!this_fiber().wgmma_pending.empty()) fail("a thread exited with a wgmma it never waited for");
  this_fiber().exited = true;
  ++t_cta->exited;
  ++t_cta->progress;
  yield("exit");
  fail("a fiber resumed after its thread exited");
}

// A fresh fiber's stack, laid out as if fiber_main's first instruction had called
// emu_switch_fiber: the saved registers (zero), the current MXCSR and x87 control
// word, fiber_main as the return address, and above it the fake return address of
// fiber_main itself, which puts the stack pointer at fiber_main's entry where the ABI
// wants it (8 below a 16-byte boundary). Returns the stack pointer to switch to.
void* prepare_stack(uint64_t* stack, size_t words) {
  uint32_t mxcsr;
  uint16_t x87_control;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(x87_control));
  uint64_t* top = stack + words;  // 16-byte aligned
  top[-1] = 0;
  top[-2] = reinterpret_cast<uint64_t>(&fiber_main);
  std::fill(top - 8, top - 2, 0);  // rbp, rbx, r12-r15
  top[-9] = mxcsr | uint64_t(x87_control) << 32;
  return top - 9;
}

unsigned char* shared_bytes(uint32_t addr, size_t bytes, const char* what) {
  if (size_t(addr) + bytes > t_cta->smem_bytes)
    fail(std::string(what) + ": shared bytes [" + std::to_string(addr) + ", " + std::to_string(addr + bytes) +
         ") outside the " + std::to_string(t_cta->smem_bytes) + "-byte dynamic allocation");
  return dynamic_smem + addr;
}

void require_aligned(uint64_t address, unsigned alignment, const char* what) {
  if (address % alignment != 0)
    fail(std::string(what) + ": address " + std::to_string(address) + " not " + std::to_string(alignment) +
         "-byte aligned");
}

// ---- warp collectives ------------------------------------------------------------

template <class Compute>
void arrive_and_wait(Warp& w, unsigned lane, Collective kind, Compute&& compute) {
  w.kind[lane] = kind;
  const uint64_t generation = w.generation;
  if (++w.arrived < kWarpSize) {
    while (w.generation == generation) yield(name(kind));
    return;
  }
  for (unsigned l = 0; l < kWarpSize; ++l)
    if (w.kind[l] != kind)
      fail("warp " + std::to_string(t_cta->current / kWarpSize) + " diverged: lane " + std::to_string(l) +
           " at " + name(w.kind[l]) + ", lane " + std::to_string(lane) + " at " + name(kind));
  compute(w);
  w.arrived = 0;
  ++w.generation;
  ++t_cta->progress;
}

struct Lane {
  Warp& warp;
  unsigned lane;
};
Lane this_lane() { return {t_cta->warps[t_cta->current / kWarpSize], t_cta->current % kWarpSize}; }

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 (PTX ISA): lanes 8i..8i+7 give
// the addresses of the 8 rows (16 bytes each) of matrix i; register i of lane l
// receives two elements of matrix i, g = l/4, t = l%4:
//   plain:  (row g, col 2t) low half, (row g, col 2t+1) high half;
//   .trans: (row 2t, col g) low half, (row 2t+1, col g) high half.
void load_matrices(Warp& w, bool trans) {
  const unsigned char* rows[kWarpSize];
  for (unsigned l = 0; l < kWarpSize; ++l) {
    require_aligned(w.in[l][0], 16, "ldmatrix row");
    rows[l] = shared_bytes(w.in[l][0], 16, "ldmatrix");
  }
  for (unsigned l = 0; l < kWarpSize; ++l) {
    const unsigned g = l / 4, t = l % 4;
    for (unsigned i = 0; i < 4; ++i) {
      uint16_t lo, hi;
      if (!trans) {
        std::memcpy(&lo, rows[8 * i + g] + 4 * t, 2);
        std::memcpy(&hi, rows[8 * i + g] + 4 * t + 2, 2);
      } else {
        std::memcpy(&lo, rows[8 * i + 2 * t] + 2 * g, 2);
        std::memcpy(&hi, rows[8 * i + 2 * t + 1] + 2 * g, 2);
      }
      w.out[l][i] = uint32_t(lo) | uint32_t(hi) << 16;
    }
  }
}

float as_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// bf16 is the high half of an fp32.
float low_bf16(uint32_t pair) { return as_float(pair << 16); }
float high_bf16(uint32_t pair) { return as_float(pair & 0xffff0000u); }
uint32_t as_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (PTX ISA fragment tables;
// g = lane/4, t = lane%4; a bf16 pair holds the lower column (A) or row (B) in its
// low half):
//   A 16×16: reg0 = A[g][2t..2t+1], reg1 = A[g+8][2t..2t+1], reg2 = A[g][2t+8..2t+9],
//            reg3 = A[g+8][2t+8..2t+9]
//   B 16×8:  reg0 = B[2t..2t+1][g], reg1 = B[2t+8..2t+9][g]
//   C, D 16×8 fp32: c0, c1 = C[g][2t..2t+1], c2, c3 = C[g+8][2t..2t+1]
// Products of bf16 are exact in fp32; the sum runs in fp32 in k order (the hardware's
// order is unspecified). Operands: in[l] = a0..a3, b0, b1, c0..c3.
void multiply_tiles(Warp& w) {
  float A[16][16], B[16][8], C[16][8];
  for (unsigned l = 0; l < kWarpSize; ++l) {
    const unsigned g = l / 4, t = l % 4;
    const uint32_t* in = w.in[l];
    const unsigned a_rows[4] = {g, g + 8, g, g + 8}, a_cols[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
    for (unsigned r = 0; r < 4; ++r) {
      A[a_rows[r]][a_cols[r]] = low_bf16(in[r]);
      A[a_rows[r]][a_cols[r] + 1] = high_bf16(in[r]);
    }
    for (unsigned r = 0; r < 2; ++r) {
      B[2 * t + 8 * r][g] = low_bf16(in[4 + r]);
      B[2 * t + 8 * r + 1][g] = high_bf16(in[4 + r]);
    }
    for (unsigned e = 0; e < 4; ++e) C[g + 8 * (e / 2)][2 * t + e % 2] = as_float(in[6 + e]);
  }
  for (unsigned m = 0; m < 16; ++m)
    for (unsigned n = 0; n < 8; ++n) {
      float sum = C[m][n];
      for (unsigned k = 0; k < 16; ++k) sum += A[m][k] * B[k][n];
      C[m][n] = sum;
    }
  for (unsigned l = 0; l < kWarpSize; ++l) {
    const unsigned g = l / 4, t = l % 4;
    for (unsigned e = 0; e < 4; ++e) w.out[l][e] = as_bits(C[g + 8 * (e / 2)][2 * t + e % 2]);
  }
}

// shfl.sync.{bfly,up,idx}.b32 (PTX ISA) over the whole warp (CUDA's width 32): lane l
// reads the value of lane
//   bfly: l ^ b (b < 32, its lane mask);
//   up:   l − b, or keeps its own value where l − b < 0 (b: its delta);
//   idx:  b mod 32 (b: its source lane; __shfl_sync takes srcLane modulo width).
// A 64-bit value is two such shuffles. Operands: in[l] = value low word, high word, b.
void exchange(Warp& w, Collective mode) {
  for (unsigned l = 0; l < kWarpSize; ++l) {
    const uint32_t b = w.in[l][2];
    unsigned source = l;
    if (mode == Collective::shfl_bfly) {
      if (b >= kWarpSize) fail("shfl.bfly lane mask " + std::to_string(b) + " ≥ 32");
      source = l ^ b;
    } else if (mode == Collective::shfl_up) {
      source = b <= l ? l - b : l;
    } else {
      source = b % kWarpSize;
    }
    w.out[l][0] = w.in[source][0];
    w.out[l][1] = w.in[source][1];
  }
}

// match.any.sync.b32/.b64 (PTX ISA): each lane gets the mask of the lanes whose value
// equals its own. Operands: in[l] = value low word, high word.
void match_values(Warp& w) {
  for (unsigned l = 0; l < kWarpSize; ++l) {
    uint32_t same = 0;
    for (unsigned m = 0; m < kWarpSize; ++m)
      if (w.in[m][0] == w.in[l][0] && w.in[m][1] == w.in[l][1]) same |= 1u << m;
    w.out[l][0] = same;
  }
}

// ---- cp.async ----------------------------------------------------------------------

// Shared bytes [dst, dst + size) the current thread just wrote through the generic
// proxy (a landed cp.async, st.shared): its own until it runs fence.proxy.async (see
// fence_proxy_async_shared), which a wgmma reading them requires.
void mark_generic_write(uint32_t dst, int size) {
  std::vector<uint16_t>& by = t_cta->unfenced_by;
  if (by.empty()) by.assign(t_cta->smem_bytes, 0);
  std::fill(by.begin() + dst, by.begin() + dst + size, uint16_t(t_cta->current + 1));
  this_fiber().unfenced.emplace_back(dst, size);
}

// PTX cp.async: src-size bytes are read, the rest of the cp-size destination bytes
// are written as zeros.
void land(const Copy& c) {
  unsigned char* dst = dynamic_smem + c.dst;
  std::memcpy(dst, c.src, size_t(c.src_size));
  std::memset(dst + c.src_size, 0, size_t(c.size - c.src_size));
  mark_generic_write(c.dst, c.size);
}

// ---- thread-block clusters ----------------------------------------------------------

bool may_run(const Cluster& c, unsigned rank) {
  return c.members[rank].state == Cluster::State::running && (c.order.empty() || c.turn == rank);
}

// Waits until CTA `rank` may run (in a sequential schedule: until its turn); returns
// the number of cluster barriers completed so far.
uint64_t wait_to_run(Cluster& c, unsigned rank) {
  std::unique_lock lock(c.mutex);
  c.changed.wait(lock, [&] { return may_run(c, rank); });
  return c.generation;
}

// CTA `rank` stops running: blocked (every live thread of it waits at cluster.sync) or
// finished. Once none runs, the barrier completes for the blocked ones: barrier.cluster
// waits for the cluster's non-exited threads only (PTX ISA). A sequential schedule
// then gives the turn to the first running CTA in its order. A blocked CTA returns
// once it may run again, with the number of barriers completed.
uint64_t stop(Cluster& c, unsigned rank, Cluster::State state) {
  using State = Cluster::State;
  {
    std::lock_guard lock(c.mutex);
    c.members[rank].state = state;
    auto any = [&](State s) {
      return std::any_of(c.members.begin(), c.members.end(), [s](const Cluster::Member& m) { return m.state == s; });
    };
    if (!any(State::running) && any(State::blocked)) {
      ++c.generation;
      for (Cluster::Member& m : c.members)
        if (m.state == State::blocked) m.state = State::running;
    }
    const auto next =
        std::find_if(c.order.begin(), c.order.end(), [&](unsigned r) { return c.members[r].state == State::running; });
    if (next != c.order.end()) c.turn = *next;
  }
  c.changed.notify_all();
  return state == State::blocked ? wait_to_run(c, rank) : 0;
}

Cta& cluster_cta(const char* what) {
  if (t_cta == nullptr || t_cta->cluster == nullptr)
    fail(std::string(what) +
         " in a launch without a cluster dimension (an implicit cluster of one CTA is not emulated)");
  return *t_cta;
}

// A static __shared__ variable is a thread_local of this executable (builtins.hpp). Its
// TLS block ends at the thread pointer (x86-64's TLS variant II) and has the same
// layout in every thread, so the variable's twin in another thread lies at the same
// offset from that thread's pointer.
uintptr_t thread_pointer() {
  uintptr_t tp;
  asm("movq %%fs:0, %0" : "=r"(tp));  // the thread control block's pointer to itself
  return tp;
}

// The size of that block, with its alignment as margin.
size_t executable_tls_bytes() {
  static const size_t bytes = [] {
    size_t b = 0;
    dl_iterate_phdr(
        [](dl_phdr_info* info, size_t, void* out) {
          for (unsigned i = 0; i < info->dlpi_phnum; ++i)
            if (info->dlpi_phdr[i].p_type == PT_TLS)
              *static_cast<size_t*>(out) = info->dlpi_phdr[i].p_memsz + info->dlpi_phdr[i].p_align;
          return 1;  // the first object listed is the executable
        },
        &b);
    return b;
  }();
  return bytes;
}

// The name of the kernel at `address`, from the executable's ELF symbol table: the
// kernels live in anonymous namespaces, local symbols that dladdr does not see. Only
// for failure messages (it reads /proc/self/exe); "a kernel" when not found.
std::string kernel_name(const void* address) {
  uintptr_t bias = 0;  // where the (position-independent) executable was loaded
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        *static_cast<uintptr_t*>(out) = info->dlpi_addr;
        return 1;  // the first object listed is the executable
      },
      &bias);
  std::ifstream file("/proc/self/exe", std::ios::binary);
  const std::vector<char> elf((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (elf.size() < sizeof(Elf64_Ehdr) || std::memcmp(elf.data(), ELFMAG, SELFMAG) != 0) return "a kernel";
  const auto* header = reinterpret_cast<const Elf64_Ehdr*>(elf.data());
  const auto* sections = reinterpret_cast<const Elf64_Shdr*>(elf.data() + header->e_shoff);
  for (unsigned i = 0; i < header->e_shnum; ++i) {
    if (sections[i].sh_type != SHT_SYMTAB) continue;
    const char* names = elf.data() + sections[sections[i].sh_link].sh_offset;
    const auto* symbols = reinterpret_cast<const Elf64_Sym*>(elf.data() + sections[i].sh_offset);
    for (size_t k = 0; k < sections[i].sh_size / sizeof(Elf64_Sym); ++k) {
      if (ELF64_ST_TYPE(symbols[k].st_info) != STT_FUNC || symbols[k].st_value + bias != uintptr_t(address))
        continue;
      int status = 0;
      char* demangled = abi::__cxa_demangle(names + symbols[k].st_name, nullptr, nullptr, &status);
      std::string name = status == 0 ? demangled : names + symbols[k].st_name;
      std::free(demangled);
      for (size_t at; (at = name.find("(anonymous namespace)::")) != std::string::npos;) name.erase(at, 23);
      if (name.starts_with("void ")) name.erase(0, 5);  // a template's return type
      return name.substr(0, name.find('('));          // without the parameter list
    }
  }
  return "a kernel";
}

// What a launch-time failure calls the launch: the kernel, the grid and the block.
std::string describe_launch(const void* kernel, const dim3& grid, const dim3& block) {
  return "launch of " + kernel_name(kernel) + ", grid " + str(grid) + " block " + str(block);
}

// The cluster dimension among a launch's attributes, if any; no other attribute is
// emulated.
std::optional<dim3> cluster_dimension(const cudaLaunchConfig_t& config) {
  std::optional<dim3> dims;
  for (unsigned i = 0; i < config.numAttrs; ++i) {
    const cudaLaunchAttribute& a = config.attrs[i];
    if (a.id != cudaLaunchAttributeClusterDimension)
      fail("launch attribute " + std::to_string(int(a.id)) + " is not emulated");
    dims = dim3(a.val.clusterDim.x, a.val.clusterDim.y, a.val.clusterDim.z);
  }
  return dims;
}

// 1 to 8 CTAs (the portable limit; the non-portable opt-in is not emulated).
bool valid_cluster_size(const dim3& dims) {
  return dims.x >= 1 && dims.y >= 1 && dims.z >= 1 && uint64_t(dims.x) * dims.y * dims.z <= kMaxClusterSize;
}

// ---- running a launch ---------------------------------------------------------------

struct Launch {
  dim3 grid, block;
  size_t smem_bytes;
  const std::function<void()>* body;
};

void check_launch(const void* kernel, const Launch& l) {
  const uint64_t threads = uint64_t(l.block.x) * l.block.y * l.block.z;
  if (threads == 0 || threads % kWarpSize != 0 || threads > kMaxThreadsPerBlock || l.block.z > 64)
    fail(describe_launch(kernel, l.grid, l.block) +
         ": the emulator runs blocks of whole warps, ≤ 1024 threads, z ≤ 64");
  if (l.grid.x == 0 || l.grid.y == 0 || l.grid.z == 0 || l.grid.x > 0x7fffffffu || l.grid.y > 65535 ||
      l.grid.z > 65535)
    fail(describe_launch(kernel, l.grid, l.block) + ": grid " + str(l.grid) + " outside CUDA's limits");
  if (l.smem_bytes > kDefaultSmemLimit) {
    std::lock_guard lock(g_smem_optin_mutex);
    const auto it = g_smem_optin.find(kernel);
    if (it == g_smem_optin.end() || size_t(it->second) < l.smem_bytes)
      fail(describe_launch(kernel, l.grid, l.block) + ": " + std::to_string(l.smem_bytes) +
           " bytes of dynamic shared memory without cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  }
}

// A CTA may not end with bulk copies in flight: their bytes would land in the shared
// memory of the next CTA on the SM (PTX ISA: the copy's completion must be observed).
void require_no_copies_in_flight(const Cta& cta) {
  for (const auto& [addr, bar] : cta.mbarriers)
    if (!bar.in_flight.empty())
      fail("a CTA exited with " + std::to_string(bar.in_flight.size()) +
           " bulk tensor copies in flight on the mbarrier at shared offset " + std::to_string(addr) +
           " (no thread waited for them)");
}

// One OS thread's CTA machinery: fiber stacks and shared memory, reused from CTA to CTA.
class Worker {
 public:
  explicit Worker(const Launch& l)
      : launch_(l), smem_(l.smem_bytes + kSmemCanaryBytes), stacks_(threads_of(l.block)) {
    for (auto& s : stacks_) s = std::make_unique_for_overwrite<uint64_t[]>(kFiberStackWords);
  }

  // In a cluster launch, as CTA `rank` of `cluster`, on its turn.
  void run(uint3 block_index, Cluster* cluster = nullptr, unsigned rank = 0) {
    Cta cta;
    start(cta, block_index);
    if (cluster != nullptr) {
      cta.cluster = cluster;
      cta.rank = rank;
      cta.cluster_generation = wait_to_run(*cluster, rank);
    }
    schedule(cta);
    require_no_copies_in_flight(cta);
    if (cluster != nullptr) stop(*cluster, rank, Cluster::State::finished);
    check_canaries(cta);
    t_cta = nullptr;
  }

  unsigned char* smem() { return smem_.data(); }

 private:
  void start(Cta& cta, uint3 block_index) {
    std::fill(smem_.begin(), smem_.begin() + launch_.smem_bytes, kPoison);
    std::fill(smem_.begin() + launch_.smem_bytes, smem_.end(), kCanary);
    dynamic_smem = smem_.data();
    blockIdx = block_index;
    blockDim = launch_.block;
    gridDim = launch_.grid;
    cta.smem_bytes = launch_.smem_bytes;
    cta.body = launch_.body;
    cta.fibers.resize(stacks_.size());
    cta.warps.resize(stacks_.size() / kWarpSize);
    t_cta = &cta;
    for (unsigned i = 0; i < stacks_.size(); ++i) {
      uint64_t* stack = stacks_[i].get();
      stack[0] = kStackCanary;  // the low end: stacks grow down
      cta.fibers[i].stack_pointer = prepare_stack(stack, kFiberStackWords);
    }
  }

  // Rounds over the live fibers (see Schedule), each running until it waits at a
  // barrier or a warp collective, or exits. A round without progress means every
  // live fiber waits for one that never comes. Fiber i is the thread of linear index
  // i (x fastest), so warps are runs of 32 consecutive fibers, as in CUDA.
  void schedule(Cta& cta) {
    const unsigned n_warps = unsigned(cta.warps.size());
    for (;;) {
      const uint64_t before = cta.progress;
      bool live = false;
      if (g_schedule == Schedule::round_robin) {
        for (unsigned i = 0; i < cta.fibers.size(); ++i) live |= resume(cta, i);
      } else if (g_schedule == Schedule::last_warp_starved) {
        const unsigned starved = (n_warps - 1) * kWarpSize;
        for (unsigned i = 0; i < starved; ++i) live |= resume(cta, i);
        if (!live || cta.progress == before)
          for (unsigned i = starved; i < cta.fibers.size(); ++i) live |= resume(cta, i);
      } else {
        const bool descending = g_schedule == Schedule::warps_descending;
        for (unsigned k = 0; k < n_warps; ++k) live |= run_warp(cta, descending ? n_warps - 1 - k : k, descending);
      }
      if (!live) return;
      if (cta.progress == before) wait_for_cluster(cta);
    }
  }

  // A round without progress: a deadlock, unless every live thread waits at
  // cluster.sync, i.e. for the other CTAs of its cluster.
  void wait_for_cluster(Cta& cta) {
    if (cta.cluster == nullptr || cta.cluster_arrived != cta.fibers.size() - cta.exited) fail(deadlock_report(cta));
    cta.cluster_generation = stop(*cta.cluster, cta.rank, Cluster::State::blocked);
    cta.cluster_arrived = 0;
  }

  // Rounds over warp w's lanes until none moves: all wait at __syncthreads or exited.
  bool run_warp(Cta& cta, unsigned w, bool descending) {
    bool live = false;
    for (;;) {
      const uint64_t before = cta.progress;
      bool any = false;
      for (unsigned k = 0; k < kWarpSize; ++k) any |= resume(cta, w * kWarpSize + (descending ? kWarpSize - 1 - k : k));
      live |= any;
      if (!any || cta.progress == before) return live;
    }
  }

  // Runs fiber i until it next waits or exits; false if it had exited already.
  bool resume(Cta& cta, unsigned i) {
    if (cta.fibers[i].exited) return false;
    const dim3 b = launch_.block;
    cta.current = i;
    threadIdx = {i % b.x, i / b.x % b.y, i / (b.x * b.y)};
    emu_switch_fiber(&cta.scheduler_stack_pointer, cta.fibers[i].stack_pointer);
    return true;
  }

  std::string deadlock_report(const Cta& cta) const {
    std::map<std::string, unsigned> count;
    for (const Fiber& f : cta.fibers) ++count[f.exited ? "exited" : f.waiting_at];
    std::string threads;
    for (const auto& [where, n] : count) threads += (threads.empty() ? "" : ", ") + std::to_string(n) + " at " + where;
    return "deadlock in CTA " + str(dim3(blockIdx.x, blockIdx.y, blockIdx.z)) + ": no thread can move (" + threads + ")";
  }

  void check_canaries(const Cta& cta) const {
    if (std::any_of(smem_.begin() + cta.smem_bytes, smem_.end(), [](unsigned char c) { return c != kCanary; }))
      fail("shared memory written past the " + std::to_string(cta.smem_bytes) + "-byte dynamic allocation");
    for (const auto& s : stacks_)
      if (s[0] != kStackCanary) fail("a fiber overflowed its stack");
  }

  Launch launch_;
  std::vector<unsigned char> smem_;
  std::vector<std::unique_ptr<uint64_t[]>> stacks_;
};

uint3 block_index(uint64_t i, const dim3& grid) {
  return {unsigned(i % grid.x), unsigned(i / grid.x % grid.y), unsigned(i / grid.x / grid.y)};
}

// The OS threads that run a cluster launch's clusters one at a time, one thread per
// CTA: each CTA of a cluster needs its own (its thread_local static __shared__, its
// dynamic shared memory), and all of them at once (cluster.sync). The members meet
// at `start` before each cluster; the last to arrive picks the next one.
struct Team {
  struct NextCluster {
    Team* team;
    void operator()() noexcept {
      Team& t = *team;
      t.index = t.next++;
      for (Cluster::Member& m : t.cluster.members) m.state = Cluster::State::running;
      if (!t.cluster.order.empty()) t.cluster.turn = t.cluster.order[0];
    }
  };
  Team(unsigned size, std::atomic<uint64_t>& next_cluster) : next(next_cluster), start(size, NextCluster{this}) {
    cluster.members.resize(size);
    for (unsigned r = 0; r < size && g_schedule != Schedule::round_robin; ++r)
      cluster.order.push_back(g_schedule == Schedule::warps_descending ? size - 1 - r : r);
  }
  std::atomic<uint64_t>& next;
  uint64_t index = 0;  // the cluster being run
  Cluster cluster;
  std::barrier<NextCluster> start;
};

// Clusters of `dims` tile the grid; rank r is the r-th CTA of its cluster, x fastest
// (%cluster_ctarank).
uint3 cluster_block_index(uint64_t cluster, unsigned rank, const dim3& clusters, const dim3& dims) {
  const uint3 c = block_index(cluster, clusters), r = block_index(rank, dims);
  return {c.x * dims.x + r.x, c.y * dims.y + r.y, c.z * dims.z + r.z};
}

void run_clusters(const Launch& l, const dim3& dims) {
  const unsigned size = threads_of(dims);
  const dim3 clusters(l.grid.x / dims.x, l.grid.y / dims.y, l.grid.z / dims.z);
  const uint64_t n_clusters = uint64_t(clusters.x) * clusters.y * clusters.z;
  const unsigned n_teams = unsigned(
      std::clamp<uint64_t>(std::min(std::thread::hardware_concurrency(), kMaxWorkers) / size, 1, n_clusters));
  std::atomic<uint64_t> next{0};
  std::vector<std::unique_ptr<Team>> teams;
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < n_teams; ++t) {
    Team* team = teams.emplace_back(std::make_unique<Team>(size, next)).get();
    for (unsigned rank = 0; rank < size; ++rank)
      threads.emplace_back([&, team, rank] {
        Worker worker(l);
        team->cluster.members[rank].smem = worker.smem();
        team->cluster.members[rank].thread_pointer = thread_pointer();
        for (;;) {
          team->start.arrive_and_wait();
          if (team->index >= n_clusters) return;
          worker.run(cluster_block_index(team->index, rank, clusters, dims), &team->cluster, rank);
        }
      });
  }
  for (auto& t : threads) t.join();
}

}  // namespace

void fail_kernel_argument(const void* kernel, int position, const void* p) {
  char addr[32];
  std::snprintf(addr, sizeof addr, "%p", p);
  fail("launch of " + kernel_name(kernel) + ": argument " + std::to_string(position + 1) + " (" + addr +
       ") points neither into device memory nor into pinned host memory (a GPU cannot read it)");
}

bool in_global_buffer(const void* p, size_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::shared_lock lock(g_global_buffers_mutex);
  return std::any_of(g_global_buffers.begin(), g_global_buffers.end(),
                     [&](const Range& r) { return a >= r.begin && a + bytes <= r.begin + r.bytes; });
}

void require_device(const void* p, size_t bytes, const std::string& what) {
  if (bytes != 0 && !in_global_buffer(p, bytes))
    fail(what + ": " + std::to_string(bytes) + " bytes outside every device allocation");
}

void set_landing(Landing landing) { g_landing = landing; }
void set_schedule(Schedule schedule) { g_schedule = schedule; }

void launch(const void* kernel, dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& body) {
  const Launch l{grid, block, smem_bytes, &body};
  check_launch(kernel, l);
  const uint64_t n_ctas = uint64_t(grid.x) * grid.y * grid.z;
  const unsigned n_workers =
      unsigned(std::min<uint64_t>({n_ctas, std::max(1u, std::thread::hardware_concurrency()), kMaxWorkers}));
  std::atomic<uint64_t> next{0};
  auto work = [&] {
    Worker worker(l);
    for (uint64_t i = next++; i < n_ctas; i = next++) worker.run(block_index(i, grid));
  };
  std::vector<std::thread> workers;
  for (unsigned w = 0; w < n_workers; ++w) workers.emplace_back(work);
  for (auto& w : workers) w.join();
  check_pool_guards([&] { return describe_launch(kernel, grid, block); });
}

cudaError_t launch_ex(const void* kernel, const cudaLaunchConfig_t& config, const std::function<void()>& body) {
  const std::optional<dim3> dims = cluster_dimension(config);
  if (!dims) {
    launch(kernel, config.gridDim, config.blockDim, config.dynamicSmemBytes, body);
    return cudaSuccess;
  }
  const dim3 grid = config.gridDim;
  if (!valid_cluster_size(*dims) || grid.x % dims->x != 0 || grid.y % dims->y != 0 || grid.z % dims->z != 0)
    return cudaErrorInvalidClusterSize;
  const Launch l{grid, config.blockDim, config.dynamicSmemBytes, &body};
  check_launch(kernel, l);
  ++g_cluster_launches;
  run_clusters(l, *dims);
  check_pool_guards([&] { return describe_launch(kernel, grid, config.blockDim) + " (clusters)"; });
  return cudaSuccess;
}

uint64_t cluster_launches() { return g_cluster_launches; }

uint32_t shared_address(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p), base = reinterpret_cast<uintptr_t>(dynamic_smem);
  if (a < base || a > base + t_cta->smem_bytes)
    fail("__cvta_generic_to_shared of an address outside the CTA's dynamic shared memory");
  return uint32_t(a - base);
}

void cp_async(uint32_t dst, const void* src, int size, int src_size) {
  require_aligned(dst, unsigned(size), "cp.async shared destination");
  require_aligned(reinterpret_cast<uintptr_t>(src), unsigned(size), "cp.async global source");
  shared_bytes(dst, size_t(size), "cp.async");
  if (!in_device_buffer(src, size_t(size))) fail("cp.async: source outside every device buffer");
  Fiber& f = this_fiber();
  const Copy c{dst, src, size, src_size, f.committed_groups};
  if (g_landing == Landing::at_issue)
    land(c);
  else
    f.in_flight.push_back(c);
}

void cp_async_commit() { ++this_fiber().committed_groups; }

// cp.async.wait_group n (PTX ISA): returns when at most n of the most recent committed
// groups are pending, so every group older than those has landed.
void cp_async_wait(int n) {
  Fiber& f = this_fiber();
  const uint64_t complete_below = f.committed_groups > uint64_t(n) ? f.committed_groups - uint64_t(n) : 0;
  auto first_pending = f.in_flight.begin();
  for (; first_pending != f.in_flight.end() && first_pending->group < complete_below; ++first_pending)
    land(*first_pending);
  f.in_flight.erase(f.in_flight.begin(), first_pending);
}

void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr, bool trans) {
  auto [w, lane] = this_lane();
  w.in[lane][0] = addr;
  arrive_and_wait(w, lane, trans ? Collective::ldmatrix_trans : Collective::ldmatrix,
                  [trans](Warp& warp) { load_matrices(warp, trans); });
  std::memcpy(r, w.out[lane], sizeof r);
}

void mma_m16n8k16_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  auto [w, lane] = this_lane();
  std::memcpy(&w.in[lane][0], a, sizeof a);
  w.in[lane][4] = b0;
  w.in[lane][5] = b1;
  std::memcpy(&w.in[lane][6], c, sizeof c);
  arrive_and_wait(w, lane, Collective::mma, multiply_tiles);
  std::memcpy(c, w.out[lane], sizeof c);
}

// ---- wgmma (sm_90a), one thread's fragment at a time ------------------------------
// wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16 (PTX ISA, "Asynchronous
// Warpgroup Level Matrix Multiply-Accumulate"): the warpgroup's D (64 × N, fp32) (+)=
// A (64 × 16) · B (16 × N), A and B in shared memory as the matrix descriptors say.
// Thread t of the warpgroup (threadIdx.x % 128) holds D[16·(t/32) + (t%32)/4 + 8h]
// [8j + 2·(t%4) + p] in d[4j + 2h + p]; each thread computes its own fragment here, in
// fp32 in k order (the hardware's order is unspecified). Only what the kernels use is
// emulated: the 128-byte swizzle, base offset 0; anything else fails.
//
// When: the hardware reads the operands at some point between the issue and the
// wgmma.wait_group that retires the group. The emulator takes the opposite end of the
// window to cp.async's landing (set_landing): with copies landing at wait_group, a
// wgmma reads at issue (so one issued before its operands' copies were waited for and
// fenced by a barrier reads poison); with copies landing at issue, it reads at its
// wait_group (so a stage refilled before the wgmma reading it was waited for gives
// the new data). A race-free kernel gives the same bits both ways.

// Shared address of element (i, k), i along M (A) or N (B), k < 16, of an operand that
// `desc` describes: K-major (mn_major false) 8-row atoms of 128-byte rows, the atoms
// `sbo` apart, k contiguous; MN-major 64-element rows of one k, 8 k an atom, atoms
// `sbo` apart along k and `lbo` apart along i. Then the 128-byte swizzle on the
// address: bits 4-6 ^= bits 7-9.
uint32_t wgmma_element_address(uint64_t desc, bool mn_major, unsigned i, unsigned k) {
  const uint32_t start = uint32_t(desc & 0x3FFF) << 4, lbo = uint32_t((desc >> 16) & 0x3FFF) << 4,
                 sbo = uint32_t((desc >> 32) & 0x3FFF) << 4;
  const uint32_t a = mn_major ? start + (i % 64) * 2 + (i / 64) * lbo + (k % 8) * 128 + (k / 8) * sbo
                              : start + (i % 8) * 128 + (i / 8) * sbo + k * 2;
  return a ^ (((a >> 7) & 7) << 4);
}

void require_sw128(uint64_t desc, const char* which) {
  if (desc >> 62 != 1) fail(std::string("wgmma: ") + which + " descriptor: only the 128-byte swizzle is emulated");
  if ((desc >> 49) & 7) fail(std::string("wgmma: ") + which + " descriptor: a base offset is not emulated");
}

// cp.async writes shared memory through the generic proxy, wgmma reads it through the
// async proxy (PTX ISA, Memory Consistency Model: proxies); the writes are ordered
// before such reads only by a fence.proxy.async of the writing thread after they
// landed (and a barrier to the reading warpgroup, which the emulator's other
// schedules check). On a GPU a wgmma may see stale bytes without it; here it fails.
void fence_proxy_async_shared() {
  Fiber& f = this_fiber();
  const uint16_t me = uint16_t(t_cta->current + 1);
  for (const auto& [dst, size] : f.unfenced)
    for (uint32_t b = dst; b < dst + uint32_t(size); ++b)
      if (t_cta->unfenced_by[b] == me) t_cta->unfenced_by[b] = 0;
  f.unfenced.clear();
}

void st_shared_zero16(uint32_t addr) {
  require_aligned(addr, 16, "st.shared.v4");
  std::memset(shared_bytes(addr, 16, "st.shared.v4"), 0, 16);
  mark_generic_write(addr, 16);
}

void require_fenced(uint32_t addr) {
  const std::vector<uint16_t>& by = t_cta->unfenced_by;
  shared_bytes(addr, 2, "wgmma operand");
  for (uint32_t b = addr; b < addr + 2; ++b)
    if (by[b] != 0)
      fail("wgmma: reads shared byte " + std::to_string(b) + ", which thread " + std::to_string(by[b] - 1) +
           " wrote through the generic proxy (cp.async, st.shared) and has not fenced "
           "(fence.proxy.async.shared::cta) since: the tensor cores read through the async proxy and may not see it");
}

float shared_bf16(uint32_t addr) {
  uint16_t bits;
  std::memcpy(&bits, shared_bytes(addr, 2, "wgmma operand"), 2);
  return as_float(uint32_t(bits) << 16);
}

void run_wgmma(const Wgmma& op) {
  const unsigned t = threadIdx.x % 128, row0 = 16 * (t / 32) + (t % 32) / 4, col0 = 2 * (t % 4);
  // Every thread of the warpgroup reads the same operands (require_warpgroup_uniform),
  // after the same barrier: the first thread checks all of them for the proxy fence.
  if (t == 0 && !t_cta->unfenced_by.empty())
    for (unsigned k = 0; k < 16; ++k) {
      if (!op.a_in_registers)
        for (unsigned i = 0; i < 64; ++i) require_fenced(wgmma_element_address(op.desc_a, op.trans_a, i, k));
      for (unsigned n = 0; n < unsigned(op.n); ++n) require_fenced(wgmma_element_address(op.desc_b, op.trans_b, n, k));
    }
  float a[2][16], b[16];
  for (unsigned h = 0; h < 2; ++h)
    for (unsigned k = 0; k < 16; ++k)
      a[h][k] = op.a_in_registers ? op.a_rows[h][k]
                                  : shared_bf16(wgmma_element_address(op.desc_a, op.trans_a, row0 + 8 * h, k));
  for (int j = 0; j < op.n / 8; ++j)
    for (unsigned p = 0; p < 2; ++p) {
      for (unsigned k = 0; k < 16; ++k) b[k] = shared_bf16(wgmma_element_address(op.desc_b, op.trans_b, 8 * j + col0 + p, k));
      for (unsigned h = 0; h < 2; ++h) {
        float& d = op.d[4 * j + 2 * h + p];
        float sum = op.accumulate ? d : 0.0f;
        for (unsigned k = 0; k < 16; ++k) sum += a[h][k] * b[k];
        d = sum;
      }
    }
}

// A GPU runs one wgmma for the warpgroup from what its threads give it; one thread
// giving other descriptors, shape, transposes or scale-d than the rest is undefined
// there (a descriptor that depends on the warp, say), while here each thread would
// compute its own fragment from its own operands: so this fails.
void require_warpgroup_uniform(const WgmmaIssue& issue) {
  Fiber& f = this_fiber();
  // wgmma.fence (PTX ISA) must come before a warpgroup's first wgmma and between a
  // thread's accesses of registers a wgmma reads or writes and that wgmma, else the
  // wgmma may see them unready. The emulator asks for one after every wait_group (the
  // point after which a kernel reads or rewrites them): stricter than the rule, which
  // lets a thread that touched no such register go on without it.
  if (!f.wgmma_fenced)
    fail("wgmma: thread " + std::to_string(threadIdx.x) + " issued a wgmma with no wgmma.fence since its last "
         "wgmma.wait_group (or its start)");
  const unsigned warpgroup = threadIdx.x / 128;
  auto [it, first] = t_cta->wgmma_issues.try_emplace({warpgroup, f.wgmma_count++}, issue, 0u);
  if (!first && !(it->second.first == issue))
    fail("wgmma: thread " + std::to_string(threadIdx.x) + " of warpgroup " + std::to_string(warpgroup) +
         " issued its wgmma with other operands (descriptors, N, transposes, scale-d or A's source) than the "
         "warpgroup's first thread to issue it; the matrix descriptors must be the same across the warpgroup");
  if (++it->second.second == 128) t_cta->wgmma_issues.erase(it);
}

void wgmma_bf16(float* d, int n, uint64_t desc_a, uint64_t desc_b, bool accumulate, bool trans_a, bool trans_b) {
  if (blockDim.x % 128 != 0 || blockDim.y != 1 || blockDim.z != 1)
    fail("wgmma: the block is not whole warpgroups along x");
  if (n % 8 != 0 || n < 8 || n > 256) fail("wgmma: N must be a multiple of 8 in [8, 256]");
  require_sw128(desc_a, "A");
  require_sw128(desc_b, "B");
  require_warpgroup_uniform({n, desc_a, desc_b, accumulate, trans_a, trans_b, false});
  Fiber& f = this_fiber();
  ++g_wgmma_issued;
  const Wgmma op{d, n, desc_a, desc_b, accumulate, trans_a, trans_b, f.wgmma_groups};
  if (g_landing == Landing::at_wait)
    run_wgmma(op);
  else
    f.wgmma_pending.push_back(op);
}

// A from registers (wgmma with an A register fragment, sm_90a): the fragment of each
// warp's 16 rows is mma.m16n8k16's A fragment (cuda/ptx_sm90.cuh, wgmma_rs), so the
// 16 k values of a thread's rows g and g + 8 are spread over the 4 lanes of its quad;
// they are gathered here by warp shuffles (a warp collective, as the .sync.aligned
// instruction is) and kept with the operation: the hardware reads the registers
// before the group retires, and the caller may not change them before then anyway.
void wgmma_bf16_rs(float* d, int n, const uint32_t (&a)[4], uint64_t desc_b, bool accumulate, bool trans_b) {
  if (blockDim.x % 128 != 0 || blockDim.y != 1 || blockDim.z != 1)
    fail("wgmma: the block is not whole warpgroups along x");
  if (n % 8 != 0 || n < 8 || n > 256) fail("wgmma: N must be a multiple of 8 in [8, 256]");
  require_sw128(desc_b, "B");
  require_warpgroup_uniform({n, 0, desc_b, accumulate, false, trans_b, true});
  const unsigned lane = threadIdx.x % 32;
  const bool misread = g_wgmma_a_misread;
  const uint32_t reg[4] = {a[0], misread ? a[2] : a[1], misread ? a[1] : a[2], a[3]};
  uint32_t quad[4][4];  // register r of quad lane c
  for (unsigned c = 0; c < 4; ++c)
    for (unsigned r = 0; r < 4; r += 2) {
      const uint64_t v = shuffle(Shuffle::idx, reg[r] | uint64_t(reg[r + 1]) << 32, int((lane & ~3u) | c));
      quad[c][r] = uint32_t(v);
      quad[c][r + 1] = uint32_t(v >> 32);
    }
  Fiber& f = this_fiber();
  ++g_wgmma_issued;
  f.register_a.push_back({f.wgmma_groups, a, {a[0], a[1], a[2], a[3]}});
  Wgmma op{d, n, 0, desc_b, accumulate, false, trans_b, f.wgmma_groups};
  op.a_in_registers = true;
  for (unsigned h = 0; h < 2; ++h)
    for (unsigned k = 0; k < 16; ++k) {  // k 2c, 2c + 1 in register h, k 2c + 8, 2c + 9 in register 2 + h
      const uint32_t pair = quad[(k % 8) / 2][(k / 8) * 2 + h];
      op.a_rows[h][k] = as_float((k % 2 ? pair >> 16 : pair & 0xFFFFu) << 16);
    }
  if (g_landing == Landing::at_wait)
    run_wgmma(op);
  else
    f.wgmma_pending.push_back(op);
}

void wgmma_fence() { this_fiber().wgmma_fenced = true; }

void wgmma_commit() { ++this_fiber().wgmma_groups; }

uint64_t wgmma_issued() { return g_wgmma_issued; }
uint64_t tma_copies() { return g_tma_copies; }

void set_wgmma_a_misread(bool misread) { g_wgmma_a_misread = misread; }

// wgmma.wait_group n: every group but the n most recent committed is complete.
void wgmma_wait(int n) {
  Fiber& f = this_fiber();
  f.wgmma_fenced = false;
  const uint64_t complete_below = f.wgmma_groups > uint64_t(n) ? f.wgmma_groups - uint64_t(n) : 0;
  // The tensor cores may read a wgmma's A registers until its group is waited for
  // (PTX ISA, wgmma.mma_async): a thread that changed them before that (say, packing
  // the next k-step into the same registers) gives the GPU other values than the
  // emulator took at issue, so it fails here.
  auto done = f.register_a.begin();
  for (; done != f.register_a.end() && done->group < complete_below; ++done)
    for (int r = 0; r < 4; ++r)
      if (done->registers[r] != done->at_issue[r])
        fail("wgmma: thread " + std::to_string(threadIdx.x) + " changed register " + std::to_string(r) +
             " of a wgmma's A fragment before the wait_group for it; the tensor cores read A until then");
  f.register_a.erase(f.register_a.begin(), done);
  auto first_pending = f.wgmma_pending.begin();
  for (; first_pending != f.wgmma_pending.end() && first_pending->group < complete_below; ++first_pending)
    run_wgmma(*first_pending);
  f.wgmma_pending.erase(f.wgmma_pending.begin(), first_pending);
}

uint64_t shuffle(Shuffle mode, uint64_t value, int b) {
  const Collective kind = mode == Shuffle::bfly ? Collective::shfl_bfly
                          : mode == Shuffle::up ? Collective::shfl_up
                                                : Collective::shfl_idx;
  auto [w, lane] = this_lane();
  w.in[lane][0] = uint32_t(value);
  w.in[lane][1] = uint32_t(value >> 32);
  w.in[lane][2] = uint32_t(b);
  arrive_and_wait(w, lane, kind, [kind](Warp& warp) { exchange(warp, kind); });
  return w.out[lane][0] | uint64_t(w.out[lane][1]) << 32;
}

uint32_t match_any(uint64_t value) {
  auto [w, lane] = this_lane();
  w.in[lane][0] = uint32_t(value);
  w.in[lane][1] = uint32_t(value >> 32);
  arrive_and_wait(w, lane, Collective::match_any, match_values);
  return w.out[lane][0];
}

void syncwarp() {
  auto [w, lane] = this_lane();
  arrive_and_wait(w, lane, Collective::syncwarp, [](Warp&) {});
}

unsigned cluster_block_rank() { return cluster_cta("cluster.block_rank").rank; }
unsigned cluster_num_blocks() { return unsigned(cluster_cta("cluster.num_blocks").cluster->members.size()); }

void cluster_sync() {
  Cta& cta = cluster_cta("cluster.sync");
  const uint64_t generation = cta.cluster_generation;
  ++cta.cluster_arrived;
  while (cta.cluster_generation == generation) yield("cluster.sync");
}

void* map_shared_rank(const void* p, int rank) {
  const Cta& cta = cluster_cta("map_shared_rank");
  Cluster& c = *cta.cluster;
  if (rank < 0 || size_t(rank) >= c.members.size())
    fail("map_shared_rank: rank " + std::to_string(rank) + " outside the cluster of " +
         std::to_string(c.members.size()) + " CTAs");
  std::lock_guard lock(c.mutex);
  const Cluster::Member& target = c.members[rank];
  if (target.state == Cluster::State::finished)
    fail("map_shared_rank: CTA " + std::to_string(rank) +
         " of the cluster has exited, and its shared memory with it (a cluster.sync before it exits keeps it)");
  const auto a = reinterpret_cast<uintptr_t>(p), smem = reinterpret_cast<uintptr_t>(dynamic_smem);
  const uintptr_t tp = thread_pointer();
  if (a >= smem && a < smem + cta.smem_bytes) return target.smem + (a - smem);
  if (a < tp && a >= tp - executable_tls_bytes()) return reinterpret_cast<void*>(a - tp + target.thread_pointer);
  fail("map_shared_rank of an address outside the CTA's shared memory (dynamic, or a static __shared__ variable)");
}

void syncthreads() {
  Cta& cta = *t_cta;
  const uint64_t generation = cta.barrier_generation;
  if (++cta.barrier_arrived < cta.fibers.size()) {
    while (cta.barrier_generation == generation) yield("__syncthreads");
    return;
  }
  cta.barrier_arrived = 0;
  ++cta.barrier_generation;
  ++cta.progress;
}

GlobalBuffer::GlobalBuffer(size_t bytes) : bytes_(bytes) {
  constexpr size_t kAlignment = 256;  // cudaMalloc's
  const size_t total = (bytes + kGlobalCanaryBytes + kAlignment - 1) / kAlignment * kAlignment;
  data_ = static_cast<unsigned char*>(std::aligned_alloc(kAlignment, total));
  if (data_ == nullptr) fail("out of host memory for a " + std::to_string(bytes) + "-byte buffer");
  std::memset(data_ + bytes, kCanary, kGlobalCanaryBytes);
  std::unique_lock lock(g_global_buffers_mutex);
  g_global_buffers.push_back({reinterpret_cast<uintptr_t>(data_), bytes});
}

GlobalBuffer::GlobalBuffer(GlobalBuffer&& other) noexcept : data_(other.data_), bytes_(other.bytes_) {
  other.data_ = nullptr;
}

GlobalBuffer::~GlobalBuffer() {
  if (data_ == nullptr) return;  // moved from
  if (std::any_of(data_ + bytes_, data_ + bytes_ + kGlobalCanaryBytes, [](unsigned char c) { return c != kCanary; }))
    fail("a kernel wrote past the end of a " + std::to_string(bytes_) + "-byte global buffer");
  {
    std::unique_lock lock(g_global_buffers_mutex);
    std::erase_if(g_global_buffers, [&](const Range& r) { return r.begin == reinterpret_cast<uintptr_t>(data_); });
  }
  std::free(data_);
}

void GlobalBuffer::poison() const { std::memset(data_, kPoison, bytes_); }
void GlobalBuffer::zero() const { std::memset(data_, 0, bytes_); }

// ---- mbarrier and bulk tensor copies (TMA, sm_90) ---------------------------------
//
// An mbarrier lives in 8 bytes of shared memory; here its state is kept beside it
// (Cta::mbarriers) and the 8 bytes hold a marker, checked at every use, so that a
// store or copy over a live barrier is caught. A phase completes when its pending
// arrivals reach zero and its transaction count is zero; try_wait.parity(p) is true
// once the phase of parity p has completed (the current phase's parity is not p), so
// a wait for parity 1 passes before the first phase completes, as on the GPU.
// A bulk tensor copy reads its box at issue; its bytes land, and complete their
// transaction bytes on the barrier, at issue (Landing::at_issue) or when a thread
// first waits on that barrier for its current phase (Landing::at_wait; a wait for the
// phase before passes without landing anything): a read of the stage before
// the wait then sees the poison (or the previous data), and a copy into a stage that
// is still being read overwrites it under the at_issue landing.

namespace {

constexpr uint64_t kMbarrierMarker = 0x5245495252414d42ull;  // "BMARRIER"

uint64_t marker_at(uint32_t addr) { return kMbarrierMarker ^ addr; }

// The barrier at `addr`, initialized and not overwritten since.
Mbarrier& mbarrier_at(uint32_t addr, const char* what) {
  require_aligned(addr, 8, what);
  unsigned char* bytes = shared_bytes(addr, 8, what);
  const auto it = t_cta->mbarriers.find(addr);
  if (it == t_cta->mbarriers.end())
    fail(std::string(what) + ": no mbarrier was initialized at shared offset " + std::to_string(addr));
  uint64_t marker;
  std::memcpy(&marker, bytes, 8);
  if (marker != marker_at(addr))
    fail(std::string(what) + ": the mbarrier at shared offset " + std::to_string(addr) +
         " was overwritten (a store or copy over a live barrier)");
  return it->second;
}

void complete_phase_if_done(Mbarrier& bar) {
  if (bar.pending != 0 || bar.tx != 0) return;
  ++bar.phase;
  bar.pending = bar.expected;
  ++t_cta->progress;
}

// A copy's bytes reach shared memory through the async proxy: a wgmma may read them
// with no fence.proxy.async (the mbarrier wait orders them).
void land(Mbarrier& bar, const TensorCopy& c) {
  std::memcpy(dynamic_smem + c.dst, c.bytes.data(), c.bytes.size());
  std::vector<uint16_t>& by = t_cta->unfenced_by;
  if (!by.empty()) std::fill(by.begin() + c.dst, by.begin() + c.dst + c.bytes.size(), uint16_t(0));
  bar.tx -= int64_t(c.bytes.size());
  if (bar.tx < -((int64_t(1) << 20) - 1)) fail("an mbarrier's transaction count fell below −(2^20 − 1)");
  complete_phase_if_done(bar);
}

void land_all(Mbarrier& bar) {
  std::vector<TensorCopy> copies;
  copies.swap(bar.in_flight);
  for (const TensorCopy& c : copies) land(bar, c);
}

// The emulator's CUtensorMap: what cuTensorMapEncodeTiled was given, checked there.
struct TensorMap {
  uint64_t magic;
  const unsigned char* global;
  uint32_t rank, element_bytes;
  uint64_t dims[5];
  uint64_t strides[4];  // bytes between consecutive indices of dimensions 1 ..
  uint32_t box[5];
  uint32_t swizzle_bytes;  // 0: none, or 128
  uint32_t unused[2];
};
static_assert(sizeof(TensorMap) <= sizeof(CUtensorMap), "the emulator's tensor map fits in CUtensorMap");
constexpr uint64_t kTensorMapMagic = 0x50414d524f534e45ull;  // "ENSORMAP"

uint32_t element_bytes(CUtensorMapDataType t) {
  switch (t) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8: return 1;
    case CU_TENSOR_MAP_DATA_TYPE_UINT16:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16: return 2;
    case CU_TENSOR_MAP_DATA_TYPE_UINT32:
    case CU_TENSOR_MAP_DATA_TYPE_INT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32: return 4;
    default: return 0;
  }
}

// Where byte o of a box (packed, innermost dimension fastest) lies in shared memory
// under the 128-byte swizzle (swizzle_bytes 128; 0: none): its 16-byte chunk index
// XOR the 128-byte row index modulo 8 (CUDA programming guide, TMA swizzle; the same
// pattern wgmma's swizzled layouts read, with the box starting on the pattern's repeat).
uint32_t swizzled(uint32_t o, uint32_t swizzle_bytes) {
  if (swizzle_bytes == 0) return o;
  return o ^ (((o >> 7) & 7) << 4);
}

}  // namespace

CUresult encode_tensor_map_tiled(CUtensorMap* map, CUtensorMapDataType type, uint32_t rank, void* global,
                            const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                            const uint32_t* element_strides, CUtensorMapInterleave interleave,
                            CUtensorMapSwizzle swizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill fill) {
  // The driver's checks (CUDA driver API, cuTensorMapEncodeTiled), each an invalid value.
  // What the emulator copies as a GPU was seen to (cuda/tma_check.cu: 128-byte swizzle
  // and zero fill; unswizzled boxes by the same path); the rest is not emulated.
  TensorMap m{};
  m.magic = kTensorMapMagic;
  m.global = static_cast<const unsigned char*>(global);
  m.rank = rank;
  m.element_bytes = element_bytes(type);
  m.swizzle_bytes = swizzle == CU_TENSOR_MAP_SWIZZLE_128B ? 128 : 0;
  if (m.element_bytes == 0 || interleave != CU_TENSOR_MAP_INTERLEAVE_NONE ||
      (swizzle != CU_TENSOR_MAP_SWIZZLE_NONE && swizzle != CU_TENSOR_MAP_SWIZZLE_128B) ||
      fill != CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    fail("cuTensorMapEncodeTiled: only 1-, 2- and 4-byte types, no interleave, no swizzle or the 128-byte one, and "
         "zero fill are emulated");
  for (uint32_t i = 0; i < rank && i < 5; ++i)
    if (element_strides[i] != 1) fail("cuTensorMapEncodeTiled: element strides other than 1 are not emulated");
  if (reinterpret_cast<uintptr_t>(map) % 64 != 0 || rank < 1 || rank > 5 ||
      reinterpret_cast<uintptr_t>(global) % 16 != 0)
    return CUDA_ERROR_INVALID_VALUE;
  for (uint32_t i = 0; i < rank; ++i) {
    if (dims[i] == 0 || dims[i] > (uint64_t(1) << 32) || box[i] == 0 || box[i] > 256) return CUDA_ERROR_INVALID_VALUE;
    m.dims[i] = dims[i];
    m.box[i] = box[i];
  }
  // globalStrides[i] ≥ globalStrides[i − 1] · globalDim[i] (the first: globalDim[0] elements).
  uint64_t below = dims[0] * m.element_bytes;
  for (uint32_t i = 0; i + 1 < rank; ++i) {
    if (strides[i] % 16 != 0 || strides[i] >= (uint64_t(1) << 40) || strides[i] < below)
      return CUDA_ERROR_INVALID_VALUE;
    m.strides[i] = strides[i];
    below = strides[i] * dims[i + 1];
  }
  const uint32_t inner_bytes = box[0] * m.element_bytes;
  if (inner_bytes % 16 != 0 || (m.swizzle_bytes != 0 && inner_bytes > m.swizzle_bytes))
    return CUDA_ERROR_INVALID_VALUE;
  std::memset(map, 0, sizeof(CUtensorMap));
  std::memcpy(map, &m, sizeof m);
  return CUDA_SUCCESS;
}

void mbarrier_init(uint32_t addr, uint32_t count) {
  require_aligned(addr, 8, "mbarrier.init");
  unsigned char* bytes = shared_bytes(addr, 8, "mbarrier.init");
  if (count == 0 || count >= (1u << 20)) fail("mbarrier.init: count " + std::to_string(count) + " outside [1, 2^20)");
  if (t_cta->mbarriers.count(addr) != 0)  // PTX ISA: undefined until mbarrier.inval
    fail("mbarrier.init over the live mbarrier at shared offset " + std::to_string(addr));
  Mbarrier& bar = t_cta->mbarriers[addr];
  bar.expected = bar.pending = count;
  bar.unfenced_by = t_cta->current + 1;
  const uint64_t marker = marker_at(addr);
  std::memcpy(bytes, &marker, 8);
}

// fence.mbarrier_init: the barriers this thread initialized become usable by the copy
// engine (the threads' own use of them waits for the __syncthreads after it).
void fence_mbarrier_init() {
  for (auto& [addr, bar] : t_cta->mbarriers)
    if (bar.unfenced_by == t_cta->current + 1) bar.unfenced_by = 0;
}

// PTX ISA: a phase's transaction count stays within ±(2^20 − 1).
void require_tx_in_range(const Mbarrier& bar, uint32_t addr) {
  constexpr int64_t kTxLimit = (int64_t(1) << 20) - 1;
  if (bar.tx > kTxLimit || bar.tx < -kTxLimit)
    fail("the mbarrier at shared offset " + std::to_string(addr) + ": transaction count " + std::to_string(bar.tx) +
         " outside ±(2^20 − 1)");
}

void mbarrier_arrive(uint32_t addr, uint32_t expect_tx_bytes) {
  Mbarrier& bar = mbarrier_at(addr, "mbarrier.arrive");
  if (bar.pending == 0) fail("mbarrier.arrive: more arrivals than the barrier's count in one phase");
  bar.tx += expect_tx_bytes;
  require_tx_in_range(bar, addr);
  --bar.pending;
  ++t_cta->progress;
  complete_phase_if_done(bar);
}

namespace {
float flush_subnormal(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }
}  // namespace

void red_add_f32x2(float* dst, float a, float b) {
  if (reinterpret_cast<uintptr_t>(dst) % 8 != 0) fail("red.global.add.v2.f32: address not 8-byte aligned");
  require_device_buffer(dst, 2 * sizeof(float), "red.global.add.v2.f32");
  dst[0] = flush_subnormal(flush_subnormal(dst[0]) + flush_subnormal(a));
  dst[1] = flush_subnormal(flush_subnormal(dst[1]) + flush_subnormal(b));
}

// The parity names the current phase or the one before it (PTX ISA): the one before has
// completed, whatever copies of the current phase are still in flight, so it is answered
// before any of them lands. (A thread that skips phases, waiting on parity 1 for a
// barrier still in its phase 0, passes at once so, as on a GPU.)
bool mbarrier_try_wait_parity(uint32_t addr, uint32_t parity) {
  Mbarrier& bar = mbarrier_at(addr, "mbarrier.try_wait");
  if ((bar.phase & 1) != (parity & 1)) return true;
  if (g_landing == Landing::at_wait) land_all(bar);
  if ((bar.phase & 1) != (parity & 1)) return true;
  yield("mbarrier.try_wait");
  return false;
}

void mbarrier_check_phase(uint32_t addr, int64_t phase) {
  const Mbarrier& bar = mbarrier_at(addr, "mbarrier.try_wait");
  const int64_t current = int64_t(bar.phase);
  if (current == phase || current == phase + 1) return;
  fail("a wait for phase " + std::to_string(phase) + " of the mbarrier at shared offset " + std::to_string(addr) +
       ", which is in phase " + std::to_string(current) +
       (current > phase ? ": it ran two or more phases ahead, and the parity names a later one"
                        : current == phase - 1 ? ": the parity names the phase before the current one, complete"
                                               : ": the parity names the current one, which is not that phase"));
}

void tma_load(uint32_t dst, const void* tensor_map, const int32_t* coords, uint32_t rank, uint32_t mbar) {
  TensorMap m;
  std::memcpy(&m, tensor_map, sizeof m);
  if (m.magic != kTensorMapMagic) fail("cp.async.bulk.tensor: the tensor map was not made by cuTensorMapEncodeTiled");
  if (m.rank != rank)
    fail("cp.async.bulk.tensor." + std::to_string(rank) + "d with a tensor map of rank " + std::to_string(m.rank));
  if (m.swizzle_bytes != 0 && m.box[0] * m.element_bytes != m.swizzle_bytes)
    fail("cp.async.bulk.tensor: a swizzled box whose inner dimension is not the swizzle's span is not emulated");
  // PTX asks 128 bytes; a swizzled stage off the pattern's repeat (1024 bytes for 128-byte)
  // is laid out from the absolute address, which no wgmma descriptor here expects: the
  // emulator demands the repeat.
  const unsigned alignment = m.swizzle_bytes == 0 ? 128 : m.swizzle_bytes * 8;
  require_aligned(dst, alignment, "cp.async.bulk.tensor destination");
  uint64_t elements = 1;
  for (uint32_t i = 0; i < rank; ++i) elements *= m.box[i];
  const size_t bytes = size_t(elements) * m.element_bytes;
  shared_bytes(dst, bytes, "cp.async.bulk.tensor destination");
  Mbarrier& bar = mbarrier_at(mbar, "cp.async.bulk.tensor's mbarrier");
  if (bar.unfenced_by != 0)
    fail("cp.async.bulk.tensor on the mbarrier at shared offset " + std::to_string(mbar) +
         " before its initializing thread ran fence.mbarrier_init");
  TensorCopy copy{dst, std::vector<unsigned char>(bytes)};
  const uint32_t eb = m.element_bytes;
  uint32_t index[5] = {0, 0, 0, 0, 0};
  for (uint64_t e = 0; e < elements; e += m.box[0]) {  // one box row (innermost dimension) at a time
    int64_t offset = 0;
    bool inside = true;
    for (uint32_t i = 1; i < rank; ++i) {
      const int64_t c = int64_t(coords[i]) + index[i];
      inside = inside && c >= 0 && uint64_t(c) < m.dims[i];
      offset += c * int64_t(m.strides[i - 1]);
    }
    const int64_t c0 = coords[0];
    const int64_t first = std::clamp<int64_t>(c0, 0, int64_t(m.dims[0]));
    const int64_t last = std::clamp<int64_t>(c0 + m.box[0], 0, int64_t(m.dims[0]));
    if (inside && last > first)
      require_device_buffer(m.global + offset + first * eb, size_t(last - first) * eb, "cp.async.bulk.tensor source");
    for (uint32_t x = 0; x < m.box[0]; ++x) {
      const uint32_t o = uint32_t((e + x) * eb);
      unsigned char* out = copy.bytes.data() + swizzled(o, m.swizzle_bytes);
      const int64_t c = c0 + x;
      if (inside && c >= first && c < last)
        std::memcpy(out, m.global + offset + c * eb, eb);
      else
        std::memset(out, 0, eb);
    }
    for (uint32_t i = 1; i < rank && ++index[i] == m.box[i]; ++i) index[i] = 0;
  }
  ++g_tma_copies;
  if (g_landing == Landing::at_issue)
    land(bar, copy);
  else
    bar.in_flight.push_back(std::move(copy));
}

}  // namespace emu

// ---- the CUDA runtime calls of the launchers ---------------------------------------
// Answered for the emulated H100s above (tests/emu/runtime_emu.cpp has the rest of
// the runtime); any other attribute or device fails loudly.

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device < 0 || device >= emu::kDevices) emu::fail("cudaDeviceGetAttribute: no emulated device " + std::to_string(device));
  switch (attr) {
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = emu::kSmemOptinLimit; break;
    case cudaDevAttrMultiProcessorCount: *value = emu::kSms; break;
    case cudaDevAttrMaxBlocksPerMultiprocessor: *value = emu::kMaxBlocksPerSm; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    default: emu::fail("cudaDeviceGetAttribute: attribute " + std::to_string(int(attr)) + " is not emulated");
  }
  return cudaSuccess;
}

// Blocks of blockSize threads and dynamicSMemSize bytes of dynamic shared memory that
// fit one SM by threads, block slots and shared memory. The kernel's registers and
// static shared memory are unknown on the host and not counted, so the answer may be
// above a real H100's; the kernels must be right for any grid that follows from it.
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* numBlocks, const void*, int blockSize,
                                                         size_t dynamicSMemSize) {
  if (blockSize <= 0 || unsigned(blockSize) > emu::kMaxThreadsPerBlock ||
      dynamicSMemSize > size_t(emu::kSmemOptinLimit))
    return cudaErrorInvalidValue;
  const int by_smem = int(emu::kSmemPerSm / (dynamicSMemSize + emu::kSmemReservedPerBlock));
  *numBlocks = std::min({emu::kMaxBlocksPerSm, emu::kMaxThreadsPerSm / blockSize, by_smem});
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize)
    emu::fail("cudaFuncSetAttribute: only MaxDynamicSharedMemorySize is emulated");
  if (value < 0 || value > emu::kSmemOptinLimit) return cudaErrorInvalidValue;
  std::lock_guard lock(emu::g_smem_optin_mutex);
  emu::g_smem_optin[func] = value;
  return cudaSuccess;
}

// The kernel files run as their sm_90 code (SPES_SM90_DEVICE_CODE is 1 in the
// emulator's cuda/launch.cuh), so ptxVersion says sm_90 to the launchers that ask
// (crossentropy.cu's cluster kernel). No static shared memory is reported (its size
// is unknown here), and the most registers a thread may have.
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void* func) {
  *attr = cudaFuncAttributes{};
  attr->maxDynamicSharedSizeBytes = emu::dynamic_smem_limit(func);
  attr->maxThreadsPerBlock = int(emu::kMaxThreadsPerBlock);
  attr->ptxVersion = 90;
  attr->binaryVersion = 90;
  attr->numRegs = 255;  // no register file here: the most a thread may have
  return cudaSuccess;
}

// Clusters of the config's cluster dimension that fit at once: a cluster's CTAs share
// one GPC (kGpcs of kSmsPerGpc SMs), each SM taking as many of them as
// cudaOccupancyMaxActiveBlocksPerMultiprocessor says (with its caveats). 0 when a
// CTA's dynamic shared memory is above the kernel's opt-in (the launch would fail).
cudaError_t cudaOccupancyMaxActiveClusters(int* numClusters, const void* func, const cudaLaunchConfig_t* config) {
  const std::optional<dim3> dims = emu::cluster_dimension(*config);
  if (!dims) emu::fail("cudaOccupancyMaxActiveClusters without a cluster dimension is not emulated");
  if (!emu::valid_cluster_size(*dims)) return cudaErrorInvalidClusterSize;
  const dim3 b = config->blockDim;
  int per_sm = 0;
  if (config->dynamicSmemBytes <= size_t(emu::dynamic_smem_limit(func))) {
    const cudaError_t e =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, func, int(b.x * b.y * b.z), config->dynamicSmemBytes);
    if (e != cudaSuccess) return e;
  }
  *numClusters = emu::kGpcs * (emu::kSmsPerGpc * per_sm / int(dims->x * dims->y * dims->z));
  return cudaSuccess;
}

// The C entry point of cudaLaunchKernelEx gets the kernel's arguments as void*, with
// which the emulator cannot call the kernel: launches with attributes go through
// spes::cuda::launch_ex (cuda/launch.cuh), whose twin keeps their types.
cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t*, const void*, void**) {
  emu::fail("cudaLaunchKernelEx called directly: launch through spes::cuda::launch_ex (cuda/launch.cuh)");
}

cudaError_t cudaGetLastError() { return cudaSuccess; }

const char* cudaGetErrorString(cudaError_t) { return "error from the emulated CUDA runtime"; }
