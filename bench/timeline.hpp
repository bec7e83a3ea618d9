// What the device did during one training step, from the start and end time of every
// kernel, copy and memset it ran (bench/cupti_timeline.hpp reads them from CUPTI):
// how long it was busy, where it sat idle and between which kernels, and which kernels
// took the step's time. Timing kernels one by one (bench_train_gpu's per-kernel table)
// cannot tell a kernel that runs slower inside the step from the device waiting on
// the host; this can. It needs no GPU, so tests/test_timeline.cpp checks it on the CPU.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace spes::bench {

// One piece of device work: a kernel (short_kernel_name's name), or "memcpy HtoD" and
// the like. Spans of one name are one row of the summary.
struct DeviceSpan {
  std::string name;
  uint64_t start_ns = 0, end_ns = 0;
};

// A stretch with nothing running, between the work that ended last before it and the
// work that ends it.
struct IdleGap {
  uint64_t start_ns = 0, ns = 0;
  std::string after, before;
};

// Every span of one name: how many, and their durations summed.
struct NameTotal {
  std::string name;
  int64_t calls = 0;
  uint64_t ns = 0;
};

struct TimelineSummary {
  uint64_t first_start_ns = 0, last_end_ns = 0;  // the first work's start, the last's end
  uint64_t busy_ns = 0;  // the union of the spans: overlapping work counted once
  uint64_t idle_ns = 0;  // last_end − first_start − busy: the gaps' sum
  std::vector<IdleGap> gaps;     // every gap, longest first
  std::vector<NameTotal> names;  // per name, the most time first
};

inline TimelineSummary summarize_timeline(const std::vector<DeviceSpan>& spans) {
  TimelineSummary t;
  std::map<std::string, NameTotal> by_name;
  for (const DeviceSpan& s : spans) {
    NameTotal& n = by_name[s.name];
    n.name = s.name;
    n.calls += 1;
    n.ns += s.end_ns > s.start_ns ? s.end_ns - s.start_ns : 0;
  }
  for (auto& [name, total] : by_name) t.names.push_back(total);
  std::stable_sort(t.names.begin(), t.names.end(), [](const NameTotal& a, const NameTotal& b) { return a.ns > b.ns; });

  // The sweep takes work that lasted: an empty span (start = end) neither starts the
  // timeline nor splits a gap in two.
  std::vector<const DeviceSpan*> order;
  for (const DeviceSpan& s : spans)
    if (s.end_ns > s.start_ns) order.push_back(&s);
  if (order.empty()) return t;
  std::sort(order.begin(), order.end(), [](const DeviceSpan* a, const DeviceSpan* b) {
    return a->start_ns != b->start_ns ? a->start_ns < b->start_ns : a->end_ns < b->end_ns;
  });
  t.first_start_ns = order.front()->start_ns;
  // In start order; `reach` is the furthest end so far and `reacher` its span.
  uint64_t run_start = order.front()->start_ns, reach = order.front()->end_ns;
  const DeviceSpan* reacher = order.front();
  for (const DeviceSpan* s : order) {
    if (s->start_ns > reach) {
      t.busy_ns += reach - run_start;
      t.gaps.push_back({reach, s->start_ns - reach, reacher->name, s->name});
      run_start = s->start_ns;
    }
    if (s->end_ns > reach) reach = s->end_ns, reacher = s;
  }
  t.busy_ns += reach - run_start;
  t.last_end_ns = reach;
  t.idle_ns = t.last_end_ns - t.first_start_ns - t.busy_ns;
  std::stable_sort(t.gaps.begin(), t.gaps.end(), [](const IdleGap& a, const IdleGap& b) { return a.ns > b.ns; });
  return t;
}

// A kernel's name as a table shows it, from its demangled signature: no return type,
// no parameter list, none of "(anonymous namespace)::" and our own "spes::cuda::"
// (every kernel of ours has them); other qualifiers and the template arguments stay,
// so that different kernels keep different names (grouped_sm90::rows_kernel<...> and
// rows_kernel<...>). A name with no parameter list is not a C++ signature (cuBLAS's
// "nvjet_..." kernels, "memcpy HtoD"): it is kept whole.
inline std::string short_kernel_name(std::string s) {
  if (s.find('(') == std::string::npos) return s;
  for (const std::string drop : {"(anonymous namespace)::", "spes::cuda::"})
    for (size_t p; (p = s.find(drop)) != std::string::npos;) s.erase(p, drop.size());
  // Depth counts <> and () together, so spaces inside template arguments or the
  // parameter list are not taken for the one after the return type.
  int depth = 0;
  size_t name_begin = 0, name_end = s.size();
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '(' && depth == 0) {
      name_end = i;  // the parameter list
      break;
    }
    if (c == '<' || c == '(') ++depth;
    else if (c == '>' || c == ')') depth = std::max(0, depth - 1);
    else if (c == ' ' && depth == 0) name_begin = i + 1;  // after a return type such as "void"
  }
  return s.substr(name_begin, name_end - name_begin);
}

// `s` in at most `width` characters: cut, with "..." at the end, when longer.
inline std::string fit(const std::string& s, size_t width) {
  return s.size() <= width ? s : s.substr(0, width > 3 ? width - 3 : 0) + "...";
}

}  // namespace spes::bench
