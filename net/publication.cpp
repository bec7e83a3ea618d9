// A round's result: the next state file and θ_new − θ_old for the nodes (see publication.hpp).
#include "net/publication.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "engine/base/error.hpp"
#include "engine/base/parallel.hpp"
#include "net/file_io.hpp"
#include "net/finite_guard.hpp"
#include "net/frame.hpp"

namespace spes::net {

namespace {

[[noreturn]] void spill_fail(const std::string& dir, const std::string& what) {
  throw NetError("coordinator spill file in " + dir + ": " + what + ": " + std::strerror(errno));
}

// A round chunk frame's bytes besides its payload (header, envelope, fields), an
// estimate for the byte counts of the CSV (within ~100 bytes per 4 MiB chunk).
constexpr int64_t kRoundChunkOverhead = int64_t(kHeaderBytes) + 128;

}  // namespace

SpillFile::SpillFile(const std::string& dir) : dir_(dir) {
  fd_ = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd_ < 0) {  // a filesystem without O_TMPFILE: create, then unlink at once
    std::string name = dir + "/spill-XXXXXX";
    fd_ = ::mkostemp(name.data(), O_CLOEXEC);
    if (fd_ < 0) spill_fail(dir, "cannot create");
    ::unlink(name.c_str());
  }
}

SpillFile::~SpillFile() {
  if (fd_ >= 0) ::close(fd_);
}

void SpillFile::write(int64_t at, const void* src, size_t n) {
  std::lock_guard<std::mutex> lk(write_mu_);
  pwrite_exact(fd_, "coordinator spill file in " + dir_, src, n, at);
}

void SpillFile::read(int64_t at, size_t n, void* dst) const {
  pread_exact(fd_, "coordinator spill file in " + dir_, dst, n, at);
}

std::shared_ptr<Publication> build_publication(Codec codec, const ChunkGrid& grid, const std::vector<bool>& changed,
                                               const float* target, const StateReader& old, StateWriter& next,
                                               const std::string& spill_dir, int64_t r, int64_t step,
                                               int participants, double alpha) {
  auto pub = std::make_shared<Publication>();
  pub->round = r;
  pub->step = step;
  pub->participants = participants;
  pub->alpha = alpha;
  pub->codec = codec;
  const bool lossy = codec_is_lossy(codec);
  const size_t n_chunks = grid.chunks.size();
  std::shared_ptr<SpillFile> spill;
  std::vector<int64_t> slot(n_chunks + 1, 0);  // lossy: chunk c's payload may fill [slot[c], slot[c + 1])
  if (lossy) {
    spill = std::make_shared<SpillFile>(spill_dir);
    for (size_t c = 0; c < n_chunks; ++c) slot[c + 1] = slot[c] + int64_t(encoded_bytes(codec, grid.chunks[c].size()));
  }
  std::vector<char> refused(n_chunks, 0);  // char, not vector<bool>: written by many threads
  std::vector<int64_t> bytes(n_chunks, 0);
  // Chunks are independent: each thread reads θ_old (and the residual) of its chunk,
  // computes the new ones aside and checks them finite before writing them to `next`;
  // a chunk that would not be finite keeps its value and is not published
  // (net/finite_guard.hpp: the push checks make this a last resort).
  parallel_for(int64_t(n_chunks), [&](int64_t c) {
    const GridChunk& ch = grid.chunks[size_t(c)];
    const int64_t n = ch.size();
    const float* tg = target + ch.begin;
    auto keep_old = [&] {
      next.copy(old, Section::theta, ch.begin, n);
      if (lossy) next.copy(old, Section::residual, ch.begin, n);
    };
    if (!changed[size_t(c)]) return keep_old();
    if (!lossy) {
      if (first_non_finite(tg, n) >= 0) {
        refused[size_t(c)] = 1;
        return keep_old();
      }
      return next.write(Section::theta, ch.begin, n, tg);
    }
    // Δ = θ_new − θ_old plus what earlier downloads did not carry (error feedback),
    // computed in the residual's buffer; the update is applied in θ_old's. Scratch
    // reused per thread: fresh pages for every chunk cost more than encoding it.
    thread_local std::vector<float> th, d, new_res;
    thread_local std::vector<uint8_t> payload;
    for (auto* v : {&th, &d, &new_res}) v->resize(size_t(n));
    payload.resize(encoded_bytes(codec, n));
    old.read(Section::theta, ch.begin, n, th.data());
    old.read(Section::residual, ch.begin, n, d.data());
    for (int64_t i = 0; i < n; ++i) d[size_t(i)] += tg[i] - th[size_t(i)];
    bool ok = first_non_finite(d.data(), n) < 0;
    if (ok) {
      encode_delta(codec, d.data(), n, payload.data(), new_res.data());
      ok = apply_update(codec, payload.data(), n, th.data(), th.data()) && first_non_finite(th.data(), n) < 0 &&
           first_non_finite(new_res.data(), n) < 0;
    }
    if (!ok) {
      refused[size_t(c)] = 1;
      return keep_old();
    }
    bytes[size_t(c)] = int64_t(payload_bytes(codec, payload.data(), n));
    spill->write(slot[size_t(c)], payload.data(), size_t(bytes[size_t(c)]));
    next.write(Section::theta, ch.begin, n, th.data());
    next.write(Section::residual, ch.begin, n, new_res.data());
  });
  pub->payloads = spill;
  for (size_t c = 0; c < n_chunks; ++c) {
    if (!changed[c]) continue;
    if (refused[c]) {
      pub->refused.push_back(int(c));
      continue;
    }
    pub->chunks.push_back(int(c));
    const int64_t payload = lossy ? bytes[c] : grid.chunks[c].size() * 4;
    if (lossy) pub->payload_at.push_back(slot[c]), pub->payload_bytes.push_back(payload);
    pub->bytes += kRoundChunkOverhead + payload;
  }
  return pub;
}

}  // namespace spes::net
