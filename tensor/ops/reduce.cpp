// Reductions: sum, mean, prod, amax/amin, max/min (whole tensor and with indices), argmax/argmin,
// var/std, norm, logsumexp, all/any, and the scan cumsum. Dims lists are wrapped and sorted by
// reduction_dims (empty = all dims); keepdim leaves the reduced dims as size 1. Output dtypes
// follow PyTorch: integer and bool sums and products are int64, mean/var/std/norm want a
// floating input, logsumexp promotes integers to the default dtype, all/any give bool.
#include <algorithm>
#include <cmath>

#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

Attr optional_dtype(std::optional<ScalarType> dtype) {
  return dtype ? Attr(*dtype) : Attr(std::monostate{});
}

Shape reduced_shape(const Tensor& t, IntArrayRef dims, bool keepdim) {
  Shape out;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const bool reduced = std::find(dims.begin(), dims.end(), d) != dims.end();
    if (!reduced) {
      out.push_back(t.sizes()[d]);
    } else if (keepdim) {
      out.push_back(1);
    }
  }
  return out;
}

// Reductions without an identity (max, min, ...) cannot reduce over nothing.
void check_nonzero_reduction(const OpCall& c, const Tensor& t, IntArrayRef dims) {
  for (int64_t d : dims) {
    KILN_CHECK(t.sizes()[d] != 0, "[", c.name(), "] cannot reduce over a zero-size dimension (dim ",
               d, " of input of shape ", shape_str(t.sizes()), ")");
  }
}

void check_floating(const OpCall& c, ScalarType dtype) {
  KILN_CHECK(is_floating_point(dtype), "[", c.name(),
             "] expected a floating-point input, got dtype ", dtype_name(dtype));
}

Shape dims_of(const OpCall& c, size_t attr) {
  return reduction_dims(c.attr<Shape>(attr), c.input(0).dim(), c.name().c_str());
}

// sum, prod: attrs (dims, keepdim, dtype?). Integers and bool accumulate into int64.
SpecList sum_meta(const OpCall& c) {
  const Tensor& t = c.input(0);
  const Shape dims = dims_of(c, 0);
  ScalarType dtype = is_integral(t.dtype(), /*include_bool=*/true) ? kInt64 : t.dtype();
  if (c.has_attr(2)) dtype = c.attr<ScalarType>(2);
  return {{reduced_shape(t, dims, c.attr<bool>(1)), dtype, t.device()}};
}

SpecList mean_meta(const OpCall& c) {
  const Tensor& t = c.input(0);
  const Shape dims = dims_of(c, 0);
  ScalarType dtype = t.dtype();
  if (c.has_attr(2)) {
    dtype = c.attr<ScalarType>(2);
    KILN_CHECK(is_floating_point(dtype),
               "[mean] could not infer output dtype: the optional dtype must be floating point, "
               "got ",
               dtype_name(dtype));
  } else {
    KILN_CHECK(is_floating_point(dtype),
               "[mean] could not infer output dtype: the input dtype must be floating point, got ",
               dtype_name(dtype), "; pass a floating dtype");
  }
  return {{reduced_shape(t, dims, c.attr<bool>(1)), dtype, t.device()}};
}

// amax, amin, max, min: attrs (dims, keepdim).
SpecList extremum_meta(const OpCall& c) {
  const Tensor& t = c.input(0);
  const Shape dims = dims_of(c, 0);
  check_nonzero_reduction(c, t, dims);
  return {{reduced_shape(t, dims, c.attr<bool>(1)), t.dtype(), t.device()}};
}

// max_dim, min_dim: attrs (dim, keepdim); outputs values and int64 indices.
SpecList max_dim_meta(const OpCall& c) {
  const Tensor& t = c.input(0);
  const Shape dims = reduction_dims({c.attr<int64_t>(0)}, t.dim(), c.name().c_str());
  check_nonzero_reduction(c, t, dims);
  const Shape sizes = reduced_shape(t, dims, c.attr<bool>(1));
  return {{sizes, t.dtype(), t.device()}, {sizes, kInt64, t.device()}};
}

