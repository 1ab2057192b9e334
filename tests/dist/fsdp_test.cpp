// fully_shard (dist/fsdp.h): sharded training over 1, 2 and 4 processes equals one process on the
// global batch (an MLP and the tiny Llama, AdamW; losses, shard gradients and full weights; shard
// sizes about 1/world of the model); bf16 compute with f32 shards; a sharded checkpoint written by
// 4 ranks loads on 2; misuse ends in clear errors. The ranks are tests/dist/fsdp_worker.cpp. In
// this process, with a GPU: the NCCL backend at world size 1 along the FSDP path.
#include "dist/fsdp.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "dist/dist.h"
#include "fsdp_util.h"
#include "kernels/cuda.h"
#include "kiln.h"
#include "models/gpt.h"
#include "models/gpt_hooks.h"
#include "test_util.h"

namespace kiln::dist {
namespace {

using testing::kFsdpWorker;
using testing::scenario_passes;

TEST(FsdpTest, MlpEqualsOneProcessAtWorldSizeOne) {
  EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_mlp", 1));
}

TEST(FsdpTest, MlpEqualsOneProcessAtWorldSizeTwo) {
  EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_mlp", 2));
}

TEST(FsdpTest, MlpEqualsOneProcessAtWorldSizeFour) {
  EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_mlp", 4));
}

// Three ranks: sizes that do not divide (fc3's bias and the root's scale hold 4 elements), so
// gradients are padded into the reduce-scatter's inputs.
TEST(FsdpTest, MlpEqualsOneProcessAtWorldSizeThree) {
  EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_mlp", 3));
}

TEST(FsdpTest, NoSyncAccumulationEqualsOneProcessAtWorldSizeTwo) {
  EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_no_sync", 2));
}

TEST(FsdpTest, NoSyncAccumulationEqualsOneProcessAtWorldSizeFour) {
  EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_no_sync", 4));
}

TEST(FsdpTest, TinyLlamaEqualsOneProcessAtWorldSizeOne) {
  EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_llama", 1));
}

TEST(FsdpTest, TinyLlamaEqualsOneProcessAtWorldSizeTwo) {
  EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_llama", 2));
}

TEST(FsdpTest, TinyLlamaEqualsOneProcessAtWorldSizeFour) {
  EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_llama", 4));
}

TEST(FsdpTest, TinyLlamaGatheredPerBlockEqualsOneProcessAtWorldSizeTwo) {
  EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_llama_per_unit", 2));
}

TEST(FsdpTest, Bf16ComputeWithF32Shards) {
  EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_mixed_precision", 2));
}

TEST(FsdpTest, CheckpointOfFourRanksLoadsOnTwo) {
  char dir_template[] = "/tmp/kiln_fsdp_ckpt_XXXXXX";
  const std::string dir = ::mkdtemp(dir_template);
  const std::vector<std::string> env = {"FSDP_CKPT_DIR=" + dir};
  ASSERT_TRUE(scenario_passes(kFsdpWorker, "fsdp_checkpoint_save", 4, env));
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(std::filesystem::exists(dir + "/shard-" + std::to_string(r) + "-of-4.safetensors"));
  }
  EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_checkpoint_load", 2, env));
  EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_checkpoint_load", 1, env));
  std::filesystem::remove_all(dir);
}

// ZeRO-3 on a 16-block Llama: after the forward no block's gathered parameters are alive, the
// backward's peak stays a few units' worth (nothing full kept per unit until the end of the
// backward), and after it only the shards' gradients remain (CPU bytes counted by the worker).
TEST(FsdpTest, Zero3MemoryStaysWithinAFewUnitsAtWorldSizeTwo) {
  EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_memory", 2));
}

TEST(FsdpTest, ErrorsAreClear) { EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_errors", 2)); }

// The compiled training step (kiln::compile) under FSDP: the trace holds each unit's all-gather and
// reduce-scatter, and the step equals one process on the global batch (fsdp_worker's
// fsdp_compiled).
TEST(FsdpTest, CompiledZero2StepEqualsOneProcessAtWorldSizeTwo) {
  EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_compiled", 2, {"FSDP_ZERO=2"}));
}

TEST(FsdpTest, CompiledZero3StepEqualsOneProcessAtWorldSizeTwo) {
  EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_compiled", 2, {"FSDP_ZERO=3"}));
}

TEST(FsdpTest, CompiledZero3StepEqualsOneProcessAtWorldSizeFour) {
  EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_compiled", 4, {"FSDP_ZERO=3"}));
}

TEST(FsdpTest, CompiledStepWithBf16ComputeAndAccumulationEqualsEager) {
  EXPECT_TRUE(scenario_passes(kFsdpWorker, "fsdp_compiled_mixed", 2));
}

// The GPU tests' model: the tiny Llama on `gpu`, the same weights at every call.
models::GPT tiny_llama(const Device& gpu) {
  manual_seed(3);
  return models::GPT(models::ModelConfig::from_name("tiny-llama"), TensorOptions().device(gpu));
}

// `root`'s full state dict holds `whole`'s, to allclose(rtol, atol).
void expect_full_state_equals(FSDPModule& root, models::GPT& whole, double rtol, double atol) {
  const auto full = root.full_state_dict();
  for (const auto& [name, t] : whole->state_dict()) {
    ASSERT_TRUE(full.contains(name)) << name;
    EXPECT_TRUE(allclose(full.at(name).cpu(), t.cpu(), rtol, atol)) << name;
  }
}

// World size 1 on NCCL: gathers, reduce-scatters (an average over one rank) and the state dict
// run on the GPU; the training follows the unsharded model (the same kernels in the same order).
TEST(GpuFsdpNCCLTest, WorldSizeOneAlongTheFsdpPath) {
  if (!cuda::is_available() || !nccl_available()) {
    GTEST_SKIP() << "needs a GPU and a build with NCCL";
  }
  auto pg = testing::nccl_group_of_one();
  const Device gpu(kCUDA, 0);
  models::GPT a = tiny_llama(gpu), b = tiny_llama(gpu);
  for (size_t l = 0; l < a->h->size(); ++l) fully_shard(a->h[l], pg);
  auto root = fully_shard(a, pg);
  optim::AdamW opt_a(a->parameters(), 1e-3), opt_b(b->parameters(), 1e-3);
  for (int step = 0; step < 2; ++step) {
    Tensor idx = randint(0, 320, {2, 16}).to(gpu), tgt = randint(0, 320, {2, 16}).to(gpu);
    opt_a.zero_grad();
    opt_b.zero_grad();
    Tensor la = root->run([&] { return a->loss(idx, tgt); });
    la.backward();
    Tensor lb = b->loss(idx, tgt);
    lb.backward();
    opt_a.step();
    opt_b.step();
    EXPECT_NEAR(la.item<double>(), lb.item<double>(), 1e-5) << "step " << step;
  }
  cuda::synchronize();
  expect_full_state_equals(*root, b, 1e-4, 1e-5);
}

// The compiled ZeRO-3 step on NCCL at world size 1 (gathered per block, the gathers and
// reduce-scatters ops of the program, run on NCCL's stream with the waits ordering the compute
// stream): follows the unsharded model trained eagerly.
TEST(GpuFsdpNCCLTest, CompiledZero3StepAtWorldSizeOne) {
  if (!cuda::is_available() || !nccl_available()) {
    GTEST_SKIP() << "needs a GPU and a build with NCCL";
  }
  auto pg = testing::nccl_group_of_one();
  const Device gpu(kCUDA, 0);
  models::GPT a = tiny_llama(gpu), b = tiny_llama(gpu);
  std::vector<std::shared_ptr<FSDPModule>> blocks;
  auto root = testing::shard_per_block(a, pg, {}, blocks);
  optim::AdamW opt_a(a->parameters(), 1e-3), opt_b(b->parameters(), 1e-3);
  auto step = kiln::compile([&](const Tensor& x, const Tensor& y) {
    opt_a.zero_grad();
    Tensor loss = root->run([&] { return a->loss(x, y); });
    loss.backward();
    opt_a.step();
    return loss.detach();
  });
  for (int i = 0; i < 4; ++i) {
    Tensor idx = randint(0, 320, {2, 16}).to(gpu), tgt = randint(0, 320, {2, 16}).to(gpu);
    Tensor la = step(idx, tgt);
    opt_b.zero_grad();
    Tensor lb = b->loss(idx, tgt);
    lb.backward();
    opt_b.step();
    EXPECT_NEAR(la.item<double>(), lb.item<double>(), 1e-4) << "step " << i;
  }
  EXPECT_EQ(step.stats().misses, 2);
  EXPECT_EQ(step.stats().hits, 2);
  cuda::synchronize();
  models::set_block_hook(*a, {});
  expect_full_state_equals(*root, b, 1e-3, 1e-4);
}

// ZeRO-3 on NCCL at world size 1, a 16-block Llama whose parameters dominate (d 256, 16 tokens):
// the backward's peak allocation above the forward's end, beyond the gradients (at world size 1
// the shards' gradients are the whole model's), stays a few blocks' worth. Each unit's packed
// gradient, which the reduce-scatter holds until it is waited for, goes before the next unit's
// is made (kept until the end of the backward, it was one more block per block).
TEST(GpuFsdpNCCLTest, Zero3BackwardPeakStaysWithinAFewUnits) {
  if (!cuda::is_available() || !nccl_available()) {
    GTEST_SKIP() << "needs a GPU and a build with NCCL";
  }
  auto pg = testing::nccl_group_of_one();
  const Device gpu(kCUDA, 0);
  manual_seed(3);
  models::GPT a(testing::deep_tiny_llama(), TensorOptions().device(gpu));
  std::vector<std::shared_ptr<FSDPModule>> blocks;
  auto root = testing::shard_per_block(a, pg, {}, blocks);
  const int64_t unit = blocks[0]->unsharded_numel() * 4;  // f32 bytes of one block
  const int64_t grads = testing::shard_bytes(*root, blocks, 4);
  optim::AdamW opt(a->parameters(), 1e-3);
  for (int step = 0; step < 3; ++step) {  // the first steps allocate cuBLAS's workspaces
    Tensor idx = randint(0, 320, {1, 16}).to(gpu), tgt = randint(0, 320, {1, 16}).to(gpu);
    opt.zero_grad();
    Tensor loss = root->run([&] { return a->loss(idx, tgt); });
    cuda::synchronize();
    const int64_t after_forward = cuda::memory_stats().allocated;
    cuda::reset_peak_memory_stats();
    loss.backward();
    cuda::synchronize();
    const int64_t above = cuda::memory_stats().peak - after_forward - grads;
    if (step == 2) {
      EXPECT_LE(above, 6 * unit) << "the backward's peak is " << above << " bytes ("
                                 << static_cast<double>(above) / unit << " blocks of " << unit
                                 << " bytes) above the forward's end and the gradients";
    }
    opt.step();
  }
  models::set_block_hook(*a, {});
}

}  // namespace
}  // namespace kiln::dist
