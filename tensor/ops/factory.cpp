// Factories: empty, zeros, ones, full, arange, linspace, eye, from_blob, tensor, *_like.
#include <cmath>

#include "tensor/borrowed.h"
#include "tensor/ops.h"
#include "tensor/registry.h"
#include "tensor/tensor_data.h"
#include "tensor/traced_factories.h"

namespace kiln {
namespace {

SpecList arange_meta(const OpCall& c) {
  return {{Shape{c.attr<int64_t>(3)}, c.attr<ScalarType>(4), c.attr<Device>(5)}};
}

SpecList eye_meta(const OpCall& c) {
  const int64_t n = c.attr<int64_t>(0), m = c.attr<int64_t>(1);
  KILN_CHECK(n >= 0 && m >= 0, "[eye] sizes must be non-negative, got ", n, " and ", m);
  return {{Shape{n, m}, c.attr<ScalarType>(2), c.attr<Device>(3)}};
}

SpecList empty_meta(const OpCall& c) {
  const Shape& sizes = c.attr<Shape>(0);
  for (int64_t s : sizes) {
    KILN_CHECK(s >= 0, "[empty] negative dimension in ", shape_str(sizes));
  }
  return {{sizes, c.attr<ScalarType>(1), c.attr<Device>(2)}};
}

Tensor finish(Tensor t, const TensorOptions& options) {
  if (options.requires_grad()) t.requires_grad_(true);
  return t;
}

}  // namespace

// arange and linspace share one op: element i is start + i * step (attrs: start, step, end
// unused, count, dtype, device). linspace passes step = (end - start) / (steps - 1).
KILN_DEFINE_OP(arange, OpKind::kFunctional, arange_meta);
KILN_DEFINE_OP(eye, OpKind::kFunctional, eye_meta);
// empty(sizes; dtype, device): uninitialised memory. Eager code allocates directly (empty()
// below); full() (zeros, ones) dispatches it while kiln::compile traces, so that the tracer
// records the allocation (tensor/traced_factories.h). empty() itself stays a real allocation:
// code that writes host values into it (tensor(), scalar wrapping) makes constants.
KILN_DEFINE_OP(empty, OpKind::kFunctional, empty_meta);

Tensor empty(IntArrayRef sizes, const TensorOptions& options) {
  for (int64_t s : sizes) {
    KILN_CHECK(s >= 0, "[empty] negative dimension in ", shape_str(sizes));
  }
  const ScalarType dt = options.dtype();
  const size_t nbytes = nbytes_of(sizes, element_size(dt), "empty");
  Tensor t(std::make_shared<TensorImpl>(allocate_storage(nbytes, options.device()),
                                        to_shape(sizes), contiguous_strides(sizes), 0, dt));
  return finish(t, options);
}

Tensor full(IntArrayRef sizes, const Scalar& value, const TensorOptions& options) {
  TensorOptions o = options;
  if (!o.has_dtype()) o = o.dtype(value.dtype());
  Tensor t;
  if (internal::factories_traced()) {  // kiln::compile records the allocation (a proxy)
    static const OpDef& op = KILN_OP(empty);
    t = call_op1(op, {}, {to_shape(sizes), o.dtype(), o.device()});
  } else {
    t = empty(sizes, o.requires_grad(false));
  }
  t.fill_(value);
  return finish(t, options);
}

Tensor zeros(IntArrayRef sizes, const TensorOptions& options) {
  return full(sizes, 0, options.dtype(options.dtype()));
}

Tensor ones(IntArrayRef sizes, const TensorOptions& options) {
  return full(sizes, 1, options.dtype(options.dtype()));
}

Tensor scalar_tensor(const Scalar& value, const TensorOptions& options) {
  return full({}, value, options);
}

TensorOptions options_like(const Tensor& t, const TensorOptions& o) {
  TensorOptions r = o;
  if (!o.has_dtype()) r = r.dtype(t.dtype());
  if (!o.has_device()) r = r.device(t.device());
  return r;
}

Tensor empty_like(const Tensor& t, const TensorOptions& o) {
  const TensorOptions r = options_like(t, o);
  if (internal::factories_traced()) {  // recorded, as full() (bernoulli's output, say)
    static const OpDef& op = KILN_OP(empty);
    return finish(call_op1(op, {}, {to_shape(t.sizes()), r.dtype(), r.device()}), r);
  }
  return empty(t.sizes(), r);
}
Tensor zeros_like(const Tensor& t, const TensorOptions& o) { return zeros(t.sizes(), options_like(t, o)); }
Tensor ones_like(const Tensor& t, const TensorOptions& o) { return ones(t.sizes(), options_like(t, o)); }
Tensor full_like(const Tensor& t, const Scalar& v, const TensorOptions& o) {
  return full(t.sizes(), v, options_like(t, o));
}

Tensor arange(const Scalar& end, const TensorOptions& options) { return arange(0, end, 1, options); }

Tensor arange(const Scalar& start, const Scalar& end, const TensorOptions& options) {
  return arange(start, end, 1, options);
}

Tensor arange(const Scalar& start, const Scalar& end, const Scalar& step,
              const TensorOptions& options) {
  const bool integral = start.is_integral(true) && end.is_integral(true) && step.is_integral(true);
  const ScalarType dt = options.has_dtype() ? options.dtype() : integral ? kInt64 : default_dtype();
  const double s = start.toDouble(), e = end.toDouble(), st = step.toDouble();
  KILN_CHECK(st != 0, "[arange] step must be nonzero");
  KILN_CHECK(std::isfinite(s) && std::isfinite(e), "[arange] unsupported range: ", s, " -> ", e);
  KILN_CHECK((st > 0 && e >= s) || (st < 0 && e <= s), "[arange] upper bound ", e,
             " and lower bound ", s, " inconsistent with step sign ", st);
  const int64_t count = static_cast<int64_t>(std::ceil((e - s) / st));
  static const OpDef& op = KILN_OP(arange);
  Tensor t = call_op1(op, {}, {start, step, end, count, dt, options.device()});
  return finish(t, options);
}

Tensor linspace(const Scalar& start, const Scalar& end, int64_t steps, const TensorOptions& options) {
  KILN_CHECK(steps >= 0, "[linspace] number of steps must be non-negative, got ", steps);
  const double s = start.toDouble(), e = end.toDouble();
  const double step = steps > 1 ? (e - s) / static_cast<double>(steps - 1) : 0.0;
  static const OpDef& op = KILN_OP(arange);
  Tensor t = call_op1(op, {}, {Scalar(s), Scalar(step), Scalar(e), steps, options.dtype(),
                               options.device()});
  return finish(t, options);
}

Tensor eye(int64_t n, const TensorOptions& options) { return eye(n, n, options); }

Tensor eye(int64_t n, int64_t m, const TensorOptions& options) {
  static const OpDef& op = KILN_OP(eye);
  return finish(call_op1(op, {}, {n, m, options.dtype(), options.device()}), options);
}

Tensor from_blob(void* data, IntArrayRef sizes, IntArrayRef strides, const TensorOptions& options) {
  const int64_t extent = layout_extent(sizes, strides, "from_blob");
  const ScalarType dt = options.dtype();
  auto storage = std::make_shared<StorageImpl>(data, nbytes_of({extent}, element_size(dt), "from_blob"),
                                               options.device(), nullptr);
  internal::note_borrowed(storage);  // the caller owns the memory (kiln::compile copies it)
  Tensor t(std::make_shared<TensorImpl>(std::move(storage), to_shape(sizes), to_shape(strides), 0, dt));
  return finish(t, options);
}

Tensor from_blob(void* data, IntArrayRef sizes, const TensorOptions& options) {
  return from_blob(data, sizes, contiguous_strides(sizes), options);
}

Tensor from_blob(void* data, IntArrayRef sizes, std::function<void(void*)> deleter,
                 const TensorOptions& options) {
  const ScalarType dt = options.dtype();
  auto storage = std::make_shared<StorageImpl>(data, nbytes_of(sizes, element_size(dt), "from_blob"),
                                               options.device(), std::move(deleter));
  Tensor t(std::make_shared<TensorImpl>(std::move(storage), to_shape(sizes),
                                        contiguous_strides(sizes), 0, dt));
  return finish(t, options);
}

// --- kiln::tensor ---------------------------------------------------------------------------

TensorData::TensorData(std::initializer_list<TensorData> list) {
  sizes_.push_back(static_cast<int64_t>(list.size()));
  if (list.size() == 0) return;
  const Shape& inner = list.begin()->sizes();
  sizes_.insert(sizes_.end(), inner.begin(), inner.end());
  for (const TensorData& d : list) {
    KILN_CHECK(d.sizes() == inner, "[tensor] ragged nested list: expected an element of shape ",
               shape_str(inner), ", got ", shape_str(d.sizes()));
    values_.insert(values_.end(), d.values().begin(), d.values().end());
  }
}

ScalarType TensorData::inferred_dtype() const {
  bool any_float = false, any_int = false;
  for (const Scalar& v : values_) {
    any_float |= v.is_floating_point();
    any_int |= v.kind() == Scalar::Kind::Int;
  }
  if (values_.empty() || any_float) return default_dtype();
  return any_int ? kInt64 : kBool;
}

Tensor tensor(const TensorData& data, const TensorOptions& options) {
  const ScalarType dt = options.has_dtype() ? options.dtype() : data.inferred_dtype();
  Tensor t = empty(data.sizes(), TensorOptions(dt));
  visit_dtype(dt, [&]<typename T>(TypeTag<T>) {
    T* p = t.data_ptr<T>();
    for (size_t i = 0; i < data.values().size(); ++i) p[i] = data.values()[i].to<T>();
  });
  if (options.has_device() && !options.device().is_cpu()) t = t.to(options.device());
  return finish(t, options);
}

}  // namespace kiln
