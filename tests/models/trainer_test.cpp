// kiln::models::pretrain on the bundled corpus with a toy config: the loss falls; a checkpoint
// resumed continues bit-exactly as an uninterrupted run; bf16-true; checkpoints load back for
// generation; errors.
#include "models/trainer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "autograd/grad_mode.h"
#include "kernels/cuda.h"
#include "models/generate.h"
#include "nn/safetensors.h"
#include "tensor/deterministic.h"
#include "tensor/ops.h"
#include "test_util.h"

#ifndef KILN_SOURCE_DIR
#error "KILN_SOURCE_DIR must point at the source tree (tests/CMakeLists.txt sets it)"
#endif

namespace kiln::models {
namespace {

namespace fs = std::filesystem;

const std::string kData = std::string(KILN_SOURCE_DIR) + "/data/tinyshakespeare.txt";

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("kiln_trainer_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static PretrainOptions tiny_options() {
    PretrainOptions o;
    o.config_name = "tiny-llama";
    o.data_path = kData;
    o.batch_size = 4;
    o.seq_len = 32;
    o.max_steps = 25;
    o.lr = 3e-3;
    o.min_lr = 3e-4;
    o.warmup_steps = 3;
    o.log_interval = 5;
    o.eval_interval = 0;
    o.eval_batches = 2;
    o.device = Device(kCPU);
    o.seed = 7;
    return o;
  }
  fs::path dir_;
};

TEST_F(TrainerTest, LossFallsOnTheBundledText) {
  std::ostringstream log;
  const auto s = pretrain(tiny_options(), log);
  ASSERT_EQ(s.train_losses.size(), 25u);
  EXPECT_EQ(s.steps, 25);
  // From ln(320) ~ 5.77 at random init to well below: byte statistics are learned fast.
  EXPECT_NEAR(s.train_losses.front(), std::log(320.0), 0.6);
  double last5 = 0;
  for (size_t i = 20; i < 25; ++i) last5 += s.train_losses[i] / 5;
  EXPECT_LT(last5, s.train_losses.front() - 1.5) << log.str();
  EXPECT_LT(s.final_val_loss, s.train_losses.front() - 1.5);
  EXPECT_GT(s.tokens_per_s, 0);
  EXPECT_FALSE(s.mfu.has_value());  // CPU: no MFU
  const std::string text = log.str();
  EXPECT_NE(text.find("step 5/25 | loss "), std::string::npos) << text;
  EXPECT_NE(text.find("| grad norm "), std::string::npos);
  EXPECT_NE(text.find("tok/s"), std::string::npos);
  EXPECT_NE(text.find("eval step 25 | val loss "), std::string::npos);
  EXPECT_EQ(text.find("MFU"), std::string::npos);
}

TEST_F(TrainerTest, ResumeContinuesBitExactly) {
  std::ostringstream log;
  PretrainOptions o = tiny_options();
  o.max_steps = 6;
  o.grad_accum_steps = 2;  // the micro-batch indices must continue too
  o.out_dir = (dir_ / "straight").string();
  const auto straight = pretrain(o, log);

  o.out_dir = (dir_ / "resumed").string();
  o.max_steps = 3;
  o.lr_decay_steps = 6;       // the same schedule as the straight run
  o.checkpoint_interval = 2;  // an older checkpoint is replaced
  const auto first = pretrain(o, log);
  EXPECT_EQ(read_checkpoint_info(o.out_dir)->step, 3);
  o.max_steps = 6;
  o.resume = true;
  const auto second = pretrain(o, log);
  EXPECT_EQ(second.start_step, 3);
  EXPECT_NE(log.str().find("resumed from"), std::string::npos);

  std::vector<double> resumed = first.train_losses;
  resumed.insert(resumed.end(), second.train_losses.begin(), second.train_losses.end());
  ASSERT_EQ(resumed.size(), straight.train_losses.size());
  for (size_t i = 0; i < resumed.size(); ++i) {
    EXPECT_EQ(resumed[i], straight.train_losses[i]) << "step " << i + 1;
  }
  EXPECT_EQ(second.final_val_loss, straight.final_val_loss);
  // The final weights and optimizer state are identical bit for bit.
  const auto a = read_checkpoint_info((dir_ / "straight").string());
  const auto b = read_checkpoint_info((dir_ / "resumed").string());
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->step, 6);
  EXPECT_EQ(b->step, 6);
  for (const auto& [file_a, file_b] :
       {std::pair{a->model_file, b->model_file}, std::pair{a->optimizer_file, b->optimizer_file}}) {
    const TensorMap ma = load_safetensors((dir_ / "straight" / file_a).string());
    const TensorMap mb = load_safetensors((dir_ / "resumed" / file_b).string());
    ASSERT_EQ(ma.size(), mb.size());
    for (const auto& [name, t] : ma) {
      ASSERT_TRUE(mb.contains(name)) << name;
      EXPECT_TRUE(equal(t, mb.at(name))) << name;
    }
  }
  // Only the latest checkpoint's files are kept.
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir_ / "resumed")) {
    // metrics.jsonl and .svg (pretrain/metrics.h) and run.toml (models/run_config.h) stay.
    files += entry.path().stem() != "metrics" && entry.path().filename() != "run.toml";
  }
  EXPECT_EQ(files, 3);
}

