#include "compiler/passes.h"

#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"

namespace kiln::compiler {
namespace {

void rename(std::vector<int>& ids, const std::vector<int>& to) {
  for (int& v : ids) {
    if (v >= 0) v = to[static_cast<size_t>(v)];
  }
}

// A functional op's identity for cse: the op, its inputs and its attributes printed.
std::string op_key(const BoundOp& op) {
  std::string key = op.name();
  for (int v : op.inputs) key += "," + std::to_string(v);
  key += ";";
  for (const Attr& a : op.attrs) {
    key += std::to_string(a.index()) + ":" + attr_str(a) + ",";
  }
  return key;
}

}  // namespace

Trace dce(const Trace& trace) {
  std::vector<bool> live(trace.values.size(), false);
  auto mark = [&](int v) {
    if (v >= 0) live[static_cast<size_t>(v)] = true;
  };
  for (int v : trace.outputs) mark(v);
  for (const GradEffect& e : trace.grad_effects) mark(e.value);
  std::vector<bool> keep(trace.ops.size(), false);
  for (size_t i = trace.ops.size(); i-- > 0;) {
    const BoundOp& op = trace.ops[i];
    bool needed = op.op->kind == OpKind::kInplace;
    for (int v : op.outputs) needed |= v >= 0 && live[static_cast<size_t>(v)];
    if (!needed) continue;
    keep[i] = true;
    for (int v : op.inputs) mark(v);
  }
  Trace out = trace;
  out.stage = "dce";
  out.ops.clear();
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    if (keep[i]) out.ops.push_back(trace.ops[i]);
  }
  return out;
}

Trace cse(const Trace& trace) {
  Trace out = trace;
  out.stage = "cse";
  out.ops.clear();
  std::vector<int> to(trace.values.size());
  for (size_t v = 0; v < to.size(); ++v) to[v] = static_cast<int>(v);
  absl::flat_hash_map<std::string, size_t> seen;  // key -> index into out.ops
  for (const BoundOp& original : trace.ops) {
    BoundOp op = original;
    rename(op.inputs, to);
    if (op.op->kind == OpKind::kInplace) {
      seen.clear();
      out.ops.push_back(std::move(op));
      continue;
    }
    if (op.op->kind == OpKind::kFunctional && !op.op->random) {
      const std::string key = op_key(op);
      if (auto it = seen.find(key); it != seen.end()) {
        const BoundOp& first = out.ops[it->second];
        for (size_t i = 0; i < op.outputs.size(); ++i) {
          if (op.outputs[i] >= 0) to[static_cast<size_t>(op.outputs[i])] = first.outputs[i];
        }
        continue;
      }
      seen.emplace(key, out.ops.size());
    }
    out.ops.push_back(std::move(op));
  }
  rename(out.outputs, to);
  for (GradEffect& e : out.grad_effects) {
    if (e.value >= 0) e.value = to[static_cast<size_t>(e.value)];
  }
  return out;
}

Trace assign_executors(const Trace& trace,
                       const std::vector<std::shared_ptr<const Executor>>& executors) {
  Trace out = trace;
  out.stage = "executors";
  for (BoundOp& op : out.ops) {
    op.executor.clear();
    for (const auto& e : executors) {
      if (e->claims(out, op)) {
        op.executor = e->name();
        break;
      }
    }
    KILN_CHECK(!op.executor.empty(), "[compile] no executor claims ", op.name(),
               "; keep 'eager' last in CompileOptions::executors");
  }
  return out;
}

}  // namespace kiln::compiler
