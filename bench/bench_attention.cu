// Causal flash attention, forward and backward, in TFLOP/s with the FlashAttention
// convention: forward 4·B·S²·H·D flops halved for causal, backward 2.5× forward
// (so the dq kernel's recomputation of S and dP, the price of determinism, is not
// counted as useful work). B·S = 16k tokens, model width H·D = 2048 (as in the
// FlashAttention-2 paper's benchmark), MHA, for D = 32, 64, 128; one GQA row (4 query
// heads per kv head); one row at the tiny demo's heads (d_model 128 = 4 heads × 32,
// S = 256).
// Forward and backward are timed on the portable kernels (mma.sync) and, for D = 64
// and 128 on a GPU that runs them, on the sm90a ones (wgmma), rows marked "sm90a"; the main
// shape of issue 28 (spes-1b: B = 8, S = 2048, 12 heads of 64) has a row of its own.
// Next to the measured cuBLAS bf16 GEMM ceiling. Prints "no GPU: <reason>" and
// exits 0 without a GPU.
// Goal (issue 5, H100): causal D=128 S=2k forward ≥ 300, backward ≥ 250 TFLOP/s.
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "bench/common.cuh"
#include "cuda/attention.cuh"

namespace {

using spes::cuda::bf16;

void run(spes::bench::Bench& bench, int64_t S, int64_t D, int64_t H, int64_t Hkv) {
  const int64_t B = 16384 / S;
  const cudaStream_t s = bench.stream();
  const int64_t nq = B * S * H * D, nkv = B * S * Hkv * D;
  spes::bench::DevBuf q(nq * 2), k(nkv * 2), v(nkv * 2), out(nq * 2), dout(nq * 2), dq(nq * 2), dk(nkv * 2),
      dv(nkv * 2), lse(B * H * S * 4), scratch(spes::cuda::attention_backward_scratch_bytes(B, S, H));
  spes::bench::fill(q.as<bf16>(), nq, s, 1);
  spes::bench::fill(k.as<bf16>(), nkv, s, 2);
  spes::bench::fill(v.as<bf16>(), nkv, s, 3);
  spes::bench::fill(dout.as<bf16>(), nq, s, 4);

  const double fwd_flops = 4.0 * B * S * S * H * D / 2.0;  // causal
  const std::string size = "B=" + std::to_string(B) + " S=" + std::to_string(S) + " H=" + std::to_string(H) +
                           (Hkv != H ? std::string("/").append(std::to_string(Hkv)) : "");
  const std::string tag = " D=" + std::to_string(D);
  // Each kernel family this GPU runs (AttentionPath), portable first.
  std::vector<std::pair<spes::cuda::AttentionPath, const char*>> paths{{spes::cuda::AttentionPath::portable, ""}};
  if ((D == 64 || D == 128) && spes::cuda::attention_sm90a_available())
    paths.push_back({spes::cuda::AttentionPath::sm90a, " sm90a"});
  for (const auto& [path, name] : paths) {
    auto forward = [&] {
      spes::cuda::attention_forward(out.as<bf16>(), lse.as<float>(), q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), B, S,
                                    H, Hkv, D, s, path);
    };
    bench.flop_row("attention fwd causal" + tag + name, size, forward, fwd_flops);
  }
  spes::cuda::attention_forward(out.as<bf16>(), lse.as<float>(), q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), B, S, H,
                                Hkv, D, s, spes::cuda::AttentionPath::portable);  // out and lse for the backward
  for (const auto& [path, name] : paths)
    bench.flop_row(
        "attention bwd causal" + tag + name, size,
        [&] {
          spes::cuda::attention_backward(dq.as<bf16>(), dk.as<bf16>(), dv.as<bf16>(), dout.as<bf16>(), q.as<bf16>(),
                                         k.as<bf16>(), v.as<bf16>(), out.as<bf16>(), lse.as<float>(), scratch.p, B,
                                         S, H, Hkv, D, s, path);
        },
        2.5 * fwd_flops);
}

}  // namespace

int main() {
  try {
    spes::bench::Bench bench;
    if (!bench.ok()) return 0;
    for (int64_t D : {32, 64, 128})
      for (int64_t S : {1024, 2048, 4096, 8192}) run(bench, S, D, 2048 / D, 2048 / D);
    run(bench, 2048, 128, 16, 4);  // GQA
    run(bench, 2048, 64, 12, 12);  // spes-1b's attention (B = 16384 / S = 8)
    run(bench, 256, 32, 4, 4);     // configs/tiny.toml's attention, 16k tokens
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_attention: %s\n", e.what());
    return 1;
  }
  return 0;
}
