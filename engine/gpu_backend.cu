// GpuBackend: one node's math on one GPU (DESIGN §2 "GPU memory", §5).
//   device: bf16 compute weights over the whole layout; fp32 master weights,
//           gradients and AdamW moments for the owned segments only (frozen experts
//           are bf16 weights and nothing else); activations and kernel scratch for
//           one micro-batch — all carved at start-up from one arena, sized by
//           plan_gpu_memory, so the step loop allocates nothing;
//   host:   the fp32 θ of the whole layout in pinned memory, which sync rounds and
//           checkpoints read and write (the state hash is taken over it, so a GPU
//           node hashes exactly what the coordinator and CPU nodes hash).
#include "engine/gpu_backend.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>

#include "cuda/adamw.cuh"
#include "cuda/attention.cuh"
#include "cuda/check.cuh"
#include "cuda/convert.cuh"
#include "cuda/device_probe.hpp"
#include "cuda/embedding.cuh"
#include "cuda/global_norm.cuh"
#include "cuda/matmul.cuh"
#include "cuda/norm_common.cuh"
#include "cuda/rmsnorm.cuh"
#include "cuda/rope.cuh"
#include "cuda/runtime.cuh"
#include "engine/base/error.hpp"
#include "engine/config.hpp"
#include "engine/data_parallel.hpp"
#include "model/gpu/gpu_model.cuh"

