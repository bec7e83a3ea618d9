// `spes-engine plot CSV... --x COL --y COL [--group COL] [--logy] [-o out.svg]
// [--title T]`: columns of the CSVs the engine writes (train/local rows, eval rows,
// the coordinator's rounds.csv) as an SVG line plot (engine/base/svg_plot.hpp): one
// series per file, per value of --group (local's `node`), or per both (a file
// without the --group column, e.g. a one-node run beside a `local` run, is one
// series; at least one file must have it). Rows whose
// x or y is empty are skipped (val_ce is empty on steps without an eval); a
// repeated header line (appended runs) is skipped too. The SVG goes to -o, else
// to stdout.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <iostream>
#include <map>

#include "engine/args.hpp"
#include "engine/base/atomic_file.hpp"
#include "engine/base/error.hpp"
#include "engine/commands.hpp"
#include "engine/base/svg_plot.hpp"

namespace spes {

namespace {

// One CSV line into fields: commas separate, "double quotes" may hold commas
// and "" for a quote (the engine's own files never need them, others may).
std::vector<std::string> split_csv(const std::string& line) {
  std::vector<std::string> out(1);
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') out.back() += '"', ++i;
      else if (c == '"') quoted = false;
      else out.back() += c;
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      out.emplace_back();
    } else {
      out.back() += c;
    }
  }
  return out;
}

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t"), b = s.find_last_not_of(" \t");
  return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
}

struct Columns {
  size_t x, y, group;  // group = npos without --group
};

size_t column(const std::vector<std::string>& header, const std::string& name, const std::string& file,
              const char* option) {
  for (size_t i = 0; i < header.size(); ++i)
    if (header[i] == name) return i;
  std::string known;
  for (const std::string& h : header) known += (known.empty() ? "" : ", ") + h;
  throw DataError(file + ": no column '" + name + "' (" + option + "); its columns: " + known);
}

double number(const std::string& text, const std::string& where, const std::string& col) {
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || !std::isfinite(v))
    throw DataError(where + ": column '" + col + "' = '" + text + "' is not a finite number");
  return v;
}

struct FileSeries {
  std::vector<std::string> header;
  bool grouped = false;             // has the --group column
  std::vector<std::string> groups;  // in order of first appearance ("" when not grouped)
  std::map<std::string, PlotSeries> by_group;
};

FileSeries read_file(const std::string& path, const std::string& xcol, const std::string& ycol,
                     const std::string& gcol, bool log_y) {
  std::ifstream in(path);
  if (!in) throw DataError(path + ": cannot open");
  std::string line;
  int64_t line_no = 0, data_rows = 0;
  std::vector<std::string> header;
  while (header.empty() && std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!trim(line).empty()) header = split_csv(line);
  }
  if (header.empty()) throw DataError(path + ": empty (no CSV header)");
  for (std::string& h : header) h = trim(h);
  FileSeries out;
  out.header = header;
  out.grouped = !gcol.empty() && std::find(header.begin(), header.end(), gcol) != header.end();
  const Columns c{column(header, xcol, path, "--x"), column(header, ycol, path, "--y"),
                  out.grouped ? column(header, gcol, path, "--group") : std::string::npos};
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (trim(line).empty()) continue;
    std::vector<std::string> f = split_csv(line);
    for (std::string& s : f) s = trim(s);
    if (f == header) continue;  // the header again: runs appended to one file
    const std::string where = path + ":" + std::to_string(line_no);
    if (f.size() != header.size())
      throw DataError(where + ": " + std::to_string(f.size()) + " fields, the header has " +
                      std::to_string(header.size()));
    ++data_rows;
    if (f[c.x].empty() || f[c.y].empty()) continue;
    const double x = number(f[c.x], where, xcol), y = number(f[c.y], where, ycol);
    if (log_y && !(y > 0))
      throw DataError(where + ": column '" + ycol + "' = " + f[c.y] + ": --logy needs values > 0");
    const std::string g = c.group == std::string::npos ? "" : f[c.group];
    auto [it, fresh] = out.by_group.try_emplace(g);
    if (fresh) out.groups.push_back(g);
    it->second.x.push_back(x);
    it->second.y.push_back(y);
  }
  // Numeric group values (node ids) in numeric order; other values as they came.
  std::vector<double> keys;
  for (const std::string& g : out.groups) {
    double v = 0;
    const auto [end, ec] = std::from_chars(g.data(), g.data() + g.size(), v);
    if (ec != std::errc() || end != g.data() + g.size()) break;
    keys.push_back(v);
  }
  if (keys.size() == out.groups.size()) {
    std::vector<size_t> order(keys.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return keys[a] < keys[b]; });
    std::vector<std::string> sorted;
    for (size_t i : order) sorted.push_back(out.groups[i]);
    out.groups = std::move(sorted);
  }
  if (data_rows == 0) throw DataError(path + ": no data rows after the header");
  if (out.groups.empty())
    throw DataError(path + ": no row has both '" + xcol + "' and '" + ycol + "' set (" + std::to_string(data_rows) +
                    " rows, every one has an empty " + xcol + " or " + ycol + ")");
  return out;
}

}  // namespace

int plot_command(const std::vector<std::string>& args) {
  namespace po = boost::program_options;
  std::vector<std::string> files;
  std::string x, y, group, out, title;
  bool log_y = false;
  po::options_description opts;
  opts.add_options()("csv", po::value(&files)->multitoken(), "CSV files (plain arguments)")(
      "x", po::value(&x)->required(), "column for the x axis (e.g. step)")(
      "y", po::value(&y)->required(), "column for the y axis (e.g. loss)")(
      "group", po::value(&group), "one series per value of this column (e.g. node)")(
      "logy", po::bool_switch(&log_y), "log-scale y axis")("output,o", po::value(&out), "SVG file (default: stdout)")(
      "title", po::value(&title), "plot title (default: Y vs X)");
  const char* usage = "spes-engine plot CSV... --x COL --y COL [--group COL] [--logy] [-o out.svg] [--title T]";
  if (!parse_args(args, opts, usage, {"csv*"})) return 0;
  if (files.empty()) throw UsageError(std::string("no CSV file given\nusage: ") + usage);

  std::vector<FileSeries> read;
  for (const std::string& path : files) read.push_back(read_file(path, x, y, group, log_y));
  if (!group.empty() && std::none_of(read.begin(), read.end(), [](const FileSeries& f) { return f.grouped; }))
    column(read[0].header, group, files[0], "--group");  // throws: no file has it
  std::vector<PlotSeries> series;
  size_t points = 0;
  for (size_t k = 0; k < files.size(); ++k) {
    const std::string& path = files[k];
    FileSeries& fs = read[k];
    for (const std::string& g : fs.groups) {
      PlotSeries s = std::move(fs.by_group[g]);
      const std::string by = fs.grouped ? group + "=" + g : "";
      s.label = files.size() > 1 ? (by.empty() ? path : path + " " + by) : (by.empty() ? path : by);
      points += s.x.size();
      series.push_back(std::move(s));
    }
  }
  PlotOptions o;
  o.title = title;
  o.x_label = x;
  o.y_label = y;
  o.log_y = log_y;
  const std::string svg = render_svg(series, o);
  if (out.empty()) {
    std::cout << svg << std::flush;
  } else {
    write_file_atomic(out, svg);
    std::cerr << "plot: " << series.size() << " series, " << points << " points -> " << out << "\n";
  }
  return 0;
}

}  // namespace spes