TEST_F(TrainerTest, CheckpointLoadsForGeneration) {
  std::ostringstream log;
  PretrainOptions o = tiny_options();
  o.max_steps = 2;
  o.out_dir = dir_.string();
  pretrain(o, log);
  GPT model = load_checkpoint(dir_.string(), kCPU);
  const TensorMap saved =
      load_safetensors((dir_ / read_checkpoint_info(dir_.string())->model_file).string());
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(equal(item.value(), saved.at(item.key()))) << item.key();
  }
  GenerateOptions g;
  g.max_new_tokens = 5;
  g.temperature = 0;
  EXPECT_EQ(generate(model, {84, 111}, g).size(), 7u);
}

TEST_F(TrainerTest, Bf16True) {
  std::ostringstream log;
  PretrainOptions o = tiny_options();
  o.max_steps = 8;
  o.precision = "bf16-true";
  o.out_dir = dir_.string();
  const auto s = pretrain(o, log);
  for (double l : s.train_losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_LT(s.train_losses.back(), s.train_losses.front());
  GPT model = load_checkpoint(dir_.string(), kCPU);
  EXPECT_EQ(model->parameters().front().dtype(), kBFloat16);
  // AdamW keeps f32 state for bf16 parameters.
  const TensorMap opt =
      load_safetensors((dir_ / read_checkpoint_info(dir_.string())->optimizer_file).string());
  ASSERT_FALSE(opt.empty());
  for (const auto& [name, t] : opt) EXPECT_EQ(t.dtype(), kFloat) << name;
}

// bf16-mixed: f32 master weights, the matmuls in bf16 under autocast; the loss falls and tracks
// the f32 run's (bf16 rounding of the matmul operands only).
TEST_F(TrainerTest, Bf16Mixed) {
  std::ostringstream log;
  PretrainOptions o = tiny_options();
  o.max_steps = 8;
  const auto f32 = pretrain(o, log);
  o.precision = "bf16-mixed";
  o.out_dir = dir_.string();
  const auto mixed = pretrain(o, log);
  ASSERT_EQ(mixed.train_losses.size(), f32.train_losses.size());
  for (size_t i = 0; i < mixed.train_losses.size(); ++i) {
    EXPECT_NEAR(mixed.train_losses[i], f32.train_losses[i], 0.05) << "step " << i + 1;
  }
  EXPECT_LT(mixed.train_losses.back(), mixed.train_losses.front());
  GPT model = load_checkpoint(dir_.string(), kCPU);
  EXPECT_EQ(model->parameters().front().dtype(), kFloat);
}

// --compile: the training step (two micro-batches, clipping, AdamW, the lr schedule) through
// kiln::compile gives the eager run's losses, norms and weights bit for bit: the compiled
// program replays the same kernels. Steps 1 and 2 trace (step 1 creates AdamW's state), the
// rest replay; the lr and the step counts are tensors that the replays read.
TEST_F(TrainerTest, CompiledStepGivesTheEagerLosses) {
  for (const std::string precision : {"f32", "bf16-true", "bf16-mixed"}) {
    SCOPED_TRACE(precision);
    std::ostringstream eager_log, compiled_log;
    PretrainOptions o = tiny_options();
    o.max_steps = 6;
    o.grad_accum_steps = 2;
    o.log_interval = 1;
    o.precision = precision;
    o.out_dir = (dir_ / ("eager_" + precision)).string();
    const auto eager = pretrain(o, eager_log);
    o.compile = true;
    o.out_dir = (dir_ / ("compiled_" + precision)).string();
    const auto compiled = pretrain(o, compiled_log);
    ASSERT_EQ(compiled.train_losses.size(), eager.train_losses.size());
    for (size_t i = 0; i < eager.train_losses.size(); ++i) {
      EXPECT_EQ(compiled.train_losses[i], eager.train_losses[i]) << "step " << i + 1;
    }
    EXPECT_EQ(compiled.final_val_loss, eager.final_val_loss);
    EXPECT_EQ(compiled.compile_traces, 2);
    EXPECT_EQ(compiled.compile_replays, 4);
    EXPECT_EQ(eager.compile_traces, 0);
    // The logged lines (loss, lr, grad norm) agree up to the throughput.
    auto strip = [](const std::string& text) {
      std::string out;
      std::istringstream in(text);
      for (std::string line; std::getline(in, line);) {
        if (line.rfind("step ", 0) == 0) out += line.substr(0, line.rfind(" | ")) + "\n";
      }
      return out;
    };
    EXPECT_EQ(strip(compiled_log.str()), strip(eager_log.str()));
    EXPECT_NE(compiled_log.str().find("compile: 2 traces, 4 replays"), std::string::npos)
        << compiled_log.str();
    const TensorMap a = load_safetensors(
        (dir_ / ("eager_" + precision) / read_checkpoint_info(o.out_dir)->model_file).string());
    const TensorMap b = load_safetensors(
        (fs::path(o.out_dir) / read_checkpoint_info(o.out_dir)->model_file).string());
    for (const auto& [name, t] : a) EXPECT_TRUE(equal(t, b.at(name))) << name;
  }
}

// The step folds clipping into AdamW's update (step_with_grad_factor) when the update follows at
// once; with skip_nonfinite the update runs after the values are read, on gradients clipped in
// place (foreach_mul_). Both give the same bits: losses, logged gradient norms, final weights,
// eager and compiled. A small grad_clip makes every step clip.
TEST_F(TrainerTest, ClippingFoldedIntoTheUpdateGivesTheInPlaceBits) {
  for (const std::string precision : {"f32", "bf16-true"}) {
    SCOPED_TRACE(precision);
    PretrainOptions o = tiny_options();
    o.max_steps = 5;
    o.grad_accum_steps = 2;
    o.log_interval = 1;
    o.grad_clip = 0.05;
    o.precision = precision;
    auto run = [&](const std::string& name, bool in_place, bool compiled) {
      PretrainOptions r = o;
      r.skip_nonfinite = in_place;
      r.compile = compiled;
      r.out_dir = (dir_ / (name + "_" + precision)).string();
      std::ostringstream log;
      const auto summary = pretrain(r, log);
      std::string steps;  // the logged lines up to the throughput
      std::istringstream in(log.str());
      for (std::string line; std::getline(in, line);) {
        if (line.rfind("step ", 0) == 0) steps += line.substr(0, line.rfind(" | ")) + "\n";
      }
      const TensorMap model = load_safetensors(
          (fs::path(r.out_dir) / read_checkpoint_info(r.out_dir)->model_file).string());
      return std::make_tuple(summary.train_losses, steps, model);
    };
    const auto [in_place_losses, in_place_log, in_place_model] = run("in_place", true, false);
    for (bool compiled : {false, true}) {
      SCOPED_TRACE(compiled ? "compiled" : "eager");
      const auto [losses, log, model] = run(compiled ? "compiled" : "folded", false, compiled);
      ASSERT_EQ(losses.size(), in_place_losses.size());
      for (size_t i = 0; i < losses.size(); ++i) {
        EXPECT_EQ(losses[i], in_place_losses[i]) << "step " << i + 1;
      }
      EXPECT_EQ(log, in_place_log);
      for (const auto& [name, t] : in_place_model) EXPECT_TRUE(equal(t, model.at(name))) << name;
    }
  }
}

TEST_F(TrainerTest, Errors) {
  std::ostringstream log;
  PretrainOptions o = tiny_options();
  o.data_path = (dir_ / "nope.txt").string();
  EXPECT_KILN_ERROR(pretrain(o, log), "cannot open the file");
  o = tiny_options();
  o.precision = "fp8";
  EXPECT_KILN_ERROR(pretrain(o, log), "precision must be f32, bf16-true or bf16-mixed");
  o = tiny_options();
  o.seq_len = 129;
  EXPECT_KILN_ERROR(pretrain(o, log), "seq_len 129 exceeds the block_size 128");
  o = tiny_options();
  o.config_name = "no-such-model";
  EXPECT_KILN_ERROR(pretrain(o, log), "no-such-model");
  o = tiny_options();
  o.resume = true;
  EXPECT_KILN_ERROR(pretrain(o, log), "resume needs out_dir");
  o = tiny_options();
  o.lr = 0;
  EXPECT_KILN_ERROR(pretrain(o, log), "lr > 0");
  // Resuming a checkpoint of another config.
  o = tiny_options();
  o.max_steps = 1;
  o.out_dir = dir_.string();
  pretrain(o, log);
  o.config_name = "tiny-mistral";
  o.resume = true;
  o.max_steps = 2;
  EXPECT_KILN_ERROR(pretrain(o, log), "is of config tiny-llama, not tiny-mistral");
  EXPECT_KILN_ERROR(load_checkpoint((dir_ / "missing").string(), kCPU), "trainer_state.json");
  // Damaged trainer_state.json files: a missing field, a negative step, not JSON.
  const std::filesystem::path bad = dir_ / "bad";
  std::filesystem::create_directories(bad);
  for (const auto& [text, message] :
       {std::pair{R"({"config": "tiny-llama", "precision": "f32", "model": "m", "optimizer": "o"})",
                  R"(no "step" field)"},
        std::pair{
            R"({"config": "x", "step": -1, "precision": "f32", "model": "m", "optimizer": "o"})",
            "bad step -1"},
        std::pair{"{\"config\": ", "trainer_state.json: "}}) {
    write_file_atomically((bad / "trainer_state.json").string(), text);
    EXPECT_KILN_ERROR(read_checkpoint_info(bad.string()), message);
  }
  // A text with bytes beyond a small vocabulary.
  ModelConfig small = ModelConfig::from_name("tiny-llama");
  small.name = "tiny-vocab-64";
  small.vocab_size = small.padded_vocab_size = 64;
  o = tiny_options();
  o.config = small;
  EXPECT_KILN_ERROR(pretrain(o, log), "outside the vocabulary of tiny-vocab-64");
}

// On the GPU: the same run as on the CPU (same init, same batches) gives the same losses up to
// f32 rounding (and TF32 matmuls, if used); MFU is logged; bf16-true trains; bench reports
// MFU and peak memory.
// Suites named Gpu* are labelled gpu (tests/CMakeLists.txt).
class GpuTrainerTest : public TrainerTest {};

TEST_F(GpuTrainerTest, PretrainMatchesCpu) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  std::ostringstream cpu_log, gpu_log;
  PretrainOptions o = tiny_options();
  o.max_steps = 5;
  const auto cpu = pretrain(o, cpu_log);
  o.device = Device(kCUDA);
  o.out_dir = dir_.string();
  const auto gpu = pretrain(o, gpu_log);
  ASSERT_EQ(gpu.train_losses.size(), cpu.train_losses.size());
  for (size_t i = 0; i < cpu.train_losses.size(); ++i) {
    EXPECT_NEAR(gpu.train_losses[i], cpu.train_losses[i], 2e-2) << "step " << i + 1;
  }
  EXPECT_NEAR(gpu.final_val_loss, cpu.final_val_loss, 2e-2);
  ASSERT_TRUE(gpu.mfu.has_value());
  EXPECT_GT(*gpu.mfu, 0.0);
  EXPECT_NE(gpu_log.str().find(", MFU "), std::string::npos) << gpu_log.str();
  // The checkpoint written from the GPU loads on the CPU.
  GPT back = load_checkpoint(dir_.string(), kCPU);
  EXPECT_TRUE(back->parameters().front().is_cpu());
}

