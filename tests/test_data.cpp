// data/: token files and manifests, the sampler (order, resume, validation split),
// the byte tokenizer and the tokenize tool.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/sampler.hpp"
#include "data/token_file.hpp"
#include "data/tokenize.hpp"
#include "engine/cli.hpp"
#include "data/tokenizer.hpp"
#include "engine/base/error.hpp"

#include "test_util.hpp"

namespace fs = std::filesystem;
using namespace spes;

namespace {

using test::TempDir;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Little-endian, written byte by byte (independent of the code under test).
void write_tokens(const std::string& path, const std::vector<uint32_t>& tokens, TokenDtype dtype) {
  std::string bytes;
  for (uint32_t t : tokens) {
    for (size_t b = 0; b < token_width(dtype); ++b) bytes.push_back(static_cast<char>((t >> (8 * b)) & 0xff));
  }
  write_bytes(path, bytes);
}

// The DataError message thrown by f, or "" when it does not throw one.
std::string data_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const DataError& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

DatasetOptions opts(int64_t seq_len, int64_t vocab, TokenDtype dtype = TokenDtype::kUint16) {
  DatasetOptions o;
  o.seq_len = seq_len;
  o.vocab_size = vocab;
  o.dtype = dtype;
  return o;
}

// A dataset whose every instance is recognisable: instance k (counted over all files)
// holds k·(S+1) + t at position t, so tokens are distinct and name their instance.
std::shared_ptr<const TokenDataset> numbered_dataset(const TempDir& dir, int64_t seq_len,
                                                     const std::vector<int64_t>& instances_per_file) {
  std::string manifest;
  uint32_t next = 0;
  for (size_t f = 0; f < instances_per_file.size(); ++f) {
    std::vector<uint32_t> toks;
    for (int64_t i = 0; i < instances_per_file[f] * (seq_len + 1); ++i) toks.push_back(next++);
    const std::string name = "part" + std::to_string(f) + ".bin";
    write_tokens(dir / name, toks, TokenDtype::kUint32);
    manifest += name + "\n";
  }
  write_bytes(dir / "numbered.manifest", manifest);
  return std::make_shared<const TokenDataset>(dir / "numbered.manifest",
                                              opts(seq_len, 1 << 30, TokenDtype::kUint32));
}

// The instance a row came from, in numbered_dataset.
uint32_t row_instance(const int32_t* inputs, int64_t seq_len) {
  return static_cast<uint32_t>(inputs[0] / (seq_len + 1));
}

}  // namespace

// ---- token files and manifests ----------------------------------------------------

TEST_CASE("token dtype names") {
  CHECK(parse_token_dtype("uint16") == TokenDtype::kUint16);
  CHECK(parse_token_dtype("uint32") == TokenDtype::kUint32);
  CHECK(token_width(TokenDtype::kUint16) == 2);
  CHECK(token_width(TokenDtype::kUint32) == 4);
  CHECK(contains(data_error_of([] { parse_token_dtype("int8"); }), "int8"));
}

TEST_CASE("uint16 and uint32 token files round trip, instances are seq_len+1 tokens") {
  for (TokenDtype dtype : {TokenDtype::kUint16, TokenDtype::kUint32}) {
    CAPTURE(token_dtype_name(dtype));
    TempDir dir;
    const int64_t S = 7;
    const uint32_t big = dtype == TokenDtype::kUint16 ? 65535u : 2000000000u;  // top of the range
    // File a: 3 instances + 5 trailing tokens (dropped); file b: exactly 2 instances.
    std::vector<uint32_t> a, b;
    for (int i = 0; i < 3 * (S + 1) + 5; ++i) a.push_back(static_cast<uint32_t>(i * 37 % 1000));
    a[4] = big;
    for (int i = 0; i < 2 * (S + 1); ++i) b.push_back(static_cast<uint32_t>(5000 + i));
    write_tokens(dir / "a.bin", a, dtype);
    write_tokens(dir / "b.bin", b, dtype);
    write_bytes(dir / "m.manifest", "a.bin\nb.bin\n");

    TokenDataset ds(dir / "m.manifest", opts(S, static_cast<int64_t>(big) + 1, dtype));
    REQUIRE(ds.n_files() == 2);
    CHECK(ds.file(0).n_tokens() == a.size());
    CHECK(ds.n_instances() == 5);
    CHECK(ds.instance_tokens() == S + 1);
    std::vector<int32_t> row(S + 1);
    for (uint64_t i = 0; i < 5; ++i) {
      ds.read_instance(i, row.data());
      const auto& src = i < 3 ? a : b;
      const uint64_t first = (i < 3 ? i : i - 3) * (S + 1);
      for (int64_t t = 0; t <= S; ++t) {
        CHECK(static_cast<uint32_t>(row[t]) == src[first + t]);
      }
    }
    CHECK(ds.locate(3).file == 1);
    CHECK(ds.locate(3).token_offset == 0);
    CHECK(ds.locate(2).token_offset == 2 * (S + 1));
    CHECK(contains(data_error_of([&] { ds.read_instance(5, row.data()); }), "out of range"));
  }
}

