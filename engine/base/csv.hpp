// CSV rows for stdout (README, Architecture: stdout is data). A row is built field by
// field, each printed with its own printf format (strprintf), and joined with commas;
// fields are numbers, hex hashes and plain words, never text that would need quoting.
//
// A CSV that the engine prints is one table of CsvColumn: the header, every row and
// the column reference in the READMEs all come from it, so they cannot drift apart.
#pragma once
#include <string>
#include <string_view>

#include "engine/base/format.hpp"

namespace spes {

// One column of a CSV whose rows are made from a Record.
template <class Record>
struct CsvColumn {
  const char* name;
  std::string (*format)(const Record&);  // the field; "" when the row has no value
  const char* doc;                       // one line of markdown
};

class CsvRow {
 public:
  CsvRow& add(std::string_view text) {
    if (!s_.empty() || fields_ > 0) s_ += ',';
    s_ += text;
    ++fields_;
    return *this;
  }
  const std::string& str() const { return s_; }

 private:
  std::string s_;
  int fields_ = 0;
};


template <class Columns>
std::string csv_header(const Columns& columns) {
  CsvRow row;
  for (const auto& c : columns) row.add(c.name);
  return row.str();
}

template <class Columns, class Record>
std::string csv_row(const Columns& columns, const Record& r) {
  CsvRow row;
  for (const auto& c : columns) row.add(c.format(r));
  return row.str();
}

// The markdown reference: | column | meaning |, one row per column.
template <class Columns>
std::string csv_reference_markdown(const Columns& columns) {
  std::string out = "| column | meaning |\n| --- | --- |\n";
  for (const auto& c : columns) out += std::string("| `") + c.name + "` | " + c.doc + " |\n";
  return out;
}

}  // namespace spes
