// "fused_cpu": the CPU executor of fusion regions (compiler/fuse.h).
//
// Eager code runs a chain such as sigmoid(x * w + b).sum(1) as four passes over memory, each
// writing a full-size intermediate that the next one reads back. This executor runs the region
// in row blocks instead: the blocks go to the thread pool, and within a block each member runs
// its own CPU kernel on the block's rows, so the intermediates are a few hundred KiB that stay
// in cache, and only the region's outputs (the values read outside it) reach memory.
//
// Same bits as eager, by construction: every element is computed by the kernel eager code
// runs, on the same values. The region rule makes rows independent; what remains is where a
// kernel's result depends on how its tensor is split, and the executor avoids both cases:
//   - Eigen's packet math (log, tanh, erf, gelu, ... on contiguous f32/f64: kernels/cpu/unary.cpp)
//     rounds differently from the scalar loop it uses for a range's unaligned head and tail, so
//     those ops are not fused on f32/f64;
//   - a reduction with fewer than 4 outputs per thread splits its reduced dim across threads
//     (kernels/cpu/reduce.h), so a region with a row op gives each block at least 4 rows per
//     thread, and a region of fewer rows runs whole.
// A region of one block (small tensors, or few rows) runs its members on the whole tensors, as
// eager code would, with no copies.
#include <algorithm>
#include <memory>
#include <string_view>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "autograd/grad_mode.h"
#include "compiler/executor.h"
#include "compiler/fuse.h"
#include "tensor/ops.h"
#include "tensor/parallel.h"
#include "tensor/profiler.h"

namespace kiln::compiler {
namespace {

// Elements of the largest value per block: a chain of a few such intermediates stays in L2.
constexpr int64_t kBlockElements = 16384;

// Float ops with an Eigen spelling on the CPU (kernels/cpu/unary.cpp's EigenSpelling).
bool split_sensitive(const Trace& t, const BoundOp& op) {
  static const absl::flat_hash_set<std::string_view> eigen = {"log", "log1p", "expm1", "sin",
                                                              "cos", "tanh",  "erf",   "gelu"};
  if (!eigen.contains(op.name()) || op.inputs.empty() || op.inputs[0] < 0) return false;
  const ScalarType d = t.value(op.inputs[0]).spec.dtype;
  return d == kFloat || d == kDouble;
}

// An uninitialised tensor with the spec's sizes and strides.
Tensor empty_as(const TensorSpec& spec) {
  const TensorOptions options = TensorOptions().dtype(spec.dtype).device(spec.device);
  int64_t extent = 1;
  for (size_t d = 0; d < spec.sizes.size(); ++d) {
    if (spec.sizes[d] == 0) return empty(spec.sizes, options);
    extent += (spec.sizes[d] - 1) * spec.strides[d];
  }
  if (spec.strides.size() != spec.sizes.size()) return empty(spec.sizes, options);
  return empty({extent}, options).as_strided(spec.sizes, spec.strides, 0);
}

// A region prepared for running: its members read and write local slots. The first slots hold
// the region's inputs (a value read whole or by rows: each its own slot), then the members'
// outputs.
struct RegionPlan {
  std::vector<const BoundOp*> members;
  int64_t rows = 0;
  int64_t row_elements = 1;  // of the largest value
  bool has_row_op = false;
  struct Input {
    int value;
    bool by_rows;
  };
  std::vector<Input> inputs;                    // slots [0, inputs.size())
  std::vector<std::vector<int>> member_inputs;  // slot per input (-1: absent)
  std::vector<std::vector<int>> member_outputs;
  std::vector<std::vector<int>> release_after;  // slots dropped after each member
  size_t num_slots = 0;
  std::vector<std::pair<int, int>> outputs;  // (value id, slot): the values read outside
  std::vector<TensorSpec> output_specs;

  int64_t blocks() const {
    int64_t block_rows = std::max<int64_t>(1, kBlockElements / std::max<int64_t>(1, row_elements));
    if (has_row_op) block_rows = std::max<int64_t>(block_rows, 4 * get_num_threads());
    return std::max<int64_t>(1, rows / block_rows);
  }

