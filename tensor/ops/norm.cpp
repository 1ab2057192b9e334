// rms_norm and layer_norm, fused registry ops with their decompositions (kernels:
// kernels/cpu/norm.cpp, kernels/cuda/norm.cu and layer_norm.cu, support rules in
// kernels/fused_support.h; backward rules: autograd/norm_backward.cpp; tests:
// tests/tensor/fused_ops_test.cpp, tests/kernels/gpu_fused_test.cpp), and their fused backward
// ops rms_norm_backward and layer_norm_backward.
//
// rms_norm(x, weight; eps, normalized_shape) -> (y, rstd): weight (optional) has the normalised
// (trailing) shape of x; without one, the attribute normalized_shape gives it. rstd =
// rsqrt(mean(x^2) + eps) per row, kept in the compute dtype (f32, or f64 for f64 x) for the
// backward. y = x * rstd * weight, computed in the compute dtype, has x's dtype. The public
// kiln::rms_norm returns y.
// rms_norm_backward(dy, x, weight, rstd[, residual]) -> (dx, dweight). With a residual (of x's
// shape and dtype; the compiler's fuse_norm_residual passes the gradient that reaches x around
// the norm, as a pre-norm block's residual stream does), dx is the norm's gradient plus the
// residual, rounded once.
//
// layer_norm(x, weight, bias; normalized_shape, eps) -> (y, mean, rstd): the same over the
// trailing dims normalized_shape, y = (x - mean) * rstd * weight + bias with
// rstd = rsqrt(var + eps) (biased variance); weight and bias are optional (undefined tensors) of
// normalized_shape. mean and rstd have the row shape and the compute dtype. The public
// kiln::layer_norm returns y.
// layer_norm_backward(dy, x, weight, mean, rstd) -> (dx, dweight, dbias): the normalised shape
// is x's shape after mean's dims; dweight and dbias have weight's dtype (the compute dtype
// without a weight), and are computed whether or not the parameters exist.
//
// The parameters may have any floating dtype; the kernels take those of x's dtype, or f32 for
// f16/bf16 x (fused_support.h), and the decomposition runs the rest.
#include <limits>

#include "tensor/ops.h"
#include "tensor/ops/elementwise_meta.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

using internal::compute_dtype;

// Checks that `normalized` is the trailing shape of x; returns the leading (row) shape.
Shape check_trailing(const char* op, const Tensor& x, IntArrayRef normalized) {
  const int64_t nd = static_cast<int64_t>(normalized.size());
  bool fits = nd >= 1 && nd <= x.dim();
  for (int64_t d = 0; fits && d < nd; ++d) fits = x.size(x.dim() - nd + d) == normalized[d];
  KILN_CHECK(fits, "[", op, "] normalized shape ", shape_str(normalized),
             " does not match the trailing dims of input of shape ", shape_str(x.sizes()));
  return Shape(x.sizes().begin(), x.sizes().end() - nd);
}

// Checks an optional affine parameter (weight or bias) against x and the normalised shape.
void check_affine(const char* op, const char* what, const Tensor& p, const Tensor& x,
                  IntArrayRef normalized) {
  if (!p.defined()) return;
  KILN_CHECK(is_floating_point(p.dtype()), "[", op, "] expected a floating-point ", what, ", got ",
             dtype_name(p.dtype()));
  KILN_CHECK(to_shape(p.sizes()) == to_shape(normalized), "[", op, "] ", what, " of shape ",
             shape_str(p.sizes()), " does not match the normalized shape ", shape_str(normalized),
             " of input of shape ", shape_str(x.sizes()));
  KILN_CHECK(p.device() == x.device(), "[", op, "] ", what, " is on ", p.device().str(),
             " but input is on ", x.device().str());
}

void check_input(const char* op, const Tensor& x) {
  KILN_CHECK(x.defined(), "[", op, "] the input is undefined");
  KILN_CHECK(is_floating_point(x.dtype()), "[", op, "] expected a floating-point input, got ",
             dtype_name(x.dtype()));
}

