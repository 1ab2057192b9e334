// CPU kernels of the binary elementwise ops (tensor/ops/binary.cpp holds their dtype rules; the
// kernels themselves, shared with kernels/cuda/binary.cu, are kernels/binary_fn.h's
// BinaryKernels). What is the CPU's own: its loops.
//
// A 0-d operand (a wrapped Scalar or a 0-d tensor) is read once into a constant, so that
// `x * 0.5` runs as a one-input loop that vectorises.
#include <atomic>
#include <type_traits>

#include "kernels/binary_fn.h"
#include "kernels/cpu/loops.h"
#include "kernels/scalar_fn.h"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

using scalar::convert;
using scalar::ScalarRead;

// The value of a 0-d CPU tensor as opmath_t<T>: directly, or rounded to T on the way.
template <typename T, ScalarRead R>
opmath_t<T> read_scalar(const Tensor& t) {
  return visit_dtype(t.dtype(), [&]<typename S>(TypeTag<S>) -> opmath_t<T> {
    const S v = *static_cast<const S*>(t.data_ptr());
    if constexpr (R == ScalarRead::kOpmath) {
      return convert<opmath_t<T>>(v);
    } else {
      return static_cast<opmath_t<T>>(convert<T>(v));
    }
  });
}

// The device half of scalar::BinaryKernels (kernels/binary_fn.h).
struct CpuBinary {
  template <typename T, typename Out, ScalarRead R, typename F>
  static void binary(const Tensor& out, const Tensor& a, const Tensor& b, const F& f) {
    using M = opmath_t<T>;
    constexpr ScalarType kT = dtype_of<T>();
    if (b.dim() == 0) {
      const M y = read_scalar<T, R>(b);
      elementwise_typed<Out, T>(
          out, [=](T x) { return f(M(x), y); }, as_dtype(a, kT));
    } else if (a.dim() == 0) {
      const M x = read_scalar<T, R>(a);
      elementwise_typed<Out, T>(
          out, [=](T y) { return f(x, M(y)); }, as_dtype(b, kT));
    } else {
      elementwise_typed<Out, T, T>(
          out, [=](T x, T y) { return f(M(x), M(y)); }, as_dtype(a, kT), as_dtype(b, kT));
    }
  }

  template <typename Out, typename... Ins, typename F>
  static void map(const Tensor& out, const F& f, TensorFor<Ins>... in) {
    elementwise_typed<Out, Ins...>(out, f, in...);
  }

  static Tensor as_dtype(const Tensor& t, ScalarType dtype) { return cpu::as_dtype(t, dtype); }
  static Tensor empty(IntArrayRef sizes, ScalarType dtype, Device) {
    return kiln::empty(sizes, TensorOptions(dtype));
  }
  static void copy(const Tensor& dst, const Tensor& src) { copy_elements(dst, src); }

  // Raised from any thread of a loop.
  class ErrorFlag {
   public:
    struct View {
      std::atomic<bool>* raised;
      void raise(int64_t) const { raised->store(true, std::memory_order_relaxed); }
    };
    explicit ErrorFlag(Device) {}
    View view() const { return {&raised_}; }
    bool raised() const { return raised_.load(); }

   private:
    mutable std::atomic<bool> raised_{false};
  };
};

}  // namespace

#define KILN_REGISTER_BINARY(op, fn) \
  KILN_REGISTER_KERNEL(op, kCPU, scalar::BinaryKernels<CpuBinary>::fn);
KILN_BINARY_OPS(KILN_REGISTER_BINARY)
#undef KILN_REGISTER_BINARY

}  // namespace kiln::cpu
