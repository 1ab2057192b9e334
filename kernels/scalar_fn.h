// The per-element formulas of the elementwise ops, shared by the CPU kernels
// (kernels/cpu/unary.cpp, binary.cpp) and the CUDA kernels (kernels/cuda/unary.cu, binary.cu) so
// that both backends compute the same expressions: integer results are bit-identical, float
// results differ only by the math library (glibc on the host, CUDA's on the device).
//
//   #include "kernels/scalar_fn.h"
//   const M y = scalar::GeluTanh::apply(x);            // a unary op's functor (M: opmath type)
//   const M q = scalar::floor_div_float(a, b);         // Python's float floor division
//   const float e = scalar::math::exp(1.0f);           // expf on float, exp on double
//
// Everything is __host__ __device__ under nvcc and plain inline under the host compiler.
// M is the arithmetic type of an op: opmath_t<T> (float for f16/bf16), an integer type for
// the ops that keep integer dtypes. Internal to kernels/.
#pragma once

#if defined(__CUDACC_RTC__)
// Under NVRTC (fused_cuda's generated kernels, compiler/fused_cuda.h): no C++ library there; the
// few traits and types this file uses.
#include "compiler/fused_cuda_rtc.h"
#else
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "tensor/dtype.h"
#endif

#if defined(__CUDACC__)
#define KILN_SCALAR_HD __host__ __device__ __forceinline__
#else
#define KILN_SCALAR_HD inline
#endif

namespace kiln::scalar {

// --- Math overloads for float and double -----------------------------------------------------

// The C library's float and double functions by name, for both sides: on the host ::expf is
// glibc's (what std::exp(float) calls), on the device CUDA's. kernels/cuda/loops.cuh calls this
// namespace loops::dmath.
namespace math {
KILN_SCALAR_HD float exp(float x) { return ::expf(x); }
KILN_SCALAR_HD double exp(double x) { return ::exp(x); }
KILN_SCALAR_HD float log(float x) { return ::logf(x); }
KILN_SCALAR_HD double log(double x) { return ::log(x); }
KILN_SCALAR_HD float log1p(float x) { return ::log1pf(x); }
KILN_SCALAR_HD double log1p(double x) { return ::log1p(x); }
KILN_SCALAR_HD float expm1(float x) { return ::expm1f(x); }
KILN_SCALAR_HD double expm1(double x) { return ::expm1(x); }
KILN_SCALAR_HD float sqrt(float x) { return ::sqrtf(x); }
KILN_SCALAR_HD double sqrt(double x) { return ::sqrt(x); }
KILN_SCALAR_HD float sin(float x) { return ::sinf(x); }
KILN_SCALAR_HD double sin(double x) { return ::sin(x); }
KILN_SCALAR_HD float cos(float x) { return ::cosf(x); }
KILN_SCALAR_HD double cos(double x) { return ::cos(x); }
KILN_SCALAR_HD float tanh(float x) { return ::tanhf(x); }
KILN_SCALAR_HD double tanh(double x) { return ::tanh(x); }
KILN_SCALAR_HD float erf(float x) { return ::erff(x); }
KILN_SCALAR_HD double erf(double x) { return ::erf(x); }
KILN_SCALAR_HD float pow(float x, float y) { return ::powf(x, y); }
KILN_SCALAR_HD double pow(double x, double y) { return ::pow(x, y); }
KILN_SCALAR_HD float atan2(float y, float x) { return ::atan2f(y, x); }
KILN_SCALAR_HD double atan2(double y, double x) { return ::atan2(y, x); }
KILN_SCALAR_HD float fmod(float x, float y) { return ::fmodf(x, y); }
KILN_SCALAR_HD double fmod(double x, double y) { return ::fmod(x, y); }
KILN_SCALAR_HD float floor(float x) { return ::floorf(x); }
KILN_SCALAR_HD double floor(double x) { return ::floor(x); }
KILN_SCALAR_HD float ceil(float x) { return ::ceilf(x); }
KILN_SCALAR_HD double ceil(double x) { return ::ceil(x); }
KILN_SCALAR_HD float trunc(float x) { return ::truncf(x); }
KILN_SCALAR_HD double trunc(double x) { return ::trunc(x); }
KILN_SCALAR_HD float abs(float x) { return ::fabsf(x); }  // clears the sign of -0.0 too
KILN_SCALAR_HD double abs(double x) { return ::fabs(x); }
KILN_SCALAR_HD float copysign(float x, float y) { return ::copysignf(x, y); }
KILN_SCALAR_HD double copysign(double x, double y) { return ::copysign(x, y); }
// Half to even, as torch.round: nearbyint on the host (rint's value without raising the
// inexact flag), rint on the device (no floating-point flags there).
KILN_SCALAR_HD float round_half_even(float x) {
#if defined(__CUDA_ARCH__)
  return ::rintf(x);
#else
  return ::nearbyintf(x);
#endif
}
KILN_SCALAR_HD double round_half_even(double x) {
#if defined(__CUDA_ARCH__)
  return ::rint(x);
#else
  return ::nearbyint(x);
#endif
}
// False for every non-floating type.
template <typename M>
KILN_SCALAR_HD bool is_nan(M v) {
  if constexpr (std::is_floating_point_v<M>) {
    return v != v;
  } else {
    return false;
  }
}
// True for every non-floating type.
template <typename M>
KILN_SCALAR_HD bool is_finite(M v) {
  if constexpr (std::is_floating_point_v<M>) {
#if defined(__CUDA_ARCH__)
    return ::isfinite(v);
#else
    return std::isfinite(v);
#endif
  } else {
    return true;
  }
}
}  // namespace math

// --- Conversions ------------------------------------------------------------------------------

// A number as uint8 the way PyTorch converts it: floats through int64 (c10 does the same, since
// a negative float to an unsigned type is undefined in C++), so 2.7 -> 2, -1.0 -> 255 and
// 300.0 -> 44; NaN, infinities and floats beyond int64 (undefined too) give 0, as x86's
// conversion does. Integers wrap modulo 256.
template <typename M>
KILN_SCALAR_HD uint8_t to_uint8(M v) {
  if constexpr (std::is_floating_point_v<M>) {
    constexpr M kLimit = M(9.2e18);  // inside int64's range for float and double
    if (!(v > -kLimit && v < kLimit)) return 0;
    return static_cast<uint8_t>(static_cast<int64_t>(v));
  } else {
    return static_cast<uint8_t>(v);
  }
}

// v (of element type S) as a D, through S's arithmetic type (float for f16/bf16): how the
// binary kernels convert a 0-d operand, and the copy kernels every element.
template <typename D, typename S>
KILN_SCALAR_HD D convert(S v) {
  const opmath_t<S> m = static_cast<opmath_t<S>>(v);
  if constexpr (std::is_same_v<D, bool>) {
    return m != opmath_t<S>(0);
  } else if constexpr (std::is_same_v<D, Half> || std::is_same_v<D, BFloat16>) {
    return D(static_cast<float>(m));
  } else if constexpr (std::is_same_v<D, uint8_t>) {
    return to_uint8(m);
  } else {
    return static_cast<D>(m);
  }
}

// --- Integer helpers -------------------------------------------------------------------------

// Integer negation and products wrap around like PyTorch's instead of overflowing (UB).
template <typename T>
KILN_SCALAR_HD T wrapping_neg(T x) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(U{0} - static_cast<U>(x));
  } else {
    return -x;
  }
}

