#include "engine/args.hpp"

#include <cctype>
#include <iostream>

#include "engine/config.hpp"

namespace spes {

namespace po = boost::program_options;

bool parse_args(const std::vector<std::string>& args, po::options_description& opts, const std::string& usage,
                const std::vector<std::string>& positional) {
  opts.add_options()("help,h", "print this help");
  po::positional_options_description pos;
  for (const std::string& name : positional) {
    const bool rest = !name.empty() && name.back() == '*';
    const std::string n = rest ? name.substr(0, name.size() - 1) : name;
    if (opts.find_nothrow(n, false)) pos.add(n.c_str(), rest ? -1 : 1);
  }
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(args).options(opts).positional(pos).run(), vm);
    if (vm.count("help")) {
      std::cout << "usage: " << usage << "\n" << opts << "\n";
      return false;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    throw UsageError(std::string(e.what()) + "\nusage: " + usage);
  }
  return true;
}

void ConfigArgs::declare(po::options_description& opts, bool with_node_id) {
  opts.add_options()("config", po::value(&config)->required(), "TOML config")(
      "set", po::value(&sets)->composing(), "override a config key: section.key=value");
  if (with_node_id)
    opts.add_options()("node-id", optional_value(node_id), "this node's id (same as --set spes.node_id=N)");
}

Config ConfigArgs::load() const {
  std::vector<std::string> all = sets;
  if (node_id) {
    if (*node_id < 0) throw UsageError("--node-id " + std::to_string(*node_id) + ": expected a node id >= 0");
    all.push_back("spes.node_id=" + std::to_string(*node_id));
  }
  return load_config(config, all);
}

std::optional<Quantity> parse_quantity(const std::string& s) {
  Quantity q;
  size_t i = 0;
  try {
    q.value = std::stod(s, &i);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  for (; i < s.size(); ++i)
    if (!std::isspace(static_cast<unsigned char>(s[i]))) q.unit += char(std::tolower(static_cast<unsigned char>(s[i])));
  return q;
}

}  // namespace spes
