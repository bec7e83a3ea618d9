// Shared helpers of the net tests: a tiny model config, a coordinator on a
// thread, simulated nodes (their "training" is a deterministic perturbation of
// the owned parameters), and a raw POSIX client for refusal and fuzz tests.
#pragma once
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "engine/config.hpp"
#include "engine/net_sync.hpp"
#include "model/layout.hpp"
#include "net/coordinator.hpp"
#include "net/digest.hpp"
#include "net/frame.hpp"
#include "net/frame_mac.hpp"
#include "net/state_file.hpp"
#include "net/sync_client.hpp"
#include "test_util.hpp"

extern char** environ;

namespace spes::net::testing {

inline Config tiny_config(int n_nodes, Codec codec = Codec::fp32, OwnershipMode ownership = OwnershipMode::partitioned) {
  Config c;
  c.model.vocab_size = 64;
  c.model.d_model = 32;
  c.model.n_layers = 2;
  c.model.n_heads = 2;
  c.model.n_kv_heads = 2;
  c.model.n_experts = 4;
  c.model.top_k = 2;
  c.model.expert_hidden = 64;
  c.model.seq_len = 16;
  c.train.seed = 7;
  c.spes.n_nodes = n_nodes;
  c.spes.ownership = ownership;
  c.spes.experts_per_node = ownership == OwnershipMode::all ? 0 : c.model.n_experts / n_nodes;
  c.spes.sync_steps = 5;
  c.spes.run_id = "net-test";
  c.spes.coordinator = "127.0.0.1:0";
  c.spes.codec = codec;
  c.spes.round_timeout_s = 30;
  c.spes.min_nodes = 1;
  c.spes.state_dir = "";  // CoordThread: a new run in a temp folder; tests that restart set one
  return c;
}

// A loopback port that was free a moment ago (for a coordinator in another process).
inline uint16_t free_loopback_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// A field of /proc/PID/status in KiB: VmHWM (peak RSS) or VmRSS (0 when absent).
inline long status_kib(pid_t pid, const char* field) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind(field, 0) == 0) return std::atol(line.c_str() + std::strlen(field));
  return 0;
}

inline std::string temp_dir(const std::string& name) { return spes::test::temp_dir("net-" + name).string(); }

// A whole state file written and read back through StateWriter / StateReader (the
// coordinator writes and reads it a chunk at a time). save: residual / momentum
// null = none. load: theta has the model's size; the residual and the momentum are
// read when the file has them and the pointer is not null.
inline void save_state_file(const std::string& path, PersistedState info, const std::vector<float>& theta,
                            const std::vector<float>* residual, const std::vector<float>* momentum = nullptr) {
  info.has_residual = residual != nullptr;
  info.has_momentum = momentum != nullptr;
  const int64_t n = int64_t(theta.size());
  StateWriter w(path, info, n);
  w.write(Section::theta, 0, n, theta.data());
  if (residual) w.write(Section::residual, 0, n, residual->data());
  if (momentum) w.write(Section::momentum, 0, n, momentum->data());
  w.commit();
}

inline PersistedState load_state_file(const std::string& path, std::vector<float>& theta,
                                      std::vector<float>* residual, std::vector<float>* momentum = nullptr) {
  const auto r = StateReader::open(path, int64_t(theta.size()));
  const int64_t n = r->size();
  r->read(Section::theta, 0, n, theta.data());
  for (auto [section, out] : {std::pair{Section::residual, residual}, std::pair{Section::momentum, momentum}})
    if (out && r->has(section)) out->resize(size_t(n)), r->read(section, 0, n, out->data());
  return r->info();
}

// Rewrites the header of the state file at `path` to claim another format (its
// CRC made to match: only the format is wrong).
inline void set_state_file_format(const std::string& path, uint32_t format) {
  std::string bytes;
  {
    std::ifstream f(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), {});
  }
  std::memcpy(bytes.data() + 8, &format, 4);
  const uint32_t crc = crc32c(bytes.data(), 4092);
  std::memcpy(bytes.data() + 4092, &crc, 4);
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), std::streamsize(bytes.size()));
}

