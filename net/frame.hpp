// Framing of the sync protocol (net/README.md, Protocol). A frame is a 16-byte
// little-endian header followed by one FlatBuffers Envelope (net/protocol.fbs):
//
//   offset 0  u32  magic "SPES"
//          4  u16  protocol version
//          6  u16  flags (0, or kFlagMac: a MAC follows the payload, net/frame_mac.hpp)
//          8  u32  payload length (≤ the receiver's current cap)
//         12  u32  CRC32C of the payload
//
// A receiver checks magic, version and the declared length against its cap
// *before* allocating or reading the payload, then the CRC, then runs the
// FlatBuffers verifier (depth/table limits) before any field is read, and then
// checks every count and length a peer sent against the caps below.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "net/codec.hpp"
#include "net/train_figures.hpp"
#include "protocol_generated.h"

namespace spes::net {

namespace wire = spes::net::wire;

constexpr uint32_t kMagic = 0x53455053u;  // bytes "SPES"
constexpr uint16_t kProtocolVersion = 2;  // 2: PushDone.stop, RoundDone.stop, SnapshotDone.stop
constexpr size_t kHeaderBytes = 16;
constexpr int64_t kMaxChunkElems = int64_t(1) << 20;         // 4 MiB of fp32 per chunk
constexpr uint32_t kMaxFrameBytes = uint32_t(kMaxChunkElems) * 4 + 4096;
constexpr uint32_t kMaxHandshakeFrameBytes = 1024;           // before authentication
constexpr size_t kNonceBytes = 32;
constexpr size_t kProofBytes = 32;
constexpr size_t kMaxRunIdBytes = 128;
constexpr size_t kMaxReasonBytes = 512;

struct FrameHeader {
  uint16_t version = 0;
  uint16_t flags = 0;
  uint32_t length = 0;
  uint32_t crc = 0;
};

enum class HeaderCheck { ok, bad_magic, bad_version, too_large, bad_flags };

void write_header(uint8_t* out, uint32_t length, uint32_t crc, uint16_t version = kProtocolVersion);
void set_header_flags(uint8_t* header, uint16_t flags);
// Reads the 16 bytes; `max_length` is the receiver's cap in its current state.
HeaderCheck parse_header(const uint8_t* in, uint32_t max_length, FrameHeader* out);
std::string header_problem(HeaderCheck c, const FrameHeader& h, uint32_t max_length);

// CRC then the FlatBuffers verifier; nullptr (and why) when either fails.
const wire::Envelope* open_payload(const uint8_t* payload, size_t n, uint32_t crc, std::string* why);

// A built frame: header + body, valid until the FrameWriter builds the next one.
struct FrameView {
  const uint8_t* header = nullptr;
  const uint8_t* body = nullptr;
  size_t body_size = 0;
  size_t size() const { return kHeaderBytes + body_size; }
};

// An owned copy of a frame (for frames queued to several peers).
struct OwnedFrame {
  std::vector<uint8_t> bytes;  // header + body
  size_t size() const { return bytes.size(); }
};
OwnedFrame own(const FrameView& f);

struct HelloFields {
  std::string run_id;
  int32_t node_id = 0;
  uint64_t fingerprint = 0;
  Codec codec = Codec::fp32;
  int64_t sync_round = 0;
  uint64_t state_hash = 0;
  std::array<uint8_t, kNonceBytes> node_nonce{};
  std::array<uint8_t, kProofBytes> proof{};
};

struct WelcomeFields {
  int64_t round = 0, step = 0;
  uint64_t state_hash = 0;
  bool in_sync = false;
  uint32_t chunk_elems = 0;
  int32_t n_nodes = 0;
  std::array<uint8_t, kProofBytes> proof{};
  int64_t rolled_back_to = -1;  // the round `--rollback-to` restarted the run from (-1: never)
};

// Where a data chunk sits: [begin, end) of the flat buffer in a round.
struct ChunkTag {
  int64_t round = 0, step = 0;
  int32_t node_id = 0;  // PushChunk only
  int64_t begin = 0, end = 0;
  Codec codec = Codec::fp32;
};

// The training figures a PushDone carries (none: an older node, or it sent none).
std::optional<TrainFigures> read_figures(const wire::TrainFigures* f);

// Builds frames into one reusable FlatBufferBuilder (no allocation per frame
// once it has grown to the largest chunk). Data frames take a `fill(uint8_t*)`
// that writes the payload straight into the frame.
class FrameWriter {
 public:
  explicit FrameWriter(size_t initial_bytes = 4096) : b_(initial_bytes) {}

