// The reducers of the reductions (sum, mean, prod, amax/amin, max/min with indices,
// argmax/argmin, var/std, norm, logsumexp, all/any), shared by the CPU kernels
// (kernels/cpu/reduce.cpp, through the loop of kernels/cpu/reduce.h) and the CUDA kernels
// (kernels/cuda/reduce.cu) so that both fold, merge and finish with the same rules; and the op
// kernels around them (ReduceOps: attributes decoded, reducer chosen, registration list), written
// once for both devices.
//
//   // F: the floating accumulator (double on the CPU; float for f32/f16/bf16 on the GPU)
//   using Red = scalar::SumReducer<T, F>;
//   Red red{out_ptr, F(1)};
//   Red::acc_t a = red.init();
//   red.step(a, x, r);         // r: the index along the reduced dim
//   a = red.merge(a, b);       // a covers lower indices than b (only argmax looks)
//   red.finish(a, out_index);  // writes the output
//
// Integer sums and products accumulate in int64 and wrap (two's complement), as PyTorch's.
// Internal to kernels/.
#pragma once

#include <bit>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kernels/scalar_fn.h"
#include "tensor/dtype.h"
#include "tensor/registry.h"
#include "tensor/shape.h"
#include "tensor/tensor.h"

namespace kiln::scalar {

// Integer arithmetic wraps (two's complement), as PyTorch's does in practice.
KILN_SCALAR_HD int64_t wrap_add(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}
KILN_SCALAR_HD int64_t wrap_mul(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
}

// The accumulator of sums and products: int64 for integers, F for floating types.
template <typename T, typename F>
using sum_acc_t = std::conditional_t<std::is_integral_v<T>, int64_t, F>;

// x as an accumulator of type A, through T's arithmetic type (float for f16/bf16).
template <typename A, typename T>
KILN_SCALAR_HD A to_acc(T x) {
  return static_cast<A>(static_cast<opmath_t<T>>(x));
}

// An accumulated value stored as a T.
template <typename T, typename V>
KILN_SCALAR_HD T from_acc(V v) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
    return T(static_cast<float>(v));
  } else {
    return static_cast<T>(v);
  }
}

// The NaN that amax and amin give, on the host as on the device: the device's canonical NaN (all
// ones but the sign), which its max.NaN and min.NaN write.
template <typename V>
KILN_SCALAR_HD V canonical_nan() {
  if constexpr (std::is_same_v<V, float>) {
#if defined(__CUDA_ARCH__)
    return __int_as_float(0x7fffffff);
#else
    return std::bit_cast<float>(0x7fffffff);
#endif
  } else {
#if defined(__CUDA_ARCH__)
    return __longlong_as_double(0x7fffffffffffffffLL);
#else
    return std::bit_cast<double>(0x7fffffffffffffffLL);
#endif
  }
}

// The larger (kMax) or smaller of a and b, whatever their order (IEEE 754-2019's maximum and
// minimum): NaN wins, as canonical_nan, and +0 is larger than -0. So amax and amin have one
// result in any order of reduction, the same bits on the host and the device: the generated row
// kernels (compiler/fused_cuda_rows.cpp) fold two bf16 elements an instruction and combine
// threads in their own order, with eager's bits. float's is one instruction on the device
// (max.NaN.f32; GpuFusedCuda.AmaxAminRowsMatchEagerBitwise checks zeros and NaN against eager's).
template <bool kMax, typename V>
KILN_SCALAR_HD V pick(V a, V b) {
  if constexpr (std::is_floating_point_v<V>) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (std::is_same_v<V, float>) {
      float r;
      if constexpr (kMax) {
        asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
      } else {
        asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
      }
      return r;
    }
#endif
    if (math::is_nan(a) || math::is_nan(b)) return canonical_nan<V>();
    // Equal: the same value, or zeros of either sign (max takes +0, min -0).
    if (a == b) return (math::copysign(V(1), a) < V(0)) == kMax ? b : a;
  }
  if constexpr (kMax) {
    return b > a ? b : a;
  } else {
    return b < a ? b : a;
  }
}

