// Indexing ops: Tensor::index / index_put_ (kiln::indexing), index_select, gather, scatter,
// scatter_add, index_add, masked_fill, masked_select, embedding, triu/tril, one_hot.
//
// Basic indices (integers, slices, None, Ellipsis, Python-style bools) become views (select,
// slice, unsqueeze); tensor indices become one registry op, "index" (or "index_put_"), that
// takes the sliced view, the int64/int32 index tensors and the dims they index. Boolean masks
// are turned into index tensors by "nonzero" first, as PyTorch does, so "index" itself has a
// static output shape.
#include <algorithm>

#include "tensor/indexing.h"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

using indexing::TensorIndex;

bool is_index_dtype(ScalarType t) { return t == kInt64 || t == kInt32; }

// Whether a tensor of shape `from` broadcasts to exactly `to`.
bool expandable_to(IntArrayRef from, IntArrayRef to) {
  if (from.size() > to.size()) return false;
  const size_t lead = to.size() - from.size();
  for (size_t i = 0; i < from.size(); ++i) {
    if (from[i] != 1 && from[i] != to[lead + i]) return false;
  }
  return true;
}

// The shape of self[indices] for index tensors broadcast to `b` that index `dims` of self:
// when the indexed dims are adjacent the broadcast dims replace them in place, otherwise they
// go first (numpy's rule, which PyTorch follows).
Shape advanced_result_shape(IntArrayRef self_sizes, IntArrayRef dims, IntArrayRef b) {
  const int64_t k = static_cast<int64_t>(dims.size());
  const bool adjacent = dims.back() - dims.front() == k - 1;
  Shape out;
  if (adjacent) {
    out.insert(out.end(), self_sizes.begin(), self_sizes.begin() + dims.front());
    out.insert(out.end(), b.begin(), b.end());
    out.insert(out.end(), self_sizes.begin() + dims.back() + 1, self_sizes.end());
  } else {
    out.insert(out.end(), b.begin(), b.end());
    for (int64_t d = 0; d < static_cast<int64_t>(self_sizes.size()); ++d) {
      if (std::find(dims.begin(), dims.end(), d) == dims.end()) out.push_back(self_sizes[d]);
    }
  }
  return out;
}

// Checks the index tensors inputs[first...] against `dims` and returns the result shape.
Shape check_advanced(const OpCall& c, size_t first, const char* op) {
  const Tensor& self = c.input(0);
  const Shape& dims = c.attr<Shape>(0);
  KILN_CHECK(!dims.empty() && dims.size() + first == c.inputs.size(), "[", op, "] expected ",
             c.inputs.size() - first, " indexed dims, got ", shape_str(dims));
  Shape b;
  for (size_t k = 0; k < dims.size(); ++k) {
    const Tensor& idx = c.input(first + k);
    KILN_CHECK(is_index_dtype(idx.dtype()), "[", op,
               "] tensors used as indices must be int64, int32 or bool tensors, got ",
               dtype_name(idx.dtype()));
    KILN_CHECK(dims[k] >= 0 && dims[k] < self.dim() && (k == 0 || dims[k] > dims[k - 1]), "[", op,
               "] invalid indexed dims ", shape_str(dims), " for a tensor of shape ",
               shape_str(self.sizes()));
    b = k == 0 ? to_shape(idx.sizes()) : broadcast_shapes(b, idx.sizes(), op);
  }
  return advanced_result_shape(self.sizes(), dims, b);
}

// inputs: self, index tensors; attrs: dims (the dims of self each index tensor indexes).
SpecList index_meta(const OpCall& c) {
  const Tensor& self = c.input(0);
  return {{check_advanced(c, 1, "index"), self.dtype(), self.device()}};
}

// inputs: self, values, index tensors; attrs: dims, accumulate.
SpecList index_put_meta(const OpCall& c) {
  const Tensor& self = c.input(0);
  const Tensor& values = c.input(1);
  const Shape result = check_advanced(c, 2, "index_put_");
  KILN_CHECK(values.dtype() == self.dtype(),
             "[index_put_] index put requires the source and destination dtypes match, got ",
             dtype_name(self.dtype()), " for the destination and ", dtype_name(values.dtype()),
             " for the source");
  KILN_CHECK(expandable_to(values.sizes(), result),
             "[index_put_] shape mismatch: value tensor of shape ", shape_str(values.sizes()),
             " cannot be broadcast to indexing result of shape ", shape_str(result));
  return {};
}

