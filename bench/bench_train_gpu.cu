// The whole GPU training step (issue "Train on the GPU" §5) at the configs/spes-1b.toml
// shape — vocab 151665, d_model 768, 12 layers, 12 heads, 16 experts top-2, expert
// hidden 2048, seq_len 2048, micro_batch 8 — for a node owning all 16 experts and a
// SPES node owning 4 of 16. A GpuBackend is driven directly (no trainer, no data
// files) with random tokens: zero_grads, forward_backward × micro-batches,
// grad_sum_squares, optimizer_step with clipping, as the trainer's step does.
//
// Reported per node:
//   - step time (median of --steps timed steps after one warm-up; host clock around
//     the step, device synchronised), tokens/s, and MFU = model/flops' training
//     FLOPs per token × tokens/s over the backend's peak_flops();
//   - the step's phases from the same host clock: forward+backward of all
//     micro-batches, the gradient norm, AdamW;
//   - device memory: cudaMemGetInfo before the backend and after the timed steps
//     (what the node really took), next to the memory plan's total and categories;
//   - which kernels the grouped expert GEMMs take (sm90a, or portable: where the
//     device lacks sm_90a or SPES_GROUPED_GEMM=portable keeps them there), and which
//     the attention takes (likewise, and portable where the sm90a kernels failed
//     their check against the portable ones on this GPU);
//   - the per-kernel share of the step: every kernel the step launches, timed in
//     isolation at the step's shapes (median of 25 runs after warm-up, CUDA events),
//     times its calls per step, as ms and % of the measured step, with its achieved
//     TFLOP/s (GEMMs, attention, MoE: useful FLOPs) or GB/s (memory-bound kernels:
//     minimum bytes moved, bench/common.cuh's convention). The rows' sum against the
//     measured step mixes two things: kernels running slower inside the step than
//     alone, and the device waiting (launch gaps, token copies, loss read-backs);
//   - the timeline of one more step, traced by CUPTI (bench/cupti_timeline.hpp) where
//     the machine has it, after a traced warm-up: the device's busy time, the time
//     outside kernels and copies (the step minus that, goal <= 2%) split into before
//     the first work, gaps between work (by length, the longest named by the work
//     either side) and after the last, and every kernel's own time inside the step;
//   - for the all-experts node, the same step through the NCCL data-parallel path at
//     one rank (issue 16): its overhead over the plain backend (goal ≤ 2%), the
//     all-reduce of the owned gradients, and that all-reduce projected to 8 GPUs.
//
// Usage: bench_train_gpu [--steps N] [--micro-batches N] [--micro-batch N] [--layers N] [--profile]
//   --micro-batches: gradient-accumulation micro-batches per step (default: the
//   config's global_batch / micro_batch = 32). Without a GPU it prints "no GPU:
//   <reason>" and exits 0, like the other GPU benches.
//   --profile: for a profiler, not a measurement: the all-experts node takes one
//   warm-up step and one more step inside the NVTX range "profiled step" (which
//   `ncu --nvtx --nvtx-include "profiled step/"` selects), and the bench exits.
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "bench/common.cuh"
#include "bench/cupti_timeline.hpp"
#include "bench/timeline.hpp"
#include "cuda/adamw.cuh"
#include "cuda/attention.cuh"
#include "cuda/crossentropy.cuh"
#include "cuda/device_probe.hpp"
#include "cuda/embedding.cuh"
#include "cuda/global_norm.cuh"
#include "cuda/grouped_gemm.cuh"
#include "cuda/loss.cuh"
#include "cuda/matmul.cuh"
#include "cuda/moe.cuh"
#include "cuda/rmsnorm.cuh"
#include "cuda/rope.cuh"
#include "cuda/router.cuh"
#include "cuda/runtime.cuh"
#include "engine/backend.hpp"
#include "engine/base/error.hpp"
#include "engine/config.hpp"
#include "engine/gpu_backend.hpp"
#include "model/flops.hpp"
#include "model/gpu/gpu_model.cuh"
#include "model/gpu/gpu_plan.hpp"
#include "model/gpu_memory.hpp"
#include "model/layout.hpp"

