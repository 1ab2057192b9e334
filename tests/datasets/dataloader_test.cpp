// make_data_loader in each of its forms: the batches an epoch yields against the sampler's
// indices, drop_last, worker threads (in and out of order), errors from workers, timeouts,
// restarting an epoch.
#include "datasets/dataloader.h"

#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "test_util.h"

namespace kiln {
namespace {

namespace data = kiln::data;

// Example i: data = [i] (float), target = i (int64). Optionally slow for chosen indices, or
// failing at one index.
class Numbers : public data::datasets::Dataset<Numbers> {
 public:
  explicit Numbers(size_t n, std::shared_ptr<std::atomic<int>> calls = nullptr)
      : n_(n), calls_(std::move(calls)) {}
  Numbers& slow_at(size_t i, int ms) {
    slow_index_ = i;
    slow_ms_ = ms;
    return *this;
  }
  Numbers& fail_at(size_t i) {
    fail_index_ = i;
    return *this;
  }
  data::Example<> get(size_t index) override {
    if (calls_) ++*calls_;
    if (index == slow_index_) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms_));
    KILN_CHECK(index != fail_index_, "[Numbers] example ", index, " is broken");
    return {kiln::full({1}, static_cast<double>(index)),
            kiln::scalar_tensor(static_cast<int64_t>(index))};
  }
  kiln::optional<size_t> size() const override { return n_; }

 private:
  size_t n_;
  std::shared_ptr<std::atomic<int>> calls_;
  size_t slow_index_ = SIZE_MAX, fail_index_ = SIZE_MAX;
  int slow_ms_ = 0;
};

// The targets of each batch of one epoch.
template <typename Loader>
std::vector<std::vector<int64_t>> targets_of_epoch(Loader& loader) {
  std::vector<std::vector<int64_t>> out;
  for (auto& batch : loader) out.push_back(batch.target.template to_vector<int64_t>());
  return out;
}

std::vector<int64_t> iota(int64_t from, int64_t to) {
  std::vector<int64_t> v(static_cast<size_t>(to - from));
  std::iota(v.begin(), v.end(), from);
  return v;
}

TEST(DataLoaderTest, BatchSizeFormIsRandomAndCoversTheDataset) {
  kiln::manual_seed(3);
  auto loader = data::make_data_loader(Numbers(10).map(data::transforms::Stack<>()), 4);
  const auto epoch = targets_of_epoch(*loader);
  ASSERT_EQ(epoch.size(), 3u);
  EXPECT_EQ(epoch[2].size(), 2u);  // the short last batch is kept
  std::vector<int64_t> all;
  for (const auto& b : epoch) all.insert(all.end(), b.begin(), b.end());
  EXPECT_NE(all, iota(0, 10));
  std::sort(all.begin(), all.end());
  EXPECT_EQ(all, iota(0, 10));
  // The batch's data rows go with their targets.
  for (auto& batch : *loader) {
    EXPECT_EQ(batch.data.sizes()[1], 1);
    EXPECT_TRUE(kiln::equal(batch.data.squeeze(1), batch.target.to(kFloat32)));
  }
}

TEST(DataLoaderTest, SequentialSamplerByTypeWithOptions) {
  auto loader = data::make_data_loader<data::samplers::SequentialSampler>(
      Numbers(7).map(data::transforms::Stack<>()),
      data::DataLoaderOptions().batch_size(3).drop_last(true));
  const auto epoch = targets_of_epoch(*loader);
  EXPECT_EQ(epoch, (std::vector<std::vector<int64_t>>{{0, 1, 2}, {3, 4, 5}}));
  EXPECT_EQ(loader->options().batch_size, 3u);
  EXPECT_TRUE(loader->options().drop_last);
  // A second epoch is the same.
  EXPECT_EQ(targets_of_epoch(*loader), epoch);
}

TEST(DataLoaderTest, UnstackedBatchesAreVectorsOfExamples) {
  auto loader = data::make_data_loader<data::samplers::SequentialSampler>(Numbers(5), 2);
  std::vector<size_t> sizes;
  for (std::vector<data::Example<>>& batch : *loader) sizes.push_back(batch.size());
  EXPECT_EQ(sizes, (std::vector<size_t>{2, 2, 1}));
}

