// Backward rule of cross_entropy_fused (tensor/ops/cross_entropy.cpp): one pass of the fused
// cross_entropy_fused_backward op, dlogits = (exp(logits - lse) - onehot) * grad / count, from
// the logits, the targets and the saved per-row logsumexp. The gradient of the lse output is
// ignored: lse is an auxiliary output for this rule, not a result users differentiate.
#include "autograd/backward_util.h"

namespace kiln::autograd {
namespace {

// Recorded only for calls a fused kernel ran (the others run the decomposition, whose ops
// autograd records): [N, V] logits, int64 targets, no weight or smoothing, the mean.
TensorVec cross_entropy_fused_backward_rule(const BackwardCall& c) {
  if (!c.needs_grad(0)) return internal::no_grads(c.forward.inputs.size());
  static const OpDef& op = KILN_OP(cross_entropy_fused_backward);
  return {call_op1(op, {c.grad(0), c.input(0), c.input(1), c.output(1)}, {c.attr<int64_t>(0)}),
          Tensor()};
}

}  // namespace

KILN_REGISTER_BACKWARD(cross_entropy_fused, cross_entropy_fused_backward_rule, save_inputs({0, 1}),
                       true);

}  // namespace kiln::autograd
