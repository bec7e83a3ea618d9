#include "engine/link_plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>

#include "engine/args.hpp"
#include "engine/base/log.hpp"
#include "model/flops.hpp"
#include "net/coordinator.hpp"
#include "net/frame.hpp"
#include "net/frame_mac.hpp"
#include "net/grid.hpp"

namespace spes {

namespace {

// The quality each setting cost on the tiny study, in points of central's final
// validation CE over fp32 synchronous rounds at the same interval (2 seeds; bench/
// RESULTS.md, "Links"), 0 where the study measured no cost (a gain inside the seeds'
// spread). Overlap and a codec together: the sum (not measured together).
struct StudyCost {
  net::Codec codec;
  double pts;
};
constexpr StudyCost kCodecCost[] = {{net::Codec::fp32, 0.0}, {net::Codec::bf16, 0.0}, {net::Codec::int8, 0.0},
                                    {net::Codec::int3, 0.0}, {net::Codec::sparse, 4.7}};
// Overlapped rounds: the cost against the share of the interval a round is stale (its
// overlap_steps over sync_steps; a whole round when applied at the next one), measured
// at these points and interpolated linearly between them: free at a fifth (fp32, −0.2
// points), +0.8 at 4 of 15 steps (with int3, over a throttled link), +4.1 a round late.
struct StaleCost {
  double stale, pts;
};
constexpr StaleCost kOverlapCost[] = {{0.2, 0.0}, {4.0 / 15.0, 0.8}, {1.0, 4.1}};

double overlap_cost(int64_t overlap_steps, int64_t sync_steps) {
  const double stale = overlap_steps ? double(overlap_steps) / double(sync_steps) : 1.0;
  if (stale <= kOverlapCost[0].stale) return kOverlapCost[0].pts;
  for (size_t i = 1; i < std::size(kOverlapCost); ++i) {
    const StaleCost a = kOverlapCost[i - 1], b = kOverlapCost[i];
    if (stale <= b.stale) return a.pts + (b.pts - a.pts) * (stale - a.stale) / (b.stale - a.stale);
  }
  return kOverlapCost[std::size(kOverlapCost) - 1].pts;
}

std::string mb(int64_t bytes) { return strprintf("%.1f MB", double(bytes) / 1e6); }

std::string rate_name(double bps) {
  return bps >= 1e9 ? strprintf("%g Gbit/s", bps / 1e9) : strprintf("%g Mbit/s", bps / 1e6);
}

std::string setting_name(const LinkOption& o) {
  std::string s = strprintf("codec = \"%s\", overlap = %s", net::codec_name(o.codec), o.overlap ? "true" : "false");
  if (o.overlap_steps > 0) s += strprintf(", overlap_steps = %lld", (long long)o.overlap_steps);
  return s;
}

}  // namespace

RoundBytes round_bytes(const Config& cfg, net::Codec codec, int64_t chunk_elems, bool frame_macs) {
  const ParamLayout layout = make_layout(cfg.model);
  const Ownership own = make_ownership(cfg.model, layout, int(cfg.spes.node_id), int(cfg.spes.n_nodes),
                                       cfg.spes.ownership, cfg.spes.experts_per_node);
  const net::ChunkGrid grid = net::make_grid(layout, cfg.model.n_experts, chunk_elems);
  const int64_t mac = frame_macs ? int64_t(net::kMacBytes) : 0;
  net::FrameWriter w(1 << 12);
  auto none = [](uint8_t*) {};  // sizes only: the payload's bytes do not change the frame's size
  RoundBytes b;
  uint32_t pushed = 0;
  for (const net::GridChunk& c : grid.chunks) {
    const net::ChunkTag t{1, cfg.spes.sync_steps, int32_t(cfg.spes.node_id), c.begin, c.end, codec};
    const size_t payload = net::encoded_bytes(codec, c.size());
    b.down += int64_t(w.round_chunk(t, payload, none).size()) + mac;
    if (own.space.packed_offset(Range{c.begin, c.end}) >= 0) {
      b.up += int64_t(w.push_chunk(t, payload, none).size()) + mac;
      ++pushed;
    }
  }
  // The push ends with the node's training figures (the coordinator's status page), every
  // field present as once the node has evaluated: the largest they get.
  const net::TrainFigures figures{1, 1.0, 1.0, 1.0, 1, 1.0};
  b.up += int64_t(w.push_done(1, int32_t(cfg.spes.node_id), cfg.spes.sync_steps, pushed, &figures).size()) + mac;
  // FlatBuffers leaves out fields at their default (0): a real hash and the warm-up's first α.
  b.down += int64_t(w.round_done(1, cfg.spes.sync_steps, uint32_t(grid.chunks.size()), ~uint64_t(0),
                                 int32_t(cfg.spes.n_nodes), cfg.spes.merge_alpha)
                        .size()) +
            mac;
  return b;
}

double parse_link_rate(const std::string& s) {
  const std::optional<Quantity> q = parse_quantity(s);
  std::string unit = q ? q->unit : "";
  if (unit.ends_with("bit/s")) unit.resize(unit.size() - 2);
  if (unit.ends_with("bps")) unit.replace(unit.size() - 3, 3, "bit");
  const double k = unit == "bit" ? 1 : unit == "kbit" ? 1e3 : unit == "mbit" ? 1e6 : unit == "gbit" ? 1e9
                 : unit == "tbit" ? 1e12 : -1;
  if (!q || k < 0 || !(q->value > 0 && std::isfinite(q->value)))
    throw UsageError("--link " + s + ": expected a rate in bits per second such as 100Mbit or 1Gbit");
  return q->value * k;
}

double step_seconds_from_flops(const Config& cfg) {
  const double tokens = double(cfg.train.global_batch) * double(cfg.model.seq_len);
  return train_flops_per_token(cfg.model) * tokens / (kPlanPeakFlops * kPlanMfu);
}

LinkPlan plan_link(const Config& cfg, double bits_per_s, double step_s) {
  LinkPlan p;
  p.bits_per_s = bits_per_s;
  p.step_s = step_s;
  const int64_t sync_steps = std::max<int64_t>(1, cfg.spes.sync_steps);
  p.round_compute_s = step_s * double(sync_steps);
  const int64_t chunk_elems = net::CoordinatorOptions{}.chunk_elems;
  const bool macs = !cfg.spes.secret_file.empty() && cfg.spes.tls_ca.empty();
  for (bool overlap : {false, true}) {
    for (const StudyCost& s : kCodecCost) {
      LinkOption o;
      o.codec = s.codec;
      o.overlap = overlap;
      o.bytes = round_bytes(cfg, s.codec, chunk_elems, macs);
      o.wire_s = double(o.bytes.up + o.bytes.down) * 8.0 / bits_per_s;
      double hidden = 0;  // the compute the round overlaps
      if (overlap) {      // applied as soon as the link allows: the steps its wire time takes, or a whole round
        const int64_t tau = int64_t(std::ceil(o.wire_s / step_s));
        o.overlap_steps = tau < sync_steps ? std::max<int64_t>(1, tau) : 0;
        hidden = o.overlap_steps ? double(o.overlap_steps) * step_s : p.round_compute_s;
        o.quality_pts = overlap_cost(o.overlap_steps, sync_steps);
      }
      o.time_share = std::max(0.0, o.wire_s - hidden) / p.round_compute_s;
      o.quality_pts += s.pts;
      p.options.push_back(o);
    }
  }
  // Fastest to the quality of fp32 synchronous rounds: a setting with a quality cost
  // never gets there at the same steps (the time-to-quality runs: bench/RESULTS.md,
  // "Links"), so the least cost first; among those, the first in the table's order
  // (synchronous before overlapped, then fp32, bf16, int8, int3, sparse) whose round
  // fits kLinkBudget of the compute, else the one that costs least time.
  double least = p.options.front().quality_pts;
  for (const LinkOption& o : p.options) least = std::min(least, o.quality_pts);
  const LinkOption* best = nullptr;
  for (const LinkOption& o : p.options)
    if (o.quality_pts == least && o.time_share <= kLinkBudget) {
      best = &o;
      break;
    }
  if (!best)
    for (const LinkOption& o : p.options)
      if (o.quality_pts == least && (!best || o.time_share < best->time_share)) best = &o;
  p.recommended = *best;
  return p;
}

void print_link_plan(const Config& cfg, const LinkPlan& p, const std::string& step_source) {
  std::printf("\nSync rounds over a %s link, node %lld: a step %.0f ms (%s), %lld steps between rounds: %.1f s of "
              "compute per round. Quality: the tiny study's cost in points over fp32 synchronous rounds.\n\n",
              rate_name(p.bits_per_s).c_str(), (long long)cfg.spes.node_id, p.step_s * 1e3, step_source.c_str(),
              (long long)cfg.spes.sync_steps, p.round_compute_s);
  std::printf("| codec | overlap | up per round | down per round | wire s per round | share of compute | quality cost |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- |\n");
  for (const LinkOption& o : p.options) {
    const std::string overlap = !o.overlap ? "no" : o.overlap_steps ? strprintf("after %lld step%s", (long long)o.overlap_steps,
                                                                                       o.overlap_steps > 1 ? "s" : "")
                                                                    : "a whole round";
    std::printf("| %s | %s | %s | %s | %.1f | %.0f%% | %+.1f |\n", net::codec_name(o.codec), overlap.c_str(),
                mb(o.bytes.up).c_str(), mb(o.bytes.down).c_str(), o.wire_s, 100 * o.time_share, o.quality_pts);
  }
  const LinkOption& r = p.recommended;
  std::printf("\nRecommended: [spes] %s: the round costs %.0f%% of the compute (budget %.0f%%) for %+.1f points of "
              "quality.\n",
              setting_name(r).c_str(), 100 * r.time_share, 100 * kLinkBudget, r.quality_pts);
}

}  // namespace spes