TEST_CASE("manifest: comments, blank lines, whitespace, relative and absolute paths") {
  TempDir dir;
  fs::create_directories(dir.path / "sub");
  write_tokens(dir / "sub/x.bin", std::vector<uint32_t>(8, 1), TokenDtype::kUint16);
  write_tokens(dir / "y.bin", std::vector<uint32_t>(8, 2), TokenDtype::kUint16);
  write_bytes(dir / "sub/m.manifest", "# comment\n\n  x.bin  \r\n   # indented comment\n" + (dir / "y.bin") + "\n");
  const auto files = read_manifest(dir / "sub/m.manifest");
  REQUIRE(files.size() == 2);
  CHECK(files[0] == (dir.path / "sub" / "x.bin").lexically_normal().string());
  CHECK(files[1] == dir / "y.bin");
  TokenDataset ds(dir / "sub/m.manifest", opts(3, 256));
  CHECK(ds.n_instances() == 4);
  // With each file's size after a tab (as tokenize writes them): a file of another
  // size, cut short by a full disk or a copy, is named instead of trained on.
  write_bytes(dir / "sub/sized.manifest", "x.bin\t16\n" + (dir / "y.bin") + " \t16\n");
  CHECK(read_manifest(dir / "sub/sized.manifest") == files);
  write_tokens(dir / "y.bin", std::vector<uint32_t>(6, 2), TokenDtype::kUint16);
  CHECK(data_error_of([&] { read_manifest(dir / "sub/sized.manifest"); }) ==
        "token file " + (dir / "y.bin") + ": 12 bytes, but manifest " + (dir / "sub/sized.manifest") +
            " lists 16 (cut short or replaced since)");
}

TEST_CASE("bad data inputs fail with one line naming the file") {
  struct Case {
    const char* name;
    std::function<void(const TempDir&)> setup;  // writes files; the manifest is m.manifest
    std::string manifest;                         // which manifest to open
    std::string must_name;                        // file the message must name
    const char* what;                             // and this phrase
  };
  const int64_t S = 4;  // instance = 5 tokens
  const std::vector<Case> cases = {
      {"missing manifest", [](const TempDir&) {}, "nope.manifest", "nope.manifest", "not found"},
      {"empty manifest", [](const TempDir& d) { write_bytes(d / "m.manifest", "# only a comment\n\n"); },
       "m.manifest", "m.manifest", "lists no token files"},
      {"missing token file", [](const TempDir& d) { write_bytes(d / "m.manifest", "gone.bin\n"); },
       "m.manifest", "gone.bin", "not found"},
      {"odd size", [](const TempDir& d) {
         write_bytes(d / "odd.bin", std::string(11, '\1'));
         write_bytes(d / "m.manifest", "odd.bin\n");
       }, "m.manifest", "odd.bin", "not a multiple of 2"},
      {"shorter than one instance", [](const TempDir& d) {
         write_tokens(d / "short.bin", {1, 2, 3, 4}, TokenDtype::kUint16);
         write_bytes(d / "m.manifest", "short.bin\n");
       }, "m.manifest", "short.bin", "shorter than one instance"},
      {"empty token file", [](const TempDir& d) {
         write_bytes(d / "empty.bin", "");
         write_bytes(d / "m.manifest", "empty.bin\n");
       }, "m.manifest", "empty.bin", "shorter than one instance"},
      {"token id >= vocab", [](const TempDir& d) {
         write_tokens(d / "ok.bin", std::vector<uint32_t>(10, 7), TokenDtype::kUint16);
         write_tokens(d / "big.bin", {1, 2, 3, 4, 5, 300, 6, 7, 8, 9}, TokenDtype::kUint16);
         write_bytes(d / "m.manifest", "ok.bin\nbig.bin\n");
       }, "m.manifest", "big.bin", "token id 300 at token offset 5"},
      {"manifest is a folder", [](const TempDir& d) { fs::create_directories(d.path / "dir.manifest"); },
       "dir.manifest", "dir.manifest", "is a folder"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.name);
    TempDir dir;
    c.setup(dir);
    const std::string msg = data_error_of([&] { TokenDataset ds(dir / c.manifest, opts(S, 256)); });
    CHECK(contains(msg, c.must_name));
    CHECK(contains(msg, c.what));
    CHECK(msg.find('\n') == std::string::npos);
  }
}

