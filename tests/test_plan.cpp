// `spes-engine plan`: its numbers are what the backends allocate. CPU: the model's
// planned bytes equal the bytes it holds once built (the GPU side is checked
// against the GPU backend's arena in test_gpu_step.cu); the command prints the
// SPES node below its centralized twin.
#include <doctest/doctest.h>

#include <array>
#include <cstdio>
#include <string>

#include "model/cpu/cpu_model.hpp"
#include "model/layout.hpp"
#include "test_util.hpp"

using namespace spes;

TEST_CASE("plan: the CPU model allocates exactly its planned bytes") {
  auto dir = test::temp_dir("plan-cpu");
  for (const std::vector<std::string>& sets :
       {std::vector<std::string>{}, {"model.n_kv_heads=1", "model.top_k=1"}, {"model.tie_embeddings=true"}}) {
    const Config c = test::small_config(dir, sets);
    const ParamLayout L = make_layout(c.model);
    const Ownership own = make_ownership(c.model, L, 0, 2, OwnershipMode::partitioned, 0);
    for (int64_t batch : {1, 3}) {
      CpuModel m(c.model, L, own, batch, c.model.seq_len);
      const int64_t planned = CpuModel::planned_bytes(c.model, L, own, batch, c.model.seq_len);
      CHECK(planned == m.allocated_bytes());
      CHECK(planned > 0);
    }
  }
}

TEST_CASE("plan: the command prints every category, the SPES node below its centralized twin") {
  const std::string cmd = std::string(SPES_ENGINE_BIN) + " plan " + SPES_SOURCE_DIR +
                          "/configs/spes-1b.toml --memory 80GiB 2>&1";
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  REQUIRE(pclose(p) == 0);
  INFO(out);
#ifdef SPES_HAVE_CUDA  // the GPU plan (bf16 compute weights + fp32 master copy), the default with CUDA
  for (const char* want : {"master weights", "AdamW moments", "gradients", "activations", "**total**",
                           "Largest micro-batch per GPU in 80.00 GiB"})
#else  // a binary without CUDA plans a CPU node
  for (const char* want : {"parameters (fp32, all; the master copy)", "AdamW moments", "gradients", "activations",
                           "**total**", "Largest micro-batch per CPU node in 80.00 GiB"})
#endif
    CHECK(out.find(want) != std::string::npos);
  // The total row's last column: SPES / centralized < 1 (4 of 16 experts trained).
  const size_t t = out.find("| **total** |");
  REQUIRE(t != std::string::npos);
  const std::string row = out.substr(t, out.find('\n', t) - t);
  const double ratio = std::stod(row.substr(row.rfind("| ", row.size() - 3) + 2));
  CHECK(ratio > 0.3);
  CHECK(ratio < 0.9);
}
