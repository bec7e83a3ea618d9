// `spes-engine certs CONFIG --out DIR [--host H]... [--days N]`: the run's CA and
// certificates for TLS (net/certs.hpp): DIR/ca.{crt,key}, DIR/coordinator.{crt,key}
// (its subjectAltName: the host of [spes] coordinator, loopback, and every --host)
// and DIR/node-<id>.{crt,key} for each of the config's n_nodes. Keys are 0600;
// copy ca.crt and a node's own pair to that node, and keep ca.key offline.
#include <cstdio>
#include <string>
#include <vector>

#include "engine/args.hpp"
#include "engine/base/error.hpp"
#include "engine/commands.hpp"
#include "engine/config.hpp"
#include "net/address.hpp"
#include "net/certs.hpp"

namespace spes {

int certs_command(const std::vector<std::string>& args) {
  namespace po = boost::program_options;
  ConfigArgs a;
  net::CertRequest r;
  std::vector<std::string> hosts;
  po::options_description opts;
  a.declare(opts, false);
  opts.add_options()("out", po::value(&r.out_dir)->required(), "write the certificates and keys here")(
      "host", po::value(&hosts)->composing(), "another name or IP of the coordinator (repeatable)")(
      "days", po::value(&r.valid_days), "validity in days (default 825)");
  if (!parse_args(args, opts, "spes-engine certs CONFIG --out DIR [--host H]... [--days N]")) return 0;
  const Config cfg = a.load();
  if (r.valid_days <= 0) throw UsageError("--days must be positive");
  r.n_nodes = int(cfg.spes.n_nodes);
  r.coordinator_hosts = hosts;
  r.coordinator_hosts.push_back(net::parse_host_port(cfg.spes.coordinator).host);
  net::make_run_certs(r);
  std::fprintf(stderr, "[certs] %s: ca.crt, coordinator.crt and %d node certificate(s) with their keys (0600)\n",
               r.out_dir.c_str(), r.n_nodes);
  return 0;
}

}  // namespace spes
