#include "engine/args.hpp"

#include <string>

#include "engine/base/error.hpp"

namespace spes {

void parse_args(int argc, char** argv, const boost::program_options::options_description& opts, const char* usage) {
  namespace po = boost::program_options;
  po::positional_options_description pos;
  if (opts.find_nothrow("config", false)) pos.add("config", 1);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(opts).positional(pos).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    throw Error(std::string(e.what()) + "\nusage: " + usage);
  }
}

}  // namespace spes
