// Grouped expert GEMMs (cuda/grouped_gemm.cuh) at the spes-1b expert shape: 16 experts,
// top-2, N = 16384 tokens → S = 32768 routed rows, d = 768, H = 2048. For each expert
// weight (gate|up: C = d, OC = 2H = 4096; down: C = H, OC = d) the three products
// (forward, backward-input, weight gradient) are timed five ways on the same work:
//   portable     one grouped_matmul_* launch on the portable (mma.sync) path, offsets
//                read on the device;
//   sm90a        the same on the Hopper (wgmma) path, where the device runs it;
//   sm90a_tma    the weight gradient alone on the sm90a path's other kernel, fed by
//                the copy engine (grouped_sm90::WgradKernel::tma), where it runs;
//   grouped      one cublasGemmGroupedBatchedEx call over the non-empty experts;
//   per_expert   one cublasGemmEx per non-empty expert;
//   dense        one cublasGemmEx with all S rows as one expert: the same FLOPs, the
//                ceiling a grouped GEMM aims at.
// Every timed run routes afresh: a routing is per-expert biases b_e ~ N(0, 1) plus
// per-token logits ~ N(0, 1), top-2 of softmax(b + logits) (a skewed load, like a
// trained router's), drawn on the host before timing; the cuBLAS paths get their row
// counts and pointer arrays from the host outside the timed region, ours only a
// different device offsets array. Median of 25 runs after 5 warm-up (CUDA events,
// bench/common.cuh), each run a routing no other run used.
//
// stdout is a CSV, header first: per (weights, product) the time and TFLOP/s of each
// way, and ours (the path the launchers take by default: sm90a where it runs, else
// portable) over each of the others as a ratio of TFLOP/s (> 1: ours faster), and
// sm90a over portable; last, ours on two even routings of the same FLOPs: every
// expert S/E rows (against the skewed ones: what the load imbalance costs), and half
// the experts 2S/E rows each (a weight gradient's tiles then reduce over twice the
// rows: with the first, a tile's fixed cost, its store and fill, apart from its cost
// per row); last, the weight gradient on the TMA kernel ("nan" in the other products).
// A refused cuBLAS call (the grouped API with an fp32 output on some versions) and a
// path the device does not run leave their columns "nan". stderr gets the device,
// which paths it runs, the routings' load imbalance, a check of each path against
// cuBLAS per expert on one routing, the sm90a kernels at a few L2 prefetch
// distances (grouped_sm90::set_l2_prefetch_k_steps; the CSV's sm90a column is the
// default's), and on each path the products with SwiGLU in their store (the gate|up
// forward, the down backward-input) against the two launches each replaces, with
// whether their bits agree. Without a GPU: exit 77, the reason on stderr.
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench/common.cuh"
#include "cuda/grouped_gemm.cuh"
#include "cuda/grouped_gemm_sm90.cuh"
#include "cuda/swiglu.cuh"

namespace {

using spes::bench::DevBuf;
using spes::cuda::bf16;
using spes::cuda::GroupedGemmPath;

const char* path_name(GroupedGemmPath p) { return p == GroupedGemmPath::sm90a ? "sm90a" : "portable"; }

constexpr int64_t kTokens = 16384, kTopK = 2, kS = kTokens * kTopK, kE = 16, kD = 768, kH = 2048;
constexpr int kRoutings = spes::bench::kWarmup + spes::bench::kRuns;

// Expert row offsets [E+1] of one routing (see the file comment).
std::vector<int32_t> random_offsets(std::mt19937_64& g) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> bias(kE);
  for (auto& b : bias) b = n(g);
  std::vector<int32_t> counts(kE, 0);
  std::vector<float> logit(kE);
  for (int64_t t = 0; t < kTokens; ++t) {
    for (int64_t e = 0; e < kE; ++e) logit[e] = bias[e] + n(g);
    int first = 0, second = -1;
    for (int e = 1; e < kE; ++e)
      if (logit[e] > logit[first]) first = e;
    for (int e = 0; e < kE; ++e)
      if (e != first && (second < 0 || logit[e] > logit[second])) second = e;
    ++counts[first];
    ++counts[second];
  }
  std::vector<int32_t> off(kE + 1, 0);
  for (int64_t e = 0; e < kE; ++e) off[e + 1] = off[e] + counts[e];
  return off;
}

