// cross_entropy_fused, the class-index cross-entropy op behind F::cross_entropy, with its
// decomposition (kernels: kernels/cpu/cross_entropy.cpp, kernels/cuda/cross_entropy.cu, support
// rule in kernels/fused_support.h; backward rule: autograd/cross_entropy_backward.cpp; tests:
// tests/tensor/fused_ops_test.cpp, tests/nn/functional_test.cpp, tests/kernels/gpu_fused_test.cpp),
// and its fused backward cross_entropy_fused_backward.
//
// cross_entropy_fused(logits, targets, weight; ignore_index, reduction, label_smoothing)
//     -> (loss, lse):
//   logits [N, C, d...] (or [C]: one sample), integer targets [N, d...] (or []), an optional
//   class weight [C]; reduction "mean" (the default), "sum" or "none"; label_smoothing in [0, 1]
//   (default 0), with PyTorch's semantics (ignored targets are left out of sum and count; the
//   weighted mean divides by the summed weights of the targets; NaN when every target is
//   ignored). lse = logsumexp over the classes, of the targets' shape. loss and lse are in the
//   compute dtype (f32, f64 for f64 logits). The fused kernels take the LM-training case: [N, V]
//   logits, int64 targets, no weight, no smoothing, the mean; they never materialise an f32 copy
//   of the logits, and the backward writes dlogits in one pass. The decomposition runs the rest.
// cross_entropy_fused_backward(grad, logits, targets, lse; ignore_index) -> dlogits (the fused
//   case only): (softmax(logits) - onehot(targets)) * grad / count, zero on ignored rows, logits'
//   dtype.
// cross_entropy_fused_with_grad(logits, targets, grad; ignore_index) -> (loss, lse, dlogits):
//   the fused case's forward and backward in one call, for callers that want the gradient at
//   once (linear_cross_entropy's chunks): loss and lse as cross_entropy_fused's mean, dlogits as
//   cross_entropy_fused_backward(grad, logits, targets, lse). The CUDA kernel reads each row
//   once where it fits in registers (V up to 32768 for f16/bf16); the CPU kernel runs the two
//   kernels.
#include <string>

#include "tensor/ops.h"
#include "tensor/ops/elementwise_meta.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

using internal::compute_dtype;

// Inputs (logits, targets, weight), weight optional; attributes (ignore_index, reduction,
// label_smoothing), the last two optional.
const std::string& reduction_of(const OpCall& c) {
  static const std::string mean = "mean";
  return c.has_attr(1) ? c.attr<std::string>(1) : mean;
}
double smoothing_of(const OpCall& c) { return c.has_attr(2) ? c.attr<double>(2) : 0.0; }
const Tensor& weight_of(const OpCall& c) {
  static const Tensor none;
  return c.inputs.size() > 2 ? c.input(2) : none;
}
int64_t class_dim(const Tensor& logits) { return logits.dim() == 1 ? 0 : 1; }

SpecList cross_entropy_fused_meta(const OpCall& c) {
  constexpr const char* kOp = "cross_entropy_fused";
  KILN_CHECK(
      c.inputs.size() == 2 || c.inputs.size() == 3,
      "[cross_entropy_fused] expected inputs (logits, targets) or (logits, targets, weight)");
  const Tensor& logits = c.input(0);
  const Tensor& targets = c.input(1);
  KILN_CHECK(logits.defined() && targets.defined(), "[", kOp,
             "] logits and targets must be defined");
  KILN_CHECK(is_floating_point(logits.dtype()), "[", kOp, "] expected floating-point logits, got ",
             dtype_name(logits.dtype()));
  KILN_CHECK(logits.dim() >= 1, "[", kOp, "] logits must have at least one dim (the classes)");
  KILN_CHECK(!is_floating_point(targets.dtype()) && targets.dtype() != kBool, "[", kOp,
             "] expected integer class indices as targets, got dtype ",
             dtype_name(targets.dtype()));
  const int64_t cdim = class_dim(logits);
  Shape expected;
  for (int64_t d = 0; d < logits.dim(); ++d) {
    if (d != cdim) expected.push_back(logits.size(d));
  }
  KILN_CHECK(targets.sizes() == IntArrayRef(expected), "[", kOp, "] expected targets of shape ",
             shape_str(expected), " for logits of shape ", shape_str(logits.sizes()), ", got ",
             shape_str(targets.sizes()));
  KILN_CHECK(targets.device() == logits.device(), "[", kOp, "] targets are on ",
             targets.device().str(), " but logits are on ", logits.device().str());
  const int64_t classes = logits.size(cdim);
  const Tensor& weight = weight_of(c);
  if (weight.defined()) {
    KILN_CHECK(weight.dim() == 1 && weight.size(0) == classes && is_floating_point(weight.dtype()),
               "[", kOp, "] expected a floating-point weight of shape [", classes,
               "] (one per class), got ", dtype_name(weight.dtype()), " ",
               shape_str(weight.sizes()));
    KILN_CHECK(weight.device() == logits.device(), "[", kOp, "] weight is on ",
               weight.device().str(), " but logits are on ", logits.device().str());
  }
  (void)c.attr<int64_t>(0);
  const std::string& reduction = reduction_of(c);
  KILN_CHECK(reduction == "mean" || reduction == "sum" || reduction == "none", "[", kOp,
             "] reduction must be 'mean', 'sum' or 'none', got '", reduction, "'");
  const double ls = smoothing_of(c);
  KILN_CHECK(ls >= 0.0 && ls <= 1.0, "[", kOp, "] label_smoothing must be in [0, 1], got ", ls);
  const ScalarType ct = compute_dtype(logits.dtype());
  return {{reduction == "none" ? expected : Shape{}, ct, logits.device()},
          {expected, ct, logits.device()}};
}

