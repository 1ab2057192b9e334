// Datasets, transforms and samplers of kiln::data, written as a libtorch user would write them:
// a user Dataset<Self>, .map() chains, Stack/Normalize/Lambda, every sampler's indices.
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <vector>

#include "datasets/data.h"
#include "test_util.h"

namespace kiln {
namespace {

namespace data = kiln::data;

// Example i: data [2] = {i, -i}, target 0-d = i % 3.
class Pairs : public data::datasets::Dataset<Pairs> {
 public:
  explicit Pairs(size_t n) : n_(n) {}
  data::Example<> get(size_t index) override {
    KILN_CHECK(index < n_, "[Pairs] index ", index, " out of range");
    const auto i = static_cast<double>(index);
    return {kiln::tensor({i, -i}), kiln::scalar_tensor(static_cast<int64_t>(index % 3))};
  }
  kiln::optional<size_t> size() const override { return n_; }

 private:
  size_t n_;
};

TEST(DatasetTest, GetBatchCallsGetPerIndex) {
  Pairs ds(10);
  const auto batch = ds.get_batch({3, 7});
  ASSERT_EQ(batch.size(), 2u);
  EXPECT_EQ(batch[0].data.to_vector<float>(), (std::vector<float>{3, -3}));
  EXPECT_EQ(batch[1].target.item<int64_t>(), 1);
  EXPECT_EQ(ds.size().value(), 10u);
}

TEST(DatasetTest, MapStackGivesBatchTensors) {
  auto ds = Pairs(10).map(data::transforms::Stack<>());
  const data::Example<> b = ds.get_batch({0, 4, 5});
  EXPECT_EQ(b.data.sizes(), (IntArrayRef{3, 2}));
  EXPECT_EQ(b.target.sizes(), (IntArrayRef{3}));
  EXPECT_EQ(b.data.to_vector<float>(), (std::vector<float>{0, 0, 4, -4, 5, -5}));
  EXPECT_EQ(b.target.to_vector<int64_t>(), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(ds.size().value(), 10u);
}

TEST(DatasetTest, MapOnLvalueCopiesAndChains) {
  Pairs base(6);
  auto doubled = base.map(data::transforms::Lambda<data::Example<>>([](data::Example<> e) {
                       e.data = e.data * 2;
                       return e;
                     }))
                     .map(data::transforms::TensorLambda<>([](Tensor t) { return t + 1; }))
                     .map(data::transforms::Stack<>());
  const auto b = doubled.get_batch({2});
  EXPECT_EQ(b.data.to_vector<float>(), (std::vector<float>{5, -3}));            // 2*2+1, -2*2+1
  EXPECT_EQ(base.get(2).data.to_vector<float>(), (std::vector<float>{2, -2}));  // untouched
  EXPECT_EQ(doubled.dataset().dataset().dataset().size().value(), 6u);
}

TEST(DatasetTest, BatchLambdaSeesTheWholeBatch) {
  auto ds = Pairs(5).map(data::transforms::BatchLambda<std::vector<data::Example<>>, Tensor>(
      [](std::vector<data::Example<>> batch) {
        return kiln::scalar_tensor(static_cast<int64_t>(batch.size()));
      }));
  EXPECT_EQ(ds.get_batch({0, 1, 2}).item<int64_t>(), 3);
}

TEST(DatasetTest, NormalizeSingleValueAndPerChannel) {
  data::transforms::Normalize<> one(0.5, 0.25);
  const Tensor x = kiln::tensor({0.5, 1.0, 0.0});
  EXPECT_TRUE(kiln::allclose(one(x), kiln::tensor({0.0, 2.0, -2.0})));
  EXPECT_EQ(one(x).sizes(), (IntArrayRef{3}));  // a single value keeps any shape

  data::transforms::Normalize<> per_channel({1.0, 2.0}, {2.0, 4.0});
  const Tensor img = kiln::ones({2, 2, 3});
  const Tensor want = kiln::cat({kiln::zeros({1, 2, 3}), kiln::full({1, 2, 3}, -0.25)}, 0);
  EXPECT_TRUE(kiln::allclose(per_channel(img), want));
  // As a dataset transform it rewrites the data and leaves the target.
  auto ds = Pairs(4).map(data::transforms::Normalize<>(1.0, 2.0));
  const auto b = ds.get_batch({3});
  EXPECT_EQ(b[0].data.to_vector<float>(), (std::vector<float>{1, -2}));
  EXPECT_EQ(b[0].target.item<int64_t>(), 0);
  // f64 data stays f64.
  EXPECT_EQ(one(x.to(kFloat64)).dtype(), kFloat64);
  EXPECT_KILN_ERROR(data::transforms::Normalize<>(std::vector<double>{}, {1.0}), "[Normalize]");
}

TEST(DatasetTest, StackRejectsEmptyAndMismatchedShapes) {
  data::transforms::Stack<> stack;
  EXPECT_KILN_ERROR(stack.apply_batch({}), "[Stack] cannot stack an empty batch");
  std::vector<data::Example<>> ragged{{kiln::zeros({2}), kiln::zeros({})},
                                      {kiln::zeros({3}), kiln::zeros({})}};
  EXPECT_KILN_ERROR(stack.apply_batch(ragged), "[stack]");
}

TEST(DatasetTest, TensorDatasetAndTensorExampleStack) {
  data::datasets::TensorDataset ds(kiln::arange(12).view({6, 2}));
  EXPECT_EQ(ds.size().value(), 6u);
  data::TensorExample e = ds.get(2);
  Tensor row = e;  // converts to its data
  EXPECT_EQ(row.to_vector<int64_t>(), (std::vector<int64_t>{4, 5}));
  auto stacked = ds.map(data::transforms::Stack<data::TensorExample>());
  EXPECT_EQ(stacked.get_batch({5, 0}).data.to_vector<int64_t>(),
            (std::vector<int64_t>{10, 11, 0, 1}));
  EXPECT_KILN_ERROR(ds.get(6), "[TensorDataset] index 6 is out of range");
}

// All indices one sampler returns in an epoch, batch by batch.
template <typename S>
std::vector<std::vector<size_t>> epoch(S& sampler, size_t batch_size) {
  std::vector<std::vector<size_t>> out;
  while (auto b = sampler.next(batch_size)) out.push_back(*b);
  return out;
}

std::vector<size_t> flat(const std::vector<std::vector<size_t>>& batches) {
  std::vector<size_t> out;
  for (const auto& b : batches) out.insert(out.end(), b.begin(), b.end());
  return out;
}

TEST(SamplerTest, Sequential) {
  data::samplers::SequentialSampler s(5);
  const auto batches = epoch(s, 2);
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[2], (std::vector<size_t>{4}));
  EXPECT_EQ(flat(batches), (std::vector<size_t>{0, 1, 2, 3, 4}));
  EXPECT_FALSE(s.next(2).has_value());
  s.reset(3);
  EXPECT_EQ(flat(epoch(s, 10)), (std::vector<size_t>{0, 1, 2}));
  EXPECT_KILN_ERROR(s.next(0), "batch_size must be positive");
}

TEST(SamplerTest, RandomIsAPermutationReproducibleBySeed) {
  kiln::manual_seed(7);
  data::samplers::RandomSampler s(20);
  std::vector<size_t> a = flat(epoch(s, 3));
  std::vector<size_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  std::vector<size_t> all(20);
  std::iota(all.begin(), all.end(), size_t{0});
  EXPECT_EQ(sorted, all);
  EXPECT_NE(a, all);  // 1 in 20! to fail by chance
  s.reset();
  const std::vector<size_t> b = flat(epoch(s, 3));
  EXPECT_NE(a, b);  // a new epoch, a new order
  kiln::manual_seed(7);
  data::samplers::RandomSampler again(20);
  EXPECT_EQ(flat(epoch(again, 7)), a);
  EXPECT_KILN_ERROR(data::samplers::RandomSampler(-1), "[RandomSampler] size must be");
}

TEST(SamplerTest, DistributedRandomPartsCoverEveryIndex) {
  const size_t size = 10, replicas = 3;
  std::multiset<size_t> seen;
  for (size_t rank = 0; rank < replicas; ++rank) {
    data::samplers::DistributedRandomSampler s(size, replicas, rank);
    s.set_epoch(4);
    s.reset();
    EXPECT_EQ(s.local_sample_count(), 4u);  // ceil(10 / 3)
    const auto part = flat(epoch(s, 3));
    EXPECT_EQ(part.size(), 4u);
    seen.insert(part.begin(), part.end());
  }
  EXPECT_EQ(seen.size(), 12u);
  for (size_t i = 0; i < size; ++i) EXPECT_GE(seen.count(i), 1u) << i;

  // Same epoch, same order on every construction; another epoch, another order.
  data::samplers::DistributedRandomSampler a(100, 2, 1), b(100, 2, 1);
  const auto pa = flat(epoch(a, 8));
  EXPECT_EQ(pa, flat(epoch(b, 8)));
  a.set_epoch(1);
  a.reset();
  EXPECT_NE(flat(epoch(a, 8)), pa);
  EXPECT_EQ(a.epoch(), 1u);
}

TEST(SamplerTest, DistributedWithoutDuplicatesDropsTheRemainder) {
  std::set<size_t> seen;
  for (size_t rank = 0; rank < 3; ++rank) {
    data::samplers::DistributedRandomSampler s(10, 3, rank, /*allow_duplicates=*/false);
    const auto part = flat(epoch(s, 100));
    EXPECT_EQ(part.size(), 3u);
    seen.insert(part.begin(), part.end());
  }
  EXPECT_EQ(seen.size(), 9u);  // disjoint parts
  EXPECT_KILN_ERROR(data::samplers::DistributedRandomSampler(10, 2, 2), "rank 2 is out of range");
}

TEST(SamplerTest, DistributedSequential) {
  data::samplers::DistributedSequentialSampler r0(5, 2, 0), r1(5, 2, 1);
  EXPECT_EQ(flat(epoch(r0, 2)), (std::vector<size_t>{0, 1, 2}));
  EXPECT_EQ(flat(epoch(r1, 2)), (std::vector<size_t>{3, 4, 0}));  // padded from the start
  r1.reset(8);
  EXPECT_EQ(flat(epoch(r1, 10)), (std::vector<size_t>{4, 5, 6, 7}));
  data::samplers::DistributedSequentialSampler nodup(5, 2, 1, false);
  EXPECT_EQ(flat(epoch(nodup, 10)), (std::vector<size_t>{2, 3}));
}

}  // namespace
}  // namespace kiln