// The coordinates of the nonzero elements of input 0, as an [n, ndim] int64 tensor.
SpecList nonzero_meta(const OpCall& c) { return {}; }

// --- index_select, gather, scatter, index_add, embedding ----------------------------------

void check_index_tensor(const Tensor& idx, const char* op, bool allow_int32) {
  if (allow_int32) {
    KILN_CHECK(is_index_dtype(idx.dtype()), "[", op,
               "] expected dtype int64 or int32 for index, got ", dtype_name(idx.dtype()));
  } else {
    KILN_CHECK(idx.dtype() == kInt64, "[", op, "] expected dtype int64 for index, got ",
               dtype_name(idx.dtype()));
  }
}

// A 0-d tensor takes part in gather/scatter as if it had shape [1].
int64_t size_or_1(const Tensor& t, int64_t d) { return t.dim() == 0 ? 1 : t.sizes()[d]; }

SpecList index_select_meta(const OpCall& c) {
  const Tensor& self = c.input(0);
  const Tensor& idx = c.input(1);
  const int64_t d = wrap_dim(c.attr<int64_t>(0), self.dim(), "index_select");
  check_index_tensor(idx, "index_select", true);
  KILN_CHECK(idx.dim() <= 1, "[index_select] index is supposed to be a vector, got shape ",
             shape_str(idx.sizes()));
  Shape out = to_shape(self.sizes());
  if (self.dim() == 0) {
    KILN_CHECK(idx.numel() == 1, "[index_select] index to a 0-d tensor can have only 1 value, got ",
               idx.numel());
  } else {
    out[d] = idx.numel();
  }
  return {{out, self.dtype(), self.device()}};
}

// gather/scatter shape rules: same number of dims; index no larger than self except along dim
// and (scatter with src) no larger than src anywhere.
void check_gather_shapes(const Tensor& self, const Tensor& idx, const Tensor* src, int64_t d,
                         const char* op) {
  KILN_CHECK(std::max<int64_t>(self.dim(), 1) == std::max<int64_t>(idx.dim(), 1), "[", op,
             "] index tensor must have the same number of dimensions as self: index shape ",
             shape_str(idx.sizes()), ", self shape ", shape_str(self.sizes()));
  if (src != nullptr) {
    KILN_CHECK(std::max<int64_t>(src->dim(), 1) == std::max<int64_t>(idx.dim(), 1), "[", op,
               "] index tensor must have the same number of dimensions as src: index shape ",
               shape_str(idx.sizes()), ", src shape ", shape_str(src->sizes()));
  }
  for (int64_t i = 0; i < idx.dim(); ++i) {
    const int64_t is = idx.sizes()[i];
    KILN_CHECK(i == d || is <= size_or_1(self, i), "[", op, "] expected index ",
               shape_str(idx.sizes()), " to be no larger than self ", shape_str(self.sizes()),
               " apart from dimension ", d);
    KILN_CHECK(src == nullptr || is <= size_or_1(*src, i), "[", op, "] expected index ",
               shape_str(idx.sizes()), " to be no larger than src ", shape_str(src->sizes()));
  }
}

SpecList gather_meta(const OpCall& c) {
  const Tensor& self = c.input(0);
  const Tensor& idx = c.input(1);
  const int64_t d = wrap_dim(c.attr<int64_t>(0), self.dim(), "gather");
  check_index_tensor(idx, "gather", false);
  check_gather_shapes(self, idx, nullptr, d, "gather");
  return {{to_shape(idx.sizes()), self.dtype(), self.device()}};
}

