// The CUDA kernels of rms_norm and rms_norm_backward. kernels/cuda/norm.cu picks one per call
// (from the row length and alignment); the kernel lab (benchmarks/lab/norm_lab.cu) also runs the
// row-group backward at other configurations. Over rows of d elements, in opmath_t<T> (f32 for
// f16/bf16, f64 for f64):
//
//   y = x * r * w,  r = 1 / sqrt(mean(x^2) + eps)                        (rstd: r per row)
//   dx = r * dy * w - x * r^3 * mean(dy * w * x),  dweight = sum over rows of dy * x * r
//
// Forward: x is read once and y written once, the floor. The threads of a row hold its 16-byte
// packs in registers across the sum of squares: one warp per row (shuffles only, no barrier) or
// a group of 128 threads per row (one exchange of the warp sums through shared memory); the loop
// kernel takes any row, holding kCache packs per thread and reading the rest again.
// Backward: x and dy are read once and dx written once. A grid of one wave of blocks loops over
// the rows with a fixed thread -> column mapping, so that every thread accumulates dweight for its
// columns in registers across all the rows of its block; each block writes one partial row
// [grid, d] (f32) at its end, and launch_column_sums adds them by column in a fixed order: the
// result is deterministic (no atomics).
// Packs: N elements of 16 bytes where packable() (d % N == 0, aligned pointers); else N = 1.
// Large and tiny magnitudes (kernels/norm_range.h, the CPU kernels' rule): a row whose f32 sum of
// squares leaves its accurate range (|x| beyond about 1e19, or below about 1e-19 with eps below
// about 1e-11) sums its squares again in f32, each element scaled by a power of two first
// (rms_rescale), from the values the threads hold; the backward of a row whose r^3 leaves the f32
// range computes x * r^3 * dot as (x * r) * (r * (r * dot / d)) (dot = sum(dy * w * x) itself
// must stay finite: |x * dy * w| * d below 3e38; the CPU kernel has no such limit). The decision
// is uniform over the threads of a row; other rows run the f32 code unchanged (no double
// arithmetic, which would cost every row registers).
// Internal to kernels/cuda/ and the kernel lab.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kernels/cuda/check.h"
#include "kernels/cuda/fused_util.cuh"
#include "kernels/cuda/loops.cuh"
#include "kernels/cuda/norm_util.cuh"
#include "kernels/norm_range.h"
#include "tensor/ops.h"

namespace kiln::cuda::internal {

inline constexpr int kRmsCache = 2;     // packs per thread the forward loop kernel keeps
inline constexpr int kRmsCacheBwd = 1;  // backward loop kernel: x, dy * w and dweight of 1 pack
inline constexpr int kRmsGroupThreads = 128;  // threads per row of the group forward

// --- Rows out of the f32 range (kernels/norm_range.h) --------------------------------------------

// The sum of the squares of this thread's elements (packs t, t + STRIDE, ... of raw), each
// multiplied by `scale` first.
template <typename T, int N, int P, int STRIDE>
__device__ __forceinline__ opmath_t<T> scaled_squares(const RawPack<T, N> (&raw)[P], int t,
                                                      int64_t nvec, opmath_t<T> scale) {
  using Acc = opmath_t<T>;
  Acc s = 0;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    if (t + p * STRIDE < nvec) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const Acc f = raw_elem<T, N, Acc>(raw[p], i) * scale;
        s += f * f;
      }
    }
  }
  return s;
}

// rstd from the sum of the squares of the row's elements multiplied by `scale`.
template <typename Acc>
__device__ __forceinline__ Acc rstd_of_scaled(Acc ss, int64_t d, Acc eps, Acc scale) {
  return rsqrt_of(ss / static_cast<Acc>(d > 0 ? d : 1) + eps * scale * scale) * scale;
}