// Issue 20: --resume on CUDA continues bit-exactly (bf16-true, with gradient accumulation): the
// resumed run's losses and final model and optimizer files equal an uninterrupted run's. Two
// uninterrupted runs are compared first, so that a kernel that is not deterministic is named as
// such rather than as a resume bug.
// Two uninterrupted runs of `o` (bf16-true on CUDA, 6 steps) are equal, and a run of 3 steps
// resumed to 6 equals them: losses, model and optimizer files bit for bit.
void expect_bit_exact_resume(PretrainOptions o, const std::filesystem::path& dir) {
  std::ostringstream log;
  auto files_of = [&](const std::string& name) {
    const auto info = read_checkpoint_info((dir / name).string());
    EXPECT_TRUE(info.has_value()) << name;
    return std::pair{load_safetensors((dir / name / info->model_file).string()),
                     load_safetensors((dir / name / info->optimizer_file).string())};
  };
  auto expect_same = [&](const std::string& a, const std::string& b) {
    const auto [ma, oa] = files_of(a);
    const auto [mb, ob] = files_of(b);
    for (const auto* pair : {&ma, &oa}) {
      const TensorMap& other = pair == &ma ? mb : ob;
      ASSERT_EQ(pair->size(), other.size());
      for (const auto& [name, t] : *pair) {
        ASSERT_TRUE(other.contains(name)) << name;
        EXPECT_TRUE(equal(t, other.at(name))) << a << " vs " << b << ": " << name;
      }
    }
  };
  o.max_steps = 6;
  o.out_dir = (dir / "straight").string();
  const auto straight = pretrain(o, log);
  o.out_dir = (dir / "again").string();
  const auto again = pretrain(o, log);
  ASSERT_EQ(again.train_losses, straight.train_losses) << "the CUDA step is not deterministic";
  expect_same("straight", "again");

  o.out_dir = (dir / "resumed").string();
  o.max_steps = 3;
  o.lr_decay_steps = 6;
  const auto first = pretrain(o, log);
  o.max_steps = 6;
  o.resume = true;
  const auto second = pretrain(o, log);
  std::vector<double> resumed = first.train_losses;
  resumed.insert(resumed.end(), second.train_losses.begin(), second.train_losses.end());
  EXPECT_EQ(resumed, straight.train_losses);
  expect_same("straight", "resumed");
}

