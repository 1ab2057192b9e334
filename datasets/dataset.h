// Datasets in torch::data's spelling: a dataset returns a batch for a list of indices, and
// .map(transform) wraps it in another dataset that transforms each batch.
//
//   class Squares : public kiln::data::datasets::Dataset<Squares> {
//    public:
//     kiln::data::Example<> get(size_t i) override {
//       auto x = kiln::full({1}, static_cast<double>(i));
//       return {x, x * x};
//     }
//     kiln::optional<size_t> size() const override { return 100; }
//   };
//   auto ds = Squares().map(kiln::data::transforms::Stack<>());   // batches: Example<> of [B, 1]
//
// - BatchDataset<Self, Batch, BatchRequest>: get_batch(request) and size() (nullopt: unsized).
// - Dataset<Self, Example>: get(index) and size(); get_batch calls get for each index.
// - MapDataset<Source, Transform>: get_batch = transform.apply_batch(source.get_batch(request)).
//   .map() on an lvalue copies the dataset, on an rvalue moves it; maps chain.
// - TensorDataset: the rows of one tensor, as TensorExample (no target).
// - StatefulDataset<Self, Batch>: get_batch(batch_size) -> optional<Batch> and reset(); the
//   dataset keeps its own position (reading a stream, chunks of files) and needs no sampler.
//
// A data loader with workers copies the dataset into every worker thread (as libtorch does), so
// a dataset must be copyable and its get()/get_batch() must be safe to run on several copies at
// once; copies of a Tensor share their data, so tensors held by a dataset are loaded once.
#pragma once

#include <cstddef>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "datasets/example.h"
#include "tensor/ops.h"

namespace kiln::data::datasets {

template <typename SourceDataset, typename AppliedTransform>
class MapDataset;

template <typename DatasetType, typename TransformType>
MapDataset<DatasetType, TransformType> map(DatasetType dataset, TransformType transform);

template <typename Self, typename Batch = std::vector<Example<>>,
          typename BatchRequest = ArrayRef<size_t>>
class BatchDataset {
 public:
  using SelfType = Self;
  using BatchType = Batch;
  using BatchRequestType = BatchRequest;

  virtual ~BatchDataset() = default;

  // The batch for `request` (the indices a sampler chose).
  virtual Batch get_batch(BatchRequest request) = 0;
  // The number of examples, or nullopt when the dataset does not know it.
  virtual optional<size_t> size() const = 0;

  // A dataset that applies `transform` to every batch of this one.
  template <typename TransformType>
  MapDataset<Self, TransformType> map(TransformType transform) & {
    return datasets::map(static_cast<Self&>(*this), std::move(transform));
  }
  template <typename TransformType>
  MapDataset<Self, TransformType> map(TransformType transform) && {
    return datasets::map(std::move(static_cast<Self&>(*this)), std::move(transform));
  }
};

template <typename Self, typename SingleExample = Example<>>
class Dataset : public BatchDataset<Self, std::vector<SingleExample>> {
 public:
  using ExampleType = SingleExample;

  // The example at `index` (0 <= index < size()).
  virtual ExampleType get(size_t index) = 0;

  std::vector<ExampleType> get_batch(ArrayRef<size_t> indices) override {
    std::vector<ExampleType> batch;
    batch.reserve(indices.size());
    for (const size_t i : indices) batch.push_back(get(i));
    return batch;
  }
};

// A dataset that decides its own batches and says when an epoch is over, as
// torch::data::datasets::StatefulDataset: get_batch(batch_size) returns the next batch of at most
// batch_size examples, or nullopt once the epoch is exhausted; reset() starts the next epoch.
// make_data_loader(dataset, options) takes it without a sampler.
template <typename Self, typename Batch = std::vector<Example<>>, typename BatchRequest = size_t>
class StatefulDataset : public BatchDataset<Self, optional<Batch>, BatchRequest> {
 public:
  virtual void reset() = 0;
};

namespace internal {
template <typename T>
struct Unoptional {
  using type = T;
  static constexpr bool optional = false;
};
template <typename T>
struct Unoptional<std::optional<T>> {
  using type = T;
  static constexpr bool optional = true;
};
// The transform's output, optional when the source's batches are (a stateful source).
template <typename SourceBatch, typename Transform>
using MapOutput = std::conditional_t<Unoptional<SourceBatch>::optional,
                                     optional<typename Transform::OutputBatchType>,
                                     typename Transform::OutputBatchType>;
}  // namespace internal

template <typename SourceDataset, typename AppliedTransform>
class MapDataset
    : public BatchDataset<MapDataset<SourceDataset, AppliedTransform>,
                          internal::MapOutput<typename SourceDataset::BatchType, AppliedTransform>,
                          typename SourceDataset::BatchRequestType> {
  using SourceBatch = typename SourceDataset::BatchType;
  static constexpr bool kStateful = internal::Unoptional<SourceBatch>::optional;

 public:
  using DatasetType = SourceDataset;
  using TransformType = AppliedTransform;
  using BatchRequestType = typename SourceDataset::BatchRequestType;
  using OutputBatchType = internal::MapOutput<SourceBatch, AppliedTransform>;
  static_assert(std::is_same_v<typename internal::Unoptional<SourceBatch>::type,
                               typename AppliedTransform::InputBatchType>,
                "[MapDataset] the transform's input batch type must be the dataset's batch type");

  MapDataset(SourceDataset dataset, AppliedTransform transform)
      : dataset_(std::move(dataset)), transform_(std::move(transform)) {}

  OutputBatchType get_batch(BatchRequestType request) override {
    if constexpr (kStateful) {
      auto batch = dataset_.get_batch(std::move(request));
      if (!batch) return nullopt;
      return transform_.apply_batch(std::move(*batch));
    } else {
      return transform_.apply_batch(dataset_.get_batch(std::move(request)));
    }
  }
  optional<size_t> size() const override { return dataset_.size(); }
  // Resets a stateful source.
  void reset() requires kStateful { dataset_.reset(); }

  const SourceDataset& dataset() const noexcept { return dataset_; }
  const AppliedTransform& transform() const noexcept { return transform_; }

 private:
  SourceDataset dataset_;
  AppliedTransform transform_;
};

template <typename DatasetType, typename TransformType>
MapDataset<DatasetType, TransformType> map(DatasetType dataset, TransformType transform) {
  return MapDataset<DatasetType, TransformType>(std::move(dataset), std::move(transform));
}

// The rows of one tensor (its first dimension indexes the examples), without targets.
class TensorDataset : public Dataset<TensorDataset, TensorExample> {
 public:
  // Stacks the tensors (all of one shape) into one.
  explicit TensorDataset(const std::vector<Tensor>& tensors)
      : TensorDataset(kiln::stack(tensors)) {}
  explicit TensorDataset(Tensor tensor) : tensor(std::move(tensor)) {
    KILN_CHECK(this->tensor.defined() && this->tensor.dim() >= 1,
               "[TensorDataset] expected a tensor with at least one dimension");
  }

  TensorExample get(size_t index) override {
    KILN_CHECK(index < static_cast<size_t>(tensor.size(0)), "[TensorDataset] index ", index,
               " is out of range for a dataset of ", tensor.size(0), " examples");
    return tensor[static_cast<int64_t>(index)];
  }
  optional<size_t> size() const override { return static_cast<size_t>(tensor.size(0)); }

  Tensor tensor;
};

}  // namespace kiln::data::datasets