// On the CPU, that every target is a class or ignore_index (a device check would sync).
void check_target_values(const Tensor& targets, int64_t classes, int64_t ignore_index) {
  // Proxies (kiln::compile tracing) carry no values: the kernels check when the program runs.
  if (!targets.is_cpu() || targets.numel() == 0 || targets.impl()->storage()->is_proxy()) return;
  const Tensor bad =
      (targets != Scalar(ignore_index)) & ((targets < Scalar(0)) | (targets >= Scalar(classes)));
  if (bad.any().item<bool>()) {
    KILN_FAIL("[cross_entropy_fused] target ", targets.masked_select(bad)[0].item<int64_t>(),
              " is out of bounds for ", classes, " classes");
  }
}

// The loss in plain ops (log_softmax, gather), as PyTorch's composite: nll with class weights,
// plus label smoothing's ls / C * sum_c -w_c log p_c, each reduced and normalised as the nll.
TensorVec cross_entropy_fused_decomposition(const OpCall& c) {
  const Tensor& logits = c.input(0);
  const Tensor& weight = weight_of(c);
  const int64_t cdim = class_dim(logits);
  const int64_t classes = logits.size(cdim);
  const int64_t ignore_index = c.attr<int64_t>(0);
  const ScalarType ct = compute_dtype(logits.dtype());
  const Tensor t = c.input(1).to(kInt64);
  check_target_values(t, classes, ignore_index);
  const Tensor x = logits.to(ct);
  const Tensor lse = logsumexp(x, {cdim});
  const Tensor lsm = x - lse.unsqueeze(cdim);
  const Tensor valid = t != Scalar(ignore_index);
  const Tensor safe = where(valid, t, Scalar(int64_t{0}));
  const Tensor picked = lsm.gather(cdim, safe.unsqueeze(cdim)).squeeze(cdim);
  Tensor w = valid.to(ct);
  if (weight.defined()) {
    w = w * weight.to(ct).index_select(0, safe.flatten()).view(safe.sizes());
  }
  const std::string& reduction = reduction_of(c);
  const auto reduce = [&](const Tensor& per_target) {
    if (reduction == "none") return per_target;
    if (reduction == "sum") return per_target.sum();
    return per_target.sum() / w.sum();  // NaN when every target is ignored, as PyTorch
  };
  // where, not a product, so that -inf log-probabilities of ignored targets give 0, not NaN.
  Tensor loss = reduce(where(valid, -picked * w, Scalar(0.0)));
  const double ls = smoothing_of(c);
  if (ls > 0) {
    Tensor terms = lsm;
    if (weight.defined()) {
      Shape ws(static_cast<size_t>(logits.dim() - cdim), 1);
      ws[0] = classes;
      terms = terms * weight.to(ct).view(ws);
    }
    const Tensor smooth = reduce(where(valid, -terms.sum({cdim}), Scalar(0.0)));
    loss = loss * (1.0 - ls) + smooth * (ls / static_cast<double>(classes));
  }
  return {loss, lse};
}