  // Runs the members on rows [r0, r1) (all rows: the whole tensors); fills `slots`.
  void run(const Frame& frame, int64_t r0, int64_t r1, bool whole,
           std::vector<Tensor>& slots) const {
    for (size_t i = 0; i < inputs.size(); ++i) {
      const Tensor& t = frame.slots[static_cast<size_t>(inputs[i].value)];
      slots[i] = whole || !inputs[i].by_rows ? t : t.narrow(0, r0, r1 - r0);
    }
    for (size_t k = 0; k < members.size(); ++k) {
      const BoundOp& op = *members[k];
      OpCall call;
      call.op = op.op;
      call.inputs.reserve(op.inputs.size());
      for (int s : member_inputs[k])
        call.inputs.push_back(s >= 0 ? slots[static_cast<size_t>(s)] : Tensor());
      call.attrs = op.attrs;
      dispatch_after(call, DispatchKey::Trace);
      for (size_t o = 0; o < member_outputs[k].size() && o < call.outputs.size(); ++o) {
        if (member_outputs[k][o] >= 0)
          slots[static_cast<size_t>(member_outputs[k][o])] = std::move(call.outputs[o]);
      }
      for (int s : release_after[k]) slots[static_cast<size_t>(s)] = Tensor();
    }
  }
};

// Whether member input j of `op` is read by rows (else whole), for a value from outside the
// region: by the region rule (fuse.h), a row op's input 0, or a pointwise input with the
// output's rank and the region's rows.
bool reads_by_rows(const Trace& t, const BoundOp& op, size_t j, int64_t rows) {
  const Shape& s = t.value(op.inputs[j]).spec.sizes;
  const size_t out_rank = t.value(op.outputs[0]).spec.sizes.size();
  return !s.empty() && s[0] == rows &&
         ((fuse_kind(op) == FuseKind::kRow && j == 0) || s.size() == out_rank);
}

std::shared_ptr<const RegionPlan> plan_region(const Trace& t, size_t begin, size_t end) {
  auto plan = std::make_shared<RegionPlan>();
  plan->rows = t.value(t.ops[begin].outputs[0]).spec.sizes[0];
  auto note_elements = [&](int v) {
    const Shape& s = t.value(v).spec.sizes;
    int64_t per_row = 1;
    for (size_t d = 1; d < s.size(); ++d) per_row *= s[d];
    plan->row_elements = std::max(plan->row_elements, per_row);
  };
  // Slots: the region's inputs first, then the members' outputs in order.
  absl::flat_hash_map<int, int> slot_of;         // produced value -> slot
  absl::flat_hash_map<int64_t, int> input_slot;  // value * 2 + by_rows -> slot
  for (size_t i = begin; i < end; ++i) {
    const BoundOp& op = t.ops[i];
    for (size_t j = 0; j < op.inputs.size(); ++j) {
      const int v = op.inputs[j];
      if (v < 0 || slot_of.contains(v)) continue;
      const bool by_rows = reads_by_rows(t, op, j, plan->rows);
      const int64_t key = static_cast<int64_t>(v) * 2 + (by_rows ? 1 : 0);
      if (input_slot.emplace(key, static_cast<int>(plan->inputs.size())).second) {
        plan->inputs.push_back({v, by_rows});
        if (by_rows) note_elements(v);
      }
    }
    for (int v : op.outputs) {
      if (v >= 0) slot_of.emplace(v, -1);  // numbered below
    }
  }
  int next = static_cast<int>(plan->inputs.size());
  std::vector<int> produced;  // in order
  for (size_t i = begin; i < end; ++i) {
    const BoundOp& op = t.ops[i];
    plan->members.push_back(&op);
    plan->has_row_op |= fuse_kind(op) == FuseKind::kRow;
    std::vector<int> ins;
    for (size_t j = 0; j < op.inputs.size(); ++j) {
      const int v = op.inputs[j];
      if (v < 0) {
        ins.push_back(-1);
      } else if (auto it = slot_of.find(v); it != slot_of.end() && it->second >= 0) {
        ins.push_back(it->second);
      } else {
        const bool by_rows = reads_by_rows(t, op, j, plan->rows);
        ins.push_back(input_slot.at(static_cast<int64_t>(v) * 2 + (by_rows ? 1 : 0)));
      }
    }
    plan->member_inputs.push_back(std::move(ins));
    std::vector<int> outs;
    for (int v : op.outputs) {
      if (v >= 0) {
        slot_of[v] = next;
        produced.push_back(v);
        note_elements(v);
      }
      outs.push_back(v >= 0 ? next++ : -1);
    }
    plan->member_outputs.push_back(std::move(outs));
  }
  plan->num_slots = static_cast<size_t>(next);

  // The region's outputs: its values that later ops, the program's outputs or grads read.
  const absl::flat_hash_set<int> read_outside = values_read_outside(t, begin, end);
  std::vector<bool> keep(plan->num_slots, false);
  for (int v : produced) {
    if (read_outside.contains(v)) {
      plan->outputs.emplace_back(v, slot_of.at(v));
      plan->output_specs.push_back(t.value(v).spec);
      keep[static_cast<size_t>(slot_of.at(v))] = true;
    }
  }
  // Within a block, a slot goes after its last reader (or its producer, when nothing reads it),
  // so a region that runs whole holds no more than eager code would.
  std::vector<int> last(plan->num_slots, -1);
  for (size_t k = 0; k < plan->members.size(); ++k) {
    for (int s : plan->member_inputs[k]) {
      if (s >= 0) last[static_cast<size_t>(s)] = static_cast<int>(k);
    }
    for (int s : plan->member_outputs[k]) {
      if (s >= 0 && last[static_cast<size_t>(s)] < 0)
        last[static_cast<size_t>(s)] = static_cast<int>(k);
    }
  }
  plan->release_after.resize(plan->members.size());
  for (size_t s = 0; s < plan->num_slots; ++s) {
    if (!keep[s] && last[s] >= 0)
      plan->release_after[static_cast<size_t>(last[s])].push_back(static_cast<int>(s));
  }
  return plan;
}

class FusedCpuExecutor final : public Executor {
 public:
  const std::string& name() const override {
    static const std::string n = "fused_cpu";
    return n;
  }
  // Runs regions only: single ops stay with the executors after it.
  bool claims(const Trace&, const BoundOp&) const override { return false; }
  Step lower(const Trace&, const BoundOp& op) const override {
    KILN_FAIL("[compile] fused_cpu runs fusion regions only, not the single op ", op.name());
  }

