// A round's result: encode θ_new − θ_old, apply the decoded update, hash (see publication.hpp).
#include "net/publication.hpp"

#include <cstring>
#include <string>

#include "engine/base/parallel.hpp"
#include "net/digest.hpp"
#include "net/finite_guard.hpp"

namespace spes::net {

std::shared_ptr<Publication> build_publication(Codec codec, const ChunkGrid& grid, const std::vector<bool>& changed,
                                               const float* target, GlobalState& s, int64_t r, int64_t step,
                                               int participants, double alpha) {
  auto pub = std::make_shared<Publication>();
  pub->round = r;
  pub->step = step;
  pub->participants = participants;
  pub->alpha = alpha;
  std::vector<int> ids;
  for (size_t c = 0; c < grid.chunks.size(); ++c)
    if (changed[c]) ids.push_back(int(c));
  const bool lossy = codec_is_lossy(codec);
  std::vector<OwnedFrame> frames(lossy ? ids.size() : 0);
  std::vector<char> refused(ids.size(), 0);  // char, not vector<bool>: written by many threads
  // Chunks are independent: encode/apply them in parallel, then hash θ in order.
  // Each chunk's new θ (and residual) is computed aside and checked finite before
  // it replaces the old one: a chunk that would not be finite keeps its value and is
  // not published (net/finite_guard.hpp: the push checks make this a last resort).
  parallel_for(int64_t(ids.size()), [&](int64_t k) {
    const GridChunk& ch = grid.chunks[size_t(ids[size_t(k)])];
    const int64_t n = ch.size();
    float* th = s.theta.data() + ch.begin;
    const float* tg = target + ch.begin;
    if (!lossy) {
      if (first_non_finite(tg, n) >= 0) refused[size_t(k)] = 1;
      else std::memcpy(th, tg, size_t(n) * 4);
      return;
    }
    // Δ = θ_new − θ_old plus what earlier downloads did not carry (error feedback).
    // Scratch reused per thread: fresh pages for every chunk cost more than encoding it.
    thread_local std::vector<float> d, x, new_res;
    thread_local std::vector<uint8_t> payload;
    thread_local FrameWriter w(64 * 1024);
    d.resize(size_t(n));
    x.resize(size_t(n));
    new_res.resize(size_t(n));
    payload.resize(encoded_bytes(codec, n));
    float* res = s.down_residual.data() + ch.begin;
    for (int64_t i = 0; i < n; ++i) d[size_t(i)] = (tg[i] - th[i]) + res[i];
    bool ok = first_non_finite(d.data(), n) < 0;
    if (ok) {
      encode_delta(codec, d.data(), n, payload.data(), new_res.data());
      ok = apply_update(codec, payload.data(), n, th, x.data()) && first_non_finite(x.data(), n) < 0 &&
           first_non_finite(new_res.data(), n) < 0;
    }
    if (!ok) {
      refused[size_t(k)] = 1;
      return;
    }
    const size_t bytes = payload_bytes(codec, payload.data(), n);
    ChunkTag t{r, step, 0, ch.begin, ch.end, codec};
    const FrameView v = w.round_chunk(t, bytes, [&](uint8_t* dst) { std::memcpy(dst, payload.data(), bytes); });
    std::memcpy(th, x.data(), size_t(n) * 4);
    std::memcpy(res, new_res.data(), size_t(n) * 4);
    frames[size_t(k)] = own(v);
  });
  for (size_t k = 0; k < ids.size(); ++k) {
    if (refused[k]) {
      pub->refused.push_back(ids[k]);
      continue;
    }
    pub->chunks.push_back(ids[k]);
    if (lossy) pub->frames.push_back(std::move(frames[k]));
  }
  for (size_t k = 0; k < pub->chunks.size(); ++k)
    pub->bytes += lossy ? int64_t(pub->frames[k].size())
                        : int64_t(kHeaderBytes + 128 + grid.chunks[size_t(pub->chunks[k])].size() * 4);
  StateHasher hasher;
  hasher.update(s.theta.data(), int64_t(s.theta.size()));
  pub->hash = hasher.digest();
  return pub;
}

}  // namespace spes::net
