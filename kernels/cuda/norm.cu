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
// Alternative forward and backward kernels, for timing side by side in one process, are chosen
// by the environment variables KILN_RMSNORM_FWD (1 to 6) and KILN_RMSNORM_BWD (1 to 4), cached
// (forward_variant(), backward_variant(); reload_env_switches() after a setenv); 0: the kernels
// above. Unset, the measured
// fastest: forward variant 2 for rows of 2048 and more (the kernels above below that), backward
// variant 1 for rows longer than 2048, variant 3 otherwise.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>

#include "kernels/cuda/check.h"
#include "kernels/cuda/fused_util.cuh"
#include "kernels/cuda/loops.cuh"
#include "kernels/cuda/norm_util.cuh"
#include "tensor/env_switch.h"
#include "tensor/ops.h"
#include "kernels/fused_support.h"
#include "tensor/registry.h"

namespace kiln::cuda {
namespace {

using internal::aligned_to;
using internal::block_sum;
using internal::launch_column_sums;
using internal::load_pack;
using internal::packable;
using internal::rsqrt_of;
using internal::store_pack;
using internal::visit_x_weight;
using loops::multiprocessor_count;

constexpr int kCache = 2;     // packs per thread held in registers (forward)
constexpr int kCacheBwd = 1;  // backward: x, dy * w and dweight for one pack (64 registers)

template <typename T, typename W, int N>
__global__ void __launch_bounds__(1024)
    rms_norm_fwd_kernel(T* __restrict__ y, opmath_t<T>* __restrict__ rstd, const T* __restrict__ x,
                        const W* __restrict__ w, int64_t rows, int64_t d, opmath_t<T> eps) {
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
  using internal::raw_elem;
  using internal::RawPack;
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
        for (int i = 0; i < N; ++i) o[i] = raw_elem<T, N, Acc>(raw[p], i) * r * wv[i];
        store_pack<N>(yr + v * N, o);
      }
    }
  }
}

// Forward variants for timing side by side (KILN_RMSNORM_FWD, see forward_variant()): groups of
// TPR threads (a multiple of 32) each normalise R rows at a time, every thread holding P 16-byte
// packs of each row in registers. All R rows' loads are issued before any reduction (more bytes
// in flight per thread); with kWFirst the weight packs are loaded with x, before the reduction,
// instead of after it. Groups wider than a warp combine their warps' sums through shared memory.
// The loop is uniform over the block (every thread runs every iteration, rows past the end are
// masked) so the barriers are safe. Rows of at most TPR * P packs.
template <typename T, typename W, int N, int P, int TPR, int R, bool kWFirst>
__global__ void __launch_bounds__(256)
    rms_norm_fwd_group_kernel(T* __restrict__ y, opmath_t<T>* __restrict__ rstd,
                              const T* __restrict__ x, const W* __restrict__ w, int64_t rows,
                              int64_t d, opmath_t<T> eps) {
  using Acc = opmath_t<T>;
  using internal::Pack;
  using internal::raw_elem;
  using internal::RawPack;
  constexpr int kWarpsPerGroup = TPR / 32;
  const int groups = static_cast<int>(blockDim.x) / TPR;
  const int g = static_cast<int>(threadIdx.x) / TPR, t = static_cast<int>(threadIdx.x) % TPR;
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t nvec = d / N;
  const int64_t per_block = static_cast<int64_t>(groups) * R;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * per_block; base < rows;
       base += static_cast<int64_t>(gridDim.x) * per_block) {
    const int64_t row0 = base + static_cast<int64_t>(g) * R;
    RawPack<T, N> raw[R][P];
    Pack<W, N> wraw[kWFirst ? P : 1];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row0 + r < rows) {
        const T* xr = x + (row0 + r) * d;
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const int64_t v = t + p * TPR;
          if (v < nvec) raw[r][p] = *reinterpret_cast<const RawPack<T, N>*>(xr + v * N);
        }
      }
    }
    if constexpr (kWFirst) {
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const int64_t v = t + p * TPR;
        if (v < nvec) wraw[p] = *reinterpret_cast<const Pack<W, N>*>(w + v * N);
      }
    }
    Acc ss[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      ss[r] = 0;
      if (row0 + r < rows) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
          if (t + p * TPR < nvec) {
#pragma unroll
            for (int i = 0; i < N; ++i) {
              const Acc f = raw_elem<T, N, Acc>(raw[r][p], i);
              ss[r] += f * f;
            }
          }
        }
      }
      ss[r] = internal::warp_sum(ss[r]);
    }
    if constexpr (kWarpsPerGroup > 1) {
      __shared__ Acc smem[8][R];  // [warp][row]; blocks of at most 256 threads
      if (lane == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) smem[warp][r] = ss[r];
      }
      __syncthreads();
