// A whole SPES run inside the test process: a coordinator on a free loopback port,
// then one Trainer per node, each on its own thread with the network sync hook, and
// each round's state hash read back from the nodes' CSV. Used where a node with an
// unusual backend (data-parallel ranks, a GPU) must agree with ordinary CPU nodes.
#pragma once
#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "engine/config.hpp"
#include "engine/net_sync.hpp"
#include "engine/trainer.hpp"
#include "net/coordinator.hpp"

namespace spes::test {

// The field of CSV `row` in the column `header` names `name` ("" when absent).
inline std::string csv_field(const std::string& header, const std::string& row, const std::string& name) {
  auto split = [](const std::string& line) {
    std::vector<std::string> out;
    std::istringstream is(line);
    for (std::string f; std::getline(is, f, ',');) out.push_back(f);
    if (!line.empty() && line.back() == ',') out.push_back("");
    return out;
  };
  const std::vector<std::string> names = split(header), fields = split(row);
  for (size_t i = 0; i < names.size() && i < fields.size(); ++i)
    if (names[i] == name) return fields[i];
  return "";
}

class InProcessSpes {
 public:
  // base: the run's config (n_nodes, run_id, state_dir, …); the coordinator starts a
  // fresh run on a free port.
  explicit InProcessSpes(const Config& base) {
    net::CoordinatorParams p = coordinator_params(base);
    p.secret = "";
    net::CoordinatorOptions o;
    o.port = 0;
    o.log = false;
    o.fresh = true;
    coordinator_ = std::make_unique<net::Coordinator>(std::move(p), o);
    server_ = std::thread([this] { coordinator_->run(); });
  }
  ~InProcessSpes() {
    coordinator_->stop();
    server_.join();
  }
  InProcessSpes(const InProcessSpes&) = delete;
  InProcessSpes& operator=(const InProcessSpes&) = delete;

  // The run's --sets for node `id`: its id and this coordinator's address added.
  std::vector<std::string> node_sets(std::vector<std::string> sets, int id) const {
    sets.push_back("spes.node_id=" + std::to_string(id));
    sets.push_back("spes.coordinator=\"127.0.0.1:" + std::to_string(coordinator_->port()) + "\"");
    return sets;
  }

  // Runs every node to its last step, each on its own thread; returns their CSVs.
  std::vector<std::string> run(std::vector<std::unique_ptr<Trainer>>& nodes) {
    for (auto& n : nodes) n->set_sync_hook(make_net_sync_hook(n->config(), n->layout(), n->ownership(), n->theta().data()));
    std::vector<std::ostringstream> csv(nodes.size());
    std::vector<std::thread> ts;
    for (size_t i = 0; i < nodes.size(); ++i) ts.emplace_back([&, i] { nodes[i]->run(csv[i], false); });
    for (auto& t : ts) t.join();
    std::vector<std::string> out;
    for (auto& c : csv) out.push_back(c.str());
    return out;
  }

  // The state hash of every row that ended a sync round (column state_hash).
  static std::vector<std::string> round_hashes(const std::string& csv) {
    std::vector<std::string> out;
    std::istringstream is(csv);
    std::string header, line;
    std::getline(is, header);
    while (std::getline(is, line))
      if (std::string h = csv_field(header, line, "state_hash"); !h.empty()) out.push_back(h);
    return out;
  }

 private:
  std::unique_ptr<net::Coordinator> coordinator_;
  std::thread server_;
};

}  // namespace spes::test