// --- sum, mean, prod ----------------------------------------------------------------------------

template <typename T, typename F>
struct SumReducer {
  using acc_t = sum_acc_t<T, F>;
  T* out;
  F scale;  // 1 for sum, 1 / count for mean (floating types only)
  KILN_SCALAR_HD acc_t init() const { return 0; }
  KILN_SCALAR_HD void step(acc_t& a, T x, int64_t) const { a = merge(a, to_acc<acc_t>(x)); }
  KILN_SCALAR_HD acc_t merge(acc_t a, acc_t b) const {
    if constexpr (std::is_integral_v<T>) {
      return wrap_add(a, b);
    } else {
      return a + b;
    }
  }
  KILN_SCALAR_HD void finish(acc_t a, int64_t i) const {
    if constexpr (std::is_integral_v<T>) {
      out[i] = static_cast<T>(a);
    } else {
      out[i] = from_acc<T>(a * scale);
    }
  }
};

template <typename T, typename F>
struct ProdReducer {
  using acc_t = sum_acc_t<T, F>;
  T* out;
  KILN_SCALAR_HD acc_t init() const { return 1; }
  KILN_SCALAR_HD void step(acc_t& a, T x, int64_t) const { a = merge(a, to_acc<acc_t>(x)); }
  KILN_SCALAR_HD acc_t merge(acc_t a, acc_t b) const {
    if constexpr (std::is_integral_v<T>) {
      return wrap_mul(a, b);
    } else {
      return a * b;
    }
  }
  KILN_SCALAR_HD void finish(acc_t a, int64_t i) const { out[i] = from_acc<T>(a); }
};

// --- amax, amin, max, min
// -------------------------------------------------------------------------

// The value type of extrema: bool for bool, T's arithmetic type otherwise.
template <typename T>
using value_t = std::conditional_t<std::is_same_v<T, bool>, bool, opmath_t<T>>;

template <typename T, bool kMax>
struct ExtremumReducer {
  using acc_t = value_t<T>;
  T* out;
  KILN_SCALAR_HD acc_t init() const {
    if constexpr (std::is_same_v<T, bool>) {
      return !kMax;
    } else if constexpr (std::is_integral_v<T>) {
      return kMax ? std::numeric_limits<T>::lowest() : std::numeric_limits<T>::max();
    } else {
      return kMax ? -std::numeric_limits<acc_t>::infinity()
                  : std::numeric_limits<acc_t>::infinity();
    }
  }
  KILN_SCALAR_HD void step(acc_t& a, T x, int64_t) const {
    a = pick<kMax>(a, static_cast<acc_t>(x));
  }
  KILN_SCALAR_HD acc_t merge(acc_t a, acc_t b) const { return pick<kMax>(a, b); }
  KILN_SCALAR_HD void finish(acc_t a, int64_t i) const { out[i] = from_acc<T>(a); }
};

// --- max/min with indices, argmax/argmin ------------------------------------------------------

template <typename T>
struct ArgAcc {
  value_t<T> value;
  int64_t index;
};

// Value and index of the best element so far; index -1 means none yet. Ties keep the lowest
// index and the first NaN beats everything, as PyTorch.
template <typename T, bool kMax>
struct ArgReducer {
  using acc_t = ArgAcc<T>;
  using V = value_t<T>;
  T* values;  // may be null (argmax)
  int64_t* indices;

  static KILN_SCALAR_HD bool better(V x, V than) {
    if (math::is_nan(than)) return false;
    if (math::is_nan(x)) return true;
    if constexpr (kMax) {
      return x > than;
    } else {
      return x < than;
    }
  }
  KILN_SCALAR_HD acc_t init() const { return {V{}, -1}; }
  KILN_SCALAR_HD void step(acc_t& a, T x, int64_t r) const {
    const V v = static_cast<V>(x);
    if (a.index < 0 || better(v, a.value)) a = {v, r};
  }
  KILN_SCALAR_HD acc_t merge(const acc_t& a, const acc_t& b) const {
    if (a.index < 0) return b;
    if (b.index < 0) return a;
    if (better(b.value, a.value)) return b;
    if (better(a.value, b.value)) return a;
    return a.index <= b.index ? a : b;
  }
  KILN_SCALAR_HD void finish(const acc_t& a, int64_t i) const {
    if (values != nullptr) values[i] = from_acc<T>(a.value);
    indices[i] = a.index;
  }
};

