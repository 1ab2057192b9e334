#include "compiler/functionalize.h"

#include <limits>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "compiler/tracer.h"
#include "tensor/error.h"

namespace kiln::compiler {
namespace {

constexpr size_t kAtEnd = std::numeric_limits<size_t>::max();

// X for X_ when the registry defines X as a functional, non-random op; else nullptr. Looked up
// with Registry::op (Registry::entry would create an empty entry for a missing name).
const OpDef* functional_counterpart(const OpDef& inplace) {
  static std::mutex mu;  // compiled functions may be traced on several threads
  static absl::flat_hash_map<const OpDef*, const OpDef*> memo;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = memo.find(&inplace); it != memo.end()) return it->second;
  const OpDef* found = nullptr;
  const std::string& name = inplace.name;
  if (name.size() > 1 && name.back() == '_') {
    try {
      const OpDef& def = Registry::get().op(std::string_view(name).substr(0, name.size() - 1));
      if (def.kind == OpKind::kFunctional && !def.random) found = &def;
    } catch (const Error&) {  // no such op: the in-place op stays
    }
  }
  memo.emplace(&inplace, found);
  return found;
}

Shape strides_of(const TensorSpec& s) {
  return s.strides.empty() ? contiguous_strides(s.sizes) : s.strides;
}

// Whether `functional`'s meta rule accepts the in-place op's inputs and attributes and gives
// exactly the spec of the value the in-place op produced.
bool same_result(const Trace& trace, const BoundOp& op, const OpDef& functional) {
  OpCall call;
  call.op = &functional;
  for (int v : op.inputs) call.inputs.push_back(v >= 0 ? proxy_of(trace.value(v).spec) : Tensor());
  call.attrs = op.attrs;
  SpecList specs;
  try {
    specs = functional.meta(call);
  } catch (const Error&) {  // attributes laid out otherwise, or a call it rejects
    return false;
  }
  if (specs.size() != 1) return false;
  const TensorSpec& want = trace.value(op.outputs[0]).spec;
  return specs[0].sizes == want.sizes && specs[0].dtype == want.dtype &&
         specs[0].device == want.device && strides_of(specs[0]) == strides_of(want);
}

}  // namespace

// Whether `v` is a row-major reinterpretation of all of `b`'s storage (a contiguous view of the
// same dtype and element count as the storage's allocating value b, so at offset 0).
bool full_contiguous(const Trace& trace, int v, int b) {
  const TensorSpec& s = trace.value(v).spec;
  const TensorSpec& base = trace.value(b).spec;
  return s.dtype == base.dtype && numel_of(s.sizes) == numel_of(base.sizes) &&
         strides_of(s) == contiguous_strides(s.sizes);
}

