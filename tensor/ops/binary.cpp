// Binary elementwise ops: arithmetic, comparisons, logical ops, where, clamp, lerp, isclose,
// with numpy broadcasting and PyTorch's type promotion (torch.result_type).
//
// One registry op per semantic. Scalar operands arrive as 0-d tensors (wrap_scalar) with the
// common dtype, computed with the Scalar's lower priority, as an attribute (see
// elementwise_meta.h). Attribute layouts, which backward rules and the tracer rely on:
//   add, add_, sub, sub_     inputs {a, b}           attrs {alpha: Scalar, [dtype]}
//   mul, mul_, pow, eq, ne, lt, le, gt, ge           attrs {[dtype]}
//   div, div_                inputs {a, b}           attrs {rounding_mode: string|none, [dtype]}
//   maximum, minimum, atan2, logical_and/or/xor      no attrs
//   where                    inputs {cond, a, b}     attrs {[dtype]}
//   clamp, clamp_            inputs {self}           attrs {min: Scalar|none, max: Scalar|none}
//   lerp, lerp_              inputs {start, end[, weight]}  attrs {weight: Scalar|none}
//   isclose                  inputs {a, b}           attrs {rtol, atol: double, equal_nan: bool}
// [dtype] is the common dtype (ScalarType), present only when an operand is a wrapped Scalar.
#include <algorithm>
#include <cmath>

#include "tensor/ops.h"
#include "tensor/ops/elementwise_meta.h"
#include "tensor/registry.h"

namespace kiln {

// --- Shared meta helpers ---------------------------------------------------------------------

namespace internal {
namespace {

int category(ScalarType t) { return t == kBool ? 0 : is_floating_point(t) ? 2 : 1; }

void promote_into(std::optional<ScalarType>& acc, ScalarType t) {
  acc = acc ? promote_types(*acc, t) : t;
}

// The result of a higher-priority group combined with a lower-priority one: the lower group
// only counts when it belongs to a higher category.
std::optional<ScalarType> combine(std::optional<ScalarType> higher,
                                  std::optional<ScalarType> lower) {
  if (!higher) return lower;
  if (!lower || category(*lower) <= category(*higher)) return higher;
  return promote_types(*higher, *lower);
}

}  // namespace

ResultTypeBuilder& ResultTypeBuilder::add(const Tensor& t) {
  KILN_CHECK(t.defined(), "[result_type] got an undefined tensor");
  promote_into(t.dim() > 0 ? dim_ : zero_, t.dtype());
  return *this;
}

ResultTypeBuilder& ResultTypeBuilder::add(const Scalar& s) {
  promote_into(wrapped_, s.dtype());
  return *this;
}

ScalarType ResultTypeBuilder::result() const {
  const std::optional<ScalarType> r = combine(dim_, combine(zero_, wrapped_));
  KILN_CHECK(r.has_value(), "[result_type] no operands");
  return *r;
}

bool can_cast(ScalarType from, ScalarType to) {
  if (is_floating_point(from) && !is_floating_point(to)) return false;
  return !(from != kBool && to == kBool);
}

std::string_view legacy_type_name(ScalarType t) {
  switch (t) {
    case kBool: return "Bool";
    case kUInt8: return "Byte";
    case kInt32: return "Int";
    case kInt64: return "Long";
    case kHalf: return "Half";
    case kBFloat16: return "BFloat16";
    case kFloat: return "Float";
    case kDouble: return "Double";
  }
  return "Unknown";
}

Tensor wrap_scalar(const Scalar& s) {
  const ScalarType dt = s.is_boolean() ? kBool : s.is_integral(false) ? kInt64 : kDouble;
  Tensor t = empty({}, TensorOptions(dt));
  visit_dtype(dt, [&]<typename T>(TypeTag<T>) { *t.data_ptr<T>() = s.to<T>(); });
  return t;
}

ScalarType binary_common_dtype(const OpCall& c, size_t attr) {
  return c.has_attr(attr) ? c.attr<ScalarType>(attr) : result_type(c.input(0), c.input(1));
}

void check_inplace_result(std::string_view op, const Tensor& self, IntArrayRef shape,
                          ScalarType result) {
  KILN_CHECK(self.sizes() == shape, "[", op, "] output with shape ", shape_str(self.sizes()),
             " doesn't match the broadcast shape ", shape_str(shape));
  KILN_CHECK(can_cast(result, self.dtype()), "[", op, "] result type ", legacy_type_name(result),
             " can't be cast to the desired output type ", legacy_type_name(self.dtype()));
  for (int64_t d = 0; d < self.dim(); ++d) {
    KILN_CHECK(self.sizes()[d] <= 1 || self.strides()[d] != 0, "[", op,
               "] unsupported operation: more than one element of the written-to tensor of "
               "shape ",
               shape_str(self.sizes()), " and strides ", shape_str(self.strides()),
               " refers to a single memory location; clone() it first");
  }
}

bool memory_overlaps(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0) return false;
  if (a.impl()->storage() != b.impl()->storage()) return false;
  auto byte_range = [](const Tensor& t) {
    const int64_t es = static_cast<int64_t>(t.element_size());
    int64_t lo = t.storage_offset() * es, hi = lo + es;
    for (int64_t d = 0; d < t.dim(); ++d) {
      const int64_t extent = (t.sizes()[d] - 1) * t.strides()[d] * es;
      (extent >= 0 ? hi : lo) += extent;
    }
    return std::pair<int64_t, int64_t>{lo, hi};
  };
  const auto [alo, ahi] = byte_range(a);
  const auto [blo, bhi] = byte_range(b);
  return alo < bhi && blo < ahi;
}

void check_no_partial_overlap(std::string_view op, const Tensor& self, const Tensor& input) {
  if (!input.defined() || self.numel() == 0 || input.numel() == 0) return;
  if (self.impl()->storage() != input.impl()->storage() || self.is_same(input)) return;
  if (self.storage_offset() == input.storage_offset() && self.dtype() == input.dtype() &&
      self.sizes() == input.sizes() && self.strides() == input.strides()) {
    return;  // the same elements: each is read before it is written
  }
  KILN_CHECK(!memory_overlaps(self, input), "[", op,
             "] unsupported operation: some elements of the input tensor (shape ",
             shape_str(input.sizes()), ") and the written-to tensor (shape ",
             shape_str(self.sizes()), ") refer to a single memory location; clone() the input");
}

}  // namespace internal

