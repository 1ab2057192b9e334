// Backward rules of the view ops and of copies (tensor/ops/view.cpp, tensor/ops/copy.cpp).
#include <numeric>

#include "autograd/backward_util.h"

namespace kiln::autograd {
namespace internal {

Tensor sum_to(const Tensor& grad, IntArrayRef shape) {
  if (grad.sizes() == shape) return grad;
  const int64_t lead = grad.dim() - static_cast<int64_t>(shape.size());
  Shape dims;
  for (int64_t d = 0; d < grad.dim(); ++d) {
    if (d < lead || (shape[d - lead] == 1 && grad.sizes()[d] != 1)) dims.push_back(d);
  }
  Tensor r = dims.empty() ? grad : grad.sum(dims, /*keepdim=*/true);
  return r.reshape(shape);
}

}  // namespace internal

namespace {

using internal::sum_to;

TensorVec view_backward(const BackwardCall& c) { return {c.grad().reshape(c.input(0).sizes())}; }

TensorVec permute_backward(const BackwardCall& c) {
  const Shape& dims = c.attr<Shape>(0);
  const int64_t n = static_cast<int64_t>(dims.size());
  Shape inverse(n);
  for (int64_t i = 0; i < n; ++i) inverse[wrap_dim(dims[i], n, "permute")] = i;
  return {c.grad().permute(inverse)};
}

TensorVec expand_backward(const BackwardCall& c) { return {sum_to(c.grad(), c.input(0).sizes())}; }

TensorVec reshape_like_input(const BackwardCall& c) {
  return {c.grad().reshape(c.input(0).sizes())};
}

TensorVec unsqueeze_backward(const BackwardCall& c) {
  return {c.grad().squeeze(wrap_dim(c.attr<int64_t>(0), c.input(0).dim() + 1, "unsqueeze"))};
}

TensorVec alias_backward(const BackwardCall& c) { return {c.grad()}; }

// slice and select scatter the gradient into zeros of the input's shape, through the ops
// slice_backward / select_backward so that the result is differentiable again.
TensorVec slice_backward(const BackwardCall& c) {
  static const OpDef& op = KILN_OP(slice_backward);
  return {call_op1(op, {c.grad()},
                   {to_shape(c.input(0).sizes()), c.attr<int64_t>(0), c.attr<int64_t>(1),
                    c.attr<int64_t>(2), c.attr<int64_t>(3)})};
}

TensorVec select_backward(const BackwardCall& c) {
  static const OpDef& op = KILN_OP(select_backward);
  return {call_op1(op, {c.grad()},
                   {to_shape(c.input(0).sizes()), c.attr<int64_t>(0), c.attr<int64_t>(1)})};
}

TensorVec slice_backward_backward(const BackwardCall& c) {
  return {c.grad().slice(c.attr<int64_t>(1), c.attr<int64_t>(2), c.attr<int64_t>(3),
                         c.attr<int64_t>(4))};
}

TensorVec select_backward_backward(const BackwardCall& c) {
  return {c.grad().select(c.attr<int64_t>(1), c.attr<int64_t>(2))};
}

// Unsaved inputs arrive as meta placeholders, so only the dtype is read here; the node moves
// the gradient back to the input's device (OpNode::apply).
TensorVec to_copy_backward(const BackwardCall& c) { return {c.grad().to(c.input(0).dtype())}; }

TensorVec copy_backward(const BackwardCall& c) {
  TensorVec g(2);
  if (c.needs_grad(0)) g[0] = zeros_like(c.grad());
  if (c.needs_grad(1)) {
    g[1] = sum_to(c.grad(), c.input(1).sizes()).to(c.input(1).dtype());
  }
  return g;
}

TensorVec fill_backward(const BackwardCall& c) { return {zeros_like(c.grad())}; }

}  // namespace

KILN_REGISTER_BACKWARD(view, view_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(permute, permute_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(expand, expand_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(squeeze, reshape_like_input, kSaveNone, false);
KILN_REGISTER_BACKWARD(unsqueeze, unsqueeze_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(alias, alias_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(slice, slice_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(select, select_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(slice_backward, slice_backward_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(select_backward, select_backward_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(to_copy, to_copy_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(copy_, copy_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(fill_, fill_backward, kSaveNone, false);

}  // namespace kiln::autograd
