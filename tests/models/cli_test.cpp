// The `kiln` tool run as a user runs it (issue 21, points 7, 8, 9): flags with absurd values
// are errors naming the flag, a directory given as --data is reported as one, and resuming
// from the tool is exact: `--steps 6` equals `--steps 3 --lr-decay-steps 6` then
// `--resume --steps 6` bit for bit. A run configuration file (issue 20) and flags over it.
//
// The binary: KILN_CLI when the build defines it, else bin/kiln beside this test's build
// directory (tests/<name>_tests -> bin/kiln).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>

#include "models/hf.h"
#include "models/run_config.h"
#include "tensor/ops.h"
#include "text/bpe_trainer.h"
#include "text/tokenizer.h"

namespace {

namespace fs = std::filesystem;

std::string kiln_binary() {
#ifdef KILN_CLI
  return KILN_CLI;
#else
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? "" : (exe.parent_path().parent_path() / "bin" / "kiln").string();
#endif
}

struct Result {
  int status = -1;
  std::string output;  // stdout and stderr
};

// Runs `kiln <args>` through the shell (arguments are quoted by the caller where needed).
Result run_kiln(const std::string& args) {
  Result r;
  const std::string cmd = "'" + kiln_binary() + "' " + args + " 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf;
  while (size_t n = std::fread(buf.data(), 1, buf.size(), pipe)) r.output.append(buf.data(), n);
  const int status = ::pclose(pipe);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kiln_binary())) {
      GTEST_SKIP() << "no kiln binary at '" << kiln_binary() << "' (build the kiln_cli target)";
    }
    dir_ = fs::temp_directory_path() /
           ("kiln_cli_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Expects `kiln <args>` to exit with `status` and print `message`.
  void expect_error(const std::string& args, int status, const std::string& message) {
    const Result r = run_kiln(args);
    EXPECT_EQ(r.status, status) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << "\n" << r.output;
  }

  fs::path dir_;
};

// Numbers a flag cannot take: usage errors (status 2) naming the flag and the value.
TEST_F(CliTest, NumericEdgeCasesNameTheFlag) {
  const std::string out = " --out '" + (dir_ / "out").string() + "'";
  expect_error("pretrain --lr inf" + out, 2, "--lr: 'inf' is not a finite number");
  expect_error("pretrain --lr nan" + out, 2, "--lr: 'nan' is not a finite number");
  expect_error("pretrain --lr 1e999" + out, 2, "--lr: '1e999' is not a finite number");
  expect_error("pretrain --lr -0.1" + out, 2, "--lr must be positive, got -0.1");
  expect_error("pretrain --lr 0" + out, 2, "--lr must be positive, got 0");
  expect_error("pretrain --steps 0" + out, 2, "--steps must be positive, got 0");
  expect_error("pretrain --batch 4611686018427387904 --seq 1024" + out, 2,
               "--batch 4611686018427387904 x --seq 1024 tokens per step overflows int64");
  expect_error("pretrain --seq -5" + out, 2, "--seq must be positive, got -5");
  expect_error("pretrain --allow-resume-changes" + out, 2,
               "--allow-resume-changes goes with --resume");
  expect_error("pretrain --compile --no-compile" + out, 2,
               "--compile and --no-compile contradict each other");
  expect_error("bench --config tiny-llama --device cpu --comm-sm-carveout 4", 2,
               "--comm-sm-carveout goes with --dist ddp");
  expect_error("bench --config tiny-llama --device cpu --dist ddp --comm-sm-carveout -1", 2,
               "--comm-sm-carveout");
  expect_error("bench --config tiny-llama --device cpu --nccl-all-reduce", 2,
               "--nccl-all-reduce goes with --dist");
  expect_error("bench --config tiny-llama --device cpu --ddp-bucket-mb 50", 2,
               "--ddp-bucket-mb goes with --dist ddp");
  expect_error("bench --config tiny-llama --device cpu --dist ddp --ddp-bucket-mb 0", 2,
               "--ddp-bucket-mb must be positive, got 0");
  expect_error("bench --config tiny-llama --device cpu --dist ddp --ddp-bucket-mb x", 2,
               "--ddp-bucket-mb: 'x' is not a number");
  expect_error("bench --config tiny-llama --device cpu --ddp-tail-buckets 1", 2,
               "--ddp-tail-buckets goes with --dist ddp");
  expect_error("bench --config tiny-llama --device cpu --dist ddp --ddp-tail-buckets -1", 2,
               "--ddp-tail-buckets must be >= 0, got -1");
  expect_error("bench --config tiny-llama --batch 4294967296 --seq 4294967296 --device cpu", 2,
               "--batch 4294967296 x --seq 4294967296 tokens per step overflows int64");
  expect_error("bench --config tiny-llama --device cpu --adam-state bf16", 2,
               "--adam-state must be f32 or param, got 'bf16'");
  const std::string gen = "generate --config tiny-llama --prompt 1 --device cpu";
  expect_error(gen + " --temperature 1e-300", 2,
               "--temperature must be 0 (greedy) or at least 1e-06, got 1e-300");
  expect_error(gen + " --temperature -1", 2, "--temperature must be 0 (greedy) or at least");
  expect_error(gen + " --temperature inf", 2, "--temperature: 'inf' is not a finite number");
  expect_error(gen + " --top-p 0", 2, "--top-p must be in (0, 1] (1 = off), got 0");
  expect_error(gen + " --top-p 1.5", 2, "--top-p must be in (0, 1] (1 = off), got 1.5");
  expect_error(gen + " --top-p nan", 2, "--top-p: 'nan' is not a finite number");
  expect_error(gen + " --top-k -1", 2, "--top-k must be >= 0, got -1");
  expect_error(gen + " --max-new-tokens -1", 2, "--max-new-tokens must be >= 0, got -1");
  expect_error(gen + " --max-new-tokens 9223372036854775807", 1,
               "--max-new-tokens 9223372036854775807 exceeds the model's block_size 128");
  const Result ok = run_kiln(gen + " --max-new-tokens 3 --temperature 0");
  EXPECT_EQ(ok.status, 0) << ok.output;
}

