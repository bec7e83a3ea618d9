// printf into a std::string: log lines, progress text and CSV fields.
#pragma once
#include <cstdarg>
#include <cstdio>
#include <string>

namespace spes {

inline std::string strprintf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline std::string strprintf(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

}  // namespace spes
