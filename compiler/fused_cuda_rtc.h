// What kernels/scalar_fn.h needs from the C++ library and tensor/dtype.h, for NVRTC, which has
// neither: fused_cuda's generated kernels (compiler/fused_cuda.h) include scalar_fn.h, which
// includes this header in place of <cmath>, <cstdint>, <limits>, <type_traits> and dtype.h when
// __CUDACC_RTC__ is defined. Read only by NVRTC (embedded in the library at build time, with
// scalar_fn.h: compiler/fused_cuda_headers.cpp); never included by host code.
#pragma once

typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;

namespace std {

template <class T, class U>
inline constexpr bool is_same_v = false;
template <class T>
inline constexpr bool is_same_v<T, T> = true;

template <class T>
inline constexpr bool is_floating_point_v = is_same_v<T, float> || is_same_v<T, double>;
template <class T>
inline constexpr bool is_integral_v =
    is_same_v<T, bool> || is_same_v<T, char> || is_same_v<T, signed char> ||
    is_same_v<T, unsigned char> || is_same_v<T, short> || is_same_v<T, unsigned short> ||
    is_same_v<T, int> || is_same_v<T, unsigned int> || is_same_v<T, long> ||
    is_same_v<T, unsigned long> || is_same_v<T, long long> || is_same_v<T, unsigned long long>;
template <class T>
inline constexpr bool is_signed_v = (is_integral_v<T> || is_floating_point_v<T>)&&T(-1) < T(0);
template <class T>
inline constexpr bool is_unsigned_v = is_integral_v<T>&& T(0) < T(-1);

template <class T>
struct make_unsigned {
  using type = T;
};  // unsigned types
template <>
struct make_unsigned<char> {
  using type = unsigned char;
};
template <>
struct make_unsigned<signed char> {
  using type = unsigned char;
};
template <>
struct make_unsigned<short> {
  using type = unsigned short;
};
template <>
struct make_unsigned<int> {
  using type = unsigned int;
};
template <>
struct make_unsigned<long> {
  using type = unsigned long;
};
template <>
struct make_unsigned<long long> {
  using type = unsigned long long;
};
template <class T>
using make_unsigned_t = typename make_unsigned<T>::type;

template <bool B, class T, class F>
struct conditional {
  using type = T;
};
template <class T, class F>
struct conditional<false, T, F> {
  using type = F;
};
template <bool B, class T, class F>
using conditional_t = typename conditional<B, T, F>::type;

// The members scalar_fn.h's clamp bounds read (infinity() is not constexpr here: NVRTC has no
// constant for it, and a constexpr template that calls it is still usable at run time).
template <class T>
struct numeric_limits {
  static constexpr T lowest() { return T(-1) < T(0) ? T(T(1) << (sizeof(T) * 8 - 1)) : T(0); }
  static constexpr T max() { return T(~lowest()); }
};
template <>
struct numeric_limits<float> {
  static float infinity() { return __int_as_float(0x7f800000); }
  static constexpr float lowest() { return -3.40282346638528859812e+38f; }
  static constexpr float max() { return 3.40282346638528859812e+38f; }
};
template <>
struct numeric_limits<double> {
  static double infinity() { return __longlong_as_double(0x7ff0000000000000ll); }
  static constexpr double lowest() { return -1.79769313486231570815e+308; }
  static constexpr double max() { return 1.79769313486231570815e+308; }
};

}  // namespace std

namespace kiln {
// tensor/dtype.h's opmath_t: the type an op computes in (float for the 16-bit floats). The
// generated kernels store 16-bit floats in their own types (the prelude's bf16, f16) and convert
// them themselves: scalar_fn.h's templates are called with float, double and integers only.
struct Half;
struct BFloat16;
template <typename T>
struct OpMath {
  using type = T;
};
template <>
struct OpMath<Half> {
  using type = float;
};
template <>
struct OpMath<BFloat16> {
  using type = float;
};
template <typename T>
using opmath_t = typename OpMath<T>::type;
}  // namespace kiln
