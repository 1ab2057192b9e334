// CUDA kernels of rms_norm and rms_norm_backward (tensor/ops/norm.cpp; reference:
// kernels/cpu/norm.cpp). Arithmetic in f32 for f16/bf16 (f64 for f64).
//
// Forward: rows of up to 512 16-byte packs (bf16: 4096 elements) take one warp each, every lane
// loading its packs up front and reducing with shuffles; longer rows take one block each, each
// thread keeping its packs in registers (up to kCache) across the block sum of squares. Either
// way one read of x and one write of y, the floor.
// Backward: a grid of about one wave of blocks, each looping over rows with a fixed thread ->
// column mapping, so every thread accumulates dweight for its columns in registers across all
// the rows of its block; dx is written per row. The per-block partials [grid, D] (f32) are then
// summed by column in a second small kernel, in a fixed order (deterministic).
// Rows whose length or pointers do not allow 16-byte packs run the same kernels with packs of
// one element.
#include <cuda_runtime_api.h>

#include <algorithm>

#include "kernels/cuda/check.h"
#include "kernels/cuda/fused_util.cuh"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::cuda {
namespace {

using internal::aligned_to;
using internal::block_sum;
using internal::load_pack;
using internal::store_pack;

constexpr int kCache = 2;     // packs per thread held in registers (forward)
constexpr int kCacheBwd = 1;  // backward: x, dy * w and dweight for one pack (64 registers)

template <typename Acc>
__device__ __forceinline__ Acc rsqrt_of(Acc v) {
  if constexpr (std::is_same_v<Acc, double>) {
    return ::rsqrt(v);
  } else {
    return rsqrtf(v);
  }
}

template <typename T, typename W, int N>
__global__ void __launch_bounds__(1024)
    rms_norm_fwd_kernel(T* __restrict__ y, opmath_t<T>* __restrict__ rstd,
                        const T* __restrict__ x, const W* __restrict__ w, int64_t rows, int64_t d,
                        opmath_t<T> eps) {
  using Acc = opmath_t<T>;
  __shared__ Acc smem[32];
  const int64_t nvec = d / N;
  const int tid = threadIdx.x, bd = blockDim.x;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * d;
    T* yr = y + row * d;
    Acc xc[kCache][N];
    Acc ss = 0;
#pragma unroll
    for (int c = 0; c < kCache; ++c) {
      const int64_t v = tid + static_cast<int64_t>(c) * bd;
      if (v < nvec) {
        load_pack<N>(xr + v * N, xc[c]);
#pragma unroll
        for (int i = 0; i < N; ++i) ss += xc[c][i] * xc[c][i];
      }
    }
    for (int64_t v = tid + static_cast<int64_t>(kCache) * bd; v < nvec; v += bd) {
      Acc t[N];
      load_pack<N>(xr + v * N, t);
#pragma unroll
      for (int i = 0; i < N; ++i) ss += t[i] * t[i];
    }
    ss = block_sum(ss, smem);
    const Acc r = rsqrt_of(ss / static_cast<Acc>(d > 0 ? d : 1) + eps);
    if (tid == 0) rstd[row] = r;
#pragma unroll
    for (int c = 0; c < kCache; ++c) {
      const int64_t v = tid + static_cast<int64_t>(c) * bd;
      if (v < nvec) {
        Acc wv[N], o[N];
        load_pack<N>(w + v * N, wv);
#pragma unroll
        for (int i = 0; i < N; ++i) o[i] = xc[c][i] * r * wv[i];
        store_pack<N>(yr + v * N, o);
      }
    }
    for (int64_t v = tid + static_cast<int64_t>(kCache) * bd; v < nvec; v += bd) {
      Acc t[N], wv[N];
      load_pack<N>(xr + v * N, t);
      load_pack<N>(w + v * N, wv);
#pragma unroll
      for (int i = 0; i < N; ++i) t[i] = t[i] * r * wv[i];
      store_pack<N>(yr + v * N, t);
    }
  }
}