// A directory as --data, or as a checkpoint file, is reported as a directory.
TEST_F(CliTest, DirectoriesAreReportedAsDirectories) {
  fs::create_directories(dir_ / "texts");
  std::ofstream(dir_ / "texts" / "a.txt") << "some text";
  expect_error("pretrain --steps 1 --device cpu --config tiny-llama --data '" +
                   (dir_ / "texts").string() + "' --out '" + (dir_ / "out").string() + "'",
               1, (dir_ / "texts").string() + ": is a directory without token shards");
  expect_error("tokenizer train --data '" + (dir_ / "texts").string() + "' --out '" +
                   (dir_ / "tok.json").string() + "'",
               1, "[tokenizer train] --data " + (dir_ / "texts").string() + ": is a directory");
  expect_error("generate --checkpoint '" + dir_.string() + "' --prompt 1 --device cpu", 1,
               "no trainer_state.json (not a kiln pretrain checkpoint directory)");
}

// `--steps 6` equals `--steps 3 --lr-decay-steps 6` then `--resume --steps 6` bit for bit:
// the model and the optimizer files are the same bytes. Resuming at the last step says so;
// resuming with another seed or lr is an error naming the override.
TEST_F(CliTest, ResumeFromTheToolIsExact) {
  const std::string common =
      "pretrain --config tiny-llama --batch 2 --seq 16 --device cpu "
      "--no-progress --seed 3 --out '";
  const fs::path straight = dir_ / "straight", resumed = dir_ / "resumed";
  Result r = run_kiln(common + straight.string() + "' --steps 6");
  ASSERT_EQ(r.status, 0) << r.output;
  // Eager by default on the CPU (compiled by default on CUDA only).
  EXPECT_EQ(r.output.find("runs through kiln::compile"), std::string::npos) << r.output;
  r = run_kiln(common + resumed.string() + "' --steps 3 --lr-decay-steps 6");
  ASSERT_EQ(r.status, 0) << r.output;
  // Flags left out take the checkpoint's: data, batch, seq, seed, lr and schedule.
  r = run_kiln(
      "pretrain --config tiny-llama --device cpu --no-progress --resume --steps 6 --out '" +
      resumed.string() + "'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from " + resumed.string() + " at step 3"), std::string::npos)
      << r.output;
  for (const char* name : {"model-00000006.safetensors", "optimizer-00000006.safetensors"}) {
    const std::string a = read_bytes(straight / name), b = read_bytes(resumed / name);
    EXPECT_FALSE(a.empty()) << name;
    EXPECT_TRUE(a == b) << name << " differs between the straight and the resumed run";
  }
  r = run_kiln(common + resumed.string() + "' --resume --steps 6");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("is at step 6, the last step (max_steps 6): nothing to train"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("done:"), std::string::npos) << r.output;
  const std::string unseeded =
      "pretrain --config tiny-llama --batch 2 --seq 16 --device cpu --no-progress --out '";
  expect_error(unseeded + resumed.string() + "' --resume --steps 8 --seed 4", 1,
               "other settings than asked: seed 3 -> 4");
  expect_error(common + resumed.string() + "' --resume --steps 8 --lr 0.01", 1, "lr 0.003 -> 0.01");
  r = run_kiln(common + resumed.string() + "' --resume --steps 7 --lr 0.01 --allow-resume-changes");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resume with changes (allowed): lr 0.003 -> 0.01"), std::string::npos)
      << r.output;
}

