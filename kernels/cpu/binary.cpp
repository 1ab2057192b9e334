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
#include <functional>
#include <limits>
#include <type_traits>

#include "kernels/cpu/loops.h"
#include "tensor/ops.h"
#include "tensor/ops/elementwise_meta.h"
#include "tensor/registry.h"

namespace kiln::cpu {

namespace {

using internal::binary_common_dtype;

template <typename T>
constexpr bool kIsFloat = std::is_floating_point_v<opmath_t<T>>;

template <typename M>
bool is_nan(M v) {
  if constexpr (std::is_floating_point_v<M>) {
    return std::isnan(v);
  } else {
    return false;
  }
}

// v (of element type S) as a D, through S's arithmetic type (float for f16/bf16).
template <typename D, typename S>
D convert(S v) {
  const opmath_t<S> m = static_cast<opmath_t<S>>(v);
  if constexpr (std::is_same_v<D, bool>) {
    return m != opmath_t<S>(0);
  } else if constexpr (std::is_same_v<D, Half> || std::is_same_v<D, BFloat16>) {
    return D(static_cast<float>(m));
  } else {
    return static_cast<D>(m);
  }
}

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

// Python's float floor division: the quotient of fmod's truncated division, stepped down when
// the remainder's sign differs from the divisor's, then snapped to the nearest integer.
template <typename M>
M floor_div_float(M a, M b) {
  if (b == 0) return a / b;  // IEEE: +-inf or nan
  const M rem = std::fmod(a, b);
  M q = (a - rem) / b;
  if (rem != 0 && ((rem < 0) != (b < 0))) q -= 1;
  if (q == 0) return std::copysign(M(0), a / b);
  const M fq = std::floor(q);
  return q - fq > M(0.5) ? fq + 1 : fq;
}

// Integer division that never traps: a zero divisor raises `zero` (the caller throws after the
// loop), and x / -1 wraps like two's complement instead of overflowing.
template <typename M, bool kFloor>
M int_div(M x, M y, std::atomic<bool>& zero) {
  if constexpr (std::is_same_v<M, bool>) {
    if (!y) zero.store(true, std::memory_order_relaxed);
    return x;
  } else {
    if (y == 0) [[unlikely]] {
      zero.store(true, std::memory_order_relaxed);
      return 0;
    }
    using U = std::make_unsigned_t<M>;
    if (y == -1) return static_cast<M>(U(0) - static_cast<U>(x));
    M q = x / y;
    if constexpr (kFloor) {
      if (x % y != 0 && ((x < 0) != (y < 0))) --q;
    }
    return q;
  }
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
          binary_loop<T, T, ScalarRead::kOpmath>(o, a, b,
                                                 [](M x, M y) { return floor_div_float(x, y); });
        } else {
          binary_loop<T, T, ScalarRead::kOpmath>(o, a, b,
                                                 [](M x, M y) { return std::trunc(x / y); });
        }
      } else {
        std::atomic<bool> zero{false};
        if (floor) {
          binary_loop<T, T, ScalarRead::kOpmath>(
              o, a, b, [&zero](M x, M y) { return int_div<M, true>(x, y, zero); });
        } else {
          binary_loop<T, T, ScalarRead::kOpmath>(
              o, a, b, [&zero](M x, M y) { return int_div<M, false>(x, y, zero); });
        }
        KILN_CHECK(!zero.load(), "[div] integer division by zero (", dtype_name(common),
                   " tensors of shapes ", shape_str(a.sizes()), " and ", shape_str(b.sizes()), ")");
      }
    });
  });
}

// Integer power by squaring, wrapping on overflow; negative exponents give 0 except for bases
// 1 and -1, as PyTorch.
template <typename M>
M int_pow(M base, M exp) {
  if (exp < 0) {
    if (base == 1) return 1;
    if (base == -1) return (exp & 1) ? -1 : 1;
    return 0;
  }
  using U = std::make_unsigned_t<M>;
  U result = 1, b = static_cast<U>(base);
  for (U e = static_cast<U>(exp); e != 0; e >>= 1) {
    if (e & 1) result *= b;
    b *= b;
  }
  return static_cast<M>(result);
}

void pow_cpu(OpCall& c) {
  visit_dtype(binary_common_dtype(c, 0), [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    if constexpr (kIsFloat<T>) {
      binary_loop<T, T, ScalarRead::kOpmath>(c.outputs[0], c.input(0), c.input(1),
                                             [](M x, M y) { return std::pow(x, y); });
    } else if constexpr (!std::is_same_v<T, bool>) {  // bool is rejected by the meta rule
      binary_loop<T, T, ScalarRead::kOpmath>(c.outputs[0], c.input(0), c.input(1),
                                             [](M x, M y) { return int_pow(x, y); });
    }
  });
}