enum class Product { forward, backward_input, backward_weight };
const char* product_name(Product p) {
  return p == Product::forward ? "forward" : p == Product::backward_input ? "backward_input" : "backward_weight";
}

// One expert's product in cuBLAS's column-major terms (row-major X[r, c] is
// column-major Xᵀ with ld c; the same mapping as cuda/matmul.cu), on rows [o, o + m).
struct Op {
  cublasOperation_t ta, tb;
  int m, n, k;
  const void *a, *b;
  void* c;
  int lda, ldb, ldc;
  float beta;
};
struct Buffers {
  bf16 *x, *y, *w;  // x [S, C], y [S, OC] (the output forward, dout backward), w [E, OC, C]
  bf16* dx;         // [S, C], backward-input output
  float* dw;        // [E, OC, C]
};
Op expert_op(Product p, const Buffers& b, int64_t e, int64_t o, int64_t m, int64_t C, int64_t OC) {
  const bf16* w = b.w + e * OC * C;
  switch (p) {
    case Product::forward:  // yᵀ[OC, m] = W_cm[C, OC]ᵀ · x_cm[C, m]
      return {CUBLAS_OP_T, CUBLAS_OP_N, int(OC), int(m), int(C), w, b.x + o * C, b.y + o * OC,
              int(C), int(C), int(OC), 0.0f};
    case Product::backward_input:  // dxᵀ[C, m] = W_cm[C, OC] · y_cm[OC, m]
      return {CUBLAS_OP_N, CUBLAS_OP_N, int(C), int(m), int(OC), w, b.y + o * OC, b.dx + o * C,
              int(C), int(OC), int(C), 0.0f};
    default:  // dWᵀ[C, OC] += x_cm[C, m] · y_cm[OC, m]ᵀ
      return {CUBLAS_OP_N, CUBLAS_OP_T, int(C), int(OC), int(m), b.x + o * C, b.y + o * OC, b.dw + e * OC * C,
              int(C), int(OC), int(C), 1.0f};
  }
}
cudaDataType_t out_type(Product p) { return p == Product::backward_weight ? CUDA_R_32F : CUDA_R_16BF; }

