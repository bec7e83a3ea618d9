// The run's certificates for TLS (net/README.md, Security), made with OpenSSL's C API
// so a user never needs the openssl CLI: a CA, the coordinator's certificate (its
// host in the subjectAltName, so nodes check they reached the right machine) and one
// certificate per node naming its node id (CN and DNS SAN "node-<id>"), which the
// coordinator matches against the node id claimed in Hello. Ed25519 keys; private
// keys are written 0600. `spes-engine certs` (engine/cmd_certs.cpp) calls this.
#pragma once
#include <string>
#include <vector>

namespace spes::net {

struct CertRequest {
  std::string out_dir;
  int n_nodes = 1;
  std::vector<std::string> coordinator_hosts;  // IPs or DNS names for the coordinator's SAN
  double valid_from_days = 0;                  // notBefore, days from now (tests: negative)
  double valid_days = 825;                     // notAfter, days from now (tests: negative = expired)
};

// DIR/ca.{crt,key}, DIR/coordinator.{crt,key}, DIR/node-<id>.{crt,key}. Throws NetError.
void make_run_certs(const CertRequest& r);
// One node certificate signed by the CA in `ca_dir` (tests: expired, or for a given id).
void make_node_cert(const std::string& ca_dir, const std::string& out_dir, int node_id, double valid_from_days,
                    double valid_days);

std::string node_cert_name(int node_id);  // "node-<id>"
// The node id a node certificate names, or -1.
int node_id_from_name(const std::string& common_name);

}  // namespace spes::net
