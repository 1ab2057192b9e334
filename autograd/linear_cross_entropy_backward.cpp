// Backward rule of linear_cross_entropy (tensor/ops/linear_cross_entropy.cpp): its forward
// already wrote the gradients of the loss (dx, dweight, outputs 1 and 2) for a loss gradient of
// 1, so backward scales them by the loss's gradient. Those stored gradients are constants: with
// create_graph (a double backward) the rule fails instead of returning a silently wrong second
// derivative.
#include "autograd/backward_util.h"
#include "autograd/grad_mode.h"

namespace kiln::autograd {
namespace {

TensorVec linear_cross_entropy_backward_rule(const BackwardCall& c) {
  if (!c.needs_grad(0) && !c.needs_grad(1)) return internal::no_grads(3);
  KILN_CHECK(c.attr<bool>(1),
             "[linear_cross_entropy] the forward ran without gradients (grad mode was off, or "
             "neither x nor weight required grad), so there is nothing to backpropagate");
  KILN_CHECK(!GradMode::is_enabled(),
             "[linear_cross_entropy] has no double backward (create_graph=true): its gradients "
             "are computed in the forward. Use F::cross_entropy on linear(x, weight) instead");
  const Tensor& g = c.grad(0);
  return {c.needs_grad(0) ? c.output(1) * g : Tensor(),
          c.needs_grad(1) ? c.output(2) * g : Tensor(), Tensor()};
}

}  // namespace

// Reads only the stored gradients (outputs), never x, weight or targets.
KILN_REGISTER_BACKWARD(linear_cross_entropy, linear_cross_entropy_backward_rule, kSaveNone, true);

}  // namespace kiln::autograd
