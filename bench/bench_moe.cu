// MoE layer bench (issue 6): the whole layer (router GEMM, router, dispatch, gather,
// expert SwiGLU GEMMs, combine) forward and backward at two shapes:
//   spes-1b:       N 16384 tokens, d 768,  16 experts, top-2, hidden 2048
//   fine-grained:  N 16384 tokens, d 2048, 64 experts, top-8, hidden 1024
// for both ways of issuing the per-expert GEMMs (per_expert, grouped). Reported:
//  - TFLOP/s counting only routed-token expert FLOPs (fwd 6·S·d·H, bwd 12·S·d·H,
//    S = N·K slots), and % of the measured cuBLAS GEMM ceiling;
//  - the ratio to one dense cuBLAS GEMM chain of the same FLOPs (the same products
//    with all S rows as one expert; goal ≥ 70 %);
//  - backward with 3/4 of the experts frozen: time saved vs the share of backward
//    FLOPs that the skipped weight-gradient GEMMs represent (goal: close);
//  - the memory-bound kernels alone, GB/s and % of the measured copy ceiling.
// Median of 25 runs after warm-up, CUDA events (bench/common.cuh). Without a GPU it
// prints "no GPU: <reason>" and exits 0.
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "bench/common.cuh"
#include "cuda/moe.cuh"
#include "cuda/router.cuh"
#include "cuda/swiglu.cuh"
#include "tests/moe_layer_buffers.cuh"

