// kiln::Scalar: a number of any kind (bool, integer or floating), as c10::Scalar.
//
// Scalars arrive from C++ literals (`t + 1`, `t * 0.5`, `t.fill_(true)`) and from item().
// Their kind matters for type promotion: `int_tensor * 2.5` is float32, `int_tensor * 2`
// stays integral.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <type_traits>

#include "tensor/dtype.h"

namespace kiln {

class Scalar {
 public:
  enum class Kind : uint8_t { Bool, Int, Double };

  Scalar() : Scalar(int64_t{0}) {}
  Scalar(bool v) : kind_(Kind::Bool), i_(v) {}  // NOLINT: implicit by design
  template <typename T>
    requires(std::is_integral_v<T> && !std::is_same_v<T, bool>)
  Scalar(T v) : kind_(Kind::Int), i_(static_cast<int64_t>(v)) {}  // NOLINT
  template <typename T>
    requires std::is_floating_point_v<T>
  Scalar(T v) : kind_(Kind::Double), d_(static_cast<double>(v)) {}  // NOLINT
  Scalar(Half v) : Scalar(static_cast<float>(v)) {}                 // NOLINT
  Scalar(BFloat16 v) : Scalar(static_cast<float>(v)) {}             // NOLINT

  Kind kind() const { return kind_; }
  bool is_boolean() const { return kind_ == Kind::Bool; }
  bool is_integral(bool include_bool) const {
    return kind_ == Kind::Int || (include_bool && kind_ == Kind::Bool);
  }
  bool is_floating_point() const { return kind_ == Kind::Double; }

  template <typename T>
  T to() const {
    if constexpr (std::is_same_v<T, bool>) {
      return kind_ == Kind::Double ? d_ != 0.0 : i_ != 0;
    } else if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
      return T(static_cast<float>(to<double>()));
    } else if constexpr (std::is_same_v<T, uint8_t>) {
      // As c10's checked conversion: floats in [0, 255] (truncated), integers in [-255, 255], the
      // negative ones wrapping (so that `a - b` runs as `a + 255 * b`).
      const bool fits = kind_ == Kind::Double ? d_ >= 0.0 && d_ <= 255.0 : i_ >= -255 && i_ <= 255;
      KILN_CHECK(fits, "[Scalar] the value ", *this,
                 " cannot be converted to uint8 without overflow");
      return kind_ == Kind::Double ? static_cast<T>(d_) : static_cast<T>(i_);
    } else if constexpr (std::is_integral_v<T>) {
      if (kind_ != Kind::Double) return static_cast<T>(i_);
      // A double converts to an integer type when it is finite and its truncation fits (NaN,
      // infinities and out-of-range values would be undefined behaviour).
      const double upper = std::ldexp(1.0, std::numeric_limits<T>::digits);
      KILN_CHECK((std::is_signed_v<T> ? d_ >= -upper : d_ > -1.0) && d_ < upper,
                 "[Scalar] the value ", d_, " cannot be converted to a ",
                 std::numeric_limits<T>::digits + (std::is_signed_v<T> ? 1 : 0),
                 "-bit integer (NaN, infinite or out of range)");
      return static_cast<T>(d_);
    } else {
      return kind_ == Kind::Double ? static_cast<T>(d_) : static_cast<T>(i_);
    }
  }
  double toDouble() const { return to<double>(); }
  float toFloat() const { return to<float>(); }
  int64_t toLong() const { return to<int64_t>(); }
  int toInt() const { return to<int>(); }
  bool toBool() const { return to<bool>(); }

  // The dtype a tensor made from this scalar alone would have (float32 for floats).
  ScalarType dtype() const {
    return kind_ == Kind::Bool ? kBool : kind_ == Kind::Int ? kInt64 : default_dtype();
  }

  Scalar operator-() const {
    return kind_ == Kind::Double ? Scalar(-d_) : Scalar(static_cast<int64_t>(-i_));
  }

 private:
  Kind kind_;
  union {
    int64_t i_;
    double d_;
  };
};

inline std::ostream& operator<<(std::ostream& os, const Scalar& s) {
  if (s.is_boolean()) return os << (s.toBool() ? "True" : "False");
  if (s.is_floating_point()) return os << s.toDouble();
  return os << s.toLong();
}

}  // namespace kiln
