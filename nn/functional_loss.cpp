// kiln::nn::functional losses: mse, l1, smooth_l1, nll, cross_entropy (class
// indices through the kiln::cross_entropy_fused op; probabilities), binary cross
// entropy (with and without logits) and kl_div, written in differentiable ops
// with PyTorch's reductions.
#include <cmath>

#include "nn/autocast.h"
#include "nn/functional.h"

namespace kiln::nn::functional {
namespace {

Tensor reduce(const Tensor &loss, Reduction reduction, const char *op) {
  switch (reduction) {
    case Reduction::None:
      return loss;
    case Reduction::Mean:
      return loss.mean();
    case Reduction::Sum:
      return loss.sum();
    case Reduction::BatchMean:
      break;
  }
  KILN_FAIL("[", op, "] reduction 'batchmean' is only supported by kl_div");
}

void check_pair(const Tensor &input, const Tensor &target, const char *op) {
  KILN_CHECK(input.defined() && target.defined(), "[", op, "] input and target must be defined");
  KILN_CHECK(input.is_floating_point(), "[", op, "] expected a floating-point input, got ",
             dtype_name(input.dtype()));
}

void check_same_shape(const Tensor &input, const Tensor &target, const char *op) {
  KILN_CHECK(input.sizes() == target.sizes(), "[", op, "] target of shape ",
             shape_str(target.sizes()), " must have the shape of the input ",
             shape_str(input.sizes()));
}

// Class-index targets: checks the shapes ([N, C, d...] with [N, d...], or [C]
// with []) and, on the CPU, that every target is a class or ignore_index (a
// device check would sync).
void check_class_targets(const Tensor &input, const Tensor &target, int64_t ignore_index,
                         const char *op) {
  KILN_CHECK(input.dim() >= 1, "[", op, "] input must have at least one dim (the classes)");
  KILN_CHECK(!is_floating_point(target.dtype()) && target.dtype() != kBool, "[", op,
             "] expected integer class indices as target, got dtype ", dtype_name(target.dtype()));
  Shape expected;
  for (int64_t d = 0; d < input.dim(); ++d) {
    if (d != (input.dim() == 1 ? 0 : 1)) expected.push_back(input.size(d));
  }
  KILN_CHECK(target.sizes() == IntArrayRef(expected), "[", op, "] expected target of shape ",
             shape_str(expected), " for input of shape ", shape_str(input.sizes()), ", got ",
             shape_str(target.sizes()));
  // Proxies (kiln::compile tracing) carry no values: the op's kernel checks when it runs.
  if (!target.is_cpu() || target.numel() == 0 || target.impl()->storage()->is_proxy()) return;
  const int64_t classes = input.size(input.dim() == 1 ? 0 : 1);
  const Tensor t = target.to(kInt64);
  const Tensor bad = (t != Scalar(ignore_index)) & ((t < Scalar(0)) | (t >= Scalar(classes)));
  if (bad.any().item<bool>()) {
    const int64_t v = t.masked_select(bad).flatten()[0].item<int64_t>();
    KILN_FAIL("[", op, "] target ", v, " is out of bounds for ", classes, " classes");
  }
}

void check_class_weight(const Tensor &weight, int64_t classes, const char *op) {
  if (!weight.defined()) return;
  KILN_CHECK(weight.dim() == 1 && weight.size(0) == classes, "[", op,
             "] expected a weight of shape [", classes, "] (one per class), got ",
             shape_str(weight.sizes()));
}

// The per-element weight of each class-index target (0 where ignored), as the
// input's dtype.
Tensor target_weights(const Tensor &input, const Tensor &safe_target, const Tensor &valid,
                      const Tensor &weight) {
  const Tensor w = valid.to(input.dtype());
  if (!weight.defined()) return w;
  const Tensor picked =
      weight.to(input.dtype()).index_select(0, safe_target.flatten()).view(safe_target.sizes());
  return picked * w;
}

}  // namespace

Tensor mse_loss(const Tensor &input, const Tensor &target, const MSELossFuncOptions &options) {
  check_pair(input, target, "mse_loss");
  return reduce((input - target).square(), options.reduction(), "mse_loss");
}

Tensor l1_loss(const Tensor &input, const Tensor &target, const L1LossFuncOptions &options) {
  check_pair(input, target, "l1_loss");
  return reduce((input - target).abs(), options.reduction(), "l1_loss");
}

Tensor smooth_l1_loss(const Tensor &input, const Tensor &target,
                      const SmoothL1LossFuncOptions &options) {
  check_pair(input, target, "smooth_l1_loss");
  const double beta = options.beta();
  KILN_CHECK(beta >= 0, "[smooth_l1_loss] beta must be non-negative, got ", beta);
  const Tensor d = (input - target).abs();
  if (beta == 0) return reduce(d, options.reduction(), "smooth_l1_loss");
  const Tensor loss = kiln::where(d < Scalar(beta), d.square() * (0.5 / beta), d - 0.5 * beta);
  return reduce(loss, options.reduction(), "smooth_l1_loss");
}

Tensor nll_loss(const Tensor &input, const Tensor &target, const NLLLossFuncOptions &options) {
  check_pair(input, target, "nll_loss");
  check_class_targets(input, target, options.ignore_index(), "nll_loss");
  const int64_t cdim = input.dim() == 1 ? 0 : 1;
  check_class_weight(options.weight(), input.size(cdim), "nll_loss");
  KILN_CHECK(options.reduction() != Reduction::BatchMean,
             "[nll_loss] reduction 'batchmean' is only supported by kl_div");
  const Tensor t = target.to(kInt64);
  const Tensor valid = t != Scalar(options.ignore_index());
  const Tensor safe = kiln::where(valid, t, Scalar(int64_t{0}));
  const Tensor picked = input.gather(cdim, safe.unsqueeze(cdim)).squeeze(cdim);
  const Tensor w = target_weights(input, safe, valid, options.weight());
  // where, not a product, so that -inf log-probabilities of ignored targets
  // give 0, not NaN.
  const Tensor loss = kiln::where(valid, -picked * w, Scalar(0.0));
  switch (options.reduction()) {
    case Reduction::None:
      return loss;
    case Reduction::Sum:
      return loss.sum();
    default:
      return loss.sum() / w.sum();  // NaN when every target is ignored, as PyTorch
  }
}

Tensor cross_entropy(const Tensor &input, const Tensor &target,
                     const CrossEntropyFuncOptions &options) {
  check_pair(input, target, "cross_entropy");
  KILN_CHECK(options.reduction() != Reduction::BatchMean,
             "[cross_entropy] reduction 'batchmean' is only supported by kl_div");
  const double ls = options.label_smoothing();
  if (!is_floating_point(target.dtype())) {
    // Class indices: the cross_entropy_fused op (tensor/ops/cross_entropy.cpp),
    // a fused kernel for [N, V] logits with a plain mean, its decomposition
    // otherwise. Its loss is f32 (f64 for f64 logits); PyTorch returns the
    // logits' dtype, except under autocast, where losses stay f32.
    const Tensor loss =
        kiln::cross_entropy_fused(input, target, options.weight(), options.ignore_index(),
                                  reduction_name(options.reduction()), ls);
    return is_autocast_enabled(input.device().type()) ? loss : loss.to(input.dtype());
  }
  // Class probabilities: the composite.
  KILN_CHECK(input.dim() >= 1, "[cross_entropy] input must have at least one dim (the classes)");
  KILN_CHECK(ls >= 0.0 && ls <= 1.0, "[cross_entropy] label_smoothing must be in [0, 1], got ", ls);
  check_same_shape(input, target, "cross_entropy");
  const int64_t cdim = input.dim() == 1 ? 0 : 1;
  const int64_t classes = input.size(cdim);
  const Tensor &weight = options.weight();
  check_class_weight(weight, classes, "cross_entropy");
  const Tensor lsm = kiln::log_softmax(input, cdim);
  Tensor p = target;
  if (ls > 0) p = p * (1.0 - ls) + ls / static_cast<double>(classes);
  Tensor terms = lsm * p;
  if (weight.defined()) {
    // The class weight as [C, 1, ...], broadcasting against the input.
    Shape ws(input.dim() - cdim, 1);
    ws[0] = classes;
    terms = terms * weight.to(input.dtype()).view(ws);
  }
  const Tensor loss = -terms.sum({cdim});
  if (options.reduction() != Reduction::Mean) return reduce(loss, options.reduction(), "");
  // Mean over the batch elements (not the weights), as PyTorch.
  return loss.sum() / static_cast<double>(input.numel() / std::max<int64_t>(classes, 1));
}

Tensor binary_cross_entropy(const Tensor &input, const Tensor &target,
                            const BinaryCrossEntropyFuncOptions &options) {
  check_pair(input, target, "binary_cross_entropy");
  check_same_shape(input, target, "binary_cross_entropy");
  if (input.is_cpu() && input.numel() > 0 && !input.impl()->storage()->is_proxy()) {
    const Tensor x = input.detach();
    KILN_CHECK(((x >= Scalar(0)) & (x <= Scalar(1))).all().item<bool>(),
               "[binary_cross_entropy] all elements of input should be between "
               "0 and 1");
  }
  // log terms clamped at -100 as PyTorch, so that a saturated input gives a
  // finite loss.
  const Tensor log_x = input.log().clamp_min(-100.0);
  const Tensor log_1mx = (1.0 - input).log().clamp_min(-100.0);
  Tensor loss = -(target * log_x + (1.0 - target) * log_1mx);
  if (options.weight().defined()) loss = loss * options.weight();
  return reduce(loss, options.reduction(), "binary_cross_entropy");
}

Tensor binary_cross_entropy_with_logits(const Tensor &input, const Tensor &target,
                                        const BinaryCrossEntropyWithLogitsFuncOptions &options) {
  check_pair(input, target, "binary_cross_entropy_with_logits");
  check_same_shape(input, target, "binary_cross_entropy_with_logits");
  // -[p t log s(x) + (1 - t) log(1 - s(x))] = (1 - t) x + (1 + (p - 1) t)
  // softplus(-x), with softplus(-x) = log1p(exp(-|x|)) + relu(-x) never
  // overflowing.
  const Tensor softplus_neg = (-input.abs()).exp().log1p() + (-input).relu();
  Tensor loss;
  if (options.pos_weight().defined()) {
    const Tensor log_weight = (options.pos_weight() - 1.0) * target + 1.0;
    loss = (1.0 - target) * input + log_weight * softplus_neg;
  } else {
    loss = (1.0 - target) * input + softplus_neg;
  }
  if (options.weight().defined()) loss = loss * options.weight();
  return reduce(loss, options.reduction(), "binary_cross_entropy_with_logits");
}

Tensor kl_div(const Tensor &input, const Tensor &target, const KLDivFuncOptions &options) {
  check_pair(input, target, "kl_div");
  Tensor loss;
  if (options.log_target()) {
    loss = target.exp() * (target - input);
  } else {
    // target * log(target) is 0 where target is 0; log sees 1 there so no NaN
    // reaches grads.
    const Tensor positive = target > Scalar(0);
    const Tensor safe = kiln::where(positive, target, Scalar(1.0));
    loss = kiln::where(positive, target * safe.log(), Scalar(0.0)) - target * input;
  }
  if (options.reduction() == Reduction::BatchMean) {
    const int64_t batch = input.dim() == 0 ? 1 : input.size(0);
    return loss.sum() / static_cast<double>(batch);
  }
  return reduce(loss, options.reduction(), "kl_div");
}

}  // namespace kiln::nn::functional
