// The launcher's loop: one poll(2) over the ranks' output pipes and a self-pipe that the signal
// handler writes to; children are reaped with waitpid(WNOHANG) every pass (at most 50 ms apart).
#include "dist/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace kiln::dist {
namespace {

using Clock = std::chrono::steady_clock;

const char kUsage[] =
    "usage: kiln run --nproc-per-node N [--nnodes M --node-rank R] [--master-addr A]\n"
    "                [--master-port P] [--term-timeout S] [--] program [args...]\n"
    "  Starts N ranks of `program` on this node (ranks R*N .. R*N+N-1 of M*N) with RANK,\n"
    "  LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT set.\n"
    "  --nproc-per-node N  ranks on this node (required)\n"
    "  --nnodes M          nodes of the job (default 1); run the launcher once on every node\n"
    "  --node-rank R       this node's number in [0, M) (default 0)\n"
    "  --master-addr A     the address of node 0, where rank 0 serves the store (127.0.0.1)\n"
    "  --master-port P     its port (default 29500)\n"
    "  --term-timeout S    seconds between SIGTERM and SIGKILL when stopping ranks (default 5)\n";

struct Options {
  int nproc_per_node = 0;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  double term_timeout = 5;
  std::vector<std::string> program;
};

struct BadArgs {
  std::string message;
};

int parse_int(const std::string& flag, const std::string& v, int lo, int hi) {
  int out = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec != std::errc() || end != v.data() + v.size() || v.empty()) {
    throw BadArgs{flag + " expects an integer, got '" + v + "'"};
  }
  if (out < lo || out > hi) {
    throw BadArgs{flag + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                  "], got " + v};
  }
  return out;
}

Options parse(const std::vector<std::string>& args) {
  Options o;
  size_t i = 0;
  bool have_nproc = false;
  while (i < args.size()) {
    std::string a = args[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a.rfind("--", 0) != 0) break;  // the program
    std::string value;
    bool has_value = false;
    if (auto eq = a.find('='); eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
      has_value = true;
    }
    for (char& c : a) {
      if (c == '_') c = '-';  // torchrun accepts --nproc_per_node too
    }
    auto take = [&]() {
      if (has_value) return value;
      if (i + 1 >= args.size()) throw BadArgs{a + " needs a value"};
      return args[++i];
    };
    if (a == "--nproc-per-node") {
      o.nproc_per_node = parse_int(a, take(), 1, 4096);
      have_nproc = true;
    } else if (a == "--nnodes") {
      o.nnodes = parse_int(a, take(), 1, 1 << 20);
    } else if (a == "--node-rank") {
      o.node_rank = parse_int(a, take(), 0, 1 << 20);
    } else if (a == "--master-addr") {
      o.master_addr = take();
      if (o.master_addr.empty()) throw BadArgs{"--master-addr is empty"};
    } else if (a == "--master-port") {
      o.master_port = parse_int(a, take(), 1, 65535);
    } else if (a == "--term-timeout") {
      const std::string v = take();
      char* end = nullptr;
      o.term_timeout = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || o.term_timeout < 0) {
        throw BadArgs{"--term-timeout expects seconds >= 0, got '" + v + "'"};
      }
    } else {
      throw BadArgs{"unknown flag '" + a + "'"};
    }
    ++i;
  }
  o.program.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  if (!have_nproc) throw BadArgs{"--nproc-per-node is required"};
  if (o.program.empty()) throw BadArgs{"no program to run"};
  if (o.node_rank >= o.nnodes) {
    throw BadArgs{"--node-rank " + std::to_string(o.node_rank) + " must be less than --nnodes " +
                  std::to_string(o.nnodes)};
  }
  return o;
}

int signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const int saved = errno;
  const unsigned char c = static_cast<unsigned char>(sig);
  [[maybe_unused]] auto r = ::write(signal_pipe[1], &c, 1);
  errno = saved;
}

void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

void say(const std::string& s) { write_all(2, "kiln run: " + s + "\n"); }

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = ::sigabbrev_np(sig);
    return "was killed by signal " + std::to_string(sig) + " (SIG" + (name ? name : "?") + ")";
  }
  return "ended with wait status " + std::to_string(status);
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

struct Rank {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  int out_fd = -1;  // read ends of the rank's stdout and stderr
  int err_fd = -1;
  std::string out_buf;
  std::string err_buf;
};

// Writes the complete lines of `buf` (all of it when `flush`) with the rank's prefix.
void emit(const Rank& r, std::string& buf, int fd, bool flush) {
  const std::string prefix = "[rank" + std::to_string(r.rank) + "]: ";
  std::string out;
  size_t start = 0;
  for (;;) {
    const size_t nl = buf.find('\n', start);
    if (nl == std::string::npos) break;
    out += prefix;
    out.append(buf, start, nl + 1 - start);
    start = nl + 1;
  }
  if (flush && start < buf.size()) {
    out += prefix;
    out.append(buf, start, std::string::npos);
    out += '\n';
    start = buf.size();
  }
  buf.erase(0, start);
  if (!out.empty()) write_all(fd, out);
}

