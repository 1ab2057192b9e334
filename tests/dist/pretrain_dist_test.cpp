// `kiln run --nproc-per-node 2 kiln pretrain --dist ddp|zero3` on the CPU (Gloo): the run equals
// one process training on the global batch (losses and weights), its checkpoints hold the full
// model and optimizer state, so a run resumes in one process or at another world size, and
// rank 0 alone reports; compiled (--compile) under ddp and zero2/zero3 too, a compiled sharded
// run resuming from its own checkpoint. Bad --dist values are clear errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>

#include "models/trainer.h"
#include "nn/safetensors.h"
#include "spawn.h"
#include "tensor/ops.h"

namespace kiln::dist {
namespace {

namespace fs = std::filesystem;
using std::chrono::seconds;
using testing::free_port;
using testing::JobResult;
using testing::run_job;

// A job's deadline: 50 s, five times that in a sanitized build (KILN_SANITIZE: ASan + UBSan, under
// which the tests run three to five times as long, docs/testing.md); ctest's bound on each test of
// dist scales likewise (tests/CMakeLists.txt). g++ defines __SANITIZE_ADDRESS__ under
// -fsanitize=address, clang has __has_feature(address_sanitizer).
#if defined(__SANITIZE_ADDRESS__)
#define KILN_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KILN_TEST_SANITIZED 1
#endif
#endif
#ifdef KILN_TEST_SANITIZED
constexpr seconds kJobDeadline{250};
#else
constexpr seconds kJobDeadline{50};
#endif

class PretrainDistTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kiln_pretrain_dist_XXXXXX";
    dir_ = ::mkdtemp(tmpl);
    data_ = dir_ + "/data.txt";
    std::ofstream f(data_);
    for (int i = 0; i < 400; ++i) {
      f << "line " << i << ": the quick brown fox jumps over the lazy dog " << (i * 7919) % 1000
        << "\n";
    }
  }
  void TearDown() override { fs::remove_all(dir_); }

  // kiln pretrain on kiln-tiny, f32 on the CPU, a 4-step schedule, stopping at `steps`.
  std::vector<std::string> pretrain_args(const std::string& out, int64_t batch, int64_t steps) {
    return {KILN_CLI,
            "pretrain",
            "--config",
            "kiln-tiny",
            "--data",
            data_,
            "--batch",
            std::to_string(batch),
            "--seq",
            "32",
            "--steps",
            std::to_string(steps),
            "--lr-decay-steps",
            "4",
            "--device",
            "cpu",
            "--no-progress",
            "--out",
            dir_ + "/" + out};
  }
  JobResult one_process(std::vector<std::string> args) { return run_job(args, 1, kJobDeadline); }
  JobResult two_ranks(const std::vector<std::string>& args) {
    std::vector<std::string> argv{
        KILN_CLI, "run", "--master-port", std::to_string(free_port()), "--nproc-per-node", "2"};
    argv.insert(argv.end(), args.begin(), args.end());
    return run_job(argv, 1, kJobDeadline);
  }
  TensorMap weights(const std::string& out) {
    const auto info = models::read_checkpoint_info(dir_ + "/" + out);
    EXPECT_TRUE(info.has_value()) << out;
    return load_safetensors(dir_ + "/" + out + "/" + info->model_file);
  }
  void expect_same_weights(const std::string& a, const std::string& b, double tol) {
    const TensorMap wa = weights(a), wb = weights(b);
    ASSERT_EQ(wa.size(), wb.size());
    for (const auto& [name, t] : wa) {
      ASSERT_TRUE(wb.contains(name)) << name;
      EXPECT_TRUE(allclose(t, wb.at(name), tol, tol))
          << a << " vs " << b << ": " << name << " differ by up to "
          << (t - wb.at(name)).abs().max().item<double>();
    }
  }
  static std::vector<std::string> loss_lines(const std::string& output) {
    std::vector<std::string> out;
    const std::regex re(R"(step (\d+)/\d+ \| loss ([0-9.]+))");
    for (auto it = std::sregex_iterator(output.begin(), output.end(), re);
         it != std::sregex_iterator(); ++it) {
      out.push_back((*it)[1].str() + ":" + (*it)[2].str());
    }
    return out;
  }

  std::string dir_, data_;
};

TEST_F(PretrainDistTest, DdpEqualsOneProcessOnTheGlobalBatch) {
  const JobResult one = one_process(pretrain_args("one", 4, 4));
  ASSERT_TRUE(one.all_ok()) << one.describe();
  auto args = pretrain_args("ddp", 2, 4);
  args.insert(args.end(), {"--dist", "ddp"});
  const JobResult ddp = two_ranks(args);
  ASSERT_TRUE(ddp.all_ok()) << ddp.describe();
  const std::string& out = ddp.ranks[0].output;
  // Rank 0 alone reports, with the global batch.
  EXPECT_NE(out.find("[rank0]: done:"), std::string::npos) << out;
  EXPECT_EQ(out.find("[rank1]: step"), std::string::npos) << out;
  EXPECT_NE(out.find("x 2 ranks (ddp) = 128 tokens/step"), std::string::npos) << out;
  // The same losses (4 digits) and weights as one process on batch 2 x 2.
  EXPECT_EQ(loss_lines(one.ranks[0].output), loss_lines(out));
  EXPECT_FALSE(loss_lines(out).empty()) << out;
  expect_same_weights("one", "ddp", 1e-4);
}

