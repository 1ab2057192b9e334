// flash_attention, the fused attention op behind F::scaled_dot_product_attention, with its
// decomposition (kernels: kernels/cpu/flash_attention.cpp, the f64-loop reference, and the CUDA
// flash kernels kernels/cuda/flash_*.cu, each with its support rule; backward rule:
// autograd/attention_backward.cpp; tests: tests/nn/attention_test.cpp,
// tests/kernels/gpu_flash_test.cpp), and its fused backward flash_attention_backward.
//
//   auto [out, lse] = kiln::flash_attention(q, k, v, /*scale=*/0.125, /*causal=*/true);
//
// flash_attention(q, k, v, attn_mask; scale, causal, sliding_window, softcap, dropout_p)
//     -> (out, lse):
//   q [B, H, T, D], k [B, H_kv, S, D] and v [B, H_kv, S, Dv] with H a multiple of H_kv (query
//   head h reads kv head h / (H / H_kv), as repeat_interleave in F::scaled_dot_product_attention
//   with enable_gqa). s_ij = scale * q_i . k_j, capped to softcap * tanh(s_ij / softcap) when
//   softcap > 0; key j is visible to query i when (!causal || j <= i) and (sliding_window == 0 ||
//   j > i - window) (top-left aligned; a sliding window implies causal) and the optional
//   attn_mask (the 4th input, broadcasting to [B, H, T, S]; bool: true attends, floating: added
//   to the scores) allows it. out_i = softmax_j(s_i) @ v (out laid out in q's memory order), with
//   dropout_p (optional attribute, default 0) applied to the probabilities; lse_i =
//   logsumexp_j(s_ij) of the visible keys, in the compute dtype (f32; f64 for f64 inputs). A row
//   that sees no key gets out 0 and lse -inf. The kernels take calls without a mask or dropout; the
//   decomposition runs the others.
// flash_attention_backward(dout, q, k, v, out, lse, dlse; the same attributes) -> (dq, dk, dv):
//   dlse is the gradient of lse, or undefined meaning zeros (what the backward rule passes when lse
//   received no gradient, as in training: the kernels then skip it); dk and dv sum over the query
//   heads of each kv group.
// flash_attention_backward_qkv(dout, q, k, v, out, lse, dlse, cos, sin; scale, causal,
//     sliding_window, softcap, transpose) -> dqkv [B, T, (H + 2 H_kv) D]:
//   merge_qkv_rotary(flash_attention_backward(...), cos, sin; transpose) as one op, the backward of
//   attention over the heads of one qkv projection (split_qkv_rotary's, T == S). The compiler's
//   fuse_qkv_rotary pass (compiler/passes.h) writes it where the three gradients are read by the
//   merge alone. Its CUDA kernel lets cuDNN write dq, dk and dv into their places in dqkv and
//   rotates dq and dk there (kernels/cuda/cudnn_attention.cpp), so that dv is never copied; every
//   other call runs the two ops' kernels one after the other (kernels/fused_support.h). No backward
//   rule (it is written after autograd has run).
#include <cmath>
#include <limits>

#include "kernels/fused_support.h"
#include "tensor/ops.h"
#include "tensor/ops/elementwise_meta.h"
#include "tensor/ops/rotary.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

using internal::compute_dtype;

void check_attrs(const char* op, const OpCall& c) {
  const double scale = c.attr<double>(0);
  const int64_t window = c.attr<int64_t>(2);
  const double softcap = c.attr<double>(3);
  KILN_CHECK(std::isfinite(scale), "[", op, "] scale must be finite, got ", scale);
  KILN_CHECK(window >= 0, "[", op, "] sliding_window must be >= 0 (0 = off), got ", window);
  KILN_CHECK(softcap >= 0 && std::isfinite(softcap), "[", op,
             "] softcap must be finite and >= 0 (0 = off), got ", softcap);
}

