// Memory-bound kernels of issue 4 at training sizes: embedding, RMSNorm + residual,
// QK-norm + RoPE, fused cross-entropy (vocab 151 665), AdamW, global norm.
// Bytes are the minimum each kernel must move (bench/common.cuh convention).
// Goal on H100: every kernel ≥ 80 % of the measured D2D copy bandwidth.
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "bench/common.cuh"
#include "cuda/adamw.cuh"
#include "cuda/crossentropy.cuh"
#include "cuda/embedding.cuh"
#include "cuda/global_norm.cuh"
#include "cuda/rmsnorm.cuh"
#include "cuda/rope.cuh"
#include "cuda/runtime.cuh"

using namespace spes::cuda;
using spes::bench::Bench;
using spes::bench::DevBuf;

namespace {

std::string dims(int64_t a, int64_t b) { return std::to_string(a) + "x" + std::to_string(b); }

void bench_width(Bench& b, cudaStream_t s, int64_t N, int64_t C, int64_t V) {
  const int64_t NC = N * C;
  const double act = double(NC) * 2;  // one bf16 activation tensor
  DevBuf x(NC * 2), y(NC * 2), z(NC * 2), w(NC * 2), wt(C * 2), dw(C * 4), rstd(N * 4);
  spes::bench::fill(x.as<bf16>(), NC, s, 1);
  spes::bench::fill(y.as<bf16>(), NC, s, 2);
  spes::bench::fill(z.as<bf16>(), NC, s, 3);
  spes::bench::fill(wt.as<bf16>(), C, s, 4);

  // embedding
  std::vector<int32_t> tok(N);
  uint32_t h = 12345;
  std::set<int32_t> uniq;
  for (auto& t : tok) {
    h = h * 1664525u + 1013904223u;
    t = int32_t((h >> 8) % uint32_t(V));
    uniq.insert(t);
  }
  DevBuf d_tok(N * 4), table(V * C * 2), dtable(V * C * 4);
  spes::bench::copy_to_device(d_tok.p, tok.data(), N * 4, s);
  spes::bench::fill(table.as<bf16>(), V * C, s, 5);
  spes::bench::zero(dtable.p, V * C * 4, s);
  b.mem_row("embedding_forward", dims(N, C), [&] { embedding_forward(w.as<bf16>(), d_tok.as<int32_t>(), table.as<bf16>(), N, C, V, s); },
            2 * act);
  const size_t ws_bytes = embedding_backward_workspace_bytes(N, V);
  DevBuf ws(ws_bytes);
  b.mem_row("embedding_backward", dims(N, C),
            [&] { embedding_backward(dtable.as<float>(), x.as<bf16>(), d_tok.as<int32_t>(), N, C, V, ws.p, ws_bytes, s); },
            act + 2.0 * uniq.size() * C * 4);

  // RMSNorm + residual: reads residual + branch, writes residual + out
  b.mem_row("rmsnorm_forward (+residual)", dims(N, C),
            [&] { rmsnorm_forward(w.as<bf16>(), rstd.as<float>(), z.as<bf16>(), x.as<bf16>(), y.as<bf16>(), wt.as<bf16>(), N, C, 1e-6f, s); },
            4 * act);
  const size_t rs = rmsnorm_backward_scratch_bytes(N, C);
  DevBuf rscratch(rs);
  b.mem_row("rmsnorm_backward (+residual)", dims(N, C),
            [&] { rmsnorm_backward(w.as<bf16>(), dw.as<float>(), rscratch.p, y.as<bf16>(), x.as<bf16>(), z.as<bf16>(), wt.as<bf16>(), rstd.as<float>(), N, C, s); },
            4 * act);

  // QK-norm + RoPE over the q projection (head dim 64 at C = 768, 128 at C = 2048)
  const int64_t D = C >= 2048 ? 128 : 64, H = C / D, T = 4096, B = N / T;
  DevBuf rope_tab(rope_table_bytes(T, D));
  rope_table_init(rope_tab.as<float2>(), T, D, 10000.0, s);
  b.mem_row("qknorm_rope_forward", dims(N, C),
            [&] { qknorm_rope_forward(w.as<bf16>(), rstd.as<float>(), x.as<bf16>(), wt.as<bf16>(), rope_tab.as<float2>(), B, T, H, D, 1e-6f, s); },
            2 * act);
  const size_t qs = qknorm_rope_backward_scratch_bytes(B, T, H, D);
  DevBuf qscratch(qs);
  b.mem_row("qknorm_rope_backward", dims(N, C),
            [&] { qknorm_rope_backward(z.as<bf16>(), dw.as<float>(), qscratch.p, y.as<bf16>(), x.as<bf16>(), wt.as<bf16>(), rstd.as<float>(), rope_tab.as<float2>(), B, T, H, D, s); },
            3 * act);
}

}  // namespace

