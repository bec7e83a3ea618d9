// GpuBackend: one node's math on one GPU (README, Architecture: "Memory plan").
//   device: every buffer of GpuBuffers (model/gpu_memory.hpp) — bf16 compute weights
//           over the whole layout; fp32 master weights, gradients and AdamW moments
//           for the owned segments only (frozen experts are bf16 weights and nothing
//           else); activations and kernel scratch for one micro-batch — carved at
//           start-up from one arena, so the step loop allocates nothing;
//   host:   the fp32 θ of the whole layout in pinned memory, which sync rounds and
//           checkpoints read and write (the state hash is taken over it, so a GPU
//           node hashes exactly what the coordinator and CPU nodes hash).
#include "engine/gpu_backend.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "cuda/adamw.cuh"
#include "cuda/attention.cuh"
#include "cuda/check.cuh"
#include "cuda/convert.cuh"
#include "cuda/device_probe.hpp"
#include "cuda/global_norm.cuh"
#include "cuda/grouped_gemm.cuh"
#include "cuda/runtime.cuh"
#include "engine/base/error.hpp"
#include "engine/config.hpp"
#include "engine/data_parallel.hpp"
#include "engine/nccl_communicator.hpp"
#include "model/gpu/gpu_model.cuh"
#include "model/gpu/gpu_plan.hpp"

namespace spes {
namespace {

using cuda::bf16;

// Throws ConfigError naming the largest node micro-batch that fits (a multiple of the
// GPUs, dividing global_batch) when the plan does not fit in the device's free memory.
void require_plan_fits(const Config& cfg, const ParamLayout& layout, const Ownership& own, const GpuMemoryPlan& plan,
                       int64_t micro_batch, int ranks, const cuda::DeviceInfo& dev) {
  size_t free_now = 0, total = 0;  // the runtime's workspace is allocated already
  cuda_check(cudaMemGetInfo(&free_now, &total));
  // cuBLAS handles and CUDA context growth; NCCL's buffers when the node has several GPUs.
  const int64_t headroom = (int64_t(512) << 20) + (ranks > 1 ? int64_t(1) << 30 : 0);
  auto fits = [&](const GpuMemoryPlan& p) { return p.arena_bytes() + headroom <= int64_t(free_now); };
  if (fits(plan)) return;
  int64_t smaller = 0;
  for (int64_t b = micro_batch - 1; b >= 1 && smaller == 0; --b)
    if (cfg.train.global_batch % (b * ranks) == 0 && fits(plan_gpu_node(cfg.model, layout, own, b, current_gpu_limits()))) smaller = b * ranks;
  throw ConfigError(cfg.path + ": [train] micro_batch = " + std::to_string(cfg.train.micro_batch) +
                    (ranks > 1 ? " (" + std::to_string(micro_batch) + " per GPU)" : std::string()) + " needs " +
                    cuda::format_bytes(size_t(plan.total())) + " on GPU " + std::to_string(dev.ordinal) + " (" +
                    dev.name + ", " + cuda::format_bytes(free_now) + " free of " + cuda::format_bytes(total) +
                    "; activations " + cuda::format_bytes(size_t(plan.bytes(MemCategory::activations))) + "): " +
                    (smaller > 0 ? "try micro_batch = " + std::to_string(smaller)
                                 : "even micro_batch = " + std::to_string(ranks) +
                                       " does not fit; train fewer experts per node or a smaller model"));
}

class GpuBackend final : public RankBackend {
 public:
  // One rank of a node: `ordinal` is its CUDA device; the node's micro-batch is split
  // over `ranks` GPUs; only rank 0 (host_copy) keeps the host θ that sync rounds and
  // checkpoints use.
  GpuBackend(const Config& cfg, const ParamLayout& layout, const Ownership& own, int ordinal, int ranks,
             bool host_copy)
      : model_cfg_(cfg.model), loss_(cfg.train.loss), layout_(layout), own_(own),
        micro_batch_(cfg.train.micro_batch / ranks), rt_(ordinal), stream_(rt_.stream()),
        runs_(adamw_runs(layout, own, false)), runs_by_class_(adamw_runs(layout, own, true)) {
    check_gpu_shape(cfg.model, cfg.path);
    // The attention's kernel family, chosen before anything is allocated or captured:
    // where it may be the sm90a one, that one's check against the portable kernels runs
    // now (once per device; on a disagreement, said on stderr, the portable ones run).
    cuda::attention_automatic_path(cfg.model.head_dim());
    plan_ = plan_gpu_node(cfg.model, layout_, own_, micro_batch_, current_gpu_limits());
    require_plan_fits(cfg, layout_, own_, plan_, micro_batch_, ranks, rt_.info());
    arena_ = cuda::DeviceArena(size_t(plan_.arena_bytes()), "GPU node arena");
    buf_ = carve_buffers(plan_, arena_);
    arena_.seal(stream_);  // NaN everywhere until written, guards after every buffer
    const size_t owned_bytes = size_t(own_.space.size()) * sizeof(float);
    for (float* p : {buf_.adam_m, buf_.adam_v, buf_.grads}) cuda_check(cudaMemsetAsync(p, 0, owned_bytes, stream_));
    model_ = std::make_unique<GpuModel>(model_cfg_, layout_, own_, plan_.sizes, rt_, buf_);
    if (host_copy) theta_ = cuda::PinnedBuffer<float>(size_t(layout_.total));
    tokens_ = cuda::PinnedBuffer<int32_t>(size_t(2 * plan_.sizes.tokens));
    peak_.flops = cuda::bf16_peak_flops(rt_, &peak_.source);
    cuda_check(cudaStreamSynchronize(stream_));

    const cuda::DeviceInfo& dev = rt_.info();
    std::fprintf(stderr, "[node %lld] GPU memory on %s (%s free of %s):\n", (long long)cfg.spes.node_id,
                 dev.name.c_str(), cuda::format_bytes(dev.free_bytes).c_str(), cuda::format_bytes(dev.total_bytes).c_str());
    for (const MemoryLine& l : memory_report(plan_))
      std::fprintf(stderr, "  %-40s %12s\n", l.category.c_str(), cuda::format_bytes(size_t(l.bytes)).c_str());
  }
  ~GpuBackend() override {
    cudaSetDevice(rt_.info().ordinal);  // handles, stream and arena belong to this device
    cudaStreamSynchronize(stream_);     // destructor path: errors have nowhere to go
  }