// Issue 20: --resume on CUDA continues bit-exactly (bf16-true, with gradient accumulation): the
// resumed run's losses and final model and optimizer files equal an uninterrupted run's. Two
// uninterrupted runs are compared first, so that a kernel that is not deterministic is named as
// such rather than as a resume bug. The tiny model's head size (16) runs attention unfused.
TEST_F(GpuTrainerTest, ResumeContinuesBitExactlyOnCuda) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  PretrainOptions o = tiny_options();
  o.device = Device(kCUDA);
  o.precision = "bf16-true";
  o.grad_accum_steps = 2;
  expect_bit_exact_resume(o, dir_);
}

// The same with attention on its CUDA kernels (head size 64, 256 tokens: several key blocks add
// into each dQ row), which needs deterministic algorithms (--deterministic): the attention
// backward then runs its decomposition.
TEST_F(GpuTrainerTest, DeterministicResumeWithCudaAttention) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  PretrainOptions o = tiny_options();
  ModelConfig c = ModelConfig::from_name("tiny-llama");
  c.name = "tiny-llama-hs64";
  c.n_embd = 128;
  c.n_head = 2;
  c.n_query_groups = 1;
  c.head_size = 64;
  c.block_size = 256;
  register_config(c, /*replace=*/true);
  o.config_name = c.name;
  o.seq_len = 256;
  o.device = Device(kCUDA);
  o.precision = "bf16-true";
  o.deterministic = true;
  expect_bit_exact_resume(o, dir_);
  EXPECT_FALSE(are_deterministic_algorithms_enabled()) << "the run restores the mode";
}

