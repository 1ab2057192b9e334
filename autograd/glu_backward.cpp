// Backward rules of swiglu and geglu_tanh (tensor/ops/glu.cpp): one call of the fused backward
// op, which reads dy, gate and up once and writes dgate and dup in the same pass.
#include "autograd/backward_util.h"

namespace kiln::autograd {
namespace {

TensorVec glu_grads(const BackwardCall& c, const OpDef& op) {
  if (!c.needs_grad(0) && !c.needs_grad(1)) return internal::no_grads(2);
  const TensorVec g = call_op(op, {c.grad(0), c.input(0), c.input(1)});
  return {c.needs_grad(0) ? g[0] : Tensor(), c.needs_grad(1) ? g[1] : Tensor()};
}

TensorVec swiglu_backward_rule(const BackwardCall& c) {
  static const OpDef& op = KILN_OP(swiglu_backward);
  return glu_grads(c, op);
}

TensorVec geglu_tanh_backward_rule(const BackwardCall& c) {
  static const OpDef& op = KILN_OP(geglu_tanh_backward);
  return glu_grads(c, op);
}

}  // namespace

// Reads gate and up; the output is not needed.
KILN_REGISTER_BACKWARD(swiglu, swiglu_backward_rule, save_inputs({0, 1}), false);
KILN_REGISTER_BACKWARD(geglu_tanh, geglu_tanh_backward_rule, save_inputs({0, 1}), false);

}  // namespace kiln::autograd
