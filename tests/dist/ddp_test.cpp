// DistributedDataParallel (dist/ddp.h): training over 1, 2 and 4 processes equals one process on
// the global batch (losses, gradients and weights after every step; several buckets; gradient
// accumulation under no_sync()), with gradient_as_bucket_view (the default: grads are views into
// the buckets, through zero_grad to undefined or zeros and gradients of another layout or dtype)
// and without it (KILN_TEST_BUCKET_VIEW=0); buckets rebuilt in rank 0's observed ready order
// after the first backward; find_unused_parameters with a branch only some ranks take; a
// parameter left out of the loss (without find_unused_parameters) and ranks with different
// models are clear errors. In this process: the post-accumulate-grad hook that DDP builds on
// (autograd/hooks.h), and, with a GPU, the NCCL backend at world size 1 along the DDP path and a
// compiled step over NCCL.
#include <gtest/gtest.h>

#include "autograd/hooks.h"
#include "dist/dist.h"
#include "kernels/cuda.h"
#include "kiln.h"
#include "test_util.h"

namespace kiln::dist {
namespace {

using testing::kDistWorker;
using testing::scenario_passes;

TEST(DdpTest, EqualsOneProcessAtWorldSizeOne) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_equivalence", 1));
}

TEST(DdpTest, EqualsOneProcessAtWorldSizeTwo) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_equivalence", 2));
}

TEST(DdpTest, EqualsOneProcessAtWorldSizeFour) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_equivalence", 4));
}

TEST(DdpTest, CompiledGatheredEmbeddingEqualsOneProcess) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_compiled_gathered_embedding", 2));
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_compiled_gathered_embedding", 2,
                              {"KILN_TEST_BUCKET_VIEW=0"}));
}

TEST(DdpTest, UnusedParameterIsNamed) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_unused_parameter", 2));
}

TEST(DdpTest, DifferentModelsAreRefused) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_mismatch", 2));
}

TEST(DdpTest, OneBucketPerDtype) { EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_two_dtypes", 2)); }

TEST(DdpTest, GatheredEmbeddingEqualsOneProcessAtWorldSizeTwo) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_gathered_embedding", 2));
}

TEST(DdpTest, GatheredEmbeddingEqualsOneProcessWithCopiesAtWorldSizeThree) {
  EXPECT_TRUE(
      scenario_passes(kDistWorker, "ddp_gathered_embedding", 3, {"KILN_TEST_BUCKET_VIEW=0"}));
}

TEST(DdpTest, FindUnusedParametersAtWorldSizeOne) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_find_unused", 1));
}

TEST(DdpTest, FindUnusedParametersAtWorldSizeThree) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_find_unused", 3));
}

TEST(DdpTest, EqualsOneProcessWithCopiesAtWorldSizeTwo) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_equivalence", 2, {"KILN_TEST_BUCKET_VIEW=0"}));
}

TEST(DdpTest, FindUnusedParametersAtWorldSizeTwo) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_find_unused", 2));
}

TEST(DdpTest, FindUnusedParametersAtWorldSizeFour) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_find_unused", 4));
}

TEST(DdpTest, FindUnusedParametersWithCopiesAtWorldSizeThree) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_find_unused", 3, {"KILN_TEST_BUCKET_VIEW=0"}));
}

TEST(DdpTest, GradientAsBucketViewAtWorldSizeOne) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_bucket_view", 1));
}

TEST(DdpTest, GradientAsBucketViewAtWorldSizeTwo) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_bucket_view", 2));
}

TEST(DdpTest, GradientAsBucketViewAtWorldSizeFour) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_bucket_view", 4));
}

TEST(DdpTest, BucketsFollowRankZerosReadyOrderAtWorldSizeOne) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_rebuild_buckets", 1));
}

TEST(DdpTest, BucketsFollowRankZerosReadyOrderAtWorldSizeTwo) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_rebuild_buckets", 2));
}

TEST(DdpTest, BucketsFollowRankZerosReadyOrderAtWorldSizeFour) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_rebuild_buckets", 4));
}

TEST(DdpTest, BucketsFollowRankZerosReadyOrderWithCopies) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_rebuild_buckets", 2, {"KILN_TEST_BUCKET_VIEW=0"}));
}

TEST(DdpTest, CompiledStepEqualsOneProcessAtWorldSizeTwo) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_compiled", 2));
}

TEST(DdpTest, CompiledStepEqualsOneProcessAtWorldSizeFour) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_compiled", 4));
}

TEST(DdpTest, CompiledStepWithCopiesAtWorldSizeTwo) {
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_compiled", 2, {"KILN_TEST_BUCKET_VIEW=0"}));
}

