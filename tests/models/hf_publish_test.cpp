// save_hf_checkpoint replaces a checkpoint directory as a whole (models/hf_weights.cpp,
// "publishing"). A worker process (tests/models/hf_publish_worker.cpp) saving into a directory is
// killed with SIGKILL at each publishing step, in both ways of publishing (one exchange, or two
// renames), and at random moments; afterwards the directory loads as the previous checkpoint or
// the new one, weight for weight, never a mix of the two, and the next save removes what the
// killed one left beside it.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "models/hf.h"
#include "models/hf_test_util.h"
#include "models/worker_process.h"
#include "tensor/ops.h"
#include "test_util.h"

namespace kiln::models {
namespace {

namespace fs = std::filesystem;
using hftest::TempDir;
using hftest::write_text;
using worker::wait_ready;
using worker::wait_worker;
using worker::Worker;

// Same weights as the worker's model of `seed`.
GPT model_of(uint64_t seed) {
  manual_seed(seed);
  return GPT(ModelConfig::from_name("tiny-llama"));
}

// The index of the model in `known` whose every parameter the checkpoint in `dir` holds exactly,
// or -1 (a mix, or another model); a checkpoint that does not load fails the test.
int loaded_model(const fs::path& dir, const std::vector<GPT>& known) {
  GPT loaded{nullptr};
  try {
    loaded = load_hf_checkpoint(dir.string());
  } catch (const Error& e) {
    ADD_FAILURE() << dir.string() << " does not load: " << e.what();
    return -1;
  }
  const auto got = loaded->state_dict();
  for (size_t k = 0; k < known.size(); ++k) {
    bool same = true;
    for (const auto& [name, t] : known[k]->state_dict()) same = same && equal(got.at(name), t);
    if (same) return static_cast<int>(k);
  }
  return -1;
}

// What saves into `dir` left beside it.
std::vector<std::string> leftovers(const fs::path& dir) {
  std::vector<std::string> out;
  const std::string prefix = "." + dir.filename().string() + ".kiln-";
  for (const auto& e : fs::directory_iterator(dir.parent_path())) {
    if (e.path().filename().string().starts_with(prefix)) out.push_back(e.path().filename());
  }
  return out;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Worker start_worker(const std::vector<std::string>& args) {
  return worker::start_worker(KILN_HF_PUBLISH_WORKER, args);
}

TEST(HfPublish, KilledAtEachStepLeavesThePreviousOrTheNewCheckpoint) {
  const std::vector<GPT> known = {model_of(1), model_of(2), model_of(3)};
  struct Case {
    const char* step;
    bool two_renames;
    int expect;  // 0: the previous checkpoint, 1: the new one
  };
  for (const Case& c :
       {Case{"staged", false, 0}, Case{"published", false, 1}, Case{"cleaned", false, 1},
        Case{"staged", true, 0}, Case{"moved-aside", true, 0}, Case{"published", true, 1},
        Case{"cleaned", true, 1}}) {
    SCOPED_TRACE(std::string("killed after '") + c.step + "'" +
                 (c.two_renames ? ", two renames" : ", exchange"));
    TempDir root;
    const fs::path dir = root / "ckpt";
    // The previous checkpoint: three shards; the new one: four, and other weights.
    save_hf_checkpoint(*known[0], dir.string(), 100'000);
    write_text(dir / "tokenizer.json", "{\"kept\": true}");
    std::vector<std::string> args = {dir.string(), "2:60000", "--die-at", c.step};
    if (c.two_renames) args.push_back("--two-renames");
    Worker w = start_worker(args);
    const int status = wait_worker(w);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "wait status " << status;

    if (std::string(c.step) == "moved-aside") {
      EXPECT_FALSE(fs::exists(dir)) << "between the two renames the directory is out of place";
    }
    EXPECT_EQ(loaded_model(dir, known), c.expect);
    EXPECT_EQ(leftovers(dir).empty(), std::string(c.step) == "cleaned");

    // The next save puts things right and replaces whichever is there.
    save_hf_checkpoint(*known[2], dir.string(), 100'000);
    EXPECT_EQ(loaded_model(dir, known), 2);
    EXPECT_EQ(leftovers(dir), std::vector<std::string>{});
    EXPECT_EQ(read_text(dir / "tokenizer.json"), "{\"kept\": true}");
  }
}

TEST(HfPublish, RandomKillsNeverLeaveAMix) {
  const std::vector<GPT> known = {model_of(1), model_of(2)};
  TempDir root;
  const fs::path dir = root / "ckpt";
  // How long a save takes here, to spread the kills over a few of them.
  const auto t0 = std::chrono::steady_clock::now();
  save_hf_checkpoint(*known[1], (root / "timing").string(), 100'000);
  const auto save_us =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  save_hf_checkpoint(*known[0], dir.string(), 100'000);

  std::mt19937_64 rng(20261126);
  int seen[2] = {0, 0};
  constexpr int kKills = 24;
  for (int i = 0; i < kKills; ++i) {
    // The two models alternate with the same three shard files: what overwriting one shard
    // after the other would mix without any load error.
    std::vector<std::string> args = {dir.string(), "2:100000,1:100000"};
    const bool two_renames = i % 2 == 1;
    if (two_renames) args.push_back("--two-renames");
    Worker w = start_worker(args);
    ASSERT_TRUE(wait_ready(w)) << "the worker did not start";
    const auto delay =
        std::chrono::microseconds(std::uniform_int_distribution<int64_t>(0, 3 * save_us)(rng));
    std::this_thread::sleep_for(delay);
    ::kill(w.pid, SIGKILL);
    const int status = wait_worker(w);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the worker ended by itself, wait status " << status;
    const int got = loaded_model(dir, known);
    ASSERT_GE(got, 0) << "kill " << i << " after " << delay.count() << " us (a save takes about "
                      << save_us << " us" << (two_renames ? ", two renames" : "")
                      << "): the checkpoint is neither the previous nor the new one";
    ++seen[got];
  }
  std::cout << "[ kills    ] " << kKills << " kills: " << seen[0] << " left seed 1, " << seen[1]
            << " left seed 2 (a save takes about " << save_us << " us)\n";
  save_hf_checkpoint(*known[1], dir.string(), 100'000);
  EXPECT_EQ(loaded_model(dir, known), 1);
  EXPECT_EQ(leftovers(dir), std::vector<std::string>{});
}

TEST(HfPublish, ReplacesTheDirectoryAndKeepsItsOtherFiles) {
  manual_seed(0);
  GPT model(ModelConfig::from_name("tiny-llama"));
  TempDir root;
  const fs::path dir = root / "ckpt";
  save_hf_checkpoint(*model, dir.string(), 100'000);
  fs::create_directories(dir / "extra");
  write_text(dir / "extra" / "notes.txt", "notes");
  write_text(dir / "README.md", "readme");
  fs::create_symlink("README.md", dir / "link.md");
  fs::permissions(dir, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec);
  // A trailing "/." names the same directory; the save replaces it, not a child.
  save_hf_checkpoint(*model, (dir / ".").string());
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"README.md", "config.json", "extra", "link.md",
                                             "model.safetensors"}));
  EXPECT_EQ(read_text(dir / "extra" / "notes.txt"), "notes");
  EXPECT_TRUE(fs::is_symlink(dir / "link.md"));
  EXPECT_EQ(fs::status(dir).permissions() & fs::perms::all,
            fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec);
  EXPECT_EQ(leftovers(dir), std::vector<std::string>{});

  // Through a symbolic link: the directory it names is replaced, the link stays.
  fs::create_directory_symlink(dir, root / "alias");
  save_hf_checkpoint(*model, (root / "alias").string(), 100'000);
  EXPECT_TRUE(fs::is_symlink(root / "alias"));
  EXPECT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors"));

  // A file in the way is an error, not replaced.
  write_text(root / "file", "x");
  EXPECT_KILN_ERROR(save_hf_checkpoint(*model, (root / "file").string()),
                    "exists and is not a directory");
  EXPECT_EQ(read_text(root / "file"), "x");
  EXPECT_EQ(leftovers(root / "file"), std::vector<std::string>{});
}

}  // namespace
}  // namespace kiln::models
