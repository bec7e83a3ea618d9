// SPES_ATTENTION, the environment override of the attention launchers' automatic
// choice of kernel family (cuda/attention.cu), on the emulator, whose H100 runs the
// sm90a family: unset (or empty), automatic runs the sm90a kernels (forward and
// backward); "portable", the
// portable ones; any other value is refused with one line naming the variable. Which
// family ran is told by the wgmma the emulator counts (emu::wgmma_issued), not by the
// bits: here both families sum every product in the same order (the emulated mma.sync
// and wgmma both add in k order, and the sm90a kernels block the work as the portable
// ones do), so they write the same bits, which is checked too. Each case runs in a
// child process, which owns its environment.
#include "tests/emu/builtins.hpp"

#include <doctest/doctest.h>

#include <cuda_bf16.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/attention.cuh"
#include "tests/emu/emu.hpp"
#include "tests/emu/emu_test.hpp"

namespace {

using namespace spes::test;
using spes::cuda::AttentionPath;

// In the child: sets SPES_ATTENTION to `value` (unset if null), runs the backward on
// each path and says on stderr which one automatic matched, or the error it threw.
void report_automatic(const char* value) {
  if (value)
    setenv("SPES_ATTENTION", value, 1);
  else
    unsetenv("SPES_ATTENTION");
  const int64_t B = 1, T = 70, H = 2, Hkv = 1, D = 64;
  const int64_t nq = B * T * H * D, nkv = B * T * Hkv * D;
  rng().seed(7);
  auto q = device_buffer<bf16>(nq), k = device_buffer<bf16>(nkv), v = device_buffer<bf16>(nkv),
       dout = device_buffer<bf16>(nq), out = device_buffer<bf16>(nq), lse = device_buffer<float>(B * H * T),
       scratch = emu::GlobalBuffer(spes::cuda::attention_backward_scratch_bytes(B, T, H));
  upload_bf16(q, random_bf16_values(nq));
  upload_bf16(k, random_bf16_values(nkv));
  upload_bf16(v, random_bf16_values(nkv));
  upload_bf16(dout, random_bf16_values(nq));
  auto grads = device_buffer<bf16>(nq + 2 * nkv);
  auto run = [&](AttentionPath path) {
    const uint64_t wgmma_before = emu::wgmma_issued();
    spes::cuda::attention_forward(out.as<bf16>(), lse.as<float>(), q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), B, T,
                                  H, Hkv, D, nullptr, path);
    bf16* g = grads.as<bf16>();
    spes::cuda::attention_backward(g, g + nq, g + nq + nkv, dout.as<bf16>(), q.as<bf16>(), k.as<bf16>(), v.as<bf16>(),
                                   out.as<bf16>(), lse.as<float>(), scratch.as<void>(), B, T, H, Hkv, D, nullptr,
                                   path);
    const char* name = path == AttentionPath::automatic ? "automatic"
                       : path == AttentionPath::sm90a   ? "sm90a"
                                                        : "portable";
    std::fprintf(stderr, "%s: %s\n", name, emu::wgmma_issued() > wgmma_before ? "wgmma" : "no wgmma");
    std::vector<uint16_t> bits = download<uint16_t>(out, nq), g_bits = download<uint16_t>(grads, nq + 2 * nkv);
    bits.insert(bits.end(), g_bits.begin(), g_bits.end());
    return bits;
  };
  try {
    const auto automatic = run(AttentionPath::automatic), portable = run(AttentionPath::portable),
               sm90a = run(AttentionPath::sm90a);
    const bool same = same_bits(automatic, portable) && same_bits(portable, sm90a);
    std::fprintf(stderr, "%s\n", same ? "same bits" : "other bits");
    std::fprintf(stderr, "said: %s\n", spes::cuda::attention_automatic_path_description(D).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  }
}

}  // namespace

TEST_CASE("emulated attention: SPES_ATTENTION=portable overrides the automatic sm90a choice") {
  const std::string sm90a_chosen =
      "automatic: wgmma\nportable: no wgmma\nsm90a: wgmma\nsame bits\n"
      "said: sm90a (wgmma), agreeing with the portable kernels on this GPU\n[returned]";
  const std::string unset = run_in_child([] { report_automatic(nullptr); });
  MESSAGE(unset);
  CHECK(unset == sm90a_chosen);
  CHECK(run_in_child([] { report_automatic(""); }) == sm90a_chosen);
  const std::string portable = run_in_child([] { report_automatic("portable"); });
  MESSAGE(portable);
  CHECK(portable == "automatic: no wgmma\nportable: no wgmma\nsm90a: wgmma\nsame bits\n"
                    "said: portable (SPES_ATTENTION=portable)\n[returned]");
  const std::string bad = run_in_child([] { report_automatic("sm90"); });
  MESSAGE(bad);
  CHECK(has(bad, "error: attention_forward: SPES_ATTENTION is \"sm90\"; it may only be \"portable\" or unset\n"));
}

// The launchers' check of the sm90a kernels against the portable ones
// (cuda/attention_check.cu), on an emulated GPU whose wgmma reads the A register
// fragment otherwise than we decoded it (registers 1 and 2 swapped): the check names
// the first output that disagrees, says on stderr that the portable kernels run
// instead, and automatic then runs them (no wgmma, the portable bits) while forcing
// sm90a still runs the misread ones. As decoded, the check passes and automatic runs
// the sm90a kernels (the case above).
TEST_CASE("emulated attention: where the sm90a kernels disagree with the portable ones, automatic falls back and says so") {
  const std::string text = run_in_child([] {
    emu::set_wgmma_a_misread(true);
    std::fprintf(stderr, "check: %s\n", spes::cuda::attention_sm90a_check_failure().c_str());
    report_automatic(nullptr);
  });
  MESSAGE(text);
  CHECK(has(text, "spes: attention: the sm90a (wgmma) kernels disagree with the portable ones on GPU 0 (out at head "
                  "dim 64: relative error "));
  CHECK(has(text, "; the portable kernels run instead\ncheck: out at head dim 64: relative error "));
  CHECK(has(text, "automatic: no wgmma\nportable: no wgmma\nsm90a: wgmma\nother bits\n"
                  "said: portable: the sm90a kernels failed their check: out at head dim 64: relative error "));
}
