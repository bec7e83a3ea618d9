// Fused cross-entropy + lm z-loss (forward and backward in one pass).
//
// Softmax statistics are kept online as (m, s) in base 2: m = running max of
// x·log2e, s = Σ 2^(x·log2e − m); a row's lse = (m + log2 s)·ln2. Partial (m, s)
// pairs merge exactly (rescale to the larger max), in a fixed tree: deterministic.
//
// cluster kernel (sm_90+): grid = 8·N blocks of up to 512 threads, clusters of 8 along x;
//   block `rank` of row n owns the slice [rank·chunk, (rank+1)·chunk) of the row
//   (chunk = ⌈V/8⌉ rounded to 8: 18 960 values = 37.9 KB of smem for V = 151 665).
//   Pass 1 streams the slice from HBM into smem (16-byte loads) while updating
//   (m, s); the 8 partials are exchanged through distributed shared memory
//   (cluster.sync + map_shared_rank), every block merges them in rank order, and
//   pass 2 computes the gradient from smem and writes it. HBM traffic: 2 B read +
//   2 B written per logit — the minimum; ~2 exp2 and ~8 other ops per logit stay
//   under the memory time on an H100, so the kernel is bound by memory.
// row kernel (fallback, any GPU): one block of up to 1024 threads per row; pass 1
//   reads the row, pass 2 re-reads it (mostly from L2) and writes: 4–6 B per logit.
// Both kernels give a block one thread per 16-byte vector of its slice, in whole warps,
// up to their maximum (reached from V = 32 768 in the cluster kernel, 8 192 in the row
// kernel): a small vocabulary (tests, toy models) leaves no warps idle, and the
// emulator (tests/emu), which runs every thread as a fiber, runs no idle ones.
//
// Rows need not be 16-byte aligned (V = 151 665 is odd): each slice is a scalar
// head up to the first 16-byte boundary, 16-byte vectors, and a scalar tail.
#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>

#include "cuda/check.cuh"
#include "cuda/crossentropy.cuh"
#include "cuda/device_common.cuh"
#include "cuda/launch.cuh"

namespace cg = cooperative_groups;

namespace spes::cuda {

namespace {

constexpr int kClusterSize = 8;  // the portable maximum
constexpr int kClusterThreads = 512;
constexpr int kRowThreads = 1024;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct Stat {
  float m;  // max of x·log2e
  float s;  // Σ 2^(x·log2e − m)
};

// Symmetric in its arguments (both lanes of a shuffle pair get the same result).
__device__ __forceinline__ Stat merge(Stat a, Stat b) {
  if (b.s == 0.0f) return a;
  if (a.s == 0.0f) return b;
  const float m = fmaxf(a.m, b.m);
  return {m, a.s * exp2f(a.m - m) + b.s * exp2f(b.m - m)};
}

__device__ __forceinline__ void add1(Stat& st, float x) {
  const float x2 = x * kLog2e;
  if (x2 > st.m) {
    st.s *= exp2f(st.m - x2);
    st.m = x2;
  }
  st.s += exp2f(x2 - st.m);
}

// One rescale per 8 values instead of per value.
__device__ __forceinline__ void add8(Stat& st, const float (&x)[8]) {
  float vm = x[0];
#pragma unroll
  for (int i = 1; i < 8; ++i) vm = fmaxf(vm, x[i]);
  vm *= kLog2e;
  if (vm > st.m) {
    st.s *= exp2f(st.m - vm);
    st.m = vm;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) st.s += exp2f(fmaf(x[i], kLog2e, -st.m));
}

__device__ __forceinline__ Stat warp_merge(Stat st) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    Stat other{__shfl_xor_sync(0xffffffffu, st.m, o), __shfl_xor_sync(0xffffffffu, st.s, o)};
    st = merge(st, other);
  }
  return st;
}