// The normalised shape of an rms_norm call: the attribute's, else the weight's.
Shape rms_normalized(const OpCall& c) {
  if (c.has_attr(1)) return c.attr<Shape>(1);
  KILN_CHECK(c.input(1).defined(),
             "[rms_norm] without a weight the normalized shape must be given");
  return to_shape(c.input(1).sizes());
}

// Inputs (x, weight), weight optional; attributes (eps, normalized_shape), the shape optional
// when there is a weight.
SpecList rms_norm_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 2, "[rms_norm] expected inputs (x, weight)");
  const Tensor& x = c.input(0);
  check_input("rms_norm", x);
  const Shape normalized = rms_normalized(c);
  const Shape rows = check_trailing("rms_norm", x, normalized);
  check_affine("rms_norm", "weight", c.input(1), x, normalized);
  const double eps = c.attr<double>(0);
  KILN_CHECK(eps >= 0, "[rms_norm] eps must be non-negative, got ", eps);
  return {{to_shape(x.sizes()), x.dtype(), x.device()},
          {rows, compute_dtype(x.dtype()), x.device()}};
}

// The trailing dims of x that `normalized` covers, as dims of x.
std::vector<int64_t> trailing_dims(const Tensor& x, size_t normalized) {
  std::vector<int64_t> dims;
  for (int64_t d = x.dim() - static_cast<int64_t>(normalized); d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

TensorVec rms_norm_decomposition(const OpCall& c) {
  const Tensor& x = c.input(0);
  const Tensor& w = c.input(1);
  const ScalarType ct = compute_dtype(x.dtype());
  const Tensor xc = x.to(ct);
  const std::vector<int64_t> dims = trailing_dims(x, rms_normalized(c).size());
  const Tensor rstd = (xc.square().mean(dims) + c.attr<double>(0)).rsqrt();
  Shape kept = to_shape(rstd.sizes());
  kept.insert(kept.end(), dims.size(), 1);
  Tensor y = xc * rstd.view(kept);
  if (w.defined()) y = y * w.to(ct);
  return {y.to(x.dtype()), rstd};
}

SpecList rms_norm_backward_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 4 || c.inputs.size() == 5,
             "[rms_norm_backward] expected inputs (dy, x, weight, rstd[, residual])");
  const Tensor& dy = c.input(0);
  const Tensor& x = c.input(1);
  const Tensor& w = c.input(2);
  const Tensor& rstd = c.input(3);
  check_input("rms_norm_backward", x);
  KILN_CHECK(w.defined(), "[rms_norm_backward] expected a weight");
  const Shape rows = check_trailing("rms_norm_backward", x, w.sizes());
  check_affine("rms_norm_backward", "weight", w, x, w.sizes());
  KILN_CHECK(dy.dtype() == x.dtype() && dy.sizes() == x.sizes(), "[rms_norm_backward] dy (",
             dtype_name(dy.dtype()), " ", shape_str(dy.sizes()), ") must match x (",
             dtype_name(x.dtype()), " ", shape_str(x.sizes()), ")");
  KILN_CHECK(rstd.dtype() == compute_dtype(x.dtype()) && to_shape(rstd.sizes()) == rows,
             "[rms_norm_backward] rstd (", dtype_name(rstd.dtype()), " ", shape_str(rstd.sizes()),
             ") must be ", dtype_name(compute_dtype(x.dtype())), " ", shape_str(rows));
  if (c.inputs.size() == 5 && c.input(4).defined()) {
    const Tensor& res = c.input(4);
    KILN_CHECK(res.dtype() == x.dtype() && res.sizes() == x.sizes() && res.device() == x.device(),
               "[rms_norm_backward] the residual (", dtype_name(res.dtype()), " ",
               shape_str(res.sizes()), " on ", res.device().str(), ") must match x (",
               dtype_name(x.dtype()), " ", shape_str(x.sizes()), " on ", x.device().str(), ")");
  }
  return {{to_shape(x.sizes()), x.dtype(), x.device()},
          {to_shape(w.sizes()), w.dtype(), w.device()}};
}

