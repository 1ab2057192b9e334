// Gradient clipping by total norm and by value.
#include "nn/utils/clip_grad.h"

#include <cmath>

#include "autograd/grad_mode.h"
#include "tensor/error.h"
#include "tensor/foreach.h"
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

// The total norm of order p of `grads` (none empty), from their per-gradient norms (foreach_norm:
// f32 for f32/bf16/f16 gradients, f64 for f64) combined in f64 on the first gradient's device,
// read with one item().
double total_norm(const std::vector<Tensor>& grads, double p) {
  const std::vector<std::vector<Tensor>> groups = foreach_groups(grads);
  const Device device = groups[0][0].device();
  std::vector<Tensor> parts;
  for (const std::vector<Tensor>& g : groups) {
    parts.push_back(stack(foreach_norm(g, p)).to(device, kFloat64));
  }
  const Tensor norms = parts.size() == 1 ? parts[0] : cat(parts);
  if (std::isinf(p)) return (p > 0 ? norms.amax() : norms.amin()).item<double>();
  if (p == 0) return norms.sum().item<double>();  // counts of non-zero entries add up
  return norms.pow(p).sum().pow(1.0 / p).item<double>();
}

}  // namespace

double clip_grad_norm_(const std::vector<Tensor>& parameters, double max_norm, double norm_type,
                       bool error_if_nonfinite) {
  KILN_CHECK(!std::isnan(norm_type), "[clip_grad_norm_] norm_type must not be nan");
  NoGradGuard no_grad;
  const std::vector<Tensor> grads = defined_grads(parameters);
  if (grads.empty()) return 0.0;
  std::vector<Tensor> nonempty;  // an empty gradient adds nothing (inf norms reject it)
  for (const Tensor& g : grads) {
    if (g.numel() != 0) nonempty.push_back(g);
  }
  const bool inf = std::isinf(norm_type);
  double total;
  if (!nonempty.empty()) {
    total = total_norm(nonempty, norm_type);
  } else {
    total = inf ? (norm_type > 0 ? 0.0 : INFINITY) : std::pow(0.0, 1.0 / norm_type);
    if (norm_type == 0) total = 0.0;
  }
  if (inf && norm_type < 0 && std::isinf(total)) total = 0.0;  // only empty gradients
  if (!std::isfinite(total)) {
    KILN_CHECK(!error_if_nonfinite, "[clip_grad_norm_] the total norm of order ", norm_type,
               " for gradients from `parameters` is non-finite (", total,
               "), so it cannot be clipped. To disable this error and scale the gradients by the "
               "non-finite norm anyway, set error_if_nonfinite=false");
  }
  // PyTorch's clamp(max_norm / (total + 1e-6), max=1), keeping a nan coefficient.
  // Multiplying by 1 changes nothing, so only a coefficient below 1 (or nan) is applied: as
  // g.mul_(coef) would, read as f32 by f32/bf16/f16 gradients (a host scalar: no sync).
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0 || std::isnan(coef)) {
    for (const std::vector<Tensor>& g : foreach_groups(grads)) {
      foreach_mul_(g, full({}, coef, g[0].dtype() == kDouble ? kDouble : kFloat));
    }
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
