// rotary_emb and rotary_emb_qk, fused registry ops with their decompositions (kernels:
// kernels/cpu/rotary.cpp, kernels/cuda/rotary.cu, support rules in kernels/fused_support.h;
// backward rules: autograd/rotary_backward.cpp; tests: tests/tensor/fused_ops_test.cpp,
// tests/kernels/gpu_fused_test.cpp).
//
//   Tensor q2 = kiln::rotary_emb(q, cos, sin);                // q [..., T, D], cos/sin [T, D]
//   auto [q3, k3] = kiln::rotary_emb_qk(q, k, cos, sin);      // both in one launch
//
// rotary_emb(x, cos, sin; transpose) -> y, with h = D / 2, x1 = x[..., :h], x2 = x[..., h:] and
// the same halves c1, c2, s1, s2 of cos/sin, which broadcast against x (the kernels take
// [T, D] tables, with leading dims of 1; per-batch positions [B, 1, T, D] run the decomposition):
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

// Checks x [..., D] (D even) against cos/sin, which must broadcast to x's shape.
void check_rotary(const char* op, const char* what, const Tensor& x, const Tensor& cos,
                  const Tensor& sin) {
  KILN_CHECK(x.defined() && cos.defined() && sin.defined(), "[", op, "] ", what,
             ", cos and sin must be defined");
  KILN_CHECK(is_floating_point(x.dtype()), "[", op, "] expected a floating-point ", what, ", got ",
             dtype_name(x.dtype()));
  KILN_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "[", op, "] the last dim of ", what,
             " must be even (the two rotated halves), got shape ", shape_str(x.sizes()));
  KILN_CHECK(cos.sizes() == sin.sizes() && cos.dtype() == sin.dtype(), "[", op, "] cos (",
             dtype_name(cos.dtype()), " ", shape_str(cos.sizes()), ") and sin (",
             dtype_name(sin.dtype()), " ", shape_str(sin.sizes()),
             ") must have the same shape and dtype");
  bool fits = cos.dim() >= 1 && cos.dim() <= x.dim() && cos.size(-1) == x.size(-1);
  for (int64_t i = 2; fits && i <= cos.dim(); ++i) {
    fits = cos.size(-i) == x.size(-i) || cos.size(-i) == 1;
  }
  KILN_CHECK(fits, "[", op, "] cos/sin of shape ", shape_str(cos.sizes()), " must broadcast to ",
             what, " of shape ", shape_str(x.sizes()));
  KILN_CHECK(is_floating_point(cos.dtype()), "[", op, "] expected floating-point cos/sin, got ",
             dtype_name(cos.dtype()));
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

// y = x * cos + r(x * sin) for transpose, else x * cos + r(x) * sin, with r = rotate_half
// ([-x2, x1]) or its transpose ([x2, -x1]); in the compute dtype, returned in x's dtype.
Tensor rotate(const Tensor& x, const Tensor& cos, const Tensor& sin, bool transpose) {
  const ScalarType ct = x.dtype() == kDouble ? kDouble : kFloat;
  const Tensor xc = x.to(ct), c = cos.to(ct), s = sin.to(ct);
  const int64_t h = x.size(-1) / 2;
  const auto halves = [&](const Tensor& t, bool forward) {
    const Tensor t1 = t.narrow(-1, 0, h), t2 = t.narrow(-1, h, h);
    return forward ? cat({-t2, t1}, -1) : cat({t2, -t1}, -1);
  };
  const Tensor y = transpose ? xc * c + halves(xc * s, false) : xc * c + halves(xc, true) * s;
  return y.to(x.dtype());
}

TensorVec rotary_emb_decomposition(const OpCall& c) {
  return {rotate(c.input(0), c.input(1), c.input(2), c.attr<bool>(0))};
}

TensorVec rotary_emb_qk_decomposition(const OpCall& c) {
  const bool transpose = c.attr<bool>(0);
  return {rotate(c.input(0), c.input(2), c.input(3), transpose),
          rotate(c.input(1), c.input(2), c.input(3), transpose)};
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
  (void)c.attr<bool>(0);
  return {rotary_out(q), rotary_out(k)};
}

}  // namespace

KILN_DEFINE_OP(rotary_emb, OpKind::kFunctional, rotary_emb_meta);
KILN_REGISTER_DECOMPOSITION(rotary_emb, rotary_emb_decomposition);
KILN_DEFINE_OP(rotary_emb_qk, OpKind::kFunctional, rotary_emb_qk_meta);
KILN_REGISTER_DECOMPOSITION(rotary_emb_qk, rotary_emb_qk_decomposition);

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