// --- Meta rules ------------------------------------------------------------------------------

namespace {

using internal::binary_common_dtype;
using internal::wrap_scalar;

void check_defined(const OpCall& c) {
  for (const Tensor& t : c.inputs) {
    KILN_CHECK(t.defined(), "[", c.name(), "] got an undefined tensor");
  }
}

Shape broadcast_inputs(const OpCall& c) {
  Shape shape = to_shape(c.input(0).sizes());
  for (size_t i = 1; i < c.inputs.size(); ++i) {
    shape = broadcast_shapes(shape, c.input(i).sizes(), c.name().c_str());
  }
  return shape;
}

// A fresh output of `dtype` and `shape`; for in-place ops, self after checking that the result
// fits into it.
SpecList elementwise_result(const OpCall& c, const Shape& shape, ScalarType dtype) {
  if (c.op->kind == OpKind::kInplace) {
    const Tensor& self = c.input(0);
    internal::check_inplace_result(c.name(), self, shape, dtype);
    for (size_t i = 1; i < c.inputs.size(); ++i) {
      internal::check_no_partial_overlap(c.name(), self, c.input(i));
    }
    return {{to_shape(self.sizes()), self.dtype(), self.device()}};
  }
  return {{shape, dtype, common_device(c)}};
}

SpecList add_meta(const OpCall& c) {
  check_defined(c);
  const ScalarType common = binary_common_dtype(c, 1);
  const Scalar& alpha = c.attr<Scalar>(0);
  KILN_CHECK(!alpha.is_boolean() || common == kBool, "[", c.name(),
             "] boolean alpha is only supported for bool results, got ", dtype_name(common));
  KILN_CHECK(is_floating_point(common) || alpha.is_integral(true), "[", c.name(),
             "] for integral input tensors (", dtype_name(common),
             "), argument alpha must not be a floating point number, got ", alpha);
  return elementwise_result(c, broadcast_inputs(c), common);
}

SpecList sub_meta(const OpCall& c) {
  check_defined(c);
  const bool a_bool = c.input(0).dtype() == kBool, b_bool = c.input(1).dtype() == kBool;
  KILN_CHECK(!(a_bool && b_bool), "[", c.name(),
             "] subtraction, the `-` operator, with two bool tensors is not supported; use the "
             "`^` or logical_xor() operator instead");
  KILN_CHECK(!(a_bool || b_bool), "[", c.name(),
             "] subtraction, the `-` operator, with a bool tensor is not supported; to invert "
             "a mask, use the `~` or logical_not() operator instead");
  return add_meta(c);
}

// Ops whose result has the common dtype (mul, maximum, minimum).
SpecList common_meta(const OpCall& c) {
  check_defined(c);
  return elementwise_result(c, broadcast_inputs(c), binary_common_dtype(c, 0));
}

SpecList pow_meta(const OpCall& c) {
  check_defined(c);
  const ScalarType common = binary_common_dtype(c, 0);
  KILN_CHECK(common != kBool, "[pow] not implemented for bool base and exponent (shapes ",
             shape_str(c.input(0).sizes()), " and ", shape_str(c.input(1).sizes()), ")");
  return elementwise_result(c, broadcast_inputs(c), common);
}

SpecList div_meta(const OpCall& c) {
  check_defined(c);
  const ScalarType common = binary_common_dtype(c, 1);
  if (c.has_attr(0)) {
    const std::string& mode = c.attr<std::string>(0);
    KILN_CHECK(mode == "trunc" || mode == "floor", "[", c.name(),
               "] expected rounding_mode to be one of None, 'trunc', or 'floor' but found '", mode,
               "'");
    return elementwise_result(c, broadcast_inputs(c), common);
  }
  // True division promotes integers (and bool) to the default floating dtype.
  const ScalarType result = is_floating_point(common) ? common : default_dtype();
  return elementwise_result(c, broadcast_inputs(c), result);
}

SpecList float_meta(const OpCall& c) {  // atan2: integers promote to the default float
  check_defined(c);
  const ScalarType common = binary_common_dtype(c, 0);
  return elementwise_result(c, broadcast_inputs(c),
                            is_floating_point(common) ? common : default_dtype());
}

SpecList bool_meta(const OpCall& c) {  // comparisons and logical ops
  check_defined(c);
  return elementwise_result(c, broadcast_inputs(c), kBool);
}

SpecList where_meta(const OpCall& c) {
  check_defined(c);
  const Tensor& cond = c.input(0);
  KILN_CHECK(cond.dtype() == kBool,
             "[where] expected condition to be a boolean tensor, but got "
             "a tensor with dtype ",
             dtype_name(cond.dtype()), " (shape ", shape_str(cond.sizes()), ")");
  const ScalarType common =
      c.has_attr(0) ? c.attr<ScalarType>(0) : result_type(c.input(1), c.input(2));
  return elementwise_result(c, broadcast_inputs(c), common);
}

SpecList clamp_meta(const OpCall& c) {
  check_defined(c);
  const Tensor& self = c.input(0);
  KILN_CHECK(c.has_attr(0) || c.has_attr(1), "[", c.name(),
             "] at least one of 'min' or 'max' must not be None");
  internal::ResultTypeBuilder r;
  r.add(self);
  if (c.has_attr(0)) r.add(c.attr<Scalar>(0));
  if (c.has_attr(1)) r.add(c.attr<Scalar>(1));
  const ScalarType result = r.result();
  KILN_CHECK(result != kBool, "[", c.name(), "] is not implemented for bool (shape ",
             shape_str(self.sizes()), ")");
  return elementwise_result(c, to_shape(self.sizes()), result);
}

SpecList lerp_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 2 || c.inputs.size() == 3, "[", c.name(),
             "] expected 2 or 3 input tensors, got ", c.inputs.size());
  check_defined(c);
  const Tensor& start = c.input(0);
  const bool tensor_weight = c.inputs.size() == 3;
  KILN_CHECK(tensor_weight != c.has_attr(0), "[", c.name(),
             "] expected exactly one weight, a tensor or a scalar");
  KILN_CHECK(is_floating_point(start.dtype()), "[", c.name(),
             "] expected a floating-point dtype, got ", dtype_name(start.dtype()));
  KILN_CHECK(c.input(1).dtype() == start.dtype(), "[", c.name(), "] expected dtype ",
             dtype_name(start.dtype()), " for `end` but got dtype ",
             dtype_name(c.input(1).dtype()));
  KILN_CHECK(!tensor_weight || c.input(2).dtype() == start.dtype(), "[", c.name(),
             "] expected dtype ", dtype_name(start.dtype()), " for `weight` but got dtype ",
             dtype_name(c.input(2).dtype()));
  return elementwise_result(c, broadcast_inputs(c), start.dtype());
}