// scatter, scatter_add (inputs self, index, src) and scatter_value (inputs self, index; the
// value in attr 1); attr 0 is dim. The in-place forms share the rule.
template <bool kHasSrc, bool kInplace>
SpecList scatter_meta(const OpCall& c) {
  const char* op = c.name().c_str();
  const Tensor& self = c.input(0);
  const Tensor& idx = c.input(1);
  const int64_t d = wrap_dim(c.attr<int64_t>(0), self.dim(), op);
  check_index_tensor(idx, op, false);
  if constexpr (kHasSrc) {
    const Tensor& src = c.input(2);
    KILN_CHECK(src.dtype() == self.dtype(), "[", op, "] expected self.dtype to be equal to ",
               "src.dtype, got ", dtype_name(self.dtype()), " and ", dtype_name(src.dtype()));
    if (idx.numel() > 0) check_gather_shapes(self, idx, &src, d, op);
  } else {
    if (idx.numel() > 0) check_gather_shapes(self, idx, nullptr, d, op);
  }
  if constexpr (kInplace) return {};
  return {{to_shape(self.sizes()), self.dtype(), self.device()}};
}

// inputs self, index, source; attrs dim, alpha.
template <bool kInplace>
SpecList index_add_meta(const OpCall& c) {
  const char* op = c.name().c_str();
  const Tensor& self = c.input(0);
  const Tensor& idx = c.input(1);
  const Tensor& src = c.input(2);
  const int64_t d = wrap_dim(c.attr<int64_t>(0), self.dim(), op);
  check_index_tensor(idx, op, true);
  KILN_CHECK(idx.dim() <= 1, "[", op, "] index is supposed to be a vector, got shape ",
             shape_str(idx.sizes()));
  KILN_CHECK(src.dtype() == self.dtype(), "[", op, "] self (", dtype_name(self.dtype()),
             ") and source (", dtype_name(src.dtype()), ") must have the same dtype");
  KILN_CHECK(!c.attr<Scalar>(1).is_floating_point() || is_floating_point(self.dtype()), "[", op,
             "] for integral input tensors, argument alpha must not be a floating point number");
  bool same = std::max<int64_t>(self.dim(), 1) == std::max<int64_t>(src.dim(), 1);
  for (int64_t i = 0; same && i < std::max<int64_t>(self.dim(), 1); ++i) {
    same = i == d || size_or_1(self, i) == size_or_1(src, i);
  }
  KILN_CHECK(same, "[", op, "] source of shape ", shape_str(src.sizes()),
             " must match self of shape ", shape_str(self.sizes()), " except in dimension ", d);
  KILN_CHECK(idx.numel() == size_or_1(src, d), "[", op, "] number of indices (", idx.numel(),
             ") should be equal to source.size(", d, ") (", size_or_1(src, d), ")");
  if constexpr (kInplace) return {};
  return {{to_shape(self.sizes()), self.dtype(), self.device()}};
}

SpecList embedding_meta(const OpCall& c) {
  const Tensor& weight = c.input(0);
  const Tensor& idx = c.input(1);
  KILN_CHECK(weight.dim() == 2, "[embedding] 'weight' must be 2-D, got shape ",
             shape_str(weight.sizes()));
  check_index_tensor(idx, "embedding", true);
  Shape out = to_shape(idx.sizes());
  out.push_back(weight.sizes()[1]);
  return {{out, weight.dtype(), weight.device()}};
}

// --- masks -------------------------------------------------------------------------------

template <bool kInplace>
SpecList masked_fill_meta(const OpCall& c) {
  const char* op = c.name().c_str();
  const Tensor& self = c.input(0);
  const Tensor& mask = c.input(1);
  KILN_CHECK(mask.dtype() == kBool, "[", op, "] expected a bool mask, got ",
             dtype_name(mask.dtype()));
  if constexpr (kInplace) {
    KILN_CHECK(expandable_to(mask.sizes(), self.sizes()), "[", op, "] mask of shape ",
               shape_str(mask.sizes()), " cannot be broadcast to self of shape ",
               shape_str(self.sizes()));
    return {};
  }
  return {{broadcast_shapes(self.sizes(), mask.sizes(), op), self.dtype(), self.device()}};
}