// --- var, std ---------------------------------------------------------------------------------

// Welford's running mean and sum of squared deviations, merged with Chan's formula.
template <typename F>
struct Moments {
  F n, mean, m2;
};

template <typename T, typename F, bool kStd>
struct VarReducer {
  using acc_t = Moments<F>;
  T* out;
  F correction;
  KILN_SCALAR_HD acc_t init() const { return {0, 0, 0}; }
  KILN_SCALAR_HD void step(acc_t& a, T x, int64_t) const {
    const F v = to_acc<F>(x);
    a.n += 1;
    const F delta = v - a.mean;
    a.mean += delta / a.n;
    a.m2 += delta * (v - a.mean);
  }
  KILN_SCALAR_HD acc_t merge(const acc_t& a, const acc_t& b) const {
    if (a.n == 0) return b;
    if (b.n == 0) return a;
    const F n = a.n + b.n;
    const F delta = b.mean - a.mean;
    return {n, a.mean + delta * (b.n / n), a.m2 + b.m2 + delta * delta * (a.n * b.n / n)};
  }
  KILN_SCALAR_HD void finish(const acc_t& a, int64_t i) const {
    // PyTorch divides by max(0, N - correction): inf or nan when nothing is left.
    const F dof = a.n - correction;
    const F var = a.m2 / (F(0) < dof ? dof : F(0));
    out[i] = from_acc<T>(kStd ? math::sqrt(var) : var);
  }
};

// --- norm -------------------------------------------------------------------------------------

enum class NormKind { kZero, kOne, kTwo, kInf, kNegInf, kGeneral };

// Calls f.template operator()<kind>() with the NormKind of order p as a constant.
template <typename Fn>
void visit_norm_kind(double p, Fn&& f) {
  if (p == 0) {
    f.template operator()<NormKind::kZero>();
  } else if (p == 1) {
    f.template operator()<NormKind::kOne>();
  } else if (p == 2) {
    f.template operator()<NormKind::kTwo>();
  } else if (std::isinf(p)) {
    if (p > 0) {
      f.template operator()<NormKind::kInf>();
    } else {
      f.template operator()<NormKind::kNegInf>();
    }
  } else {
    f.template operator()<NormKind::kGeneral>();
  }
}

template <typename T, typename F, NormKind kKind>
struct NormReducer {
  using acc_t = F;
  T* out;
  F p;
  KILN_SCALAR_HD acc_t init() const {
    return kKind == NormKind::kNegInf ? std::numeric_limits<F>::infinity() : F(0);
  }
  KILN_SCALAR_HD void step(acc_t& a, T x, int64_t) const {
    const F v = to_acc<F>(x);
    if constexpr (kKind == NormKind::kZero) {
      a += v != F(0) ? F(1) : F(0);
    } else if constexpr (kKind == NormKind::kOne) {
      a += math::abs(v);
    } else if constexpr (kKind == NormKind::kTwo) {
      a += v * v;
    } else if constexpr (kKind == NormKind::kInf) {
      a = pick<true>(a, math::abs(v));
    } else if constexpr (kKind == NormKind::kNegInf) {
      a = pick<false>(a, math::abs(v));
    } else {
      a += math::pow(math::abs(v), p);
    }
  }
  KILN_SCALAR_HD acc_t merge(acc_t a, acc_t b) const {
    if constexpr (kKind == NormKind::kInf) {
      return pick<true>(a, b);
    } else if constexpr (kKind == NormKind::kNegInf) {
      return pick<false>(a, b);
    } else {
      return a + b;
    }
  }
  KILN_SCALAR_HD void finish(acc_t a, int64_t i) const {
    if constexpr (kKind == NormKind::kTwo) {
      a = math::sqrt(a);
    } else if constexpr (kKind == NormKind::kGeneral) {
      a = math::pow(a, F(1) / p);
    }
    out[i] = from_acc<T>(a);
  }
};

