// Backward rules of indexing, joining and sorting (tensor/ops/index.cpp, join.cpp, sort.cpp).
// Reads route the gradient back to the positions they read (scatter/index_add/index_put with
// accumulation); writes route it to what they wrote from.
#include "autograd/backward_util.h"
#include "autograd/grad_mode.h"
#include "kernels/cuda/runtime.h"
#include "tensor/indexing.h"

namespace kiln::autograd {
namespace {

using internal::sum_to;

Tensor zeros_of_input(const BackwardCall& c, size_t i) {
  return zeros(c.input(i).sizes(), c.grad().options());
}

// index: inputs (self, indices...), attr 0 the indexed dims.
TensorVec index_backward(const BackwardCall& c) {
  static const OpDef& put = KILN_OP(index_put_);
  TensorVec in{zeros_of_input(c, 0), c.grad()};
  for (size_t i = 1; i < c.forward.inputs.size(); ++i) in.push_back(c.input(i));
  TensorVec g(c.forward.inputs.size());
  g[0] = call_op1(put, std::move(in), {c.attr<Shape>(0), true});
  return g;
}

// index_put_: inputs (self, value, indices...), attrs (dims, accumulate).
TensorVec index_put_backward(const BackwardCall& c) {
  static const OpDef& index = KILN_OP(index);
  static const OpDef& put = KILN_OP(index_put_);
  TensorVec idx(c.forward.inputs.begin() + 2, c.forward.inputs.end());
  TensorVec g(c.forward.inputs.size());
  if (c.needs_grad(0)) {
    if (c.attr<bool>(1)) {
      g[0] = c.grad();
    } else {
      TensorVec in{c.grad().clone(), zeros({}, c.grad().options())};
      in.insert(in.end(), idx.begin(), idx.end());
      g[0] = call_op1(put, std::move(in), {c.attr<Shape>(0), false});
    }
  }
  if (c.needs_grad(1)) {
    TensorVec in{c.grad()};
    in.insert(in.end(), idx.begin(), idx.end());
    g[1] = sum_to(call_op1(index, std::move(in), {c.attr<Shape>(0)}), c.input(1).sizes());
  }
  return g;
}

TensorVec index_select_backward(const BackwardCall& c) {
  const int64_t dim = c.attr<int64_t>(0);
  return {zeros_of_input(c, 0).index_add(dim, c.input(1), c.grad()), Tensor()};
}

TensorVec gather_backward(const BackwardCall& c) {
  const int64_t dim = c.attr<int64_t>(0);
  return {zeros_of_input(c, 0).scatter_add(dim, c.input(1), c.grad()), Tensor()};
}

// The gradient of scatter's src: what each src element was written to. src may be larger than
// the index (only its leading block is read): the rest of src gets zeros, placed through the
// differentiable slice_backward op.
Tensor scattered_src_grad(const BackwardCall& c, int64_t dim) {
  static const OpDef& pad = KILN_OP(slice_backward);
  const Tensor& index = c.input(1);
  const Tensor& src = c.input(2);
  Tensor g = c.grad().gather(dim, index);
  if (g.dim() == 0 || src.dim() == 0 || g.sizes() == src.sizes()) return g.reshape(src.sizes());
  for (int64_t d = 0; d < g.dim(); ++d) {
    if (g.sizes()[d] == src.sizes()[d]) continue;
    Shape padded = to_shape(g.sizes());
    padded[d] = src.sizes()[d];
    g = call_op1(pad, {g}, {padded, d, int64_t{0}, g.sizes()[d], int64_t{1}});
  }
  return g;
}

// scatter(_): inputs (self, index, src).
TensorVec scatter_backward(const BackwardCall& c) {
  const int64_t dim = c.attr<int64_t>(0);
  TensorVec g(3);
  if (c.needs_grad(0)) g[0] = c.grad().scatter(dim, c.input(1), 0.0);
  if (c.needs_grad(2)) g[2] = scattered_src_grad(c, dim);
  return g;
}

// scatter_value(_): inputs (self, index), attrs (dim, value).
TensorVec scatter_value_backward(const BackwardCall& c) {
  return {c.grad().scatter(c.attr<int64_t>(0), c.input(1), 0.0), Tensor()};
}

TensorVec scatter_add_backward(const BackwardCall& c) {
  TensorVec g(3);
  if (c.needs_grad(0)) g[0] = c.grad();
  if (c.needs_grad(2)) g[2] = scattered_src_grad(c, c.attr<int64_t>(0));
  return g;
}

// index_add(_): inputs (self, index, source), attrs (dim, alpha).
TensorVec index_add_backward(const BackwardCall& c) {
  TensorVec g(3);
  if (c.needs_grad(0)) g[0] = c.grad();
  if (c.needs_grad(2)) {
    const int64_t dim = c.attr<int64_t>(0);
    Tensor picked = c.input(2).dim() == 0 ? c.grad().index_select(0, c.input(1)).reshape({})
                                          : c.grad().index_select(dim, c.input(1));
    g[2] = picked * c.attr<Scalar>(1);
  }
  return g;
}

// The rows summed into a fresh zero table in place: the functional index_add would copy the
// whole table first (llama-3.2-1b's: 525 MB a step). With create_graph the functional form keeps
// the result differentiable without an in-place op in the graph.
TensorVec embedding_backward(const BackwardCall& c) {
  const Tensor& weight = c.input(0);
  const int64_t d = weight.sizes().back();
  Tensor rows = c.grad().reshape({-1, d});
  Tensor table = zeros_of_input(c, 0);
  const Tensor index = c.input(1).reshape({-1});
  // The forward checked these ids: no wait for the device here, at the end of the backward.
  cuda::internal::TrustedIndicesScope trusted;
  if (GradMode::is_enabled()) return {table.index_add(0, index, rows), Tensor()};
  table.index_add_(0, index, rows);
  return {table, Tensor()};
}

// The output has the broadcast shape of self and mask: a broadcast self sums its gradient back.
TensorVec masked_fill_backward(const BackwardCall& c) {
  return {sum_to(c.grad().masked_fill(c.input(1), 0.0), c.input(0).sizes()), Tensor()};
}

// masked_select: the output holds the selected elements of self broadcast with mask.
TensorVec masked_select_backward(const BackwardCall& c) {
  const Shape shape = broadcast_shapes(c.input(0).sizes(), c.input(1).sizes(), "masked_select");
  Tensor full_grad = zeros(shape, c.grad().options());
  full_grad.index_put_({indexing::TensorIndex(c.input(1).expand(shape))}, c.grad());
  return {sum_to(full_grad, c.input(0).sizes()), Tensor()};
}

TensorVec triu_backward(const BackwardCall& c) { return {c.grad().triu(c.attr<int64_t>(0))}; }
TensorVec tril_backward(const BackwardCall& c) { return {c.grad().tril(c.attr<int64_t>(0))}; }

// cat: each input gets its slice of the gradient (skipped legacy [0] inputs get nothing).
TensorVec cat_backward(const BackwardCall& c) {
  const Tensor& g = c.grad();
  const int64_t dim = wrap_dim(c.attr<int64_t>(0), g.dim(), "cat");
  TensorVec out(c.forward.inputs.size());
  int64_t start = 0;
  for (size_t i = 0; i < c.forward.inputs.size(); ++i) {
    const Tensor& in = c.input(i);
    if (in.dim() == 1 && in.numel() == 0 && g.dim() != 1) continue;
    const int64_t n = in.sizes()[dim];
    if (c.needs_grad(i)) out[i] = g.narrow(dim, start, n);
    start += n;
  }
  return out;
}

// split_with_sizes_copy: the slices' gradients (zeros where one got none) joined by one cat.
TensorVec split_copy_backward(const BackwardCall& c) {
  if (!c.needs_grad(0)) return internal::no_grads(1);
  const int64_t dim = wrap_dim(c.attr<int64_t>(1), c.input(0).dim(), "split_with_sizes_copy");
  return {cat(c.grads(), dim)};
}

// sort/topk: outputs (values, indices); the value gradient goes back to where each came from.
TensorVec sort_backward(const BackwardCall& c, int64_t dim) {
  if (c.input(0).dim() == 0) return {c.grad(0)};
  return {zeros_of_input(c, 0).scatter(dim, c.output(1), c.grad(0))};
}
TensorVec sort_rule(const BackwardCall& c) { return sort_backward(c, c.attr<int64_t>(0)); }
TensorVec topk_rule(const BackwardCall& c) { return sort_backward(c, c.attr<int64_t>(1)); }

}  // namespace

constexpr uint32_t kIndexArgs = ~1u;  // everything but self
KILN_REGISTER_BACKWARD(index, index_backward, kIndexArgs, false);
KILN_REGISTER_BACKWARD(index_put_, index_put_backward, ~3u, false);
KILN_REGISTER_BACKWARD(index_select, index_select_backward, save_inputs({1}), false);
KILN_REGISTER_BACKWARD(gather, gather_backward, save_inputs({1}), false);
KILN_REGISTER_BACKWARD(scatter, scatter_backward, save_inputs({1}), false);
KILN_REGISTER_BACKWARD(scatter_, scatter_backward, save_inputs({1}), false);
KILN_REGISTER_BACKWARD(scatter_value, scatter_value_backward, save_inputs({1}), false);
KILN_REGISTER_BACKWARD(scatter_value_, scatter_value_backward, save_inputs({1}), false);
KILN_REGISTER_BACKWARD(scatter_add, scatter_add_backward, save_inputs({1}), false);
KILN_REGISTER_BACKWARD(scatter_add_, scatter_add_backward, save_inputs({1}), false);
KILN_REGISTER_BACKWARD(index_add, index_add_backward, save_inputs({1}), false);
KILN_REGISTER_BACKWARD(index_add_, index_add_backward, save_inputs({1}), false);
KILN_REGISTER_BACKWARD(embedding, embedding_backward, save_inputs({1}), false);
KILN_REGISTER_BACKWARD(masked_fill, masked_fill_backward, save_inputs({1}), false);
KILN_REGISTER_BACKWARD(masked_fill_, masked_fill_backward, save_inputs({1}), false);
KILN_REGISTER_BACKWARD(masked_select, masked_select_backward, save_inputs({1}), false);
KILN_REGISTER_BACKWARD(triu, triu_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(tril, tril_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(cat, cat_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(split_with_sizes_copy, split_copy_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(sort, sort_rule, kSaveNone, true);
KILN_REGISTER_BACKWARD(topk, topk_rule, kSaveNone, true);

}  // namespace kiln::autograd
