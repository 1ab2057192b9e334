// CUDA kernels of rotary_emb and rotary_emb_qk (tensor/ops/rotary.cpp; reference:
// kernels/cpu/rotary.cpp). Arithmetic in f32 for f16/bf16 (f64 for f64).
//
// One thread per pair of packs: N elements of the first half of a row and the N elements half a
// row further, which is all a rotated element needs (x1 and x2 at the same offset within their
// halves), so every element of x is read once and every element of y written once, in 16-byte
// packs when the row layout allows. x is read in place through its strides: the rows of x (every
// dim but the last, which must be dense) are decomposed with one div/mod per non-mergeable dim,
// in x's memory order (see RowGeometry), so the [B, H, T, D] views of a fused qkv projection
// cost no copy and are read sequentially. cos/sin ([T, D], 1 MiB at
// most for Llama shapes) stay in L2. The q-and-k form runs both tensors in one grid: threads
// below q's share of the work rotate q, the rest k.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "kernels/cuda/check.h"
#include "kernels/cuda/fused_util.cuh"
#include "kernels/cuda/loops.cuh"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::cuda {
namespace {

using internal::aligned_to;
using internal::load_pack;
using internal::store_pack;

constexpr int kMaxRowDims = 8;
constexpr int kThreads = 256;

// The rows of x: sizes and strides (elements) of every dim but the last, size-1 dims dropped and
// contiguous neighbours merged, then ordered by decreasing |stride| (x's memory order); `rows`
// are the strides of the same dims in rows of the contiguous output (the logical row index).
// Work item r decomposes over these dims (the last fastest), so consecutive threads read
// consecutive memory of x: for the [B, H, T, D] view of a [B, T, H, D] projection, the heads of
// one position (one contiguous run, sharing their cos/sin rows) rather than the positions of
// one head (rows a whole projection row apart).
struct RowGeometry {
  int ndim = 0;
  int64_t sizes[kMaxRowDims];
  int64_t strides[kMaxRowDims];
  int64_t rows[kMaxRowDims];
};

// Builds the row geometry of x (x.stride(-1) == 1); false when it has too many dims.
bool make_rows(const Tensor& x, RowGeometry& g) {
  for (int64_t d = 0; d + 1 < x.dim(); ++d) {
    const int64_t size = x.size(d), stride = x.stride(d);
    if (size == 1) continue;
    if (g.ndim > 0 && g.strides[g.ndim - 1] == stride * size) {
      g.sizes[g.ndim - 1] *= size;
      g.strides[g.ndim - 1] = stride;
      continue;
    }
    if (g.ndim == kMaxRowDims) return false;
    g.sizes[g.ndim] = size;
    g.strides[g.ndim] = stride;
    ++g.ndim;
  }
  int64_t rows = 1;
  for (int d = g.ndim - 1; d >= 0; --d) {
    g.rows[d] = rows;
    rows *= g.sizes[d];
  }
  // Insertion sort by decreasing |stride| (stable: equal strides keep the logical order).
  for (int i = 1; i < g.ndim; ++i) {
    for (int j = i; j > 0 && std::abs(g.strides[j]) > std::abs(g.strides[j - 1]); --j) {
      std::swap(g.sizes[j], g.sizes[j - 1]);
      std::swap(g.strides[j], g.strides[j - 1]);
      std::swap(g.rows[j], g.rows[j - 1]);
    }
  }
  return true;
}

// One rotated tensor: x read through `rows`, y contiguous.
template <typename T>
struct Job {
  const T* x;
  T* y;
  RowGeometry rows;
  int64_t work;  // rows * packs per half row
};

// Work row r (in x's memory order): its offset in x and its logical row (the output's row).
template <typename I>
__device__ __forceinline__ void row_at(const RowGeometry& g, I r, I& x_off, I& row) {
  x_off = 0;
  row = 0;
  for (int d = g.ndim - 1; d >= 0; --d) {
    const I size = static_cast<I>(g.sizes[d]);
    const I idx = r % size;
    x_off += idx * static_cast<I>(g.strides[d]);
    row += idx * static_cast<I>(g.rows[d]);
    r /= size;
  }
}

// Work item w of a job: row w / hp, pack w % hp of each half.
template <typename T, typename C, int N, typename I>
__global__ void __launch_bounds__(kThreads)
    rotary_kernel(Job<T> j0, Job<T> j1, const C* __restrict__ cos, const C* __restrict__ sin,
                  I t_len, I d, I hp, bool transpose) {
  using Acc = opmath_t<T>;
  const I total = static_cast<I>(j0.work + j1.work);
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  const I h = d / 2;
  for (I w = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; w < total; w += step) {
    // Branches rather than a reference to one of the jobs, which would copy both to local memory.
    const T* xr;
    T* yr;
    I row, col, x_off;
    if (w < static_cast<I>(j0.work)) {
      const I r = w / hp;
      col = (w - r * hp) * N;
      row_at<I>(j0.rows, r, x_off, row);
      xr = j0.x + x_off + col;
      yr = j0.y + row * d + col;
    } else {
      const I item = w - static_cast<I>(j0.work);
      const I r = item / hp;
      col = (item - r * hp) * N;
      row_at<I>(j1.rows, r, x_off, row);
      xr = j1.x + x_off + col;
      yr = j1.y + row * d + col;
    }
    const I tab = (row % t_len) * d + col;
    Acc x1[N], x2[N], c1[N], c2[N], s1[N], s2[N], y1[N], y2[N];
    load_pack<N>(xr, x1);
    load_pack<N>(xr + h, x2);
    load_pack<N>(cos + tab, c1);
    load_pack<N>(cos + tab + h, c2);
    load_pack<N>(sin + tab, s1);
    load_pack<N>(sin + tab + h, s2);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const Acc a1 = transpose ? s2[i] : -s1[i], a2 = transpose ? -s1[i] : s2[i];
      y1[i] = x1[i] * c1[i] + x2[i] * a1;
      y2[i] = x2[i] * c2[i] + x1[i] * a2;
    }
    store_pack<N>(yr, y1);
    store_pack<N>(yr + h, y2);
  }
}

