// `spes-engine plan CONFIG [--set k=v]... [--node-id N] [--gpus G] [--micro-batch B]
// [--memory SIZE] [--device cuda|cpu] [--link RATE [--step-ms MS]]`: the memory a node of the run needs, by
// category, next to the same model trained centrally (one node owning every expert)
// at the same micro-batch — the paper's memory claim, computed — and the largest
// micro-batch that fits in SIZE. No GPU needed. The sizes come from the code that
// allocates: plan_gpu_memory (the GPU backend's arena) and CpuModel::planned_bytes.
// A markdown table on stdout; with --link, what a sync round costs on that link and
// the setting to pick (engine/link_plan.hpp).
#include <cmath>
#include <cstdio>
#include <functional>
#include <optional>

#include "engine/args.hpp"
#include "engine/base/log.hpp"
#include "engine/commands.hpp"
#include "engine/config.hpp"
#include "engine/link_plan.hpp"
#include "model/cpu/cpu_model.hpp"
#include "model/gpu_memory.hpp"
#ifdef SPES_HAVE_CUDA
#include "cuda/device_probe.hpp"
#include "model/gpu/gpu_plan.hpp"
#endif

namespace spes {

namespace {

struct Line {
  std::string category;
  int64_t bytes = 0;
};

std::string gib(int64_t bytes) { return strprintf("%.2f GiB", double(bytes) / double(int64_t(1) << 30)); }

// "80GiB", "80 GB", "81920MiB", "1e9": bytes.
int64_t parse_size(const std::string& s) {
  const std::optional<Quantity> q = parse_quantity(s);
  const std::string unit = q ? q->unit : "";
  const double k = unit.empty() || unit == "b" ? 1 : unit == "kib" ? 1024.0 : unit == "mib" ? 1048576.0
                 : unit == "gib" ? 1073741824.0 : unit == "tib" ? 1099511627776.0 : unit == "kb" ? 1e3
                 : unit == "mb" ? 1e6 : unit == "gb" ? 1e9 : unit == "tb" ? 1e12 : -1;
  if (!q || k < 0 || !(q->value > 0 && q->value * k < 9e18))
    throw UsageError("--memory " + s + ": expected a size such as 80GiB");
  return int64_t(q->value * k);
}

// One node's memory per device, by category, at a micro-batch.
using Planner = std::function<std::vector<Line>(const Config&, int64_t micro_batch)>;

std::vector<Line> plan_cpu(const Config& c, int64_t micro_batch) {
  const ParamLayout layout = make_layout(c.model);
  const Ownership own = make_ownership(c.model, layout, int(c.spes.node_id), int(c.spes.n_nodes), c.spes.ownership,
                                       c.spes.experts_per_node);
  const int64_t owned = own.space.size();
  return {{"parameters (fp32, all; the master copy)", 4 * layout.total},
          {"gradients (fp32, owned)", 4 * owned},
          {"AdamW moments (fp32, owned)", 8 * owned},
          {"activations", CpuModel::planned_bytes(c.model, layout, own, micro_batch, c.model.seq_len)}};
}

#ifdef SPES_HAVE_CUDA
std::vector<Line> plan_gpu(const Config& c, int64_t micro_batch, bool exact) {
  const ParamLayout layout = make_layout(c.model);
  const Ownership own = make_ownership(c.model, layout, int(c.spes.node_id), int(c.spes.n_nodes), c.spes.ownership,
                                       c.spes.experts_per_node);
  const GpuMemoryPlan p =
      plan_gpu_node(c.model, layout, own, micro_batch, exact ? current_gpu_limits() : GpuDeviceLimits{});
  const int64_t staging = p.find("theta_staging").bytes;
  return {{"compute weights (bf16, trained)", p.bytes(MemCategory::weights) - p.frozen_weight_bytes},
          {"frozen experts (bf16)", p.frozen_weight_bytes},
          {"master weights (fp32, owned)", p.bytes(MemCategory::master)},
          {"AdamW moments (fp32, owned)", p.bytes(MemCategory::moments)},
          {"gradients (fp32, owned)", p.bytes(MemCategory::grads)},
          {"activations", p.bytes(MemCategory::activations)},
          {"workspace (kernels, cuBLAS)", p.bytes(MemCategory::workspace) - staging},
          {"communication (θ staging)", staging},
          {"arena alignment and guards",
           p.total() - p.bytes(MemCategory::weights) - p.bytes(MemCategory::master) -
               p.bytes(MemCategory::moments) - p.bytes(MemCategory::grads) - p.bytes(MemCategory::activations) -
               p.bytes(MemCategory::workspace)}};
}
#endif

int64_t total(const std::vector<Line>& lines) {
  int64_t s = 0;
  for (const Line& l : lines) s += l.bytes;
  return s;
}

// The largest micro-batch whose plan fits in `memory` (0 when not even 1 does).
int64_t largest_fitting(const Planner& plan, const Config& c, int64_t memory) {
  if (total(plan(c, 1)) > memory) return 0;
  int64_t lo = 1, hi = 2;
  while (hi <= 65536 && total(plan(c, hi)) <= memory) lo = hi, hi *= 2;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    (total(plan(c, mid)) <= memory ? lo : hi) = mid;
  }
  return lo;
}

}  // namespace