// Checks q [B, H, T, D], k [B, H_kv, S, D] and v [B, H_kv, S, Dv] (Dv == D for the backward).
void check_qkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
               bool same_head_size = true) {
  KILN_CHECK(q.defined() && k.defined() && v.defined(), "[", op,
             "] query, key and value must be defined");
  KILN_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "[", op,
             "] expected q [B, H, T, D] and k, v [B, H_kv, S, D], got ", shape_str(q.sizes()), ", ",
             shape_str(k.sizes()), ", ", shape_str(v.sizes()));
  KILN_CHECK(is_floating_point(q.dtype()) && k.dtype() == q.dtype() && v.dtype() == q.dtype(), "[",
             op, "] expected floating-point q, k and v of one dtype, got ", dtype_name(q.dtype()),
             ", ", dtype_name(k.dtype()), ", ", dtype_name(v.dtype()));
  KILN_CHECK(k.size(0) == v.size(0) && k.size(1) == v.size(1) && k.size(2) == v.size(2) &&
                 (!same_head_size || k.size(3) == v.size(3)),
             "[", op, "] k ", shape_str(k.sizes()), " and v ", shape_str(v.sizes()),
             same_head_size ? " must have the same shape" : " must agree in batch, heads and keys");
  KILN_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3), "[", op, "] q ",
             shape_str(q.sizes()), " and k ", shape_str(k.sizes()),
             " must agree in batch and head size");
  KILN_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "[", op, "] the query heads (", q.size(1),
             ") must be a multiple of the key/value heads (", k.size(1), ")");
  KILN_CHECK(k.device() == q.device() && v.device() == q.device(), "[", op,
             "] q, k and v must be on one device, got ", q.device().str(), ", ", k.device().str(),
             ", ", v.device().str());
}

// The optional 4th input.
const Tensor& attn_mask(const OpCall& c) {
  static const Tensor none;
  return c.inputs.size() > 3 ? c.input(3) : none;
}
double dropout_p(const OpCall& c) { return c.has_attr(4) ? c.attr<double>(4) : 0.0; }

SpecList flash_attention_meta(const OpCall& c) {
  constexpr const char* kOp = "flash_attention";
  KILN_CHECK(c.inputs.size() == 3 || c.inputs.size() == 4,
             "[flash_attention] expected inputs (q, k, v) or (q, k, v, attn_mask)");
  const Tensor& q = c.input(0);
  const Tensor& v = c.input(2);
  check_qkv(kOp, q, c.input(1), v, /*same_head_size=*/false);
  check_attrs(kOp, c);
  const double p = dropout_p(c);
  KILN_CHECK(p >= 0.0 && p < 1.0, "[", kOp, "] dropout_p must be in [0, 1), got ", p);
  const Tensor& mask = attn_mask(c);
  if (mask.defined()) {
    KILN_CHECK(!c.attr<bool>(1), "[", kOp,
               "] an explicit attn_mask should not be set when is_causal=true");
    KILN_CHECK(mask.dtype() == kBool || is_floating_point(mask.dtype()), "[", kOp,
               "] attn_mask must be bool or floating, got ", dtype_name(mask.dtype()));
    const Shape scores{q.size(0), q.size(1), q.size(2), c.input(1).size(2)};
    bool fits = mask.dim() <= 4;
    for (int64_t i = 1; fits && i <= mask.dim(); ++i) {
      fits = mask.size(-i) == 1 || mask.size(-i) == scores[4 - i];
    }
    KILN_CHECK(fits, "[", kOp, "] attn_mask of shape ", shape_str(mask.sizes()),
               " does not broadcast to the scores ", shape_str(scores));
    KILN_CHECK(mask.device() == q.device(), "[", kOp, "] attn_mask is on ", mask.device().str(),
               " but q is on ", q.device().str());
  }
  // out is laid out in q's memory order where q's last dim is dense (as PyTorch lays out
  // elementwise results): the heads of a qkv projection (split_qkv_rotary's q, stored
  // [B, T, H, D]) give an out stored [B, T, H, D], which the output projection reads as
  // [B T, H D] without a copy.
  TensorSpec out{Shape{q.size(0), q.size(1), q.size(2), v.size(3)}, q.dtype(), q.device()};
  if (q.stride(3) == 1) out.strides = dense_strides_like(out.sizes, q.strides());
  return {out, {Shape{q.size(0), q.size(1), q.size(2)}, compute_dtype(q.dtype()), q.device()}};
}

