// Grouped expert GEMMs (cuda/grouped_gemm.cuh) vs the CPU reference: cpu::matmul_forward
// and cpu::matmul_backward called per expert on its row range, on float copies of
// exactly the bf16 values the kernels read. Inputs are drawn fresh each run; every
// output starts as NaN (poison) except the weight gradients, which start from random
// fp32 values (the kernel adds to them).
//
// Tolerances, relative error ‖gpu − cpu‖/‖cpu‖ over the rows the experts own:
//   out, dinp (bf16)          1e-2: one bf16 rounding of an fp32 sum (≈ 2⁻⁹ relative
//                             per element, ~1e-3 as a norm), as test_cuda_matmul;
//   dW (fp32, prior + Σ)      1e-4: bf16 products are exact in fp32, so only the
//                             summation order differs (k-steps of 32 or 64 rows,
//                             the tensor core's adder tree vs OpenBLAS's), as
//                             test_cuda_matmul's fp32 outputs.
// The worst element of each output is printed. Exact checks: rows outside every
// expert keep their poison (and are never read: they hold NaN in the inputs); the dW
// of a frozen expert (not in trained_experts) and of a trained expert with no rows keep
// their bits; a second run of each product gives the same bits (one add per dW element).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/grouped_gemm.cuh"
#include "cuda/grouped_gemm_sm90.cuh"
#include "cuda/swiglu.cuh"
#include "model/cpu/ops.hpp"
#include "tests/cuda_test.cuh"

using namespace spes::test;

namespace {

using spes::cuda::bf16;

constexpr double kTolBf16 = 1e-2;
constexpr double kTolF32 = 1e-4;

// A routing: rows [lead, lead + Σ counts) are the experts' in order; `lead` rows before
// and `trail` rows after them belong to no expert.
struct Case {
  std::vector<int32_t> counts;   // rows per expert (E = counts.size())
  int64_t C, OC;
  std::vector<int32_t> trained;  // the trained experts; empty: all
  const char* what;
  int32_t lead = 0, trail = 0;
};

// Prints the element of a [rows × cols] matrix with the largest |gpu − cpu|.
void print_worst(const std::string& name, const std::vector<float>& gpu, const std::vector<float>& cpu, int64_t cols) {
  size_t at = 0;
  double worst = -1;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double d = std::isfinite(gpu[i]) ? std::fabs(double(gpu[i]) - cpu[i]) : INFINITY;
    if (d > worst) worst = d, at = i;
  }
  if (cpu.empty()) return;
  MESSAGE(name << ": worst |gpu - cpu| " << worst << " at [" << at / cols << ", " << at % cols << "] (gpu "
               << gpu[at] << ", cpu " << cpu[at] << ")");
}

bool all_bits(const std::vector<float>& v, size_t from, size_t to, uint32_t bits) {
  for (size_t i = from; i < to; ++i) {
    uint32_t b;
    std::memcpy(&b, &v[i], sizeof b);
    if (b != bits) return false;
  }
  return true;
}

constexpr uint32_t kSentinelBits = 0x7FC0DEADu;  // a NaN with a payload, in frozen experts' dW

float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// The kernel families this device runs: the portable one always, sm90a where it can,
// and there its weight gradient on either kernel (grouped_sm90::WgradKernel: the
// threads' copies, or the copy engine's where it can run), set while a case runs.
struct Family {
  spes::cuda::GroupedGemmPath path;
  spes::cuda::grouped_sm90::WgradKernel wgrad;
  const char* name;
};
std::vector<Family> device_families() {
  using spes::cuda::GroupedGemmPath;
  using spes::cuda::grouped_sm90::WgradKernel;
  std::vector<Family> families{{GroupedGemmPath::portable, WgradKernel::threads, "portable"}};
  if (!spes::cuda::grouped_gemm_sm90a_available()) return families;
  families.push_back({GroupedGemmPath::sm90a, WgradKernel::threads, "sm90a"});
  if (spes::cuda::grouped_sm90::wgrad_tma_unavailable_reason().empty())
    families.push_back({GroupedGemmPath::sm90a, WgradKernel::tma, "sm90a, TMA weight gradient"});
  else
    MESSAGE("the TMA weight gradient cannot run here: " << spes::cuda::grouped_sm90::wgrad_tma_unavailable_reason());
  return families;
}