void gemm(cublasHandle_t h, Product p, const Op& op) {
  const float alpha = 1.0f;
  cublas_check(cublasGemmEx(h, op.ta, op.tb, op.m, op.n, op.k, &alpha, op.a, CUDA_R_16BF, op.lda, op.b, CUDA_R_16BF,
                            op.ldb, &op.beta, op.c, out_type(p), op.ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// One routing's cublasGemmGroupedBatchedEx arguments: a group of one GEMM per non-empty
// expert, host arrays here, pointer arrays in `ptrs` (device, A | B | C, kE each).
struct GroupedCall {
  std::vector<cublasOperation_t> ta, tb;
  std::vector<int> m, n, k, lda, ldb, ldc, size;
  std::vector<float> alpha, beta;
  const void* const* a = nullptr;
  const void* const* b = nullptr;
  void* const* c = nullptr;
};

double rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = double(got[i]) - want[i];
    num += std::isfinite(got[i]) ? d * d : INFINITY;
    den += double(want[i]) * want[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1e-30));
}
std::vector<float> to_host(const bf16* d, int64_t n, cudaStream_t s) {
  std::vector<bf16> h(n);
  cuda_check(cudaMemcpyAsync(h.data(), d, n * sizeof(bf16), cudaMemcpyDeviceToHost, s));
  cuda_check(cudaStreamSynchronize(s));
  std::vector<float> f(n);
  for (int64_t i = 0; i < n; ++i) f[i] = __bfloat162float(h[i]);
  return f;
}
std::vector<float> to_host(const float* d, int64_t n, cudaStream_t s) {
  std::vector<float> h(n);
  cuda_check(cudaMemcpyAsync(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost, s));
  cuda_check(cudaStreamSynchronize(s));
  return h;
}

std::vector<unsigned char> to_host_bytes(const DevBuf& d, cudaStream_t s) {
  std::vector<unsigned char> h(d.bytes);
  cuda_check(cudaMemcpyAsync(h.data(), d.p, d.bytes, cudaMemcpyDeviceToHost, s));
  cuda_check(cudaStreamSynchronize(s));
  return h;
}

std::string ms_cell(float ms) { return ms > 0 ? std::to_string(ms) : "nan"; }
std::string tf_cell(double flops, float ms) { return ms > 0 ? std::to_string(flops / (ms * 1e-3) / 1e12) : "nan"; }
std::string ratio_cell(float ours, float other) { return ours > 0 && other > 0 ? std::to_string(other / ours) : "nan"; }

void run_weights(const char* name, int64_t C, int64_t OC, const std::vector<std::vector<int32_t>>& routings,
                 cublasHandle_t cublas, cudaStream_t stream) {
  const size_t bs = sizeof(bf16);
  DevBuf x(bs * kS * C), y(bs * kS * OC), w(bs * kE * OC * C), dx(bs * kS * C), dw(sizeof(float) * kE * OC * C);
  DevBuf y2(bs * kS * OC), dx2(bs * kS * C), dw2(sizeof(float) * kE * OC * C);  // cuBLAS's, for the check
  spes::bench::fill(x.as<bf16>(), kS * C, stream, 1, 1.0f);
  spes::bench::fill(y.as<bf16>(), kS * OC, stream, 2, 1.0f);
  spes::bench::fill(w.as<bf16>(), kE * OC * C, stream, 3, 1.7f / std::sqrt(float(C)));
  spes::bench::zero(dw.p, dw.bytes, stream);

  // Device tables: weights[e], dweights[e], trained = all experts, one offsets array per routing.
  std::vector<const bf16*> wt(kE);
  std::vector<float*> dwt(kE);
  std::vector<int32_t> trained(kE), all_offsets;
  for (int64_t e = 0; e < kE; ++e) {
    wt[e] = w.as<bf16>() + e * OC * C;
    dwt[e] = dw.as<float>() + e * OC * C;
    trained[e] = int32_t(e);
  }
  for (const auto& r : routings) all_offsets.insert(all_offsets.end(), r.begin(), r.end());
  DevBuf d_wt(sizeof(void*) * kE), d_dwt(sizeof(void*) * kE), d_trained(sizeof(int32_t) * kE),
      d_offsets(sizeof(int32_t) * all_offsets.size());
  spes::bench::copy_to_device(d_wt.p, wt.data(), d_wt.bytes, stream);
  spes::bench::copy_to_device(d_dwt.p, dwt.data(), d_dwt.bytes, stream);
  spes::bench::copy_to_device(d_trained.p, trained.data(), d_trained.bytes, stream);
  spes::bench::copy_to_device(d_offsets.p, all_offsets.data(), d_offsets.bytes, stream);
  const int32_t* offsets_of = d_offsets.as<int32_t>();
  // Even routings: every expert kS / kE rows; half the experts 2·kS / kE rows each.
  std::vector<int32_t> even(kE + 1), even_half(kE + 1);
  for (int64_t e = 0; e <= kE; ++e) {
    even[e] = int32_t(e * kS / kE);
    even_half[e] = int32_t(std::min(e, kE / 2) * 2 * kS / kE);
  }
  DevBuf d_even(sizeof(int32_t) * even.size()), d_even_half(sizeof(int32_t) * even_half.size());
  spes::bench::copy_to_device(d_even.p, even.data(), d_even.bytes, stream);
  spes::bench::copy_to_device(d_even_half.p, even_half.data(), d_even_half.bytes, stream);

  const bool has_sm90a = spes::cuda::grouped_gemm_sm90a_available();
  std::vector<GroupedGemmPath> paths{GroupedGemmPath::portable};
  if (has_sm90a) paths.push_back(GroupedGemmPath::sm90a);
  for (Product p : {Product::forward, Product::backward_input, Product::backward_weight}) {
    const double flops = 2.0 * double(kS) * double(C) * double(OC);
    auto ours_on = [&](const int32_t* off, GroupedGemmPath path) {
      if (p == Product::forward)
        spes::cuda::grouped_matmul_forward(y.as<bf16>(), x.as<bf16>(), d_wt.as<const bf16* const>(), off, kS, kE, C,
                                           OC, stream, path);
      else if (p == Product::backward_input)
        spes::cuda::grouped_matmul_backward_input(dx.as<bf16>(), y.as<bf16>(), d_wt.as<const bf16* const>(), off, kS,
                                                  kE, C, OC, stream, path);
      else
        spes::cuda::grouped_matmul_backward_weight(d_dwt.as<float* const>(), y.as<bf16>(), x.as<bf16>(), off,
                                                   d_trained.as<int32_t>(), kE, kS, kE, C, OC, stream, path);
    };
    auto ours = [&](int r, GroupedGemmPath path) { ours_on(offsets_of + r * (kE + 1), path); };
    // cuBLAS on the same inputs; its outputs go to the *2 buffers (the check below).
    const Buffers cublas_bufs{x.as<bf16>(), p == Product::forward ? y2.as<bf16>() : y.as<bf16>(), w.as<bf16>(),
                              dx2.as<bf16>(), dw2.as<float>()};
    auto per_expert = [&](int r) {
      const auto& off = routings[r];
      for (int64_t e = 0; e < kE; ++e)
        if (off[e + 1] > off[e]) gemm(cublas, p, expert_op(p, cublas_bufs, e, off[e], off[e + 1] - off[e], C, OC));
    };

    // Grouped: arguments and device pointer arrays of every routing, built before timing.
    std::vector<GroupedCall> calls(routings.size());
    DevBuf d_ptrs(sizeof(void*) * 3 * kE * routings.size());
    {
      std::vector<const void*> ptrs(3 * kE * routings.size(), nullptr);
      for (size_t r = 0; r < routings.size(); ++r) {
        GroupedCall& g = calls[r];
        const void** base = ptrs.data() + 3 * kE * r;
        const auto& off = routings[r];
        for (int64_t e = 0; e < kE; ++e) {
          if (off[e + 1] == off[e]) continue;
          const Op op = expert_op(p, cublas_bufs, e, off[e], off[e + 1] - off[e], C, OC);
          const size_t i = g.m.size();
          base[i] = op.a, base[kE + i] = op.b, base[2 * kE + i] = op.c;
          g.ta.push_back(op.ta), g.tb.push_back(op.tb), g.m.push_back(op.m), g.n.push_back(op.n);
          g.k.push_back(op.k), g.lda.push_back(op.lda), g.ldb.push_back(op.ldb), g.ldc.push_back(op.ldc);
          g.size.push_back(1), g.alpha.push_back(1.0f), g.beta.push_back(op.beta);
        }
        void** dbase = d_ptrs.as<void*>() + 3 * kE * r;
        g.a = dbase, g.b = dbase + kE, g.c = dbase + 2 * kE;
      }
      spes::bench::copy_to_device(d_ptrs.p, ptrs.data(), d_ptrs.bytes, stream);
    }
    auto grouped = [&](int r) {
      const GroupedCall& g = calls[r];
      return cublasGemmGroupedBatchedEx(cublas, g.ta.data(), g.tb.data(), g.m.data(), g.n.data(), g.k.data(),
                                        g.alpha.data(), g.a, CUDA_R_16BF, g.lda.data(), g.b, CUDA_R_16BF,
                                        g.ldb.data(), g.beta.data(), g.c, out_type(p), g.ldc.data(),
                                        int(g.m.size()), g.size.data(), CUBLAS_COMPUTE_32F);
    };
    auto dense = [&] { gemm(cublas, p, expert_op(p, cublas_bufs, 0, 0, kS, C, OC)); };

    // The weight gradient on the TMA kernel (sm90a path), where it runs.
    const bool has_tma = has_sm90a && p == Product::backward_weight &&
                         spes::cuda::grouped_sm90::wgrad_tma_unavailable_reason().empty();
    auto ours_tma = [&](int r) {
      const spes::cuda::grouped_sm90::ScopedWgradKernel tma(spes::cuda::grouped_sm90::WgradKernel::tma);
      ours(r, GroupedGemmPath::sm90a);
    };

    // Check: each path against cuBLAS per expert on routing 0 (fresh dW on both sides).
    for (int variant = 0; variant < int(paths.size()) + (has_tma ? 1 : 0); ++variant) {
      const bool tma = variant == int(paths.size());
      const GroupedGemmPath path = tma ? GroupedGemmPath::sm90a : paths[variant];
      spes::bench::zero(dw.p, dw.bytes, stream);
      spes::bench::zero(dw2.p, dw2.bytes, stream);
      if (tma)
        ours_tma(0);
      else
        ours(0, path);
      per_expert(0);
      double err;
      if (p == Product::forward)
        err = rel_err(to_host(y.as<bf16>(), kS * OC, stream), to_host(y2.as<bf16>(), kS * OC, stream));
      else if (p == Product::backward_input)
        err = rel_err(to_host(dx.as<bf16>(), kS * C, stream), to_host(dx2.as<bf16>(), kS * C, stream));
      else
        err = rel_err(to_host(dw.as<float>(), kE * OC * C, stream), to_host(dw2.as<float>(), kE * OC * C, stream));
      const bool ok = err <= (p == Product::backward_weight ? 1e-4 : 1e-2);
      std::fprintf(stderr, "check %s %s: %s vs cuBLAS per expert, rel err %.3g (%s)\n", name, product_name(p),
                   tma ? "sm90a (TMA)" : path_name(path), err, ok ? "ok" : "MISMATCH");
      if (p == Product::forward) spes::bench::fill(y.as<bf16>(), kS * OC, stream, 2, 1.0f);  // y is dout below
    }

    int next = 0;
    const float t_portable =
        spes::bench::median_ms([&] { ours(next++ % kRoutings, GroupedGemmPath::portable); }, stream);
    float t_sm90a = -1;
    if (has_sm90a) {
      next = 0;
      t_sm90a = spes::bench::median_ms([&] { ours(next++ % kRoutings, GroupedGemmPath::sm90a); }, stream);
    }
    if (has_sm90a) {  // the sm90a kernels' L2 requests ahead of their copies, each choice on the same routings
      const int chosen = spes::cuda::grouped_sm90::l2_prefetch_k_steps();
      std::string line;
      for (const int ahead : {0, 2, 4, 8}) {
        spes::cuda::grouped_sm90::set_l2_prefetch_k_steps(ahead);
        next = 0;
        const float t = spes::bench::median_ms([&] { ours(next++ % kRoutings, GroupedGemmPath::sm90a); }, stream);
        char cell[48];
        std::snprintf(cell, sizeof cell, " %d: %.1f", ahead, flops / (double(t) * 1e-3) / 1e12);
        line += cell;
      }
      spes::cuda::grouped_sm90::set_l2_prefetch_k_steps(chosen);
      std::fprintf(stderr, "%s %s, sm90a, TFLOP/s by k-steps asked of L2 ahead of their copies (%d in the step):%s\n",
                   name, product_name(p), chosen, line.c_str());
    }
    float t_tma = -1;
    if (has_tma) {
      next = 0;
      t_tma = spes::bench::median_ms([&] { ours_tma(next++ % kRoutings); }, stream);
    }
    const GroupedGemmPath ours_path = has_sm90a ? GroupedGemmPath::sm90a : GroupedGemmPath::portable;
    const float t_ours = has_sm90a ? t_sm90a : t_portable;
    const float t_even = spes::bench::median_ms([&] { ours_on(d_even.as<int32_t>(), ours_path); }, stream);
    const float t_even_half =
        spes::bench::median_ms([&] { ours_on(d_even_half.as<int32_t>(), ours_path); }, stream);
    next = 0;
    const float t_per = spes::bench::median_ms([&] { per_expert(next++ % kRoutings); }, stream);
    float t_grouped = -1;
    const cublasStatus_t st = grouped(0);
    if (st == CUBLAS_STATUS_SUCCESS) {
      next = 0;
      t_grouped = spes::bench::median_ms([&] { cublas_check(grouped(next++ % kRoutings)); }, stream);
    } else {
      std::fprintf(stderr, "%s %s: cublasGemmGroupedBatchedEx refused (%s)\n", name, product_name(p),
                   cublasGetStatusString(st));
    }
    const float t_dense = spes::bench::median_ms(dense, stream);

    std::printf("%s,%s,%ld,%ld,%ld,%ld,%.4f,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s\n", name,
                product_name(p), long(kS), long(kE), long(C), long(OC), flops / 1e12, ms_cell(t_portable).c_str(),
                tf_cell(flops, t_portable).c_str(), ms_cell(t_sm90a).c_str(), tf_cell(flops, t_sm90a).c_str(),
                ms_cell(t_grouped).c_str(), tf_cell(flops, t_grouped).c_str(), ms_cell(t_per).c_str(),
                tf_cell(flops, t_per).c_str(), ms_cell(t_dense).c_str(), tf_cell(flops, t_dense).c_str(),
                ratio_cell(t_ours, t_grouped).c_str(), ratio_cell(t_ours, t_per).c_str(),
                ratio_cell(t_ours, t_dense).c_str(), ratio_cell(t_sm90a, t_portable).c_str(), ms_cell(t_even).c_str(),
                tf_cell(flops, t_even).c_str(), ms_cell(t_even_half).c_str(), tf_cell(flops, t_even_half).c_str(),
                ms_cell(t_tma).c_str(), tf_cell(flops, t_tma).c_str());
    std::fflush(stdout);
  }
}

// The grouped GEMMs with SwiGLU in their store against the two launches each replaces,
// on each path, on the same routings, and their bits on routing 0: the gate|up forward
// (grouped_matmul_forward_swiglu) against grouped_matmul_forward then swiglu_forward,
// the down backward-input (grouped_matmul_backward_input_swiglu) against
// grouped_matmul_backward_input then swiglu_backward. stderr only; returns whether every
// fused product gave the bits of its two launches.
bool run_swiglu_fusion(const std::vector<std::vector<int32_t>>& routings, cudaStream_t stream) {
  const size_t bs = sizeof(bf16);
  DevBuf inp(bs * kS * kD), w_gate_up(bs * kE * 2 * kH * kD), dout(bs * kS * kD), w_down(bs * kE * kD * kH),
      gate_up(bs * kS * 2 * kH), gate_up2(bs * kS * 2 * kH), h(bs * kS * kH), h2(bs * kS * kH), dh(bs * kS * kH),
      dgate_up(bs * kS * 2 * kH), dgate_up2(bs * kS * 2 * kH);
  spes::bench::fill(inp.as<bf16>(), kS * kD, stream, 4, 1.0f);
  spes::bench::fill(w_gate_up.as<bf16>(), kE * 2 * kH * kD, stream, 5, 1.7f / std::sqrt(float(kD)));
  spes::bench::fill(dout.as<bf16>(), kS * kD, stream, 6, 1.0f);
  spes::bench::fill(w_down.as<bf16>(), kE * kD * kH, stream, 7, 1.7f / std::sqrt(float(kD)));
  std::vector<const bf16*> wt_gate_up(kE), wt_down(kE);
  std::vector<int32_t> all_offsets;
  for (int64_t e = 0; e < kE; ++e) {
    wt_gate_up[e] = w_gate_up.as<bf16>() + e * 2 * kH * kD;
    wt_down[e] = w_down.as<bf16>() + e * kD * kH;
  }
  for (const auto& r : routings) all_offsets.insert(all_offsets.end(), r.begin(), r.end());
  DevBuf d_wt_gate_up(sizeof(void*) * kE), d_wt_down(sizeof(void*) * kE),
      d_offsets(sizeof(int32_t) * all_offsets.size());
  spes::bench::copy_to_device(d_wt_gate_up.p, wt_gate_up.data(), d_wt_gate_up.bytes, stream);
  spes::bench::copy_to_device(d_wt_down.p, wt_down.data(), d_wt_down.bytes, stream);
  spes::bench::copy_to_device(d_offsets.p, all_offsets.data(), d_offsets.bytes, stream);
  const bf16* const* weights_gate_up = d_wt_gate_up.as<const bf16* const>();
  const bf16* const* weights_down = d_wt_down.as<const bf16* const>();
  auto offsets_of = [&](int r) { return d_offsets.as<int32_t>() + (r % kRoutings) * (kE + 1); };
  auto report = [&](const char* what, GroupedGemmPath path, const std::function<void(int)>& fused,
                    const std::function<void(int)>& two_calls, const std::function<void(int)>& gemm_alone,
                    bool same) {
    int next = 0;
    const float t_fused = spes::bench::median_ms([&] { fused(next++); }, stream);
    next = 0;
    const float t_two = spes::bench::median_ms([&] { two_calls(next++); }, stream);
    next = 0;
    const float t_gemm = spes::bench::median_ms([&] { gemm_alone(next++); }, stream);
    std::fprintf(stderr, "%s, %s: fused %.3f ms, the two launches %.3f ms (the GEMM alone %.3f ms): fused/two %.3f; "
                 "bits equal: %s\n", what, path_name(path), t_fused, t_two, t_gemm, t_fused / t_two,
                 same ? "yes" : "NO (MISMATCH)");
  };
  const bf16* gu = gate_up.as<bf16>();

  std::vector<GroupedGemmPath> paths{GroupedGemmPath::portable};
  if (spes::cuda::grouped_gemm_sm90a_available()) paths.push_back(GroupedGemmPath::sm90a);
  bool all_same = true;
  for (GroupedGemmPath path : paths) {
    // The gate|up forward with SwiGLU.
    auto forward = [&](int r, bf16* out) {
      spes::cuda::grouped_matmul_forward(out, inp.as<bf16>(), weights_gate_up, offsets_of(r), kS, kE, kD, 2 * kH,
                                         stream, path);
    };
    auto forward_two = [&](int r, bf16* out, bf16* h_out) {
      forward(r, out);
      spes::cuda::swiglu_forward(h_out, out, out + kH, kS, kH, 2 * kH, stream);
    };
    auto forward_fused = [&](int r, bf16* out, bf16* h_out) {
      spes::cuda::grouped_matmul_forward_swiglu(out, h_out, inp.as<bf16>(), weights_gate_up, offsets_of(r), kS, kE,
                                                kD, kH, stream, path);
    };
    forward_fused(0, gate_up.as<bf16>(), h.as<bf16>());
    forward_two(0, gate_up2.as<bf16>(), h2.as<bf16>());
    const bool forward_same = to_host_bytes(gate_up, stream) == to_host_bytes(gate_up2, stream) &&
                              to_host_bytes(h, stream) == to_host_bytes(h2, stream);
    report("gate|up forward with SwiGLU", path, [&](int r) { forward_fused(r, gate_up2.as<bf16>(), h2.as<bf16>()); },
           [&](int r) { forward_two(r, gate_up2.as<bf16>(), h2.as<bf16>()); },
           [&](int r) { forward(r, gate_up2.as<bf16>()); }, forward_same);

    // The down backward-input with SwiGLU's backward (gate_up from the forward above).
    auto backward = [&](int r, bf16* out) {
      spes::cuda::grouped_matmul_backward_input(out, dout.as<bf16>(), weights_down, offsets_of(r), kS, kE, kH, kD,
                                                stream, path);
    };
    auto backward_two = [&](int r, bf16* h_out, bf16* dgu) {
      backward(r, dh.as<bf16>());
      spes::cuda::swiglu_backward(dgu, dgu + kH, h_out, dh.as<bf16>(), gu, gu + kH, kS, kH, 2 * kH, stream);
    };
    auto backward_fused = [&](int r, bf16* h_out, bf16* dgu) {
      spes::cuda::grouped_matmul_backward_input_swiglu(dgu, h_out, dout.as<bf16>(), weights_down, gu, offsets_of(r),
                                                       kS, kE, kH, kD, stream, path);
    };
    backward_fused(0, h.as<bf16>(), dgate_up.as<bf16>());
    backward_two(0, h2.as<bf16>(), dgate_up2.as<bf16>());
    const bool backward_same = to_host_bytes(h, stream) == to_host_bytes(h2, stream) &&
                               to_host_bytes(dgate_up, stream) == to_host_bytes(dgate_up2, stream);
    report("down backward-input with SwiGLU's backward", path,
           [&](int r) { backward_fused(r, h2.as<bf16>(), dgate_up2.as<bf16>()); },
           [&](int r) { backward_two(r, h2.as<bf16>(), dgate_up2.as<bf16>()); },
           [&](int r) { backward(r, dh.as<bf16>()); }, backward_same);
    all_same = all_same && forward_same && backward_same;
  }
  return all_same;
}

}  // namespace

