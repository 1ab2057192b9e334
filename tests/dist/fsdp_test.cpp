// fully_shard (dist/fsdp.h): sharded training over 1, 2 and 4 processes equals one process on the
// global batch (an MLP and the tiny Llama, AdamW; losses, shard gradients and full weights; shard
// sizes about 1/world of the model); bf16 compute with f32 shards; a sharded checkpoint written by
// 4 ranks loads on 2; misuse ends in clear errors. The ranks are tests/dist/fsdp_worker.cpp. In
// this process, with a GPU: the NCCL backend at world size 1 along the FSDP path.
#include "dist/fsdp.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "dist/dist.h"
#include "kernels/cuda.h"
#include "kiln.h"
#include "models/gpt.h"
#include "models/gpt_hooks.h"
#include "spawn.h"

namespace kiln::dist {
namespace {

using testing::JobResult;
using testing::run_job;

JobResult run_fsdp(const std::string& scenario, int world,
                   const std::vector<std::string>& extra_env = {}) {
  return run_job({KILN_FSDP_WORKER, scenario}, world, std::chrono::seconds(50), extra_env);
}

TEST(FsdpTest, MlpEqualsOneProcessAtWorldSizeOne) {
  auto job = run_fsdp("fsdp_mlp", 1);
  EXPECT_TRUE(job.all_ok()) << job.describe();
}

TEST(FsdpTest, MlpEqualsOneProcessAtWorldSizeTwo) {
  auto job = run_fsdp("fsdp_mlp", 2);
  EXPECT_TRUE(job.all_ok()) << job.describe();
}

TEST(FsdpTest, MlpEqualsOneProcessAtWorldSizeFour) {
  auto job = run_fsdp("fsdp_mlp", 4);
  EXPECT_TRUE(job.all_ok()) << job.describe();
}

TEST(FsdpTest, NoSyncAccumulationEqualsOneProcessAtWorldSizeTwo) {
  auto job = run_fsdp("fsdp_no_sync", 2);
  EXPECT_TRUE(job.all_ok()) << job.describe();
}

TEST(FsdpTest, NoSyncAccumulationEqualsOneProcessAtWorldSizeFour) {
  auto job = run_fsdp("fsdp_no_sync", 4);
  EXPECT_TRUE(job.all_ok()) << job.describe();
}

TEST(FsdpTest, TinyLlamaEqualsOneProcessAtWorldSizeOne) {
  auto job = run_fsdp("fsdp_llama", 1);
  EXPECT_TRUE(job.all_ok()) << job.describe();
}

TEST(FsdpTest, TinyLlamaEqualsOneProcessAtWorldSizeTwo) {
  auto job = run_fsdp("fsdp_llama", 2);
  EXPECT_TRUE(job.all_ok()) << job.describe();
}

TEST(FsdpTest, TinyLlamaEqualsOneProcessAtWorldSizeFour) {
  auto job = run_fsdp("fsdp_llama", 4);
  EXPECT_TRUE(job.all_ok()) << job.describe();
}

TEST(FsdpTest, TinyLlamaGatheredPerBlockEqualsOneProcessAtWorldSizeTwo) {
  auto job = run_fsdp("fsdp_llama_per_unit", 2);
  EXPECT_TRUE(job.all_ok()) << job.describe();
}

TEST(FsdpTest, Bf16ComputeWithF32Shards) {
  auto job = run_fsdp("fsdp_mixed_precision", 2);
  EXPECT_TRUE(job.all_ok()) << job.describe();
}

TEST(FsdpTest, CheckpointOfFourRanksLoadsOnTwo) {
  char dir_template[] = "/tmp/kiln_fsdp_ckpt_XXXXXX";
  const std::string dir = ::mkdtemp(dir_template);
  const std::vector<std::string> env = {"FSDP_CKPT_DIR=" + dir};
  auto save = run_fsdp("fsdp_checkpoint_save", 4, env);
  ASSERT_TRUE(save.all_ok()) << save.describe();
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(std::filesystem::exists(dir + "/shard-" + std::to_string(r) + "-of-4.safetensors"));
  }
  auto load = run_fsdp("fsdp_checkpoint_load", 2, env);
  EXPECT_TRUE(load.all_ok()) << load.describe();
  auto load_one = run_fsdp("fsdp_checkpoint_load", 1, env);
  EXPECT_TRUE(load_one.all_ok()) << load_one.describe();
  std::filesystem::remove_all(dir);
}

TEST(FsdpTest, ErrorsAreClear) {
  auto job = run_fsdp("fsdp_errors", 2);
  EXPECT_TRUE(job.all_ok()) << job.describe();
}

// The compiled training step (kiln::compile) under FSDP: the trace holds each unit's all-gather and
// reduce-scatter, and the step equals one process on the global batch (fsdp_worker's
// fsdp_compiled).
TEST(FsdpTest, CompiledZero2StepEqualsOneProcessAtWorldSizeTwo) {
  auto job = run_fsdp("fsdp_compiled", 2, {"FSDP_ZERO=2"});
  EXPECT_TRUE(job.all_ok()) << job.describe();
}

TEST(FsdpTest, CompiledZero3StepEqualsOneProcessAtWorldSizeTwo) {
  auto job = run_fsdp("fsdp_compiled", 2, {"FSDP_ZERO=3"});
  EXPECT_TRUE(job.all_ok()) << job.describe();
}

TEST(FsdpTest, CompiledZero3StepEqualsOneProcessAtWorldSizeFour) {
  auto job = run_fsdp("fsdp_compiled", 4, {"FSDP_ZERO=3"});
  EXPECT_TRUE(job.all_ok()) << job.describe();
}

TEST(FsdpTest, CompiledStepWithBf16ComputeAndAccumulationEqualsEager) {
  auto job = run_fsdp("fsdp_compiled_mixed", 2);
  EXPECT_TRUE(job.all_ok()) << job.describe();
}

// World size 1 on NCCL: gathers, reduce-scatters (an average over one rank) and the state dict
// run on the GPU; the training follows the unsharded model (the same kernels in the same order).
TEST(GpuFsdpNCCLTest, WorldSizeOneAlongTheFsdpPath) {
  if (!cuda::is_available() || !nccl_available()) {
    GTEST_SKIP() << "needs a GPU and a build with NCCL";
  }
  TCPStoreOptions o;
  o.port = 0;
  o.is_server = true;
  auto store = std::make_shared<TCPStore>("127.0.0.1", o);
  ProcessGroupNCCLOptions po;
  po.device_index = 0;
  auto pg = std::make_shared<ProcessGroupNCCL>(store, 0, 1, po);
  const Device gpu(kCUDA, 0);
  const auto cfg = models::ModelConfig::from_name("tiny-llama");
  manual_seed(3);
  models::GPT a(cfg, TensorOptions().device(gpu));
  manual_seed(3);
  models::GPT b(cfg, TensorOptions().device(gpu));
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
  const auto full = root->full_state_dict();
  for (const auto& [name, t] : b->state_dict()) {
    ASSERT_TRUE(full.contains(name)) << name;
    EXPECT_TRUE(allclose(full.at(name).cpu(), t.cpu(), 1e-4, 1e-5)) << name;
  }
}

// The compiled ZeRO-3 step on NCCL at world size 1 (gathered per block, the gathers and
// reduce-scatters ops of the program, run on NCCL's stream with the waits ordering the compute
// stream): follows the unsharded model trained eagerly.
TEST(GpuFsdpNCCLTest, CompiledZero3StepAtWorldSizeOne) {
  if (!cuda::is_available() || !nccl_available()) {
    GTEST_SKIP() << "needs a GPU and a build with NCCL";
  }
  TCPStoreOptions o;
  o.port = 0;
  o.is_server = true;
  auto store = std::make_shared<TCPStore>("127.0.0.1", o);
  ProcessGroupNCCLOptions po;
  po.device_index = 0;
  auto pg = std::make_shared<ProcessGroupNCCL>(store, 0, 1, po);
  const Device gpu(kCUDA, 0);
  const auto cfg = models::ModelConfig::from_name("tiny-llama");
  manual_seed(3);
  models::GPT a(cfg, TensorOptions().device(gpu));
  manual_seed(3);
  models::GPT b(cfg, TensorOptions().device(gpu));
  std::vector<std::shared_ptr<FSDPModule>> blocks;
  for (size_t l = 0; l < a->h->size(); ++l) blocks.push_back(fully_shard(a->h[l], pg));
  auto root = fully_shard(a, pg);
  root->set_gather_per_unit(true);
  models::set_block_hook(*a, [blocks](int64_t layer, bool before) {
    auto& unit = *blocks.at(static_cast<size_t>(layer));
    before ? unit.before_forward() : unit.after_forward();
  });
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
  const auto full = root->full_state_dict();
  for (const auto& [name, t] : b->state_dict()) {
    ASSERT_TRUE(full.contains(name)) << name;
    EXPECT_TRUE(allclose(full.at(name).cpu(), t.cpu(), 1e-3, 1e-4)) << name;
  }
}

}  // namespace
}  // namespace kiln::dist
