// CPU kernels of the binary elementwise ops (tensor/ops/binary.cpp): each computes in the
// common dtype T of its inputs, arithmetic in opmath_t<T> (float for f16/bf16).
//
// A 0-d operand (a wrapped Scalar or a 0-d tensor) is read once into a constant, so that
// `x * 0.5` runs as a one-input loop that vectorises, and arithmetic ops use the scalar at
// opmath precision as PyTorch does (half_tensor * 0.1 multiplies by 0.1f, not by half(0.1)).
// Comparisons round it to T first, so `half_tensor == 0.1` matches elements equal to half(0.1).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>

#include "kernels/cpu/loops.h"
#include "kernels/scalar_fn.h"
#include "tensor/ops.h"
#include "tensor/ops/elementwise_meta.h"
#include "tensor/registry.h"

namespace kiln::cpu {

namespace {

using internal::binary_common_dtype;
using scalar::convert;

template <typename T>
constexpr bool kIsFloat = std::is_floating_point_v<opmath_t<T>>;

enum class ScalarRead { kOpmath, kRounded };

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

// out = f(a, b) over out's shape with a and b broadcast, read as T and computed on
// opmath_t<T>; Out is out's element type.
template <typename T, typename Out, ScalarRead R, typename F>
void binary_loop(const Tensor& out, const Tensor& a, const Tensor& b, F f) {
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

// Runs body(target) with a target of dtype `dt`: `out` itself, or a temporary copied into it
// afterwards (in-place ops whose result type differs from self's, e.g. int32 += int64).
template <typename Body>
void write_as(const Tensor& out, ScalarType dt, Body&& body) {
  if (out.dtype() == dt) {
    body(out);
    return;
  }
  const Tensor tmp = empty(out.sizes(), TensorOptions(dt));
  body(tmp);
  copy_elements(out, tmp);
}

// --- Arithmetic -------------------------------------------------------------------------------

void add_impl(OpCall& c, bool negate) {
  const ScalarType dt = binary_common_dtype(c, 1);
  const Scalar alpha = negate ? -c.attr<Scalar>(0) : c.attr<Scalar>(0);
  visit_dtype(dt, [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    const M al = alpha.to<M>();
    write_as(c.outputs[0], dt, [&](const Tensor& o) {
      binary_loop<T, T, ScalarRead::kOpmath>(o, c.input(0), c.input(1),
                                             [al](M x, M y) { return x + al * y; });
    });
  });
}

void add_cpu(OpCall& c) { add_impl(c, false); }
void sub_cpu(OpCall& c) { add_impl(c, true); }

void mul_cpu(OpCall& c) {
  const ScalarType dt = binary_common_dtype(c, 0);
  visit_dtype(dt, [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    write_as(c.outputs[0], dt, [&](const Tensor& o) {
      binary_loop<T, T, ScalarRead::kOpmath>(o, c.input(0), c.input(1),
                                             [](M x, M y) { return x * y; });
    });
  });
}

void div_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor& a = c.input(0);
  const Tensor& b = c.input(1);
  const ScalarType common = binary_common_dtype(c, 1);
  if (!c.has_attr(0)) {  // true division, in a floating dtype
    const ScalarType dt = is_floating_point(common) ? common : default_dtype();
    visit_floating(dt, "div", [&]<typename T>(TypeTag<T>) {
      using M = opmath_t<T>;
      write_as(out, dt, [&](const Tensor& o) {
        binary_loop<T, T, ScalarRead::kOpmath>(o, a, b, [](M x, M y) { return x / y; });
      });
    });
    return;
  }
  const bool floor = c.attr<std::string>(0) == "floor";
  visit_dtype(common, [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    write_as(out, common, [&](const Tensor& o) {
      if constexpr (kIsFloat<T>) {
        if (floor) {
          binary_loop<T, T, ScalarRead::kOpmath>(
              o, a, b, [](M x, M y) { return scalar::floor_div_float(x, y); });
        } else {
          binary_loop<T, T, ScalarRead::kOpmath>(
              o, a, b, [](M x, M y) { return scalar::math::trunc(x / y); });
        }
      } else {
        std::atomic<bool> zero{false};
        auto run = [&]<bool kFloor>() {
          binary_loop<T, T, ScalarRead::kOpmath>(o, a, b, [&zero](M x, M y) {
            bool by_zero = false;
            const M q = scalar::int_div<kFloor>(x, y, by_zero);
            if (by_zero) [[unlikely]]
              zero.store(true, std::memory_order_relaxed);
            return q;
          });
        };
        if (floor) {
          run.template operator()<true>();
        } else {
          run.template operator()<false>();
        }
        KILN_CHECK(!zero.load(), "[div] integer division by zero (", dtype_name(common),
                   " tensors of shapes ", shape_str(a.sizes()), " and ", shape_str(b.sizes()), ")");
      }
    });
  });
}

void pow_cpu(OpCall& c) {
  visit_dtype(binary_common_dtype(c, 0), [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    if constexpr (kIsFloat<T>) {
      binary_loop<T, T, ScalarRead::kOpmath>(c.outputs[0], c.input(0), c.input(1),
                                             [](M x, M y) { return scalar::math::pow(x, y); });
    } else if constexpr (!std::is_same_v<T, bool>) {  // bool is rejected by the meta rule
      binary_loop<T, T, ScalarRead::kOpmath>(c.outputs[0], c.input(0), c.input(1),
                                             [](M x, M y) { return scalar::int_pow(x, y); });
    }
  });
}

// maximum/minimum propagate NaN from either side.
template <bool kMax>
void maxmin_cpu(OpCall& c) {
  visit_dtype(binary_common_dtype(c, 0), [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    binary_loop<T, T, ScalarRead::kOpmath>(c.outputs[0], c.input(0), c.input(1),
                                           [](M x, M y) { return scalar::max_min<kMax>(x, y); });
  });
}

void atan2_cpu(OpCall& c) {
  const ScalarType common = binary_common_dtype(c, 0);
  const ScalarType dt = is_floating_point(common) ? common : default_dtype();
  visit_floating(dt, "atan2", [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    binary_loop<T, T, ScalarRead::kOpmath>(c.outputs[0], c.input(0), c.input(1),
                                           [](M y, M x) { return scalar::math::atan2(y, x); });
  });
}

// --- Comparisons and logical ops ----------------------------------------------------------------

using scalar::Cmp;
using scalar::Logical;

template <Cmp C>
void compare_cpu(OpCall& c) {
  visit_dtype(binary_common_dtype(c, 0), [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    binary_loop<T, bool, ScalarRead::kRounded>(c.outputs[0], c.input(0), c.input(1),
                                               [](M x, M y) { return scalar::compare<C>(x, y); });
  });
}

template <Logical L>
void logical_cpu(OpCall& c) {
  visit_dtype(binary_common_dtype(c, 0), [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    binary_loop<T, bool, ScalarRead::kRounded>(c.outputs[0], c.input(0), c.input(1),
                                               [](M x, M y) { return scalar::logical<L>(x, y); });
  });
}

// --- where, clamp, lerp, isclose
// ------------------------------------------------------------------

void where_cpu(OpCall& c) {
  const ScalarType dt = c.has_attr(0) ? c.attr<ScalarType>(0) : result_type(c.input(1), c.input(2));
  visit_dtype(dt, [&]<typename T>(TypeTag<T>) {
    elementwise_typed<T, bool, T, T>(
        c.outputs[0], [](bool cond, T x, T y) { return cond ? x : y; }, c.input(0),
        as_dtype(c.input(1), dt), as_dtype(c.input(2), dt));
  });
}

void clamp_cpu(OpCall& c) {
  const Tensor& self = c.input(0);
  internal::ResultTypeBuilder r;
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
        elementwise_typed<T, T>(
            o, [=](T v) { return scalar::clamp(M(v), lo, hi); }, as_dtype(self, dt));
      });
    }
  });
}

