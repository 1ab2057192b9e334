// Where a program's time goes: every kernel the dispatcher runs (eager ops, a compiled program's
// steps, decompositions' ops), timed and added up per op and kernel. `kiln bench --profile`
// prints it per kernel family.
//
//   kiln::profiler::Profiler prof;
//   prof.start();
//   step();                       // any kiln code, on any thread
//   prof.stop();
//   for (const auto& r : prof.results()) ...   // per (op, kernel, device): calls, milliseconds
//
// CUDA kernels are timed with a pair of timing events on the current stream around each launch
// (GPU time, read when results() synchronises), CPU kernels with the wall clock around the call.
// Views and decompositions are not kernels: a decomposition's ops are counted one by one.
//
// Pitfalls:
//   - The events cost about 2 x 2 µs of launch time per CUDA kernel: profile a few steps apart
//     from the timed ones, and read the GPU times, not the wall time of a profiled step.
//   - One profiler records at a time (start() fails while another is recording). CPU kernels
//     running on worker threads inside a kernel are part of that kernel's time.
//   - A kernel counts when it ends while its profiler records: one that another thread is
//     running when stop() is called is not counted (stop() does not wait for it, and a profiler
//     may be destroyed while other threads run kernels).
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "tensor/registry.h"

namespace kiln::profiler {

struct KernelTime {
  std::string op;      // the registry op
  std::string kernel;  // its kernel's name ("" for an op's only kernel)
  Device device = Device(kCPU);
  int64_t calls = 0;
  double ms = 0;  // summed over the calls
  // The compiled program's executor whose step ran it (ExecutorLabel); "" outside compiled
  // programs (eager code).
  std::string executor;
};

class Profiler {
 public:
  Profiler();
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  void start();
  void stop();
  bool recording() const;
  // Per (op, kernel, device), the most time first; waits for recorded CUDA work.
  std::vector<KernelTime> results() const;

  struct Impl;

 private:
  // Shared with the threads timing a kernel when it is stopped or destroyed (they keep it
  // alive until they have recorded).
  std::shared_ptr<Impl> impl_;
};

// Labels the kernels this thread runs, for the scope, with the executor of a compiled program's
// step (compiler/program.cpp; fused_cpu's worker threads too). `name` must outlive the scope.
class ExecutorLabel {
 public:
  explicit ExecutorLabel(const std::string* name);
  ~ExecutorLabel();
  ExecutorLabel(const ExecutorLabel&) = delete;
  ExecutorLabel& operator=(const ExecutorLabel&) = delete;

 private:
  const std::string* previous_;
};

// The family a kernel's time is reported under by `kiln bench --profile`: "GEMM", "attention",
// "norms", "RoPE", "GLU", "cross-entropy", "optimizer", "copies and casts", "reductions",
// "indexing" or "elementwise".
std::string family_of(const std::string& op);

// A table of `results` per family, one per executor when compiled programs ran (the executor of
// each step: "eager", "fused_cpu", "matmul_epilogue", ...), and of the `top` slowest kernels, per
// step of `steps` steps that took `step_ms` each (wall time, measured without the profiler).
void print_report(const std::vector<KernelTime>& results, int64_t steps, double step_ms,
                  std::ostream& out, size_t top = 15);

namespace internal {

// Whether a profiler records (one relaxed load: the dispatcher checks it per kernel).
bool active();
// Runs kernel(call) under the active profiler's timing.
void run_timed(KernelFn kernel, const KernelDef* def, OpCall& call, Device device);

}  // namespace internal

}  // namespace kiln::profiler