// --- logsumexp --------------------------------------------------------------------------------

// Online log-sum-exp: the running maximum m and sum s of exp(x - m). Rows of -inf give -inf,
// a +inf gives +inf, NaN propagates; the maximum is never subtracted from itself when infinite.
template <typename F>
struct LseAcc {
  F m, s;
};

template <typename T, typename F>
struct LogSumExpReducer {
  using acc_t = LseAcc<F>;
  T* out;
  static KILN_SCALAR_HD acc_t nan_acc() { return {std::numeric_limits<F>::quiet_NaN(), F(1)}; }
  KILN_SCALAR_HD acc_t init() const { return {-std::numeric_limits<F>::infinity(), F(0)}; }
  KILN_SCALAR_HD void step(acc_t& a, T x, int64_t) const {
    const F v = to_acc<F>(x);
    if (v == -std::numeric_limits<F>::infinity()) return;  // contributes exp(-inf) = 0
    if (math::is_nan(v) || math::is_nan(a.m)) {
      a = nan_acc();
    } else if (a.s == 0) {
      a = {v, F(1)};
    } else if (v == a.m) {
      a.s += 1;
    } else if (v > a.m) {
      a = {v, a.s * math::exp(a.m - v) + 1};
    } else {
      a.s += math::exp(v - a.m);
    }
  }
  KILN_SCALAR_HD acc_t merge(const acc_t& a, const acc_t& b) const {
    if (math::is_nan(a.m) || math::is_nan(b.m)) return nan_acc();
    if (a.s == 0) return b;
    if (b.s == 0) return a;
    if (a.m == b.m) return {a.m, a.s + b.s};
    if (a.m > b.m) return {a.m, a.s + b.s * math::exp(b.m - a.m)};
    return {b.m, b.s + a.s * math::exp(a.m - b.m)};
  }
  KILN_SCALAR_HD void finish(const acc_t& a, int64_t i) const {
    out[i] = from_acc<T>(a.s == 0 ? -std::numeric_limits<F>::infinity() : math::log(a.s) + a.m);
  }
};

// --- all, any ---------------------------------------------------------------------------------

template <typename T, bool kAll>
struct LogicalReducer {
  using acc_t = bool;
  bool* out;
  KILN_SCALAR_HD acc_t init() const { return kAll; }
  KILN_SCALAR_HD void step(acc_t& a, T x, int64_t) const {
    const bool v = static_cast<opmath_t<T>>(x) != opmath_t<T>(0);
    a = kAll ? (a && v) : (a || v);
  }
  KILN_SCALAR_HD acc_t merge(acc_t a, acc_t b) const { return kAll ? (a && b) : (a || b); }
  KILN_SCALAR_HD void finish(acc_t a, int64_t i) const { out[i] = a; }
};

// --- The op kernels, for either device -----------------------------------------------------------

// A tensor's elements as a contiguous [A, R, K] block around `dim` (the ops that walk along one
// dim: cumsum, softmax); a 0-d tensor is [1, 1, 1].
struct DimBlock {
  int64_t A, R, K;
};
inline DimBlock dim_block(const Tensor& x, int64_t dim) {
  const int64_t R = x.dim() == 0 ? 1 : x.sizes()[dim];
  const int64_t K = x.dim() == 0 ? 1 : numel_of(x.sizes().subspan(dim + 1));
  return {x.numel() / (R * K), R, K};
}

// The kernels of the reduction ops (all but cumsum) for one device: each decodes the op's
// attributes, picks the reducer and binds its outputs; Loop, the device's side
// (kernels/cpu/reduce.cpp, kernels/cuda/reduce.cu), supplies the rest:
//
//   struct Loop {
//     template <typename T> using float_acc = double;  // the floating accumulator of T
//     template <typename T, bool kMax> static Red extremum(T* out);  // the amax/amin reducer
//     // Runs red over x (of dtype T) reduced over dims (index_order: as for reduce_block).
//     template <typename T, typename Red>
//     static void run(const Tensor& x, IntArrayRef dims, const Red& red, bool index_order);
//   };
//   KILN_REGISTER_REDUCE_KERNELS(kCPU, Loop);
template <typename Loop>
struct ReduceOps {
  template <typename T>
  using F = typename Loop::template float_acc<T>;

