#include "net/status_page.hpp"

#include <cinttypes>
#include <cmath>
#include <ctime>
#include <nlohmann/json.hpp>

#include "engine/base/format.hpp"
#include "engine/base/svg_plot.hpp"
#include "net/digest.hpp"

namespace spes::net {

namespace {

// ---- Prometheus text format (version 0.0.4) --------------------------------------

std::string label_value(const std::string& v) {
  std::string o;
  for (char c : v) {
    if (c == '\\') o += "\\\\";
    else if (c == '"') o += "\\\"";
    else if (c == '\n') o += "\\n";
    else o += c;
  }
  return o;
}

std::string number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 9e15) return strprintf("%" PRId64, int64_t(v));
  return strprintf("%.15g", v);
}

class MetricsText {
 public:
  // A family's HELP and TYPE lines, then its samples.
  MetricsText& family(const char* name, const char* type, const char* help) {
    name_ = name;
    out_ += strprintf("# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
    return *this;
  }
  MetricsText& sample(double v, const std::string& labels = "") {
    out_ += name_ + (labels.empty() ? "" : "{" + labels + "}") + " " + number(v) + "\n";
    return *this;
  }
  // One sample per node that has the figure (NaN: the node did not report it).
  template <class F>
  MetricsText& per_node(const RunStatus& s, F&& value) {
    for (const NodeStatus& n : s.nodes) {
      const double v = value(n);
      if (!std::isnan(v)) sample(v, strprintf("node=\"%d\"", n.id));
    }
    return *this;
  }
  std::string str() const { return out_; }

 private:
  std::string name_, out_;
};

double figure(const NodeStatus& n, double v) { return n.reported ? v : NAN; }

// ---- HTML ------------------------------------------------------------------------

std::string esc(const std::string& s) { return xml_escape(s); }

std::string or_dash(double v, const char* fmt) { return std::isfinite(v) ? strprintf(fmt, v) : "&#8212;"; }

std::string bytes_text(int64_t b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  double v = double(b);
  int u = 0;
  while (v >= 1000 && u < 4) v /= 1000, ++u;
  return u == 0 ? strprintf("%" PRId64 " B", b) : strprintf("%.1f %s", v, units[u]);
}

std::string utc_time(double unix_s) {
  const std::time_t t = std::time_t(unix_s);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

// One series per node that reported the figure; the SVG without its XML prolog
// (inline in HTML), or a line saying why there is none.
std::string plot(const RunStatus& s, std::vector<CurvePoint> NodeStatus::*curve, const char* id, const char* title,
                 const char* y_label) {
  std::vector<PlotSeries> series;
  for (const NodeStatus& n : s.nodes) {
    const std::vector<CurvePoint>& pts = n.*curve;
    if (pts.empty()) continue;
    PlotSeries ps;
    ps.label = "node " + std::to_string(n.id);
    for (const CurvePoint& p : pts) ps.x.push_back(double(p.step)), ps.y.push_back(p.value);
    series.push_back(std::move(ps));
  }
  std::string body;
  if (series.empty()) {
    body = "<p class=\"none\">no figures reported yet</p>";
  } else {
    try {
      PlotOptions o;
      o.title = title;
      o.x_label = "step";
      o.y_label = y_label;
      body = render_svg(series, o);
      body.erase(0, body.find("<svg"));
    } catch (const std::exception& e) {  // e.g. values too far apart for an axis
      body = "<p class=\"none\">no plot: " + esc(e.what()) + "</p>";
    }
  }
  return strprintf("<div class=\"plot\" id=\"%s\">\n", id) + body + "</div>\n";
}

constexpr const char* kStyle =
    "body{font-family:sans-serif;margin:1.5em;color:#222}"
    "table{border-collapse:collapse;margin:1em 0}"
    "th,td{border:1px solid #ccc;padding:4px 10px;text-align:right;white-space:nowrap}"
    "th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}"
    ".down{color:#b00}.up{color:#070}.none{color:#777}.state{line-height:1.6}"
    "code{background:#f3f3f3;padding:0 3px}";

}  // namespace

std::string status_metrics(const RunStatus& s) {
  MetricsText m;
  int connected = 0;
  for (const NodeStatus& n : s.nodes) connected += n.connected;
  m.family("spes_run_info", "gauge", "The run: its id and codec (the value is 1).")
      .sample(1, "run_id=\"" + label_value(s.run_id) + "\",codec=\"" + label_value(s.codec) + "\"");
  m.family("spes_nodes", "gauge", "Nodes of the run.").sample(s.n_nodes);
  m.family("spes_nodes_connected", "gauge", "Nodes with an authenticated connection now.").sample(connected);
  m.family("spes_round", "gauge", "Rounds completed (the state the coordinator holds).").sample(double(s.round));
  m.family("spes_step", "gauge", "The step of the last round completed.").sample(double(s.step));
  m.family("spes_round_pushed", "gauge", "Nodes whose push of the open round is complete.").sample(s.pushed);
  m.family("spes_round_participants", "gauge", "Nodes the last round merged (rounds.csv participants).")
      .sample(s.last.participants);
  m.family("spes_round_late_pushes", "gauge", "Stale pushes refused while the last round was open.")
      .sample(double(s.last.late_pushes));
  m.family("spes_round_received_bytes", "gauge", "Bytes received for the last round (rounds.csv bytes_in).")
      .sample(double(s.last.bytes_in));
  m.family("spes_round_sent_bytes", "gauge", "Bytes of the last round's result over its recipients (rounds.csv bytes_out).")
      .sample(double(s.last.bytes_out));
  m.family("spes_round_merge_alpha", "gauge", "The expert-merging warm-up's alpha at the last round.")
      .sample(s.last.merge_alpha);
  m.family("spes_round_close_seconds", "gauge", "The last round's close: merge and write-ahead persist (rounds.csv merge_ms).")
      .sample(s.last.close_ms / 1000.0);
  m.family("spes_round_closed_timestamp_seconds", "gauge", "When the last round closed (Unix time; 0: none yet).")
      .sample(s.last.closed_at_unix_s);
  m.family("spes_state_bytes", "gauge", "Bytes on disk in state_dir (the state files).").sample(double(s.state_bytes));
  m.family("spes_received_bytes_total", "counter", "Bytes read from every connection.").sample(double(s.bytes_in));
  m.family("spes_sent_bytes_total", "counter", "Bytes written to every connection.").sample(double(s.bytes_out));
  m.family("spes_connections_total", "counter", "Connections accepted.").sample(double(s.connections));
  m.family("spes_snapshots_total", "counter", "Snapshots sent.").sample(double(s.snapshots));
  m.family("spes_dropped_total", "counter", "Sessions closed by a deadline (heartbeat, read, write).")
      .sample(double(s.dropped));
  m.family("spes_refusals_total", "counter", "Connections refused, by reason (the Error code sent).");
  for (const auto& [reason, n] : s.refusals) m.sample(double(n), "reason=\"" + label_value(reason) + "\"");
  m.family("spes_push_refusals_total", "counter", "Pushes refused as a whole, by reason (update_bound, non_finite, ...).");
  for (const auto& [reason, n] : s.push_refusals) m.sample(double(n), "reason=\"" + label_value(reason) + "\"");
  m.family("spes_max_update_ratio", "gauge", "The largest update size / bound of an accepted push (1 would be refused).")
      .sample(s.max_update_ratio);
  m.family("spes_uptime_seconds", "gauge", "Seconds since the coordinator started.").sample(s.uptime_s);
  m.family("spes_node_connected", "gauge", "1 while the node has an authenticated connection.")
      .per_node(s, [](const NodeStatus& n) { return double(n.connected); });
  m.family("spes_node_last_round_pushed", "gauge", "The last round the node's push completed (0: none yet).")
      .per_node(s, [](const NodeStatus& n) { return double(n.last_round_pushed); });
  m.family("spes_node_received_bytes_total", "counter", "Bytes read from the node's connections (its uploads).")
      .per_node(s, [](const NodeStatus& n) { return double(n.bytes_up); });
  m.family("spes_node_sent_bytes_total", "counter", "Bytes written to the node's connections (its downloads).")
      .per_node(s, [](const NodeStatus& n) { return double(n.bytes_down); });
  m.family("spes_node_round_latency_seconds", "gauge", "Wall time of the node's previous sync round, as it reports.")
      .per_node(s, [](const NodeStatus& n) { return figure(n, n.figures.sync_ms / 1000.0); });
  m.family("spes_node_step", "gauge", "The node's optimizer step at its last push, as it reports.")
      .per_node(s, [](const NodeStatus& n) { return figure(n, double(n.figures.step)); });
  m.family("spes_node_loss", "gauge", "The node's training loss at that step, as it reports.")
      .per_node(s, [](const NodeStatus& n) { return figure(n, n.figures.loss); });
  m.family("spes_node_tokens_per_second", "gauge", "The node's training tokens per second, as it reports.")
      .per_node(s, [](const NodeStatus& n) { return figure(n, n.figures.tokens_per_s); });
  m.family("spes_node_val_ce", "gauge", "The node's last validation cross-entropy, as it reports.")
      .per_node(s, [](const NodeStatus& n) { return figure(n, n.figures.val_ce); });
  return m.str();
}

std::string status_json(const RunStatus& s) {
  using nlohmann::json;
  auto num = [](double v) { return std::isfinite(v) ? json(v) : json(nullptr); };
  auto curve = [](const std::vector<CurvePoint>& pts) {
    json a = json::array();
    for (const CurvePoint& p : pts) a.push_back({p.step, p.value});
    return a;
  };
  json refusals = json::object();
  for (const auto& [reason, n] : s.refusals) refusals[reason] = n;
  json push_refusals = json::object();
  for (const auto& [reason, n] : s.push_refusals) push_refusals[reason] = n;
  json nodes = json::array();
  for (const NodeStatus& n : s.nodes) {
    const bool r = n.reported;
    nodes.push_back({{"id", n.id},
                     {"connected", n.connected},
                     {"last_round_pushed", n.last_round_pushed},
                     {"bytes_up", n.bytes_up},
                     {"bytes_down", n.bytes_down},
                     {"step", r ? json(n.figures.step) : json(nullptr)},
                     {"loss", num(r ? n.figures.loss : NAN)},
                     {"tokens_per_s", num(r ? n.figures.tokens_per_s : NAN)},
                     {"val_ce", num(r ? n.figures.val_ce : NAN)},
                     {"val_step", r && n.figures.val_step >= 0 ? json(n.figures.val_step) : json(nullptr)},
                     {"round_latency_s", num(r ? n.figures.sync_ms / 1000.0 : NAN)},
                     {"loss_curve", curve(n.loss)},
                     {"val_ce_curve", curve(n.val_ce)}});
  }
  const json j = {{"run_id", s.run_id},
                  {"codec", s.codec},
                  {"n_nodes", s.n_nodes},
                  {"round", s.round},
                  {"step", s.step},
                  {"state_hash", hash_hex(s.state_hash)},
                  {"pushed", s.pushed},
                  {"last_round",
                   {{"round", s.last.round},
                    {"step", s.last.step},
                    {"participants", s.last.participants},
                    {"missing_nodes", s.last.missing_nodes},
                    {"late_pushes", s.last.late_pushes},
                    {"bytes_in", s.last.bytes_in},
                    {"bytes_out", s.last.bytes_out},
                    {"merge_alpha", s.last.merge_alpha},
                    {"close_s", s.last.close_ms / 1000.0},
                    {"closed_at_unix_s", s.last.closed_at_unix_s}}},
                  {"state_bytes", s.state_bytes},
                  {"bytes_in", s.bytes_in},
                  {"bytes_out", s.bytes_out},
                  {"connections", s.connections},
                  {"snapshots", s.snapshots},
                  {"dropped", s.dropped},
                  {"refusals", refusals},
                  {"push_refusals", push_refusals},
                  {"max_update_ratio", s.max_update_ratio},
                  {"uptime_s", s.uptime_s},
                  {"nodes", nodes}};
  return j.dump(1) + "\n";
}

std::string status_html(const RunStatus& s) {
  int connected = 0;
  for (const NodeStatus& n : s.nodes) connected += n.connected;
  std::string o;
  o += "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
  o += strprintf("<meta http-equiv=\"refresh\" content=\"%d\">\n", kStatusRefreshSeconds);
  o += "<link rel=\"icon\" href=\"data:,\">\n";  // no favicon request (a 404 in the console)
  o += "<title>" + esc(s.run_id) + strprintf(": round %" PRId64 "</title>\n", s.round);
  o += std::string("<style>") + kStyle + "</style>\n</head>\n<body>\n";
  o += "<h1>spes-engine run <code>" + esc(s.run_id) + "</code></h1>\n<p class=\"state\" id=\"state\">";
  o += strprintf("<b>round %" PRId64 "</b> completed (step %" PRId64 "), state hash <code>%s</code><br>\n", s.round,
                 s.step, hash_hex(s.state_hash).c_str());
  if (s.last.round > 0)  // (strprintf holds 512 bytes: the missing nodes' list goes on its own)
    o += strprintf("last round closed %s: %d participant(s)", utc_time(s.last.closed_at_unix_s).c_str(),
                   s.last.participants) +
         (s.last.missing_nodes.empty() ? "" : ", missing " + esc(s.last.missing_nodes)) +
         strprintf(", %.1f ms to merge and persist, %s in, %s out<br>\n", s.last.close_ms,
                   bytes_text(s.last.bytes_in).c_str(), bytes_text(s.last.bytes_out).c_str());
  o += strprintf("round %" PRId64 " open: %d of %d node(s) pushed; %d of %d connected; codec %s; %s on disk; "
                 "up %.0f s<br>\n",
                 s.round + 1, s.pushed, s.n_nodes, connected, s.n_nodes, s.codec.c_str(),
                 bytes_text(s.state_bytes).c_str(), s.uptime_s);
  int64_t refused = 0;
  for (const auto& r : s.refusals) refused += r.second;
  o += strprintf("%" PRId64 " connection(s) accepted, %" PRId64 " refused, %" PRId64 " dropped; this page reloads "
                 "every %d s</p>\n",
                 s.connections, refused, s.dropped, kStatusRefreshSeconds);
  o += "<table id=\"nodes\">\n<thead><tr><th>node</th><th>connection</th><th>last round pushed</th><th>step</th>"
       "<th>loss</th><th>tokens/s</th><th>val CE</th><th>round latency</th><th>uploaded</th><th>downloaded</th>"
       "</tr></thead>\n<tbody>\n";
  for (const NodeStatus& n : s.nodes) {
    const TrainFigures& f = n.figures;
    o += strprintf("<tr class=\"node\" data-node=\"%d\"><td>node %d</td>", n.id, n.id);
    o += n.connected ? "<td class=\"up\">connected</td>" : "<td class=\"down\">not connected</td>";
    o += n.last_round_pushed > 0 ? strprintf("<td>%" PRId64 "</td>", n.last_round_pushed) : "<td>&#8212;</td>";
    o += n.reported ? strprintf("<td>%" PRId64 "</td>", f.step) : "<td>&#8212;</td>";
    o += "<td>" + or_dash(n.reported ? f.loss : NAN, "%.4f") + "</td>";
    o += "<td>" + or_dash(n.reported ? f.tokens_per_s : NAN, "%.0f") + "</td>";
    o += "<td>" + or_dash(n.reported ? f.val_ce : NAN, "%.4f") +
         (n.reported && f.val_step >= 0 ? strprintf(" (step %" PRId64 ")", f.val_step) : "") + "</td>";
    o += "<td>" + or_dash(n.reported ? f.sync_ms : NAN, "%.0f ms") + "</td>";
    o += "<td>" + bytes_text(n.bytes_up) + "</td><td>" + bytes_text(n.bytes_down) + "</td></tr>\n";
  }
  o += "</tbody>\n</table>\n";
  o += "<h2>Training loss</h2>\n" + plot(s, &NodeStatus::loss, "loss-plot", "training loss per node", "loss");
  o += "<h2>Validation cross-entropy</h2>\n" +
       plot(s, &NodeStatus::val_ce, "val-plot", "validation CE per node", "val CE (nats/token)");
  o += "<p class=\"none\">The same figures: <a href=\"/metrics\">/metrics</a> (Prometheus), "
       "<a href=\"/status.json\">/status.json</a>.</p>\n</body>\n</html>\n";
  return o;
}

}  // namespace spes::net