TEST_F(PretrainDistTest, TiedDdpEqualsOneProcess) {
  // A tied LM head: DDP all-reduces the table's gradient from the head and all-gathers the
  // embedding lookup's rows (DistributedDataParallel::gathered_embedding).
  auto tied = [](std::vector<std::string> args) {
    *std::find(args.begin(), args.end(), "kiln-tiny") = "tiny-gemma";
    return args;
  };
  const JobResult one = one_process(tied(pretrain_args("one", 4, 4)));
  ASSERT_TRUE(one.all_ok()) << one.describe();
  auto args = tied(pretrain_args("ddp", 2, 4));
  args.insert(args.end(), {"--dist", "ddp"});
  const JobResult ddp = two_ranks(args);
  ASSERT_TRUE(ddp.all_ok()) << ddp.describe();
  EXPECT_EQ(loss_lines(one.ranks[0].output), loss_lines(ddp.ranks[0].output));
  EXPECT_FALSE(loss_lines(ddp.ranks[0].output).empty()) << ddp.ranks[0].output;
  expect_same_weights("one", "ddp", 1e-4);
}

TEST_F(PretrainDistTest, CompiledDdpEqualsOneProcess) {
  // The compiled step records DDP's all-reduces (dist/collective_ops.h) and replays them.
  const JobResult one = one_process(pretrain_args("one", 4, 4));
  ASSERT_TRUE(one.all_ok()) << one.describe();
  auto args = pretrain_args("cddp", 2, 4);
  args.insert(args.end(), {"--dist", "ddp", "--compile"});
  const JobResult ddp = two_ranks(args);
  ASSERT_TRUE(ddp.all_ok()) << ddp.describe();
  const std::string& out = ddp.ranks[0].output;
  EXPECT_NE(out.find("compile: "), std::string::npos) << out;
  EXPECT_EQ(loss_lines(one.ranks[0].output), loss_lines(out));
  EXPECT_FALSE(loss_lines(out).empty()) << out;
  expect_same_weights("one", "cddp", 1e-4);
}

TEST_F(PretrainDistTest, FsdpCheckpointsResumeInOneProcessAndOnTwoRanks) {
  const JobResult one = one_process(pretrain_args("one", 4, 4));
  ASSERT_TRUE(one.all_ok()) << one.describe();
  // Steps 1-2 sharded over 2 ranks (ZeRO-3), step 3 in one process, step 4 sharded again
  // (ZeRO-2): the checkpoints hold the full optimizer state (gathered), sliced again on the way
  // back; each block is gathered as the forward reaches it (models/gpt_hooks.h).
  auto args = pretrain_args("z", 2, 2);
  args.insert(args.end(), {"--dist", "zero3"});
  JobResult r = two_ranks(args);
  ASSERT_TRUE(r.all_ok()) << r.describe();
  auto single = pretrain_args("z", 4, 3);
  single.push_back("--resume");
  r = one_process(single);
  ASSERT_TRUE(r.all_ok()) << r.describe();
  EXPECT_NE(r.ranks[0].output.find("resumed from"), std::string::npos) << r.ranks[0].output;
  args = pretrain_args("z", 2, 4);
  args.insert(args.end(), {"--dist", "zero2", "--resume"});
  r = two_ranks(args);
  ASSERT_TRUE(r.all_ok()) << r.describe();
  expect_same_weights("one", "z", 1e-4);
}

TEST_F(PretrainDistTest, BadDistIsAClearError) {
  auto args = pretrain_args("bad", 2, 1);
  args.insert(args.end(), {"--dist", "zero1"});
  JobResult r = one_process(args);
  ASSERT_EQ(r.ranks.size(), 1u);
  EXPECT_NE(r.ranks[0].exit_code, 0);
  EXPECT_NE(
      r.ranks[0].output.find("--dist must be ddp, zero2, zero3 or fsdp (= zero3), got 'zero1'"),
      std::string::npos)
      << r.ranks[0].output;
}

TEST_F(PretrainDistTest, CompiledFsdpEqualsOneProcessAndResumes) {
  // The compiled step records FSDP's gathers and reduce-scatters (dist/collective_ops.h): steps
  // 1-2 compiled under ZeRO-3 on 2 ranks, then steps 3-4 compiled under ZeRO-2 resumed from the
  // checkpoint the compiled run wrote; the same losses and weights as one process on the global
  // batch.
  const JobResult one = one_process(pretrain_args("one", 4, 4));
  ASSERT_TRUE(one.all_ok()) << one.describe();
  auto args = pretrain_args("cz", 2, 2);
  args.insert(args.end(), {"--dist", "zero3", "--compile"});
  JobResult first = two_ranks(args);
  ASSERT_TRUE(first.all_ok()) << first.describe();
  EXPECT_NE(first.ranks[0].output.find("compile: 2 traces"), std::string::npos)
      << first.ranks[0].output;
  args = pretrain_args("cz", 2, 4);
  args.insert(args.end(), {"--dist", "zero2", "--compile", "--resume"});
  JobResult second = two_ranks(args);
  ASSERT_TRUE(second.all_ok()) << second.describe();
  EXPECT_NE(second.ranks[0].output.find("resumed from"), std::string::npos)
      << second.ranks[0].output;
  std::vector<std::string> losses = loss_lines(first.ranks[0].output);
  for (const std::string& l : loss_lines(second.ranks[0].output)) losses.push_back(l);
  EXPECT_EQ(loss_lines(one.ranks[0].output), losses);
  EXPECT_EQ(losses.size(), 4u) << first.ranks[0].output << second.ranks[0].output;
  expect_same_weights("one", "cz", 1e-4);
}

}  // namespace
}  // namespace kiln::dist
