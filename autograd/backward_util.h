// Helpers shared by backward rules (internal to autograd/).
#pragma once

#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::autograd::internal {

// Sums `grad` down to `shape`, undoing broadcasting (leading dims and size-1 dims).
Tensor sum_to(const Tensor& grad, IntArrayRef shape);

// Gradients for a call whose rule did not compute some inputs: a list of `n` undefined tensors.
inline TensorVec no_grads(size_t n) { return TensorVec(n); }

}  // namespace kiln::autograd::internal
