// Log lines on stderr: "<prefix> <message>". A progress line on a terminal
// (engine/base/progress.hpp) is cleared first, so log lines never run into it.
#pragma once
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <string>

#include "engine/base/format.hpp"

namespace spes {

// True while a progress line is drawn on the terminal without its newline.
inline std::atomic<bool>& progress_line_drawn() {
  static std::atomic<bool> drawn{false};
  return drawn;
}

inline void log_raw(const char* line) {
  if (progress_line_drawn().exchange(false)) std::fputs("\r\033[K", stderr);
  std::fprintf(stderr, "%s\n", line);
}

inline void vlog_line(const char* prefix, const char* fmt, va_list ap) {
  char buf[1024];
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  char line[1200];
  std::snprintf(line, sizeof line, "%s %s", prefix, buf);
  log_raw(line);
}

inline void log_line(const char* prefix, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
inline void log_line(const char* prefix, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vlog_line(prefix, fmt, ap);
  va_end(ap);
}

}  // namespace spes