void check_logits_targets(const char* op, const Tensor& logits, const Tensor& targets) {
  KILN_CHECK(logits.dim() == 2, "[", op, "] expected logits of shape [N, V], got ",
             shape_str(logits.sizes()));
  KILN_CHECK(is_floating_point(logits.dtype()), "[", op, "] expected floating-point logits, got ",
             dtype_name(logits.dtype()));
  KILN_CHECK(logits.size(1) >= 1, "[", op, "] logits need at least one class, got shape ",
             shape_str(logits.sizes()));
  KILN_CHECK(targets.dtype() == kInt64, "[", op, "] expected int64 targets, got ",
             dtype_name(targets.dtype()));
  KILN_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0), "[", op,
             "] targets of shape ", shape_str(targets.sizes()), " do not match logits of shape ",
             shape_str(logits.sizes()));
  KILN_CHECK(targets.device() == logits.device(), "[", op, "] targets are on ",
             targets.device().str(), " but logits are on ", logits.device().str());
}

SpecList cross_entropy_fused_backward_meta(const OpCall& c) {
  const Tensor& grad = c.input(0);
  const Tensor& logits = c.input(1);
  const Tensor& lse = c.input(3);
  check_logits_targets("cross_entropy_fused_backward", logits, c.input(2));
  (void)c.attr<int64_t>(0);
  const ScalarType ct = compute_dtype(logits.dtype());
  KILN_CHECK(grad.dim() == 0 && grad.dtype() == ct,
             "[cross_entropy_fused_backward] expected a 0-d ", dtype_name(ct), " grad, got ",
             dtype_name(grad.dtype()), " ", shape_str(grad.sizes()));
  KILN_CHECK(lse.dtype() == ct && lse.dim() == 1 && lse.size(0) == logits.size(0),
             "[cross_entropy_fused_backward] expected lse ", dtype_name(ct), " [", logits.size(0),
             "], got ", dtype_name(lse.dtype()), " ", shape_str(lse.sizes()));
  return {{to_shape(logits.sizes()), logits.dtype(), logits.device()}};
}

SpecList cross_entropy_fused_with_grad_meta(const OpCall& c) {
  constexpr const char* kOp = "cross_entropy_fused_with_grad";
  KILN_CHECK(c.inputs.size() == 3, "[", kOp, "] expected inputs (logits, targets, grad)");
  const Tensor& logits = c.input(0);
  const Tensor& grad = c.input(2);
  check_logits_targets(kOp, logits, c.input(1));
  (void)c.attr<int64_t>(0);
  const ScalarType ct = compute_dtype(logits.dtype());
  KILN_CHECK(grad.dim() == 0 && grad.dtype() == ct, "[", kOp, "] expected a 0-d ", dtype_name(ct),
             " grad, got ", dtype_name(grad.dtype()), " ", shape_str(grad.sizes()));
  KILN_CHECK(grad.device() == logits.device(), "[", kOp, "] grad is on ", grad.device().str(),
             " but logits are on ", logits.device().str());
  return {{Shape{}, ct, logits.device()},
          {Shape{logits.size(0)}, ct, logits.device()},
          {to_shape(logits.sizes()), logits.dtype(), logits.device()}};
}

}  // namespace

KILN_DEFINE_OP(cross_entropy_fused, OpKind::kFunctional, cross_entropy_fused_meta);
KILN_REGISTER_DECOMPOSITION(cross_entropy_fused, cross_entropy_fused_decomposition);
KILN_DEFINE_OP(cross_entropy_fused_backward, OpKind::kFunctional,
               cross_entropy_fused_backward_meta);
KILN_DEFINE_OP(cross_entropy_fused_with_grad, OpKind::kFunctional,
               cross_entropy_fused_with_grad_meta);

Tensor cross_entropy_fused(const Tensor& logits, const Tensor& targets, int64_t ignore_index) {
  static const OpDef& op = KILN_OP(cross_entropy_fused);
  return call_op(op, {logits, targets}, {ignore_index})[0];
}

Tensor cross_entropy_fused(const Tensor& logits, const Tensor& targets, const Tensor& weight,
                           int64_t ignore_index, std::string_view reduction,
                           double label_smoothing) {
  static const OpDef& op = KILN_OP(cross_entropy_fused);
  return call_op(op, {logits, targets, weight},
                 {ignore_index, std::string(reduction), label_smoothing})[0];
}

std::tuple<Tensor, Tensor, Tensor> cross_entropy_fused_with_grad(const Tensor& logits,
                                                                 const Tensor& targets,
                                                                 const Tensor& grad,
                                                                 int64_t ignore_index) {
  static const OpDef& op = KILN_OP(cross_entropy_fused_with_grad);
  const TensorVec r = call_op(op, {logits, targets, grad}, {ignore_index});
  return {r[0], r[1], r[2]};
}

}  // namespace kiln