namespace spes {

KernelScratch gpu_kernel_scratch(const ModelConfig& m, int64_t micro_batch, int64_t owned) {
  const int64_t N = micro_batch * m.seq_len, d = m.d_model, hd = m.head_dim();
  const cuda::MoeShape shape{N, d, m.n_experts, m.top_k, m.expert_hidden, m.norm_topk_prob};
  KernelScratch k;
  k.moe_saved = cuda::MoeSaved::bytes(shape);
  k.moe_scratch = cuda::MoeScratch::bytes(shape);
  k.attention_backward = int64_t(cuda::attention_backward_scratch_bytes(micro_batch, m.seq_len, m.n_heads));
  k.norm_backward = int64_t(std::max({cuda::rmsnorm_backward_scratch_bytes(N, d),
                                      cuda::qknorm_rope_backward_scratch_bytes(micro_batch, m.seq_len, m.n_heads, hd),
                                      cuda::qknorm_rope_backward_scratch_bytes(micro_batch, m.seq_len, m.n_kv_heads, hd)}));
  k.embedding_backward = int64_t(cuda::embedding_backward_workspace_bytes(N, m.vocab_size));
  const cuda::GradSpan span{nullptr, owned};
  k.global_norm = int64_t(cuda::global_norm_scratch_bytes(&span, 1));
  k.rope_table = int64_t(cuda::rope_table_bytes(m.seq_len, hd));
  k.gemm_workspace = int64_t(cuda::kLtWorkspaceBytes);
  return k;
}

KernelScratch gpu_kernel_scratch_estimate(const ModelConfig& m, int64_t micro_batch, int64_t owned) {
  const int64_t N = micro_batch * m.seq_len, d = m.d_model, kv = m.kv_dim();
  const cuda::MoeShape shape{N, d, m.n_experts, m.top_k, m.expert_hidden, m.norm_topk_prob};
  KernelScratch k;
  k.moe_saved = cuda::MoeSaved::bytes(shape);
  k.moe_scratch = cuda::MoeScratch::bytes(shape);
  k.attention_backward = int64_t(cuda::attention_backward_scratch_bytes(micro_batch, m.seq_len, m.n_heads));
  // The norm backwards keep one C-float partial per resident block: at most
  // 32 blocks × 132 SMs (an H100/H200) of them.
  k.norm_backward = std::min<int64_t>(N, 32 * 132) * std::max(d, kv) * 4;
  // Sort keys and positions (4 arrays of N int32, 256-byte rounded) + CUB's radix
  // sort storage, about a second copy of the pairs plus histograms.
  k.embedding_backward = 4 * ((N * 4 + 255) / 256 * 256) + 8 * N + (int64_t(1) << 20);
  const cuda::GradSpan span{nullptr, owned};
  k.global_norm = int64_t(cuda::global_norm_scratch_bytes(&span, 1));
  k.rope_table = int64_t(cuda::rope_table_bytes(m.seq_len, m.head_dim()));
  k.gemm_workspace = int64_t(cuda::kLtWorkspaceBytes);
  return k;
}

namespace {

using cuda::bf16;

struct PinnedFree {
  void operator()(void* p) const {
    if (p) cudaFreeHost(p);  // destructor path: nothing useful to do on error
  }
};
template <class T>
using Pinned = std::unique_ptr<T, PinnedFree>;

template <class T>
Pinned<T> pinned(size_t count) {
  void* p = nullptr;
  cuda_check(cudaMallocHost(&p, std::max<size_t>(count, 1) * sizeof(T)));
  return Pinned<T>(static_cast<T*>(p));
}

// Shapes the kernels cannot run: refused before anything is allocated.
void check_gpu_shape(const Config& cfg) {
  const ModelConfig& m = cfg.model;
  auto refuse = [&](const std::string& why) { throw GpuShapeError(cfg.path + ": [model] " + why); };
  if (m.head_dim() != 32 && m.head_dim() != 64 && m.head_dim() != 128)
    refuse("d_model / n_heads = " + std::to_string(m.head_dim()) + ": the GPU attention kernels support head dims 32, 64 and 128");
  if (m.d_model % 8 || m.kv_dim() % 8) refuse("d_model and the kv width must be multiples of 8 on the GPU");
  if (!m.qk_norm) refuse("qk_norm = false: the GPU's RoPE kernel is fused with the QK-norm");
  if (m.n_experts > 256 || m.top_k > 32) refuse("the GPU router supports at most 256 experts and top_k 32");
  if (m.d_model > cuda::norm::kMaxChannels || m.kv_dim() > cuda::norm::kMaxChannels)
    refuse("d_model and the kv width must be at most " + std::to_string(cuda::norm::kMaxChannels) +
           " on the GPU (its norm kernels keep a row in registers)");
}

// Dense bf16 tensor-core peak by device name (datasheet, dense), 0 when unknown.
double datasheet_bf16_peak(const std::string& name) {
  struct Row {
    const char* match;
    double flops;
  };
  static const Row rows[] = {{"H200", 989.4e12}, {"H100 PCIe", 756.0e12}, {"H100 NVL", 835.0e12},
                             {"H100", 989.4e12}, {"A100", 312.0e12}};
  for (const Row& r : rows)
    if (name.find(r.match) != std::string::npos) return r.flops;
  return 0;
}

class GpuBackend final : public TrainBackend {
 public:
  // One rank of a node: `ordinal` is its CUDA device; the node's micro-batch is split
  // over `ranks` GPUs; only rank 0 (host_copy) keeps the host θ that sync rounds and
  // checkpoints use.
  GpuBackend(const Config& cfg, const ParamLayout& layout, const Ownership& own, int ordinal = 0, int ranks = 1,
             bool host_copy = true);
  ~GpuBackend() override;