template <typename T>
KILN_SCALAR_HD T wrapping_mul(T x, T y) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(x) * static_cast<U>(y));
  } else {
    return x * y;
  }
}

// x^n for n >= 0 by squaring, wrapping on overflow (pow(tensor, scalar) of integers).
template <typename T>
KILN_SCALAR_HD T int_pow_scalar(T x, int64_t n) {
  T result = 1;
  while (n > 0) {
    if (n & 1) result = wrapping_mul(result, x);
    x = wrapping_mul(x, x);
    n >>= 1;
  }
  return result;
}

// Integer power by squaring, wrapping on overflow; negative exponents give 0 except for bases
// 1 and -1, as PyTorch (pow of two integer tensors).
template <typename M>
KILN_SCALAR_HD M int_pow(M base, M exp) {
  if constexpr (std::is_signed_v<M>) {
    if (exp < 0) {
      if (base == 1) return 1;
      if (base == -1) return (exp & 1) ? -1 : 1;
      return 0;
    }
  }
  using U = std::make_unsigned_t<M>;
  U result = 1, b = static_cast<U>(base);
  for (U e = static_cast<U>(exp); e != 0; e >>= 1) {
    if (e & 1) result *= b;
    b *= b;
  }
  return static_cast<M>(result);
}

// Integer division that never traps: a zero divisor sets `by_zero` (the caller raises after the
// loop) and x / -1 wraps like two's complement instead of overflowing. kFloor rounds the
// quotient down (Python's //), otherwise toward zero.
template <bool kFloor, typename M>
KILN_SCALAR_HD M int_div(M x, M y, bool& by_zero) {
  if constexpr (std::is_same_v<M, bool>) {
    if (!y) by_zero = true;
    return x;
  } else {
    if (y == 0) {
      by_zero = true;
      return 0;
    }
    if constexpr (std::is_unsigned_v<M>) {  // uint8: no negative operands, no overflow
      return static_cast<M>(x / y);
    } else {
      using U = std::make_unsigned_t<M>;
      if (y == -1) return static_cast<M>(U(0) - static_cast<U>(x));
      M q = x / y;
      if constexpr (kFloor) {
        if (x % y != 0 && ((x < 0) != (y < 0))) --q;
      }
      return q;
    }
  }
}