SpecList masked_select_meta(const OpCall& c) {
  KILN_CHECK(c.input(1).dtype() == kBool, "[masked_select] expected a bool mask, got ",
             dtype_name(c.input(1).dtype()));
  broadcast_shapes(c.input(0).sizes(), c.input(1).sizes(), "masked_select");
  return {};
}

// --- triu, tril, one_hot -------------------------------------------------------------------

SpecList triangle_meta(const OpCall& c) {
  const Tensor& self = c.input(0);
  KILN_CHECK(self.dim() >= 2, "[", c.name(), "] input tensor must have at least 2 dimensions, got ",
             "shape ", shape_str(self.sizes()));
  return {{to_shape(self.sizes()), self.dtype(), self.device()}};
}

SpecList one_hot_meta(const OpCall& c) {
  const Tensor& idx = c.input(0);
  KILN_CHECK(idx.dtype() == kInt64, "[one_hot] is only applicable to index tensors of dtype ",
             "int64, got ", dtype_name(idx.dtype()));
  const int64_t n = c.attr<int64_t>(0);
  KILN_CHECK(n >= 0, "[one_hot] num_classes must be non-negative (or -1 to infer), got ", n);
  Shape out = to_shape(idx.sizes());
  out.push_back(n);
  return {{out, kInt64, idx.device()}};
}

}  // namespace

KILN_DEFINE_OP(index, OpKind::kFunctional, index_meta);
KILN_DEFINE_OP(index_put_, OpKind::kInplace, index_put_meta);
KILN_DEFINE_OP(nonzero, OpKind::kDynamic, nonzero_meta);
KILN_DEFINE_OP(index_select, OpKind::kFunctional, index_select_meta);
KILN_DEFINE_OP(gather, OpKind::kFunctional, gather_meta);
KILN_DEFINE_OP(scatter, OpKind::kFunctional, scatter_meta<true, false>);
KILN_DEFINE_OP(scatter_, OpKind::kInplace, scatter_meta<true, true>);
KILN_DEFINE_OP(scatter_value, OpKind::kFunctional, scatter_meta<false, false>);
KILN_DEFINE_OP(scatter_value_, OpKind::kInplace, scatter_meta<false, true>);
KILN_DEFINE_OP(scatter_add, OpKind::kFunctional, scatter_meta<true, false>);
KILN_DEFINE_OP(scatter_add_, OpKind::kInplace, scatter_meta<true, true>);
KILN_DEFINE_OP(index_add, OpKind::kFunctional, index_add_meta<false>);
KILN_DEFINE_OP(index_add_, OpKind::kInplace, index_add_meta<true>);
KILN_DEFINE_OP(embedding, OpKind::kFunctional, embedding_meta);
KILN_DEFINE_OP(masked_fill, OpKind::kFunctional, masked_fill_meta<false>);
KILN_DEFINE_OP(masked_fill_, OpKind::kInplace, masked_fill_meta<true>);
KILN_DEFINE_OP(masked_select, OpKind::kDynamic, masked_select_meta);
KILN_DEFINE_OP(triu, OpKind::kFunctional, triangle_meta);
KILN_DEFINE_OP(tril, OpKind::kFunctional, triangle_meta);
KILN_DEFINE_OP(one_hot, OpKind::kFunctional, one_hot_meta);

// --- Tensor::index and index_put_ ------------------------------------------------------------