void check_case(const Case& k, const Family& family) {
  const spes::cuda::grouped_sm90::ScopedWgradKernel wgrad(family.wgrad);
  const spes::cuda::GroupedGemmPath path = family.path;
  const int64_t E = int64_t(k.counts.size()), C = k.C, OC = k.OC;
  std::vector<int32_t> offsets(E + 1);
  offsets[0] = k.lead;
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + k.counts[e];
  const int64_t first = offsets[0], last = offsets[E], S = last + k.trail;
  std::vector<int32_t> trained = k.trained;
  if (trained.empty())
    for (int32_t e = 0; e < E; ++e) trained.push_back(e);
  std::vector<bool> is_trained(E, false);
  for (int32_t e : trained) is_trained[e] = true;
  std::string tag = std::string(family.name) + ", " + k.what + ": S=" + std::to_string(S) +
                    " E=" + std::to_string(E) + " C=" + std::to_string(C) + " OC=" + std::to_string(OC) + " rows";
  if (E <= 16) {
    for (int32_t c : k.counts) tag.append(" ").append(std::to_string(c));
  } else {
    tag += " in " + std::to_string(std::count_if(k.counts.begin(), k.counts.end(), [](int32_t c) { return c > 0; })) +
           " experts";
  }
  INFO(tag);

  // Inputs (bf16 values); rows outside every expert are NaN: no product may read them.
  std::vector<float> inp = rounded_bf16(random_vector(S * C)), dout = rounded_bf16(random_vector(S * OC));
  for (int64_t s = 0; s < S; ++s)
    if (s < first || s >= last) {
      std::fill(inp.begin() + s * C, inp.begin() + (s + 1) * C, NAN);
      std::fill(dout.begin() + s * OC, dout.begin() + (s + 1) * OC, NAN);
    }
  const std::vector<float> w = rounded_bf16(random_vector(E * OC * C, 1.0f / std::sqrt(float(C))));
  // The prior holds some −0: adding a zero product to it would give +0, so a trained
  // expert with no rows shows even a "+= 0" (it must not be touched at all).
  std::vector<float> dw_prior = random_vector(E * OC * C, 0.5f);
  for (size_t i = 0; i < dw_prior.size(); i += 7) dw_prior[i] = -0.0f;
  for (int64_t e = 0; e < E; ++e)
    if (!is_trained[e]) std::fill(dw_prior.begin() + e * OC * C, dw_prior.begin() + (e + 1) * OC * C, from_bits(kSentinelBits));

  // CPU reference, expert by expert on its rows.
  std::vector<float> out_ref(S * OC, 0.0f), dinp_ref(S * C, 0.0f), dw_ref = dw_prior;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t o = offsets[e], m = k.counts[e];
    if (m == 0) continue;
    spes::cpu::matmul_forward(out_ref.data() + o * OC, inp.data() + o * C, w.data() + e * OC * C, m, C, OC);
    spes::cpu::matmul_backward(dinp_ref.data() + o * C, is_trained[e] ? dw_ref.data() + e * OC * C : nullptr,
                               dout.data() + o * OC, inp.data() + o * C, w.data() + e * OC * C, m, C, OC);
  }

  // Device: weights in one buffer, per-expert pointer tables built once.
  auto d_inp = upload_bf16(inp), d_dout = upload_bf16(dout), d_w = upload_bf16(w);
  auto d_offsets = upload(offsets), d_trained = upload(trained);
  std::vector<const bf16*> w_table(E);
  std::vector<float*> dw_table(E);
  DevTensor<float> d_dw(E * OC * C);
  for (int64_t e = 0; e < E; ++e) {
    w_table[e] = d_w.get() + e * OC * C;
    dw_table[e] = d_dw.get() + e * OC * C;
  }
  // An untrained expert's gradient pointer is never read: null for the first of them.
  for (int64_t e = 0; e < E; ++e)
    if (!is_trained[e]) {
      dw_table[e] = nullptr;
      break;
    }
  DevTensor<const bf16*> d_w_table(E);
  DevTensor<float*> d_dw_table(E);
  copy_to_device(d_w_table.get(), w_table.data(), E);
  copy_to_device(d_dw_table.get(), dw_table.data(), E);
  DevTensor<bf16> d_out(S * OC), d_dinp(S * C);

  auto run = [&] {
    d_out.poison();
    d_dinp.poison();
    copy_to_device(d_dw.get(), dw_prior.data(), E * OC * C);
    spes::cuda::grouped_matmul_forward(d_out, d_inp, d_w_table, d_offsets, S, E, C, OC, stream(), path);
    spes::cuda::grouped_matmul_backward_input(d_dinp, d_dout, d_w_table, d_offsets, S, E, C, OC, stream(), path);
    spes::cuda::grouped_matmul_backward_weight(d_dw_table, d_dout, d_inp, d_offsets, d_trained,
                                               int64_t(trained.size()), S, E, C, OC, stream(), path);
  };
  run();
  // bf16 poison is 0xFFFF: read back as float it is NaN; compare bits of the raw halves.
  const std::vector<bf16> out_raw = copy_to_host(d_out.get(), S * OC), dinp_raw = copy_to_host(d_dinp.get(), S * C);
  const std::vector<float> out_g = download(d_out.get(), S * OC), dinp_g = download(d_dinp.get(), S * C);
  const std::vector<float> dw_g = download(d_dw.get(), E * OC * C);

  // Owned rows against the reference; the rest untouched.
  const auto rows = [](const std::vector<float>& v, int64_t from, int64_t to, int64_t cols) {
    return std::vector<float>(v.begin() + from * cols, v.begin() + to * cols);
  };
  const auto untouched = [](const std::vector<bf16>& raw, int64_t from, int64_t to, int64_t cols) {
    for (int64_t i = from * cols; i < to * cols; ++i) {
      uint16_t b;
      std::memcpy(&b, &raw[i], sizeof b);
      if (b != 0xFFFF) return false;
    }
    return true;
  };
  if (last > first) {
    const auto o_g = rows(out_g, first, last, OC), o_r = rows(out_ref, first, last, OC);
    const std::string n_out = "forward out " + tag, n_dinp = "backward dinp " + tag;
    CHECK_REL(n_out, o_g.data(), o_r.data(), int64_t(o_r.size()), kTolBf16);
    print_worst("forward out", o_g, o_r, OC);
    const auto i_g = rows(dinp_g, first, last, C), i_r = rows(dinp_ref, first, last, C);
    CHECK_REL(n_dinp, i_g.data(), i_r.data(), int64_t(i_r.size()), kTolBf16);
    print_worst("backward dinp", i_g, i_r, C);
  }
  CHECK_MESSAGE(untouched(out_raw, 0, first, OC), "forward wrote rows before offsets[0]");
  CHECK_MESSAGE(untouched(out_raw, last, S, OC), "forward wrote rows after offsets[E]");
  CHECK_MESSAGE(untouched(dinp_raw, 0, first, C), "backward-input wrote rows before offsets[0]");
  CHECK_MESSAGE(untouched(dinp_raw, last, S, C), "backward-input wrote rows after offsets[E]");

  // Weight gradients: trained experts with rows against prior + Σ; the rest bit for bit.
  std::vector<float> dw_g_trained, dw_r_trained;
  for (int64_t e = 0; e < E; ++e) {
    const size_t from = size_t(e * OC * C), to = size_t((e + 1) * OC * C);
    if (!is_trained[e]) {
      CHECK_MESSAGE(all_bits(dw_g, from, to, kSentinelBits), "frozen expert " << e << ": dW changed");
    } else if (k.counts[e] == 0) {
      CHECK_MESSAGE(std::memcmp(dw_g.data() + from, dw_prior.data() + from, (to - from) * sizeof(float)) == 0,
                    "trained expert " << e << " with no rows: dW changed");
    } else {
      dw_g_trained.insert(dw_g_trained.end(), dw_g.begin() + from, dw_g.begin() + to);
      dw_r_trained.insert(dw_r_trained.end(), dw_ref.begin() + from, dw_ref.begin() + to);
    }
  }
  if (!dw_r_trained.empty()) {
    const std::string n_dw = "backward dW += " + tag;
    CHECK_REL(n_dw, dw_g_trained.data(), dw_r_trained.data(), int64_t(dw_r_trained.size()),
              kTolF32);
    print_worst("backward dW", dw_g_trained, dw_r_trained, C);
  }

  // Determinism: the same inputs (dW reset to the same prior) give the same bits.
  run();
  CHECK_MESSAGE(bitwise_equal(download(d_out.get(), S * OC), out_g), "forward not deterministic");
  CHECK_MESSAGE(bitwise_equal(download(d_dinp.get(), S * C), dinp_g), "backward-input not deterministic");
  CHECK_MESSAGE(bitwise_equal(download(d_dw.get(), E * OC * C), dw_g), "weight gradient not deterministic");
}

}  // namespace

