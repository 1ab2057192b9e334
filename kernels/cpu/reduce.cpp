// CPU kernels of the reductions (sum, mean, prod, amax/amin, max/min with indices, argmax/argmin,
// var/std, norm, logsumexp, all/any) and of cumsum. Floating types accumulate in double and
// integers in int64 (wrapping on overflow, as PyTorch); the meta rules in tensor/ops/reduce.cpp
// have already checked the arguments and chosen the output dtypes.
#include "kernels/cpu/reduce.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kernels/cpu/loops.h"
#include "tensor/registry.h"

namespace kiln::cpu {

ReduceBlock reduce_block(const Tensor& t, IntArrayRef dims, bool index_order) {
  const int64_t ndim = t.dim();
  std::vector<bool> reduced(static_cast<size_t>(ndim), false);
  for (int64_t d : dims) reduced[d] = true;
  int64_t kept_numel = 1, reduced_numel = 1;
  for (int64_t d = 0; d < ndim; ++d) (reduced[d] ? reduced_numel : kept_numel) *= t.sizes()[d];
  if (t.numel() == 0) return {t, kept_numel, reduced_numel, 1};

  // The dims in memory order (size-1 dims do not matter). When they tile memory densely and
  // the kept dims keep their relative order (a contiguous tensor, or e.g. a transposed one
  // reduced over one of its dims), element (a, k) of the [A, R, K] view is output a * K + k.
  struct DimInfo {
    int64_t size, stride, index;
  };
  absl::InlinedVector<DimInfo, 5> order;
  for (int64_t d = 0; d < ndim; ++d) {
    if (t.sizes()[d] != 1) order.push_back({t.sizes()[d], t.strides()[d], d});
  }
  std::stable_sort(order.begin(), order.end(),
                   [](const DimInfo& a, const DimInfo& b) { return a.stride > b.stride; });
  bool direct = true;
  int64_t expected = 1, last_kept = -1, last_reduced = -1;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    direct = direct && it->stride == expected;
    expected *= it->size;
  }
  for (const DimInfo& d : order) {
    int64_t& last = reduced[d.index] ? last_reduced : last_kept;
    if (!reduced[d.index] || index_order) direct = direct && d.index > last;
    last = d.index;
  }
  if (direct) {
    // Runs of kept and reduced dims; [kept][reduced][kept] at most.
    absl::InlinedVector<std::pair<bool, int64_t>, 5> runs;
    for (const DimInfo& d : order) {
      if (!runs.empty() && runs.back().first == reduced[d.index]) {
        runs.back().second *= d.size;
      } else {
        runs.emplace_back(reduced[d.index], d.size);
      }
    }
    const bool starts_reduced = !runs.empty() && runs.front().first;
    if (runs.size() <= (starts_reduced ? 2u : 3u)) {
      ReduceBlock b{t};
      size_t i = 0;
      if (i < runs.size() && !runs[i].first) b.outer = runs[i++].second;
      if (i < runs.size() && runs[i].first) b.reduced = runs[i++].second;
      if (i < runs.size()) b.inner = runs[i++].second;
      if (b.reduced == 1) {  // nothing reduced: one row per output
        b.outer *= b.inner;
        b.inner = 1;
      }
      return b;
    }
  }
  // Kept dims first, then reduced dims, each in their original order, copied contiguous.
  Shape perm;
  for (int64_t d = 0; d < ndim; ++d) {
    if (!reduced[d]) perm.push_back(d);
  }
  for (int64_t d = 0; d < ndim; ++d) {
    if (reduced[d]) perm.push_back(d);
  }
  return {t.permute(perm).contiguous(), kept_numel, reduced_numel, 1};
}

namespace {

template <typename T>
using acc_t = std::conditional_t<std::is_integral_v<T>, int64_t, double>;

template <typename T>
acc_t<T> to_acc(T x) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<int64_t>(x);
  } else {
    return static_cast<double>(static_cast<opmath_t<T>>(x));
  }
}

template <typename T, typename V>
T from_acc(V v) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
    return T(static_cast<float>(v));
  } else {
    return static_cast<T>(v);
  }
}

template <typename T>
bool is_nan(T x) {
  if constexpr (std::is_integral_v<T>) {
    return false;
  } else {
    return std::isnan(static_cast<double>(x));
  }
}

// Integer arithmetic wraps (two's complement), as PyTorch's does in practice.
inline int64_t wrap_add(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}
inline int64_t wrap_mul(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
}

Shape dims_attr(const OpCall& c, size_t i) {
  return reduction_dims(c.attr<Shape>(i), c.input(0).dim(), c.name().c_str());
}

