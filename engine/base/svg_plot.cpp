#include "engine/base/svg_plot.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "engine/base/error.hpp"

namespace spes {

namespace {

// matplotlib's "tab10": ten colours that stay apart on white; after ten, the
// cycle repeats dashed, then dotted.
constexpr const char* kPalette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
constexpr int kPaletteSize = int(sizeof(kPalette) / sizeof(kPalette[0]));
constexpr const char* kDashes[] = {"", "6 3", "2 2"};

// Plot area and margins, in pixels.
constexpr double kLeft = 80, kTop = 50, kWidth = 640, kHeight = 360, kBottom = 60, kLegendGap = 20;
constexpr double kLegendRow = 20, kCharWidth = 7;  // 12px sans-serif averages under 7px a character
constexpr size_t kMaxLabelChars = 60;
constexpr size_t kMarkersUpTo = 40;  // sparse series (eval points, rounds) get a dot per point

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}
std::string px(double v) { return fmt("%.2f", v); }

std::string truncated(const std::string& s) {
  if (s.size() <= kMaxLabelChars) return s;
  size_t cut = kMaxLabelChars - 1;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // not inside a UTF-8 character
  return s.substr(0, cut) + "\u2026";
}

}  // namespace

PlotAxis linear_axis(double min, double max, int target) {
  if (!std::isfinite(max - min)) throw Error("plot: values too far apart for one axis");
  // No range, or one too narrow for a double to count its steps (k·step would stop
  // moving): a band of ±10% around the values instead.
  if (!(max - min > 1e-9 * std::max(std::fabs(min), std::fabs(max)))) {
    const double mid = min / 2 + max / 2, d = mid == 0 ? 1.0 : std::fabs(mid) * 0.1;
    min = mid - d;
    max = mid + d;
  }
  const double raw = (max - min) / std::max(target, 1);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double n = raw / mag;
  PlotAxis a;
  a.step = (n < 1.5 ? 1 : n < 3 ? 2 : n < 7 ? 5 : 10) * mag;
  const double k0 = std::floor(min / a.step * (1 + 1e-12)), k1 = std::ceil(max / a.step * (1 - 1e-12));
  a.lo = k0 * a.step;
  a.hi = k1 * a.step;
  for (double k = k0; k <= k1 + 0.5; ++k) a.ticks.push_back(k == 0 ? 0.0 : k * a.step);
  return a;
}

PlotAxis log_axis(double min, double max) {
  if (!(max > min)) {
    min /= 1.5;
    max *= 1.5;
  }
  PlotAxis a;
  a.log = true;
  const double lmin = std::log10(min), lmax = std::log10(max);
  const int dlo = int(std::floor(lmin)), dhi = int(std::ceil(lmax));
  if (dhi - dlo >= 2) {  // two decades or more: whole decades, at most ~8 labelled
    a.lo = std::pow(10.0, dlo);
    a.hi = std::pow(10.0, dhi);
    const int every = (dhi - dlo + 7) / 8;
    for (int d = dlo; d <= dhi; d += every) a.ticks.push_back(std::pow(10.0, d));
    return a;
  }
  const double pad = 0.05 * (lmax - lmin);
  a.lo = std::pow(10.0, lmin - pad);
  a.hi = std::pow(10.0, lmax + pad);
  for (const std::vector<int>& mantissas : {std::vector<int>{1, 2, 5}, std::vector<int>{1, 2, 3, 4, 5, 6, 7, 8, 9}}) {
    a.ticks.clear();
    for (int d = dlo - 1; d <= dhi; ++d)
      for (int m : mantissas) {
        const double t = m * std::pow(10.0, d);
        if (t >= a.lo && t <= a.hi) a.ticks.push_back(t);
      }
    if (a.ticks.size() >= 3) return a;
  }
  if (a.ticks.size() < 2) {  // a narrow range inside one decade: linear ticks, placed on the log scale
    a.ticks.clear();
    for (double t : linear_axis(a.lo, a.hi, 4).ticks)
      if (t >= a.lo && t <= a.hi) a.ticks.push_back(t);
  }
  return a;
}