void lerp_cpu(OpCall& c) {
  const Tensor& start = c.input(0);
  visit_floating(start.dtype(), "lerp", [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    if (c.inputs.size() == 3) {
      elementwise_typed<T, T, T, T>(
          c.outputs[0], [](T s, T e, T w) { return scalar::lerp<M>(M(s), M(e), M(w)); }, start,
          c.input(1), c.input(2));
    } else {
      const M w = c.attr<Scalar>(0).to<M>();
      elementwise_typed<T, T, T>(
          c.outputs[0], [w](T s, T e) { return scalar::lerp<M>(M(s), M(e), w); }, start,
          c.input(1));
    }
  });
}

// |a - b| <= atol + rtol * |b|, with each step rounded to T as PyTorch's composite computes it.
void isclose_cpu(OpCall& c) {
  const double rtol = c.attr<double>(0), atol = c.attr<double>(1);
  const bool equal_nan = c.attr<bool>(2);
  visit_dtype(c.input(0).dtype(), [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    if constexpr (kIsFloat<T>) {
      const M rt = static_cast<M>(rtol), at = static_cast<M>(atol);
      binary_loop<T, bool, ScalarRead::kRounded>(
          c.outputs[0], c.input(0), c.input(1),
          [=](M x, M y) { return scalar::isclose_float<T>(x, y, rt, at, equal_nan); });
    } else {
      binary_loop<T, bool, ScalarRead::kRounded>(
          c.outputs[0], c.input(0), c.input(1),
          [=](M x, M y) { return scalar::isclose_int(x, y, rtol, atol); });
    }
  });
}

}  // namespace