// Runs `red` over `x` (already of dtype T) reduced over `dims`. index_order: the reducer needs
// the index along R to be the row-major index over the reduced dims (argmax).
template <typename T, typename Red>
void run_reduction(const Tensor& x, IntArrayRef dims, const Red& red, bool index_order = false) {
  const ReduceBlock b = reduce_block(x, dims, index_order);
  const T* p = b.input.numel() == 0 ? nullptr : b.input.template data_ptr<T>();
  reduce_loop<T>(red, p, b.outer, b.reduced, b.inner);
}

// --- sum, mean, prod --------------------------------------------------------------------------

template <typename T>
struct SumReducer {
  using acc_t = cpu::acc_t<T>;
  T* out;
  double scale;  // 1 for sum, 1 / count for mean
  acc_t init() const { return 0; }
  void step(acc_t& a, T x, int64_t) const {
    if constexpr (std::is_integral_v<T>) {
      a = wrap_add(a, to_acc(x));
    } else {
      a += to_acc(x);
    }
  }
  acc_t merge(acc_t a, acc_t b) const {
    if constexpr (std::is_integral_v<T>) {
      return wrap_add(a, b);
    } else {
      return a + b;
    }
  }
  void finish(acc_t a, int64_t i) const {
    if constexpr (std::is_integral_v<T>) {
      out[i] = static_cast<T>(a);
    } else {
      out[i] = from_acc<T>(a * scale);
    }
  }
};

template <typename T>
struct ProdReducer {
  using acc_t = cpu::acc_t<T>;
  T* out;
  acc_t init() const { return 1; }
  void step(acc_t& a, T x, int64_t) const { a = merge(a, to_acc(x)); }
  acc_t merge(acc_t a, acc_t b) const {
    if constexpr (std::is_integral_v<T>) {
      return wrap_mul(a, b);
    } else {
      return a * b;
    }
  }
  void finish(acc_t a, int64_t i) const { out[i] = from_acc<T>(a); }
};

void sum_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor x = as_dtype(c.input(0), out.dtype());
  const Shape dims = dims_attr(c, 0);
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(x, dims, SumReducer<T>{out.data_ptr<T>(), 1.0});
  });
}

void mean_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor x = as_dtype(c.input(0), out.dtype());
  const Shape dims = dims_attr(c, 0);
  int64_t count = 1;
  for (int64_t d : dims) count *= x.sizes()[d];
  visit_floating(out.dtype(), "mean", [&]<typename T>(TypeTag<T>) {
    // An empty reduction gives 0 * (1 / 0) = nan, as PyTorch's mean.
    const double scale = count == 0 ? std::numeric_limits<double>::quiet_NaN() : 1.0 / count;
    run_reduction<T>(x, dims, SumReducer<T>{out.data_ptr<T>(), scale});
  });
}

void prod_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor x = as_dtype(c.input(0), out.dtype());
  const Shape dims = dims_attr(c, 0);
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(x, dims, ProdReducer<T>{out.data_ptr<T>()});
  });
}

// --- amax, amin, max, min ---------------------------------------------------------------------

// The larger (kMax) or smaller of a and b; NaN wins.
template <bool kMax, typename V>
V pick(V a, V b) {
  if (is_nan(a)) return a;
  if (is_nan(b)) return b;
  if constexpr (kMax) {
    return b > a ? b : a;
  } else {
    return b < a ? b : a;
  }
}

template <typename T, bool kMax>
struct ExtremumReducer {
  using acc_t = std::conditional_t<std::is_same_v<T, bool>, bool, opmath_t<T>>;
  T* out;
  acc_t init() const {
    if constexpr (std::is_same_v<T, bool>) {
      return !kMax;
    } else if constexpr (std::is_integral_v<T>) {
      return kMax ? std::numeric_limits<T>::lowest() : std::numeric_limits<T>::max();
    } else {
      return kMax ? -std::numeric_limits<acc_t>::infinity()
                  : std::numeric_limits<acc_t>::infinity();
    }
  }
  void step(acc_t& a, T x, int64_t) const {
    // Branch-free so that the row loop vectorises; a NaN in `a` stays (both tests fail).
    const acc_t v = static_cast<acc_t>(x);
    if constexpr (std::is_floating_point_v<acc_t>) {
      a = ((kMax ? v > a : v < a) || v != v) ? v : a;
    } else {
      a = (kMax ? v > a : v < a) ? v : a;
    }
  }
  acc_t merge(acc_t a, acc_t b) const { return pick<kMax>(a, b); }
  void finish(acc_t a, int64_t i) const { out[i] = from_acc<T>(a); }
};

