// Causal multi-head attention with grouped KV heads: out = softmax(q·kᵀ/√D)·v.
//
// Forward saves lse = logsumexp of each row of scaled scores, so backward rebuilds
// the probabilities exactly (p = exp(s − lse)) without storing the T×T matrix, as
// FlashAttention does. Work is split into (batch, head) tasks over OpenMP; inside a
// task, queries go in blocks of kQBlock rows and each block's products are single-
// threaded sgemm calls over the keys it can see (the diagonal block is computed in
// full and masked, which wastes ~25% at T = 256 but runs at GEMM speed). Fixed
// block sizes make the result independent of the thread count. It runs 2.7-4× faster
// than a per-row version with vectorised loops over keys/D and std::exp
// (bench/RESULTS.md, CPU training step).
#include <cblas.h>

#include <algorithm>
#include <bit>
#include <cassert>
#include <cmath>
#include <vector>

#include "model/cpu/fast_exp.hpp"
#include "model/cpu/ops.hpp"

namespace spes::cpu {
namespace {

constexpr int64_t kQBlock = 64;

int i32(int64_t x) { return static_cast<int>(x); }

// The strided view of one head: rows t of [B,T,heads,D] for fixed b and head.
struct HeadView {
  int64_t offset;  // element offset of row t = 0
  int ld;          // row stride = heads·D
};
HeadView head_view(int64_t b, int64_t head, int64_t T, int64_t heads, int64_t D) {
  return {(b * T * heads + head) * D, i32(heads * D)};
}

// Per-thread scratch that only grows: after the first step no call allocates
// (README, Architecture: Memory plan), and OpenMP keeps its threads, so the buffers
// live across calls.
float* scratch(int which, int64_t n) {
  thread_local std::vector<float> buffers[2];
  std::vector<float>& buf = buffers[which];
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

// S[rows, L] = scale · q[t0 : t0+rows] · k[0 : L]ᵀ for L = t0 + rows keys. Forward and
// backward both call this with the same arguments, so they see bit-identical scores.
void block_scores(float* S, const float* qh, int ldq, const float* kh, int ldk, int64_t t0,
                  int64_t rows, int64_t D, float scale) {
  const int64_t L = t0 + rows;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, i32(rows), i32(L), i32(D), scale, qh + t0 * ldq,
              ldq, kh, ldk, 0.0f, S, i32(L));
}

}  // namespace

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D) {
  assert(Hkv > 0 && H % Hkv == 0);
  const int64_t group = H / Hkv;  // query heads per kv head
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  openblas_set_num_threads(1);  // parallelism comes from the (b, h) tasks (see matmul.cpp)
#pragma omp parallel
  {
    float* S = scratch(0, kQBlock * T);
    float inv_sum[kQBlock];
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H;
      const int64_t h = bh % H;
      const HeadView qv = head_view(b, h, T, H, D);
      const HeadView kv = head_view(b, h / group, T, Hkv, D);
      const float* qh = q + qv.offset;
      const float* kh = k + kv.offset;
      const float* vh = v + kv.offset;
      float* oh = out + qv.offset;
      for (int64_t t0 = 0; t0 < T; t0 += kQBlock) {
        const int64_t rows = std::min(kQBlock, T - t0);
        const int64_t L = t0 + rows;
        block_scores(S, qh, qv.ld, kh, kv.ld, t0, rows, D, scale);
        // Row t sees keys j ≤ t: softmax over those, zero beyond (P·V then ignores them).
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t n = t0 + i + 1;
          float* s = S + i * L;
          float maxv = s[0];
#pragma omp simd reduction(max : maxv)
          for (int64_t j = 1; j < n; ++j) maxv = s[j] > maxv ? s[j] : maxv;
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < n; ++j) {
            s[j] = fast_exp(s[j] - maxv);
            sum += s[j];
          }
          for (int64_t j = n; j < L; ++j) s[j] = 0.0f;
          inv_sum[i] = 1.0f / sum;
          lse[(b * H + h) * T + t0 + i] = maxv + std::log(sum);
        }
        // out[t0 : t0+rows] = P · v[0 : L], then normalise each row.
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, i32(rows), i32(D), i32(L), 1.0f, S,
                    i32(L), vh, kv.ld, 0.0f, oh + t0 * qv.ld, qv.ld);
        for (int64_t i = 0; i < rows; ++i) {
          float* o = oh + (t0 + i) * qv.ld;
          for (int64_t d = 0; d < D; ++d) o[d] *= inv_sum[i];
        }
      }
    }
  }
}

