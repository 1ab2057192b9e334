// kiln::models::pretrain against bad values and bad files (issue 21, points 3, 6, 7, 9): a
// non-finite loss or weight never replaces a good checkpoint, skip_nonfinite skips the step, a
// resume with other settings is an error unless allowed, resuming at the last step says so,
// checkpoint tensors must have exactly the expected dtype and shape, the optimizer its buffers,
// trainer_state.json is range-checked, FIFOs and directories are reported, not read.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "autograd/grad_mode.h"
#include "models/trainer.h"
#include "nn/safetensors.h"
#include "tensor/ops.h"
#include "test_util.h"

#ifndef KILN_SOURCE_DIR
#error "KILN_SOURCE_DIR must point at the source tree (tests/CMakeLists.txt sets it)"
#endif

namespace kiln::models {
namespace {

namespace fs = std::filesystem;

const std::string kData = std::string(KILN_SOURCE_DIR) + "/data/tinyshakespeare.txt";

class TrainerHardeningTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("kiln_trainer_hardening_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  PretrainOptions options() const {
    PretrainOptions o;
    o.config_name = "tiny-llama";
    o.data_path = kData;
    o.batch_size = 2;
    o.seq_len = 16;
    o.max_steps = 4;
    o.lr = 3e-3;
    o.min_lr = 3e-4;
    o.warmup_steps = 1;
    o.log_interval = 1;
    o.eval_interval = 0;
    o.eval_batches = 1;
    o.device = Device(kCPU);
    o.seed = 5;
    o.progress_bar = false;
    o.out_dir = (dir_ / "run").string();
    return o;
  }
  std::string file(const std::string& name) const { return (dir_ / name).string(); }
  std::string run_file(const std::string& name) const { return (dir_ / "run" / name).string(); }

