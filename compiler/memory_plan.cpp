#include "compiler/memory_plan.h"

#include <algorithm>
#include <map>
#include <numeric>

namespace kiln::compiler {
namespace {

int64_t bytes_of(const ValueInfo& v) {
  int64_t extent = 1;  // elements spanned by the layout (strides may leave no gaps or some)
  const TensorSpec& s = v.spec;
  if (s.strides.size() != s.sizes.size()) {
    extent = numel_of(s.sizes);
  } else {
    for (size_t d = 0; d < s.sizes.size(); ++d) {
      if (s.sizes[d] == 0) return 0;
      extent += (s.sizes[d] - 1) * s.strides[d];
    }
  }
  return extent * static_cast<int64_t>(element_size(s.dtype));
}

int64_t aligned(int64_t n) { return (n + kArenaAlignment - 1) / kArenaAlignment * kArenaAlignment; }

}  // namespace

Trace plan_memory(const Trace& trace) {
  Trace out = trace;
  out.stage = "plan_memory";
  out.arenas.clear();
  for (ValueInfo& v : out.values) v.arena = -1;
  const size_t n = trace.ops.size();
  const size_t nv = trace.values.size();
  const std::vector<int> at = step_positions(trace);
  // Candidates and their lifetimes [first, last].
  std::vector<bool> excluded(nv, false);
  for (int v : trace.outputs) {
    if (v >= 0) excluded[static_cast<size_t>(v)] = true;
  }
  for (const GradEffect& e : trace.grad_effects) {
    if (e.value >= 0) excluded[static_cast<size_t>(e.value)] = true;
  }
  std::vector<int> first(nv, -1), last(nv, -1);
  for (size_t i = 0; i < n; ++i) {
    const BoundOp& op = trace.ops[i];
    const bool aliases = op.op->kind == OpKind::kView || op.op->kind == OpKind::kInplace;
    for (int v : op.inputs) {
      if (v < 0) continue;
      if (aliases) excluded[static_cast<size_t>(v)] = true;
      last[static_cast<size_t>(v)] = std::max(last[static_cast<size_t>(v)], at[i]);
    }
    const bool placeable = op.op->kind == OpKind::kFunctional && op.region < 0 &&
                           op.executor == "eager" && !op.autocast.any() && !op.op->cross_device;
    for (int v : op.outputs) {
      if (v < 0) continue;
      // CUDA values keep the caching allocator: see memory_plan.h.
      if (!placeable || !trace.value(v).spec.device.is_cpu())
        excluded[static_cast<size_t>(v)] = true;
      first[static_cast<size_t>(v)] = at[i];
      last[static_cast<size_t>(v)] = std::max(last[static_cast<size_t>(v)], at[i]);
    }
  }
  std::vector<int> placed;
  for (size_t v = 0; v < nv; ++v) {
    if (trace.roles[v] == ValueRole::kOp && first[v] >= 0 && !excluded[v] &&
        bytes_of(trace.values[v]) > 0) {
      placed.push_back(static_cast<int>(v));
    }
  }
  // Greedy: largest first (ties: earliest), each at the lowest offset free over its lifetime.
  std::stable_sort(placed.begin(), placed.end(), [&](int a, int b) {
    return bytes_of(trace.value(a)) > bytes_of(trace.value(b));
  });
  std::map<std::string, int> arena_of_device;
  struct Block {
    int64_t offset, size;
    int first, last;
  };
  std::vector<std::vector<Block>> blocks;
  for (int v : placed) {
    ValueInfo& info = out.values[static_cast<size_t>(v)];
    const std::string key = info.spec.device.str();
    auto [it, fresh] = arena_of_device.emplace(key, static_cast<int>(out.arenas.size()));
    if (fresh) {
      out.arenas.push_back(Arena{info.spec.device, 0});
      blocks.emplace_back();
    }
    std::vector<Block>& taken = blocks[static_cast<size_t>(it->second)];
    const int f = first[static_cast<size_t>(v)], l = last[static_cast<size_t>(v)];
    const int64_t size = aligned(bytes_of(info));
    std::vector<const Block*> overlapping;
    for (const Block& b : taken) {
      if (b.first <= l && f <= b.last) overlapping.push_back(&b);
    }
    std::sort(overlapping.begin(), overlapping.end(),
              [](const Block* a, const Block* b) { return a->offset < b->offset; });
    int64_t offset = 0;
    for (const Block* b : overlapping) {
      if (offset + size <= b->offset) break;
      offset = std::max(offset, b->offset + b->size);
    }
    taken.push_back(Block{offset, size, f, l});
    info.arena = it->second;
    info.arena_offset = offset;
    Arena& arena = out.arenas[static_cast<size_t>(it->second)];
    arena.bytes = std::max(arena.bytes, offset + size);
  }
  return out;
}

int64_t placed_bytes(const Trace& trace) {
  int64_t total = 0;
  for (const ValueInfo& v : trace.values) {
    if (v.arena >= 0) total += aligned(bytes_of(v));
  }
  return total;
}

}  // namespace kiln::compiler
