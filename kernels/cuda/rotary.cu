// CUDA kernels of rotary_emb, rotary_emb_qk, split_qkv_rotary, merge_qkv_rotary and rotary_qkv_
// (tensor/ops/rotary.cpp; reference:
// kernels/cpu/rotary.cpp). Arithmetic in f32 for f16/bf16 (f64 for f64).
//
// One thread per pair of packs: N elements of the first half of a row and the N elements half a
// row further, which is all a rotated element needs (x1 and x2 at the same offset within their
// halves), so every element of x is read once and every element of y written once, in 16-byte
// packs when the row layout allows. x is read and y written in place through their strides: the
// rows (every dim but the last, which is dense) are walked in x's memory order (see
// make_rows), which is also y's (tensor/ops/rotary.cpp lays y out so), so the [B, H, T, D] views
// of a fused qkv projection cost no copy and both streams are sequential. The index arithmetic
// uses multiply-shift division (kernels/int_div.h) in the 32-bit path: with hardware division it
// was the busiest pipe (ncu: ALU 72% of peak, DRAM 61%). cos/sin ([T, D], 1 MiB at most for Llama
// shapes) stay in L2. The q-and-k form runs both tensors in one grid: threads below q's share of
// the work rotate q, the rest k. split_qkv_rotary and merge_qkv_rotary run three jobs in one
// grid (q, k rotated, v copied) between the heads of a qkv projection and three head tensors,
// each job a strided view of the side with the heads side by side.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <utility>
#include <vector>

#include "kernels/cuda/check.h"
#include "kernels/cuda/fused_util.cuh"
#include "kernels/cuda/loops.cuh"
#include "kernels/fused_support.h"
#include "tensor/ops.h"
#include "tensor/ops/rotary.h"
#include "tensor/registry.h"

namespace kiln::cuda {
namespace {

using internal::aligned_to;
using internal::load_pack;
using internal::store_pack;

using ::kiln::internal::IntDivider;
using loops::Geometry;

constexpr int kThreads = 256;

// The row geometry of x and y (both with a dense last dim): the dims but the last, ordered by
// decreasing |x stride| (x's memory order; ties keep the logical order), size-1 dims dropped and
// neighbours merged where contiguous for all three operands: x's strides, y's strides, and the
// position operand (stride 1 along dim -2, 0 elsewhere), whose offset is the row's position t.
Geometry<3> make_rows(const Tensor& x, const Tensor& y) {
  const int64_t n = x.dim() - 1;
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t d = 0; d < n; ++d) order[static_cast<size_t>(d)] = d;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return std::abs(x.stride(a)) > std::abs(x.stride(b));
  });
  Shape sizes;
  Shape strides[3];
  for (int64_t d : order) {
    sizes.push_back(x.size(d));
    strides[0].push_back(x.stride(d));
    strides[1].push_back(y.stride(d));
    strides[2].push_back(d == n - 1 ? 1 : 0);
  }
  return loops::make_geometry<3>(sizes, strides, "rotary_emb");
}

// One rotated (or, without `rotate`, copied) tensor: x read and y written through `rows`.
template <typename T>
struct Job {
  const T* x;
  T* y;
  Geometry<3> rows;
  int64_t work;  // rows * packs per half row
  bool rotate;
};

// Work item w of a job: row w / hp (in x's memory order), pack w % hp of each half.
template <typename T, typename I>
__device__ __forceinline__ void locate(const Job<T>& j, I w, const IntDivider& hp, I& x_off,
                                       I& y_off, I& pos, I& col) {
  I r;
  if constexpr (sizeof(I) == 4) {
    uint32_t q, m;
    hp.divmod(static_cast<uint32_t>(w), q, m);
    r = static_cast<I>(q);
    col = static_cast<I>(m);
  } else {
    const I n = static_cast<I>(hp.divisor);
    r = w / n;
    col = w - r * n;
  }
  I off[3];
  loops::offsets<I, 3>(j.rows, r, off);
  x_off = off[0];
  y_off = off[1];
  pos = off[2];
}