// argmax, argmin: attrs (dim?, keepdim). Without a dim, over the flattened tensor; keepdim then
// keeps every dim as size 1.
SpecList argmax_meta(const OpCall& c) {
  const Tensor& t = c.input(0);
  KILN_CHECK(t.dtype() != kBool, "[", c.name(), "] not implemented for bool tensors");
  const Shape dims = c.has_attr(0) ? reduction_dims({c.attr<int64_t>(0)}, t.dim(), c.name().c_str())
                                   : reduction_dims({}, t.dim(), c.name().c_str());
  check_nonzero_reduction(c, t, dims);
  return {{reduced_shape(t, dims, c.attr<bool>(1)), kInt64, t.device()}};
}

// var, std: attrs (dims, correction, keepdim).
SpecList var_meta(const OpCall& c) {
  const Tensor& t = c.input(0);
  check_floating(c, t.dtype());
  const Shape dims = dims_of(c, 0);
  return {{reduced_shape(t, dims, c.attr<bool>(2)), t.dtype(), t.device()}};
}

// norm: attrs (p, dims, keepdim).
SpecList norm_meta(const OpCall& c) {
  const Tensor& t = c.input(0);
  check_floating(c, t.dtype());
  const double p = c.attr<Scalar>(0).toDouble();
  KILN_CHECK(!std::isnan(p), "[norm] p must not be nan");
  const Shape dims = dims_of(c, 1);
  if (std::isinf(p)) {
    for (int64_t d : dims) {
      KILN_CHECK(t.sizes()[d] != 0, "[norm] cannot compute the ", p > 0 ? "" : "-",
                 "inf norm over a zero-size dimension (dim ", d, " of input of shape ",
                 shape_str(t.sizes()), ")");
    }
  }
  return {{reduced_shape(t, dims, c.attr<bool>(2)), t.dtype(), t.device()}};
}

// logsumexp: attrs (dims, keepdim); integer inputs give the default floating dtype.
SpecList logsumexp_meta(const OpCall& c) {
  const Tensor& t = c.input(0);
  const Shape dims = dims_of(c, 0);
  const ScalarType dtype = is_floating_point(t.dtype()) ? t.dtype() : default_dtype();
  return {{reduced_shape(t, dims, c.attr<bool>(1)), dtype, t.device()}};
}

// all, any: attrs (dims, keepdim).
SpecList logical_meta(const OpCall& c) {
  const Tensor& t = c.input(0);
  const Shape dims = dims_of(c, 0);
  return {{reduced_shape(t, dims, c.attr<bool>(1)), kBool, t.device()}};
}

// cumsum: attrs (dim, dtype?).
SpecList cumsum_meta(const OpCall& c) {
  const Tensor& t = c.input(0);
  wrap_dim(c.attr<int64_t>(0), t.dim(), "cumsum");
  ScalarType dtype = is_integral(t.dtype(), /*include_bool=*/true) ? kInt64 : t.dtype();
  if (c.has_attr(1)) dtype = c.attr<ScalarType>(1);
  return {{to_shape(t.sizes()), dtype, t.device()}};
}

}  // namespace

