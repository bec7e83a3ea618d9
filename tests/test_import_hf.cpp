// Hugging Face import and export against transformers, with no Python: the fixtures in
// tests/oracles/hf/ are small random models that tests/oracles/hf_models.py built and
// saved with transformers, with transformers' fp32 logits on fixed tokens. Checked here:
// import -> our CPU forward (training and KV-cache decoder) within 1e-5 of those logits
// relative to their largest; import -> export -> the same bytes for every tensor (also
// through the CLI); dense -> upcycle at noise 0 -> the MoE's logits equal the dense ones
// within float rounding; unsupported config.json keys refused in one line naming them; a
// dense import trains; configs/spes-9b-upcycle.toml upcycles Qwen3-1.7B's shape to ~3B/9B.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/base/error.hpp"
#include "engine/checkpoint.hpp"
#include "engine/config.hpp"
#include "engine/trainer.hpp"
#include "model/cpu/cpu_decoder.hpp"
#include "model/cpu/cpu_model.hpp"
#include "model/hf_export.hpp"
#include "model/safetensors.hpp"
#include "model/upcycle.hpp"
#include "hf_fixtures.hpp"
#include "test_util.hpp"

using spes::testing::hf_fixtures;
using spes::testing::read_fixture_bin;

using namespace spes;
namespace fs = std::filesystem;

namespace {

const fs::path kFixtures = hf_fixtures();

// Every tensor's stored bytes (and dtype) in an HF folder, by name: one file or shards.
std::map<std::string, std::pair<std::string, std::string>> tensor_bytes(const fs::path& dir) {
  std::map<std::string, std::pair<std::string, std::string>> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".safetensors") continue;
    std::ifstream f(e.path(), std::ios::binary);
    std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    uint64_t n = 0;
    std::memcpy(&n, all.data(), 8);
    const auto header = nlohmann::json::parse(all.substr(8, n));
    for (const auto& [name, info] : header.items()) {
      if (name == "__metadata__") continue;
      const uint64_t b = info["data_offsets"][0], end = info["data_offsets"][1];
      out[name] = {info["dtype"].get<std::string>(), all.substr(8 + n + b, end - b)};
    }
  }
  return out;
}

struct Logits {
  std::vector<float> values;  // [T, V]
  double max_abs = 0;
};

Logits forward_logits(const ModelConfig& m, const std::vector<float>& params, const std::vector<int32_t>& tokens) {
  const ParamLayout layout = make_layout(m);
  const Ownership own = make_ownership(m, layout, 0, 1, OwnershipMode::all, 0);
  const int64_t T = int64_t(tokens.size());
  CpuModel model(m, layout, own, 1, T);
  std::vector<int32_t> targets(tokens.begin() + 1, tokens.end());
  targets.push_back(0);
  model.forward(params.data(), tokens.data(), targets.data(), LossConfig{});
  Logits l;
  l.values.assign(model.logits(), model.logits() + T * m.vocab_size);
  for (float x : l.values) l.max_abs = std::max(l.max_abs, double(std::fabs(x)));
  return l;
}

// max |a - b| / max |b|
double worst_relative(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, double(std::fabs(a[i] - b[i])));
    scale = std::max(scale, double(std::fabs(b[i])));
  }
  return worst / scale;
}

// *_gpu: the GPU-shaped cases (head_dim 32, bf16 weights), also run on the GPU model by
// test_gpu_import.cu.
const char* kCases[] = {"qwen3",     "qwen3_moe",     "olmo2",     "olmoe",    "qwen3_bf16", "olmo2_sharded",
                        "qwen3_gpu", "qwen3_moe_gpu", "olmo2_gpu", "olmoe_gpu"};

}  // namespace

