// CUDA kernels of the binary elementwise ops (tensor/ops/binary.cpp; CPU: kernels/cpu/binary.cpp):
// each computes in the common dtype T of its inputs, arithmetic in opmath_t<T>.
//
// As on the CPU, a 0-d operand (a wrapped Scalar or any 0-d tensor) is an operand of opmath
// type for arithmetic ops (half_tensor * 0.1 multiplies by 0.1f) and is rounded to T first for
// comparisons. A 0-d CPU operand travels to the kernel by value; a 0-d GPU operand is converted
// on the device to the type the kernel reads, so no op waits for the device.
#include <type_traits>

#include "kernels/cuda/loops.cuh"
#include "kernels/scalar_fn.h"
#include "tensor/ops/elementwise_meta.h"

namespace kiln::cuda {
namespace {

using ::kiln::internal::binary_common_dtype;
using loops::as_dtype;
using loops::elementwise;
using loops::ErrorFlag;
using loops::FlagView;

template <typename T>
constexpr bool kIsFloat = std::is_floating_point_v<opmath_t<T>>;

enum class ScalarRead { kOpmath, kRounded };

// f(M(a), M(b)) for operands of element types A and B.
template <typename F, typename M, typename A, typename B>
struct Apply2 {
  F f;
  __device__ auto operator()(A a, B b) const { return f(static_cast<M>(a), static_cast<M>(b)); }
};

// A 0-d operand as the tensor the kernel reads: element type S (opmath or T).
template <typename S>
Tensor scalar_operand(const Tensor& t) {
  return loops::is_host_scalar(t) ? t : as_dtype(t, dtype_of<S>());
}

// out = f(a, b) over out's shape with a and b broadcast, read as T and computed on
// opmath_t<T>; Out is out's element type.
template <typename T, typename Out, ScalarRead R, typename F>
void binary_loop(const Tensor& out, const Tensor& a, const Tensor& b, F f) {
  using M = opmath_t<T>;
  using S = std::conditional_t<R == ScalarRead::kOpmath, M, T>;
  constexpr ScalarType kT = dtype_of<T>();
  if (b.dim() == 0) {
    elementwise<Out, T, S>(out, Apply2<F, M, T, S>{f}, as_dtype(a, kT), scalar_operand<S>(b));
  } else if (a.dim() == 0) {
    elementwise<Out, S, T>(out, Apply2<F, M, S, T>{f}, scalar_operand<S>(a), as_dtype(b, kT));
  } else {
    elementwise<Out, T, T>(out, Apply2<F, M, T, T>{f}, as_dtype(a, kT), as_dtype(b, kT));
  }
}

// Runs body(target) with a target of dtype `dt`: `out` itself, or a temporary copied into it
// afterwards (in-place ops whose result type differs from self's, e.g. int32 += int64).
template <typename Body>
void write_as(const Tensor& out, ScalarType dt, Body&& body) {
  if (out.dtype() == dt) {
    body(out);
    return;
  }
  const Tensor tmp = loops::empty_on(out.sizes(), dt, out.device());
  body(tmp);
  loops::copy_into(out, tmp);
}

// --- Arithmetic -------------------------------------------------------------------------------

template <typename M>
struct AddFn {
  M alpha;
  __device__ auto operator()(M x, M y) const { return x + alpha * y; }
};

void add_impl(OpCall& c, bool negate) {
  const ScalarType dt = binary_common_dtype(c, 1);
  const Scalar alpha = negate ? -c.attr<Scalar>(0) : c.attr<Scalar>(0);
  visit_dtype(dt, [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    write_as(c.outputs[0], dt, [&](const Tensor& o) {
      binary_loop<T, T, ScalarRead::kOpmath>(o, c.input(0), c.input(1), AddFn<M>{alpha.to<M>()});
    });
  });
}

void add_cuda(OpCall& c) { add_impl(c, false); }
void sub_cuda(OpCall& c) { add_impl(c, true); }

struct MulFn {
  template <typename M>
  __device__ auto operator()(M x, M y) const {
    return x * y;
  }
};

void mul_cuda(OpCall& c) {
  const ScalarType dt = binary_common_dtype(c, 0);
  visit_dtype(dt, [&]<typename T>(TypeTag<T>) {
    write_as(c.outputs[0], dt, [&](const Tensor& o) {
      binary_loop<T, T, ScalarRead::kOpmath>(o, c.input(0), c.input(1), MulFn{});
    });
  });
}

struct TrueDivFn {
  template <typename M>
  __device__ M operator()(M x, M y) const {
    return x / y;
  }
};

struct TruncDivFn {
  template <typename M>
  __device__ M operator()(M x, M y) const {
    return scalar::math::trunc(x / y);
  }
};

struct FloorDivFn {
  template <typename M>
  __device__ M operator()(M a, M b) const {
    return scalar::floor_div_float(a, b);
  }
};

// Integer division that never traps: a zero divisor raises the flag (the host throws after the
// kernel).
template <bool kFloor>
struct IntDivFn {
  FlagView flag;
  template <typename M>
  __device__ M operator()(M x, M y) const {
    bool by_zero = false;
    const M q = scalar::int_div<kFloor>(x, y, by_zero);
    if (by_zero) flag.raise(0);
    return q;
  }
};

void div_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor& a = c.input(0);
  const Tensor& b = c.input(1);
  const ScalarType common = binary_common_dtype(c, 1);
  if (!c.has_attr(0)) {  // true division, in a floating dtype
    const ScalarType dt = is_floating_point(common) ? common : default_dtype();
    visit_floating(dt, "div", [&]<typename T>(TypeTag<T>) {
      write_as(out, dt, [&](const Tensor& o) {
        binary_loop<T, T, ScalarRead::kOpmath>(o, a, b, TrueDivFn{});
      });
    });
    return;
  }
  const bool floor = c.attr<std::string>(0) == "floor";
  visit_dtype(common, [&]<typename T>(TypeTag<T>) {
    write_as(out, common, [&](const Tensor& o) {
      if constexpr (kIsFloat<T>) {
        if (floor) {
          binary_loop<T, T, ScalarRead::kOpmath>(o, a, b, FloorDivFn{});
        } else {
          binary_loop<T, T, ScalarRead::kOpmath>(o, a, b, TruncDivFn{});
        }
      } else {
        const ErrorFlag zero(out.device());
        if (floor) {
          binary_loop<T, T, ScalarRead::kOpmath>(o, a, b, IntDivFn<true>{zero.view()});
        } else {
          binary_loop<T, T, ScalarRead::kOpmath>(o, a, b, IntDivFn<false>{zero.view()});
        }
        KILN_CHECK(!zero.raised(), "[div] integer division by zero (", dtype_name(common),
                   " tensors of shapes ", shape_str(a.sizes()), " and ", shape_str(b.sizes()), ")");
      }
    });
  });
}

// Integer powers: scalar::int_pow (negative exponents give 0 except for bases 1 and -1).
struct PowFn {
  template <typename M>
  __device__ M operator()(M base, M exp) const {
    if constexpr (std::is_floating_point_v<M>) {
      return scalar::math::pow(base, exp);
    } else {
      return scalar::int_pow(base, exp);
    }
  }
};

void pow_cuda(OpCall& c) {
  visit_dtype(binary_common_dtype(c, 0), [&]<typename T>(TypeTag<T>) {
    if constexpr (!std::is_same_v<T, bool>) {  // bool is rejected by the meta rule
      binary_loop<T, T, ScalarRead::kOpmath>(c.outputs[0], c.input(0), c.input(1), PowFn{});
    }
  });
}

// maximum/minimum propagate NaN from either side.
template <bool kMax>
struct MaxMinFn {
  template <typename M>
  __device__ M operator()(M x, M y) const {
    return scalar::max_min<kMax>(x, y);
  }
};

template <bool kMax>
void maxmin_cuda(OpCall& c) {
  visit_dtype(binary_common_dtype(c, 0), [&]<typename T>(TypeTag<T>) {
    binary_loop<T, T, ScalarRead::kOpmath>(c.outputs[0], c.input(0), c.input(1), MaxMinFn<kMax>{});
  });
}

struct Atan2Fn {
  template <typename M>
  __device__ M operator()(M y, M x) const {
    return scalar::math::atan2(y, x);
  }
};

void atan2_cuda(OpCall& c) {
  const ScalarType common = binary_common_dtype(c, 0);
  const ScalarType dt = is_floating_point(common) ? common : default_dtype();
  visit_floating(dt, "atan2", [&]<typename T>(TypeTag<T>) {
    binary_loop<T, T, ScalarRead::kOpmath>(c.outputs[0], c.input(0), c.input(1), Atan2Fn{});
  });
}

// --- Comparisons and logical ops ----------------------------------------------------------------

using scalar::Cmp;
using scalar::Logical;

template <Cmp C>
struct CompareFn {
  template <typename M>
  __device__ bool operator()(M x, M y) const {
    return scalar::compare<C>(x, y);
  }
};

template <Cmp C>
void compare_cuda(OpCall& c) {
  visit_dtype(binary_common_dtype(c, 0), [&]<typename T>(TypeTag<T>) {
    binary_loop<T, bool, ScalarRead::kRounded>(c.outputs[0], c.input(0), c.input(1),
                                               CompareFn<C>{});
  });
}

template <Logical L>
struct LogicalFn {
  template <typename M>
  __device__ bool operator()(M x, M y) const {
    return scalar::logical<L>(x, y);
  }
};

template <Logical L>
void logical_cuda(OpCall& c) {
  visit_dtype(binary_common_dtype(c, 0), [&]<typename T>(TypeTag<T>) {
    binary_loop<T, bool, ScalarRead::kRounded>(c.outputs[0], c.input(0), c.input(1),
                                               LogicalFn<L>{});
  });
}

// --- where, clamp, lerp, isclose ---------------------------------------------------------------

template <typename T>
struct WhereFn {
  __device__ T operator()(bool cond, T x, T y) const { return cond ? x : y; }
};

void where_cuda(OpCall& c) {
  const ScalarType dt = c.has_attr(0) ? c.attr<ScalarType>(0) : result_type(c.input(1), c.input(2));
  visit_dtype(dt, [&]<typename T>(TypeTag<T>) {
    elementwise<T, bool, T, T>(c.outputs[0], WhereFn<T>{}, c.input(0), as_dtype(c.input(1), dt),
                               as_dtype(c.input(2), dt));
  });
}

template <typename T>
struct ClampFn {
  opmath_t<T> lo, hi;
  __device__ T operator()(T v) const {
    return T(scalar::clamp(static_cast<opmath_t<T>>(v), lo, hi));
  }
};

void clamp_cuda(OpCall& c) {
  const Tensor& self = c.input(0);
  ::kiln::internal::ResultTypeBuilder r;
  r.add(self);
  if (c.has_attr(0)) r.add(c.attr<Scalar>(0));
  if (c.has_attr(1)) r.add(c.attr<Scalar>(1));
  const ScalarType dt = r.result();
  visit_dtype(dt, [&]<typename T>(TypeTag<T>) {
    if constexpr (!std::is_same_v<T, bool>) {  // bool is rejected by the meta rule
      using M = opmath_t<T>;
      const M lo = c.has_attr(0) ? M(c.attr<Scalar>(0).to<T>()) : scalar::clamp_lowest<M>();
      const M hi = c.has_attr(1) ? M(c.attr<Scalar>(1).to<T>()) : scalar::clamp_highest<M>();
      write_as(c.outputs[0], dt, [&](const Tensor& o) {
        elementwise<T, T>(o, ClampFn<T>{lo, hi}, as_dtype(self, dt));
      });
    }
  });
}

template <typename T>
struct LerpTensorFn {
  __device__ T operator()(T s, T e, T w) const {
    using M = opmath_t<T>;
    return T(scalar::lerp<M>(M(s), M(e), M(w)));
  }
};

template <typename T>
struct LerpScalarFn {
  opmath_t<T> w;
  __device__ T operator()(T s, T e) const {
    using M = opmath_t<T>;
    return T(scalar::lerp<M>(M(s), M(e), w));
  }
};

void lerp_cuda(OpCall& c) {
  const Tensor& start = c.input(0);
  visit_floating(start.dtype(), "lerp", [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    if (c.inputs.size() == 3) {
      elementwise<T, T, T, T>(c.outputs[0], LerpTensorFn<T>{}, start, c.input(1), c.input(2));
    } else {
      elementwise<T, T, T>(c.outputs[0], LerpScalarFn<T>{c.attr<Scalar>(0).to<M>()}, start,
                           c.input(1));
    }
  });
}

// |a - b| <= atol + rtol * |b| (scalar::isclose_float and isclose_int).
template <typename T>
struct IsCloseFloatFn {
  opmath_t<T> rt, at;
  bool equal_nan;
  __device__ bool operator()(opmath_t<T> x, opmath_t<T> y) const {
    return scalar::isclose_float<T>(x, y, rt, at, equal_nan);
  }
};

struct IsCloseIntFn {
  double rtol, atol;
  template <typename M>
  __device__ bool operator()(M x, M y) const {
    return scalar::isclose_int(x, y, rtol, atol);
  }
};

void isclose_cuda(OpCall& c) {
  const double rtol = c.attr<double>(0), atol = c.attr<double>(1);
  const bool equal_nan = c.attr<bool>(2);
  visit_dtype(c.input(0).dtype(), [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    if constexpr (kIsFloat<T>) {
      binary_loop<T, bool, ScalarRead::kRounded>(
          c.outputs[0], c.input(0), c.input(1),
          IsCloseFloatFn<T>{static_cast<M>(rtol), static_cast<M>(atol), equal_nan});
    } else {
      binary_loop<T, bool, ScalarRead::kRounded>(c.outputs[0], c.input(0), c.input(1),
                                                 IsCloseIntFn{rtol, atol});
    }
  });
}

}  // namespace