KILN_DEFINE_OP(sum, OpKind::kFunctional, sum_meta);
KILN_DEFINE_OP(prod, OpKind::kFunctional, sum_meta);
KILN_DEFINE_OP(mean, OpKind::kFunctional, mean_meta);
KILN_DEFINE_OP(amax, OpKind::kFunctional, extremum_meta);
KILN_DEFINE_OP(amin, OpKind::kFunctional, extremum_meta);
KILN_DEFINE_OP(max, OpKind::kFunctional, extremum_meta);
KILN_DEFINE_OP(min, OpKind::kFunctional, extremum_meta);
KILN_DEFINE_OP(max_dim, OpKind::kFunctional, max_dim_meta);
KILN_DEFINE_OP(min_dim, OpKind::kFunctional, max_dim_meta);
KILN_DEFINE_OP(argmax, OpKind::kFunctional, argmax_meta);
KILN_DEFINE_OP(argmin, OpKind::kFunctional, argmax_meta);
KILN_DEFINE_OP(var, OpKind::kFunctional, var_meta);
KILN_DEFINE_OP(std, OpKind::kFunctional, var_meta);
KILN_DEFINE_OP(norm, OpKind::kFunctional, norm_meta);
KILN_DEFINE_OP(logsumexp, OpKind::kFunctional, logsumexp_meta);
KILN_DEFINE_OP(all, OpKind::kFunctional, logical_meta);
KILN_DEFINE_OP(any, OpKind::kFunctional, logical_meta);
KILN_DEFINE_OP(cumsum, OpKind::kFunctional, cumsum_meta);

// --- Free functions ---------------------------------------------------------------------------

Tensor sum(const Tensor& a, IntArrayRef dims, bool keepdim, std::optional<ScalarType> dtype) {
  static const OpDef& op = KILN_OP(sum);
  return call_op1(op, {a}, {to_shape(dims), keepdim, optional_dtype(dtype)});
}

Tensor mean(const Tensor& a, IntArrayRef dims, bool keepdim, std::optional<ScalarType> dtype) {
  static const OpDef& op = KILN_OP(mean);
  return call_op1(op, {a}, {to_shape(dims), keepdim, optional_dtype(dtype)});
}

Tensor amax(const Tensor& a, IntArrayRef dims, bool keepdim) {
  static const OpDef& op = KILN_OP(amax);
  return call_op1(op, {a}, {to_shape(dims), keepdim});
}

Tensor amin(const Tensor& a, IntArrayRef dims, bool keepdim) {
  static const OpDef& op = KILN_OP(amin);
  return call_op1(op, {a}, {to_shape(dims), keepdim});
}

Tensor argmax(const Tensor& a, std::optional<int64_t> dim, bool keepdim) {
  static const OpDef& op = KILN_OP(argmax);
  return call_op1(op, {a}, {dim ? Attr(*dim) : Attr(std::monostate{}), keepdim});
}

Tensor argmin(const Tensor& a, std::optional<int64_t> dim, bool keepdim) {
  static const OpDef& op = KILN_OP(argmin);
  return call_op1(op, {a}, {dim ? Attr(*dim) : Attr(std::monostate{}), keepdim});
}

Tensor var(const Tensor& a, IntArrayRef dims, int64_t correction, bool keepdim) {
  static const OpDef& op = KILN_OP(var);
  return call_op1(op, {a}, {to_shape(dims), correction, keepdim});
}

Tensor std(const Tensor& a, IntArrayRef dims, int64_t correction, bool keepdim) {
  static const OpDef& op = KILN_OP(std);
  return call_op1(op, {a}, {to_shape(dims), correction, keepdim});
}

Tensor norm(const Tensor& a, const Scalar& p, IntArrayRef dims, bool keepdim) {
  static const OpDef& op = KILN_OP(norm);
  return call_op1(op, {a}, {p, to_shape(dims), keepdim});
}

Tensor logsumexp(const Tensor& a, IntArrayRef dims, bool keepdim) {
  static const OpDef& op = KILN_OP(logsumexp);
  return call_op1(op, {a}, {to_shape(dims), keepdim});
}

Tensor cumsum(const Tensor& a, int64_t dim, std::optional<ScalarType> dtype) {
  static const OpDef& op = KILN_OP(cumsum);
  return call_op1(op, {a}, {dim, optional_dtype(dtype)});
}

// --- Tensor methods ---------------------------------------------------------------------------

