// `spes-engine coordinator CONFIG [--set section.key=value]... [--fresh]
// [--dump-state DIR [--dump-every N]] [--port P]`: the merge coordinator of a run.
#include "engine/args.hpp"
#include "engine/commands.hpp"
#include "engine/config.hpp"
#include "net/coordinator.hpp"

namespace spes {

int coordinator_command(const std::vector<std::string>& args) {
  std::string config;
  std::vector<std::string> sets, rest;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const bool takes_value = a == "--set" || a == "--dump-state" || a == "--dump-every" || a == "--port";
    if (takes_value && i + 1 >= args.size()) throw UsageError(a + " needs a value");
    if (a == "--set") sets.push_back(args[++i]);
    else if (a.rfind("--set=", 0) == 0) sets.push_back(a.substr(6));
    else if (takes_value) rest.push_back(a), rest.push_back(args[++i]);
    else if (config.empty() && !a.empty() && a[0] != '-') config = a;
    else rest.push_back(a);
  }
  if (config.empty())
    throw UsageError(
        "usage: spes-engine coordinator CONFIG [--set section.key=value]... [--fresh] [--dump-state DIR [--dump-every N]]");
  return net::coordinator_main(load_config(config, sets), rest);
}

}  // namespace spes
