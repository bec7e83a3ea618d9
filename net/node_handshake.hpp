// A node's side of the handshake on a freshly opened link: Challenge → Hello →
// Welcome. Each side proves the shared secret with an HMAC over the other's nonce
// (without a secret the key is empty and the proofs prove nothing: check_insecure
// allows that only on loopback, over TLS, or when the config says so). The Welcome
// says how far the coordinator is and how it cuts θ into chunks.
#pragma once
#include <cstdint>
#include <optional>

#include "net/digest.hpp"
#include "net/node_link.hpp"
#include "net/sync_client.hpp"

namespace spes::net {

// What the coordinator's Welcome told this node.
struct Welcome {
  int64_t coordinator_round = 0;     // its completed round
  int64_t chunk_elems = 0;           // the grid's chunk size (checked)
  bool in_sync = false;              // this node holds θ of that round
  int64_t rolled_back_to = -1;       // the round `--rollback-to` restarted the run from (-1: never)
  std::optional<Digest> frame_key;   // shared-secret mode without TLS: the frames' MAC key
};

// Hello says: this node, its run, model fingerprint and codec, the round it holds
// and the hash of its θ (0: it knows it must resync). Throws Refused when the
// coordinator speaks another protocol version, fails its proof or runs another
// number of nodes; Transient on anything malformed.
Welcome handshake(NodeLink& link, const SyncClientParams& node, int64_t round, uint64_t state_hash);

}  // namespace spes::net
