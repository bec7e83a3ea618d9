// Upcycling (model/upcycle.hpp, `spes-engine upcycle`) and starting runs from it
// ([train] init, engine/init_theta.hpp): E noisy copies of the dense MLP with the
// stated relative noise, the dense model's logits at noise 0, clear errors on
// shape mismatches, and nodes + coordinator starting from the upcycled θ.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include <sys/wait.h>

#include "engine/args.hpp"
#include "engine/base/error.hpp"
#include "engine/checkpoint.hpp"
#include "engine/commands.hpp"
#include "engine/config.hpp"
#include "engine/init_theta.hpp"
#include "engine/net_sync.hpp"
#include "engine/trainer.hpp"
#include "model/cpu/cpu_model.hpp"
#include "model/hf_export.hpp"
#include "model/upcycle.hpp"
#include "net/coordinator.hpp"
#include "net/digest.hpp"
#include "spes_run_util.hpp"
#include "test_util.hpp"

using namespace spes;

namespace {

double rms(const float* w, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += double(w[i]) * w[i];
  return std::sqrt(s / double(n));
}

// Dense (one expert) and MoE twins of the test shape; expert tensors of
// 128 × 64 = 8192 elements keep the measured noise within ~1% of X.
ModelConfig dense_model() {
  ModelConfig m;
  m.vocab_size = 64;
  m.d_model = 64;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.n_experts = 1;
  m.top_k = 1;
  m.expert_hidden = 128;
  m.seq_len = 16;
  m.norm_topk_prob = true;
  return m;
}
ModelConfig moe_model(int64_t experts = 4, int64_t top_k = 2) {
  ModelConfig m = dense_model();
  m.n_experts = experts;
  m.top_k = top_k;
  return m;
}

std::string upcycle_error(const ModelConfig& dense, const ModelConfig& moe) {
  try {
    check_upcyclable(dense, moe, "DENSE", "MOE.toml");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

// CpuModel logits [B·T, V] of θ on fixed tokens.
std::vector<float> logits(const ModelConfig& m, const std::vector<float>& theta, LossParts* parts = nullptr) {
  const ParamLayout L = make_layout(m);
  const Ownership own = make_ownership(m, L, 0, 1, OwnershipMode::all, 0);
  const int64_t B = 2, T = m.seq_len;
  std::vector<int32_t> in(B * T), tgt(B * T);
  for (int64_t i = 0; i < B * T; ++i) in[i] = int32_t((i * 7 + i / 3) % m.vocab_size), tgt[i] = int32_t((i * 5 + 1) % m.vocab_size);
  CpuModel model(m, L, own, B, T);
  const LossParts p = model.forward(theta.data(), in.data(), tgt.data(), LossConfig{});
  if (parts) *parts = p;
  return {model.logits(), model.logits() + B * T * m.vocab_size};
}

// The test config as dense (one expert) or as the 4-expert MoE, training on the CPU.
Config run_config(const std::filesystem::path& dir, bool dense, std::vector<std::string> sets = {}) {
  sets.insert(sets.begin(), {"model.norm_topk_prob=true", "data.val_fraction=0.1"});
  if (dense) sets.insert(sets.end(), {"model.n_experts=1", "model.top_k=1"});
  return test::small_config(dir, sets);
}

std::string write_config(const Config& c, const std::string& path) {
  std::ofstream(path) << config_to_toml(c);
  return path;
}

// A dense checkpoint after a few steps (weights no longer at their init) in dir/dense.
std::string dense_checkpoint(const std::filesystem::path& dir) {
  Config c = run_config(dir, true, {"checkpoint.dir=\"" + (dir / "dense").string() + "\""});
  std::ostringstream csv;
  Trainer(c).run(csv, false);
  return (dir / "dense").string();
}

}  // namespace

TEST_CASE("upcycle: every expert is the dense MLP plus noise of relative size X; shared copied; fresh routers") {
  const ModelConfig d = dense_model(), m = moe_model();
  const ParamLayout dl = make_layout(d), ml = make_layout(m);
  std::vector<float> dense(size_t(dl.total));
  init_parameters(dense.data(), d, dl, 7);
  for (size_t i = 0; i < dense.size(); ++i) dense[i] += 0.01f * float(i % 13);  // not the init any more
  const double X = 0.5;
  std::vector<float> up(size_t(ml.total)), again(size_t(ml.total)), other_seed(size_t(ml.total));
  upcycle(d, dl, dense, m, ml, up.data(), {X, 11});
  upcycle(d, dl, dense, m, ml, again.data(), {X, 11});
  upcycle(d, dl, dense, m, ml, other_seed.data(), {X, 12});
  CHECK(up == again);  // deterministic
  CHECK(up != other_seed);

  std::vector<float> fresh(size_t(ml.total));
  init_parameters(fresh.data(), m, ml, 11);
  for (const ParamTensor& t : ml.tensors) {
    if (t.kind == ParamKind::expert) continue;
    const float* got = up.data() + t.offset;
    const float* want = t.kind == ParamKind::router ? fresh.data() + t.offset : dense.data() + dl.find(t.name)->offset;
    CHECK_MESSAGE(std::equal(got, got + t.numel(), want), t.name);
  }
  // rms(W_e − W_dense) / rms(W_dense) ≈ X: rms of n N(0,1) draws has relative std
  // 1/sqrt(2n) = 0.8% at n = 8192, so 4% is 5σ. Different experts' noise is
  // uncorrelated: |corr| < 0.05 (σ = 1/sqrt(n) = 0.011).
  double worst = 0;
  for (int l = 0; l < m.n_layers; ++l)
    for (int w = 0; w < 3; ++w) {
      const int64_t dense_off = w == 0 ? dl.experts[l][0].gate : w == 1 ? dl.experts[l][0].up : dl.experts[l][0].down;
      const int64_t n = m.expert_hidden * m.d_model;
      const double base = rms(dense.data() + dense_off, n);
      std::vector<std::vector<double>> eps(size_t(m.n_experts));
      for (int e = 0; e < m.n_experts; ++e) {
        const ExpertOffsets& o = ml.experts[l][e];
        const float* we = up.data() + (w == 0 ? o.gate : w == 1 ? o.up : o.down);
        std::vector<float> diff(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) diff[i] = we[i] - dense[dense_off + i];
        const double rel = rms(diff.data(), n) / base;
        worst = std::max(worst, std::fabs(rel - X) / X);
        CHECK_MESSAGE(std::fabs(rel - X) <= 0.04 * X, "layer " << l << " expert " << e << " tensor " << w << ": " << rel);
        for (int64_t i = 0; i < n; ++i) eps[e].push_back(diff[i] / (X * base));
      }
      for (int a = 0; a < m.n_experts; ++a)
        for (int b = a + 1; b < m.n_experts; ++b) {
          double dot = 0;
          for (int64_t i = 0; i < n; ++i) dot += eps[a][i] * eps[b][i];
          CHECK(std::fabs(dot / double(n)) < 0.05);
        }
    }
  MESSAGE("upcycle noise 0.5: worst |measured/X - 1| over tensors = " << worst << " (tolerance 0.04)");
}

TEST_CASE("upcycle at noise 0 computes the dense model (norm_topk_prob = true)") {
  const ModelConfig d = dense_model();
  const ParamLayout dl = make_layout(d);
  std::vector<float> dense(size_t(dl.total));
  init_parameters(dense.data(), d, dl, 3);
  // Larger MLP weights than the init, so the experts' share of the logits is not negligible.
  for (int l = 0; l < d.n_layers; ++l)
    for (int64_t i = dl.experts[l][0].gate; i < dl.experts[l][0].gate + 3 * d.expert_hidden * d.d_model; ++i)
      dense[i] *= 10.0f;
  LossParts dp;
  const std::vector<float> want = logits(d, dense, &dp);
  for (auto [E, k] : {std::pair<int64_t, int64_t>{4, 2}, {8, 8}, {4, 1}}) {
    const ModelConfig m = moe_model(E, k);
    const ParamLayout ml = make_layout(m);
    std::vector<float> up(size_t(ml.total));
    upcycle(d, dl, dense, m, ml, up.data(), {0.0, 5});
    for (int e = 0; e < E; ++e)
      for (int l = 0; l < m.n_layers; ++l)
        CHECK(std::equal(up.begin() + ml.experts[l][e].gate, up.begin() + ml.experts[l][e].gate + 3 * m.expert_hidden * m.d_model,
                         dense.begin() + dl.experts[l][0].gate));
    LossParts mp;
    const std::vector<float> got = logits(m, up, &mp);
    REQUIRE(got.size() == want.size());
    double worst = 0, scale = 0;
    for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, double(std::fabs(got[i] - want[i]))), scale = std::max(scale, double(std::fabs(want[i])));
    // The top-k weights sum to 1 up to float rounding (~1e-7 relative), and the
    // experts see the same rows, so logits agree to rounding: 1e-5 of their scale.
    MESSAGE("E = " << E << ", top_k = " << k << ": max |logit diff| = " << worst << " (logits up to " << scale
                   << "; tolerance 1e-5 x that)");
    CHECK(worst <= 1e-5 * scale);
    CHECK(std::fabs(mp.ce - dp.ce) <= 1e-5 * dp.ce);
  }
  // The check has teeth: without renormalisation the top-2 of 4 weights sum to
  // well under 1 with a fresh router, and the logits move far beyond the tolerance.
  ModelConfig m = moe_model(4, 2);
  m.norm_topk_prob = false;
  const ParamLayout ml = make_layout(m);
  std::vector<float> up(size_t(ml.total));
  upcycle(d, dl, dense, m, ml, up.data(), {0.0, 5});
  const std::vector<float> got = logits(m, up);
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, double(std::fabs(got[i] - want[i])));
  MESSAGE("norm_topk_prob = false (control): max |logit diff| = " << worst);
  CHECK(worst > 1e-3);  // 200x the tolerance above
}