TEST_CASE("dataset options out of range are refused") {
  TempDir dir;
  write_tokens(dir / "t.bin", std::vector<uint32_t>(8, 1), TokenDtype::kUint16);
  write_bytes(dir / "m.manifest", "t.bin\n");
  CHECK(contains(data_error_of([&] { TokenDataset ds(dir / "m.manifest", opts(0, 256)); }), "seq_len 0"));
  CHECK(contains(data_error_of([&] { TokenDataset ds(dir / "m.manifest", opts(3, int64_t{1} << 31)); }),
                 "vocab_size 2147483648"));
}

TEST_CASE("uint32 file whose size is not a multiple of 4") {
  TempDir dir;
  write_bytes(dir / "t.bin", std::string(22, '\0'));
  const std::string msg = data_error_of([&] { TokenFile f(dir / "t.bin", TokenDtype::kUint32); });
  CHECK(contains(msg, dir / "t.bin"));
  CHECK(contains(msg, "not a multiple of 4"));
}

TEST_CASE("big files are validated lazily, at read time, still naming file and offset") {
  TempDir dir;
  const int64_t S = 4;
  std::vector<uint32_t> toks(20, 3);
  toks[12] = 999;  // instance 2 (tokens 10..14)
  write_tokens(dir / "lazy.bin", toks, TokenDtype::kUint16);
  write_bytes(dir / "m.manifest", "lazy.bin\n");
  DatasetOptions o = opts(S, 256);
  o.scan_at_load_bytes = 0;  // treat every file as big
  TokenDataset ds(dir / "m.manifest", o);  // opens without scanning
  std::vector<int32_t> row(S + 1);
  ds.read_instance(0, row.data());
  ds.read_instance(1, row.data());
  ds.read_instance(3, row.data());
  const std::string msg = data_error_of([&] { ds.read_instance(2, row.data()); });
  CHECK(contains(msg, dir / "lazy.bin"));
  CHECK(contains(msg, "token id 999 at token offset 12 (byte 24)"));
  CHECK(contains(msg, "vocab_size 256"));
}

// ---- sampler ------------------------------------------------------------------------

TEST_CASE("splitmix64 matches the reference generator; seeds follow SPES") {
  SplitMix64 rng(1234567);  // the reference splitmix64.c outputs for this seed
  CHECK(rng.next() == 6457827717110365317ull);
  CHECK(rng.next() == 3203168211198807973ull);
  CHECK(rng.next() == 9817491932198370423ull);
  CHECK(node_seed(42, 0) == 42);
  CHECK(node_seed(42, 3) == 3042);
}

TEST_CASE("the shuffle is a seeded permutation, pinned across platforms") {
  TempDir dir;
  auto ds = numbered_dataset(dir, 3, {4, 6});  // 10 instances over two files
  const auto all = all_instances(ds->n_instances(), ds->source());
  auto order_of = [&](uint64_t seed, uint64_t epoch) {
    TrainSampler s(ds, all, seed);
    std::vector<uint32_t> order;
    std::vector<int32_t> in(3), tg(3);
    for (uint64_t e = 0; e <= epoch; ++e) {
      order.clear();
      for (uint64_t i = 0; i < ds->n_instances(); ++i) {
        s.next_batch(in.data(), tg.data(), 1);
        order.push_back(row_instance(in.data(), 3));
      }
    }
    return order;
  };
  // Fisher–Yates over splitmix64, checked against an independent Python version.
  CHECK(order_of(42, 0) == std::vector<uint32_t>{7, 8, 6, 3, 4, 5, 2, 0, 9, 1});
  CHECK(order_of(42, 1) == std::vector<uint32_t>{4, 6, 8, 1, 3, 2, 9, 7, 0, 5});
  CHECK(order_of(node_seed(42, 1), 0) == std::vector<uint32_t>{9, 0, 6, 1, 7, 5, 8, 3, 4, 2});

  // Same seed, same order; another node, another order; each epoch a permutation.
  CHECK(order_of(7, 0) == order_of(7, 0));
  CHECK(order_of(node_seed(7, 0), 0) != order_of(node_seed(7, 1), 0));
  CHECK(order_of(7, 0) != order_of(7, 1));
  for (uint64_t e = 0; e < 3; ++e) {
    auto o = order_of(99, e);
    std::sort(o.begin(), o.end());
    CHECK(o == all);
  }
}

