// The coordinator's status page (net/run_status, net/status_page, net/status_server):
// a figure's history stays bounded and keeps its shape; the documents escape what a
// peer or a config can put in them and show unknown figures as unknown; a live
// coordinator serves, over HTTP, what its nodes reported with their pushes and what
// its rounds CSV says, counts refusals by reason, and binds off loopback only as
// its sync port may. (tests/status_page_test.py checks a real run with the
// Prometheus parser and headless Chromium; test_net_status_hostile, hostile clients.)
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "engine/base/error.hpp"
#include "net/status_page.hpp"
#include "net/status_server.hpp"
#include "net_test_util.hpp"

using namespace spes;
using namespace spes::net;
using namespace spes::net::testing;

namespace {

// "name{labels}" → value, every sample line of a Prometheus text document; fails the
// test on a line that is neither a sample nor a HELP / TYPE comment.
std::map<std::string, double> parse_metrics(const std::string& text) {
  static const std::regex sample(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})?) (\S+)$)");
  static const std::regex comment(R"(^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .*$)");
  std::map<std::string, double> out;
  std::istringstream is(text);
  for (std::string line; std::getline(is, line);) {
    std::smatch m;
    if (std::regex_match(line, comment)) continue;
    REQUIRE_MESSAGE(std::regex_match(line, m, sample), "not a Prometheus sample line: " << line);
    out[m[1]] = m[5] == "NaN" ? NAN : std::stod(m[5]);
  }
  return out;
}

std::vector<std::string> csv_fields(const std::string& line) {
  std::vector<std::string> f;
  std::istringstream is(line);
  for (std::string x; std::getline(is, x, ',');) f.push_back(x);
  return f;
}

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

// The text of the loss plot's div.
std::string loss_plot(const std::string& html) {
  const size_t a = html.find("id=\"loss-plot\"");
  return a == std::string::npos ? "" : html.substr(a, html.find("</div>", a) - a);
}

}  // namespace

TEST_CASE("status: a figure's history stays bounded, keeps its first point and reaches the end") {
  Curve c;
  c.add(0, NAN);  // not finite: skipped
  for (int64_t s = 1; s <= 100000; ++s) c.add(s, 1.0 / double(s));
  const auto& p = c.points();
  CHECK(p.size() < kMaxCurvePoints);
  CHECK(p.size() >= kMaxCurvePoints / 2);
  CHECK(p.front().step == 1);
  CHECK(p.back().step > 100000 - 2 * 100000 / int64_t(p.size()));  // within one stride of the end
  for (size_t i = 1; i < p.size(); ++i) {
    CHECK(p[i].step > p[i - 1].step);
    CHECK(p[i].value == 1.0 / double(p[i].step));
  }
}