TEST(PostAccumulateGradHookTest, RunsAfterAccumulationOncePerBackward) {
  Tensor w = ones({3}, kDouble).requires_grad_();
  std::vector<std::vector<double>> seen;
  const unsigned h = autograd::register_post_accumulate_grad_hook(
      w, [&seen](const Tensor& p) { seen.push_back(p.grad().to_vector<double>()); });
  // w is used twice: the hook still runs once, with the summed gradient.
  ((w * 2).sum() + (w * 3).sum()).backward();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0], (std::vector<double>{5, 5, 5}));
  (w * 1).sum().backward();  // accumulates: the hook sees 6
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[1], (std::vector<double>{6, 6, 6}));
  // A hook may rewrite grad in place.
  const unsigned h2 = autograd::register_post_accumulate_grad_hook(w, [](const Tensor& p) {
    Tensor g = p.grad();
    g.mul_(10);
  });
  w.mutable_grad() = Tensor();
  (w * 1).sum().backward();
  EXPECT_EQ(w.grad().to_vector<double>(), (std::vector<double>{10, 10, 10}));
  EXPECT_TRUE(autograd::remove_post_accumulate_grad_hook(w, h));
  EXPECT_TRUE(autograd::remove_post_accumulate_grad_hook(w, h2));
  EXPECT_FALSE(autograd::remove_post_accumulate_grad_hook(w, h));
  (w * 1).sum().backward();
  EXPECT_EQ(seen.size(), 3u);  // three backward passes ran it; none after its removal
  try {
    autograd::register_post_accumulate_grad_hook(w * 2, [](const Tensor&) {});
    ADD_FAILURE() << "a non-leaf was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be a leaf that requires grad"), std::string::npos);
  }
}

// A group of this process alone that records which all-reduce each call takes ('f': all_reduce,
// the fastest alone; 'b': all_reduce_beside_compute) and leaves the tensors as they are.
class RecordingGroup : public ProcessGroup {
 public:
  RecordingGroup() : ProcessGroup(0, 1) {}
  std::string backend_name() const override { return "recording"; }
  std::string calls;

  std::shared_ptr<Work> all_reduce(Tensor&, ReduceOp) override { return done('f'); }
  std::shared_ptr<Work> all_reduce_beside_compute(Tensor&, ReduceOp) override { return done('b'); }
  std::shared_ptr<Work> broadcast(Tensor&, int) override { return done(0); }
  std::shared_ptr<Work> all_gather_into_tensor(Tensor&, const Tensor&) override { fail(); }
  std::shared_ptr<Work> all_gather(std::vector<Tensor>&, const Tensor&) override { fail(); }
  std::shared_ptr<Work> reduce_scatter_tensor(Tensor&, const Tensor&, ReduceOp) override { fail(); }
  std::shared_ptr<Work> reduce_scatter(Tensor&, const std::vector<Tensor>&, ReduceOp) override {
    fail();
  }
  std::shared_ptr<Work> barrier() override { return done(0); }
  std::shared_ptr<Work> send(const Tensor&, int, int) override { fail(); }
  std::shared_ptr<Work> recv(Tensor&, int, int) override { fail(); }

 private:
  std::shared_ptr<Work> done(char call) {
    if (call != 0) calls += call;
    auto w = std::make_shared<Work>("recorded");
    w->finish();
    return w;
  }
  [[noreturn]] static void fail() { KILN_FAIL("RecordingGroup: not used by DDP"); }
};

// DDPOptions::tail_buckets: the last buckets of every backward take the all-reduce that is
// fastest alone, the others the one beside the compute.
TEST(DdpTest, TailBucketsTakeTheFastestAllReduce) {
  auto run = [](std::optional<int> tail_buckets) {
    auto pg = std::make_shared<RecordingGroup>();
    manual_seed(5);
    nn::Sequential net(nn::Linear(4, 8), nn::Linear(8, 8), nn::Linear(8, 2));
    DDPOptions o;
    o.bucket_cap_mb = 1e-6;  // a bucket per parameter: six
    if (tail_buckets) o.tail_buckets = *tail_buckets;
    DistributedDataParallel ddp(net, pg, o);
    pg->calls.clear();  // the constructor's check that the ranks hold the same model
    Tensor x = randn({3, 4});
    ddp(x).square().mean().backward();
    const std::string first = pg->calls;
    pg->calls.clear();
    ddp(x).square().mean().backward();  // in the buckets rebuilt in the ready order
    EXPECT_EQ(pg->calls, first);
    return first;
  };
  EXPECT_EQ(run(std::nullopt), "bbbbbf");  // the default: 1
  EXPECT_EQ(run(2), "bbbbff");
  EXPECT_EQ(run(0), "bbbbbb");
  EXPECT_EQ(run(6), "ffffff");
  EXPECT_EQ(run(100), "ffffff");
  DDPOptions bad;
  bad.tail_buckets = -1;
  manual_seed(5);
  nn::Linear net(4, 2);
  try {
    DistributedDataParallel ddp(net, std::make_shared<RecordingGroup>(), bad);
    ADD_FAILURE() << "tail_buckets -1 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tail_buckets must be >= 0, got -1"), std::string::npos)
        << e.what();
  }
}

