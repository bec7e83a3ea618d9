// bench/timeline.hpp, the summary of a traced GPU step, on made-up spans: busy time
// as the union of overlapping work, every idle gap with the work either side of it,
// the totals per name, and kernel names as the table shows them. A random timeline
// is checked against the same figures counted nanosecond by nanosecond.
#include <doctest/doctest.h>

#include <random>

#include "bench/timeline.hpp"

using spes::bench::DeviceSpan;
using spes::bench::short_kernel_name;
using spes::bench::summarize_timeline;

TEST_CASE("timeline: busy is the union of the spans, gaps are named by the work either side") {
  // a [10,20) and b [15,30) overlap; idle [30,40); c [40,45) inside d [40,60);
  // idle [60,100); a again [100,110). Given out of order.
  const std::vector<DeviceSpan> spans = {
      {"d", 40, 60}, {"a", 10, 20}, {"c", 40, 45}, {"a", 100, 110}, {"b", 15, 30}};
  const auto t = summarize_timeline(spans);
  CHECK(t.first_start_ns == 10);
  CHECK(t.last_end_ns == 110);
  CHECK(t.busy_ns == 20 + 20 + 10);
  CHECK(t.idle_ns == 10 + 40);
  REQUIRE(t.gaps.size() == 2);
  CHECK(t.gaps[0].start_ns == 60);  // longest first
  CHECK(t.gaps[0].ns == 40);
  CHECK(t.gaps[0].after == "d");  // d, not c, reached 60
  CHECK(t.gaps[0].before == "a");
  CHECK(t.gaps[1].start_ns == 30);
  CHECK(t.gaps[1].ns == 10);
  CHECK(t.gaps[1].after == "b");
  CHECK(t.gaps[1].before == "c");  // c and d start together: the shorter comes first
  REQUIRE(t.names.size() == 4);  // a 10 + 10, d 20 (ties keep name order), b 15, c 5
  CHECK(t.names[0].name == "a");
  CHECK(t.names[0].calls == 2);
  CHECK(t.names[0].ns == 20);
  CHECK(t.names[1].name == "d");
  CHECK(t.names[2].name == "b");
  CHECK(t.names[2].ns == 15);
  CHECK(t.names[3].name == "c");
}

TEST_CASE("timeline: no spans, one span; touching spans and empty ones leave the gaps as they are") {
  const auto none = summarize_timeline({});
  CHECK(none.busy_ns == 0);
  CHECK(none.gaps.empty());
  CHECK(none.names.empty());
  const auto one = summarize_timeline({{"k", 5, 9}});
  CHECK(one.busy_ns == 4);
  CHECK(one.idle_ns == 0);
  const auto touching = summarize_timeline({{"x", 0, 10}, {"y", 10, 20}, {"z", 20, 20}});
  CHECK(touching.busy_ns == 20);
  CHECK(touching.gaps.empty());
  const auto empty_inside = summarize_timeline({{"x", 0, 10}, {"e", 15, 15}, {"y", 20, 30}});
  REQUIRE(empty_inside.gaps.size() == 1);  // the empty span does not split the gap
  CHECK(empty_inside.gaps[0].ns == 10);
  CHECK(empty_inside.gaps[0].before == "y");
  CHECK(empty_inside.names.size() == 3);
}

