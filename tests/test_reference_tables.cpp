// The reference tables of the READMEs are the ones the code prints from its own
// lists (`spes-engine reference config|csv|rounds-csv`): the config's keys, the
// training CSV's columns and the coordinator's rounds CSV. A change to a list that
// is not carried into its README fails here; paste the command's output over the table.
#include <doctest/doctest.h>

#include <fstream>
#include <string>

#include "engine/config.hpp"
#include "engine/trainer.hpp"
#include "net/coordinator.hpp"

using namespace spes;

namespace {

// The lines of the first markdown table after the line `heading` of a README.
std::string table_after(const std::string& readme, const std::string& heading) {
  std::ifstream in(std::string(SPES_SOURCE_DIR) + "/" + readme);
  REQUIRE(in);
  std::string line, table;
  bool under_heading = false;
  while (std::getline(in, line)) {
    if (!under_heading) {
      under_heading = line == heading;
    } else if (line.rfind('|', 0) == 0) {
      table += line + "\n";
    } else if (!table.empty()) {
      break;
    }
  }
  return table;
}

}  // namespace

TEST_CASE("engine/README.md's configuration table is the key list's") {
  CHECK_MESSAGE(table_after("engine/README.md", "## Configuration") == config_reference_markdown(),
                "engine/README.md, Configuration: replace the table with `spes-engine reference config`");
}

TEST_CASE("engine/README.md's CSV columns are the trainer's") {
  CHECK_MESSAGE(table_after("engine/README.md", "## CSV columns (stdout of `train`)") ==
                    Trainer::csv_reference_markdown(),
                "engine/README.md, CSV columns: replace the table with `spes-engine reference csv`");
}

TEST_CASE("net/README.md's rounds CSV columns are the coordinator's") {
  CHECK_MESSAGE(table_after("net/README.md", "### Coordinator CSV") == net::Coordinator::csv_reference_markdown(),
                "net/README.md, Coordinator CSV: replace the table with `spes-engine reference rounds-csv`");
}

TEST_CASE("the CSV headers users parse stay as they are") {
  CHECK(Trainer::csv_header() ==
        "step,tokens,loss,ce,lb,router_z,lm_z,lr,grad_norm,step_ms,tokens_per_s,mfu,expert_load_cv,"
        "val_ce,sync_round,sync_ms,bytes_up,bytes_down,sync_inflight_ms,sync_wait_ms,state_hash,elapsed_s");
  CHECK(net::Coordinator::csv_header() ==
        "round,step,participants,missing_nodes,late_pushes,bytes_in,bytes_out,merge_alpha,merge_ms,state_hash");
}
