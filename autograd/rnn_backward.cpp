// Backward rules of lstm_cell_fused and gru_cell_fused (tensor/ops/rnn.cpp): one call of the
// fused backward op: the LSTM's reads the activations its forward kept in a workspace, the GRU's
// recomputes them from the saved pre-activations; and
// unbind_copy's (one stack).
#include "autograd/backward_util.h"

namespace kiln::autograd {
namespace {

// Inputs (gates, cx); reads cx and the workspace (output 2). The workspace's own gradient is
// ignored: it is internal (kiln::lstm_cell_fused returns hy and cy only).
TensorVec lstm_cell_backward_rule(const BackwardCall& c) {
  if (!c.needs_grad(0) && !c.needs_grad(1)) return internal::no_grads(2);
  static const OpDef& op = KILN_OP(lstm_cell_fused_backward);
  const TensorVec g = call_op(op, {c.grad(0), c.grad(1), c.output(2), c.input(1)});
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

// One gradient per slice (zeros where a slice got none): stacked back along dim.
TensorVec unbind_copy_backward_rule(const BackwardCall& c) {
  if (!c.needs_grad(0)) return internal::no_grads(1);
  const int64_t d = wrap_dim(c.attr<int64_t>(0), c.input(0).dim(), "unbind_copy");
  if (c.grad_outputs.empty())
    return {
        zeros(c.input(0).sizes(), TensorOptions(c.input(0).dtype()).device(c.input(0).device()))};
  return {stack(c.grads(), d)};
}

}  // namespace

KILN_REGISTER_BACKWARD(unbind_copy, unbind_copy_backward_rule, kSaveNone, false);
KILN_REGISTER_BACKWARD(lstm_cell_fused, lstm_cell_backward_rule, save_inputs({1}), true);
KILN_REGISTER_BACKWARD(gru_cell_fused, gru_cell_backward_rule, kSaveAll, false);

}  // namespace kiln::autograd