  fs::path dir_;
};

// The message of the kiln::Error `f` throws ("" if none).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string test_read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Sets the named parameter to `value` everywhere (a fault injected between steps).
void fill_parameter(GPT& model, const std::string& name, double value) {
  NoGradGuard no_grad;
  for (const auto& item : model->named_parameters()) {
    if (item.key() == name) item.value().fill_(value);
  }
}

bool all_finite(const TensorMap& tensors) {
  for (const auto& [name, t] : tensors) {
    if (!std::isfinite((t.to(kFloat64) * 0.0).sum().item<double>())) return false;
  }
  return true;
}

// --- Point 3: non-finite values --------------------------------------------------------------

// A NaN loss at step 3 (the final norm poisoned before it) stops the run naming the step; the
// checkpoint of step 2 stays the newest, and loads.
TEST_F(TrainerHardeningTest, NonFiniteLossStopsAndKeepsTheLastCheckpoint) {
  std::ostringstream log;
  PretrainOptions o = options();
  o.checkpoint_interval = 2;
  o.before_step = [](int64_t step, GPT& model) {
    if (step == 3) fill_parameter(model, "transformer.ln_f.weight", std::nan(""));
  };
  const std::string message = error_of([&] { pretrain(o, log); });
  EXPECT_NE(message.find("[pretrain] step 3: the loss is nan and the gradient norm nan (not "
                         "finite); stopped before saving: the last checkpoint in " +
                         o.out_dir + " (step 2) is kept"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("--skip-nonfinite"), std::string::npos) << message;
  EXPECT_EQ(read_checkpoint_info(o.out_dir)->step, 2);
  EXPECT_TRUE(all_finite(load_safetensors(run_file("model-00000002.safetensors"))));
  EXPECT_FALSE(fs::exists(run_file("model-00000003.safetensors")));
}

// An lr that overflows the update leaves the loss and the gradient finite but the weights
// infinite: the save checks them, and the checkpoint of step 2 stays (it was replaced before).
TEST_F(TrainerHardeningTest, NonFiniteWeightsAreNeverSaved) {
  std::ostringstream log;
  PretrainOptions o = options();
  o.max_steps = 2;
  pretrain(o, log);
  o.resume = true;
  o.allow_resume_changes = true;
  o.max_steps = 3;
  o.lr = o.min_lr = 1e39;  // finite as a double, infinite in the f32 update
  const std::string message = error_of([&] { pretrain(o, log); });
  EXPECT_NE(message.find("[pretrain] step 3: the weights are not finite after the update ("),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("the last checkpoint in " + o.out_dir + " (step 2) is kept"),
            std::string::npos)
      << message;
  EXPECT_EQ(read_checkpoint_info(o.out_dir)->step, 2);
  EXPECT_TRUE(all_finite(load_safetensors(run_file("model-00000002.safetensors"))));
}

// With skip_nonfinite the poisoned step 3 is skipped (no update: the optimizer counts one step
// fewer), the run goes on once the fault is gone, and its checkpoint is finite. Compiled, the
// same steps are skipped and the same losses come out.
TEST_F(TrainerHardeningTest, SkipNonFiniteSkipsTheStep) {
  std::vector<double> eager_losses;
  for (const bool compiled : {false, true}) {
    std::ostringstream log;
    PretrainOptions o = options();
    o.max_steps = 5;
    o.skip_nonfinite = true;
    o.compile = compiled;
    o.out_dir = file(compiled ? "compiled" : "eager");
    Tensor saved;
    o.before_step = [&saved](int64_t step, GPT& model) {
      NoGradGuard no_grad;
      for (const auto& item : model->named_parameters()) {
        if (item.key() != "transformer.ln_f.weight") continue;
        if (step == 3) {
          saved = item.value().clone();
          item.value().fill_(std::numeric_limits<double>::infinity());
        } else if (step == 4) {
          item.value().copy_(saved);  // the fault was transient
        }
      }
    };
    const PretrainSummary s = pretrain(o, log);
    EXPECT_EQ(s.steps, 5);
    EXPECT_EQ(s.skipped_steps, std::vector<int64_t>{3});
    ASSERT_EQ(s.train_losses.size(), 5u);
    for (size_t i = 0; i < 5; ++i) EXPECT_EQ(std::isfinite(s.train_losses[i]), i != 2) << i;
    EXPECT_NE(log.str().find("step 3 skipped: loss "), std::string::npos) << log.str();
    const auto info = read_checkpoint_info(o.out_dir);
    ASSERT_TRUE(info.has_value());
    EXPECT_EQ(info->step, 5);
    EXPECT_TRUE(all_finite(load_safetensors(o.out_dir + "/" + info->model_file)));
    SafetensorsMetadata meta;
    load_safetensors(o.out_dir + "/" + info->optimizer_file, &meta);
    EXPECT_EQ(meta.at("state.0.step"), "4");  // 5 steps, one skipped
    if (compiled) {
      EXPECT_EQ(s.train_losses[0], eager_losses[0]);
      for (size_t i = 0; i < 5; ++i) {
        if (i != 2) {
          EXPECT_EQ(s.train_losses[i], eager_losses[i]) << "step " << i + 1;
        }
      }
    } else {
      eager_losses = s.train_losses;
    }
  }
}

// Options no run can use fail in validate(), naming the option and the value.
TEST_F(TrainerHardeningTest, OptionsWithImpossibleValues) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  PretrainOptions o = options();
  o.lr = o.min_lr = inf;  // min_lr <= lr held, so lr > 0 alone let it through
  EXPECT_KILN_ERROR(o.validate(), "need 0 <= min_lr <= lr and lr > 0 (finite), got lr inf");
  o = options();
  o.lr = nan;
  EXPECT_KILN_ERROR(o.validate(), "got lr nan");
  o = options();
  o.weight_decay = nan;
  EXPECT_KILN_ERROR(o.validate(), "weight_decay must be finite and >= 0, got nan");
  o = options();
  o.grad_clip = inf;
  EXPECT_KILN_ERROR(o.validate(), "grad_clip must be finite and >= 0 (0 = off), got inf");
  o = options();
  o.batch_size = int64_t{1} << 40;
  o.seq_len = int64_t{1} << 30;
  EXPECT_KILN_ERROR(o.validate(),
                    "batch_size 1099511627776 x seq_len 1073741824 x "
                    "grad_accum_steps 1 tokens per step overflows int64");
  o = options();
  o.batch_size = int64_t{1} << 31;
  o.seq_len = int64_t{1} << 31;
  o.grad_accum_steps = 4;
  EXPECT_KILN_ERROR(o.validate(), "tokens per step overflows int64");
}

// --- Point 7: resume ---------------------------------------------------------------------------

TEST_F(TrainerHardeningTest, ResumeWithOtherSettingsIsAnErrorUnlessAllowed) {
  std::ostringstream log;
  PretrainOptions o = options();
  o.max_steps = 2;
  o.lr_decay_steps = 6;
  pretrain(o, log);
  o.resume = true;
  o.max_steps = 3;
  o.lr_decay_steps = 0;  // the stored schedule's length
  PretrainOptions bad = o;
  bad.seed = 6;
  bad.batch_size = 3;
  bad.lr = 1e-2;
  const std::string message = error_of([&] { pretrain(bad, log); });
  EXPECT_NE(message.find("[pretrain] resume: the checkpoint in " + o.out_dir +
                         " (step 2) was trained with other settings than asked: batch_size 2 -> "
                         "3, seed 5 -> 6, lr 0.003 -> 0.01"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("--allow-resume-changes"), std::string::npos) << message;
  for (const auto& [field, expected] :
       {std::pair{0, "data "}, std::pair{1, "seq_len 16 -> 8"},
        std::pair{2, "grad_accum_steps 1 -> 2"}, std::pair{3, "lr_decay_steps 6 -> 9"},
        std::pair{4, "min_lr 0.0003 -> 0.0001"}}) {
    bad = o;
    if (field == 0) bad.data_path = std::string(KILN_SOURCE_DIR) + "/README.md";
    if (field == 1) bad.seq_len = 8;
    if (field == 2) bad.grad_accum_steps = 2;
    if (field == 3) bad.lr_decay_steps = 9;
    if (field == 4) bad.min_lr = 1e-4;
    EXPECT_KILN_ERROR(pretrain(bad, log), expected);
  }
  EXPECT_EQ(read_checkpoint_info(o.out_dir)->step, 2);  // nothing ran
  // Allowed: the options win, and a line lists the changes.
  bad = o;
  bad.lr = 1e-2;
  bad.allow_resume_changes = true;
  const PretrainSummary s = pretrain(bad, log);
  EXPECT_EQ(s.start_step, 2);
  EXPECT_EQ(s.steps, 3);
  EXPECT_NE(log.str().find("resume with changes (allowed): lr 0.003 -> 0.01"), std::string::npos)
      << log.str();
  EXPECT_EQ(read_checkpoint_info(o.out_dir)->schedule->lr, 1e-2);
}

TEST_F(TrainerHardeningTest, ResumingAtOrPastTheLastStepSaysSo) {
  std::ostringstream log;
  PretrainOptions o = options();
  o.max_steps = 3;
  pretrain(o, log);
  const std::string state = test_read(run_file("trainer_state.json"));
  o.resume = true;
  for (const int64_t steps : {3, 2}) {
    o.max_steps = steps;
    o.lr_decay_steps = 3;
    std::ostringstream out;
    const PretrainSummary s = pretrain(o, out);
    EXPECT_EQ(s.start_step, 3);
    EXPECT_EQ(s.steps, 3);
    EXPECT_TRUE(s.train_losses.empty());
    EXPECT_NE(out.str().find("the checkpoint in " + o.out_dir + " is at step 3, " +
                             (steps == 3 ? "the last step" : "past the last step") +
                             " (max_steps " + std::to_string(steps) + "): nothing to train"),
              std::string::npos)
        << out.str();
    EXPECT_EQ(test_read(run_file("trainer_state.json")), state);  // nothing written
  }
}

// --- Point 6: loaders validate -----------------------------------------------------------------

// Saves the run's checkpoint files after `edit` changed their tensors.
void rewrite(const std::string& path, const std::function<void(TensorMap&)>& edit) {
  SafetensorsMetadata meta;
  TensorMap tensors;
  for (const auto& [name, t] : load_safetensors(path, &meta)) tensors[name] = t.clone();
  edit(tensors);
  save_safetensors(tensors, path, meta);
}

TEST_F(TrainerHardeningTest, CheckpointTensorsMustHaveTheExpectedDtypeAndShape) {
  std::ostringstream log;
  PretrainOptions o = options();
  o.max_steps = 1;
  pretrain(o, log);
  const std::string model = run_file("model-00000001.safetensors");
  const std::string optimizer = run_file("optimizer-00000001.safetensors");
  const std::string model_backup = file("model.bak");
  const std::string optimizer_backup = file("optimizer.bak");
  fs::copy_file(model, model_backup);
  fs::copy_file(optimizer, optimizer_backup);
  auto restore = [&] {
    fs::copy_file(model_backup, model, fs::copy_options::overwrite_existing);
    fs::copy_file(optimizer_backup, optimizer, fs::copy_options::overwrite_existing);
  };
  const std::string w = "transformer.ln_f.weight";
  // I32 where F32 is expected: kiln::load converted it silently.
  rewrite(model, [&](TensorMap& t) { t[w] = t[w].to(kInt32); });
  EXPECT_KILN_ERROR(load_checkpoint(o.out_dir, kCPU), "[checkpoint] " + model + ": tensor \"" + w +
                                                          "\" is I32 [64], expected F32 [64]");
  rewrite(model, [&](TensorMap& t) { t[w] = t[w].to(kFloat).reshape({8, 8}); });
  EXPECT_KILN_ERROR(load_checkpoint(o.out_dir, kCPU), "is F32 [8, 8], expected F32 [64]");
  rewrite(model, [&](TensorMap& t) { t.erase(w); });
  EXPECT_KILN_ERROR(load_checkpoint(o.out_dir, kCPU),
                    "no tensor \"" + w + "\" (expected F32 [64])");
  restore();
  rewrite(model, [&](TensorMap& t) { t["extra"] = zeros({2}); });
  EXPECT_KILN_ERROR(load_checkpoint(o.out_dir, kCPU), "unexpected tensor \"extra\"");
  restore();
  // The optimizer: an exact dtype, every buffer, no unknown one.
  o.resume = true;
  o.max_steps = 2;
  rewrite(optimizer,
          [](TensorMap& t) { t["state.0.exp_avg"] = t["state.0.exp_avg"].to(kBFloat16); });
  EXPECT_KILN_ERROR(pretrain(o, log),
                    "[checkpoint] " + optimizer + ": tensor \"state.0.exp_avg\" is BF16");
  restore();
  rewrite(optimizer, [](TensorMap& t) { t.erase("state.0.exp_avg_sq"); });
  EXPECT_KILN_ERROR(pretrain(o, log), "the checkpoint has no \"state.0.exp_avg_sq\"");
  restore();
  rewrite(optimizer, [](TensorMap& t) { t["state.0.max_exp_avg_sq"] = t["state.0.exp_avg"]; });
  EXPECT_KILN_ERROR(pretrain(o, log), "unexpected tensor \"state.0.max_exp_avg_sq\"");
  rewrite(optimizer, [](TensorMap& t) { t["state.99999.exp_avg"] = zeros({1}); });
  EXPECT_KILN_ERROR(pretrain(o, log), "unexpected tensor \"state.99999.exp_avg\"");
  restore();
  EXPECT_EQ(pretrain(o, log).steps, 2);  // the untouched files resume
}

// trainer_state.json: duplicate keys, numbers out of range, an unknown precision.
TEST_F(TrainerHardeningTest, StateFileFieldsAreRangeChecked) {
  const std::string dir = file("state");
  fs::create_directories(dir);
  const std::string head = R"({"config": "tiny-llama", "model": "m", "optimizer": "o", )";
  for (const auto& [body, message] :
       {std::pair{R"("step": 1, "step": 2, "precision": "f32"})", "duplicate key \"step\""},
        std::pair{R"("step": 1099511627777, "precision": "f32"})", "bad step 1099511627777"},
        std::pair{R"("step": 1, "precision": "fp8"})", "unknown precision \"fp8\""},
        std::pair{R"("step": 1, "precision": "f32", "seq_len": 0})", "bad seq_len 0"},
        std::pair{R"("step": 1, "precision": "f32", "batch_size": -4})", "bad batch_size -4"},
        std::pair{
            R"("step": 1, "precision": "f32", "batch_size": 4294967296, "seq_len": 4294967296})",
            "bad batch_size 4294967296"},
        std::pair{R"("step": 1, "precision": "f32", "schedule": {"lr": 1, "lr": 2}})",
                  "duplicate key \"lr\""}}) {
    write_file_atomically(dir + "/trainer_state.json", head + body);
    EXPECT_KILN_ERROR(read_checkpoint_info(dir), message);
  }
}

// A FIFO or a directory where a checkpoint file or the data should be: an error, not a hang.
TEST_F(TrainerHardeningTest, OnlyRegularFilesAreOpened) {
  std::ostringstream log;
  PretrainOptions o = options();
  o.max_steps = 1;
  pretrain(o, log);
  const std::string model = run_file("model-00000001.safetensors");
  fs::remove(model);
  ASSERT_EQ(::mkfifo(model.c_str(), 0600), 0);
  EXPECT_KILN_ERROR(load_checkpoint(o.out_dir, kCPU),
                    "[checkpoint] " + model + ": is a FIFO, not a regular file");
  fs::remove(model);
  fs::create_directories(model);
  EXPECT_KILN_ERROR(load_checkpoint(o.out_dir, kCPU),
                    "[checkpoint] " + model + ": is a directory, not a file");
  // ... and a file where the checkpoint directory should be.
  EXPECT_KILN_ERROR(load_checkpoint(run_file("trainer_state.json"), kCPU),
                    "trainer_state.json: is a file, not a checkpoint directory");
  const std::string state = file("fifo_state");
  fs::create_directories(state);
  ASSERT_EQ(::mkfifo((state + "/trainer_state.json").c_str(), 0600), 0);
  EXPECT_KILN_ERROR(read_checkpoint_info(state), "trainer_state.json: is a FIFO");
  // The data: a FIFO, a directory without shards.
  o = options();
  o.out_dir.clear();
  o.data_path = file("data_fifo");
  ASSERT_EQ(::mkfifo(o.data_path.c_str(), 0600), 0);
  EXPECT_KILN_ERROR(pretrain(o, log), "[pretrain] data " + o.data_path + ": is a FIFO");
  o.data_path = file("data_dir");
  fs::create_directories(o.data_path);
  std::ofstream(o.data_path + "/notes.txt") << "text";
  EXPECT_KILN_ERROR(pretrain(o, log),
                    "[pretrain] data " + o.data_path + ": is a directory without token shards");
}

}  // namespace
}  // namespace kiln::models