namespace {

// self after the basic indices, and the tensor indices (masks already expanded) with the dims
// of that view they index.
struct Indexed {
  Tensor view;
  Shape dims;
  TensorVec tensors;
};

Tensor nonzero(const Tensor& t) {
  static const OpDef& op = KILN_OP(nonzero);
  return call_op1(op, {t});
}

// A Python bool index: a new dim of size 1, indexed by [0] (true) or [] (false).
Tensor bool_index(bool b) { return b ? zeros({1}, kInt64) : empty({0}, kInt64); }

Indexed apply_indices(const Tensor& self, absl::Span<const TensorIndex> indices, const char* op) {
  // Dims of self the indices consume (None and bools add dims, masks consume their dims).
  int64_t consumed = 0;
  int ellipses = 0;
  for (const TensorIndex& i : indices) {
    if (i.is_integer() || i.is_slice()) {
      ++consumed;
    } else if (i.is_ellipsis()) {
      ++ellipses;
    } else if (i.is_tensor()) {
      const Tensor& t = i.tensor();
      KILN_CHECK(t.defined(), "[", op, "] got an undefined index tensor");
      consumed += t.dtype() == kBool ? t.dim() : 1;
    }
  }
  KILN_CHECK(ellipses <= 1, "[", op, "] an index can only have a single ellipsis ('...')");
  KILN_CHECK(consumed <= self.dim(), "[", op, "] too many indices for tensor of dimension ",
             self.dim(), " (shape ", shape_str(self.sizes()), ")");

  Indexed r{self, {}, {}};
  struct Mask {
    int64_t dim;
    Tensor mask;
  };
  std::vector<Mask> masks;
  std::vector<int64_t> mask_slot;  // position in r.tensors where each mask's indices go
  int64_t dim = 0, real_dim = 0;
  auto select = [&](int64_t i) {
    const int64_t size = r.view.sizes()[dim];
    KILN_CHECK(i >= -size && i < size, "[", op, "] index ", i, " is out of bounds for dimension ",
               real_dim, " with size ", size);
    r.view = r.view.select(dim, i);
    ++real_dim;
  };
  for (const TensorIndex& i : indices) {
    if (i.is_integer()) {
      select(i.integer());
    } else if (i.is_slice()) {
      const auto& s = i.slice();
      KILN_CHECK(s.step() > 0, "[", op, "] slice step must be positive, got ", s.step());
      r.view = r.view.slice(dim, s.start(), s.stop(), s.step());
      ++dim;
      ++real_dim;
    } else if (i.is_none()) {
      r.view = r.view.unsqueeze(dim);
      ++dim;
    } else if (i.is_ellipsis()) {
      dim += self.dim() - consumed;
      real_dim += self.dim() - consumed;
    } else if (i.is_boolean()) {
      r.view = r.view.unsqueeze(dim);
      r.dims.push_back(dim);
      r.tensors.push_back(bool_index(i.boolean()));
      ++dim;
    } else {
      const Tensor& t = i.tensor();
      if (t.dtype() == kBool && t.dim() == 0) {
        r.view = r.view.unsqueeze(dim);
        r.dims.push_back(dim);
        r.tensors.push_back(bool_index(t.item<bool>()));
        ++dim;
      } else if (t.dtype() == kBool) {
        masks.push_back({dim, t});
        mask_slot.push_back(static_cast<int64_t>(r.tensors.size()));
        dim += t.dim();
        real_dim += t.dim();
      } else {
        KILN_CHECK(is_index_dtype(t.dtype()), "[", op,
                   "] tensors used as indices must be int64, int32 or bool tensors, got ",
                   dtype_name(t.dtype()));
        if (t.dim() == 0) {
          // A 0-d integer tensor selects, as an integer does (libtorch does the same).
          select(t.item<int64_t>());
        } else {
          r.dims.push_back(dim);
          r.tensors.push_back(t);
          ++dim;
          ++real_dim;
        }
      }
    }
  }
  // Masks become one index tensor per dim they cover (the columns of nonzero(mask)).
  for (size_t m = masks.size(); m-- > 0;) {
    const Tensor& mask = masks[m].mask;
    const int64_t d0 = masks[m].dim;
    for (int64_t j = 0; j < mask.dim(); ++j) {
      KILN_CHECK(mask.sizes()[j] == r.view.sizes()[d0 + j], "[", op, "] the shape of the mask ",
                 shape_str(mask.sizes()), " at index ", j,
                 " does not match the shape of the indexed tensor ", shape_str(r.view.sizes()),
                 " at index ", d0 + j);
    }
    const Tensor nz = nonzero(mask);
    const auto at = mask_slot[m];
    for (int64_t j = mask.dim(); j-- > 0;) {
      r.dims.insert(r.dims.begin() + at, d0 + j);
      r.tensors.insert(r.tensors.begin() + at, nz.select(1, j));
    }
  }
  return r;
}

// libtorch drops leading size-1 dims of an assigned value, so `x[0] = t.view({1, 3})` works.
Tensor strip_leading_ones(Tensor value, int64_t target_dim) {
  while (value.dim() > target_dim && value.sizes()[0] == 1) value = value.squeeze(0);
  return value;
}

// Writes `value` (a tensor of self's dtype, or a scalar) into self[indices].
void put(Indexed r, const Tensor* value, const Scalar& scalar) {
  if (r.tensors.empty()) {
    if (value != nullptr) {
      r.view.copy_(strip_leading_ones(*value, r.view.dim()));
    } else {
      r.view.fill_(scalar);
    }
    return;
  }
  static const OpDef& op = KILN_OP(index_put_);
  OpCall call;
  call.op = &op;
  call.inputs = {r.view, value != nullptr ? strip_leading_ones(*value, 0)
                                          : scalar_tensor(scalar, r.view.options())};
  call.inputs.insert(call.inputs.end(), r.tensors.begin(), r.tensors.end());
  call.attrs = {r.dims, false};
  dispatch(call);
}

}  // namespace