TEST_CASE("upcycle: mismatched shapes are refused with the key and both values") {
  const ModelConfig d = dense_model();
  auto with = [](ModelConfig m, auto f) { f(m); return m; };
  CHECK(upcycle_error(d, moe_model()) == "(no error)");
  CHECK(upcycle_error(with(d, [](ModelConfig& m) { m.n_experts = 2; }), moe_model()) ==
        "DENSE: [model] n_experts = 2, top_k = 1: upcycle takes a dense model (n_experts = 1, top_k = 1)");
  CHECK(upcycle_error(d, with(moe_model(), [](ModelConfig& m) { m.d_model = 128; })) ==
        "upcycle: [model] d_model differs: DENSE has 64, MOE.toml has 128");
  CHECK(upcycle_error(d, with(moe_model(), [](ModelConfig& m) { m.expert_hidden = 256; })) ==
        "upcycle: [model] expert_hidden differs: DENSE has 128 (its dense MLP's hidden size), MOE.toml has 256");
  CHECK(upcycle_error(d, with(moe_model(), [](ModelConfig& m) { m.vocab_size = 256; })).find("vocab_size differs: DENSE has 64, MOE.toml has 256") != std::string::npos);
  CHECK(upcycle_error(d, with(moe_model(), [](ModelConfig& m) { m.n_layers = 3; })).find("n_layers differs: DENSE has 2, MOE.toml has 3") != std::string::npos);
  CHECK(upcycle_error(d, with(moe_model(), [](ModelConfig& m) { m.n_heads = 8; })).find("n_heads differs") != std::string::npos);
  CHECK(upcycle_error(d, with(moe_model(), [](ModelConfig& m) { m.n_kv_heads = 4; })).find("n_kv_heads differs") != std::string::npos);
  CHECK(upcycle_error(d, with(moe_model(), [](ModelConfig& m) { m.tie_embeddings = true; })).find("tie_embeddings differs") != std::string::npos);

  // A tensor whose shape disagrees with its name's (a layout the configs did not
  // predict) is named with both shapes.
  const ModelConfig m = moe_model();
  ParamLayout dl = make_layout(d);
  const ParamLayout ml = make_layout(m);
  dl.tensors[0].rows = 32, dl.tensors[0].cols = 128;  // the embedding, same element count
  std::vector<float> dense(size_t(dl.total)), out(size_t(ml.total));
  try {
    upcycle(d, dl, dense, m, ml, out.data(), {}, "DENSE", "MOE.toml");
    FAIL("no error");
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()) ==
          "upcycle: model.embed_tokens.weight is [64, 64] in MOE.toml but model.embed_tokens.weight is [32, 128] in DENSE");
  }
}

