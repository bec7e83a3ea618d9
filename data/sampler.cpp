#include "data/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "engine/base/error.hpp"

namespace spes {

namespace {

// state() layout, version 1.
constexpr uint64_t kStateMagic = 0x3130544144534550ull;  // "PESDAT01" little-endian
constexpr uint64_t kStateVersion = 1;
constexpr size_t kStateWords = 7;  // magic, version, seed, n_instances, fingerprint, epoch, position

// splitmix64's output function, also used to derive seeds.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void fill_rows(const TokenDataset& data, const std::vector<uint32_t>& ids, uint64_t first,
               int64_t rows, int32_t* inputs, int32_t* targets, std::vector<int32_t>& row) {
  const int64_t s = data.seq_len();
  for (int64_t r = 0; r < rows; ++r) {
    data.read_instance(ids[first + static_cast<uint64_t>(r)], row.data());
    std::copy(row.begin(), row.begin() + s, inputs + r * s);
    std::copy(row.begin() + 1, row.end(), targets + r * s);
  }
}

}  // namespace

uint64_t SplitMix64::next() {
  state_ += 0x9e3779b97f4a7c15ull;
  return mix64(state_);
}

uint64_t SplitMix64::below(uint64_t n) {
  // Reject the lowest (2^64 mod n) values so that every residue is equally likely.
  const uint64_t threshold = (0 - n) % n;
  for (;;) {
    const uint64_t r = next();
    if (r >= threshold) return r % n;
  }
}

uint64_t node_seed(uint64_t base_seed, int64_t node_id) {
  return base_seed + 1000ull * static_cast<uint64_t>(node_id);
}

uint64_t epoch_seed(uint64_t seed, uint64_t epoch) {
  // Mix both so that nearby (seed, epoch) pairs, e.g. node 0 epoch 1000 vs node 1
  // epoch 0, do not collide.
  return mix64(mix64(seed) ^ (epoch * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull));
}

namespace {

// Instance ids are stored as uint32 (4 bytes per instance in the shuffle order).
void check_instance_count(uint64_t n_instances, const std::string& source) {
  if (n_instances > std::numeric_limits<uint32_t>::max()) {
    throw DataError(source + ": " + std::to_string(n_instances) +
                    " instances is more than the sampler supports (2^32 - 1)");
  }
}

}  // namespace

std::vector<uint32_t> all_instances(uint64_t n_instances, const std::string& source) {
  check_instance_count(n_instances, source);
  std::vector<uint32_t> ids(n_instances);
  for (uint64_t i = 0; i < n_instances; ++i) ids[i] = static_cast<uint32_t>(i);
  return ids;
}

InstanceSplit split_instances(uint64_t n_instances, double val_fraction, const std::string& source) {
  if (!(val_fraction >= 0.0 && val_fraction < 1.0)) {
    throw DataError(source + ": val_fraction " + std::to_string(val_fraction) + " must be in [0, 1)");
  }
  InstanceSplit split;
  if (val_fraction == 0.0) {
    split.train = all_instances(n_instances, source);
    return split;
  }
  check_instance_count(n_instances, source);
  const uint64_t n_val = static_cast<uint64_t>(std::llround(val_fraction * static_cast<double>(n_instances)));
  if (n_val == 0 || n_val >= n_instances) {
    throw DataError(source + ": val_fraction " + std::to_string(val_fraction) + " of " +
                    std::to_string(n_instances) + " instances leaves " +
                    (n_val == 0 ? "no validation instances" : "no training instances"));
  }
  // Validation instance j is the middle of the j-th of n_val equal strides:
  // floor((2j+1)·n / (2·n_val)); distinct because the stride n/n_val >= 1.
  split.validation.reserve(n_val);
  split.train.reserve(n_instances - n_val);
  uint64_t j = 0;
  uint64_t next_val = static_cast<uint64_t>((static_cast<unsigned __int128>(1) * n_instances) / (2 * n_val));
  for (uint64_t i = 0; i < n_instances; ++i) {
    if (j < n_val && i == next_val) {
      split.validation.push_back(static_cast<uint32_t>(i));
      ++j;
      next_val = static_cast<uint64_t>((static_cast<unsigned __int128>(2 * j + 1) * n_instances) / (2 * n_val));
    } else {
      split.train.push_back(static_cast<uint32_t>(i));
    }
  }
  return split;
}

// ---- TrainSampler ----------------------------------------------------------------

TrainSampler::TrainSampler(std::shared_ptr<const TokenDataset> data, std::vector<uint32_t> instances,
                           uint64_t seed)
    : data_(std::move(data)), order_(std::move(instances)), seed_(seed) {
  if (!data_) throw DataError("train sampler: no dataset");
  if (order_.empty()) throw DataError(data_->source() + ": no training instances");
  for (uint32_t id : order_) {
    if (id >= data_->n_instances()) {
      throw DataError(data_->source() + ": training instance " + std::to_string(id) + " out of range (" +
                      std::to_string(data_->n_instances()) + " instances)");
    }
  }
  row_.resize(static_cast<size_t>(data_->instance_tokens()));
  shuffle_for_epoch();
}

