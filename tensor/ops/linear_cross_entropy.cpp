// linear_cross_entropy (tensor/linear_cross_entropy.h): the op, its meta rule and its
// decomposition (kernel: kernels/linear_cross_entropy.cpp; backward rule:
// autograd/linear_cross_entropy_backward.cpp; tests: tests/tensor/linear_cross_entropy_test.cpp).
//
// linear_cross_entropy(x, weight, targets; ignore_index, with_grad, chunk_rows)
//     -> (loss, dx, dweight):
//   x [N, C] and weight [V, C] of one floating dtype, targets [N] int64. loss = the mean over
//   non-ignored rows of lse(x_i W^T) - (x_i W^T)[t_i], 0-d in the compute dtype (f32; f64 for
//   f64). With with_grad, dx [N, C] and dweight [V, C] (x's dtype) are the gradients of loss
//   itself (as if its gradient were 1), which backward scales; without, both are [0]. chunk_rows
//   (0: chosen from V and the dtype) is how many rows of logits the kernel holds at once.
#include "tensor/linear_cross_entropy.h"

#include <algorithm>

#include "autograd/grad_mode.h"
#include "tensor/ops.h"
#include "tensor/ops/elementwise_meta.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

using internal::compute_dtype;

SpecList linear_cross_entropy_meta(const OpCall& c) {
  constexpr const char* kOp = "linear_cross_entropy";
  KILN_CHECK(c.inputs.size() == 3, "[", kOp, "] expected inputs (x, weight, targets)");
  const Tensor& x = c.input(0);
  const Tensor& w = c.input(1);
  const Tensor& t = c.input(2);
  (void)c.attr<int64_t>(0);
  const bool with_grad = c.attr<bool>(1);
  KILN_CHECK(c.attr<int64_t>(2) >= 0, "[", kOp, "] chunk_rows must be >= 0, got ",
             c.attr<int64_t>(2));
  KILN_CHECK(x.defined() && w.defined() && t.defined(), "[", kOp,
             "] x, weight and targets must be defined");
  KILN_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "[", kOp,
             "] expected x [N, C] and weight [V, C], got ", shape_str(x.sizes()), " and ",
             shape_str(w.sizes()));
  KILN_CHECK(is_floating_point(x.dtype()) && w.dtype() == x.dtype(), "[", kOp,
             "] expected x and weight of one floating-point dtype, got ", dtype_name(x.dtype()),
             " and ", dtype_name(w.dtype()));
  KILN_CHECK(t.dtype() == kInt64 && t.dim() == 1 && t.size(0) == x.size(0), "[", kOp,
             "] expected int64 targets [", x.size(0), "], got ", dtype_name(t.dtype()), " ",
             shape_str(t.sizes()));
  KILN_CHECK(w.device() == x.device() && t.device() == x.device(), "[", kOp, "] x is on ",
             x.device().str(), ", weight on ", w.device().str(), ", targets on ", t.device().str());
  const Shape none{0};
  return {{Shape{}, compute_dtype(x.dtype()), x.device()},
          {with_grad ? to_shape(x.sizes()) : none, x.dtype(), x.device()},
          {with_grad ? to_shape(w.sizes()) : none, x.dtype(), x.device()}};
}

// The unchunked composition: the logits whole, cross_entropy_fused and (with_grad) its backward
// with a gradient of 1 and the two matmuls.
TensorVec linear_cross_entropy_decomposition(const OpCall& c) {
  const Tensor& x = c.input(0);
  const Tensor& w = c.input(1);
  const Tensor& t = c.input(2);
  const int64_t ignore = c.attr<int64_t>(0);
  static const OpDef& ce = KILN_OP(cross_entropy_fused);
  static const OpDef& ce_backward = KILN_OP(cross_entropy_fused_backward);
  const Tensor logits = mm(x, w.t());
  const TensorVec loss = call_op(ce, {logits, t}, {ignore});
  if (!c.attr<bool>(1)) {
    return {loss[0], empty({0}, x.options()), empty({0}, x.options())};
  }
  const Tensor one = ones({}, loss[0].options());
  const Tensor g = call_op1(ce_backward, {one, logits, t, loss[1]}, {ignore});
  return {loss[0], mm(g, w), mm(g.t(), x)};
}

}  // namespace

KILN_DEFINE_OP(linear_cross_entropy, OpKind::kFunctional, linear_cross_entropy_meta);
KILN_REGISTER_DECOMPOSITION(linear_cross_entropy, linear_cross_entropy_decomposition);

Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& targets,
                            int64_t ignore_index) {
  static const OpDef& op = KILN_OP(linear_cross_entropy);
  const bool with_grad = GradMode::is_enabled() && ((x.defined() && x.requires_grad()) ||
                                                    (weight.defined() && weight.requires_grad()));
  return call_op(op, {x, weight, targets}, {ignore_index, with_grad, int64_t{0}})[0];
}

}  // namespace kiln