  static Tensor as_dtype(const Tensor& t, ScalarType dtype) {
    return t.dtype() == dtype ? t : t.to(dtype);
  }
  static Shape dims_attr(const OpCall& c, size_t i) {
    return reduction_dims(c.attr<Shape>(i), c.input(0).dim(), c.name().c_str());
  }
  // The one dim of max_dim/argmax (attribute 0), or every dim where argmax has none.
  static Shape dim_attr(const OpCall& c) {
    const int64_t ndim = c.input(0).dim();
    return c.has_attr(0) ? reduction_dims({c.attr<int64_t>(0)}, ndim, c.name().c_str())
                         : reduction_dims({}, ndim, c.name().c_str());
  }

  static void sum(OpCall& c) {
    const Tensor& out = c.outputs[0];
    const Tensor x = as_dtype(c.input(0), out.dtype());
    const Shape dims = dims_attr(c, 0);
    visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
      Loop::template run<T>(x, dims, SumReducer<T, F<T>>{out.data_ptr<T>(), F<T>(1)}, false);
    });
  }

  static void mean(OpCall& c) {
    const Tensor& out = c.outputs[0];
    const Tensor x = as_dtype(c.input(0), out.dtype());
    const Shape dims = dims_attr(c, 0);
    int64_t count = 1;
    for (int64_t d : dims) count *= x.sizes()[d];
    visit_floating(out.dtype(), "mean", [&]<typename T>(TypeTag<T>) {
      // An empty reduction gives 0 * (1 / 0) = nan, as PyTorch's mean.
      const double scale = count == 0 ? std::numeric_limits<double>::quiet_NaN() : 1.0 / count;
      Loop::template run<T>(
          x, dims, SumReducer<T, F<T>>{out.data_ptr<T>(), static_cast<F<T>>(scale)}, false);
    });
  }

  static void prod(OpCall& c) {
    const Tensor& out = c.outputs[0];
    const Tensor x = as_dtype(c.input(0), out.dtype());
    const Shape dims = dims_attr(c, 0);
    visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
      Loop::template run<T>(x, dims, ProdReducer<T, F<T>>{out.data_ptr<T>()}, false);
    });
  }

  template <bool kMax>
  static void extremum(OpCall& c) {
    const Shape dims = dims_attr(c, 0);
    visit_dtype(c.input(0).dtype(), [&]<typename T>(TypeTag<T>) {
      Loop::template run<T>(c.input(0), dims,
                            Loop::template extremum<T, kMax>(c.outputs[0].data_ptr<T>()), false);
    });
  }

  // max/min with indices (max_dim, min_dim) and argmax/argmin: indices along the reduced dims in
  // row-major order.
  template <bool kMax>
  static void max_dim(OpCall& c) {
    const Shape dims = dim_attr(c);
    visit_dtype(c.input(0).dtype(), [&]<typename T>(TypeTag<T>) {
      const ArgReducer<T, kMax> red{c.outputs[0].data_ptr<T>(), c.outputs[1].data_ptr<int64_t>()};
      Loop::template run<T>(c.input(0), dims, red, true);
    });
  }
  template <bool kMax>
  static void argmax(OpCall& c) {
    const Shape dims = dim_attr(c);
    visit_dtype(c.input(0).dtype(), [&]<typename T>(TypeTag<T>) {
      const ArgReducer<T, kMax> red{nullptr, c.outputs[0].data_ptr<int64_t>()};
      Loop::template run<T>(c.input(0), dims, red, true);
    });
  }

  template <bool kStd>
  static void var(OpCall& c) {
    const Shape dims = dims_attr(c, 0);
    const double correction = static_cast<double>(c.attr<int64_t>(1));
    visit_floating(c.input(0).dtype(), c.name(), [&]<typename T>(TypeTag<T>) {
      const VarReducer<T, F<T>, kStd> red{c.outputs[0].data_ptr<T>(),
                                          static_cast<F<T>>(correction)};
      Loop::template run<T>(c.input(0), dims, red, false);
    });
  }

  static void norm(OpCall& c) {
    const double p = c.attr<Scalar>(0).toDouble();
    const Shape dims = dims_attr(c, 1);
    visit_floating(c.input(0).dtype(), "norm", [&]<typename T>(TypeTag<T>) {
      visit_norm_kind(p, [&]<NormKind kKind>() {
        const NormReducer<T, F<T>, kKind> red{c.outputs[0].data_ptr<T>(), static_cast<F<T>>(p)};
        Loop::template run<T>(c.input(0), dims, red, false);
      });
    });
  }

  static void logsumexp(OpCall& c) {
    const Tensor& out = c.outputs[0];
    const Tensor x = as_dtype(c.input(0), out.dtype());
    const Shape dims = dims_attr(c, 0);
    visit_floating(out.dtype(), "logsumexp", [&]<typename T>(TypeTag<T>) {
      Loop::template run<T>(x, dims, LogSumExpReducer<T, F<T>>{out.data_ptr<T>()}, false);
    });
  }

  template <bool kAll>
  static void logical(OpCall& c) {
    const Shape dims = dims_attr(c, 0);
    visit_dtype(c.input(0).dtype(), [&]<typename T>(TypeTag<T>) {
      Loop::template run<T>(c.input(0), dims,
                            LogicalReducer<T, kAll>{c.outputs[0].data_ptr<bool>()}, false);
    });
  }
};

}  // namespace kiln::scalar

