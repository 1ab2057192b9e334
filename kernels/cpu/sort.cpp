// CPU kernels for sort and topk. Each row along the dim is independent: rows go to threads,
// each sorts (value, position) pairs. Sorting is always stable (ties keep their input order),
// which satisfies stable=false as well; topk breaks ties by the lower position, so its result
// is deterministic. NaN is larger than every number (PyTorch's order).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/cpu/loops.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

template <typename M>
bool is_nan(M v) {
  if constexpr (std::is_floating_point_v<M>) {
    return std::isnan(v);
  } else {
    return false;
  }
}

// a < b with NaN above everything.
template <typename M>
bool less_nan_last(M a, M b) {
  return is_nan(b) ? !is_nan(a) : a < b;
}

// The rows of `t` (contiguous) along dim d: `outer` blocks of `size` x `inner` elements.
struct RowGeometry {
  int64_t outer = 1, size = 1, inner = 1;
};
RowGeometry rows_of(IntArrayRef sizes, int64_t d) {
  RowGeometry g;
  if (sizes.empty()) return g;
  for (int64_t k = 0; k < d; ++k) g.outer *= sizes[k];
  g.size = sizes[d];
  for (size_t k = d + 1; k < sizes.size(); ++k) g.inner *= sizes[k];
  return g;
}

// Calls body(values_in, row_base, stride, thread_buffer) for each row, rows across threads.
template <typename T, typename Body>
void for_each_row(const Tensor& src, const RowGeometry& g, Body&& body) {
  const int64_t rows = g.outer * g.inner;
  const int64_t grain = std::max<int64_t>(1, internal::kGrainSize / std::max<int64_t>(g.size, 1));
  const T* s = src.data_ptr<T>();
  internal::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    std::vector<std::pair<opmath_t<T>, int64_t>> buf(static_cast<size_t>(g.size));
    for (int64_t r = b; r < e; ++r) {
      const int64_t base = (r / g.inner) * g.size * g.inner + r % g.inner;
      for (int64_t j = 0; j < g.size; ++j) {
        buf[j] = {static_cast<opmath_t<T>>(s[base + j * g.inner]), j};
      }
      body(buf, base);
    }
  });
}

void sort_cpu(OpCall& c) {
  const Tensor src = c.input(0).contiguous();
  const Tensor& values = c.outputs[0];
  const Tensor& indices = c.outputs[1];
  if (src.numel() == 0) return;
  const int64_t d = wrap_dim(c.attr<int64_t>(0), src.dim(), "sort");
  const bool descending = c.attr<bool>(1);
  const RowGeometry g = rows_of(src.sizes(), d);
  visit_dtype(src.dtype(), [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    T* v = values.data_ptr<T>();
    int64_t* ix = indices.data_ptr<int64_t>();
    for_each_row<T>(src, g, [&](std::vector<std::pair<M, int64_t>>& buf, int64_t base) {
      if (descending) {
        std::stable_sort(buf.begin(), buf.end(), [](const auto& a, const auto& b) {
          return less_nan_last(b.first, a.first);
        });
      } else {
        std::stable_sort(buf.begin(), buf.end(), [](const auto& a, const auto& b) {
          return less_nan_last(a.first, b.first);
        });
      }
      for (int64_t j = 0; j < g.size; ++j) {
        v[base + j * g.inner] = T(buf[j].first);
        ix[base + j * g.inner] = buf[j].second;
      }
    });
  });
}

void topk_cpu(OpCall& c) {
  const Tensor src = c.input(0).contiguous();
  const Tensor& values = c.outputs[0];
  const Tensor& indices = c.outputs[1];
  const int64_t k = c.attr<int64_t>(0);
  if (values.numel() == 0) return;
  const int64_t d = wrap_dim(c.attr<int64_t>(1), src.dim(), "topk");
  const bool largest = c.attr<bool>(2);
  const RowGeometry g = rows_of(src.sizes(), d);
  visit_dtype(src.dtype(), [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    using Pair = std::pair<M, int64_t>;
    T* v = values.data_ptr<T>();
    int64_t* ix = indices.data_ptr<int64_t>();
    for_each_row<T>(src, g, [&](std::vector<Pair>& buf, int64_t base) {
      // A strict total order (ties by position), so partial_sort's result is well defined.
      auto before = [largest](const Pair& a, const Pair& b) {
        if (largest ? less_nan_last(b.first, a.first) : less_nan_last(a.first, b.first))
          return true;
        if (less_nan_last(a.first, b.first) || less_nan_last(b.first, a.first)) return false;
        return a.second < b.second;
      };
      std::partial_sort(buf.begin(), buf.begin() + k, buf.end(), before);
      // The output row has k elements along d: its base differs from the input's.
      const int64_t r_outer = base / (g.size * g.inner), r_inner = base % g.inner;
      const int64_t out_base = r_outer * k * g.inner + r_inner;
      for (int64_t j = 0; j < k; ++j) {
        v[out_base + j * g.inner] = T(buf[j].first);
        ix[out_base + j * g.inner] = buf[j].second;
      }
    });
  });
}

}  // namespace

KILN_REGISTER_KERNEL(sort, kCPU, sort_cpu);
KILN_REGISTER_KERNEL(topk, kCPU, topk_cpu);

}  // namespace kiln::cpu
