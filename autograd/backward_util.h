// Helpers shared by backward rules (internal to autograd/).
#pragma once

#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::autograd::internal {

// Sums `grad` down to `shape`, undoing broadcasting (leading dims and size-1 dims).
Tensor sum_to(const Tensor& grad, IntArrayRef shape);

// Gradients for a call whose rule did not compute some inputs: a list of `n` undefined tensors.
inline TensorVec no_grads(size_t n) { return TensorVec(n); }

// Whether `grad`, one of the output gradients a backward rule received, is zeros the engine made
// for an output that received no gradient (autograd/engine.cpp gives every rule defined
// gradients) rather than a gradient that arrived. A rule may then skip the work that gradient
// causes: flash_attention's passes an undefined dlse, so that the kernels need not read zeros.
//
//   const Tensor dlse = internal::is_absent_grad(c.grad(1)) ? Tensor() : c.grad(1);
//
// Answers for the node being applied on the calling thread (false outside a rule, and for a
// gradient that merely equals zero); under kiln::compile's tracer too, which runs the same engine.
bool is_absent_grad(const Tensor& grad);

}  // namespace kiln::autograd::internal