// --lr 1e30: step 1 is finite and makes the weights huge; step 2's loss is still finite (the
// norms flatten the activations) but its gradient norm is NaN. The run stops naming step 2 and
// keeps step 1's checkpoint, where it used to train on and save NaN weights; with
// --skip-nonfinite the bad steps are skipped and the run ends with a finite checkpoint.
TEST_F(CliTest, NonFiniteValuesNeverReplaceACheckpoint) {
  const std::string common =
      "pretrain --config tiny-llama --batch 2 --seq 16 --device cpu --no-progress --lr 1e30 "
      "--steps 3 --out '";
  const fs::path out = dir_ / "out";
  const Result r = run_kiln(common + out.string() + "' --save-every 1");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("[pretrain] step 2: the loss is "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" and the gradient norm nan (not finite); stopped before saving: the "
                          "last checkpoint in " +
                          out.string() + " (step 1) is kept"),
            std::string::npos)
      << r.output;
  EXPECT_NE(read_bytes(out / "trainer_state.json").find("\"step\": 1,"), std::string::npos);
  EXPECT_FALSE(fs::exists(out / "model-00000002.safetensors"));
  const Result skip = run_kiln(common + (dir_ / "skip").string() + "' --skip-nonfinite");
  EXPECT_EQ(skip.status, 0) << skip.output;
  EXPECT_NE(skip.output.find("step 2 skipped: loss "), std::string::npos) << skip.output;
  EXPECT_NE(skip.output.find("step 3 skipped: loss "), std::string::npos) << skip.output;
  EXPECT_NE(skip.output.find("checkpoint step 3 -> "), std::string::npos) << skip.output;
}

// --config FILE.toml: the file's settings, the flags over them, the defaults derived from both;
// the run writes what it ran with to <out>/run.toml, and `--config <out>/run.toml` repeats the
// run byte for byte. A bad file is an error naming file:line and the key.
TEST_F(CliTest, RunConfigFileAndFlagsOverIt) {
  const fs::path out = dir_ / "out", again = dir_ / "again", file = dir_ / "run.toml";
  std::ofstream(file) << "[model]\nname = \"tiny-llama\"\n"
                      << "[data]\nbatch_size = 2\nseq_len = 16\n"
                      << "[training]\nsteps = 9\ndevice = \"cpu\"\nseed = 5\n"
                      << "[optimizer]\nlr = 0.002\nbetas = [0.8, 0.9]\n"
                      << "[checkpoint]\nout_dir = \"" << out.string() << "\"\n";
  Result r = run_kiln("pretrain --config '" + file.string() + "' --steps 2 --no-progress");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto o = kiln::models::read_run_config((out / "run.toml").string()).options;
  EXPECT_EQ(o.config_name, "tiny-llama");
  EXPECT_EQ(o.batch_size, 2);
  EXPECT_EQ(o.seq_len, 16);
  EXPECT_EQ(o.max_steps, 2);  // the flag over the file
  EXPECT_EQ(o.seed, 5u);
  EXPECT_EQ(o.lr, 0.002);
  EXPECT_EQ(o.min_lr, 0.002 / 10);  // derived from the file's lr, as from --lr
  EXPECT_EQ(o.warmup_steps, 0);     // derived from --steps 2
  EXPECT_EQ(o.betas, (std::tuple<double, double>{0.8, 0.9}));
  EXPECT_EQ(o.progress_bar, false);
  EXPECT_EQ(o.device, kiln::Device(kiln::kCPU));
  EXPECT_EQ(o.out_dir, out.string());
  EXPECT_NE(o.data_path.find("tinyshakespeare.txt"), std::string::npos);
  // The written file repeats the run: the same weights, byte for byte.
  r = run_kiln("pretrain --config '" + (out / "run.toml").string() + "' --out '" + again.string() +
               "'");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string a = read_bytes(out / "model-00000002.safetensors");
  EXPECT_FALSE(a.empty());
  EXPECT_TRUE(a == read_bytes(again / "model-00000002.safetensors"));
  std::string expected = read_bytes(out / "run.toml");
  expected.replace(expected.find(out.string()), out.string().size(), again.string());
  EXPECT_EQ(read_bytes(again / "run.toml"), expected);

  std::ofstream(dir_ / "bad.toml") << "[training]\nsteps = 0\n";
  expect_error("pretrain --config '" + (dir_ / "bad.toml").string() + "'", 1,
               "[run_config] " + (dir_ / "bad.toml").string() +
                   ":2: training.steps must be positive, got 0");
  expect_error("pretrain --config '" + (dir_ / "missing.toml").string() + "'", 1,
               (dir_ / "missing.toml").string() + ": no such file");
}

