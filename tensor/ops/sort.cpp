// Sorting ops: sort (values and int64 indices along a dim), topk, and argsort (sort's indices).
// NaN compares as larger than every number, as in PyTorch.
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

// inputs: self; attrs: dim, descending, stable.
SpecList sort_meta(const OpCall& c) {
  const Tensor& self = c.input(0);
  wrap_dim(c.attr<int64_t>(0), self.dim(), "sort");
  const Shape sizes = to_shape(self.sizes());
  return {{sizes, self.dtype(), self.device()}, {sizes, kInt64, self.device()}};
}

// inputs: self; attrs: k, dim, largest, sorted.
SpecList topk_meta(const OpCall& c) {
  const Tensor& self = c.input(0);
  const int64_t k = c.attr<int64_t>(0);
  const int64_t d = wrap_dim(c.attr<int64_t>(1), self.dim(), "topk");
  const int64_t size = self.dim() == 0 ? 1 : self.sizes()[d];
  KILN_CHECK(k >= 0 && k <= size, "[topk] selected index k out of range: k = ", k,
             " but dimension ", d, " of shape ", shape_str(self.sizes()), " has size ", size);
  Shape sizes = to_shape(self.sizes());
  if (self.dim() > 0) sizes[d] = k;
  return {{sizes, self.dtype(), self.device()}, {sizes, kInt64, self.device()}};
}

}  // namespace

KILN_DEFINE_OP(sort, OpKind::kFunctional, sort_meta);
KILN_DEFINE_OP(topk, OpKind::kFunctional, topk_meta);

std::tuple<Tensor, Tensor> Tensor::sort(int64_t dim, bool descending, bool stable) const {
  static const OpDef& op = KILN_OP(sort);
  TensorVec out = call_op(op, {*this}, {dim, descending, stable});
  return {out[0], out[1]};
}

Tensor Tensor::argsort(int64_t dim, bool descending, bool stable) const {
  return std::get<1>(sort(dim, descending, stable));
}

std::tuple<Tensor, Tensor> Tensor::topk(int64_t k, int64_t dim, bool largest, bool sorted) const {
  static const OpDef& op = KILN_OP(topk);
  TensorVec out = call_op(op, {*this}, {k, dim, largest, sorted});
  return {out[0], out[1]};
}

std::tuple<Tensor, Tensor> sort(const Tensor& a, int64_t dim, bool descending, bool stable) {
  return a.sort(dim, descending, stable);
}

Tensor argsort(const Tensor& a, int64_t dim, bool descending, bool stable) {
  return a.argsort(dim, descending, stable);
}

std::tuple<Tensor, Tensor> topk(const Tensor& a, int64_t k, int64_t dim, bool largest,
                                bool sorted) {
  return a.topk(k, dim, largest, sorted);
}

}  // namespace kiln
