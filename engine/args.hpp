// Command-line parsing shared by the subcommands: Boost.Program_Options with the
// config path as the positional argument, and a bad argument turned into one
// Error line followed by the usage.
#pragma once
#include <boost/program_options.hpp>

namespace spes {

// Stores argv into the variables bound in `opts` (the first bare word is "config"
// when `opts` declares it). Throws Error("<what>\nusage: <usage>").
void parse_args(int argc, char** argv, const boost::program_options::options_description& opts, const char* usage);

}  // namespace spes
