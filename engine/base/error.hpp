// Errors are values until the edge of the program: each layer throws one of these
// with a complete one-line message; main() prints it and exits non-zero.
#pragma once
#include <stdexcept>
#include <string>

namespace spes {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct ConfigError : Error { using Error::Error; };
struct DataError : Error { using Error::Error; };
struct CheckpointError : Error { using Error::Error; };
struct NetError : Error { using Error::Error; };

}  // namespace spes
