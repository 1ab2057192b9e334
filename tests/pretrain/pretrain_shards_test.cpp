// `kiln pretrain` on token shards (models/trainer.h with pretrain/loader.h): the loader position
// goes into trainer_state.json and a resume continues bit-exactly; errors come before the first
// step (a crafted state file naming files outside the checkpoint, an unwritable output, shards of
// a larger vocabulary, a checkpoint of other data); the progress bar on a terminal.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "models/trainer.h"
#include "nn/safetensors.h"
#include "pretrain/loader.h"
#include "pretrain/shard.h"
#include "pretrain_test_util.h"
#include "tensor/ops.h"
#include "test_util.h"

namespace kiln::models {
namespace {

namespace fs = std::filesystem;

class PretrainShardsTest : public test::TempDirTest {
 protected:
  void SetUp() override {
    test::TempDirTest::SetUp();
    // Two byte-token shards of the bundled text's first 24 KB.
    const std::string text =
        test::read_bytes(std::string(KILN_SOURCE_DIR) + "/data/tinyshakespeare.txt")
            .substr(0, 24000);
    fs::create_directories(dir() / "shards");
    for (int s = 0; s < 2; ++s) {
      pretrain::ShardWriter w(
          file("shards/shard-0000" + std::to_string(s) + ".tokens"),
          {.vocab_size = 256, .tokenizer_fingerprint = pretrain::kByteTokenizerFingerprint});
      const std::string part = text.substr(static_cast<size_t>(s) * 12000, 12000);
      std::vector<int64_t> ids(part.begin(), part.end());
      for (auto& v : ids) v &= 0xff;
      w.append_document(ids);
      w.finish();
    }
  }
  PretrainOptions options() const {
    PretrainOptions o;
    o.config_name = "tiny-llama";
    o.data_path = file("shards");
    o.batch_size = 4;
    o.seq_len = 32;
    o.max_steps = 6;
    o.warmup_steps = 2;
    o.log_interval = 2;
    o.eval_interval = 0;
    o.eval_batches = 2;
    o.grad_accum_steps = 2;
    o.device = Device(kCPU);
    o.seed = 11;
    o.progress_bar = false;
    return o;
  }
};

TEST_F(PretrainShardsTest, ResumeRestoresTheLoaderPositionAndIsBitExact) {
  std::ostringstream log;
  PretrainOptions o = options();
  o.out_dir = file("straight");
  const auto straight = pretrain(o, log);
  EXPECT_TRUE(std::isfinite(straight.final_val_loss));
  EXPECT_NE(log.str().find("2 shards, 24000 tokens"), std::string::npos) << log.str();

  o.out_dir = file("resumed");
  o.max_steps = 3;
  o.lr_decay_steps = 6;
  const auto first = pretrain(o, log);
  const auto mid = read_checkpoint_info(o.out_dir);
  ASSERT_TRUE(mid && mid->loader);
  EXPECT_EQ(mid->loader->position, 3u * 2 * 4);  // steps x micro-batches x batch
  EXPECT_EQ(mid->loader->seed, 11u);
  o.max_steps = 6;
  o.resume = true;
  const auto second = pretrain(o, log);
  EXPECT_EQ(second.start_step, 3);

  std::vector<double> resumed = first.train_losses;
  resumed.insert(resumed.end(), second.train_losses.begin(), second.train_losses.end());
  ASSERT_EQ(resumed, straight.train_losses);
  EXPECT_EQ(second.final_val_loss, straight.final_val_loss);
  const auto a = read_checkpoint_info(file("straight"));
  const auto b = read_checkpoint_info(file("resumed"));
  EXPECT_EQ(a->loader->position, 6u * 2 * 4);
  EXPECT_EQ(*a->loader, *b->loader);
  const TensorMap ma = load_safetensors(file("straight/" + a->model_file));
  const TensorMap mb = load_safetensors(file("resumed/" + b->model_file));
  for (const auto& [name, t] : ma) EXPECT_TRUE(equal(t, mb.at(name))) << name;

  // Resuming with another seed or sequence length is refused (the batches would differ).
  o.seed = 12;
  o.max_steps = 8;
  EXPECT_KILN_ERROR(pretrain(o, log), "other settings than asked: seed 11 -> 12");
  o.seed = 11;
  o.seq_len = 16;
  EXPECT_KILN_ERROR(pretrain(o, log), "other settings than asked: seq_len 32 -> 16");
}

TEST_F(PretrainShardsTest, ACraftedStateFileCannotReachOutsideTheCheckpoint) {
  test::write_bytes(file("victim.txt"), "keep me");
  fs::create_directories(dir() / "run");
  for (const std::string& name : {std::string("../victim.txt"), file("victim.txt")}) {
    test::write_bytes(file("run/trainer_state.json"),
                      "{\"config\": \"tiny-llama\", \"step\": 1, \"precision\": \"f32\", "
                      "\"model\": \"m.safetensors\", \"optimizer\": \"" +
                          name + "\"}");
    PretrainOptions o = options();
    o.out_dir = file("run");
    std::ostringstream log;
    // Without --resume too: the run would remove the previous checkpoint's files at its first save.
    EXPECT_KILN_ERROR(pretrain(o, log),
                      "\"optimizer\" is \"" + name + "\", not a file name inside");
    EXPECT_EQ(log.str().find("step 1/"), std::string::npos) << "failed after training started";
  }
  EXPECT_EQ(test::read_bytes(file("victim.txt")), "keep me");
}

TEST_F(PretrainShardsTest, ErrorsComeBeforeTheFirstStep) {
  std::ostringstream log;
  PretrainOptions o = options();
  test::write_bytes(file("a_file"), "x");
  o.out_dir = file("a_file");
  EXPECT_KILN_ERROR(pretrain(o, log), "cannot create the output directory");

  o.out_dir = file("out");
  o.data_path = file("nowhere");
  EXPECT_KILN_ERROR(pretrain(o, log), "cannot open the file");
  o.data_path = file("nowhere.tokens");
  EXPECT_KILN_ERROR(pretrain(o, log), "nowhere.tokens: no such file or directory");
  fs::create_directories(dir() / "empty");
  o.data_path = file("empty");
  EXPECT_KILN_ERROR(pretrain(o, log), "a directory without token shards");

  test::write_counting_shard(file("big.tokens"), 0, 1000, /*vocab_size=*/1000);
  o.data_path = file("big.tokens");
  EXPECT_KILN_ERROR(pretrain(o, log),
                    "the shards come from a tokenizer of 1000 ids, more than the "
                    "vocab_size 320 of tiny-llama");

  // A checkpoint of the bundled text cannot be resumed on shards, nor the other way round.
  o.data_path = std::string(KILN_SOURCE_DIR) + "/data/tinyshakespeare.txt";
  o.max_steps = 1;
  pretrain(o, log);
  o.data_path = file("shards");
  o.resume = true;
  o.max_steps = 2;
  EXPECT_KILN_ERROR(pretrain(o, log), "other settings than asked: data ");
  o.allow_resume_changes = true;  // even then the loader has nothing to resume from
  EXPECT_KILN_ERROR(pretrain(o, log), "has no loader position");
  o.out_dir = file("on_shards");
  o.resume = false;
  o.max_steps = 1;
  pretrain(o, log);
  o.resume = true;
  o.max_steps = 2;
  o.data_path = std::string(KILN_SOURCE_DIR) + "/data/tinyshakespeare.txt";
  EXPECT_KILN_ERROR(pretrain(o, log), "was trained on token shards");
  o.allow_resume_changes = false;
}

TEST_F(PretrainShardsTest, ProgressBarOnATerminalKeepsTheLoggedLines) {
  std::ostringstream log;
  PretrainOptions o = options();
  o.max_steps = 4;
  o.progress_bar = true;
  pretrain(o, log);
  const std::string text = log.str();
  EXPECT_NE(text.find("\r\033[2Kstep 4/4 [########################] 100% | loss "),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("tok/s, mem "), std::string::npos);
  EXPECT_NE(text.find("| ETA "), std::string::npos);
  EXPECT_NE(text.find("step 2/4 | loss "), std::string::npos);
  EXPECT_NE(text.find("eval step 4 | val loss "), std::string::npos);
}

// SIGTERM (or SIGINT) mid-run: the run stops after its current step with a checkpoint of that
// step, and --resume goes on from it.
TEST_F(PretrainShardsTest, SigtermSavesACheckpointAndStops) {
  PretrainOptions o = options();
  o.max_steps = 1000;
  o.grad_accum_steps = 1;
  o.out_dir = file("run");
  std::atomic<bool> done{false};
  std::thread killer([&] {
    // Wait for two logged steps (no timing assumption), then signal the process.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (!done && std::chrono::steady_clock::now() < deadline) {
      const std::string lines = test::read_bytes(file("run/metrics.jsonl"));
      if (std::count(lines.begin(), lines.end(), '\n') >= 2) {
        ::kill(::getpid(), SIGTERM);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  std::ostringstream log;
  const auto s = pretrain(o, log);
  done = true;
  killer.join();
  EXPECT_EQ(s.stop_signal, SIGTERM);
  EXPECT_GE(s.steps, 2);
  EXPECT_LT(s.steps, 1000);
  const auto info = read_checkpoint_info(o.out_dir);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->step, s.steps);
  EXPECT_EQ(info->loader->position, static_cast<uint64_t>(s.steps * o.batch_size));
  EXPECT_NE(log.str().find("stopped by SIGTERM after step " + std::to_string(s.steps) +
                           "; continue with --resume"),
            std::string::npos)
      << log.str();
  o.resume = true;
  o.max_steps = s.steps + 1;
  const auto more = pretrain(o, log);
  EXPECT_EQ(more.start_step, s.steps);
  EXPECT_EQ(more.stop_signal, 0);
}

// The schedule is part of the run's state: a run of 4 steps (decaying over 4) resumed to 6 steps
// with lr_decay_steps 0 keeps decaying over 4, as a straight run told so; asking for another lr
// is an error unless allowed (models/trainer.h).
TEST_F(PretrainShardsTest, ResumeKeepsTheStoredSchedule) {
  std::ostringstream log;
  PretrainOptions o = options();
  o.grad_accum_steps = 1;
  o.out_dir = file("straight");
  o.lr_decay_steps = 4;
  const auto straight = pretrain(o, log);

  o.out_dir = file("resumed");
  o.lr_decay_steps = 0;  // = max_steps
  o.max_steps = 4;
  const auto first = pretrain(o, log);
  const auto info = read_checkpoint_info(o.out_dir);
  ASSERT_TRUE(info && info->schedule);
  EXPECT_EQ(info->schedule->lr_decay_steps, 4);
  EXPECT_EQ(info->schedule->warmup_steps, 2);
  EXPECT_EQ(info->schedule->lr, o.lr);
  o.max_steps = 6;
  o.resume = true;
  PretrainOptions other_lr = o;
  other_lr.lr = 1e-2;
  EXPECT_KILN_ERROR(pretrain(other_lr, log), "other settings than asked: lr 0.003 -> 0.01");
  const auto second = pretrain(o, log);
  std::vector<double> resumed = first.train_losses;
  resumed.insert(resumed.end(), second.train_losses.begin(), second.train_losses.end());
  EXPECT_EQ(resumed, straight.train_losses);
  // The metrics file holds the whole run once, lr included.
  const std::string jsonl = test::read_bytes(file("resumed/metrics.jsonl"));
  EXPECT_NE(jsonl.find("{\"step\": 6, \"loss\": "), std::string::npos) << jsonl;
  EXPECT_EQ(jsonl.find("{\"step\": 5, \"loss\": "), jsonl.rfind("{\"step\": 5, \"loss\": "));
}

// --save-every 1 --keep 2: the two newest checkpoints stay, each with its own state file; a
// temporary file of a killed save is removed at the next start.
TEST_F(PretrainShardsTest, KeepsTheNewestCheckpointsAndCleansTemporaries) {
  std::ostringstream log;
  PretrainOptions o = options();
  o.max_steps = 4;
  o.grad_accum_steps = 1;
  o.checkpoint_interval = 1;
  o.keep_checkpoints = 2;
  o.out_dir = file("run");
  fs::create_directories(dir() / "run");
  test::write_bytes(file("run/model-00000009.safetensors.tmp.123.abcdef"), "half a file");
  test::write_bytes(file("run/run.toml.tmp.123.abcdef"), "half a file");
  test::write_bytes(file("run/notes.txt.tmp.1"), "not ours");
  pretrain(o, log);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir() / "run")) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names,
            (std::vector<std::string>{
                "metrics.jsonl", "metrics.svg", "model-00000003.safetensors",
                "model-00000004.safetensors", "notes.txt.tmp.1", "optimizer-00000003.safetensors",
                "optimizer-00000004.safetensors", "run.toml", "trainer_state-00000003.json",
                "trainer_state-00000004.json", "trainer_state.json"}));
  EXPECT_EQ(test::read_bytes(file("run/trainer_state-00000004.json")),
            test::read_bytes(file("run/trainer_state.json")));
  // The older one resumes as well: its state file names its own files.
  fs::copy_file(file("run/trainer_state-00000003.json"), file("run/trainer_state.json"),
                fs::copy_options::overwrite_existing);
  EXPECT_EQ(read_checkpoint_info(file("run"))->step, 3);
  o.resume = true;
  o.keep_checkpoints = 1;
  const auto s = pretrain(o, log);
  EXPECT_EQ(s.start_step, 3);
  EXPECT_FALSE(fs::exists(file("run/model-00000003.safetensors")));  // keep 1: only step 4 now
  // Step 4 saved again: under the next generation's names (models/trainer_internal.h,
  // save_checkpoint), which the state names; the first save's files are gone.
  const auto info = read_checkpoint_info(file("run"));
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->step, 4);
  EXPECT_TRUE(fs::exists(dir() / "run" / info->model_file)) << info->model_file;
  EXPECT_TRUE(fs::exists(dir() / "run" / info->optimizer_file)) << info->optimizer_file;
  EXPECT_FALSE(fs::exists(file("run/model-00000004.safetensors")));
}

}  // namespace
}  // namespace kiln::models
