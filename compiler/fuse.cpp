#include "compiler/fuse.h"

#include <algorithm>
#include <string_view>
#include <variant>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"

namespace kiln::compiler {
namespace {

// The pointwise ops: every output element depends on the inputs' elements at its (broadcast)
// position only.
const absl::flat_hash_set<std::string_view>& pointwise_ops() {
  static const absl::flat_hash_set<std::string_view> ops = {
      // unary
      "abs", "ceil", "floor", "round", "neg", "relu", "sign", "square", "sqrt", "rsqrt",
      "reciprocal", "exp", "expm1", "log", "log1p", "sin", "cos", "tanh", "erf", "sigmoid", "silu",
      "gelu", "logical_not", "bitwise_not", "pow_tensor_scalar",
      // gelu's gradient, g * gelu'(x)
      "gelu_backward",
      // binary and ternary
      "add", "sub", "mul", "div", "pow", "maximum", "minimum", "atan2", "eq", "ne", "lt", "le",
      "gt", "ge", "logical_and", "logical_or", "logical_xor", "where", "clamp", "lerp", "isclose",
      "masked_fill",
      // dtype conversion
      "to_copy"};
  return ops;
}

// Row ops: the attribute (an int64 dim or a Shape of dims) saying where they reduce, scan or
// normalise input 0 (tensor/ops/reduce.cpp and softmax.cpp give the layouts).
const absl::flat_hash_map<std::string_view, size_t>& row_ops() {
  static const absl::flat_hash_map<std::string_view, size_t> ops = {
      {"sum", 0},    {"prod", 0},    {"mean", 0},   {"amax", 0},    {"amin", 0},
      {"max", 0},    {"min", 0},     {"all", 0},    {"any", 0},     {"logsumexp", 0},
      {"var", 0},    {"std", 0},     {"norm", 1},   {"softmax", 0}, {"log_softmax", 0},
      {"cumsum", 0}, {"max_dim", 0}, {"min_dim", 0}};
  return ops;
}

int64_t rank_of(const Trace& t, int v) {
  return static_cast<int64_t>(t.value(v).spec.sizes.size());
}

// Whether a row op leaves dim 0 alone: its dims are given and none of them wraps to 0.
bool keeps_rows(const Trace& t, const BoundOp& op) {
  if (op.inputs.empty() || op.inputs[0] < 0) return false;
  const int64_t rank = rank_of(t, op.inputs[0]);
  if (rank == 0) return false;
  const size_t at = row_ops().at(op.name());
  if (at >= op.attrs.size()) return false;
  Shape dims;
  if (const auto* one = std::get_if<int64_t>(&op.attrs[at])) {
    dims = {*one};
  } else if (const auto* many = std::get_if<Shape>(&op.attrs[at])) {
    dims = *many;
  } else {
    return false;
  }
  if (dims.empty()) return false;  // every dim
  return std::none_of(dims.begin(), dims.end(),
                      [&](int64_t d) { return ((d % rank) + rank) % rank == 0; });
}

// The op's rows: the leading size shared by all its outputs (-1: none, or a 0-d output).
int64_t rows_of(const Trace& t, const BoundOp& op) {
  int64_t rows = -1;
  for (int v : op.outputs) {
    if (v < 0) continue;
    const Shape& s = t.value(v).spec.sizes;
    if (s.empty() || (rows >= 0 && s[0] != rows)) return -1;
    rows = s[0];
  }
  return rows;
}

// Whether the op reads its inputs as the region rule requires (fuse.h), given which of them
// the region produces.
template <typename FromRegion>
bool reads_by_rows(const Trace& t, const BoundOp& op, FuseKind kind, int64_t rows,
                   const FromRegion& from_region) {
  const int64_t out_rank = rank_of(t, op.outputs[0]);
  for (size_t i = 0; i < op.inputs.size(); ++i) {
    const int v = op.inputs[i];
    if (v < 0) continue;
    const Shape& s = t.value(v).spec.sizes;
    const bool row_input = kind == FuseKind::kRow && i == 0;
    const bool sliced =
        !s.empty() && s[0] == rows && (row_input || static_cast<int64_t>(s.size()) == out_rank);
    if (row_input && !sliced) return false;
    if (from_region(v) && !sliced) return false;
    // A pointwise input from outside: broadcasting makes it either row-sliced or constant
    // along the rows (rank below the output's, or one row).
  }
  return true;
}

}  // namespace

FuseKind fuse_kind(const BoundOp& op) {
  if (op.op->kind != OpKind::kFunctional || op.op->random || op.autocast.any()) {
    return FuseKind::kNone;
  }
  if (pointwise_ops().contains(op.name())) return FuseKind::kPointwise;
  if (row_ops().contains(op.name())) return FuseKind::kRow;
  return FuseKind::kNone;
}

absl::flat_hash_set<int> values_read_outside(const Trace& trace, size_t begin, size_t end) {
  absl::flat_hash_set<int> out;
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    if (i >= begin && i < end) continue;
    for (int v : trace.ops[i].inputs) out.insert(v);
  }
  for (int v : trace.outputs) out.insert(v);
  for (const GradEffect& e : trace.grad_effects) out.insert(e.value);
  return out;
}