// maximum/minimum propagate NaN from either side.
template <bool kMax>
void maxmin_cpu(OpCall& c) {
  visit_dtype(binary_common_dtype(c, 0), [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    binary_loop<T, T, ScalarRead::kOpmath>(c.outputs[0], c.input(0), c.input(1), [](M x, M y) {
      const bool pick_x = kMax ? x > y : x < y;
      return (pick_x || is_nan(x)) ? x : y;
    });
  });
}

void atan2_cpu(OpCall& c) {
  const ScalarType common = binary_common_dtype(c, 0);
  const ScalarType dt = is_floating_point(common) ? common : default_dtype();
  visit_floating(dt, "atan2", [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    binary_loop<T, T, ScalarRead::kOpmath>(c.outputs[0], c.input(0), c.input(1),
                                           [](M y, M x) { return std::atan2(y, x); });
  });
}

// --- Comparisons and logical ops ----------------------------------------------------------------

template <typename Cmp>
void compare_cpu(OpCall& c) {
  visit_dtype(binary_common_dtype(c, 0), [&]<typename T>(TypeTag<T>) {
    binary_loop<T, bool, ScalarRead::kRounded>(c.outputs[0], c.input(0), c.input(1), Cmp{});
  });
}

enum class Logical { kAnd, kOr, kXor };

template <Logical L>
void logical_cpu(OpCall& c) {
  visit_dtype(binary_common_dtype(c, 0), [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    binary_loop<T, bool, ScalarRead::kRounded>(c.outputs[0], c.input(0), c.input(1), [](M x, M y) {
      const bool p = x != M(0), q = y != M(0);
      if constexpr (L == Logical::kAnd) {
        return static_cast<bool>(p & q);
      } else if constexpr (L == Logical::kOr) {
        return static_cast<bool>(p | q);
      } else {
        return p != q;
      }
    });
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
      // An absent bound is the type's extreme, so one loop serves every case.
      constexpr M kLowest =
          kIsFloat<T> ? -std::numeric_limits<M>::infinity() : std::numeric_limits<M>::lowest();
      constexpr M kHighest =
          kIsFloat<T> ? std::numeric_limits<M>::infinity() : std::numeric_limits<M>::max();
      const M lo = c.has_attr(0) ? M(c.attr<Scalar>(0).to<T>()) : kLowest;
      const M hi = c.has_attr(1) ? M(c.attr<Scalar>(1).to<T>()) : kHighest;
      write_as(c.outputs[0], dt, [&](const Tensor& o) {
        // std::max(NaN, lo) and std::min(NaN, hi) return the NaN: NaN propagates.
        elementwise_typed<T, T>(
            o, [=](T v) { return std::min(std::max(M(v), lo), hi); }, as_dtype(self, dt));
      });
    }
  });
}

// start + w * (end - start), from whichever end is nearer for accuracy at w close to 1.
template <typename M>
M lerp_value(M start, M end, M w) {
  const M diff = end - start;
  return std::abs(w) < M(0.5) ? start + w * diff : end - diff * (M(1) - w);
}

void lerp_cpu(OpCall& c) {
  const Tensor& start = c.input(0);
  visit_floating(start.dtype(), "lerp", [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    if (c.inputs.size() == 3) {
      elementwise_typed<T, T, T, T>(
          c.outputs[0], [](T s, T e, T w) { return lerp_value<M>(M(s), M(e), M(w)); }, start,
          c.input(1), c.input(2));
    } else {
      const M w = c.attr<Scalar>(0).to<M>();
      elementwise_typed<T, T, T>(
          c.outputs[0], [w](T s, T e) { return lerp_value<M>(M(s), M(e), w); }, start, c.input(1));
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
      auto rnd = [](M v) { return static_cast<M>(T(v)); };
      binary_loop<T, bool, ScalarRead::kRounded>(
          c.outputs[0], c.input(0), c.input(1), [=](M x, M y) {
            if (x == y) return true;
            if (equal_nan && is_nan(x) && is_nan(y)) return true;
            const M actual = std::abs(rnd(x - y));
            const M allowed = rnd(at + rnd(std::abs(rnd(rt * y))));
            return std::isfinite(actual) && actual <= allowed;
          });
    } else {
      binary_loop<T, bool, ScalarRead::kRounded>(
          c.outputs[0], c.input(0), c.input(1), [=](M x, M y) {
            const double dx = static_cast<double>(x), dy = static_cast<double>(y);
            return dx == dy || std::abs(dx - dy) <= atol + std::abs(rtol * dy);
          });
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
KILN_REGISTER_KERNEL(eq, kCPU, compare_cpu<std::equal_to<>>);
KILN_REGISTER_KERNEL(ne, kCPU, compare_cpu<std::not_equal_to<>>);
KILN_REGISTER_KERNEL(lt, kCPU, compare_cpu<std::less<>>);
KILN_REGISTER_KERNEL(le, kCPU, compare_cpu<std::less_equal<>>);
KILN_REGISTER_KERNEL(gt, kCPU, compare_cpu<std::greater<>>);
KILN_REGISTER_KERNEL(ge, kCPU, compare_cpu<std::greater_equal<>>);
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