SpecList layer_norm_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 3, "[layer_norm] expected inputs (x, weight, bias)");
  const Tensor& x = c.input(0);
  const Tensor& w = c.input(1);
  const Tensor& b = c.input(2);
  check_input("layer_norm", x);
  const Shape& normalized = c.attr<Shape>(0);
  const Shape rows = check_trailing("layer_norm", x, normalized);
  check_affine("layer_norm", "weight", w, x, normalized);
  check_affine("layer_norm", "bias", b, x, normalized);
  const double eps = c.attr<double>(1);
  KILN_CHECK(eps >= 0, "[layer_norm] eps must be non-negative, got ", eps);
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

TensorVec layer_norm_decomposition(const OpCall& c) {
  const Tensor& x = c.input(0);
  const Tensor& w = c.input(1);
  const Tensor& b = c.input(2);
  const ScalarType ct = compute_dtype(x.dtype());
  const Tensor xc = x.to(ct);
  const std::vector<int64_t> dims = trailing_dims(x, c.attr<Shape>(0).size());
  const Tensor mean = xc.mean(dims, /*keepdim=*/true);
  const Tensor rstd =
      (xc.var(dims, /*correction=*/0, /*keepdim=*/true) + c.attr<double>(1)).rsqrt();
  Tensor y = (xc - mean) * rstd;
  if (w.defined()) y = y * w.to(ct);
  if (b.defined()) y = y + b.to(ct);
  const Shape rows(x.sizes().begin(), x.sizes().end() - dims.size());
  return {y.to(x.dtype()), mean.view(rows), rstd.view(rows)};
}

}  // namespace

KILN_DEFINE_OP(rms_norm, OpKind::kFunctional, rms_norm_meta);
KILN_REGISTER_DECOMPOSITION(rms_norm, rms_norm_decomposition);
KILN_DEFINE_OP(rms_norm_backward, OpKind::kFunctional, rms_norm_backward_meta);
// Inputs (x, weight, bias), weight and bias optional; attributes (normalized_shape, eps).
KILN_DEFINE_OP(layer_norm, OpKind::kFunctional, layer_norm_meta);
KILN_REGISTER_DECOMPOSITION(layer_norm, layer_norm_decomposition);
// Inputs (dy, x, weight, mean, rstd), weight optional.
KILN_DEFINE_OP(layer_norm_backward, OpKind::kFunctional, layer_norm_backward_meta);

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  static const OpDef& op = KILN_OP(rms_norm);
  return call_op(op, {x, weight}, {eps})[0];
}

Tensor rms_norm(const Tensor& x, IntArrayRef normalized_shape, const Tensor& weight,
                std::optional<double> eps) {
  static const OpDef& op = KILN_OP(rms_norm);
  KILN_CHECK(x.defined(), "[rms_norm] the input is undefined");
  // PyTorch's default: the machine epsilon of x's dtype.
  double e = std::numeric_limits<float>::epsilon();
  if (eps) {
    e = *eps;
  } else if (x.dtype() == kHalf) {
    e = 0.0009765625;  // 2^-10
  } else if (x.dtype() == kBFloat16) {
    e = 0.0078125;  // 2^-7
  } else if (x.dtype() == kDouble) {
    e = std::numeric_limits<double>::epsilon();
  }
  return call_op(op, {x, weight}, {e, to_shape(normalized_shape)})[0];
}

Tensor layer_norm(const Tensor& x, IntArrayRef normalized_shape, const Tensor& weight,
                  const Tensor& bias, double eps) {
  static const OpDef& op = KILN_OP(layer_norm);
  return call_op(op, {x, weight, bias}, {to_shape(normalized_shape), eps})[0];
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