// A completed round's state file holding theta (and a residual / momentum when
// given) and the writer of the next round's, in a temp folder: what the merge and
// the publication read and write at a round's close.
struct RoundFiles {
  std::string dir = temp_dir("round-files");
  std::shared_ptr<const StateReader> old;
  std::unique_ptr<StateWriter> next;
  RoundFiles(const std::vector<float>& theta, const std::vector<float>* residual,
             const std::vector<float>* momentum = nullptr) {
    PersistedState h;
    h.run_id = "round-files";
    save_state_file(dir + "/coordinator_state.bin", h, theta, residual, momentum);
    old = StateReader::open(dir + "/coordinator_state.bin", int64_t(theta.size()));
    h.has_residual = residual != nullptr;
    h.has_momentum = momentum != nullptr;
    next = std::make_unique<StateWriter>(dir + "/coordinator_state.bin", h, int64_t(theta.size()));
  }
  ~RoundFiles() { std::filesystem::remove_all(dir); }
  void commit() { old = next->commit(); }  // the next round's file becomes the completed one
  std::vector<float> read(Section s = Section::theta) const {
    std::vector<float> v(size_t(old->size()));
    old->read(s, 0, old->size(), v.data());
    return v;
  }
};

// The coordinator of a test config, as the program builds it, with the tests' secret.
inline CoordinatorParams test_coordinator_params(const Config& cfg, const std::string& secret = "test-secret-0123456789") {
  CoordinatorParams p = coordinator_params(cfg);
  p.secret = secret;
  return p;
}

// A coordinator serving on its own thread, on a free loopback port. Without a
// state_dir it runs a new run (--fresh) in a temp folder of its own, removed after.
struct CoordThread {
  std::unique_ptr<Coordinator> c;
  std::thread t;
  std::ostringstream csv;
  std::string own_state_dir;
  CoordThread(const Config& cfg, CoordinatorOptions opt = {}) : CoordThread(test_coordinator_params(cfg), opt) {}
  CoordThread(CoordinatorParams params, CoordinatorOptions opt) {
    if (params.state_dir.empty()) {
      static std::atomic<int> counter{0};
      own_state_dir = (std::filesystem::temp_directory_path() /
                       ("spes-test-coordinator-" + std::to_string(::getpid()) + "-" + std::to_string(counter++)))
                          .string();
      params.state_dir = own_state_dir;
      opt.fresh = true;
    }
    if (opt.port < 0) opt.port = 0;
    if (opt.chunk_elems == (1 << 20)) opt.chunk_elems = 1024;
    opt.csv = &csv;
    c = std::make_unique<Coordinator>(std::move(params), opt);
    t = std::thread([this] { c->run(); });
  }
  ~CoordThread() {
    stop();
    if (!own_state_dir.empty()) std::filesystem::remove_all(own_state_dir);
  }
  void stop() {
    if (t.joinable()) {
      c->stop();
      t.join();
    }
  }
  uint16_t port() const { return c->port(); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port()); }
};