// Rows of at most 32 * P packs: one warp per row. Each lane issues its P 16-byte loads up front
// (independent, all in flight together), keeps the raw packs in registers and reduces with
// shuffles only (no block barrier). The bandwidth-bound case of Llama's hidden sizes.
template <typename T, typename W, int N, int P>
__global__ void __launch_bounds__(256)
    rms_norm_fwd_warp_kernel(T* __restrict__ y, opmath_t<T>* __restrict__ rstd,
                             const T* __restrict__ x, const W* __restrict__ w, int64_t rows,
                             int64_t d, opmath_t<T> eps) {
  using Acc = opmath_t<T>;
  using internal::Pack;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int64_t nvec = d / N;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       row < rows; row += warps) {
    const T* xr = x + row * d;
    T* yr = y + row * d;
    Pack<T, N> raw[P];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int64_t v = lane + p * 32;
      if (v < nvec) raw[p] = *reinterpret_cast<const Pack<T, N>*>(xr + v * N);
    }
    Acc ss = 0;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      if (lane + p * 32 < nvec) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
          const Acc f = static_cast<Acc>(raw[p].v[i]);
          ss += f * f;
        }
      }
    }
    ss = internal::warp_sum(ss);
    const Acc r = rsqrt_of(ss / static_cast<Acc>(d) + eps);
    if (lane == 0) rstd[row] = r;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int64_t v = lane + p * 32;
      if (v < nvec) {
        Acc wv[N], o[N];
        load_pack<N>(w + v * N, wv);
#pragma unroll
        for (int i = 0; i < N; ++i) o[i] = static_cast<Acc>(raw[p].v[i]) * r * wv[i];
        store_pack<N>(yr + v * N, o);
      }
    }
  }
}

template <typename T, typename W, int N>
__global__ void __launch_bounds__(1024)
    rms_norm_bwd_kernel(T* __restrict__ dx, opmath_t<T>* __restrict__ partial,
                        const T* __restrict__ dy, const T* __restrict__ x,
                        const W* __restrict__ w, const opmath_t<T>* __restrict__ rstd,
                        int64_t rows, int64_t d) {
  using Acc = opmath_t<T>;
  __shared__ Acc smem[32];
  const int64_t nvec = d / N;
  const int tid = threadIdx.x, bd = blockDim.x;
  Acc* part = partial + blockIdx.x * d;
  Acc dwc[kCacheBwd][N];
#pragma unroll
  for (int c = 0; c < kCacheBwd; ++c) {
#pragma unroll
    for (int i = 0; i < N; ++i) dwc[c][i] = 0;
  }
  for (int64_t v = tid + static_cast<int64_t>(kCacheBwd) * bd; v < nvec; v += bd) {
    for (int i = 0; i < N; ++i) part[v * N + i] = 0;
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const Acc r = rstd[row];
    const T* xr = x + row * d;
    const T* gr = dy + row * d;
    T* dr = dx + row * d;
    Acc xc[kCacheBwd][N], gc[kCacheBwd][N];
    Acc dot = 0;
#pragma unroll
    for (int c = 0; c < kCacheBwd; ++c) {
      const int64_t v = tid + static_cast<int64_t>(c) * bd;
      if (v < nvec) {
        Acc dyv[N], wv[N];
        load_pack<N>(xr + v * N, xc[c]);
        load_pack<N>(gr + v * N, dyv);
        load_pack<N>(w + v * N, wv);
#pragma unroll
        for (int i = 0; i < N; ++i) {
          gc[c][i] = dyv[i] * wv[i];
          dot += gc[c][i] * xc[c][i];
          dwc[c][i] += dyv[i] * xc[c][i] * r;
        }
      }
    }
    for (int64_t v = tid + static_cast<int64_t>(kCacheBwd) * bd; v < nvec; v += bd) {
      Acc xv[N], dyv[N], wv[N];
      load_pack<N>(xr + v * N, xv);
      load_pack<N>(gr + v * N, dyv);
      load_pack<N>(w + v * N, wv);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        dot += dyv[i] * wv[i] * xv[i];
        part[v * N + i] += dyv[i] * xv[i] * r;
      }
    }
    dot = block_sum(dot, smem);
    const Acc k = r * r * r * dot / static_cast<Acc>(d);
#pragma unroll
    for (int c = 0; c < kCacheBwd; ++c) {
      const int64_t v = tid + static_cast<int64_t>(c) * bd;
      if (v < nvec) {
        Acc o[N];
#pragma unroll
        for (int i = 0; i < N; ++i) o[i] = r * gc[c][i] - xc[c][i] * k;
        store_pack<N>(dr + v * N, o);
      }
    }
    for (int64_t v = tid + static_cast<int64_t>(kCacheBwd) * bd; v < nvec; v += bd) {
      Acc xv[N], dyv[N], wv[N], o[N];
      load_pack<N>(xr + v * N, xv);
      load_pack<N>(gr + v * N, dyv);
      load_pack<N>(w + v * N, wv);
#pragma unroll
      for (int i = 0; i < N; ++i) o[i] = r * dyv[i] * wv[i] - xv[i] * k;
      store_pack<N>(dr + v * N, o);
    }
  }