// A barrier of the TPR threads of row group g (0 to 3: groups of 64 threads or more in blocks of
// at most 256) alone: named barrier 1 + g (0 is __syncthreads').
template <int TPR>
__device__ __forceinline__ void group_barrier(int g) {
  switch (g) {
    case 0:
      asm volatile("bar.sync 1, %0;" ::"n"(TPR) : "memory");
      break;
    case 1:
      asm volatile("bar.sync 2, %0;" ::"n"(TPR) : "memory");
      break;
    case 2:
      asm volatile("bar.sync 3, %0;" ::"n"(TPR) : "memory");
      break;
    default:
      asm volatile("bar.sync 4, %0;" ::"n"(TPR) : "memory");
      break;
  }
}

// --- Forward ----------------------------------------------------------------------------------

// Rows of at most 32 * P packs: one warp per row. Each lane issues its P 16-byte loads up front
// (independent, all in flight together), keeps the raw packs in registers and reduces with
// shuffles only (no block barrier).
template <typename T, typename W, int N, int P>
__global__ void __launch_bounds__(256)
    rms_norm_fwd_warp_kernel(T* __restrict__ y, opmath_t<T>* __restrict__ rstd,
                             const T* __restrict__ x, const W* __restrict__ w, int64_t rows,
                             int64_t d, opmath_t<T> eps) {
  using Acc = opmath_t<T>;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int64_t nvec = d / N;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       row < rows; row += warps) {
    const T* xr = x + row * d;
    T* yr = y + row * d;
    RawPack<T, N> raw[P];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int64_t v = lane + p * 32;
      if (v < nvec) raw[p] = *reinterpret_cast<const RawPack<T, N>*>(xr + v * N);
    }
    Acc ss = 0;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      if (lane + p * 32 < nvec) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
          const Acc f = raw_elem<T, N, Acc>(raw[p], i);
          ss += f * f;
        }
      }
    }
    ss = warp_sum(ss);
    Acc r = rsqrt_of(ss / static_cast<Acc>(d) + eps);
    if (!kiln::internal::rms_sum_in_range(ss, eps)) {  // the whole warp: scaled, again
      const Acc scale = kiln::internal::rms_rescale(ss);
      r = rstd_of_scaled(warp_sum(scaled_squares<T, N, P, 32>(raw, lane, nvec, scale)), d, eps,
                         scale);
    }
    if (lane == 0) rstd[row] = r;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int64_t v = lane + p * 32;
      if (v < nvec) {
        Acc wv[N], o[N];
        load_pack<N>(w + v * N, wv);
#pragma unroll
        for (int i = 0; i < N; ++i) o[i] = raw_elem<T, N, Acc>(raw[p], i) * r * wv[i];
        store_pack<N>(yr + v * N, o);
      }
    }
  }
}

