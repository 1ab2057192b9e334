// Test helpers: runs the dist_worker program (tests/dist/dist_worker.cpp) as the ranks of a job,
// each a separate process (fork + exec: nothing of the test's own threads is inherited), with
// RANK, WORLD_SIZE, ... set, and waits for them with a deadline: past it every rank is killed
// and the test fails instead of hanging.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace kiln::dist::testing {

// A TCP port that was free a moment ago (the kernel's choice for port 0).
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

struct RankResult {
  int exit_code = -1;  // -1: killed by a signal or by the deadline
  std::string output;  // stdout and stderr together
};

struct JobResult {
  std::vector<RankResult> ranks;
  bool timed_out = false;
  bool all_ok() const {
    if (timed_out) return false;
    for (const auto& r : ranks) {
      if (r.exit_code != 0) return false;
    }
    return true;
  }
  std::string describe() const {
    std::ostringstream os;
    if (timed_out) os << "(the job hit its deadline and was killed)\n";
    for (size_t r = 0; r < ranks.size(); ++r) {
      os << "--- rank " << r << " exit " << ranks[r].exit_code << "\n" << ranks[r].output;
    }
    return os.str();
  }
};

// Runs `program args...` as `world` processes (or any argv when program is given whole) with the
// torchrun environment. `extra_env` adds "NAME=value" entries.
inline JobResult run_job(const std::vector<std::string>& argv, int world,
                         std::chrono::milliseconds deadline = std::chrono::seconds(30),
                         const std::vector<std::string>& extra_env = {}) {
  const int port = free_port();
  char dir_template[] = "/tmp/kiln_dist_test_XXXXXX";
  const std::string dir = ::mkdtemp(dir_template);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const std::string out = dir + "/rank" + std::to_string(r) + ".log";
    const pid_t pid = ::fork();
    if (pid == 0) {
      const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("OMP_NUM_THREADS", "1", 1);
      for (const auto& e : extra_env) ::putenv(const_cast<char*>(e.c_str()));
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  JobResult result;
  result.ranks.resize(world);
  const auto end = std::chrono::steady_clock::now() + deadline;
  int running = world;
  while (running > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (int r = 0; r < world; ++r) {
        if (pids[r] == pid) {
          result.ranks[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
          pids[r] = -1;
          --running;
        }
      }
      continue;
    }
    if (std::chrono::steady_clock::now() > end) {
      result.timed_out = true;
      for (pid_t p : pids) {
        if (p > 0) ::kill(p, SIGKILL);
      }
      for (pid_t p : pids) {
        if (p > 0) ::waitpid(p, nullptr, 0);
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (int r = 0; r < world; ++r) {
    const std::string out = dir + "/rank" + std::to_string(r) + ".log";
    std::ifstream in(out);
    std::stringstream ss;
    ss << in.rdbuf();
    result.ranks[r].output = ss.str();
    ::unlink(out.c_str());
  }
  ::rmdir(dir.c_str());
  return result;
}

// The worker program with one scenario.
inline JobResult run_workers(const std::string& scenario, int world,
                             std::chrono::milliseconds deadline = std::chrono::seconds(30),
                             const std::vector<std::string>& extra_env = {}) {
  return run_job({KILN_DIST_WORKER, scenario}, world, deadline, extra_env);
}

}  // namespace kiln::dist::testing
