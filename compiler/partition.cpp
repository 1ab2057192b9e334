#include "compiler/partition.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <string_view>

#include "absl/container/flat_hash_set.h"
#include "compiler/max_flow.h"

namespace kiln::compiler {
namespace {

// How costly an op is to run again in the backward (the rules of AOTAutograd's partitioner).
enum class Cost : uint8_t {
  kCheap,      // pointwise, views, indexing, factories: memory-bound, redone for free when fused
  kReduction,  // reductions, softmax, norms: cheap when their output is not much smaller
  kExpensive,  // everything else: redone only at RematLevel::kAll
  kBanned,     // never redone (see partition.h)
};

Cost cost_of(const BoundOp& op, const Trace& trace) {
  static const absl::flat_hash_set<std::string_view> banned = {
      "mm", "bmm", "addmm", "flash_attention", "flash_attention_backward"};
  // clang-format off
  static const absl::flat_hash_set<std::string_view> cheap = {
      // pointwise
      "abs", "neg", "relu", "sigmoid", "tanh", "exp", "log", "log1p", "expm1", "erf", "gelu",
      "silu", "sqrt", "rsqrt", "reciprocal", "square", "sign", "ceil", "floor", "round", "sin",
      "cos", "add", "sub", "mul", "div", "pow", "pow_tensor_scalar", "atan2", "maximum",
      "minimum", "clamp", "where", "lerp", "masked_fill", "isclose", "to_copy", "eq", "ne", "gt",
      "ge", "lt", "le", "logical_and", "logical_or", "logical_xor", "logical_not", "bitwise_not",
      "tril", "triu", "rotary_emb", "rotary_emb_qk", "split_qkv_rotary", "merge_qkv_rotary",
      "swiglu", "geglu_tanh",
      // indexing and joining
      "cat", "index", "index_select", "gather", "embedding", "one_hot",
      // factories
      "empty", "arange", "eye"};
  static const absl::flat_hash_set<std::string_view> reductions = {
      "sum", "mean", "prod", "amax", "amin", "max", "min", "max_dim", "min_dim", "argmax",
      "argmin", "any", "all", "var", "std", "norm", "logsumexp", "cumsum", "softmax",
      "log_softmax", "rms_norm", "layer_norm"};
  // clang-format on
  const OpDef& def = *op.op;
  if (def.kind == OpKind::kInplace || def.kind == OpKind::kDynamic || def.random ||
      banned.contains(def.name)) {
    return Cost::kBanned;
  }
  if (def.kind == OpKind::kView) return Cost::kCheap;
  if (def.cross_device && !op.inputs.empty() && op.inputs[0] >= 0 && !op.outputs.empty() &&
      op.outputs[0] >= 0 &&
      !(trace.value(op.inputs[0]).spec.device == trace.value(op.outputs[0]).spec.device)) {
    return Cost::kExpensive;  // a copy between devices
  }
  if (cheap.contains(def.name)) return Cost::kCheap;
  if (reductions.contains(def.name)) return Cost::kReduction;
  return Cost::kExpensive;
}

// Per value: the root of its alias class. A view aliases its input 0; an in-place op's outputs
// alias what it writes (input 0, or every input for ops that name theirs: conservatively).
struct AliasClasses {
  std::vector<int> parent;
  int find(int v) {
    while (parent[static_cast<size_t>(v)] != v) {
      parent[static_cast<size_t>(v)] = parent[static_cast<size_t>(parent[static_cast<size_t>(v)])];
      v = parent[static_cast<size_t>(v)];
    }
    return v;
  }
  void join(int a, int b) {
    if (a >= 0 && b >= 0) parent[static_cast<size_t>(find(a))] = find(b);
  }
};

// The facts about a joint trace that every level's cut shares.
struct Joint {
  const Trace& trace;
  size_t begin = 0;               // the first backward op
  std::vector<int> producer;      // per value: the forward op producing it, or -1
  std::vector<bool> forward;      // per value: an argument or a forward op's output
  std::vector<int> needed;        // forward values the backward reads, in first-read order
  std::vector<bool> memory_safe;  // per forward op: no in-place op writes its memory later
  std::vector<Cost> cost;         // per forward op
  std::vector<int64_t> out_bytes, in_bytes;  // per forward op: its outputs' and inputs' bytes

