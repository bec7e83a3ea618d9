// printf-style stderr log lines with a fixed prefix ("[coordinator]", "[node 3]"),
// switched off as a whole for quiet tests. The pure parts of net/ (the round state
// machine) take a LineSink instead and never print themselves.
#pragma once
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "engine/base/log.hpp"

namespace spes::net {

using LineSink = std::function<void(const std::string& line)>;

class LineLog {
 public:
  LineLog(std::string prefix, bool on) : prefix_(std::move(prefix)), on_(on) {}
  bool on() const { return on_; }
  void operator()(const char* fmt, ...) const __attribute__((format(printf, 2, 3))) {
    if (!on_) return;
    va_list ap;
    va_start(ap, fmt);
    vlog_line(prefix_.c_str(), fmt, ap);
    va_end(ap);
  }
  void line(const std::string& s) const { (*this)("%s", s.c_str()); }
  LineSink sink() const {
    return [this](const std::string& s) { line(s); };
  }

 private:
  std::string prefix_;
  bool on_;
};

// Log lines a peer can trigger at will (refusals): at most `per_window` per
// window, so a fuzzer or a port scanner cannot flood the log, and the first line
// of a later window says how many were left out; never silenced for good.
class RateLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  RateLimiter(int per_window, double window_s)
      : per_window_(per_window), window_(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(window_s))) {}
  // Whether to log this line; *suppressed = lines left out since the last one logged.
  bool admit(Clock::time_point now, int64_t* suppressed) {
    if (now - window_start_ >= window_) window_start_ = now, in_window_ = 0;
    if (in_window_ >= per_window_) return ++suppressed_, false;
    ++in_window_;
    *suppressed = suppressed_;
    suppressed_ = 0;
    return true;
  }

 private:
  int per_window_;
  Clock::duration window_;
  Clock::time_point window_start_{};
  int in_window_ = 0;
  int64_t suppressed_ = 0;
};

}  // namespace spes::net