// Every case runs on each kernel family the device has (device_families). Tiles are
// 128 rows × 128 columns × 32 of the reduction on the portable path, 128 × 256 × 64 on
// the sm90a one, 128 × 128 × 64 in its TMA weight gradient. The cases cover: empty
// experts, a 1-row expert, row counts of 7, 129 (a tile + 1) and 257, all rows in one
// expert, E = 1, E = 16 with random counts, E = 256, rows outside every expert; C and
// OC that are multiples of 128 and that are not (as an output width: 64, 72, 96, 136,
// 200; as a reduction: 136 = 4·32 + 8, 200 = 6·32 + 8, 72 = 2·32 + 8), a long
// reduction (512: either pipeline wraps its 4 stages), frozen experts and trained experts
// with no rows.
GPU_TEST_CASE("cuda grouped matmul: forward, backward-input and weight gradient vs cpu, per expert") {
  const std::vector<Case> cases = {
      {{0, 1, 7, 129}, 64, 136, {}, "empty, 1-row, 7-row and tile+1 experts; OC tail"},
      {{130}, 256, 128, {}, "E = 1; C and OC multiples of the tile"},
      {{0, 0, 257, 0, 0, 0, 0, 0}, 200, 64, {2, 5}, "all rows in one expert; C tail"},
      {{5, 0, 140}, 64, 64, {0, 2}, "rows outside every expert, NaN right behind a trained one", 3, 4},
      {{33, 100}, 512, 256, {1}, "long reduction"},
  };
  // E = 16, routed at random, some experts empty; a few trained, one of them empty.
  std::vector<int32_t> counts(16);
  std::uniform_int_distribution<int32_t> d(0, 40);
  for (auto& c : counts) c = d(rng());
  counts[3] = counts[9] = 0;

  // E = 256, the most the launchers take: the row-tile scan spans all 8 warps of the
  // CTA (E ≤ 32 stays within warp 0). Mostly empty experts, a few of every size class.
  std::vector<int32_t> many(256, 0);
  std::uniform_int_distribution<int32_t> pick(0, 255), rows(1, 3);
  for (int i = 0; i < 60; ++i) many[pick(rng())] = rows(rng());
  many[37] = 130;   // two row tiles, in warp 1
  many[255] = 1;    // the last expert, the last thread
  std::vector<int32_t> some;
  for (int32_t e = 5; e < 256; e += 25) some.push_back(e);  // 5, 30, …, 255
  some.push_back(37);
  for (const Family& family : device_families()) {
    for (const Case& k : cases) check_case(k, family);
    check_case({counts, 72, 96, {0, 3, 4, 8, 15}, "E = 16, random routing"}, family);
    check_case({many, 64, 64, some, "E = 256"}, family);
  }
}