namespace {

using spes::bench::DevBuf;
using spes::cuda::bf16;
using spes::cuda::ExpertGemm;

struct Shape {
  const char* name;
  int64_t N, d, E, K, H;
};

const char* gemm_name(ExpertGemm g) { return g == ExpertGemm::grouped ? "grouped" : "per_expert"; }

// One dense bf16 GEMM, row-major C[M,N] = op(A)·op(B) (+ beta·C), as MoeLayer issues them.
void dense(cublasHandle_t h, bool ta, bool tb, int64_t M, int64_t N, int64_t K, const bf16* A, int64_t lda,
           const bf16* B, int64_t ldb, void* C, cudaDataType_t ctype, int64_t ldc, float beta) {
  const float alpha = 1.0f;
  cublas_check(cublasGemmEx(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, int(N), int(M),
                            int(K), &alpha, B, CUDA_R_16BF, int(ldb), A, CUDA_R_16BF, int(lda), &beta, C, ctype,
                            int(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

struct LayerTimes {
  float fwd = 0, bwd = 0, bwd_frozen = 0;
  double removed_wgrad_flops = 0;  // weight-gradient FLOPs of the frozen experts' actual rows
};

void run_shape(spes::bench::Bench& b, const Shape& s, cublasHandle_t cublas, cudaStream_t stream) {
  const int64_t N = s.N, d = s.d, E = s.E, K = s.K, H = s.H, S = N * K;
  const double fwd_flops = 6.0 * double(S) * d * H, bwd_flops = 2.0 * fwd_flops;
  char size[64];
  std::snprintf(size, sizeof size, "%s N%ld d%ld E%ld k%ld H%ld", s.name, long(N), long(d), long(E), long(K),
                long(H));
  std::printf("\n== %s: %ld routed slots, expert FLOPs fwd %.2f TFLOP, bwd %.2f TFLOP\n", size, long(S),
              fwd_flops / 1e12, bwd_flops / 1e12);

  // Parameters: flat expert blocks [gate | up | down] like the layout; fp32 grads.
  const int64_t blk = 3 * H * d;
  DevBuf x(sizeof(bf16) * N * d), router(sizeof(bf16) * E * d), w(sizeof(bf16) * E * blk);
  DevBuf out(sizeof(bf16) * N * d), dout(sizeof(bf16) * N * d), dx(sizeof(bf16) * N * d);
  DevBuf g(sizeof(float) * E * blk), grouter(sizeof(float) * E * d);
  spes::bench::fill(x.as<bf16>(), N * d, stream, 1, 1.0f);
  // Uniform ±a has std a/√3: router std 3/√d gives logits of std ≈ 1 (mildly uneven routing).
  spes::bench::fill(router.as<bf16>(), E * d, stream, 2, 3.0f / std::sqrt(float(d)));
  spes::bench::fill(w.as<bf16>(), E * blk, stream, 3, 1.7f / std::sqrt(float(d)));
  spes::bench::fill(dout.as<bf16>(), N * d, stream, 4, 1.0f);
  spes::bench::fill(g.as<float>(), E * blk, stream, 5, 0.0f);
  spes::bench::fill(grouter.as<float>(), E * d, stream, 6, 0.0f);
  const spes::cuda::MoeShape shape{N, d, E, K, H, false};
  const spes::test::MoeLayerBuffers bufs(shape);
  const auto& saved = bufs.saved;
  const auto& scratch = bufs.scratch;

  auto make_layer = [&](ExpertGemm gemm, bool frozen_3_4) {
    spes::cuda::MoeWeights wt;
    wt.router = router.as<bf16>();
    spes::cuda::MoeGrads gr;
    gr.router = grouter.as<float>();
    for (int64_t e = 0; e < E; ++e) {
      bf16* base = w.as<bf16>() + e * blk;
      float* gbase = g.as<float>() + e * blk;
      const bool owned = !frozen_3_4 || e % 4 == 0;
      wt.gate.push_back(base);
      wt.up.push_back(base + H * d);
      wt.down.push_back(base + 2 * H * d);
      gr.gate.push_back(owned ? gbase : nullptr);
      gr.up.push_back(owned ? gbase + H * d : nullptr);
      gr.down.push_back(owned ? gbase + 2 * H * d : nullptr);
    }
    return std::make_unique<spes::cuda::MoeLayer>(shape, gemm, wt, gr, saved, scratch);
  };

  std::vector<LayerTimes> times;
  for (ExpertGemm gemm : {ExpertGemm::per_expert, ExpertGemm::grouped}) {
    LayerTimes t;
    try {
      auto layer = make_layer(gemm, false);
      const std::string tag = std::string(" [") + gemm_name(gemm) + "]";
      t.fwd = b.flop_row("moe fwd" + tag, s.name,
                         [&] { layer->forward(cublas, out.as<bf16>(), x.as<bf16>(), nullptr, stream); },
                         fwd_flops);
      t.bwd = b.flop_row("moe bwd, all owned" + tag, s.name,
                         [&] {
                           layer->backward(cublas, dx.as<bf16>(), dout.as<bf16>(), x.as<bf16>(), 0.01f, 0.001f,
                                           stream);
                         },
                         bwd_flops);
      auto frozen = make_layer(gemm, true);
      frozen->forward(cublas, out.as<bf16>(), x.as<bf16>(), nullptr, stream);
      const auto off = frozen->expert_offsets();
      for (int64_t e = 0; e < E; ++e)
        if (e % 4 != 0) t.removed_wgrad_flops += 6.0 * double(off[e + 1] - off[e]) * d * H;
      t.bwd_frozen = b.flop_row("moe bwd, 3/4 frozen" + tag, s.name,
                                [&] {
                                  frozen->backward(cublas, dx.as<bf16>(), dout.as<bf16>(), x.as<bf16>(), 0.01f,
                                                   0.001f, stream);
                                },
                                bwd_flops - t.removed_wgrad_flops);
      // Expert load of this batch, for reading the numbers: max / mean rows per expert.
      int64_t max_rows = 0;
      for (int64_t e = 0; e < E; ++e) max_rows = std::max<int64_t>(max_rows, off[e + 1] - off[e]);
      std::printf("   expert load: max %ld rows vs mean %.0f (imbalance %.2f)\n", long(max_rows), double(S) / E,
                  max_rows * double(E) / S);
      if (gemm == ExpertGemm::grouped && layer->grouped_fallback_sites() + frozen->grouped_fallback_sites() > 0)
        std::printf("   note: cublasGemmGroupedBatchedEx refused %d GEMM site(s); they ran per expert\n",
                    std::max(layer->grouped_fallback_sites(), frozen->grouped_fallback_sites()));
    } catch (const spes::Error& e) {
      std::printf("   %s path failed: %s\n", gemm_name(gemm), e.what());
      t = LayerTimes{};
    }
    times.push_back(t);
  }

  // The rows above route the same batch in every run, so by the timed runs cuBLAS's
  // heuristic cache has seen each per-expert row count. In training the routing, and
  // with it every expert's row count, changes with each micro-batch. Here each run
  // routes a batch no earlier run routed, so a per-expert GEMM pays for the shape it
  // has not seen, as in a run's first steps (bench_train_gpu's whole step with
  // per-expert GEMMs spent far more time outside kernels than grouped:
  // bench/RESULTS.md, Whole step).
  {
    const int64_t inputs = spes::bench::kWarmup + spes::bench::kRuns;
    DevBuf xs(sizeof(bf16) * N * d * inputs);
    spes::bench::fill(xs.as<bf16>(), N * d * inputs, stream, 7, 1.0f);
    for (ExpertGemm gemm : {ExpertGemm::per_expert, ExpertGemm::grouped}) {
      try {
        auto layer = make_layer(gemm, false);
        int64_t next = 0;
        b.flop_row(std::string("moe fwd+bwd, new routing each run [") + gemm_name(gemm) + "]", s.name,
                   [&] {
                     const bf16* xi = xs.as<bf16>() + (next++ % inputs) * N * d;
                     layer->forward(cublas, out.as<bf16>(), xi, nullptr, stream);
                     layer->backward(cublas, dx.as<bf16>(), dout.as<bf16>(), xi, 0.01f, 0.001f, stream);
                   },
                   fwd_flops + bwd_flops);
      } catch (const spes::Error& e) {
        std::printf("   %s path failed: %s\n", gemm_name(gemm), e.what());
      }
    }
  }

  // Dense chain: the same six products with all S rows as one expert.
  bf16 *xe = saved.xe, *gu = saved.gu, *ye = saved.ye, *hbuf = scratch.h, *dye = scratch.dye, *dgu = scratch.dgu;
  const bf16* wgu = w.as<bf16>();
  const bf16* wd = w.as<bf16>() + 2 * H * d;
  float* gwgu = g.as<float>();
  float* gwd = g.as<float>() + 2 * H * d;
  const float dense_fwd = b.flop_row("dense chain fwd (2 GEMMs)", s.name,
                                     [&] {
                                       dense(cublas, false, true, S, 2 * H, d, xe, d, wgu, d, gu, CUDA_R_16BF, 2 * H, 0.0f);
                                       dense(cublas, false, true, S, d, H, hbuf, H, wd, H, ye, CUDA_R_16BF, d, 0.0f);
                                     },
                                     fwd_flops);
  const float dense_bwd = b.flop_row("dense chain bwd (4 GEMMs)", s.name,
                                     [&] {
                                       dense(cublas, false, false, S, H, d, dye, d, wd, H, hbuf, CUDA_R_16BF, H, 0.0f);
                                       dense(cublas, true, false, d, H, S, dye, d, hbuf, H, gwd, CUDA_R_32F, H, 1.0f);
                                       dense(cublas, false, false, S, d, 2 * H, dgu, 2 * H, wgu, d, dye, CUDA_R_16BF, d, 0.0f);
                                       dense(cublas, true, false, 2 * H, d, S, dgu, 2 * H, xe, d, gwgu, CUDA_R_32F, d, 1.0f);
                                     },
                                     bwd_flops);

  for (size_t i = 0; i < times.size(); ++i) {
    const LayerTimes& t = times[i];
    if (t.fwd <= 0) continue;
    const char* name = gemm_name(i == 0 ? ExpertGemm::per_expert : ExpertGemm::grouped);
    std::printf("   [%s] vs dense chain: fwd %.0f%%, bwd %.0f%% (goal >= 70%%)\n", name, 100.0 * dense_fwd / t.fwd,
                100.0 * dense_bwd / t.bwd);
    std::printf("   [%s] 3/4 frozen: backward %.3f -> %.3f ms, saves %.1f%% of its time; the skipped weight-gradient "
                "GEMMs are %.1f%% of backward FLOPs\n",
                name, t.bwd, t.bwd_frozen, 100.0 * (t.bwd - t.bwd_frozen) / t.bwd,
                100.0 * t.removed_wgrad_flops / bwd_flops);
  }

  // Memory-bound pieces alone, on the buffers the last forward left (valid data).
  auto per = make_layer(ExpertGemm::per_expert, false);
  per->forward(cublas, out.as<bf16>(), x.as<bf16>(), nullptr, stream);
  per->backward(cublas, dx.as<bf16>(), dout.as<bf16>(), x.as<bf16>(), 0.01f, 0.001f, stream);
  const double bs = sizeof(bf16);
  b.mem_row("router fwd (fp32 logits)", s.name,
            [&] {
              spes::cuda::router_forward(saved.probs, saved.lse, saved.topk_idx, saved.topk_w, scratch.router_partials,
                                         saved.probs, N, E, K, false, stream);
            },
            2.0 * N * E * 4 + N * 4 + N * K * 8.0);
  b.mem_row("router bwd (bf16 dlogits)", s.name,
            [&] {
              spes::cuda::router_backward(scratch.dlogits, scratch.dtopk_w, saved.probs, saved.lse, saved.topk_idx,
                                          saved.topk_w, saved.lb_weight, 0.01f, 0.001f / N, N, E, K, false, stream);
            },
            N * E * 4.0 + N * E * bs + N * 4 + N * K * 12.0);
  b.mem_row("dispatch indices", s.name,
            [&] {
              spes::cuda::moe_dispatch_indices(saved.offsets, saved.slot_token, saved.token_slot, scratch.dispatch,
                                               saved.topk_idx, N, E, K, stream);
            },
            2.0 * S * 4 + 2.0 * S * 4);
  b.mem_row("gather fwd", s.name,
            [&] { spes::cuda::moe_gather_forward(saved.xe, x.as<bf16>(), saved.slot_token, S, d, stream); },
            2.0 * S * d * bs + S * 4.0);
  b.mem_row("swiglu fwd", s.name, [&] { spes::cuda::swiglu_forward(hbuf, gu, gu + H, S, H, 2 * H, stream); },
            3.0 * S * H * bs);
  b.mem_row("combine fwd", s.name,
            [&] {
              spes::cuda::moe_combine_forward(out.as<bf16>(), ye, saved.topk_w, saved.token_slot, N, K, d, stream);
            },
            (S + N) * d * bs + S * 8.0);
  b.mem_row("combine bwd", s.name,
            [&] {
              spes::cuda::moe_combine_backward(dye, scratch.dtopk_w, dout.as<bf16>(), ye, saved.topk_w,
                                               saved.token_slot, N, K, d, stream);
            },
            (2.0 * S + N) * d * bs + S * 12.0);
  b.mem_row("swiglu bwd (+ h recompute)", s.name,
            [&] { spes::cuda::swiglu_backward(dgu, dgu + H, hbuf, hbuf, gu, gu + H, S, H, 2 * H, stream); },
            6.0 * S * H * bs);
  b.mem_row("gather bwd", s.name,
            [&] { spes::cuda::moe_gather_backward(dx.as<bf16>(), dye, saved.token_slot, N, K, d, stream); },
            (S + N) * d * bs + S * 4.0);
}

}  // namespace

int main() {
  try {
    spes::bench::Bench b;
    if (!b.ok()) return 0;
    // The Runtime's stream and cuBLAS handle (bound to that stream, sharing the
    // GEMM workspace with cuBLASLt): the configuration the trainer runs.
    cudaStream_t stream = b.stream();
    cublasHandle_t cublas = b.runtime().cublas();
    const Shape shapes[] = {{"spes-1b", 16384, 768, 16, 2, 2048}, {"fine-grained", 16384, 2048, 64, 8, 1024}};
    for (const Shape& s : shapes) run_shape(b, s, cublas, stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_moe: %s\n", e.what());
    return 1;
  }
  return 0;
}