template <typename T, typename C, int N, typename I>
__global__ void __launch_bounds__(kThreads)
    rotary_kernel(Job<T> j0, Job<T> j1, Job<T> j2, const C* __restrict__ cos,
                  const C* __restrict__ sin, I d, IntDivider hp, bool transpose) {
  using Acc = opmath_t<T>;
  const I w01 = static_cast<I>(j0.work + j1.work);
  const I total = w01 + static_cast<I>(j2.work);
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  const I h = d / 2;
  for (I w = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; w < total; w += step) {
    // Branches rather than a reference to one of the jobs, which would copy them to local memory.
    const T* xr;
    T* yr;
    bool rotate;
    I x_off, y_off, pos, col;
    if (w < static_cast<I>(j0.work)) {
      locate<T, I>(j0, w, hp, x_off, y_off, pos, col);
      xr = j0.x;
      yr = j0.y;
      rotate = j0.rotate;
    } else if (w < w01) {
      locate<T, I>(j1, w - static_cast<I>(j0.work), hp, x_off, y_off, pos, col);
      xr = j1.x;
      yr = j1.y;
      rotate = j1.rotate;
    } else {
      locate<T, I>(j2, w - w01, hp, x_off, y_off, pos, col);
      xr = j2.x;
      yr = j2.y;
      rotate = j2.rotate;
    }
    col *= N;
    xr += x_off + col;
    yr += y_off + col;
    Acc x1[N], x2[N];
    load_pack<N>(xr, x1);
    load_pack<N>(xr + h, x2);
    if (rotate) {
      const I tab = pos * d + col;
      Acc c1[N], c2[N], s1[N], s2[N], y1[N], y2[N];
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
    } else {
      store_pack<N>(yr, x1);
      store_pack<N>(yr + h, x2);
    }
  }
}

// Largest element offset of operand k (x 0, y 1) over the rows, plus one row.
int64_t extent(const Geometry<3>& g, int k, int64_t d) {
  int64_t e = d;
  for (int i = 0; i < g.ndim; ++i) e += (g.sizes[i] - 1) * std::abs(g.strides[k][i]);
  return e;
}

