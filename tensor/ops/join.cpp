// Joining ops: cat (a registry op) and stack (unsqueeze each input, then cat); and their inverse
// as copies, split_with_sizes_copy, whose gradient is one cat.
#include "autograd/grad_mode.h"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

// PyTorch keeps accepting 1-D empty tensors in cat whatever the other shapes (a legacy of
// tensors created empty before being resized); they are skipped except for type promotion.
bool is_legacy_empty(const Tensor& t) { return t.dim() == 1 && t.sizes()[0] == 0; }

// inputs: the tensors; attr 0: dim. The result dtype promotes across all inputs.
SpecList cat_meta(const OpCall& c) {
  KILN_CHECK(!c.inputs.empty(), "[cat] expected a non-empty list of tensors");
  ScalarType dtype = c.input(0).dtype();
  const Tensor* ref = nullptr;
  size_t ref_pos = 0;
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    const Tensor& t = c.input(i);
    KILN_CHECK(t.dim() > 0, "[cat] zero-dimensional tensor (at position ", i,
               ") cannot be concatenated");
    dtype = promote_types(dtype, t.dtype());
    if (ref == nullptr && !is_legacy_empty(t)) {
      ref = &t;
      ref_pos = i;
    }
  }
  if (ref == nullptr) return {{Shape{0}, dtype, c.input(0).device()}};
  const int64_t d = wrap_dim(c.attr<int64_t>(0), ref->dim(), "cat");
  Shape out = to_shape(ref->sizes());
  out[d] = 0;
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    const Tensor& t = c.input(i);
    if (is_legacy_empty(t)) continue;
    KILN_CHECK(t.dim() == ref->dim(),
               "[cat] tensors must have the same number of dimensions: ", "got shapes ",
               shape_str(ref->sizes()), " (tensor ", ref_pos, ") and ", shape_str(t.sizes()),
               " (tensor ", i, ")");
    for (int64_t k = 0; k < t.dim(); ++k) {
      KILN_CHECK(k == d || t.sizes()[k] == ref->sizes()[k], "[cat] shapes ",
                 shape_str(ref->sizes()), " (tensor ", ref_pos, ") and ", shape_str(t.sizes()),
                 " (tensor ", i, ") must match except in dimension ", d, " (they differ in ",
                 "dimension ", k, ")");
    }
    out[d] += t.sizes()[d];
  }
  return {{out, dtype, ref->device()}};
}

// split_with_sizes_copy(x; sizes, dim): x's consecutive slices of `sizes` along dim, each a
// fresh contiguous tensor.
SpecList split_copy_meta(const OpCall& c) {
  const Tensor& x = c.input(0);
  KILN_CHECK(x.dim() > 0, "[split_with_sizes_copy] cannot split a 0-d tensor");
  const Shape& sizes = c.attr<Shape>(0);
  const int64_t d = wrap_dim(c.attr<int64_t>(1), x.dim(), "split_with_sizes_copy");
  int64_t total = 0;
  for (int64_t s : sizes) {
    KILN_CHECK(s >= 0, "[split_with_sizes_copy] negative size in ", shape_str(sizes));
    total += s;
  }
  KILN_CHECK(total == x.size(d), "[split_with_sizes_copy] sizes ", shape_str(sizes), " sum to ",
             total, " but dimension ", d, " of ", shape_str(x.sizes()), " has size ", x.size(d));
  SpecList out;
  for (int64_t s : sizes) {
    Shape shape = to_shape(x.sizes());
    shape[static_cast<size_t>(d)] = s;
    out.push_back({shape, x.dtype(), x.device()});
  }
  return out;
}

// One copy_ per slice (copy_ runs on the tensors' device): the kernel of every device.
void split_copy_kernel(OpCall& c) {
  NoGradGuard no_grad;
  const int64_t d = wrap_dim(c.attr<int64_t>(1), c.input(0).dim(), "split_with_sizes_copy");
  int64_t start = 0;
  for (Tensor& out : c.outputs) {
    const int64_t n = out.size(d);
    out.copy_(c.input(0).narrow(d, start, n));
    start += n;
  }
}

}  // namespace

KILN_DEFINE_OP(cat, OpKind::kFunctional, cat_meta);
// Attributes: 0 sizes (Shape), 1 dim (int64). Its backward is one cat of the slices' gradients,
// where narrow views each give back a zero-filled gradient of the whole input to add up.
KILN_DEFINE_OP(split_with_sizes_copy, OpKind::kFunctional, split_copy_meta);
KILN_REGISTER_KERNEL(split_with_sizes_copy, kCPU, split_copy_kernel);
KILN_REGISTER_KERNEL(split_with_sizes_copy, kCUDA, split_copy_kernel);

std::vector<Tensor> split_with_sizes_copy(const Tensor& x, IntArrayRef sizes, int64_t dim) {
  static const OpDef& op = KILN_OP(split_with_sizes_copy);
  const TensorVec out = call_op(op, {x}, {to_shape(sizes), dim});
  return std::vector<Tensor>(out.begin(), out.end());
}

Tensor cat(TensorList tensors, int64_t dim) {
  static const OpDef& op = KILN_OP(cat);
  return call_op1(op, TensorVec(tensors.begin(), tensors.end()), {dim});
}

Tensor stack(TensorList tensors, int64_t dim) {
  KILN_CHECK(!tensors.empty(), "[stack] expects a non-empty list of tensors");
  for (size_t i = 1; i < tensors.size(); ++i) {
    KILN_CHECK(tensors[i].sizes() == tensors[0].sizes(),
               "[stack] expects each tensor to be equal size, but got ",
               shape_str(tensors[0].sizes()), " at entry 0 and ", shape_str(tensors[i].sizes()),
               " at entry ", i);
  }
  const int64_t d = wrap_dim(dim, tensors[0].dim() + 1, "stack");
  std::vector<Tensor> parts;
  parts.reserve(tensors.size());
  for (const Tensor& t : tensors) parts.push_back(t.unsqueeze(d));
  return cat(parts, d);
}

}  // namespace kiln