// Block-wide merge in a fixed tree; every thread gets the result.
__device__ Stat block_merge(Stat st, Stat* red /*[32]*/, Stat* out) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, nwarps = blockDim.x / kWarp;
  st = warp_merge(st);
  if (lane == 0) red[warp] = st;
  __syncthreads();
  if (warp == 0) {
    Stat t = lane < nwarps ? red[lane] : Stat{-INFINITY, 0.0f};
    t = warp_merge(t);
    if (lane == 0) *out = t;
  }
  __syncthreads();
  return *out;
}

// A slice of `len` values at `src`: `head` scalars up to the first 16-byte
// boundary, `nvec` 16-byte vectors, then scalars from `tail` to `len`.
struct Geom {
  int head, nvec, tail, len;
};
__device__ __forceinline__ Geom geometry(const bf16* src, int len) {
  int head = static_cast<int>(((16 - (reinterpret_cast<uintptr_t>(src) & 15)) & 15) / 2);
  head = min(head, len);
  const int nvec = (len - head) / 8;
  return {head, nvec, head + nvec * 8, len};
}

// Vectors a thread loads before it uses any in pass 1. A cluster block's slice is
// ~5 vectors per thread: read one at a time, each thread would keep one 16-byte load
// in flight, too few for HBM's latency; all of a batch in flight are 4.
constexpr int kLoadBatch = 4;

// Pass 1: softmax statistics of the slice; with STORE, also copies it to s_x
// (element e at s_x[pad + e], pad making the vectors 16-byte aligned in smem). A
// thread takes vectors tid, tid + blockDim.x, ... in that order, kLoadBatch loads
// at a time.
template <bool STORE>
__device__ Stat pass1(const bf16* src, const Geom& g, bf16* s_x, int pad) {
  Stat st{-INFINITY, 0.0f};
  const int4* vsrc = reinterpret_cast<const int4*>(src + g.head);
  const int stride = static_cast<int>(blockDim.x);
  for (int k0 = threadIdx.x; k0 < g.nvec; k0 += kLoadBatch * stride) {
    int4 raw[kLoadBatch];
#pragma unroll
    for (int b = 0; b < kLoadBatch; ++b) {
      // Read once (cluster: the smem copy serves pass 2) → evict-first; otherwise
      // keep it cacheable for the re-read.
      const int k = k0 + b * stride;
      if (k < g.nvec) raw[b] = STORE ? __ldcs(vsrc + k) : vsrc[k];
    }
#pragma unroll
    for (int b = 0; b < kLoadBatch; ++b) {
      const int k = k0 + b * stride;
      if (k >= g.nvec) break;
      if (STORE) reinterpret_cast<int4*>(s_x + pad + g.head)[k] = raw[b];
      float x[8];
      unpack8(x, raw[b]);
      add8(st, x);
    }
  }
  for (int e = threadIdx.x; e < g.head; e += blockDim.x) {
    const bf16 v = src[e];
    if (STORE) s_x[pad + e] = v;
    add1(st, __bfloat162float(v));
  }
  for (int e = g.tail + threadIdx.x; e < g.len; e += blockDim.x) {
    const bf16 v = src[e];
    if (STORE) s_x[pad + e] = v;
    add1(st, __bfloat162float(v));
  }
  return st;
}