// [B, H_kv, S, D] -> [B, H_kv * rep, S, D] (kv head g serves query heads g*rep .. g*rep+rep-1).
Tensor repeat_kv(const Tensor& t, int64_t rep) {
  if (rep == 1) return t;
  return t.unsqueeze(2)
      .expand({t.size(0), t.size(1), rep, t.size(2), t.size(3)})
      .reshape({t.size(0), t.size(1) * rep, t.size(2), t.size(3)});
}

// The attention in plain ops, scores and softmax in the compute dtype (the T x S scores are
// materialised): what runs when no kernel takes a call (a mask, dropout, a head size or dtype
// the kernels lack), and the reference the kernels are tested against.
TensorVec flash_attention_decomposition(const OpCall& c) {
  const Tensor& q = c.input(0);
  const ScalarType ct = compute_dtype(q.dtype());
  const int64_t rep = q.size(1) / c.input(1).size(1);
  const Tensor k = repeat_kv(c.input(1), rep).to(ct);
  const Tensor v = repeat_kv(c.input(2), rep).to(ct);
  const double softcap = c.attr<double>(3);
  const int64_t window = c.attr<int64_t>(2);
  Tensor scores = q.to(ct).matmul(k.transpose(-2, -1)) * c.attr<double>(0);
  if (softcap > 0.0) scores = (scores / softcap).tanh() * softcap;
  // Which keys each query may attend (bool, broadcast against the scores).
  Tensor allowed;
  if (c.attr<bool>(1) || window > 0) {
    const TensorOptions o = TensorOptions(kInt64).device(q.device());
    const Tensor i = arange(q.size(2), o).view({q.size(2), 1});
    const Tensor j = arange(k.size(2), o).view({1, k.size(2)});
    allowed = j <= i;
    if (window > 0) allowed = allowed & (j > i - window);
  }
  const Tensor& mask = attn_mask(c);
  if (mask.defined()) {
    if (mask.dtype() == kBool) {
      allowed = allowed.defined() ? (allowed & mask) : mask;
    } else {
      scores = scores + mask.to(ct);
    }
  }
  const Scalar neg_inf(-std::numeric_limits<double>::infinity());
  if (allowed.defined()) scores = where(allowed, scores, neg_inf);
  // A row with every key masked attends nothing (out 0, lse -inf); its scores are replaced before
  // the softmax so that no NaN enters the graph.
  const Tensor row_max = scores.detach().amax({-1}, /*keepdim=*/true);
  const Tensor dead = row_max == neg_inf;
  const Tensor safe = where(dead, Scalar(0.0), scores);
  Tensor probs = where(dead, Scalar(0.0), softmax(safe, -1));
  const Tensor shift = where(dead, Scalar(0.0), row_max);
  const Tensor lse =
      where(dead, Scalar(0.0), (safe - shift).exp()).sum({-1}).log() + shift.squeeze(-1);
  const double p = dropout_p(c);
  if (p > 0.0) probs = probs * (rand_like(probs) >= Scalar(p)).to(ct) * (1.0 / (1.0 - p));
  return {probs.matmul(v).to(q.dtype()), lse};
}

// Which keys each query may attend (bool [T, S]; undefined: all), by causal and sliding_window.
Tensor visible_keys(const OpCall& c, int64_t t, int64_t s, Device device) {
  const int64_t window = c.attr<int64_t>(2);
  if (!c.attr<bool>(1) && window == 0) return Tensor();
  const TensorOptions o = TensorOptions(kInt64).device(device);
  const Tensor i = arange(t, o).view({t, 1});
  const Tensor j = arange(s, o).view({1, s});
  Tensor allowed = j <= i;
  if (window > 0) allowed = allowed & (j > i - window);
  return allowed;
}