Tensor Tensor::index(absl::Span<const TensorIndex> indices) const {
  Indexed r = apply_indices(*this, indices, "index");
  if (r.tensors.empty()) return r.view.is_same(*this) ? alias() : r.view;
  static const OpDef& op = KILN_OP(index);
  TensorVec inputs{r.view};
  inputs.insert(inputs.end(), r.tensors.begin(), r.tensors.end());
  return call_op1(op, std::move(inputs), {r.dims});
}

Tensor Tensor::index(std::initializer_list<TensorIndex> indices) const {
  return index(absl::MakeConstSpan(indices.begin(), indices.size()));
}

Tensor Tensor::operator[](const Tensor& index) const { return this->index({index}); }

Tensor& Tensor::index_put_(absl::Span<const TensorIndex> indices, const Tensor& value) {
  put(apply_indices(*this, indices, "index_put_"), &value, Scalar());
  return *this;
}

Tensor& Tensor::index_put_(std::initializer_list<TensorIndex> indices, const Tensor& value) {
  return index_put_(absl::MakeConstSpan(indices.begin(), indices.size()), value);
}

Tensor& Tensor::index_put_(std::initializer_list<TensorIndex> indices, const Scalar& value) {
  const auto span = absl::MakeConstSpan(indices.begin(), indices.size());
  put(apply_indices(*this, span, "index_put_"), nullptr, value);
  return *this;
}

// --- The other indexing ops -----------------------------------------------------------------

Tensor Tensor::index_select(int64_t dim, const Tensor& index) const {
  static const OpDef& op = KILN_OP(index_select);
  return call_op1(op, {*this, index}, {dim});
}

Tensor Tensor::gather(int64_t dim, const Tensor& index) const {
  static const OpDef& op = KILN_OP(gather);
  return call_op1(op, {*this, index}, {dim});
}

Tensor Tensor::scatter(int64_t dim, const Tensor& index, const Tensor& src) const {
  static const OpDef& op = KILN_OP(scatter);
  return call_op1(op, {*this, index, src}, {dim});
}

Tensor Tensor::scatter(int64_t dim, const Tensor& index, const Scalar& value) const {
  static const OpDef& op = KILN_OP(scatter_value);
  return call_op1(op, {*this, index}, {dim, value});
}

Tensor Tensor::scatter_add(int64_t dim, const Tensor& index, const Tensor& src) const {
  static const OpDef& op = KILN_OP(scatter_add);
  return call_op1(op, {*this, index, src}, {dim});
}

Tensor Tensor::index_add(int64_t dim, const Tensor& index, const Tensor& source,
                         const Scalar& alpha) const {
  static const OpDef& op = KILN_OP(index_add);
  return call_op1(op, {*this, index, source}, {dim, alpha});
}

namespace {
Tensor& run_inplace(Tensor& self, const OpDef& op, TensorVec inputs,
                    absl::InlinedVector<Attr, 4> attrs) {
  OpCall call;
  call.op = &op;
  call.inputs = std::move(inputs);
  call.attrs = std::move(attrs);
  dispatch(call);
  return self;
}
}  // namespace