TEST_CASE("spes-engine upcycle: a step-0 checkpoint that eval, export-hf and [train] init read") {
  test::TempDir dir("upcycle-cmd");
  const std::string dense = dense_checkpoint(dir.path);
  const Config moe = run_config(dir.path, false);
  const std::string moe_toml = write_config(moe, dir / "moe.toml");
  const std::string out = dir / "upcycled";
  REQUIRE(upcycle_command({"--checkpoint", dense, "--config", moe_toml, "--out", out, "--noise", "0"}) == 0);
  const CheckpointState s = load_checkpoint(out);
  CHECK(s.step == 0);
  CHECK(s.adam_m.empty());
  const CheckpointState ds = load_checkpoint(dense);
  const Config dc = parse_config_text(ds.config_toml, "dense");

  // The upcycled model's logits are the dense model's (noise 0, norm_topk_prob).
  const std::vector<float> want = logits(dc.model, ds.params), got = logits(moe.model, s.params);
  double worst = 0, scale = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, double(std::fabs(got[i] - want[i]))), scale = std::max(scale, double(std::fabs(want[i])));
  MESSAGE("trained dense checkpoint -> 4 experts top-2: max |logit diff| = " << worst << " (tolerance 1e-5 x " << scale << ")");
  CHECK(worst <= 1e-5 * scale);

  // eval (the MoE config's fingerprint) and export-hf read it.
  Trainer ev(moe);
  ev.load_params(s, out);
  CHECK(std::isfinite(ev.evaluate(2).ce));
  REQUIRE(export_hf_command({"--checkpoint", out, "--out", dir / "hf"}) == 0);
  CHECK(import_hf(dir / "hf").params == s.params);

  // Noise past the float range is refused before anything is written.
  CHECK_THROWS_WITH_AS(
      upcycle_command({"--checkpoint", dense, "--config", moe_toml, "--out", dir / "loud", "--noise", "1e300"}),
      doctest::Contains("--noise 1e+300 makes the upcycled weights non-finite (element "), UsageError);
  CHECK(latest_checkpoint(dir / "loud").empty());
  // An existing checkpoint under --out is not overwritten.
  CHECK_THROWS_WITH_AS(upcycle_command({"--checkpoint", dense, "--config", moe_toml, "--out", out}),
                       doctest::Contains("already holds checkpoint"), UsageError);
  // Through the binary: a mismatch is one line on stderr and exit status 1.
  const Config wide = run_config(dir.path, false, {"model.expert_hidden=48"});
  const std::string cmd = std::string(SPES_ENGINE_BIN) + " upcycle --checkpoint " + dense + " --config " +
                          write_config(wide, dir / "wide.toml") + " --out " + (dir / "wide") + " 2> " + (dir / "err.txt");
  const int status = std::system(cmd.c_str());
  CHECK(WEXITSTATUS(status) == 1);
  std::ifstream err(dir / "err.txt");
  std::string line, rest;
  std::getline(err, line);
  CHECK_FALSE(std::getline(err, rest));
  CHECK(line.find("[model] expert_hidden differs: the dense checkpoint " + dense + " has 24 (its dense MLP's hidden size), " +
                  (dir / "wide.toml") + " has 48") != std::string::npos);
}

