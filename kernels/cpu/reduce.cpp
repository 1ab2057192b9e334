// CPU kernels of the reductions (sum, mean, prod, amax/amin, max/min with indices, argmax/argmin,
// var/std, norm, logsumexp, all/any) and of cumsum. Floating types accumulate in double and
// integers in int64 (wrapping on overflow, as PyTorch); the meta rules in tensor/ops/reduce.cpp
// have already checked the arguments and chosen the output dtypes. The op kernels themselves
// (attributes, reducers, registration) are kernels/reduce_fn.h's ReduceOps, shared with the CUDA
// kernels; this file holds the CPU's side of them (CpuLoop), the [A, R, K] block and cumsum.
#include "kernels/cpu/reduce.h"

#include <algorithm>
#include <bit>
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

template <typename T>
acc_t<T> to_acc(T x) {
  return scalar::to_acc<acc_t<T>>(x);
}

// scalar::ExtremumReducer with a branch-free step, so that the row loop vectorises. Integers
// and bool compare as they are.
template <typename T, bool kMax,
          bool kFloating =
              std::is_floating_point_v<typename scalar::ExtremumReducer<T, kMax>::acc_t>>
struct ExtremumReducer : scalar::ExtremumReducer<T, kMax> {
  using acc_t = typename scalar::ExtremumReducer<T, kMax>::acc_t;
  void step(acc_t& a, T x, int64_t) const {
    const acc_t v = static_cast<acc_t>(x);
    a = (kMax ? v > a : v < a) ? v : a;
  }
};

// Floating values: reduced as integer keys that order them as scalar::pick does, so that the row
// loop is an integer max (min), which vectorises (a float select with the NaN and zero rules did
// not: amax over 4096 rows of 4096 f32 took 16.4 ms on one thread, BM_AmaxRows16M). A value's key
// is its bits with the magnitude bits flipped where the sign is set: -inf < ... < -0 < +0 < ... <
// +inf as signed integers. Every NaN's key is the extreme one, so NaN wins; finish writes it as
// scalar::canonical_nan.
template <typename T, bool kMax>
struct ExtremumReducer<T, kMax, true> : scalar::ExtremumReducer<T, kMax> {
  using F = typename scalar::ExtremumReducer<T, kMax>::acc_t;  // float or double
  using acc_t = std::conditional_t<sizeof(F) == 8, int64_t, int32_t>;
  static constexpr acc_t kMagnitude = std::numeric_limits<acc_t>::max();  // all but the sign
  static constexpr acc_t kNaN =
      kMax ? std::numeric_limits<acc_t>::max() : std::numeric_limits<acc_t>::min();
  static acc_t key(F v) {
    const auto b = std::bit_cast<acc_t>(v);
    const acc_t inf = std::bit_cast<acc_t>(std::numeric_limits<F>::infinity());
    const acc_t nan = -static_cast<acc_t>((b & kMagnitude) > inf);  // all ones for NaN
    const acc_t k = b ^ ((b >> (sizeof(acc_t) * 8 - 1)) & kMagnitude);
    return (k & ~nan) | (kNaN & nan);
  }
  acc_t init() const {  // below (max) or above (min) every value's key, NaN's too
    return kMax ? std::numeric_limits<acc_t>::min() : std::numeric_limits<acc_t>::max();
  }
  void step(acc_t& a, T x, int64_t) const { a = merge(a, key(static_cast<F>(x))); }
  acc_t merge(acc_t a, acc_t b) const { return kMax ? std::max(a, b) : std::min(a, b); }
  void finish(acc_t a, int64_t i) const {
    const F v = a == kNaN ? scalar::canonical_nan<F>()
                          : std::bit_cast<F>(a ^ ((a >> (sizeof(acc_t) * 8 - 1)) & kMagnitude));
    this->out[i] = scalar::from_acc<T>(v);
  }
};

// The CPU side of the reduction ops (scalar::ReduceOps): floats accumulate in double, and the
// loop of kernels/cpu/reduce.h runs the reducer.
struct CpuLoop {
  template <typename T>
  using float_acc = double;
  template <typename T, bool kMax>
  static ExtremumReducer<T, kMax> extremum(T* out) {
    return {{out}};
  }
  template <typename T, typename Red>
  static void run(const Tensor& x, IntArrayRef dims, const Red& red, bool index_order) {
    const ReduceBlock b = reduce_block(x, dims, index_order);
    const T* p = b.input.numel() == 0 ? nullptr : b.input.template data_ptr<T>();
    reduce_loop<T>(red, p, b.outer, b.reduced, b.inner);
  }
};

// --- cumsum -----------------------------------------------------------------------------------

void cumsum_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  if (out.numel() == 0) return;
  const Tensor x = as_dtype(c.input(0), out.dtype()).contiguous();
  // [A, R, K] with the scanned dim in the middle; both tensors contiguous.
  const scalar::DimBlock blk =
      scalar::dim_block(x, wrap_dim(c.attr<int64_t>(0), x.dim(), "cumsum"));
  const int64_t A = blk.A, R = blk.R, K = blk.K;
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

KILN_REGISTER_REDUCE_KERNELS(kCPU, CpuLoop);
KILN_REGISTER_KERNEL(cumsum, kCPU, cumsum_cpu);

}  // namespace kiln::cpu
