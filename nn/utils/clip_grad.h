// Gradient clipping, as torch.nn.utils.clip_grad_norm_ / clip_grad_value_.
//
//   loss.backward();
//   double norm = kiln::nn::utils::clip_grad_norm_(model->parameters(), /*max_norm=*/1.0);
//   opt.step();
//
// clip_grad_norm_ computes the norm of all gradients together, as if concatenated into one
// vector (norm_type 2, inf, or any p), and when it exceeds max_norm scales every gradient in
// place by max_norm / (total + 1e-6). Parameters without a gradient are skipped; with none at
// all the norm is 0.
//
// Pitfall: a non-finite total norm (an inf or nan gradient). With error_if_nonfinite it throws
// kiln::Error before touching any gradient. Without, it follows PyTorch: the coefficient
// max_norm / (total + 1e-6) is applied anyway, so an inf norm zeroes the finite entries (and
// turns inf entries into nan), and a nan norm turns every gradient into nan. Check the returned
// norm (std::isfinite) to skip such a step.
#pragma once

#include <vector>

#include "tensor/tensor.h"

namespace kiln::nn::utils {

// Returns the total norm of the gradients (before clipping).
double clip_grad_norm_(const std::vector<Tensor>& parameters, double max_norm,
                       double norm_type = 2.0, bool error_if_nonfinite = false);
double clip_grad_norm_(const Tensor& parameter, double max_norm, double norm_type = 2.0,
                       bool error_if_nonfinite = false);

// Clamps every gradient in place to [-clip_value, clip_value].
void clip_grad_value_(const std::vector<Tensor>& parameters, double clip_value);
void clip_grad_value_(const Tensor& parameter, double clip_value);

}  // namespace kiln::nn::utils