// Rows of at most TPR * P packs (TPR a multiple of 32, blocks of at most 256 threads): one group
// of TPR threads per row, each thread holding P raw packs; groups wider than a warp add their
// warps' sums through shared memory. The loop is uniform over the block (rows past the end are
// masked) so that the barriers are safe.
template <typename T, typename W, int N, int P, int TPR>
__global__ void __launch_bounds__(256)
    rms_norm_fwd_group_kernel(T* __restrict__ y, opmath_t<T>* __restrict__ rstd,
                              const T* __restrict__ x, const W* __restrict__ w, int64_t rows,
                              int64_t d, opmath_t<T> eps) {
  using Acc = opmath_t<T>;
  constexpr int kWarpsPerGroup = TPR / 32;
  const int groups = static_cast<int>(blockDim.x) / TPR;
  const int g = static_cast<int>(threadIdx.x) / TPR, t = static_cast<int>(threadIdx.x) % TPR;
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t nvec = d / N;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * groups; base < rows;
       base += static_cast<int64_t>(gridDim.x) * groups) {
    const int64_t row = base + g;
    RawPack<T, N> raw[P];
    if (row < rows) {
      const T* xr = x + row * d;
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const int64_t v = t + p * TPR;
        if (v < nvec) raw[p] = *reinterpret_cast<const RawPack<T, N>*>(xr + v * N);
      }
    }
    Acc ss = 0;
    if (row < rows) {
#pragma unroll
      for (int p = 0; p < P; ++p) {
        if (t + p * TPR < nvec) {
#pragma unroll
          for (int i = 0; i < N; ++i) {
            const Acc f = raw_elem<T, N, Acc>(raw[p], i);
            ss += f * f;
          }
        }
      }
    }
    ss = warp_sum(ss);
    if constexpr (kWarpsPerGroup > 1) {
      __shared__ Acc smem[8];  // per warp; blocks of at most 256 threads
      if (lane == 0) smem[warp] = ss;
      __syncthreads();
      Acc s = 0;
#pragma unroll
      for (int k = 0; k < kWarpsPerGroup; ++k) s += smem[g * kWarpsPerGroup + k];
      ss = s;
      __syncthreads();  // smem is written again by the next iteration
    }
    if (row < rows) {
      Acc r = rsqrt_of(ss / static_cast<Acc>(d) + eps);
      if (!kiln::internal::rms_sum_in_range(ss, eps)) {  // the whole group: scaled, again
        const Acc scale = kiln::internal::rms_rescale(ss);
        Acc s = warp_sum(scaled_squares<T, N, P, TPR>(raw, t, nvec, scale));
        if constexpr (kWarpsPerGroup > 1) {
          // This group's next use of `scaled` comes after the block barriers of its next row.
          __shared__ Acc scaled[8];
          if (lane == 0) scaled[warp] = s;
          group_barrier<TPR>(g);
          s = 0;
#pragma unroll
          for (int k = 0; k < kWarpsPerGroup; ++k) s += scaled[g * kWarpsPerGroup + k];
        }
        r = rstd_of_scaled(s, d, eps, scale);
      }
      if (t == 0) rstd[row] = r;
      T* yr = y + row * d;
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const int64_t v = t + p * TPR;
        if (v < nvec) {
          Acc wv[N], o[N];
          load_pack<N>(w + v * N, wv);
#pragma unroll
          for (int i = 0; i < N; ++i) o[i] = raw_elem<T, N, Acc>(raw[p], i) * r * wv[i];
          store_pack<N>(yr + v * N, o);
        }
      }
    }
  }
}

// Any row: one block per row, each thread keeping its first kRmsCache packs in registers across
// the block sum of squares and reading any further packs again.
template <typename T, typename W, int N>
__global__ void __launch_bounds__(1024)
    rms_norm_fwd_loop_kernel(T* __restrict__ y, opmath_t<T>* __restrict__ rstd,
                             const T* __restrict__ x, const W* __restrict__ w, int64_t rows,
                             int64_t d, opmath_t<T> eps) {
  using Acc = opmath_t<T>;
  __shared__ Acc smem[32];
  const int64_t nvec = d / N;
  const int tid = threadIdx.x, bd = blockDim.x;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * d;
    T* yr = y + row * d;
    Acc xc[kRmsCache][N];
    Acc ss = 0;
#pragma unroll
    for (int c = 0; c < kRmsCache; ++c) {
      const int64_t v = tid + static_cast<int64_t>(c) * bd;
      if (v < nvec) {
        load_pack<N>(xr + v * N, xc[c]);
#pragma unroll
        for (int i = 0; i < N; ++i) ss += xc[c][i] * xc[c][i];
      }
    }
    for (int64_t v = tid + static_cast<int64_t>(kRmsCache) * bd; v < nvec; v += bd) {
      Acc t[N];
      load_pack<N>(xr + v * N, t);
#pragma unroll
      for (int i = 0; i < N; ++i) ss += t[i] * t[i];
    }
    ss = block_sum(ss, smem);
    Acc r = rsqrt_of(ss / static_cast<Acc>(d > 0 ? d : 1) + eps);
    if (!kiln::internal::rms_sum_in_range(ss, eps)) {  // the whole block: scaled, again
      const Acc scale = kiln::internal::rms_rescale(ss);
      Acc s = 0;
#pragma unroll
      for (int c = 0; c < kRmsCache; ++c) {
        if (tid + static_cast<int64_t>(c) * bd < nvec) {
#pragma unroll
          for (int i = 0; i < N; ++i) s += (xc[c][i] * scale) * (xc[c][i] * scale);
        }
      }
      for (int64_t v = tid + static_cast<int64_t>(kRmsCache) * bd; v < nvec; v += bd) {
        Acc t[N];
        load_pack<N>(xr + v * N, t);
#pragma unroll
        for (int i = 0; i < N; ++i) s += (t[i] * scale) * (t[i] * scale);
      }
      r = rstd_of_scaled(block_sum(s, smem), d, eps, scale);
    }
    if (tid == 0) rstd[row] = r;
#pragma unroll
    for (int c = 0; c < kRmsCache; ++c) {
      const int64_t v = tid + static_cast<int64_t>(c) * bd;
      if (v < nvec) {
        Acc wv[N], o[N];
        load_pack<N>(w + v * N, wv);
#pragma unroll
        for (int i = 0; i < N; ++i) o[i] = xc[c][i] * r * wv[i];
        store_pack<N>(yr + v * N, o);
      }
    }
    for (int64_t v = tid + static_cast<int64_t>(kRmsCache) * bd; v < nvec; v += bd) {
      Acc t[N], wv[N];
      load_pack<N>(xr + v * N, t);
      load_pack<N>(w + v * N, wv);
#pragma unroll
      for (int i = 0; i < N; ++i) t[i] = t[i] * r * wv[i];
      store_pack<N>(yr + v * N, t);
    }
  }
}

