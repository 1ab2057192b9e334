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
#include "kernels/reduce_fn.h"
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

// Floating types accumulate in double, integers in int64.
template <typename T>
using acc_t = scalar::sum_acc_t<T, double>;

using scalar::from_acc;
using scalar::NormKind;

template <typename T>
acc_t<T> to_acc(T x) {
  return scalar::to_acc<acc_t<T>>(x);
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

// The reducers are those of kernels/reduce_fn.h (shared with the CUDA kernels), accumulating
// floats in double.
template <typename T>
using SumReducer = scalar::SumReducer<T, double>;
template <typename T>
using ProdReducer = scalar::ProdReducer<T, double>;

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

// scalar::ExtremumReducer with a branch-free step, so that the row loop vectorises; a NaN in `a`
// stays (both tests fail).
template <typename T, bool kMax>
struct ExtremumReducer : scalar::ExtremumReducer<T, kMax> {
  using acc_t = typename scalar::ExtremumReducer<T, kMax>::acc_t;
  void step(acc_t& a, T x, int64_t) const {
    const acc_t v = static_cast<acc_t>(x);
    if constexpr (std::is_floating_point_v<acc_t>) {
      a = ((kMax ? v > a : v < a) || v != v) ? v : a;
    } else {
      a = (kMax ? v > a : v < a) ? v : a;
    }
  }
};

template <bool kMax>
void extremum_cpu(OpCall& c) {
  const Tensor& x = c.input(0);
  const Shape dims = dims_attr(c, 0);
  visit_dtype(x.dtype(), [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(x, dims, ExtremumReducer<T, kMax>{{c.outputs[0].data_ptr<T>()}});
  });
}

// --- max/min with indices, argmax/argmin -------------------------------------------------------

using scalar::ArgReducer;

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

template <bool kStd>
void var_cpu(OpCall& c) {
  const Tensor& x = c.input(0);
  const Shape dims = dims_attr(c, 0);
  const double correction = static_cast<double>(c.attr<int64_t>(1));
  visit_floating(x.dtype(), c.name(), [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(x, dims,
                     scalar::VarReducer<T, double, kStd>{c.outputs[0].data_ptr<T>(), correction});
  });
}

// --- norm -------------------------------------------------------------------------------------

void norm_cpu(OpCall& c) {
  const Tensor& x = c.input(0);
  const double p = c.attr<Scalar>(0).toDouble();
  const Shape dims = dims_attr(c, 1);
  visit_floating(x.dtype(), "norm", [&]<typename T>(TypeTag<T>) {
    T* out = c.outputs[0].data_ptr<T>();
    scalar::visit_norm_kind(p, [&]<NormKind kKind>() {
      run_reduction<T>(x, dims, scalar::NormReducer<T, double, kKind>{out, p});
    });
  });
}

// --- logsumexp --------------------------------------------------------------------------------

void logsumexp_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor x = as_dtype(c.input(0), out.dtype());
  const Shape dims = dims_attr(c, 0);
  visit_floating(out.dtype(), "logsumexp", [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(x, dims, scalar::LogSumExpReducer<T, double>{out.data_ptr<T>()});
  });
}

// --- all, any ---------------------------------------------------------------------------------

template <bool kAll>
void logical_reduce_cpu(OpCall& c) {
  const Tensor& x = c.input(0);
  const Shape dims = dims_attr(c, 0);
  visit_dtype(x.dtype(), [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(x, dims, scalar::LogicalReducer<T, kAll>{c.outputs[0].data_ptr<bool>()});
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
                  acc[kk] = scalar::wrap_add(acc[kk], to_acc(in[off + kk]));
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