  Joint(const Trace& t, const JointBoundary& b)
      : trace(t), begin(static_cast<size_t>(b.backward_begin)) {
    const size_t nv = t.values.size();
    producer.assign(nv, -1);
    forward.assign(nv, false);
    for (int v : t.arguments) {
      if (v >= 0) forward[static_cast<size_t>(v)] = true;
    }
    for (size_t i = 0; i < begin; ++i) {
      for (int v : t.ops[i].outputs) {
        if (v < 0) continue;
        forward[static_cast<size_t>(v)] = true;
        producer[static_cast<size_t>(v)] = static_cast<int>(i);
      }
    }
    std::vector<bool> seen(nv, false);
    auto need = [&](int v) {
      if (v >= 0 && forward[static_cast<size_t>(v)] && !seen[static_cast<size_t>(v)]) {
        seen[static_cast<size_t>(v)] = true;
        needed.push_back(v);
      }
    };
    for (size_t i = begin; i < t.ops.size(); ++i) {
      for (int v : t.ops[i].inputs) need(v);
    }
    for (int v : b.grads) need(v);

    // An op may be redone only if the memory it reads and writes holds the same contents in the
    // backward: no in-place op of the joint trace (forward or backward) writes it afterwards.
    // Views of memory that in-place ops write are not redone either: the backward reads the
    // forward's own view, aliased as in eager code.
    AliasClasses alias{std::vector<int>(nv)};
    std::iota(alias.parent.begin(), alias.parent.end(), 0);
    auto written = [](const BoundOp& op) {  // the inputs an in-place op writes
      return op.op->mutated ? op.inputs.size() : std::min<size_t>(1, op.inputs.size());
    };
    for (const BoundOp& op : t.ops) {
      if (op.op->kind == OpKind::kView && !op.inputs.empty()) {
        for (int v : op.outputs) alias.join(v, op.inputs[0]);
      } else if (op.op->kind == OpKind::kInplace) {
        for (size_t k = 0; k < written(op); ++k) {
          for (int v : op.outputs) alias.join(v, op.inputs[k]);
          if (k > 0) alias.join(op.inputs[k], op.inputs[0]);
        }
      }
    }
    std::vector<int> last_write(nv, -1);  // per alias root
    for (size_t i = 0; i < t.ops.size(); ++i) {
      const BoundOp& op = t.ops[i];
      if (op.op->kind != OpKind::kInplace) continue;
      for (size_t k = 0; k < written(op); ++k) {
        if (op.inputs[k] >= 0) {
          last_write[static_cast<size_t>(alias.find(op.inputs[k]))] = static_cast<int>(i);
        }
      }
    }
    memory_safe.assign(begin, true);
    cost.resize(begin);
    out_bytes.assign(begin, 0);
    in_bytes.assign(begin, 0);
    for (size_t i = 0; i < begin; ++i) {
      const BoundOp& op = t.ops[i];
      auto check = [&](int v, int64_t& bytes) {
        if (v < 0) return;
        bytes += value_bytes(t.value(v));
        if (last_write[static_cast<size_t>(alias.find(v))] > static_cast<int>(i)) {
          memory_safe[i] = false;
        }
      };
      for (int v : op.inputs) check(v, in_bytes[i]);
      for (int v : op.outputs) check(v, out_bytes[i]);
      if (op.op->kind == OpKind::kView && !op.inputs.empty() && op.inputs[0] >= 0 &&
          last_write[static_cast<size_t>(alias.find(op.inputs[0]))] >= 0) {
        memory_safe[i] = false;
      }
      cost[i] = cost_of(op, t);
    }
  }

  // Whether forward op i may be redone in the backward at `level`.
  bool recomputable(size_t i, RematLevel level) const {
    if (!memory_safe[i]) return false;
    switch (cost[i]) {
      case Cost::kCheap:
        return level >= RematLevel::kPointwise;
      case Cost::kReduction:
        // A reduction to a quarter of its inputs or less is cheap to save and costly to redo.
        return level >= RematLevel::kReductions ||
               (level == RematLevel::kPointwise && out_bytes[i] * 4 >= in_bytes[i]);
      case Cost::kExpensive:
        return level >= RematLevel::kAll;
      case Cost::kBanned:
        return false;
    }
    return false;
  }