Trace functionalize(const Trace& trace) {
  const size_t n = trace.values.size();
  // The last op reading each value (kAtEnd: returned, or assigned to a grad).
  std::vector<size_t> last_read(n, 0);
  std::vector<bool> read(n, false);
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    for (int v : trace.ops[i].inputs) {
      if (v < 0) continue;
      last_read[static_cast<size_t>(v)] = i;
      read[static_cast<size_t>(v)] = true;
    }
  }
  auto read_at_end = [&](int v) {
    if (v < 0) return;
    last_read[static_cast<size_t>(v)] = kAtEnd;
    read[static_cast<size_t>(v)] = true;
  };
  for (int v : trace.outputs) read_at_end(v);
  for (const GradEffect& e : trace.grad_effects) read_at_end(e.value);

  // Storage classes: each value's base is the value whose storage it names (views and in-place
  // results share their input's). `owned`: the base was allocated by a functional op (or is a
  // functionalized result), so no one outside the trace can see its storage.
  std::vector<int> base(n);
  std::vector<bool> owned(n, false);
  absl::flat_hash_map<int, std::vector<int>> members;  // base -> the values naming its storage
  for (size_t v = 0; v < n; ++v) base[v] = static_cast<int>(v);
  auto join = [&](int v, int b) {
    base[static_cast<size_t>(v)] = b;
    members[b].push_back(v);
  };
  auto own = [&](int v) {
    owned[static_cast<size_t>(v)] = true;
    members[v] = {v};
  };
  // An op whose outputs may name its inputs' storages in ways not tracked here: those storages
  // are never functionalized after it.
  auto disown_inputs = [&](const BoundOp& op) {
    for (int v : op.inputs) {
      if (v >= 0) owned[static_cast<size_t>(base[static_cast<size_t>(v)])] = false;
    }
  };
  // Reads after a rewritten write of values that name the old storage go to views of the new
  // result (`to`, followed to its end).
  std::vector<int> to(n);
  for (size_t v = 0; v < n; ++v) to[v] = static_cast<int>(v);
  auto renamed = [&](int v) {
    while (v >= 0 && to[static_cast<size_t>(v)] != v) v = to[static_cast<size_t>(v)];
    return v;
  };
  static const OpDef& view = Registry::get().op("view");

  Trace out = trace;
  out.stage = "functionalize";
  out.ops.clear();
  out.ops.reserve(trace.ops.size());
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    BoundOp op = trace.ops[i];
    for (int& v : op.inputs) v = renamed(v);
    const OpKind kind = op.op->kind;
    if (kind == OpKind::kFunctional) {
      for (int v : op.outputs) {
        if (v >= 0) own(v);
      }
    } else if (kind == OpKind::kDynamic) {  // the kernel allocates its outputs: unknown storage
      disown_inputs(op);
    } else if (kind == OpKind::kView) {
      for (int v : op.outputs) {
        if (v >= 0 && op.inputs[0] >= 0) join(v, base[static_cast<size_t>(op.inputs[0])]);
      }
    }
    const bool single = kind == OpKind::kInplace && op.op->mutated == nullptr && !op.op->random &&
                        op.outputs.size() == 1 && op.outputs[0] >= 0 && !op.inputs.empty() &&
                        op.inputs[0] >= 0;
    if (kind == OpKind::kInplace && !single) disown_inputs(op);  // multi-tensor writes, fills
    if (!single) {
      out.ops.push_back(std::move(op));
      continue;
    }
    const int written = op.inputs[0];
    const int result = op.outputs[0];
    const int b = base[static_cast<size_t>(written)];
    bool safe = owned[static_cast<size_t>(b)];
    for (size_t k = 1; k < op.inputs.size() && safe; ++k) {
      safe = op.inputs[k] < 0 || base[static_cast<size_t>(op.inputs[k])] != b;
    }
    // Values of the storage read after the op: each must be rebuilt from the result, which
    // needs a write over all of the storage and a row-major reinterpretation of it to read.
    std::vector<int> later;
    for (int m : members[b]) {
      if (read[static_cast<size_t>(m)] && last_read[static_cast<size_t>(m)] > i) later.push_back(m);
    }
    if (safe && !later.empty()) {
      safe = full_contiguous(out, written, b);
      for (int m : later) safe = safe && full_contiguous(out, m, b);
    }
    const OpDef* functional = safe ? functional_counterpart(*op.op) : nullptr;
    if (functional == nullptr || !same_result(out, op, *functional)) {
      join(result, b);
      out.ops.push_back(std::move(op));
      continue;
    }
    op.op = functional;
    own(result);
    out.ops.push_back(std::move(op));
    for (int m : later) {
      const ValueInfo old = out.value(m);
      const int id = out.add_value(old.spec, ValueRole::kOp, old.requires_grad);
      base.push_back(result);
      owned.push_back(false);
      read.push_back(true);
      last_read.push_back(last_read[static_cast<size_t>(m)]);
      to.push_back(id);
      members[result].push_back(id);
      read[static_cast<size_t>(m)] = false;  // its reads from here on are the new value's
      to[static_cast<size_t>(m)] = id;
      BoundOp rebuild;
      rebuild.op = &view;
      rebuild.inputs = {result};
      rebuild.attrs = {Shape(old.spec.sizes.begin(), old.spec.sizes.end())};
      rebuild.outputs = {id};
      out.ops.push_back(std::move(rebuild));
    }
  }
  for (int& v : out.outputs) v = renamed(v);
  for (GradEffect& e : out.grad_effects) e.value = renamed(e.value);
  return out;
}

}  // namespace kiln::compiler