namespace {

using namespace spes;
using spes::bench::DevBuf;
using spes::cuda::bf16;
using spes::cuda::DType;
using Clock = std::chrono::steady_clock;

struct Options {
  int steps = 3;
  int64_t micro_batches = 0;  // 0 = global_batch / micro_batch
  int64_t micro_batch = 0;    // 0 = the config's
  int64_t layers = 0;         // 0 = the config's (shrunk only when memory requires)
  bool profile = false;       // one warm-up step, one step in kProfiledStep, exit (see the usage)
};

constexpr const char* kProfiledStep = "profiled step";

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

double gib(double bytes) { return bytes / double(int64_t(1) << 30); }

size_t free_bytes() {
  size_t f = 0, t = 0;
  cuda_check(cudaMemGetInfo(&f, &t));
  return f;
}

// One line of the per-kernel table.
struct Row {
  std::string kernel;
  double calls = 0;       // per step
  double ms_call = 0;     // isolated, median
  double work = 0;        // per call: FLOPs (flops = true) or bytes
  bool flops = true;
};

struct StepResult {
  double step_ms = 0, fb_ms = 0, norm_ms = 0, adam_ms = 0;
  double tokens_per_s = 0, mfu = 0;
  double taken_bytes = 0;
};

// ---- one step as the device saw it (bench/timeline.hpp) -----------------------------

void print_timeline(const spes::bench::CuptiTimeline::Trace& trace, double untraced_ms) {
  using spes::bench::fit;
  const spes::bench::TimelineSummary t = spes::bench::summarize_timeline(trace.spans);
  const double ms = 1e-6, step = double(trace.host_end_ns - trace.host_start_ns) * ms;
  const double outside = step - double(t.busy_ns) * ms;
  std::printf("traced step: %.1f ms on the host clock (the untraced steps' median: %.1f ms)\n", step, untraced_ms);
  if (trace.dropped || trace.untimed)
    std::printf("warning: %zu records dropped by CUPTI, %zu without timestamps: the device was busier than this says\n",
                trace.dropped, trace.untimed);
  std::printf("device busy (kernels, copies, memsets; overlaps counted once): %.2f ms = %.1f%% of the step\n",
              double(t.busy_ns) * ms, 100.0 * double(t.busy_ns) * ms / step);
  // Before and after come from CUPTI's mapping of device times onto the host clock:
  // a slightly negative one is that mapping's error.
  std::printf("time outside kernels and copies: %.2f ms = %.2f%% of the step (goal <= 2%%): %.2f ms before the first "
              "work started, %.2f ms idle between work in %zu gaps, %.2f ms from the last work's end to the host's\n",
              outside, 100.0 * outside / step, (double(t.first_start_ns) - double(trace.host_start_ns)) * ms,
              double(t.idle_ns) * ms, t.gaps.size(), (double(trace.host_end_ns) - double(t.last_end_ns)) * ms);
  // Launch-to-launch gaps on a busy stream are a few µs; longer ones are the device
  // waiting on the host (a sync, a copy, a slow launch).
  const double bounds_us[] = {5, 50, 500};
  int64_t count[4] = {};
  double total[4] = {};
  for (const auto& g : t.gaps) {
    const double us = double(g.ns) * 1e-3;
    int b = 0;
    while (b < 3 && us >= bounds_us[b]) ++b;
    count[b] += 1, total[b] += double(g.ns) * ms;
  }
  std::printf("gaps by length: < 5 us: %lld, %.2f ms; 5-50 us: %lld, %.2f ms; 50-500 us: %lld, %.2f ms; "
              ">= 500 us: %lld, %.2f ms\n",
              (long long)count[0], total[0], (long long)count[1], total[1], (long long)count[2], total[2],
              (long long)count[3], total[3]);
  std::printf("the longest gaps:\n");
  for (size_t i = 0; i < std::min<size_t>(8, t.gaps.size()); ++i) {
    const auto& g = t.gaps[i];
    std::printf("  %8.3f ms at +%.2f ms, after %s, before %s\n", double(g.ns) * ms,
                (double(g.start_ns) - double(trace.host_start_ns)) * ms, fit(g.after, 60).c_str(),
                fit(g.before, 60).c_str());
  }
  // Each row is its kernel's own time; kernels that overlap each count in full.
  std::printf("%-74s %7s %9s %7s %10s\n", "kernel (in the traced step, the device's own times)", "calls", "ms",
              "% step", "us/call");
  const size_t shown = std::min<size_t>(40, t.names.size());
  double rest = 0;
  for (size_t i = 0; i < t.names.size(); ++i) {
    const auto& n = t.names[i];
    const double nms = double(n.ns) * ms;
    if (i >= shown) {
      rest += nms;
      continue;
    }
    std::printf("%-74s %7lld %9.2f %6.1f%% %10.1f\n", fit(n.name, 74).c_str(), (long long)n.calls, nms,
                100.0 * nms / step, 1e3 * nms / double(n.calls));
  }
  if (shown < t.names.size())
    std::printf("%-74s %7s %9.2f %6.1f%%\n", ("the other " + std::to_string(t.names.size() - shown)).c_str(), "",
                rest, 100.0 * rest / step);
}

// Two more steps under CUPTI's activity tracing, the first a warm-up (CUPTI sets up
// its buffers on the first traced work); of the second, where the device was busy
// and idle, and each kernel's time inside the step rather than alone. A CUPTI
// failure is said and the bench goes on; the step's own errors end it as usual.
template <class Step>
void trace_step(Step&& step, double untraced_ms) {
  std::string why;
  spes::bench::CuptiTimeline* timeline = spes::bench::CuptiTimeline::open(&why);
  if (!timeline) {
    std::printf("timeline: not traced: %s\n", why.c_str());
    return;
  }
  std::fflush(stdout);  // what came before survives a failure inside CUPTI
  spes::bench::CuptiTimeline::Trace trace;
  try {
    timeline->trace(step);
    trace = timeline->trace(step);
  } catch (const spes::bench::CuptiError& e) {
    std::printf("timeline: not traced: %s (%s)\n", e.what(), timeline->describe().c_str());
    return;
  }
  if (trace.spans.empty()) {
    std::printf("timeline: not traced: CUPTI gave no timed records of the step (%s)\n",
                timeline->describe().c_str());
    return;
  }
  std::printf("\n-- timeline of one more step (%s; %zu records) --\n", timeline->describe().c_str(),
              trace.spans.size());
  print_timeline(trace, untraced_ms);
}

// ---- the whole step, through the backend ---------------------------------------------

// nccl: the backend is the data-parallel one over NCCL with one rank (GPU 0), as a
// node with several GPUs runs, instead of the plain GpuBackend.
StepResult time_step(const Config& cfg, const Options& opt, int64_t n_micro, bool nccl = false) {
  const ParamLayout layout = make_layout(cfg.model);
  const Ownership own = make_ownership(cfg.model, layout, int(cfg.spes.node_id), int(cfg.spes.n_nodes),
                                       cfg.spes.ownership, cfg.spes.experts_per_node);
  const int64_t B = cfg.train.micro_batch, T = cfg.model.seq_len, N = B * T;
  cuda_check(cudaDeviceSynchronize());
  const size_t free0 = free_bytes();
  std::unique_ptr<TrainBackend> gpu =
      nccl ? make_nccl_data_parallel_backend(cfg, layout, own, {0}) : make_gpu_rank(cfg, layout, own);
  init_parameters(gpu->host_theta().data(), cfg.model, layout, cfg.train.seed);
  gpu->push_theta();

  // A few distinct random micro-batches, cycled.
  const int kPool = 4;
  std::mt19937 g(123);
  std::uniform_int_distribution<int32_t> tok(0, int32_t(cfg.model.vocab_size - 1));
  std::vector<std::vector<int32_t>> xs(kPool), ys(kPool);
  for (int p = 0; p < kPool; ++p) {
    xs[p].resize(size_t(N)), ys[p].resize(size_t(N));
    for (int64_t i = 0; i < N; ++i) xs[p][i] = tok(g), ys[p][i] = tok(g);
  }

  // One training step as the trainer takes it (t: AdamW's step count); the host
  // clock before it, after the micro-batches, after the norm and after AdamW.
  struct StepTimes {
    Clock::time_point start, fb_done, norm_done, end;
  };
  auto one_step = [&](int t) {
    StepTimes at;
    cuda_check(cudaDeviceSynchronize());
    at.start = Clock::now();
    gpu->zero_grads();
    for (int64_t i = 0; i < n_micro; ++i)
      gpu->forward_backward(xs[i % kPool].data(), ys[i % kPool].data(), 1.0f, 1.0f / float(n_micro));
    at.fb_done = Clock::now();
    const double norm = std::sqrt(gpu->grad_sum_squares());
    at.norm_done = Clock::now();
    AdamWStep st;
    st.lr = cfg.optim.lr, st.beta1 = cfg.optim.beta1, st.beta2 = cfg.optim.beta2, st.eps = cfg.optim.eps;
    st.weight_decay = cfg.optim.weight_decay, st.t = t;
    if (cfg.optim.grad_clip > 0 && norm > cfg.optim.grad_clip) st.grad_scale = float(cfg.optim.grad_clip / (norm + 1e-6));
    gpu->optimizer_step(st);
    cuda_check(cudaDeviceSynchronize());
    at.end = Clock::now();
    return at;
  };
  std::vector<double> step_ms, fb_ms, norm_ms, adam_ms;
  size_t min_free = free_bytes();
  for (int s = 0; s < 1 + opt.steps; ++s) {
    const bool profiled = opt.profile && s == 1;
    if (profiled) nvtxRangePushA(kProfiledStep);
    const StepTimes at = one_step(s + 1);
    if (profiled) nvtxRangePop();
    min_free = std::min(min_free, free_bytes());
    if (s == 0) continue;  // warm-up: GEMM plans, lazy module loading, first touches
    step_ms.push_back(ms_between(at.start, at.end));
    fb_ms.push_back(ms_between(at.start, at.fb_done));
    norm_ms.push_back(ms_between(at.fb_done, at.norm_done));
    adam_ms.push_back(ms_between(at.norm_done, at.end));
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  StepResult r;
  r.step_ms = median(step_ms);
  r.fb_ms = median(fb_ms);
  r.norm_ms = median(norm_ms);
  r.adam_ms = median(adam_ms);
  const double tokens = double(n_micro) * double(N);
  r.tokens_per_s = tokens / (r.step_ms / 1e3);
  const PeakFlops peak = gpu->peak_flops();
  r.mfu = peak.flops > 0 ? train_flops_per_token(cfg.model) * r.tokens_per_s / peak.flops : 0;
  r.taken_bytes = double(free0) - double(min_free);

  std::printf("backend: %s\n", gpu->describe().c_str());
  std::printf("step: median %.1f ms of %d (min %.1f, max %.1f); %.0f tokens/step, %.0f tokens/s\n", r.step_ms,
              opt.steps, *std::min_element(step_ms.begin(), step_ms.end()),
              *std::max_element(step_ms.begin(), step_ms.end()), tokens, r.tokens_per_s);
  // Each step in order: a trend shows warming caches rather than noise.
  std::printf("steps in order (ms):");
  for (const double ms : step_ms) std::printf(" %.1f", ms);
  std::printf("\n");
  std::printf("MFU: %.1f%% (%.3f GFLOP/token training, peak %.1f TFLOP/s: %s)\n", 100.0 * r.mfu,
              train_flops_per_token(cfg.model) / 1e9, peak.flops / 1e12, peak.source.c_str());
  std::printf("phases: forward+backward %.1f ms (%lld micro-batches, %.2f ms each), grad norm %.2f ms, AdamW %.2f ms\n",
              r.fb_ms, (long long)n_micro, r.fb_ms / double(n_micro), r.norm_ms, r.adam_ms);
  std::printf("device memory: %.2f GiB taken (cudaMemGetInfo before the backend and lowest after; %.2f GiB free before)\n",
              gib(r.taken_bytes), gib(double(free0)));
  if (nccl) return r;  // the memory lines are the plain backend's (its rank's arena)
  const GpuMemoryUse use = gpu_memory_use(*gpu);
  std::printf("memory plan: total %.2f GiB (arena %.2f GiB, %.2f GiB of it carved)\n", gib(double(use.plan.total())),
              gib(double(use.arena_capacity)), gib(double(use.arena_used)));
  for (const MemoryLine& l : memory_report(use.plan))
    if (l.category != "total") std::printf("  %-40s %10.3f GiB\n", l.category.c_str(), gib(double(l.bytes)));
  if (opt.profile) return r;  // CUPTI's tracing and the profiler's would meet
  int t = opt.steps + 1;  // AdamW's step count goes on from the timed steps
  trace_step([&] { one_step(++t); }, r.step_ms);
  return r;
}

// ---- every kernel of the step, in isolation at the step's shapes ----------------------

std::vector<Row> time_kernels(const Config& cfg, int64_t n_micro) {
  const ModelConfig& m = cfg.model;
  const ParamLayout layout = make_layout(m);
  const Ownership own = make_ownership(m, layout, int(cfg.spes.node_id), int(cfg.spes.n_nodes), cfg.spes.ownership,
                                       cfg.spes.experts_per_node);
  const int64_t B = cfg.train.micro_batch, T = m.seq_len, N = B * T, d = m.d_model, kv = m.kv_dim();
  const int64_t H = m.n_heads, Hkv = m.n_kv_heads, D = m.head_dim(), V = m.vocab_size, L = m.n_layers;
  const int64_t E = m.n_experts, K = m.top_k, Hx = m.expert_hidden, S = N * K;
  const int64_t Vpad = logits_row_stride(V), chunk = lm_chunk_tokens(N, V);
  const double nm = double(n_micro), bs = 2.0;
  cuda::Runtime rt(0);
  cudaStream_t s = rt.stream();
  cuda::Gemm& g = rt.gemm();
  std::vector<Row> rows;
  auto add = [&](const std::string& name, double calls_per_micro, double per_step, double work, bool flops,
                 auto&& f) {
    Row r;
    r.kernel = name;
    r.calls = calls_per_micro * nm + per_step;
    r.ms_call = spes::bench::median_ms(f, s);
    r.work = work;
    r.flops = flops;
    rows.push_back(r);
  };

  // Activations and weights (values as at init: unit-RMS activations, weights of std 0.02).
  const float w_scale = 0.02f * std::sqrt(3.0f), a_scale = std::sqrt(3.0f);
  DevBuf x(N * d * 2), y(N * d * 2), z(N * d * 2), o(N * d * 2), kx(N * kv * 2), ky(N * kv * 2), kz(N * kv * 2);
  DevBuf rstd(N * 4), lse(B * H * T * 4), wnorm(std::max(d, kv) * 2), dwnorm(std::max(d, kv) * 4);
  DevBuf wq(d * d * 2), wk(kv * d * 2), dwq(d * d * 4), dwk(kv * d * 4);
  for (auto* b : {&x, &y, &z, &o}) spes::bench::fill(b->as<bf16>(), N * d, s, uint32_t(uintptr_t(b->p) >> 8), a_scale);
  for (auto* b : {&kx, &ky, &kz}) spes::bench::fill(b->as<bf16>(), N * kv, s, uint32_t(uintptr_t(b->p) >> 8), a_scale);
  spes::bench::fill(wnorm.as<bf16>(), std::max(d, kv), s, 3, 1.0f);
  spes::bench::fill(wq.as<bf16>(), d * d, s, 4, w_scale);
  spes::bench::fill(wk.as<bf16>(), kv * d, s, 5, w_scale);
  cuda_check(cudaMemsetAsync(dwq.p, 0, dwq.bytes, s));
  cuda_check(cudaMemsetAsync(dwk.p, 0, dwk.bytes, s));
  cuda_check(cudaMemsetAsync(dwnorm.p, 0, dwnorm.bytes, s));
  std::vector<int32_t> tokens(static_cast<size_t>(N));
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> tok(0, int32_t(V - 1));
  std::set<int32_t> uniq;
  for (auto& t : tokens) uniq.insert(t = tok(rng));
  DevBuf d_tok(N * 4);
  cuda_check(cudaMemcpy(d_tok.p, tokens.data(), size_t(N) * 4, cudaMemcpyHostToDevice));
  cuda_check(cudaStreamSynchronize(s));

  const double act = double(N) * d * bs, kv_act = double(N) * kv * bs;
  // Embedding (the table is the lm head's size).
  {
    DevBuf table(V * d * 2), dtable(V * d * 4);
    spes::bench::fill(table.as<bf16>(), V * d, s, 6, w_scale);
    cuda_check(cudaMemsetAsync(dtable.p, 0, dtable.bytes, s));
    cuda_check(cudaDeviceSynchronize());
    add("embedding fwd", 1, 0, 2 * act, false,
        [&] { cuda::embedding_forward(x.as<bf16>(), d_tok.as<int32_t>(), table.as<bf16>(), N, d, V, s); });
    const size_t ws = cuda::embedding_backward_workspace_bytes(N, V);
    DevBuf wsb(ws);
    add("embedding bwd", 1, 0, act + 2.0 * double(uniq.size()) * d * 4, false, [&] {
      cuda::embedding_backward(dtable.as<float>(), y.as<bf16>(), d_tok.as<int32_t>(), N, d, V, wsb.p, ws, s);
    });
  }
  // RMSNorm + residual, 2 per layer + the final norm.
  const size_t rs = cuda::rmsnorm_backward_scratch_bytes(N, d);
  DevBuf rscratch(rs);
  add("rmsnorm fwd (+residual)", 2 * L + 1, 0, 4 * act, false, [&] {
    cuda::rmsnorm_forward(o.as<bf16>(), rstd.as<float>(), z.as<bf16>(), x.as<bf16>(), y.as<bf16>(),
                          wnorm.as<bf16>(), N, d, float(m.norm_eps), s);
  });
  add("rmsnorm bwd (+residual)", 2 * L + 1, 0, 4 * act, false, [&] {
    cuda::rmsnorm_backward(o.as<bf16>(), dwnorm.as<float>(), rscratch.p, y.as<bf16>(), x.as<bf16>(), z.as<bf16>(),
                           wnorm.as<bf16>(), rstd.as<float>(), N, d, s);
  });
  // Attention projections (q, o: d → d; k, v: d → kv), forward and backward.
  add("q,o proj GEMM fwd", 2 * L, 0, 2.0 * N * d * d, true,
      [&] { cuda::matmul_forward(g, o.as<bf16>(), DType::bf16, x.as<bf16>(), wq.as<bf16>(), N, d, d, s); });
  add("k,v proj GEMM fwd", 2 * L, 0, 2.0 * N * d * kv, true,
      [&] { cuda::matmul_forward(g, kz.as<bf16>(), DType::bf16, x.as<bf16>(), wk.as<bf16>(), N, d, kv, s); });
  add("q,o proj GEMM bwd input", 2 * L, 0, 2.0 * N * d * d, true, [&] {
    cuda::matmul_backward_input(g, o.as<bf16>(), DType::bf16, y.as<bf16>(), wq.as<bf16>(), N, d, d, s);
  });
  add("k,v proj GEMM bwd input (+=)", 2 * L, 0, 2.0 * N * d * kv, true, [&] {
    cuda::matmul_backward_input(g, o.as<bf16>(), DType::bf16, ky.as<bf16>(), wk.as<bf16>(), N, d, kv, s, true);
  });
  add("q,o proj GEMM bwd weight", 2 * L, 0, 2.0 * N * d * d, true,
      [&] { cuda::matmul_backward_weight(g, dwq.as<float>(), y.as<bf16>(), x.as<bf16>(), N, d, d, s); });
  add("k,v proj GEMM bwd weight", 2 * L, 0, 2.0 * N * d * kv, true,
      [&] { cuda::matmul_backward_weight(g, dwk.as<float>(), ky.as<bf16>(), x.as<bf16>(), N, d, kv, s); });
  // QK-norm + RoPE on q (H heads) and k (Hkv heads).
  {
    DevBuf table(cuda::rope_table_bytes(T, D));
    cuda::rope_table_init(table.as<float2>(), T, D, m.rope_theta, s);
    const size_t qs = std::max(cuda::qknorm_rope_backward_scratch_bytes(B, T, H, D),
                               cuda::qknorm_rope_backward_scratch_bytes(B, T, Hkv, D));
    DevBuf qscratch(qs);
    add("qknorm+rope fwd (q)", L, 0, 2 * act, false, [&] {
      cuda::qknorm_rope_forward(o.as<bf16>(), rstd.as<float>(), x.as<bf16>(), wnorm.as<bf16>(), table.as<float2>(),
                                B, T, H, D, float(m.norm_eps), s);
    });
    add("qknorm+rope fwd (k)", L, 0, 2 * kv_act, false, [&] {
      cuda::qknorm_rope_forward(kz.as<bf16>(), rstd.as<float>(), kx.as<bf16>(), wnorm.as<bf16>(),
                                table.as<float2>(), B, T, Hkv, D, float(m.norm_eps), s);
    });
    add("qknorm+rope bwd (q)", L, 0, 3 * act, false, [&] {
      cuda::qknorm_rope_backward(o.as<bf16>(), dwnorm.as<float>(), qscratch.p, y.as<bf16>(), x.as<bf16>(),
                                 wnorm.as<bf16>(), rstd.as<float>(), table.as<float2>(), B, T, H, D, s);
    });
    add("qknorm+rope bwd (k)", L, 0, 3 * kv_act, false, [&] {
      cuda::qknorm_rope_backward(kz.as<bf16>(), dwnorm.as<float>(), qscratch.p, ky.as<bf16>(), kx.as<bf16>(),
                                 wnorm.as<bf16>(), rstd.as<float>(), table.as<float2>(), B, T, Hkv, D, s);
    });
  }
  // Causal attention: QKᵀ and PV over half the T×T scores (2 GEMMs fwd, 5 bwd).
  {
    const double causal = double(B) * H * T * T * D;  // 2·(T²/2)·D multiply-adds ×2 products
    DevBuf dq(N * d * 2), dk(N * kv * 2), dv(N * kv * 2), ascratch(cuda::attention_backward_scratch_bytes(B, T, H));
    add("attention fwd", L, 0, 2 * causal, true, [&] {
      cuda::attention_forward(o.as<bf16>(), lse.as<float>(), x.as<bf16>(), kx.as<bf16>(), ky.as<bf16>(), B, T, H,
                              Hkv, D, s);
    });
    add("attention bwd", L, 0, 5 * causal, true, [&] {
      cuda::attention_backward(dq.as<bf16>(), dk.as<bf16>(), dv.as<bf16>(), y.as<bf16>(), x.as<bf16>(),
                               kx.as<bf16>(), ky.as<bf16>(), o.as<bf16>(), lse.as<float>(), ascratch.p, B, T, H, Hkv,
                               D, s);
    });
  }
  // The lm head and the fused cross-entropy, chunk by chunk (full chunks, plus the rest).
  {
    DevBuf wlm(V * d * 2), dwlm(V * d * 4), logits(chunk * Vpad * 2), losses(N * 4), lsev(N * 4), sums(16);
    spes::bench::fill(wlm.as<bf16>(), V * d, s, 8, w_scale);
    cuda_check(cudaMemsetAsync(dwlm.p, 0, dwlm.bytes, s));
    cuda_check(cudaDeviceSynchronize());
    const int64_t full = N / chunk, rest = N % chunk;
    for (const int64_t n : {chunk, rest}) {
      if (n == 0) continue;
      const double calls = n == chunk && full > 0 ? double(full) : 1.0;
      const std::string tag = " [" + std::to_string(n) + " tokens]";
      add("lm head GEMM fwd" + tag, calls, 0, 2.0 * n * d * V, true, [&] {
        cuda::matmul_forward(g, logits.as<bf16>(), DType::bf16, x.as<bf16>(), wlm.as<bf16>(), n, d, V, s, false, Vpad);
      });
      add("cross-entropy fwd+bwd (fused)" + tag, calls, 0, 2.0 * n * V * bs, false, [&] {
        cuda::crossentropy_forward_backward(logits.as<bf16>(), losses.as<float>(), lsev.as<float>(), logits.as<bf16>(),
                                            d_tok.as<int32_t>(), n, V, Vpad, 1.0f / float(N), 1e-5f / float(N), s);
      });
      add("lm head GEMM bwd input" + tag, calls, 0, 2.0 * n * d * V, true, [&] {
        cuda::matmul_backward_input(g, o.as<bf16>(), DType::bf16, logits.as<bf16>(), wlm.as<bf16>(), n, d, V, s,
                                    false, Vpad);
      });
      add("lm head GEMM bwd weight" + tag, calls, 0, 2.0 * n * d * V, true, [&] {
        cuda::matmul_backward_weight(g, dwlm.as<float>(), logits.as<bf16>(), x.as<bf16>(), n, d, V, s, true, Vpad);
      });
    }
    add("loss sums", 1, 0, 8.0 * N, false,
        [&] { cuda::loss_sums(sums.as<double>(), losses.as<float>(), lsev.as<float>(), N, s); });
  }
  // The MoE block as the model runs it: the router GEMM and router, dispatch, gather,
  // the experts' grouped GEMMs and SwiGLU, combine; backward, where the frozen experts
  // of this node get no weight-gradient tiles. The routing is the one x gives at init.
  int64_t owned_slots = 0;
  {
    const int64_t blk = 3 * Hx * d;  // one expert's gate, up, down as the layout keeps them
    DevBuf router(E * d * 2), w(E * blk * 2), gw(E * blk * 4), grouter(E * d * 4), mout(N * d * 2);
    DevBuf probs(N * E * 4), rlse(N * 4), idx(N * K * 4), tw(N * K * 4), dtw(N * K * 4), dlog(N * E * 2);
    DevBuf partials(cuda::router_partials_count(N, E) * 4), dscratch(cuda::moe_dispatch_scratch_count(N, E, K) * 4);
    DevBuf offsets((E + 1) * 4), slot_token(S * 4), token_slot(S * 4), lbw(E * 4), aux(8), cs(E * 4);
    DevBuf xe(S * d * 2), gu(S * 2 * Hx * 2), hx(S * Hx * 2), ye(S * d * 2), dye(S * d * 2), dgu(S * 2 * Hx * 2);
    DevBuf tables(4 * E * 8), trained(E * 4);
    spes::bench::fill(router.as<bf16>(), E * d, s, 9, w_scale);
    spes::bench::fill(w.as<bf16>(), E * blk, s, 10, w_scale);
    cuda_check(cudaMemsetAsync(gw.p, 0, gw.bytes, s));
    cuda_check(cudaMemsetAsync(grouter.p, 0, grouter.bytes, s));
    std::vector<float> ones(size_t(E), 1.0f);
    std::vector<const void*> t(size_t(4 * E));
    std::vector<int32_t> owned_list;
    for (int64_t e = 0; e < E; ++e) {
      const bool owned = own.owns_expert(int(e));
      t[size_t(e)] = w.as<bf16>() + e * blk;                           // gate|up
      t[size_t(E + e)] = w.as<bf16>() + e * blk + 2 * Hx * d;          // down
      t[size_t(2 * E + e)] = owned ? gw.as<float>() + e * blk : nullptr;
      t[size_t(3 * E + e)] = owned ? gw.as<float>() + e * blk + 2 * Hx * d : nullptr;
      if (owned) owned_list.push_back(int32_t(e));
    }
    cuda_check(cudaMemcpy(cs.p, ones.data(), size_t(E) * 4, cudaMemcpyHostToDevice));
    cuda_check(cudaMemcpy(tables.p, t.data(), t.size() * 8, cudaMemcpyHostToDevice));
    cuda_check(cudaMemcpy(trained.p, owned_list.data(), owned_list.size() * 4, cudaMemcpyHostToDevice));
    const auto* gu_w = reinterpret_cast<const bf16* const*>(tables.as<const void*>());
    const auto* down_w = gu_w + E;
    auto* gu_g = reinterpret_cast<float* const*>(tables.as<void*>() + 2 * E);
    auto* down_g = gu_g + E;
    const int64_t n_trained = int64_t(owned_list.size());
    const bool renorm = m.norm_topk_prob;
    auto route = [&] {
      cuda::matmul_forward(g, probs.as<float>(), DType::f32, x.as<bf16>(), router.as<bf16>(), N, d, E, s);
      cuda::router_forward(probs.as<float>(), rlse.as<float>(), idx.as<int32_t>(), tw.as<float>(),
                           partials.as<float>(), probs.as<float>(), N, E, K, renorm, s);
      cuda::moe_dispatch_indices(offsets.as<int32_t>(), slot_token.as<int32_t>(), token_slot.as<int32_t>(),
                                 dscratch.as<int32_t>(), idx.as<int32_t>(), N, E, K, s);
    };
    route();
    std::vector<int32_t> off(size_t(E + 1));
    cuda_check(cudaMemcpy(off.data(), offsets.p, off.size() * 4, cudaMemcpyDeviceToHost));
    for (int64_t e = 0; e < E; ++e)
      if (own.owns_expert(int(e))) owned_slots += off[size_t(e + 1)] - off[size_t(e)];
    const double owned_rows = double(owned_slots);
    // Forward.
    add("MoE router GEMM fwd (fp32 out)", L, 0, 2.0 * N * d * E, true,
        [&] { cuda::matmul_forward(g, probs.as<float>(), DType::f32, x.as<bf16>(), router.as<bf16>(), N, d, E, s); });
    add("MoE router fwd (softmax, top-k)", L, 0, 2.0 * N * E * 4 + N * 4 + N * K * 8.0, false, [&] {
      cuda::router_forward(probs.as<float>(), rlse.as<float>(), idx.as<int32_t>(), tw.as<float>(),
                           partials.as<float>(), probs.as<float>(), N, E, K, renorm, s);
    });
    route();  // the timed router rewrote probs in place: the routing again
    add("MoE dispatch indices", L, 0, 4.0 * S * 4, false, [&] {
      cuda::moe_dispatch_indices(offsets.as<int32_t>(), slot_token.as<int32_t>(), token_slot.as<int32_t>(),
                                 dscratch.as<int32_t>(), idx.as<int32_t>(), N, E, K, s);
    });
    add("MoE router aux losses", L, 0, double(cuda::router_partials_count(N, E)) * 4, false, [&] {
      cuda::router_aux_forward(aux.as<float>(), lbw.as<float>(), partials.as<float>(), offsets.as<int32_t>(),
                               cs.as<float>(), N, E, K, s);
    });
    add("MoE gather fwd", L, 0, 2.0 * S * d * bs + S * 4.0, false, [&] {
      cuda::moe_gather_forward(xe.as<bf16>(), x.as<bf16>(), slot_token.as<int32_t>(), S, d, s);
    });
    add("expert gate|up GEMM fwd + swiglu (grouped)", L, 0, 4.0 * S * d * Hx, true, [&] {
      cuda::grouped_matmul_forward_swiglu(gu.as<bf16>(), hx.as<bf16>(), xe.as<bf16>(), gu_w, offsets.as<int32_t>(), S,
                                          E, d, Hx, s);
    });
    add("expert down GEMM fwd (grouped)", L, 0, 2.0 * S * d * Hx, true, [&] {
      cuda::grouped_matmul_forward(ye.as<bf16>(), hx.as<bf16>(), down_w, offsets.as<int32_t>(), S, E, Hx, d, s);
    });
    add("MoE combine fwd", L, 0, (S + N) * d * bs + S * 8.0, false, [&] {
      cuda::moe_combine_forward(mout.as<bf16>(), ye.as<bf16>(), tw.as<float>(), token_slot.as<int32_t>(), N, K, d, s);
    });
    // Backward.
    add("MoE combine bwd", L, 0, (2.0 * S + N) * d * bs + S * 12.0, false, [&] {
      cuda::moe_combine_backward(dye.as<bf16>(), dtw.as<float>(), y.as<bf16>(), ye.as<bf16>(), tw.as<float>(),
                                 token_slot.as<int32_t>(), N, K, d, s);
    });
    add("expert down GEMM bwd input + swiglu bwd (grouped)", L, 0, 2.0 * S * d * Hx, true, [&] {
      cuda::grouped_matmul_backward_input_swiglu(dgu.as<bf16>(), hx.as<bf16>(), dye.as<bf16>(), down_w, gu.as<bf16>(),
                                                 offsets.as<int32_t>(), S, E, Hx, d, s);
    });
    add("expert down GEMM bwd weight (owned)", L, 0, 2.0 * owned_rows * d * Hx, true, [&] {
      cuda::grouped_matmul_backward_weight(down_g, dye.as<bf16>(), hx.as<bf16>(), offsets.as<int32_t>(),
                                           trained.as<int32_t>(), n_trained, S, E, Hx, d, s);
    });
    add("expert gate|up GEMM bwd input (grouped)", L, 0, 4.0 * S * d * Hx, true, [&] {
      cuda::grouped_matmul_backward_input(dye.as<bf16>(), dgu.as<bf16>(), gu_w, offsets.as<int32_t>(), S, E, d,
                                          2 * Hx, s);
    });
    add("expert gate|up GEMM bwd weight (owned)", L, 0, 4.0 * owned_rows * d * Hx, true, [&] {
      cuda::grouped_matmul_backward_weight(gu_g, dgu.as<bf16>(), xe.as<bf16>(), offsets.as<int32_t>(),
                                           trained.as<int32_t>(), n_trained, S, E, d, 2 * Hx, s);
    });
    add("MoE gather bwd", L, 0, (S + N) * d * bs + S * 4.0, false, [&] {
      cuda::moe_gather_backward(o.as<bf16>(), dye.as<bf16>(), token_slot.as<int32_t>(), N, K, d, s);
    });
    add("MoE router bwd (bf16 dlogits)", L, 0, N * E * 4.0 + N * E * bs + N * 4 + N * K * 12.0, false, [&] {
      cuda::router_backward(dlog.as<bf16>(), dtw.as<float>(), probs.as<float>(), rlse.as<float>(), idx.as<int32_t>(),
                            tw.as<float>(), lbw.as<float>(), 0.01f, 0.001f / float(N), N, E, K, renorm, s);
    });
    add("MoE router GEMM bwd input (+=)", L, 0, 2.0 * N * d * E, true, [&] {
      cuda::matmul_backward_input(g, o.as<bf16>(), DType::bf16, dlog.as<bf16>(), router.as<bf16>(), N, d, E, s, true);
    });
    add("MoE router GEMM bwd weight", L, 0, 2.0 * N * d * E, true, [&] {
      cuda::matmul_backward_weight(g, grouter.as<float>(), dlog.as<bf16>(), x.as<bf16>(), N, d, E, s);
    });
  }
  // Once per step over the owned parameters: zero the gradients, the global norm,
  // AdamW. Memory-bound and linear in the count, so timed on up to 2^27 parameters
  // and scaled.
  {
    const int64_t owned = own.space.size(), P = std::min<int64_t>(owned, int64_t(1) << 27);
    const double scale = double(owned) / double(P);
    DevBuf master(P * 4), grad(P * 4), mm(P * 4), vv(P * 4), wts(P * 2), nsq(8), clip(4);
    spes::bench::fill(master.as<float>(), P, s, 11, 0.02f);
    spes::bench::fill(grad.as<float>(), P, s, 12, 1e-3f);
    cuda_check(cudaMemsetAsync(mm.p, 0, mm.bytes, s));
    cuda_check(cudaMemsetAsync(vv.p, 0, vv.bytes, s));
    const float one = 1.0f;
    cuda_check(cudaMemcpy(clip.p, &one, 4, cudaMemcpyHostToDevice));
    cuda_check(cudaDeviceSynchronize());
    auto add_scaled = [&](const std::string& name, double bytes_per_param, auto&& f) {
      Row r;
      r.kernel = name;
      r.calls = 1;
      r.ms_call = spes::bench::median_ms(f, s) * scale;
      r.work = bytes_per_param * double(owned);
      r.flops = false;
      rows.push_back(r);
    };
    add_scaled("zero grads (memset)", 4, [&] { cuda_check(cudaMemsetAsync(grad.p, 0, size_t(P) * 4, s)); });
    spes::bench::fill(grad.as<float>(), P, s, 12, 1e-3f);
    cuda_check(cudaDeviceSynchronize());
    const cuda::GradSpan span{grad.as<float>(), P};
    const size_t gs = cuda::global_norm_scratch_bytes(&span, 1);
    DevBuf gscratch(gs);
    add_scaled("global grad norm", 4, [&] {
      cuda::global_norm_clip(nsq.as<double>(), nullptr, &span, 1, 0.0, gscratch.p, gs, s);
    });
    int64_t t = 1;
    add_scaled("AdamW (+ bf16 weights)", 30, [&] {
      cuda::adamw_update(master.as<float>(), wts.as<bf16>(), grad.as<float>(), mm.as<float>(), vv.as<float>(), P,
                         1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, t++, clip.as<float>(), s);
    });
  }
  std::printf("(MoE backward: %lld of %lld routed slots on owned experts)\n", (long long)owned_slots, (long long)S);
  return rows;
}

// The NCCL path at one rank against the plain backend: its whole overhead (the
// rank thread, the all-reduce, the broadcast path) and the all-reduce of the owned
// gradients alone (in the norm phase: the data-parallel backend reduces there). A
// one-GPU machine cannot measure G ranks; the G = 8 times are a projection: a ring
// all-reduce moves 2·(G−1)/G of the gradient bytes through each GPU's link, at the
// bus bandwidth NCCL reaches on it (assumed, from the link's datasheet figure).
void report_nccl(const StepResult& plain, const StepResult& dp, int64_t owned) {
  const double overhead = (dp.step_ms - plain.step_ms) / plain.step_ms;
  std::printf("NCCL path overhead (1 rank): step %.1f ms vs %.1f ms plain = %+.2f%% (goal <= 2%%)\n", dp.step_ms,
              plain.step_ms, 100.0 * overhead);
  const double bytes = double(owned) * 4.0;
  std::printf("all-reduce of the owned gradients (%.3fB floats, %.2f GB), 1 rank: ~%.2f ms, the norm phase's "
              "difference (%.2f ms vs %.2f ms plain: the data-parallel backend reduces there)\n",
              double(owned) / 1e9, bytes / 1e9, std::max(0.0, dp.norm_ms - plain.norm_ms), dp.norm_ms, plain.norm_ms);
  struct Link {
    const char* name;
    double bus_gbs;
  };
  const Link links[] = {{"8 GPUs, NVLink 4 (H100/H200 SXM, 450 GB/s per direction)", 450.0},
                        {"8 GPUs, PCIe Gen5 x16 only (~50 GB/s per direction)", 50.0}};
  for (const Link& l : links) {
    const double ms = 2.0 * 7.0 / 8.0 * bytes / (l.bus_gbs * 1e9) * 1e3;
    std::printf("  projection, not a measurement: %s: %.1f ms per step = %.1f%% of this step\n", l.name, ms,
                100.0 * ms / plain.step_ms);
  }
}

void print_table(const std::vector<Row>& rows, double step_ms) {
  std::printf("%-44s %9s %10s %10s %8s %16s\n", "kernel (isolated, step shapes)", "calls", "ms/call", "ms/step",
              "% step", "achieved");
  double sum = 0;
  for (const Row& r : rows) {
    const double ms = r.calls * r.ms_call;
    sum += ms;
    const double rate = r.work / (r.ms_call * 1e-3);
    char achieved[32];
    if (r.flops) std::snprintf(achieved, sizeof achieved, "%8.1f TFLOP/s", rate / 1e12);
    else std::snprintf(achieved, sizeof achieved, "%8.0f GB/s", rate / 1e9);
    std::printf("%-44s %9.1f %10.4f %10.2f %7.1f%% %16s\n", r.kernel.c_str(), r.calls, r.ms_call, ms,
                100.0 * ms / step_ms, achieved);
  }
  std::printf("%-44s %9s %10s %10.2f %7.1f%%\n", "sum of the kernels above", "", "", sum, 100.0 * sum / step_ms);
  std::printf("%-44s %9s %10s %10.2f %7.1f%%\n", "measured step", "", "", step_ms, 100.0);
  std::printf("%-44s %9s %10s %10.2f %7.1f%%\n", "rest: slower in the step than alone, gaps", "", "", step_ms - sum,
              100.0 * (step_ms - sum) / step_ms);
}

int64_t parse_int(const char* flag, const char* value) {
  char* end = nullptr;
  const long long v = value ? std::strtoll(value, &end, 10) : 0;
  if (!value || *end != '\0' || v < 1) {
    std::fprintf(stderr, "bench_train_gpu: %s needs a positive integer\n", flag);
    std::exit(2);
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* next = i + 1 < argc ? argv[i + 1] : nullptr;
    if (a == "--steps") opt.steps = int(parse_int("--steps", next)), ++i;
    else if (a == "--micro-batches") opt.micro_batches = parse_int("--micro-batches", next), ++i;
    else if (a == "--micro-batch") opt.micro_batch = parse_int("--micro-batch", next), ++i;
    else if (a == "--layers") opt.layers = parse_int("--layers", next), ++i;
    else if (a == "--profile") opt.profile = true;
    else {
      std::fprintf(stderr,
                   "usage: bench_train_gpu [--steps N] [--micro-batches N] [--micro-batch N] [--layers N] [--profile]\n");
      return 2;
    }
  }
  if (opt.profile) opt.steps = 1;
  std::string why;
  if (!spes::cuda::gpu_available(&why)) {
    std::printf("no GPU: %s (bench_train_gpu needs one; nothing was measured)\n", why.c_str());
    return 0;
  }
  try {
    struct Node {
      const char* label;
      std::vector<std::string> sets;
    };
    const Node nodes[] = {
        {"node owning all 16 experts", {"spes.ownership=all", "spes.n_nodes=1", "spes.node_id=0"}},
        {"SPES node owning 4 of 16 experts",
         {"spes.ownership=partitioned", "spes.n_nodes=4", "spes.node_id=0", "spes.experts_per_node=4"}},
    };
    cudaDeviceProp prop{};
    cuda_check(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s (sm_%d%d, %d SMs, %.1f GiB)\n", prop.name, prop.major, prop.minor,
                prop.multiProcessorCount, gib(double(prop.totalGlobalMem)));
    // Which kernels the step takes (spes-1b's head dim 64; the GPU check reports both).
    std::printf("grouped expert GEMMs: %s\n", cuda::grouped_gemm_automatic_path_description().c_str());
    std::printf("attention kernels: %s\n", cuda::attention_automatic_path_description(64).c_str());
    for (const Node& node : nodes) {
      std::vector<std::string> sets = node.sets;
      sets.push_back("train.device=cuda");
      if (opt.layers) sets.push_back("model.n_layers=" + std::to_string(opt.layers));
      Config cfg = load_config(std::string(SPES_SOURCE_DIR) + "/configs/spes-1b.toml", sets);
      const int64_t n_micro = opt.micro_batches ? opt.micro_batches : cfg.train.global_batch / cfg.train.micro_batch;
      if (opt.micro_batch) cfg.train.micro_batch = opt.micro_batch;
      cfg.train.global_batch = n_micro * cfg.train.micro_batch;
      // Shrink the depth only when the node's plan does not fit (vocabulary, widths
      // and the expert shape stay those of spes-1b).
      const size_t headroom = size_t(1) << 30;
      for (;;) {
        const ParamLayout layout = make_layout(cfg.model);
        const Ownership own = make_ownership(cfg.model, layout, int(cfg.spes.node_id), int(cfg.spes.n_nodes),
                                             cfg.spes.ownership, cfg.spes.experts_per_node);
        const GpuMemoryPlan plan =
            plan_gpu_node(cfg.model, layout, own, cfg.train.micro_batch, current_gpu_limits());
        if (size_t(plan.total()) + headroom <= free_bytes() || cfg.model.n_layers == 1) break;
        std::printf("note: %lld layers need %.1f GiB; trying %lld\n", (long long)cfg.model.n_layers,
                    gib(double(plan.total())), (long long)cfg.model.n_layers - 1);
        --cfg.model.n_layers;
      }
      const ParamLayout layout = make_layout(cfg.model);
      const Ownership own = make_ownership(cfg.model, layout, int(cfg.spes.node_id), int(cfg.spes.n_nodes),
                                           cfg.spes.ownership, cfg.spes.experts_per_node);
      std::printf("\n== spes-1b shape, %s: %lld layers, %.3fB parameters, %.3fB owned; micro_batch %lld x seq %lld, "
                  "%lld micro-batches per step\n",
                  node.label, (long long)cfg.model.n_layers, double(layout.total) / 1e9,
                  double(own.space.size()) / 1e9, (long long)cfg.train.micro_batch, (long long)cfg.model.seq_len,
                  (long long)n_micro);
      std::fflush(stdout);
      const StepResult r = time_step(cfg, opt, n_micro);  // the backend is gone when this returns
      std::fflush(stdout);
      if (opt.profile) break;
      if (&node == &nodes[0]) {
        std::printf("\n-- the same node through the NCCL data-parallel path, 1 rank --\n");
        const StepResult dp = time_step(cfg, opt, n_micro, true);
        report_nccl(r, dp, own.space.size());
        std::fflush(stdout);
      }
      print_table(time_kernels(cfg, n_micro), r.step_ms);
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_train_gpu: %s\n", e.what());
    return 1;
  }
  return 0;
}
