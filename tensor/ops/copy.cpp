// Copies and conversions: copy_, fill_, zero_, to, clone, contiguous.
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

SpecList to_copy_meta(const OpCall& c) {
  return {{to_shape(c.input(0).sizes()), c.attr<ScalarType>(0), c.attr<Device>(1)}};
}

SpecList copy_meta(const OpCall& c) {
  const Tensor& dst = c.input(0);
  const Tensor& src = c.input(1);
  KILN_CHECK(broadcast_shapes(dst.sizes(), src.sizes(), "copy_") == dst.impl()->sizes(),
             "[copy_] source of shape ", shape_str(src.sizes()),
             " cannot be broadcast to the destination shape ", shape_str(dst.sizes()));
  return {};
}

SpecList fill_meta(const OpCall& c) { return {}; }

}  // namespace

KILN_DEFINE_OP(to_copy, OpKind::kFunctional, to_copy_meta, OpFlags{.cross_device = true});
KILN_DEFINE_OP(copy_, OpKind::kInplace, copy_meta, OpFlags{.cross_device = true});
KILN_DEFINE_OP(fill_, OpKind::kInplace, fill_meta);

Tensor Tensor::to(const TensorOptions& options, bool non_blocking, bool copy) const {
  const ScalarType dt = options.has_dtype() ? options.dtype() : dtype();
  const Device dev = options.has_device() ? options.device() : device();
  Tensor out = *this;
  if (copy || dt != dtype() || !(dev == device())) {
    static const OpDef& op = KILN_OP(to_copy);
    // attrs (dtype, device, non_blocking?): the device kernels read the flag.
    out = non_blocking && !(dev == device()) ? call_op1(op, {*this}, {dt, dev, true})
                                             : call_op1(op, {*this}, {dt, dev});
  }
  if (options.requires_grad()) out.requires_grad_(true);
  return out;
}

Tensor Tensor::to(const TensorOptions& options, bool copy) const {
  return to(options, /*non_blocking=*/false, copy);
}
Tensor Tensor::to(ScalarType dt, bool copy) const { return to(TensorOptions(dt), false, copy); }
Tensor Tensor::to(Device dev, bool non_blocking, bool copy) const {
  return to(TensorOptions(dev), non_blocking, copy);
}
Tensor Tensor::to(Device dev, ScalarType dt, bool non_blocking, bool copy) const {
  return to(TensorOptions(dt).device(dev), non_blocking, copy);
}

Tensor Tensor::clone() const { return to(options(), /*copy=*/true); }

Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }

Tensor& Tensor::copy_(const Tensor& src) {
  static const OpDef& op = KILN_OP(copy_);
  OpCall call;
  call.op = &op;
  call.inputs = {*this, src};
  dispatch(call);
  return *this;
}

Tensor& Tensor::fill_(const Scalar& value) {
  static const OpDef& op = KILN_OP(fill_);
  OpCall call;
  call.op = &op;
  call.inputs = {*this};
  call.attrs = {value};
  dispatch(call);
  return *this;
}

Tensor& Tensor::zero_() { return fill_(0); }

}  // namespace kiln