int plan_command(const std::vector<std::string>& args) {
  namespace po = boost::program_options;
  ConfigArgs a;
  int64_t gpus = 1;
  std::optional<int64_t> micro_batch_arg;
  std::string memory, device, link;
  double step_ms = 0;
  po::options_description opts;
  a.declare(opts);
  opts.add_options()("gpus", po::value(&gpus), "GPUs per node (data parallel: each holds a replica)")(
      "micro-batch", optional_value(micro_batch_arg), "sequences per forward/backward (default: the config's)")(
      "memory", po::value(&memory), "device memory, e.g. 80GiB: also print the largest micro-batch that fits")(
      "device", po::value(&device), "cuda or cpu (default: cuda when this binary has CUDA, else cpu)")(
      "link", po::value(&link), "the node's link, e.g. 100Mbit or 1Gbit: what a sync round costs per codec")(
      "step-ms", po::value(&step_ms), "with --link: the step time (default: the plan's FLOPs at 40% of an H100)");
  if (!parse_args(args, opts,
                  "spes-engine plan CONFIG [--set k=v]... [--node-id N] [--gpus G] [--micro-batch B] "
                  "[--memory SIZE] [--device cuda|cpu] [--link RATE [--step-ms MS]]"))
    return 0;
  if (gpus < 1) throw UsageError("--gpus must be ≥ 1");
  if (micro_batch_arg && *micro_batch_arg < 1) throw UsageError("--micro-batch must be ≥ 1");
  if (!(step_ms >= 0 && std::isfinite(step_ms)) || (step_ms > 0 && link.empty()))
    throw UsageError("--step-ms: a positive time, with --link");
  const double bits_per_s = link.empty() ? 0 : parse_link_rate(link);
  // Every argument is checked before the table goes to stdout.
  const int64_t memory_bytes = memory.empty() ? 0 : parse_size(memory);
  const Config spes = a.load();
  if (bits_per_s > 0 && spes.spes.sync_steps == 0)
    throw UsageError("--link: " + spes.path + " has no sync rounds ([spes] sync_steps = 0)");
  const int64_t micro_batch = micro_batch_arg.value_or(spes.train.micro_batch);
  // Data parallel: each of the node's GPUs runs micro_batch / gpus sequences.
  if (micro_batch % gpus)
    throw UsageError("--micro-batch " + std::to_string(micro_batch) + " is the node's: it must be a multiple of --gpus " +
                     std::to_string(gpus));
  const int64_t per_device = micro_batch / gpus;
  Config central = spes;  // the same model on one node that owns every expert
  central.spes.n_nodes = 1;
  central.spes.node_id = 0;
  central.spes.ownership = OwnershipMode::all;
  central.spes.experts_per_node = 0;

  std::optional<Device> chosen;
  if (!device.empty()) {
    chosen = enum_from_name(kDeviceNames, device);
    if (!chosen || *chosen == Device::automatic) throw UsageError("--device " + device + ": expected cuda or cpu");
  }
#ifdef SPES_HAVE_CUDA
  const bool gpu = chosen.value_or(Device::cuda) == Device::cuda;
  const bool exact = gpu && cuda::gpu_available();
#else
  const bool gpu = chosen.value_or(Device::cpu) == Device::cuda;
  if (gpu) throw UsageError("--device cuda: this binary was built without CUDA");
  const bool exact = false;
#endif
  Planner plan = plan_cpu;
#ifdef SPES_HAVE_CUDA
  if (gpu) plan = [exact](const Config& c, int64_t b) { return plan_gpu(c, b, exact); };
#endif

  const std::vector<Line> node = plan(spes, per_device), twin = plan(central, per_device);
  const ParamLayout layout = make_layout(spes.model);
  const Ownership own = make_ownership(spes.model, layout, int(spes.spes.node_id), int(spes.spes.n_nodes),
                                       spes.spes.ownership, spes.spes.experts_per_node);
  int owned_experts = 0;
  for (bool o : own.owned) owned_experts += o;
  const char* unit = gpu ? "GPU" : "CPU node";
  std::printf("%s, node %lld of %lld (trains %d of %lld experts), micro-batch %lld x %lld tokens per %s, %s%s\n\n",
              spes.path.c_str(), (long long)spes.spes.node_id, (long long)spes.spes.n_nodes, owned_experts,
              (long long)spes.model.n_experts, (long long)per_device, (long long)spes.model.seq_len,
              gpu ? "GPU" : "node",
              gpu ? "GPU backend" : "CPU backend",
              gpu ? (exact ? " (sizes from this GPU)" : " (kernel scratch estimated: no GPU here)") : "");
  const bool per_node = gpu && gpus > 1;
  std::printf("| category | SPES node, per %s |%s centralized, per %s | SPES / centralized |\n", unit,
              per_node ? strprintf(" SPES node, %lld GPUs |", (long long)gpus).c_str() : "", unit);
  std::printf("| --- | --- |%s --- | --- |\n", per_node ? " --- |" : "");
  auto row = [&](const std::string& name, int64_t mine, int64_t theirs) {
    std::printf("| %s | %s |%s %s | %s |\n", name.c_str(), gib(mine).c_str(),
                per_node ? strprintf(" %s |", gib(mine * gpus).c_str()).c_str() : "", gib(theirs).c_str(),
                theirs > 0 ? strprintf("%.2f", double(mine) / double(theirs)).c_str() : "-");
  };
  for (size_t i = 0; i < node.size(); ++i) row(node[i].category, node[i].bytes, twin[i].bytes);
  row("**total**", total(node), total(twin));
  if (gpu)
    std::printf("\nHost (pinned): the fp32 θ a sync round and checkpoints read, %s per node.\n",
                gib(4 * layout.total).c_str());
  if (!memory.empty()) {
    // What the GPU backend keeps free besides its arena (handles, context growth, NCCL).
    const int64_t reserve = gpu ? (int64_t(512) << 20) + (gpus > 1 ? int64_t(1) << 30 : 0) : 0;
    const int64_t bytes = memory_bytes, usable = bytes - reserve;
    std::printf("\nLargest micro-batch per %s in %s%s: SPES node %lld, centralized %lld", unit, gib(bytes).c_str(),
                reserve ? strprintf(" (%s kept free, as the backend does)", gib(reserve).c_str()).c_str() : "",
                (long long)largest_fitting(plan, spes, usable), (long long)largest_fitting(plan, central, usable));
    if (per_node) std::printf(" (× %lld GPUs per node)", (long long)gpus);
    std::printf(".\n");
  }
  if (bits_per_s > 0) {
    const double step_s = step_ms > 0 ? step_ms / 1e3 : step_seconds_from_flops(spes);
    const std::string source =
        step_ms > 0 ? "--step-ms"
                    : strprintf("the plan's FLOPs at %.0f%% MFU of an H100's %.0f TFLOP/s", 100 * kPlanMfu,
                                kPlanPeakFlops / 1e12);
    print_link_plan(spes, plan_link(spes, bits_per_s, step_s), source);
  }
  return 0;
}

}  // namespace spes