TEST_CASE("status: the documents escape what they show and leave unknown figures out") {
  RunStatus s;
  s.run_id = "a\"b\\c\n<script>alert(1)</script>";
  s.codec = "int8";
  s.n_nodes = 3;
  s.round = 7;
  s.step = 70;
  s.state_hash = 0xabcdef;
  s.last.round = 7;
  s.last.participants = 2;
  s.last.missing_nodes = "2";
  s.last.close_ms = 12.5;
  s.refusals = {{"bad_frame", 3}, {"busy", 1}};
  s.nodes.resize(3);
  for (int i = 0; i < 3; ++i) s.nodes[size_t(i)].id = i;
  for (int i = 0; i < 2; ++i) {  // node 2 never reported
    NodeStatus& n = s.nodes[size_t(i)];
    n.connected = i == 0;
    n.reported = true;
    n.last_round_pushed = 7;
    n.figures.step = 70;
    n.figures.loss = 2.5 + i;
    n.figures.tokens_per_s = 1000;
    n.figures.val_ce = i == 0 ? 2.25 : NAN;  // node 1 never evaluated
    n.figures.val_step = i == 0 ? 60 : -1;
    n.figures.sync_ms = 40;
    n.loss = {{10, 4.0}, {70, n.figures.loss}};
    if (i == 0) n.val_ce = {{60, 2.25}};
  }

  const std::string text = status_metrics(s);
  const auto m = parse_metrics(text);
  CHECK(m.at("spes_round") == 7);
  CHECK(m.at("spes_round_close_seconds") == doctest::Approx(0.0125));
  CHECK(m.at("spes_nodes_connected") == 1);
  CHECK(m.count("spes_run_info{run_id=\"a\\\"b\\\\c\\n<script>alert(1)</script>\",codec=\"int8\"}") == 1);
  CHECK(m.at("spes_refusals_total{reason=\"bad_frame\"}") == 3);
  CHECK(m.at("spes_node_loss{node=\"1\"}") == 3.5);
  CHECK(m.count("spes_node_loss{node=\"2\"}") == 0);    // never reported: no sample
  CHECK(m.count("spes_node_val_ce{node=\"1\"}") == 0);  // never evaluated: no sample
  CHECK(m.at("spes_node_val_ce{node=\"0\"}") == 2.25);
  CHECK(m.at("spes_node_connected{node=\"2\"}") == 0);

  const auto j = nlohmann::json::parse(status_json(s));
  CHECK(j["run_id"] == s.run_id);
  CHECK(j["round"] == 7);
  CHECK(j["nodes"].size() == 3);
  CHECK(j["nodes"][1]["val_ce"].is_null());
  CHECK(j["nodes"][2]["loss"].is_null());
  CHECK(j["nodes"][0]["loss_curve"] == nlohmann::json::parse("[[10, 4.0], [70, 2.5]]"));
  CHECK(j["refusals"]["busy"] == 1);

  const std::string html = status_html(s);
  CHECK(html.find("<script>") == std::string::npos);  // the run id is text, not markup
  CHECK(html.find("&lt;script&gt;") != std::string::npos);
  CHECK(count(html, "<tr class=\"node\"") == 3);
  CHECK(count(loss_plot(html), "<polyline") == 2);  // one series per node that reported
  CHECK(html.find("<?xml") == std::string::npos);   // the SVG is inline
  CHECK(html.find("missing 2") != std::string::npos);

  // Figures no real run has (a hostile node's) still give a page: the plot says why it is not there.
  s.nodes[0].loss = {{1, -1e308}, {2, 1e308}};
  const std::string odd = status_html(s);
  CHECK(loss_plot(odd).find("no plot: plot: values too far apart") != std::string::npos);
  CHECK(count(odd, "<tr class=\"node\"") == 3);
}

