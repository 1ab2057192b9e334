// Backward rules of reductions, cumsum and softmax (tensor/ops/reduce.cpp, softmax.cpp).
// A reduction's gradient is the output gradient broadcast back over the reduced dims
// (`unreduce`), then weighted per op.
#include <cmath>

#include "autograd/backward_util.h"

namespace kiln::autograd {
namespace {

// The reduced dims of a call whose attr 0 is a dims list (empty = all).
Shape reduced_dims(const BackwardCall& c) {
  return reduction_dims(c.attr<Shape>(0), c.input(0).dim(), c.forward.name().c_str());
}

// `t` (shaped like the reduction's output) viewed with the reduced dims restored as size 1.
Tensor keepdim_view(const Tensor& t, IntArrayRef dims, bool keepdim) {
  if (keepdim) return t;
  Tensor r = t;
  for (int64_t d : dims) r = r.unsqueeze(d);  // dims ascending: each lands at its place
  return r;
}

Tensor unreduce(const Tensor& t, const BackwardCall& c, IntArrayRef dims, bool keepdim) {
  return keepdim_view(t, dims, keepdim).expand(c.input(0).sizes());
}

int64_t count_of(const BackwardCall& c, IntArrayRef dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= c.input(0).sizes()[d];
  return n;
}

TensorVec sum_backward(const BackwardCall& c) {
  return {unreduce(c.grad(), c, reduced_dims(c), c.attr<bool>(1))};
}

TensorVec mean_backward(const BackwardCall& c) {
  const Shape dims = reduced_dims(c);
  return {unreduce(c.grad(), c, dims, c.attr<bool>(1)) /
          static_cast<double>(count_of(c, dims))};
}

TensorVec prod_backward(const BackwardCall& c) {
  const Shape dims = reduced_dims(c);
  const bool keepdim = c.attr<bool>(1);
  const Tensor& x = c.input(0);
  const Tensor g = unreduce(c.grad(), c, dims, keepdim);
  const Tensor out = unreduce(c.output(0), c, dims, keepdim);
  // Elements that are not zero: d/dx_i prod = prod / x_i. A zero element gets the product of
  // the others when it is the only zero of its slice, and 0 otherwise.
  const Tensor nonzero = x != 0;
  const Tensor safe_x = where(nonzero, x, ones_like(x));
  static const OpDef& prod_op = KILN_OP(prod);
  const Tensor others = call_op1(prod_op, {safe_x}, {dims, true, std::monostate{}});
  const Tensor zero_count = (~nonzero).sum(dims, /*keepdim=*/true);
  const Tensor zero_grad = where(zero_count == 1, g * others.expand(x.sizes()), zeros_like(g));
  return {where(nonzero, g * out / safe_x, zero_grad)};
}

// amax/amin/max/min: the gradient is shared equally among the elements equal to the result.
TensorVec extremum_backward(const BackwardCall& c) {
  const Shape dims = reduced_dims(c);
  const bool keepdim = c.attr<bool>(1);
  const Tensor mask = (c.input(0) == unreduce(c.output(0), c, dims, keepdim)).to(c.grad().dtype());
  const Tensor count = mask.sum(dims, /*keepdim=*/true);
  return {unreduce(c.grad(), c, dims, keepdim) * mask / count};
}

// max_dim/min_dim/sort/topk: the gradient goes to the positions the indices name.
Tensor scatter_to_input(const BackwardCall& c, int64_t dim, const Tensor& values_grad,
                        const Tensor& indices) {
  return zeros(c.input(0).sizes(), values_grad.options()).scatter(dim, indices, values_grad);
}

TensorVec max_dim_backward(const BackwardCall& c) {
  const int64_t dim = wrap_dim(c.attr<int64_t>(0), c.input(0).dim(), "max");
  const bool keepdim = c.attr<bool>(1);
  if (c.input(0).dim() == 0) return {c.grad()};
  const Tensor g = keepdim ? c.grad() : c.grad().unsqueeze(dim);
  const Tensor idx = keepdim ? c.output(1) : c.output(1).unsqueeze(dim);
  return {scatter_to_input(c, dim, g, idx)};
}

// var and std: attrs (dims, correction, keepdim). d var / dx = 2 (x - mean) / (N - correction);
// d std / dx = d var / dx / (2 std).
TensorVec spread_backward(const BackwardCall& c, bool is_std) {
  const Shape dims = reduced_dims(c);
  const int64_t correction = c.attr<int64_t>(1);
  const bool keepdim = c.attr<bool>(2);
  const Tensor& x = c.input(0);
  const double denom = static_cast<double>(count_of(c, dims) - correction);
  const Tensor centered = x - x.mean(dims, /*keepdim=*/true);
  // A slice with zero std gets a zero gradient rather than 0/0 (PyTorch masks it the same way).
  const Tensor g = is_std ? where(c.output(0) == 0, zeros_like(c.grad()), c.grad() / c.output(0))
                          : c.grad() * 2.0;
  return {unreduce(g, c, dims, keepdim) * centered / denom};
}
TensorVec var_backward(const BackwardCall& c) { return spread_backward(c, false); }
TensorVec std_backward(const BackwardCall& c) { return spread_backward(c, true); }

TensorVec norm_backward(const BackwardCall& c) {
  const double p = c.attr<Scalar>(0).toDouble();
  const Shape dims = reduction_dims(c.attr<Shape>(1), c.input(0).dim(), "norm");
  const bool keepdim = c.attr<bool>(2);
  const Tensor& x = c.input(0);
  const Tensor g = unreduce(c.grad(), c, dims, keepdim);
  const Tensor out = unreduce(c.output(0), c, dims, keepdim);
  if (p == 0.0) return {zeros_like(g)};
  if (p == 1.0) return {g * x.sign()};
  if (std::isinf(p)) {
    const Tensor mask = (x.abs() == out).to(g.dtype());
    return {g * x.sign() * mask / mask.sum(dims, /*keepdim=*/true)};
  }
  // d||x||_p / dx = x |x|^(p-2) / ||x||^(p-1); zero where the norm is zero.
  const Tensor safe_out = where(out == 0, ones_like(out), out);
  const Tensor scale = p == 2.0 ? x / safe_out : x * x.abs().pow(p - 2) / safe_out.pow(p - 1);
  return {where(out == 0, zeros_like(g), g * scale)};
}

TensorVec logsumexp_backward(const BackwardCall& c) {
  const Shape dims = reduced_dims(c);
  const bool keepdim = c.attr<bool>(1);
  return {unreduce(c.grad(), c, dims, keepdim) *
          (c.input(0) - unreduce(c.output(0), c, dims, keepdim)).exp()};
}

TensorVec cumsum_backward(const BackwardCall& c) {
  // d/dx_i sum_{j>=i} ... : the reversed cumulative sum of g = total - prefix + g.
  const int64_t dim = c.attr<int64_t>(0);
  const Tensor& g = c.grad();
  if (g.dim() == 0) return {g};
  return {g.sum(dim, /*keepdim=*/true) - g.cumsum(dim) + g};
}

TensorVec softmax_backward(const BackwardCall& c) {
  const int64_t dim = c.attr<int64_t>(0);
  const Tensor& y = c.output(0);
  return {y * (c.grad() - (c.grad() * y).sum(dim, /*keepdim=*/true))};
}

TensorVec log_softmax_backward(const BackwardCall& c) {
  const int64_t dim = c.attr<int64_t>(0);
  return {c.grad() - c.output(0).exp() * c.grad().sum(dim, /*keepdim=*/true)};
}

}  // namespace

constexpr uint32_t kX = save_inputs({0});
KILN_REGISTER_BACKWARD(sum, sum_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(mean, mean_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(prod, prod_backward, kX, true);
KILN_REGISTER_BACKWARD(amax, extremum_backward, kX, true);
KILN_REGISTER_BACKWARD(amin, extremum_backward, kX, true);
KILN_REGISTER_BACKWARD(max, extremum_backward, kX, true);
KILN_REGISTER_BACKWARD(min, extremum_backward, kX, true);
KILN_REGISTER_BACKWARD(max_dim, max_dim_backward, kSaveNone, true);
KILN_REGISTER_BACKWARD(min_dim, max_dim_backward, kSaveNone, true);
KILN_REGISTER_BACKWARD(var, var_backward, kX, false);
KILN_REGISTER_BACKWARD(std, std_backward, kX, true);
KILN_REGISTER_BACKWARD(norm, norm_backward, kX, true);
KILN_REGISTER_BACKWARD(logsumexp, logsumexp_backward, kX, true);
KILN_REGISTER_BACKWARD(cumsum, cumsum_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(softmax, softmax_backward, kSaveNone, true);
KILN_REGISTER_BACKWARD(log_softmax, log_softmax_backward, kSaveNone, true);

}  // namespace kiln::autograd
