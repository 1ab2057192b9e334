// A worker process that a test kills in the middle of its work (tests/models/hf_publish_test.cpp,
// trainer_checkpoint_test.cpp): started with its stdout on a pipe, awaited with a bound.
//
//   worker::Worker w = worker::start_worker(KILN_SOME_WORKER, {dir, "--flag"});
//   ASSERT_TRUE(wait_ready(w));        // it printed "ready"
//   ::kill(w.pid, SIGKILL);
//   const int status = wait_worker(w);  // WIFSIGNALED(status) ...
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace kiln::models::worker {

struct Worker {
  pid_t pid = -1;
  int out = -1;  // read end of its stdout
};

inline Worker start_worker(const std::string& binary, const std::vector<std::string>& args) {
  int fds[2];
  EXPECT_EQ(::pipe2(fds, O_CLOEXEC), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  std::vector<std::string> argv = {binary};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargs;
  for (auto& a : argv) cargs.push_back(a.data());
  cargs.push_back(nullptr);
  Worker w;
  const int rc = ::posix_spawn(&w.pid, cargs[0], &actions, nullptr, cargs.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  EXPECT_EQ(rc, 0) << "cannot start " << binary;
  w.out = fds[0];
  return w;
}

// Waits (at most 60 s) for the worker to end; returns its wait status.
inline int wait_worker(Worker& w) {
  int status = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (::waitpid(w.pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > end) {
      ADD_FAILURE() << "the worker did not end within 60 s";
      ::kill(w.pid, SIGKILL);
      ::waitpid(w.pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ::close(w.out);
  return status;
}

// Whether the worker wrote "ready" within 60 s.
inline bool wait_ready(const Worker& w) {
  std::string got;
  while (got.find("ready\n") == std::string::npos) {
    pollfd p{w.out, POLLIN, 0};
    if (::poll(&p, 1, 60'000) <= 0) return false;
    char buf[64];
    const ssize_t n = ::read(w.out, buf, sizeof(buf));
    if (n <= 0) return false;
    got.append(buf, static_cast<size_t>(n));
  }
  return true;
}

}  // namespace kiln::models::worker
