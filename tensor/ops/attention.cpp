// flash_attention, a fused registry op (kernels: kernels/cpu/flash_attention.cpp, the f64-loop
// reference, and kernels/cuda/flash_attention.cu; backward rule: autograd/attention_backward.cpp),
// and its fused backward flash_attention_backward.
//
//   auto [out, lse] = kiln::flash_attention(q, k, v, /*scale=*/0.125, /*causal=*/true);
//
// flash_attention(q, k, v; scale, causal, sliding_window, softcap) -> (out, lse):
//   q [B, H, T, D], k and v [B, H_kv, S, D] with H a multiple of H_kv (query head h reads kv head
//   h / (H / H_kv), as repeat_interleave in F::scaled_dot_product_attention with enable_gqa).
//   s_ij = scale * q_i . k_j, capped to softcap * tanh(s_ij / softcap) when softcap > 0; key j is
//   visible to query i when (!causal || j <= i) and (sliding_window == 0 || j > i - window)
//   (top-left aligned); as in the composite, a sliding window implies causal. out_i =
//   softmax_j(s_i) @ v, lse_i = logsumexp_j(s_ij), in the compute dtype (f32; f64 for f64 inputs).
//   A row that sees no key gets out 0 and lse -inf.
// flash_attention_backward(dout, q, k, v, out, lse, dlse; the same attributes) -> (dq, dk, dv):
//   dlse is the gradient of lse (zeros when lse is unused); dk and dv sum over the query heads
//   of each kv group.
#include <cmath>

#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

ScalarType compute_dtype(ScalarType t) { return t == kDouble ? kDouble : kFloat; }

void check_attrs(const char* op, const OpCall& c) {
  const double scale = c.attr<double>(0);
  const int64_t window = c.attr<int64_t>(2);
  const double softcap = c.attr<double>(3);
  KILN_CHECK(std::isfinite(scale), "[", op, "] scale must be finite, got ", scale);
  KILN_CHECK(window >= 0, "[", op, "] sliding_window must be >= 0 (0 = off), got ", window);
  KILN_CHECK(softcap >= 0 && std::isfinite(softcap), "[", op,
             "] softcap must be finite and >= 0 (0 = off), got ", softcap);
}

// Checks q [B, H, T, D], k and v [B, H_kv, S, D].
void check_qkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  KILN_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "[", op,
             "] expected q [B, H, T, D] and k, v [B, H_kv, S, D], got ", shape_str(q.sizes()), ", ",
             shape_str(k.sizes()), ", ", shape_str(v.sizes()));
  KILN_CHECK(is_floating_point(q.dtype()) && k.dtype() == q.dtype() && v.dtype() == q.dtype(), "[",
             op, "] expected floating-point q, k and v of one dtype, got ", dtype_name(q.dtype()),
             ", ", dtype_name(k.dtype()), ", ", dtype_name(v.dtype()));
  KILN_CHECK(k.sizes() == v.sizes(), "[", op, "] k ", shape_str(k.sizes()), " and v ",
             shape_str(v.sizes()), " must have the same shape");
  KILN_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3), "[", op, "] q ",
             shape_str(q.sizes()), " and k ", shape_str(k.sizes()),
             " must agree in batch and head size");
  KILN_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "[", op, "] the query heads (", q.size(1),
             ") must be a multiple of the key/value heads (", k.size(1), ")");
  KILN_CHECK(k.device() == q.device() && v.device() == q.device(), "[", op,
             "] q, k and v must be on one device, got ", q.device().str(), ", ", k.device().str(),
             ", ", v.device().str());
}

SpecList flash_attention_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 3, "[flash_attention] expected inputs (q, k, v)");
  const Tensor& q = c.input(0);
  check_qkv("flash_attention", q, c.input(1), c.input(2));
  check_attrs("flash_attention", c);
  return {{to_shape(q.sizes()), q.dtype(), q.device()},
          {Shape{q.size(0), q.size(1), q.size(2)}, compute_dtype(q.dtype()), q.device()}};
}

SpecList flash_attention_backward_meta(const OpCall& c) {
  constexpr const char* kOp = "flash_attention_backward";
  KILN_CHECK(c.inputs.size() == 7, "[", kOp, "] expected inputs (dout, q, k, v, out, lse, dlse)");
  const Tensor& dout = c.input(0);
  const Tensor& q = c.input(1);
  const Tensor& k = c.input(2);
  const Tensor& v = c.input(3);
  const Tensor& out = c.input(4);
  check_qkv(kOp, q, k, v);
  check_attrs(kOp, c);
  for (const Tensor* t : {&dout, &out}) {
    KILN_CHECK(t->dtype() == q.dtype() && t->sizes() == q.sizes(), "[", kOp, "] dout and out (",
               dtype_name(t->dtype()), " ", shape_str(t->sizes()), ") must match q (",
               dtype_name(q.dtype()), " ", shape_str(q.sizes()), ")");
  }
  const Shape rows{q.size(0), q.size(1), q.size(2)};
  for (size_t i : {size_t{5}, size_t{6}}) {
    const Tensor& t = c.input(i);
    KILN_CHECK(t.dtype() == compute_dtype(q.dtype()) && to_shape(t.sizes()) == rows, "[", kOp,
               "] lse and dlse (", dtype_name(t.dtype()), " ", shape_str(t.sizes()), ") must be ",
               dtype_name(compute_dtype(q.dtype())), " ", shape_str(rows));
  }
  return {{to_shape(q.sizes()), q.dtype(), q.device()},
          {to_shape(k.sizes()), k.dtype(), k.device()},
          {to_shape(v.sizes()), v.dtype(), v.device()}};
}

}  // namespace

KILN_DEFINE_OP(flash_attention, OpKind::kFunctional, flash_attention_meta);
KILN_DEFINE_OP(flash_attention_backward, OpKind::kFunctional, flash_attention_backward_meta);

std::tuple<Tensor, Tensor> flash_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                           double scale, bool causal, int64_t sliding_window,
                                           double softcap) {
  static const OpDef& op = KILN_OP(flash_attention);
  const TensorVec r = call_op(op, {q, k, v}, {scale, causal, sliding_window, softcap});
  return {r[0], r[1]};
}

}  // namespace kiln
