// One stderr log line for the coordinator and the nodes: "<prefix> <message>".
#pragma once
#include <cstdarg>
#include <cstdio>

namespace spes {

inline void vlog_line(const char* prefix, const char* fmt, va_list ap) {
  char buf[1024];
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  std::fprintf(stderr, "%s %s\n", prefix, buf);
}

}  // namespace spes
