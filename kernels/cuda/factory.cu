// CUDA kernels for the computed factories arange/linspace and eye (CPU: kernels/cpu/factory.cpp).
// Element i of arange is start + i * step in double (or in int64 for integer arguments), the
// CPU's formula, written with round-to-nearest intrinsics so that nvcc does not fuse it into an
// fma: the values are bit-identical to the CPU's.
#include "kernels/cuda/loops.cuh"

namespace kiln::cuda {
namespace {

template <typename T>
__global__ void arange_kernel(T* out, int64_t n, bool exact_int, int64_t istart, int64_t istep,
                              double start, double step) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    if (exact_int) {
      out[i] = static_cast<T>(static_cast<int64_t>(
          static_cast<uint64_t>(istart) + static_cast<uint64_t>(i) * static_cast<uint64_t>(istep)));
    } else {
      const double v = __dadd_rn(start, __dmul_rn(static_cast<double>(i), step));
      out[i] = scalar::convert<T>(v);  // the CPU's conversion (uint8 through int64)
    }
  }
}

void arange_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const int64_t n = out.numel();
  if (n == 0) return;
  const double start = c.attr<Scalar>(0).toDouble();
  const double step = c.attr<Scalar>(1).toDouble();
  const bool integral = !is_floating_point(out.dtype());
  const int64_t istart = c.attr<Scalar>(0).toLong(), istep = c.attr<Scalar>(1).toLong();
  const bool exact_int =
      integral && c.attr<Scalar>(0).is_integral(true) && c.attr<Scalar>(1).is_integral(true);
  DeviceGuard guard(out.device().index());
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    arange_kernel<T><<<loops::grid_for(n), loops::kThreads, 0, current_stream()>>>(
        static_cast<T*>(out.data_ptr()), n, exact_int, istart, istep, start, step);
    KILN_CUDA_LAUNCH_CHECK("arange_kernel");
  });
}

template <typename T>
__global__ void eye_kernel(T* out, int64_t n, int64_t m) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n * m;
       i += stride) {
    out[i] = i / m == i % m ? T(1.0f) : T(0.0f);
  }
}

void eye_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const int64_t n = out.sizes()[0], m = out.sizes()[1];
  if (n * m == 0) return;
  DeviceGuard guard(out.device().index());
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    eye_kernel<T><<<loops::grid_for(n * m), loops::kThreads, 0, current_stream()>>>(
        static_cast<T*>(out.data_ptr()), n, m);
    KILN_CUDA_LAUNCH_CHECK("eye_kernel");
  });
}

// empty: the dispatcher allocated the output; its contents stay uninitialised.
void empty_cuda(OpCall&) {}

}  // namespace

KILN_REGISTER_KERNEL(arange, kCUDA, arange_cuda);
KILN_REGISTER_KERNEL(empty, kCUDA, empty_cuda);
KILN_REGISTER_KERNEL(eye, kCUDA, eye_cuda);

}  // namespace kiln::cuda