// --- Backward ---------------------------------------------------------------------------------

// Rows of at most TPR * P packs: one row per block of TPR threads (at most 256), R rows at a
// time. Each thread keeps its columns' weight (loaded once) and dweight partial sums in
// registers for all the rows of its block, and issues the loads of x, dy and the residual of all
// R rows before the block sum (one barrier pair for the R sums). The loop is uniform over the block
// (rows past the end are masked) so that the barriers are safe.
template <typename T, typename W, int N, int P, int TPR, int R>
__global__ void __launch_bounds__(256)
    rms_norm_bwd_rows_kernel(T* __restrict__ dx, opmath_t<T>* __restrict__ partial,
                             const T* __restrict__ dy, const T* __restrict__ x,
                             const W* __restrict__ w, const opmath_t<T>* __restrict__ rstd,
                             const T* __restrict__ res, int64_t rows, int64_t d) {
  using Acc = opmath_t<T>;
  constexpr int kWarps = TPR / 32;
  __shared__ Acc smem[kWarps][R];
  const int t = static_cast<int>(threadIdx.x);
  const int warp = t >> 5, lane = t & 31;
  const int64_t nvec = d / N;
  Acc wv[P][N], dw[P][N];
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int64_t v = t + p * TPR;
    if (v < nvec) load_pack<N>(w + v * N, wv[p]);
#pragma unroll
    for (int i = 0; i < N; ++i) dw[p][i] = 0;
  }
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * R; base < rows;
       base += static_cast<int64_t>(gridDim.x) * R) {
    RawPack<T, N> xr[R][P], gr[R][P], rr[R][P];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (base + r < rows) {
        const int64_t off = (base + r) * d;
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const int64_t v = t + p * TPR;
          if (v < nvec) {
            xr[r][p] = *reinterpret_cast<const RawPack<T, N>*>(x + off + v * N);
            gr[r][p] = *reinterpret_cast<const RawPack<T, N>*>(dy + off + v * N);
            if (res != nullptr)
              rr[r][p] = *reinterpret_cast<const RawPack<T, N>*>(res + off + v * N);
          }
        }
      }
    }
    Acc rs[R], dot[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      dot[r] = 0;
      rs[r] = base + r < rows ? rstd[base + r] : Acc(0);
      if (base + r < rows) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
          if (t + p * TPR < nvec) {
#pragma unroll
            for (int i = 0; i < N; ++i) {
              const Acc xv = raw_elem<T, N, Acc>(xr[r][p], i);
              const Acc gv = raw_elem<T, N, Acc>(gr[r][p], i);
              dot[r] += gv * wv[p][i] * xv;
              dw[p][i] += gv * xv * rs[r];
            }
          }
        }
      }
      dot[r] = warp_sum(dot[r]);
    }
    if constexpr (kWarps > 1) {
      if (lane == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) smem[warp][r] = dot[r];
      }
      __syncthreads();
