// remat: splits a joint forward+backward trace into a forward and a backward program, choosing
// what the forward saves for the backward by a minimum cut, as AOTAutograd's min-cut
// rematerialization partitioner does. The backward may recompute cheap forward values (a
// pointwise chain, a view, a norm) from saved ones instead of keeping them alive between the two.
//
//   compiler::Partition p = compiler::partition_joint(joint, compiler::joint_boundary(traced),
//                                                     {});  // kMinCut, no budget
//   p.forward;         // returns the user's outputs, then p.saved
//   p.backward;        // arguments: p.saved, then the output gradients; may recompute
//   p.saved_bytes;     // what the saved values hold (numel * element size each)
//   p.recomputed_ops;  // forward ops copied into the backward
//
// The cut: each forward value v is two nodes v_in -> v_out joined by an edge of v's bytes
// (saving v cuts it); data flows u_out -> v_in with infinite capacity; the source feeds the
// forward's arguments and every value that must not be recomputed, and the values the backward
// reads feed the sink. Externals (captured tensors) are no nodes: both programs read them. A
// minimum cut is a cheapest set of values from which the backward can recompute all it reads; of
// the minimum cuts the one nearest the sink is taken (the least recomputation).
//
// Never recomputed: matmuls (mm, bmm, addmm), attention (flash_attention), random ops (a second
// draw would differ), kDynamic ops, in-place ops, any op reading or writing memory that an
// in-place op of the joint trace writes after it (the recomputation would see other contents),
// and views of memory that in-place ops write (the backward keeps the forward's own alias).
// Recomputed by default (RematLevel::kPointwise): pointwise ops, views, indexing and factories,
// and reductions and norms whose output is not much smaller than their inputs (a reduction to a
// quarter or less is cheap to save and costly to redo). An activation budget raises the level
// until the saved bytes fit: kReductions allows every reduction and norm, kAll every op that is
// not banned. The recomputed ops read only saved values, externals and each other; each is
// placed before its first reader in the backward, so recomputed values do not all live at once.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "compiler/trace.h"
#include "compiler/tracer.h"

namespace kiln::compiler {

enum class RematPolicy : uint8_t {
  kSaveAll,  // save every forward value the backward reads (no recomputation)
  kMinCut,   // save a minimum cut and recompute the rest
};

// What may be recomputed, from the least to the most.
enum class RematLevel : uint8_t {
  kNone,        // kSaveAll
  kPointwise,   // pointwise ops, views, indexing, factories, non-shrinking reductions and norms
  kReductions,  // and every reduction and norm
  kAll,         // and every op that is not banned
};
const char* remat_level_name(RematLevel level);

struct PartitionOptions {
  RematPolicy policy = RematPolicy::kMinCut;
  // Bytes the saved values may hold at most (-1: no budget). kMinCut raises the level until the
  // cut fits, and fails naming the least it can save when even kAll does not.
  int64_t activation_budget = -1;
};

// What partition_joint needs of a joint TraceResult (compiler/tracer.h).
struct JointBoundary {
  int backward_begin = -1;        // ops from here on are the backward
  std::vector<int> grad_outputs;  // per output of the callable: its gradient's value, or -1
  std::vector<int> grads;         // the gradients the backward returns (-1: none)
};
JointBoundary joint_boundary(const TraceResult& traced);

struct Partition {
  Trace forward;           // stage "forward": the user's outputs, then `saved`
  Trace backward;          // stage "backward": arguments `saved`, then the output gradients
  std::vector<int> saved;  // forward values (arguments or op outputs) the backward reads
  int64_t saved_bytes = 0;
  int recomputed_ops = 0;  // forward ops the backward runs again
  RematLevel level = RematLevel::kNone;
};

// Splits `joint` (whose outputs are the callable's) at `boundary.backward_begin`.
Partition partition_joint(const Trace& joint, const JointBoundary& boundary,
                          const PartitionOptions& options = {});

// The bytes of a value's elements (numel * element size).
int64_t value_bytes(const ValueInfo& value);

}  // namespace kiln::compiler
