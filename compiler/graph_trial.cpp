#include "compiler/graph_trial.h"

#include <iomanip>
#include <sstream>
#include <utility>
#include <vector>

#include "autograd/grad_mode.h"
#include "tensor/ops.h"
#include "tensor/registry.h"
#include "tensor/tensor_data.h"

namespace kiln::compiler {

std::unique_ptr<GraphTrial> GraphTrial::of(const Program& program) {
  const Trace& t = program.trace();
  for (const BoundOp& op : t.ops) {
    if (op.name() != "dist_all_reduce_") continue;
    auto g = std::make_unique<GraphTrial>();
    g->reduce_attrs_ = op.attrs;
    g->reduce_attrs_[2] = int64_t{0};  // not beside compute: NCCL's, at once
    g->device_ = t.value(op.inputs[0]).spec.device;
    return g;
  }
  return nullptr;
}

std::string GraphTrial::measuring_reason() {
  return "a program with all-reduces: op by op, or as CUDA graphs split at the all-reduces' "
         "waits; the faster is kept after " +
         std::to_string(2 * kRuns + 1) + " runs";
}

void GraphTrial::before_run() {
  if (phase_ == Phase::kOpByOp && runs_ == 0) op_begin_.record();
  // The graphs' first run captures them: not timed.
  if (phase_ == Phase::kGraphs && runs_ == 1) graph_begin_.record();
}

void GraphTrial::after_run() {
  ++runs_;
  if (phase_ == Phase::kOpByOp && runs_ == kRuns) {
    op_end_.record();
    phase_ = Phase::kGraphs;
    runs_ = 0;
  } else if (phase_ == Phase::kGraphs && runs_ == kRuns + 1) {
    graph_end_.record();
    decide();
  }
}

void GraphTrial::decide() {
  phase_ = Phase::kDecided;
  graph_end_.synchronize();
  const double op_ms = op_begin_.elapsed_time(op_end_) / kRuns;
  const double graph_ms = failure_.empty() ? graph_begin_.elapsed_time(graph_end_) / kRuns : 1e30;
  // The ranks' mean times, through the program's all-reduce (its group, op and device).
  Tensor times = tensor(std::vector<double>{op_ms, graph_ms}, kFloat).to(device_);
  {
    NoGradGuard no_grad;
    static const OpDef& all_reduce = KILN_OP(dist_all_reduce_);
    static const OpDef& wait = KILN_OP(dist_wait_);
    call_op(all_reduce, {times}, reduce_attrs_);
    call_op(wait, {times});
  }
  const std::vector<float> mean = times.cpu().to_vector<float>();
  failed_ = mean[1] >= 1e29f;
  graphs_kept_ = mean[1] < mean[0];
  std::ostringstream note;
  note << std::fixed << std::setprecision(2);
  if (!failed_) note << mean[1] << " ms a run as CUDA graphs, ";
  note << mean[0] << " ms op by op, measured";
  measurement_ = note.str();
}

std::string GraphTrial::off_reason() const {
  if (!failed_) return "op by op measured faster: " + measurement_;
  return "capturing failed on " + (failure_.empty() ? "another rank" : "this rank: " + failure_) +
         "; " + measurement_;
}

}  // namespace kiln::compiler