// --- Float unary ops (outputs are floating; M is float or double) ----------------------------

inline constexpr double kSqrt1_2 = 0.70710678118654752440;  // 1/sqrt(2)
inline constexpr double kSqrt2OverPi = 0.79788456080286535588;
inline constexpr double kInvSqrt2Pi = 0.39894228040143267794;  // 1/sqrt(2 pi)
inline constexpr double kGeluTanhCoeff = 0.044715;

// Defines functor `Name` with `static M apply(M x)` computing `expr`.
#define KILN_SCALAR_UNARY(Name, expr)    \
  struct Name {                          \
    template <typename M>                \
    static KILN_SCALAR_HD M apply(M x) { \
      return expr;                       \
    }                                    \
  }

KILN_SCALAR_UNARY(Exp, math::exp(x));
KILN_SCALAR_UNARY(Log, math::log(x));
KILN_SCALAR_UNARY(Log1p, math::log1p(x));
KILN_SCALAR_UNARY(Expm1, math::expm1(x));
KILN_SCALAR_UNARY(Sqrt, math::sqrt(x));
KILN_SCALAR_UNARY(Rsqrt, M(1) / math::sqrt(x));
KILN_SCALAR_UNARY(Sin, math::sin(x));
KILN_SCALAR_UNARY(Cos, math::cos(x));
KILN_SCALAR_UNARY(Tanh, math::tanh(x));
KILN_SCALAR_UNARY(Sigmoid, M(1) / (M(1) + math::exp(-x)));
KILN_SCALAR_UNARY(Silu, x / (M(1) + math::exp(-x)));
KILN_SCALAR_UNARY(Erf, math::erf(x));
KILN_SCALAR_UNARY(Reciprocal, M(1) / x);
KILN_SCALAR_UNARY(GeluExact, M(0.5) * x * (M(1) + math::erf(x * M(kSqrt1_2))));
KILN_SCALAR_UNARY(GeluTanh,
                  M(0.5) * x *
                      (M(1) + math::tanh(M(kSqrt2OverPi) * (x + M(kGeluTanhCoeff) * x * x * x))));

// gelu'(x), the derivative gelu_backward multiplies the gradient by (tensor/ops/unary.cpp).
// Exact: Phi(x) + x phi(x); at x = +-inf the second term (inf * 0) is 0.
struct GeluExactGrad {
  template <typename M>
  static KILN_SCALAR_HD M apply(M x) {
    const M xp = x * math::exp(M(-0.5) * x * x) * M(kInvSqrt2Pi);
    return M(0.5) * (M(1) + math::erf(x * M(kSqrt1_2))) + (xp == xp ? xp : M(0));
  }
};
// Tanh: with u = sqrt(2/pi) (x + 0.044715 x^3) and s = sigmoid(2u) = (1 + tanh u) / 2,
// gelu'(x) = s + 2 x u' s (1 - s). s and 1 - s come from one exp of -2|u| each without the
// cancellation of 1 - tanh(u); past |u| = 40 the second term is below 1e-30 and is dropped, so
// that huge |x| (x^3 overflowing) gives 1 or 0, not inf * 0.
struct GeluTanhGrad {
  template <typename M>
  static KILN_SCALAR_HD M apply(M x) {
    const M x2 = x * x;
    const M u = M(kSqrt2OverPi) * (x + M(kGeluTanhCoeff) * x2 * x);
    const M au = u < M(0) ? -u : u;
    if (au > M(40)) return u > M(0) ? M(1) : M(0);
    const M e = math::exp(M(-2) * au);
    const M r = M(1) / (M(1) + e);
    const M s = u >= M(0) ? r : e * r;
    const M s1 = u >= M(0) ? e * r : r;
    const M du = M(kSqrt2OverPi) * (M(1) + M(3 * kGeluTanhCoeff) * x2);
    return s + M(2) * x * du * s * s1;
  }
};