// --skip-nonfinite is a flag of pretrain, listed in the usage.
// generate --tokenizer: the text goes through a Hugging Face tokenizer.json, and the output is
// decoded with it; another model's tokenizer (more ids than the model's vocabulary) is refused.
TEST_F(CliTest, GenerateWithATokenizerJson) {
  const std::string tok = std::string(KILN_SOURCE_DIR) + "/tests/text/data/llama3.json";
  const Result r = run_kiln(
      "generate --config llama-160m --device cpu --max-new-tokens 2 "
      "--temperature 0 --tokenizer '" +
      tok + "' --text 'Hello world'");
  ASSERT_EQ(r.status, 0) << r.output;
  std::string ids = "prompt:";
  for (int64_t id : kiln::text::Tokenizer::from_file(tok).encode("Hello world")) {
    ids += " " + std::to_string(id);
  }
  EXPECT_NE(r.output.find(ids + "\n"), std::string::npos) << ids << "\n" << r.output;
  EXPECT_NE(r.output.find("text:\nHello world"), std::string::npos) << r.output;
  expect_error("generate --config tiny-llama --device cpu --tokenizer '" + tok + "' --text hi", 1,
               "has 1500 ids, more than the vocab_size 320 of the model (tiny-llama)");
}

// pretrain --hf DIR (issue 20): a Hugging Face directory's model, weights and tokenizer; --config
// NAME with it is a usage error; --resume without --hf continues on the checkpoint's directory.
TEST_F(CliTest, PretrainFromAHuggingFaceDirectory) {
  const fs::path hf = dir_ / "tiny-hf";
  kiln::manual_seed(3);
  kiln::models::GPT model(kiln::models::ModelConfig::from_name("tiny-llama"));
  kiln::models::save_hf_checkpoint(*model, hf.string());
  const std::string data = (dir_ / "corpus.txt").string();
  {
    std::ofstream(data)
        << read_bytes(std::string(KILN_SOURCE_DIR) + "/data/tinyshakespeare.txt").substr(0, 20'000);
    kiln::text::BpeTrainerOptions bpe;
    bpe.vocab_size = 300;  // the model has 320 ids
    std::ofstream(hf / "tokenizer.json") << kiln::text::train_bpe({read_bytes(data)}, bpe);
  }
  const std::string common = " --data '" + data + "' --batch 2 --seq 16 --device cpu --no-progress";
  expect_error("pretrain --hf '" + hf.string() + "' --config tiny-llama" + common, 2,
               "--hf " + hf.string() + " and --config tiny-llama both name the model");
  const std::string out = " --out '" + (dir_ / "out").string() + "'";
  const Result first =
      run_kiln("pretrain --hf '" + hf.string() + "' --steps 2 --lr-decay-steps 3" + common + out);
  ASSERT_EQ(first.status, 0) << first.output;
  EXPECT_NE(first.output.find("initial weights: " + hf.string()), std::string::npos)
      << first.output;
  const Result resumed = run_kiln("pretrain --resume --steps 3" + common + out);
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("pretraining tiny-hf"), std::string::npos) << resumed.output;
}

// --no-matmul-autotune is a flag of bench and pretrain (on the CPU it changes nothing).
TEST_F(CliTest, BenchTakesNoMatmulAutotune) {
  const Result r = run_kiln(
      "bench --config tiny-llama --device cpu --batch 2 --seq 16 --steps 1 "
      "--no-matmul-autotune");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("tok/s"), std::string::npos) << r.output;
}

TEST_F(CliTest, UsageListsTheNewFlags) {
  const Result r = run_kiln("help");
  EXPECT_EQ(r.status, 0);
  for (const char* flag : {"--skip-nonfinite", "--allow-resume-changes", "--lr-decay-steps",
                           "--adam-state", "--config FILE.toml", "--dist M", "--tokenizer FILE",
                           "--hf DIR ", "--no-compile", "--comm-sm-carveout N", "--ddp-bucket-mb X",
                           "--ddp-tail-buckets N", "--no-matmul-autotune", "--nccl-all-reduce"}) {
    EXPECT_NE(r.output.find(flag), std::string::npos) << flag;
  }
}

}  // namespace
