#include "net/frame.hpp"

#include <cstring>

#include "net/digest.hpp"

namespace spes::net {

namespace {
void put16(uint8_t* p, uint16_t v) { p[0] = uint8_t(v), p[1] = uint8_t(v >> 8); }
void put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i));
}
uint16_t get16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
uint32_t get32(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}

// The verifier's own limits: an Envelope holds one message table (depth 3 with
// its vectors), so anything deeper or with more tables is not ours.
constexpr flatbuffers::uoffset_t kMaxDepth = 8;
constexpr flatbuffers::uoffset_t kMaxTables = 8;
}  // namespace

void write_header(uint8_t* out, uint32_t length, uint32_t crc, uint16_t version) {
  put32(out, kMagic);
  put16(out + 4, version);
  put16(out + 6, 0);
  put32(out + 8, length);
  put32(out + 12, crc);
}

void set_header_flags(uint8_t* header, uint16_t flags) { put16(header + 6, flags); }

HeaderCheck parse_header(const uint8_t* in, uint32_t max_length, FrameHeader* out) {
  out->version = get16(in + 4);
  out->flags = get16(in + 6);
  out->length = get32(in + 8);
  out->crc = get32(in + 12);
  if (get32(in) != kMagic) return HeaderCheck::bad_magic;
  if (out->version != kProtocolVersion) return HeaderCheck::bad_version;
  if (out->length > max_length || out->length < 8) return HeaderCheck::too_large;
  if (out->flags & ~uint16_t(1)) return HeaderCheck::bad_flags;  // only kFlagMac is defined
  return HeaderCheck::ok;
}

std::string header_problem(HeaderCheck c, const FrameHeader& h, uint32_t max_length) {
  switch (c) {
    case HeaderCheck::ok: return "";
    case HeaderCheck::bad_magic: return "not a spes-engine sync frame (bad magic)";
    case HeaderCheck::bad_version:
      return "protocol version mismatch: this side speaks " + std::to_string(kProtocolVersion) +
             ", the peer sent " + std::to_string(h.version);
    case HeaderCheck::too_large:
      return "frame length " + std::to_string(h.length) + " outside [8, " + std::to_string(max_length) + "]";
    case HeaderCheck::bad_flags: return "unknown frame flags " + std::to_string(h.flags);
  }
  return "bad frame header";
}

const wire::Envelope* open_payload(const uint8_t* payload, size_t n, uint32_t crc, std::string* why) {
  if (crc32c(payload, n) != crc) {
    *why = "frame checksum mismatch";
    return nullptr;
  }
  flatbuffers::Verifier::Options opts;
  opts.max_depth = kMaxDepth;
  opts.max_tables = kMaxTables;
  opts.check_alignment = true;
  flatbuffers::Verifier v(payload, n, opts);
  if (!wire::VerifyEnvelopeBuffer(v)) {
    *why = "malformed message (FlatBuffers verifier)";
    return nullptr;
  }
  const auto* env = wire::GetEnvelope(payload);
  if (env->msg_type() == wire::Message_NONE || env->msg() == nullptr) {
    *why = "empty message";
    return nullptr;
  }
  return env;
}

OwnedFrame own(const FrameView& f) {
  OwnedFrame o;
  o.bytes.resize(f.size());
  std::memcpy(o.bytes.data(), f.header, kHeaderBytes);
  std::memcpy(o.bytes.data() + kHeaderBytes, f.body, f.body_size);
  return o;
}

uint32_t FrameWriter::checksum(const uint8_t* p, size_t n) { return crc32c(p, n); }

FrameView FrameWriter::finish(wire::Message type, flatbuffers::Offset<void> msg) {
  auto env = wire::CreateEnvelope(b_, type, msg);
  b_.Finish(env);
  FrameView f;
  f.body = b_.GetBufferPointer();
  f.body_size = b_.GetSize();
  write_header(header_.data(), uint32_t(f.body_size), crc32c(f.body, f.body_size));
  f.header = header_.data();
  return f;
}

FrameView FrameWriter::challenge(std::span<const uint8_t> nonce) {
  b_.Clear();
  auto n = b_.CreateVector(nonce.data(), nonce.size());
  return finish(wire::Message_Challenge, wire::CreateChallenge(b_, kProtocolVersion, n).Union());
}

FrameView FrameWriter::hello(const HelloFields& h) {
  b_.Clear();
  auto run = b_.CreateString(h.run_id);
  auto nn = b_.CreateVector(h.node_nonce.data(), h.node_nonce.size());
  auto pr = b_.CreateVector(h.proof.data(), h.proof.size());
  auto m = wire::CreateHello(b_, kProtocolVersion, run, h.node_id, h.fingerprint, wire::Codec(h.codec),
                             h.sync_round, h.state_hash, nn, pr);
  return finish(wire::Message_Hello, m.Union());
}

