// Functionalization: in-place ops on intermediates rewritten as their functional counterparts,
// so that the passes after it (dce, cse, fusion, memory planning, remat) see pure dataflow.
//
//   Trace t = compiler::functionalize(traced);
//
//   t3 = exp(a0)                  # f32[4, 8] cpu        t3 = exp(a0)
//   t5 = add_(t3, a1)             # f32[4, 8] cpu   ->   t5 = add(t3, a1)
//   t6 = relu(t5)                 # f32[4, 8] cpu        t6 = relu(t5)
//
// In a trace an in-place op's output is a new value naming the written tensor's new contents,
// and the values it wrote (its input, views of it) still name that tensor. `t5 = X_(t3, ...)`
// becomes `t5 = X(t3, ...)` when
//   - t3's storage was allocated by a functional op of the trace (not an argument or a captured
//     tensor), and no other input of the op shares the storage;
//   - no value of that storage other than t5 is read after the op (not t3, no view of it, not
//     the value it is a view of; returned values and grads count as read at the end), or else
//     the write covers the whole storage and each value read later is a row-major view of all
//     of it: t3 and those values are contiguous, with the storage's dtype and element count (a
//     full write through `view`/`reshape`/`flatten` chains). Reads of such a value v after the
//     op then read `v' = view(t5; v's sizes)`, made right after it;
//   - the registry defines X as a functional, non-random op whose meta rule gives t5's spec
//     (sizes, dtype, device and strides) for the same inputs and attributes (add_ of an f32
//     tensor and an f64 one stays: add would give f64);
//   - the op writes only its first input (not the multi-tensor optimizer updates) and is not
//     random.
// Later ops already read t5, so nothing else changes; t5 then owns a storage of its own, and a
// chain of in-place ops on it (add_, then mul_) becomes a chain of functional ops.
//
//   t3 = exp(a0)                               t3 = exp(a0)
//   t4 = view(t3; [32])                        t4 = view(t3; [32])
//   t5 = mul_(t4, p1; f32)             ->      t5 = mul(t4, p1; f32)
//                                              t8 = view(t5; [4, 8])
//   t6 = add(t3, a1; 1)                        t6 = add(t8, a1; 1)
//
// What stays in place, in program order, as before:
//   - writes to arguments and captured tensors (the optimizer's parameter updates, buffers,
//     zero_grad's fill_): they are the program's effects. torch's functionalization turns them
//     into a functional op plus a copy back at the end; here the write itself is the copy.
//   - partial writes, or writes through strided views (a slice, a transpose), of a storage read
//     afterwards: its new contents would be a scatter of the result into the old contents
//     (torch's view inverses), which the registry has no general op for.
//   - ops without a functional counterpart (fill_, copy_, index_put_, the random fills).
#pragma once

#include "compiler/trace.h"

namespace kiln::compiler {

Trace functionalize(const Trace& trace);

}  // namespace kiln::compiler
