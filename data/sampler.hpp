// The seeded, resumable training sampler, the validation split and the validation
// iterator over a TokenDataset (data/token_file.hpp).
//
// Order. Each epoch visits every training instance once, in a Fisher–Yates shuffle
// driven by splitmix64 (our own code, so the order is the same on every platform and
// standard library, unlike std::shuffle). The node's seed is base_seed + 1000·node_id,
// as in the SPES reference, so nodes see the data in different orders; epoch e uses a
// seed derived from (node seed, e), so every epoch is a fresh order.
//
// Resume. state() is a short vector of integers (seed, dataset fingerprint, epoch,
// position); restore() rebuilds the epoch's order from the seed and continues at the
// same instance, so a resumed run reads bit-identical batches.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/token_file.hpp"

namespace spes {

// splitmix64 (Steele, Lea, Flood 2014): tiny, fast, fully specified.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next();
  // Uniform in [0, n) without modulo bias (rejection of the short top range); n > 0.
  uint64_t below(uint64_t n);

 private:
  uint64_t state_;
};

// SPES: node seed = base seed + 1000 · node id.
uint64_t node_seed(uint64_t base_seed, int64_t node_id);
// The seed of one epoch's shuffle.
uint64_t epoch_seed(uint64_t seed, uint64_t epoch);

// Instances split into training and held-out validation. The validation instances
// are spread evenly over the whole dataset (every file contributes), chosen by index
// only: no seed, no node id, so every node holds out the same instances and trains on
// none of them. val_fraction in [0, 1); 0 gives no validation instances. Throws
// DataError when a split side would be empty.
struct InstanceSplit {
  std::vector<uint32_t> train;       // ascending instance ids
  std::vector<uint32_t> validation;  // ascending instance ids
};
InstanceSplit split_instances(uint64_t n_instances, double val_fraction, const std::string& source);
// 0, 1, …, n-1 (a whole dataset as one side).
std::vector<uint32_t> all_instances(uint64_t n_instances, const std::string& source);

class TrainSampler {
 public:
  // `instances`: the training instance ids (e.g. split_instances(...).train);
  // `seed`: the node seed (node_seed()).
  TrainSampler(std::shared_ptr<const TokenDataset> data, std::vector<uint32_t> instances,
               uint64_t seed);

  int64_t seq_len() const { return data_->seq_len(); }
  uint64_t n_instances() const { return order_.size(); }
  uint64_t epoch() const { return epoch_; }
  uint64_t position() const { return position_; }  // instances consumed in this epoch
  // The instance served at `position` of the current epoch (tests, logging).
  uint32_t instance_at(uint64_t position) const { return order_.at(position); }

  // Fills inputs and targets, both [batch, seq_len] row-major: row r is the next
  // instance's tokens [0, S) and [1, S+1). Crosses into the next epoch (reshuffled)
  // as needed.
  void next_batch(int32_t* inputs, int32_t* targets, int64_t batch);

  std::vector<uint64_t> state() const;
  // Throws DataError when the state is malformed or was saved for another seed or
  // another dataset (fingerprint or instance count differ).
  void restore(const std::vector<uint64_t>& state);

 private:
  void shuffle_for_epoch();

  std::shared_ptr<const TokenDataset> data_;
  // This epoch's order. One array only (4 bytes per instance): each epoch sorts it
  // back to ascending ids and shuffles that, so an epoch's order depends on (seed,
  // epoch) alone and restore() needs no replay of earlier epochs.
  std::vector<uint32_t> order_;
  uint64_t seed_;
  uint64_t epoch_ = 0;
  uint64_t position_ = 0;
  std::vector<int32_t> row_;  // one instance, seq_len+1 tokens
};

// The validation instances in fixed (ascending) order, from the start after reset().
class ValidationIterator {
 public:
  ValidationIterator(std::shared_ptr<const TokenDataset> data, std::vector<uint32_t> instances);

  int64_t seq_len() const { return data_->seq_len(); }
  uint64_t n_instances() const { return instances_.size(); }
  // Fills up to `batch` rows like TrainSampler::next_batch; returns the rows filled
  // (fewer than batch at the end, 0 once exhausted).
  int64_t next_batch(int32_t* inputs, int32_t* targets, int64_t batch);
  void reset() { position_ = 0; }

 private:
  std::shared_ptr<const TokenDataset> data_;
  std::vector<uint32_t> instances_;
  uint64_t position_ = 0;
  std::vector<int32_t> row_;
};

// Everything a node's trainer needs, from the [data] config.
struct DataSpec {
  std::string train_manifest;
  std::string validation_manifest;  // empty: hold out val_fraction of the training data
  double val_fraction = 0.0;
  TokenDtype dtype = TokenDtype::kUint16;
  int64_t seq_len = 0;
  int64_t vocab_size = 0;
  uint64_t base_seed = 0;
  int64_t node_id = 0;
};

struct DataPipeline {
  std::shared_ptr<const TokenDataset> train_data;
  std::shared_ptr<const TokenDataset> validation_data;  // may be the same as train_data
  TrainSampler train;
  std::optional<ValidationIterator> validation;  // none without a validation source
};

// Opens the manifests, splits, and seeds the sampler with node_seed(base_seed, node_id).
// Setting both validation_manifest and val_fraction > 0 is a DataError.
DataPipeline open_data(const DataSpec& spec);

}  // namespace spes
