// Backward rule of flash_attention (tensor/ops/attention.cpp): one call of the fused
// flash_attention_backward op, which recomputes the scores from q, k and the saved logsumexp
// instead of keeping the T x S probabilities. The gradient of the lse output goes in too, so both
// outputs are differentiable; when lse received none (training uses only out), an undefined dlse
// goes in instead of the engine's zeros, which lets the kernels skip it (cuDNN's standard backward
// graph, kernels/cuda/cudnn_attention.cpp, runs only then).
#include "autograd/backward_util.h"

namespace kiln::autograd {
namespace {

TensorVec flash_attention_backward_rule(const BackwardCall& c) {
  if (!c.needs_grad(0) && !c.needs_grad(1) && !c.needs_grad(2)) return internal::no_grads(3);
  static const OpDef& op = KILN_OP(flash_attention_backward);
  const Tensor dlse = c.has_grad(1) ? c.grad(1) : Tensor();
  const TensorVec g =
      call_op(op, {c.grad(0), c.input(0), c.input(1), c.input(2), c.output(0), c.output(1), dlse},
              {c.attr<double>(0), c.attr<bool>(1), c.attr<int64_t>(2), c.attr<double>(3)});
  return {c.needs_grad(0) ? g[0] : Tensor(), c.needs_grad(1) ? g[1] : Tensor(),
          c.needs_grad(2) ? g[2] : Tensor()};
}

}  // namespace

// Reads q, k, v and both outputs (out for Delta = rowsum(dout * out), lse for the probabilities).
KILN_REGISTER_BACKWARD(flash_attention, flash_attention_backward_rule, kSaveAll, true);

}  // namespace kiln::autograd