TEST_CASE("import-hf: our CPU forward gives transformers' fp32 logits for every architecture") {
  for (const std::string c : kCases) {
    CAPTURE(c);
    const fs::path dir = kFixtures / c;
    const HfModel hf = import_hf(dir.string());
    const auto tokens = read_fixture_bin<int32_t>(dir / "tokens.bin");
    const auto ref = read_fixture_bin<float>(dir / "logits.bin");
    const double rel = worst_relative(forward_logits(hf.config, hf.params, tokens).values, ref);
    // The KV-cache decoder (generate) on the same tokens.
    const ParamLayout layout = make_layout(hf.config);
    CpuDecoder dec(hf.config, layout, hf.params.data(), int64_t(tokens.size()));
    std::vector<float> dec_logits;
    for (int32_t t : tokens) {
      const auto lg = dec.step(t);
      dec_logits.insert(dec_logits.end(), lg.begin(), lg.end());
    }
    const double rel_dec = worst_relative(dec_logits, ref);
    const std::string arch = hf_arch_class(hf.arch);  // doctest prints a const char* as an address
    MESSAGE(c << " (" << arch << "): worst |logit - transformers| / max |logit|: forward " << rel << ", decoder "
              << rel_dec << " (tol 1e-5)");
    CHECK(rel < 1e-5);
    CHECK(rel_dec < 1e-5);
  }
  // The options each architecture brings, as imported.
  const ModelConfig q = import_hf((kFixtures / "qwen3").string()).config;
  CHECK(q.qk_norm_per_head);
  CHECK(q.head_dim() == 16);
  CHECK(q.q_dim() == 64);  // != hidden_size 32
  CHECK(q.n_kv_heads * 2 == q.n_heads);
  CHECK(q.tie_embeddings);
  CHECK(q.rope_theta == 1e6);
  CHECK(q.n_experts == 1);
  const ModelConfig o = import_hf((kFixtures / "olmo2").string()).config;
  CHECK(o.post_norm);
  CHECK(!o.qk_norm_per_head);
  CHECK(make_layout(o).find("model.layers.1.post_feedforward_layernorm.weight") != nullptr);
  CHECK(import_hf((kFixtures / "qwen3_moe").string()).arch == HfArch::qwen3_moe);
}

TEST_CASE("import-hf -> export-hf: the same bytes for every tensor, the same architecture") {
  test::TempDir tmp("hf-roundtrip");
  for (const std::string c : kCases) {
    CAPTURE(c);
    const fs::path dir = kFixtures / c;
    const HfModel hf = import_hf(dir.string());
    const auto theirs = tensor_bytes(dir);
    HfExportOptions o;
    o.dtype = theirs.begin()->second.first == "BF16" ? "BF16" : "F32";
    const std::string out = tmp / c;
    export_hf(hf.config, make_layout(hf.config), hf.params.data(), out, o);
    const auto ours = tensor_bytes(out);
    CHECK(ours.size() == theirs.size());
    int same = 0;
    for (const auto& [name, t] : theirs) {
      CAPTURE(name);
      REQUIRE(ours.count(name));
      CHECK(ours.at(name).first == t.first);
      same += ours.at(name).second == t.second;
    }
    CHECK(same == int(theirs.size()));
    std::ifstream ours_cfg(fs::path(out) / "config.json"), their_cfg(dir / "config.json");
    const auto a = nlohmann::json::parse(ours_cfg), b = nlohmann::json::parse(their_cfg);
    CHECK(a["architectures"] == b["architectures"]);
    CHECK(import_hf(out).config.head_dim() == hf.config.head_dim());
  }
}

TEST_CASE("import-hf and export-hf commands: a step-0 checkpoint and its config, exported to the same bytes") {
  test::TempDir tmp("hf-cli");
  const std::string bin = SPES_ENGINE_BIN;
  for (const std::string c : {"qwen3_moe", "olmo2_sharded"}) {
    CAPTURE(c);
    const std::string ck = tmp / (c + "-ck"), ex = tmp / (c + "-ex");
    REQUIRE(std::system((bin + " import-hf --in " + (kFixtures / c).string() + " --out " + ck + " 2>/dev/null").c_str()) == 0);
    CHECK(fs::exists(fs::path(ck) / "config.toml"));
    const CheckpointState s = load_checkpoint(ck);
    CHECK(s.step == 0);
    const Config cfg = load_config((fs::path(ck) / "config.toml").string());
    CHECK(cfg.data.train == (fs::path(ck) / "data" / "train.manifest").string());
    CHECK(fs::equivalent(cfg.train.init, ck));
    REQUIRE(std::system((bin + " export-hf --checkpoint " + ck + " --out " + ex + " 2>/dev/null").c_str()) == 0);
    CHECK(tensor_bytes(ex) == tensor_bytes(kFixtures / c));
    // A second import into the same folder is refused.
    CHECK(std::system((bin + " import-hf --in " + (kFixtures / c).string() + " --out " + ck + " 2>/dev/null").c_str()) != 0);
  }
}