#pragma unroll
  for (int c = 0; c < kCacheBwd; ++c) {
    const int64_t v = tid + static_cast<int64_t>(c) * bd;
    if (v < nvec) {
#pragma unroll
      for (int i = 0; i < N; ++i) part[v * N + i] = dwc[c][i];
    }
  }
}

// out[j] = sum over b of partial[b, j]; blocks of 32 columns x 32 partial rows.
template <typename Acc, typename W>
__global__ void column_sum_kernel(W* __restrict__ out, const Acc* __restrict__ partial,
                                  int64_t nb, int64_t d) {
  __shared__ Acc s[32][33];
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  Acc acc = 0;
  if (j < d) {
    for (int64_t b = threadIdx.y; b < nb; b += 32) acc += partial[b * d + j];
  }
  s[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && j < d) {
    Acc sum = 0;
    for (int i = 0; i < 32; ++i) sum += s[i][threadIdx.x];
    out[j] = W(sum);
  }
}

int sm_count() {
  static int counts[64] = {};
  int dev = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 64 && counts[dev] > 0) return counts[dev];
  int n = 0;
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  if (dev < 64) counts[dev] = n;
  return n;
}

// Threads per row: one pack per thread up to 256 threads, more threads (up to 1024) before a
// thread holds more than kCache packs.
int threads_for(int64_t nvec, int cache) {
  auto round32 = [](int64_t v) { return static_cast<int>(std::max<int64_t>(32, (v + 31) / 32 * 32)); };
  const int one_each = std::min(round32(nvec), 256);
  const int cached = std::min(round32((nvec + cache - 1) / cache), 1024);
  return std::max(one_each, cached);
}

// Calls f(TypeTag<T>, TypeTag<W>) for x's dtype T and weight's dtype W (T, or float).
template <typename F>
void visit_x_weight(ScalarType xt, ScalarType wt, F&& f) {
  visit_floating(xt, "rms_norm", [&]<typename T>(TypeTag<T>) {
    if (wt == xt) {
      f(TypeTag<T>{}, TypeTag<T>{});
    } else if constexpr (!std::is_same_v<T, double> && !std::is_same_v<T, float>) {
      f(TypeTag<T>{}, TypeTag<float>{});
    } else {
      KILN_FAIL("[rms_norm] unsupported weight dtype ", dtype_name(wt));
    }
  });
}

// Whether rows of length d can be accessed in packs of kPack elements of T through every
// pointer (W pointers in packs of the same element count).
template <typename T, typename W>
bool packable(int64_t d, std::initializer_list<const void*> t_ptrs, const void* w_ptr) {
  constexpr int kPack = 16 / sizeof(T);
  if (d % kPack != 0) return false;
  for (const void* p : t_ptrs) {
    if (!aligned_to(p, 16)) return false;
  }
  return aligned_to(w_ptr, static_cast<int64_t>(sizeof(W)) * kPack);
}

