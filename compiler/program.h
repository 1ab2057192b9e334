// A compiled program: a trace after its passes, lowered op by op to the steps of the executors
// that claimed them, ready to run on real tensors.
//
// A run fills the value slots with the arguments and the captured tensors, reserves the
// trace's Philox blocks from the global generator, runs the steps in order with grad mode off,
// drops every intermediate after its last use, applies the grad effects (external.grad = value)
// and returns the outputs.
#pragma once

#include <memory>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "compiler/executor.h"
#include "compiler/trace.h"
#include "tensor/random.h"

namespace kiln::compiler {

class Program {
 public:
  Program(Trace trace, std::vector<Tensor> externals,
          const std::vector<std::shared_ptr<const Executor>>& executors);

  // Runs the program; `arguments` as the trace's arguments (shapes as traced). Random ops draw
  // from `rng` when given (a compiled backward replaying its forward's draws), else from blocks
  // the run reserves from the global generator; `rng_used` receives the seed and base offset.
  std::vector<Tensor> run(const std::vector<Tensor>& arguments, const RngState* rng = nullptr,
                          RngState* rng_used = nullptr) const;

  // run() in three parts, for a caller that runs some steps another way (compiler/cuda_graph.h):
  // begin_run fills a frame (arguments, captured tensors, random base, arenas) and drops the
  // gradients the program replaces without reading; run_steps runs steps [begin, end) with grad
  // mode off, dropping each value after its last reader; end_run applies the grad effects and
  // returns the outputs.
  Frame begin_run(const std::vector<Tensor>& arguments, const RngState* rng = nullptr,
                  RngState* rng_used = nullptr) const;
  void run_steps(Frame& frame, size_t begin, size_t end) const;
  std::vector<Tensor> end_run(Frame& frame) const;
  // One step per op index (empty where a fusion region's earlier ops are); the values dropped
  // after step i.
  size_t num_steps() const { return steps_.size(); }
  bool has_step(size_t i) const { return static_cast<bool>(steps_[i]); }
  const std::vector<int>& dropped_after(size_t i) const { return free_after_[i]; }

  const Trace& trace() const { return *trace_; }
  // The most bytes of intermediates (outputs of functional ops: views and in-place results
  // share memory) alive at once during a run, with every value dropped after its last use.
  int64_t planned_peak_bytes() const { return planned_peak_bytes_; }
  const std::vector<Tensor>& externals() const { return externals_; }

 private:
  std::shared_ptr<const Trace> trace_;  // the steps point into it: never moved
  std::vector<Tensor> externals_;
  std::vector<std::shared_ptr<const Executor>> executors_;  // keeps the lowered steps' owners
  std::vector<Step> steps_;
  std::vector<const std::string*> step_executors_;  // the executor of each step (the profiler's label)
  std::vector<std::vector<int>> free_after_;  // values dropped after each step
  // The captured tensors' storages: a gradient outside them is not read by the program.
  absl::flat_hash_set<const void*> external_storages_;
  int64_t planned_peak_bytes_ = 0;
  int cuda_device_ = -1;  // the device of the first CUDA value (-1: none)
};

}  // namespace kiln::compiler
