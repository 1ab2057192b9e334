// ScalarType (dtype): the element types kiln tensors hold, and PyTorch's promotion rules.
//
//   kiln::kFloat32 (kFloat), kFloat64 (kDouble), kFloat16 (kHalf), kBFloat16,
//   kInt64 (kLong), kInt32 (kInt), kUInt8 (kByte: image and dataset bytes, C++ uint8_t),
//   kBool (one byte per element).
//
// uint8 follows PyTorch: uint8 + uint8 stays uint8 and wraps around (250 + 10 == 4), uint8 with
// int32 / int64 gives that type, with a float the float; `/` gives a float (true division), and
// sum() accumulates into int64. Floats convert to uint8 through int64, as c10 does: 2.7 -> 2,
// -1.0 -> 255, 300.0 -> 44.
//
// promote_types(a, b) is torch.promote_types; result_type() in tensor/ops lifts it to
// operands with PyTorch's priority of dimensioned tensors over 0-d tensors over scalars.
// visit_dtype(dtype, op, f) calls f(TypeTag<T>{}) with the C++ element type of dtype.
#pragma once

#include <cstdint>
#include <ostream>
#include <string_view>

#include "tensor/error.h"
#include "tensor/half.h"

namespace kiln {

// UInt8 comes last so that the other values keep their numbers.
enum class ScalarType : int8_t { Bool, Int32, Int64, Half, BFloat16, Float, Double, UInt8 };
inline constexpr int kNumScalarTypes = 8;

inline constexpr ScalarType kBool = ScalarType::Bool;
inline constexpr ScalarType kUInt8 = ScalarType::UInt8;
inline constexpr ScalarType kByte = ScalarType::UInt8;
inline constexpr ScalarType kInt32 = ScalarType::Int32;
inline constexpr ScalarType kInt = ScalarType::Int32;
inline constexpr ScalarType kInt64 = ScalarType::Int64;
inline constexpr ScalarType kLong = ScalarType::Int64;
inline constexpr ScalarType kFloat16 = ScalarType::Half;
inline constexpr ScalarType kHalf = ScalarType::Half;
inline constexpr ScalarType kBFloat16 = ScalarType::BFloat16;
inline constexpr ScalarType kFloat32 = ScalarType::Float;
inline constexpr ScalarType kFloat = ScalarType::Float;
inline constexpr ScalarType kFloat64 = ScalarType::Double;
inline constexpr ScalarType kDouble = ScalarType::Double;
// libtorch's short names.
inline constexpr ScalarType kF16 = ScalarType::Half;
inline constexpr ScalarType kF32 = ScalarType::Float;
inline constexpr ScalarType kF64 = ScalarType::Double;
inline constexpr ScalarType kI32 = ScalarType::Int32;
inline constexpr ScalarType kI64 = ScalarType::Int64;
inline constexpr ScalarType kU8 = ScalarType::UInt8;

size_t element_size(ScalarType t);
// "float32", "bfloat16", "int64", "uint8", "bool" ...: the names PyTorch prints.
std::string_view dtype_name(ScalarType t);
std::ostream& operator<<(std::ostream& os, ScalarType t);

constexpr bool is_floating_point(ScalarType t) {
  return t == kHalf || t == kBFloat16 || t == kFloat || t == kDouble;
}
constexpr bool is_integral(ScalarType t, bool include_bool) {
  return t == kUInt8 || t == kInt32 || t == kInt64 || (include_bool && t == kBool);
}
constexpr bool is_reduced_float(ScalarType t) { return t == kHalf || t == kBFloat16; }

// torch.promote_types: the smallest type both a and b convert to without leaving their kind
// (bool < integer < floating). Half with BFloat16 promotes to Float; uint8 with int32 or int64
// gives the signed type (which holds every uint8).
ScalarType promote_types(ScalarType a, ScalarType b);

// The dtype of factories and Python-like float scalars (float32 unless changed).
ScalarType default_dtype();
void set_default_dtype(ScalarType t);

template <typename T>
struct TypeTag {
  using type = T;
};

template <typename T>
constexpr ScalarType dtype_of();
template <> constexpr ScalarType dtype_of<bool>() { return kBool; }
template <> constexpr ScalarType dtype_of<uint8_t>() { return kUInt8; }
template <> constexpr ScalarType dtype_of<int32_t>() { return kInt32; }
template <> constexpr ScalarType dtype_of<int64_t>() { return kInt64; }
template <> constexpr ScalarType dtype_of<Half>() { return kHalf; }
template <> constexpr ScalarType dtype_of<BFloat16>() { return kBFloat16; }
template <> constexpr ScalarType dtype_of<float>() { return kFloat; }
template <> constexpr ScalarType dtype_of<double>() { return kDouble; }

// The type arithmetic on T happens in: float for the 16-bit floats, T otherwise.
template <typename T> struct OpMath { using type = T; };
template <> struct OpMath<Half> { using type = float; };
template <> struct OpMath<BFloat16> { using type = float; };
template <typename T> using opmath_t = typename OpMath<T>::type;

// Calls f(TypeTag<T>{}) for the element type T of `t`.
template <typename F>
decltype(auto) visit_dtype(ScalarType t, F&& f) {
  switch (t) {
    case kBool: return f(TypeTag<bool>{});
    case kUInt8: return f(TypeTag<uint8_t>{});
    case kInt32: return f(TypeTag<int32_t>{});
    case kInt64: return f(TypeTag<int64_t>{});
    case kHalf: return f(TypeTag<Half>{});
    case kBFloat16: return f(TypeTag<BFloat16>{});
    case kFloat: return f(TypeTag<float>{});
    case kDouble: return f(TypeTag<double>{});
  }
  KILN_FAIL("[visit_dtype] unknown dtype ", static_cast<int>(t));
}

// As visit_dtype, restricted to the floating types; other dtypes fail naming `op`.
template <typename F>
decltype(auto) visit_floating(ScalarType t, std::string_view op, F&& f) {
  switch (t) {
    case kHalf: return f(TypeTag<Half>{});
    case kBFloat16: return f(TypeTag<BFloat16>{});
    case kFloat: return f(TypeTag<float>{});
    case kDouble: return f(TypeTag<double>{});
    default: break;
  }
  KILN_FAIL("[", op, "] expected a floating-point dtype, got ", dtype_name(t));
}

}  // namespace kiln