Trace fuse(const Trace& trace, const Executor& executor) {
  const size_t n = trace.ops.size();
  struct Group {
    int64_t rows = 0;
    bool open = true;
    int merged_into = -1;
    std::vector<size_t> members;
  };
  std::vector<Group> groups;
  std::vector<int> produced_by(trace.values.size(), -1);  // group id
  auto find = [&](int g) {
    while (groups[static_cast<size_t>(g)].merged_into >= 0)
      g = groups[static_cast<size_t>(g)].merged_into;
    return g;
  };
  auto open_group_of = [&](int v) {
    if (v < 0 || produced_by[static_cast<size_t>(v)] < 0) return -1;
    const int g = find(produced_by[static_cast<size_t>(v)]);
    return groups[static_cast<size_t>(g)].open ? g : -1;
  };
  auto close_read = [&](const BoundOp& op) {
    for (int v : op.inputs) {
      if (const int g = open_group_of(v); g >= 0) groups[static_cast<size_t>(g)].open = false;
    }
  };

  for (size_t i = 0; i < n; ++i) {
    const BoundOp& op = trace.ops[i];
    const FuseKind kind = op.region < 0 ? fuse_kind(op) : FuseKind::kNone;
    int64_t rows = -1;
    bool candidate = kind != FuseKind::kNone && executor.fuses(trace, op);
    if (candidate) rows = rows_of(trace, op);
    candidate = candidate && rows >= 0 && (kind != FuseKind::kRow || keeps_rows(trace, op));
    if (!candidate) {
      close_read(op);
      if (op.op->kind == OpKind::kInplace) {
        for (Group& g : groups) g.open = false;
      }
      continue;
    }
    // Join the open groups it reads when their rows match and it reads them by rows; else
    // close them (it reads their values from outside) and start a group of its own.
    std::vector<int> reads;
    for (int v : op.inputs) {
      const int g = open_group_of(v);
      if (g >= 0 && std::find(reads.begin(), reads.end(), g) == reads.end()) reads.push_back(g);
    }
    const bool joins = !reads.empty() && std::all_of(reads.begin(), reads.end(), [&](int g) {
      return groups[static_cast<size_t>(g)].rows == rows;
    }) && reads_by_rows(trace, op, kind, rows, [&](int v) { return open_group_of(v) >= 0; });
    int target;
    if (joins) {
      target = reads[0];
      for (size_t k = 1; k < reads.size(); ++k) {
        Group& other = groups[static_cast<size_t>(reads[k])];
        Group& into = groups[static_cast<size_t>(target)];
        into.members.insert(into.members.end(), other.members.begin(), other.members.end());
        other.members.clear();
        other.open = false;
        other.merged_into = target;
      }
    } else {
      close_read(op);
      if (!reads_by_rows(trace, op, kind, rows, [](int) { return false; })) continue;
      target = static_cast<int>(groups.size());
      groups.push_back(Group{rows, true, -1, {}});
    }
    groups[static_cast<size_t>(target)].members.push_back(i);
    for (int v : op.outputs) {
      if (v >= 0) produced_by[static_cast<size_t>(v)] = target;
    }
  }

  // Regions: groups of 2 ops or more, each placed at its last member.
  Trace out = trace;
  out.stage = "fuse";
  out.ops.clear();
  std::vector<int> last_of(n, -1);  // op index -> group placed there
  std::vector<bool> member(n, false);
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<size_t>& m = groups[g].members;
    if (m.size() < 2) continue;
    std::sort(m.begin(), m.end());
    last_of[m.back()] = static_cast<int>(g);
    for (size_t i : m) member[i] = true;
  }
  for (size_t i = 0; i < n; ++i) {
    if (!member[i]) {
      out.ops.push_back(trace.ops[i]);
      continue;
    }
    if (last_of[i] < 0) continue;
    const int region = static_cast<int>(out.region_names.size());
    out.region_names.push_back("fusion" + std::to_string(region));
    for (size_t k : groups[static_cast<size_t>(last_of[i])].members) {
      BoundOp op = trace.ops[k];
      op.region = region;
      op.executor = executor.name();
      out.ops.push_back(std::move(op));
    }
  }
  return out;
}

