// Data loaders in torch::data's spelling: batches of a dataset in the order of a sampler,
// prepared by worker threads ahead of the loop that consumes them.
//
//   auto dataset = kiln::data::datasets::MNIST(root).map(kiln::data::transforms::Stack<>());
//   auto loader = kiln::data::make_data_loader(
//       std::move(dataset), kiln::data::DataLoaderOptions().batch_size(64).workers(2));
//   for (auto& batch : *loader) {   // an epoch; batch.data [64, 1, 28, 28], batch.target [64]
//     ...
//   }
//
// make_data_loader's forms (the loader is a std::unique_ptr<StatelessDataLoader<...>>):
//   make_data_loader(dataset, batch_size)                     RandomSampler
//   make_data_loader(dataset, options)                        RandomSampler
//   make_data_loader<samplers::SequentialSampler>(dataset, batch_size or options)
//   make_data_loader(dataset, sampler, options)               any sampler object
//   make_data_loader(stateful_dataset, options)              no sampler (StatefulDataLoader)
// A sampler type given by name is built as Sampler(dataset.size()); the dataset must be sized.
//
// DataLoaderOptions: batch_size (1), workers (0: batches are made on the calling thread),
// max_jobs (default 2 * workers: batches requested ahead), timeout (none: how long the loop
// waits for a worker's batch before failing), enforce_ordering (true: batches arrive in the
// sampler's order; false: as workers finish them), drop_last (false: keep a short last batch).
//
// Each worker thread holds its own copy of the dataset (copies share tensors; see dataset.h).
// begin() starts a new epoch: it resets the sampler and requests max_jobs batches at once; each
// batch taken out requests the next one. An error thrown by get_batch on a worker is rethrown
// by the loop at that batch. Calling begin() again in the middle of an epoch drops the batches
// under way and starts over. Destroying the loader (or join()) stops the workers.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "datasets/dataset.h"
#include "datasets/samplers.h"
#include "nn/functional.h"  // KILN_ARG

namespace kiln::data {

struct DataLoaderOptions {
  DataLoaderOptions() = default;
  DataLoaderOptions(size_t batch_size) : batch_size_(batch_size) {}  // NOLINT: as libtorch

  KILN_ARG(size_t, batch_size) = 1;
  KILN_ARG(size_t, workers) = 0;
  KILN_ARG(optional<size_t>, max_jobs);
  KILN_ARG(optional<std::chrono::milliseconds>, timeout);
  KILN_ARG(bool, enforce_ordering) = true;
  KILN_ARG(bool, drop_last) = false;
};

// The options with their defaults resolved (max_jobs).
struct FullDataLoaderOptions {
  explicit FullDataLoaderOptions(const DataLoaderOptions& o)
      : batch_size(o.batch_size()),
        workers(o.workers()),
        max_jobs(o.max_jobs().value_or(2 * o.workers())),
        timeout(o.timeout()),
        enforce_ordering(o.enforce_ordering()),
        drop_last(o.drop_last()) {
    KILN_CHECK(batch_size > 0, "[DataLoader] batch_size must be positive");
    KILN_CHECK(workers == 0 || max_jobs > 0,
               "[DataLoader] max_jobs must be positive when there are workers");
  }
  size_t batch_size;
  size_t workers;
  size_t max_jobs;
  optional<std::chrono::milliseconds> timeout;
  bool enforce_ordering;
  bool drop_last;
};

// An input iterator over the batches of one epoch. Dereferencing gives the batch (Batch&); the
// batch is fetched when first needed, so begin() == end() only once the epoch is known empty.
template <typename Batch>
class Iterator {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = Batch;
  using difference_type = std::ptrdiff_t;
  using pointer = Batch*;
  using reference = Batch&;

  // The end sentinel.
  Iterator() = default;
  explicit Iterator(std::function<optional<Batch>()> next_batch)
      : next_batch_(std::move(next_batch)) {}

  Batch& operator*() {
    fetch();
    KILN_CHECK(batch_.has_value(), "[DataLoader] dereferencing an exhausted iterator");
    return *batch_;
  }
  Batch* operator->() { return &**this; }
  Iterator& operator++() {
    fetch();
    KILN_CHECK(batch_.has_value(), "[DataLoader] incrementing an exhausted iterator");
    fetched_ = false;
    batch_.reset();
    return *this;
  }
  void operator++(int) { ++*this; }

