// CUDA kernels of the elementwise unary ops (tensor/ops/unary.cpp holds their dtype rules; the
// CPU kernels are kernels/cpu/unary.cpp). The same formulas as the CPU, computed in opmath_t
// (float for f16/bf16) through the elementwise machinery of kernels/cuda/loops.cuh. Integer
// results are bit-identical to the CPU's; float results differ from glibc's by the few ulps of
// CUDA's math library.
#include <type_traits>

#include "kernels/cuda/loops.cuh"

namespace kiln::cuda {
namespace {

using loops::as_dtype;
using loops::elementwise;
namespace dm = loops::dmath;

// --- Float ops (outputs are floating; integer inputs were promoted by the meta rule) --------

constexpr double kSqrt1_2 = 0.70710678118654752440;  // 1/sqrt(2)
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kGeluTanhCoeff = 0.044715;

#define KILN_CUDA_FLOAT_OP(Name, expr)               \
  struct Name {                                      \
    template <typename M>                            \
    __device__ __forceinline__ static M apply(M x) { \
      return expr;                                   \
    }                                                \
  }

KILN_CUDA_FLOAT_OP(Exp, dm::exp(x));
KILN_CUDA_FLOAT_OP(Log, dm::log(x));
KILN_CUDA_FLOAT_OP(Log1p, dm::log1p(x));
KILN_CUDA_FLOAT_OP(Expm1, dm::expm1(x));
KILN_CUDA_FLOAT_OP(Sqrt, dm::sqrt(x));
KILN_CUDA_FLOAT_OP(Rsqrt, M(1) / dm::sqrt(x));
KILN_CUDA_FLOAT_OP(Sin, dm::sin(x));
KILN_CUDA_FLOAT_OP(Cos, dm::cos(x));
KILN_CUDA_FLOAT_OP(Tanh, dm::tanh(x));
KILN_CUDA_FLOAT_OP(Sigmoid, M(1) / (M(1) + dm::exp(-x)));
KILN_CUDA_FLOAT_OP(Silu, x / (M(1) + dm::exp(-x)));
KILN_CUDA_FLOAT_OP(Erf, dm::erf(x));
KILN_CUDA_FLOAT_OP(Reciprocal, M(1) / x);
KILN_CUDA_FLOAT_OP(GeluExact, M(0.5) * x * (M(1) + dm::erf(x * M(kSqrt1_2))));
KILN_CUDA_FLOAT_OP(GeluTanh,
                   M(0.5) * x *
                       (M(1) + dm::tanh(M(kSqrt2OverPi) * (x + M(kGeluTanhCoeff) * x * x * x))));
#undef KILN_CUDA_FLOAT_OP

template <typename T, typename Op>
struct FloatFn {
  __device__ T operator()(T v) const {
    using M = opmath_t<T>;
    return T(Op::apply(static_cast<M>(v)));
  }
};

template <typename Op>
void float_unary(const Tensor& out, const Tensor& input, std::string_view name) {
  const Tensor in = as_dtype(input, out.dtype());
  visit_floating(out.dtype(), name,
                 [&]<typename T>(TypeTag<T>) { elementwise<T, T>(out, FloatFn<T, Op>{}, in); });
}

// Serves the functional op and its in-place form (where outputs[0] is inputs[0]).
template <typename Op>
void float_unary_cuda(OpCall& c) {
  float_unary<Op>(c.outputs[0], c.input(0), c.name());
}

void gelu_cuda(OpCall& c) {
  if (c.attr<std::string>(0) == "tanh") {
    float_unary<GeluTanh>(c.outputs[0], c.input(0), "gelu");
  } else {
    float_unary<GeluExact>(c.outputs[0], c.input(0), "gelu");
  }
}

// --- Ops that keep the dtype (integers included) --------------------------------------------

// Integer negation and products wrap around like PyTorch's instead of overflowing.
template <typename T>
__device__ __forceinline__ T wrapping_neg(T x) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(U{0} - static_cast<U>(x));
  } else {
    return -x;
  }
}

template <typename T>
__device__ __forceinline__ T wrapping_mul(T x, T y) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(x) * static_cast<U>(y));
  } else {
    return x * y;
  }
}

#define KILN_CUDA_NUMERIC_OP(Name, expr)             \
  struct Name {                                      \
    template <typename T>                            \
    __device__ __forceinline__ static T apply(T x) { \
      return expr;                                   \
    }                                                \
  }

