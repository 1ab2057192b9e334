// softmax and log_softmax along one dim. The result dtype is `dtype` when given (the input is
// converted to it first, as PyTorch) and the input's otherwise; it must be floating, so an
// integer input needs a dtype. The kernels subtract the maximum for stability and compute the
// 16-bit floats in float.
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

// attrs (dim, dtype?).
SpecList softmax_meta(const OpCall& c) {
  const Tensor& t = c.input(0);
  wrap_dim(c.attr<int64_t>(0), t.dim(), c.name().c_str());
  const ScalarType dtype = c.has_attr(1) ? c.attr<ScalarType>(1) : t.dtype();
  KILN_CHECK(is_floating_point(dtype), "[", c.name(), "] expected a floating-point ",
             c.has_attr(1) ? "dtype" : "input (or pass a floating dtype)", ", got ",
             dtype_name(dtype));
  return {{to_shape(t.sizes()), dtype, t.device()}};
}

Attr optional_dtype(std::optional<ScalarType> dtype) {
  return dtype ? Attr(*dtype) : Attr(std::monostate{});
}

}  // namespace

KILN_DEFINE_OP(softmax, OpKind::kFunctional, softmax_meta);
KILN_DEFINE_OP(log_softmax, OpKind::kFunctional, softmax_meta);

Tensor softmax(const Tensor& a, int64_t dim, std::optional<ScalarType> dtype) {
  static const OpDef& op = KILN_OP(softmax);
  return call_op1(op, {a}, {dim, optional_dtype(dtype)});
}

Tensor log_softmax(const Tensor& a, int64_t dim, std::optional<ScalarType> dtype) {
  static const OpDef& op = KILN_OP(log_softmax);
  return call_op1(op, {a}, {dim, optional_dtype(dtype)});
}

Tensor Tensor::softmax(int64_t dim, std::optional<ScalarType> dtype) const {
  return kiln::softmax(*this, dim, dtype);
}

Tensor Tensor::log_softmax(int64_t dim, std::optional<ScalarType> dtype) const {
  return kiln::log_softmax(*this, dim, dtype);
}

}  // namespace kiln
