// The binary elementwise ops (tensor/ops/binary.cpp holds their dtype rules), and where, clamp,
// lerp and isclose, written once for the CPU kernels (kernels/cpu/binary.cpp) and the CUDA
// kernels (kernels/cuda/binary.cu): the dtype dispatch, the attribute decoding, the per-element
// functors around the formulas of kernels/scalar_fn.h, and the list of the ops with their kernels.
//
// Each op computes in the common dtype T of its inputs, arithmetic in opmath_t<T> (float for
// f16/bf16). A 0-d operand (a wrapped Scalar or a 0-d tensor) is an operand of opmath type for
// arithmetic ops, as PyTorch's (half_tensor * 0.1 multiplies by 0.1f, not by half(0.1)), and is
// rounded to T first for comparisons, so `half_tensor == 0.1` matches elements equal to half(0.1).
//
// A device file supplies its loops as a `Backend` type and registers BinaryKernels<Backend>:
//
//   struct CpuBinary {
//     // out = f(M(a), M(b)) over out's shape with a and b broadcast, read as T, computed on
//     // M = opmath_t<T>; Out is out's element type; a 0-d operand is read as R says.
//     template <typename T, typename Out, ScalarRead R, typename F>
//     static void binary(const Tensor& out, const Tensor& a, const Tensor& b, const F& f);
//     // out[i] = f(in[i]...), the inputs broadcast to out's shape, of element types Ins.
//     template <typename Out, typename... Ins, typename F>
//     static void map(const Tensor& out, const F& f, TensorFor<Ins>... in);
//     static Tensor as_dtype(const Tensor& t, ScalarType dtype);
//     static Tensor empty(IntArrayRef sizes, ScalarType dtype, Device device);  // contiguous
//     static void copy(const Tensor& dst, const Tensor& src);  // converting, without autograd
//     // Raised by a loop (view().raise(0), in the loop's functor), read after it (raised()).
//     class ErrorFlag;
//   };
//   #define REGISTER(op, fn) KILN_REGISTER_KERNEL(op, kCPU, scalar::BinaryKernels<CpuBinary>::fn);
//   KILN_BINARY_OPS(REGISTER)
//
// Internal to kernels/.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/scalar_fn.h"
#include "tensor/dtype.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/ops/elementwise_meta.h"
#include "tensor/registry.h"
#include "tensor/scalar.h"

