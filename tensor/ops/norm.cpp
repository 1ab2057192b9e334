// rms_norm, a fused registry op (kernels: kernels/cpu/norm.cpp, kernels/cuda/norm.cu; backward
// rule: autograd/norm_backward.cpp), and its fused backward rms_norm_backward.
//
// rms_norm(x, weight; eps) -> (y, rstd): weight's shape is the normalised (trailing) shape of x;
// rstd = rsqrt(mean(x^2) + eps) per row, kept in the compute dtype (f32, or f64 for f64 x) for
// the backward. y has x's dtype. The public kiln::rms_norm returns y.
// rms_norm_backward(dy, x, weight, rstd) -> (dx, dweight).
//
// layer_norm(x, weight, bias; normalized_shape, eps) -> (y, mean, rstd): the same over the
// trailing dims normalized_shape, y = (x - mean) * rstd * weight + bias with
// rstd = rsqrt(var + eps) (biased variance); weight and bias are optional (undefined tensors),
// of normalized_shape and of x's dtype or f32 for f16/bf16 x (one dtype when both are given).
// mean and rstd have the row shape and the compute dtype. The public kiln::layer_norm returns y.
// layer_norm_backward(dy, x, weight, mean, rstd) -> (dx, dweight, dbias): the normalised shape
// is x's shape after mean's dims; dweight and dbias have weight's dtype (the compute dtype
// without a weight), and are computed whether or not the parameters exist.
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

ScalarType compute_dtype(ScalarType t) { return t == kDouble ? kDouble : kFloat; }

// Checks x and weight; returns the leading (row) shape of x.
Shape check_x_weight(const char* op, const Tensor& x, const Tensor& w) {
  KILN_CHECK(is_floating_point(x.dtype()), "[", op, "] expected a floating-point input, got ",
             dtype_name(x.dtype()));
  KILN_CHECK(w.dtype() == x.dtype() || (is_reduced_float(x.dtype()) && w.dtype() == kFloat), "[",
             op, "] expected weight of dtype ", dtype_name(x.dtype()),
             is_reduced_float(x.dtype()) ? " or float32" : "", ", got ", dtype_name(w.dtype()));
  KILN_CHECK(w.dim() >= 1 && w.dim() <= x.dim(), "[", op, "] weight of shape ",
             shape_str(w.sizes()), " does not match the trailing dims of input of shape ",
             shape_str(x.sizes()));
  const int64_t lead = x.dim() - w.dim();
  for (int64_t d = 0; d < w.dim(); ++d) {
    KILN_CHECK(x.size(lead + d) == w.size(d), "[", op, "] weight of shape ", shape_str(w.sizes()),
               " does not match the trailing dims of input of shape ", shape_str(x.sizes()));
  }
  KILN_CHECK(w.device() == x.device(), "[", op, "] weight is on ", w.device().str(),
             " but input is on ", x.device().str());
  return Shape(x.sizes().begin(), x.sizes().begin() + lead);
}

SpecList rms_norm_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 2, "[rms_norm] expected inputs (x, weight)");
  const Tensor& x = c.input(0);
  const Shape rows = check_x_weight("rms_norm", x, c.input(1));
  const double eps = c.attr<double>(0);
  KILN_CHECK(eps >= 0, "[rms_norm] eps must be non-negative, got ", eps);
  return {{to_shape(x.sizes()), x.dtype(), x.device()},
          {rows, compute_dtype(x.dtype()), x.device()}};
}

SpecList rms_norm_backward_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 4, "[rms_norm_backward] expected inputs (dy, x, weight, rstd)");
  const Tensor& dy = c.input(0);
  const Tensor& x = c.input(1);
  const Tensor& w = c.input(2);
  const Tensor& rstd = c.input(3);
  const Shape rows = check_x_weight("rms_norm_backward", x, w);
  KILN_CHECK(dy.dtype() == x.dtype() && dy.sizes() == x.sizes(), "[rms_norm_backward] dy (",
             dtype_name(dy.dtype()), " ", shape_str(dy.sizes()), ") must match x (",
             dtype_name(x.dtype()), " ", shape_str(x.sizes()), ")");
  KILN_CHECK(rstd.dtype() == compute_dtype(x.dtype()) && to_shape(rstd.sizes()) == rows,
             "[rms_norm_backward] rstd (", dtype_name(rstd.dtype()), " ", shape_str(rstd.sizes()),
             ") must be ", dtype_name(compute_dtype(x.dtype())), " ", shape_str(rows));
  return {{to_shape(x.sizes()), x.dtype(), x.device()},
          {to_shape(w.sizes()), w.dtype(), w.device()}};
}

// Checks an optional affine parameter (weight or bias) of layer_norm against x and the
// normalised shape.
void check_affine(const char* op, const char* what, const Tensor& p, const Tensor& x,
                  IntArrayRef normalized) {
  if (!p.defined()) return;
  KILN_CHECK(p.dtype() == x.dtype() || (is_reduced_float(x.dtype()) && p.dtype() == kFloat), "[",
             op, "] expected ", what, " of dtype ", dtype_name(x.dtype()),
             is_reduced_float(x.dtype()) ? " or float32" : "", ", got ", dtype_name(p.dtype()));
  KILN_CHECK(to_shape(p.sizes()) == to_shape(normalized), "[", op, "] ", what, " of shape ",
             shape_str(p.sizes()), " does not match the normalized shape ", shape_str(normalized),
             " of input of shape ", shape_str(x.sizes()));
  KILN_CHECK(p.device() == x.device(), "[", op, "] ", what, " is on ", p.device().str(),
             " but input is on ", x.device().str());
}