// The grouped GEMMs with SwiGLU in their store against the two calls each replaces on
// the same path, on the experts' rows: the gate|up forward (grouped_matmul_forward_swiglu)
// against grouped_matmul_forward then swiglu_forward; the down backward-input
// (grouped_matmul_backward_input_swiglu) against grouped_matmul_backward_input into a
// dh buffer then swiglu_backward. Every output bit for bit (both round to bf16 where
// the two calls store, and share the element math, cuda/swiglu_math.cuh), rows outside
// every expert untouched. Each of the calls is checked against the CPU elsewhere
// (above; test_cuda_swiglu.cu).
namespace {

struct SwigluCase {
  std::vector<int32_t> counts;
  int64_t H, OC;
  const char* what;
  int32_t lead = 0, trail = 0;
};

bool bf16_poisoned(const std::vector<bf16>& raw, int64_t from, int64_t to) {
  for (int64_t i = from; i < to; ++i) {
    uint16_t b;
    std::memcpy(&b, &raw[size_t(i)], sizeof b);
    if (b != 0xFFFF) return false;
  }
  return true;
}

bool bf16_bits_equal(const std::vector<bf16>& a, const std::vector<bf16>& b, int64_t from, int64_t to) {
  return std::memcmp(a.data() + from, b.data() + from, size_t(to - from) * sizeof(bf16)) == 0;
}

// The case's expert row offsets (E + 1 of them, the first at its lead).
std::vector<int32_t> case_offsets(const SwigluCase& k) {
  std::vector<int32_t> offsets(k.counts.size() + 1);
  offsets[0] = k.lead;
  for (size_t e = 0; e < k.counts.size(); ++e) offsets[e + 1] = offsets[e] + k.counts[e];
  return offsets;
}

// Not vacuous: an output's elements [from, to) are finite and not all zero (when any).
void check_finite_nonzero(const std::vector<float>& v, int64_t from, int64_t to, const char* name) {
  bool finite = true, nonzero = false;
  for (int64_t i = from; i < to; ++i) {
    finite = finite && std::isfinite(v[size_t(i)]);
    nonzero = nonzero || v[size_t(i)] != 0.0f;
  }
  CHECK_MESSAGE(finite, name << " holds a non-finite value in an expert's rows");
  CHECK_MESSAGE((to == from || nonzero), name << " is all zero");
}

// The forward: C = OC of the case (the input width), H its H; W_e is [2H, C].
void check_swiglu_forward_case(const SwigluCase& k, const Family& family) {
  const spes::cuda::GroupedGemmPath path = family.path;
  const int64_t E = int64_t(k.counts.size()), H = k.H, C = k.OC;
  const std::vector<int32_t> offsets = case_offsets(k);
  const int64_t first = offsets[0], last = offsets[E], S = last + k.trail;
  INFO(family.name << ", forward, " << k.what << ": S=" << S << " E=" << E << " C=" << C << " H=" << H);

  std::vector<float> inp = rounded_bf16(random_vector(S * C));
  for (int64_t s = 0; s < S; ++s)
    if (s < first || s >= last) std::fill(inp.begin() + s * C, inp.begin() + (s + 1) * C, NAN);
  const std::vector<float> w = rounded_bf16(random_vector(E * 2 * H * C, 2.0f / std::sqrt(float(C))));
  auto d_inp = upload_bf16(inp), d_w = upload_bf16(w);
  auto d_offsets = upload(offsets);
  std::vector<const bf16*> w_table(E);
  for (int64_t e = 0; e < E; ++e) w_table[e] = d_w.get() + e * 2 * H * C;
  DevTensor<const bf16*> d_w_table(E);
  copy_to_device(d_w_table.get(), w_table.data(), E);

  DevTensor<bf16> d_gu_ref(S * 2 * H), d_h_ref(S * H), d_gu(S * 2 * H), d_h(S * H);
  for (auto* t : {&d_gu_ref, &d_h_ref, &d_gu, &d_h}) t->poison();
  spes::cuda::grouped_matmul_forward(d_gu_ref, d_inp, d_w_table, d_offsets, S, E, C, 2 * H, stream(), path);
  const bf16* gu_rows = d_gu_ref.get() + first * 2 * H;
  spes::cuda::swiglu_forward(d_h_ref.get() + first * H, gu_rows, gu_rows + H, last - first, H, 2 * H, stream());
  spes::cuda::grouped_matmul_forward_swiglu(d_gu, d_h, d_inp, d_w_table, d_offsets, S, E, C, H, stream(), path);

  const std::vector<bf16> gu = copy_to_host(d_gu.get(), S * 2 * H), gu_ref = copy_to_host(d_gu_ref.get(), S * 2 * H);
  const std::vector<bf16> h = copy_to_host(d_h.get(), S * H), h_ref = copy_to_host(d_h_ref.get(), S * H);
  CHECK_MESSAGE(bf16_bits_equal(gu, gu_ref, first * 2 * H, last * 2 * H),
                "gate|up differs from grouped_matmul_forward");
  CHECK_MESSAGE(bf16_bits_equal(h, h_ref, first * H, last * H), "h differs from forward + swiglu_forward");
  CHECK_MESSAGE((bf16_poisoned(gu, 0, first * 2 * H) && bf16_poisoned(gu, last * 2 * H, S * 2 * H)),
                "gate|up written in rows outside every expert");
  CHECK_MESSAGE((bf16_poisoned(h, 0, first * H) && bf16_poisoned(h, last * H, S * H)),
                "h written in rows outside every expert");
  check_finite_nonzero(download(d_h.get(), S * H), first * H, last * H, "h");
}

// The backward-input: W_e is [OC, H].
void check_swiglu_backward_case(const SwigluCase& k, const Family& family) {
  const spes::cuda::GroupedGemmPath path = family.path;
  const int64_t E = int64_t(k.counts.size()), H = k.H, OC = k.OC;
  const std::vector<int32_t> offsets = case_offsets(k);
  const int64_t first = offsets[0], last = offsets[E], S = last + k.trail;
  INFO(family.name << ", " << k.what << ": S=" << S << " E=" << E << " H=" << H << " OC=" << OC);

  // Rows outside every expert are NaN in the inputs: the fused product may not read them.
  std::vector<float> dout = rounded_bf16(random_vector(S * OC)), gate_up = rounded_bf16(random_vector(S * 2 * H, 3.0f));
  for (int64_t s = 0; s < S; ++s)
    if (s < first || s >= last) {
      std::fill(dout.begin() + s * OC, dout.begin() + (s + 1) * OC, NAN);
      std::fill(gate_up.begin() + s * 2 * H, gate_up.begin() + (s + 1) * 2 * H, NAN);
    }
  const std::vector<float> w = rounded_bf16(random_vector(E * OC * H, 1.0f / std::sqrt(float(OC))));
  auto d_dout = upload_bf16(dout), d_gate_up = upload_bf16(gate_up), d_w = upload_bf16(w);
  auto d_offsets = upload(offsets);
  std::vector<const bf16*> w_table(E);
  for (int64_t e = 0; e < E; ++e) w_table[e] = d_w.get() + e * OC * H;
  DevTensor<const bf16*> d_w_table(E);
  copy_to_device(d_w_table.get(), w_table.data(), E);

  // The two calls the fused one replaces.
  DevTensor<bf16> d_dh(S * H), d_h_ref(S * H), d_dgu_ref(S * 2 * H);
  d_dh.poison();
  d_h_ref.poison();
  d_dgu_ref.poison();
  spes::cuda::grouped_matmul_backward_input(d_dh, d_dout, d_w_table, d_offsets, S, E, H, OC, stream(), path);
  bf16* dgu_rows = d_dgu_ref.get() + first * 2 * H;
  const bf16* gu_rows = d_gate_up.get() + first * 2 * H;
  spes::cuda::swiglu_backward(dgu_rows, dgu_rows + H, d_h_ref.get() + first * H, d_dh.get() + first * H, gu_rows,
                              gu_rows + H, last - first, H, 2 * H, stream());

  DevTensor<bf16> d_h(S * H), d_dgu(S * 2 * H);
  d_h.poison();
  d_dgu.poison();
  spes::cuda::grouped_matmul_backward_input_swiglu(d_dgu, d_h, d_dout, d_w_table, d_gate_up, d_offsets, S, E, H, OC,
                                                   stream(), path);
  const std::vector<bf16> h = copy_to_host(d_h.get(), S * H), h_ref = copy_to_host(d_h_ref.get(), S * H);
  const std::vector<bf16> dgu = copy_to_host(d_dgu.get(), S * 2 * H);
  const std::vector<bf16> dgu_ref = copy_to_host(d_dgu_ref.get(), S * 2 * H);
  CHECK_MESSAGE(bf16_bits_equal(h, h_ref, first * H, last * H), "h differs from backward-input + swiglu_backward");
  CHECK_MESSAGE(bf16_bits_equal(dgu, dgu_ref, first * 2 * H, last * 2 * H),
                "dgate|dup differ from backward-input + swiglu_backward");
  CHECK_MESSAGE((bf16_poisoned(h, 0, first * H) && bf16_poisoned(h, last * H, S * H)),
                "h written in rows outside every expert");
  CHECK_MESSAGE((bf16_poisoned(dgu, 0, first * 2 * H) && bf16_poisoned(dgu, last * 2 * H, S * 2 * H)),
                "dgate_up written in rows outside every expert");
  check_finite_nonzero(download(d_dgu.get(), S * 2 * H), first * 2 * H, last * 2 * H, "dgate_up");
}

}  // namespace

