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
//
// split_qkv_rotary(qkv, cos, sin; transpose, H, G) -> (q, k, v): the heads of a fused qkv
// projection qkv [..., T, (H + 2G) D], q [..., H, T, D] and k, v [..., G, T, D], with q and k
// rotated and v copied, in one kernel. Each output is stored [..., T, heads, D] (the read of
// qkv and the writes are sequential). merge_qkv_rotary(dq, dk, dv, cos, sin; transpose) -> dqkv
// is its adjoint: dq and dk rotated, laid side by side with dv in one contiguous
// [..., T, (H + 2G) D]; split's backward is merge with the opposite transpose, and merge's is
// split. Splitting qkv by narrow views instead costs, in backward, one zero-filled qkv-sized
// gradient per view and their sum (a quarter of llama-160m's GPU step). cos/sin are [T, D]
// tables (leading dims of 1 allowed), as the rotary kernels take them.
//
// rotary_qkv_(qkv, cos, sin; transpose, H, G) -> qkv: split_qkv_rotary in place, for kiln::compile
// (the fuse_qkv_rotary pass, compiler/passes.h): the q and k heads of qkv rotated where they are
// and the v heads left alone, so that the heads become views of qkv (internal::qkv_heads) and v is
// never copied. No decomposition and no backward rule: the compiler writes it into programs whose
// backward is already traced, where nothing else reads qkv. Kernels: CPU and CUDA, for the tables
// rotary_emb's kernels take.
#include "tensor/ops/rotary.h"

#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln {

namespace internal {
void check_rotary_tables(const char* op, const Tensor& cos, const Tensor& sin, int64_t t, int64_t d,
                         Device device) {
  KILN_CHECK(cos.defined() && sin.defined(), "[", op, "] cos and sin must be defined");
  KILN_CHECK(cos.sizes() == sin.sizes() && cos.dtype() == sin.dtype(), "[", op, "] cos (",
             dtype_name(cos.dtype()), " ", shape_str(cos.sizes()), ") and sin (",
             dtype_name(sin.dtype()), " ", shape_str(sin.sizes()),
             ") must have the same shape and dtype");
  bool fits = cos.dim() >= 2 && cos.size(-1) == d && cos.size(-2) == t;
  for (int64_t i = 0; fits && i + 2 < cos.dim(); ++i) fits = cos.size(i) == 1;
  KILN_CHECK(fits, "[", op, "] expected cos/sin of shape [T, D] = [", t, ", ", d,
             "] (leading dims of 1 allowed), got ", shape_str(cos.sizes()));
  KILN_CHECK(is_floating_point(cos.dtype()), "[", op, "] expected floating-point cos/sin, got ",
             dtype_name(cos.dtype()));
  KILN_CHECK(cos.device() == device && sin.device() == device, "[", op, "] cos/sin are on ",
             cos.device().str(), "/", sin.device().str(), " but the heads are on ", device.str());
}
}  // namespace internal

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

// [lead..., heads, T, D] stored as [lead..., T, heads, D].
TensorSpec heads_spec(IntArrayRef lead, int64_t heads, int64_t t, int64_t d, ScalarType dtype,
                      Device device) {
  Shape sizes(lead.begin(), lead.end());
  sizes.insert(sizes.end(), {heads, t, d});
  Shape stored(lead.begin(), lead.end());
  stored.insert(stored.end(), {t, heads, d});
  Shape strides = contiguous_strides(stored);
  const size_t n = strides.size();
  std::swap(strides[n - 3], strides[n - 2]);
  TensorSpec spec{std::move(sizes), dtype, device};
  spec.strides = std::move(strides);
  return spec;
}

// Checks split_qkv_rotary's and rotary_qkv_'s call (qkv, cos, sin; transpose, H, G) and returns
// the head size D.
int64_t check_qkv_call(const char* op, const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 3, "[", op, "] expected inputs (qkv, cos, sin)");
  const Tensor& qkv = c.input(0);
  (void)c.attr<bool>(0);
  const int64_t h = c.attr<int64_t>(1), g = c.attr<int64_t>(2);
  KILN_CHECK(qkv.defined(), "[", op, "] qkv must be defined");
  KILN_CHECK(is_floating_point(qkv.dtype()), "[", op, "] expected a floating-point qkv, got ",
             dtype_name(qkv.dtype()));
  KILN_CHECK(h > 0 && g > 0, "[", op, "] expected positive head counts, got n_head ", h,
             " and n_kv_head ", g);
  KILN_CHECK(
      qkv.dim() >= 2 && qkv.size(-1) % (h + 2 * g) == 0 && qkv.size(-1) / (h + 2 * g) % 2 == 0, "[",
      op, "] expected qkv [..., T, (n_head + 2 n_kv_head) D] with an even D, got shape ",
      shape_str(qkv.sizes()), " for n_head ", h, " and n_kv_head ", g);
  const int64_t d = qkv.size(-1) / (h + 2 * g);
  internal::check_rotary_tables(op, c.input(1), c.input(2), qkv.size(-2), d, qkv.device());
  return d;
}

// Attributes: 0 transpose (bool), 1 n_head H, 2 n_kv_head G.
SpecList split_qkv_rotary_meta(const OpCall& c) {
  const int64_t d = check_qkv_call("split_qkv_rotary", c);
  const Tensor& qkv = c.input(0);
  const int64_t h = c.attr<int64_t>(1), g = c.attr<int64_t>(2), t = qkv.size(-2);
  const IntArrayRef lead = qkv.sizes().subspan(0, static_cast<size_t>(qkv.dim() - 2));
  return {heads_spec(lead, h, t, d, qkv.dtype(), qkv.device()),
          heads_spec(lead, g, t, d, qkv.dtype(), qkv.device()),
          heads_spec(lead, g, t, d, qkv.dtype(), qkv.device())};
}

