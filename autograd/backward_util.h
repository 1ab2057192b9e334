// Helpers shared by backward rules (internal to autograd/).
#pragma once

#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::autograd::internal {

// Sums `grad` down to `shape`, undoing broadcasting (leading dims and size-1 dims).
Tensor sum_to(const Tensor& grad, IntArrayRef shape);

// Gradients for a call whose rule did not compute some inputs: a list of `n` undefined tensors.
inline TensorVec no_grads(size_t n) { return TensorVec(n); }

// Whether `grad`, one of the output gradients a node received, is zeros the engine made for
// an output that received no gradient rather than a gradient that arrived: a custom function's
// (autograd/function.h: the engine gives it defined gradients), or one a registry rule read
// through BackwardCall::grad (a rule asks BackwardCall::has_grad instead, which makes no zeros:
// flash_attention's passes an undefined dlse, so that the kernels need not read zeros).
//
// Answers for the node being applied on the calling thread (false outside a node's apply, and
// for a gradient that merely equals zero); under kiln::compile's tracer too, which runs the same
// engine.
bool is_absent_grad(const Tensor& grad);
// Records `zeros`, made for an absent gradient during the current node's apply, for
// is_absent_grad (nothing outside an apply).
void note_absent_grad(const Tensor& zeros);

}  // namespace kiln::autograd::internal
