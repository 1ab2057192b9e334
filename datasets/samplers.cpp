// The samplers of datasets/samplers.h.
#include "datasets/samplers.h"

#include <algorithm>
#include <numeric>
#include <random>

#include "tensor/ops.h"

namespace kiln::data::samplers {
namespace {

// The next min(batch_size, remaining) entries of `indices` from `index`, or nullopt when none
// remain.
optional<std::vector<size_t>> take(const std::vector<size_t>& indices, size_t& index,
                                   size_t batch_size, const char* sampler) {
  KILN_CHECK(batch_size > 0, "[", sampler, "] batch_size must be positive");
  if (index >= indices.size()) return nullopt;
  const size_t n = std::min(batch_size, indices.size() - index);
  std::vector<size_t> out(indices.begin() + static_cast<std::ptrdiff_t>(index),
                          indices.begin() + static_cast<std::ptrdiff_t>(index + n));
  index += n;
  return out;
}

// A uniform draw from [0, n) without modulo bias (std::uniform_int_distribution's algorithm is
// the library's choice; this one is the same on every platform, which ranks rely on).
uint64_t uniform_below(std::mt19937_64& rng, uint64_t n) {
  const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t x;
  do {
    x = rng();
  } while (x >= limit);
  return x % n;
}

// This replica's part of the epoch's indices (see samplers.h).
std::vector<size_t> replica_part(size_t size, size_t num_replicas, size_t rank, size_t local,
                                 bool shuffle, size_t epoch) {
  std::vector<size_t> all(size);
  std::iota(all.begin(), all.end(), size_t{0});
  if (shuffle) {
    std::mt19937_64 rng(epoch);
    for (size_t i = size; i > 1; --i) std::swap(all[i - 1], all[uniform_below(rng, i)]);
  }
  std::vector<size_t> part;
  part.reserve(local);
  for (size_t k = rank * local; k < (rank + 1) * local; ++k) part.push_back(all[k % size]);
  return part;
}

}  // namespace

void SequentialSampler::reset(optional<size_t> new_size) {
  if (new_size) size_ = *new_size;
  index_ = 0;
}

optional<std::vector<size_t>> SequentialSampler::next(size_t batch_size) {
  KILN_CHECK(batch_size > 0, "[SequentialSampler] batch_size must be positive");
  if (index_ >= size_) return nullopt;
  const size_t n = std::min(batch_size, size_ - index_);
  std::vector<size_t> out(n);
  std::iota(out.begin(), out.end(), index_);
  index_ += n;
  return out;
}

RandomSampler::RandomSampler(int64_t size, ScalarType index_dtype) {
  KILN_CHECK(size >= 0, "[RandomSampler] size must be non-negative, got ", size);
  KILN_CHECK(index_dtype == kInt64 || index_dtype == kInt32,
             "[RandomSampler] index_dtype must be int64 or int32, got ", index_dtype);
  reset(static_cast<size_t>(size));
}

void RandomSampler::reset(optional<size_t> new_size) {
  const size_t size = new_size ? *new_size : indices_.size();
  indices_.resize(size);
  if (size > 0) {
    const Tensor perm = kiln::randperm(static_cast<int64_t>(size));
    const int64_t* p = perm.data_ptr<int64_t>();
    for (size_t i = 0; i < size; ++i) indices_[i] = static_cast<size_t>(p[i]);
  }
  index_ = 0;
}

optional<std::vector<size_t>> RandomSampler::next(size_t batch_size) {
  return take(indices_, index_, batch_size, "RandomSampler");
}

DistributedSampler::DistributedSampler(size_t size, size_t num_replicas, size_t rank,
                                       bool allow_duplicates)
    : size_(size), num_replicas_(num_replicas), rank_(rank), allow_duplicates_(allow_duplicates) {
  KILN_CHECK(num_replicas > 0, "[DistributedSampler] num_replicas must be positive");
  KILN_CHECK(rank < num_replicas, "[DistributedSampler] rank ", rank,
             " is out of range for num_replicas ", num_replicas);
}

size_t DistributedSampler::local_sample_count() const {
  return allow_duplicates_ ? (size_ + num_replicas_ - 1) / num_replicas_ : size_ / num_replicas_;
}

DistributedRandomSampler::DistributedRandomSampler(size_t size, size_t num_replicas, size_t rank,
                                                   bool allow_duplicates)
    : DistributedSampler(size, num_replicas, rank, allow_duplicates) {
  reset();
}

void DistributedRandomSampler::reset(optional<size_t> new_size) {
  if (new_size) size_ = *new_size;
  indices_ = size_ == 0 ? std::vector<size_t>{}
                        : replica_part(size_, num_replicas_, rank_, local_sample_count(),
                                       /*shuffle=*/true, epoch_);
  index_ = 0;
}

optional<std::vector<size_t>> DistributedRandomSampler::next(size_t batch_size) {
  return take(indices_, index_, batch_size, "DistributedRandomSampler");
}

DistributedSequentialSampler::DistributedSequentialSampler(size_t size, size_t num_replicas,
                                                           size_t rank, bool allow_duplicates)
    : DistributedSampler(size, num_replicas, rank, allow_duplicates) {
  reset();
}

void DistributedSequentialSampler::reset(optional<size_t> new_size) {
  if (new_size) size_ = *new_size;
  indices_ = size_ == 0 ? std::vector<size_t>{}
                        : replica_part(size_, num_replicas_, rank_, local_sample_count(),
                                       /*shuffle=*/false, epoch_);
  index_ = 0;
}

optional<std::vector<size_t>> DistributedSequentialSampler::next(size_t batch_size) {
  return take(indices_, index_, batch_size, "DistributedSequentialSampler");
}

}  // namespace kiln::data::samplers
