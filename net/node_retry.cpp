#include "net/node_retry.hpp"

#include <algorithm>
#include <cmath>
#include <thread>

#include "net/asio_util.hpp"

namespace spes::net {

RoundRetry::RoundRetry(const SyncClientOptions& opt, int node, const HostPort& coordinator, const LineLog& log)
    : opt_(opt), node_(node), coordinator_(coordinator), log_(log) {
  std::random_device rd;
  rng_.seed((uint64_t(rd()) << 32) ^ rd() ^ uint64_t(node));
}

void RoundRetry::begin_round() {
  give_up_ = Clock::now() + to_duration(opt_.retry_for_s);
  attempt_ = 0;
}

std::string RoundRetry::coordinator_name() const {
  return coordinator_.host + ":" + std::to_string(coordinator_.port);
}

void RoundRetry::after(const Refused& e) {
  switch (e.code) {
    case wire::ErrorCode_stale_round:
      log_("%s", e.what());
      return;
    case wire::ErrorCode_duplicate_node:
    case wire::ErrorCode_busy:
    case wire::ErrorCode_timeout:
    case wire::ErrorCode_shutting_down:
    case wire::ErrorCode_bad_frame:
      if (Clock::now() > give_up_)
        throw NetError("coordinator keeps refusing node " + std::to_string(node_) + ": " + e.what());
      back_off(e.what());
      return;
    default:
      throw NetError("coordinator " + coordinator_name() + " refused node " + std::to_string(node_) + ": " + e.what());
  }
}

void RoundRetry::after(const Transient& e) {
  if (Clock::now() > give_up_)
    throw NetError("node " + std::to_string(node_) + ": coordinator " + coordinator_name() + " unreachable for " +
                   std::to_string(int(opt_.retry_for_s)) + " s (" + e.what() + ")");
  back_off(e.what());
}

void RoundRetry::back_off(const char* why) {
  const double base_s = std::min(opt_.backoff_max_s, opt_.backoff_min_s * std::pow(2.0, std::min(attempt_++, 30)));
  std::uniform_real_distribution<double> jitter(0.5, 1.5);
  const double s = base_s * jitter(rng_);
  log_("%s; retrying in %.2f s", why, s);
  std::this_thread::sleep_for(to_duration(s));
}

}  // namespace spes::net
