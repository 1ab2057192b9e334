// fully_shard (dist/fsdp.h): sharded training over 1, 2 and 4 processes equals one process on the
// global batch (an MLP and the tiny Llama, AdamW; losses, shard gradients and full weights; shard
// sizes about 1/world of the model); bf16 compute with f32 shards; a sharded checkpoint written by
// 4 ranks loads on 2; misuse ends in clear errors. The ranks are tests/dist/fsdp_worker.cpp.
#include <gtest/gtest.h>

#include <filesystem>

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

}  // namespace
}  // namespace kiln::dist