template <bool kMax>
void extremum_cpu(OpCall& c) {
  const Tensor& x = c.input(0);
  const Shape dims = dims_attr(c, 0);
  visit_dtype(x.dtype(), [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(x, dims, ExtremumReducer<T, kMax>{c.outputs[0].data_ptr<T>()});
  });
}

// --- max/min with indices, argmax/argmin -------------------------------------------------------

// Value and index of the best element so far; index -1 means none yet. Ties keep the lowest
// index and the first NaN beats everything, as PyTorch.
template <typename T, bool kMax>
struct ArgReducer {
  using value_t = std::conditional_t<std::is_same_v<T, bool>, bool, opmath_t<T>>;
  struct acc_t {
    value_t value;
    int64_t index;
  };
  T* values;  // may be null (argmax)
  int64_t* indices;

  static bool better(value_t x, value_t than) {
    if (is_nan(than)) return false;
    if (is_nan(x)) return true;
    if constexpr (kMax) {
      return x > than;
    } else {
      return x < than;
    }
  }
  acc_t init() const { return {value_t{}, -1}; }
  void step(acc_t& a, T x, int64_t r) const {
    const value_t v = static_cast<value_t>(x);
    if (a.index < 0 || better(v, a.value)) a = {v, r};
  }
  acc_t merge(const acc_t& a, const acc_t& b) const {
    if (a.index < 0) return b;
    if (b.index < 0) return a;
    if (better(b.value, a.value)) return b;
    if (better(a.value, b.value)) return a;
    return a.index <= b.index ? a : b;
  }
  void finish(const acc_t& a, int64_t i) const {
    if (values != nullptr) values[i] = from_acc<T>(a.value);
    indices[i] = a.index;
  }
};

template <bool kMax>
void max_dim_cpu(OpCall& c) {
  const Tensor& x = c.input(0);
  const Shape dims = reduction_dims({c.attr<int64_t>(0)}, x.dim(), c.name().c_str());
  visit_dtype(x.dtype(), [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(
        x, dims, ArgReducer<T, kMax>{c.outputs[0].data_ptr<T>(), c.outputs[1].data_ptr<int64_t>()},
        /*index_order=*/true);
  });
}

template <bool kMax>
void argmax_cpu(OpCall& c) {
  const Tensor& x = c.input(0);
  // No dim: over the flattened tensor, whose element order reduce_block keeps.
  const Shape dims = c.has_attr(0) ? reduction_dims({c.attr<int64_t>(0)}, x.dim(), c.name().c_str())
                                   : reduction_dims({}, x.dim(), c.name().c_str());
  visit_dtype(x.dtype(), [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(x, dims, ArgReducer<T, kMax>{nullptr, c.outputs[0].data_ptr<int64_t>()},
                     /*index_order=*/true);
  });
}

// --- var, std ---------------------------------------------------------------------------------

// Welford's running mean and sum of squared deviations, merged with Chan's formula.
struct Moments {
  double n = 0, mean = 0, m2 = 0;
};

template <typename T, bool kStd>
struct VarReducer {
  using acc_t = Moments;
  T* out;
  double correction;
  acc_t init() const { return {}; }
  void step(acc_t& a, T x, int64_t) const {
    const double v = to_acc(x);
    a.n += 1;
    const double delta = v - a.mean;
    a.mean += delta / a.n;
    a.m2 += delta * (v - a.mean);
  }
  acc_t merge(const acc_t& a, const acc_t& b) const {
    if (a.n == 0) return b;
    if (b.n == 0) return a;
    const double n = a.n + b.n;
    const double delta = b.mean - a.mean;
    return {n, a.mean + delta * (b.n / n), a.m2 + b.m2 + delta * delta * (a.n * b.n / n)};
  }
  void finish(const acc_t& a, int64_t i) const {
    // PyTorch divides by max(0, N - correction): inf or nan when nothing is left.
    const double var = a.m2 / std::max(0.0, a.n - correction);
    out[i] = from_acc<T>(kStd ? std::sqrt(var) : var);
  }
};

template <bool kStd>
void var_cpu(OpCall& c) {
  const Tensor& x = c.input(0);
  const Shape dims = dims_attr(c, 0);
  const double correction = static_cast<double>(c.attr<int64_t>(1));
  visit_floating(x.dtype(), c.name(), [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(x, dims, VarReducer<T, kStd>{c.outputs[0].data_ptr<T>(), correction});
  });
}

// --- norm -------------------------------------------------------------------------------------

enum class NormKind { kZero, kOne, kTwo, kInf, kNegInf, kGeneral };

