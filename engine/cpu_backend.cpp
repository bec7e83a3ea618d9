#include "engine/cpu_backend.hpp"

#include <omp.h>

#include <algorithm>

#include "engine/base/error.hpp"
#include "model/cpu/ops.hpp"

namespace spes {

CpuBackend::CpuBackend(const ModelConfig& model, const LossConfig& loss, const ParamLayout& layout,
                       const Ownership& own, int64_t micro_batch, int64_t threads)
    : model_cfg_(model), loss_(loss), layout_(layout), own_(own), micro_batch_(micro_batch),
      threads_(threads > 0 ? int(threads) : omp_get_num_procs()), runs_(adamw_runs(layout, own, false)),
      runs_by_class_(adamw_runs(layout, own, true)) {
  omp_set_num_threads(threads_);
  params_.assign(size_t(layout_.total), 0.0f);
  grads_.assign(size_t(own_.space.size()), 0.0f);
  m_.assign(grads_.size(), 0.0f);
  v_.assign(grads_.size(), 0.0f);
  model_ = std::make_unique<CpuModel>(model_cfg_, layout_, own_, micro_batch_, model_cfg_.seq_len);
}

std::string CpuBackend::describe() const { return "cpu (" + std::to_string(threads_) + " threads)"; }

void CpuBackend::zero_grads() { std::fill(grads_.begin(), grads_.end(), 0.0f); }

LossParts CpuBackend::forward_backward(const int32_t* inputs, const int32_t* targets, float aux_factor,
                                       float grad_scale) {
  omp_set_num_threads(threads_);  // per calling thread: data-parallel ranks call from their own
  return model_->forward_backward(params_.data(), grads_.data(), inputs, targets, loss_, aux_factor, grad_scale);
}

double CpuBackend::grad_sum_squares() { return cpu::sum_squares(grads_.data(), int64_t(grads_.size())); }

void CpuBackend::optimizer_step(const AdamWStep& s) {
  omp_set_num_threads(threads_);
  if (s.grad_scale != 1.0f) cpu::scale_inplace(grads_.data(), int64_t(grads_.size()), s.grad_scale);
  for (const AdamWRun& r : s.decay_norms_and_embeddings ? runs_ : runs_by_class_)
    cpu::adamw_update(params_.data() + r.flat, grads_.data() + r.packed, m_.data() + r.packed, v_.data() + r.packed,
                      r.n, float(s.lr), float(s.beta1), float(s.beta2), float(s.eps),
                      r.norm_or_embedding ? 0.0f : float(s.weight_decay), s.t);
}

LossParts CpuBackend::forward(const int32_t* inputs, const int32_t* targets, int64_t rows) {
  omp_set_num_threads(threads_);
  CpuModel* m = model_.get();
  if (rows != micro_batch_) {
    if (!tail_model_ || tail_model_->batch() != rows)
      tail_model_ = std::make_unique<CpuModel>(model_cfg_, layout_, own_, rows, model_cfg_.seq_len);
    m = tail_model_.get();
  }
  return m->forward(params_.data(), inputs, targets, loss_);
}

void CpuBackend::read_moments(std::span<float> m, std::span<float> v) {
  if (m.size() != m_.size() || v.size() != v_.size()) throw Error("read_moments: owned-space size mismatch");
  std::copy(m_.begin(), m_.end(), m.begin());
  std::copy(v_.begin(), v_.end(), v.begin());
}

void CpuBackend::write_moments(std::span<const float> m, std::span<const float> v) {
  if (m.size() != m_.size() || v.size() != v_.size()) throw Error("write_moments: owned-space size mismatch");
  std::copy(m.begin(), m.end(), m_.begin());
  std::copy(v.begin(), v.end(), v_.begin());
}

int64_t CpuBackend::optimizer_state_bytes() const {
  return int64_t(sizeof(float)) * int64_t(grads_.size() + m_.size() + v_.size());
}

}  // namespace spes