  friend bool operator==(Iterator& a, Iterator& b) { return a.exhausted() == b.exhausted(); }
  friend bool operator!=(Iterator& a, Iterator& b) { return !(a == b); }

 private:
  bool exhausted() {
    if (!next_batch_) return true;  // the sentinel
    fetch();
    return !batch_.has_value();
  }
  void fetch() {
    if (!next_batch_ || fetched_) return;
    batch_ = next_batch_();
    fetched_ = true;
  }

  std::function<optional<Batch>()> next_batch_;
  optional<Batch> batch_;
  bool fetched_ = false;
};

namespace internal {

// A queue between threads; pop waits (up to `timeout` when given).
template <typename T>
class Queue {
 public:
  void push(T value) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      items_.push_back(std::move(value));
    }
    cv_.notify_one();
  }
  // Moves the front item into *out; false when `timeout` passed first.
  bool pop(T* out, optional<std::chrono::milliseconds> timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto ready = [&] { return !items_.empty(); };
    if (timeout) {
      if (!cv_.wait_for(lock, *timeout, ready)) return false;
    } else {
      cv_.wait(lock, ready);
    }
    *out = std::move(items_.front());
    items_.pop_front();
    return true;
  }
  // Removes everything queued; returns how many.
  size_t clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t n = items_.size();
    items_.clear();
    return n;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<T> items_;
};

}  // namespace internal

namespace internal {

// What both loaders share: worker threads that turn requests into batches (each worker with its
// own `produce` function, made by the factory on the loader's thread), the jobs under way, and
// the results put back into request order when `ordered`.
template <typename Request, typename Out>
class WorkerPool {
 public:
  using Produce = std::function<Out(Request)>;

  WorkerPool(size_t workers, const std::function<Produce()>& make_produce, bool ordered,
             optional<std::chrono::milliseconds> timeout)
      : ordered_(ordered), timeout_(timeout) {
    threads_.reserve(workers);
    for (size_t w = 0; w < workers; ++w) {
      threads_.emplace_back([this, produce = make_produce()]() mutable { run(produce); });
    }
  }
  ~WorkerPool() { join(); }
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void push(Request request) {
    jobs_.push(Job{std::move(request), next_sequence_++});
    ++in_flight_;
  }

  // The next result (in request order when ordered), or nullopt when none is under way.
  // Rethrows what the worker's produce threw.
  optional<Out> pop() {
    for (;;) {
      if (ordered_) {
        auto it = reorder_.find(expected_sequence_);
        if (it != reorder_.end()) {
          Result r = std::move(it->second);
          reorder_.erase(it);
          ++expected_sequence_;
          return deliver(std::move(r));
        }
      }
      if (in_flight_ == 0) return nullopt;
      Result popped;
      KILN_CHECK(results_.pop(&popped, timeout_),
                 "[DataLoader] no batch arrived from the workers within the ", timeout_->count(),
                 " ms timeout");
      --in_flight_;
      if (!ordered_) return deliver(std::move(popped));
      const size_t sequence = popped.sequence;
      reorder_.emplace(sequence, std::move(popped));
    }
  }

  // Drops queued jobs, waits for those under way and forgets their results.
  void drain() {
    in_flight_ -= jobs_.clear();
    Result dropped;
    while (in_flight_ > 0) {
      results_.pop(&dropped, nullopt);
      --in_flight_;
    }
    reorder_.clear();
    next_sequence_ = 0;
    expected_sequence_ = 0;
  }

