// Backward rule of rms_norm (tensor/ops/norm.cpp): one call of the fused rms_norm_backward op,
// which reads dy, x, weight and the saved rstd and writes dx and dweight in one kernel (plus a
// small reduction of dweight's per-block partials on the GPU).
#include "autograd/backward_util.h"

namespace kiln::autograd {
namespace {

TensorVec rms_norm_backward_rule(const BackwardCall& c) {
  if (!c.needs_grad(0) && !c.needs_grad(1)) return internal::no_grads(2);
  static const OpDef& op = KILN_OP(rms_norm_backward);
  const TensorVec g = call_op(op, {c.grad(0), c.input(0), c.input(1), c.output(1)});
  return {c.needs_grad(0) ? g[0] : Tensor(), c.needs_grad(1) ? g[1] : Tensor()};
}

}  // namespace

// Reads x and weight, and the rstd output (y itself is not needed).
KILN_REGISTER_BACKWARD(rms_norm, rms_norm_backward_rule, save_inputs({0, 1}), true);

}  // namespace kiln::autograd