Tensor& Tensor::scatter_(int64_t dim, const Tensor& index, const Tensor& src) {
  static const OpDef& op = KILN_OP(scatter_);
  return run_inplace(*this, op, {*this, index, src}, {dim});
}

Tensor& Tensor::scatter_(int64_t dim, const Tensor& index, const Scalar& value) {
  static const OpDef& op = KILN_OP(scatter_value_);
  return run_inplace(*this, op, {*this, index}, {dim, value});
}

Tensor& Tensor::scatter_add_(int64_t dim, const Tensor& index, const Tensor& src) {
  static const OpDef& op = KILN_OP(scatter_add_);
  return run_inplace(*this, op, {*this, index, src}, {dim});
}

Tensor& Tensor::index_add_(int64_t dim, const Tensor& index, const Tensor& source,
                           const Scalar& alpha) {
  static const OpDef& op = KILN_OP(index_add_);
  return run_inplace(*this, op, {*this, index, source}, {dim, alpha});
}

Tensor Tensor::masked_fill(const Tensor& mask, const Scalar& value) const {
  static const OpDef& op = KILN_OP(masked_fill);
  return call_op1(op, {*this, mask}, {value});
}

Tensor& Tensor::masked_fill_(const Tensor& mask, const Scalar& value) {
  static const OpDef& op = KILN_OP(masked_fill_);
  return run_inplace(*this, op, {*this, mask}, {value});
}

Tensor Tensor::masked_select(const Tensor& mask) const {
  static const OpDef& op = KILN_OP(masked_select);
  return call_op1(op, {*this, mask});
}

Tensor Tensor::triu(int64_t diagonal) const {
  static const OpDef& op = KILN_OP(triu);
  return call_op1(op, {*this}, {diagonal});
}

Tensor Tensor::tril(int64_t diagonal) const {
  static const OpDef& op = KILN_OP(tril);
  return call_op1(op, {*this}, {diagonal});
}

Tensor index_select(const Tensor& a, int64_t dim, const Tensor& index) {
  return a.index_select(dim, index);
}
Tensor gather(const Tensor& a, int64_t dim, const Tensor& index) { return a.gather(dim, index); }
Tensor scatter(const Tensor& a, int64_t dim, const Tensor& index, const Tensor& src) {
  return a.scatter(dim, index, src);
}
Tensor scatter_add(const Tensor& a, int64_t dim, const Tensor& index, const Tensor& src) {
  return a.scatter_add(dim, index, src);
}
Tensor index_add(const Tensor& a, int64_t dim, const Tensor& index, const Tensor& source,
                 const Scalar& alpha) {
  return a.index_add(dim, index, source, alpha);
}
Tensor masked_fill(const Tensor& a, const Tensor& mask, const Scalar& value) {
  return a.masked_fill(mask, value);
}
Tensor masked_select(const Tensor& a, const Tensor& mask) { return a.masked_select(mask); }
Tensor triu(const Tensor& a, int64_t diagonal) { return a.triu(diagonal); }
Tensor tril(const Tensor& a, int64_t diagonal) { return a.tril(diagonal); }

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  static const OpDef& op = KILN_OP(embedding);
  return call_op1(op, {weight, indices});
}

Tensor one_hot(const Tensor& indices, int64_t num_classes) {
  KILN_CHECK(indices.dtype() == kInt64, "[one_hot] is only applicable to index tensors of dtype ",
             "int64, got ", dtype_name(indices.dtype()));
  if (num_classes == -1) {
    // The class count is data-dependent here (as in PyTorch): read the largest index.
    KILN_CHECK(indices.numel() > 0,
               "[one_hot] cannot infer the total number of classes from an empty tensor");
    const std::vector<int64_t> v = indices.to_vector<int64_t>();
    const int64_t lo = *std::min_element(v.begin(), v.end());
    KILN_CHECK(lo >= 0, "[one_hot] class values must be non-negative, got ", lo);
    num_classes = *std::max_element(v.begin(), v.end()) + 1;
  }
  static const OpDef& op = KILN_OP(one_hot);
  return call_op1(op, {indices}, {num_classes});
}

}  // namespace kiln