  void join() {
    jobs_.clear();
    for (size_t w = 0; w < threads_.size(); ++w) jobs_.push(Job{});
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

 private:
  struct Job {
    optional<Request> request;  // nullopt: stop
    size_t sequence = 0;
  };
  struct Result {
    std::unique_ptr<Out> out;
    std::exception_ptr error;
    size_t sequence = 0;
  };

  void run(Produce& produce) {
    for (;;) {
      Job job;
      jobs_.pop(&job, nullopt);
      if (!job.request) return;
      Result r;
      r.sequence = job.sequence;
      try {
        r.out = std::make_unique<Out>(produce(std::move(*job.request)));
      } catch (...) {
        r.error = std::current_exception();
      }
      results_.push(std::move(r));
    }
  }

  static optional<Out> deliver(Result r) {
    if (r.error) std::rethrow_exception(r.error);
    return std::move(*r.out);
  }

  bool ordered_;
  optional<std::chrono::milliseconds> timeout_;
  std::vector<std::thread> threads_;
  Queue<Job> jobs_;
  Queue<Result> results_;
  std::map<size_t, Result> reorder_;  // results that arrived before their turn
  size_t in_flight_ = 0;              // jobs queued or under way whose result is not taken
  size_t next_sequence_ = 0;
  size_t expected_sequence_ = 0;
};

template <typename T>
struct IsOptional : std::false_type {};
template <typename T>
struct IsOptional<std::optional<T>> : std::true_type {};

}  // namespace internal

// A dataset is stateful when its batches are optional (datasets::StatefulDataset): it decides
// the batches itself and says when the epoch is over.
// clang-format off
template <typename Dataset>
concept StatefulDatasetType = requires { typename Dataset::BatchType; } &&
                              internal::IsOptional<typename Dataset::BatchType>::value;
// clang-format on

template <typename Dataset, typename Sampler>
class StatelessDataLoader {
 public:
  using BatchType = typename Dataset::BatchType;
  using BatchRequestType = typename Sampler::BatchRequestType;
  using IteratorType = Iterator<BatchType>;

  StatelessDataLoader(Dataset dataset, Sampler sampler, DataLoaderOptions options)
      : options_(options),
        sampler_(std::move(sampler)),
        // Each worker owns a copy of the dataset, as libtorch's loader does.
        pool_(
            options_.workers,
            [&dataset]() -> typename Pool::Produce {
              return [d = dataset](BatchRequestType request) mutable {
                return d.get_batch(std::move(request));
              };
            },
            options_.enforce_ordering, options_.timeout) {
    if (options_.workers == 0) main_dataset_.emplace(std::move(dataset));
  }
  StatelessDataLoader(const StatelessDataLoader&) = delete;
  StatelessDataLoader& operator=(const StatelessDataLoader&) = delete;

  // Starts an epoch.
  IteratorType begin() {
    KILN_CHECK(!joined_, "[DataLoader] begin() after join(): the workers are stopped");
    pool_.drain();
    sampler_.reset(nullopt);
    if (options_.workers > 0) prefetch(options_.max_jobs);
    return IteratorType([this] { return next(); });
  }
  IteratorType end() { return IteratorType(); }

  // Stops the workers (the destructor does it too). The loader cannot be iterated afterwards.
  void join() {
    joined_ = true;
    pool_.join();
  }

  const FullDataLoaderOptions& options() const noexcept { return options_; }

 private:
  using Pool = internal::WorkerPool<BatchRequestType, BatchType>;

  // The sampler's next request, or nullopt at the end of the epoch (a short last batch ends it
  // under drop_last).
  optional<BatchRequestType> next_request() {
    auto request = sampler_.next(options_.batch_size);
    if (request && options_.drop_last && request->size() < options_.batch_size) return nullopt;
    return request;
  }

  void prefetch(size_t n) {
    for (size_t i = 0; i < n; ++i) {
      auto request = next_request();
      if (!request) return;
      pool_.push(std::move(*request));
    }
  }

  optional<BatchType> next() {
    if (options_.workers == 0) {
      auto request = next_request();
      if (!request) return nullopt;
      return main_dataset_->get_batch(std::move(*request));
    }
    auto batch = pool_.pop();
    if (batch) prefetch(1);
    return batch;
  }

  FullDataLoaderOptions options_;
  Sampler sampler_;
  optional<Dataset> main_dataset_;
  Pool pool_;
  bool joined_ = false;
};

// The loader of a stateful dataset: every request asks the dataset for the next batch_size
// examples (get_batch(batch_size)); the epoch ends when the dataset returns nullopt. begin()
// calls the dataset's reset(). With workers, the threads share the one dataset (as libtorch's):
// its get_batch must be safe to call from several threads at once. drop_last does not apply:
// the dataset decides its batches.
template <typename Dataset>
class StatefulDataLoader {
 public:
  using BatchType = typename Dataset::BatchType::value_type;
  using BatchRequestType = typename Dataset::BatchRequestType;
  using IteratorType = Iterator<BatchType>;
  static_assert(std::is_constructible_v<BatchRequestType, size_t>,
                "[StatefulDataLoader] the dataset's batch request must be a batch size");