// Tiles: 128 × 128 (portable), 128 × 256 (sm90a); the forward's paired tiles 64 + 64
// and 128 + 128 columns of gate and up. H = 136 and 264 leave a tail column tile on
// each, 520 gives the sm90a backward three column tiles (the forward five); rows
// outside every expert on both sides; E = 16 routed at random with empty experts.
GPU_TEST_CASE("cuda grouped matmul: SwiGLU fused into the gate|up forward and the down backward-input") {
  std::vector<int32_t> counts(16);
  std::uniform_int_distribution<int32_t> d(0, 40);
  for (auto& c : counts) c = d(rng());
  counts[3] = counts[9] = 0;
  for (const Family& family : device_families()) {
    if (family.wgrad != spes::cuda::grouped_sm90::WgradKernel::threads) continue;  // no weight gradient here
    check_swiglu_backward_case({{0, 1, 7, 129}, 136, 64, "empty, 1-row, 7-row and tile+1 experts; H tail", 3, 5}, family);
    check_swiglu_backward_case({{130, 40}, 520, 200, "three sm90a column tiles; OC tail"}, family);
    check_swiglu_backward_case({counts, 264, 72, "E = 16, random routing", 2, 0}, family);
    check_swiglu_forward_case({{0, 1, 7, 129}, 136, 64, "empty, 1-row, 7-row and tile+1 experts; H tail", 3, 5}, family);
    check_swiglu_forward_case({{130, 40}, 520, 200, "five sm90a column tiles; C tail"}, family);
    check_swiglu_forward_case({counts, 264, 72, "E = 16, random routing", 2, 0}, family);
    check_swiglu_forward_case({{60, 3}, 72, 136, "C = 136: the portable main loop ends in stage 0"}, family);
  }
}