template <typename T, NormKind kKind>
struct NormReducer {
  using acc_t = double;
  T* out;
  double p;
  acc_t init() const {
    return kKind == NormKind::kNegInf ? std::numeric_limits<double>::infinity() : 0.0;
  }
  void step(acc_t& a, T x, int64_t) const {
    const double v = to_acc(x);
    if constexpr (kKind == NormKind::kZero) {
      a += v != 0.0 ? 1.0 : 0.0;
    } else if constexpr (kKind == NormKind::kOne) {
      a += std::abs(v);
    } else if constexpr (kKind == NormKind::kTwo) {
      a += v * v;
    } else if constexpr (kKind == NormKind::kInf) {
      a = pick<true>(a, std::abs(v));
    } else if constexpr (kKind == NormKind::kNegInf) {
      a = pick<false>(a, std::abs(v));
    } else {
      a += std::pow(std::abs(v), p);
    }
  }
  acc_t merge(acc_t a, acc_t b) const {
    if constexpr (kKind == NormKind::kInf) {
      return pick<true>(a, b);
    } else if constexpr (kKind == NormKind::kNegInf) {
      return pick<false>(a, b);
    } else {
      return a + b;
    }
  }
  void finish(acc_t a, int64_t i) const {
    if constexpr (kKind == NormKind::kTwo) {
      a = std::sqrt(a);
    } else if constexpr (kKind == NormKind::kGeneral) {
      a = std::pow(a, 1.0 / p);
    }
    out[i] = from_acc<T>(a);
  }
};

void norm_cpu(OpCall& c) {
  const Tensor& x = c.input(0);
  const double p = c.attr<Scalar>(0).toDouble();
  const Shape dims = dims_attr(c, 1);
  visit_floating(x.dtype(), "norm", [&]<typename T>(TypeTag<T>) {
    T* out = c.outputs[0].data_ptr<T>();
    auto run = [&]<NormKind kKind>() { run_reduction<T>(x, dims, NormReducer<T, kKind>{out, p}); };
    if (p == 0) {
      run.template operator()<NormKind::kZero>();
    } else if (p == 1) {
      run.template operator()<NormKind::kOne>();
    } else if (p == 2) {
      run.template operator()<NormKind::kTwo>();
    } else if (std::isinf(p)) {
      if (p > 0) {
        run.template operator()<NormKind::kInf>();
      } else {
        run.template operator()<NormKind::kNegInf>();
      }
    } else {
      run.template operator()<NormKind::kGeneral>();
    }
  });
}

// --- logsumexp --------------------------------------------------------------------------------

// Online log-sum-exp: the running maximum m and sum s of exp(x - m). Rows of -inf give -inf,
// a +inf gives +inf, NaN propagates; the maximum is never subtracted from itself when infinite.
struct LseAcc {
  double m = -std::numeric_limits<double>::infinity();
  double s = 0;
};

inline LseAcc lse_merge(const LseAcc& a, const LseAcc& b) {
  if (std::isnan(a.m) || std::isnan(b.m)) return {std::numeric_limits<double>::quiet_NaN(), 1};
  if (a.s == 0) return b;
  if (b.s == 0) return a;
  if (a.m == b.m) return {a.m, a.s + b.s};
  if (a.m > b.m) return {a.m, a.s + b.s * std::exp(b.m - a.m)};
  return {b.m, b.s + a.s * std::exp(a.m - b.m)};
}

template <typename T>
struct LogSumExpReducer {
  using acc_t = LseAcc;
  T* out;
  acc_t init() const { return {}; }
  void step(acc_t& a, T x, int64_t) const {
    const double v = to_acc(x);
    if (v == -std::numeric_limits<double>::infinity()) return;  // contributes exp(-inf) = 0
    if (std::isnan(v) || std::isnan(a.m)) {
      a = {std::numeric_limits<double>::quiet_NaN(), 1};
    } else if (a.s == 0) {
      a = {v, 1};
    } else if (v == a.m) {
      a.s += 1;
    } else if (v > a.m) {
      a = {v, a.s * std::exp(a.m - v) + 1};
    } else {
      a.s += std::exp(v - a.m);
    }
  }
  acc_t merge(const acc_t& a, const acc_t& b) const { return lse_merge(a, b); }
  void finish(const acc_t& a, int64_t i) const {
    out[i] = from_acc<T>(a.s == 0 ? -std::numeric_limits<double>::infinity() : std::log(a.s) + a.m);
  }
};

void logsumexp_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor x = as_dtype(c.input(0), out.dtype());
  const Shape dims = dims_attr(c, 0);
  visit_floating(out.dtype(), "logsumexp", [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(x, dims, LogSumExpReducer<T>{out.data_ptr<T>()});
  });
}

