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