  StatefulDataLoader(Dataset dataset, DataLoaderOptions options)
      : options_(options),
        dataset_(std::make_shared<Dataset>(std::move(dataset))),
        pool_(
            options_.workers,
            [this]() -> typename Pool::Produce {
              return [d = dataset_](BatchRequestType request) {
                return d->get_batch(std::move(request));
              };
            },
            options_.enforce_ordering, options_.timeout) {}
  StatefulDataLoader(const StatefulDataLoader&) = delete;
  StatefulDataLoader& operator=(const StatefulDataLoader&) = delete;

  IteratorType begin() {
    KILN_CHECK(!joined_, "[DataLoader] begin() after join(): the workers are stopped");
    pool_.drain();
    dataset_->reset();
    exhausted_ = false;
    for (size_t i = 0; i < options_.max_jobs; ++i)
      pool_.push(BatchRequestType(options_.batch_size));
    return IteratorType([this] { return next(); });
  }
  IteratorType end() { return IteratorType(); }

  void join() {
    joined_ = true;
    pool_.join();
  }

  const FullDataLoaderOptions& options() const noexcept { return options_; }

 private:
  using Pool = internal::WorkerPool<BatchRequestType, typename Dataset::BatchType>;

  optional<BatchType> next() {
    if (options_.workers == 0) return dataset_->get_batch(BatchRequestType(options_.batch_size));
    // A worker that found the dataset exhausted ends the requests, but the batches other
    // workers got before it are still delivered.
    for (;;) {
      auto result = pool_.pop();
      if (!result) return nullopt;
      if (!*result) {
        exhausted_ = true;
        continue;
      }
      if (!exhausted_) pool_.push(BatchRequestType(options_.batch_size));
      return std::move(**result);
    }
  }

  FullDataLoaderOptions options_;
  std::shared_ptr<Dataset> dataset_;
  Pool pool_;
  bool exhausted_ = false;
  bool joined_ = false;
};

namespace internal {
template <typename Dataset>
size_t dataset_size(const Dataset& dataset) {
  const optional<size_t> size = dataset.size();
  KILN_CHECK(size.has_value(),
             "[make_data_loader] the dataset has no size(), which the sampler needs");
  return *size;
}
}  // namespace internal

// What make_data_loader accepts as a sampler object.
template <typename S>
concept SamplerType = requires(S s, size_t n) {
  typename S::BatchRequestType;
  s.reset(nullopt);
  s.next(n);
};

template <typename Sampler = samplers::RandomSampler, typename Dataset>
requires(SamplerType<Sampler> && !StatefulDatasetType<Dataset>)
    std::unique_ptr<StatelessDataLoader<Dataset, Sampler>> make_data_loader(
        Dataset dataset, Sampler sampler, DataLoaderOptions options = DataLoaderOptions()) {
  return std::make_unique<StatelessDataLoader<Dataset, Sampler>>(
      std::move(dataset), std::move(sampler), std::move(options));
}

template <typename Sampler = samplers::RandomSampler, typename Dataset>
requires(std::is_constructible_v<Sampler, size_t> && !StatefulDatasetType<Dataset>)
    std::unique_ptr<StatelessDataLoader<Dataset, Sampler>> make_data_loader(
        Dataset dataset, DataLoaderOptions options = DataLoaderOptions()) {
  const size_t size = internal::dataset_size(dataset);
  return make_data_loader(std::move(dataset), Sampler(size), std::move(options));
}

template <typename Sampler = samplers::RandomSampler, typename Dataset>
requires(std::is_constructible_v<Sampler, size_t> && !StatefulDatasetType<Dataset>)
    std::unique_ptr<StatelessDataLoader<Dataset, Sampler>> make_data_loader(Dataset dataset,
                                                                            size_t batch_size) {
  return make_data_loader<Sampler>(std::move(dataset), DataLoaderOptions(batch_size));
}

// A stateful dataset (datasets::StatefulDataset, or a map of one) needs no sampler.
template <typename Dataset>
requires StatefulDatasetType<Dataset> std::unique_ptr<StatefulDataLoader<Dataset>> make_data_loader(
    Dataset dataset, DataLoaderOptions options = DataLoaderOptions()) {
  return std::make_unique<StatefulDataLoader<Dataset>>(std::move(dataset), std::move(options));
}

}  // namespace kiln::data