// Pass 2: dst[e] = 2^(x·log2e − lse2)·pscale − [e == y_local]·ce_scale, with x read
// from smem (FROM_SMEM) or again from src. dst has src's alignment mod 16.
template <bool FROM_SMEM>
__device__ void pass2(bf16* dst, const bf16* src, const bf16* s_x, int pad, const Geom& g, int64_t y_local,
                      float lse2, float pscale, float ce_scale) {
  const int4* vsrc = FROM_SMEM ? reinterpret_cast<const int4*>(s_x + pad + g.head)
                               : reinterpret_cast<const int4*>(src + g.head);
  int4* vdst = reinterpret_cast<int4*>(dst + g.head);
  for (int k = threadIdx.x; k < g.nvec; k += blockDim.x) {
    float x[8];
    unpack8(x, vsrc[k]);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = exp2f(fmaf(x[i], kLog2e, -lse2)) * pscale;
    const int64_t rel = y_local - (g.head + 8 * static_cast<int64_t>(k));
    if (static_cast<uint64_t>(rel) < 8) {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (i == rel) x[i] -= ce_scale;
    }
    vdst[k] = pack8(x);
  }
  auto scalar = [&](int e) {
    const float x = __bfloat162float(FROM_SMEM ? s_x[pad + e] : src[e]);
    float d = exp2f(fmaf(x, kLog2e, -lse2)) * pscale;
    if (e == y_local) d -= ce_scale;
    dst[e] = __float2bfloat16_rn(d);
  };
  for (int e = threadIdx.x; e < g.head; e += blockDim.x) scalar(e);
  for (int e = g.tail + threadIdx.x; e < g.len; e += blockDim.x) scalar(e);
}

__global__ void __launch_bounds__(kClusterThreads)
    ce_cluster_kernel(bf16* dlogits, float* __restrict__ losses, float* __restrict__ lse_out, const bf16* logits,
                      const int32_t* __restrict__ targets, int64_t V, int64_t ld, int chunk, float ce_scale,
                      float z_scale) {
#if SPES_SM90_DEVICE_CODE
  cg::cluster_group cluster = cg::this_cluster();
  bf16* s_x = dynamic_smem<bf16>;
  __shared__ Stat red[kWarp];
  __shared__ Stat s_part;      // this block's partial: read by the whole cluster
  __shared__ Stat s_tot;       // merged row statistics
  __shared__ float s_target;   // the target logit, in the block whose slice holds it

  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t row = blockIdx.x / kClusterSize;
  const int64_t c0 = static_cast<int64_t>(rank) * chunk;
  const int64_t c1 = V < c0 + chunk ? V : c0 + chunk;
  const int len = c1 > c0 ? static_cast<int>(c1 - c0) : 0;
  const bf16* src = logits + row * ld + c0;
  const Geom g = geometry(src, len);
  const int pad = (8 - g.head) & 7;
  const int64_t y = targets[row];

  // Read before any gradient is written (dlogits may alias logits).
  if (threadIdx.x == 0 && y >= c0 && y < c0 + len) s_target = __bfloat162float(src[y - c0]);
  const Stat st = block_merge(pass1<true>(src, g, s_x, pad), red, &s_tot);
  if (threadIdx.x == 0) s_part = st;
  cluster.sync();  // all 8 partials (and s_target) published
  if (threadIdx.x == 0) {
    Stat tot{-INFINITY, 0.0f};
    for (int r = 0; r < kClusterSize; ++r) tot = merge(tot, *cluster.map_shared_rank(&s_part, r));
    s_tot = tot;
    if (rank == 0) {
      const float l = (tot.m + log2f(tot.s)) * kLn2;
      const float zt = (y >= 0 && y < V) ? *cluster.map_shared_rank(&s_target, static_cast<int>(y / chunk)) : NAN;
      losses[row] = l - zt;
      lse_out[row] = l;
    }
  }
  cluster.sync();  // every remote read done: blocks may now finish independently
  if (dlogits == nullptr) return;
  const Stat tot = s_tot;
  const float lse2 = tot.m + log2f(tot.s);
  const float pscale = ce_scale + z_scale * 2.0f * (lse2 * kLn2);
  pass2<true>(dlogits + row * ld + c0, src, s_x, pad, g, y - c0, lse2, pscale, ce_scale);
#endif
}

