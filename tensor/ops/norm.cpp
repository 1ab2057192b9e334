// rms_norm, a fused registry op (kernels: kernels/cpu/norm.cpp, kernels/cuda/norm.cu; backward
// rule: autograd/norm_backward.cpp), and its fused backward rms_norm_backward.
//
// rms_norm(x, weight; eps) -> (y, rstd): weight's shape is the normalised (trailing) shape of x;
// rstd = rsqrt(mean(x^2) + eps) per row, kept in the compute dtype (f32, or f64 for f64 x) for
// the backward. y has x's dtype. The public kiln::rms_norm returns y.
// rms_norm_backward(dy, x, weight, rstd) -> (dx, dweight).
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
  KILN_CHECK(dy.dtype() == x.dtype() && dy.sizes() == x.sizes(),
             "[rms_norm_backward] dy (", dtype_name(dy.dtype()), " ", shape_str(dy.sizes()),
             ") must match x (", dtype_name(x.dtype()), " ", shape_str(x.sizes()), ")");
  KILN_CHECK(rstd.dtype() == compute_dtype(x.dtype()) && to_shape(rstd.sizes()) == rows,
             "[rms_norm_backward] rstd (", dtype_name(rstd.dtype()), " ", shape_str(rstd.sizes()),
             ") must be ", dtype_name(compute_dtype(x.dtype())), " ", shape_str(rows));
  return {{to_shape(x.sizes()), x.dtype(), x.device()},
          {to_shape(w.sizes()), w.dtype(), w.device()}};
}

}  // namespace

KILN_DEFINE_OP(rms_norm, OpKind::kFunctional, rms_norm_meta);
KILN_DEFINE_OP(rms_norm_backward, OpKind::kFunctional, rms_norm_backward_meta);

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  static const OpDef& op = KILN_OP(rms_norm);
  return call_op(op, {x, weight}, {eps})[0];
}

}  // namespace kiln