TEST_CASE("a larger shuffle is a permutation and differs per node") {
  TempDir dir;
  auto ds = numbered_dataset(dir, 1, {500, 300, 201});
  const auto all = all_instances(ds->n_instances(), ds->source());
  TrainSampler a(ds, all, node_seed(5, 0));
  TrainSampler b(ds, all, node_seed(5, 1));
  std::vector<uint32_t> oa, ob;
  for (uint64_t i = 0; i < a.n_instances(); ++i) {
    oa.push_back(a.instance_at(i));
    ob.push_back(b.instance_at(i));
  }
  CHECK(oa != ob);
  std::sort(oa.begin(), oa.end());
  CHECK(oa == all);
}

TEST_CASE("batches are [batch, seq_len] inputs with targets shifted by one") {
  TempDir dir;
  const int64_t S = 5;
  auto ds = numbered_dataset(dir, S, {3, 4});
  TrainSampler s(ds, all_instances(ds->n_instances(), ds->source()), 11);
  const int64_t B = 3;
  std::vector<int32_t> in(B * S), tg(B * S), row(S + 1);
  for (int step = 0; step < 5; ++step) {  // 15 rows: crosses two epoch boundaries
    const uint64_t epoch = s.epoch(), pos = s.position();
    s.next_batch(in.data(), tg.data(), B);
    for (int64_t r = 0; r < B; ++r) {
      const int32_t* x = &in[r * S];
      const int32_t* y = &tg[r * S];
      for (int64_t t = 0; t < S; ++t) {
        CHECK(x[t] == static_cast<int32_t>(row_instance(x, S) * (S + 1) + t));
        CHECK(y[t] == x[t] + 1);
      }
      if (epoch == s.epoch() && pos + r < s.n_instances()) {
        CHECK(row_instance(x, S) == s.instance_at(pos + r));
      }
    }
  }
  CHECK(s.epoch() == 2);
  CHECK(s.position() == 1);
}

TEST_CASE("resume: a restored sampler continues with identical batches") {
  TempDir dir;
  const int64_t S = 4, B = 3;
  auto ds = numbered_dataset(dir, S, {5, 6});  // 11 instances
  const auto all = all_instances(ds->n_instances(), ds->source());
  for (int k : {0, 1, 3, 4, 7}) {  // 7 batches = 21 rows: the state is in epoch 1
    CAPTURE(k);
    TrainSampler a(ds, all, 77);
    std::vector<int32_t> in(B * S), tg(B * S), in2(B * S), tg2(B * S);
    for (int i = 0; i < k; ++i) a.next_batch(in.data(), tg.data(), B);
    const std::vector<uint64_t> state = a.state();

    TrainSampler b(ds, all, 77);
    b.next_batch(in2.data(), tg2.data(), B);  // b's own position must be overwritten
    b.restore(state);
    CHECK(b.state() == state);
    for (int i = 0; i < 6; ++i) {
      a.next_batch(in.data(), tg.data(), B);
      b.next_batch(in2.data(), tg2.data(), B);
      CHECK(in == in2);
      CHECK(tg == tg2);
    }
  }
}

TEST_CASE("restore refuses a state from another seed, other data, or garbage") {
  TempDir dir;
  auto ds = numbered_dataset(dir, 4, {5});
  auto other = numbered_dataset(dir, 4, {6});
  const auto all5 = all_instances(5, "x");
  TrainSampler a(ds, all5, 1);
  const auto st = a.state();

  TrainSampler other_seed(ds, all5, 2);
  CHECK(contains(data_error_of([&] { other_seed.restore(st); }), "seed 1"));
  TrainSampler other_data(other, all_instances(6, "x"), 1);
  CHECK(contains(data_error_of([&] { other_data.restore(st); }), "different data"));
  TrainSampler same(ds, all5, 1);
  CHECK(contains(data_error_of([&] { same.restore({1, 2, 3}); }), "not a sampler state"));
  auto bad = st;
  bad[6] = 99;
  CHECK(contains(data_error_of([&] { same.restore(bad); }), "past the epoch"));
}