// x with a dense last dim and a row geometry the kernel takes (a copy otherwise).
Tensor readable(const Tensor& x, RowGeometry& g) {
  g = RowGeometry{};
  if (x.dim() >= 1 && (x.stride(-1) == 1 || x.size(-1) <= 1) && make_rows(x, g)) return x;
  g = RowGeometry{};
  const Tensor c = x.contiguous();
  make_rows(c, g);
  return c;
}

// Largest element offset of x's rows plus one row: whether 32-bit indices suffice.
int64_t extent(const Tensor& x, const RowGeometry& g) {
  int64_t e = x.size(-1);
  for (int d = 0; d < g.ndim; ++d) e += (g.sizes[d] - 1) * std::abs(g.strides[d]);
  return std::max(e, x.numel());
}

// Rotates xs[i] into ys[i] (one or two tensors) in one launch.
void rotary_cuda_impl(const std::vector<Tensor>& xs_in, const std::vector<Tensor>& ys,
                      const Tensor& cos_in, const Tensor& sin_in, bool transpose) {
  const Tensor& x0 = xs_in[0];
  const int64_t d = x0.size(-1), t_len = x0.size(-2), h = d / 2;
  if (h == 0) return;
  DeviceGuard guard(x0.device().index());
  const cudaStream_t stream = current_stream();
  const Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  std::vector<Tensor> xs;
  std::vector<RowGeometry> geos(2);
  int64_t max_extent = 0;
  for (size_t i = 0; i < xs_in.size(); ++i) {
    xs.push_back(readable(xs_in[i], geos[i]));
    max_extent = std::max(max_extent, extent(xs[i], geos[i]));
  }
  visit_floating(x0.dtype(), "rotary_emb", [&]<typename T>(TypeTag<T>) {
    auto run = [&]<typename C>(TypeTag<C>) {
      constexpr int kPack = 16 / sizeof(T);
      bool packed = h % kPack == 0 && aligned_to(cos.data_ptr(), sizeof(C) * kPack) &&
                    aligned_to(sin.data_ptr(), sizeof(C) * kPack);
      for (size_t i = 0; i < xs.size(); ++i) {
        packed = packed && aligned_to(xs[i].data_ptr(), 16) && aligned_to(ys[i].data_ptr(), 16);
        for (int k = 0; k < geos[i].ndim; ++k) packed = packed && geos[i].strides[k] % kPack == 0;
      }
      auto launch = [&]<int N, typename I>(std::integral_constant<int, N>, TypeTag<I>) {
        Job<T> jobs[2] = {};
        for (size_t i = 0; i < xs.size(); ++i) {
          jobs[i] = {static_cast<const T*>(xs[i].data_ptr()), static_cast<T*>(ys[i].data_ptr()),
                     geos[i], xs[i].numel() / d * (h / N)};
        }
        const int64_t total = jobs[0].work + jobs[1].work;
        if (total == 0) return;
        rotary_kernel<T, C, N, I><<<loops::grid_for(total, kThreads), kThreads, 0, stream>>>(
            jobs[0], jobs[1], static_cast<const C*>(cos.data_ptr()),
            static_cast<const C*>(sin.data_ptr()), static_cast<I>(t_len), static_cast<I>(d),
            static_cast<I>(h / N), transpose);
        KILN_CUDA_LAUNCH_CHECK("rotary_kernel");
      };
      // 2^30: the grid-stride index must not overflow after its last step either.
      const bool small = max_extent < (int64_t{1} << 30) && cos.numel() < (int64_t{1} << 30);
      if (packed && small) {
        launch(std::integral_constant<int, kPack>{}, TypeTag<int32_t>{});
      } else if (packed) {
        launch(std::integral_constant<int, kPack>{}, TypeTag<int64_t>{});
      } else if (small) {
        launch(std::integral_constant<int, 1>{}, TypeTag<int32_t>{});
      } else {
        launch(std::integral_constant<int, 1>{}, TypeTag<int64_t>{});
      }
    };
    if (cos.dtype() == x0.dtype()) {
      run(TypeTag<T>{});
    } else if constexpr (!std::is_same_v<T, double> && !std::is_same_v<T, float>) {
      run(TypeTag<float>{});
    } else {
      KILN_FAIL("[rotary_emb] unsupported cos/sin dtype ", dtype_name(cos.dtype()));
    }
  });
}

void rotary_emb_cuda(OpCall& c) {
  rotary_cuda_impl({c.input(0)}, {c.outputs[0]}, c.input(1), c.input(2), c.attr<bool>(0));
}

void rotary_emb_qk_cuda(OpCall& c) {
  rotary_cuda_impl({c.input(0), c.input(1)}, {c.outputs[0], c.outputs[1]}, c.input(2), c.input(3),
                   c.attr<bool>(0));
}

}  // namespace

KILN_REGISTER_KERNEL(rotary_emb, kCUDA, rotary_emb_cuda);
KILN_REGISTER_KERNEL(rotary_emb_qk, kCUDA, rotary_emb_qk_cuda);

}  // namespace kiln::cuda