// --- all, any ---------------------------------------------------------------------------------

template <typename T, bool kAll>
struct LogicalReducer {
  using acc_t = bool;
  bool* out;
  acc_t init() const { return kAll; }
  void step(acc_t& a, T x, int64_t) const {
    const bool v = static_cast<opmath_t<T>>(x) != opmath_t<T>(0);
    a = kAll ? (a && v) : (a || v);
  }
  acc_t merge(acc_t a, acc_t b) const { return kAll ? (a && b) : (a || b); }
  void finish(acc_t a, int64_t i) const { out[i] = a; }
};

template <bool kAll>
void logical_reduce_cpu(OpCall& c) {
  const Tensor& x = c.input(0);
  const Shape dims = dims_attr(c, 0);
  visit_dtype(x.dtype(), [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(x, dims, LogicalReducer<T, kAll>{c.outputs[0].data_ptr<bool>()});
  });
}

// --- cumsum -----------------------------------------------------------------------------------

void cumsum_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  if (out.numel() == 0) return;
  const Tensor x = as_dtype(c.input(0), out.dtype()).contiguous();
  const int64_t dim = wrap_dim(c.attr<int64_t>(0), x.dim(), "cumsum");
  // [A, R, K] with the scanned dim in the middle; both tensors contiguous.
  const int64_t R = x.dim() == 0 ? 1 : x.sizes()[dim];
  const int64_t K = x.dim() == 0 ? 1 : numel_of(x.sizes().subspan(dim + 1));
  const int64_t A = x.numel() / (R * K);
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    const T* in = x.data_ptr<T>();
    T* o = out.data_ptr<T>();
    constexpr int64_t kb = 256;
    const int64_t kblocks = (K + kb - 1) / kb;
    kiln::internal::parallel_for(
        0, A * kblocks, std::max<int64_t>(1, kiln::internal::kGrainSize / (R * std::min(K, kb))),
        [&](int64_t b, int64_t e) {
          acc_t<T> acc[kb];
          for (int64_t t = b; t < e; ++t) {
            const int64_t a = t / kblocks, k0 = (t % kblocks) * kb;
            const int64_t kn = std::min(kb, K - k0);
            for (int64_t kk = 0; kk < kn; ++kk) acc[kk] = 0;
            for (int64_t r = 0; r < R; ++r) {
              const int64_t off = (a * R + r) * K + k0;
              for (int64_t kk = 0; kk < kn; ++kk) {
                if constexpr (std::is_integral_v<T>) {
                  acc[kk] = wrap_add(acc[kk], to_acc(in[off + kk]));
                  o[off + kk] = static_cast<T>(acc[kk]);
                } else {
                  acc[kk] += to_acc(in[off + kk]);
                  o[off + kk] = from_acc<T>(acc[kk]);
                }
              }
            }
          }
        });
  });
}

}  // namespace

KILN_REGISTER_KERNEL(sum, kCPU, sum_cpu);
KILN_REGISTER_KERNEL(mean, kCPU, mean_cpu);
KILN_REGISTER_KERNEL(prod, kCPU, prod_cpu);
KILN_REGISTER_KERNEL(amax, kCPU, extremum_cpu<true>);
KILN_REGISTER_KERNEL(amin, kCPU, extremum_cpu<false>);
KILN_REGISTER_KERNEL(max, kCPU, extremum_cpu<true>);
KILN_REGISTER_KERNEL(min, kCPU, extremum_cpu<false>);
KILN_REGISTER_KERNEL(max_dim, kCPU, max_dim_cpu<true>);
KILN_REGISTER_KERNEL(min_dim, kCPU, max_dim_cpu<false>);
KILN_REGISTER_KERNEL(argmax, kCPU, argmax_cpu<true>);
KILN_REGISTER_KERNEL(argmin, kCPU, argmax_cpu<false>);
KILN_REGISTER_KERNEL(var, kCPU, var_cpu<false>);
KILN_REGISTER_KERNEL(std, kCPU, var_cpu<true>);
KILN_REGISTER_KERNEL(norm, kCPU, norm_cpu);
KILN_REGISTER_KERNEL(logsumexp, kCPU, logsumexp_cpu);
KILN_REGISTER_KERNEL(all, kCPU, logical_reduce_cpu<true>);
KILN_REGISTER_KERNEL(any, kCPU, logical_reduce_cpu<false>);
KILN_REGISTER_KERNEL(cumsum, kCPU, cumsum_cpu);

}  // namespace kiln::cpu
