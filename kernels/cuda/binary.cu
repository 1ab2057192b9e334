// CUDA kernels of the binary elementwise ops (tensor/ops/binary.cpp holds their dtype rules; CPU:
// kernels/cpu/binary.cpp; the kernels themselves, shared with the CPU, are kernels/binary_fn.h's
// BinaryKernels). What is the GPU's own: its loops.
//
// A 0-d CPU operand travels to the kernel by value; a 0-d GPU operand is converted on the device
// to the type the kernel reads, so no op waits for the device.
#include <type_traits>

#include "kernels/binary_fn.h"
#include "kernels/cuda/loops.cuh"

namespace kiln::cuda {
namespace {

using loops::as_dtype;
using scalar::ScalarRead;

// f(M(a), M(b)) for operands of element types A and B.
template <typename F, typename M, typename A, typename B>
struct Apply2 {
  F f;
  __device__ auto operator()(A a, B b) const { return f(static_cast<M>(a), static_cast<M>(b)); }
};

// A 0-d operand as the tensor the kernel reads: element type S (opmath or T).
template <typename S>
Tensor scalar_operand(const Tensor& t) {
  return loops::is_host_scalar(t) ? t : as_dtype(t, dtype_of<S>());
}

// The device half of scalar::BinaryKernels (kernels/binary_fn.h).
struct CudaBinary {
  template <typename T, typename Out, ScalarRead R, typename F>
  static void binary(const Tensor& out, const Tensor& a, const Tensor& b, const F& f) {
    using M = opmath_t<T>;
    using S = std::conditional_t<R == ScalarRead::kOpmath, M, T>;
    constexpr ScalarType kT = dtype_of<T>();
    if (b.dim() == 0) {
      loops::elementwise<Out, T, S>(out, Apply2<F, M, T, S>{f}, as_dtype(a, kT),
                                    scalar_operand<S>(b));
    } else if (a.dim() == 0) {
      loops::elementwise<Out, S, T>(out, Apply2<F, M, S, T>{f}, scalar_operand<S>(a),
                                    as_dtype(b, kT));
    } else {
      loops::elementwise<Out, T, T>(out, Apply2<F, M, T, T>{f}, as_dtype(a, kT), as_dtype(b, kT));
    }
  }

  template <typename Out, typename... Ins, typename F>
  static void map(const Tensor& out, const F& f, loops::TensorFor<Ins>... in) {
    loops::elementwise<Out, Ins...>(out, f, in...);
  }

  static Tensor as_dtype(const Tensor& t, ScalarType dtype) { return loops::as_dtype(t, dtype); }
  static Tensor empty(IntArrayRef sizes, ScalarType dtype, Device device) {
    return loops::empty_on(sizes, dtype, device);
  }
  static void copy(const Tensor& dst, const Tensor& src) { loops::copy_into(dst, src); }

  using ErrorFlag = loops::ErrorFlag;
};

}  // namespace

#define KILN_REGISTER_BINARY(op, fn) \
  KILN_REGISTER_KERNEL(op, kCUDA, scalar::BinaryKernels<CudaBinary>::fn);
KILN_BINARY_OPS(KILN_REGISTER_BINARY)
KILN_REGISTER_BINARY(gelu_backward, gelu_backward)
#undef KILN_REGISTER_BINARY

}  // namespace kiln::cuda