  std::string describe() const override {
    const cuda::DeviceInfo& d = rt_.info();
    return "cuda: " + d.name + " (sm_" + std::to_string(d.cc_major) + std::to_string(d.cc_minor) + ", " +
           cuda::format_bytes(d.total_bytes) + "); MFU against " + peak_.source + "; attention " +
           cuda::attention_automatic_path_description(model_cfg_.head_dim()) + "; expert GEMMs " +
           cuda::grouped_gemm_automatic_path_description();
  }
  PeakFlops peak_flops() const override { return peak_; }
  int64_t optimizer_state_bytes() const override { return 3 * int64_t(sizeof(float)) * own_.space.size(); }

  void zero_grads() override {
    on_device();
    cuda_check(cudaMemsetAsync(buf_.grads, 0, size_t(own_.space.size()) * sizeof(float), stream_));
  }
  LossParts forward_backward(const int32_t* inputs, const int32_t* targets, float aux_factor,
                             float grad_scale) override {
    on_device();
    copy_tokens(inputs, targets, plan_.sizes.tokens);
    return model_->forward_backward(loss_, aux_factor, grad_scale);
  }
  double grad_sum_squares() override;
  void optimizer_step(const AdamWStep& s) override;
  LossParts forward(const int32_t* inputs, const int32_t* targets, int64_t rows) override {
    on_device();
    const int64_t tokens = rows * model_cfg_.seq_len;
    if (rows < 1 || tokens > plan_.sizes.tokens) throw Error("GpuBackend::forward: rows outside [1, micro_batch]");
    copy_tokens(inputs, targets, tokens);
    return model_->forward(loss_, 1.0f, tokens);
  }

  // Empty on ranks other than 0 of a data-parallel node (they have no host copy).
  std::span<float> host_theta() override { return {theta_.data(), theta_.size()}; }
  void pull_theta() override;
  void push_theta() override;
  void read_moments(std::span<float> m, std::span<float> v) override;
  void write_moments(std::span<const float> m, std::span<const float> v) override;

