// CSV rows for stdout (README, Architecture: stdout is data). A row is built field by
// field, each with its own printf format, and joined with commas; fields are numbers,
// hex hashes and plain words, never text that would need quoting.
#pragma once
#include <cstdarg>
#include <cstdio>
#include <string>
#include <string_view>

namespace spes {

class CsvRow {
 public:
  CsvRow& add(std::string_view text) {
    if (!s_.empty() || fields_ > 0) s_ += ',';
    s_ += text;
    ++fields_;
    return *this;
  }
  CsvRow& addf(const char* fmt, ...) __attribute__((format(printf, 2, 3))) {
    char buf[128];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return add(buf);
  }
  const std::string& str() const { return s_; }

 private:
  std::string s_;
  int fields_ = 0;
};

}  // namespace spes
