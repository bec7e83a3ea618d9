// Config parsing: every shipped config loads; every kind of bad input stops with
// one line naming the file (and line), the key and what was expected.
#include <doctest/doctest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "engine/config.hpp"
#include "engine/base/error.hpp"

using namespace spes;

namespace {

const char* kMinimal = R"([model]
d_model = 64
n_heads = 4
n_kv_heads = 2
[data]
train = "train.manifest"
)";

std::string error_of(const std::string& text, const std::vector<std::string>& sets = {}) {
  try {
    parse_config_text(text, "cfg.toml", sets);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("shipped configs load and validate") {
  for (const char* name : {"tiny.toml", "tiny-central.toml", "spes-1b.toml", "spes-1b-central.toml"}) {
    CAPTURE(name);
    Config c = load_config(std::string(SPES_SOURCE_DIR) + "/configs/" + name);
    CHECK(c.model.d_model % c.model.n_heads == 0);
  }
  Config b = load_config(std::string(SPES_SOURCE_DIR) + "/configs/spes-1b.toml");
  CHECK(b.model.d_model == 768);
  CHECK(b.model.n_layers == 12);
  CHECK(b.model.n_experts == 16);
  CHECK(b.model.vocab_size == 151665);
  CHECK(b.spes.n_nodes == 4);
  CHECK(b.spes.sync_steps == 100);
  Config central = load_config(std::string(SPES_SOURCE_DIR) + "/configs/spes-1b-central.toml");
  CHECK(central.spes.ownership == OwnershipMode::all);
  CHECK(central.spes.n_nodes == 1);
}

TEST_CASE("defaults, overrides and round trip through config_to_toml") {
  Config c = parse_config_text(kMinimal, "cfg.toml", {"optim.lr=0.003", "train.device=cpu", "model.qk_norm=false"});
  CHECK(c.model.d_model == 64);
  CHECK(c.model.n_kv_heads == 2);
  CHECK(c.optim.lr == doctest::Approx(0.003));
  CHECK(c.train.device == Device::cpu);
  CHECK_FALSE(c.model.qk_norm);
  Config back = parse_config_text(config_to_toml(c), "back.toml");
  CHECK(config_to_toml(back) == config_to_toml(c));
  CHECK(back.optim.lr == c.optim.lr);  // %.17g: bit-exact doubles
}

TEST_CASE("bad config input gives one clear line") {
  struct Case {
    std::string what;
    std::string text;
    std::vector<std::string> sets;
    std::vector<std::string> expect;  // substrings the message must contain
  };
  const std::string base = kMinimal;
  const std::vector<Case> cases = {
      {"unknown key", base + "[optim]\nlearning_rate = 1e-3\n", {}, {"cfg.toml:8", "unknown key [optim] learning_rate", "lr"}},
      {"unknown section", base + "[optimizer]\nlr = 1.0\n", {},
       {"cfg.toml:7", "unknown section [optimizer] (known: [model] [train] [optim] [data] [spes] [checkpoint])"}},
      {"wrong type", "[model]\nd_model = \"big\"\n[data]\ntrain = \"t\"\n", {}, {"cfg.toml:2", "[model] d_model", "expected an integer"}},
      {"float for int", "[model]\nn_layers = 2.5\n[data]\ntrain = \"t\"\n", {}, {"cfg.toml:2", "n_layers", "integer"}},
      {"out of range", base + "[optim]\nbeta2 = 1.5\n", {}, {"cfg.toml:8", "[optim] beta2 = 1.5", "[0, 1)"}},
      {"negative", base + "[train]\nsteps = -3\n", {}, {"cfg.toml:8", "[train] steps = -3"}},
      {"bad enum", base + "[train]\ndevice = \"tpu\"\n", {}, {"[train] device", "\"auto\" \"cuda\" \"cpu\""}},
      {"enum not a string", base + "[spes]\ncodec = 8\n", {},
       {"cfg.toml:8: [spes] codec = 8: expected one of \"fp32\" \"bf16\" \"int8\" \"sparse\""}},
      {"bad ownership", base, {"spes.ownership=some"},
       {"--set spes.ownership=some: [spes] ownership = \"some\": expected one of \"partitioned\" \"all\""}},
      {"bool type", base, {"model.qk_norm=1"}, {"--set model.qk_norm=1", "true or false"}},
      {"heads do not divide", "[model]\nd_model = 100\nn_heads = 3\n[data]\ntrain = \"t\"\n", {}, {"d_model = 100", "n_heads = 3"}},
      {"kv heads", "[model]\nn_heads = 4\nn_kv_heads = 3\n[data]\ntrain = \"t\"\n", {}, {"n_kv_heads = 3"}},
      {"top_k > experts", "[model]\nn_experts = 2\ntop_k = 3\n[data]\ntrain = \"t\"\n", {}, {"top_k = 3", "n_experts = 2"}},
      {"batch", base + "[train]\nmicro_batch = 3\nglobal_batch = 8\n", {}, {"global_batch = 8", "micro_batch = 3"}},
      {"node id", base + "[spes]\nn_nodes = 2\nnode_id = 2\n", {}, {"node_id = 2", "n_nodes = 2"}},
      {"orphan experts", base + "[spes]\nn_nodes = 2\nexperts_per_node = 2\n", {}, {"without an owner"}},
      {"no train data", "[model]\nd_model = 64\n", {}, {"[data] train"}},
      {"syntax", "[model\nd_model = 1\n", {}, {"cfg.toml", "TOML syntax error"}},
      {"set without dot", base, {"lr=1"}, {"--set lr=1", "section.key=value"}},
      {"set unknown key", base, {"model.width=3"}, {"--set model.width=3", "unknown key [model] width"}},
      {"set out of range", base, {"train.micro_batch=0"}, {"--set train.micro_batch=0", "[1, "}},
      // The parser clamps an integer past 64 bits to the range's end: the message shows
      // what was written, and the clamped value is refused.
      {"past 64 bits", base + "[train]\nsteps = 99999999999999999999\n", {},
       {"cfg.toml:8", "[train] steps = 99999999999999999999: expected an integer"}},
      {"past 64 bits, negative", base + "[train]\nseed = -99999999999999999999\n", {},
       {"[train] seed = -99999999999999999999"}},
      {"list on one line", base + "[train]\ngpus = [0,\n  -1]\n", {}, {"cfg.toml:8", "[train] gpus = [", "[0, 1023]"}},
      {"set a table", base, {"train.steps={a=1}"}, {"--set train.steps={a=1}: [train] steps = {a=1}"}},
      {"set unknown section", base, {"foo.bar=1"}, {"--set foo.bar=1: unknown section [foo]"}},
      {"duplicate key, no parser names", base + "[train]\nsteps = 2\nsteps = 3\n", {},
       {"cfg.toml:9: TOML syntax error: value (\"steps\") already exists"}},
      {"coordinator address", base + "[spes]\ncoordinator = \"localhost\"\n", {},
       {"cfg.toml: [spes] coordinator: bad coordinator address 'localhost': expected host:port"}},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    const std::string msg = error_of(c.text, c.sets);
    CAPTURE(msg);
    REQUIRE_FALSE(msg.empty());
    CHECK(msg.find('\n') == std::string::npos);
    for (const auto& e : c.expect) CHECK_MESSAGE(msg.find(e) != std::string::npos, "missing: " << e);
    CHECK_MESSAGE(msg.find("toml::") == std::string::npos, "the parser's own names leak");
  }
}

TEST_CASE("a key no longer in the key list is unknown") {
  CHECK_THROWS_WITH_AS(parse_config_text(std::string(kMinimal) + "[spes]\npersist_every = 1\n", "old/config.toml"),
                       doctest::Contains("old/config.toml:8: unknown key [spes] persist_every (known keys: node_id, "),
                       ConfigError);
}

TEST_CASE("string settings are parsed into their enums and written back by name") {
  const Config c = parse_config_text(kMinimal, "cfg.toml",
                                     {"train.device=cuda", "data.token_dtype=uint32", "spes.ownership=all",
                                      "spes.codec=int8", "spes.outer_optimizer=nesterov"});
  CHECK(c.train.device == Device::cuda);
  CHECK(c.data.token_dtype == TokenDtype::kUint32);
  CHECK(c.spes.ownership == OwnershipMode::all);
  CHECK(c.spes.codec == net::Codec::int8);
  CHECK(c.spes.outer_optimizer == net::OuterKind::nesterov);
  const std::string toml = config_to_toml(c);
  for (const char* line : {"device = \"cuda\"\n", "token_dtype = \"uint32\"\n", "ownership = \"all\"\n",
                           "codec = \"int8\"\n", "outer_optimizer = \"nesterov\"\n"})
    CHECK_MESSAGE(toml.find(line) != std::string::npos, "missing: " << line);
  const Config back = parse_config_text(toml, "back.toml");
  CHECK(back.spes.codec == net::Codec::int8);
  CHECK(config_to_toml(back) == toml);
}

TEST_CASE("path keys are relative to the config's folder; the tokenizer \"bytes\" is a name") {
  const Config c = parse_config_text(std::string(kMinimal) + "tokenizer = \"bytes\"\n[checkpoint]\ndir = \"ck\"\n",
                                     "cfg.toml", {"spes.state_dir=coord"});
  const std::filesystem::path here = std::filesystem::current_path();
  CHECK(c.data.train == (here / "train.manifest").string());
  CHECK(c.data.tokenizer == "bytes");
  CHECK(c.checkpoint.dir == (here / "ck").string());
  CHECK(c.spes.state_dir == (here / "coord").string());
  CHECK(c.spes.secret_file.empty());  // "" stays "" (not set)
}

TEST_CASE("missing config file is named; a folder is not read as one") {
  CHECK_THROWS_WITH_AS(load_config("/nonexistent/x.toml"), doctest::Contains("/nonexistent/x.toml"), ConfigError);
  // An ifstream opens a folder, and the parser then ran out of memory reading it.
  const std::string dir = std::filesystem::temp_directory_path().string();
  CHECK_THROWS_WITH_AS(load_config(dir), (dir + ": is a folder, not a TOML config file").c_str(), ConfigError);
}