std::string tick_label(double v, const PlotAxis& axis) {
  if (axis.log || axis.step <= 0) return fmt("%.6g", v);
  if (std::fabs(v) < axis.step * 1e-6) return "0";
  const double big = std::max(std::fabs(axis.lo), std::fabs(axis.hi));
  auto decimals = [](double step) { return std::max(0, -int(std::floor(std::log10(step) + 1e-9))); };
  if (big >= 1e4 && big < 1e15) {
    static const char* kSuffix[] = {"", "k", "M", "G", "T"};
    const int e3 = std::min(4, int(std::floor(std::log10(big) / 3)));
    const double unit = std::pow(1000.0, e3);
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.*f%s", decimals(axis.step / unit), v / unit, kSuffix[e3]);
    return buf;
  }
  const int d = decimals(axis.step);
  if (d > 6 || big >= 1e15) return fmt("%.3g", v);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", d, v);
  return buf;
}

std::string xml_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default:
        // Control characters other than tab/newline are not allowed in XML 1.0.
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n') out += ' ';
        else out += c;
    }
  }
  return out;
}

std::string render_svg(const std::vector<PlotSeries>& series, const PlotOptions& opt) {
  if (series.empty()) throw Error("plot: no series to draw");
  double xmin = INFINITY, xmax = -INFINITY, ymin = INFINITY, ymax = -INFINITY;
  size_t longest = 0;
  for (const PlotSeries& s : series) {
    if (s.x.empty() || s.x.size() != s.y.size())
      throw Error("plot: series '" + s.label + "' has " + std::to_string(s.x.size()) + " x and " +
                  std::to_string(s.y.size()) + " y values");
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i]))
        throw Error("plot: series '" + s.label + "' has a non-finite value");
      if (opt.log_y && !(s.y[i] > 0))
        throw Error("plot: series '" + s.label + "' has y = " + fmt("%g", s.y[i]) + ", a log axis needs y > 0");
      xmin = std::min(xmin, s.x[i]), xmax = std::max(xmax, s.x[i]);
      ymin = std::min(ymin, s.y[i]), ymax = std::max(ymax, s.y[i]);
    }
    longest = std::max(longest, truncated(s.label).size());
  }
  const PlotAxis xa = linear_axis(xmin, xmax), ya = opt.log_y ? log_axis(ymin, ymax) : linear_axis(ymin, ymax);
  auto X = [&](double x) { return kLeft + (x - xa.lo) / (xa.hi - xa.lo) * kWidth; };
  const double ylo = ya.log ? std::log10(ya.lo) : ya.lo, yhi = ya.log ? std::log10(ya.hi) : ya.hi;
  auto Y = [&](double y) { return kTop + kHeight - ((ya.log ? std::log10(y) : y) - ylo) / (yhi - ylo) * kHeight; };

  const double legend_x = kLeft + kWidth + kLegendGap;
  const double width = legend_x + 36 + kCharWidth * double(longest) + 10;
  const double height = std::max(kTop + kHeight + kBottom, kTop + kLegendRow * double(series.size()) + 10);
  const std::string title = opt.title.empty() ? opt.y_label + " vs " + opt.x_label : opt.title;
  std::string o;
  o += "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  o += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + px(width) + "\" height=\"" + px(height) +
       "\" viewBox=\"0 0 " + px(width) + " " + px(height) + "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  o += "<title>" + xml_escape(title) + "</title>\n";
  o += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o += "<text x=\"" + px(kLeft + kWidth / 2) + "\" y=\"28\" text-anchor=\"middle\" font-size=\"16\" font-weight=\"bold\">" +
       xml_escape(title) + "</text>\n";

  // Grid and ticks.
  o += "<g stroke=\"#e0e0e0\" stroke-width=\"1\">\n";
  for (double t : xa.ticks)
    o += "<line x1=\"" + px(X(t)) + "\" y1=\"" + px(kTop) + "\" x2=\"" + px(X(t)) + "\" y2=\"" + px(kTop + kHeight) + "\"/>\n";
  for (double t : ya.ticks)
    o += "<line x1=\"" + px(kLeft) + "\" y1=\"" + px(Y(t)) + "\" x2=\"" + px(kLeft + kWidth) + "\" y2=\"" + px(Y(t)) + "\"/>\n";
  o += "</g>\n";
  o += "<rect x=\"" + px(kLeft) + "\" y=\"" + px(kTop) + "\" width=\"" + px(kWidth) + "\" height=\"" + px(kHeight) +
       "\" fill=\"none\" stroke=\"#333333\"/>\n";
  o += "<g text-anchor=\"middle\" fill=\"#333333\">\n";
  for (double t : xa.ticks)
    o += "<line x1=\"" + px(X(t)) + "\" y1=\"" + px(kTop + kHeight) + "\" x2=\"" + px(X(t)) + "\" y2=\"" +
         px(kTop + kHeight + 5) + "\" stroke=\"#333333\"/><text x=\"" + px(X(t)) + "\" y=\"" + px(kTop + kHeight + 19) +
         "\">" + xml_escape(tick_label(t, xa)) + "</text>\n";
  o += "</g>\n<g text-anchor=\"end\" fill=\"#333333\">\n";
  for (double t : ya.ticks)
    o += "<line x1=\"" + px(kLeft - 5) + "\" y1=\"" + px(Y(t)) + "\" x2=\"" + px(kLeft) + "\" y2=\"" + px(Y(t)) +
         "\" stroke=\"#333333\"/><text x=\"" + px(kLeft - 8) + "\" y=\"" + px(Y(t) + 4) + "\">" +
         xml_escape(tick_label(t, ya)) + "</text>\n";
  o += "</g>\n";
  o += "<text x=\"" + px(kLeft + kWidth / 2) + "\" y=\"" + px(kTop + kHeight + 42) + "\" text-anchor=\"middle\">" +
       xml_escape(opt.x_label) + "</text>\n";
  const std::string ylabel = opt.y_label + (opt.log_y ? " (log scale)" : "");
  o += "<text transform=\"translate(18 " + px(kTop + kHeight / 2) + ") rotate(-90)\" text-anchor=\"middle\">" +
       xml_escape(ylabel) + "</text>\n";

  // Series: a line through the points in x order; dots too when there are few.
  for (size_t k = 0; k < series.size(); ++k) {
    const PlotSeries& s = series[k];
    const std::string colour = kPalette[k % kPaletteSize];
    const char* dash = kDashes[(k / kPaletteSize) % 3];
    std::vector<size_t> order(s.x.size());
    std::iota(order.begin(), order.end(), size_t(0));
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return s.x[a] < s.x[b]; });
    o += "<g>\n<title>" + xml_escape(s.label) + "</title>\n<polyline fill=\"none\" stroke=\"" + colour +
         "\" stroke-width=\"1.5\" stroke-linejoin=\"round\"" +
         (*dash ? std::string(" stroke-dasharray=\"") + dash + "\"" : std::string()) + " points=\"";
    for (size_t i : order) o += px(X(s.x[i])) + "," + px(Y(s.y[i])) + " ";
    o += "\"/>\n";
    if (s.x.size() <= kMarkersUpTo)
      for (size_t i : order)
        o += "<circle cx=\"" + px(X(s.x[i])) + "\" cy=\"" + px(Y(s.y[i])) + "\" r=\"2.5\" fill=\"" + colour + "\"/>\n";
    o += "</g>\n";
  }

  // Legend, right of the plot.
  o += "<g>\n";
  for (size_t k = 0; k < series.size(); ++k) {
    const double y = kTop + 10 + kLegendRow * double(k);
    const char* dash = kDashes[(k / kPaletteSize) % 3];
    o += "<line x1=\"" + px(legend_x) + "\" y1=\"" + px(y) + "\" x2=\"" + px(legend_x + 26) + "\" y2=\"" + px(y) +
         "\" stroke=\"" + kPalette[k % kPaletteSize] + "\" stroke-width=\"2\"" +
         (*dash ? std::string(" stroke-dasharray=\"") + dash + "\"" : std::string()) + "/><text x=\"" +
         px(legend_x + 32) + "\" y=\"" + px(y + 4) + "\">" + xml_escape(truncated(series[k].label)) + "</text>\n";
  }
  o += "</g>\n</svg>\n";
  return o;
}

}  // namespace spes