// A compiled DDP step over NCCL equals eager DDP (dist_worker's ddp_compiled_nccl); at 2 ranks
// where there are 2 GPUs.
TEST(GpuDdpTest, CompiledStepOverNcclEqualsEager) {
  if (!cuda::is_available() || !nccl_available()) {
    GTEST_SKIP() << "needs a GPU and a build with NCCL";
  }
  EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_compiled_nccl", 1));
  if (cuda::device_count() >= 2) {
    EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_compiled_nccl", 2));
  }
}

TEST(GpuProcessGroupNCCLTest, WorldSizeOneAlongTheDdpPath) {
  if (!cuda::is_available() || !nccl_available()) {
    GTEST_SKIP() << "needs a GPU and a build with NCCL";
  }
  auto pg = testing::nccl_group_of_one();
  const Device gpu(kCUDA, 0);
  Tensor t = arange(0, 8, kFloat).to(gpu);
  pg->all_reduce(t, ReduceOp::kAvg)->wait();
  pg->broadcast(t, 0)->wait();
  Tensor gathered = empty({8}, TensorOptions().dtype(kFloat).device(gpu));
  pg->all_gather_into_tensor(gathered, t)->wait();
  Tensor scattered = empty({8}, TensorOptions().dtype(kFloat).device(gpu));
  pg->reduce_scatter_tensor(scattered, gathered)->wait();
  pg->barrier()->wait();
  EXPECT_EQ(scattered.cpu().to_vector<float>(), arange(0, 8, kFloat).to_vector<float>());

  // One rank's all-reduce and broadcast run nothing: their Works are done at once, even behind a
  // busy stream (NCCL's would wait for it), and the tensor is as it was.
  Tensor busy = randn({4096, 4096}).to(gpu);
  for (int i = 0; i < 4; ++i) busy = matmul(busy, busy) / 64;  // milliseconds of queued work
  Tensor u = arange(0, 1 << 20, kFloat).to(gpu);
  auto avg = pg->all_reduce(u, ReduceOp::kAvg);
  auto beside = pg->all_reduce_beside_compute(u, ReduceOp::kAvg);
  auto bcast = pg->broadcast(u, 0);
  EXPECT_TRUE(avg->is_completed() && beside->is_completed() && bcast->is_completed());
  avg->wait();
  beside->wait();
  bcast->wait();
  EXPECT_TRUE(equal(u.cpu(), arange(0, 1 << 20, kFloat)));
  // The checks still run: an average of integers is refused at one rank too.
  Tensor ints = zeros({4}, TensorOptions().dtype(kInt32).device(gpu));
  try {
    pg->all_reduce(ints, ReduceOp::kAvg);
    ADD_FAILURE() << "an average of int32 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("kAvg needs a floating-point tensor"), std::string::npos)
        << e.what();
  }

  // DDP on the GPU == plain training, one step.
  manual_seed(3);
  nn::Linear a(4, 2);
  manual_seed(3);
  nn::Linear b(4, 2);
  a->to(gpu);
  b->to(gpu);
  DistributedDataParallel ddp(a, pg);
  Tensor x = randn({5, 4}).to(gpu);
  ddp(x).square().mean().backward();
  b(x).square().mean().backward();
  cuda::synchronize();
  EXPECT_TRUE(allclose(a->weight.grad().cpu(), b->weight.grad().cpu()));
  EXPECT_TRUE(allclose(a->bias.grad().cpu(), b->bias.grad().cpu()));

  // comm_sm_carveout: the products after the first bucket's launch leave SMs free; the setting
  // is restored when the backward's reduction ends, and the gradients are the same.
  DDPOptions carve;
  carve.comm_sm_carveout = 16;
  carve.bucket_cap_mb = 1e-6;  // one bucket per parameter: products run after the first launch
  manual_seed(3);
  nn::Sequential c(nn::Linear(4, 8), nn::Linear(8, 2));
  manual_seed(3);
  nn::Sequential d(nn::Linear(4, 8), nn::Linear(8, 2));
  c->to(gpu);
  d->to(gpu);
  DistributedDataParallel ddp_c(c, pg, carve);
  ddp_c(x).square().mean().backward();
  EXPECT_EQ(cuda::matmul_sm_carveout(), 0);
  d->forward(x).square().mean().backward();
  cuda::synchronize();
  const auto pc = c->parameters(), pd = d->parameters();
  ASSERT_EQ(pc.size(), pd.size());
  for (size_t i = 0; i < pc.size(); ++i) {
    EXPECT_TRUE(allclose(pc[i].grad().cpu(), pd[i].grad().cpu())) << i;
  }
}

}  // namespace
}  // namespace kiln::dist
