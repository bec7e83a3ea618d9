// A small SVG line-plot writer for `spes-engine plot` and the coordinator's status
// page (net/status_page): labelled series, axes with
// 1/2/5×10^k ticks (or a log y axis), grid, legend, title, colours from a fixed
// palette. Hand-written rather than a plotting library: no well-kept one ships as
// a static library in Debian (engine/README.md, Commands: plot), and an SVG is just
// text that any browser shows. Knows nothing of CSV files or the model.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace spes {

struct PlotSeries {
  std::string label;
  std::vector<double> x, y;  // same length, finite; drawn in order of x
};

struct PlotOptions {
  std::string title, x_label, y_label;
  bool log_y = false;  // every y must be > 0
};

// An axis: its range and where its ticks go (values, not pixels).
struct PlotAxis {
  double lo = 0, hi = 1;
  double step = 0;  // between linear ticks (0 on a log axis)
  std::vector<double> ticks;
  bool log = false;
};

// [min, max] widened to whole steps of 1, 2 or 5 × 10^k, about `target` ticks (a
// range narrower than 1e-9 of its values: ±10% around them). Throws Error when
// max − min overflows.
PlotAxis linear_axis(double min, double max, int target = 6);
// A log10 axis over [min, max] (min > 0): ticks at powers of ten, or at 1-2-5 /
// 1…9 × 10^k when the range spans less than two decades.
PlotAxis log_axis(double min, double max);
// A tick label: fixed decimals as fine as the tick step, k/M/G for large values.
std::string tick_label(double v, const PlotAxis& axis);

// Text safe inside an XML element or a quoted attribute.
std::string xml_escape(std::string_view s);

// The whole SVG document. Throws Error on an empty series list or series, sizes
// that differ, a non-finite value, y <= 0 with log_y, or values too far apart.
std::string render_svg(const std::vector<PlotSeries>& series, const PlotOptions& opt);

}  // namespace spes