SpecList isclose_meta(const OpCall& c) {
  check_defined(c);
  const Tensor& a = c.input(0);
  const Tensor& b = c.input(1);
  KILN_CHECK(a.dtype() == b.dtype(), "[isclose] ", dtype_name(a.dtype()), " did not match ",
             dtype_name(b.dtype()));
  const double rtol = c.attr<double>(0), atol = c.attr<double>(1);
  KILN_CHECK(rtol >= 0, "[isclose] rtol must be greater than or equal to zero, but got ", rtol);
  KILN_CHECK(atol >= 0, "[isclose] atol must be greater than or equal to zero, but got ", atol);
  return elementwise_result(c, broadcast_inputs(c), kBool);
}

}  // namespace

KILN_DEFINE_OP(add, OpKind::kFunctional, add_meta);
KILN_DEFINE_OP(add_, OpKind::kInplace, add_meta);
KILN_DEFINE_OP(sub, OpKind::kFunctional, sub_meta);
KILN_DEFINE_OP(sub_, OpKind::kInplace, sub_meta);
KILN_DEFINE_OP(mul, OpKind::kFunctional, common_meta);
KILN_DEFINE_OP(mul_, OpKind::kInplace, common_meta);
KILN_DEFINE_OP(div, OpKind::kFunctional, div_meta);
KILN_DEFINE_OP(div_, OpKind::kInplace, div_meta);
KILN_DEFINE_OP(pow, OpKind::kFunctional, pow_meta);
KILN_DEFINE_OP(maximum, OpKind::kFunctional, common_meta);
KILN_DEFINE_OP(minimum, OpKind::kFunctional, common_meta);
KILN_DEFINE_OP(atan2, OpKind::kFunctional, float_meta);
KILN_DEFINE_OP(eq, OpKind::kFunctional, bool_meta);
KILN_DEFINE_OP(ne, OpKind::kFunctional, bool_meta);
KILN_DEFINE_OP(lt, OpKind::kFunctional, bool_meta);
KILN_DEFINE_OP(le, OpKind::kFunctional, bool_meta);
KILN_DEFINE_OP(gt, OpKind::kFunctional, bool_meta);
KILN_DEFINE_OP(ge, OpKind::kFunctional, bool_meta);
KILN_DEFINE_OP(logical_and, OpKind::kFunctional, bool_meta);
KILN_DEFINE_OP(logical_or, OpKind::kFunctional, bool_meta);
KILN_DEFINE_OP(logical_xor, OpKind::kFunctional, bool_meta);
KILN_DEFINE_OP(where, OpKind::kFunctional, where_meta);
KILN_DEFINE_OP(clamp, OpKind::kFunctional, clamp_meta);
KILN_DEFINE_OP(clamp_, OpKind::kInplace, clamp_meta);
KILN_DEFINE_OP(lerp, OpKind::kFunctional, lerp_meta);
KILN_DEFINE_OP(lerp_, OpKind::kInplace, lerp_meta);
KILN_DEFINE_OP(isclose, OpKind::kFunctional, isclose_meta);

