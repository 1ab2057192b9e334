// CPU kernels of the elementwise unary ops (tensor/ops/unary.cpp holds their dtype rules; the
// kernels themselves, shared with kernels/cuda/unary.cu, are kernels/unary_fn.h's UnaryKernels).
// What is the CPU's own: its loop, and a second spelling of some float formulas.
//
// Float ops have one or two spellings of the same formula:
//   - apply(x): the scalar formula of kernels/scalar_fn.h (shared with the CUDA kernels), used
//     on strided tensors, and for f16/bf16, which compute in float;
//   - an Eigen array expression (EigenSpelling below) used on contiguous f32/f64. GCC cannot
//     vectorise calls into libm (tanh, erf, log, sin, ...) without -ffast-math; Eigen's packet
//     math is faster on one core (8M floats, SSE2: tanh 12x, erf 10x, log1p 3.5x, log, sin and
//     cos 2x, expm1 1.5x).
// Ops without an Eigen spelling stay scalar on purpose: sqrt, rsqrt and reciprocal must be
// correctly rounded (Eigen's fast packet sqrt is not) and GCC vectorises the division itself;
// Eigen's packet exp clamps its input, so exp(-inf) would be 3e-39 instead of 0, while
// glibc's expf is nearly as fast (exp, sigmoid, silu).
#include <Eigen/Core>
#include <type_traits>
#include <unsupported/Eigen/SpecialFunctions>

#include "kernels/cpu/loops.h"
#include "kernels/scalar_fn.h"
#include "kernels/unary_fn.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

template <typename T>
using ArrayMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
template <typename T>
using ConstArrayMap = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;

// The Eigen spelling of float op Op (a scalar:: functor): of(a) is the formula as an Eigen array
// expression in a (element type T). Ops without one have kHas = false.
template <typename Op>
struct EigenSpelling {
  static constexpr bool kHas = false;
};

#define KILN_EIGEN_SPELLING(Name, vector_expr) \
  template <>                                  \
  struct EigenSpelling<scalar::Name> {         \
    static constexpr bool kHas = true;         \
    template <typename T, typename A>          \
    static auto of(const A& a) {               \
      return vector_expr;                      \
    }                                          \
  }

using scalar::kGeluTanhCoeff;
using scalar::kSqrt1_2;
using scalar::kSqrt2OverPi;

KILN_EIGEN_SPELLING(Log, a.log());
KILN_EIGEN_SPELLING(Log1p, a.log1p());
KILN_EIGEN_SPELLING(Expm1, a.expm1());
KILN_EIGEN_SPELLING(Sin, a.sin());
KILN_EIGEN_SPELLING(Cos, a.cos());
KILN_EIGEN_SPELLING(Tanh, a.tanh());
KILN_EIGEN_SPELLING(Erf, a.erf());
KILN_EIGEN_SPELLING(GeluExact, T(0.5) * a * (T(1) + (a * T(kSqrt1_2)).erf()));
KILN_EIGEN_SPELLING(GeluTanh,
                    T(0.5) * a *
                        (T(1) + (T(kSqrt2OverPi) * (a + T(kGeluTanhCoeff) * a.cube())).tanh()));
#undef KILN_EIGEN_SPELLING

// The device half of scalar::UnaryKernels (kernels/unary_fn.h).
struct CpuUnary {
  template <typename Out, typename... Ins, typename F>
  static void map(const Tensor& out, const F& f, TensorFor<Ins>... in) {
    elementwise_typed<Out, Ins...>(out, f, in...);
  }

  static Tensor as_dtype(const Tensor& t, ScalarType dtype) { return cpu::as_dtype(t, dtype); }

  // The Eigen path for contiguous f32/f64 of ops that have one. `if constexpr`, so that ops
  // without a spelling never instantiate it.
  template <typename Op, typename T>
  static bool vectorised(const Tensor& out, const Tensor& in) {
    if constexpr (EigenSpelling<Op>::kHas && std::is_floating_point_v<T>) {
      if (!in.is_contiguous() || !out.is_contiguous()) return false;
      const T* src = static_cast<const T*>(in.data_ptr());
      T* dst = static_cast<T*>(out.data_ptr());
      internal::parallel_for(0, out.numel(), internal::kGrainSize, [&](int64_t b, int64_t e) {
        ArrayMap<T>(dst + b, e - b) =
            EigenSpelling<Op>::template of<T>(ConstArrayMap<T>(src + b, e - b));
      });
      return true;
    } else {
      return false;
    }
  }
};

}  // namespace

#define KILN_REGISTER_UNARY(op, fn) \
  KILN_REGISTER_KERNEL(op, kCPU, scalar::UnaryKernels<CpuUnary>::fn);
KILN_UNARY_OPS(KILN_REGISTER_UNARY)
#undef KILN_REGISTER_UNARY

}  // namespace kiln::cpu