// --- Unary ops that keep the dtype (M may be an integer type) --------------------------------

// Integers are already whole: floor, ceil and round return them unchanged.
template <typename M>
KILN_SCALAR_HD M floor_of(M x) {
  if constexpr (std::is_integral_v<M>) {
    return x;
  } else {
    return math::floor(x);
  }
}
template <typename M>
KILN_SCALAR_HD M ceil_of(M x) {
  if constexpr (std::is_integral_v<M>) {
    return x;
  } else {
    return math::ceil(x);
  }
}
template <typename M>
KILN_SCALAR_HD M round_of(M x) {
  if constexpr (std::is_integral_v<M>) {
    return x;
  } else {
    return math::round_half_even(x);
  }
}
template <typename M>
KILN_SCALAR_HD M abs_value(M x) {
  if constexpr (std::is_unsigned_v<M>) {
    return x;
  } else if constexpr (std::is_integral_v<M>) {
    return x < 0 ? wrapping_neg(x) : x;
  } else {
    return math::abs(x);
  }
}

// x < 0; false for NaN and for unsigned types (without a comparison compilers flag as pointless).
template <typename M>
KILN_SCALAR_HD bool is_negative(M x) {
  if constexpr (std::is_unsigned_v<M>) {
    return false;
  } else {
    return x < M(0);
  }
}

KILN_SCALAR_UNARY(Neg, wrapping_neg(x));
KILN_SCALAR_UNARY(Abs, abs_value(x));
KILN_SCALAR_UNARY(Relu, is_negative(x) ? M(0) : x);  // NaN passes through, as in PyTorch
// sign(NaN) = 0, as PyTorch's.
KILN_SCALAR_UNARY(Sign, static_cast<M>((M(0) < x) - is_negative(x)));
KILN_SCALAR_UNARY(Square, wrapping_mul(x, x));
KILN_SCALAR_UNARY(Floor, floor_of(x));
KILN_SCALAR_UNARY(Ceil, ceil_of(x));
KILN_SCALAR_UNARY(Round, round_of(x));
#undef KILN_SCALAR_UNARY

// --- pow(tensor, scalar) of floats -------------------------------------------------------------

// Common exponents skip the general pow (slow, may be inexact where x * x is exact, and libm's
// does not vectorise).
enum class PowKind { kSquare, kCube, kSqrt, kRsqrt, kReciprocal, kInvSquare, kGeneral };

inline PowKind pow_kind(double exponent) {
  if (exponent == 2) return PowKind::kSquare;
  if (exponent == 3) return PowKind::kCube;
  if (exponent == 0.5) return PowKind::kSqrt;
  if (exponent == -0.5) return PowKind::kRsqrt;
  if (exponent == -1) return PowKind::kReciprocal;
  if (exponent == -2) return PowKind::kInvSquare;
  return PowKind::kGeneral;
}

// Calls f.template operator()<kind>() with the PowKind of `exponent` as a constant.
template <typename F>
void visit_pow_kind(double exponent, F&& f) {
  switch (pow_kind(exponent)) {
    case PowKind::kSquare:
      return f.template operator()<PowKind::kSquare>();
    case PowKind::kCube:
      return f.template operator()<PowKind::kCube>();
    case PowKind::kSqrt:
      return f.template operator()<PowKind::kSqrt>();
    case PowKind::kRsqrt:
      return f.template operator()<PowKind::kRsqrt>();
    case PowKind::kReciprocal:
      return f.template operator()<PowKind::kReciprocal>();
    case PowKind::kInvSquare:
      return f.template operator()<PowKind::kInvSquare>();
    case PowKind::kGeneral:
      return f.template operator()<PowKind::kGeneral>();
  }
}

// x^e with e the exponent of kind kKind (e itself is read only by kGeneral).
template <PowKind kKind, typename M>
KILN_SCALAR_HD M pow_scalar(M x, M e) {
  if constexpr (kKind == PowKind::kSquare) {
    return x * x;
  } else if constexpr (kKind == PowKind::kCube) {
    return x * x * x;
  } else if constexpr (kKind == PowKind::kSqrt) {
    return math::sqrt(x);
  } else if constexpr (kKind == PowKind::kRsqrt) {
    return M(1) / math::sqrt(x);
  } else if constexpr (kKind == PowKind::kReciprocal) {
    return M(1) / x;
  } else if constexpr (kKind == PowKind::kInvSquare) {
    return M(1) / (x * x);
  } else {
    return math::pow(x, e);
  }
}

