// Support rules of the fused ops' kernels: which calls (already accepted by the op's meta rule)
// a kernel can run. The CPU and CUDA kernels of these ops take the same calls, so each rule is
// written once here and registered with both (KILN_REGISTER_KERNEL_IF in kernels/cpu/ and
// kernels/cuda/). A call no kernel supports runs the op's decomposition (tensor/ops/).
//
//   KILN_REGISTER_KERNEL_IF(rms_norm, kCUDA, "fused", rms_norm_cuda, kiln::rms_norm_supported);
//
// Flash attention's rules follow the GPU's properties and live with its kernels
// (kernels/cuda/flash_attention.cu). Also here: what both devices' kernels of one fused op share
// (cross_entropy_with_grad_in_two, attention_backward_qkv_in_parts).
#pragma once

#include "tensor/ops.h"
#include "tensor/ops/rotary.h"
#include "tensor/registry.h"

namespace kiln {

// A norm parameter the kernels read: absent, or of x's dtype, or f32 for a f16/bf16 x.
inline bool norm_param_supported(const Tensor& p, const Tensor& x) {
  return !p.defined() || p.dtype() == x.dtype() ||
         (is_reduced_float(x.dtype()) && p.dtype() == kFloat);
}

// rms_norm(x, weight): a weight is given, of a dtype the kernels read.
inline bool rms_norm_supported(const OpCall& c) {
  return c.input(1).defined() && norm_param_supported(c.input(1), c.input(0));
}

// layer_norm(x, weight, bias): each parameter of a dtype the kernels read, one dtype for both.
inline bool layer_norm_supported(const OpCall& c) {
  const Tensor& x = c.input(0);
  const Tensor& w = c.input(1);
  const Tensor& b = c.input(2);
  return norm_param_supported(w, x) && norm_param_supported(b, x) &&
         (!w.defined() || !b.defined() || w.dtype() == b.dtype());
}

// One rotary table (cos or sin) against x: a [T, D] table for x's positions (leading dims of 1
// allowed: the kernels read it as [T, D]) of x's dtype, or f32 for a f16/bf16 x.
inline bool rotary_table_supported(const Tensor& table, const Tensor& x) {
  if (x.dim() < 2 || table.dim() < 2 || table.size(-2) != x.size(-2)) return false;
  for (int64_t d = 0; d + 2 < table.dim(); ++d) {
    if (table.size(d) != 1) return false;
  }
  return table.dtype() == x.dtype() || (is_reduced_float(x.dtype()) && table.dtype() == kFloat);
}

// rotary_emb(x, cos, sin) (meta: cos and sin have one shape and dtype).
inline bool rotary_emb_supported(const OpCall& c) {
  return rotary_table_supported(c.input(1), c.input(0));
}

// rotary_emb_qk(q, k, cos, sin): q and k of one dtype and T.
inline bool rotary_emb_qk_supported(const OpCall& c) {
  const Tensor& q = c.input(0);
  const Tensor& k = c.input(1);
  return q.dtype() == k.dtype() && rotary_table_supported(c.input(2), q) &&
         rotary_table_supported(c.input(2), k);
}

// split_qkv_rotary(qkv, cos, sin), rotary_qkv_(qkv, cos, sin) and merge_qkv_rotary(dq, dk, dv,
// cos, sin) (meta: the tables are [T, D] with leading 1s): the tables' dtype.
inline bool split_qkv_rotary_supported(const OpCall& c) {
  return rotary_table_supported(c.input(1), c.input(0));
}
inline bool rotary_qkv_supported(const OpCall& c) {
  return rotary_table_supported(c.input(1), c.input(0));
}
inline bool merge_qkv_rotary_supported(const OpCall& c) {
  return rotary_table_supported(c.input(3), c.input(0));
}

// cross_entropy_fused_with_grad(logits, targets, grad) run as its two kernels, one device's
// cross_entropy_fused kernel `fwd` (-> loss, lse) and then its backward kernel `bwd` (grad,
// logits, targets, lse -> dlogits): the CPU kernel, and the CUDA kernel's rows that do not fit
// its one-pass kernel.
inline void cross_entropy_with_grad_in_two(OpCall& c, void (*fwd)(OpCall&), void (*bwd)(OpCall&)) {
  OpCall f = c;
  f.inputs = {c.input(0), c.input(1)};
  f.outputs = {c.outputs[0], c.outputs[1]};
  fwd(f);
  OpCall b = c;
  b.inputs = {c.input(2), c.input(0), c.input(1), c.outputs[1]};
  b.outputs = {c.outputs[2]};
  bwd(b);
}

// flash_attention_backward_qkv(dout, q, k, v, out, lse, dlse, cos, sin; scale, causal,
// sliding_window, softcap, transpose) (tensor/ops/attention.cpp) as its two parts: the
// flash_attention_backward call (the first seven inputs and four attributes), and the
// merge_qkv_rotary of its dq, dk, dv (with cos, sin and transpose).
inline OpCall attention_backward_part(const OpCall& c) {
  static const OpDef& op = KILN_OP(flash_attention_backward);
  OpCall b;
  b.op = &op;
  b.inputs.assign(c.inputs.begin(), c.inputs.begin() + 7);
  b.attrs.assign(c.attrs.begin(), c.attrs.begin() + 4);
  return b;
}

// Where a device runs both parts with its kernels: flash_attention_backward's kernel of the
// device supports the call, and the tables are ones merge_qkv_rotary's kernels take.
inline bool attention_backward_qkv_supported(const OpCall& c) {
  const OpCall b = attention_backward_part(c);
  const Tensor& q = c.input(1);
  return b.op->select_kernel(q.device().type(), b) != nullptr &&
         rotary_table_supported(c.input(7), q);
}

// Both parts one after the other, by their kernels (run_into): dq, dk and dv in fresh tensors,
// then rotated back and merged into the output. What a device without a faster way runs.
inline void attention_backward_qkv_in_parts(OpCall& c) {
  static const OpDef& merge = KILN_OP(merge_qkv_rotary);
  const OpCall b = attention_backward_part(c);
  const Tensor& q = c.input(1);
  const Tensor& k = c.input(2);
  const TensorOptions o = TensorOptions(q.dtype()).device(q.device());
  const Tensor dq = empty(q.sizes(), o), dk = empty(k.sizes(), o), dv = empty(k.sizes(), o);
  run_into(*b.op, b.inputs, {dq, dk, dv}, b.attrs);
  run_into(merge, {dq, dk, dv, c.input(7), c.input(8)}, {c.outputs[0]}, {c.attrs[4]});
}

// cross_entropy_fused(logits, targets, weight; ignore_index, reduction, label_smoothing): the
// LM-training case, [N, V] logits, int64 targets, no weight, no smoothing, the mean.
inline bool cross_entropy_supported(const OpCall& c) {
  return c.input(0).dim() == 2 && c.input(1).dtype() == kInt64 &&
         (c.inputs.size() < 3 || !c.input(2).defined()) &&
         (!c.has_attr(1) || c.attr<std::string>(1) == "mean") &&
         (!c.has_attr(2) || c.attr<double>(2) == 0.0);
}

}  // namespace kiln