  FrameView challenge(std::span<const uint8_t> nonce);
  FrameView hello(const HelloFields& h);
  FrameView welcome(const WelcomeFields& w);
  FrameView error(wire::ErrorCode code, std::string_view reason);
  // figures: the node's training figures for the coordinator's status page (null: none);
  // stop: the node asks the run to end at this round.
  FrameView push_done(int64_t round, int32_t node_id, int64_t step, uint32_t chunks,
                      const TrainFigures* figures = nullptr, bool stop = false);
  // stop: the run ends at this round.
  FrameView round_done(int64_t round, int64_t step, uint32_t chunks, uint64_t state_hash,
                       int32_t participants, double merge_alpha, bool stop = false);
  FrameView snapshot_request(int64_t since_round = -1);  // -1: every chunk
  FrameView heartbeat();
  FrameView bad_round(int64_t round, int32_t node_id, std::string_view reason);
  FrameView snapshot_done(int64_t round, int64_t step, uint32_t chunks, uint64_t state_hash, bool stop);

  template <class Fill>
  FrameView push_chunk(const ChunkTag& t, size_t payload_bytes, Fill&& fill) {
    b_.Clear();
    uint8_t* p = nullptr;
    auto payload = b_.CreateUninitializedVector<uint8_t>(payload_bytes, &p);
    fill(p);
    auto m = wire::CreatePushChunk(b_, t.round, t.node_id, t.step, t.begin, t.end,
                                   wire::Codec(t.codec), checksum(p, payload_bytes), payload);
    return finish(wire::Message_PushChunk, m.Union());
  }
  template <class Fill>
  FrameView round_chunk(const ChunkTag& t, size_t payload_bytes, Fill&& fill) {
    b_.Clear();
    uint8_t* p = nullptr;
    auto payload = b_.CreateUninitializedVector<uint8_t>(payload_bytes, &p);
    fill(p);
    auto m = wire::CreateRoundChunk(b_, t.round, t.step, t.begin, t.end, wire::Codec(t.codec),
                                    checksum(p, payload_bytes), payload);
    return finish(wire::Message_RoundChunk, m.Union());
  }
  template <class Fill>
  FrameView snapshot_chunk(int64_t round, int64_t begin, int64_t end, Fill&& fill) {
    b_.Clear();
    uint8_t* p = nullptr;
    const size_t bytes = size_t(end - begin) * 4;
    auto payload = b_.CreateUninitializedVector<uint8_t>(bytes, &p);
    fill(p);
    auto m = wire::CreateSnapshotChunk(b_, round, begin, end, checksum(p, bytes), payload);
    return finish(wire::Message_SnapshotChunk, m.Union());
  }

 private:
  FrameView finish(wire::Message type, flatbuffers::Offset<void> msg);
  static uint32_t checksum(const uint8_t* p, size_t n);
  flatbuffers::FlatBufferBuilder b_;
  std::array<uint8_t, kHeaderBytes> header_{};
};

// A receive buffer that grows without zero-filling (a frame is read straight into
// it; std::vector::resize would memset every chunk) and stays 16-byte aligned.
class RecvBuffer {
 public:
  uint8_t* take(size_t n) {
    if (n > cap_) {
      buf_.reset(new uint8_t[n]);
      cap_ = n;
    }
    size_ = n;
    return buf_.get();
  }
  uint8_t* data() { return buf_.get(); }
  size_t size() const { return size_; }
  void release() { buf_.reset(), cap_ = size_ = 0; }

 private:
  std::unique_ptr<uint8_t[]> buf_;
  size_t cap_ = 0, size_ = 0;
};

// Field caps a receiver applies after verification (counts and lengths a peer sent).
inline size_t vec_size(const flatbuffers::Vector<uint8_t>* v) { return v ? v->size() : 0; }
inline std::string_view str_view(const flatbuffers::String* s) {
  return s ? std::string_view(s->c_str(), s->size()) : std::string_view();
}
bool valid_codec(wire::Codec c);

// The HMAC messages both sides compute.
std::vector<uint8_t> hello_proof_message(std::span<const uint8_t> server_nonce, std::string_view run_id,
                                         int32_t node_id, uint64_t fingerprint);
std::vector<uint8_t> welcome_proof_message(std::span<const uint8_t> node_nonce,
                                           std::span<const uint8_t> server_nonce);

}  // namespace spes::net