namespace kiln::scalar {

// Every binary op and its kernel in BinaryKernels: X(op, function). In-place forms (add_, ...)
// share the functional op's kernel (outputs[0] is then inputs[0]).
#define KILN_BINARY_OPS(X)                       \
  X(add, add)                                    \
  X(add_, add)                                   \
  X(sub, sub)                                    \
  X(sub_, sub)                                   \
  X(mul, mul)                                    \
  X(mul_, mul)                                   \
  X(div, div)                                    \
  X(div_, div)                                   \
  X(pow, pow)                                    \
  X(maximum, max_min<true>)                      \
  X(minimum, max_min<false>)                     \
  X(atan2, atan2)                                \
  X(eq, compare<scalar::Cmp::kEq>)               \
  X(ne, compare<scalar::Cmp::kNe>)               \
  X(lt, compare<scalar::Cmp::kLt>)               \
  X(le, compare<scalar::Cmp::kLe>)               \
  X(gt, compare<scalar::Cmp::kGt>)               \
  X(ge, compare<scalar::Cmp::kGe>)               \
  X(logical_and, logical<scalar::Logical::kAnd>) \
  X(logical_or, logical<scalar::Logical::kOr>)   \
  X(logical_xor, logical<scalar::Logical::kXor>) \
  X(where, where)                                \
  X(clamp, clamp)                                \
  X(clamp_, clamp)                               \
  X(lerp, lerp)                                  \
  X(lerp_, lerp)                                 \
  X(isclose, isclose)

// How a binary loop reads a 0-d operand: as opmath_t<T> (arithmetic), or rounded to T first
// (comparisons).
enum class ScalarRead { kOpmath, kRounded };

template <typename T>
inline constexpr bool kIsFloat = std::is_floating_point_v<opmath_t<T>>;

// --- Per-element functors: f(x, y) on opmath values ---------------------------------------------

template <typename M>
struct AddFn {
  M alpha;
  KILN_SCALAR_HD auto operator()(M x, M y) const { return x + alpha * y; }
};

struct MulFn {
  template <typename M>
  KILN_SCALAR_HD auto operator()(M x, M y) const {
    return x * y;
  }
};

struct TrueDivFn {
  template <typename M>
  KILN_SCALAR_HD M operator()(M x, M y) const {
    return x / y;
  }
};

struct TruncDivFn {
  template <typename M>
  KILN_SCALAR_HD M operator()(M x, M y) const {
    return math::trunc(x / y);
  }
};

struct FloorDivFn {
  template <typename M>
  KILN_SCALAR_HD M operator()(M a, M b) const {
    return floor_div_float(a, b);
  }
};

// Integer division that never traps: a zero divisor raises `flag` (the host throws after the
// loop). Flag: the device's ErrorFlag view.
template <bool kFloor, typename Flag>
struct IntDivFn {
  Flag flag;
  template <typename M>
  KILN_SCALAR_HD M operator()(M x, M y) const {
    bool by_zero = false;
    const M q = int_div<kFloor>(x, y, by_zero);
    if (by_zero) flag.raise(0);
    return q;
  }
};

// Floats through pow; integers by int_pow (negative exponents give 0 except for bases 1 and -1).
struct PowFn {
  template <typename M>
  KILN_SCALAR_HD M operator()(M base, M exp) const {
    if constexpr (std::is_floating_point_v<M>) {
      return math::pow(base, exp);
    } else {
      return int_pow(base, exp);
    }
  }
};

// maximum/minimum propagate NaN from either side.
template <bool kMax>
struct MaxMinFn {
  template <typename M>
  KILN_SCALAR_HD M operator()(M x, M y) const {
    return max_min<kMax>(x, y);
  }
};

struct Atan2Fn {
  template <typename M>
  KILN_SCALAR_HD M operator()(M y, M x) const {
    return math::atan2(y, x);
  }
};

template <Cmp C>
struct CompareFn {
  template <typename M>
  KILN_SCALAR_HD bool operator()(M x, M y) const {
    return compare<C>(x, y);
  }
};

template <Logical L>
struct LogicalFn {
  template <typename M>
  KILN_SCALAR_HD bool operator()(M x, M y) const {
    return logical<L>(x, y);
  }
};

// |a - b| <= atol + rtol * |b| (isclose_float and isclose_int).
template <typename T>
struct IsCloseFloatFn {
  opmath_t<T> rt, at;
  bool equal_nan;
  KILN_SCALAR_HD bool operator()(opmath_t<T> x, opmath_t<T> y) const {
    return isclose_float<T>(x, y, rt, at, equal_nan);
  }
};

struct IsCloseIntFn {
  double rtol, atol;
  template <typename M>
  KILN_SCALAR_HD bool operator()(M x, M y) const {
    return isclose_int(x, y, rtol, atol);
  }
};

// g * gelu'(x): gelu_backward's element, Grad = GeluTanhGrad or GeluExactGrad (scalar_fn.h).
template <typename Grad>
struct GeluBackwardFn {
  template <typename M>
  KILN_SCALAR_HD M operator()(M g, M x) const {
    return g * Grad::apply(x);
  }
};

// --- Functors on elements of type T (for map) ----------------------------------------------------

template <typename T>
struct WhereFn {
  KILN_SCALAR_HD T operator()(bool cond, T x, T y) const { return cond ? x : y; }
};

template <typename T>
struct ClampFn {
  opmath_t<T> lo, hi;
  KILN_SCALAR_HD T operator()(T v) const {
    return T(scalar::clamp(static_cast<opmath_t<T>>(v), lo, hi));
  }
};

template <typename T>
struct LerpTensorFn {
  KILN_SCALAR_HD T operator()(T s, T e, T w) const {
    using M = opmath_t<T>;
    return T(scalar::lerp<M>(M(s), M(e), M(w)));
  }
};

template <typename T>
struct LerpScalarFn {
  opmath_t<T> w;
  KILN_SCALAR_HD T operator()(T s, T e) const {
    using M = opmath_t<T>;
    return T(scalar::lerp<M>(M(s), M(e), w));
  }
};

// --- The kernels ---------------------------------------------------------------------------------

// The kernels of the binary ops on the device that `Backend` describes (see the banner).
template <typename Backend>
struct BinaryKernels {
  static void add(OpCall& c) { add_impl(c, false); }
  static void sub(OpCall& c) { add_impl(c, true); }

  static void mul(OpCall& c) {
    const ScalarType dt = ::kiln::internal::binary_common_dtype(c, 0);
    visit_dtype(dt, [&]<typename T>(TypeTag<T>) {
      write_as(c.outputs[0], dt, [&](const Tensor& o) {
        Backend::template binary<T, T, ScalarRead::kOpmath>(o, c.input(0), c.input(1), MulFn{});
      });
    });
  }

