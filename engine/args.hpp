// The one command-line parser of the subcommands: Boost.Program_Options, bare
// words bound to positional options (the config path, tokenize's inputs), --help
// printing the usage, and a bad argument turned into a UsageError (exit code 2)
// that names it and shows the usage.
#pragma once
#include <boost/program_options.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/base/error.hpp"

namespace spes {

struct Config;

// A wrong or missing command-line argument: run_cli prints it and exits 2.
struct UsageError : Error {
  using Error::Error;
};

// Stores `args` into the variables bound in `opts`. Bare words go, in order, to the
// options named in `positional` ("config" by default when `opts` declares it; a
// name may take every remaining word when it is the last and marked with a
// trailing '*', e.g. "input*"). Adds --help; returns false when it was given (the
// usage went to stdout and the command should return 0).
bool parse_args(const std::vector<std::string>& args, boost::program_options::options_description& opts,
                const std::string& usage, const std::vector<std::string>& positional = {"config"});

// An option whose absence is not a value (no sentinel a user could type): `out` is
// set only when the option is given.
template <class T>
boost::program_options::typed_value<T>* optional_value(std::optional<T>& out) {
  return boost::program_options::value<T>()->notifier([&out](const T& v) { out = v; });
}

// The arguments every config-reading command shares: CONFIG, --set k=v..., and
// --node-id N (same as --set spes.node_id=N).
struct ConfigArgs {
  std::string config;
  std::vector<std::string> sets;
  std::optional<int64_t> node_id;  // --node-id, when given

  // Declares CONFIG (positional), --set and, with_node_id, --node-id.
  void declare(boost::program_options::options_description& opts, bool with_node_id = true);
  Config load() const;  // load_config with the overrides; throws ConfigError
};

// A number and its unit as an argument gives them ("80 GiB", "100Mbit", "1e9"): the
// value, and the unit lower-cased without spaces ("" when none); nullopt when the text
// does not start with a number.
struct Quantity {
  double value = 0;
  std::string unit;
};
std::optional<Quantity> parse_quantity(const std::string& s);

}  // namespace spes
