#include "compiler/program.h"

#include <algorithm>

#include "autograd/grad_mode.h"
#include "tensor/random.h"

namespace kiln::compiler {

Program::Program(Trace trace, std::vector<Tensor> externals,
                 const std::vector<std::shared_ptr<const Executor>>& executors)
    : trace_(std::make_shared<const Trace>(std::move(trace))),
      externals_(std::move(externals)),
      executors_(executors) {
  const Trace& t = *trace_;
  KILN_CHECK(externals_.size() == t.externals.size(), "[compile] the program has ",
             t.externals.size(), " captured tensors, got ", externals_.size());
  steps_.reserve(t.ops.size());
  for (const BoundOp& op : t.ops) {
    const Executor* chosen = nullptr;
    for (const auto& e : executors_) {
      if (e->name() == op.executor) chosen = e.get();
    }
    KILN_CHECK(chosen != nullptr, "[compile] ", op.name(), " is assigned to the executor '",
               op.executor, "', which is not among the program's executors");
    steps_.push_back(chosen->lower(t, op));
  }
  // Liveness: an op-produced value is dropped after the last step that reads it, unless the
  // program returns it or assigns it to a grad.
  std::vector<int> last_use(t.values.size(), -1);
  for (size_t i = 0; i < t.ops.size(); ++i) {
    for (int v : t.ops[i].inputs) {
      if (v >= 0) last_use[static_cast<size_t>(v)] = static_cast<int>(i);
    }
    for (int v : t.ops[i].outputs) {  // an output nothing reads goes right away
      if (v >= 0 && last_use[static_cast<size_t>(v)] < static_cast<int>(i)) {
        last_use[static_cast<size_t>(v)] = static_cast<int>(i);
      }
    }
  }
  for (int v : t.outputs) {
    if (v >= 0) last_use[static_cast<size_t>(v)] = -1;
  }
  for (const GradEffect& e : t.grad_effects) {
    if (e.value >= 0) last_use[static_cast<size_t>(e.value)] = -1;
  }
  free_after_.resize(t.ops.size());
  for (size_t v = 0; v < t.values.size(); ++v) {
    if (t.roles[v] == ValueRole::kOp && last_use[v] >= 0) {
      free_after_[static_cast<size_t>(last_use[v])].push_back(static_cast<int>(v));
    }
  }
  // The planned peak: allocations of functional ops, released where free_after_ says.
  auto bytes = [&](int v) {
    const TensorSpec& s = t.value(v).spec;
    return numel_of(s.sizes) * static_cast<int64_t>(element_size(s.dtype));
  };
  std::vector<bool> allocated(t.values.size(), false);
  int64_t live = 0;
  for (size_t i = 0; i < t.ops.size(); ++i) {
    const OpKind kind = t.ops[i].op->kind;
    if (kind == OpKind::kFunctional || kind == OpKind::kDynamic) {
      for (int v : t.ops[i].outputs) {
        if (v < 0) continue;
        allocated[static_cast<size_t>(v)] = true;
        live += bytes(v);
      }
    }
    planned_peak_bytes_ = std::max(planned_peak_bytes_, live);
    for (int v : free_after_[i]) live -= allocated[static_cast<size_t>(v)] ? bytes(v) : 0;
  }
}

std::vector<Tensor> Program::run(const std::vector<Tensor>& arguments, const RngState* rng,
                                 RngState* rng_used) const {
  const Trace& t = *trace_;
  KILN_CHECK(arguments.size() == t.arguments.size(), "[compile] the program takes ",
             t.arguments.size(), " tensor arguments, got ", arguments.size());
  Frame frame;
  frame.slots.resize(t.values.size());
  for (size_t i = 0; i < arguments.size(); ++i) {
    if (t.arguments[i] >= 0) frame.slots[static_cast<size_t>(t.arguments[i])] = arguments[i];
  }
  for (size_t i = 0; i < externals_.size(); ++i) {
    frame.slots[static_cast<size_t>(t.externals[i])] = externals_[i];
  }
  if (rng != nullptr) {
    frame.rng_seed = rng->seed;
    frame.rng_base = rng->offset;
  } else if (t.rng_blocks > 0) {
    const RngState s = philox_reserve(t.rng_blocks);
    frame.rng_seed = s.seed;
    frame.rng_base = s.offset;
  } else {
    const RngState s = get_rng_state();
    frame.rng_seed = s.seed;
    frame.rng_base = s.offset;
  }
  if (rng_used != nullptr) *rng_used = RngState{frame.rng_seed, frame.rng_base};
  {
    NoGradGuard no_grad;
    for (size_t i = 0; i < steps_.size(); ++i) {
      steps_[i](frame);
      for (int v : free_after_[i]) frame.slots[static_cast<size_t>(v)] = Tensor();
    }
  }
  for (const GradEffect& e : t.grad_effects) {
    Tensor external = externals_[static_cast<size_t>(e.external)];
    external.mutable_grad() = e.value >= 0 ? frame.slots[static_cast<size_t>(e.value)] : Tensor();
  }
  std::vector<Tensor> outputs;
  outputs.reserve(t.outputs.size());
  for (int v : t.outputs)
    outputs.push_back(v >= 0 ? frame.slots[static_cast<size_t>(v)] : Tensor());
  return outputs;
}

}  // namespace kiln::compiler