// Reads what is available on `fd` into `buf`; closes it and returns -1 at EOF.
int drain(int fd, std::string& buf) {
  char chunk[65536];
  for (;;) {
    const ssize_t n = ::read(fd, chunk, sizeof(chunk));
    if (n > 0) {
      buf.append(chunk, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return fd;
    ::close(fd);
    return -1;
  }
}

[[noreturn]] void exec_rank(const Options& o, const Rank& r, int out_w, int err_w,
                            pid_t launcher) {
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) ::_exit(1);  // the launcher died before prctl
  ::signal(SIGINT, SIG_DFL);
  ::signal(SIGTERM, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  // A rank in its own process group that read the terminal would be stopped (SIGTTIN).
  const int null_fd = ::open("/dev/null", O_RDONLY);
  if (null_fd >= 0) ::dup2(null_fd, 0);
  ::dup2(out_w, 1);
  ::dup2(err_w, 2);
  const int world = o.nnodes * o.nproc_per_node;
  ::setenv("RANK", std::to_string(r.rank).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(r.local_rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node).c_str(), 1);
  ::setenv("GROUP_RANK", std::to_string(o.node_rank).c_str(), 1);
  ::setenv("MASTER_ADDR", o.master_addr.c_str(), 1);
  ::setenv("MASTER_PORT", std::to_string(o.master_port).c_str(), 1);
  if (o.nproc_per_node > 1) ::setenv("OMP_NUM_THREADS", "1", /*overwrite=*/0);
  std::vector<char*> argv;
  for (const auto& a : o.program) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  const std::string msg =
      "kiln run: cannot execute '" + o.program[0] + "': " + std::strerror(errno) + "\n";
  write_all(2, msg);
  ::_exit(127);
}

int run(const Options& o) {
  if (::pipe2(signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    say(std::string("pipe failed: ") + std::strerror(errno));
    return 1;
  }
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  struct sigaction old_int {}, old_term {};
  ::sigaction(SIGINT, &sa, &old_int);
  ::sigaction(SIGTERM, &sa, &old_term);

  const pid_t self = ::getpid();
  std::vector<Rank> ranks(o.nproc_per_node);
  for (int l = 0; l < o.nproc_per_node; ++l) {
    Rank& r = ranks[l];
    r.local_rank = l;
    r.rank = o.node_rank * o.nproc_per_node + l;
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
      say(std::string("pipe failed: ") + std::strerror(errno));
      return 1;
    }
    const pid_t pid = ::fork();
    if (pid == 0) exec_rank(o, r, out[1], err[1], self);
    ::close(out[1]);
    ::close(err[1]);
    if (pid < 0) {
      say(std::string("fork failed: ") + std::strerror(errno) + "; stopping the started ranks");
      ::close(out[0]);
      ::close(err[0]);
      for (auto& started : ranks) {
        if (started.running) {
          ::kill(-started.pid, SIGKILL);
          ::waitpid(started.pid, nullptr, 0);
        }
      }
      return 1;
    }
    ::setpgid(pid, pid);  // also in the child: whichever runs first
    r.pid = pid;
    r.running = true;
    r.out_fd = out[0];
    r.err_fd = err[0];
    ::fcntl(r.out_fd, F_SETFL, O_NONBLOCK);
    ::fcntl(r.err_fd, F_SETFL, O_NONBLOCK);
  }

  const auto grace = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(o.term_timeout));
  std::optional<Clock::time_point> kill_at;  // when the stopped ranks get SIGKILL
  int failed = -1;                           // index of the first rank that failed
  int interrupted = 0;                       // the signal the launcher got
  bool killed = false;
  auto stop_all = [&](int sig) {
    for (auto& r : ranks) {
      if (r.running) ::kill(-r.pid, sig);
    }
  };

  for (;;) {
    int running = 0;
    for (const auto& r : ranks) running += r.running;
    bool pipes_open = false;
    for (const auto& r : ranks) pipes_open |= r.out_fd >= 0 || r.err_fd >= 0;
    if (running == 0 && !pipes_open) break;

    std::vector<pollfd> fds{{signal_pipe[0], POLLIN, 0}};
    for (const auto& r : ranks) {
      if (r.out_fd >= 0) fds.push_back({r.out_fd, POLLIN, 0});
      if (r.err_fd >= 0) fds.push_back({r.err_fd, POLLIN, 0});
    }
    ::poll(fds.data(), fds.size(), 50);

    unsigned char sig = 0;
    while (::read(signal_pipe[0], &sig, 1) == 1) {
      if (!interrupted) {
        const char* name = ::sigabbrev_np(sig);
        say(std::string("got SIG") + (name ? name : "?") + ", forwarding it to the ranks");
      }
      interrupted = sig;
      stop_all(sig);
      if (!kill_at) kill_at = Clock::now() + grace;
    }
    for (auto& r : ranks) {
      if (r.out_fd >= 0) r.out_fd = drain(r.out_fd, r.out_buf);
      emit(r, r.out_buf, 1, r.out_fd < 0);
      if (r.err_fd >= 0) r.err_fd = drain(r.err_fd, r.err_buf);
      emit(r, r.err_buf, 2, r.err_fd < 0);
    }
    // Reap; among the ranks found failed in one pass, blame one killed by a signal first (the
    // others usually failed because it vanished), else the lowest rank.
    int culprit = -1;
    for (size_t i = 0; i < ranks.size(); ++i) {
      Rank& r = ranks[i];
      if (!r.running) continue;
      int status = 0;
      if (::waitpid(r.pid, &status, WNOHANG) != r.pid) continue;
      r.running = false;
      r.status = status;
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!ok && (culprit < 0 || (WIFSIGNALED(status) && !WIFSIGNALED(ranks[culprit].status)))) {
        culprit = static_cast<int>(i);
      }
    }
    if (culprit >= 0 && failed < 0 && !interrupted && !kill_at) {
      // A rank killed by a signal takes its peers down with it a moment later (their collectives
      // fail); when the first one seen is not signalled, look for a signalled one a bit longer
      // so that the report names the cause.
      const auto look_until = Clock::now() + std::chrono::milliseconds(200);
      while (!WIFSIGNALED(ranks[culprit].status) && Clock::now() < look_until) {
        for (size_t i = 0; i < ranks.size(); ++i) {
          Rank& r = ranks[i];
          int status = 0;
          if (!r.running || ::waitpid(r.pid, &status, WNOHANG) != r.pid) continue;
          r.running = false;
          r.status = status;
          if (WIFSIGNALED(status)) culprit = static_cast<int>(i);
        }
        ::poll(nullptr, 0, 10);
      }
      failed = culprit;
      const Rank& r = ranks[culprit];
      say("rank " + std::to_string(r.rank) + " (local rank " + std::to_string(r.local_rank) +
          ", pid " + std::to_string(r.pid) + ") " + describe_status(r.status) +
          "; stopping the other ranks");
      stop_all(SIGTERM);
      kill_at = Clock::now() + grace;
    }
    // A rank that outlives the grace period, or whose pipes are held open by a process it left
    // behind, is killed with its whole process group.
    if (kill_at && Clock::now() >= *kill_at && !killed) {
      killed = true;
      for (auto& r : ranks) {
        if (r.running) {
          say("rank " + std::to_string(r.rank) + " did not stop within " +
              std::to_string(o.term_timeout) + " s of SIGTERM; sending SIGKILL");
        }
        if (r.pid > 0) ::kill(-r.pid, SIGKILL);
      }
    }
    if (killed && running == 0) {
      // Only left-behind descendants hold the pipes now: stop reading them.
      for (auto& r : ranks) {
        for (int* fd : {&r.out_fd, &r.err_fd}) {
          if (*fd >= 0) ::close(*fd);
          *fd = -1;
        }
        emit(r, r.out_buf, 1, true);
        emit(r, r.err_buf, 2, true);
      }
    }
    if (running == 0 && !kill_at) {
      // Every rank has exited; give their descendants the grace period to close the pipes.
      kill_at = Clock::now() + grace;
    }
  }

  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  ::close(signal_pipe[0]);
  ::close(signal_pipe[1]);

  if (failed >= 0) {
    const Rank& f = ranks[failed];
    std::string others;
    for (const auto& r : ranks) {
      if (&r == &f) continue;
      others += (others.empty() ? "" : "; ") + ("rank " + std::to_string(r.rank) + " " +
                                                describe_status(r.status));
    }
    say("the job failed: rank " + std::to_string(f.rank) + " " + describe_status(f.status) +
        (others.empty() ? "" : " (then " + others + ")"));
    return exit_code_of(f.status);
  }
  if (interrupted) return 128 + interrupted;
  for (const auto& r : ranks) {
    if (!(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0)) return exit_code_of(r.status);
  }
  return 0;
}

}  // namespace

const char* launcher_usage() { return kUsage; }

int launcher_main(const std::vector<std::string>& args) {
  if (args.size() == 1 && (args[0] == "--help" || args[0] == "-h")) {
    write_all(1, kUsage);
    return 0;
  }
  Options o;
  try {
    o = parse(args);
  } catch (const BadArgs& e) {
    write_all(2, "kiln run: " + e.message + "\n\n" + kUsage);
    return 2;
  }
  return run(o);
}

}  // namespace kiln::dist