// --- Type promotion ----------------------------------------------------------------------------

ScalarType result_type(const Tensor& a, const Tensor& b) {
  return internal::ResultTypeBuilder().add(a).add(b).result();
}

ScalarType result_type(const Tensor& a, const Scalar& b) {
  return internal::ResultTypeBuilder().add(a).add(b).result();
}

// --- Free functions ----------------------------------------------------------------------------

namespace {

// The common dtype of `t` with the Scalar `s`, naming `op` when t is undefined.
ScalarType scalar_common(const char* op, const Tensor& t, const Scalar& s) {
  KILN_CHECK(t.defined(), "[", op, "] got an undefined tensor");
  return result_type(t, s);
}

// op(t, s) and op(s, t) for ops whose only attribute is the common dtype.
Tensor with_scalar(const OpDef& op, const Tensor& t, const Scalar& s, bool scalar_first) {
  const ScalarType common = scalar_common(op.name.c_str(), t, s);
  return scalar_first ? call_op1(op, {wrap_scalar(s), t}, {common})
                      : call_op1(op, {t, wrap_scalar(s)}, {common});
}

const OpDef& div_op() {
  static const OpDef& op = KILN_OP(div);
  return op;
}

Attr rounding_attr(std::optional<std::string_view> mode) {
  return mode ? Attr(std::string(*mode)) : Attr(std::monostate{});
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b, const Scalar& alpha) {
  static const OpDef& op = KILN_OP(add);
  return call_op1(op, {a, b}, {alpha});
}

Tensor add(const Tensor& a, const Scalar& b, const Scalar& alpha) {
  static const OpDef& op = KILN_OP(add);
  return call_op1(op, {a, wrap_scalar(b)}, {alpha, scalar_common("add", a, b)});
}

Tensor sub(const Tensor& a, const Tensor& b, const Scalar& alpha) {
  static const OpDef& op = KILN_OP(sub);
  return call_op1(op, {a, b}, {alpha});
}

Tensor sub(const Tensor& a, const Scalar& b, const Scalar& alpha) {
  static const OpDef& op = KILN_OP(sub);
  return call_op1(op, {a, wrap_scalar(b)}, {alpha, scalar_common("sub", a, b)});
}

Tensor mul(const Tensor& a, const Tensor& b) {
  static const OpDef& op = KILN_OP(mul);
  return call_op1(op, {a, b});
}

Tensor mul(const Tensor& a, const Scalar& b) {
  static const OpDef& op = KILN_OP(mul);
  return with_scalar(op, a, b, /*scalar_first=*/false);
}

Tensor div(const Tensor& a, const Tensor& b, std::optional<std::string_view> rounding_mode) {
  return call_op1(div_op(), {a, b}, {rounding_attr(rounding_mode)});
}

Tensor div(const Tensor& a, const Scalar& b, std::optional<std::string_view> rounding_mode) {
  return call_op1(div_op(), {a, wrap_scalar(b)},
                  {rounding_attr(rounding_mode), scalar_common("div", a, b)});
}

Tensor floor_divide(const Tensor& a, const Tensor& b) { return div(a, b, "floor"); }

Tensor pow(const Tensor& a, const Tensor& exponent) {
  static const OpDef& op = KILN_OP(pow);
  return call_op1(op, {a, exponent});
}

Tensor pow(const Scalar& a, const Tensor& exponent) {
  static const OpDef& op = KILN_OP(pow);
  return with_scalar(op, exponent, a, /*scalar_first=*/true);
}

Tensor maximum(const Tensor& a, const Tensor& b) {
  static const OpDef& op = KILN_OP(maximum);
  return call_op1(op, {a, b});
}

Tensor minimum(const Tensor& a, const Tensor& b) {
  static const OpDef& op = KILN_OP(minimum);
  return call_op1(op, {a, b});
}

Tensor atan2(const Tensor& a, const Tensor& b) {
  static const OpDef& op = KILN_OP(atan2);
  return call_op1(op, {a, b});
}

#define KILN_COMPARISON(name)                                                         \
  Tensor name(const Tensor& a, const Tensor& b) {                                     \
    static const OpDef& op = KILN_OP(name);                                           \
    return call_op1(op, {a, b});                                                      \
  }                                                                                   \
  Tensor Tensor::name(const Tensor& other) const { return kiln::name(*this, other); } \
  Tensor Tensor::name(const Scalar& other) const {                                    \
    static const OpDef& op = KILN_OP(name);                                           \
    return with_scalar(op, *this, other, /*scalar_first=*/false);                     \
  }
KILN_COMPARISON(eq)
KILN_COMPARISON(ne)
KILN_COMPARISON(lt)
KILN_COMPARISON(le)
KILN_COMPARISON(gt)
KILN_COMPARISON(ge)
#undef KILN_COMPARISON

Tensor logical_and(const Tensor& a, const Tensor& b) {
  static const OpDef& op = KILN_OP(logical_and);
  return call_op1(op, {a, b});
}

Tensor logical_or(const Tensor& a, const Tensor& b) {
  static const OpDef& op = KILN_OP(logical_or);
  return call_op1(op, {a, b});
}

Tensor logical_xor(const Tensor& a, const Tensor& b) {
  static const OpDef& op = KILN_OP(logical_xor);
  return call_op1(op, {a, b});
}

Tensor where(const Tensor& condition, const Tensor& a, const Tensor& b) {
  static const OpDef& op = KILN_OP(where);
  return call_op1(op, {condition, a, b});
}

Tensor where(const Tensor& condition, const Tensor& a, const Scalar& b) {
  static const OpDef& op = KILN_OP(where);
  return call_op1(op, {condition, a, wrap_scalar(b)}, {scalar_common("where", a, b)});
}

Tensor where(const Tensor& condition, const Scalar& a, const Tensor& b) {
  static const OpDef& op = KILN_OP(where);
  return call_op1(op, {condition, wrap_scalar(a), b}, {scalar_common("where", b, a)});
}

namespace {
Attr optional_attr(const std::optional<Scalar>& s) { return s ? Attr(*s) : Attr(std::monostate{}); }
}  // namespace

Tensor clamp(const Tensor& a, std::optional<Scalar> min, std::optional<Scalar> max) {
  static const OpDef& op = KILN_OP(clamp);
  return call_op1(op, {a}, {optional_attr(min), optional_attr(max)});
}

Tensor lerp(const Tensor& start, const Tensor& end, const Scalar& weight) {
  static const OpDef& op = KILN_OP(lerp);
  return call_op1(op, {start, end}, {weight});
}

Tensor lerp(const Tensor& start, const Tensor& end, const Tensor& weight) {
  static const OpDef& op = KILN_OP(lerp);
  return call_op1(op, {start, end, weight});
}

Tensor isclose(const Tensor& a, const Tensor& b, double rtol, double atol, bool equal_nan) {
  static const OpDef& op = KILN_OP(isclose);
  return call_op1(op, {a, b}, {rtol, atol, equal_nan});
}

namespace {
bool all_true(const Tensor& t) {
  const std::vector<bool> v = t.to_vector<bool>();
  return std::all_of(v.begin(), v.end(), [](bool x) { return x; });
}
}  // namespace

bool allclose(const Tensor& a, const Tensor& b, double rtol, double atol, bool equal_nan) {
  return all_true(isclose(a, b, rtol, atol, equal_nan));
}

bool equal(const Tensor& a, const Tensor& b) {
  KILN_CHECK(a.defined() && b.defined(), "[equal] got an undefined tensor");
  KILN_CHECK(a.device() == b.device(),
             "[equal] cannot compare two tensors on different "
             "devices, got ",
             a.device().str(), " and ", b.device().str());
  return a.sizes() == b.sizes() && all_true(eq(a, b));
}

// --- Tensor methods ----------------------------------------------------------------------------

Tensor Tensor::add(const Tensor& o, const Scalar& alpha) const {
  return kiln::add(*this, o, alpha);
}
Tensor Tensor::add(const Scalar& o, const Scalar& alpha) const {
  return kiln::add(*this, o, alpha);
}
Tensor Tensor::sub(const Tensor& o, const Scalar& alpha) const {
  return kiln::sub(*this, o, alpha);
}
Tensor Tensor::sub(const Scalar& o, const Scalar& alpha) const {
  return kiln::sub(*this, o, alpha);
}
Tensor Tensor::mul(const Tensor& o) const { return kiln::mul(*this, o); }
Tensor Tensor::mul(const Scalar& o) const { return kiln::mul(*this, o); }
Tensor Tensor::div(const Tensor& o, std::optional<std::string_view> mode) const {
  return kiln::div(*this, o, mode);
}
Tensor Tensor::div(const Scalar& o, std::optional<std::string_view> mode) const {
  return kiln::div(*this, o, mode);
}
Tensor Tensor::floor_divide(const Tensor& o) const { return kiln::floor_divide(*this, o); }
Tensor Tensor::pow(const Tensor& exponent) const { return kiln::pow(*this, exponent); }
Tensor Tensor::maximum(const Tensor& o) const { return kiln::maximum(*this, o); }
Tensor Tensor::minimum(const Tensor& o) const { return kiln::minimum(*this, o); }
Tensor Tensor::atan2(const Tensor& o) const { return kiln::atan2(*this, o); }
Tensor Tensor::logical_and(const Tensor& o) const { return kiln::logical_and(*this, o); }
Tensor Tensor::logical_or(const Tensor& o) const { return kiln::logical_or(*this, o); }
Tensor Tensor::logical_xor(const Tensor& o) const { return kiln::logical_xor(*this, o); }
Tensor Tensor::where(const Tensor& condition, const Tensor& other) const {
  return kiln::where(condition, *this, other);
}
Tensor Tensor::clamp(std::optional<Scalar> min, std::optional<Scalar> max) const {
  return kiln::clamp(*this, min, max);
}
Tensor Tensor::lerp(const Tensor& end, const Scalar& weight) const {
  return kiln::lerp(*this, end, weight);
}
Tensor Tensor::lerp(const Tensor& end, const Tensor& weight) const {
  return kiln::lerp(*this, end, weight);
}

Tensor& Tensor::add_(const Tensor& o, const Scalar& alpha) {
  static const OpDef& op = KILN_OP(add_);
  call_op(op, {*this, o}, {alpha});
  return *this;
}

Tensor& Tensor::add_(const Scalar& o, const Scalar& alpha) {
  static const OpDef& op = KILN_OP(add_);
  call_op(op, {*this, wrap_scalar(o)}, {alpha, scalar_common("add_", *this, o)});
  return *this;
}

Tensor& Tensor::sub_(const Tensor& o, const Scalar& alpha) {
  static const OpDef& op = KILN_OP(sub_);
  call_op(op, {*this, o}, {alpha});
  return *this;
}

Tensor& Tensor::sub_(const Scalar& o, const Scalar& alpha) {
  static const OpDef& op = KILN_OP(sub_);
  call_op(op, {*this, wrap_scalar(o)}, {alpha, scalar_common("sub_", *this, o)});
  return *this;
}

Tensor& Tensor::mul_(const Tensor& o) {
  static const OpDef& op = KILN_OP(mul_);
  call_op(op, {*this, o});
  return *this;
}

Tensor& Tensor::mul_(const Scalar& o) {
  static const OpDef& op = KILN_OP(mul_);
  with_scalar(op, *this, o, /*scalar_first=*/false);
  return *this;
}

Tensor& Tensor::div_(const Tensor& o) {
  static const OpDef& op = KILN_OP(div_);
  call_op(op, {*this, o}, {std::monostate{}});
  return *this;
}

Tensor& Tensor::div_(const Scalar& o) {
  static const OpDef& op = KILN_OP(div_);
  call_op(op, {*this, wrap_scalar(o)}, {std::monostate{}, scalar_common("div_", *this, o)});
  return *this;
}

Tensor& Tensor::clamp_(std::optional<Scalar> min, std::optional<Scalar> max) {
  static const OpDef& op = KILN_OP(clamp_);
  call_op(op, {*this}, {optional_attr(min), optional_attr(max)});
  return *this;
}

Tensor& Tensor::lerp_(const Tensor& end, const Scalar& weight) {
  static const OpDef& op = KILN_OP(lerp_);
  call_op(op, {*this, end}, {weight});
  return *this;
}

// --- Operators -----------------------------------------------------------------------------------

Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator+(const Tensor& a, const Scalar& b) { return add(a, b); }
Tensor operator+(const Scalar& a, const Tensor& b) { return add(b, a); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator-(const Tensor& a, const Scalar& b) { return sub(a, b); }
Tensor operator-(const Scalar& a, const Tensor& b) {  // rsub: a - b with a wrapped
  static const OpDef& op = KILN_OP(sub);
  return call_op1(op, {wrap_scalar(a), b}, {Scalar(1), scalar_common("sub", b, a)});
}
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator*(const Tensor& a, const Scalar& b) { return mul(a, b); }
Tensor operator*(const Scalar& a, const Tensor& b) { return mul(b, a); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator/(const Tensor& a, const Scalar& b) { return div(a, b); }
Tensor operator/(const Scalar& a, const Tensor& b) {
  return call_op1(div_op(), {wrap_scalar(a), b}, {std::monostate{}, scalar_common("div", b, a)});
}
Tensor operator==(const Tensor& a, const Tensor& b) { return eq(a, b); }
Tensor operator==(const Tensor& a, const Scalar& b) { return a.eq(b); }
Tensor operator==(const Scalar& a, const Tensor& b) { return b.eq(a); }
Tensor operator!=(const Tensor& a, const Tensor& b) { return ne(a, b); }
Tensor operator!=(const Tensor& a, const Scalar& b) { return a.ne(b); }
Tensor operator!=(const Scalar& a, const Tensor& b) { return b.ne(a); }
Tensor operator<(const Tensor& a, const Tensor& b) { return lt(a, b); }
Tensor operator<(const Tensor& a, const Scalar& b) { return a.lt(b); }
Tensor operator<(const Scalar& a, const Tensor& b) { return b.gt(a); }
Tensor operator<=(const Tensor& a, const Tensor& b) { return le(a, b); }
Tensor operator<=(const Tensor& a, const Scalar& b) { return a.le(b); }
Tensor operator<=(const Scalar& a, const Tensor& b) { return b.ge(a); }
Tensor operator>(const Tensor& a, const Tensor& b) { return gt(a, b); }
Tensor operator>(const Tensor& a, const Scalar& b) { return a.gt(b); }
Tensor operator>(const Scalar& a, const Tensor& b) { return b.lt(a); }
Tensor operator>=(const Tensor& a, const Tensor& b) { return ge(a, b); }
Tensor operator>=(const Tensor& a, const Scalar& b) { return a.ge(b); }
Tensor operator>=(const Scalar& a, const Tensor& b) { return b.le(a); }

namespace {
// PyTorch's & | ^ are bitwise; on bool tensors that is the logical op, the only case kiln has.
void check_bool_operands(const char* op, const Tensor& a, const Tensor& b) {
  KILN_CHECK(a.defined() && b.defined(), "[", op, "] got an undefined tensor");
  KILN_CHECK(a.dtype() == kBool && b.dtype() == kBool, "[", op,
             "] is only implemented for bool tensors, got ", dtype_name(a.dtype()), " and ",
             dtype_name(b.dtype()), "; use logical_and/or/xor for other dtypes");
}
}  // namespace

Tensor operator&(const Tensor& a, const Tensor& b) {
  check_bool_operands("bitwise_and", a, b);
  return logical_and(a, b);
}
Tensor operator|(const Tensor& a, const Tensor& b) {
  check_bool_operands("bitwise_or", a, b);
  return logical_or(a, b);
}
Tensor operator^(const Tensor& a, const Tensor& b) {
  check_bool_operands("bitwise_xor", a, b);
  return logical_xor(a, b);
}

}  // namespace kiln