__global__ void __launch_bounds__(kRowThreads)
    ce_row_kernel(bf16* dlogits, float* __restrict__ losses, float* __restrict__ lse_out, const bf16* logits,
                  const int32_t* __restrict__ targets, int64_t V, int64_t ld, float ce_scale, float z_scale) {
  __shared__ Stat red[kWarp];
  __shared__ Stat s_tot;
  const int64_t row = blockIdx.x;
  const bf16* src = logits + row * ld;
  const Geom g = geometry(src, static_cast<int>(V));
  const int64_t y = targets[row];
  // Read before block_merge's barrier, i.e. before any gradient is written.
  const float zt = (threadIdx.x == 0 && y >= 0 && y < V) ? __bfloat162float(src[y]) : NAN;
  const Stat st = block_merge(pass1<false>(src, g, nullptr, 0), red, &s_tot);
  const float lse2 = st.m + log2f(st.s);
  const float l = lse2 * kLn2;
  if (threadIdx.x == 0) {
    losses[row] = l - zt;
    lse_out[row] = l;
  }
  if (dlogits == nullptr) return;
  const float pscale = ce_scale + z_scale * 2.0f * l;
  pass2<false>(dlogits + row * ld, src, nullptr, 0, g, y, lse2, pscale, ce_scale);
}

// A thread per 16-byte vector of a slice of `len` values, in whole warps, at most `max`.
unsigned block_threads(int64_t len, int max) {
  return static_cast<unsigned>(std::min<int64_t>(round_up(std::max<int64_t>(ceil_div(len, 8), 1), kWarp), max));
}

int cluster_chunk(int64_t V) { return static_cast<int>(round_up(ceil_div(V, kClusterSize), 8)); }
size_t cluster_smem_bytes(int64_t V) { return (static_cast<size_t>(cluster_chunk(V)) + 8) * sizeof(bf16); }

cudaLaunchConfig_t cluster_config(int64_t N, int64_t V, cudaStream_t stream, cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(N * kClusterSize));
  cfg.blockDim = dim3(block_threads(cluster_chunk(V), kClusterThreads));
  cfg.dynamicSmemBytes = cluster_smem_bytes(V);
  cfg.stream = stream;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = kClusterSize;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// What the cluster kernel needs to know about one device. The launcher runs for every
// chunk of logits of every step, so the device is asked once: the attributes when the
// device is first seen, the shared-memory opt-in when a larger V first needs it (in
// practice once per run), the cluster occupancy once per row-slice size.
struct ClusterDevice {
  bool eligible = false;    // sm_90+ GPU and sm_90 code in this build
  size_t smem_max = 0;      // dynamic smem a block may opt in to: opt-in limit − static smem
  size_t smem_allowed = 0;  // current cudaFuncAttributeMaxDynamicSharedMemorySize
  std::map<int, bool> fits;  // row-slice length (the block's smem and threads) → a cluster of 8 fits
};

ClusterDevice query_device(int dev) {
  ClusterDevice d;
  int major = 0, optin = 0;
  cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  cuda_check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  cudaFuncAttributes fa{};
  cuda_check(cudaFuncGetAttributes(&fa, ce_cluster_kernel));
  // ptxVersion < 90: built without sm_90 code, the kernel body is empty.
  d.eligible = major >= 9 && fa.ptxVersion >= 90;
  d.smem_max = static_cast<size_t>(optin) > fa.sharedSizeBytes ? optin - fa.sharedSizeBytes : 0;
  d.smem_allowed = static_cast<size_t>(fa.maxDynamicSharedSizeBytes);
  return d;
}