int main() {
  try {
    Bench b(/*need_gemm_ceiling=*/false);
    if (!b.ok()) return 0;
    cudaStream_t s = b.stream();
    const int64_t N = 16384, V = 151665;
    bench_width(b, s, N, 768, V);
    bench_width(b, s, N, 2048, V);

    // fused cross-entropy over a chunk of tokens; gradient written in place
    for (int64_t rows : {int64_t(4096), int64_t(16384)}) {
      const int64_t ld = 151672;  // rows padded to 16 bytes, as the lm-head GEMM writes them
      const int64_t n = rows * ld;
      DevBuf logits(n * 2), loss(rows * 4), lse(rows * 4), tgt(rows * 4);
      spes::bench::fill(logits.as<bf16>(), n, s, 7, 4.0f);
      spes::bench::zero(tgt.p, rows * 4, s);
      for (CeImpl impl : {CeImpl::cluster, CeImpl::row}) {
        if (impl == CeImpl::cluster && !crossentropy_cluster_supported(V)) {
          std::printf("%-34s (not supported on this device/build)\n", "crossentropy cluster");
          continue;
        }
        // re-filling between runs is unnecessary: bf16 gradients are finite inputs too
        b.mem_row(std::string("crossentropy fused (") + (impl == CeImpl::cluster ? "cluster" : "row") + ")",
                  dims(rows, V),
                  [&] { crossentropy_forward_backward(logits.as<bf16>(), loss.as<float>(), lse.as<float>(), logits.as<bf16>(), tgt.as<int32_t>(), rows, V, ld, 1.0f / rows, 1e-5f / rows, s, impl); },
                  2.0 * rows * V * 2);
      }
    }

    // optimizer over 100M owned parameters
    const int64_t P = 100'000'000;
    DevBuf master(P * 4), grad(P * 4), m(P * 4), v(P * 4), wts(P * 2), nsq(8), scale(4);
    spes::bench::fill(master.as<float>(), P, s, 8);
    spes::bench::fill(grad.as<float>(), P, s, 9, 0.01f);
    spes::bench::zero(m.p, P * 4, s);
    spes::bench::zero(v.p, P * 4, s);
    int64_t t = 1;
    b.mem_row("adamw_update", std::to_string(P),
              [&] { adamw_update(master.as<float>(), wts.as<bf16>(), grad.as<float>(), m.as<float>(), v.as<float>(), P, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, t++, nullptr, s); },
              30.0 * P);
    GradSpan span{grad.as<float>(), P};
    const size_t gs = global_norm_scratch_bytes(&span, 1);
    DevBuf gscratch(gs);
    b.mem_row("global_norm_clip", std::to_string(P),
              [&] { global_norm_clip(nsq.as<double>(), scale.as<float>(), &span, 1, 1.0, gscratch.p, gs, s); },
              4.0 * P);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_core: %s\n", e.what());
    return 1;
  }
  return 0;
}
