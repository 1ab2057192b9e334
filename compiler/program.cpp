#include "compiler/program.h"

#include <algorithm>
#include <optional>

#include "autograd/grad_mode.h"
#include "kernels/cuda/runtime.h"
#include "tensor/profiler.h"
#include "tensor/random.h"
#include "tensor/storage.h"
#include "tensor/tensor_impl.h"

namespace kiln::compiler {

Program::Program(Trace trace, std::vector<Tensor> externals,
                 const std::vector<std::shared_ptr<const Executor>>& executors)
    : trace_(std::make_shared<const Trace>(std::move(trace))),
      externals_(std::move(externals)),
      executors_(executors) {
  const Trace& t = *trace_;
  KILN_CHECK(externals_.size() == t.externals.size(), "[compile] the program has ",
             t.externals.size(), " captured tensors, got ", externals_.size());
  // One step per op, except that a fusion region (a contiguous block, compiler/fuse.h) is one
  // step at its last op's place; its other ops get none.
  for (const Tensor& e : externals_) {
    if (e.defined()) external_storages_.insert(e.impl()->storage().get());
  }
  for (const ValueInfo& v : t.values) {
    if (v.spec.device.is_cuda()) {
      cuda_device_ = static_cast<int>(v.spec.device.index());
      break;
    }
  }
  steps_.resize(t.ops.size());
  step_executors_.resize(t.ops.size(), nullptr);
  const std::vector<int> at = step_positions(t);
  for (size_t i = 0; i < t.ops.size(); i = static_cast<size_t>(at[i]) + 1) {
    const BoundOp& op = t.ops[i];
    const Executor* chosen = nullptr;
    for (const auto& e : executors_) {
      if (e->name() == op.executor) chosen = e.get();
    }
    KILN_CHECK(chosen != nullptr, "[compile] ", op.name(), " is assigned to the executor '",
               op.executor, "', which is not among the program's executors");
    const size_t last = static_cast<size_t>(at[i]);
    steps_[last] = op.region >= 0 ? chosen->lower_region(t, i, last + 1) : chosen->lower(t, op);
    step_executors_[last] = &chosen->name();
  }
  // Liveness: an op-produced value is dropped after the last step that reads it, unless the
  // program returns it or assigns it to a grad. `pos[i]` is where op i's reads happen.
  auto liveness = [&](const std::vector<int>& pos) {
    std::vector<int> last_use(t.values.size(), -1);
    for (size_t i = 0; i < t.ops.size(); ++i) {
      for (int v : t.ops[i].inputs) {
        if (v >= 0) last_use[static_cast<size_t>(v)] = pos[i];
      }
      for (int v : t.ops[i].outputs) {  // an output nothing reads goes right away
        if (v >= 0 && last_use[static_cast<size_t>(v)] < pos[i]) {
          last_use[static_cast<size_t>(v)] = pos[i];
        }
      }
    }
    for (int v : t.outputs) {
      if (v >= 0) last_use[static_cast<size_t>(v)] = -1;
    }
    for (const GradEffect& e : t.grad_effects) {
      if (e.value >= 0) last_use[static_cast<size_t>(e.value)] = -1;
    }
    std::vector<std::vector<int>> free_after(t.ops.size());
    for (size_t v = 0; v < t.values.size(); ++v) {
      if (t.roles[v] == ValueRole::kOp && last_use[v] >= 0) {
        free_after[static_cast<size_t>(last_use[v])].push_back(static_cast<int>(v));
      }
    }
    return free_after;
  };
  free_after_ = liveness(at);
  // The planned peak: allocations of functional ops, each released after its last reader, as
  // a fusion region that runs whole releases them (one that runs in row blocks needs less).
  std::vector<int> each(t.ops.size());
  for (size_t i = 0; i < each.size(); ++i) each[i] = static_cast<int>(i);
  const std::vector<std::vector<int>> released = liveness(each);
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
    for (int v : released[i]) live -= allocated[static_cast<size_t>(v)] ? bytes(v) : 0;
  }
}

std::vector<Tensor> Program::run(const std::vector<Tensor>& arguments, const RngState* rng,
                                 RngState* rng_used) const {
  Frame frame = begin_run(arguments, rng, rng_used);
  run_steps(frame, 0, steps_.size());
  return end_run(frame);
}

Frame Program::begin_run(const std::vector<Tensor>& arguments, const RngState* rng,
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
  // A gradient the program replaces without reading it (the step's zero_grad() was traced) is
  // dropped now, as zero_grad() drops it in eager code, instead of living until the new one
  // is assigned at the end: a training step would otherwise hold two sets of gradients.
  for (const GradEffect& e : t.grad_effects) {
    Tensor external = externals_[static_cast<size_t>(e.external)];
    const Tensor& old = external.grad();
    if (old.defined() && !external_storages_.contains(old.impl()->storage().get())) {
      external.mutable_grad() = Tensor();
    }
  }
  if (!t.arenas.empty()) {
    // One allocation per arena; each placed value is a view of it (compiler/memory_plan.h).
    std::vector<Storage> arenas;
    for (const Arena& a : t.arenas)
      arenas.push_back(allocate_storage(static_cast<size_t>(a.bytes), a.device));
    frame.placed.resize(t.values.size());
    for (size_t v = 0; v < t.values.size(); ++v) {
      const ValueInfo& info = t.values[v];
      if (info.arena < 0) continue;
      const TensorSpec& s = info.spec;
      frame.placed[v] = Tensor(std::make_shared<TensorImpl>(
          arenas[static_cast<size_t>(info.arena)], s.sizes,
          s.strides.empty() ? contiguous_strides(s.sizes) : s.strides,
          info.arena_offset / static_cast<int64_t>(element_size(s.dtype)), s.dtype));
    }
  }
  return frame;
}

void Program::run_steps(Frame& frame, size_t begin, size_t end) const {
  NoGradGuard no_grad;
  // The device's argument checks (an index in range) are read by the next run, not waited for
  // here (kernels/cuda/runtime.h); a capture has its own.
  std::optional<cuda::internal::DeferredChecksScope> deferred;
  if (cuda_device_ >= 0 && !cuda::internal::capturing_graph()) deferred.emplace(cuda_device_);
  for (size_t i = begin; i < end && i < steps_.size(); ++i) {
    if (steps_[i]) {
      const profiler::ExecutorLabel label(step_executors_[i]);
      steps_[i](frame);
    }
    for (int v : free_after_[i]) frame.slots[static_cast<size_t>(v)] = Tensor();
  }
}

std::vector<Tensor> Program::end_run(Frame& frame) const {
  const Trace& t = *trace_;
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