  // True division (no rounding mode: in a floating dtype), or "floor" / "trunc" rounding.
  static void div(OpCall& c) {
    const Tensor& out = c.outputs[0];
    const Tensor& a = c.input(0);
    const Tensor& b = c.input(1);
    const ScalarType common = ::kiln::internal::binary_common_dtype(c, 1);
    if (!c.has_attr(0)) {
      const ScalarType dt = is_floating_point(common) ? common : default_dtype();
      visit_floating(dt, "div", [&]<typename T>(TypeTag<T>) {
        write_as(out, dt, [&](const Tensor& o) {
          Backend::template binary<T, T, ScalarRead::kOpmath>(o, a, b, TrueDivFn{});
        });
      });
      return;
    }
    const bool floor = c.attr<std::string>(0) == "floor";
    visit_dtype(common, [&]<typename T>(TypeTag<T>) {
      write_as(out, common, [&](const Tensor& o) {
        if constexpr (kIsFloat<T>) {
          if (floor) {
            Backend::template binary<T, T, ScalarRead::kOpmath>(o, a, b, FloorDivFn{});
          } else {
            Backend::template binary<T, T, ScalarRead::kOpmath>(o, a, b, TruncDivFn{});
          }
        } else {
          const typename Backend::ErrorFlag zero(out.device());
          using View = decltype(zero.view());
          if (floor) {
            Backend::template binary<T, T, ScalarRead::kOpmath>(o, a, b,
                                                                IntDivFn<true, View>{zero.view()});
          } else {
            Backend::template binary<T, T, ScalarRead::kOpmath>(o, a, b,
                                                                IntDivFn<false, View>{zero.view()});
          }
          KILN_CHECK(!zero.raised(), "[div] integer division by zero (", dtype_name(common),
                     " tensors of shapes ", shape_str(a.sizes()), " and ", shape_str(b.sizes()),
                     ")");
        }
      });
    });
  }

  // gelu_backward(grad, self; approximate): grad * gelu'(self), both of self's floating dtype
  // and shape (the meta rule checks). CUDA's kernel (kernels/cuda/binary.cu); the CPU's takes
  // the packet functions (kernels/cpu/glu.cpp).
  static void gelu_backward(OpCall& c) {
    const bool tanh = c.attr<std::string>(0) == "tanh";
    visit_floating(c.input(1).dtype(), "gelu_backward", [&]<typename T>(TypeTag<T>) {
      if (tanh) {
        Backend::template binary<T, T, ScalarRead::kOpmath>(c.outputs[0], c.input(0), c.input(1),
                                                            GeluBackwardFn<GeluTanhGrad>{});
      } else {
        Backend::template binary<T, T, ScalarRead::kOpmath>(c.outputs[0], c.input(0), c.input(1),
                                                            GeluBackwardFn<GeluExactGrad>{});
      }
    });
  }

  static void pow(OpCall& c) {
    visit_dtype(::kiln::internal::binary_common_dtype(c, 0), [&]<typename T>(TypeTag<T>) {
      if constexpr (!std::is_same_v<T, bool>) {  // bool is rejected by the meta rule
        Backend::template binary<T, T, ScalarRead::kOpmath>(c.outputs[0], c.input(0), c.input(1),
                                                            PowFn{});
      }
    });
  }

  template <bool kMax>
  static void max_min(OpCall& c) {
    visit_dtype(::kiln::internal::binary_common_dtype(c, 0), [&]<typename T>(TypeTag<T>) {
      Backend::template binary<T, T, ScalarRead::kOpmath>(c.outputs[0], c.input(0), c.input(1),
                                                          MaxMinFn<kMax>{});
    });
  }

  static void atan2(OpCall& c) {
    const ScalarType common = ::kiln::internal::binary_common_dtype(c, 0);
    const ScalarType dt = is_floating_point(common) ? common : default_dtype();
    visit_floating(dt, "atan2", [&]<typename T>(TypeTag<T>) {
      Backend::template binary<T, T, ScalarRead::kOpmath>(c.outputs[0], c.input(0), c.input(1),
                                                          Atan2Fn{});
    });
  }

  template <Cmp C>
  static void compare(OpCall& c) {
    visit_dtype(::kiln::internal::binary_common_dtype(c, 0), [&]<typename T>(TypeTag<T>) {
      Backend::template binary<T, bool, ScalarRead::kRounded>(c.outputs[0], c.input(0), c.input(1),
                                                              CompareFn<C>{});
    });
  }

  template <Logical L>
  static void logical(OpCall& c) {
    visit_dtype(::kiln::internal::binary_common_dtype(c, 0), [&]<typename T>(TypeTag<T>) {
      Backend::template binary<T, bool, ScalarRead::kRounded>(c.outputs[0], c.input(0), c.input(1),
                                                              LogicalFn<L>{});
    });
  }

