// Run configuration files (models/run_config.h): to_toml and back gives the same options; every
// kind of bad file is an error naming file:line and the key; the file read over a base leaves
// the keys it does not set alone and says which it set.
#include "models/run_config.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <tuple>

#include "models/config.h"
#include "nn/safetensors.h"
#include "tensor/error.h"

#ifndef KILN_SOURCE_DIR
#error "KILN_SOURCE_DIR must point at the source tree (tests/CMakeLists.txt sets it)"
#endif

namespace kiln::models {
namespace {

namespace fs = std::filesystem;

// Every option that the file holds, each away from its default.
PretrainOptions unusual_options() {
  PretrainOptions o;
  o.config_name = "tiny-llama";
  o.data_path = "data/a \"quoted\" path\\with\tescapes/é.txt";
  o.batch_size = 3;
  o.seq_len = 17;
  o.max_steps = 1234;
  o.lr_decay_steps = 2000;
  o.lr = 0.1 + 0.2;  // 0.30000000000000004: the round trip must be exact
  o.min_lr = 1e-7;
  o.warmup_steps = 0;
  o.weight_decay = 0;
  o.betas = {0.85, 0.999};
  o.eps = 1e-12;
  o.adam_state_in_param_dtype = true;
  o.grad_clip = 0.5;
  o.grad_accum_steps = 4;
  o.precision = "bf16-mixed";
  o.device = Device("cuda:1");
  o.log_interval = 7;
  o.eval_interval = 0;
  o.eval_batches = 3;
  o.out_dir = "";
  o.checkpoint_interval = 50;
  o.keep_checkpoints = 3;
  o.skip_nonfinite = true;
  o.deterministic = true;
  o.seed = std::numeric_limits<uint64_t>::max();  // above int64: written as a string
  o.compile = true;
  o.dist = "zero2";
  o.progress_bar = false;
  return o;
}

void expect_same(const PretrainOptions& a, const PretrainOptions& b) {
  EXPECT_EQ(a.config_name, b.config_name);
  EXPECT_EQ(a.config.has_value(), b.config.has_value());
  EXPECT_EQ(a.data_path, b.data_path);
  EXPECT_EQ(a.batch_size, b.batch_size);
  EXPECT_EQ(a.seq_len, b.seq_len);
  EXPECT_EQ(a.max_steps, b.max_steps);
  EXPECT_EQ(a.lr_decay_steps, b.lr_decay_steps);
  EXPECT_EQ(a.lr, b.lr);  // bit for bit
  EXPECT_EQ(a.min_lr, b.min_lr);
  EXPECT_EQ(a.warmup_steps, b.warmup_steps);
  EXPECT_EQ(a.weight_decay, b.weight_decay);
  EXPECT_EQ(a.betas, b.betas);
  EXPECT_EQ(a.eps, b.eps);
  EXPECT_EQ(a.adam_state_in_param_dtype, b.adam_state_in_param_dtype);
  EXPECT_EQ(a.grad_clip, b.grad_clip);
  EXPECT_EQ(a.grad_accum_steps, b.grad_accum_steps);
  EXPECT_EQ(a.precision, b.precision);
  EXPECT_EQ(a.device, b.device);
  EXPECT_EQ(a.log_interval, b.log_interval);
  EXPECT_EQ(a.eval_interval, b.eval_interval);
  EXPECT_EQ(a.eval_batches, b.eval_batches);
  EXPECT_EQ(a.out_dir, b.out_dir);
  EXPECT_EQ(a.checkpoint_interval, b.checkpoint_interval);
  EXPECT_EQ(a.keep_checkpoints, b.keep_checkpoints);
  EXPECT_EQ(a.skip_nonfinite, b.skip_nonfinite);
  EXPECT_EQ(a.deterministic, b.deterministic);
  EXPECT_EQ(a.seed, b.seed);
  EXPECT_EQ(a.compile, b.compile);
  EXPECT_EQ(a.dist, b.dist);
  EXPECT_EQ(a.progress_bar, b.progress_bar);
}

// The message of parse_run_config's error on `text` ("" when it parses).
std::string error_of(const std::string& text) {
  try {
    parse_run_config(text, "bad.toml");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Expects `text` to be rejected with `message` (file:line included).
void expect_error(const std::string& text, const std::string& message) {
  const std::string error = error_of(text);
  EXPECT_NE(error.find(message), std::string::npos)
      << "file:\n"
      << text << "\nerror: " << error << "\nexpected: " << message;
}

TEST(RunConfigTest, RoundTripGivesTheSameOptions) {
  const PretrainOptions o = unusual_options();
  const std::string text = to_toml(o);
  const RunConfig back = parse_run_config(text, "run.toml");
  expect_same(back.options, o);
  EXPECT_EQ(to_toml(back.options), text);
  EXPECT_EQ(back.keys.size(), 29u) << text;  // every key, device and progress_bar included
  EXPECT_NE(text.find("seed = \"18446744073709551615\""), std::string::npos) << text;
  EXPECT_NE(text.find("lr = 0.30000000000000004"), std::string::npos) << text;

  // The defaults: data path, device and progress_bar unset, written as comments, not read back.
  const PretrainOptions d;
  const std::string defaults = to_toml(d);
  expect_same(parse_run_config(defaults, "run.toml").options, d);
  const RunConfig d_back = parse_run_config(defaults, "run.toml", unusual_options());
  EXPECT_EQ(d_back.keys.size(), 26u);
  EXPECT_FALSE(d_back.has("data.path"));
  EXPECT_FALSE(d_back.has("training.device"));
  EXPECT_FALSE(d_back.has("metrics.progress_bar"));
  EXPECT_EQ(d_back.options.device, Device("cuda:1"));  // the base's
  EXPECT_NE(defaults.find("# path unset"), std::string::npos) << defaults;
  EXPECT_NE(defaults.find("# device unset"), std::string::npos) << defaults;
  EXPECT_NE(defaults.find("weight_decay = 0.1"), std::string::npos) << defaults;
  EXPECT_NE(defaults.find("betas = [0.9, 0.95]"), std::string::npos) << defaults;
}

TEST(RunConfigTest, FileOverridesOnlyTheKeysItSets) {
  const PretrainOptions base = unusual_options();
  const RunConfig rc = parse_run_config(R"(
# a comment
[training]
steps = 10
device = "cpu"

[optimizer]
lr = 1        # an integer where a float goes
betas = [0, 0.5]
)",
                                        "small.toml", base);
  EXPECT_EQ(rc.keys, (std::set<std::string>{"training.steps", "training.device", "optimizer.lr",
                                            "optimizer.betas"}));
  EXPECT_EQ(rc.options.max_steps, 10);
  EXPECT_EQ(rc.options.device, Device(kCPU));
  EXPECT_EQ(rc.options.lr, 1.0);
  EXPECT_EQ(rc.options.betas, (std::tuple<double, double>{0.0, 0.5}));
  // The rest is the base's.
  PretrainOptions expected = base;
  expected.max_steps = 10;
  expected.device = Device(kCPU);
  expected.lr = 1.0;
  expected.betas = {0.0, 0.5};
  expect_same(rc.options, expected);

  // Dotted keys and inline tables are TOML too; an empty file changes nothing.
  const RunConfig dotted =
      parse_run_config("data.seq_len = 64\nmodel = { name = \"tiny-llama\" }\n", "d.toml");
  EXPECT_EQ(dotted.options.seq_len, 64);
  EXPECT_EQ(dotted.options.config_name, "tiny-llama");
  EXPECT_TRUE(parse_run_config("", "empty.toml", base).keys.empty());

  // model.name replaces a hand-built config of the base.
  PretrainOptions with_config;
  with_config.config = ModelConfig::from_name("tiny-llama");
  const RunConfig named =
      parse_run_config("[model]\nname = \"kiln-tiny\"\n", "m.toml", with_config);
  EXPECT_FALSE(named.options.config.has_value());
  EXPECT_EQ(named.options.config_name, "kiln-tiny");
}

TEST(RunConfigTest, UnknownTablesAndKeysAreErrors) {
  expect_error("[trainig]\nsteps = 1\n",
               "bad.toml:1: unknown table [trainig] (did you mean [training]?)");
  expect_error("[job]\nsteps = 1\n",
               "bad.toml:1: unknown table [job] (the tables: [model], [data]");
  expect_error("[training]\n\nstpes = 1\n",
               "bad.toml:3: unknown key training.stpes (did you mean steps?)");
  expect_error("[training]\nprecison = \"f32\"\n",
               "bad.toml:2: unknown key training.precison (did you mean precision?)");
  expect_error("[training]\nwarmup = 1\n",
               "bad.toml:2: unknown key training.warmup (the keys of [training]: steps, precision, "
               "device, compile, dist, grad_accum_steps, seed, deterministic, skip_nonfinite)");
  expect_error("[training]\nlr = 0.1\n",
               "bad.toml:2: unknown key training.lr: it goes in [optimizer]");
  expect_error("steps = 1\n", "bad.toml:1: steps: a key outside any table; it goes in [training]");
  expect_error("[training.extra]\nx = 1\n", "bad.toml:1: unknown key training.extra");
  expect_error("[checkpoint]\nresume = true\n",
               "bad.toml:2: checkpoint.resume: not a setting of the file; --resume is given on "
               "the command line");
  expect_error("allow_resume_changes = true\n",
               "bad.toml:1: allow_resume_changes: not a setting of the file; "
               "--allow-resume-changes");
  expect_error("model = \"kiln-tiny\"\n",
               "bad.toml:1: model must be a table ([model]), got a string");
  expect_error("[[training]]\nsteps = 1\n",
               "bad.toml:1: training must be a table ([training]), got an array");
}

TEST(RunConfigTest, WrongTypesAreErrors) {
  expect_error("[training]\nsteps = \"200\"\n",
               "bad.toml:2: training.steps must be an integer, got a string \"200\"");
  expect_error("[training]\nsteps = 200.0\n",
               "bad.toml:2: training.steps must be an integer, got a float 200.0");
  expect_error("[training]\ncompile = 1\n",
               "bad.toml:2: training.compile must be true or false, got an integer 1");
  expect_error("[optimizer]\nlr = \"3e-3\"\n",
               "bad.toml:2: optimizer.lr must be a number, got a string \"3e-3\"");
  expect_error("[optimizer]\nbetas = [0.9]\n",
               "bad.toml:2: optimizer.betas must be an array of two numbers, got an array [");
  expect_error("[optimizer]\nbetas = [0.9, \"x\"]\n",
               "optimizer.betas must be an array of two numbers");
  expect_error("[optimizer]\nbetas = 0.9\n",
               "bad.toml:2: optimizer.betas must be an array of two numbers, got a float 0.9");
  expect_error("[data]\npath = 3\n", "bad.toml:2: data.path must be a string, got an integer 3");
  expect_error("[model]\nname = 1\n",
               "bad.toml:2: model.name must be a config name, got an integer 1");
  expect_error("[model]\nhf = 1\n", "bad.toml:2: model.hf must be a directory, got an integer 1");
  expect_error("[model]\nname = \"tiny-llama\"\nhf = \"llama\"\n",
               "bad.toml:3: model.hf and model.name (line 2) both name the model: give one");
  expect_error("[metrics]\nprogress_bar = \"yes\"\n",
               "bad.toml:2: metrics.progress_bar must be true or false, got a string \"yes\"");
  expect_error("[training]\nseed = 1.5\n",
               "bad.toml:2: training.seed must be an integer in [0, 2^64), got a float 1.5");
  expect_error("[checkpoint]\nout_dir = 2024-01-01\n",
               "bad.toml:2: checkpoint.out_dir must be a string, got a date or time 2024-01-01");
}

TEST(RunConfigTest, OutOfRangeValuesAreErrors) {
  expect_error("[training]\nsteps = 0\n", "bad.toml:2: training.steps must be positive, got 0");
  expect_error("[data]\nbatch_size = -4\n", "bad.toml:2: data.batch_size must be positive, got -4");
  expect_error("[data]\nseq_len = 0\n", "bad.toml:2: data.seq_len must be positive, got 0");
  expect_error("[data]\npath = \"\"\n", "bad.toml:2: data.path must not be empty");
  expect_error("[training]\ngrad_accum_steps = 0\n", "training.grad_accum_steps must be positive");
  expect_error("[training]\nseed = -1\n",
               "bad.toml:2: training.seed must be an integer in [0, 2^64)");
  expect_error("[training]\nseed = \"18446744073709551616\"\n", "training.seed must be an integer");
  expect_error("[training]\nprecision = \"fp16\"\n",
               "bad.toml:2: training.precision must be one of \"f32\", \"bf16-true\", "
               "\"bf16-mixed\", got a string \"fp16\"");
  expect_error("[training]\ndevice = \"tpu\"\n",
               "bad.toml:2: training.device must be \"cpu\", \"cuda\" or \"cuda:N\", got a string "
               "\"tpu\"");
  expect_error("[training]\ndevice = \"meta\"\n", "training.device must be \"cpu\"");
  expect_error("[training]\ndist = \"mpi\"\n",
               "bad.toml:2: training.dist must be one of \"\", \"ddp\", \"zero2\", \"zero3\", "
               "\"fsdp\", got a string \"mpi\"");
  expect_error("[model]\nname = \"gpt-5\"\n",
               "bad.toml:2: model.name must be a registered config (");
  expect_error("[optimizer]\nlr = 0\n",
               "bad.toml:2: optimizer.lr must be a finite number > 0, got an integer 0");
  expect_error("[optimizer]\nlr = nan\n",
               "optimizer.lr must be a finite number > 0, got a float nan");
  expect_error("[optimizer]\nlr = inf\n",
               "optimizer.lr must be a finite number > 0, got a float inf");
  expect_error("[optimizer]\nweight_decay = -0.1\n",
               "bad.toml:2: optimizer.weight_decay must be a finite number >= 0, got a float -0.1");
  expect_error("[optimizer]\neps = -1e-8\n", "optimizer.eps must be a finite number >= 0");
  expect_error("[optimizer]\ngrad_clip = -1\n", "optimizer.grad_clip must be a finite number >= 0");
  expect_error("[optimizer]\nbetas = [0.9, 1.0]\n",
               "bad.toml:2: optimizer.betas must each be in [0, 1), got an array [");
  expect_error(
      "[optimizer]\nadam_state = \"bf16\"\n",
      "bad.toml:2: optimizer.adam_state must be \"f32\" or \"param\", got a string \"bf16\"");
  expect_error("[schedule]\nwarmup_steps = -1\n", "schedule.warmup_steps must be >= 0, got -1");
  expect_error("[schedule]\nlr_decay_steps = -5\n", "schedule.lr_decay_steps must be >= 0, got -5");
  expect_error("[schedule]\nmin_lr = -1e-4\n", "schedule.min_lr must be a finite number >= 0");
  expect_error("[optimizer]\nlr = 1e-3\n[schedule]\nmin_lr = 1e-2\n",
               "bad.toml:4: schedule.min_lr 0.01 exceeds optimizer.lr 0.001 (line 2)");
  expect_error("[metrics]\nlog_interval = 0\n", "metrics.log_interval must be positive, got 0");
  expect_error("[metrics]\neval_interval = -1\n", "metrics.eval_interval must be >= 0, got -1");
  expect_error("[metrics]\neval_batches = 0\n", "metrics.eval_batches must be positive, got 0");
  expect_error("[checkpoint]\ninterval = -1\n", "checkpoint.interval must be >= 0, got -1");
  expect_error("[checkpoint]\nkeep = 0\n", "bad.toml:2: checkpoint.keep must be positive, got 0");
}

TEST(RunConfigTest, EveryErrorOfAFileIsReportedInLineOrder) {
  const std::string error = error_of("[training]\nsteps = 0\n[data]\nbatch_size = \"x\"\n[foo]\n");
  EXPECT_EQ(error,
            "[run_config] bad.toml:2: training.steps must be positive, got 0\n"
            "[run_config] bad.toml:4: data.batch_size must be an integer, got a string \"x\"\n"
            "[run_config] bad.toml:5: unknown table [foo] (the tables: [model], [data], "
            "[training], [optimizer], [schedule], [metrics], [checkpoint])");
}

TEST(RunConfigTest, SyntaxErrorsNameLineAndColumn) {
  expect_error("[training]\nsteps = \n", "[run_config] bad.toml:2:9: ");
  expect_error("[training]\nsteps = 1\nsteps = 2\n", "bad.toml:3:");
  expect_error("[training\n", "bad.toml:1:");
  expect_error("[data]\npath = \"unterminated\n", "bad.toml:2:");
}

// examples/kiln-tiny.toml is what `kiln pretrain` runs by default, spelled out.
TEST(RunConfigTest, TheExampleFileReads) {
  const RunConfig rc = read_run_config(std::string(KILN_SOURCE_DIR) + "/examples/kiln-tiny.toml");
  EXPECT_EQ(rc.options.config_name, "kiln-tiny");
  EXPECT_EQ(rc.options.data_path, "data/tinyshakespeare.txt");
  EXPECT_EQ(rc.options.batch_size, 8);
  EXPECT_EQ(rc.options.seq_len, 128);
  EXPECT_EQ(rc.options.max_steps, 200);
  EXPECT_EQ(rc.options.lr, 3e-3);
  EXPECT_EQ(rc.options.min_lr, 3e-4);
  EXPECT_EQ(rc.options.warmup_steps, 20);
  EXPECT_EQ(rc.options.out_dir, "out/kiln-tiny");
  EXPECT_EQ(rc.options.keep_checkpoints, 2);
  EXPECT_EQ(rc.keys.size(), 18u);
  EXPECT_FALSE(rc.has("training.device"));
}

class RunConfigFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("kiln_run_config_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(RunConfigFileTest, WriteThenReadGivesTheSameOptions) {
  const PretrainOptions o = unusual_options();
  write_run_config(dir_.string(), o);
  const fs::path path = dir_ / kRunConfigFile;
  ASSERT_TRUE(fs::is_regular_file(path));
  // Atomic: only run.toml, no temporary left beside it.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);
  EXPECT_EQ(read_file(path.string()), to_toml(o));
  expect_same(read_run_config(path.string()).options, o);
}

// pretrain writes the options it runs with to out_dir/run.toml before the first step.
TEST_F(RunConfigFileTest, PretrainWritesTheOptionsItRunsWith) {
  PretrainOptions o;
  o.config_name = "tiny-llama";
  o.data_path = std::string(KILN_SOURCE_DIR) + "/data/tinyshakespeare.txt";
  o.batch_size = 2;
  o.seq_len = 16;
  o.max_steps = 1;
  o.warmup_steps = 0;
  o.eval_batches = 1;
  o.device = Device(kCPU);
  o.out_dir = (dir_ / "out").string();
  o.progress_bar = false;
  o.betas = {0.8, 0.99};
  bool written_before_step = false;
  o.before_step = [&](int64_t, GPT&) {
    written_before_step = fs::is_regular_file(dir_ / "out" / kRunConfigFile);
  };
  std::ostringstream log;
  pretrain(o, log);
  EXPECT_TRUE(written_before_step);
  expect_same(read_run_config((dir_ / "out" / kRunConfigFile).string()).options, o);
}

TEST_F(RunConfigFileTest, UnreadableFilesAreErrors) {
  const std::string missing = (dir_ / "missing.toml").string();
  EXPECT_THROW(
      {
        try {
          read_run_config(missing);
        } catch (const Error& e) {
          EXPECT_EQ(std::string(e.what()), "[run_config] " + missing + ": no such file");
          throw;
        }
      },
      Error);
  try {
    read_run_config(dir_.string());
    ADD_FAILURE() << "a directory was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(": is a directory, not a TOML file"), std::string::npos)
        << e.what();
  }
  const std::string fifo = (dir_ / "fifo.toml").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  try {
    read_run_config(fifo);
    ADD_FAILURE() << "a FIFO was read";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "[run_config] " + fifo + ": not a regular file");
  }
  // Errors in a file name its path.
  const fs::path bad = dir_ / "bad.toml";
  std::ofstream(bad) << "[training]\nsteps = 0\n";
  try {
    read_run_config(bad.string());
    ADD_FAILURE() << "steps = 0 was read";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[run_config] " + bad.string() + ":2: training.steps must be positive, got 0");
  }
}

}  // namespace
}  // namespace kiln::models