void rms_norm_cuda(OpCall& c) {
  const Tensor x = c.input(0).contiguous();
  const Tensor w = c.input(1).contiguous();
  const Tensor& y = c.outputs[0];
  const Tensor& rstd = c.outputs[1];
  const int64_t d = w.numel(), rows = rstd.numel();
  if (rows == 0) return;
  DeviceGuard guard(x.device().index());
  visit_x_weight(x.dtype(), w.dtype(), [&]<typename T, typename W>(TypeTag<T>, TypeTag<W>) {
    using Acc = opmath_t<T>;
    constexpr int kPack = 16 / sizeof(T);
    const Acc eps = static_cast<Acc>(c.attr<double>(0));
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, 1 << 20));
    auto launch = [&]<int N>(std::integral_constant<int, N>) {
      rms_norm_fwd_kernel<T, W, N><<<grid, threads_for(d / N, kCache), 0, current_stream()>>>(
          static_cast<T*>(y.data_ptr()), static_cast<Acc*>(rstd.data_ptr()),
          static_cast<const T*>(x.data_ptr()), static_cast<const W*>(w.data_ptr()), rows, d, eps);
      KILN_CUDA_LAUNCH_CHECK("rms_norm_fwd_kernel");
    };
    const bool packed = packable<T, W>(d, {x.data_ptr(), y.data_ptr()}, w.data_ptr());
    const int64_t nvec = d / kPack;
    auto launch_warp = [&]<int P>(std::integral_constant<int, P>) {
      constexpr int kRowsPerBlock = 8;
      const unsigned blocks = static_cast<unsigned>(
          std::min<int64_t>((rows + kRowsPerBlock - 1) / kRowsPerBlock, 1 << 20));
      rms_norm_fwd_warp_kernel<T, W, kPack, P><<<blocks, 32 * kRowsPerBlock, 0, current_stream()>>>(
          static_cast<T*>(y.data_ptr()), static_cast<Acc*>(rstd.data_ptr()),
          static_cast<const T*>(x.data_ptr()), static_cast<const W*>(w.data_ptr()), rows, d, eps);
      KILN_CUDA_LAUNCH_CHECK("rms_norm_fwd_warp_kernel");
    };
    if (packed && d > 0 && nvec <= 32) {
      launch_warp(std::integral_constant<int, 1>{});
    } else if (packed && d > 0 && nvec <= 64) {
      launch_warp(std::integral_constant<int, 2>{});
    } else if (packed && d > 0 && nvec <= 128) {
      launch_warp(std::integral_constant<int, 4>{});
    } else if (packed && d > 0 && nvec <= 256) {
      launch_warp(std::integral_constant<int, 8>{});
    } else if (packed && d > 0 && nvec <= 512) {
      launch_warp(std::integral_constant<int, 16>{});
    } else if (packed) {
      launch(std::integral_constant<int, kPack>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
  });
}

void rms_norm_backward_cuda(OpCall& c) {
  const Tensor dy = c.input(0).contiguous();
  const Tensor x = c.input(1).contiguous();
  const Tensor w = c.input(2).contiguous();
  const Tensor rstd = (c.input(3).is_cuda() ? c.input(3) : c.input(3).to(x.device())).contiguous();
  const Tensor& dx = c.outputs[0];
  const Tensor& dw = c.outputs[1];
  const int64_t d = w.numel(), rows = rstd.numel();
  if (d == 0) return;
  DeviceGuard guard(x.device().index());
  const cudaStream_t stream = current_stream();
  if (rows == 0) {
    KILN_CUDA_CHECK(cudaMemsetAsync(dw.data_ptr(), 0, dw.nbytes(), stream));
    return;
  }
  visit_x_weight(x.dtype(), w.dtype(), [&]<typename T, typename W>(TypeTag<T>, TypeTag<W>) {
    using Acc = opmath_t<T>;
    constexpr int kPack = 16 / sizeof(T);
    const bool packed =
        packable<T, W>(d, {x.data_ptr(), dy.data_ptr(), dx.data_ptr()}, w.data_ptr());
    const int n = packed ? kPack : 1;
    const int threads = threads_for(d / n, kCacheBwd);
    const int64_t grid = std::min<int64_t>(rows, sm_count() * std::max(1, 2048 / threads));
    const Tensor partial = empty({grid, d}, TensorOptions(dtype_of<Acc>()).device(x.device()));
    auto launch = [&]<int N>(std::integral_constant<int, N>) {
      rms_norm_bwd_kernel<T, W, N><<<static_cast<unsigned>(grid), threads, 0, stream>>>(
          static_cast<T*>(dx.data_ptr()), static_cast<Acc*>(partial.data_ptr()),
          static_cast<const T*>(dy.data_ptr()), static_cast<const T*>(x.data_ptr()),
          static_cast<const W*>(w.data_ptr()), static_cast<const Acc*>(rstd.data_ptr()), rows,
          d);
      KILN_CUDA_LAUNCH_CHECK("rms_norm_bwd_kernel");
    };
    if (packed) {
      launch(std::integral_constant<int, kPack>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
    column_sum_kernel<Acc, W><<<static_cast<unsigned>((d + 31) / 32), dim3(32, 32), 0, stream>>>(
        static_cast<W*>(dw.data_ptr()), static_cast<const Acc*>(partial.data_ptr()), grid, d);
    KILN_CUDA_LAUNCH_CHECK("column_sum_kernel");
  });
}

}  // namespace

KILN_REGISTER_KERNEL(rms_norm, kCUDA, rms_norm_cuda);
KILN_REGISTER_KERNEL(rms_norm_backward, kCUDA, rms_norm_backward_cuda);

}  // namespace kiln::cuda