TEST_CASE("held-out validation instances: deterministic, spread out, never trained on") {
  const auto split = split_instances(1000, 0.1, "test");
  CHECK(split.validation.size() == 100);
  CHECK(split.train.size() == 900);
  std::set<uint32_t> val(split.validation.begin(), split.validation.end());
  CHECK(val.size() == 100);
  for (uint32_t t : split.train) CHECK(val.count(t) == 0);
  CHECK(split.validation.front() == 5);   // middle of the first stride of 10
  CHECK(split.validation.back() == 995);
  CHECK(split_instances(1000, 0.1, "test").validation == split.validation);

  CHECK(split_instances(7, 0.0, "t").validation.empty());
  CHECK(split_instances(7, 0.5, "t").validation.size() == 4);  // llround(3.5)
  CHECK(contains(data_error_of([] { split_instances(10, 0.01, "src"); }), "no validation instances"));
  CHECK(contains(data_error_of([] { split_instances(2, 0.9, "src"); }), "no training instances"));
  CHECK(contains(data_error_of([] { split_instances(10, 1.0, "src"); }), "[0, 1)"));

  // Through open_data: every node holds out the same instances and never reads them.
  TempDir dir;
  const int64_t S = 3;
  numbered_dataset(dir, S, {40, 23});
  DataSpec spec;
  spec.train_manifest = dir / "numbered.manifest";
  spec.val_fraction = 0.2;
  spec.dtype = TokenDtype::kUint32;
  spec.seq_len = S;
  spec.vocab_size = 1 << 30;
  spec.base_seed = 9;
  std::vector<uint32_t> val_of_node0;
  for (int64_t node = 0; node < 3; ++node) {
    spec.node_id = node;
    DataPipeline p = open_data(spec);
    REQUIRE(p.validation.has_value());
    std::vector<uint32_t> held;
    std::vector<int32_t> in(S), tg(S);
    while (p.validation->next_batch(in.data(), tg.data(), 1) == 1) held.push_back(row_instance(in.data(), S));
    CHECK(held.size() == 13);  // llround(0.2 · 63)
    if (node == 0) val_of_node0 = held;
    CHECK(held == val_of_node0);
    const std::set<uint32_t> held_set(held.begin(), held.end());
    std::set<uint32_t> trained;
    for (uint64_t i = 0; i < 3 * p.train.n_instances(); ++i) {  // three epochs
      p.train.next_batch(in.data(), tg.data(), 1);
      const uint32_t id = row_instance(in.data(), S);
      CHECK(held_set.count(id) == 0);
      trained.insert(id);
    }
    CHECK(trained.size() == 50);
  }
}

TEST_CASE("validation iterator: fixed order, partial last batch, reset") {
  TempDir dir;
  const int64_t S = 2;
  auto ds = numbered_dataset(dir, S, {5});
  ValidationIterator v(ds, {4, 1, 3});
  std::vector<int32_t> in(2 * S), tg(2 * S);
  CHECK(v.next_batch(in.data(), tg.data(), 2) == 2);
  CHECK(row_instance(&in[0], S) == 4);
  CHECK(row_instance(&in[S], S) == 1);
  CHECK(tg[0] == in[0] + 1);
  CHECK(v.next_batch(in.data(), tg.data(), 2) == 1);
  CHECK(row_instance(&in[0], S) == 3);
  CHECK(v.next_batch(in.data(), tg.data(), 2) == 0);
  v.reset();
  CHECK(v.next_batch(in.data(), tg.data(), 2) == 2);
  CHECK(row_instance(&in[0], S) == 4);
}

TEST_CASE("open_data: separate validation manifest; both sources set is an error") {
  TempDir dir;
  write_tokens(dir / "train.bin", std::vector<uint32_t>(40, 1), TokenDtype::kUint16);
  write_tokens(dir / "val.bin", std::vector<uint32_t>(12, 2), TokenDtype::kUint16);
  write_bytes(dir / "train.manifest", "train.bin\n");
  write_bytes(dir / "val.manifest", "val.bin\n");
  DataSpec spec;
  spec.train_manifest = dir / "train.manifest";
  spec.validation_manifest = dir / "val.manifest";
  spec.seq_len = 3;
  spec.vocab_size = 256;
  DataPipeline p = open_data(spec);
  CHECK(p.train.n_instances() == 10);
  REQUIRE(p.validation.has_value());
  CHECK(p.validation->n_instances() == 3);
  std::vector<int32_t> in(3), tg(3);
  p.validation->next_batch(in.data(), tg.data(), 1);
  CHECK(in[0] == 2);

  spec.val_fraction = 0.1;
  CHECK(contains(data_error_of([&] { open_data(spec); }), "choose one"));
  spec.val_fraction = 0.0;
  spec.validation_manifest.clear();
  CHECK_FALSE(open_data(spec).validation.has_value());
}

