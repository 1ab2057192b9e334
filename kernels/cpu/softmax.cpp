// CPU kernels of softmax and log_softmax: y = exp(x - m) / s and y = x - m - log(s), with m the
// maximum along the dim and s = sum exp(x - m), so that no exp overflows. The input is viewed as
// a contiguous [A, R, K] block with the softmax dim in the middle: rows when K = 1 (the usual
// last-dim case), otherwise blocks of columns walked together so that the inner loop runs along
// contiguous memory. Arithmetic is in opmath_t (float for f16/bf16). A row of -inf gives nan,
// as PyTorch.
#include <cmath>
#include <limits>

#include "kernels/cpu/loops.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

template <typename T, bool kLog>
void softmax_row(const T* x, T* y, int64_t n) {
  using M = opmath_t<T>;
  M m = -std::numeric_limits<M>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    const M v = static_cast<M>(x[i]);
    m = v > m ? v : m;
  }
  M s = 0;
  if constexpr (!kLog && std::is_same_v<T, M>) {
    // Full-precision output: keep exp(x - m) in y and scale it afterwards (one exp each).
    for (int64_t i = 0; i < n; ++i) {
      y[i] = std::exp(x[i] - m);
      s += y[i];
    }
    const M inv = M(1) / s;
    for (int64_t i = 0; i < n; ++i) y[i] *= inv;
  } else {
    for (int64_t i = 0; i < n; ++i) s += std::exp(static_cast<M>(x[i]) - m);
    if constexpr (kLog) {
      // (x - m) - log(s), not x - (m + log(s)): m may be large next to log(s).
      const M log_s = std::log(s);
      for (int64_t i = 0; i < n; ++i) y[i] = T((static_cast<M>(x[i]) - m) - log_s);
    } else {
      const M inv = M(1) / s;
      for (int64_t i = 0; i < n; ++i) y[i] = T(std::exp(static_cast<M>(x[i]) - m) * inv);
    }
  }
}

// Columns [k0, k0 + kn) of block a of the [A, R, K] tensors x and y.
template <typename T, bool kLog>
void softmax_columns(const T* x, T* y, int64_t R, int64_t K, int64_t a, int64_t k0, int64_t kn,
                     opmath_t<T>* m, opmath_t<T>* s) {
  using M = opmath_t<T>;
  const T* xa = x + a * R * K + k0;
  T* ya = y + a * R * K + k0;
  for (int64_t kk = 0; kk < kn; ++kk) {
    m[kk] = -std::numeric_limits<M>::infinity();
    s[kk] = 0;
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t kk = 0; kk < kn; ++kk) {
      const M v = static_cast<M>(xa[r * K + kk]);
      m[kk] = v > m[kk] ? v : m[kk];
    }
  }
  if constexpr (!kLog && std::is_same_v<T, M>) {
    // As in softmax_row: store exp(x - m), then scale (one exp per element).
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t kk = 0; kk < kn; ++kk) {
        ya[r * K + kk] = std::exp(xa[r * K + kk] - m[kk]);
        s[kk] += ya[r * K + kk];
      }
    }
    for (int64_t kk = 0; kk < kn; ++kk) s[kk] = M(1) / s[kk];
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t kk = 0; kk < kn; ++kk) ya[r * K + kk] *= s[kk];
    }
    return;
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t kk = 0; kk < kn; ++kk) s[kk] += std::exp(static_cast<M>(xa[r * K + kk]) - m[kk]);
  }
  for (int64_t kk = 0; kk < kn; ++kk) {
    if constexpr (kLog) {
      s[kk] = std::log(s[kk]);
    } else {
      s[kk] = M(1) / s[kk];
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t kk = 0; kk < kn; ++kk) {
      const M v = static_cast<M>(xa[r * K + kk]);
      if constexpr (kLog) {
        ya[r * K + kk] = T((v - m[kk]) - s[kk]);
      } else {
        ya[r * K + kk] = T(std::exp(v - m[kk]) * s[kk]);
      }
    }
  }
}

template <bool kLog>
void softmax_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  if (out.numel() == 0) return;
  const Tensor x = as_dtype(c.input(0), out.dtype()).contiguous();
  const int64_t dim = wrap_dim(c.attr<int64_t>(0), x.dim(), c.name().c_str());
  const int64_t R = x.dim() == 0 ? 1 : x.sizes()[dim];
  const int64_t K = x.dim() == 0 ? 1 : numel_of(x.sizes().subspan(dim + 1));
  const int64_t A = x.numel() / (R * K);
  visit_floating(out.dtype(), c.name(), [&]<typename T>(TypeTag<T>) {
    const T* in = x.data_ptr<T>();
    T* o = out.data_ptr<T>();
    if (K == 1) {
      kiln::internal::parallel_for(0, A, std::max<int64_t>(1, kiln::internal::kGrainSize / R),
                                   [&](int64_t b, int64_t e) {
                                     for (int64_t a = b; a < e; ++a)
                                       softmax_row<T, kLog>(in + a * R, o + a * R, R);
                                   });
      return;
    }
    constexpr int64_t kb = 1024;  // columns walked together: 1024 contiguous elements per row
    const int64_t kblocks = (K + kb - 1) / kb;
    kiln::internal::parallel_for(
        0, A * kblocks, std::max<int64_t>(1, kiln::internal::kGrainSize / (R * std::min(K, kb))),
        [&](int64_t b, int64_t e) {
          opmath_t<T> m[kb], s[kb];
          for (int64_t t = b; t < e; ++t) {
            const int64_t a = t / kblocks, k0 = (t % kblocks) * kb;
            softmax_columns<T, kLog>(in, o, R, K, a, k0, std::min(kb, K - k0), m, s);
          }
        });
  });
}

}  // namespace

KILN_REGISTER_KERNEL(softmax, kCPU, softmax_cpu<false>);
KILN_REGISTER_KERNEL(log_softmax, kCPU, softmax_cpu<true>);

}  // namespace kiln::cpu
