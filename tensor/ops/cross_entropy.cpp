// cross_entropy_fused, a fused registry op (kernels: kernels/cpu/cross_entropy.cpp,
// kernels/cuda/cross_entropy.cu; backward rule: autograd/cross_entropy_backward.cpp), and its
// backward cross_entropy_fused_backward.
//
// cross_entropy_fused(logits [N, V], targets int64 [N]; ignore_index) -> (loss, lse):
//   lse[i] = logsumexp(logits[i, :]), loss = mean over rows with targets[i] != ignore_index of
//   lse[i] - logits[i, targets[i]] (NaN when every row is ignored, as PyTorch). Both in the
//   compute dtype (f32, f64 for f64 logits); lse is what the backward needs.
// cross_entropy_fused_backward(grad, logits, targets, lse; ignore_index) -> dlogits:
//   (softmax(logits) - onehot(targets)) * grad / count, zero on ignored rows, logits' dtype.
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

ScalarType compute_dtype(ScalarType t) { return t == kDouble ? kDouble : kFloat; }

void check_logits_targets(const char* op, const Tensor& logits, const Tensor& targets) {
  KILN_CHECK(logits.dim() == 2, "[", op, "] expected logits of shape [N, V], got ",
             shape_str(logits.sizes()));
  KILN_CHECK(is_floating_point(logits.dtype()), "[", op,
             "] expected floating-point logits, got ", dtype_name(logits.dtype()));
  KILN_CHECK(logits.size(1) >= 1, "[", op, "] logits need at least one class, got shape ",
             shape_str(logits.sizes()));
  KILN_CHECK(targets.dtype() == kInt64, "[", op, "] expected int64 targets, got ",
             dtype_name(targets.dtype()));
  KILN_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0), "[", op, "] targets of shape ",
             shape_str(targets.sizes()), " do not match logits of shape ",
             shape_str(logits.sizes()));
  KILN_CHECK(targets.device() == logits.device(), "[", op, "] targets are on ",
             targets.device().str(), " but logits are on ", logits.device().str());
}

SpecList cross_entropy_fused_meta(const OpCall& c) {
  const Tensor& logits = c.input(0);
  check_logits_targets("cross_entropy_fused", logits, c.input(1));
  (void)c.attr<int64_t>(0);
  const ScalarType ct = compute_dtype(logits.dtype());
  return {{Shape{}, ct, logits.device()}, {Shape{logits.size(0)}, ct, logits.device()}};
}

SpecList cross_entropy_fused_backward_meta(const OpCall& c) {
  const Tensor& grad = c.input(0);
  const Tensor& logits = c.input(1);
  const Tensor& lse = c.input(3);
  check_logits_targets("cross_entropy_fused_backward", logits, c.input(2));
  (void)c.attr<int64_t>(0);
  const ScalarType ct = compute_dtype(logits.dtype());
  KILN_CHECK(grad.dim() == 0 && grad.dtype() == ct, "[cross_entropy_fused_backward] expected a 0-d ",
             dtype_name(ct), " grad, got ", dtype_name(grad.dtype()), " ",
             shape_str(grad.sizes()));
  KILN_CHECK(lse.dtype() == ct && lse.dim() == 1 && lse.size(0) == logits.size(0),
             "[cross_entropy_fused_backward] expected lse ", dtype_name(ct), " [",
             logits.size(0), "], got ", dtype_name(lse.dtype()), " ", shape_str(lse.sizes()));
  return {{to_shape(logits.sizes()), logits.dtype(), logits.device()}};
}

}  // namespace

KILN_DEFINE_OP(cross_entropy_fused, OpKind::kFunctional, cross_entropy_fused_meta);
KILN_DEFINE_OP(cross_entropy_fused_backward, OpKind::kFunctional,
               cross_entropy_fused_backward_meta);

Tensor cross_entropy_fused(const Tensor& logits, const Tensor& targets, int64_t ignore_index) {
  static const OpDef& op = KILN_OP(cross_entropy_fused);
  return call_op(op, {logits, targets}, {ignore_index})[0];
}

}  // namespace kiln