TEST_F(GpuTrainerTest, Bf16TrueAndBench) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  std::ostringstream log;
  PretrainOptions o = tiny_options();
  o.max_steps = 10;
  o.precision = "bf16-true";
  o.device = Device(kCUDA);
  const auto s = pretrain(o, log);
  for (double l : s.train_losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_LT(s.train_losses.back(), s.train_losses.front() - 0.5);
  BenchOptions b;
  b.config_name = "tiny-llama";
  b.batch_size = 4;
  b.seq_len = 64;
  b.steps = 3;
  b.device = Device(kCUDA);
  // Matmul autotuning is on for the run (its products' shapes tuned) and off again after it.
  cuda::reset_matmul_autotune_stats();
  const bool autotune_before = cuda::matmul_autotune();
  const auto r = bench(b, log);
  EXPECT_GT(cuda::matmul_autotune_stats().tuned_shapes, 0);
  EXPECT_EQ(cuda::matmul_autotune(), autotune_before);
  cuda::reset_matmul_autotune_stats();
  b.matmul_autotune = false;
  bench(b, log);
  EXPECT_EQ(cuda::matmul_autotune_stats().tuned_shapes, 0);
  EXPECT_EQ(cuda::matmul_autotune(), autotune_before);
  EXPECT_GT(r.tokens_per_s, 0);
  ASSERT_TRUE(r.mfu.has_value());
  ASSERT_TRUE(r.peak_memory.has_value());
  EXPECT_GT(*r.peak_memory, 0);
  EXPECT_TRUE(std::isfinite(r.final_loss));
}

