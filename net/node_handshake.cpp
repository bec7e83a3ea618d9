#include "net/node_handshake.hpp"

#include <cstring>
#include <span>

#include "net/codec.hpp"
#include "net/frame_mac.hpp"

namespace spes::net {

Welcome handshake(NodeLink& link, const SyncClientParams& node, int64_t round, uint64_t state_hash) {
  const wire::Envelope* env = link.read(kMaxHandshakeFrameBytes, link.connect_timeout_s());
  if (env->msg_type() != wire::Message_Challenge) throw Transient("coordinator did not send a Challenge");
  const auto* ch = env->msg_as_Challenge();
  if (ch->protocol_version() != kProtocolVersion)
    throw Refused(wire::ErrorCode_protocol_version,
                  "protocol version mismatch: coordinator speaks " + std::to_string(ch->protocol_version()) +
                      ", this node " + std::to_string(kProtocolVersion));
  if (vec_size(ch->nonce()) != kNonceBytes) throw Transient("bad Challenge from the coordinator");
  std::array<uint8_t, kNonceBytes> server_nonce;
  std::memcpy(server_nonce.data(), ch->nonce()->data(), kNonceBytes);

  HelloFields h;
  h.run_id = node.run_id;
  h.node_id = node.node_id;
  h.fingerprint = node.fingerprint;
  h.codec = node.codec;
  h.sync_round = round;
  h.state_hash = state_hash;
  random_bytes(h.node_nonce.data(), h.node_nonce.size());
  h.proof = hmac_sha256(node.secret, hello_proof_message(server_nonce, h.run_id, node.node_id, node.fingerprint));
  link.write(FrameWriter(1024).hello(h));

  env = link.read(kMaxFrameBytes, link.io_timeout_s());
  if (env->msg_type() != wire::Message_Welcome) throw Transient("coordinator did not send Welcome");
  const auto* w = env->msg_as_Welcome();
  const auto expect = hmac_sha256(node.secret, welcome_proof_message(h.node_nonce, server_nonce));
  if (vec_size(w->proof()) != kProofBytes ||
      !digest_equal(expect, std::span<const uint8_t>(w->proof()->data(), kProofBytes)))
    throw Refused(wire::ErrorCode_auth, "the coordinator failed to prove the shared secret");
  const int64_t ce = w->chunk_elems();
  if (ce < kInt8Block || ce > kMaxChunkElems || ce % kInt8Block)
    throw Transient("coordinator announced a bad chunk size " + std::to_string(ce));
  if (w->n_nodes() != node.n_nodes)
    throw Refused(wire::ErrorCode_bad_node, "coordinator runs " + std::to_string(w->n_nodes()) +
                                                " nodes, config says " + std::to_string(node.n_nodes));
  Welcome out;
  out.coordinator_round = w->round();
  out.chunk_elems = ce;
  out.in_sync = w->in_sync();
  out.rolled_back_to = w->rolled_back_to();
  if (!node.secret.empty() && !node.tls.on())
    out.frame_key = session_key(node.secret, server_nonce, h.node_nonce);
  return out;
}

}  // namespace spes::net