TEST_CASE("import-hf: a NaN or inf weight stops the import, naming the file and the tensor") {
  test::TempDir tmp("hf-nan");
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    const fs::path dir = tmp / (std::isnan(bad) ? "nan" : "inf");
    fs::create_directories(dir);
    fs::copy_file(kFixtures / "qwen3" / "config.json", dir / "config.json");
    SafeTensorsFile f = read_safetensors((kFixtures / "qwen3" / "model.safetensors").string());
    SafeTensor* t = nullptr;
    for (SafeTensor& x : f.tensors)
      if (x.name == "model.layers.1.mlp.up_proj.weight") t = &x;
    REQUIRE(t);
    t->data[7] = bad;
    write_safetensors((dir / "model.safetensors").string(), f.tensors, f.metadata);
    const std::string expect = "safetensors " + (dir / "model.safetensors").string() +
                               ": tensor 'model.layers.1.mlp.up_proj.weight' element 7 is " + (std::isnan(bad) ? "nan" : "inf");
    CHECK_THROWS_WITH_AS(import_hf(dir.string()), doctest::Contains(expect.c_str()), CheckpointError);
  }
}

TEST_CASE("dense import -> upcycle at noise 0 -> the MoE's logits are the dense ones") {
  for (const std::string c : {"qwen3", "olmo2"}) {
    CAPTURE(c);
    const fs::path dir = kFixtures / c;
    const HfModel dense = import_hf(dir.string());
    ModelConfig moe = dense.config;
    moe.n_experts = 4;
    moe.top_k = 2;
    moe.norm_topk_prob = true;  // the top-2 weights sum to 1: the dense MLP exactly
    const ParamLayout dl = make_layout(dense.config), ml = make_layout(moe);
    std::vector<float> params(size_t(ml.total));
    upcycle(dense.config, dl, dense.params, moe, ml, params.data(), UpcycleOptions{0.0, 5});
    const auto tokens = read_fixture_bin<int32_t>(dir / "tokens.bin");
    const double rel = worst_relative(forward_logits(moe, params, tokens).values,
                                      forward_logits(dense.config, dense.params, tokens).values);
    MESSAGE(c << ": upcycled (4 experts, top-2, noise 0) vs dense: worst |logit diff| / max |logit| " << rel
              << " (tol 1e-6)");
    CHECK(rel < 1e-6);
    if (c == "qwen3") CHECK(hf_arch_of(moe) == HfArch::qwen3_moe);
    if (c == "olmo2") CHECK_THROWS_AS(hf_arch_of(moe), ConfigError);  // no HF post-norm MoE
  }
}

