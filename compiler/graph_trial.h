// GraphTrial: how a compiled program with all-reduces (a compiled DDP step) runs, measured.
//
// DDP's large buckets are all-reduced through the copy engines beside the backward (dist's
// PeerAllReduce), op by op and as CUDA graphs alike: a graph cannot hold them (their flags count
// uses), so its all-reduces start on the host after each launch, each once the graph has reached
// it (cuda::internal::defer_to_each_launch), and their waits run between the graphs, which split
// there (compiler/cuda_graph.h). Graphs save the host's launches; the split costs a graph launch
// and the waits' host steps. Until session 31 the graphs held NCCL's all-reduces, whose kernels
// take SMs from the backward, and neither way won on both models (benchmarks/RESULTS.md, sessions
// 27-31), so the way is measured: after the program's warm-up each way runs kRuns times, timed by
// events on the current stream (the graphs' first run, the capture, is not timed); the ranks then
// average their times through the program's own all-reduce, so that every rank keeps the same
// way, and a failed capture on any rank counts as infinitely slow. Both ways issue the same
// collectives, so a rank whose capture failed runs op by op beside the others' graphs.
// compile.cpp runs the program; this class counts, times and decides:
//
//   trial->before_run();
//   ... run op by op (kOpByOp, or a failed capture) or through GraphedProgram (kGraphs) ...
//   trial->after_run();   // at the end of kGraphs: measures, agrees, decides (kDecided)
#pragma once

#include <memory>
#include <string>

#include "compiler/program.h"
#include "kernels/cuda.h"

namespace kiln::compiler {

class GraphTrial {
 public:
  static constexpr int kRuns = 3;
  enum class Phase { kOpByOp, kGraphs, kDecided };

  // The trial of `program`, or null when it has no all-reduce (nothing to choose).
  static std::unique_ptr<GraphTrial> of(const Program& program);

  Phase phase() const { return phase_; }
  void before_run();
  void after_run();
  // This rank's capture failed or was refused: the rest of the trial runs op by op.
  void capture_failed(std::string why) { failure_ = std::move(why); }
  const std::string& failure() const { return failure_; }

  // Once decided: whether graphs were kept, the measurement (both ways' mean times), and, when op
  // by op was kept, why graphs are off and whether that is a failure (warned).
  bool graphs_kept() const { return graphs_kept_; }
  const std::string& measurement() const { return measurement_; }
  std::string off_reason() const;
  bool failed() const { return failed_; }
  // What stats().graph_reason says while measuring.
  static std::string measuring_reason();

 private:
  void decide();

  absl::InlinedVector<Attr, 4> reduce_attrs_;  // the program's first all-reduce's attributes
  Device device_ = Device(kCUDA, 0);           // and its tensor's
  Phase phase_ = Phase::kOpByOp;
  int runs_ = 0;  // in this phase
  cuda::Event op_begin_{true}, op_end_{true}, graph_begin_{true}, graph_end_{true};
  std::string failure_;  // this rank's capture failed: why
  bool graphs_kept_ = false, failed_ = false;
  std::string measurement_;
};

}  // namespace kiln::compiler
