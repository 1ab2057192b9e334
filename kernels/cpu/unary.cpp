// CPU kernels of the elementwise unary ops (tensor/ops/unary.cpp holds their dtype rules).
//
// Each op is a small functor. Float ops have one or two spellings of the same formula:
//   - scalar(x): used on strided tensors, and for f16/bf16, which compute in float;
//   - vector(a): an Eigen array expression used on contiguous f32/f64. GCC cannot vectorise
//     calls into libm (tanh, erf, log, sin, ...) without -ffast-math; Eigen's packet math
//     is faster on one core (8M floats, SSE2: tanh 12x, erf 10x, log1p 3.5x, log, sin and
//     cos 2x, expm1 1.5x).
// Ops without a vector spelling stay scalar on purpose: sqrt, rsqrt and reciprocal must be
// correctly rounded (Eigen's fast packet sqrt is not) and GCC vectorises the division itself;
// Eigen's packet exp clamps its input, so exp(-inf) would be 3e-39 instead of 0, while
// glibc's expf is nearly as fast (exp, sigmoid, silu).
#include <Eigen/Core>
#include <cmath>
#include <type_traits>
#include <unsupported/Eigen/SpecialFunctions>

#include "kernels/cpu/loops.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

// --- Float ops (outputs are floating; integer inputs were promoted by the meta rule) --------

template <typename T>
using ArrayMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
template <typename T>
using ConstArrayMap = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;

// Defines functor `Name`: `scalar_expr` in x (type T: float or double), `vector_expr` in the
// Eigen array a (element type T).
#define KILN_VECTOR_OP(Name, scalar_expr, vector_expr) \
  struct Name {                                        \
    static constexpr bool kVector = true;              \
    template <typename T>                              \
    static T scalar(T x) {                             \
      return scalar_expr;                              \
    }                                                  \
    template <typename T, typename A>                  \
    static auto vector(const A& a) {                   \
      return vector_expr;                              \
    }                                                  \
  }
#define KILN_SCALAR_OP(Name, scalar_expr)  \
  struct Name {                            \
    static constexpr bool kVector = false; \
    template <typename T>                  \
    static T scalar(T x) {                 \
      return scalar_expr;                  \
    }                                      \
  }

constexpr double kSqrt1_2 = 0.70710678118654752440;  // 1/sqrt(2)
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kGeluTanhCoeff = 0.044715;

KILN_VECTOR_OP(Log, std::log(x), a.log());
KILN_VECTOR_OP(Log1p, std::log1p(x), a.log1p());
KILN_VECTOR_OP(Expm1, std::expm1(x), a.expm1());
KILN_VECTOR_OP(Sin, std::sin(x), a.sin());
KILN_VECTOR_OP(Cos, std::cos(x), a.cos());
KILN_VECTOR_OP(Tanh, std::tanh(x), a.tanh());
KILN_VECTOR_OP(Erf, std::erf(x), a.erf());
KILN_VECTOR_OP(GeluExact, T(0.5) * x * (T(1) + std::erf(x * T(kSqrt1_2))),
               T(0.5) * a * (T(1) + (a * T(kSqrt1_2)).erf()));
KILN_VECTOR_OP(GeluTanh,
               T(0.5) * x *
                   (T(1) + std::tanh(T(kSqrt2OverPi) * (x + T(kGeluTanhCoeff) * x * x * x))),
               T(0.5) * a * (T(1) + (T(kSqrt2OverPi) * (a + T(kGeluTanhCoeff) * a.cube())).tanh()));
KILN_SCALAR_OP(Exp, std::exp(x));
KILN_SCALAR_OP(Sigmoid, T(1) / (T(1) + std::exp(-x)));
KILN_SCALAR_OP(Silu, x / (T(1) + std::exp(-x)));
KILN_SCALAR_OP(Sqrt, std::sqrt(x));
KILN_SCALAR_OP(Rsqrt, T(1) / std::sqrt(x));
KILN_SCALAR_OP(Reciprocal, T(1) / x);

// The Eigen-vectorised path for contiguous f32/f64 of ops that have one. A function template
// (not a branch inside the generic lambda below) so that ops without `vector` never
// instantiate it, on every compiler.
template <typename Op, typename T>
bool run_vectorised(const Tensor& out, const Tensor& in) {
  if constexpr (Op::kVector && std::is_floating_point_v<T>) {
    if (!in.is_contiguous() || !out.is_contiguous()) return false;
    const T* src = static_cast<const T*>(in.data_ptr());
    T* dst = static_cast<T*>(out.data_ptr());
    internal::parallel_for(0, out.numel(), internal::kGrainSize, [&](int64_t b, int64_t e) {
      ArrayMap<T>(dst + b, e - b) = Op::template vector<T>(ConstArrayMap<T>(src + b, e - b));
    });
    return true;
  } else {
    return false;
  }
}

