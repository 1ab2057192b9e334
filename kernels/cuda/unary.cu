// CUDA kernels of the elementwise unary ops (tensor/ops/unary.cpp holds their dtype rules; the
// CPU kernels are kernels/cpu/unary.cpp). The kernels themselves are kernels/unary_fn.h's
// UnaryKernels, shared with the CPU: the CPU's formulas (kernels/scalar_fn.h), computed in
// opmath_t (float for f16/bf16), here through the elementwise loop of kernels/cuda/loops.cuh.
// Integer results are bit-identical to the CPU's; float results differ from glibc's by the few ulps
// of CUDA's math library.
#include "kernels/cuda/loops.cuh"
#include "kernels/unary_fn.h"

namespace kiln::cuda {
namespace {

// The device half of scalar::UnaryKernels (kernels/unary_fn.h).
struct CudaUnary {
  template <typename Out, typename... Ins, typename F>
  static void map(const Tensor& out, const F& f, loops::TensorFor<Ins>... in) {
    loops::elementwise<Out, Ins...>(out, f, in...);
  }
  static Tensor as_dtype(const Tensor& t, ScalarType dtype) { return loops::as_dtype(t, dtype); }
  template <typename Op, typename T>
  static bool vectorised(const Tensor&, const Tensor&) {
    return false;  // loops::elementwise vectorises its loads and stores already
  }
};

}  // namespace

#define KILN_REGISTER_UNARY(op, fn) \
  KILN_REGISTER_KERNEL(op, kCUDA, scalar::UnaryKernels<CudaUnary>::fn);
KILN_UNARY_OPS(KILN_REGISTER_UNARY)
#undef KILN_REGISTER_UNARY

}  // namespace kiln::cuda