void TrainSampler::shuffle_for_epoch() {
  std::sort(order_.begin(), order_.end());
  SplitMix64 rng(epoch_seed(seed_, epoch_));
  for (uint64_t i = order_.size() - 1; i > 0; --i) {
    const uint64_t j = rng.below(i + 1);
    std::swap(order_[i], order_[j]);
  }
}

void TrainSampler::next_batch(int32_t* inputs, int32_t* targets, int64_t batch) {
  const int64_t s = data_->seq_len();
  int64_t done = 0;
  while (done < batch) {
    if (position_ == order_.size()) {
      ++epoch_;
      position_ = 0;
      shuffle_for_epoch();
    }
    const int64_t rows = std::min<int64_t>(batch - done, static_cast<int64_t>(order_.size() - position_));
    fill_rows(*data_, order_, position_, rows, inputs + done * s, targets + done * s, row_);
    position_ += static_cast<uint64_t>(rows);
    done += rows;
  }
}

std::vector<uint64_t> TrainSampler::state() const {
  return {kStateMagic, kStateVersion, seed_, order_.size(), data_->fingerprint(), epoch_, position_};
}

void TrainSampler::restore(const std::vector<uint64_t>& st) {
  const std::string& src = data_->source();
  if (st.size() != kStateWords || st[0] != kStateMagic) {
    throw DataError(src + ": saved data position is not a sampler state (" + std::to_string(st.size()) +
                    " words)");
  }
  if (st[1] != kStateVersion) {
    throw DataError(src + ": saved data position has version " + std::to_string(st[1]) + ", expected " +
                    std::to_string(kStateVersion));
  }
  if (st[2] != seed_) {
    throw DataError(src + ": saved data position was made with seed " + std::to_string(st[2]) +
                    ", this run uses " + std::to_string(seed_) + " (different train.seed or node id)");
  }
  if (st[3] != order_.size() || st[4] != data_->fingerprint()) {
    throw DataError(src + ": saved data position is for different data (" + std::to_string(st[3]) +
                    " training instances then, " + std::to_string(order_.size()) +
                    " now, or other files/seq_len)");
  }
  if (st[6] > order_.size()) {
    throw DataError(src + ": saved data position " + std::to_string(st[6]) + " is past the epoch's end");
  }
  epoch_ = st[5];
  position_ = st[6];
  shuffle_for_epoch();
}

// ---- ValidationIterator ----------------------------------------------------------

ValidationIterator::ValidationIterator(std::shared_ptr<const TokenDataset> data,
                                       std::vector<uint32_t> instances)
    : data_(std::move(data)), instances_(std::move(instances)) {
  if (!data_) throw DataError("validation iterator: no dataset");
  if (instances_.empty()) throw DataError(data_->source() + ": no validation instances");
  for (uint32_t id : instances_) {
    if (id >= data_->n_instances()) {
      throw DataError(data_->source() + ": validation instance " + std::to_string(id) + " out of range");
    }
  }
  row_.resize(static_cast<size_t>(data_->instance_tokens()));
}

int64_t ValidationIterator::next_batch(int32_t* inputs, int32_t* targets, int64_t batch) {
  const int64_t rows = std::min<int64_t>(batch, static_cast<int64_t>(instances_.size() - position_));
  if (rows <= 0) return 0;
  fill_rows(*data_, instances_, position_, rows, inputs, targets, row_);
  position_ += static_cast<uint64_t>(rows);
  return rows;
}

// ---- open_data -------------------------------------------------------------------

DataPipeline open_data(const DataSpec& spec) {
  if (spec.train_manifest.empty()) throw DataError("data: no training manifest given (data.train)");
  if (!spec.validation_manifest.empty() && spec.val_fraction > 0.0) {
    throw DataError("data: both a validation manifest (" + spec.validation_manifest +
                    ") and val_fraction > 0 are set; choose one");
  }
  DatasetOptions opts;
  opts.dtype = spec.dtype;
  opts.seq_len = spec.seq_len;
  opts.vocab_size = spec.vocab_size;
  auto train_data = std::make_shared<const TokenDataset>(spec.train_manifest, opts);

  std::shared_ptr<const TokenDataset> val_data;
  std::vector<uint32_t> train_ids;
  std::vector<uint32_t> val_ids;
  if (!spec.validation_manifest.empty()) {
    val_data = std::make_shared<const TokenDataset>(spec.validation_manifest, opts);
    train_ids = all_instances(train_data->n_instances(), train_data->source());
    val_ids = all_instances(val_data->n_instances(), val_data->source());
  } else {
    InstanceSplit split = split_instances(train_data->n_instances(), spec.val_fraction, train_data->source());
    train_ids = std::move(split.train);
    val_ids = std::move(split.validation);
    if (!val_ids.empty()) val_data = train_data;
  }

  TrainSampler sampler(train_data, std::move(train_ids), node_seed(spec.base_seed, spec.node_id));
  std::optional<ValidationIterator> validation;
  if (val_data) validation.emplace(val_data, std::move(val_ids));
  return DataPipeline{std::move(train_data), std::move(val_data), std::move(sampler), std::move(validation)};
}

}  // namespace spes