// The same attributes; qkv is written in place.
SpecList rotary_qkv_meta(const OpCall& c) {
  (void)check_qkv_call("rotary_qkv_", c);
  return {};
}

// Attributes: 0 transpose (bool).
SpecList merge_qkv_rotary_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 5, "[merge_qkv_rotary] expected inputs (dq, dk, dv, cos, sin)");
  (void)c.attr<bool>(0);
  const Tensor& q = c.input(0);
  const Tensor& k = c.input(1);
  const Tensor& v = c.input(2);
  KILN_CHECK(q.defined() && k.defined() && v.defined(),
             "[merge_qkv_rotary] dq, dk and dv must be defined");
  KILN_CHECK(is_floating_point(q.dtype()) && k.dtype() == q.dtype() && v.dtype() == q.dtype(),
             "[merge_qkv_rotary] expected dq, dk, dv of one floating-point dtype, got ",
             dtype_name(q.dtype()), ", ", dtype_name(k.dtype()), ", ", dtype_name(v.dtype()));
  KILN_CHECK(k.device() == q.device() && v.device() == q.device(),
             "[merge_qkv_rotary] dq, dk, dv are on ", q.device().str(), ", ", k.device().str(),
             ", ", v.device().str());
  bool fits = q.dim() >= 3 && k.dim() == q.dim() && k.sizes() == v.sizes() && q.size(-1) % 2 == 0 &&
              k.size(-1) == q.size(-1) && k.size(-2) == q.size(-2);
  for (int64_t i = 0; fits && i + 3 < q.dim(); ++i) fits = k.size(i) == q.size(i);
  KILN_CHECK(fits,
             "[merge_qkv_rotary] expected dq [..., H, T, D] and dk, dv [..., G, T, D] with an "
             "even D, got ",
             shape_str(q.sizes()), ", ", shape_str(k.sizes()), ", ", shape_str(v.sizes()));
  const int64_t t = q.size(-2), d = q.size(-1);
  internal::check_rotary_tables("merge_qkv_rotary", c.input(3), c.input(4), t, d, q.device());
  Shape sizes(q.sizes().begin(), q.sizes().end() - 3);
  sizes.insert(sizes.end(), {t, (q.size(-3) + 2 * k.size(-3)) * d});
  return {TensorSpec{std::move(sizes), q.dtype(), q.device()}};
}

TensorVec split_qkv_rotary_decomposition(const OpCall& c) {
  const bool transpose = c.attr<bool>(0);
  const int64_t h = c.attr<int64_t>(1), g = c.attr<int64_t>(2), n = h + 2 * g;
  const Tensor& qkv = c.input(0);
  return {rotate(internal::qkv_heads(qkv, 0, h, n), c.input(1), c.input(2), transpose),
          rotate(internal::qkv_heads(qkv, h, g, n), c.input(1), c.input(2), transpose),
          internal::qkv_heads(qkv, h + g, g, n).clone()};
}

TensorVec merge_qkv_rotary_decomposition(const OpCall& c) {
  const bool transpose = c.attr<bool>(0);
  const Tensor q = rotate(c.input(0), c.input(3), c.input(4), transpose);
  const Tensor k = rotate(c.input(1), c.input(3), c.input(4), transpose);
  const Tensor merged =
      cat({q.transpose(-3, -2), k.transpose(-3, -2), c.input(2).transpose(-3, -2)}, -2);
  return {merged.flatten(-2)};
}

}  // namespace

KILN_DEFINE_OP(rotary_emb, OpKind::kFunctional, rotary_emb_meta);
KILN_REGISTER_DECOMPOSITION(rotary_emb, rotary_emb_decomposition);
KILN_DEFINE_OP(rotary_emb_qk, OpKind::kFunctional, rotary_emb_qk_meta);
KILN_REGISTER_DECOMPOSITION(rotary_emb_qk, rotary_emb_qk_decomposition);
KILN_DEFINE_OP(split_qkv_rotary, OpKind::kFunctional, split_qkv_rotary_meta);
KILN_REGISTER_DECOMPOSITION(split_qkv_rotary, split_qkv_rotary_decomposition);
KILN_DEFINE_OP(merge_qkv_rotary, OpKind::kFunctional, merge_qkv_rotary_meta);
KILN_REGISTER_DECOMPOSITION(merge_qkv_rotary, merge_qkv_rotary_decomposition);
KILN_DEFINE_OP(rotary_qkv_, OpKind::kInplace, rotary_qkv_meta);

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

std::tuple<Tensor, Tensor, Tensor> split_qkv_rotary(const Tensor& qkv, const Tensor& cos,
                                                    const Tensor& sin, int64_t n_head,
                                                    int64_t n_kv_head) {
  static const OpDef& op = KILN_OP(split_qkv_rotary);
  TensorVec out = call_op(op, {qkv, cos, sin}, {false, n_head, n_kv_head});
  return {std::move(out[0]), std::move(out[1]), std::move(out[2])};
}

Tensor merge_qkv_rotary(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& cos,
                        const Tensor& sin) {
  static const OpDef& op = KILN_OP(merge_qkv_rotary);
  return call_op1(op, {dq, dk, dv, cos, sin}, {true});
}

}  // namespace kiln
