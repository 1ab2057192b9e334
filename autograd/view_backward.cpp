// Backward rules of the view ops and of copies (tensor/ops/view.cpp, tensor/ops/copy.cpp).
#include <algorithm>
#include <numeric>
#include <utility>
#include <vector>

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

// as_strided addresses the storage directly, so its gradient goes through the storage too:
// each output element's gradient is added at its storage position (index_add: overlapping
// output elements accumulate), and each input element reads the position it occupies. When
// input elements themselves share a position (an expanded input) they split it evenly, as
// PyTorch does. The rule saves the input for its geometry (strides, offset).
Tensor storage_positions(IntArrayRef sizes, IntArrayRef strides, int64_t offset) {
  Tensor pos = full({}, offset, kInt64);
  for (size_t d = 0; d < sizes.size(); ++d) {
    pos = pos.unsqueeze(-1) + arange(sizes[d], kInt64) * strides[d];
  }
  return pos.reshape({-1});
}

int64_t last_position(IntArrayRef sizes, IntArrayRef strides, int64_t offset) {
  for (size_t d = 0; d < sizes.size(); ++d) offset += (sizes[d] - 1) * strides[d];
  return offset;
}

// Whether two elements of a tensor with this geometry can share a storage position.
bool may_overlap(IntArrayRef sizes, IntArrayRef strides) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims that vary
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] > 1) dims.emplace_back(strides[d], sizes[d]);
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 1;  // positions covered by the faster dims
  for (const auto& [stride, size] : dims) {
    if (stride < span) return true;
    span = stride * size;
  }
  return false;
}

TensorVec as_strided_backward(const BackwardCall& c) {
  const Tensor& in = c.input(0);
  const Shape& sizes = c.attr<Shape>(0);
  const Shape& strides = c.attr<Shape>(1);
  const int64_t offset = c.attr<int64_t>(2);
  const Tensor& g = c.grad();
  if (in.numel() == 0 || g.numel() == 0) return {zeros(in.sizes(), g.options())};
  const Device dev = g.device();
  const int64_t lo = std::min(in.storage_offset(), offset);
  const int64_t hi = std::max(last_position(in.sizes(), in.strides(), in.storage_offset()),
                              last_position(sizes, strides, offset));
  const Tensor out_pos = (storage_positions(sizes, strides, offset) - lo).to(dev);
  const Tensor in_pos =
      (storage_positions(in.sizes(), in.strides(), in.storage_offset()) - lo).to(dev);
  const Tensor storage_grad =
      zeros({hi - lo + 1}, g.options()).index_add(0, out_pos, g.reshape({-1}));
  Tensor r = storage_grad.index_select(0, in_pos);
  if (may_overlap(in.sizes(), in.strides())) {
    const Tensor count = zeros({hi - lo + 1}, g.options())
                             .index_add(0, in_pos, ones({in.numel()}, g.options()));
    r = r / count.index_select(0, in_pos);
  }
  return {r.reshape(in.sizes())};
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
KILN_REGISTER_BACKWARD(as_strided, as_strided_backward, save_inputs({0}), false);
KILN_REGISTER_BACKWARD(slice, slice_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(select, select_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(slice_backward, slice_backward_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(select_backward, select_backward_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(to_copy, to_copy_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(copy_, copy_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(fill_, fill_backward, kSaveNone, false);

}  // namespace kiln::autograd
