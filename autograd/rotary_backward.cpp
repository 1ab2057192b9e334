// Backward rules of rotary_emb and rotary_emb_qk (tensor/ops/rotary.cpp). The rotation is linear
// in x, so dx is the same op with the transposed rotation (one kernel, and itself differentiable:
// the transpose of the transpose is the forward). The gradients of cos and sin, needed only
// when the tables themselves require grad, are composed of plain ops and summed over x's leading
// dims:
//   transpose = false:  dcos = sum(dy * x),  dsin = sum(dy * rotate_half(x))
//   transpose = true:   dcos = sum(dy * x),  dsin = sum(x * rotate_half(dy))
// split_qkv_rotary and merge_qkv_rotary are each other's adjoints (with the opposite transpose);
// their table gradients are those of the q and k rotations. Each op saves the tensors it rotates
// only when a table requires grad, so that the qkv projection's output (or dq and dk) need not
// live until backward.
#include "autograd/backward_util.h"
#include "tensor/ops/rotary.h"

namespace kiln::autograd {
namespace {

using internal::sum_to;

Tensor as_dtype(const Tensor& t, ScalarType dtype) { return t.dtype() == dtype ? t : t.to(dtype); }

// [-v2, v1] over the halves of the last dim.
Tensor rotate_half(const Tensor& v) {
  const int64_t h = v.size(-1) / 2;
  return cat({v.narrow(-1, h, h).neg(), v.narrow(-1, 0, h)}, -1);
}

// Adds the cos/sin gradients of one rotated tensor x (output gradient g) into dcos/dsin.
void accumulate_table_grads(const BackwardCall& c, size_t cos_index, const Tensor& x,
                            const Tensor& g, Tensor& dcos, Tensor& dsin) {
  // x is saved only when a table requires grad (a meta tensor otherwise).
  if (!c.needs_grad(cos_index) && !c.needs_grad(cos_index + 1)) return;
  const Tensor& cos = c.input(cos_index);
  const bool transpose = c.attr<bool>(0);
  const Tensor xc = as_dtype(x, cos.dtype()), gc = as_dtype(g, cos.dtype());
  auto add = [](Tensor& acc, const Tensor& term) { acc = acc.defined() ? acc + term : term; };
  if (c.needs_grad(cos_index)) add(dcos, sum_to(gc * xc, cos.sizes()));
  if (c.needs_grad(cos_index + 1)) {
    add(dsin, sum_to(transpose ? xc * rotate_half(gc) : gc * rotate_half(xc), cos.sizes()));
  }
}

TensorVec rotary_emb_backward_rule(const BackwardCall& c) {
  TensorVec out(3);
  if (c.needs_grad(0)) {
    static const OpDef& op = KILN_OP(rotary_emb);
    out[0] = call_op1(op, {c.grad(0), c.input(1), c.input(2)}, {!c.attr<bool>(0)});
  }
  accumulate_table_grads(c, 1, c.input(0), c.grad(0), out[1], out[2]);
  return out;
}

TensorVec rotary_emb_qk_backward_rule(const BackwardCall& c) {
  TensorVec out(4);
  const bool transpose = c.attr<bool>(0);
  if (c.needs_grad(0) && c.needs_grad(1)) {
    static const OpDef& op = KILN_OP(rotary_emb_qk);
    const TensorVec g = call_op(op, {c.grad(0), c.grad(1), c.input(2), c.input(3)}, {!transpose});
    out[0] = g[0];
    out[1] = g[1];
  } else {
    static const OpDef& op = KILN_OP(rotary_emb);
    for (size_t i = 0; i < 2; ++i) {
      if (c.needs_grad(i)) out[i] = call_op1(op, {c.grad(i), c.input(2), c.input(3)}, {!transpose});
    }
  }
  accumulate_table_grads(c, 2, c.input(0), c.grad(0), out[2], out[3]);
  accumulate_table_grads(c, 2, c.input(1), c.grad(1), out[2], out[3]);
  return out;
}

bool tables_need_grad(const OpCall& c, size_t cos_index) {
  return c.input(cos_index).requires_grad() || c.input(cos_index + 1).requires_grad();
}

uint32_t rotary_emb_saved(const OpCall& c) {
  return tables_need_grad(c, 1) ? save_inputs({0, 1, 2}) : save_inputs({1, 2});
}
uint32_t rotary_emb_qk_saved(const OpCall& c) {
  return tables_need_grad(c, 2) ? save_inputs({0, 1, 2, 3}) : save_inputs({2, 3});
}

// split_qkv_rotary(qkv, cos, sin; transpose, H, G) -> (q, k, v).
TensorVec split_qkv_rotary_backward_rule(const BackwardCall& c) {
  TensorVec out(3);
  const bool transpose = c.attr<bool>(0);
  if (c.needs_grad(0)) {
    static const OpDef& op = KILN_OP(merge_qkv_rotary);
    out[0] = call_op1(op, {c.grad(0), c.grad(1), c.grad(2), c.input(1), c.input(2)}, {!transpose});
  }
  if (c.needs_grad(1) || c.needs_grad(2)) {
    const int64_t h = c.attr<int64_t>(1), g = c.attr<int64_t>(2), n = h + 2 * g;
    accumulate_table_grads(c, 1, ::kiln::internal::qkv_heads(c.input(0), 0, h, n), c.grad(0),
                           out[1], out[2]);
    accumulate_table_grads(c, 1, ::kiln::internal::qkv_heads(c.input(0), h, g, n), c.grad(1),
                           out[1], out[2]);
  }
  return out;
}
uint32_t split_qkv_rotary_saved(const OpCall& c) {
  return tables_need_grad(c, 1) ? save_inputs({0, 1, 2}) : save_inputs({1, 2});
}

// merge_qkv_rotary(dq, dk, dv, cos, sin; transpose) -> dqkv.
TensorVec merge_qkv_rotary_backward_rule(const BackwardCall& c) {
  TensorVec out(5);
  const bool transpose = c.attr<bool>(0);
  const int64_t h = c.input(0).size(-3), g = c.input(1).size(-3), n = h + 2 * g;
  if (c.needs_grad(0) || c.needs_grad(1) || c.needs_grad(2)) {
    static const OpDef& op = KILN_OP(split_qkv_rotary);
    const TensorVec d = call_op(op, {c.grad(0), c.input(3), c.input(4)}, {!transpose, h, g});
    for (size_t i = 0; i < 3; ++i) {
      if (c.needs_grad(i)) out[i] = d[i];
    }
  }
  if (c.needs_grad(3) || c.needs_grad(4)) {
    accumulate_table_grads(c, 3, c.input(0), ::kiln::internal::qkv_heads(c.grad(0), 0, h, n),
                           out[3], out[4]);
    accumulate_table_grads(c, 3, c.input(1), ::kiln::internal::qkv_heads(c.grad(0), h, g, n),
                           out[3], out[4]);
  }
  return out;
}
uint32_t merge_qkv_rotary_saved(const OpCall& c) {
  return tables_need_grad(c, 3) ? save_inputs({0, 1, 3, 4}) : save_inputs({3, 4});
}

}  // namespace

// x is read only for the gradients of cos/sin (so saved only when a table requires grad); the
// outputs are never needed.
KILN_REGISTER_BACKWARD(rotary_emb, rotary_emb_backward_rule, rotary_emb_saved, false);
KILN_REGISTER_BACKWARD(rotary_emb_qk, rotary_emb_qk_backward_rule, rotary_emb_qk_saved, false);
KILN_REGISTER_BACKWARD(split_qkv_rotary, split_qkv_rotary_backward_rule, split_qkv_rotary_saved,
                       false);
KILN_REGISTER_BACKWARD(merge_qkv_rotary, merge_qkv_rotary_backward_rule, merge_qkv_rotary_saved,
                       false);

}  // namespace kiln::autograd