// bf16-mixed on the GPU: the autocast guard of the GPU's device type; tracks the f32 GPU run
// (head dims 16 of tiny-llama keep the attention on the composite path in both).
TEST_F(GpuTrainerTest, Bf16MixedTracksF32) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  std::ostringstream log;
  PretrainOptions o = tiny_options();
  o.max_steps = 8;
  o.device = Device(kCUDA);
  const auto f32 = pretrain(o, log);
  o.precision = "bf16-mixed";
  const auto mixed = pretrain(o, log);
  ASSERT_EQ(mixed.train_losses.size(), f32.train_losses.size());
  for (size_t i = 0; i < f32.train_losses.size(); ++i) {
    EXPECT_NEAR(mixed.train_losses[i], f32.train_losses[i], 0.05) << "step " << i + 1;
  }
  EXPECT_LT(mixed.train_losses.back(), mixed.train_losses.front());
  BenchOptions b;
  b.config_name = "tiny-llama";
  b.batch_size = 4;
  b.seq_len = 64;
  b.steps = 2;
  b.precision = "bf16-mixed";
  b.device = Device(kCUDA);
  EXPECT_TRUE(std::isfinite(bench(b, log).final_loss));
}

TEST_F(TrainerTest, BenchOnCpu) {
  std::ostringstream log;
  BenchOptions b;
  b.config_name = "tiny-llama";
  b.batch_size = 2;
  b.seq_len = 16;
  b.steps = 2;
  b.warmup_steps = 1;
  b.precision = "f32";
  b.device = Device(kCPU);
  const auto r = bench(b, log);
  EXPECT_EQ(r.num_parameters, ModelConfig::from_name("tiny-llama").num_parameters());
  EXPECT_GT(r.tokens_per_s, 0);
  EXPECT_GT(r.step_ms, 0);
  EXPECT_FALSE(r.mfu.has_value());
  EXPECT_FALSE(r.peak_memory.has_value());
  EXPECT_NEAR(r.final_loss, std::log(320.0), 1.0);
  ASSERT_EQ(r.warmup_step_s.size(), 1u);  // the time to the first step, reported
  EXPECT_GT(r.warmup_step_s[0], 0);
  EXPECT_NE(log.str().find("warm-up steps: "), std::string::npos) << log.str();
  b.compile = true;
  const auto c = bench(b, log);
  EXPECT_EQ(c.final_loss, r.final_loss);  // the same random tokens, the same steps
  EXPECT_NE(log.str().find("compile: 2 traces, 1 replays"), std::string::npos) << log.str();
  b.seq_len = 1000;
  EXPECT_KILN_ERROR(bench(b, log), "seq_len 1000 exceeds the block_size 128");
}

}  // namespace
}  // namespace kiln::models