FrameView FrameWriter::welcome(const WelcomeFields& w) {
  b_.Clear();
  auto pr = b_.CreateVector(w.proof.data(), w.proof.size());
  auto m = wire::CreateWelcome(b_, w.round, w.step, w.state_hash, w.in_sync, w.chunk_elems, w.n_nodes, pr,
                               w.rolled_back_to);
  return finish(wire::Message_Welcome, m.Union());
}

FrameView FrameWriter::error(wire::ErrorCode code, std::string_view reason) {
  b_.Clear();
  if (reason.size() > kMaxReasonBytes) reason = reason.substr(0, kMaxReasonBytes);
  auto r = b_.CreateString(reason.data(), reason.size());
  return finish(wire::Message_Error, wire::CreateError(b_, code, r).Union());
}

std::optional<TrainFigures> read_figures(const wire::TrainFigures* f) {
  if (!f) return std::nullopt;
  return TrainFigures{f->step(), f->loss(), f->tokens_per_s(), f->val_ce(), f->val_step(), f->sync_ms()};
}

FrameView FrameWriter::push_done(int64_t round, int32_t node_id, int64_t step, uint32_t chunks,
                                 const TrainFigures* figures, bool stop) {
  b_.Clear();
  flatbuffers::Offset<wire::TrainFigures> f;
  if (figures)
    f = wire::CreateTrainFigures(b_, figures->step, figures->loss, figures->tokens_per_s, figures->val_ce,
                                 figures->val_step, figures->sync_ms);
  return finish(wire::Message_PushDone, wire::CreatePushDone(b_, round, node_id, step, chunks, f, stop).Union());
}

FrameView FrameWriter::round_done(int64_t round, int64_t step, uint32_t chunks, uint64_t state_hash,
                                  int32_t participants, double merge_alpha, bool stop) {
  b_.Clear();
  auto m = wire::CreateRoundDone(b_, round, step, chunks, state_hash, participants, merge_alpha, stop);
  return finish(wire::Message_RoundDone, m.Union());
}

FrameView FrameWriter::snapshot_request(int64_t since_round) {
  b_.Clear();
  return finish(wire::Message_SnapshotRequest, wire::CreateSnapshotRequest(b_, since_round).Union());
}

FrameView FrameWriter::heartbeat() {
  b_.Clear();
  return finish(wire::Message_Heartbeat, wire::CreateHeartbeat(b_).Union());
}

FrameView FrameWriter::bad_round(int64_t round, int32_t node_id, std::string_view reason) {
  b_.Clear();
  auto r = b_.CreateString(reason.substr(0, kMaxReasonBytes));
  return finish(wire::Message_BadRound, wire::CreateBadRound(b_, round, node_id, r).Union());
}

FrameView FrameWriter::snapshot_done(int64_t round, int64_t step, uint32_t chunks, uint64_t state_hash,
                                     bool stop) {
  b_.Clear();
  auto m = wire::CreateSnapshotDone(b_, round, step, chunks, state_hash, stop);
  return finish(wire::Message_SnapshotDone, m.Union());
}

bool valid_codec(wire::Codec c) {
  return c == wire::Codec_fp32 || c == wire::Codec_bf16 || c == wire::Codec_int8 || c == wire::Codec_sparse ||
         c == wire::Codec_int3;
}

namespace {
void append(std::vector<uint8_t>& m, const void* p, size_t n) {
  if (n == 0) return;
  const size_t at = m.size();
  m.resize(at + n);
  std::memcpy(m.data() + at, p, n);
}
void append_u64(std::vector<uint8_t>& m, uint64_t v) {
  for (int i = 0; i < 8; ++i) m.push_back(uint8_t(v >> (8 * i)));
}
}  // namespace

std::vector<uint8_t> hello_proof_message(std::span<const uint8_t> server_nonce, std::string_view run_id,
                                         int32_t node_id, uint64_t fingerprint) {
  std::vector<uint8_t> m;
  append(m, "spes-hello", 10);
  append(m, server_nonce.data(), server_nonce.size());
  append_u64(m, run_id.size());
  append(m, run_id.data(), run_id.size());
  append_u64(m, uint64_t(uint32_t(node_id)));
  append_u64(m, fingerprint);
  return m;
}

std::vector<uint8_t> welcome_proof_message(std::span<const uint8_t> node_nonce,
                                           std::span<const uint8_t> server_nonce) {
  std::vector<uint8_t> m;
  append(m, "spes-welcome", 12);
  append(m, node_nonce.data(), node_nonce.size());
  append(m, server_nonce.data(), server_nonce.size());
  return m;
}

}  // namespace spes::net