int main() {
  std::string why;
  if (!spes::cuda::gpu_available(&why)) {
    std::fprintf(stderr, "bench_grouped_gemm: no GPU (%s); nothing was measured\n", why.c_str());
    return 77;
  }
  try {
    spes::cuda::Runtime rt(0);
    cudaDeviceProp prop{};
    cuda_check(cudaGetDeviceProperties(&prop, rt.info().ordinal));
    std::fprintf(stderr, "device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor,
                 prop.multiProcessorCount);

    std::mt19937_64 g(20260301);
    std::vector<std::vector<int32_t>> routings;
    double worst = 0;
    for (int r = 0; r < kRoutings; ++r) {
      routings.push_back(random_offsets(g));
      int32_t max_rows = 0;
      for (int64_t e = 0; e < kE; ++e) max_rows = std::max(max_rows, routings.back()[e + 1] - routings.back()[e]);
      worst = std::max(worst, double(max_rows) * kE / kS);
    }
    std::fprintf(stderr, "%d routings of %ld rows over %ld experts; worst max/mean expert load %.2f\n", kRoutings,
                 long(kS), long(kE), worst);

    if (spes::cuda::grouped_gemm_sm90a_available()) {
      const std::string tma = spes::cuda::grouped_sm90::wgrad_tma_unavailable_reason();
      std::fprintf(stderr, "paths: portable, sm90a (ours); the TMA weight gradient: %s\n",
                   tma.empty() ? "runs" : tma.c_str());
    } else
      std::fprintf(stderr, "paths: portable (ours); no sm90a: %s\n",
                   spes::cuda::grouped_gemm_sm90a_unavailable_reason().c_str());
    std::printf("weights,product,S,E,C,OC,tflop,portable_ms,portable_tflops,sm90a_ms,sm90a_tflops,"
                "cublas_grouped_ms,cublas_grouped_tflops,cublas_per_expert_ms,cublas_per_expert_tflops,dense_ms,"
                "dense_tflops,ours_over_grouped,ours_over_per_expert,ours_over_dense,sm90a_over_portable,ours_even_ms,"
                "ours_even_tflops,ours_even_half_ms,ours_even_half_tflops,sm90a_tma_ms,sm90a_tma_tflops\n");
    cublasHandle_t cublas = nullptr;  // the peer: plain cuBLAS on the same stream
    cublas_check(cublasCreate(&cublas));
    cublas_check(cublasSetStream(cublas, rt.stream()));
    run_weights("gate_up", kD, 2 * kH, routings, cublas, rt.stream());
    run_weights("down", kH, kD, routings, cublas, rt.stream());
    const bool fused_same = run_swiglu_fusion(routings, rt.stream());
    cublasDestroy(cublas);
    if (!fused_same) {
      std::fprintf(stderr, "bench_grouped_gemm: a product with SwiGLU in its store did not give its two launches' bits\n");
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_grouped_gemm: %s\n", e.what());
    return 1;
  }
  return 0;
}
