#include "net/node_result.hpp"

#include <chrono>
#include <cinttypes>
#include <cstring>
#include <utility>

#include "net/background_job.hpp"
#include "net/codec.hpp"
#include "net/digest.hpp"

namespace spes::net {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

}  // namespace

void ResultReceiver::receive(const NodeGrid& grid, HeldRound& held, float* params, RoundReport& report) {
  const int64_t r = held.round + 1;
  const Codec codec = node_.codec;
  uint32_t got = 0;
  bool reset = false;
  StateHasher hasher;
  int64_t hashed = 0;
  const auto t_wait = Clock::now();
  auto t_first = t_wait;
  BackgroundJob apply;  // applies chunk k while chunk k+1 is read (after what it touches: joins first)
  for (int b = 0;; b ^= 1) {
    const wire::Envelope* env = link_.read(kMaxFrameBytes, link_.io_timeout_s(), rx_[size_t(b)]);
    if (!reset) {  // the coordinator has merged: from here on params are θ_old
      t_first = Clock::now();
      report.wait_ms = std::chrono::duration<double, std::milli>(t_first - t_wait).count();
      held.force_snapshot = true;  // until the round is complete, params are neither old nor new
      node_.space.scatter(held.base.data(), params);
      reset = true;
    }
    if (env->msg_type() == wire::Message_RoundChunk) {
      const auto* m = env->msg_as_RoundChunk();
      const int c = grid.grid.find(m->begin(), m->end());
      const int64_t n = m->end() - m->begin();
      if (m->round() != r || c < 0 || !valid_codec(m->codec()) || Codec(m->codec()) != codec ||
          !payload_size_ok(codec, vec_size(m->payload()) ? m->payload()->data() : nullptr, vec_size(m->payload()), n) ||
          crc32c(m->payload()->data(), vec_size(m->payload())) != m->checksum())
        throw Transient("bad round chunk from the coordinator");
      if (m->begin() < hashed) throw Transient("round chunks out of order");
      const int64_t end = m->end();
      const int64_t owned_off = grid.owned_offset[c];
      apply.start([this, m, n, end, owned_off, params, codec, &held, &hasher, hashed] {
        float* x = params + m->begin();
        if (!apply_update(codec, m->payload()->data(), n, x, x, threads_)) throw Transient("malformed round chunk");
        if (owned_off >= 0) std::memcpy(held.base.data() + owned_off, x, size_t(n) * 4);
        hasher.update(params + hashed, end - hashed);
      });
      hashed = end;
      ++got;
      continue;
    }
    apply.wait();
    if (env->msg_type() != wire::Message_RoundDone) throw Transient("unexpected message while waiting for the round");
    const auto* d = env->msg_as_RoundDone();
    if (d->round() != r || d->chunks() != got) throw Transient("incomplete round result");
    hasher.update(params + hashed, node_.layout.total - hashed);
    const uint64_t h = hasher.digest();
    if (h != d->state_hash()) {
      log_("state hash mismatch after round %" PRId64 ": node %s, coordinator %s; resyncing from a snapshot", r,
           hash_hex(h).c_str(), hash_hex(d->state_hash()).c_str());
      throw Transient("state hash mismatch");
    }
    report.pull_ms = ms_since(t_first);
    held.round = r;  // base already holds the new owned values
    std::swap(held.residual, held.pending);
    held.force_snapshot = false;
    log_("round %" PRId64 " synced: %d participant(s), merge alpha %.4g, state %s%s", r, d->participants(),
         d->merge_alpha(), hash_hex(h).c_str(), d->stop() ? "; the run stops at this round" : "");
    report.round = r;
    report.state_hash = h;
    report.participants = d->participants();
    report.merge_alpha = d->merge_alpha();
    report.stop = d->stop();
    return;
  }
}

}  // namespace spes::net
