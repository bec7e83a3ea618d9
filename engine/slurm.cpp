#include "engine/slurm.hpp"

#include <algorithm>
#include <cctype>

#include "engine/base/error.hpp"

namespace spes {

namespace {

int64_t parse_count(const char* name, const char* value) {
  std::string s = value;
  size_t used = 0;
  long long v = -1;
  try {
    v = std::stoll(s, &used);
  } catch (const std::exception&) {
  }
  if (used != s.size() || v < 0) throw ConfigError(std::string("$") + name + " = '" + s + "': expected a number ≥ 0");
  return v;
}

// "01-03,7" → 01 02 03 7 (zero padding kept).
std::vector<std::string> expand_ranges(const std::string& body, const std::string& list) {
  std::vector<std::string> out;
  size_t a = 0;
  while (a <= body.size()) {
    const size_t b = std::min(body.find(',', a), body.size());
    const std::string part = body.substr(a, b - a);
    const size_t dash = part.find('-');
    auto number = [&](const std::string& t) {
      if (t.empty() || t.size() > 9 || !std::all_of(t.begin(), t.end(), [](char c) { return std::isdigit(c); }))
        throw ConfigError("$SLURM_JOB_NODELIST = '" + list + "': bad range '" + part + "'");
      return std::stol(t);
    };
    if (dash == std::string::npos) {
      number(part);
      out.push_back(part);
    } else {
      const std::string lo = part.substr(0, dash), hi = part.substr(dash + 1);
      const long from = number(lo), to = number(hi);
      if (to < from || to - from > 100000) throw ConfigError("$SLURM_JOB_NODELIST = '" + list + "': bad range '" + part + "'");
      for (long i = from; i <= to; ++i) {
        std::string n = std::to_string(i);
        if (n.size() < lo.size()) n.insert(0, lo.size() - n.size(), '0');
        out.push_back(n);
      }
    }
    a = b + 1;
  }
  return out;
}

}  // namespace

namespace {

// One entry of a node list (no top-level comma): "r[1-2]-g[1,3]" → r1-g1 r1-g3 r2-g1 r2-g3.
std::vector<std::string> expand_entry(const std::string& entry, const std::string& list) {
  const size_t open = entry.find('[');
  if (open == std::string::npos) return {entry};
  const size_t close = entry.find(']', open);
  if (close == std::string::npos) throw ConfigError("$SLURM_JOB_NODELIST = '" + list + "': '[' without ']'");
  std::vector<std::string> out;
  const std::vector<std::string> tails = expand_entry(entry.substr(close + 1), list);
  for (const std::string& n : expand_ranges(entry.substr(open + 1, close - open - 1), list))
    for (const std::string& t : tails) out.push_back(entry.substr(0, open) + n + t);
  return out;
}

}  // namespace

std::vector<std::string> expand_slurm_nodelist(const std::string& list) {
  std::vector<std::string> hosts;
  std::string entry;
  int depth = 0;
  for (size_t i = 0; i <= list.size(); ++i) {
    const char c = i < list.size() ? list[i] : ',';
    if (c == ',' && depth == 0) {
      if (entry.empty()) throw ConfigError("$SLURM_JOB_NODELIST = '" + list + "': empty host name");
      for (std::string& h : expand_entry(entry, list)) hosts.push_back(std::move(h));
      entry.clear();
      continue;
    }
    depth += c == '[' ? 1 : c == ']' ? -1 : 0;
    if (depth < 0 || depth > 1) throw ConfigError("$SLURM_JOB_NODELIST = '" + list + "': unbalanced brackets");
    entry += c;
  }
  if (depth != 0) throw ConfigError("$SLURM_JOB_NODELIST = '" + list + "': '[' without ']'");
  return hosts;
}

std::optional<SlurmTask> slurm_task(const std::function<const char*(const char*)>& getenv) {
  const char* procid = getenv("SLURM_PROCID");
  const char* ntasks = getenv("SLURM_NTASKS");
  if (!procid || !ntasks) return std::nullopt;
  SlurmTask t;
  t.node_id = parse_count("SLURM_PROCID", procid);
  t.n_nodes = parse_count("SLURM_NTASKS", ntasks);
  if (t.n_nodes < 1 || t.node_id >= t.n_nodes)
    throw ConfigError("$SLURM_PROCID = " + std::to_string(t.node_id) + " is not a task of $SLURM_NTASKS = " +
                      std::to_string(t.n_nodes));
  if (const char* list = getenv("SLURM_JOB_NODELIST")) {
    const std::vector<std::string> hosts = expand_slurm_nodelist(list);
    if (!hosts.empty()) t.first_host = hosts.front();
  }
  return t;
}

std::vector<std::string> slurm_overrides(const SlurmTask& task, const std::string& config_coordinator,
                                         const char* spes_coordinator_env) {
  std::vector<std::string> sets = {"spes.node_id=" + std::to_string(task.node_id),
                                   "spes.n_nodes=" + std::to_string(task.n_nodes)};
  const auto colon = config_coordinator.rfind(':');
  std::string host = colon == std::string::npos ? config_coordinator : config_coordinator.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);  // [v6]
  const std::string port = colon == std::string::npos ? "29500" : config_coordinator.substr(colon + 1);
  const bool loopback = host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
  if (spes_coordinator_env && *spes_coordinator_env)
    sets.push_back(std::string("spes.coordinator=\"") + spes_coordinator_env + "\"");
  else if (loopback && !task.first_host.empty())
    sets.push_back("spes.coordinator=\"" + task.first_host + ":" + port + "\"");
  return sets;
}

}  // namespace spes