TEST_CASE("status: a live coordinator serves what the nodes reported and what its rounds CSV says") {
  const Config cfg = tiny_config(3);
  CoordinatorParams params = test_coordinator_params(cfg);
  params.status_address = "127.0.0.1:0";
  CoordThread coord(params, {});
  const uint16_t http = coord.c->status_port();
  REQUIRE(http != 0);
  std::vector<std::unique_ptr<TestNode>> nodes;
  for (int i = 0; i < 3; ++i) nodes.push_back(std::make_unique<TestNode>(cfg, i, coord.address()));
  for (int r = 1; r <= 3; ++r) {
    for (int i = 0; i < 3; ++i) {
      TrainFigures& f = nodes[size_t(i)]->figures;
      f.step = r * 5;
      f.loss = 10 - r + 0.25 * i;
      f.tokens_per_s = 100.0 * (i + 1);
      f.sync_ms = r > 1 ? 20.0 + i : NAN;
      if (r == 2) f.val_ce = 7.5 + i, f.val_step = 10;
    }
    sync_all(nodes);
  }
  {  // one refused connection: a frame that is not one
    RawConn c;
    REQUIRE(c.connect(coord.port()));
    std::array<uint8_t, kNonceBytes> nonce;
    REQUIRE(read_challenge(c, nonce));
    const std::string junk(64, 'x');
    REQUIRE(c.send_all(junk.data(), junk.size()));
    CHECK(c.wait_closed());
  }
  const CoordinatorStats st = coord.c->stats();
  REQUIRE(st.round == 3);
  REQUIRE(wait_until([&] { return coord.c->stats().refused == 1; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // past the documents' render interval

  std::istringstream rows(st.csv_rows);
  std::string line, last;
  while (std::getline(rows, line)) last = line;
  const auto header = csv_fields(Coordinator::csv_header());
  const auto row = csv_fields(last);
  auto col = [&](const std::string& name) {
    for (size_t i = 0; i < header.size(); ++i)
      if (header[i] == name) return row.at(i);
    FAIL("no column " << name);
    return std::string();
  };

  const HttpReply metrics = http_request(http, "/metrics");
  REQUIRE(metrics.status == 200);
  CHECK(metrics.headers.find("text/plain; version=0.0.4") != std::string::npos);
  const auto m = parse_metrics(metrics.body);
  CHECK(m.at("spes_round") == 3);
  CHECK(m.at("spes_step") == std::stod(col("step")));
  CHECK(m.at("spes_round_participants") == std::stod(col("participants")));
  CHECK(m.at("spes_round_received_bytes") == std::stod(col("bytes_in")));
  CHECK(m.at("spes_round_sent_bytes") == std::stod(col("bytes_out")));
  CHECK(std::fabs(m.at("spes_round_close_seconds") * 1000 - std::stod(col("merge_ms"))) <= 0.006);
  CHECK(m.at("spes_nodes_connected") == 3);
  CHECK(m.at("spes_refusals_total{reason=\"bad_frame\"}") == 1);
  double refused = 0, up = 0;
  for (const auto& [k, v] : m) {
    if (k.rfind("spes_refusals_total{", 0) == 0) refused += v;
    if (k.rfind("spes_node_received_bytes_total{", 0) == 0) up += v;
  }
  CHECK(refused == double(st.refused));
  CHECK(up > 0);
  CHECK(up <= m.at("spes_received_bytes_total"));
  for (int i = 0; i < 3; ++i) {
    CAPTURE(i);
    const std::string n = "{node=\"" + std::to_string(i) + "\"}";
    CHECK(m.at("spes_node_loss" + n) == 7 + 0.25 * i);
    CHECK(m.at("spes_node_step" + n) == 15);
    CHECK(m.at("spes_node_last_round_pushed" + n) == 3);
    CHECK(m.at("spes_node_tokens_per_second" + n) == 100.0 * (i + 1));
    CHECK(m.at("spes_node_round_latency_seconds" + n) == doctest::Approx((20.0 + i) / 1000));
    CHECK(m.at("spes_node_val_ce" + n) == 7.5 + i);
  }

  const HttpReply json = http_request(http, "/status.json");
  REQUIRE(json.status == 200);
  const auto j = nlohmann::json::parse(json.body);
  CHECK(j["state_hash"] == col("state_hash"));
  CHECK(j["nodes"][2]["loss_curve"] == nlohmann::json::parse("[[5, 9.5], [10, 8.5], [15, 7.5]]"));
  CHECK(j["nodes"][1]["val_ce_curve"] == nlohmann::json::parse("[[10, 8.5]]"));
  CHECK(j["nodes"][0]["val_step"] == 10);

  const HttpReply page = http_request(http, "/");
  REQUIRE(page.status == 200);
  CHECK(count(page.body, "<tr class=\"node\"") == 3);
  CHECK(count(loss_plot(page.body), "<polyline") == 3);

  CHECK(http_request(http, "/nowhere").status == 404);
  CHECK(http_request(http, "/metrics", "POST").status == 405);
  CHECK(http_request(http, "/metrics?debug=1").status == 200);

  // A node that leaves shows as not connected.
  nodes[1]->client->disconnect();
  CHECK(wait_until([&] {
    return parse_metrics(http_request(http, "/metrics").body).at("spes_node_connected{node=\"1\"}") == 0;
  }));
}

TEST_CASE("status: the page binds off loopback only as the sync port may") {
  Config cfg = tiny_config(1);
  CoordinatorParams p = test_coordinator_params(cfg, "");
  p.status_address = "0.0.0.0:0";
  CoordinatorOptions opt;
  opt.port = 0;
  opt.fresh = true;
  opt.log = false;
  opt.chunk_elems = 1024;
  const test::TempDir dir("status-bind");
  p.state_dir = dir.path.string();
  CHECK_THROWS_WITH_AS(Coordinator(p, opt), doctest::Contains("status page bind address 0.0.0.0"), NetError);
  p.allow_insecure = true;
  CHECK(Coordinator(p, opt).status_port() != 0);
  p.allow_insecure = false;
  p.secret = "test-secret-0123456789";
  CHECK(Coordinator(p, opt).status_port() != 0);
  p.status_address = "";
  CHECK(Coordinator(p, opt).status_port() == 0);  // off
  p.status_address = "127.0.0.1:nope";
  CHECK_THROWS_AS(Coordinator(p, opt), NetError);
}

TEST_CASE("status server: each bound closes the connection that breaks it; the newest connection is served") {
  StatusLimits lim;
  lim.max_connections = 4;
  lim.request_timeout_s = 0.5;
  RunStatus s;
  s.run_id = "bounds";
  std::atomic<int> renders{0};
  StatusServer server("127.0.0.1", 0, [&] { return ++renders, s; }, lim);
  const uint16_t port = server.port();
  CHECK(server.url() == "http://127.0.0.1:" + std::to_string(port) + "/");
  auto open = [&] {
    auto c = std::make_unique<RawConn>();
    REQUIRE(c->connect(port));
    return c;
  };
  SUBCASE("a header over 8 KiB") {
    auto c = open();
    const std::string req = "GET / HTTP/1.1\r\nX-Long: " + std::string(64 << 10, 'a') + "\r\n\r\n";
    c->send_all(req.data(), req.size());  // may fail part-way: the server closes at 8 KiB
    std::string got(12, '\0');
    const bool answered = c->recv_all(got.data(), got.size(), 2.0);
    CHECK(!(answered && got.rfind("HTTP/1.1 200", 0) == 0));
    CHECK((answered || c->wait_closed(0.1)));  // refused at once (EOF or a reset), not left hanging
  }
  SUBCASE("a request line that never ends") {
    auto c = open();
    const auto t0 = std::chrono::steady_clock::now();
    bool open_still = true;
    for (int i = 0; i < 400 && open_still; ++i) {  // 2 s of one byte every 5 ms
      open_still = c->send_all(i == 0 ? "GET /" : "a", i == 0 ? 5 : 1);
      pollfd pf{c->fd, POLLIN, 0};
      if (::poll(&pf, 1, 5) > 0) open_still = false;  // EOF (or an answer, which would be wrong too)
    }
    const double s_open = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(!open_still);
    CHECK(s_open < 1.5);  // request_timeout_s 0.5
  }
  SUBCASE("a body") {
    auto c = open();
    const std::string req = "GET / HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello";
    REQUIRE(c->send_all(req.data(), req.size()));
    CHECK(c->wait_closed(2.0));
  }
  SUBCASE("more connections than max_connections: the oldest make way") {
    std::vector<std::unique_ptr<RawConn>> idle;
    for (int i = 0; i < 10; ++i) idle.push_back(open());
    const HttpReply r = http_request(port, "/status.json");
    CHECK(r.status == 200);
    int closed = 0;
    for (auto& c : idle) closed += c->wait_closed(0.2);
    CHECK(closed >= 10 - lim.max_connections + 1);  // the newest request took a place too
    CHECK(closed <= 10);
  }
  SUBCASE("documents are rendered at most once per render_every_s, however often asked") {
    const int before = renders;
    for (int i = 0; i < 20; ++i) REQUIRE(http_request(port, "/metrics").status == 200);
    CHECK(renders - before <= 2);
  }
}
