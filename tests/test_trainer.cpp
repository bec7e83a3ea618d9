// The training loop: bitwise resume, frozen experts untouched, optimizer state
// proportional to owned parameters, NaN stops cleanly, the loss goes down.
#include <doctest/doctest.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine/config.hpp"
#include "engine/base/error.hpp"
#include "engine/trainer.hpp"
#include "model/hf_export.hpp"
#include "test_util.hpp"

using namespace spes;

namespace {

// The shared small config with the SPES decayed aux loss on and a held-out split.
Config small_config(const std::filesystem::path& dir, std::vector<std::string> extra = {}) {
  extra.insert(extra.begin(), {"train.decayed_aux_loss=true", "data.val_fraction=0.1"});
  return test::small_config(dir, extra);
}

// The loss column (3rd) of each CSV row after the header.
std::vector<std::string> loss_column(const std::string& csv) {
  std::vector<std::string> out;
  std::istringstream is(csv);
  std::string line;
  std::getline(is, line);
  while (std::getline(is, line)) {
    size_t a = line.find(','), b = line.find(',', a + 1), c = line.find(',', b + 1);
    out.push_back(line.substr(0, a) + ":" + line.substr(b + 1, c - b - 1));
  }
  return out;
}

}  // namespace

TEST_CASE("resume: N steps equal N/2 + resume N/2, bitwise") {
  auto dir = test::temp_dir("resume");
  std::ostringstream full_csv, first_csv, second_csv;
  Config c = small_config(dir / "a");
  Trainer full(c);
  full.run(full_csv, false);

  Config half = small_config(dir / "b", {"train.max_steps_this_run=3"});
  {
    Trainer t(half);
    t.run(first_csv, false);
    CHECK(t.step() == 3);
  }
  Trainer resumed(small_config(dir / "b"));
  resumed.run(second_csv, true);
  CHECK(resumed.step() == 6);
  CHECK(resumed.params() == full.params());  // bit-identical parameters
  std::vector<std::string> a = loss_column(full_csv.str()), b = loss_column(first_csv.str()),
                           b2 = loss_column(second_csv.str());
  b.insert(b.end(), b2.begin(), b2.end());
  CHECK(a == b);  // and identical losses at every step
}

TEST_CASE("frozen experts stay bit-unchanged and get no optimizer state") {
  auto dir = test::temp_dir("frozen");
  Config c = small_config(dir, {"spes.n_nodes=2", "spes.node_id=1", "spes.ownership=\"partitioned\""});
  Trainer t(c);
  const std::vector<float> before = t.params();
  std::ostringstream csv;
  t.run(csv, false);
  const ParamLayout& L = t.layout();
  const Ownership& own = t.ownership();
  CHECK(own.space.size() == L.shared_count + 2 * L.expert_block);
  // grads + Adam m + Adam v, fp32, over owned parameters only.
  CHECK(t.optimizer_state_bytes() == 3 * 4 * own.space.size());
  for (int e = 0; e < 4; ++e) {
    const bool changed = !std::equal(before.begin() + L.expert_begin(e), before.begin() + L.expert_begin(e + 1),
                                     t.params().begin() + L.expert_begin(e));
    CHECK_MESSAGE(changed == own.owns_expert(e), "expert " << e);
  }
}

TEST_CASE("a NaN loss stops the run and leaves the last checkpoint intact") {
  auto dir = test::temp_dir("nan");
  Config c = small_config(dir, {"checkpoint.every=2", "train.max_steps_this_run=2"});
  std::ostringstream csv;
  {
    Trainer t(c);
    t.run(csv, false);
  }
  const std::string good = latest_checkpoint(c.checkpoint.dir);
  REQUIRE_FALSE(good.empty());
  const CheckpointState before = load_checkpoint(good);
  Config more = small_config(dir, {"checkpoint.every=2"});
  Trainer t(more);
  std::ostringstream csv2;
  std::vector<float> poisoned = t.params();
  poisoned[5] = NAN;                          // poisons the embedding of token 5 ...
  poisoned[t.layout().final_norm] = NAN;      // ... and every token's final norm
  t.set_params(poisoned);
  try {
    t.run(csv2, false);
    FAIL("no error");
  } catch (const Error& e) {
    const std::string msg = e.what();
    CHECK(msg.find("NaN") != std::string::npos);
    CHECK(msg.find("step 0") != std::string::npos);
  }
  CHECK(latest_checkpoint(c.checkpoint.dir) == good);
  CHECK(load_checkpoint(good).params == before.params);
}

TEST_CASE("resume refuses a checkpoint of another model") {
  auto dir = test::temp_dir("mismatch");
  Config c = small_config(dir, {"train.max_steps_this_run=1"});
  std::ostringstream csv;
  Trainer(c).run(csv, false);
  Config other = small_config(dir, {"model.expert_hidden=16"});
  Trainer t(other);
  CHECK_THROWS_AS(t.run(csv, true), CheckpointError);
}

TEST_CASE("the loss goes down") {
  auto dir = test::temp_dir("learn");
  Config c = small_config(dir, {"train.steps=40", "optim.decay_steps=40"});
  std::ostringstream csv;
  Trainer t(c);
  t.run(csv, false);
  std::vector<std::string> rows = loss_column(csv.str());
  REQUIRE(rows.size() == 40);
  auto loss = [](const std::string& r) { return std::stod(r.substr(r.find(':') + 1)); };
  CHECK(loss(rows.front()) > std::log(64.0) - 0.3);
  CHECK(loss(rows.back()) < loss(rows.front()) - 1.0);
}

TEST_CASE("export -> import -> eval gives the same loss") {
  auto dir = test::temp_dir("export");
  Config c = small_config(dir, {"train.steps=3"});
  std::ostringstream csv;
  Trainer t(c);
  t.run(csv, false);
  const EvalResult before = t.evaluate(0);
  REQUIRE(before.tokens > 0);
  export_hf(c.model, t.layout(), t.params().data(), (dir / "hf").string());
  HfModel back = import_hf((dir / "hf").string());
  CHECK(back.params == t.params());
  Trainer fresh(c);
  fresh.set_params(back.params);
  const EvalResult after = fresh.evaluate(0);
  CHECK(after.tokens == before.tokens);
  CHECK(after.ce == before.ce);
  // Eval through the checkpoint path as well (what `spes-engine eval` does).
  Trainer from_ckpt(c);
  from_ckpt.load_params(load_checkpoint(c.checkpoint.dir), c.checkpoint.dir);
  CHECK(from_ckpt.evaluate(0).ce == before.ce);
}

TEST_CASE("[train] init: a fresh run starts from a checkpoint's θ (step 0); another model shape is refused") {
  auto dir = test::temp_dir("init");
  Config c = small_config(dir / "a", {"train.steps=2"});
  std::ostringstream csv;
  Trainer(c).run(csv, false);
  const CheckpointState s = load_checkpoint(c.checkpoint.dir);
  Trainer from(small_config(dir / "b", {"train.init=\"" + c.checkpoint.dir + "\""}));
  CHECK(from.step() == 0);
  CHECK(from.params() == s.params);
  CHECK(Trainer(small_config(dir / "b")).params() != s.params);  // without init: the seeded init
  try {
    Trainer wrong(small_config(dir / "c", {"model.expert_hidden=16", "train.init=\"" + c.checkpoint.dir + "\""}));
    FAIL("no error");
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()) == "small.toml: [train] init = " + c.checkpoint.dir +
                                       ": its model has [model] expert_hidden = 24, this config has 16");
  }
}