TEST_CASE("[train] init: a node and the coordinator start from the checkpoint; another shape is refused") {
  test::TempDir dir("upcycle-init");
  const std::string dense = dense_checkpoint(dir.path);
  const Config moe = run_config(dir.path, false);
  const std::string out = dir / "upcycled";
  REQUIRE(upcycle_command({"--checkpoint", dense, "--config", write_config(moe, dir / "moe.toml"), "--out", out,
                           "--noise", "0.5", "--seed", "9"}) == 0);
  const std::vector<float> file = load_checkpoint(out).params;

  const Config c = run_config(dir.path, false, {"train.init=\"" + out + "\"", "train.steps=2"});
  Trainer t(c);
  CHECK(t.step() == 0);
  CHECK(t.params() == file);  // step-0 θ is the file's, bit for bit
  std::vector<float> coordinator(file.size());
  coordinator_params(c).init_theta(coordinator.data());
  CHECK(coordinator == file);
  std::ostringstream csv;
  t.run(csv, false);
  CHECK(t.step() == 2);
  CHECK(t.params() != file);
  // Without init: the seeded init, not the file.
  CHECK(Trainer(run_config(dir.path, false)).params() != file);

  // `train --resume` takes θ from its checkpoint and does not read [train] init,
  // which may be gone by then.
  const Config r = run_config(dir.path, false, {"train.init=\"" + out + "\"", "train.steps=2",
                                                 "checkpoint.dir=\"" + (dir / "resume") + "\""});
  const std::string toml = write_config(r, dir / "resume.toml");
  const std::string train = std::string(SPES_ENGINE_BIN) + " train " + toml;
  CHECK(WEXITSTATUS(std::system((train + " --set train.max_steps_this_run=1 > /dev/null 2>&1").c_str())) == 0);
  std::filesystem::rename(out, dir / "moved");
  const std::string fresh = train + " --set 'checkpoint.dir=\"" + (dir / "fresh") + "\"'";
  CHECK(WEXITSTATUS(std::system((fresh + " > /dev/null 2>&1").c_str())) == 1);  // a fresh start needs it
  CHECK(WEXITSTATUS(std::system((train + " --resume > /dev/null 2>&1").c_str())) == 0);
  CHECK(load_checkpoint(dir / "resume").step == 2);
  std::filesystem::rename(dir / "moved", out);

  // The dense checkpoint as init of the MoE config: n_experts differs.
  const Config wrong = run_config(dir.path, false, {"train.init=\"" + dense + "\""});
  CHECK_THROWS_WITH_AS(Trainer{wrong}, doctest::Contains(("[train] init = " + dense + ": its model has [model] n_experts = 1, this config has 4").c_str()),
                       ConfigError);
}