  std::string describe() const override;
  void zero_grads() override;
  LossParts forward_backward(const int32_t* inputs, const int32_t* targets, float aux_factor,
                             float grad_scale) override;
  double grad_sum_squares() override;
  void optimizer_step(const AdamWStep& s) override;
  LossParts forward(const int32_t* inputs, const int32_t* targets, int64_t rows) override;
  // Empty on ranks other than 0 of a data-parallel node (they have no host copy).
  std::span<float> host_theta() override {
    return theta_ ? std::span<float>(theta_.get(), size_t(layout_.total)) : std::span<float>();
  }
  void pull_theta() override;
  void push_theta() override;
  void read_moments(std::span<float> m, std::span<float> v) override;
  void write_moments(std::span<const float> m, std::span<const float> v) override;
  int64_t optimizer_state_bytes() const override { return 3 * int64_t(sizeof(float)) * own_.space.size(); }
  std::vector<MemoryLine> memory_report() const override;
  std::span<float> grad_buffer() override { return {grads_, size_t(own_.space.size())}; }
  std::vector<std::span<std::byte>> theta_buffers() override {
    return {{reinterpret_cast<std::byte*>(master_), size_t(own_.space.size()) * sizeof(float)},
            {reinterpret_cast<std::byte*>(weights_), size_t(layout_.total) * sizeof(bf16)}};
  }
  cudaStream_t stream() const { return stream_; }
  int ordinal() const { return rt_.info().ordinal; }
  double peak_flops() const override { return peak_flops_; }
  std::string peak_flops_source() const override { return peak_source_; }
  GpuArenaUse arena_use() const { return {int64_t(arena_.capacity()), int64_t(arena_.used())}; }

 private:
  // A run of owned tensors that AdamW updates in one launch: contiguous in the flat
  // layout and in owned space, and (in runs_by_class_) of one decay class.
  struct AdamRun {
    int64_t flat, packed, n;
    bool norm_or_embedding;
  };
  void copy_tokens(const int32_t* inputs, const int32_t* targets, int64_t tokens);
  // The calling thread's current device is this rank's: with several GPUs in one
  // process, rank threads and the trainer's thread call in turn.
  void on_device() const { cuda_check(cudaSetDevice(rt_.info().ordinal)); }
  void measure_peak();

