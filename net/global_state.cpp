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
    : rules_(std::move(rules)), log_(log),
      path_((std::filesystem::path(rules_.state_dir) / kCoordinatorStateFile).string()) {}

PersistedState StatePersistence::header(int64_t round, int64_t step) const {
  PersistedState h;
  h.run_id = rules_.run_id;
  h.fingerprint = rules_.fingerprint;
  h.round = round;
  h.step = step;
  h.codec = uint32_t(rules_.codec);
  h.has_residual = codec_is_lossy(rules_.codec);
  h.has_momentum = rules_.outer_momentum;
  return h;
}

GlobalState StatePersistence::open(bool fresh, const std::function<void(float*)>& init_theta,
                                   const std::string& init_source) {
  const int64_t n_params = rules_.n_params;
  GlobalState s;
  adopt_old_name();
  if (fresh) {
    if (!init_theta) throw NetError("coordinator: no init_theta to start a fresh run from");
    if (std::filesystem::exists(path_)) log_("--fresh: replacing the persisted state in %s", path_.c_str());
    // The one moment the coordinator holds a model-sized θ: it goes to the file at once.
    std::vector<float> theta(static_cast<size_t>(n_params));
    init_theta(theta.data());
    const std::unique_ptr<StateWriter> w = next(0, 0);
    w->write(Section::theta, 0, n_params, theta.data());
    for (Section x : {Section::residual, Section::momentum})
      if (w->has(x)) w->zero(x);
    theta = {};
    commit(*w, s);  // from now on the run has a state: a restart without --fresh resumes it
    log_("fresh run '%s': θ initialised from %s (%" PRId64 " params), state %s", rules_.run_id.c_str(),
         init_source.c_str(), n_params, hash_hex(s.hash).c_str());
    return s;
  }
  // Without --fresh the state is the run's memory: starting from the seed instead
  // would silently reset every node (issue 13), so a missing or bad file stops here.
  const std::string restart_hint =
      "; --rollback-to ROUND restarts the run from a round kept in its state_dir's rounds/ folder (--fresh would "
      "start a new run from the seed instead)";
  if (!std::filesystem::exists(path_))
    throw NetError(path_ + ": no coordinator state; the first start of a run needs --fresh (a restart needs the "
                   "state_dir of its run)");
  try {
    s.file = StateReader::open(path_, n_params);
  } catch (const NetError& e) {
    throw NetError(std::string(e.what()) + restart_hint);
  }
  const PersistedState ps = s.file->info();  // a copy: conforming below replaces the file
  check_identity(ps);
  log_("resumed round %" PRId64 " (step %" PRId64 ") from %s, state %s", ps.round, ps.step, path_.c_str(),
       hash_hex(ps.state_hash).c_str());
  // A change of codec or outer optimizer between runs is allowed; say what happens.
  if (rules_.outer_momentum && !ps.has_momentum)
    log_("%s holds no outer momentum (saved by an averaging coordinator): it starts at 0", path_.c_str());
  if (rules_.outer_momentum && ps.has_momentum) log_("outer momentum %s resumed", hash_hex(ps.momentum_hash).c_str());
  if (!rules_.outer_momentum && ps.has_momentum)
    log_("%s holds an outer momentum, which outer_optimizer = \"average\" drops", path_.c_str());
  if (ps.has_residual != codec_is_lossy(rules_.codec) || ps.has_momentum != rules_.outer_momentum) {
    // Rewritten with this run's sections: θ kept, a new residual or momentum at 0.
    const std::unique_ptr<StateWriter> w = next(ps.round, ps.step);
    w->copy(*s.file, Section::theta, 0, n_params);
    for (Section x : {Section::residual, Section::momentum}) {
      if (w->has(x) && s.file->has(x)) w->copy(*s.file, x, 0, n_params);
      else if (w->has(x)) w->zero(x);
    }
    commit(*w, s);
  }
  s.round = ps.round;
  s.step = ps.step;
  s.hash = ps.state_hash;
  return s;
}

void StatePersistence::check_identity(const PersistedState& ps) const {
  if (ps.run_id != rules_.run_id)
    throw NetError(path_ + " belongs to run '" + ps.run_id + "', not '" + rules_.run_id +
                   "' (use another state_dir or run_id)");
  if (ps.fingerprint != rules_.fingerprint)
    throw NetError(path_ + " holds a different model (fingerprint " + hash_hex(ps.fingerprint) + " vs " +
                   hash_hex(rules_.fingerprint) + ")");
}

// The coordinator's file was called state.bin, like a node's checkpoint file; a
// state_dir from then still holds it. The first start there renames it (and its
// .next scratch) once, so the run goes on from its state; a state.bin that is not
// a coordinator state file is left alone.
void StatePersistence::adopt_old_name() {
  namespace fs = std::filesystem;
  const fs::path old = fs::path(folder()) / "state.bin";
  std::error_code ec;
  if (fs::exists(path_, ec) || !fs::is_regular_file(old, ec) || state_file_format(old.string()) == 0) return;
  fs::rename(old, path_, ec);
  if (ec) throw NetError(old.string() + ": cannot rename to " + path_ + ": " + ec.message());
  const fs::path old_next = old.string() + ".next";
  if (fs::exists(old_next, ec)) fs::rename(old_next, path_ + ".next", ec);
  log_("%s renamed to %s (the coordinator's state file has its own name)", old.c_str(), path_.c_str());
}

std::string StatePersistence::folder() const {
  const std::filesystem::path p(path_);
  return p.has_parent_path() ? p.parent_path().string() : ".";
}

std::unique_ptr<StateWriter> StatePersistence::next(int64_t round, int64_t step) const {
  return std::make_unique<StateWriter>(path_, header(round, step), rules_.n_params);
}

void StatePersistence::commit(StateWriter& w, GlobalState& s) {
  const auto t0 = std::chrono::steady_clock::now();
  s.file = w.commit();
  s.round = s.file->info().round;
  s.step = s.file->info().step;
  s.hash = s.file->info().state_hash;
  log_("round %" PRId64 " persisted to %s (%.0f ms)", s.round, path_.c_str(),
       std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace spes::net