// Registers ReduceOps<Loop>'s kernels of every reduction op (all but cumsum) for `device`.
#define KILN_REGISTER_REDUCE_KERNELS(device, Loop)                                        \
  KILN_REGISTER_KERNEL(sum, device, ::kiln::scalar::ReduceOps<Loop>::sum);                \
  KILN_REGISTER_KERNEL(mean, device, ::kiln::scalar::ReduceOps<Loop>::mean);              \
  KILN_REGISTER_KERNEL(prod, device, ::kiln::scalar::ReduceOps<Loop>::prod);              \
  KILN_REGISTER_KERNEL(amax, device, ::kiln::scalar::ReduceOps<Loop>::extremum<true>);    \
  KILN_REGISTER_KERNEL(amin, device, ::kiln::scalar::ReduceOps<Loop>::extremum<false>);   \
  KILN_REGISTER_KERNEL(max, device, ::kiln::scalar::ReduceOps<Loop>::extremum<true>);     \
  KILN_REGISTER_KERNEL(min, device, ::kiln::scalar::ReduceOps<Loop>::extremum<false>);    \
  KILN_REGISTER_KERNEL(max_dim, device, ::kiln::scalar::ReduceOps<Loop>::max_dim<true>);  \
  KILN_REGISTER_KERNEL(min_dim, device, ::kiln::scalar::ReduceOps<Loop>::max_dim<false>); \
  KILN_REGISTER_KERNEL(argmax, device, ::kiln::scalar::ReduceOps<Loop>::argmax<true>);    \
  KILN_REGISTER_KERNEL(argmin, device, ::kiln::scalar::ReduceOps<Loop>::argmax<false>);   \
  KILN_REGISTER_KERNEL(var, device, ::kiln::scalar::ReduceOps<Loop>::var<false>);         \
  KILN_REGISTER_KERNEL(std, device, ::kiln::scalar::ReduceOps<Loop>::var<true>);          \
  KILN_REGISTER_KERNEL(norm, device, ::kiln::scalar::ReduceOps<Loop>::norm);              \
  KILN_REGISTER_KERNEL(logsumexp, device, ::kiln::scalar::ReduceOps<Loop>::logsumexp);    \
  KILN_REGISTER_KERNEL(all, device, ::kiln::scalar::ReduceOps<Loop>::logical<true>);      \
  KILN_REGISTER_KERNEL(any, device, ::kiln::scalar::ReduceOps<Loop>::logical<false>)
