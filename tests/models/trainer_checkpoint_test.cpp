// A trainer checkpoint of a step saved again into the same directory is published whole, as a new
// step is (issue 21): its files get the next generation's names and trainer_state.json's rename
// publishes them. A worker (tests/models/trainer_checkpoint_worker.cpp) saving the same step over
// and over is killed at random moments; afterwards trainer_state.json (and
// trainer_state-<step>.json) name a model and an optimizer file of the same save, never a mix, and
// the next start removes what the killed save left.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "models/hf_test_util.h"
#include "models/trainer_internal.h"
#include "models/worker_process.h"
#include "nn/safetensors.h"
#include "tensor/ops.h"

namespace kiln::models {
namespace {

namespace fs = std::filesystem;
using hftest::TempDir;

// The value every element of a file's tensors holds (the worker saves constant tensors); NaN
// when they differ.
double value_of(const fs::path& file) {
  double v = std::nan("");
  bool first = true;
  for (const auto& [name, t] : load_safetensors(file.string())) {
    const double lo = t.min().item<double>(), hi = t.max().item<double>();
    if (lo != hi || (!first && lo != v)) return std::nan("");
    v = lo;
    first = false;
  }
  return v;
}

// The value of the checkpoint a state file names: its model's and its optimizer's, which must be
// the same save's. -1 when the state file does not exist.
double checkpoint_value(const fs::path& dir, const std::string& state_file) {
  const auto info = internal::read_state_file((dir / state_file).string());
  if (!info) return -1;
  const double model = value_of(dir / info->model_file);
  const double opt = value_of(dir / info->optimizer_file);
  EXPECT_EQ(model, opt) << state_file << " names " << info->model_file << " and "
                        << info->optimizer_file << ": a mix of two saves";
  return model;
}

std::vector<std::string> files_in(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename());
  std::sort(out.begin(), out.end());
  return out;
}

void save(const fs::path& dir, int64_t step, double value, int64_t keep) {
  PretrainOptions o;
  o.data_path = "data.txt";
  o.keep_checkpoints = keep;
  const TensorMap model = {{"w", full({16}, value)}};
  const TensorMap opt = {{"m", full({16}, value)}};
  internal::save_checkpoint(
      dir.string(), [&](const std::string& path) { save_safetensors(model, path); },
      [&](const std::string& path) { save_safetensors(opt, path); }, "tiny-llama", o, step,
      {1e-3, 1e-4, 0, 10}, std::nullopt);
}

TEST(TrainerCheckpoint, ASecondSaveOfAStepGetsNewNamesAndReplacesTheFirst) {
  TempDir dir;
  const fs::path d = dir.str();
  save(d, 5, 1, 1);
  EXPECT_EQ(files_in(d),
            (std::vector<std::string>{"model-00000005.safetensors",
                                      "optimizer-00000005.safetensors", "trainer_state.json"}));
  save(d, 5, 2, 1);
  EXPECT_EQ(files_in(d),
            (std::vector<std::string>{"model-00000005.1.safetensors",
                                      "optimizer-00000005.1.safetensors", "trainer_state.json"}));
  EXPECT_EQ(checkpoint_value(d, "trainer_state.json"), 2);
  save(d, 5, 3, 1);
  EXPECT_EQ(files_in(d),
            (std::vector<std::string>{"model-00000005.2.safetensors",
                                      "optimizer-00000005.2.safetensors", "trainer_state.json"}));
  EXPECT_EQ(checkpoint_value(d, "trainer_state.json"), 3);
  // The next step is saved under plain names; with keep 2 the re-saved step stays beside it.
  save(d, 6, 4, 2);
  EXPECT_EQ(files_in(d), (std::vector<std::string>{
                             "model-00000005.2.safetensors", "model-00000006.safetensors",
                             "optimizer-00000005.2.safetensors", "optimizer-00000006.safetensors",
                             "trainer_state-00000006.json", "trainer_state.json"}));
  save(d, 6, 5, 2);
  EXPECT_EQ(checkpoint_value(d, "trainer_state.json"), 5);
  EXPECT_EQ(checkpoint_value(d, "trainer_state-00000006.json"), 5);
  EXPECT_FALSE(fs::exists(d / "model-00000006.safetensors"));
  EXPECT_TRUE(fs::exists(d / "model-00000006.1.safetensors"));
  EXPECT_TRUE(fs::exists(d / "model-00000005.2.safetensors"));
}

TEST(TrainerCheckpoint, AtStartFilesThatNoStateNamesAreRemoved) {
  TempDir dir;
  const fs::path d = dir.str();
  save(d, 5, 1, 1);
  // What a killed re-save leaves: its files written, trainer_state.json not yet replaced.
  hftest::write_text(d / "model-00000005.1.safetensors", "new");
  hftest::write_text(d / "optimizer-00000005.1.safetensors", "new");
  hftest::write_text(d / "model-00000004.safetensors", "another step: pruning's business");
  internal::remove_superseded_files(d.string());
  EXPECT_EQ(files_in(d),
            (std::vector<std::string>{"model-00000004.safetensors", "model-00000005.safetensors",
                                      "optimizer-00000005.safetensors", "trainer_state.json"}));
  EXPECT_EQ(checkpoint_value(d, "trainer_state.json"), 1);
}

TEST(TrainerCheckpoint, KilledWhileSavingTheSameStepAgainLeavesOneWholeSave) {
  TempDir root;
  std::mt19937_64 rng(20261126);
  int seen[3] = {0, 0, 0};
  constexpr int kKills = 24;
  for (int i = 0; i < kKills; ++i) {
    const fs::path d = root / ("ckpt" + std::to_string(i));
    const int64_t keep = 1 + i % 2;
    worker::Worker w = worker::start_worker(KILN_TRAINER_CHECKPOINT_WORKER,
                                            {d.string(), "7", std::to_string(keep)});
    ASSERT_TRUE(worker::wait_ready(w)) << "the worker did not start";
    // Saves of 12 MB: some tens of ms each; kill within the first few.
    const auto delay =
        std::chrono::microseconds(std::uniform_int_distribution<int64_t>(0, 300'000)(rng));
    std::this_thread::sleep_for(delay);
    ::kill(w.pid, SIGKILL);
    const int status = worker::wait_worker(w);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the worker ended by itself, wait status " << status;
    SCOPED_TRACE("kill " + std::to_string(i) + " after " + std::to_string(delay.count()) +
                 " us, keep " + std::to_string(keep));

    const double v = checkpoint_value(d, "trainer_state.json");
    ASSERT_TRUE(v == 1 || v == 2) << "trainer_state.json names value " << v;
    ++seen[static_cast<int>(v)];
    if (keep > 1) {
      // Written just before trainer_state.json: the same save, or the next one.
      const double own = checkpoint_value(d, "trainer_state-00000007.json");
      EXPECT_TRUE(own == 1 || own == 2) << "trainer_state-00000007.json names value " << own;
    }
    // The next start: what the killed save left is removed, the checkpoint stays.
    internal::remove_stale_temporaries(d.string());
    internal::remove_superseded_files(d.string());
    EXPECT_EQ(checkpoint_value(d, "trainer_state.json"), v);
    int64_t models = 0;
    for (const std::string& name : files_in(d)) {
      EXPECT_EQ(name.find(".tmp."), std::string::npos) << name;
      models += name.starts_with("model-");
    }
    EXPECT_LE(models, keep) << "superseded model files were left";
  }
  std::cout << "[ kills    ] " << kKills << " kills: " << seen[1] << " left value 1, " << seen[2]
            << " left value 2\n";
}

}  // namespace
}  // namespace kiln::models
