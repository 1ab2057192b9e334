// The autocast pass: nn/autocast's mixed-precision policy written into the trace as explicit
// casts, so that the program holds no autocast state and runs with autocast off.
//
//   Trace t = compiler::autocast(traced);                     // ops recorded under a guard
//   Trace u = compiler::autocast(f32_trace, kCPU, kBFloat16); // a trace recorded without one
//
// The tracer records the autocast state each op was called under (BoundOp::autocast) and the
// eager executor replays it: the dispatcher casts the op's inputs at every run, and ops with an
// autocast state are neither fused nor memory-planned. This pass applies the policy once
// (internal::autocast_input_casts, the rule the dispatch handler applies): before each op that
// the policy casts it inserts `to_copy(v; dtype, device)` ops on the inputs (the op Tensor::to
// dispatches, with the same attributes, so the values are those eager code computes), re-derives
// the op's output specs from the cast inputs (the meta rule and view kernels on proxies, as the
// dispatcher would) and clears op.autocast. A cast of one value to one dtype is made once and
// shared until the next in-place op (which may write the value or an alias of it); casts the
// tracer recorded inside an op (autocast's own, which the traced backward reads) are reused.
//
// Pitfalls:
//   - An op whose kernels do not support the call with the cast inputs runs its decomposition
//     at run time, whose ops eager code autocasts one by one; such an op keeps its autocast
//     state (and is replayed as before).
//   - autocast(trace, device, dtype) re-derives every spec downstream of a cast (a bf16 matmul
//     makes the relu after it bf16). Use it on forward traces: the backward of a joint trace
//     recorded without autocast differentiates the f32 ops, not the casts eager code records.
#pragma once

#include "compiler/trace.h"

namespace kiln::compiler {

// Applies the policy to every op recorded under autocast (BoundOp::autocast), as replaying it
// would; the result has no autocast state but for the pitfall above.
Trace autocast(const Trace& trace);

// Applies the policy to every op on `device` tensors, as running the trace's ops under
// AutocastGuard(device, dtype) would (the ops' recorded states are ignored).
Trace autocast(const Trace& trace, DeviceType device, ScalarType dtype);

}  // namespace kiln::compiler