// ---- tokenizer and tokenize -----------------------------------------------------------

TEST_CASE("byte tokenizer: token = byte, decode inverts encode") {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const auto ids = ByteTokenizer().encode(all);
  REQUIRE(ids.size() == 256);
  for (uint32_t b = 0; b < 256; ++b) CHECK(ids[b] == b);
  CHECK(ByteTokenizer().decode(std::span<const uint32_t>(ids)) == all);
  const std::vector<int32_t> hi{72, 105};
  CHECK(ByteTokenizer().decode(std::span<const int32_t>(hi)) == "Hi");
  const std::vector<int32_t> bad{65, 256};
  CHECK(contains(data_error_of([&] { ByteTokenizer().decode(std::span<const int32_t>(bad)); }), "256"));
}

TEST_CASE("tokenize text -> token files -> sampler reads back the exact bytes") {
  for (TokenDtype dtype : {TokenDtype::kUint16, TokenDtype::kUint32}) {
    CAPTURE(token_dtype_name(dtype));
    TempDir dir;
    std::string text;
    for (int i = 0; i < 200; ++i) text += "line " + std::to_string(i) + ": caf\xc3\xa9 \x01\xff!\n";
    write_bytes(dir / "in.txt", text);
    TokenizeOptions o;
    o.inputs = {dir / "in.txt"};
    o.out_dir = dir / "out";
    o.dtype = dtype;
    const TokenizeSummary s = run_tokenize(o);
    CHECK(s.documents == 1);
    CHECK(s.train_tokens == text.size() + 1);  // + EOS
    CHECK(s.validation_manifest.empty());
    REQUIRE(s.train_files == std::vector<std::string>{"train-00000.bin"});

    const std::string expected = text + std::string(1, '\0');
    const int64_t S = 63;
    TokenDataset ds(s.train_manifest, opts(S, 256, dtype));
    CHECK(ds.n_instances() == expected.size() / (S + 1));
    std::string got;
    std::vector<int32_t> row(S + 1);
    for (uint64_t i = 0; i < ds.n_instances(); ++i) {
      ds.read_instance(i, row.data());
      got += ByteTokenizer().decode(std::span<const int32_t>(row));
    }
    CHECK(got == expected.substr(0, got.size()));
    // Validation instance reading through the sampler gives the same bytes.
    ValidationIterator v(std::make_shared<const TokenDataset>(s.train_manifest, opts(S, 256, dtype)), {0});
    std::vector<int32_t> in(S), tg(S);
    v.next_batch(in.data(), tg.data(), 1);
    CHECK(ByteTokenizer().decode(std::span<const int32_t>(in)) == expected.substr(0, S));
    CHECK(ByteTokenizer().decode(std::span<const int32_t>(tg)) == expected.substr(1, S));
  }
}

TEST_CASE("tokenize text with a validation split cuts at a line end; shards list in order") {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 100; ++i) text += "the line number " + std::to_string(i) + "\n";
  write_bytes(dir / "a.txt", text);
  TokenizeOptions o;
  o.inputs = {dir / "a.txt"};
  o.out_dir = dir / "out";
  o.val_fraction = 0.1;
  o.max_shard_bytes = 1000;
  const TokenizeSummary s = run_tokenize(o);
  REQUIRE_FALSE(s.validation_manifest.empty());
  CHECK(s.train_tokens + s.validation_tokens == text.size() + 2);  // an EOS each

  auto concat = [](const std::string& manifest) {
    std::string all;
    for (const auto& f : read_manifest(manifest)) {
      const std::string raw = read_bytes(f);
      for (size_t i = 0; i < raw.size(); i += 2) all.push_back(raw[i]);  // uint16 LE, bytes < 256
    }
    return all;
  };
  const std::string train = concat(s.train_manifest);
  const std::string val = concat(s.validation_manifest);
  CHECK(s.train_files.size() == (s.train_tokens + 499) / 500);
  CHECK(s.train_files[1] == "train-00001.bin");
  REQUIRE(train.size() >= 2);
  CHECK(train.back() == '\0');
  CHECK(train[train.size() - 2] == '\n');  // the head ends at a line end
  CHECK(train.substr(0, train.size() - 1) + val.substr(0, val.size() - 1) == text);
  CHECK(val.size() - 1 <= text.size() / 10 + 1);
  CHECK(val.size() - 1 >= text.size() / 10 - 30);
  CHECK(contains(read_bytes(s.train_manifest), "# written by spes-engine tokenize"));
  // Each shard with its size (max_shard_bytes 1000): one cut short is named on reading.
  CHECK(contains(read_bytes(s.train_manifest), "\ntrain-00000.bin\t1000\n"));
  fs::resize_file(dir.path / "out" / "train-00000.bin", 998);
  CHECK(contains(data_error_of([&] { read_manifest(s.train_manifest); }), "train-00000.bin: 998 bytes, but manifest"));
}

