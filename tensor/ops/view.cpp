// View ops: new sizes/strides/offset over the same storage. Each primitive view is one
// registry op (so autograd and the tracer see it); reshape, flatten, split and friends are
// compositions of them.
#include <algorithm>
#include <numeric>

#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

struct Geometry {
  Shape sizes;
  Shape strides;
  int64_t offset;
};

Tensor make_view(const Tensor& base, Geometry g) {
  return Tensor(std::make_shared<TensorImpl>(base.impl()->storage(), std::move(g.sizes),
                                             std::move(g.strides), g.offset, base.dtype()));
}

// The strides that let `base` be viewed with `sizes`, if any (PyTorch's computeStride): each
// run of input dims that is contiguous with itself may be split or merged.
std::optional<Shape> view_strides(IntArrayRef old_sizes, IntArrayRef old_strides,
                                  IntArrayRef sizes) {
  Shape strides(sizes.size(), 1);
  if (old_sizes.empty()) return strides;
  if (numel_of(old_sizes) == 0) return contiguous_strides(sizes);
  int64_t view_d = static_cast<int64_t>(sizes.size()) - 1;
  int64_t chunk_base_stride = old_strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = static_cast<int64_t>(old_sizes.size()) - 1; d >= 0; --d) {
    tensor_numel *= old_sizes[d];
    if (d == 0 || (old_sizes[d - 1] != 1 && old_strides[d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || sizes[view_d] == 1)) {
        strides[view_d] = view_numel * chunk_base_stride;
        view_numel *= sizes[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (d > 0) {
        chunk_base_stride = old_strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return strides;
}

Geometry view_geometry(const OpCall& c) {
  const Tensor& t = c.input(0);
  Shape sizes = infer_size(c.attr<Shape>(0), t.numel(), "view");
  auto strides = view_strides(t.sizes(), t.strides(), sizes);
  KILN_CHECK(strides.has_value(), "[view] size ", shape_str(sizes),
             " is not compatible with the input's size ", shape_str(t.sizes()), " and stride ",
             shape_str(t.strides()),
             " (at least one dimension spans across two contiguous subspaces); use .reshape(...)");
  return {std::move(sizes), std::move(*strides), t.storage_offset()};
}

Geometry permute_geometry(const OpCall& c) {
  const Tensor& t = c.input(0);
  const Shape& dims = c.attr<Shape>(0);
  KILN_CHECK(static_cast<int64_t>(dims.size()) == t.dim(), "[permute] number of dims ",
             shape_str(dims), " does not match the tensor's ", t.dim(), " dims");
  Geometry g{Shape(t.dim()), Shape(t.dim()), t.storage_offset()};
  std::vector<bool> seen(t.dim(), false);
  for (int64_t i = 0; i < t.dim(); ++i) {
    const int64_t d = wrap_dim(dims[i], t.dim(), "permute");
    KILN_CHECK(!seen[d], "[permute] repeated dim ", d, " in ", shape_str(dims));
    seen[d] = true;
    g.sizes[i] = t.sizes()[d];
    g.strides[i] = t.strides()[d];
  }
  return g;
}

Geometry expand_geometry(const OpCall& c) {
  const Tensor& t = c.input(0);
  const Shape& sizes = c.attr<Shape>(0);
  const int64_t n = static_cast<int64_t>(sizes.size());
  KILN_CHECK(n >= t.dim(), "[expand] the number of sizes provided (", n,
             ") must be greater or equal to the number of dimensions in the tensor (", t.dim(),
             ")");
  Geometry g{Shape(n), Shape(n), t.storage_offset()};
  for (int64_t i = n - 1; i >= 0; --i) {
    const int64_t td = i - (n - t.dim());
    if (td < 0) {
      KILN_CHECK(sizes[i] >= 0, "[expand] -1 is not allowed for a new leading dim, got ",
                 shape_str(sizes));
      g.sizes[i] = sizes[i];
      g.strides[i] = 0;
      continue;
    }
    const int64_t s = t.sizes()[td];
    const int64_t want = sizes[i] == -1 ? s : sizes[i];
    KILN_CHECK(s == want || s == 1, "[expand] the expanded size of the tensor (", want,
               ") must match the existing size (", s, ") at non-singleton dimension ", i,
               ". Target sizes: ", shape_str(sizes), ". Tensor sizes: ", shape_str(t.sizes()));
    g.sizes[i] = want;
    g.strides[i] = s == want ? t.strides()[td] : 0;
  }
  return g;
}

Geometry squeeze_geometry(const OpCall& c) {
  const Tensor& t = c.input(0);
  const Shape dims = reduction_dims(c.attr<Shape>(0), t.dim(), "squeeze");
  Geometry g{{}, {}, t.storage_offset()};
  for (int64_t d = 0; d < t.dim(); ++d) {
    const bool listed = std::find(dims.begin(), dims.end(), d) != dims.end();
    if (listed && t.sizes()[d] == 1) continue;
    g.sizes.push_back(t.sizes()[d]);
    g.strides.push_back(t.strides()[d]);
  }
  return g;
}

Geometry unsqueeze_geometry(const OpCall& c) {
  const Tensor& t = c.input(0);
  const int64_t d = wrap_dim(c.attr<int64_t>(0), t.dim() + 1, "unsqueeze");
  Geometry g{to_shape(t.sizes()), to_shape(t.strides()), t.storage_offset()};
  const int64_t stride = d < t.dim() ? t.sizes()[d] * t.strides()[d] : 1;
  g.sizes.insert(g.sizes.begin() + d, 1);
  g.strides.insert(g.strides.begin() + d, stride);
  return g;
}

// slice(dim, start, end, step): attrs dim, start, end (already clamped by the wrapper? no: here).
Geometry slice_geometry(const OpCall& c) {
  const Tensor& t = c.input(0);
  KILN_CHECK(t.dim() > 0, "[slice] cannot slice a 0-d tensor");
  const int64_t d = wrap_dim(c.attr<int64_t>(0), t.dim(), "slice");
  const int64_t size = t.sizes()[d];
  int64_t start = c.attr<int64_t>(1), end = c.attr<int64_t>(2);
  const int64_t step = c.attr<int64_t>(3);
  KILN_CHECK(step > 0, "[slice] step must be positive, got ", step);
  if (start < 0) start += size;
  if (end < 0) end += size;
  start = std::clamp<int64_t>(start, 0, size);
  end = std::clamp<int64_t>(end, start, size);
  Geometry g{to_shape(t.sizes()), to_shape(t.strides()),
             t.storage_offset() + start * t.strides()[d]};
  g.sizes[d] = (end - start + step - 1) / step;
  g.strides[d] = t.strides()[d] * step;
  return g;
}

Geometry select_geometry(const OpCall& c) {
  const Tensor& t = c.input(0);
  KILN_CHECK(t.dim() > 0, "[select] cannot select from a 0-d tensor");
  const int64_t d = wrap_dim(c.attr<int64_t>(0), t.dim(), "select");
  int64_t index = c.attr<int64_t>(1);
  const int64_t size = t.sizes()[d];
  KILN_CHECK(index >= -size && index < size, "[select] index ", index,
             " is out of bounds for dimension ", d, " with size ", size, " (shape ",
             shape_str(t.sizes()), ")");
  if (index < 0) index += size;
  Geometry g{to_shape(t.sizes()), to_shape(t.strides()), t.storage_offset() + index * t.strides()[d]};
  g.sizes.erase(g.sizes.begin() + d);
  g.strides.erase(g.strides.begin() + d);
  return g;
}

Geometry as_strided_geometry(const OpCall& c) {
  const Tensor& t = c.input(0);
  const Shape& sizes = c.attr<Shape>(0);
  const Shape& strides = c.attr<Shape>(1);
  const int64_t offset = c.attr<int64_t>(2);
  KILN_CHECK(sizes.size() == strides.size(), "[as_strided] sizes ", shape_str(sizes),
             " and strides ", shape_str(strides), " have different lengths");
  KILN_CHECK(offset >= 0, "[as_strided] negative storage offset ", offset);
  const int64_t extent = layout_extent(sizes, strides, "as_strided");
  int64_t max_index = -1;  // the last element read; -1 when none is
  KILN_CHECK(extent == 0 || !__builtin_add_overflow(offset, extent - 1, &max_index),
             "[as_strided] offset ", offset, " plus the extent of ", shape_str(sizes),
             " overflows an int64");
  const int64_t capacity =
      static_cast<int64_t>(t.impl()->storage()->nbytes() / t.element_size());
  KILN_CHECK(max_index < capacity, "[as_strided] size ", shape_str(sizes), " with stride ",
             shape_str(strides), " and offset ", offset, " reads element ", max_index,
             " of a storage holding ", capacity, " elements");
  return {sizes, strides, offset};
}

Geometry alias_geometry(const OpCall& c) {
  const Tensor& t = c.input(0);
  return {to_shape(t.sizes()), to_shape(t.strides()), t.storage_offset()};
}

template <Geometry (*G)(const OpCall&)>
SpecList view_meta(const OpCall& c) {
  return {{G(c).sizes, c.input(0).dtype(), c.input(0).device()}};
}

template <Geometry (*G)(const OpCall&)>
void view_kernel(OpCall& c) {
  c.outputs.assign({make_view(c.input(0), G(c))});
}

// The gradients of slice and select: zeros of the input's shape (attr 0) with the gradient
// written where the view was. Functional ops of their own so that they can be differentiated.
SpecList scatter_back_meta(const OpCall& c) {
  return {{c.attr<Shape>(0), c.input(0).dtype(), c.input(0).device()}};
}
KILN_DEFINE_OP(slice_backward, OpKind::kFunctional, scatter_back_meta);
KILN_DEFINE_OP(select_backward, OpKind::kFunctional, scatter_back_meta);

#define KILN_VIEW_OP(name)                                                  \
  KILN_DEFINE_OP(name, OpKind::kView, view_meta<name##_geometry>);          \
  KILN_REGISTER_KERNEL(name, kCPU, view_kernel<name##_geometry>)

KILN_VIEW_OP(view);
KILN_VIEW_OP(permute);
KILN_VIEW_OP(expand);
KILN_VIEW_OP(squeeze);
KILN_VIEW_OP(unsqueeze);
KILN_VIEW_OP(slice);
KILN_VIEW_OP(select);
KILN_VIEW_OP(as_strided);
KILN_VIEW_OP(alias);

}  // namespace

Tensor Tensor::view(IntArrayRef sizes) const {
  static const OpDef& op = KILN_OP(view);
  return call_op1(op, {*this}, {to_shape(sizes)});
}

Tensor Tensor::reshape(IntArrayRef sizes) const {
  const Shape s = infer_size(sizes, numel(), "reshape");
  if (view_strides(this->sizes(), strides(), s)) return view(s);
  return contiguous().view(s);
}

Tensor Tensor::permute(IntArrayRef dims) const {
  static const OpDef& op = KILN_OP(permute);
  return call_op1(op, {*this}, {to_shape(dims)});
}

Tensor Tensor::transpose(int64_t dim0, int64_t dim1) const {
  const int64_t n = dim();
  if (n == 0) {
    wrap_dim(dim0, n, "transpose");
    wrap_dim(dim1, n, "transpose");
    return alias();
  }
  const int64_t a = wrap_dim(dim0, n, "transpose"), b = wrap_dim(dim1, n, "transpose");
  Shape dims(n);
  std::iota(dims.begin(), dims.end(), 0);
  std::swap(dims[a], dims[b]);
  return permute(dims);
}

Tensor Tensor::t() const {
  KILN_CHECK(dim() <= 2, "[t] expects a tensor with <= 2 dimensions, but got ", dim(),
             "-D of shape ", shape_str(sizes()));
  return dim() < 2 ? alias() : transpose(0, 1);
}

Tensor Tensor::expand(IntArrayRef sizes) const {
  static const OpDef& op = KILN_OP(expand);
  return call_op1(op, {*this}, {to_shape(sizes)});
}

Tensor Tensor::squeeze() const {
  static const OpDef& op = KILN_OP(squeeze);
  return call_op1(op, {*this}, {Shape{}});
}

Tensor Tensor::squeeze(int64_t d) const {
  static const OpDef& op = KILN_OP(squeeze);
  return call_op1(op, {*this}, {Shape{d}});
}

Tensor Tensor::unsqueeze(int64_t d) const {
  static const OpDef& op = KILN_OP(unsqueeze);
  return call_op1(op, {*this}, {d});
}

Tensor Tensor::flatten(int64_t start_dim, int64_t end_dim) const {
  if (dim() == 0) return reshape({1});
  const int64_t s = wrap_dim(start_dim, dim(), "flatten"), e = wrap_dim(end_dim, dim(), "flatten");
  KILN_CHECK(s <= e, "[flatten] start_dim ", start_dim, " comes after end_dim ", end_dim);
  Shape sizes(this->sizes().begin(), this->sizes().begin() + s);
  int64_t merged = 1;
  for (int64_t d = s; d <= e; ++d) merged *= this->sizes()[d];
  sizes.push_back(merged);
  sizes.insert(sizes.end(), this->sizes().begin() + e + 1, this->sizes().end());
  return reshape(sizes);
}

Tensor Tensor::unflatten(int64_t d, IntArrayRef sizes) const {
  const int64_t w = wrap_dim(d, dim(), "unflatten");
  const Shape inner = infer_size(sizes, this->sizes()[w], "unflatten");
  Shape out(this->sizes().begin(), this->sizes().begin() + w);
  out.insert(out.end(), inner.begin(), inner.end());
  out.insert(out.end(), this->sizes().begin() + w + 1, this->sizes().end());
  return view(out);
}

Tensor Tensor::slice(int64_t d, std::optional<int64_t> start, std::optional<int64_t> end,
                     int64_t step) const {
  static const OpDef& op = KILN_OP(slice);
  return call_op1(op, {*this},
                  {d, start.value_or(0), end.value_or(std::numeric_limits<int64_t>::max()), step});
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  KILN_CHECK(dim() > 0, "[narrow] cannot narrow a 0-d tensor");
  const int64_t w = wrap_dim(d, dim(), "narrow");
  const int64_t size = sizes()[w];
  KILN_CHECK(start >= -size && start <= size, "[narrow] start ", start,
             " is out of range for dimension ", w, " of size ", size);
  if (start < 0) start += size;
  KILN_CHECK(length >= 0 && start + length <= size, "[narrow] start (", start, ") + length (",
             length, ") exceeds dimension ", w, " of size ", size, " (shape ",
             shape_str(sizes()), ")");
  return slice(w, start, start + length);
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  static const OpDef& op = KILN_OP(select);
  return call_op1(op, {*this}, {d, index});
}

std::vector<Tensor> Tensor::split(int64_t split_size, int64_t d) const {
  KILN_CHECK(dim() > 0, "[split] cannot split a 0-d tensor");
  const int64_t w = wrap_dim(d, dim(), "split");
  const int64_t size = sizes()[w];
  KILN_CHECK(split_size > 0 || (split_size == 0 && size == 0), "[split] split_size must be positive, got ", split_size);
  std::vector<Tensor> out;
  if (size == 0) return {alias()};
  for (int64_t start = 0; start < size; start += split_size) {
    out.push_back(narrow(w, start, std::min(split_size, size - start)));
  }
  return out;
}

std::vector<Tensor> Tensor::split_with_sizes(IntArrayRef split_sizes, int64_t d) const {
  KILN_CHECK(dim() > 0, "[split_with_sizes] cannot split a 0-d tensor");
  const int64_t w = wrap_dim(d, dim(), "split_with_sizes");
  int64_t total = 0;
  for (int64_t s : split_sizes) {
    KILN_CHECK(s >= 0, "[split_with_sizes] negative size in ", shape_str(split_sizes));
    total += s;
  }
  KILN_CHECK(total == sizes()[w], "[split_with_sizes] sizes ", shape_str(split_sizes),
             " sum to ", total, " but dimension ", w, " has size ", sizes()[w]);
  std::vector<Tensor> out;
  int64_t start = 0;
  for (int64_t s : split_sizes) {
    out.push_back(narrow(w, start, s));
    start += s;
  }
  return out;
}

std::vector<Tensor> Tensor::chunk(int64_t chunks, int64_t d) const {
  KILN_CHECK(chunks > 0, "[chunk] number of chunks must be positive, got ", chunks);
  KILN_CHECK(dim() > 0, "[chunk] cannot chunk a 0-d tensor");
  const int64_t size = sizes()[wrap_dim(d, dim(), "chunk")];
  return split(std::max<int64_t>((size + chunks - 1) / chunks, size == 0 ? 0 : 1), d);
}

std::vector<Tensor> Tensor::unbind(int64_t d) const {
  KILN_CHECK(dim() > 0, "[unbind] cannot unbind a 0-d tensor");
  const int64_t w = wrap_dim(d, dim(), "unbind");
  std::vector<Tensor> out;
  for (int64_t i = 0; i < sizes()[w]; ++i) out.push_back(select(w, i));
  return out;
}

Tensor Tensor::as_strided(IntArrayRef sizes, IntArrayRef strides,
                          std::optional<int64_t> storage_offset) const {
  static const OpDef& op = KILN_OP(as_strided);
  return call_op1(op, {*this},
                  {to_shape(sizes), to_shape(strides), storage_offset.value_or(this->storage_offset())});
}

Tensor Tensor::alias() const {
  static const OpDef& op = KILN_OP(alias);
  return call_op1(op, {*this});
}

}  // namespace kiln