SpecList layer_norm_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 3, "[layer_norm] expected inputs (x, weight, bias)");
  const Tensor& x = c.input(0);
  const Tensor& w = c.input(1);
  const Tensor& b = c.input(2);
  KILN_CHECK(x.defined(), "[layer_norm] the input is undefined");
  KILN_CHECK(is_floating_point(x.dtype()), "[layer_norm] expected a floating-point input, got ",
             dtype_name(x.dtype()));
  const Shape& normalized = c.attr<Shape>(0);
  const int64_t nd = static_cast<int64_t>(normalized.size());
  bool fits = nd >= 1 && nd <= x.dim();
  for (int64_t d = 0; fits && d < nd; ++d) fits = x.size(x.dim() - nd + d) == normalized[d];
  KILN_CHECK(fits, "[layer_norm] normalized shape ", shape_str(normalized),
             " does not match the trailing dims of input of shape ", shape_str(x.sizes()));
  check_affine("layer_norm", "weight", w, x, normalized);
  check_affine("layer_norm", "bias", b, x, normalized);
  KILN_CHECK(!w.defined() || !b.defined() || w.dtype() == b.dtype(), "[layer_norm] weight (",
             dtype_name(w.dtype()), ") and bias (", dtype_name(b.dtype()), ") must have one dtype");
  const double eps = c.attr<double>(1);
  KILN_CHECK(eps >= 0, "[layer_norm] eps must be non-negative, got ", eps);
  const Shape rows(x.sizes().begin(), x.sizes().end() - nd);
  return {{to_shape(x.sizes()), x.dtype(), x.device()},
          {rows, compute_dtype(x.dtype()), x.device()},
          {rows, compute_dtype(x.dtype()), x.device()}};
}

SpecList layer_norm_backward_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 5,
             "[layer_norm_backward] expected inputs (dy, x, weight, mean, rstd)");
  const Tensor& dy = c.input(0);
  const Tensor& x = c.input(1);
  const Tensor& w = c.input(2);
  const Tensor& mean = c.input(3);
  const Tensor& rstd = c.input(4);
  KILN_CHECK(x.defined() && dy.defined() && mean.defined() && rstd.defined(),
             "[layer_norm_backward] dy, x, mean and rstd must be defined");
  KILN_CHECK(is_floating_point(x.dtype()),
             "[layer_norm_backward] expected a floating-point input, got ", dtype_name(x.dtype()));
  KILN_CHECK(dy.dtype() == x.dtype() && dy.sizes() == x.sizes(), "[layer_norm_backward] dy (",
             dtype_name(dy.dtype()), " ", shape_str(dy.sizes()), ") must match x (",
             dtype_name(x.dtype()), " ", shape_str(x.sizes()), ")");
  const ScalarType acc = compute_dtype(x.dtype());
  const int64_t lead = mean.dim();
  bool fits = lead < x.dim();
  for (int64_t d = 0; fits && d < lead; ++d) fits = mean.size(d) == x.size(d);
  KILN_CHECK(fits && mean.dtype() == acc, "[layer_norm_backward] mean (", dtype_name(mean.dtype()),
             " ", shape_str(mean.sizes()), ") must be ", dtype_name(acc),
             " of the leading dims of x ", shape_str(x.sizes()));
  KILN_CHECK(rstd.dtype() == acc && rstd.sizes() == mean.sizes(), "[layer_norm_backward] rstd (",
             dtype_name(rstd.dtype()), " ", shape_str(rstd.sizes()), ") must be ", dtype_name(acc),
             " ", shape_str(mean.sizes()));
  KILN_CHECK(
      dy.device() == x.device() && mean.device() == x.device() && rstd.device() == x.device(),
      "[layer_norm_backward] dy, mean and rstd must be on the device of x, ", x.device().str());
  const Shape normalized(x.sizes().begin() + lead, x.sizes().end());
  check_affine("layer_norm_backward", "weight", w, x, normalized);
  const ScalarType pt = w.defined() ? w.dtype() : acc;
  return {{to_shape(x.sizes()), x.dtype(), x.device()},
          {normalized, pt, x.device()},
          {normalized, pt, x.device()}};
}

}  // namespace

KILN_DEFINE_OP(rms_norm, OpKind::kFunctional, rms_norm_meta);
KILN_DEFINE_OP(rms_norm_backward, OpKind::kFunctional, rms_norm_backward_meta);
// Inputs (x, weight, bias), weight and bias optional; attributes (normalized_shape, eps).
KILN_DEFINE_OP(layer_norm, OpKind::kFunctional, layer_norm_meta);
// Inputs (dy, x, weight, mean, rstd), weight optional.
KILN_DEFINE_OP(layer_norm_backward, OpKind::kFunctional, layer_norm_backward_meta);

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  static const OpDef& op = KILN_OP(rms_norm);
  return call_op(op, {x, weight}, {eps})[0];
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  static const OpDef& op = KILN_OP(layer_norm);
  KILN_CHECK(weight.defined() || bias.defined(),
             "[layer_norm] without weight and bias the normalized shape is unknown: use "
             "nn::functional::layer_norm");
  const Tensor& p = weight.defined() ? weight : bias;
  return call_op(op, {x, weight, bias}, {to_shape(p.sizes()), eps})[0];
}

}  // namespace kiln