// Integers are already whole: floor, ceil and round return them unchanged.
template <typename T>
__device__ __forceinline__ T floor_of(T x) {
  if constexpr (std::is_integral_v<T>) {
    return x;
  } else {
    return dm::floor(x);
  }
}
template <typename T>
__device__ __forceinline__ T ceil_of(T x) {
  if constexpr (std::is_integral_v<T>) {
    return x;
  } else {
    return dm::ceil(x);
  }
}
template <typename T>
__device__ __forceinline__ T round_of(T x) {
  if constexpr (std::is_integral_v<T>) {
    return x;
  } else {
    return dm::rint(x);  // half to even, as torch.round (and nearbyint on the CPU)
  }
}
template <typename T>
__device__ __forceinline__ T abs_value(T x) {
  if constexpr (std::is_integral_v<T>) {
    return x < 0 ? wrapping_neg(x) : x;
  } else {
    return dm::abs(x);
  }
}

KILN_CUDA_NUMERIC_OP(Neg, wrapping_neg(x));
KILN_CUDA_NUMERIC_OP(Abs, abs_value(x));
KILN_CUDA_NUMERIC_OP(Relu, x < T(0) ? T(0) : x);  // NaN passes through, as in PyTorch
KILN_CUDA_NUMERIC_OP(Sign, static_cast<T>((T(0) < x) - (x < T(0))));  // sign(NaN) = 0
KILN_CUDA_NUMERIC_OP(Square, wrapping_mul(x, x));
KILN_CUDA_NUMERIC_OP(Floor, floor_of(x));
KILN_CUDA_NUMERIC_OP(Ceil, ceil_of(x));
KILN_CUDA_NUMERIC_OP(Round, round_of(x));
#undef KILN_CUDA_NUMERIC_OP

template <typename T, typename Op>
struct NumericFn {
  __device__ T operator()(T v) const {
    using M = opmath_t<T>;
    return T(Op::apply(static_cast<M>(v)));
  }
};

struct Identity {
  __device__ bool operator()(bool v) const { return v; }
};

template <typename Op>
void numeric_unary_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor in = as_dtype(c.input(0), out.dtype());  // square: bool -> int64
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    if constexpr (std::is_same_v<T, bool>) {
      // Only sign keeps bool (the meta rules reject bool for the others): sign(b) = b.
      KILN_CHECK((std::is_same_v<Op, Sign>), "[", c.name(), "] not supported for bool tensors");
      elementwise<bool, bool>(out, Identity{}, in);
    } else {
      elementwise<T, T>(out, NumericFn<T, Op>{}, in);
    }
  });
}

template <typename T>
struct LogicalNot {
  __device__ bool operator()(T v) const {
    using M = opmath_t<T>;
    return static_cast<M>(v) == M(0);
  }
};

void logical_not_cuda(OpCall& c) {
  const Tensor& in = c.input(0);
  visit_dtype(in.dtype(), [&]<typename T>(TypeTag<T>) {
    elementwise<bool, T>(c.outputs[0], LogicalNot<T>{}, in);
  });
}

template <typename T>
struct BitwiseNot {
  __device__ T operator()(T v) const {
    if constexpr (std::is_same_v<T, bool>) {
      return !v;
    } else {
      return static_cast<T>(~v);
    }
  }
};

void bitwise_not_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    if constexpr (std::is_integral_v<T>) {  // bool included
      elementwise<T, T>(out, BitwiseNot<T>{}, c.input(0));
    } else {
      KILN_FAIL("[bitwise_not] not supported for ", dtype_name(out.dtype()));
    }
  });
}

// --- pow(tensor, scalar) ---------------------------------------------------------------------

// x^n for n >= 0 by squaring, wrapping on overflow.
template <typename T>
struct IntPowScalar {
  int64_t n;
  __device__ T operator()(T x) const {
    T result = 1;
    for (int64_t e = n; e > 0; e >>= 1) {
      if (e & 1) result = wrapping_mul(result, x);
      x = wrapping_mul(x, x);
    }
    return result;
  }
};

enum class PowKind { kSquare, kCube, kSqrt, kRsqrt, kReciprocal, kInvSquare, kGeneral };

template <typename T, PowKind kKind>
struct FloatPowScalar {
  opmath_t<T> e;
  __device__ T operator()(T v) const {
    using M = opmath_t<T>;
    const M x = static_cast<M>(v);
    if constexpr (kKind == PowKind::kSquare) {
      return T(x * x);
    } else if constexpr (kKind == PowKind::kCube) {
      return T(x * x * x);
    } else if constexpr (kKind == PowKind::kSqrt) {
      return T(dm::sqrt(x));
    } else if constexpr (kKind == PowKind::kRsqrt) {
      return T(M(1) / dm::sqrt(x));
    } else if constexpr (kKind == PowKind::kReciprocal) {
      return T(M(1) / x);
    } else if constexpr (kKind == PowKind::kInvSquare) {
      return T(M(1) / (x * x));
    } else {
      return T(dm::pow(x, e));
    }
  }
};

