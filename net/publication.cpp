// A round's result: encode θ_new − θ_old, apply the decoded update, hash (see publication.hpp).
#include "net/publication.hpp"

#include <algorithm>
#include <string>

#include "engine/base/parallel.hpp"
#include "net/digest.hpp"
#include "net/finite_guard.hpp"

namespace spes::net {

std::shared_ptr<Publication> build_publication(Codec codec, const ChunkGrid& grid, const std::vector<bool>& changed,
                                               const double* target, GlobalState& s, int64_t r, int64_t step,
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
    const double* tg = target + ch.begin;
    std::vector<float> x(static_cast<size_t>(n));
    if (!lossy) {
      for (int64_t i = 0; i < n; ++i) x[size_t(i)] = float(tg[i]);
      if (first_non_finite(x.data(), n) >= 0) refused[size_t(k)] = 1;
      else std::copy(x.begin(), x.end(), th);
      return;
    }
    // Δ = θ_new − θ_old plus what earlier downloads did not carry (error feedback).
    std::vector<float> d(static_cast<size_t>(n));
    float* res = s.down_residual.data() + ch.begin;
    for (int64_t i = 0; i < n; ++i) d[size_t(i)] = float(tg[i] - double(th[i])) + res[i];
    FrameWriter w(encoded_bytes(codec, n) + 1024);
    ChunkTag t{r, step, 0, ch.begin, ch.end, codec};
    std::vector<float> new_res(static_cast<size_t>(n));
    bool ok = first_non_finite(d.data(), n) < 0;
    const FrameView v = w.round_chunk(t, encoded_bytes(codec, n), [&](uint8_t* dst) {
      if (!ok) return;
      encode_delta(codec, d.data(), n, dst, new_res.data());
      ok = apply_update(codec, dst, n, th, x.data()) && first_non_finite(x.data(), n) < 0 &&
           first_non_finite(new_res.data(), n) < 0;
    });
    if (!ok) {
      refused[size_t(k)] = 1;
      return;
    }
    std::copy(x.begin(), x.end(), th);
    std::copy(new_res.begin(), new_res.end(), res);
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