template <typename Op>
void float_unary(const Tensor& out, const Tensor& input, std::string_view name) {
  const Tensor in = as_dtype(input, out.dtype());
  visit_floating(out.dtype(), name, [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    if (run_vectorised<Op, T>(out, in)) return;
    elementwise<T, T>(out, [](T v) { return T(Op::template scalar<M>(M(v))); }, in);
  });
}

// Serves the functional op and its in-place form (where outputs[0] is inputs[0]).
template <typename Op>
void float_unary_cpu(OpCall& c) {
  float_unary<Op>(c.outputs[0], c.input(0), c.name());
}

void gelu_cpu(OpCall& c) {
  if (c.attr<std::string>(0) == "tanh") {
    float_unary<GeluTanh>(c.outputs[0], c.input(0), "gelu");
  } else {
    float_unary<GeluExact>(c.outputs[0], c.input(0), "gelu");
  }
}

// --- Ops that keep the dtype (integers included) --------------------------------------------

// Integer negation and products wrap around like PyTorch's instead of overflowing (UB).
template <typename T>
T wrapping_neg(T x) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(U{0} - static_cast<U>(x));
  } else {
    return -x;
  }
}

template <typename T>
T wrapping_mul(T x, T y) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(x) * static_cast<U>(y));
  } else {
    return x * y;
  }
}

// Functor `Name` computing `expr` in x of type T (an integer, float or double).
#define KILN_NUMERIC_OP(Name, expr) \
  struct Name {                     \
    template <typename T>           \
    static T apply(T x) {           \
      return expr;                  \
    }                               \
  }

// Integers are already whole: floor, ceil and round return them unchanged.
template <typename T, typename F>
T whole(T x, F round_floating) {
  if constexpr (std::is_integral_v<T>) {
    return x;
  } else {
    return round_floating(x);
  }
}

template <typename T>
T abs_value(T x) {
  if constexpr (std::is_integral_v<T>) {
    return x < 0 ? wrapping_neg(x) : x;
  } else {
    return std::abs(x);  // clears the sign of -0.0 too
  }
}

KILN_NUMERIC_OP(Neg, wrapping_neg(x));
KILN_NUMERIC_OP(Abs, abs_value(x));
KILN_NUMERIC_OP(Relu, x < T(0) ? T(0) : x);  // NaN passes through, as in PyTorch
KILN_NUMERIC_OP(Sign, static_cast<T>((T(0) < x) - (x < T(0))));  // sign(NaN) = 0, as PyTorch
KILN_NUMERIC_OP(Square, wrapping_mul(x, x));
KILN_NUMERIC_OP(Floor, whole(x, [](auto v) { return std::floor(v); }));
KILN_NUMERIC_OP(Ceil, whole(x, [](auto v) { return std::ceil(v); }));
// nearbyint rounds half to even in the default rounding mode, as torch.round does.
KILN_NUMERIC_OP(Round, whole(x, [](auto v) { return std::nearbyint(v); }));

template <typename Op>
void numeric_unary_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor in = as_dtype(c.input(0), out.dtype());  // square: bool -> int64
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    if constexpr (std::is_same_v<T, bool>) {
      // Only sign keeps bool (the meta rules reject bool for the others): sign(b) = b.
      KILN_CHECK((std::is_same_v<Op, Sign>), "[", c.name(), "] not supported for bool tensors");
      elementwise<bool, bool>(out, [](bool v) { return v; }, in);
    } else {
      using M = opmath_t<T>;
      elementwise<T, T>(out, [](T v) { return T(Op::template apply<M>(M(v))); }, in);
    }
  });
}

void logical_not_cpu(OpCall& c) {
  const Tensor& in = c.input(0);
  visit_dtype(in.dtype(), [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    elementwise_typed<bool, T>(c.outputs[0], [](T v) { return static_cast<M>(v) == M(0); }, in);
  });
}

void bitwise_not_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    if constexpr (std::is_same_v<T, bool>) {
      elementwise<bool, bool>(out, [](bool v) { return !v; }, c.input(0));
    } else if constexpr (std::is_integral_v<T>) {
      elementwise<T, T>(out, [](T v) { return static_cast<T>(~v); }, c.input(0));
    } else {
      KILN_FAIL("[bitwise_not] not supported for ", dtype_name(out.dtype()));
    }
  });
}

// --- pow(tensor, scalar) ---------------------------------------------------------------------

// x^n for n >= 0 by squaring, wrapping on overflow.
template <typename T>
T int_pow(T x, int64_t n) {
  T result = 1;
  while (n > 0) {
    if (n & 1) result = wrapping_mul(result, x);
    x = wrapping_mul(x, x);
    n >>= 1;
  }
  return result;
}