Tensor Tensor::sum(std::optional<ScalarType> dtype) const {
  return kiln::sum(*this, {}, false, dtype);
}
Tensor Tensor::sum(IntArrayRef dims, bool keepdim, std::optional<ScalarType> dtype) const {
  return kiln::sum(*this, dims, keepdim, dtype);
}
Tensor Tensor::mean(std::optional<ScalarType> dtype) const {
  return kiln::mean(*this, {}, false, dtype);
}
Tensor Tensor::mean(IntArrayRef dims, bool keepdim, std::optional<ScalarType> dtype) const {
  return kiln::mean(*this, dims, keepdim, dtype);
}
Tensor Tensor::prod(std::optional<ScalarType> dtype) const {
  static const OpDef& op = KILN_OP(prod);
  return call_op1(op, {*this}, {Shape{}, false, optional_dtype(dtype)});
}
Tensor Tensor::prod(int64_t dim, bool keepdim, std::optional<ScalarType> dtype) const {
  static const OpDef& op = KILN_OP(prod);
  return call_op1(op, {*this}, {Shape{dim}, keepdim, optional_dtype(dtype)});
}
Tensor Tensor::amax(IntArrayRef dims, bool keepdim) const {
  return kiln::amax(*this, dims, keepdim);
}
Tensor Tensor::amin(IntArrayRef dims, bool keepdim) const {
  return kiln::amin(*this, dims, keepdim);
}
Tensor Tensor::max() const {
  static const OpDef& op = KILN_OP(max);
  return call_op1(op, {*this}, {Shape{}, false});
}
Tensor Tensor::min() const {
  static const OpDef& op = KILN_OP(min);
  return call_op1(op, {*this}, {Shape{}, false});
}
std::tuple<Tensor, Tensor> Tensor::max(int64_t dim, bool keepdim) const {
  static const OpDef& op = KILN_OP(max_dim);
  TensorVec out = call_op(op, {*this}, {dim, keepdim});
  return {out[0], out[1]};
}
std::tuple<Tensor, Tensor> Tensor::min(int64_t dim, bool keepdim) const {
  static const OpDef& op = KILN_OP(min_dim);
  TensorVec out = call_op(op, {*this}, {dim, keepdim});
  return {out[0], out[1]};
}
Tensor Tensor::argmax(std::optional<int64_t> dim, bool keepdim) const {
  return kiln::argmax(*this, dim, keepdim);
}
Tensor Tensor::argmin(std::optional<int64_t> dim, bool keepdim) const {
  return kiln::argmin(*this, dim, keepdim);
}
Tensor Tensor::var(IntArrayRef dims, int64_t correction, bool keepdim) const {
  return kiln::var(*this, dims, correction, keepdim);
}
Tensor Tensor::std(IntArrayRef dims, int64_t correction, bool keepdim) const {
  return kiln::std(*this, dims, correction, keepdim);
}
Tensor Tensor::norm(const Scalar& p, IntArrayRef dims, bool keepdim) const {
  return kiln::norm(*this, p, dims, keepdim);
}
Tensor Tensor::logsumexp(IntArrayRef dims, bool keepdim) const {
  return kiln::logsumexp(*this, dims, keepdim);
}
Tensor Tensor::all() const {
  static const OpDef& op = KILN_OP(all);
  return call_op1(op, {*this}, {Shape{}, false});
}
Tensor Tensor::all(int64_t dim, bool keepdim) const {
  static const OpDef& op = KILN_OP(all);
  return call_op1(op, {*this}, {Shape{dim}, keepdim});
}
Tensor Tensor::any() const {
  static const OpDef& op = KILN_OP(any);
  return call_op1(op, {*this}, {Shape{}, false});
}
Tensor Tensor::any(int64_t dim, bool keepdim) const {
  static const OpDef& op = KILN_OP(any);
  return call_op1(op, {*this}, {Shape{dim}, keepdim});
}
Tensor Tensor::cumsum(int64_t dim, std::optional<ScalarType> dtype) const {
  return kiln::cumsum(*this, dim, dtype);
}

}  // namespace kiln