KILN_REGISTER_KERNEL(add, kCPU, add_cpu);
KILN_REGISTER_KERNEL(add_, kCPU, add_cpu);
KILN_REGISTER_KERNEL(sub, kCPU, sub_cpu);
KILN_REGISTER_KERNEL(sub_, kCPU, sub_cpu);
KILN_REGISTER_KERNEL(mul, kCPU, mul_cpu);
KILN_REGISTER_KERNEL(mul_, kCPU, mul_cpu);
KILN_REGISTER_KERNEL(div, kCPU, div_cpu);
KILN_REGISTER_KERNEL(div_, kCPU, div_cpu);
KILN_REGISTER_KERNEL(pow, kCPU, pow_cpu);
KILN_REGISTER_KERNEL(maximum, kCPU, maxmin_cpu<true>);
KILN_REGISTER_KERNEL(minimum, kCPU, maxmin_cpu<false>);
KILN_REGISTER_KERNEL(atan2, kCPU, atan2_cpu);
KILN_REGISTER_KERNEL(eq, kCPU, compare_cpu<Cmp::kEq>);
KILN_REGISTER_KERNEL(ne, kCPU, compare_cpu<Cmp::kNe>);
KILN_REGISTER_KERNEL(lt, kCPU, compare_cpu<Cmp::kLt>);
KILN_REGISTER_KERNEL(le, kCPU, compare_cpu<Cmp::kLe>);
KILN_REGISTER_KERNEL(gt, kCPU, compare_cpu<Cmp::kGt>);
KILN_REGISTER_KERNEL(ge, kCPU, compare_cpu<Cmp::kGe>);
KILN_REGISTER_KERNEL(logical_and, kCPU, logical_cpu<Logical::kAnd>);
KILN_REGISTER_KERNEL(logical_or, kCPU, logical_cpu<Logical::kOr>);
KILN_REGISTER_KERNEL(logical_xor, kCPU, logical_cpu<Logical::kXor>);
KILN_REGISTER_KERNEL(where, kCPU, where_cpu);
KILN_REGISTER_KERNEL(clamp, kCPU, clamp_cpu);
KILN_REGISTER_KERNEL(clamp_, kCPU, clamp_cpu);
KILN_REGISTER_KERNEL(lerp, kCPU, lerp_cpu);
KILN_REGISTER_KERNEL(lerp_, kCPU, lerp_cpu);
KILN_REGISTER_KERNEL(isclose, kCPU, isclose_cpu);

}  // namespace kiln::cpu