// The two kernel families (GroupedGemmPath) on the same inputs: where the device runs
// the sm90a one, every product on both paths must agree within the tolerances above
// (bf16 outputs 1e-2, fp32 weight gradients 1e-4: only the summation order differs),
// the sm90a path must give the same bits twice, and again with its L2 prefetch off or
// further ahead, and leave rows outside every expert and frozen experts' dW untouched.
// The cases above check each path against the CPU on small shapes; these are larger:
// the spes-1b expert widths (C = 768, OC = 4096 and back), reductions long enough to
// wrap the 4-stage pipeline many times (weight gradients over hundreds of rows,
// backward-input over OC = 4096), more tiles than SMs (the persistent grid walking
// several tiles per CTA), tails in every dimension, E = 256. The host emulator
// (tests/emu/, whose device name says "emulated") runs the last two only: the spes-1b
// widths take it minutes.
namespace {

struct PathCase {
  std::vector<int32_t> counts;
  int64_t C, OC;
  std::vector<int32_t> trained;  // empty: all
  const char* what;
  int32_t lead = 0, trail = 0;
};

// Whether the device is the host emulator (tests/emu/: its name says "emulated").
bool emulated_device() {
  cudaDeviceProp prop{};
  cuda_check(cudaGetDeviceProperties(&prop, runtime().info().ordinal));
  return std::string(prop.name).find("emulated") != std::string::npos;
}

void compare_paths(const PathCase& k) {
  using spes::cuda::GroupedGemmPath;
  const int64_t E = int64_t(k.counts.size()), C = k.C, OC = k.OC;
  std::vector<int32_t> offsets(E + 1);
  offsets[0] = k.lead;
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + k.counts[e];
  const int64_t first = offsets[0], last = offsets[E], S = last + k.trail;
  std::vector<int32_t> trained = k.trained;
  if (trained.empty())
    for (int32_t e = 0; e < E; ++e) trained.push_back(e);
  std::vector<bool> is_trained(E, false);
  for (int32_t e : trained) is_trained[e] = true;
  const std::string tag = std::string(k.what) + ": S=" + std::to_string(S) + " E=" + std::to_string(E) +
                          " C=" + std::to_string(C) + " OC=" + std::to_string(OC);
  INFO(tag);

  std::vector<float> inp = rounded_bf16(random_vector(S * C)), dout = rounded_bf16(random_vector(S * OC));
  for (int64_t s = 0; s < S; ++s)
    if (s < first || s >= last) {
      std::fill(inp.begin() + s * C, inp.begin() + (s + 1) * C, NAN);
      std::fill(dout.begin() + s * OC, dout.begin() + (s + 1) * OC, NAN);
    }
  const std::vector<float> w = rounded_bf16(random_vector(E * OC * C, 1.0f / std::sqrt(float(C))));
  // dW starts at 0 (trained) or a NaN sentinel (frozen): the comparison sees Σ alone.
  std::vector<float> dw_prior(E * OC * C, 0.0f);
  for (int64_t e = 0; e < E; ++e)
    if (!is_trained[e])
      std::fill(dw_prior.begin() + e * OC * C, dw_prior.begin() + (e + 1) * OC * C, from_bits(kSentinelBits));

  auto d_inp = upload_bf16(inp), d_dout = upload_bf16(dout), d_w = upload_bf16(w);
  auto d_offsets = upload(offsets), d_trained = upload(trained);
  std::vector<const bf16*> w_table(E);
  std::vector<float*> dw_table(E);
  DevTensor<float> d_dw(E * OC * C);
  for (int64_t e = 0; e < E; ++e) {
    w_table[e] = d_w.get() + e * OC * C;
    dw_table[e] = d_dw.get() + e * OC * C;
  }
  DevTensor<const bf16*> d_w_table(E);
  DevTensor<float*> d_dw_table(E);
  copy_to_device(d_w_table.get(), w_table.data(), E);
  copy_to_device(d_dw_table.get(), dw_table.data(), E);
  DevTensor<bf16> d_out(S * OC), d_dinp(S * C);

  struct Outputs {
    std::vector<float> out, dinp, dw;
    std::vector<bf16> out_raw, dinp_raw;
  };
  auto run = [&](GroupedGemmPath path) {
    d_out.poison();
    d_dinp.poison();
    copy_to_device(d_dw.get(), dw_prior.data(), E * OC * C);
    spes::cuda::grouped_matmul_forward(d_out, d_inp, d_w_table, d_offsets, S, E, C, OC, stream(), path);
    spes::cuda::grouped_matmul_backward_input(d_dinp, d_dout, d_w_table, d_offsets, S, E, C, OC, stream(), path);
    spes::cuda::grouped_matmul_backward_weight(d_dw_table, d_dout, d_inp, d_offsets, d_trained,
                                               int64_t(trained.size()), S, E, C, OC, stream(), path);
    return Outputs{download(d_out.get(), S * OC), download(d_dinp.get(), S * C), download(d_dw.get(), E * OC * C),
                   copy_to_host(d_out.get(), S * OC), copy_to_host(d_dinp.get(), S * C)};
  };
  const Outputs portable = run(GroupedGemmPath::portable), sm90a = run(GroupedGemmPath::sm90a);

  const auto rows = [](const std::vector<float>& v, int64_t from, int64_t to, int64_t cols) {
    return std::vector<float>(v.begin() + from * cols, v.begin() + to * cols);
  };
  const auto poisoned = [](const std::vector<bf16>& raw, int64_t from, int64_t to, int64_t cols) {
    for (int64_t i = from * cols; i < to * cols; ++i) {
      uint16_t b;
      std::memcpy(&b, &raw[i], sizeof b);
      if (b != 0xFFFF) return false;
    }
    return true;
  };
  if (last > first) {
    const auto o_s = rows(sm90a.out, first, last, OC), o_p = rows(portable.out, first, last, OC);
    const std::string n_out = "forward out sm90a vs portable " + tag;
    CHECK_REL(n_out, o_s.data(), o_p.data(), int64_t(o_p.size()), kTolBf16);
    print_worst("forward out sm90a vs portable", o_s, o_p, OC);
    const auto i_s = rows(sm90a.dinp, first, last, C), i_p = rows(portable.dinp, first, last, C);
    const std::string n_dinp = "backward dinp sm90a vs portable " + tag;
    CHECK_REL(n_dinp, i_s.data(), i_p.data(), int64_t(i_p.size()), kTolBf16);
    print_worst("backward dinp sm90a vs portable", i_s, i_p, C);
  }
  CHECK_MESSAGE((poisoned(sm90a.out_raw, 0, first, OC) && poisoned(sm90a.out_raw, last, S, OC)),
                "sm90a forward wrote rows outside every expert");
  CHECK_MESSAGE((poisoned(sm90a.dinp_raw, 0, first, C) && poisoned(sm90a.dinp_raw, last, S, C)),
                "sm90a backward-input wrote rows outside every expert");

  std::vector<float> dw_s, dw_p;
  for (int64_t e = 0; e < E; ++e) {
    const size_t from = size_t(e * OC * C), to = size_t((e + 1) * OC * C);
    if (!is_trained[e]) {
      CHECK_MESSAGE(all_bits(sm90a.dw, from, to, kSentinelBits), "sm90a: frozen expert " << e << ": dW changed");
    } else {
      dw_s.insert(dw_s.end(), sm90a.dw.begin() + from, sm90a.dw.begin() + to);
      dw_p.insert(dw_p.end(), portable.dw.begin() + from, portable.dw.begin() + to);
    }
  }
  if (!dw_p.empty()) {
    const std::string n_dw = "backward dW sm90a vs portable " + tag;
    CHECK_REL(n_dw, dw_s.data(), dw_p.data(), int64_t(dw_p.size()), kTolF32);
    print_worst("backward dW sm90a vs portable", dw_s, dw_p, C);
  }

  const Outputs again = run(GroupedGemmPath::sm90a);
  CHECK_MESSAGE(bitwise_equal(again.out, sm90a.out), "sm90a forward not deterministic");
  CHECK_MESSAGE(bitwise_equal(again.dinp, sm90a.dinp), "sm90a backward-input not deterministic");
  CHECK_MESSAGE(bitwise_equal(again.dw, sm90a.dw), "sm90a weight gradient not deterministic");

  // The L2 requests ahead of the copies move no data: off, or further ahead than
  // most of these reductions are long, the bits stay those of the default.
  const int chosen = spes::cuda::grouped_sm90::l2_prefetch_k_steps();
  for (const int ahead : {0, 9}) {
    spes::cuda::grouped_sm90::set_l2_prefetch_k_steps(ahead);
    const Outputs o = run(GroupedGemmPath::sm90a);
    CHECK_MESSAGE(bitwise_equal(o.out, sm90a.out), "sm90a forward changed with L2 prefetch " << ahead);
    CHECK_MESSAGE(bitwise_equal(o.dinp, sm90a.dinp), "sm90a backward-input changed with L2 prefetch " << ahead);
    CHECK_MESSAGE(bitwise_equal(o.dw, sm90a.dw), "sm90a weight gradient changed with L2 prefetch " << ahead);
  }
  spes::cuda::grouped_sm90::set_l2_prefetch_k_steps(chosen);

  // The TMA weight gradient against the threads' one: the same k-steps of 64 rows in
  // the same order, so the same sums up to the tensor cores' adder (the emulator's
  // give the same bits); frozen experts untouched, the same bits twice.
  const std::string tma_why_not = spes::cuda::grouped_sm90::wgrad_tma_unavailable_reason();
  if (!tma_why_not.empty()) {
    MESSAGE("the TMA weight gradient cannot run here: " << tma_why_not);
    return;
  }
  const spes::cuda::grouped_sm90::ScopedWgradKernel wgrad(spes::cuda::grouped_sm90::WgradKernel::tma);
  const Outputs tma = run(GroupedGemmPath::sm90a);
  std::vector<float> dw_t;
  for (int64_t e = 0; e < E; ++e) {
    const size_t from = size_t(e * OC * C), to = size_t((e + 1) * OC * C);
    if (!is_trained[e])
      CHECK_MESSAGE(all_bits(tma.dw, from, to, kSentinelBits), "TMA: frozen expert " << e << ": dW changed");
    else
      dw_t.insert(dw_t.end(), tma.dw.begin() + from, tma.dw.begin() + to);
  }
  if (!dw_s.empty()) {
    const std::string n_dw = "backward dW TMA vs threads " + tag;
    CHECK_REL(n_dw, dw_t.data(), dw_s.data(), int64_t(dw_s.size()), kTolF32);
    print_worst("backward dW TMA vs threads", dw_t, dw_s, C);
    const bool same = bitwise_equal(dw_t, dw_s);
    MESSAGE("TMA weight gradient: " << std::string(same ? "the same bits as" : "other bits than")
                                    << " the threads' kernel");
    if (emulated_device()) CHECK_MESSAGE(same, "the emulator's two kernels sum alike: the bits must be the same");
  }
  CHECK_MESSAGE(bitwise_equal(run(GroupedGemmPath::sm90a).dw, tma.dw), "TMA weight gradient not deterministic");
}

}  // namespace