  bool fuses(const Trace& t, const BoundOp& op) const override {
    auto on_cpu = [&](int v) { return v < 0 || t.value(v).spec.device.is_cpu(); };
    return std::all_of(op.inputs.begin(), op.inputs.end(), on_cpu) &&
           std::all_of(op.outputs.begin(), op.outputs.end(), on_cpu) && !split_sensitive(t, op);
  }

  Step lower_region(const Trace& t, size_t begin, size_t end) const override {
    std::shared_ptr<const RegionPlan> plan = plan_region(t, begin, end);
    return [plan, executor = &name()](Frame& frame) {
      const RegionPlan& p = *plan;
      const int64_t blocks = p.blocks();
      // Members carry no autocast state (fuse_kind): run them with autocast off, as the eager
      // executor would, whatever the caller's state.
      const AutocastScope no_autocast(BoundOp::Autocast{});
      if (blocks == 1) {
        std::vector<Tensor> slots(p.num_slots);
        p.run(frame, 0, p.rows, /*whole=*/true, slots);
        for (const auto& [v, s] : p.outputs)
          frame.slots[static_cast<size_t>(v)] = std::move(slots[static_cast<size_t>(s)]);
        return;
      }
      std::vector<Tensor> outs;
      outs.reserve(p.outputs.size());
      for (const TensorSpec& spec : p.output_specs) outs.push_back(empty_as(spec));
      internal::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
        NoGradGuard no_grad;  // grad mode, autocast and the profiler's label are per thread
        const AutocastScope off(BoundOp::Autocast{});
        const profiler::ExecutorLabel label(executor);
        std::vector<Tensor> slots(p.num_slots);
        for (int64_t blk = b; blk < e; ++blk) {
          const int64_t r0 = blk * p.rows / blocks, r1 = (blk + 1) * p.rows / blocks;
          p.run(frame, r0, r1, /*whole=*/false, slots);
          for (size_t o = 0; o < p.outputs.size(); ++o) {
            outs[o].narrow(0, r0, r1 - r0).copy_(slots[static_cast<size_t>(p.outputs[o].second)]);
          }
        }
      });
      for (size_t o = 0; o < p.outputs.size(); ++o)
        frame.slots[static_cast<size_t>(p.outputs[o].first)] = std::move(outs[o]);
    };
  }
};

}  // namespace

std::shared_ptr<const Executor> make_fused_cpu_executor() {
  return std::make_shared<FusedCpuExecutor>();
}

}  // namespace kiln::compiler
