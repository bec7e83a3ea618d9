#include "net/node_push.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "engine/base/parallel.hpp"
#include "net/background_job.hpp"
#include "net/codec.hpp"

namespace spes::net {

PushPipeline::PushPipeline(NodeLink& link, const SyncClientParams& node, int threads)
    : link_(link), node_(node), threads_(threads) {
  for (auto& bank : banks_) bank.resize(size_t(threads));
}

void PushPipeline::push(const NodeGrid& grid, HeldRound& held, const float* params, int64_t step,
                        const TrainFigures& figures, bool ask_stop) {
  const int64_t r = held.round + 1;
  const Codec codec = node_.codec;
  const bool overlap = grid.grid.chunk_elems >= (int64_t(1) << 16) && threads_ > 1;
  const size_t n = grid.owned.size(), per_bank = overlap ? size_t(threads_) : 1;
  std::array<std::vector<FrameView>, 2> views{std::vector<FrameView>(per_bank), std::vector<FrameView>(per_bank)};
  std::atomic<int64_t> bad{-1};  // a chunk with non-finite parameters
  // Fills bank b with the frames of owned chunks first, first + 1, ...
  auto build = [&](int b, size_t first) {
    parallel_for(int64_t(std::min(per_bank, n - first)), threads_, [&](int64_t k) {
      const OwnedChunk& oc = grid.owned[first + size_t(k)];
      const GridChunk& c = grid.grid.chunks[oc.chunk];
      const float* res = held.residual.empty() ? nullptr : held.residual.data() + oc.owned_off;
      float* res_out = held.pending.empty() ? nullptr : held.pending.data() + oc.owned_off;
      ChunkTag t{r, step, node_.node_id, c.begin, c.end, codec};
      auto encode = [&](uint8_t* dst) {
        return encode_update(codec, params + c.begin, held.base.data() + oc.owned_off, res, res_out, c.size(), dst);
      };
      FrameWriter& w = banks_[b][size_t(k)];
      if (codec == Codec::sparse) {  // its size is known once encoded
        thread_local std::vector<uint8_t> payload;
        payload.resize(encoded_bytes(codec, c.size()));
        if (!encode(payload.data())) bad = oc.chunk;
        const size_t bytes = payload_bytes(codec, payload.data(), c.size());
        views[b][size_t(k)] = w.push_chunk(t, bytes, [&](uint8_t* dst) { std::memcpy(dst, payload.data(), bytes); });
      } else {
        views[b][size_t(k)] = w.push_chunk(t, encoded_bytes(codec, c.size()), [&](uint8_t* dst) {
          if (!encode(dst)) bad = oc.chunk;
        });
      }
    });
  };
  BackgroundJob job;  // after everything it touches: its destructor joins
  if (n > 0) build(0, 0);
  for (size_t first = 0, b = 0; first < n; first += per_bank, b ^= 1) {
    if (bad >= 0) {
      const GridChunk& c = grid.grid.chunks[size_t(bad.load())];
      throw NetError("node " + std::to_string(node_.node_id) + ": non-finite parameters in [" +
                     std::to_string(c.begin) + ", " + std::to_string(c.end) + ") at step " + std::to_string(step) +
                     "; not pushing them");
    }
    const bool more = first + per_bank < n;
    if (more && overlap) job.start([&build, b, next = first + per_bank] { build(int(b ^ 1), next); });
    for (size_t k = 0; k < std::min(per_bank, n - first); ++k) write(views[b][k]);
    job.wait();
    if (more && !overlap) build(int(b ^ 1), first + per_bank);
  }
  write(FrameWriter(256).push_done(r, node_.node_id, step, uint32_t(n), &figures, ask_stop));
}

// A push the coordinator refused mid-way (an Error frame, then it closes) shows
// here as a failed write: read the Error, if it came, so the node learns why.
void PushPipeline::write(const FrameView& v) {
  try {
    link_.write(v);
  } catch (const Transient&) {
    try {
      link_.read(kMaxFrameBytes, 1.0);
    } catch (const Refused&) {
      throw;
    } catch (const std::exception&) {
    }
    throw;
  }
}

}  // namespace spes::net