TEST_CASE("tokenize JSONL: documents end with EOS, whole documents go to validation") {
  TempDir dir;
  std::string jsonl;
  std::vector<std::string> docs;
  for (int i = 0; i < 20; ++i) {
    docs.push_back("doc " + std::to_string(i) + " says \"hi\"\n\tok \xe2\x9c\x93");
    jsonl += nlohmann::json({{"id", i}, {"text", docs.back()}}).dump() + "\n";
    if (i == 3) jsonl += "\n   \n";                        // blank lines are skipped
    if (i == 5) jsonl += "{\"text\": \"\", \"id\": 99}\n";  // empty documents too
  }
  write_bytes(dir / "in.jsonl", jsonl);
  TokenizeOptions o;
  o.inputs = {dir / "in.jsonl"};
  o.out_dir = dir / "out";
  o.val_fraction = 0.25;
  o.dtype = TokenDtype::kUint32;
  const TokenizeSummary s = run_tokenize(o);
  CHECK(s.documents == 20);

  auto concat = [](const std::string& manifest) {
    std::string all;
    for (const auto& f : read_manifest(manifest)) {
      const std::string raw = read_bytes(f);
      for (size_t i = 0; i < raw.size(); i += 4) all.push_back(raw[i]);  // uint32 LE, bytes < 256
    }
    return all;
  };
  std::string want_train, want_val;
  for (int i = 0; i < 20; ++i) {
    // floor((d+1)/4) > floor(d/4): documents 3, 7, 11, 15, 19.
    (i % 4 == 3 ? want_val : want_train) += docs[i] + std::string(1, '\0');
  }
  CHECK(concat(s.train_manifest) == want_train);
  CHECK(concat(s.validation_manifest) == want_val);
}

TEST_CASE("bad tokenize inputs fail with file:line, and leave earlier outputs untouched") {
  struct Case {
    const char* name;
    const char* file;
    std::string content;
    const char* where;  // expected "file:line" suffix
    const char* what;
  };
  const std::vector<Case> cases = {
      {"bad JSON", "a.jsonl", "{\"text\": \"ok\"}\n{\"text\": \"oops\n", "a.jsonl:2", "not valid JSON"},
      {"not an object", "b.jsonl", "{\"text\": \"ok\"}\n\n[1, 2]\n", "b.jsonl:3", "expected a JSON object"},
      {"no text field", "c.jsonl", "{\"body\": \"x\"}\n", "c.jsonl:1", "no \"text\" field"},
      {"text not a string", "d.jsonl", "{\"text\": \"a\"}\n{\"text\": 5}\n", "d.jsonl:2", "\"text\" is number"},
      {"NUL in JSON text", "e.jsonl", "{\"text\": \"a\\u0000b\"}\n", "e.jsonl:1", "NUL"},
      {"NUL in plain text", "f.txt", std::string("one\ntwo\nth\0ree\n", 15), "f.txt:3", "NUL byte"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.name);
    TempDir dir;
    // An earlier good run's outputs.
    write_bytes(dir / "good.txt", "earlier text\n");
    TokenizeOptions good;
    good.inputs = {dir / "good.txt"};
    good.out_dir = dir / "out";
    run_tokenize(good);
    const std::string manifest_before = read_bytes(dir / "out/train.manifest");
    const std::string tokens_before = read_bytes(dir / "out/train-00000.bin");

    write_bytes(dir / c.file, c.content);
    TokenizeOptions o;
    o.inputs = {dir / "good.txt", dir / c.file};
    o.out_dir = dir / "out";
    const std::string msg = data_error_of([&] { run_tokenize(o); });
    CHECK(contains(msg, dir / c.where));
    CHECK(contains(msg, c.what));
    CHECK(msg.find('\n') == std::string::npos);
    CHECK(read_bytes(dir / "out/train.manifest") == manifest_before);
    CHECK(read_bytes(dir / "out/train-00000.bin") == tokens_before);
    size_t n_files = 0;
    for (const auto& e : fs::directory_iterator(dir.path / "out")) {
      CHECK_FALSE(contains(e.path().string(), ".tmp"));
      ++n_files;
    }
    CHECK(n_files == 2);
  }
  TempDir dir;
  TokenizeOptions o;
  o.inputs = {dir / "missing.txt"};
  o.out_dir = dir / "out";
  CHECK(contains(data_error_of([&] { run_tokenize(o); }), dir / "missing.txt"));
  write_bytes(dir / "few.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\"}\n");
  o.inputs = {dir / "few.jsonl"};
  o.val_fraction = 0.2;
  CHECK(contains(data_error_of([&] { run_tokenize(o); }), "validation split empty"));
  o.inputs = {dir / "x.jsonl.xz"};
  CHECK(contains(data_error_of([&] { run_tokenize(o); }), ".xz compression is not read"));
}