#pragma unroll
      for (int r = 0; r < R; ++r) {
        Acc sum = 0;
#pragma unroll
        for (int k = 0; k < kWarps; ++k) sum += smem[k][r];
        dot[r] = sum;
      }
      __syncthreads();  // smem is written again by the next iteration
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (base + r < rows) {
        // x * k, or (x * s) * k when r^3 leaves the f32 range (x * 1 is exact: the same bits).
        const bool in_range = kiln::internal::rms_backward_in_range(rs[r], dot[r]);
        const Acc k = in_range ? rs[r] * rs[r] * rs[r] * dot[r] / static_cast<Acc>(d)
                               : rs[r] * (rs[r] * dot[r] / static_cast<Acc>(d));
        const Acc s = in_range ? Acc(1) : rs[r];
        T* dr = dx + (base + r) * d;
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const int64_t v = t + p * TPR;
          if (v < nvec) {
            Acc o[N];
#pragma unroll
            for (int i = 0; i < N; ++i) {
              o[i] = rs[r] * raw_elem<T, N, Acc>(gr[r][p], i) * wv[p][i] -
                     raw_elem<T, N, Acc>(xr[r][p], i) * s * k;
            }
            if (res != nullptr) {
#pragma unroll
              for (int i = 0; i < N; ++i) o[i] += raw_elem<T, N, Acc>(rr[r][p], i);
            }
            store_pack<N>(dr + v * N, o);
          }
        }
      }
    }
  }
  Acc* part = partial + blockIdx.x * d;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int64_t v = t + p * TPR;
    if (v < nvec) {
#pragma unroll
      for (int i = 0; i < N; ++i) part[v * N + i] = dw[p][i];
    }
  }
}

