// `kiln run` (dist/launcher.h): the environment of each rank on one node and as node 1 of 2,
// output prefixed with the rank, a failing rank stopping the others with a message naming it and
// its status, SIGKILL after the grace period, SIGTERM forwarded, usage errors, a program that
// cannot be executed, and a Gloo job through the launcher with a rank killed mid-step.
#include <gtest/gtest.h>

#include <fstream>

#include "spawn.h"

namespace kiln::dist {
namespace {

using std::chrono::seconds;
using testing::free_port;
using testing::JobResult;
using testing::run_job;

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// `kiln run ARGS...` (with a free --master-port), bounded by `deadline`.
JobResult kiln_run(std::vector<std::string> args, seconds deadline = seconds(30),
                   int* port_out = nullptr) {
  const int port = free_port();
  if (port_out) *port_out = port;
  std::vector<std::string> argv{KILN_CLI, "run", "--master-port", std::to_string(port)};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_job(argv, 1, deadline);
}

const char kPrintEnv[] =
    "echo \"r=$RANK l=$LOCAL_RANK w=$WORLD_SIZE lw=$LOCAL_WORLD_SIZE g=$GROUP_RANK "
    "m=$MASTER_ADDR:$MASTER_PORT omp=$OMP_NUM_THREADS\"; echo to-stderr >&2; printf partial";

TEST(LauncherTest, EnvironmentAndPrefixedOutput) {
  int port = 0;
  auto job = kiln_run({"--nproc-per-node", "3", "/bin/sh", "-c", kPrintEnv}, seconds(30), &port);
  ASSERT_FALSE(job.timed_out);
  const std::string& out = job.ranks[0].output;
  EXPECT_EQ(job.ranks[0].exit_code, 0) << out;
  for (int r = 0; r < 3; ++r) {
    const std::string p = "[rank" + std::to_string(r) + "]: ";
    EXPECT_TRUE(contains(out, p + "r=" + std::to_string(r) + " l=" + std::to_string(r) +
                                  " w=3 lw=3 g=0 m=127.0.0.1:" + std::to_string(port) + " omp=1\n"))
        << out;
    EXPECT_TRUE(contains(out, p + "to-stderr\n")) << out;
    EXPECT_TRUE(contains(out, p + "partial\n")) << out;  // a last line without a newline
  }
}

TEST(LauncherTest, SecondNodeOfTwo) {
  int port = 0;
  auto job = kiln_run({"--nnodes=2", "--node_rank", "1", "--nproc-per-node", "2", "--master-addr",
                       "10.1.2.3", "--", "/bin/sh", "-c", kPrintEnv},
                      seconds(30), &port);
  const std::string& out = job.ranks[0].output;
  EXPECT_EQ(job.ranks[0].exit_code, 0) << out;
  const std::string m = " m=10.1.2.3:" + std::to_string(port);
  EXPECT_TRUE(contains(out, "[rank2]: r=2 l=0 w=4 lw=2 g=1" + m)) << out;
  EXPECT_TRUE(contains(out, "[rank3]: r=3 l=1 w=4 lw=2 g=1" + m)) << out;
  EXPECT_FALSE(contains(out, "[rank0]")) << out;
}

TEST(LauncherTest, FailingRankStopsTheOthers) {
  auto job = kiln_run({"--nproc-per-node", "3", "/bin/sh", "-c",
                       "if [ \"$RANK\" = 1 ]; then exit 3; fi; exec sleep 60"},
                      seconds(20));
  ASSERT_FALSE(job.timed_out) << job.describe();
  const std::string& out = job.ranks[0].output;
  EXPECT_EQ(job.ranks[0].exit_code, 3) << out;
  EXPECT_TRUE(contains(out, "kiln run: rank 1 (local rank 1, pid ")) << out;
  EXPECT_TRUE(contains(out, ") exited with status 3; stopping the other ranks")) << out;
  EXPECT_TRUE(contains(out, "kiln run: the job failed: rank 1 exited with status 3 (then rank 0 "
                            "was killed by signal 15 (SIGTERM); rank 2 was killed by signal 15"))
      << out;
}

TEST(LauncherTest, RankIgnoringSigtermIsKilledAfterTheGracePeriod) {
  // Rank 0 fails once rank 1 ignores SIGTERM (the file says so).
  auto job = kiln_run({"--nproc-per-node", "2", "--term-timeout", "0.5", "/bin/sh", "-c",
                       "f=/tmp/kiln_launcher_trap_$MASTER_PORT; if [ \"$RANK\" = 0 ]; then "
                       "while [ ! -e $f ]; do sleep 0.02; done; rm -f $f; exit 1; fi; "
                       "trap '' TERM; touch $f; while true; do sleep 0.1; done"},
                      seconds(20));
  ASSERT_FALSE(job.timed_out) << job.describe();
  const std::string& out = job.ranks[0].output;
  EXPECT_EQ(job.ranks[0].exit_code, 1) << out;
  EXPECT_TRUE(contains(out, "rank 1 did not stop within 0.5")) << out;
  EXPECT_TRUE(contains(out, "rank 1 was killed by signal 9 (SIGKILL)")) << out;
}

TEST(LauncherTest, ForwardsSigterm) {
  char path[] = "/tmp/kiln_launcher_test_XXXXXX";
  const int fd = ::mkstemp(path);
  const int port = free_port();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::execl(KILN_CLI, KILN_CLI, "run", "--master-port", std::to_string(port).c_str(),
            "--nproc-per-node", "2", "/bin/sh", "-c",
            "trap 'echo got TERM; exit 0' TERM; echo ready; while true; do sleep 0.05; done",
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(fd);
  auto read_out = [&] {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  const auto end = std::chrono::steady_clock::now() + seconds(20);
  while (!(contains(read_out(), "[rank0]: ready") && contains(read_out(), "[rank1]: ready")) &&
         std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(pid, SIGTERM);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0 && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const bool exited = WIFEXITED(status);
  if (!exited) ::kill(pid, SIGKILL), ::waitpid(pid, &status, 0);
  const std::string out = read_out();
  ::unlink(path);
  ASSERT_TRUE(exited) << out;
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << out;
  EXPECT_TRUE(contains(out, "kiln run: got SIGTERM, forwarding it to the ranks")) << out;
  EXPECT_TRUE(contains(out, "[rank0]: got TERM")) << out;
  EXPECT_TRUE(contains(out, "[rank1]: got TERM")) << out;
}

TEST(LauncherTest, UsageErrors) {
  auto job = kiln_run({"--nproc-per-node", "2"});
  EXPECT_EQ(job.ranks[0].exit_code, 2);
  EXPECT_TRUE(contains(job.ranks[0].output, "kiln run: no program to run")) << job.describe();
  job = kiln_run({"--nnodes", "2", "--node-rank", "2", "--nproc-per-node", "1", "true"});
  EXPECT_EQ(job.ranks[0].exit_code, 2);
  EXPECT_TRUE(contains(job.ranks[0].output, "--node-rank 2 must be less than --nnodes 2"))
      << job.describe();
  job = kiln_run({"--nproc-per-node", "zero", "true"});
  EXPECT_EQ(job.ranks[0].exit_code, 2);
  EXPECT_TRUE(contains(job.ranks[0].output, "--nproc-per-node expects an integer, got 'zero'"));
  job = kiln_run({"--procs", "2", "true"});
  EXPECT_EQ(job.ranks[0].exit_code, 2);
  EXPECT_TRUE(contains(job.ranks[0].output, "unknown flag '--procs'"));
  EXPECT_TRUE(contains(job.ranks[0].output, "usage: kiln run --nproc-per-node N"));
}

TEST(LauncherTest, ProgramThatCannotBeExecuted) {
  auto job = kiln_run({"--nproc-per-node", "2", "/nonexistent/program"});
  ASSERT_FALSE(job.timed_out);
  EXPECT_EQ(job.ranks[0].exit_code, 127);
  EXPECT_TRUE(contains(job.ranks[0].output,
                       "kiln run: cannot execute '/nonexistent/program': No such file"))
      << job.describe();
}

TEST(LauncherTest, GlooJobThroughTheLauncher) {
  auto job = kiln_run({"--nproc-per-node", "2", KILN_DIST_WORKER, "collectives"});
  ASSERT_FALSE(job.timed_out) << job.describe();
  EXPECT_EQ(job.ranks[0].exit_code, 0) << job.describe();
  EXPECT_TRUE(contains(job.ranks[0].output, "[rank1]: rank 1: collectives ok")) << job.describe();
}

TEST(LauncherTest, RankKilledMidStepEndsTheJob) {
  auto job = kiln_run({"--nproc-per-node", "3", KILN_DIST_WORKER, "killed_mid_step"}, seconds(30));
  ASSERT_FALSE(job.timed_out) << job.describe();
  const std::string& out = job.ranks[0].output;
  EXPECT_EQ(job.ranks[0].exit_code, 128 + SIGKILL) << out;
  EXPECT_TRUE(contains(out, "kiln run: the job failed: rank 1 was killed by signal 9 (SIGKILL)"))
      << out;
}

}  // namespace
}  // namespace kiln::dist