  static void where(OpCall& c) {
    const ScalarType dt =
        c.has_attr(0) ? c.attr<ScalarType>(0) : result_type(c.input(1), c.input(2));
    visit_dtype(dt, [&]<typename T>(TypeTag<T>) {
      Backend::template map<T, bool, T, T>(c.outputs[0], WhereFn<T>{}, c.input(0),
                                           Backend::as_dtype(c.input(1), dt),
                                           Backend::as_dtype(c.input(2), dt));
    });
  }

  // Absent bounds are the type's extremes (infinities for floats), so one loop serves all cases.
  static void clamp(OpCall& c) {
    const Tensor& self = c.input(0);
    ::kiln::internal::ResultTypeBuilder r;
    r.add(self);
    if (c.has_attr(0)) r.add(c.attr<Scalar>(0));
    if (c.has_attr(1)) r.add(c.attr<Scalar>(1));
    const ScalarType dt = r.result();
    visit_dtype(dt, [&]<typename T>(TypeTag<T>) {
      if constexpr (!std::is_same_v<T, bool>) {  // bool is rejected by the meta rule
        using M = opmath_t<T>;
        const M lo = c.has_attr(0) ? M(c.attr<Scalar>(0).to<T>()) : clamp_lowest<M>();
        const M hi = c.has_attr(1) ? M(c.attr<Scalar>(1).to<T>()) : clamp_highest<M>();
        write_as(c.outputs[0], dt, [&](const Tensor& o) {
          Backend::template map<T, T>(o, ClampFn<T>{lo, hi}, Backend::as_dtype(self, dt));
        });
      }
    });
  }

  // The weight: a tensor (input 2) or a scalar (attribute 0).
  static void lerp(OpCall& c) {
    const Tensor& start = c.input(0);
    visit_floating(start.dtype(), "lerp", [&]<typename T>(TypeTag<T>) {
      using M = opmath_t<T>;
      if (c.inputs.size() == 3) {
        Backend::template map<T, T, T, T>(c.outputs[0], LerpTensorFn<T>{}, start, c.input(1),
                                          c.input(2));
      } else {
        Backend::template map<T, T, T>(c.outputs[0], LerpScalarFn<T>{c.attr<Scalar>(0).to<M>()},
                                       start, c.input(1));
      }
    });
  }

  // |a - b| <= atol + rtol * |b|, with each step rounded to T as PyTorch's composite computes it.
  static void isclose(OpCall& c) {
    const double rtol = c.attr<double>(0), atol = c.attr<double>(1);
    const bool equal_nan = c.attr<bool>(2);
    visit_dtype(c.input(0).dtype(), [&]<typename T>(TypeTag<T>) {
      using M = opmath_t<T>;
      if constexpr (kIsFloat<T>) {
        Backend::template binary<T, bool, ScalarRead::kRounded>(
            c.outputs[0], c.input(0), c.input(1),
            IsCloseFloatFn<T>{static_cast<M>(rtol), static_cast<M>(atol), equal_nan});
      } else {
        Backend::template binary<T, bool, ScalarRead::kRounded>(
            c.outputs[0], c.input(0), c.input(1), IsCloseIntFn{rtol, atol});
      }
    });
  }

 private:
  // add and sub: out = a + alpha * b (alpha negated for sub).
  static void add_impl(OpCall& c, bool negate) {
    const ScalarType dt = ::kiln::internal::binary_common_dtype(c, 1);
    const Scalar alpha = negate ? -c.attr<Scalar>(0) : c.attr<Scalar>(0);
    visit_dtype(dt, [&]<typename T>(TypeTag<T>) {
      using M = opmath_t<T>;
      write_as(c.outputs[0], dt, [&](const Tensor& o) {
        Backend::template binary<T, T, ScalarRead::kOpmath>(o, c.input(0), c.input(1),
                                                            AddFn<M>{alpha.to<M>()});
      });
    });
  }

  // Runs body(target) with a target of dtype `dt`: `out` itself, or a temporary copied into it
  // afterwards (in-place ops whose result type differs from self's, e.g. int32 += int64).
  template <typename Body>
  static void write_as(const Tensor& out, ScalarType dt, Body&& body) {
    if (out.dtype() == dt) {
      body(out);
      return;
    }
    const Tensor tmp = Backend::empty(out.sizes(), dt, out.device());
    body(tmp);
    Backend::copy(out, tmp);
  }
};

}  // namespace kiln::scalar