TEST_CASE("[train] init: two SPES nodes and the coordinator start from the upcycled θ and agree after each round") {
  test::TempDir dir("upcycle-2node");
  const std::string dense = dense_checkpoint(dir.path);
  const std::string out = dir / "upcycled";
  REQUIRE(upcycle_command({"--checkpoint", dense, "--config", write_config(run_config(dir.path, false), dir / "moe.toml"),
                           "--out", out, "--noise", "0.5"}) == 0);
  const std::vector<float> file = load_checkpoint(out).params;
  const std::vector<std::string> sets = {"train.init=\"" + out + "\"", "spes.n_nodes=2", "spes.ownership=\"partitioned\"",
                                         "spes.sync_steps=2", "spes.run_id=\"upcycle-test\"", "spes.round_timeout_s=60",
                                         "spes.codec=\"fp32\"", "spes.state_dir=\"" + (dir / "coordinator") + "\""};
  net::CoordinatorParams p = coordinator_params(run_config(dir.path, false, sets));
  p.secret = "";
  net::CoordinatorOptions o;
  o.port = 0;
  o.log = false;
  o.fresh = true;  // a new run
  net::Coordinator server(std::move(p), o);
  std::thread serve([&] { server.run(); });
  const std::string address = "spes.coordinator=\"127.0.0.1:" + std::to_string(server.port()) + "\"";
  std::vector<std::unique_ptr<Trainer>> nodes;
  std::vector<std::ostringstream> csv(2);
  for (int n = 0; n < 2; ++n) {
    auto s = sets;
    s.push_back("spes.node_id=" + std::to_string(n));
    s.push_back(address);
    const Config c = run_config(dir.path / ("n" + std::to_string(n)), false, s);
    nodes.push_back(std::make_unique<Trainer>(c));
    CHECK(nodes.back()->params() == file);
    nodes.back()->set_sync_hook(make_net_sync_hook(c, nodes.back()->layout(), nodes.back()->ownership(),
                                                   nodes.back()->theta().data()));
  }
  std::vector<std::thread> ts;
  for (int n = 0; n < 2; ++n) ts.emplace_back([&, n] { nodes[n]->run(csv[n], false); });
  for (auto& t : ts) t.join();
  server.stop();
  serve.join();
  CHECK(server.stats().round == 3);
  CHECK(nodes[0]->params() == nodes[1]->params());
  CHECK(server.stats().state_hash == net::state_hash(nodes[0]->params().data(), int64_t(nodes[0]->params().size())));
  // The first round's state hash (CSV column state_hash at step 2) is the same on both nodes.
  auto first_hash = [](const std::string& text) {
    std::istringstream is(text);
    std::string header, line;
    std::getline(is, header);
    std::getline(is, line);
    std::getline(is, line);  // step 2: the first sync round
    return test::csv_field(header, line, "state_hash");
  };
  CHECK(first_hash(csv[0].str()).size() == 16);
  CHECK(first_hash(csv[0].str()) == first_hash(csv[1].str()));
}