// Rotates xs[i] into ys[i] (up to three tensors; copies where !rotate[i]) in one launch. The
// xs have one T and D.
void rotary_cuda_impl(const std::vector<Tensor>& xs_in, const std::vector<Tensor>& ys,
                      const Tensor& cos_in, const Tensor& sin_in, bool transpose,
                      std::vector<bool> rotate = {true, true}) {
  const Tensor& x0 = xs_in[0];
  const int64_t d = x0.size(-1), h = d / 2;
  if (h == 0) return;
  DeviceGuard guard(x0.device().index());
  const cudaStream_t stream = current_stream();
  const Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  std::vector<Tensor> xs;
  std::vector<Geometry<3>> geos;
  int64_t max_extent = 0;
  for (size_t i = 0; i < xs_in.size(); ++i) {
    KILN_CHECK(ys[i].stride(-1) == 1,
               "[rotary_emb] expected an output with a dense last dim, got strides ",
               shape_str(ys[i].strides()));
    xs.push_back(xs_in[i].stride(-1) == 1 ? xs_in[i] : xs_in[i].contiguous());
    geos.push_back(make_rows(xs[i], ys[i]));
    max_extent = std::max({max_extent, extent(geos[i], 0, d), extent(geos[i], 1, d)});
  }
  visit_floating(x0.dtype(), "rotary_emb", [&]<typename T>(TypeTag<T>) {
    auto run = [&]<typename C>(TypeTag<C>) {
      constexpr int kPack = 16 / sizeof(T);
      bool packed = h % kPack == 0 && aligned_to(cos.data_ptr(), sizeof(C) * kPack) &&
                    aligned_to(sin.data_ptr(), sizeof(C) * kPack);
      for (size_t i = 0; i < xs.size(); ++i) {
        packed = packed && aligned_to(xs[i].data_ptr(), 16) && aligned_to(ys[i].data_ptr(), 16);
        for (int k = 0; k < geos[i].ndim; ++k) {
          packed =
              packed && geos[i].strides[0][k] % kPack == 0 && geos[i].strides[1][k] % kPack == 0;
        }
      }
      auto launch = [&]<int N, typename I>(std::integral_constant<int, N>, TypeTag<I>) {
        Job<T> jobs[3] = {};
        for (size_t i = 0; i < xs.size(); ++i) {
          jobs[i] = {static_cast<const T*>(xs[i].data_ptr()), static_cast<T*>(ys[i].data_ptr()),
                     geos[i], xs[i].numel() / d * (h / N), rotate[i]};
        }
        const int64_t total = jobs[0].work + jobs[1].work + jobs[2].work;
        if (total == 0) return;
        rotary_kernel<T, C, N, I><<<loops::grid_for(total, kThreads), kThreads, 0, stream>>>(
            jobs[0], jobs[1], jobs[2], static_cast<const C*>(cos.data_ptr()),
            static_cast<const C*>(sin.data_ptr()), static_cast<I>(d), IntDivider(h / N), transpose);
        KILN_CUDA_LAUNCH_CHECK("rotary_kernel");
      };
      // 2^30: the grid-stride index must not overflow after its last step either.
      int64_t elements = 0;
      for (const Tensor& x : xs) elements += x.numel();
      const bool small = max_extent < (int64_t{1} << 30) && cos.numel() < (int64_t{1} << 30) &&
                         elements < (int64_t{1} << 30);
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

void split_qkv_rotary_cuda(OpCall& c) {
  const int64_t h = c.attr<int64_t>(1), g = c.attr<int64_t>(2), n = h + 2 * g;
  const Tensor& qkv = c.input(0);
  rotary_cuda_impl(
      {::kiln::internal::qkv_heads(qkv, 0, h, n), ::kiln::internal::qkv_heads(qkv, h, g, n),
       ::kiln::internal::qkv_heads(qkv, h + g, g, n)},
      {c.outputs[0], c.outputs[1], c.outputs[2]}, c.input(1), c.input(2), c.attr<bool>(0),
      {true, true, false});
}

// In place: each thread reads its two packs before it writes them, and no other thread touches
// them.
void rotary_qkv_cuda(OpCall& c) {
  const int64_t h = c.attr<int64_t>(1), g = c.attr<int64_t>(2), n = h + 2 * g;
  const Tensor& qkv = c.outputs[0];
  const Tensor q = ::kiln::internal::qkv_heads(qkv, 0, h, n);
  const Tensor k = ::kiln::internal::qkv_heads(qkv, h, g, n);
  rotary_cuda_impl({q, k}, {q, k}, c.input(1), c.input(2), c.attr<bool>(0));
}

void merge_qkv_rotary_cuda(OpCall& c) {
  const int64_t h = c.input(0).size(-3), g = c.input(1).size(-3), n = h + 2 * g;
  const Tensor& out = c.outputs[0];
  rotary_cuda_impl(
      {c.input(0), c.input(1), c.input(2)},
      {::kiln::internal::qkv_heads(out, 0, h, n), ::kiln::internal::qkv_heads(out, h, g, n),
       ::kiln::internal::qkv_heads(out, h + g, g, n)},
      c.input(3), c.input(4), c.attr<bool>(0), {true, true, false});
}

}  // namespace

KILN_REGISTER_KERNEL_IF(rotary_emb, kCUDA, "fused", rotary_emb_cuda, rotary_emb_supported);
KILN_REGISTER_KERNEL_IF(rotary_emb_qk, kCUDA, "fused", rotary_emb_qk_cuda, rotary_emb_qk_supported);
KILN_REGISTER_KERNEL_IF(split_qkv_rotary, kCUDA, "fused", split_qkv_rotary_cuda,
                        split_qkv_rotary_supported);
KILN_REGISTER_KERNEL_IF(merge_qkv_rotary, kCUDA, "fused", merge_qkv_rotary_cuda,
                        merge_qkv_rotary_supported);
KILN_REGISTER_KERNEL_IF(rotary_qkv_, kCUDA, "fused", rotary_qkv_cuda, rotary_qkv_supported);

}  // namespace kiln::cuda