GPU_TEST_CASE("cuda grouped matmul: the sm90a path against the portable one, same inputs") {
  if (!spes::cuda::grouped_gemm_sm90a_available()) {
    MESSAGE("SKIPPED: no sm90a path here: " << spes::cuda::grouped_gemm_sm90a_unavailable_reason());
    return;
  }
  // Routed at random like a trained router's skewed load, some experts empty.
  auto routing = [](int n, int32_t max_rows) {
    std::vector<int32_t> counts(n);
    std::uniform_int_distribution<int32_t> d(0, max_rows);
    for (auto& c : counts) c = d(rng());
    counts[1] = 0;
    return counts;
  };
  if (!emulated_device()) {
    compare_paths({routing(8, 700), 768, 4096, {}, "gate|up widths, E = 8"});
    compare_paths({routing(8, 700), 2048, 768, {0, 2, 3, 5, 7}, "down widths, E = 8, some frozen"});
  }
  compare_paths({{1, 0, 7, 129, 300, 700}, 200, 136, {}, "tails: 1-, 7-, 129-row experts, C = 200, OC = 136", 5, 3});
  std::vector<int32_t> many(256, 0);
  std::uniform_int_distribution<int32_t> pick(0, 255), rows(1, 12);
  for (int i = 0; i < 80; ++i) many[pick(rng())] = rows(rng());
  many[255] = 1;
  compare_paths({many, 264, 520, {}, "E = 256"});
}

// Argument checks run on the host before any CUDA call, so this case needs no GPU: the
// fake device addresses below are never dereferenced, and every call has exactly one
// bad argument (a call with none would launch on them).
namespace {
template <class T>
T* fake(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}
}  // namespace

