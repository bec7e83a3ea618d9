// Progress of long work on stderr (stdout is data). When stderr is a terminal: one
// line rewritten in place, at most 5 times a second; log lines (log.hpp) clear it
// before they print. Otherwise (a log file, a pipe):
// a plain line every `log_every_s` seconds and at the end. SPES_PROGRESS=off turns
// both off (`local` sets it for the processes it starts and draws one line for all
// of them).
#pragma once
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "engine/base/log.hpp"

namespace spes {

class Progress {
 public:
  explicit Progress(std::string label, double log_every_s = 30.0)
      : label_(std::move(label)), log_every_s_(log_every_s), start_(Clock::now()), last_(start_ - std::chrono::hours(1)) {
    const char* env = std::getenv("SPES_PROGRESS");
    off_ = env && std::strcmp(env, "off") == 0;
    tty_ = isatty(STDERR_FILENO);
  }
  ~Progress() { finish(); }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  bool terminal() const { return tty_ && !off_; }  // a line drawn in place
  double elapsed_s() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }
  // ETA from the rate so far: done of total units.
  std::string eta(double done, double total) const {
    if (done <= 0 || total <= done) return "--";
    const double s = elapsed_s() / done * (total - done);
    if (!(s < 1e6 * 3600)) return ">1e6h";  // a run this long is a typo in its steps
    char b[32];
    if (s >= 3600) std::snprintf(b, sizeof b, "%dh%02dm", int(s / 3600), int(s / 60) % 60);
    else std::snprintf(b, sizeof b, "%dm%02ds", int(s / 60), int(s) % 60);
    return b;
  }
  // Shows `text` (one line, no newline); `force` draws even if drawn just now.
  void update(const std::string& text, bool force = false) {
    if (off_) return;
    const auto now = Clock::now();
    const double since = std::chrono::duration<double>(now - last_).count();
    if (tty_) {
      if (!force && since < 0.2) return;
      std::fprintf(stderr, "\r\033[K%s %s", label_.c_str(), text.c_str());
      progress_line_drawn() = true;
    } else {
      if (!force && since < log_every_s_) return;
      std::fprintf(stderr, "%s %s\n", label_.c_str(), text.c_str());
    }
    std::fflush(stderr);
    last_ = now;
  }
  // Ends the terminal line so that later output starts clean.
  void finish() {
    if (tty_ && progress_line_drawn().exchange(false)) std::fputc('\n', stderr);
  }

 private:
  using Clock = std::chrono::steady_clock;
  std::string label_;
  double log_every_s_;
  Clock::time_point start_, last_;
  bool tty_ = false;
  bool off_ = false;
};

}  // namespace spes
