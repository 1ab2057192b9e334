// CPU kernels for copies between dtypes and layouts, and for fill_.
#include "kernels/cpu/loops.h"
#include "kernels/scalar_fn.h"
#include "tensor/registry.h"

namespace kiln::cpu {

// dst[i] = convert(src[i]) with src broadcast to dst; any dtypes and strides.
void copy_elements(const Tensor& dst, const Tensor& src) {
  if (dst.numel() == 0) return;
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous() &&
      dst.sizes() == src.sizes()) {
    std::memcpy(dst.data_ptr(), src.data_ptr(), dst.nbytes());
    return;
  }
  visit_dtype(dst.dtype(), [&]<typename D>(TypeTag<D>) {
    visit_dtype(src.dtype(), [&]<typename S>(TypeTag<S>) {
      // Through S's own arithmetic type (a float64 1e-300 is true, as in PyTorch), floats to
      // uint8 through int64: the CUDA copy's formula.
      elementwise_typed<D, S>(
          dst, [](S v) -> D { return scalar::convert<D>(v); }, src);
    });
  });
}

namespace {

// to_copy runs on the source's device and copy_ on the destination's, so a copy between the
// CPU and a GPU can land here: the other device's kernel of the same op does it.
void run_on_other_device(OpCall& c, Device other, std::string_view op, const std::string& what) {
  const KernelFn kernel = c.op->first_kernel(other.type());
  KILN_CHECK(kernel != nullptr, "[", op, "] copying ", what, " needs the ",
             device_type_name(other.type()), " backend");
  kernel(c);
}

void to_copy_cpu(OpCall& c) {
  if (!c.outputs[0].is_cpu()) {
    return run_on_other_device(c, c.outputs[0].device(), "to",
                               "from cpu to " + c.outputs[0].device().str());
  }
  copy_elements(c.outputs[0], c.input(0));
}

void copy_cpu(OpCall& c) {
  if (!c.input(1).is_cpu()) {
    return run_on_other_device(c, c.input(1).device(), "copy_",
                               "from " + c.input(1).device().str() + " into a cpu tensor");
  }
  copy_elements(c.input(0), c.input(1));
}

void fill_cpu(OpCall& c) {
  const Tensor& t = c.input(0);
  const Scalar& v = c.attr<Scalar>(0);
  visit_dtype(t.dtype(), [&]<typename T>(TypeTag<T>) {
    const T value = v.to<T>();
    elementwise_typed<T>(t, [value]() { return value; });
  });
}

// Written with ops (fill, view, copy), so they serve every device that has those kernels.
void slice_backward_kernel(OpCall& c) {
  Tensor& out = c.outputs[0];
  out.zero_();
  out.slice(c.attr<int64_t>(1), c.attr<int64_t>(2), c.attr<int64_t>(3), c.attr<int64_t>(4))
      .copy_(c.input(0));
}

void select_backward_kernel(OpCall& c) {
  Tensor& out = c.outputs[0];
  out.zero_();
  out.select(c.attr<int64_t>(1), c.attr<int64_t>(2)).copy_(c.input(0));
}

}  // namespace

KILN_REGISTER_KERNEL(slice_backward, kCPU, slice_backward_kernel);
KILN_REGISTER_KERNEL(select_backward, kCPU, select_backward_kernel);
#if defined(KILN_WITH_CUDA)
// Composite kernels: registered for CUDA too, where the ops they call run CUDA kernels.
KILN_REGISTER_KERNEL(slice_backward, kCUDA, slice_backward_kernel);
KILN_REGISTER_KERNEL(select_backward, kCUDA, select_backward_kernel);
#endif
KILN_REGISTER_KERNEL(to_copy, kCPU, to_copy_cpu);
KILN_REGISTER_KERNEL(copy_, kCPU, copy_cpu);
KILN_REGISTER_KERNEL(fill_, kCPU, fill_cpu);

}  // namespace kiln::cpu