// Whether the cluster kernel can run on device `dev` for rows of V logits; raises the
// kernel's opt-in to the slice's shared memory first if needed. Thread-safe: one
// mutex over all devices (one host thread per GPU, a few calls per step).
bool cluster_supported(int dev, int64_t V) {
  const int chunk = cluster_chunk(V);
  const size_t smem = cluster_smem_bytes(V);
  static std::mutex mu;
  static std::map<int, ClusterDevice> devices;
  std::lock_guard<std::mutex> lock(mu);
  auto it = devices.find(dev);
  if (it == devices.end()) it = devices.emplace(dev, query_device(dev)).first;  // nothing stored on a throw
  ClusterDevice& d = it->second;
  if (!d.eligible || smem > d.smem_max) return false;
  auto f = d.fits.find(chunk);
  if (f != d.fits.end()) return f->second;
  if (smem > d.smem_allowed) {
    // The opt-in is per (kernel, device) and only ever raised: a smaller V later runs
    // under the larger limit.
    cuda_check(cudaFuncSetAttribute(ce_cluster_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
    d.smem_allowed = smem;
  }
  cudaLaunchAttribute attr{};
  cudaLaunchConfig_t cfg = cluster_config(1, V, nullptr, &attr);
  int clusters = 0;
  // A device or driver may refuse the query itself (MIG or MPS set-ups): that means
  // "no clusters here", and the per-row kernel runs, rather than a failed step.
  if (cudaOccupancyMaxActiveClusters(&clusters, ce_cluster_kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();  // the refusal is not a sticky error: clear it
    clusters = 0;
  }
  return d.fits.emplace(chunk, clusters > 0).first->second;
}

}  // namespace

bool crossentropy_cluster_supported(int64_t V) {
  require(V > 0 && V < (int64_t(1) << 30), "crossentropy_cluster_supported", "need 0 < V < 2^30");
  int dev = 0;
  cuda_check(cudaGetDevice(&dev));  // the calling thread's current device: no device query
  return cluster_supported(dev, V);
}

void crossentropy_forward_backward(bf16* dlogits, float* losses, float* lse, const bf16* logits,
                                   const int32_t* targets, int64_t N, int64_t V, int64_t ld, float ce_scale,
                                   float z_scale, cudaStream_t stream, CeImpl impl) {
  const char* op = "crossentropy_forward_backward";
  require(V > 0 && V < (int64_t(1) << 30) && ld >= V, op, "need 0 < V < 2^30 and ld ≥ V");
  require(N >= 0 && N < (int64_t(1) << 28), op, "need 0 ≤ N < 2^28 rows (8 blocks per row must fit the grid)");
  // Rows may start anywhere (each slice runs scalar up to its first 16-byte boundary),
  // but the gradient is written with the logits' vector boundaries.
  require_ptr(logits, 2, op, "logits");
  require_aligned(dlogits, 2, op, "dlogits");
  require(dlogits == nullptr ||
              (reinterpret_cast<uintptr_t>(dlogits) - reinterpret_cast<uintptr_t>(logits)) % 16 == 0,
          op, "dlogits must have the same 16-byte alignment offset as logits");
  require_ptr(losses, 4, op, "losses");
  require_ptr(lse, 4, op, "lse");
  require_ptr(targets, 4, op, "targets");
  // In place (dlogits == logits) each element is read before it is written, by the
  // same thread; a partial overlap would have other threads' rows race.
  const size_t span = N > 0 ? size_t((N - 1) * ld + V) * sizeof(bf16) : 0;
  if (dlogits != logits)
    require_disjoint(dlogits, span, logits, span, op,
                     "dlogits must be the logits themselves (in place) or not overlap them");
  if (N == 0) return;
  bool cluster = false;
  if (impl == CeImpl::automatic) cluster = crossentropy_cluster_supported(V);
  else if (impl == CeImpl::cluster) {
    require(crossentropy_cluster_supported(V), op, "the cluster kernel needs sm_90+ code on an sm_90+ GPU");
    cluster = true;
  }
  if (cluster) {
    cudaLaunchAttribute attr{};
    const cudaLaunchConfig_t cfg = cluster_config(N, V, stream, &attr);
    cuda_check(launch_ex(cfg, ce_cluster_kernel, dlogits, losses, lse, logits, targets, V, ld, cluster_chunk(V),
                         ce_scale, z_scale));
  } else {
    launch(ce_row_kernel, static_cast<unsigned>(N), block_threads(V, kRowThreads), 0, stream, dlogits, losses, lse,
           logits, targets, V, ld, ce_scale, z_scale);
  }
  cuda_check_launch();
}

}  // namespace spes::cuda