template <typename T>
void pow_floating(const Tensor& out, const Tensor& in, double exponent) {
  using M = opmath_t<T>;
  auto run = [&](auto f) { elementwise<T, T>(out, [f](T v) { return T(f(M(v))); }, in); };
  // Common exponents skip the general pow (slow, and libm's pow does not vectorise).
  if (exponent == 2) {
    run([](M x) { return x * x; });
  } else if (exponent == 3) {
    run([](M x) { return x * x * x; });
  } else if (exponent == 0.5) {
    run([](M x) { return std::sqrt(x); });
  } else if (exponent == -0.5) {
    run([](M x) { return M(1) / std::sqrt(x); });
  } else if (exponent == -1) {
    run([](M x) { return M(1) / x; });
  } else if (exponent == -2) {
    run([](M x) { return M(1) / (x * x); });
  } else {
    const M e = static_cast<M>(exponent);
    run([e](M x) { return std::pow(x, e); });
  }
}

void pow_tensor_scalar_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor in = as_dtype(c.input(0), out.dtype());
  const Scalar& exponent = c.attr<Scalar>(0);
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    if constexpr (std::is_same_v<T, bool>) {
      KILN_FAIL("[pow] not supported for bool results");
    } else if constexpr (std::is_integral_v<T>) {
      const int64_t n = exponent.toLong();  // >= 0: the meta rule rejects negative ones
      elementwise<T, T>(out, [n](T x) { return int_pow(x, n); }, in);
    } else {
      pow_floating<T>(out, in, exponent.toDouble());
    }
  });
}

}  // namespace

KILN_REGISTER_KERNEL(exp, kCPU, float_unary_cpu<Exp>);
KILN_REGISTER_KERNEL(exp_, kCPU, float_unary_cpu<Exp>);
KILN_REGISTER_KERNEL(log, kCPU, float_unary_cpu<Log>);
KILN_REGISTER_KERNEL(log1p, kCPU, float_unary_cpu<Log1p>);
KILN_REGISTER_KERNEL(expm1, kCPU, float_unary_cpu<Expm1>);
KILN_REGISTER_KERNEL(sqrt, kCPU, float_unary_cpu<Sqrt>);
KILN_REGISTER_KERNEL(sqrt_, kCPU, float_unary_cpu<Sqrt>);
KILN_REGISTER_KERNEL(rsqrt, kCPU, float_unary_cpu<Rsqrt>);
KILN_REGISTER_KERNEL(sin, kCPU, float_unary_cpu<Sin>);
KILN_REGISTER_KERNEL(cos, kCPU, float_unary_cpu<Cos>);
KILN_REGISTER_KERNEL(tanh, kCPU, float_unary_cpu<Tanh>);
KILN_REGISTER_KERNEL(sigmoid, kCPU, float_unary_cpu<Sigmoid>);
KILN_REGISTER_KERNEL(silu, kCPU, float_unary_cpu<Silu>);
KILN_REGISTER_KERNEL(erf, kCPU, float_unary_cpu<Erf>);
KILN_REGISTER_KERNEL(reciprocal, kCPU, float_unary_cpu<Reciprocal>);
KILN_REGISTER_KERNEL(gelu, kCPU, gelu_cpu);
KILN_REGISTER_KERNEL(neg, kCPU, numeric_unary_cpu<Neg>);
KILN_REGISTER_KERNEL(neg_, kCPU, numeric_unary_cpu<Neg>);
KILN_REGISTER_KERNEL(abs, kCPU, numeric_unary_cpu<Abs>);
KILN_REGISTER_KERNEL(relu, kCPU, numeric_unary_cpu<Relu>);
KILN_REGISTER_KERNEL(relu_, kCPU, numeric_unary_cpu<Relu>);
KILN_REGISTER_KERNEL(sign, kCPU, numeric_unary_cpu<Sign>);
KILN_REGISTER_KERNEL(square, kCPU, numeric_unary_cpu<Square>);
KILN_REGISTER_KERNEL(floor, kCPU, numeric_unary_cpu<Floor>);
KILN_REGISTER_KERNEL(ceil, kCPU, numeric_unary_cpu<Ceil>);
KILN_REGISTER_KERNEL(round, kCPU, numeric_unary_cpu<Round>);
KILN_REGISTER_KERNEL(logical_not, kCPU, logical_not_cpu);
KILN_REGISTER_KERNEL(bitwise_not, kCPU, bitwise_not_cpu);
KILN_REGISTER_KERNEL(pow_tensor_scalar, kCPU, pow_tensor_scalar_cpu);

}  // namespace kiln::cpu