TEST_CASE("timeline: a random timeline agrees with counting every nanosecond") {
  std::mt19937 g(11);
  for (int trial = 0; trial < 50; ++trial) {
    CAPTURE(trial);
    const int n = 1 + int(g() % 40);
    const uint64_t horizon = 2000;
    std::vector<DeviceSpan> spans;
    std::vector<int> running(horizon, 0);
    std::vector<uint64_t> per_name(3, 0);
    for (int i = 0; i < n; ++i) {
      const uint64_t a = g() % horizon, len = g() % 60, b = std::min(horizon, a + len);  // some empty
      const int name = int(g() % 3);
      spans.push_back({std::string(1, char('a' + name)), a, b});
      for (uint64_t x = a; x < b; ++x) running[x] += 1;
      per_name[size_t(name)] += b - a;
    }
    const auto t = summarize_timeline(spans);
    uint64_t first = horizon, last = 0;
    for (const DeviceSpan& s : spans)
      if (s.end_ns > s.start_ns) first = std::min(first, s.start_ns), last = std::max(last, s.end_ns);
    if (last == 0) {  // every span empty
      CHECK(t.busy_ns == 0);
      CHECK(t.gaps.empty());
      continue;
    }
    uint64_t busy = 0, idle = 0, gaps = 0;
    for (uint64_t x = first; x < last; ++x) {
      busy += running[x] > 0;
      if (running[x] == 0) idle += 1, gaps += x == first || running[x - 1] > 0;
    }
    CHECK(t.first_start_ns == first);
    CHECK(t.last_end_ns == last);
    CHECK(t.busy_ns == busy);
    CHECK(t.idle_ns == idle);
    CHECK(t.gaps.size() == gaps);
    uint64_t gap_sum = 0;
    for (size_t i = 0; i < t.gaps.size(); ++i) {
      gap_sum += t.gaps[i].ns;
      if (i) CHECK(t.gaps[i - 1].ns >= t.gaps[i].ns);
      // A gap is idle throughout, and work runs on both sides of it.
      for (uint64_t x = t.gaps[i].start_ns; x < t.gaps[i].start_ns + t.gaps[i].ns; ++x) CHECK(running[x] == 0);
      CHECK(running[t.gaps[i].start_ns - 1] > 0);
      CHECK(running[t.gaps[i].start_ns + t.gaps[i].ns] > 0);
    }
    CHECK(gap_sum == idle);
    for (const auto& nt : t.names) CHECK(nt.ns == per_name[size_t(nt.name[0] - 'a')]);
  }
}

TEST_CASE("timeline: kernel names lose return type, parameters and our namespaces, keep other qualifiers") {
  CHECK(short_kernel_name("void spes::cuda::(anonymous namespace)::attention_backward_dkv_kernel<64, true>"
                          "(spes::cuda::(anonymous namespace)::Args)") == "attention_backward_dkv_kernel<64, true>");
  // The portable and the sm90a grouped GEMM kernels share a name: their namespace
  // keeps them apart, as do their template arguments.
  const std::string sm90a = short_kernel_name(
      "void spes::cuda::grouped_sm90::(anonymous namespace)::rows_kernel<spes::cuda::grouped_sm90::Shape<128, "
      "256>, (spes::cuda::Op)1>(int, float const*)");
  CHECK(sm90a == "grouped_sm90::rows_kernel<grouped_sm90::Shape<128, 256>, (Op)1>");
  CHECK(short_kernel_name("void spes::cuda::(anonymous namespace)::rows_kernel<(spes::cuda::Op)1>(int)") ==
        "rows_kernel<(Op)1>");
  CHECK(short_kernel_name("void cutlass::Kernel2<cutlass_80_tensorop_s16816gemm_bf16_64x64_nn_align8>"
                          "(cutlass_80_tensorop_s16816gemm_bf16_64x64_nn_align8::Params)") ==
        "cutlass::Kernel2<cutlass_80_tensorop_s16816gemm_bf16_64x64_nn_align8>");
  CHECK(short_kernel_name("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopA_TNT") ==
        "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopA_TNT");
  CHECK(short_kernel_name("memcpy HtoD") == "memcpy HtoD");
}

TEST_CASE("timeline: fit cuts a long name to its width with an ellipsis") {
  CHECK(spes::bench::fit("short", 10) == "short");
  CHECK(spes::bench::fit("exactly10!", 10) == "exactly10!");
  std::string long_name = "k<";
  long_name.append(100, 'x');
  const std::string cut = spes::bench::fit(long_name, 20);
  CHECK(cut.size() == 20);
  CHECK(cut.substr(0, 2) == "k<");
  CHECK(cut.substr(17) == "...");
}