TEST_CASE("spes-engine tokenize parses the command line") {
  TempDir dir;
  write_bytes(dir / "in.txt", std::string(300, 'x') + "\n" + std::string(50, 'y') + "\n");
  CHECK(run_cli({"tokenize", "--input", dir / "in.txt", "--out", dir / "o", "--dtype", "uint32",
                       "--val-fraction", "0.2"}) == 0);
  // The cut (byte 281) moves to the next line start (byte 301).
  CHECK(fs::file_size(dir / "o/train-00000.bin") == 302 * 4);
  CHECK(fs::file_size(dir / "o/val-00000.bin") == 52 * 4);
  CHECK(fs::exists(dir / "o/val.manifest"));
  CHECK(run_cli({"tokenize", dir / "in.txt", "-o", dir / "p", "--format", "text", "--no-eos"}) == 0);
  CHECK(fs::file_size(dir / "p/train-00000.bin") == 352 * 2);

  CHECK(run_cli({"tokenize", "--help"}) == 0);
  CHECK(run_cli({"tokenize", "--out", dir / "q"}) == 2);                                    // no input
  CHECK(run_cli({"tokenize", "--input", dir / "in.txt"}) == 2);                             // no --out
  CHECK(run_cli({"tokenize", "--input", dir / "in.txt", "--out", dir / "q", "--dtype", "int8"}) == 2);
  CHECK(run_cli({"tokenize", "--input", dir / "in.txt", "--out", dir / "q", "--format", "csv"}) == 2);
  CHECK(run_cli({"tokenize", "--input", dir / "in.txt", "--out", dir / "q", "--val-fraction", "1.5"}) == 2);
  CHECK(run_cli({"tokenize", "--input", dir / "in.txt", "--out", dir / "q", "--bogus"}) == 2);
  CHECK_FALSE(fs::exists(dir / "q"));
}

TEST_CASE("the shipped Tiny Shakespeare corpus tokenizes into a usable dataset") {
  const std::string corpus = std::string(SPES_SOURCE_DIR) + "/data/corpus/tinyshakespeare.txt";
  REQUIRE(fs::exists(corpus));
  TempDir dir;
  TokenizeOptions o;
  o.inputs = {corpus};
  o.out_dir = dir / "out";
  o.val_fraction = 0.1;
  const TokenizeSummary s = run_tokenize(o);
  CHECK(s.train_tokens + s.validation_tokens == fs::file_size(corpus) + 2);
  DataSpec spec;
  spec.train_manifest = s.train_manifest;
  spec.validation_manifest = s.validation_manifest;
  spec.seq_len = 256;
  spec.vocab_size = 256;
  DataPipeline p = open_data(spec);
  CHECK(p.train.n_instances() == s.train_tokens / 257);
  CHECK(p.validation->n_instances() == s.validation_tokens / 257);
  std::vector<int32_t> in(256), tg(256);
  p.validation->next_batch(in.data(), tg.data(), 1);
  // train = head + EOS, so the validation tail starts at byte train_tokens - 1.
  CHECK(ByteTokenizer().decode(std::span<const int32_t>(in)) == read_bytes(corpus).substr(s.train_tokens - 1, 256));
}
