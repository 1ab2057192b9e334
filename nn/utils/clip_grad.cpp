// Gradient clipping by total norm and by value.
#include "nn/utils/clip_grad.h"

#include <cmath>

#include "autograd/grad_mode.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace kiln::nn::utils {

namespace {

std::vector<Tensor> defined_grads(const std::vector<Tensor>& parameters) {
  std::vector<Tensor> grads;
  for (const Tensor& p : parameters) {
    if (p.defined() && p.grad().defined()) grads.push_back(p.grad());
  }
  return grads;
}

}  // namespace

double clip_grad_norm_(const std::vector<Tensor>& parameters, double max_norm, double norm_type,
                       bool error_if_nonfinite) {
  KILN_CHECK(!std::isnan(norm_type), "[clip_grad_norm_] norm_type must not be nan");
  NoGradGuard no_grad;
  const std::vector<Tensor> grads = defined_grads(parameters);
  if (grads.empty()) return 0.0;
  // Per-gradient norms (the kernel accumulates in double), combined in double.
  const bool inf = std::isinf(norm_type);
  double total = inf ? (norm_type > 0 ? 0.0 : INFINITY) : 0.0;
  for (const Tensor& g : grads) {
    if (g.numel() == 0) continue;  // an empty gradient adds nothing (inf norms reject it)
    const double n = g.norm(norm_type).item<double>();
    if (inf) {
      total = std::isnan(n) || std::isnan(total) ? NAN
              : norm_type > 0                    ? std::max(total, n)
                                                 : std::min(total, n);
    } else if (norm_type == 0) {
      total += n;  // counts of non-zero entries add up
    } else {
      total += std::pow(n, norm_type);
    }
  }
  if (!inf && norm_type != 0) total = std::pow(total, 1.0 / norm_type);
  if (inf && norm_type < 0 && std::isinf(total)) total = 0.0;  // only empty gradients
  if (!std::isfinite(total)) {
    KILN_CHECK(!error_if_nonfinite, "[clip_grad_norm_] the total norm of order ", norm_type,
               " for gradients from `parameters` is non-finite (", total,
               "), so it cannot be clipped. To disable this error and scale the gradients by the "
               "non-finite norm anyway, set error_if_nonfinite=false");
  }
  // PyTorch's clamp(max_norm / (total + 1e-6), max=1), keeping a nan coefficient.
  // Multiplying by 1 changes nothing, so only a coefficient below 1 (or nan) is applied.
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0 || std::isnan(coef)) {
    for (Tensor g : grads) g.mul_(coef);
  }
  return total;
}

double clip_grad_norm_(const Tensor& parameter, double max_norm, double norm_type,
                       bool error_if_nonfinite) {
  return clip_grad_norm_(std::vector<Tensor>{parameter}, max_norm, norm_type, error_if_nonfinite);
}

void clip_grad_value_(const std::vector<Tensor>& parameters, double clip_value) {
  NoGradGuard no_grad;
  for (Tensor g : defined_grads(parameters)) g.clamp_(-clip_value, clip_value);
}

void clip_grad_value_(const Tensor& parameter, double clip_value) {
  clip_grad_value_(std::vector<Tensor>{parameter}, clip_value);
}

}  // namespace kiln::nn::utils