  std::span<float> grad_buffer() override { return {buf_.grads, size_t(own_.space.size())}; }
  std::vector<std::span<std::byte>> theta_buffers() override {
    return {{reinterpret_cast<std::byte*>(buf_.master), size_t(own_.space.size()) * sizeof(float)},
            {reinterpret_cast<std::byte*>(buf_.weights), size_t(layout_.total) * sizeof(bf16)}};
  }

  cudaStream_t stream() const { return stream_; }
  GpuMemoryUse memory_use() const { return {plan_, int64_t(arena_.capacity()), int64_t(arena_.used())}; }

 private:
  // The calling thread's current device is this rank's: with several GPUs in one
  // process, rank threads and the trainer's thread call in turn.
  void on_device() const { cuda_check(cudaSetDevice(rt_.info().ordinal)); }
  void copy_tokens(const int32_t* inputs, const int32_t* targets, int64_t tokens);
  void require_host_theta(const char* op) const {
    if (!theta_) throw Error(std::string("GpuBackend::") + op + ": this rank keeps no host θ (rank 0 does)");
  }

  ModelConfig model_cfg_;
  LossConfig loss_;
  ParamLayout layout_;
  Ownership own_;
  int64_t micro_batch_;
  cuda::Runtime rt_;
  cudaStream_t stream_;
  std::vector<AdamWRun> runs_, runs_by_class_;  // every tensor decays / norms and embeddings apart
  GpuMemoryPlan plan_;
  cuda::DeviceArena arena_;
  DeviceBuffers buf_;
  std::unique_ptr<GpuModel> model_;
  cuda::PinnedBuffer<float> theta_;      // host θ, fp32, whole layout
  cuda::PinnedBuffer<int32_t> tokens_;   // staging for inputs and targets
  cuda::PinnedBuffer<double> host_norm_sq_{1};
  cuda::PinnedBuffer<float> host_clip_scale_{1};
  PeakFlops peak_;
  bool guards_checked_ = false;  // after the first optimizer step
};

// The pinned staging is free: every call that copies from it ends with a stream sync.
void GpuBackend::copy_tokens(const int32_t* inputs, const int32_t* targets, int64_t tokens) {
  const int64_t N = plan_.sizes.tokens;
  int32_t* in = tokens_.data();
  int32_t* tg = in + N;
  std::memcpy(in, inputs, size_t(tokens) * 4);
  std::memcpy(tg, targets, size_t(tokens) * 4);
  std::fill(in + tokens, in + N, 0);  // padding rows of a short eval batch: any valid token
  std::fill(tg + tokens, tg + N, 0);
  cuda_check(cudaMemcpyAsync(model_->inputs(), in, size_t(2 * N) * 4, cudaMemcpyHostToDevice, stream_));
}

double GpuBackend::grad_sum_squares() {
  on_device();
  const cuda::GradSpan span{buf_.grads, own_.space.size()};
  cuda::global_norm_clip(buf_.norm_sq, nullptr, &span, 1, 0.0, buf_.global_norm_scratch,
                         size_t(plan_.sizes.k.global_norm), stream_);
  cuda_check(cudaMemcpyAsync(host_norm_sq_.data(), buf_.norm_sq, sizeof(double), cudaMemcpyDeviceToHost, stream_));
  cuda_check(cudaStreamSynchronize(stream_));
  return host_norm_sq_[0];
}

void GpuBackend::optimizer_step(const AdamWStep& s) {
  on_device();
  // The pinned scale was last read by the previous step's copy, which a sync has passed.
  host_clip_scale_[0] = s.grad_scale;
  cuda_check(cudaMemcpyAsync(buf_.clip_scale, host_clip_scale_.data(), sizeof(float), cudaMemcpyHostToDevice, stream_));
  for (const AdamWRun& r : s.decay_norms_and_embeddings ? runs_ : runs_by_class_)
    cuda::adamw_update(buf_.master + r.packed, buf_.weights + r.flat, buf_.grads + r.packed, buf_.adam_m + r.packed,
                       buf_.adam_v + r.packed, r.n, float(s.lr), float(s.beta1), float(s.beta2), float(s.eps),
                       r.norm_or_embedding ? 0.0f : float(s.weight_decay), s.t, buf_.clip_scale, stream_);
  if (!guards_checked_) {  // every kernel of a step has run once, on every rank (each calls this)
    arena_.check_guards(stream_);
    guards_checked_ = true;
  }
}

void GpuBackend::pull_theta() {
  on_device();
  require_host_theta("pull_theta");
  arena_.check_guards(stream_);  // θ leaves the GPU (a sync round, a checkpoint): never from a corrupt arena
  for (const OwnedSegment& seg : own_.space.segments())
    cuda_check(cudaMemcpyAsync(theta_.data() + seg.flat.begin, buf_.master + seg.packed_begin,
                               size_t(seg.flat.size()) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  cuda_check(cudaStreamSynchronize(stream_));
}

// Host θ → bf16 compute weights (whole layout, through the fp32 staging buffer) and
// fp32 master weights (owned segments).
void GpuBackend::push_theta() {
  on_device();
  require_host_theta("push_theta");
  cuda::float_to_bf16_from_host(buf_.weights, theta_.data(), layout_.total, buf_.theta_staging, plan_.sizes.staging,
                                stream_);
  for (const OwnedSegment& seg : own_.space.segments())
    cuda_check(cudaMemcpyAsync(buf_.master + seg.packed_begin, theta_.data() + seg.flat.begin,
                               size_t(seg.flat.size()) * sizeof(float), cudaMemcpyHostToDevice, stream_));
  cuda_check(cudaStreamSynchronize(stream_));  // the host θ may change again once this returns
}

void GpuBackend::read_moments(std::span<float> m, std::span<float> v) {
  on_device();
  const size_t n = size_t(own_.space.size());
  if (m.size() != n || v.size() != n) throw Error("read_moments: owned-space size mismatch");
  arena_.check_guards(stream_);
  cuda_check(cudaMemcpyAsync(m.data(), buf_.adam_m, n * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  cuda_check(cudaMemcpyAsync(v.data(), buf_.adam_v, n * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  cuda_check(cudaStreamSynchronize(stream_));
}

void GpuBackend::write_moments(std::span<const float> m, std::span<const float> v) {
  on_device();
  const size_t n = size_t(own_.space.size());
  if (m.size() != n || v.size() != n) throw Error("write_moments: owned-space size mismatch");
  cuda_check(cudaMemcpyAsync(buf_.adam_m, m.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream_));
  cuda_check(cudaMemcpyAsync(buf_.adam_v, v.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream_));
  cuda_check(cudaStreamSynchronize(stream_));
}

}  // namespace

GpuMemoryUse gpu_memory_use(const TrainBackend& backend) {
  const auto* gpu = dynamic_cast<const GpuBackend*>(&backend);
  if (!gpu) throw Error("gpu_memory_use: not a GPU backend (" + backend.describe() + ")");
  return gpu->memory_use();
}

std::unique_ptr<RankBackend> make_gpu_rank(const Config& cfg, const ParamLayout& layout, const Ownership& own,
                                           int ordinal) {
  return std::make_unique<GpuBackend>(cfg, layout, own, ordinal, 1, true);
}

std::unique_ptr<TrainBackend> make_gpu_backend(const Config& cfg, const ParamLayout& layout, const Ownership& own,
                                               const std::vector<int>& devices) {
  if (devices.size() == 1) return make_gpu_rank(cfg, layout, own, devices[0]);
  return make_nccl_data_parallel_backend(cfg, layout, own, devices);
}

std::unique_ptr<TrainBackend> make_nccl_data_parallel_backend(const Config& cfg, const ParamLayout& layout,
                                                              const Ownership& own, const std::vector<int>& devices,
                                                              std::vector<RankBackend*>* ranks_out) {
  const int G = int(devices.size());
  if (cfg.train.micro_batch % G)
    throw ConfigError(cfg.path + ": [train] micro_batch = " + std::to_string(cfg.train.micro_batch) +
                      " must be a multiple of the node's " + std::to_string(G) + " GPUs ([train] gpus)");
  std::vector<std::unique_ptr<RankBackend>> ranks;
  std::vector<cudaStream_t> streams;
  for (int r = 0; r < G; ++r) {
    auto b = std::make_unique<GpuBackend>(cfg, layout, own, devices[size_t(r)], G, r == 0);
    streams.push_back(b->stream());
    if (ranks_out) ranks_out->push_back(b.get());
    ranks.push_back(std::move(b));
  }
  return make_data_parallel_backend(std::move(ranks), make_nccl_communicator(devices, streams), cfg.train.micro_batch,
                                    cfg.model.seq_len);
}

}  // namespace spes