TEST(DataLoaderTest, SamplerObjectForm) {
  // Replica 1 of 2 reads its half.
  auto loader = data::make_data_loader(Numbers(6).map(data::transforms::Stack<>()),
                                       data::samplers::DistributedSequentialSampler(6, 2, 1),
                                       data::DataLoaderOptions(2));
  EXPECT_EQ(targets_of_epoch(*loader), (std::vector<std::vector<int64_t>>{{3, 4}, {5}}));
}

TEST(DataLoaderTest, WorkersKeepTheSamplersOrder) {
  // Batch 0 is slow: with enforce_ordering it still comes first.
  auto loader = data::make_data_loader<data::samplers::SequentialSampler>(
      Numbers(12).slow_at(0, 50).map(data::transforms::Stack<>()),
      data::DataLoaderOptions().batch_size(2).workers(3));
  std::vector<std::vector<int64_t>> want;
  for (int64_t i = 0; i < 12; i += 2) want.push_back({i, i + 1});
  EXPECT_EQ(targets_of_epoch(*loader), want);
  EXPECT_EQ(targets_of_epoch(*loader), want);
  EXPECT_EQ(loader->options().max_jobs, 6u);  // 2 * workers
}

TEST(DataLoaderTest, WorkersOutOfOrderDeliverEveryBatchOnce) {
  auto loader = data::make_data_loader<data::samplers::SequentialSampler>(
      Numbers(12).slow_at(0, 300).map(data::transforms::Stack<>()),
      data::DataLoaderOptions().batch_size(2).workers(2).enforce_ordering(false));
  const auto epoch = targets_of_epoch(*loader);
  ASSERT_EQ(epoch.size(), 6u);
  EXPECT_NE(epoch.front(), (std::vector<int64_t>{0, 1}));  // the slow batch came later
  std::vector<int64_t> all;
  for (const auto& b : epoch) all.insert(all.end(), b.begin(), b.end());
  std::sort(all.begin(), all.end());
  EXPECT_EQ(all, iota(0, 12));
}