  // The values to save at `level`: the minimum cut nearest the sink (see partition.h).
  std::vector<bool> cut(RematLevel level) const {
    const size_t nv = trace.values.size();
    std::vector<int> node(nv, -1);  // per forward value: its _in node (its _out is node + 1)
    MaxFlow g(2);
    const int source = 0, sink = 1;
    for (size_t v = 0; v < nv; ++v) {
      if (!forward[v]) continue;
      node[v] = g.add_node();
      g.add_node();
      g.add_edge(node[v], node[v] + 1, value_bytes(trace.values[v]));
      if (producer[v] < 0) g.add_edge(source, node[v], MaxFlow::kInfinity);  // an argument
    }
    for (size_t i = 0; i < begin; ++i) {
      const BoundOp& op = trace.ops[i];
      const bool redo = recomputable(i, level);
      for (int w : op.outputs) {
        if (w < 0) continue;
        if (!redo) g.add_edge(source, node[static_cast<size_t>(w)], MaxFlow::kInfinity);
        for (int u : op.inputs) {
          if (u >= 0 && forward[static_cast<size_t>(u)]) {
            g.add_edge(node[static_cast<size_t>(u)] + 1, node[static_cast<size_t>(w)],
                       MaxFlow::kInfinity);
          }
        }
      }
    }
    for (int v : needed) g.add_edge(node[static_cast<size_t>(v)] + 1, sink, MaxFlow::kInfinity);
    g.run(source, sink);  // finite: every path crosses some value's in -> out edge
    const std::vector<bool> reaches = g.reaches_sink();
    std::vector<bool> saved(nv, false);
    for (size_t v = 0; v < nv; ++v) {
      if (forward[v]) {
        saved[v] =
            !reaches[static_cast<size_t>(node[v])] && reaches[static_cast<size_t>(node[v] + 1)];
      }
    }
    return saved;
  }
};

Partition assemble(const Trace& joint, const JointBoundary& b, std::vector<int> saved,
                   std::vector<BoundOp> backward_ops, RematLevel level, int recomputed) {
  Partition p;
  p.saved = std::move(saved);
  p.level = level;
  p.recomputed_ops = recomputed;
  for (int v : p.saved) p.saved_bytes += value_bytes(joint.value(v));
  const auto begin = joint.ops.begin() + b.backward_begin;
  p.forward = joint;
  p.forward.stage = "forward";
  p.forward.ops.assign(joint.ops.begin(), begin);
  p.forward.outputs.insert(p.forward.outputs.end(), p.saved.begin(), p.saved.end());

  p.backward = joint;
  p.backward.stage = "backward";
  p.backward.fn_name = joint.fn_name + "_backward";
  p.backward.ops = std::move(backward_ops);
  p.backward.arguments = p.saved;
  for (int v : b.grad_outputs) {
    if (v >= 0) p.backward.arguments.push_back(v);
  }
  for (int v : p.backward.arguments)
    p.backward.roles[static_cast<size_t>(v)] = ValueRole::kArgument;
  p.backward.outputs = b.grads;
  p.backward.grad_effects.clear();
  p.backward.rng_blocks = 0;
  return p;
}

// The partition of one level: the cut's values saved, the forward ops between them and what the
// backward reads recomputed, each just before its first reader.
Partition recompute_from_cut(const Joint& j, const JointBoundary& b, RematLevel level) {
  const Trace& t = j.trace;
  const std::vector<bool> cut = j.cut(level);
  // The forward ops to redo: walk back from what the backward reads, stopping at cut values.
  std::vector<bool> redo(j.begin, false);
  std::vector<bool> visited(t.values.size(), false);
  std::vector<int> stack(j.needed.rbegin(), j.needed.rend());
  while (!stack.empty()) {
    const int v = stack.back();
    stack.pop_back();
    if (v < 0 || !j.forward[static_cast<size_t>(v)] || visited[static_cast<size_t>(v)] ||
        cut[static_cast<size_t>(v)]) {
      continue;
    }
    visited[static_cast<size_t>(v)] = true;
    const int i = j.producer[static_cast<size_t>(v)];
    KILN_CHECK(i >= 0 && j.recomputable(static_cast<size_t>(i), level),
               "[remat] internal error: the backward reads ", t.value(v).name,
               ", which is neither saved nor recomputable");
    redo[static_cast<size_t>(i)] = true;
    for (int u : t.ops[static_cast<size_t>(i)].inputs) stack.push_back(u);
  }
  // A value a redone op produces is not saved (a multi-output op redone for another output).
  std::vector<bool> available(t.values.size(), true);  // backward values, externals, gradients
  for (size_t v = 0; v < t.values.size(); ++v) {
    if (j.forward[v])
      available[v] = cut[v] && !(j.producer[v] >= 0 && redo[static_cast<size_t>(j.producer[v])]);
  }
  std::vector<int> saved;
  std::vector<bool> is_saved(t.values.size(), false);
  std::vector<BoundOp> ops;
  std::vector<bool> emitted(j.begin, false);
  int recomputed = 0;
  std::function<void(int)> provide = [&](int v) {
    if (v < 0) return;
    if (available[static_cast<size_t>(v)]) {
      if (j.forward[static_cast<size_t>(v)] && !is_saved[static_cast<size_t>(v)]) {
        is_saved[static_cast<size_t>(v)] = true;
        saved.push_back(v);
      }
      return;
    }
    const size_t i = static_cast<size_t>(j.producer[static_cast<size_t>(v)]);
    if (emitted[i]) return;
    for (int u : t.ops[i].inputs) provide(u);
    emitted[i] = true;
    ++recomputed;
    ops.push_back(t.ops[i]);
  };
  for (size_t i = j.begin; i < t.ops.size(); ++i) {
    for (int v : t.ops[i].inputs) provide(v);
    ops.push_back(t.ops[i]);
  }
  for (int v : b.grads) provide(v);
  return assemble(t, b, std::move(saved), std::move(ops), level, recomputed);
}

}  // namespace

const char* remat_level_name(RematLevel level) {
  switch (level) {
    case RematLevel::kNone:
      return "none";
    case RematLevel::kPointwise:
      return "pointwise";
    case RematLevel::kReductions:
      return "reductions";
    case RematLevel::kAll:
      return "all";
  }
  return "?";
}

int64_t value_bytes(const ValueInfo& value) {
  return numel_of(value.spec.sizes) * static_cast<int64_t>(element_size(value.spec.dtype));
}

JointBoundary joint_boundary(const TraceResult& traced) {
  return {traced.backward_begin, traced.grad_outputs, traced.grads};
}

Partition partition_joint(const Trace& joint, const JointBoundary& boundary,
                          const PartitionOptions& options) {
  KILN_CHECK(boundary.backward_begin >= 0 &&
                 static_cast<size_t>(boundary.backward_begin) <= joint.ops.size(),
             "[remat] backward_begin ", boundary.backward_begin,
             " is not an op of the joint trace (", joint.ops.size(), " ops)");
  const Joint j(joint, boundary);
  if (options.policy == RematPolicy::kSaveAll) {
    KILN_CHECK(options.activation_budget < 0, "[remat] activation_budget(",
               options.activation_budget,
               ") needs the min-cut policy: remat(kSaveAll) saves every value the backward reads");
    std::vector<BoundOp> ops(joint.ops.begin() + boundary.backward_begin, joint.ops.end());
    return assemble(joint, boundary, j.needed, std::move(ops), RematLevel::kNone, 0);
  }
  Partition p;
  for (RematLevel level : {RematLevel::kPointwise, RematLevel::kReductions, RematLevel::kAll}) {
    p = recompute_from_cut(j, boundary, level);
    if (options.activation_budget < 0 || p.saved_bytes <= options.activation_budget) return p;
  }
  KILN_FAIL("[remat] activation_budget(", options.activation_budget, " bytes) is below what ",
            joint.fn_name, "'s backward must save: ", p.saved_bytes,
            " bytes even when every op that may be is recomputed (outputs of matmuls, attention, "
            "random and in-place ops, and the arguments the backward reads, are always saved)");
}

}  // namespace kiln::compiler