template <typename T>
void pow_floating(const Tensor& out, const Tensor& in, double exponent) {
  using M = opmath_t<T>;
  const M e = static_cast<M>(exponent);
  auto run = [&]<PowKind kKind>() { elementwise<T, T>(out, FloatPowScalar<T, kKind>{e}, in); };
  // The CPU's special cases, so that results agree (x * x is exact where pow may not be).
  if (exponent == 2) {
    run.template operator()<PowKind::kSquare>();
  } else if (exponent == 3) {
    run.template operator()<PowKind::kCube>();
  } else if (exponent == 0.5) {
    run.template operator()<PowKind::kSqrt>();
  } else if (exponent == -0.5) {
    run.template operator()<PowKind::kRsqrt>();
  } else if (exponent == -1) {
    run.template operator()<PowKind::kReciprocal>();
  } else if (exponent == -2) {
    run.template operator()<PowKind::kInvSquare>();
  } else {
    run.template operator()<PowKind::kGeneral>();
  }
}

void pow_tensor_scalar_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor in = as_dtype(c.input(0), out.dtype());
  const Scalar& exponent = c.attr<Scalar>(0);
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    if constexpr (std::is_same_v<T, bool>) {
      KILN_FAIL("[pow] not supported for bool results");
    } else if constexpr (std::is_integral_v<T>) {
      elementwise<T, T>(out, IntPowScalar<T>{exponent.toLong()}, in);
    } else {
      pow_floating<T>(out, in, exponent.toDouble());
    }
  });
}

}  // namespace

KILN_REGISTER_KERNEL(exp, kCUDA, float_unary_cuda<Exp>);
KILN_REGISTER_KERNEL(exp_, kCUDA, float_unary_cuda<Exp>);
KILN_REGISTER_KERNEL(log, kCUDA, float_unary_cuda<Log>);
KILN_REGISTER_KERNEL(log1p, kCUDA, float_unary_cuda<Log1p>);
KILN_REGISTER_KERNEL(expm1, kCUDA, float_unary_cuda<Expm1>);
KILN_REGISTER_KERNEL(sqrt, kCUDA, float_unary_cuda<Sqrt>);
KILN_REGISTER_KERNEL(sqrt_, kCUDA, float_unary_cuda<Sqrt>);
KILN_REGISTER_KERNEL(rsqrt, kCUDA, float_unary_cuda<Rsqrt>);
KILN_REGISTER_KERNEL(sin, kCUDA, float_unary_cuda<Sin>);
KILN_REGISTER_KERNEL(cos, kCUDA, float_unary_cuda<Cos>);
KILN_REGISTER_KERNEL(tanh, kCUDA, float_unary_cuda<Tanh>);
KILN_REGISTER_KERNEL(sigmoid, kCUDA, float_unary_cuda<Sigmoid>);
KILN_REGISTER_KERNEL(silu, kCUDA, float_unary_cuda<Silu>);
KILN_REGISTER_KERNEL(erf, kCUDA, float_unary_cuda<Erf>);
KILN_REGISTER_KERNEL(reciprocal, kCUDA, float_unary_cuda<Reciprocal>);
KILN_REGISTER_KERNEL(gelu, kCUDA, gelu_cuda);
KILN_REGISTER_KERNEL(neg, kCUDA, numeric_unary_cuda<Neg>);
KILN_REGISTER_KERNEL(neg_, kCUDA, numeric_unary_cuda<Neg>);
KILN_REGISTER_KERNEL(abs, kCUDA, numeric_unary_cuda<Abs>);
KILN_REGISTER_KERNEL(relu, kCUDA, numeric_unary_cuda<Relu>);
KILN_REGISTER_KERNEL(relu_, kCUDA, numeric_unary_cuda<Relu>);
KILN_REGISTER_KERNEL(sign, kCUDA, numeric_unary_cuda<Sign>);
KILN_REGISTER_KERNEL(square, kCUDA, numeric_unary_cuda<Square>);
KILN_REGISTER_KERNEL(floor, kCUDA, numeric_unary_cuda<Floor>);
KILN_REGISTER_KERNEL(ceil, kCUDA, numeric_unary_cuda<Ceil>);
KILN_REGISTER_KERNEL(round, kCUDA, numeric_unary_cuda<Round>);
KILN_REGISTER_KERNEL(logical_not, kCUDA, logical_not_cuda);
KILN_REGISTER_KERNEL(bitwise_not, kCUDA, bitwise_not_cuda);
KILN_REGISTER_KERNEL(pow_tensor_scalar, kCUDA, pow_tensor_scalar_cuda);

}  // namespace kiln::cuda
