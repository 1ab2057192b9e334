#include "compiler/executor.h"

#include <algorithm>
#include <mutex>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "kernels/cuda/runtime.h"
#include "tensor/autocast_state.h"
#include "tensor/profiler.h"

namespace kiln::compiler {
namespace {

// Runs a functional op whose outputs plan_memory placed: the kernel the dispatcher would choose
// (support rules), writing into the arena's views. False when it is not placed or no kernel of
// the device supports the call (the dispatcher then runs the decomposition, which allocates).
bool run_placed(const BoundOp& op, OpCall& call, Frame& frame) {
  if (frame.placed.empty() || op.outputs.empty()) return false;
  for (int v : op.outputs) {
    if (v < 0 || !frame.placed[static_cast<size_t>(v)].defined()) return false;
  }
  const Device device = common_device(call);
  const KernelDef* kernel = op.op->select_kernel(device.type(), call);
  if (kernel == nullptr) return false;
  call.kernel = kernel;
  call.outputs.clear();
  for (int v : op.outputs) call.outputs.push_back(frame.placed[static_cast<size_t>(v)]);
  if (profiler::internal::active()) {
    profiler::internal::run_timed(kernel->fn, kernel, call, device);
  } else {
    kernel->fn(call);
  }
  store_outputs(op, call, frame);
  return true;
}

// Runs every op through the dispatcher below the Trace key: autocast and the device's kernel
// choice (support rules, decompositions) as in eager code.
class EagerExecutor final : public Executor {
 public:
  const std::string& name() const override {
    static const std::string n = "eager";
    return n;
  }
  bool claims(const Trace&, const BoundOp&) const override { return true; }
  Step lower(const Trace&, const BoundOp& op) const override {
    return [&op](Frame& frame) {
      std::optional<cuda::internal::TrustedIndicesScope> trusted;
      if (op.trusted_indices) trusted.emplace();
      OpCall call = bind_call(op, frame);
      if (run_placed(op, call, frame)) return;
      AutocastScope autocast(op.autocast);
      dispatch_after(call, DispatchKey::Trace);
      store_outputs(op, call, frame);
    };
  }
};

class OpExecutor final : public Executor {
 public:
  OpExecutor(std::string name, std::vector<std::pair<std::string, OpImpl>> impls)
      : name_(std::move(name)) {
    for (auto& [op, fn] : impls) {
      (void)Registry::get().op(op);  // a misspelled op name fails here
      impls_[op] = std::move(fn);
    }
  }
  const std::string& name() const override { return name_; }
  bool claims(const Trace&, const BoundOp& op) const override { return impls_.contains(op.name()); }
  Step lower(const Trace& trace, const BoundOp& op) const override {
    const OpImpl& fn = impls_.at(op.name());
    std::vector<TensorSpec> specs;
    for (int v : op.outputs)
      specs.push_back(v >= 0 ? trace.value(v).spec : TensorSpec{{}, kFloat, Device(kCPU)});
    return [&op, &fn, specs = std::move(specs), name = name_](Frame& frame) {
      OpCall call = bind_call(op, frame);
      call.outputs.clear();
      fn(call);
      KILN_CHECK(call.outputs.size() == specs.size(), "[", op.name(), "] the executor '", name,
                 "' returned ", call.outputs.size(), " outputs, the op has ", specs.size());
      for (size_t i = 0; i < specs.size(); ++i) {
        const Tensor& out = call.outputs[i];
        KILN_CHECK(
            !out.defined() || (out.sizes() == specs[i].sizes && out.dtype() == specs[i].dtype), "[",
            op.name(), "] the executor '", name, "' returned output ", i, " as ",
            out.defined() ? spec_str(spec_of(out)) : "undefined", ", the trace expects ",
            spec_str(specs[i]));
      }
      store_outputs(op, call, frame);
    };
  }

