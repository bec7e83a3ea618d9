// The coordinator's status documents, rendered from a RunStatus (net/run_status):
// the Prometheus text format (/metrics), the same figures as JSON (/status.json),
// and one self-contained HTML page (/): the run's state, a table of nodes and the
// loss curves of every node as inline SVG (engine/base/svg_plot), refreshing itself
// with a meta tag. No scripts, no external fonts or styles: the page works offline
// and behind any proxy. The metrics' names and meanings: net/README.md, Watching a run.
#pragma once
#include <string>

#include "net/run_status.hpp"

namespace spes::net {

constexpr int kStatusRefreshSeconds = 5;  // the page reloads itself this often

std::string status_metrics(const RunStatus& s);  // text/plain; version=0.0.4
std::string status_json(const RunStatus& s);
std::string status_html(const RunStatus& s);

}  // namespace spes::net