// Any row: a block loops over its rows, each thread keeping kRmsCacheBwd packs of x, dy * w and
// dweight in registers and accumulating the dweight of any further columns in its block's
// partial row in global memory.
template <typename T, typename W, int N>
__global__ void __launch_bounds__(1024)
    rms_norm_bwd_loop_kernel(T* __restrict__ dx, opmath_t<T>* __restrict__ partial,
                             const T* __restrict__ dy, const T* __restrict__ x,
                             const W* __restrict__ w, const opmath_t<T>* __restrict__ rstd,
                             const T* __restrict__ res, int64_t rows, int64_t d) {
  using Acc = opmath_t<T>;
  __shared__ Acc smem[32];
  const int64_t nvec = d / N;
  const int tid = threadIdx.x, bd = blockDim.x;
  Acc* part = partial + blockIdx.x * d;
  Acc dwc[kRmsCacheBwd][N];
#pragma unroll
  for (int c = 0; c < kRmsCacheBwd; ++c) {
#pragma unroll
    for (int i = 0; i < N; ++i) dwc[c][i] = 0;
  }
  for (int64_t v = tid + static_cast<int64_t>(kRmsCacheBwd) * bd; v < nvec; v += bd) {
    for (int i = 0; i < N; ++i) part[v * N + i] = 0;
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const Acc r = rstd[row];
    const T* xr = x + row * d;
    const T* gr = dy + row * d;
    T* dr = dx + row * d;
    const T* rr = res != nullptr ? res + row * d : nullptr;
    Acc xc[kRmsCacheBwd][N], gc[kRmsCacheBwd][N];
    Acc dot = 0;
#pragma unroll
    for (int c = 0; c < kRmsCacheBwd; ++c) {
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
    for (int64_t v = tid + static_cast<int64_t>(kRmsCacheBwd) * bd; v < nvec; v += bd) {
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
    // x * k, or (x * s) * k when r^3 leaves the f32 range (x * 1 is exact: the same bits).
    const bool in_range = kiln::internal::rms_backward_in_range(r, dot);
    const Acc k =
        in_range ? r * r * r * dot / static_cast<Acc>(d) : r * (r * dot / static_cast<Acc>(d));
    const Acc s = in_range ? Acc(1) : r;
#pragma unroll
    for (int c = 0; c < kRmsCacheBwd; ++c) {
      const int64_t v = tid + static_cast<int64_t>(c) * bd;
      if (v < nvec) {
        Acc o[N];
#pragma unroll
        for (int i = 0; i < N; ++i) o[i] = r * gc[c][i] - xc[c][i] * s * k;
        if (rr != nullptr) add_pack<N>(o, rr + v * N);
        store_pack<N>(dr + v * N, o);
      }
    }
    for (int64_t v = tid + static_cast<int64_t>(kRmsCacheBwd) * bd; v < nvec; v += bd) {
      Acc xv[N], dyv[N], wv[N], o[N];
      load_pack<N>(xr + v * N, xv);
      load_pack<N>(gr + v * N, dyv);
      load_pack<N>(w + v * N, wv);
#pragma unroll
      for (int i = 0; i < N; ++i) o[i] = r * dyv[i] * wv[i] - xv[i] * s * k;
      if (rr != nullptr) add_pack<N>(o, rr + v * N);
      store_pack<N>(dr + v * N, o);
    }
  }
#pragma unroll
  for (int c = 0; c < kRmsCacheBwd; ++c) {
    const int64_t v = tid + static_cast<int64_t>(c) * bd;
    if (v < nvec) {
#pragma unroll
      for (int i = 0; i < N; ++i) part[v * N + i] = dwc[c][i];
    }
  }
}

// Launches rms_norm_bwd_rows_kernel with TPR threads per row and R rows at a time over one wave
// of blocks (res: nullptr, or a residual of dx's shape added to dx before the rounding), then the
// column sum of its partials into dw; false (nothing launched) where a row needs more than 4 packs
// per thread (bf16: 8192 elements at 256 threads per row). Rows packable.
template <typename T, typename W, int TPR, int R>
bool launch_rms_norm_bwd_rows(T* dx, W* dw, const T* dy, const T* x, const W* w,
                              const opmath_t<T>* rstd, const T* res, int64_t rows, int64_t d,
                              Device device, cudaStream_t stream) {
  using Acc = opmath_t<T>;
  constexpr int N = 16 / sizeof(T);
  // One wave: as many blocks as are resident at once (registers may allow fewer than 2048 / TPR
  // per SM), so that every block's dweight partial is written once, at its end.
  auto go = [&]<int P>(std::integral_constant<int, P>) {
    const auto kernel = rms_norm_bwd_rows_kernel<T, W, N, P, TPR, R>;
    int per_sm = 0;
    KILN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, TPR, 0));
    const int64_t grid =
        std::min<int64_t>((rows + R - 1) / R, static_cast<int64_t>(loops::multiprocessor_count()) *
                                                  std::max(1, per_sm));
    const Tensor partial = empty({grid, d}, TensorOptions(dtype_of<Acc>()).device(device));
    Acc* pp = static_cast<Acc*>(partial.data_ptr());
    kernel<<<static_cast<unsigned>(grid), TPR, 0, stream>>>(dx, pp, dy, x, w, rstd, res, rows, d);
    KILN_CUDA_LAUNCH_CHECK("rms_norm_bwd_rows_kernel");
    launch_column_sums<Acc, W>(dw, pp, nullptr, nullptr, grid, d, stream);
  };
  return with_packs<TPR>(d / N, std::integer_sequence<int, 1, 2, 4>{}, go);
}

}  // namespace kiln::cuda::internal
