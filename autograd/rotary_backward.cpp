// Backward rules of rotary_emb and rotary_emb_qk (tensor/ops/rotary.cpp). The rotation is linear
// in x, so dx is the same op with the transposed rotation (one kernel, and itself differentiable:
// the transpose of the transpose is the forward). The gradients of cos and sin, needed only
// when the tables themselves require grad, are composed of plain ops and summed over x's leading
// dims:
//   transpose = false:  dcos = sum(dy * x),  dsin = sum(dy * rotate_half(x))
//   transpose = true:   dcos = sum(dy * x),  dsin = sum(x * rotate_half(dy))
#include "autograd/backward_util.h"

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

}  // namespace

// x is read only for the gradients of cos/sin; the outputs are never needed.
KILN_REGISTER_BACKWARD(rotary_emb, rotary_emb_backward_rule, save_inputs({0, 1, 2}), false);
KILN_REGISTER_BACKWARD(rotary_emb_qk, rotary_emb_qk_backward_rule, save_inputs({0, 1, 2, 3}),
                       false);

}  // namespace kiln::autograd
