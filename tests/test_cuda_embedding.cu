// Embedding forward/backward vs cpu::embedding_*. Forward is a copy (exact);
// backward adds the same fp32 values in the same (token) order as the CPU, so it
// must match bit for bit — the stated tolerance is 0 — under every schedule
// (for_each_schedule).
#include <cmath>
#include <tuple>

#include "cuda/embedding.cuh"
#include "model/cpu/ops.hpp"
#include "tests/cuda_test.cuh"

using namespace spes::cuda;
using namespace spes::test;

GPU_TEST_CASE("cuda embedding: forward and deterministic backward vs cpu") {
  // small V: heavy repetition (runs longer than the 4-row unroll); V = 151665: the
  // real vocabulary (18 key bits), few repeats.
  for (auto [N, C, V] : {std::tuple<int64_t, int64_t, int64_t>{300, 64, 50}, {1000, 64, 151665}, {17, 8, 3},
                         {2000, 768, 5000}, {4096, 2048, 1000}}) {
    CAPTURE(N);
    CAPTURE(C);
    CAPTURE(V);
    std::vector<int32_t> tokens = random_tokens(N, V);
    for (int64_t i = 0; i < N; i += 3) tokens[i] = int32_t(V - 1);  // one hot token: a long run
    const std::vector<float> table = rounded_bf16(random_vector(V * C));
    std::vector<float> out_ref(N * C);
    spes::cpu::embedding_forward(out_ref.data(), tokens.data(), table.data(), N, C);

    auto d_tok = upload(tokens);
    auto d_table = upload_bf16(table);
    DevTensor<bf16> d_out(N * C);
    for_each_schedule("embedding forward", {d_out}, [&] {
      embedding_forward(d_out, d_tok, d_table, N, C, V, stream());
      CHECK_MESSAGE(bitwise_equal(download(d_out.get(), N * C), out_ref), "embedding forward is not a copy");
    });

    const std::vector<float> dout = rounded_bf16(random_vector(N * C));
    const std::vector<float> dtable0 = random_vector(V * C);  // += onto existing gradients
    std::vector<float> dtable_ref = dtable0;
    spes::cpu::embedding_backward(dtable_ref.data(), dout.data(), tokens.data(), N, C);

    auto d_dout = upload_bf16(dout);
    DevTensor<float> d_dtable(V * C);
    const size_t ws_bytes = embedding_backward_workspace_bytes(N, V);
    DevTensor<char> ws{static_cast<int64_t>(ws_bytes)};
    for_each_schedule("embedding backward", {d_dtable}, [&] {
      d_dtable.upload(dtable0);
      embedding_backward(d_dtable, d_dout, d_tok, N, C, V, ws, ws_bytes, stream());
      CHECK_MESSAGE(bitwise_equal(download(d_dtable.get(), V * C), dtable_ref),
                    "embedding backward is not bit-identical to the CPU reference");
    });
  }
}

GPU_TEST_CASE("cuda embedding: out-of-range tokens give NaN rows forward and are skipped backward") {
  const int64_t N = 6, C = 16, V = 10;
  const std::vector<int32_t> tokens = {1, -1, 3, 10, 3, 9};
  const std::vector<float> table = rounded_bf16(random_vector(V * C));
  auto d_tok = upload(tokens);
  auto d_table = upload_bf16(table);
  DevTensor<bf16> d_out(N * C);
  embedding_forward(d_out, d_tok, d_table, N, C, V, stream());
  const std::vector<float> out = download(d_out.get(), N * C);
  CHECK(std::isnan(out[1 * C]));
  CHECK(std::isnan(out[3 * C + C - 1]));
  CHECK(out[2 * C + 5] == table[3 * C + 5]);

  std::vector<float> dout = rounded_bf16(random_vector(N * C));
  auto d_dout = upload_bf16(dout);
  DevTensor<float> d_dtable(V * C);
  d_dtable.zero();
  const size_t ws_bytes = embedding_backward_workspace_bytes(N, V);
  DevTensor<char> ws{static_cast<int64_t>(ws_bytes)};
  embedding_backward(d_dtable, d_dout, d_tok, N, C, V, ws, ws_bytes, stream());
  const std::vector<float> dt = download(d_dtable.get(), V * C);
  for (int64_t c = 0; c < C; ++c) {
    CHECK(dt[1 * C + c] == dout[0 * C + c]);
    CHECK(dt[3 * C + c] == dout[2 * C + c] + dout[4 * C + c]);
    CHECK(dt[9 * C + c] == dout[5 * C + c]);
    CHECK(dt[0 * C + c] == 0.0f);
  }
}

// Argument checks throw on the host before any CUDA call: no GPU needed (fake device
// addresses, never dereferenced; one bad argument per call). See test_cuda_attention.cu.
TEST_CASE("cuda embedding: bad shapes and pointers throw before any CUDA call") {
  bf16* a = reinterpret_cast<bf16*>(0x10000);
  bf16* m = reinterpret_cast<bf16*>(0x10002);
  const int32_t* tok = reinterpret_cast<const int32_t*>(0x20000);
  float* f = reinterpret_cast<float*>(0x30000);
  CHECK_THROWS_ERROR(embedding_forward(a, tok, a, 8, 12, 50, nullptr), "positive multiple of 8");
  CHECK_THROWS_ERROR(embedding_forward(m, tok, a, 8, 64, 50, nullptr),
                     "embedding_forward: out must be 16-byte aligned");
  CHECK_THROWS_ERROR(embedding_forward(a, tok, m, 8, 64, 50, nullptr), "table must be 16-byte aligned");
  CHECK_THROWS_ERROR(embedding_forward(a, nullptr, a, 8, 64, 50, nullptr), "tokens must not be null");
  CHECK_THROWS_ERROR(embedding_backward(reinterpret_cast<float*>(0x30004), a, tok, 8, 64, 50, nullptr, 0, nullptr),
                     "embedding_backward: dtable must be 16-byte aligned");
  CHECK_THROWS_ERROR(embedding_backward(f, m, tok, 8, 64, 50, nullptr, 0, nullptr), "dout must be 16-byte aligned");
}