  ModelConfig model_cfg_;
  LossConfig loss_;
  ParamLayout layout_;
  Ownership own_;
  int64_t micro_batch_;
  cuda::Runtime rt_;
  cudaStream_t stream_;
  GpuMemoryPlan plan_;
  cuda::DeviceArena arena_;
  std::unique_ptr<GpuBuffers> buf_;
  std::unique_ptr<GpuModel> model_;
  bf16* weights_;
  float *master_, *m_, *v_, *grads_, *staging_, *clip_scale_;
  double* norm_sq_;
  void* norm_scratch_;
  int64_t staging_count_;
  std::vector<AdamRun> runs_, runs_by_class_;  // every tensor decays / norms and embeddings apart
  Pinned<float> theta_;           // host θ, fp32, whole layout
  Pinned<int32_t> tokens_;        // staging for inputs and targets
  Pinned<double> host_norm_sq_;
  Pinned<float> host_clip_scale_;
  double peak_flops_ = 0;
  std::string peak_source_;
  bool guards_checked_ = false;  // after the first optimizer step
};

GpuBackend::GpuBackend(const Config& cfg, const ParamLayout& layout, const Ownership& own, int ordinal, int ranks,
                       bool host_copy)
    : model_cfg_(cfg.model), loss_(cfg.train.loss), layout_(layout), own_(own),
      micro_batch_(cfg.train.micro_batch / ranks), rt_(ordinal), stream_(rt_.stream()) {
  const ModelConfig& m = cfg.model;
  check_gpu_shape(cfg);
  const int64_t owned = own_.space.size();
  plan_ = plan_gpu_memory(m, layout_, own_, micro_batch_, gpu_kernel_scratch(m, micro_batch_, owned));
  const cuda::DeviceInfo& dev = rt_.info();
  const int64_t need = plan_.total();
  // The runtime's workspace is allocated already; compare the rest with what is free now.
  size_t free_now = 0, total = 0;
  cuda_check(cudaMemGetInfo(&free_now, &total));
  // cuBLAS handles and CUDA context growth; NCCL's buffers when the node has several GPUs.
  const int64_t headroom = (int64_t(512) << 20) + (ranks > 1 ? int64_t(1) << 30 : 0);
  if (plan_.arena_bytes() + headroom > int64_t(free_now)) {
    // The largest node micro-batch (a multiple of the GPUs, dividing global_batch) that fits.
    int64_t fits = 0;
    for (int64_t b = micro_batch_ - 1; b >= 1 && fits == 0; --b) {
      if (cfg.train.global_batch % (b * ranks)) continue;
      const GpuMemoryPlan p = plan_gpu_memory(m, layout_, own_, b, gpu_kernel_scratch(m, b, owned));
      if (p.arena_bytes() + headroom <= int64_t(free_now)) fits = b * ranks;
    }
    throw ConfigError(cfg.path + ": [train] micro_batch = " + std::to_string(cfg.train.micro_batch) +
                      (ranks > 1 ? " (" + std::to_string(micro_batch_) + " per GPU)" : std::string()) + " needs " +
                      cuda::format_bytes(size_t(need)) + " on GPU " + std::to_string(dev.ordinal) + " (" + dev.name +
                      ", " + cuda::format_bytes(free_now) + " free of " + cuda::format_bytes(total) + "; activations " +
                      cuda::format_bytes(size_t(plan_.bytes(MemCategory::activations))) + "): " +
                      (fits > 0 ? "try micro_batch = " + std::to_string(fits)
                                : "even micro_batch = " + std::to_string(ranks) +
                                      " does not fit; train fewer experts per node or a smaller model"));
  }
  arena_ = cuda::DeviceArena(size_t(plan_.arena_bytes()), "GPU node arena");
  buf_ = std::make_unique<GpuBuffers>(plan_, arena_);
  arena_.seal(stream_);  // NaN everywhere until written, guards after every buffer
  weights_ = buf_->get<bf16>("weights");
  master_ = buf_->get<float>("master");
  m_ = buf_->get<float>("adam_m");
  v_ = buf_->get<float>("adam_v");
  grads_ = buf_->get<float>("grads");
  staging_ = buf_->get<float>("theta_staging");
  staging_count_ = buf_->bytes("theta_staging") / int64_t(sizeof(float));
  clip_scale_ = buf_->get<float>("clip_scale");
  norm_sq_ = buf_->get<double>("norm_sq");
  norm_scratch_ = buf_->raw("global_norm_scratch");
  cuda_check(cudaMemsetAsync(m_, 0, size_t(owned) * sizeof(float), stream_));
  cuda_check(cudaMemsetAsync(v_, 0, size_t(owned) * sizeof(float), stream_));
  cuda_check(cudaMemsetAsync(grads_, 0, size_t(owned) * sizeof(float), stream_));
  model_ = std::make_unique<GpuModel>(model_cfg_, layout_, own_, micro_batch_, rt_, plan_, *buf_);

  // AdamW runs: owned tensors merged while contiguous — across decay classes for
  // steps that decay every tensor, within one class for steps that exempt norms and
  // embeddings (AdamWStep::decay_norms_and_embeddings decides per step, as on the CPU).
  for (const ParamTensor& t : layout_.tensors) {
    const int64_t g = own_.space.packed_index(t.offset);
    if (g < 0) continue;
    const bool norm_or_embedding = t.kind == ParamKind::norm || t.kind == ParamKind::embedding;
    for (const bool by_class : {false, true}) {
      std::vector<AdamRun>& runs = by_class ? runs_by_class_ : runs_;
      const bool cls = by_class && norm_or_embedding;
      if (!runs.empty() && runs.back().flat + runs.back().n == t.offset && runs.back().packed + runs.back().n == g &&
          runs.back().norm_or_embedding == cls)
        runs.back().n += t.numel();
      else
        runs.push_back({t.offset, g, t.numel(), cls});
    }
  }

  if (host_copy) theta_ = pinned<float>(size_t(layout_.total));
  tokens_ = pinned<int32_t>(size_t(2 * plan_.tokens));
  host_norm_sq_ = pinned<double>(1);
  host_clip_scale_ = pinned<float>(1);
  measure_peak();
  cuda_check(cudaStreamSynchronize(stream_));

  std::fprintf(stderr, "[node %lld] GPU memory on %s (%s free of %s):\n", (long long)cfg.spes.node_id,
               dev.name.c_str(), cuda::format_bytes(dev.free_bytes).c_str(), cuda::format_bytes(dev.total_bytes).c_str());
  for (const MemoryLine& l : memory_report())
    std::fprintf(stderr, "  %-40s %12s\n", l.category.c_str(), cuda::format_bytes(size_t(l.bytes)).c_str());
}

GpuBackend::~GpuBackend() {
  cudaSetDevice(rt_.info().ordinal);  // handles, stream and arena belong to this device
  cudaStreamSynchronize(stream_);  // destructor path: errors have nowhere to go
}

// MFU's denominator: the datasheet's dense bf16 peak for known devices, otherwise a
// large bf16 GEMM timed once at start-up (and named as such in the log).
void GpuBackend::measure_peak() {
  peak_flops_ = datasheet_bf16_peak(rt_.info().name);
  if (peak_flops_ > 0) {
    peak_source_ = "datasheet dense bf16 peak of " + rt_.info().name;
    return;
  }
  const int64_t n = 4096;
  cuda::DeviceBuffer a(size_t(n * n) * 2, "peak GEMM"), b(size_t(n * n) * 2, "peak GEMM"), c(size_t(n * n) * 2, "peak GEMM");
  cuda_check(cudaMemsetAsync(a.get(), 0x3c, a.bytes(), stream_));  // bf16 ≈ 0.0116, not zero
  cuda_check(cudaMemsetAsync(b.get(), 0x3c, b.bytes(), stream_));
  cudaEvent_t e0, e1;
  cuda_check(cudaEventCreate(&e0));
  cuda_check(cudaEventCreate(&e1));
  auto gemm = [&] {
    rt_.gemm().run(false, false, n, n, n, a.as<bf16>(), n, b.as<bf16>(), n, c.get(), cuda::DType::bf16, n, 1.0f, 0.0f,
                   stream_);
  };
  for (int i = 0; i < 3; ++i) gemm();
  cuda_check(cudaEventRecord(e0, stream_));
  const int reps = 20;
  for (int i = 0; i < reps; ++i) gemm();
  cuda_check(cudaEventRecord(e1, stream_));
  cuda_check(cudaEventSynchronize(e1));
  float ms = 0;
  cuda_check(cudaEventElapsedTime(&ms, e0, e1));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  peak_flops_ = 2.0 * double(n) * n * n * reps / (double(ms) / 1e3);
  peak_source_ = "a 4096³ bf16 GEMM measured at start-up on " + rt_.info().name;
}

std::string GpuBackend::describe() const {
  const cuda::DeviceInfo& d = rt_.info();
  return "cuda: " + d.name + " (sm_" + std::to_string(d.cc_major) + std::to_string(d.cc_minor) + ", " +
         cuda::format_bytes(d.total_bytes) + "); MFU against " + peak_source_;
}

std::vector<MemoryLine> GpuBackend::memory_report() const {
  std::vector<MemoryLine> lines;
  for (MemCategory c : {MemCategory::weights, MemCategory::master, MemCategory::moments, MemCategory::grads,
                        MemCategory::activations, MemCategory::workspace}) {
    lines.push_back({mem_category_name(c), plan_.bytes(c)});
    if (c == MemCategory::weights) lines.push_back({"  of which frozen experts", plan_.frozen_weight_bytes});
  }
  lines.push_back({"total", plan_.total()});
  return lines;
}

void GpuBackend::zero_grads() {
  on_device();
  cuda_check(cudaMemsetAsync(grads_, 0, size_t(own_.space.size()) * sizeof(float), stream_));
}

// The pinned staging is free: every call that copies from it ends with a stream sync.
void GpuBackend::copy_tokens(const int32_t* inputs, const int32_t* targets, int64_t tokens) {
  const int64_t N = plan_.tokens;
  int32_t* in = tokens_.get();
  int32_t* tg = in + N;
  std::memcpy(in, inputs, size_t(tokens) * 4);
  std::memcpy(tg, targets, size_t(tokens) * 4);
  std::fill(in + tokens, in + N, 0);  // padding rows of a short eval batch: any valid token
  std::fill(tg + tokens, tg + N, 0);
  cuda_check(cudaMemcpyAsync(model_->inputs(), in, size_t(2 * N) * 4, cudaMemcpyHostToDevice, stream_));
}

LossParts GpuBackend::forward_backward(const int32_t* inputs, const int32_t* targets, float aux_factor,
                                       float grad_scale) {
  on_device();
  copy_tokens(inputs, targets, plan_.tokens);
  return model_->forward_backward(loss_, aux_factor, grad_scale);
}

LossParts GpuBackend::forward(const int32_t* inputs, const int32_t* targets, int64_t rows) {
  on_device();
  const int64_t tokens = rows * model_cfg_.seq_len;
  if (rows < 1 || tokens > plan_.tokens) throw Error("GpuBackend::forward: rows outside [1, micro_batch]");
  copy_tokens(inputs, targets, tokens);
  return model_->forward(loss_, 1.0f, tokens);
}

double GpuBackend::grad_sum_squares() {
  on_device();
  const cuda::GradSpan span{grads_, own_.space.size()};
  cuda::global_norm_clip(norm_sq_, nullptr, &span, 1, 0.0, norm_scratch_, size_t(buf_->bytes("global_norm_scratch")),
                         stream_);
  cuda_check(cudaMemcpyAsync(host_norm_sq_.get(), norm_sq_, sizeof(double), cudaMemcpyDeviceToHost, stream_));
  cuda_check(cudaStreamSynchronize(stream_));
  return *host_norm_sq_;
}

void GpuBackend::optimizer_step(const AdamWStep& s) {
  on_device();
  // The pinned scale was last read by the previous step's copy, which a sync has passed.
  *host_clip_scale_ = s.grad_scale;
  cuda_check(cudaMemcpyAsync(clip_scale_, host_clip_scale_.get(), sizeof(float), cudaMemcpyHostToDevice, stream_));
  for (const AdamRun& r : s.decay_norms_and_embeddings ? runs_ : runs_by_class_)
    cuda::adamw_update(master_ + r.packed, weights_ + r.flat, grads_ + r.packed, m_ + r.packed, v_ + r.packed, r.n,
                       float(s.lr), float(s.beta1), float(s.beta2), float(s.eps),
                       r.norm_or_embedding ? 0.0f : float(s.weight_decay), s.t, clip_scale_, stream_);
  if (!guards_checked_) {  // every kernel of a step has run once, on every rank (each calls this)
    arena_.check_guards(stream_);
    guards_checked_ = true;
  }
}

void GpuBackend::pull_theta() {
  on_device();
  if (!theta_) throw Error("GpuBackend::pull_theta: this rank keeps no host θ (rank 0 does)");
  arena_.check_guards(stream_);  // θ leaves the GPU (a sync round, a checkpoint): never from a corrupt arena
  for (const OwnedSegment& seg : own_.space.segments())
    cuda_check(cudaMemcpyAsync(theta_.get() + seg.flat.begin, master_ + seg.packed_begin,
                               size_t(seg.flat.size()) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  cuda_check(cudaStreamSynchronize(stream_));
}

// Host θ → bf16 compute weights (whole layout, through the fp32 staging buffer) and
// fp32 master weights (owned segments).
void GpuBackend::push_theta() {
  on_device();
  if (!theta_) throw Error("GpuBackend::push_theta: this rank keeps no host θ (rank 0 does)");
  cuda::float_to_bf16_from_host(weights_, theta_.get(), layout_.total, staging_, staging_count_, stream_);
  for (const OwnedSegment& seg : own_.space.segments())
    cuda_check(cudaMemcpyAsync(master_ + seg.packed_begin, theta_.get() + seg.flat.begin,
                               size_t(seg.flat.size()) * sizeof(float), cudaMemcpyHostToDevice, stream_));
  cuda_check(cudaStreamSynchronize(stream_));  // the host θ may change again once this returns
}

void GpuBackend::read_moments(std::span<float> m, std::span<float> v) {
  on_device();
  const size_t n = size_t(own_.space.size());
  if (m.size() != n || v.size() != n) throw Error("read_moments: owned-space size mismatch");
  arena_.check_guards(stream_);
  cuda_check(cudaMemcpyAsync(m.data(), m_, n * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  cuda_check(cudaMemcpyAsync(v.data(), v_, n * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  cuda_check(cudaStreamSynchronize(stream_));
}

void GpuBackend::write_moments(std::span<const float> m, std::span<const float> v) {
  on_device();
  const size_t n = size_t(own_.space.size());
  if (m.size() != n || v.size() != n) throw Error("write_moments: owned-space size mismatch");
  cuda_check(cudaMemcpyAsync(m_, m.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream_));
  cuda_check(cudaMemcpyAsync(v_, v.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream_));
  cuda_check(cudaStreamSynchronize(stream_));
}

}  // namespace

GpuArenaUse gpu_arena_use(const TrainBackend& backend) {
  const auto* gpu = dynamic_cast<const GpuBackend*>(&backend);
  if (!gpu) throw Error("gpu_arena_use: not a GPU backend (" + backend.describe() + ")");
  return gpu->arena_use();
}

namespace {

// The ranks of a node on their GPUs, in one process with one thread per rank
// (ncclCommInitAll). Rank r's collectives run on rank r's stream, then it waits for
// them: the rank's next kernels would be ordered after them anyway, and the host
// needs the reduced gradient norm right after.
class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(const std::vector<GpuBackend*>& ranks) : comms_(ranks.size()) {
    // ncclAvg (the mean in one collective) came with NCCL 2.10; the library is the
    // machine's own, so an older one is named here rather than failing every step.
    int version = 0;
    nccl_check(ncclGetVersion(&version));
    if (version < NCCL_VERSION(2, 10, 0))
      throw Error("data parallel needs NCCL 2.10 or newer; this machine's libnccl is " + std::to_string(version));
    std::vector<int> devices;
    for (GpuBackend* r : ranks) devices.push_back(r->ordinal()), streams_.push_back(r->stream());
    devices_ = devices;
    nccl_check(ncclCommInitAll(comms_.data(), int(ranks.size()), devices.data()));
  }
  ~NcclCommunicator() override {
    if (aborted_) return;  // ncclCommAbort freed them
    for (ncclComm_t c : comms_) ncclCommDestroy(c);  // destructor path: nothing useful to do on error
  }
  // A rank failed: abort every communicator, which ends the collectives other ranks
  // wait in (their NCCL calls or stream syncs then fail and their threads return).
  void abort() override {
    if (aborted_.exchange(true)) return;
    for (ncclComm_t c : comms_) ncclCommAbort(c);  // error path: the run ends with the rank's own error
  }
  int size() const override { return int(comms_.size()); }
  void all_reduce_mean(int rank, std::span<float> data) override {
    cuda_check(cudaSetDevice(devices_[size_t(rank)]));
    refuse_if_aborted();
    nccl_check(ncclAllReduce(data.data(), data.data(), data.size(), ncclFloat, ncclAvg, comms_[size_t(rank)],
                             streams_[size_t(rank)]));
    cuda_check(cudaStreamSynchronize(streams_[size_t(rank)]));
  }
  void broadcast(int rank, std::span<std::byte> data, int root) override {
    cuda_check(cudaSetDevice(devices_[size_t(rank)]));
    refuse_if_aborted();
    nccl_check(ncclBroadcast(data.data(), data.data(), data.size(), ncclUint8, root, comms_[size_t(rank)],
                             streams_[size_t(rank)]));
    cuda_check(cudaStreamSynchronize(streams_[size_t(rank)]));
  }

 private:
  // abort() freed the communicators: a rank that reaches a collective afterwards
  // (one that had not yet got there, or push_theta's next buffer) gets an Error
  // instead of using a freed communicator.
  void refuse_if_aborted() const {
    if (aborted_) throw Error("data parallel: another rank failed; this collective was not run");
  }
  std::vector<ncclComm_t> comms_;
  std::vector<int> devices_;
  std::vector<cudaStream_t> streams_;
  std::atomic<bool> aborted_{false};
};

}  // namespace

// One GPU: the backend itself. Several ([train] gpus, or every visible GPU): one rank
// per GPU, each with micro_batch / G sequences, under the data-parallel backend with
// NCCL.
std::unique_ptr<TrainBackend> make_gpu_backend(const Config& cfg, const ParamLayout& layout, const Ownership& own) {
  std::string why;
  if (!cuda::gpu_available(&why)) throw GpuShapeError(cfg.path + ": there is no usable GPU (" + why + ")");
  check_gpu_shape(cfg);
  std::vector<int> devices;
  for (int64_t g : cfg.train.gpus) {
    if (g >= cuda::gpu_count())
      throw ConfigError(cfg.path + ": [train] gpus names GPU " + std::to_string(g) + " but " +
                        std::to_string(cuda::gpu_count()) + " are visible");
    if (std::find(devices.begin(), devices.end(), int(g)) != devices.end())
      throw ConfigError(cfg.path + ": [train] gpus names GPU " + std::to_string(g) + " twice");
    devices.push_back(int(g));
  }
  if (devices.empty()) {
    // Every visible GPU — as many as divide the micro-batch (each takes an equal slice).
    int use = cuda::gpu_count();
    while (use > 1 && cfg.train.micro_batch % use) --use;
    if (use < cuda::gpu_count())
      std::fprintf(stderr, "[node %lld] using %d of %d GPUs: [train] micro_batch = %lld must be a multiple\n",
                   (long long)cfg.spes.node_id, use, cuda::gpu_count(), (long long)cfg.train.micro_batch);
    for (int g = 0; g < use; ++g) devices.push_back(g);
  }
  if (devices.size() <= 1) return std::make_unique<GpuBackend>(cfg, layout, own, devices.empty() ? 0 : devices[0]);
  return make_nccl_data_parallel_backend(cfg, layout, own, devices);
}

std::unique_ptr<TrainBackend> make_nccl_data_parallel_backend(const Config& cfg, const ParamLayout& layout,
                                                              const Ownership& own, const std::vector<int>& devices,
                                                              std::vector<TrainBackend*>* ranks_out) {
  const int G = int(devices.size());
  if (cfg.train.micro_batch % G)
    throw ConfigError(cfg.path + ": [train] micro_batch = " + std::to_string(cfg.train.micro_batch) +
                      " must be a multiple of the node's " + std::to_string(G) + " GPUs ([train] gpus)");
  std::vector<std::unique_ptr<TrainBackend>> ranks;
  std::vector<GpuBackend*> gpus;
  for (int r = 0; r < G; ++r) {
    auto b = std::make_unique<GpuBackend>(cfg, layout, own, devices[size_t(r)], G, r == 0);
    gpus.push_back(b.get());
    if (ranks_out) ranks_out->push_back(b.get());
    ranks.push_back(std::move(b));
  }
  auto comm = std::make_unique<NcclCommunicator>(gpus);
  return make_data_parallel_backend(std::move(ranks), std::move(comm), cfg.train.micro_batch, cfg.model.seq_len);
}

}  // namespace spes
