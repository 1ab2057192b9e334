// Backward rules of the random fills (tensor/ops/random.cpp): the new values do not depend
// on the old ones, so the gradient to the overwritten tensor is zero. bernoulli_ with a
// probability tensor is not differentiable in p (as in PyTorch).
#include "autograd/backward_util.h"

namespace kiln::autograd {
namespace {

TensorVec overwritten_backward(const BackwardCall& c) {
  TensorVec g(c.forward.inputs.size());
  if (c.needs_grad(0)) g[0] = zeros_like(c.grad());
  return g;
}

}  // namespace

KILN_REGISTER_BACKWARD(uniform_, overwritten_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(normal_, overwritten_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(random_, overwritten_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(bernoulli_, overwritten_backward, kSaveNone, false);

}  // namespace kiln::autograd