// The backward in plain ops, from the saved lse: the probabilities recomputed (one layer's
// [B, H, T, S] in the compute dtype, held only during this call), then
//   dv = P^T dO,  dP = dO V^T,  dS = P (dP - Delta) with Delta = rowsum(dO out) - dlse,
//   dS *= 1 - tanh^2 (softcap),  dq = scale dS K,  dk = scale dS^T Q,
// dk and dv summed over the query heads of each kv group. What runs when no kernel takes a call
// (deterministic algorithms: tensor/deterministic.h), and a reference the kernels can be held
// to. A row that sees no key (lse -inf) gets zero gradients.
TensorVec flash_attention_backward_decomposition(const OpCall& c) {
  const Tensor& q = c.input(1);
  const Tensor& dlse = c.input(6);
  const ScalarType ct = compute_dtype(q.dtype());
  const int64_t hkv = c.input(2).size(1), rep = q.size(1) / hkv;
  const Tensor k = repeat_kv(c.input(2), rep).to(ct);
  const Tensor v = repeat_kv(c.input(3), rep).to(ct);
  const Tensor qc = q.to(ct), dout = c.input(0).to(ct);
  const double scale = c.attr<double>(0), softcap = c.attr<double>(3);
  Tensor scores = qc.matmul(k.transpose(-2, -1)) * scale;
  Tensor capped;  // tanh(scores / softcap)
  if (softcap > 0.0) {
    capped = (scores / softcap).tanh();
    scores = capped * softcap;
  }
  const Tensor lse = c.input(5).unsqueeze(-1);
  const Scalar neg_inf(-std::numeric_limits<double>::infinity());
  const Tensor dead = lse == neg_inf;
  Tensor probs = where(dead, Scalar(0.0), (scores - where(dead, Scalar(0.0), lse)).exp());
  const Tensor allowed = visible_keys(c, q.size(2), k.size(2), q.device());
  if (allowed.defined()) probs = where(allowed, probs, Scalar(0.0));
  const Tensor dv = probs.transpose(-2, -1).matmul(dout);
  const Tensor dp = dout.matmul(v.transpose(-2, -1));
  Tensor delta = (dout * c.input(4).to(ct)).sum({-1}, /*keepdim=*/true);
  if (dlse.defined()) delta = delta - dlse.unsqueeze(-1);
  Tensor ds = probs * (dp - delta);
  if (softcap > 0.0) ds = ds * (1.0 - capped * capped);
  const Tensor dq = ds.matmul(k) * scale;
  const Tensor dk = ds.transpose(-2, -1).matmul(qc) * scale;
  // [B, H, S, D] -> [B, H_kv, S, D]: the sum over each group's rep query heads.
  auto per_kv_head = [&](const Tensor& t) {
    if (rep == 1) return t;
    return t.view({t.size(0), hkv, rep, t.size(2), t.size(3)}).sum({2});
  };
  return {dq.to(q.dtype()), per_kv_head(dk).to(q.dtype()), per_kv_head(dv).to(q.dtype())};
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
  KILN_CHECK(dout.defined() && out.defined() && c.input(5).defined(), "[", kOp,
             "] dout, out and lse must be defined (dlse may be undefined: zeros)");
  for (const Tensor* t : {&dout, &out}) {
    KILN_CHECK(t->dtype() == q.dtype() && t->sizes() == q.sizes(), "[", kOp, "] dout and out (",
               dtype_name(t->dtype()), " ", shape_str(t->sizes()), ") must match q (",
               dtype_name(q.dtype()), " ", shape_str(q.sizes()), ")");
  }
  const Shape rows{q.size(0), q.size(1), q.size(2)};
  for (size_t i : {size_t{5}, size_t{6}}) {
    const Tensor& t = c.input(i);
    if (!t.defined()) continue;  // dlse: zeros
    KILN_CHECK(t.dtype() == compute_dtype(q.dtype()) && to_shape(t.sizes()) == rows, "[", kOp,
               "] lse and dlse (", dtype_name(t.dtype()), " ", shape_str(t.sizes()), ") must be ",
               dtype_name(compute_dtype(q.dtype())), " ", shape_str(rows));
  }
  return {{to_shape(q.sizes()), q.dtype(), q.device()},
          {to_shape(k.sizes()), k.dtype(), k.device()},
          {to_shape(v.sizes()), v.dtype(), v.device()}};
}