KILN_REGISTER_KERNEL(add, kCUDA, add_cuda);
KILN_REGISTER_KERNEL(add_, kCUDA, add_cuda);
KILN_REGISTER_KERNEL(sub, kCUDA, sub_cuda);
KILN_REGISTER_KERNEL(sub_, kCUDA, sub_cuda);
KILN_REGISTER_KERNEL(mul, kCUDA, mul_cuda);
KILN_REGISTER_KERNEL(mul_, kCUDA, mul_cuda);
KILN_REGISTER_KERNEL(div, kCUDA, div_cuda);
KILN_REGISTER_KERNEL(div_, kCUDA, div_cuda);
KILN_REGISTER_KERNEL(pow, kCUDA, pow_cuda);
KILN_REGISTER_KERNEL(maximum, kCUDA, maxmin_cuda<true>);
KILN_REGISTER_KERNEL(minimum, kCUDA, maxmin_cuda<false>);
KILN_REGISTER_KERNEL(atan2, kCUDA, atan2_cuda);
KILN_REGISTER_KERNEL(eq, kCUDA, compare_cuda<Cmp::kEq>);
KILN_REGISTER_KERNEL(ne, kCUDA, compare_cuda<Cmp::kNe>);
KILN_REGISTER_KERNEL(lt, kCUDA, compare_cuda<Cmp::kLt>);
KILN_REGISTER_KERNEL(le, kCUDA, compare_cuda<Cmp::kLe>);
KILN_REGISTER_KERNEL(gt, kCUDA, compare_cuda<Cmp::kGt>);
KILN_REGISTER_KERNEL(ge, kCUDA, compare_cuda<Cmp::kGe>);
KILN_REGISTER_KERNEL(logical_and, kCUDA, logical_cuda<Logical::kAnd>);
KILN_REGISTER_KERNEL(logical_or, kCUDA, logical_cuda<Logical::kOr>);
KILN_REGISTER_KERNEL(logical_xor, kCUDA, logical_cuda<Logical::kXor>);
KILN_REGISTER_KERNEL(where, kCUDA, where_cuda);
KILN_REGISTER_KERNEL(clamp, kCUDA, clamp_cuda);
KILN_REGISTER_KERNEL(clamp_, kCUDA, clamp_cuda);
KILN_REGISTER_KERNEL(lerp, kCUDA, lerp_cuda);
KILN_REGISTER_KERNEL(lerp_, kCUDA, lerp_cuda);
KILN_REGISTER_KERNEL(isclose, kCUDA, isclose_cuda);

}  // namespace kiln::cuda
