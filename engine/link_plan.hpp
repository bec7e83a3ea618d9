// What a sync round costs on the user's link (`spes-engine plan CONFIG --link RATE
// [--step-ms MS]`): per codec, the bytes a node sends and receives in a round, their
// time on the link, the share of the compute between rounds that the round costs
// synchronous (training waits for it) and overlapped (only what the compute does
// not hide), the quality cost the tiny study measured, and the setting to pick.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/config.hpp"
#include "net/codec.hpp"

namespace spes {

// Bytes node `cfg.spes.node_id` sends and receives in a round every node pushes: the
// frames as they travel (header, FlatBuffers message, payload, and a 32-byte MAC each
// with a shared secret): PushChunk for each chunk it owns and PushDone up, RoundChunk
// for every chunk of θ and RoundDone down. Sparse: its largest payloads (its real
// ones are data-dependent and smaller). chunk_elems: the coordinator's grid.
struct RoundBytes {
  int64_t up = 0, down = 0;
};
RoundBytes round_bytes(const Config& cfg, net::Codec codec, int64_t chunk_elems, bool frame_macs);

// "100Mbit", "1 Gbit", "2.5Gbit/s", "10Gbps": bits per second; throws UsageError.
double parse_link_rate(const std::string& s);

// One setting the planner weighs, and its price.
struct LinkOption {
  net::Codec codec = net::Codec::fp32;
  bool overlap = false;
  int64_t overlap_steps = 0;  // overlapped: the steps the round's wire time takes (0: a whole round)
  RoundBytes bytes;
  double wire_s = 0;        // (up + down) / rate: push, then pull
  double time_share = 0;    // of the compute between rounds: wire_s (synchronous), what the steps it overlaps do not hide
  double quality_pts = 0;   // the tiny study's cost in points over fp32 synchronous rounds
};

struct LinkPlan {
  double bits_per_s = 0, step_s = 0, round_compute_s = 0;
  std::vector<LinkOption> options;  // every codec, synchronous then overlapped
  LinkOption recommended;
};

// The recommendation, the fastest to fp32 synchronous rounds' quality: of the options
// of least quality cost, the simplest (synchronous and the widest codec first) whose
// round costs at most kLinkBudget of the compute between rounds, else the one of them
// that costs least time.
constexpr double kLinkBudget = 0.05;
LinkPlan plan_link(const Config& cfg, double bits_per_s, double step_s);

// The step time when --step-ms is not given: the plan's training FLOPs per step over
// an H100's dense bf16 peak at this MFU.
constexpr double kPlanPeakFlops = 989e12, kPlanMfu = 0.4;
double step_seconds_from_flops(const Config& cfg);

// The markdown table and the recommendation (stdout of `plan --link`).
void print_link_plan(const Config& cfg, const LinkPlan& p, const std::string& step_source);

}  // namespace spes