// Per query block (p = exp(s − lse), g = dout):
//   dP = g · vᵀ;   dS = P ⊙ (dP − Δ),  Δ_t = Σ_j p_tj·dP_tj = g_t·out_t;
//   dq = scale·dS·k;   dk += scale·dSᵀ·q;   dv += Pᵀ·g.
// Tasks are (batch, kv head) so that all query heads writing one dk/dv slice run in
// one task, in a fixed order: no atomics, same bits for any thread count.
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                        const float* k, const float* v, const float* out, const float* lse,
                        int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D) {
  const int64_t group = H / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  openblas_set_num_threads(1);
#pragma omp parallel
  {
    float* P = scratch(0, kQBlock * T);
    float* dS = scratch(1, kQBlock * T);
#pragma omp for schedule(static)
    for (int64_t bk = 0; bk < B * Hkv; ++bk) {
      const int64_t b = bk / Hkv;
      const int64_t kvh = bk % Hkv;
      const HeadView kv = head_view(b, kvh, T, Hkv, D);
      const float* kh = k + kv.offset;
      const float* vh = v + kv.offset;
      float* dkh = dk + kv.offset;
      float* dvh = dv + kv.offset;
      for (int64_t t = 0; t < T; ++t) {
        std::fill(dkh + t * kv.ld, dkh + t * kv.ld + D, 0.0f);
        std::fill(dvh + t * kv.ld, dvh + t * kv.ld + D, 0.0f);
      }
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        const HeadView qv = head_view(b, h, T, H, D);
        const float* qh = q + qv.offset;
        const float* gh = dout + qv.offset;
        const float* oh = out + qv.offset;
        float* dqh = dq + qv.offset;
        for (int64_t t0 = 0; t0 < T; t0 += kQBlock) {
          const int64_t rows = std::min(kQBlock, T - t0);
          const int64_t L = t0 + rows;
          block_scores(P, qh, qv.ld, kh, kv.ld, t0, rows, D, scale);
          // dP[rows, L] = g[t0 : t0+rows] · v[0 : L]ᵀ
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, i32(rows), i32(L), i32(D), 1.0f,
                      gh + t0 * qv.ld, qv.ld, vh, kv.ld, 0.0f, dS, i32(L));
          for (int64_t i = 0; i < rows; ++i) {
            const int64_t t = t0 + i;
            const int64_t n = t + 1;
            const float* g = gh + t * qv.ld;
            const float* o = oh + t * qv.ld;
            float delta = 0.0f;
#pragma omp simd reduction(+ : delta)
            for (int64_t d = 0; d < D; ++d) delta += g[d] * o[d];
            const float l = lse[(b * H + h) * T + t];
            float* p = P + i * L;
            float* ds = dS + i * L;
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) {
              p[j] = fast_exp(p[j] - l);
              ds[j] = p[j] * (ds[j] - delta);
            }
            for (int64_t j = n; j < L; ++j) p[j] = ds[j] = 0.0f;  // future keys
          }
          // dq[t0 : t0+rows] = scale · dS · k[0 : L]
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, i32(rows), i32(D), i32(L), scale,
                      dS, i32(L), kh, kv.ld, 0.0f, dqh + t0 * qv.ld, qv.ld);
          // dk[0 : L] += scale · dSᵀ · q[t0 : t0+rows];  dv[0 : L] += Pᵀ · g[t0 : t0+rows]
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, i32(L), i32(D), i32(rows), scale,
                      dS, i32(L), qh + t0 * qv.ld, qv.ld, 1.0f, dkh, kv.ld);
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, i32(L), i32(D), i32(rows), 1.0f, P,
                      i32(L), gh + t0 * qv.ld, qv.ld, 1.0f, dvh, kv.ld);
        }
      }
    }
  }
}

}  // namespace spes::cpu
