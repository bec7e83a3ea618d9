// The coordinator's global state and its persistence (see global_state.hpp).
#include "net/global_state.hpp"

#include <chrono>
#include <cinttypes>
#include <filesystem>

#include "engine/base/error.hpp"
#include "net/digest.hpp"
#include "net/state_file.hpp"

namespace spes::net {

StatePersistence::StatePersistence(PersistRules rules, const LineLog& log)
    : rules_(std::move(rules)), log_(log), path_((std::filesystem::path(rules_.state_dir) / "state.bin").string()) {}

GlobalState StatePersistence::open(int64_t n_params, bool fresh, const std::function<void(float*)>& init_theta,
                                   const std::string& init_source) {
  GlobalState s;
  s.theta.resize(size_t(n_params));
  const bool lossy = codec_is_lossy(rules_.codec);
  if (fresh) {
    if (!init_theta) throw NetError("coordinator: no init_theta to start a fresh run from");
    if (std::filesystem::exists(path_)) log_("--fresh: replacing the persisted state in %s", path_.c_str());
    init_theta(s.theta.data());
    s.hash = state_hash(s.theta.data(), n_params);
    if (lossy) s.down_residual.assign(size_t(n_params), 0.0f);
    if (rules_.outer_momentum) s.outer_momentum.assign(size_t(n_params), 0.0f);
    log_("fresh run '%s': θ initialised from %s (%" PRId64 " params), state %s", rules_.run_id.c_str(),
         init_source.c_str(), n_params, hash_hex(s.hash).c_str());
    persist(s);  // from now on the run has a state: a restart without --fresh resumes it
    return s;
  }
  // Without --fresh the state is the run's memory: starting from the seed instead
  // would silently reset every node (issue 13), so a missing or bad file stops here.
  const std::string restart_hint = "; to start a new run from the seed instead, pass --fresh";
  if (!std::filesystem::exists(path_))
    throw NetError(path_ + ": no coordinator state; the first start of a run needs --fresh (a restart needs the "
                   "state_dir of its run)");
  PersistedState ps;
  try {
    ps = load_state_file(path_, s.theta, lossy ? &s.down_residual : nullptr,
                         rules_.outer_momentum ? &s.outer_momentum : nullptr);
  } catch (const NetError& e) {
    throw NetError(std::string(e.what()) + restart_hint);
  }
  if (ps.run_id != rules_.run_id)
    throw NetError(path_ + " belongs to run '" + ps.run_id + "', not '" + rules_.run_id +
                   "' (use another state_dir or run_id)");
  if (ps.fingerprint != rules_.fingerprint)
    throw NetError(path_ + " holds a different model (fingerprint " + hash_hex(ps.fingerprint) + " vs " +
                   hash_hex(rules_.fingerprint) + ")");
  s.round = ps.round;
  s.step = ps.step;
  s.hash = state_hash(s.theta.data(), n_params);
  if (s.hash != ps.state_hash) throw NetError(path_ + ": state hash does not match its θ" + restart_hint);
  log_("resumed round %" PRId64 " (step %" PRId64 ") from %s, state %s", s.round, s.step, path_.c_str(),
       hash_hex(s.hash).c_str());
  // A change of outer optimizer between runs is allowed; say what happens to the momentum.
  if (rules_.outer_momentum && !ps.has_momentum)
    log_("%s holds no outer momentum (saved by an averaging coordinator): it starts at 0", path_.c_str());
  if (rules_.outer_momentum && ps.has_momentum)
    log_("outer momentum %s resumed", hash_hex(ps.momentum_hash).c_str());
  if (!rules_.outer_momentum && ps.has_momentum)
    log_("%s holds an outer momentum, which outer_optimizer = \"average\" drops", path_.c_str());
  if (lossy && s.down_residual.empty()) s.down_residual.assign(size_t(n_params), 0.0f);
  if (rules_.outer_momentum && s.outer_momentum.empty()) s.outer_momentum.assign(size_t(n_params), 0.0f);
  return s;
}

void StatePersistence::persist(const GlobalState& s) {
  const auto t0 = std::chrono::steady_clock::now();
  PersistedState ps;
  ps.run_id = rules_.run_id;
  ps.fingerprint = rules_.fingerprint;
  ps.round = s.round;
  ps.step = s.step;
  ps.state_hash = s.hash;
  ps.codec = uint32_t(rules_.codec);
  save_state_file(path_, ps, s.theta, codec_is_lossy(rules_.codec) ? &s.down_residual : nullptr,
                  rules_.outer_momentum ? &s.outer_momentum : nullptr);
  log_("round %" PRId64 " persisted to %s (%.0f ms)", s.round, path_.c_str(),
       std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace spes::net
