// rotary_emb and rotary_emb_qk, fused registry ops (kernels: kernels/cpu/rotary.cpp,
// kernels/cuda/rotary.cu; backward rules: autograd/rotary_backward.cpp).
//
//   Tensor q2 = kiln::rotary_emb(q, cos, sin);                // q [..., T, D], cos/sin [T, D]
//   auto [q3, k3] = kiln::rotary_emb_qk(q, k, cos, sin);      // both in one launch
//
// rotary_emb(x, cos, sin; transpose) -> y, with h = D / 2, x1 = x[..., :h], x2 = x[..., h:] and
// the same halves c1, c2, s1, s2 of the row of cos/sin for x's position t (dim -2):
//   transpose = false:  y = x * cos + rotate_half(x) * sin   (rotate_half(x) = [-x2, x1])
//                       y1 = x1 c1 - x2 s1,   y2 = x2 c2 + x1 s2
//   transpose = true:   y = x * cos + rotate_half^T(x * sin)   (the backward of the above)
//                       y1 = x1 c1 + x2 s2,   y2 = x2 c2 - x1 s1
// Nothing assumes that the halves of cos/sin are equal (rope_cache's layout has them equal).
// Arithmetic in f32 for f16/bf16 (f64 for f64); y is in x's dtype. x may be any strided view
// (the q/k/v split of a fused projection) and is read in place. y is dense and laid out in x's
// memory order where x's last dim is dense (as PyTorch's elementwise ops lay out their outputs):
// the [B, H, T, D] view of a [B, T, 3 H D] projection gives a y of shape [B, H, T, D] stored as
// [B, T, H, D], so both the reads and the writes are sequential. Otherwise y is contiguous.
// rotary_emb_qk(q, k, cos, sin; transpose) -> (rotary_emb(q), rotary_emb(k)) in one kernel; q
// and k may have different leading shapes (grouped-query attention: fewer k heads).
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

// Checks x against cos/sin [T, D] (T = x.size(-2), D = x.size(-1), D even).
void check_rotary(const char* op, const char* what, const Tensor& x, const Tensor& cos,
                  const Tensor& sin) {
  KILN_CHECK(is_floating_point(x.dtype()), "[", op, "] expected a floating-point ", what, ", got ",
             dtype_name(x.dtype()));
  KILN_CHECK(x.dim() >= 2 && x.size(-1) % 2 == 0, "[", op, "] expected ", what,
             " of shape [..., T, D] with D even, got ", shape_str(x.sizes()));
  KILN_CHECK(cos.sizes() == sin.sizes() && cos.dtype() == sin.dtype(), "[", op, "] cos (",
             dtype_name(cos.dtype()), " ", shape_str(cos.sizes()), ") and sin (",
             dtype_name(sin.dtype()), " ", shape_str(sin.sizes()),
             ") must have the same shape and dtype");
  KILN_CHECK(cos.dim() == 2 && cos.size(0) == x.size(-2) && cos.size(1) == x.size(-1), "[", op,
             "] expected cos/sin of shape [T, D] = [", x.size(-2), ", ", x.size(-1), "] for ", what,
             " of shape ", shape_str(x.sizes()), ", got ", shape_str(cos.sizes()));
  KILN_CHECK(cos.dtype() == x.dtype() || (is_reduced_float(x.dtype()) && cos.dtype() == kFloat),
             "[", op, "] expected cos/sin of dtype ", dtype_name(x.dtype()),
             is_reduced_float(x.dtype()) ? " or float32" : "", ", got ", dtype_name(cos.dtype()));
  KILN_CHECK(cos.device() == x.device() && sin.device() == x.device(), "[", op, "] cos/sin are on ",
             cos.device().str(), "/", sin.device().str(), " but ", what, " is on ",
             x.device().str());
}

// The output of x: x's shape and dtype, strides in x's memory order (see above).
TensorSpec rotary_out(const Tensor& x) {
  TensorSpec spec{to_shape(x.sizes()), x.dtype(), x.device()};
  if (x.stride(-1) == 1) spec.strides = dense_strides_like(x.sizes(), x.strides());
  return spec;
}

// Attributes: 0 transpose (bool).
SpecList rotary_emb_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 3, "[rotary_emb] expected inputs (x, cos, sin)");
  const Tensor& x = c.input(0);
  check_rotary("rotary_emb", "x", x, c.input(1), c.input(2));
  (void)c.attr<bool>(0);
  return {rotary_out(x)};
}

SpecList rotary_emb_qk_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 4, "[rotary_emb_qk] expected inputs (q, k, cos, sin)");
  const Tensor& q = c.input(0);
  const Tensor& k = c.input(1);
  check_rotary("rotary_emb_qk", "q", q, c.input(2), c.input(3));
  check_rotary("rotary_emb_qk", "k", k, c.input(2), c.input(3));
  KILN_CHECK(q.dtype() == k.dtype(), "[rotary_emb_qk] q (", dtype_name(q.dtype()), ") and k (",
             dtype_name(k.dtype()), ") must have the same dtype");
  (void)c.attr<bool>(0);
  return {rotary_out(q), rotary_out(k)};
}

}  // namespace

KILN_DEFINE_OP(rotary_emb, OpKind::kFunctional, rotary_emb_meta);
KILN_DEFINE_OP(rotary_emb_qk, OpKind::kFunctional, rotary_emb_qk_meta);

Tensor rotary_emb(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  static const OpDef& op = KILN_OP(rotary_emb);
  return call_op1(op, {x, cos, sin}, {false});
}

std::tuple<Tensor, Tensor> rotary_emb_qk(const Tensor& q, const Tensor& k, const Tensor& cos,
                                         const Tensor& sin) {
  static const OpDef& op = KILN_OP(rotary_emb_qk);
  TensorVec out = call_op(op, {q, k, cos, sin}, {false});
  return {std::move(out[0]), std::move(out[1])};
}

}  // namespace kiln