TEST_CASE("cuda grouped matmul: bad sizes and pointers throw before any CUDA call") {
  using spes::cuda::grouped_matmul_backward_input;
  using spes::cuda::grouped_matmul_backward_weight;
  using spes::cuda::grouped_matmul_forward;
  bf16* a = fake<bf16>(0x100000);   // 16-byte aligned
  bf16* b = fake<bf16>(0x200000);
  bf16* m = fake<bf16>(0x100002);   // 2-byte aligned only
  const bf16* const* wt = fake<const bf16* const>(0x300000);
  float* const* dwt = fake<float* const>(0x300000);
  int32_t* off = fake<int32_t>(0x400000);
  int32_t* tr = fake<int32_t>(0x500000);
  const int64_t S = 100, E = 4, C = 64, OC = 128;

  for (const char* op : {"grouped_matmul_forward", "grouped_matmul_backward_input"}) {
    const bool fwd = std::string(op) == "grouped_matmul_forward";
    INFO(op);
    auto call = [&](bf16* o, bf16* i, const bf16* const* w, const int32_t* of, int64_t s, int64_t e, int64_t c,
                    int64_t oc) {
      if (fwd)
        grouped_matmul_forward(o, i, w, of, s, e, c, oc, nullptr);
      else
        grouped_matmul_backward_input(o, i, w, of, s, e, c, oc, nullptr);
    };
    const std::string pre = std::string(op) + ": ";
    CHECK_THROWS_ERROR(call(a, b, wt, off, S, E, 12, OC), (pre + "C must be a positive multiple of 8").c_str());
    CHECK_THROWS_ERROR(call(a, b, wt, off, S, E, 0, OC), (pre + "C must be a positive multiple of 8").c_str());
    CHECK_THROWS_ERROR(call(a, b, wt, off, S, E, C, 100), (pre + "OC must be a positive multiple of 8").c_str());
    CHECK_THROWS_ERROR(call(a, b, wt, off, -1, E, C, OC), (pre + "S must be in [0, INT32_MAX]").c_str());
    CHECK_THROWS_ERROR(call(a, b, wt, off, int64_t(INT32_MAX) + 1, E, C, OC), (pre + "S must be in [0, INT32_MAX]").c_str());
    CHECK_THROWS_ERROR(call(a, b, wt, off, S, 0, C, OC), (pre + "E must be in [1, 256]").c_str());
    CHECK_THROWS_ERROR(call(a, b, wt, off, S, 257, C, OC), (pre + "E must be in [1, 256]").c_str());
    CHECK_THROWS_ERROR(call(a, b, wt, off, INT32_MAX, 256, 16384, 16384), (pre + "too many tiles for one launch").c_str());
    const char* o_name = fwd ? "out" : "dinp";
    const char* i_name = fwd ? "inp" : "dout";
    CHECK_THROWS_ERROR(call(nullptr, b, wt, off, S, E, C, OC), (pre + o_name + " must not be null").c_str());
    CHECK_THROWS_ERROR(call(m, b, wt, off, S, E, C, OC), (pre + o_name + " must be 16-byte aligned").c_str());
    CHECK_THROWS_ERROR(call(a, nullptr, wt, off, S, E, C, OC), (pre + i_name + " must not be null").c_str());
    CHECK_THROWS_ERROR(call(a, m, wt, off, S, E, C, OC), (pre + i_name + " must be 16-byte aligned").c_str());
    CHECK_THROWS_ERROR(call(a, b, nullptr, off, S, E, C, OC), (pre + "weights must not be null").c_str());
    CHECK_THROWS_ERROR(call(a, b, fake<const bf16* const>(0x300004), off, S, E, C, OC),
                       (pre + "weights must be 8-byte aligned").c_str());
    CHECK_THROWS_ERROR(call(a, b, wt, nullptr, S, E, C, OC), (pre + "offsets must not be null").c_str());
    CHECK_THROWS_ERROR(call(a, b, wt, fake<int32_t>(0x400002), S, E, C, OC), (pre + "offsets must be 4-byte aligned").c_str());
    CHECK_THROWS_ERROR(call(a, a + 8, wt, off, S, E, C, OC), (pre + o_name + " must not overlap " + i_name).c_str());
  }

  {
    const std::string pre = "grouped_matmul_forward_swiglu: ";
    bf16* g = fake<bf16>(0x700000);
    auto fs = [&](bf16* gu, bf16* h, bf16* inp, int64_t H) {
      spes::cuda::grouped_matmul_forward_swiglu(gu, h, inp, wt, off, S, E, C, H, nullptr);
    };
    CHECK_THROWS_ERROR(fs(a, b, g, 12), (pre + "H must be a positive multiple of 8").c_str());
    CHECK_THROWS_ERROR(fs(a, b, g, 0), (pre + "H must be a positive multiple of 8").c_str());
    CHECK_THROWS_ERROR(fs(nullptr, b, g, C), (pre + "gate_up must not be null").c_str());
    CHECK_THROWS_ERROR(fs(a, m, g, C), (pre + "h must be 16-byte aligned").c_str());
    CHECK_THROWS_ERROR(fs(a, b, nullptr, C), (pre + "inp must not be null").c_str());
    CHECK_THROWS_ERROR(fs(a, b, a + 8, C), (pre + "gate_up must not overlap inp").c_str());
    CHECK_THROWS_ERROR(fs(a, g + 8, g, C), (pre + "h must not overlap inp").c_str());
    CHECK_THROWS_ERROR(fs(a, a + 8, g, C), (pre + "h must not overlap gate_up").c_str());
  }
  {
    const std::string pre = "grouped_matmul_backward_input_swiglu: ";
    bf16* c = fake<bf16>(0x600000);
    bf16* g = fake<bf16>(0x700000);
    auto sw = [&](bf16* dgu, bf16* h, bf16* dout, const bf16* gu, int64_t s, int64_t H) {
      spes::cuda::grouped_matmul_backward_input_swiglu(dgu, h, dout, wt, gu, off, s, E, H, OC, nullptr);
    };
    CHECK_THROWS_ERROR(sw(a, b, c, g, S, 12), (pre + "H must be a positive multiple of 8").c_str());
    CHECK_THROWS_ERROR(sw(nullptr, b, c, g, S, C), (pre + "dgate_up must not be null").c_str());
    CHECK_THROWS_ERROR(sw(m, b, c, g, S, C), (pre + "dgate_up must be 16-byte aligned").c_str());
    CHECK_THROWS_ERROR(sw(a, m, c, g, S, C), (pre + "h must be 16-byte aligned").c_str());
    CHECK_THROWS_ERROR(sw(a, b, m, g, S, C), (pre + "dout must be 16-byte aligned").c_str());
    CHECK_THROWS_ERROR(sw(a, b, c, nullptr, S, C), (pre + "gate_up must not be null").c_str());
    CHECK_THROWS_ERROR(sw(a, b, c, fake<bf16>(0x700008), S, C), (pre + "gate_up must be 16-byte aligned").c_str());
    CHECK_THROWS_ERROR(sw(a, c + 8, c, g, S, C), (pre + "h must not overlap dout").c_str());
    CHECK_THROWS_ERROR(sw(a, g + 8, c, g, S, C), (pre + "h must not overlap gate_up").c_str());
    CHECK_THROWS_ERROR(sw(a, a + 8, c, g, S, C), (pre + "h must not overlap dgate_up").c_str());
    CHECK_THROWS_ERROR(sw(c + 8, b, c, g, S, C), (pre + "dgate_up must not overlap dout").c_str());
    CHECK_THROWS_ERROR(sw(g + 8, b, c, g, S, C), (pre + "dgate_up must not overlap gate_up").c_str());
  }

  const std::string pre = "grouped_matmul_backward_weight: ";
  auto wg = [&](float* const* dw, bf16* dout, bf16* inp, const int32_t* of, const int32_t* t, int64_t n,
                int64_t s, int64_t e, int64_t c, int64_t oc) {
    grouped_matmul_backward_weight(dw, dout, inp, of, t, n, s, e, c, oc, nullptr);
  };
  CHECK_THROWS_ERROR(wg(dwt, a, b, off, tr, 2, S, E, 12, OC), (pre + "C must be a positive multiple of 8").c_str());
  CHECK_THROWS_ERROR(wg(dwt, a, b, off, tr, 2, S, E, C, 4), (pre + "OC must be a positive multiple of 8").c_str());
  CHECK_THROWS_ERROR(wg(dwt, a, b, off, tr, 2, -5, E, C, OC), (pre + "S must be in [0, INT32_MAX]").c_str());
  CHECK_THROWS_ERROR(wg(dwt, a, b, off, tr, 2, S, 300, C, OC), (pre + "E must be in [1, 256]").c_str());
  CHECK_THROWS_ERROR(wg(dwt, a, b, off, tr, -1, S, E, C, OC), (pre + "n_trained must be in [0, E]").c_str());
  CHECK_THROWS_ERROR(wg(dwt, a, b, off, tr, 5, S, E, C, OC), (pre + "n_trained must be in [0, E]").c_str());
  CHECK_THROWS_ERROR(wg(nullptr, a, b, off, tr, 2, S, E, C, OC), (pre + "dweights must not be null").c_str());
  CHECK_THROWS_ERROR(wg(fake<float* const>(0x300004), a, b, off, tr, 2, S, E, C, OC),
                     (pre + "dweights must be 8-byte aligned").c_str());
  CHECK_THROWS_ERROR(wg(dwt, nullptr, b, off, tr, 2, S, E, C, OC), (pre + "dout must not be null").c_str());
  CHECK_THROWS_ERROR(wg(dwt, m, b, off, tr, 2, S, E, C, OC), (pre + "dout must be 16-byte aligned").c_str());
  CHECK_THROWS_ERROR(wg(dwt, a, nullptr, off, tr, 2, S, E, C, OC), (pre + "inp must not be null").c_str());
  CHECK_THROWS_ERROR(wg(dwt, a, m, off, tr, 2, S, E, C, OC), (pre + "inp must be 16-byte aligned").c_str());
  CHECK_THROWS_ERROR(wg(dwt, a, b, nullptr, tr, 2, S, E, C, OC), (pre + "offsets must not be null").c_str());
  CHECK_THROWS_ERROR(wg(dwt, a, b, fake<int32_t>(0x400001), tr, 2, S, E, C, OC), (pre + "offsets must be 4-byte aligned").c_str());
  CHECK_THROWS_ERROR(wg(dwt, a, b, off, nullptr, 2, S, E, C, OC), (pre + "trained_experts must not be null").c_str());
  CHECK_THROWS_ERROR(wg(dwt, a, b, off, fake<int32_t>(0x500002), 2, S, E, C, OC),
                     (pre + "trained_experts must be 4-byte aligned").c_str());
  CHECK_THROWS_ERROR(wg(dwt, a, b, off, tr, 256, S, 256, 16384, int64_t(1) << 23),
                     (pre + "too many tiles for one launch").c_str());
  const int chosen = spes::cuda::grouped_sm90::l2_prefetch_k_steps();
  for (const int bad : {-1, spes::cuda::grouped_sm90::kMaxL2PrefetchKSteps + 1})
    CHECK_THROWS_ERROR(
        spes::cuda::grouped_sm90::set_l2_prefetch_k_steps(bad),
        ("grouped_sm90::set_l2_prefetch_k_steps: k_steps must be in [0, 64], got " + std::to_string(bad)).c_str());
  CHECK(spes::cuda::grouped_sm90::l2_prefetch_k_steps() == chosen);
}