TEST(DataLoaderTest, WorkersPrefetchAheadOfTheLoop) {
  auto calls = std::make_shared<std::atomic<int>>(0);
  auto loader = data::make_data_loader<data::samplers::SequentialSampler>(
      Numbers(40, calls).map(data::transforms::Stack<>()),
      data::DataLoaderOptions().batch_size(2).workers(2).max_jobs(4));
  auto it = loader->begin();
  (void)*it;  // the first batch is in hand ...
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (calls->load() < 10 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // ... and the workers have made the 4 requested ahead (batch 0 plus 4 refills: 5 batches).
  EXPECT_EQ(calls->load(), 10);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(calls->load(), 10);  // and no more than that
}

TEST(DataLoaderTest, WorkerErrorsReachTheLoop) {
  for (size_t workers : {0, 2}) {
    auto loader = data::make_data_loader<data::samplers::SequentialSampler>(
        Numbers(8).fail_at(5).map(data::transforms::Stack<>()),
        data::DataLoaderOptions().batch_size(2).workers(workers));
    int batches = 0;
    EXPECT_KILN_ERROR(
        [&] {
          for (auto& b : *loader) {
            (void)b;
            ++batches;
          }
          return 0;
        }(),
        "[Numbers] example 5 is broken");
    EXPECT_EQ(batches, 2) << workers;
    // The loader starts over cleanly afterwards.
    EXPECT_EQ(loader->begin()->target.to_vector<int64_t>(), (std::vector<int64_t>{0, 1}));
  }
}

TEST(DataLoaderTest, TimeoutFailsClearly) {
  auto loader = data::make_data_loader<data::samplers::SequentialSampler>(
      Numbers(4).slow_at(0, 300).map(data::transforms::Stack<>()),
      data::DataLoaderOptions().batch_size(2).workers(1).timeout(std::chrono::milliseconds(20)));
  EXPECT_KILN_ERROR(*loader->begin(),
                    "[DataLoader] no batch arrived from the workers within the 20 ms");
}

TEST(DataLoaderTest, RestartingMidEpochStartsOver) {
  auto loader = data::make_data_loader<data::samplers::SequentialSampler>(
      Numbers(20).map(data::transforms::Stack<>()),
      data::DataLoaderOptions().batch_size(2).workers(2));
  for (auto& b : *loader) {
    (void)b;
    break;
  }
  EXPECT_EQ(targets_of_epoch(*loader).size(), 10u);
  EXPECT_EQ(loader->begin()->target.to_vector<int64_t>(), (std::vector<int64_t>{0, 1}));
}

TEST(DataLoaderTest, BadOptionsAndUnsizedDatasets) {
  EXPECT_KILN_ERROR(data::make_data_loader(Numbers(3), data::DataLoaderOptions().batch_size(0)),
                    "[DataLoader] batch_size must be positive");
  struct Unsized : data::datasets::Dataset<Unsized> {
    data::Example<> get(size_t) override { return {}; }
    kiln::optional<size_t> size() const override { return kiln::nullopt; }
  };
  EXPECT_KILN_ERROR(data::make_data_loader(Unsized(), 2),
                    "[make_data_loader] the dataset has no size()");
  auto loader = data::make_data_loader(Numbers(3), 1);
  loader->join();
  EXPECT_KILN_ERROR(loader->begin(), "[DataLoader] begin() after join()");
}

TEST(DataLoaderTest, EmptyDatasetYieldsNoBatches) {
  auto loader = data::make_data_loader(Numbers(0).map(data::transforms::Stack<>()),
                                       data::DataLoaderOptions(4).workers(2));
  EXPECT_TRUE(targets_of_epoch(*loader).empty());
}

// A stateful dataset: hands out 0, 1, ..., n - 1 in batches as asked, safe on several threads.
class Counter : public data::datasets::StatefulDataset<Counter> {
 public:
  explicit Counter(size_t n) : state_(std::make_shared<State>()), n_(n) {}
  kiln::optional<std::vector<data::Example<>>> get_batch(size_t batch_size) override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->next >= n_) return kiln::nullopt;
    std::vector<data::Example<>> batch;
    for (; batch.size() < batch_size && state_->next < n_; ++state_->next) {
      const auto i = static_cast<int64_t>(state_->next);
      batch.push_back({kiln::full({1}, static_cast<double>(i)), kiln::scalar_tensor(i)});
    }
    return batch;
  }
  kiln::optional<size_t> size() const override { return n_; }
  void reset() override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->next = 0;
    ++state_->resets;
  }
  int resets() const { return state_->resets; }

 private:
  struct State {
    std::mutex mutex;
    size_t next = 0;
    int resets = 0;
  };
  std::shared_ptr<State> state_;
  size_t n_;
};

TEST(DataLoaderTest, StatefulDatasetWithoutSampler) {
  for (size_t workers : {0, 3}) {
    Counter counter(11);
    auto loader = data::make_data_loader(counter.map(data::transforms::Stack<>()),
                                         data::DataLoaderOptions().batch_size(4).workers(workers));
    for (int epoch = 1; epoch <= 2; ++epoch) {
      std::vector<int64_t> all;
      size_t batches = 0;
      for (auto& batch : *loader) {
        ++batches;
        for (int64_t t : batch.target.to_vector<int64_t>()) all.push_back(t);
      }
      EXPECT_EQ(counter.resets(), epoch) << workers;  // begin() resets the dataset
      EXPECT_EQ(batches, 3u) << workers;
      if (workers == 0) {
        EXPECT_EQ(all, iota(0, 11));
      } else {  // every example once; the threads share the dataset, so the order may vary
        std::sort(all.begin(), all.end());
        EXPECT_EQ(all, iota(0, 11)) << workers;
      }
    }
  }
}

TEST(DataLoaderTest, StatefulDatasetErrorsReachTheLoop) {
  class Broken : public data::datasets::StatefulDataset<Broken, Tensor> {
   public:
    kiln::optional<Tensor> get_batch(size_t) override { KILN_FAIL("[Broken] no data today"); }
    kiln::optional<size_t> size() const override { return kiln::nullopt; }
    void reset() override {}
  };
  auto loader = data::make_data_loader(Broken(), data::DataLoaderOptions(2).workers(2));
  EXPECT_KILN_ERROR(*loader->begin(), "[Broken] no data today");
}

}  // namespace
}  // namespace kiln