Trace attach_epilogues(const Trace& trace, const Executor& executor) {
  const size_t n = trace.ops.size();
  const size_t nv = trace.values.size();
  // The ops reading each value, in order (an op reading it twice is there twice).
  std::vector<std::vector<int>> readers(nv);
  for (size_t i = 0; i < n; ++i) {
    for (int v : trace.ops[i].inputs) {
      if (v >= 0) readers[static_cast<size_t>(v)].push_back(static_cast<int>(i));
    }
  }
  std::vector<bool> escapes(nv, false);  // returned or assigned to a grad
  for (int v : trace.outputs) {
    if (v >= 0) escapes[static_cast<size_t>(v)] = true;
  }
  for (const GradEffect& e : trace.grad_effects) {
    if (e.value >= 0) escapes[static_cast<size_t>(e.value)] = true;
  }
  // The chain from an mm at `i` to its consumer, or empty. Each link is its value's first
  // reader; a value with other readers (or returned) is kept: the region writes it too, which
  // the executor must accept, and its other readers must come after the consumer.
  auto chain_from = [&](size_t i) {
    std::vector<size_t> members{i};
    const BoundOp& mm = trace.ops[i];
    if (mm.region >= 0 || (mm.name() != "mm" && mm.name() != "addmm") || mm.outputs.size() != 1 ||
        mm.outputs[0] < 0) {
      return std::vector<size_t>{};
    }
    std::vector<int> kept;
    int v = mm.outputs[0];
    while (true) {
      const auto sv = static_cast<size_t>(v);
      if (readers[sv].empty()) return std::vector<size_t>{};
      if (escapes[sv] || readers[sv].size() != 1) kept.push_back(v);
      const auto j = static_cast<size_t>(readers[sv].front());
      const BoundOp& next = trace.ops[j];
      if (next.region >= 0) return std::vector<size_t>{};
      members.push_back(j);
      if (next.name() == "view" && next.outputs.size() == 1 && next.outputs[0] >= 0) {
        v = next.outputs[0];
        continue;
      }
      if (!executor.fuses_epilogue(trace, mm, v, next, !kept.empty())) {
        return std::vector<size_t>{};
      }
      break;
    }
    const size_t consumer = members.back();
    for (int kv : kept) {  // readers[kv].front() is the chain's
      const std::vector<int>& r = readers[static_cast<size_t>(kv)];
      for (size_t k = 1; k < r.size(); ++k) {
        if (static_cast<size_t>(r[k]) <= consumer) return std::vector<size_t>{};
      }
    }
    for (size_t k = i + 1; k < consumer; ++k) {  // nothing may write what the mm reads
      if (trace.ops[k].op->kind == OpKind::kInplace) return std::vector<size_t>{};
    }
    return members;
  };

  std::vector<std::vector<size_t>> chains;
  std::vector<int> chain_at(n, -1);  // consumer index -> chain
  std::vector<bool> member(n, false);
  for (size_t i = 0; i < n; ++i) {
    if (member[i]) continue;
    std::vector<size_t> c = chain_from(i);
    // An add of two products (both views of mms) takes the first; the second is its residual.
    if (c.empty() || member[c.back()]) continue;
    for (size_t k : c) member[k] = true;
    chain_at[c.back()] = static_cast<int>(chains.size());
    chains.push_back(std::move(c));
  }
  if (chains.empty()) return trace;
  Trace out = trace;
  out.stage = "fuse";
  out.ops.clear();
  for (size_t i = 0; i < n; ++i) {
    if (!member[i]) {
      out.ops.push_back(trace.ops[i]);
      continue;
    }
    if (chain_at[i] < 0) continue;
    const int region = static_cast<int>(out.region_names.size());
    out.region_names.push_back("fusion" + std::to_string(region));
    for (size_t k : chains[static_cast<size_t>(chain_at[i])]) {
      BoundOp op = trace.ops[k];
      op.region = region;
      op.executor = executor.name();
      out.ops.push_back(std::move(op));
    }
  }
  return out;
}

}  // namespace kiln::compiler
