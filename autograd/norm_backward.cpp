// Backward rules of rms_norm and layer_norm (tensor/ops/norm.cpp): one call of the fused
// rms_norm_backward / layer_norm_backward op, which reads dy, x, weight and the saved statistics
// and writes dx and the parameter gradients in one kernel (plus a small reduction of the
// parameters' per-block partials on the GPU).
#include "autograd/backward_util.h"

namespace kiln::autograd {
namespace {

TensorVec rms_norm_backward_rule(const BackwardCall& c) {
  if (!c.needs_grad(0) && !c.needs_grad(1)) return internal::no_grads(2);
  static const OpDef& op = KILN_OP(rms_norm_backward);
  const TensorVec g = call_op(op, {c.grad(0), c.input(0), c.input(1), c.output(1)});
  return {c.needs_grad(0) ? g[0] : Tensor(), c.needs_grad(1) ? g[1] : Tensor()};
}

// Inputs (x, weight, bias), weight and bias optional; outputs (y, mean, rstd).
TensorVec layer_norm_backward_rule(const BackwardCall& c) {
  if (!c.needs_grad(0) && !c.needs_grad(1) && !c.needs_grad(2)) return internal::no_grads(3);
  static const OpDef& op = KILN_OP(layer_norm_backward);
  const TensorVec g = call_op(op, {c.grad(0), c.input(0), c.input(1), c.output(1), c.output(2)});
  Tensor db;
  if (c.needs_grad(2)) {
    // dbias comes in weight's dtype (the compute dtype without a weight): the bias's may differ
    // only where there is no weight.
    const ScalarType bt = c.input(2).dtype();
    db = g[2].dtype() == bt ? g[2] : g[2].to(bt);
  }
  return {c.needs_grad(0) ? g[0] : Tensor(), c.needs_grad(1) ? g[1] : Tensor(), db};
}

}  // namespace

// Read x and weight, and the statistics outputs (y itself is not needed).
KILN_REGISTER_BACKWARD(rms_norm, rms_norm_backward_rule, save_inputs({0, 1}), true);
KILN_REGISTER_BACKWARD(layer_norm, layer_norm_backward_rule, save_inputs({0, 1}), true);

}  // namespace kiln::autograd