 private:
  std::string name_;
  absl::flat_hash_map<std::string, OpImpl> impls_;
};

struct ExecutorTable {
  std::mutex mu;
  std::vector<std::shared_ptr<const Executor>> executors{
      std::make_shared<EagerExecutor>(), make_fused_cpu_executor(),
      make_matmul_epilogue_executor("matmul_epilogue", {kCUDA}), make_fused_cuda_executor()};
};
ExecutorTable& table() {
  static ExecutorTable t;
  return t;
}

}  // namespace

AutocastScope::AutocastScope(const BoundOp::Autocast& want) {
  BoundOp::Autocast now;
  if (internal::any_autocast_enabled()) {
    now = {is_autocast_enabled(kCPU), is_autocast_enabled(kCUDA), autocast_dtype(kCPU),
           autocast_dtype(kCUDA)};
  }
  if (now == want) return;
  saved_ = now;
  changed_ = true;
  set(want);
}

AutocastScope::~AutocastScope() {
  if (changed_) set(saved_);
}

void AutocastScope::set(const BoundOp::Autocast& s) {
  internal::set_autocast_state(kCPU, s.cpu, s.cpu_dtype);
  internal::set_autocast_state(kCUDA, s.cuda, s.cuda_dtype);
}

bool Executor::fuses(const Trace&, const BoundOp&) const { return false; }

bool Executor::fuses_epilogue(const Trace&, const BoundOp&, int, const BoundOp&, bool) const {
  return false;
}

Step Executor::lower_region(const Trace& trace, size_t begin, size_t) const {
  KILN_FAIL("[compile] the executor '", name(), "' was given the fusion region ",
            trace.region_names[static_cast<size_t>(trace.ops[begin].region)],
            " but runs no regions (Executor::fuses is false for every op)");
}

void register_executor(std::shared_ptr<const Executor> executor) {
  KILN_CHECK(executor != nullptr, "[register_executor] the executor is null");
  KILN_CHECK(executor->name() != "eager" && executor->name() != "fused_cpu",
             "[register_executor] '", executor->name(), "' is built in");
  ExecutorTable& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  auto it = std::find_if(t.executors.begin(), t.executors.end(),
                         [&](const auto& e) { return e->name() == executor->name(); });
  if (it != t.executors.end()) {
    *it = std::move(executor);
  } else {
    t.executors.push_back(std::move(executor));
  }
}

std::vector<std::string> executor_names() {
  ExecutorTable& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  std::vector<std::string> names;
  for (const auto& e : t.executors) names.push_back(e->name());
  return names;
}

std::shared_ptr<const Executor> find_executor(std::string_view name) {
  ExecutorTable& t = table();
  {
    std::lock_guard<std::mutex> lock(t.mu);
    for (const auto& e : t.executors) {
      if (e->name() == name) return e;
    }
  }
  std::string known;
  for (const std::string& n : executor_names()) known += (known.empty() ? "" : ", ") + n;
  KILN_FAIL("[compile] no executor is named '", name, "' (registered: ", known, ")");
}

std::shared_ptr<const Executor> make_op_executor(
    std::string name, std::vector<std::pair<std::string, OpImpl>> impls) {
  KILN_CHECK(!name.empty(), "[make_op_executor] the executor needs a name");
  return std::make_shared<OpExecutor>(std::move(name), std::move(impls));
}

OpCall bind_call(const BoundOp& op, const Frame& frame) {
  OpCall call;
  call.op = op.op;
  call.inputs.reserve(op.inputs.size());
  for (int v : op.inputs)
    call.inputs.push_back(v >= 0 ? frame.slots[static_cast<size_t>(v)] : Tensor());
  call.attrs = op.attrs;
  if (op.rng_offset >= 0) {
    const size_t n = call.attrs.size();
    if (op.rng_seed_from_entry) call.attrs[n - 2] = static_cast<int64_t>(frame.rng_seed);
    call.attrs[n - 1] = static_cast<int64_t>(frame.rng_base + static_cast<uint64_t>(op.rng_offset));
  }
  return call;
}

void store_outputs(const BoundOp& op, OpCall& call, Frame& frame) {
  for (size_t i = 0; i < op.outputs.size() && i < call.outputs.size(); ++i) {
    if (op.outputs[i] >= 0)
      frame.slots[static_cast<size_t>(op.outputs[i])] = std::move(call.outputs[i]);
  }
}

}  // namespace kiln::compiler
