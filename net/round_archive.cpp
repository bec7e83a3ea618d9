#include "net/round_archive.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "engine/base/atomic_file.hpp"
#include "engine/base/error.hpp"
#include "net/state_file.hpp"

namespace spes::net {

namespace fs = std::filesystem;

namespace {

// A copy of `from` at `to`, whole or absent (write_file_atomic: a temp file, fsynced,
// renamed, removed on any error). Not std::filesystem::copy_file, whose failure on a
// full disk reads "Input/output error" and leaves its partial copy behind.
void copy_durably(const std::string& from, const std::string& to) {
  std::ifstream in(from, std::ios::binary);
  if (!in) throw NetError("cannot read " + from);
  write_file_atomic(to, [&](FileWriter& out) {
    std::vector<char> buf(size_t(1) << 20);
    while (in.read(buf.data(), std::streamsize(buf.size())) || in.gcount() > 0)
      out.write(buf.data(), size_t(in.gcount()));
    if (in.bad()) throw NetError("cannot read " + from);
  });
}

std::string rounds_list(const std::vector<int64_t>& r) {
  if (r.empty()) return "none";
  std::string s;
  for (int64_t x : r) s += (s.empty() ? "" : ", ") + std::to_string(x);
  return s;
}

}  // namespace

RoundArchive::RoundArchive(std::string state_dir, int keep, const LineLog& log)
    : dir_((fs::path(state_dir) / "rounds").string()), keep_(std::max(2, keep)), log_(log) {}

std::string RoundArchive::path(int64_t round) const {
  char name[32];
  std::snprintf(name, sizeof name, "round-%08" PRId64 ".bin", round);
  return (fs::path(dir_) / name).string();
}

std::vector<int64_t> RoundArchive::rounds() const {
  std::vector<int64_t> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    const std::string n = e.path().filename().string();
    int64_t r = -1;
    char tail[8] = {};
    if (std::sscanf(n.c_str(), "round-%" SCNd64 ".%7s", &r, tail) == 2 && std::string(tail) == "bin" && r >= 0)
      out.push_back(r);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void RoundArchive::keep(int64_t round, const std::string& state_path) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) throw NetError("cannot create " + dir_ + ": " + ec.message());
  copy_durably(state_path, path(round));
  std::vector<int64_t> kept = rounds();
  // The newest K up to this round; rounds after it (left by a rollback) are not kept.
  for (int64_t r : kept)
    if (r > round || r <= round - keep_) fs::remove(path(r), ec);
  (void)log_;
}

void roll_back(const std::string& state_dir, const std::string& state_path, int64_t round, int64_t n_params,
               const LineLog& log) {
  RoundArchive archive(state_dir, 2, log);
  const std::vector<int64_t> kept = archive.rounds();
  if (!std::binary_search(kept.begin(), kept.end(), round))
    throw NetError("--rollback-to " + std::to_string(round) + ": " + archive.path(round) +
                   " is not kept (kept rounds: " + rounds_list(kept) + "; [spes] keep_rounds sets how many)");
  {
    const auto r = StateReader::open(archive.path(round), n_params);  // verified: hashes, finite
    if (r->info().round != round)
      throw NetError(archive.path(round) + ": holds round " + std::to_string(r->info().round) + ", not " +
                     std::to_string(round));
  }
  copy_durably(archive.path(round), state_path);
  std::error_code ec;
  for (int64_t r : kept)
    if (r > round) fs::remove(archive.path(r), ec);
  write_file_atomic((fs::path(state_dir) / "rollback").string(), std::to_string(round) + "\n");
  log("rolled back to round %" PRId64 " (from %s); kept rounds after it removed: %s", round,
      archive.path(round).c_str(), rounds_list(std::vector<int64_t>(std::upper_bound(kept.begin(), kept.end(), round),
                                                                     kept.end()))
                                       .c_str());
}

int64_t rolled_back_to(const std::string& state_dir) {
  std::ifstream f(fs::path(state_dir) / "rollback");
  int64_t r = -1;
  if (f && (f >> r)) return r;
  return -1;
}

}  // namespace spes::net
