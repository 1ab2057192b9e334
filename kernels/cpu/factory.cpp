// CPU kernels for the computed factories (arange/linspace, eye).
#include "kernels/cpu/loops.h"
#include "kernels/scalar_fn.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

void arange_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const double start = c.attr<Scalar>(0).toDouble();
  const double step = c.attr<Scalar>(1).toDouble();
  const bool integral = !is_floating_point(out.dtype());
  const int64_t istart = c.attr<Scalar>(0).toLong(), istep = c.attr<Scalar>(1).toLong();
  const bool exact_int = integral && c.attr<Scalar>(0).is_integral(true) && c.attr<Scalar>(1).is_integral(true);
  const int64_t n = out.numel();
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    T* p = out.data_ptr<T>();
    internal::parallel_for(0, n, internal::kGrainSize, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        if (exact_int) {
          p[i] = static_cast<T>(istart + i * istep);
        } else {
          p[i] = scalar::convert<T>(start + static_cast<double>(i) * step);  // uint8 via int64
        }
      }
    });
  });
}

void eye_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  out.impl();
  const int64_t n = out.sizes()[0], m = out.sizes()[1];
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    T* p = out.data_ptr<T>();
    for (int64_t i = 0; i < n * m; ++i) p[i] = T(0.0f);
    for (int64_t i = 0; i < std::min(n, m); ++i) p[i * m + i] = T(1.0f);
  });
}

// empty: the dispatcher allocated the output; its contents stay uninitialised.
void empty_cpu(OpCall&) {}

}  // namespace

KILN_REGISTER_KERNEL(arange, kCPU, arange_cpu);
KILN_REGISTER_KERNEL(empty, kCPU, empty_cpu);
KILN_REGISTER_KERNEL(eye, kCPU, eye_cpu);

}  // namespace kiln::cpu
