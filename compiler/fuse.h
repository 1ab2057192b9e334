// Fusion: the `fuse` pass groups ops that one executor runs together into regions, which the
// listing prints as named blocks and the program runs as one step of that executor:
//
//   fusion0:  # region [fused_cpu]               (sigmoid(x * w + b).sum({1}, true))
//     t3 = mul(a0, a1)                                    # f32[256, 512] cpu
//     t4 = add(t3, a2; 1)                                 # f32[256, 512] cpu
//     t5 = sigmoid(t4)                                    # f32[256, 512] cpu
//     t6 = sum(t5; [1], true, none)                       # f32[256, 1] cpu
//
// The region rule, which every executor that runs regions may rely on:
//   - Members are functional ops the executor fuses (Executor::fuses): pointwise ops (inputs
//     broadcast to the output) and row ops, which reduce, scan or normalise within dims other
//     than 0 (sum over dim 1, softmax over the last dim, ...).
//   - They share one iteration domain: every output has the same leading size N0 (the rows).
//   - A value produced in the region and read by a member has N0 rows at the rank of the
//     member's output (a row op reads it whole-row). The region's other inputs either have N0
//     rows at that rank (sliced by rows) or broadcast along the rows (passed whole).
// So rows [r0, r1) of every output need only rows [r0, r1) of the region's values: a region runs
// on any split of its rows, which is how the CPU executor keeps its working set in cache and how
// a GPU executor would give rows to blocks.
//
// Placement: a region runs where its last member was, so the pass moves the other members down
// to it (the region becomes a contiguous block). That is sound because a region closes before
// any op outside it reads one of its values, and before any in-place op (which may write what
// an earlier member read).
#pragma once

#include "absl/container/flat_hash_set.h"
#include "compiler/executor.h"
#include "compiler/trace.h"

namespace kiln::compiler {

// What an op is to fusion, by the region rule above.
enum class FuseKind : uint8_t {
  kNone,       // never fused
  kPointwise,  // elementwise over its broadcast inputs
  kRow,        // reduces, scans or normalises input 0 within dims given by an attribute
};
FuseKind fuse_kind(const BoundOp& op);

// The values that something outside the ops [begin, end) of `trace` reads: later or earlier ops'
// inputs, the program's outputs and its grad effects. A region's members' outputs among them are
// the region's outputs (what its executor must write to memory).
absl::flat_hash_set<int> values_read_outside(const Trace& trace, size_t begin, size_t end);

// Groups the ops `executor` fuses into regions (at least 2 ops each) and assigns them to it;
// ops already in a region stay as they are. Regions are named fusion0, fusion1, ... in the
// order they end.
Trace fuse(const Trace& trace, const Executor& executor);

// Matmul epilogues: each mm (or addmm) whose output is read by one op, through `view`s,
// becomes a region with that op when executor.fuses_epilogue accepts the pair:
//
//   fusion2:  # region [matmul_epilogue]
//     t56 = mm(t55, t54)                                  # bf16[8192, 2048] cuda:0
//     t57 = view(t56; [4, 2048, 2048])                    # bf16[4, 2048, 2048] cuda:0
//     t58 = add(t47, t57; 1)                              # bf16[4, 2048, 2048] cuda:0
//
// The intermediate values (the product and its views) are usually read by nothing else, nor
// returned or assigned to grads, so the region may compute the consumer's output without them.
// Where one is also read later or returned (a gelu's input kept for its backward), the region
// writes it too, if the executor can (fuses_epilogue's keeps_product), and its other readers
// must come after the consumer. The region is placed at the consumer (the mm moves down to it),
// which needs no in-place op between them.
// Runs before fuse(), so that an add taken here is not also put into an elementwise region.
Trace attach_epilogues(const Trace& trace, const Executor& executor);

}  // namespace kiln::compiler
