// Samplers in torch::data::samplers' spelling: which indices each batch of an epoch reads.
//
//   kiln::data::samplers::RandomSampler s(/*size=*/10);
//   while (auto indices = s.next(/*batch_size=*/4)) { ... }   // 4, 4, then 2 indices
//   s.reset();                                                 // a new epoch, a new order
//
// - SequentialSampler(size): 0, 1, ..., size - 1.
// - RandomSampler(size): a permutation drawn from kiln's global generator at each reset()
//   (kiln::manual_seed makes the epochs reproducible).
// - DistributedRandomSampler(size, num_replicas, rank, allow_duplicates) and
//   DistributedSequentialSampler(...): rank r of num_replicas reads its own part of the
//   (permuted) indices. With allow_duplicates every replica reads ceil(size / num_replicas)
//   indices (the list is padded with its own first entries, so every index is read at least
//   once); without, size / num_replicas (the remainder is left out). The random one permutes
//   with a generator seeded by the epoch (set_epoch), the same on every rank and independent
//   of the global generator, so the ranks' parts never overlap within an epoch.
//
// next(batch_size) returns at most batch_size indices, nullopt once the epoch is exhausted.
// reset(new_size) starts a new epoch, over a new dataset size when one is given.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "tensor/tensor.h"

namespace kiln::data::samplers {

template <typename BatchRequest = std::vector<size_t>>
class Sampler {
 public:
  using BatchRequestType = BatchRequest;
  virtual ~Sampler() = default;
  virtual void reset(optional<size_t> new_size) = 0;
  virtual optional<BatchRequest> next(size_t batch_size) = 0;
};

class SequentialSampler : public Sampler<> {
 public:
  explicit SequentialSampler(size_t size) : size_(size) {}
  void reset(optional<size_t> new_size = nullopt) override;
  optional<std::vector<size_t>> next(size_t batch_size) override;
  // The number of indices returned so far in this epoch.
  size_t index() const noexcept { return index_; }

 private:
  size_t size_;
  size_t index_ = 0;
};

class RandomSampler : public Sampler<> {
 public:
  // index_dtype is accepted for libtorch's signature (kInt64 or kInt32); indices are size_t.
  explicit RandomSampler(int64_t size, ScalarType index_dtype = kInt64);
  void reset(optional<size_t> new_size = nullopt) override;
  optional<std::vector<size_t>> next(size_t batch_size) override;
  size_t index() const noexcept { return index_; }

 private:
  std::vector<size_t> indices_;
  size_t index_ = 0;
};

class DistributedSampler : public Sampler<> {
 public:
  DistributedSampler(size_t size, size_t num_replicas = 1, size_t rank = 0,
                     bool allow_duplicates = true);
  // The epoch seeds the random sampler's permutation; call it before reset() of each epoch.
  void set_epoch(size_t epoch) { epoch_ = epoch; }
  size_t epoch() const { return epoch_; }
  // How many indices this replica reads per epoch.
  size_t local_sample_count() const;

 protected:
  size_t size_;
  size_t num_replicas_;
  size_t rank_;
  size_t epoch_ = 0;
  bool allow_duplicates_;
};

class DistributedRandomSampler : public DistributedSampler {
 public:
  DistributedRandomSampler(size_t size, size_t num_replicas = 1, size_t rank = 0,
                           bool allow_duplicates = true);
  void reset(optional<size_t> new_size = nullopt) override;
  optional<std::vector<size_t>> next(size_t batch_size) override;
  size_t index() const noexcept { return index_; }

 private:
  std::vector<size_t> indices_;  // this replica's part
  size_t index_ = 0;
};

class DistributedSequentialSampler : public DistributedSampler {
 public:
  DistributedSequentialSampler(size_t size, size_t num_replicas = 1, size_t rank = 0,
                               bool allow_duplicates = true);
  void reset(optional<size_t> new_size = nullopt) override;
  optional<std::vector<size_t>> next(size_t batch_size) override;
  size_t index() const noexcept { return index_; }

 private:
  std::vector<size_t> indices_;
  size_t index_ = 0;
};

}  // namespace kiln::data::samplers