inline float noise(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t x = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull ^ c * 0x94D049BB133111EBull;
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 32;
  return float(double(x >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

// A node whose "training" perturbs its owned parameters deterministically.
struct TestNode {
  Config cfg;
  ParamLayout layout;
  Ownership own;
  uint64_t fp = 0;
  std::vector<float> params;
  std::unique_ptr<SyncClient> client;
  int64_t step = 0;
  TrainFigures figures;  // sent with each push (the status page)

  TestNode(const Config& c, int node_id, const std::string& address, SyncClientOptions opt = {},
           const std::string& secret = "test-secret-0123456789")
      : cfg(c) {
    cfg.spes.node_id = node_id;
    layout = make_layout(cfg.model);
    own = make_ownership(cfg.model, layout, node_id, int(cfg.spes.n_nodes), cfg.spes.ownership,
                         cfg.spes.experts_per_node);
    fp = model_fingerprint(cfg.model, layout, own);
    params.resize(size_t(layout.total));
    init_parameters(params.data(), cfg.model, layout, cfg.train.seed);
    SyncClientParams p = sync_client_params(cfg, layout, own, params);
    p.coordinator = address;
    p.secret = secret;
    if (opt.backoff_min_s == 0.2) opt.backoff_min_s = 0.02;
    if (opt.backoff_max_s == 10) opt.backoff_max_s = 0.3;
    opt.log = std::getenv("SPES_NET_TEST_LOG") != nullptr;
    client = std::make_unique<SyncClient>(p, opt);
  }

  void train(int64_t steps = 5) {
    for (int64_t s = 0; s < steps; ++s, ++step)
      for (const Range& r : own.space.ranges())
        for (int64_t i = r.begin; i < r.end; ++i) params[i] += 1e-3f * noise(own.node_id, step, i);
  }
  RoundReport sync(bool ask_stop = false) { return client->sync_round(params.data(), step, figures, ask_stop); }
};

// Every node trains, then all sync concurrently (each sync_round blocks until the round closes).
inline std::vector<RoundReport> sync_all(std::vector<std::unique_ptr<TestNode>>& nodes, bool train = true) {
  std::vector<RoundReport> st(nodes.size());
  std::vector<std::thread> ts;
  std::vector<std::string> errors(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i)
    ts.emplace_back([&, i] {
      try {
        if (train) nodes[i]->train();
        st[i] = nodes[i]->sync();
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (size_t i = 0; i < nodes.size(); ++i)
    if (!errors[i].empty()) throw std::runtime_error("node " + std::to_string(i) + ": " + errors[i]);
  return st;
}

// One HTTP/1.1 exchange with the coordinator's status server: the status code and
// the body (0 when no answer came).
struct HttpReply {
  int status = 0;
  std::string headers, body;
};
inline HttpReply http_request(uint16_t port, const std::string& target, const std::string& method = "GET") {
  HttpReply r;
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return ::close(fd), r;
  const std::string req = method + " " + target + " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
  if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) != ssize_t(req.size())) return ::close(fd), r;
  std::string all;
  char buf[65536];
  for (;;) {
    pollfd pf{fd, POLLIN, 0};
    if (::poll(&pf, 1, 10000) <= 0) break;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    all.append(buf, size_t(n));
  }
  ::close(fd);
  const size_t end = all.find("\r\n\r\n");
  if (all.rfind("HTTP/1.1 ", 0) != 0 || end == std::string::npos) return r;
  r.status = std::atoi(all.c_str() + 9);
  r.headers = all.substr(0, end);
  r.body = all.substr(end + 4);
  return r;
}

// A raw TCP client for refusal and fuzz tests (plain POSIX, with timeouts). Once
// welcomed in shared-secret mode it seals what it sends (header flag + MAC), as a
// node does, unless a test writes raw bytes itself.
struct RawConn {
  int fd = -1;
  std::string secret = "test-secret-0123456789";
  std::array<uint8_t, kNonceBytes> server_nonce{}, node_nonce{};  // from the Challenge and the Hello sent
  FrameMac mac;
  ~RawConn() { close(); }
  bool connect(uint16_t port) {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  }
  void close() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  bool send_all(const void* p, size_t n) {
    const auto* c = static_cast<const uint8_t*>(p);
    while (n) {
      const ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
      if (w <= 0) return false;
      c += w;
      n -= size_t(w);
    }
    return true;
  }
  std::vector<uint8_t> sealed(std::vector<uint8_t> f) {
    if (!mac.on() || f.size() < kHeaderBytes) return f;
    set_header_flags(f.data(), kFlagMac);
    const Digest m = mac.seal(f.data(), f.data() + kHeaderBytes, f.size() - kHeaderBytes);
    f.insert(f.end(), m.begin(), m.end());
    return f;
  }
  bool send_frame(const FrameView& v) {
    const auto* env = wire::GetEnvelope(v.body);
    if (env->msg_type() == wire::Message_Hello && vec_size(env->msg_as_Hello()->node_nonce()) == kNonceBytes)
      std::memcpy(node_nonce.data(), env->msg_as_Hello()->node_nonce()->data(), kNonceBytes);
    if (!mac.on()) return send_all(v.header, kHeaderBytes) && send_all(v.body, v.body_size);
    std::vector<uint8_t> f(v.header, v.header + kHeaderBytes);
    f.insert(f.end(), v.body, v.body + v.body_size);
    f = sealed(std::move(f));
    return send_all(f.data(), f.size());
  }
  // Reads exactly n bytes; false on close or timeout.
  bool recv_all(void* p, size_t n, double timeout_s) {
    auto* c = static_cast<uint8_t*>(p);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (n) {
      const int ms = int(std::chrono::duration<double, std::milli>(deadline - std::chrono::steady_clock::now()).count());
      if (ms <= 0) return false;
      pollfd pf{fd, POLLIN, 0};
      if (::poll(&pf, 1, ms) <= 0) return false;
      const ssize_t r = ::recv(fd, c, n, 0);
      if (r <= 0) return false;
      c += r;
      n -= size_t(r);
    }
    return true;
  }
  // One frame's payload (verified); false on close/timeout/bad frame.
  bool read_frame(std::vector<uint8_t>& payload, double timeout_s = 5) {
    uint8_t h[kHeaderBytes];
    if (!recv_all(h, kHeaderBytes, timeout_s)) return false;
    FrameHeader fh;
    if (parse_header(h, kMaxFrameBytes, &fh) != HeaderCheck::ok) return false;
    payload.resize(fh.length);
    if (!recv_all(payload.data(), fh.length, timeout_s)) return false;
    if (fh.flags & kFlagMac) {
      uint8_t m[kMacBytes];
      if (!recv_all(m, kMacBytes, timeout_s)) return false;
      if (mac.on() && !mac.open(h, payload.data(), payload.size(), m)) return false;
    }
    std::string why;
    return open_payload(payload.data(), payload.size(), fh.crc, &why) != nullptr;
  }
  // True when the peer closes (EOF) within the timeout, skipping any data.
  bool wait_closed(double timeout_s = 5) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    uint8_t buf[4096];
    for (;;) {
      const int ms = int(std::chrono::duration<double, std::milli>(deadline - std::chrono::steady_clock::now()).count());
      if (ms <= 0) return false;
      pollfd pf{fd, POLLIN, 0};
      if (::poll(&pf, 1, ms) <= 0) return false;
      const ssize_t r = ::recv(fd, buf, sizeof buf, 0);
      if (r <= 0) return true;
    }
  }
};

// Reads the Challenge's nonce; false when it does not come.
inline bool read_challenge(RawConn& c, std::array<uint8_t, kNonceBytes>& nonce) {
  std::vector<uint8_t> p;
  if (!c.read_frame(p)) return false;
  const auto* env = wire::GetEnvelope(p.data());
  if (env->msg_type() != wire::Message_Challenge || vec_size(env->msg_as_Challenge()->nonce()) != kNonceBytes)
    return false;
  std::memcpy(nonce.data(), env->msg_as_Challenge()->nonce()->data(), kNonceBytes);
  c.server_nonce = nonce;
  return true;
}

// A correct Hello for node `id` of the tiny config (fields overridable by the caller).
inline HelloFields make_hello(const Config& cfg, int id, const std::array<uint8_t, kNonceBytes>& nonce,
                              const std::string& secret = "test-secret-0123456789") {
  const ParamLayout layout = make_layout(cfg.model);
  const Ownership own =
      make_ownership(cfg.model, layout, id, int(cfg.spes.n_nodes), cfg.spes.ownership, cfg.spes.experts_per_node);
  HelloFields h;
  h.run_id = cfg.spes.run_id;
  h.node_id = id;
  h.fingerprint = model_fingerprint(cfg.model, layout, own);
  h.codec = cfg.spes.codec;
  h.sync_round = 0;
  h.state_hash = 0;
  h.proof = hmac_sha256(secret, hello_proof_message(nonce, h.run_id, id, h.fingerprint));
  return h;
}

// A frame around any envelope a test builds in `b`, with fields no real peer sends.
inline std::vector<uint8_t> envelope_frame(flatbuffers::FlatBufferBuilder& b, wire::Message type,
                                           flatbuffers::Offset<void> msg) {
  b.Finish(wire::CreateEnvelope(b, type, msg));
  std::vector<uint8_t> f(kHeaderBytes + b.GetSize());
  write_header(f.data(), uint32_t(b.GetSize()), crc32c(b.GetBufferPointer(), b.GetSize()));
  std::memcpy(f.data() + kHeaderBytes, b.GetBufferPointer(), b.GetSize());
  return f;
}

// The Hello FrameWriter::hello builds, but claiming protocol version `version`.
inline std::vector<uint8_t> hello_frame(const HelloFields& h, uint16_t version) {
  flatbuffers::FlatBufferBuilder b;
  auto run = b.CreateString(h.run_id);
  auto nn = b.CreateVector(h.node_nonce.data(), h.node_nonce.size());
  auto pr = b.CreateVector(h.proof.data(), h.proof.size());
  auto m = wire::CreateHello(b, version, run, h.node_id, h.fingerprint, wire::Codec(h.codec), h.sync_round,
                             h.state_hash, nn, pr);
  return envelope_frame(b, wire::Message_Hello, m.Union());
}

// The reply to a Hello: the Error's code and reason, or "welcome".
struct Reply {
  bool welcome = false;
  bool error = false;
  wire::ErrorCode code = wire::ErrorCode_bad_frame;
  std::string reason;
};
inline Reply read_reply(RawConn& c) {
  Reply r;
  std::vector<uint8_t> p;
  if (!c.read_frame(p)) return r;
  const auto* env = wire::GetEnvelope(p.data());
  if (env->msg_type() == wire::Message_Welcome) {
    r.welcome = true;
    if (!c.secret.empty()) c.mac.start(session_key(c.secret, c.server_nonce, c.node_nonce), FrameMac::node);
  }
  if (env->msg_type() == wire::Message_Error) {
    r.error = true;
    r.code = env->msg_as_Error()->code();
    r.reason = std::string(str_view(env->msg_as_Error()->reason()));
  }
  return r;
}

inline long rss_kib() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  long v = 0;
  while (std::fgets(line, sizeof line, f))
    if (std::strncmp(line, "VmRSS:", 6) == 0) v = std::atol(line + 6);
  std::fclose(f);
  return v;
}

template <class Pred>
bool wait_until(Pred p, double timeout_s = 10) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < deadline) {
    if (p()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return p();
}

// Re-runs this test binary as a separate process on one hidden test case (a
// coordinator whose peak RSS or SIGKILL must be its own), with extra environment
// variables; returns once it accepts connections on `port`, or kills it and fails
// the test (an orphan would hold ctest's pipe open until its timeout).
inline pid_t spawn_test_child(const std::string& test_case, std::vector<std::string> env, uint16_t port,
                              double ready_timeout_s = 10) {
  std::vector<char*> envp;
  for (char** e = environ; *e; ++e) envp.push_back(*e);
  for (auto& s : env) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string a0 = "spes_tests", a1 = "--no-skip=true", a2 = "--test-case=" + test_case, a3 = "--no-version=true",
              a4 = "--minimal=true";
  char* argv[] = {a0.data(), a1.data(), a2.data(), a3.data(), a4.data(), nullptr};
  pid_t pid = -1;
  REQUIRE(posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, envp.data()) == 0);
  const bool ready = wait_until([&] {
    RawConn c;
    return c.connect(port);
  }, ready_timeout_s);
  if (!ready) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  REQUIRE_MESSAGE(ready, "the child process " << test_case << " did not listen on port " << port << " within "
                                              << ready_timeout_s << " s");
  return pid;
}

}  // namespace spes::net::testing
