// Backward rules of lstm_cell_fused and gru_cell_fused (tensor/ops/rnn.cpp): one call of the
// fused backward op, which recomputes the gate activations from the saved pre-activations.
#include "autograd/backward_util.h"

namespace kiln::autograd {
namespace {

// Inputs (gates, cx); reads them and cy (output 1).
TensorVec lstm_cell_backward_rule(const BackwardCall& c) {
  if (!c.needs_grad(0) && !c.needs_grad(1)) return internal::no_grads(2);
  static const OpDef& op = KILN_OP(lstm_cell_fused_backward);
  const TensorVec g = call_op(op, {c.grad(0), c.grad(1), c.input(0), c.input(1), c.output(1)});
  return {c.needs_grad(0) ? g[0] : Tensor(), c.needs_grad(1) ? g[1] : Tensor()};
}

// Inputs (igates, hgates, hx).
TensorVec gru_cell_backward_rule(const BackwardCall& c) {
  if (!c.needs_grad(0) && !c.needs_grad(1) && !c.needs_grad(2)) return internal::no_grads(3);
  static const OpDef& op = KILN_OP(gru_cell_fused_backward);
  const TensorVec g = call_op(op, {c.grad(0), c.input(0), c.input(1), c.input(2)});
  return {c.needs_grad(0) ? g[0] : Tensor(), c.needs_grad(1) ? g[1] : Tensor(),
          c.needs_grad(2) ? g[2] : Tensor()};
}

}  // namespace

KILN_REGISTER_BACKWARD(lstm_cell_fused, lstm_cell_backward_rule, kSaveAll, true);
KILN_REGISTER_BACKWARD(gru_cell_fused, gru_cell_backward_rule, kSaveAll, false);

}  // namespace kiln::autograd
