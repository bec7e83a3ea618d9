// A round's result: encode θ_new − θ_old, apply the decoded update, hash (see publication.hpp).
#include "net/publication.hpp"

#include <atomic>
#include <cstring>
#include <string>

#include "engine/base/error.hpp"
#include "engine/base/parallel.hpp"
#include "net/digest.hpp"

namespace spes::net {

std::shared_ptr<Publication> build_publication(Codec codec, const ChunkGrid& grid, const std::vector<bool>& changed,
                                               const float* target, GlobalState& s, int64_t r, int64_t step,
                                               int participants, double alpha) {
  auto pub = std::make_shared<Publication>();
  pub->round = r;
  pub->step = step;
  pub->participants = participants;
  pub->alpha = alpha;
  for (size_t c = 0; c < grid.chunks.size(); ++c)
    if (changed[c]) pub->chunks.push_back(int(c));
  const std::vector<int>& ids = pub->chunks;
  const bool lossy = codec_is_lossy(codec);
  if (lossy) pub->frames.resize(ids.size());
  // Chunks are independent: encode/apply them in parallel, then hash θ in order.
  std::atomic<int> bad{0};
  parallel_for(int64_t(ids.size()), [&](int64_t k) {
    const GridChunk& ch = grid.chunks[size_t(ids[size_t(k)])];
    const int64_t n = ch.size();
    float* th = s.theta.data() + ch.begin;
    const float* tg = target + ch.begin;
    if (!lossy) {
      std::memcpy(th, tg, size_t(n) * 4);
      return;
    }
    // Δ = θ_new − θ_old plus what earlier downloads did not carry (error feedback).
    std::vector<float> d(static_cast<size_t>(n));
    float* res = s.down_residual.data() + ch.begin;
    for (int64_t i = 0; i < n; ++i) d[size_t(i)] = (tg[i] - th[i]) + res[i];
    std::vector<uint8_t> payload(encoded_bytes(codec, n));
    encode_delta(codec, d.data(), n, payload.data(), res);
    const size_t bytes = payload_bytes(codec, payload.data(), n);
    const bool ok = apply_update(codec, payload.data(), n, th, th);
    FrameWriter w(bytes + 1024);
    ChunkTag t{r, step, 0, ch.begin, ch.end, codec};
    const FrameView v = w.round_chunk(t, bytes, [&](uint8_t* dst) { std::memcpy(dst, payload.data(), bytes); });
    if (!ok) ++bad;
    pub->frames[size_t(k)] = own(v);
  });
  if (bad) throw NetError("internal: round " + std::to_string(r) + " produced a non-finite update");
  for (size_t k = 0; k < ids.size(); ++k)
    pub->bytes += lossy ? int64_t(pub->frames[k].size())
                        : int64_t(kHeaderBytes + 128 + grid.chunks[size_t(ids[k])].size() * 4);
  StateHasher hasher;
  hasher.update(s.theta.data(), int64_t(s.theta.size()));
  pub->hash = hasher.digest();
  return pub;
}

}  // namespace spes::net