// --- Binary ops ---------------------------------------------------------------------------------

// Python's float floor division: the quotient of fmod's truncated division, stepped down when
// the remainder's sign differs from the divisor's, then snapped to the nearest integer.
template <typename M>
KILN_SCALAR_HD M floor_div_float(M a, M b) {
  if (b == 0) return a / b;  // IEEE: +-inf or nan
  const M rem = math::fmod(a, b);
  M q = (a - rem) / b;
  if (rem != 0 && ((rem < 0) != (b < 0))) q -= 1;
  if (q == 0) return math::copysign(M(0), a / b);
  const M fq = math::floor(q);
  return q - fq > M(0.5) ? fq + 1 : fq;
}

// maximum (kMax) / minimum: NaN propagates from either side.
template <bool kMax, typename M>
KILN_SCALAR_HD M max_min(M x, M y) {
  const bool pick_x = kMax ? x > y : x < y;
  return (pick_x || math::is_nan(x)) ? x : y;
}

// The bounds that an absent clamp limit stands for: the type's extremes (infinities for floats),
// so that one loop serves every case.
template <typename M>
constexpr M clamp_lowest() {
  if constexpr (std::is_floating_point_v<M>) {
    return -std::numeric_limits<M>::infinity();
  } else {
    return std::numeric_limits<M>::lowest();
  }
}
template <typename M>
constexpr M clamp_highest() {
  if constexpr (std::is_floating_point_v<M>) {
    return std::numeric_limits<M>::infinity();
  } else {
    return std::numeric_limits<M>::max();
  }
}

// min(max(x, lo), hi) with std::max/std::min's comparisons: NaN in x propagates.
template <typename M>
KILN_SCALAR_HD M clamp(M x, M lo, M hi) {
  const M a = x < lo ? lo : x;
  return hi < a ? hi : a;
}

// start + w * (end - start), from whichever end is nearer for accuracy at w close to 1.
template <typename M>
KILN_SCALAR_HD M lerp(M start, M end, M w) {
  const M diff = end - start;
  return math::abs(w) < M(0.5) ? start + w * diff : end - diff * (M(1) - w);
}

// |x - y| <= atol + rtol * |y| for floats, each step rounded to the element type T as
// PyTorch's composite computes it.
// v rounded to T and back.
template <typename T, typename M>
KILN_SCALAR_HD M round_through(M v) {
  return static_cast<M>(T(v));
}
template <typename T, typename M>
KILN_SCALAR_HD bool isclose_float(M x, M y, M rtol, M atol, bool equal_nan) {
  if (x == y) return true;
  if (equal_nan && math::is_nan(x) && math::is_nan(y)) return true;
  const M actual = math::abs(round_through<T>(x - y));
  const M allowed =
      round_through<T>(atol + round_through<T>(math::abs(round_through<T>(rtol * y))));
  return math::is_finite(actual) && actual <= allowed;
}

// isclose of integers (and bools), in double.
template <typename M>
KILN_SCALAR_HD bool isclose_int(M x, M y, double rtol, double atol) {
  const double dx = static_cast<double>(x), dy = static_cast<double>(y);
  return dx == dy || math::abs(dx - dy) <= atol + math::abs(rtol * dy);
}

enum class Cmp { kEq, kNe, kLt, kLe, kGt, kGe };

template <Cmp C, typename M>
KILN_SCALAR_HD bool compare(M x, M y) {
  if constexpr (C == Cmp::kEq) {
    return x == y;
  } else if constexpr (C == Cmp::kNe) {
    return x != y;
  } else if constexpr (C == Cmp::kLt) {
    return x < y;
  } else if constexpr (C == Cmp::kLe) {
    return x <= y;
  } else if constexpr (C == Cmp::kGt) {
    return x > y;
  } else {
    return x >= y;
  }
}

enum class Logical { kAnd, kOr, kXor };

// The truth values of x and y (nonzero is true) combined.
template <Logical L, typename M>
KILN_SCALAR_HD bool logical(M x, M y) {
  const bool p = x != M(0), q = y != M(0);
  if constexpr (L == Logical::kAnd) {
    return p && q;
  } else if constexpr (L == Logical::kOr) {
    return p || q;
  } else {
    return p != q;
  }
}

}  // namespace kiln::scalar
