// Trace transforms: each takes a Trace and returns a new one (the input is left as it was), so
// that CompiledFunction::traces() can show every stage.
//
//   Trace t1 = compiler::dce(traced);     // drops ops whose results nothing uses
//   Trace t2 = compiler::cse(t1);         // merges repeated pure ops
//
// What the passes assume about in-place ops (OpKind::kInplace, kept in program order): an
// in-place op writes memory that other values may alias, so dce keeps every in-place op and
// what it reads, and cse forgets everything it has seen at each in-place op. Random ops are
// never merged (two draws differ).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "compiler/executor.h"
#include "compiler/trace.h"

namespace kiln::compiler {

// Dead-code elimination: keeps the ops that produce the outputs and grad effects, every
// in-place op, and what they read.
Trace dce(const Trace& trace);

// Algebraic simplification: `x * c` and `c * x`, where c is a constant one (a 0-d value that
// `fill_(empty([]), 1)` made, as the gradient backward() seeds: a backward rule scales by it),
// is x itself when the product has x's sizes, dtype and device and neither x nor the product
// is written in place; x must be made by a functional op (not an argument, a captured tensor or
// a view of one), so that no returned value or gradient comes to alias one. Uses of the product
// are renamed to x, which dce then leaves alone (llama-3.2-1b: two products of its head's
// 525 MB gradient and of its hidden states' gradient by one, each step).
Trace simplify(const Trace& trace);

// The residual gradient added in the norm's backward: `add(r, dx)` (either order, alpha 1), where
// dx is rms_norm_backward's first result and nothing else reads it, becomes rms_norm_backward
// with r as its fifth input (dx + r rounded once, in the norm's kernel), so that the sum is not
// a second pass over dx. A pre-norm block's backward has two (the gradient of its input is the
// residual stream's gradient plus the norm's): llama-160m's 24 adds of [16384, 768] a step. r
// must have dx's sizes, dtype and device and be made before the norm's backward (a pre-norm
// block's is); no in-place op may run between the two, dx must not be handed out, and neither
// op may carry an autocast state. On the CPU only f32 and f64 values (where the sum rounded
// once is eager's sum: compiled CPU code keeps eager's bits). Uses of the sum are renamed to dx.
Trace fuse_norm_residual(const Trace& trace);

// A lookup's dense gradient added to another: `add(g, index_add(z, idx, src; dim, alpha))`
// (either order, alpha 1), where z is a new zero-filled tensor (`fill_(empty(...), 0)`, read by
// nothing else) and the index_add's result is read by nothing else, becomes
// `index_add(g, idx, src; dim, alpha)`: the rows added into a copy of g, instead of a zeroed
// table, the rows added into it, and a pass adding the two tables. A tied embedding's gradient
// (the LM head's plus the lookup's) took a fill, a copy and a three-table add of llama-3.2-1b's
// 525 MB table each step. g must be made before the index_add (or be an argument or a captured
// tensor) and never be written in place; the three results alike in sizes, strides, dtype and
// device; no autocast state. CUDA values only: there the rows' sum is added to g with one
// rounding where eager rounds it once more into the zeroed table (bf16), and compiled CPU code
// keeps eager's bits. Uses of the sum are renamed to the index_add's result.
// When nothing else reads g or the tensor it views (g made by a functional op, or from one
// through views and in-place ops, each value read only by the next, none handed out, none written
// but by those in-place ops) and g has the sum's layout, the rows go into g in place
// (`index_add_`), without the copy of g (llama-3.2-1b: 525 MB, 0.35 ms a step).
// Any other `index_add(g, ...)` whose g is read by nothing else in that sense, with g's layout,
// also becomes `index_add_` on g, on every device (the same arithmetic): under DDP the ranks'
// lookup rows go into the table's gradient, all-reduced in place and waited for, instead of into
// a copy of it (llama-3.2-1b: 525 MB, 0.25 ms on the step's tail).
Trace fold_index_add(const Trace& trace);

// Attention over the heads of one qkv projection without copying v. Forward: `(q, k, v) =
// split_qkv_rotary(qkv, cos, sin)`, where qkv's memory dies in the split (qkv made by a functional
// op, or a view of one through views each read only by the next, none handed out or written),
// becomes `rotary_qkv_(qkv, cos, sin)` (the q and k heads rotated in place) and q, k, v views of
// qkv (`view` to [..., T, heads, D], `slice`, `permute`), as internal::qkv_heads makes them; the
// specs of later views of the heads are derived again. If another op's outputs would change
// layout, or a changed value is handed out, the trace is returned as it was. Backward: `dqkv =
// merge_qkv_rotary(dq, dk, dv, cos, sin)`, where dq, dk, dv are the results of one
// flash_attention_backward (no dropout), each read by the merge alone (through views that keep
// their sizes, each read once), none handed out or written, and no in-place op runs between the
// two, becomes `flash_attention_backward_qkv(...)` at the merge's place (tensor/ops/attention.cpp):
// on CUDA cuDNN writes the three into dqkv and no v gradient is copied. Each rewrite only where a
// kernel of the device takes the new op; CPU results keep eager's bits (the same kernels run).
Trace fuse_qkv_rotary(const Trace& trace);

// A product copied into place: `copy_(dst, x)`, where x is `y = mm(a, b)` or a chain of views of
// y that ends in y's own layout (the two transposes of autograd's weight gradient), y's memory
// read by nothing but that chain (none handed out or written), dst contiguous with y's sizes,
// dtype and device, and no in-place op between the product and the copy, becomes
// `mm_into_(dst, a, b)` at the copy's place (tensor/ops/linalg.cpp): the product is written where
// the copy put it. DDP's gradient buckets take the weight gradients that way (llama-160m: every
// one of them, once more a step). mm_into_ runs mm's kernel into dst, so the bits are the copy's.
Trace fold_copy_into_mm(const Trace& trace);

// Common-subexpression elimination over functional, non-random ops: a second op with the same
// inputs and attributes is dropped and its outputs renamed to the first one's. Ops whose results
// an in-place op later writes (directly or through a view) are never merged.
Trace cse(const Trace& trace);

// Decomposition: each op with a registered decomposition for which `expand(trace, op)` holds is
// replaced by the ops of its decomposition (traced on proxies of its inputs), so that later
// passes and executors see primitives. Tensors the decomposition captures (constants made
// outside the registry) are appended to `externals` as new captured values. compile() expands
// the ops that no executor claims whole and no kernel of their device supports. `expand` sees
// the trace being built (the op's inputs name its values).
Trace decompose(const Trace& trace, std::vector<Tensor>& externals,
                const std::function<bool(const Trace& trace, const BoundOp& op)>& expand);

// Whether a kernel of the op's device supports the call the bound op makes (support rules read
// shapes, dtypes, strides and device properties only, so proxies answer them).
bool device_kernel_supports(const Trace& trace, const BoundOp& op);

// The output specs `op` gives on inputs of the specs `trace` holds: the op run in proxy mode
// below every handler, as the dispatcher's last step runs it (meta rule; views built on
// proxies). Throws the meta rule's error when it rejects the inputs.
std::vector<TensorSpec> derive_specs(const Trace& trace, const BoundOp& op);

// Executor assignment: each op goes to the first executor in `executors` that claims it (the
// last should be "eager", which claims everything). Sets BoundOp::executor.
Trace assign_executors(const Trace& trace,
                       const std::vector<std::shared_ptr<const Executor>>& executors);

}  // namespace kiln::compiler