TEST_CASE("import-hf: an unsupported architecture or option is one line naming the config.json key and value") {
  test::TempDir tmp("hf-refuse");
  const fs::path src = kFixtures / "qwen3_moe";
  std::ifstream f(src / "config.json");
  const nlohmann::json base = nlohmann::json::parse(f);
  auto error_with = [&](const std::string& key, const nlohmann::json& value) -> std::string {
    const fs::path d = tmp / key;
    fs::create_directories(d);
    fs::copy_file(src / "model.safetensors", d / "model.safetensors", fs::copy_options::overwrite_existing);
    nlohmann::json j = base;
    j[key] = value;
    std::ofstream(d / "config.json") << j.dump();
    try {
      import_hf(d.string());
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  const std::pair<const char*, nlohmann::json> cases[] = {{"model_type", "llama"},
                                                          {"use_sliding_window", true},
                                                          {"mlp_only_layers", {1}},
                                                          {"decoder_sparse_step", 2},
                                                          {"rope_scaling", {{"rope_type", "yarn"}}},
                                                          {"attention_bias", true},
                                                          {"hidden_act", "gelu"},
                                                          {"architectures", {"LlamaForCausalLM"}}};
  for (const auto& [key, value] : cases) {
    const std::string e = error_with(key, value);
    CAPTURE(e);
    CHECK(e.find("config.json: " + std::string(key) + ": ") != std::string::npos);
    CHECK(e.find(value.dump()) != std::string::npos);
    CHECK(e.find('\n') == std::string::npos);
  }
}

TEST_CASE("a dense import trains directly from its config.toml (a dense model is n_experts = 1, top_k = 1)") {
  test::TempDir tmp("hf-train");
  const std::string ck = tmp / "ck";
  REQUIRE(std::system((std::string(SPES_ENGINE_BIN) + " import-hf --in " + (kFixtures / "olmo2").string() +
                       " --out " + ck + " 2>/dev/null").c_str()) == 0);
  const std::string manifest = test::write_token_data(tmp.path / "data", 4000, 64);
  const Config c = load_config((fs::path(ck) / "config.toml").string(),
                               {"data.train=\"" + manifest + "\"", "data.token_dtype=\"uint16\"", "train.device=\"cpu\"",
                                "train.steps=3", "train.micro_batch=2", "train.global_batch=2", "train.threads=1",
                                "train.eval_every=0", "model.seq_len=16", "checkpoint.dir=\"" + (tmp / "run") + "\""});
  CHECK(c.model.n_experts == 1);
  CHECK(c.model.post_norm);
  Trainer t(c);
  const std::vector<float> start = t.params();
  CHECK(start == import_hf((kFixtures / "olmo2").string()).params);  // [train] init = the import
  std::ostringstream csv;
  t.run(csv, false);
  const std::vector<float> end = t.params();
  bool finite = true;
  for (float x : end) finite = finite && std::isfinite(x);
  CHECK(finite);
  CHECK(end != start);
  const std::string rows = csv.str();
  CHECK(std::count(rows.begin(), rows.end(), '\n') == 4);  // header + 3 steps
}

TEST_CASE("configs/spes-9b-upcycle.toml: Qwen3-1.7B's shape upcycled to A3B-9B") {
  // Qwen3-1.7B's config.json as published (its weights are not needed for the shape).
  const std::string qwen3_1_7b = R"({"architectures": ["Qwen3ForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": true,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": true,
    "use_sliding_window": false, "vocab_size": 151936})";
  const ModelConfig dense = hf_config_from_json(qwen3_1_7b, "Qwen3-1.7B/config.json").model;
  const Config moe = load_config(std::string(SPES_SOURCE_DIR) + "/configs/spes-9b-upcycle.toml");
  CHECK_NOTHROW(check_upcyclable(dense, moe.model, "Qwen3-1.7B", "spes-9b-upcycle.toml"));
  CHECK(dense.norm_eps == moe.model.norm_eps);
  CHECK(dense.rope_theta == moe.model.rope_theta);
  CHECK(hf_arch_of(moe.model) == HfArch::qwen3_moe);
  const ParamLayout dl = make_layout(dense), ml = make_layout(moe.model);
  const double total = double(ml.total), active = double(ml.shared_count + moe.model.top_k * ml.expert_block);
  MESSAGE("Qwen3-1.7B: " << double(dl.total) / 1e9 << "B; SPES-9B: " << total / 1e9 << "B total, " << active / 1e9
                         << "B active");
  CHECK(std::abs(double(dl.total) / 1e9 - 1.72) < 0.01);
  CHECK(std::abs(total / 1e9 - 9) < 0.25);
  CHECK(std::abs(active / 1e9 - 3) < 0.25);
}
