// SLURM: node ids from the task id, the node list's first host as the coordinator,
// and clear errors on malformed variables (a faked environment).
#include <doctest/doctest.h>

#include <map>
#include <string>

#include "engine/base/error.hpp"
#include "engine/slurm.hpp"

using namespace spes;

namespace {

auto env_of(const std::map<std::string, std::string>& vars) {
  return [vars](const char* name) -> const char* {
    const auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

}  // namespace

TEST_CASE("slurm: node lists expand in order, zero padding kept") {
  CHECK(expand_slurm_nodelist("gpu[01-03,7],login2") ==
        std::vector<std::string>{"gpu01", "gpu02", "gpu03", "gpu7", "login2"});
  CHECK(expand_slurm_nodelist("a1") == std::vector<std::string>{"a1"});
  CHECK(expand_slurm_nodelist("n[8-10]-ib") == std::vector<std::string>{"n8-ib", "n9-ib", "n10-ib"});
  CHECK(expand_slurm_nodelist("r[1-2]-g[1,3],x") ==
        std::vector<std::string>{"r1-g1", "r1-g3", "r2-g1", "r2-g3", "x"});
  CHECK_THROWS_AS(expand_slurm_nodelist("gpu[01-"), ConfigError);
  CHECK_THROWS_AS(expand_slurm_nodelist("gpu[3-1]"), ConfigError);
  CHECK_THROWS_AS(expand_slurm_nodelist("gpu[x]"), ConfigError);
  CHECK_THROWS_AS(expand_slurm_nodelist("a,,b"), ConfigError);
}

TEST_CASE("slurm: the task becomes the node; the coordinator is the first host unless named") {
  CHECK_FALSE(slurm_task(env_of({})).has_value());
  const auto t = slurm_task(env_of({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "4"}, {"SLURM_JOB_NODELIST", "h[10-13]"}}));
  REQUIRE(t.has_value());
  CHECK(t->node_id == 2);
  CHECK(t->n_nodes == 4);
  CHECK(t->first_host == "h10");
  // A loopback coordinator in the config: the job's first host at the same port.
  CHECK(slurm_overrides(*t, "127.0.0.1:29517", nullptr) ==
        std::vector<std::string>{"spes.node_id=2", "spes.n_nodes=4", "spes.coordinator=\"h10:29517\""});
  CHECK(slurm_overrides(*t, "[::1]:7000", nullptr).back() == "spes.coordinator=\"h10:7000\"");
  // A real host in the config stays; $SPES_COORDINATOR wins over both.
  CHECK(slurm_overrides(*t, "coord.lab:29500", nullptr).size() == 2);
  CHECK(slurm_overrides(*t, "coord.lab:29500", "10.0.0.9:4000").back() == "spes.coordinator=\"10.0.0.9:4000\"");
  CHECK_THROWS_WITH_AS(slurm_task(env_of({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}})),
                       doctest::Contains("SLURM_PROCID"), ConfigError);
  CHECK_THROWS_AS(slurm_task(env_of({{"SLURM_PROCID", "x"}, {"SLURM_NTASKS", "4"}})), ConfigError);
}