#pragma unroll
      for (int r = 0; r < R; ++r) {
        Acc s = 0;
#pragma unroll
        for (int k = 0; k < kWarpsPerGroup; ++k) s += smem[g * kWarpsPerGroup + k][r];
        ss[r] = s;
      }
      __syncthreads();  // smem is written again by the next iteration
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row0 + r < rows) {
        const Acc rs = rsqrt_of(ss[r] / static_cast<Acc>(d) + eps);
        if (t == 0) rstd[row0 + r] = rs;
        T* yr = y + (row0 + r) * d;
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const int64_t v = t + p * TPR;
          if (v < nvec) {
            Acc wv[N], o[N];
            if constexpr (kWFirst) {
#pragma unroll
              for (int i = 0; i < N; ++i) wv[i] = static_cast<Acc>(wraw[p].v[i]);
            } else {
              load_pack<N>(w + v * N, wv);
            }
#pragma unroll
            for (int i = 0; i < N; ++i) o[i] = raw_elem<T, N, Acc>(raw[r][p], i) * rs * wv[i];
            store_pack<N>(yr + v * N, o);
          }
        }
      }
    }
  }
}

template <typename T, typename W, int N>
__global__ void __launch_bounds__(1024)
    rms_norm_bwd_kernel(T* __restrict__ dx, opmath_t<T>* __restrict__ partial,
                        const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ w,
                        const opmath_t<T>* __restrict__ rstd, int64_t rows, int64_t d) {
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

// Backward variants for timing side by side (KILN_RMSNORM_BWD, see backward_variant()): one row
// per block of TPR threads (at most 256), R rows at a time, for rows of at most TPR * P packs.
// Each thread keeps its columns' weight (loaded once) and dweight partial sums in registers for
// all the rows of its block, and issues the loads of x and dy of all R rows before the block
// sum (one barrier pair for the R sums). The loop is uniform over the block (masked rows).
template <typename T, typename W, int N, int P, int TPR, int R>
__global__ void __launch_bounds__(256)
    rms_norm_bwd_group_kernel(T* __restrict__ dx, opmath_t<T>* __restrict__ partial,
                              const T* __restrict__ dy, const T* __restrict__ x,
                              const W* __restrict__ w, const opmath_t<T>* __restrict__ rstd,
                              int64_t rows, int64_t d) {
  using Acc = opmath_t<T>;
  using internal::Pack;
  using internal::raw_elem;
  using internal::RawPack;
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
    RawPack<T, N> xr[R][P], gr[R][P];
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
      dot[r] = internal::warp_sum(dot[r]);
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
        const Acc k = rs[r] * rs[r] * rs[r] * dot[r] / static_cast<Acc>(d);
        T* dr = dx + (base + r) * d;
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const int64_t v = t + p * TPR;
          if (v < nvec) {
            Acc o[N];
#pragma unroll
            for (int i = 0; i < N; ++i) {
              o[i] = rs[r] * raw_elem<T, N, Acc>(gr[r][p], i) * wv[p][i] -
                     raw_elem<T, N, Acc>(xr[r][p], i) * k;
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

// Threads per row: one pack per thread up to 256 threads, more threads (up to 1024) before a
// thread holds more than kCache packs.
int threads_for(int64_t nvec, int cache) {
  auto round32 = [](int64_t v) {
    return static_cast<int>(std::max<int64_t>(32, (v + 31) / 32 * 32));
  };
  const int one_each = std::min(round32(nvec), 256);
  const int cached = std::min(round32((nvec + cache - 1) / cache), 1024);
  return std::max(one_each, cached);
}

// The forward kernel chosen by the environment variable KILN_RMSNORM_FWD (cached; the GPU
// benchmark reloads it to time every variant in one process). "0": the kernels
// above; unset or empty: the measured default (see rms_norm_forward_cuda). Each variant applies to
// 16-byte-packable rows that fit its register cache; other rows take the default kernels.
//   1: one warp per 2 rows (both rows' loads issued before either reduction), 4-warp blocks
//   2: one 128-thread block (4 warps) per row, shared-memory exchange of the warp sums
//   3: one 256-thread block (8 warps) per row
//   4: 64 threads (2 warps) per row, 256-thread blocks (4 rows per block)
//   5: as 2, with the weight loaded with x before the reduction
//   6: the default one warp per row (8-warp blocks), with the weight loaded before the reduction
int forward_variant() {
  // Unset or empty: -1, the measured default (rms_norm_forward_cuda).
  static const kiln::internal::EnvInt variant("KILN_RMSNORM_FWD", -1, 0, 6);
  return static_cast<int>(variant.get());
}

// Launches rms_norm_fwd_group_kernel with TPR threads per row, R rows per group and blocks of
// `block` threads, with P the smallest of 1, 2, 4, 8, 16 covering nvec packs; false (nothing
// launched) where a row needs more than 16 packs per thread.
template <typename T, typename W, int N, int TPR, int R, bool kWFirst>
bool launch_group(int block, T* y, opmath_t<T>* rstd, const T* x, const W* w, int64_t rows,
                  int64_t d, opmath_t<T> eps) {
  const int64_t nvec = d / N;
  const int64_t per_block = static_cast<int64_t>(block / TPR) * R;
  const unsigned grid =
      static_cast<unsigned>(std::min<int64_t>((rows + per_block - 1) / per_block, 1 << 30));
  auto go = [&]<int P>(std::integral_constant<int, P>) {
    rms_norm_fwd_group_kernel<T, W, N, P, TPR, R, kWFirst>
        <<<grid, block, 0, current_stream()>>>(y, rstd, x, w, rows, d, eps);
    KILN_CUDA_LAUNCH_CHECK("rms_norm_fwd_group_kernel");
  };
  if (nvec <= TPR) {
    go(std::integral_constant<int, 1>{});
  } else if (nvec <= 2 * TPR) {
    go(std::integral_constant<int, 2>{});
  } else if (nvec <= 4 * TPR) {
    go(std::integral_constant<int, 4>{});
  } else if (nvec <= 8 * TPR) {
    go(std::integral_constant<int, 8>{});
  } else if (nvec <= 16 * TPR) {
    go(std::integral_constant<int, 16>{});
  } else {
    return false;
  }
  return true;
}

// Runs forward variant `variant` (1 to 6) on packable rows; false where it does not apply.
template <typename T, typename W>
bool launch_forward_variant(int variant, T* y, opmath_t<T>* rstd, const T* x, const W* w,
                            int64_t rows, int64_t d, opmath_t<T> eps) {
  constexpr int N = 16 / sizeof(T);
  switch (variant) {
    case 1:
      return launch_group<T, W, N, 32, 2, false>(128, y, rstd, x, w, rows, d, eps);
    case 2:
      return launch_group<T, W, N, 128, 1, false>(128, y, rstd, x, w, rows, d, eps);
    case 3:
      return launch_group<T, W, N, 256, 1, false>(256, y, rstd, x, w, rows, d, eps);
    case 4:
      return launch_group<T, W, N, 64, 1, false>(256, y, rstd, x, w, rows, d, eps);
    case 5:
      return launch_group<T, W, N, 128, 1, true>(128, y, rstd, x, w, rows, d, eps);
    case 6:
      return launch_group<T, W, N, 32, 1, true>(256, y, rstd, x, w, rows, d, eps);
    default:
      return false;
  }
}

void rms_norm_cuda(OpCall& c) {
  const Tensor x = c.input(0).contiguous();
  const Tensor w = c.input(1).contiguous();
  const Tensor& y = c.outputs[0];
  const Tensor& rstd = c.outputs[1];
  const int64_t d = w.numel(), rows = rstd.numel();
  if (rows == 0) return;
  // Default, from the variants timed side by side on the H100 (benchmarks/RESULTS.md): a
  // 128-thread block per row for rows of 2048 and more (28.9 us against 32.0 at 8192 x 2048
  // bf16), one warp per row below (21.9 us against 24.4 at 16384 x 768).
  int variant = forward_variant();
  if (variant < 0) variant = d >= 2048 ? 2 : 0;
  DeviceGuard guard(x.device().index());
  visit_x_weight(
      "rms_norm", x.dtype(), w.dtype(), [&]<typename T, typename W>(TypeTag<T>, TypeTag<W>) {
        using Acc = opmath_t<T>;
        constexpr int kPack = 16 / sizeof(T);
        const Acc eps = static_cast<Acc>(c.attr<double>(0));
        const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, 1 << 20));
        auto launch = [&]<int N>(std::integral_constant<int, N>) {
          rms_norm_fwd_kernel<T, W, N><<<grid, threads_for(d / N, kCache), 0, current_stream()>>>(
              static_cast<T*>(y.data_ptr()), static_cast<Acc*>(rstd.data_ptr()),
              static_cast<const T*>(x.data_ptr()), static_cast<const W*>(w.data_ptr()), rows, d,
              eps);
          KILN_CUDA_LAUNCH_CHECK("rms_norm_fwd_kernel");
        };
        const bool packed = packable<T, W>(d, {x.data_ptr(), y.data_ptr()}, {w.data_ptr()});
        const int64_t nvec = d / kPack;
        auto launch_warp = [&]<int P>(std::integral_constant<int, P>) {
          constexpr int kRowsPerBlock = 8;
          const unsigned blocks = static_cast<unsigned>(
              std::min<int64_t>((rows + kRowsPerBlock - 1) / kRowsPerBlock, 1 << 20));
          rms_norm_fwd_warp_kernel<T, W, kPack, P>
              <<<blocks, 32 * kRowsPerBlock, 0, current_stream()>>>(
                  static_cast<T*>(y.data_ptr()), static_cast<Acc*>(rstd.data_ptr()),
                  static_cast<const T*>(x.data_ptr()), static_cast<const W*>(w.data_ptr()), rows, d,
                  eps);
          KILN_CUDA_LAUNCH_CHECK("rms_norm_fwd_warp_kernel");
        };
        if (packed && d > 0 && variant != 0 &&
            launch_forward_variant<T, W>(variant, static_cast<T*>(y.data_ptr()),
                                         static_cast<Acc*>(rstd.data_ptr()),
                                         static_cast<const T*>(x.data_ptr()),
                                         static_cast<const W*>(w.data_ptr()), rows, d, eps)) {
          return;
        }
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

// The backward kernel chosen by KILN_RMSNORM_BWD (cached, as KILN_RMSNORM_FWD).
// "0": the kernel above; unset or empty: the measured fastest (see rms_norm_backward_cuda).
// Variants apply to packable rows of at most 4 packs per thread; other rows take the default
// kernel. Blocks per SM: 2048 / TPR (one wave).
//   1: 256 threads per row, 1 row at a time, weight and dweight in registers
//   2: 256 threads per row, 2 rows at a time (both rows' loads before the block sum)
//   3: 128 threads per row, 2 rows at a time
//   4: 128 threads per row, 4 rows at a time
int backward_variant() {
  // Unset or empty: -1, the measured default (rms_norm_backward_cuda).
  static const kiln::internal::EnvInt variant("KILN_RMSNORM_BWD", -1, 0, 4);
  return static_cast<int>(variant.get());
}

// Backward variant with TPR threads per row and R rows at a time: launches the row kernel and
// the column sum of its partials; false (nothing launched) where a row needs more than 4 packs
// per thread (bf16: 8192 elements for 256 threads per row).
template <typename T, typename W, int TPR, int R>
bool launch_backward_group(T* dx, W* dw, const T* dy, const T* x, const W* w,
                           const opmath_t<T>* rstd, int64_t rows, int64_t d, Device device) {
  using Acc = opmath_t<T>;
  constexpr int N = 16 / sizeof(T);
  const int64_t nvec = d / N;
  if (nvec > 4 * TPR) return false;
  const cudaStream_t stream = current_stream();
  // One wave: as many blocks as are resident at once (registers may allow fewer than 2048 / TPR
  // per SM), so that every block's dweight partial is written once, at its end.
  auto go = [&]<int P>(std::integral_constant<int, P>) {
    const auto kernel = rms_norm_bwd_group_kernel<T, W, N, P, TPR, R>;
    int per_sm = 0;
    KILN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, TPR, 0));
    const int64_t grid = std::min<int64_t>(
        (rows + R - 1) / R, static_cast<int64_t>(multiprocessor_count()) * std::max(1, per_sm));
    const Tensor partial = empty({grid, d}, TensorOptions(dtype_of<Acc>()).device(device));
    kernel<<<static_cast<unsigned>(grid), TPR, 0, stream>>>(
        dx, static_cast<Acc*>(partial.data_ptr()), dy, x, w, rstd, rows, d);
    KILN_CUDA_LAUNCH_CHECK("rms_norm_bwd_group_kernel");
    launch_column_sums<Acc, W>(dw, static_cast<const Acc*>(partial.data_ptr()), nullptr, nullptr,
                               grid, d, stream);
  };
  if (nvec <= TPR) {
    go(std::integral_constant<int, 1>{});
  } else if (nvec <= 2 * TPR) {
    go(std::integral_constant<int, 2>{});
  } else {
    go(std::integral_constant<int, 4>{});
  }
  return true;
}

template <typename T, typename W>
bool launch_backward_variant(int variant, T* dx, W* dw, const T* dy, const T* x, const W* w,
                             const opmath_t<T>* rstd, int64_t rows, int64_t d, Device device) {
  switch (variant) {
    case 1:
      return launch_backward_group<T, W, 256, 1>(dx, dw, dy, x, w, rstd, rows, d, device);
    case 2:
      return launch_backward_group<T, W, 256, 2>(dx, dw, dy, x, w, rstd, rows, d, device);
    case 3:
      return launch_backward_group<T, W, 128, 2>(dx, dw, dy, x, w, rstd, rows, d, device);
    case 4:
      return launch_backward_group<T, W, 128, 4>(dx, dw, dy, x, w, rstd, rows, d, device);
    default:
      return false;
  }
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
  // The measured default (benchmarks/RESULTS.md): 256 threads per row, one row at a time, for
  // rows longer than 2048 elements (0.236 ms against 0.302 for variant 3 at 32768 x 4096 bf16 on
  // the H200); 128 threads per row, 2 rows at a time, up to 2048 (16384 x 768: 36.6 us against
  // 45.6; 8192 x 2048: within 3% of variants 1 and 2).
  int variant = backward_variant();
  if (variant < 0) variant = d > 2048 ? 1 : 3;
  visit_x_weight(
      "rms_norm", x.dtype(), w.dtype(), [&]<typename T, typename W>(TypeTag<T>, TypeTag<W>) {
        using Acc = opmath_t<T>;
        constexpr int kPack = 16 / sizeof(T);
        const bool packed =
            packable<T, W>(d, {x.data_ptr(), dy.data_ptr(), dx.data_ptr()}, {w.data_ptr()});
        if (packed && variant != 0 &&
            launch_backward_variant<T, W>(
                variant, static_cast<T*>(dx.data_ptr()), static_cast<W*>(dw.data_ptr()),
                static_cast<const T*>(dy.data_ptr()), static_cast<const T*>(x.data_ptr()),
                static_cast<const W*>(w.data_ptr()), static_cast<const Acc*>(rstd.data_ptr()), rows,
                d, x.device())) {
          return;
        }
        const int n = packed ? kPack : 1;
        const int threads = threads_for(d / n, kCacheBwd);
        const int64_t grid =
            std::min<int64_t>(rows, multiprocessor_count() * std::max(1, 2048 / threads));
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
        launch_column_sums<Acc, W>(static_cast<W*>(dw.data_ptr()),
                                   static_cast<const Acc*>(partial.data_ptr()), nullptr, nullptr,
                                   grid, d, stream);
      });
}

}  // namespace

KILN_REGISTER_KERNEL_IF(rms_norm, kCUDA, "fused", rms_norm_cuda, rms_norm_supported);
KILN_REGISTER_KERNEL(rms_norm_backward, kCUDA, rms_norm_backward_cuda);

}  // namespace kiln::cuda
