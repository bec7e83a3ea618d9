// `spes-engine reference config|csv|rounds-csv`: one of the reference tables as
// markdown, made from the very lists the code reads and writes with: the config's
// keys (engine/config_keys.hpp), the training CSV's columns (engine/trainer.cpp) and
// the coordinator's rounds CSV (net/coordinator.cpp). engine/README.md and
// net/README.md hold these tables; tests/test_reference_tables.cpp fails when they
// differ from what this prints.
#include <cstdio>
#include <string>
#include <vector>

#include "engine/args.hpp"
#include "engine/base/error.hpp"
#include "engine/commands.hpp"
#include "engine/config.hpp"
#include "engine/trainer.hpp"
#include "net/coordinator.hpp"

namespace spes {

int reference_command(const std::vector<std::string>& args) {
  namespace po = boost::program_options;
  std::string table;
  po::options_description opts;
  opts.add_options()("table", po::value(&table)->required(),
                     "config (engine/README.md, Configuration), csv (engine/README.md, CSV columns) or rounds-csv "
                     "(net/README.md, Coordinator CSV)");
  if (!parse_args(args, opts, "spes-engine reference config|csv|rounds-csv", {"table"})) return 0;
  if (table == "config")
    std::fputs(config_reference_markdown().c_str(), stdout);
  else if (table == "csv")
    std::fputs(Trainer::csv_reference_markdown().c_str(), stdout);
  else if (table == "rounds-csv")
    std::fputs(net::Coordinator::csv_reference_markdown().c_str(), stdout);
  else
    throw UsageError("unknown table '" + table + "': expected config, csv or rounds-csv");
  return 0;
}

}  // namespace spes
