// printf-style stderr log lines with a fixed prefix ("[coordinator]", "[node 3]"),
// switched off as a whole for quiet tests. The pure parts of net/ (the round state
// machine) take a LineSink instead and never print themselves.
#pragma once
#include <cstdarg>
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

}  // namespace spes::net