// Attributes: flash_attention_backward's four, then 4 transpose (merge_qkv_rotary's).
SpecList flash_attention_backward_qkv_meta(const OpCall& c) {
  constexpr const char* kOp = "flash_attention_backward_qkv";
  KILN_CHECK(c.inputs.size() == 9 && c.attrs.size() == 5, "[", kOp,
             "] expected inputs (dout, q, k, v, out, lse, dlse, cos, sin) and attributes (scale, "
             "causal, sliding_window, softcap, transpose)");
  (void)flash_attention_backward_meta(attention_backward_part(c));
  (void)c.attr<bool>(4);
  const Tensor& q = c.input(1);
  const Tensor& k = c.input(2);
  KILN_CHECK(k.size(2) == q.size(2) && q.size(3) % 2 == 0, "[", kOp,
             "] expected as many keys as queries and an even head size (the heads of one qkv "
             "projection), got q ",
             shape_str(q.sizes()), " and k ", shape_str(k.sizes()));
  internal::check_rotary_tables(kOp, c.input(7), c.input(8), q.size(2), q.size(3), q.device());
  return {{Shape{q.size(0), q.size(2), (q.size(1) + 2 * k.size(1)) * q.size(3)}, q.dtype(),
           q.device()}};
}

TensorVec flash_attention_backward_qkv_decomposition(const OpCall& c) {
  static const OpDef& merge = KILN_OP(merge_qkv_rotary);
  const OpCall b = attention_backward_part(c);
  const TensorVec d = call_op(*b.op, b.inputs, b.attrs);
  return {call_op1(merge, {d[0], d[1], d[2], c.input(7), c.input(8)}, {c.attrs[4]})};
}

}  // namespace

KILN_DEFINE_OP(flash_attention, OpKind::kFunctional, flash_attention_meta);
KILN_REGISTER_DECOMPOSITION(flash_attention, flash_attention_decomposition);
KILN_DEFINE_OP(flash_attention_backward, OpKind::kFunctional, flash_attention_backward_meta);
KILN_REGISTER_DECOMPOSITION(flash_attention_backward, flash_attention_backward_decomposition);
KILN_DEFINE_OP(flash_attention_backward_qkv, OpKind::kFunctional,
               flash_attention_backward_qkv_meta);
KILN_REGISTER_DECOMPOSITION(flash_attention_backward_qkv,
                            flash_attention_backward_qkv_decomposition);

std::tuple<Tensor, Tensor> flash_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                           double scale, bool causal, int64_t sliding_window,
                                           double softcap) {
  static const OpDef& op = KILN_OP(flash_attention);
  const TensorVec r = call_op(op, {q, k, v}, {scale, causal, sliding_window, softcap});
  return {r[0], r[1]};
}

std::tuple<Tensor, Tensor> flash_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                           const Tensor& attn_mask, double scale, bool causal,
                                           int64_t sliding_window, double softcap,
                                           double dropout_p) {
  static const OpDef& op = KILN_OP(flash_attention);
  const TensorVec r =
      call_op(op, {q, k, v, attn_mask}, {scale, causal, sliding_window, softcap, dropout_p});
  return {r[0], r[1]};
}

}  // namespace kiln
