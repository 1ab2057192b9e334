// The CUDA kernels of layer_norm and layer_norm_backward. kernels/cuda/layer_norm.cu picks one
// per call (from the row length and alignment); the kernel lab (benchmarks/lab/layer_norm_lab.cu)
// also runs the register kernels at other threads per row and rows per iteration. Over rows of d
// elements, in opmath_t<T> (f32 for f16/bf16, f64 for f64), with w and b optional (1 and 0):
//
//   mean = sum(x) / d,  r = 1 / sqrt(sum((x - mean)^2) / d + eps),  xh = (x - mean) * r
//   y = xh * w + b
//   dx = r * (dy * w - mean(dy * w) - xh * mean(dy * w * xh)),
//   dweight = sum over rows of dy * xh,  dbias = sum over rows of dy
//
// Register kernels: a group of TPR threads per row (a multiple of 32; BLOCK / TPR groups per
// block), every thread holding P 16-byte packs of its row in registers, kept as raw words
// (RawPack) and widened where used. Forward: x is read once, the mean and then the variance about
// it are two passes over the registers (no E[x^2] - E[x]^2 cancellation), y is written once.
// Backward: a grid of one wave of blocks, each group looping over rows with a fixed thread ->
// column mapping, so that every thread accumulates dweight and dbias of its columns in f32 across
// all the rows of its group (in private shared-memory slots with the weight in registers where
// they fit, kSumsInShared, else in registers), R rows per iteration (both rows' loads in flight
// together, one exchange of the row sums, one update of the sums). x and dy are read once; dx is
// written from the registers. The groups of a block add their sums into the block's partial row
// in group order; the partials [grid, d] are summed by column in a fixed order
// (launch_column_sums): deterministic, no atomics.
// Loop kernels (any row, and f64): one block per row looping over it (x is read three times
// forward, twice backward; L1/L2 serve the repeats).
// Packs: N elements of 16 bytes where packable() (d % N == 0, aligned pointers); else N = 1.
// Large and tiny magnitudes (kernels/norm_range.h, the CPU kernel's rule): a row whose f32 sum or
// sum of squared deviations leaves its accurate range (|x - mean| beyond about 1e19, or below
// about 1e-19 with an eps below 2^-36) takes its mean and variance again in f32, from the values
// the threads hold, scaled by a power of two (layer_norm_rescale); the decision is uniform over
// the threads of a row (the register kernels' groups sum among themselves, group_sum_alone),
// and other rows run the f32 code unchanged. The backward needs nothing more: it reads the mean
// and rstd, and xh = (x - mean) * rstd stays in range.
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

// Sums each of v[0..K) over the TPR threads of a group (TPR a multiple of 32; the groups of a
// block are consecutive runs of TPR threads), every thread receiving its group's sums. Groups
// wider than a warp exchange their warp sums through `smem` ([warps of the block][K]), with
// barriers: every thread of the block must call it.
template <int TPR, int K, typename Acc>
__device__ __forceinline__ void group_sum(Acc (&v)[K], Acc* smem) {
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum(v[k]);
  if constexpr (TPR > 32) {
    constexpr int kWarps = TPR / 32;
    const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
    const int first = warp / kWarps * kWarps;
    __syncthreads();  // the previous call's readers are done with smem
    if (lane == 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) smem[warp * K + k] = v[k];
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < K; ++k) {
      Acc s = 0;
#pragma unroll
      for (int i = 0; i < kWarps; ++i) s += smem[(first + i) * K + k];
      v[k] = s;
    }
  }
}

// group_sum for the threads of one group alone, where the other groups of the block may not call
// it (a row out of range): the same sums in the same order, exchanged through the group's named
// barrier 1 + g instead of the block's. smem as group_sum's (a group writes its own warps' slots
// only; the leading barrier waits for the group's readers of the previous call).
template <int TPR, int K, typename Acc>
__device__ __forceinline__ void group_sum_alone(Acc (&v)[K], Acc* smem) {
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum(v[k]);
  if constexpr (TPR > 32) {
    constexpr int kWarps = TPR / 32;
    const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
    const int first = warp / kWarps * kWarps;
    const unsigned barrier = 1 + static_cast<unsigned>(warp / kWarps);
    asm volatile("bar.sync %0, %1;" ::"r"(barrier), "n"(TPR) : "memory");
    if (lane == 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) smem[warp * K + k] = v[k];
    }
    asm volatile("bar.sync %0, %1;" ::"r"(barrier), "n"(TPR) : "memory");
#pragma unroll
    for (int k = 0; k < K; ++k) {
      Acc s = 0;
#pragma unroll
      for (int i = 0; i < kWarps; ++i) s += smem[(first + i) * K + k];
      v[k] = s;
    }
  }
}

// A row whose f32 sums s and ss left their range (kernels/norm_range.h): its mean m and rstd r
// again, in f32 scaled by layer_norm_rescale(ss). sum_each(f) returns the sum over the row of
// f(x) for each element x (in Acc), the same in every thread that takes the row. Called by all of
// them, with the s, ss, m and r they hold; f32 only (f64 rows are never out of range).
template <typename Acc, typename SumEach>
__device__ __forceinline__ void layer_norm_stats_rescaled(SumEach&& sum_each, Acc ss, Acc inv_d,
                                                          Acc eps, Acc& m, Acc& r) {
  const Acc scale = kiln::internal::layer_norm_rescale(ss);
  if (scale < Acc(1)) {
    // A sum overflowed: the elements scaled down, then their deviations from the scaled mean.
    const Acc ms = sum_each([&](Acc v) { return v * scale; }) * inv_d;
    m = ms / scale;
    ss = sum_each([&](Acc v) {
      const Acc c = v * scale - ms;
      return c * c;
    });
  } else {
    // ss underflowed: the deviations scaled up.
    ss = sum_each([&](Acc v) {
      const Acc c = (v - m) * scale;
      return c * c;
    });
  }
  r = rsqrt_of(ss * inv_d + eps * scale * scale) * scale;
}

// Register cap of the forward register kernel (as resident blocks per SM for
// __launch_bounds__): a memory-bound kernel needs many rows in flight, and without a cap the
// compiler keeps f32 copies of the row (125 registers at 4 packs: 4 resident blocks). Up to 4
// packs: 64 registers. The backward's caps are below its kernel (kBwdMinBlocks).
template <int P, int BLOCK>
constexpr int kFwdMinBlocks = P <= 4 ? 65536 / (BLOCK * 64) : 1;

// Forward for rows of at most TPR * P packs of N elements: groups of TPR threads, one row per
// group at a time, BLOCK / TPR groups per block. The loop is uniform over the block (rows past
// the end are masked) so that group_sum's barriers are safe. w and b may be null (1 and 0).
// kRangeCheck false: without the test for rows out of range (the kernel lab times both).
template <typename T, typename W, int N, int P, int TPR, int BLOCK, bool kRangeCheck = true>
__global__ void __launch_bounds__(BLOCK, kFwdMinBlocks<P, BLOCK>)
    layer_norm_fwd_kernel(T* __restrict__ y, opmath_t<T>* __restrict__ mean,
                          opmath_t<T>* __restrict__ rstd, const T* __restrict__ x,
                          const W* __restrict__ w, const W* __restrict__ b, int64_t rows, int64_t d,
                          opmath_t<T> eps) {
  using Acc = opmath_t<T>;
  constexpr int kGroups = BLOCK / TPR;
  __shared__ Acc smem[BLOCK / 32];
  const int g = static_cast<int>(threadIdx.x) / TPR, t = static_cast<int>(threadIdx.x) % TPR;
  const int64_t nvec = d / N;
  const Acc inv_d = Acc(1) / static_cast<Acc>(d);
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kGroups; base < rows;
       base += static_cast<int64_t>(gridDim.x) * kGroups) {
    const int64_t row = base + g;
    const bool active = row < rows;
    const T* xr = x + row * d;
    RawPack<T, N> raw[P];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int64_t v = t + p * TPR;
      if (active && v < nvec) raw[p] = *reinterpret_cast<const RawPack<T, N>*>(xr + v * N);
    }
    Acc s[1] = {0};
#pragma unroll
    for (int p = 0; p < P; ++p) {
      if (active && t + p * TPR < nvec) {
#pragma unroll
        for (int i = 0; i < N; ++i) s[0] += raw_elem<T, N, Acc>(raw[p], i);
      }
    }
    group_sum<TPR>(s, smem);
    Acc m = s[0] * inv_d;
    Acc ss[1] = {0};
#pragma unroll
    for (int p = 0; p < P; ++p) {
      if (active && t + p * TPR < nvec) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
          const Acc c = raw_elem<T, N, Acc>(raw[p], i) - m;
          ss[0] += c * c;
        }
      }
    }
    group_sum<TPR>(ss, smem);
    Acc r = rsqrt_of(ss[0] * inv_d + eps);
    if (kRangeCheck && !kiln::internal::layer_norm_sums_in_range(s[0], ss[0], eps)) {
      // The whole group (its sums are the same in every thread): again, scaled, from the
      // registers, with the group's own barriers.
      auto sum_each = [&](auto&& f) {
        Acc v[1] = {0};
#pragma unroll
        for (int p = 0; p < P; ++p) {
          if (active && t + p * TPR < nvec) {
#pragma unroll
            for (int i = 0; i < N; ++i) v[0] += f(raw_elem<T, N, Acc>(raw[p], i));
          }
        }
        group_sum_alone<TPR>(v, smem);
        return v[0];
      };
      layer_norm_stats_rescaled(sum_each, ss[0], inv_d, eps, m, r);
    }
    if (!active) continue;  // after the last barrier of the iteration
    if (t == 0) {
      mean[row] = m;
      rstd[row] = r;
    }
    T* yr = y + row * d;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int64_t v = t + p * TPR;
      if (v < nvec) {
        Acc o[N];
#pragma unroll
        for (int i = 0; i < N; ++i) o[i] = (raw_elem<T, N, Acc>(raw[p], i) - m) * r;
        if (w != nullptr) {
          Acc wv[N];
          load_pack<N>(w + v * N, wv);
#pragma unroll
          for (int i = 0; i < N; ++i) o[i] *= wv[i];
        }
        if (b != nullptr) {
          Acc bv[N];
          load_pack<N>(b + v * N, bv);
#pragma unroll
          for (int i = 0; i < N; ++i) o[i] += bv[i];
        }
        store_pack<N>(yr + v * N, o);
      }
    }
  }
}

// Forward for any row: one block per row, looping over it (sum, squared deviations, output).
template <typename T, typename W>
__global__ void __launch_bounds__(256)
    layer_norm_fwd_loop_kernel(T* __restrict__ y, opmath_t<T>* __restrict__ mean,
                               opmath_t<T>* __restrict__ rstd, const T* __restrict__ x,
                               const W* __restrict__ w, const W* __restrict__ b, int64_t rows,
                               int64_t d, opmath_t<T> eps) {
  using Acc = opmath_t<T>;
  __shared__ Acc smem[32];
  const int tid = static_cast<int>(threadIdx.x), bd = static_cast<int>(blockDim.x);
  const Acc inv_d = d > 0 ? Acc(1) / static_cast<Acc>(d) : Acc(0);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * d;
    Acc s = 0;
    for (int64_t j = tid; j < d; j += bd) s += static_cast<Acc>(xr[j]);
    s = block_sum(s, smem);
    Acc m = s * inv_d;
    Acc ss = 0;
    for (int64_t j = tid; j < d; j += bd) {
      const Acc c = static_cast<Acc>(xr[j]) - m;
      ss += c * c;
    }
    ss = block_sum(ss, smem);
    Acc r = rsqrt_of(ss * inv_d + eps);
    if (!kiln::internal::layer_norm_sums_in_range(s, ss, eps)) {  // the whole block: scaled
      auto sum_each = [&](auto&& f) {
        Acc v = 0;
        for (int64_t j = tid; j < d; j += bd) v += f(static_cast<Acc>(xr[j]));
        return block_sum(v, smem);
      };
      layer_norm_stats_rescaled(sum_each, ss, inv_d, eps, m, r);
    }
    if (tid == 0) {
      mean[row] = m;
      rstd[row] = r;
    }
    T* yr = y + row * d;
    for (int64_t j = tid; j < d; j += bd) {
      Acc o = (static_cast<Acc>(xr[j]) - m) * r;
      if (w != nullptr) o *= static_cast<Acc>(w[j]);
      if (b != nullptr) o += static_cast<Acc>(b[j]);
      yr[j] = T(o);
    }
  }
}

// Adds a thread's column sums (dw(p, i) and db(p, i): dweight and dbias of element i of its pack
// p) into its block's partial rows, group after group (a fixed order), the first group writing
// over whatever was there. Every thread of the block calls it.
template <typename Acc, int N, int P, int TPR, int BLOCK, typename Dw, typename Db>
__device__ __forceinline__ void add_partials(Acc* pw, Acc* pb, Dw&& dw, Db&& db, int64_t nvec) {
  constexpr int kGroups = BLOCK / TPR;
  const int g = static_cast<int>(threadIdx.x) / TPR, t = static_cast<int>(threadIdx.x) % TPR;
#pragma unroll 1
  for (int turn = 0; turn < kGroups; ++turn) {
    if (g == turn) {
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const int64_t v = t + p * TPR;
        if (v < nvec) {
#pragma unroll
          for (int i = 0; i < N; ++i) {
            const int64_t j = v * N + i;
            pw[j] = (turn == 0 ? Acc(0) : pw[j]) + dw(p, i);
            pb[j] = (turn == 0 ? Acc(0) : pb[j]) + db(p, i);
          }
        }
      }
    }
    // Global writes before the barrier are visible to the whole block after it.
    if constexpr (kGroups > 1) __syncthreads();
  }
}

// Whether the backward keeps its dweight and dbias sums in shared memory (private slots, one per
// thread and column: 2 P N BLOCK values) and the weight in registers, rather than the sums in
// registers and the weight read from L1 per use: where the slots fit in 32 KiB (rows up to 4096
// bf16 elements at 256 threads per row).
template <typename Acc, int N, int P, int BLOCK>
constexpr bool kSumsInShared = 2 * P* N* BLOCK * sizeof(Acc) <= 32768;

// Register caps of the backward (resident blocks per SM for __launch_bounds__): one pack per
// thread with the sums in shared memory, 64 registers (4 blocks of 256 threads); up to 2 packs,
// 85 (3 blocks: at 64 the 2-pack kernel spills); more packs, none. Two rows per iteration (at
// most 2 packs): 85 for one pack, 128 for two (at 256 threads: 3 and 2 blocks).
template <typename Acc, int N, int P, int BLOCK, int R>
constexpr int bwd_min_blocks() {
  if (P > 2) return 1;
  if (R > 1) return 65536 / (BLOCK * (P == 1 ? 85 : 128));
  return 65536 / (BLOCK * (P == 1 && kSumsInShared<Acc, N, P, BLOCK> ? 64 : 85));
}
template <typename Acc, int N, int P, int BLOCK, int R>
constexpr int kBwdMinBlocks = bwd_min_blocks<Acc, N, P, BLOCK, R>();

// Backward for rows of at most TPR * P packs (layout as the forward kernel), R rows per group
// and iteration. Each thread accumulates its columns' dweight and dbias sums over all the rows
// of its group, and writes them to the block's partial rows [blockIdx.x] at the end. Where
// kSumsInShared the sums live in shared memory and the weight in registers: with sums and weight in
// registers the kernel spilled at its register cap, and reading the weight per use put an L1 round
// trip on every row's critical path.
template <typename T, typename W, int N, int P, int TPR, int BLOCK, int R>
__global__ void __launch_bounds__(BLOCK, kBwdMinBlocks<opmath_t<T>, N, P, BLOCK, R>)
    layer_norm_bwd_kernel(T* __restrict__ dx, opmath_t<T>* __restrict__ part_w,
                          opmath_t<T>* __restrict__ part_b, const T* __restrict__ dy,
                          const T* __restrict__ x, const W* __restrict__ w,
                          const opmath_t<T>* __restrict__ mean,
                          const opmath_t<T>* __restrict__ rstd, int64_t rows, int64_t d) {
  using Acc = opmath_t<T>;
  constexpr int kGroups = BLOCK / TPR;
  constexpr bool kShared = kSumsInShared<Acc, N, P, BLOCK>;
  constexpr int kSlots = kShared ? P * N * BLOCK : 1;
  __shared__ Acc smem[BLOCK / 32 * 2 * R];
  __shared__ __align__(16) Acc sums_w[kSlots], sums_b[kSlots];  // see slot()
  const int g = static_cast<int>(threadIdx.x) / TPR, t = static_cast<int>(threadIdx.x) % TPR;
  const int64_t nvec = d / N;
  const Acc inv_d = Acc(1) / static_cast<Acc>(d);
  // Registers: the weight where the sums are shared, the sums otherwise.
  Acc wreg[kShared ? P : 1][N], dwreg[kShared ? 1 : P][N], dbreg[kShared ? 1 : P][N];
  // The shared slot of element i of pack p of this thread: groups of 4 consecutive elements in
  // one 16-byte slot where N % 4 == 0 (a warp's 16-byte accesses are then conflict-free and a
  // pack's sums take N / 4 loads), one element per 4-byte slot otherwise.
  constexpr bool kQuads = N % 4 == 0;
  auto slot = [](int p, int i) {
    const int tid = static_cast<int>(threadIdx.x);
    return kQuads ? ((p * (N / 4) + i / 4) * BLOCK + tid) * 4 + i % 4 : (p * N + i) * BLOCK + tid;
  };
  // Elements per group of slots (G consecutive elements of a pack share one 16-byte slot where
  // kQuads), and a group's sums from their slots into registers and back.
  constexpr int G = kQuads ? 4 : 1;
  auto load_group = [&](const Acc* sums, int p, int q, Acc(&v)[G]) {
    if constexpr (kQuads) {
      const float4 f = *reinterpret_cast<const float4*>(sums + slot(p, 4 * q));
      v[0] = f.x;
      v[1] = f.y;
      v[2] = f.z;
      v[3] = f.w;
    } else {
      v[0] = sums[slot(p, q)];
    }
  };
  auto store_group = [&](Acc* sums, int p, int q, const Acc(&v)[G]) {
    if constexpr (kQuads) {
      *reinterpret_cast<float4*>(sums + slot(p, 4 * q)) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
      sums[slot(p, q)] = v[0];
    }
  };
  auto dw = [&](int p, int i) -> Acc& {
    if constexpr (kShared) {
      return sums_w[slot(p, i)];
    } else {
      return dwreg[p][i];
    }
  };
  auto db = [&](int p, int i) -> Acc& {
    if constexpr (kShared) {
      return sums_b[slot(p, i)];
    } else {
      return dbreg[p][i];
    }
  };
  // The weight of pack p (1 without one).
  auto weight = [&](int p, Acc(&wv)[N]) {
    if constexpr (kShared) {
#pragma unroll
      for (int i = 0; i < N; ++i) wv[i] = wreg[p][i];
    } else if (w != nullptr) {
      load_pack<N>(w + (t + p * TPR) * N, wv);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) wv[i] = 1;
    }
  };
#pragma unroll
  for (int p = 0; p < P; ++p) {
    if constexpr (kShared) {
      const int64_t v = t + p * TPR;
      if (w != nullptr && v < nvec) {
        load_pack<N>(w + v * N, wreg[p]);
      } else {
#pragma unroll
        for (int i = 0; i < N; ++i) wreg[p][i] = 1;
      }
    }
#pragma unroll
    for (int i = 0; i < N; ++i) dw(p, i) = db(p, i) = 0;
  }
  const int64_t step = static_cast<int64_t>(gridDim.x) * kGroups * R;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kGroups * R; base < rows; base += step) {
    // This group's R rows, row0 + j: all their loads are issued before any use, and each shared
    // sum is read and written once per R rows.
    const int64_t row0 = base + static_cast<int64_t>(g) * R;
    RawPack<T, N> xr[R][P], gr[R][P];
    Acc m[R], r[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const bool active = row0 + j < rows;
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const int64_t v = t + p * TPR;
        if (active && v < nvec) {
          xr[j][p] = *reinterpret_cast<const RawPack<T, N>*>(x + (row0 + j) * d + v * N);
          gr[j][p] = *reinterpret_cast<const RawPack<T, N>*>(dy + (row0 + j) * d + v * N);
        }
      }
      m[j] = active ? mean[row0 + j] : Acc(0);
      r[j] = active ? rstd[row0 + j] : Acc(0);
    }
    // sums[2 j] = sum of g = dy * w over row j, sums[2 j + 1] = sum of g * xh, with
    // xh = (x - mean) * rstd.
    Acc sums[2 * R];
#pragma unroll
    for (int k = 0; k < 2 * R; ++k) sums[k] = 0;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int64_t v = t + p * TPR;
      if (row0 < rows && v < nvec) {
        Acc wv[N];
        weight(p, wv);
        // One group of G elements at a time: its sums in registers only meanwhile.
#pragma unroll
        for (int q = 0; q < N / G; ++q) {
          Acc dws[G], dbs[G];
          if constexpr (kShared) {
            load_group(sums_w, p, q, dws);
            load_group(sums_b, p, q, dbs);
          } else {
#pragma unroll
            for (int e = 0; e < G; ++e) {
              dws[e] = dwreg[p][q * G + e];
              dbs[e] = dbreg[p][q * G + e];
            }
          }
#pragma unroll
          for (int j = 0; j < R; ++j) {
            if (j > 0 && row0 + j >= rows) break;
#pragma unroll
            for (int e = 0; e < G; ++e) {
              const int i = q * G + e;
              const Acc gv = raw_elem<T, N, Acc>(gr[j][p], i);
              const Acc xh = (raw_elem<T, N, Acc>(xr[j][p], i) - m[j]) * r[j];
              sums[2 * j] += gv * wv[i];
              sums[2 * j + 1] += gv * wv[i] * xh;
              dws[e] += gv * xh;
              dbs[e] += gv;
            }
          }
          if constexpr (kShared) {
            store_group(sums_w, p, q, dws);
            store_group(sums_b, p, q, dbs);
          } else {
#pragma unroll
            for (int e = 0; e < G; ++e) {
              dwreg[p][q * G + e] = dws[e];
              dbreg[p][q * G + e] = dbs[e];
            }
          }
        }
      }
    }
    group_sum<TPR>(sums, smem);  // the last barrier of the iteration
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int64_t row = row0 + j;
      if (row >= rows) break;
      const Acc a = sums[2 * j] * inv_d, k = sums[2 * j + 1] * inv_d;
      T* dr = dx + row * d;
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const int64_t v = t + p * TPR;
        if (v < nvec) {
          Acc wv[N], o[N];
          weight(p, wv);
#pragma unroll
          for (int i = 0; i < N; ++i) {
            const Acc xh = (raw_elem<T, N, Acc>(xr[j][p], i) - m[j]) * r[j];
            o[i] = r[j] * (raw_elem<T, N, Acc>(gr[j][p], i) * wv[i] - a - xh * k);
          }
          store_pack<N>(dr + v * N, o);
        }
      }
    }
  }
  add_partials<Acc, N, P, TPR, BLOCK>(part_w + blockIdx.x * d, part_b + blockIdx.x * d, dw, db,
                                      nvec);
}

// Backward for any row: one block at a time per row, looping over it; each thread owns the
// columns tid, tid + blockDim, ... of its block's partial rows and accumulates into them there.
template <typename T, typename W>
__global__ void __launch_bounds__(256)
    layer_norm_bwd_loop_kernel(T* __restrict__ dx, opmath_t<T>* __restrict__ part_w,
                               opmath_t<T>* __restrict__ part_b, const T* __restrict__ dy,
                               const T* __restrict__ x, const W* __restrict__ w,
                               const opmath_t<T>* __restrict__ mean,
                               const opmath_t<T>* __restrict__ rstd, int64_t rows, int64_t d) {
  using Acc = opmath_t<T>;
  __shared__ Acc smem[32];
  const int tid = static_cast<int>(threadIdx.x), bd = static_cast<int>(blockDim.x);
  const Acc inv_d = Acc(1) / static_cast<Acc>(d);
  Acc* pw = part_w + blockIdx.x * d;
  Acc* pb = part_b + blockIdx.x * d;
  for (int64_t j = tid; j < d; j += bd) pw[j] = pb[j] = 0;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * d;
    const T* gr = dy + row * d;
    const Acc m = mean[row], r = rstd[row];
    Acc sg = 0, sgx = 0;
    for (int64_t j = tid; j < d; j += bd) {
      const Acc gv = static_cast<Acc>(gr[j]);
      const Acc xh = (static_cast<Acc>(xr[j]) - m) * r;
      const Acc gw = w != nullptr ? gv * static_cast<Acc>(w[j]) : gv;
      sg += gw;
      sgx += gw * xh;
      pw[j] += gv * xh;
      pb[j] += gv;
    }
    const Acc a = block_sum(sg, smem) * inv_d;
    const Acc k = block_sum(sgx, smem) * inv_d;
    T* dr = dx + row * d;
    for (int64_t j = tid; j < d; j += bd) {
      const Acc gv = static_cast<Acc>(gr[j]);
      const Acc xh = (static_cast<Acc>(xr[j]) - m) * r;
      const Acc gw = w != nullptr ? gv * static_cast<Acc>(w[j]) : gv;
      dr[j] = T(r * (gw - a - xh * k));
    }
  }
}

// Blocks of `kernel` (BLOCK threads) resident at once on the device, at least one per SM: the
// backward's grid, so that every block writes its parameter partials once, at its end.
template <typename Kernel>
int64_t one_wave(Kernel kernel, int block) {
  int per_sm = 0;
  KILN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block, 0));
  return static_cast<int64_t>(loops::multiprocessor_count()) * std::max(1, per_sm);
}

// Launches the forward register kernel, TPR threads per row in blocks of BLOCK, with the smallest
// P of 1 to 16 that covers a row of d / N packs; false (nothing launched) where none does.
template <typename T, typename W, int N, int TPR, int BLOCK, bool kRangeCheck = true>
bool launch_layer_norm_fwd(T* y, opmath_t<T>* mean, opmath_t<T>* rstd, const T* x, const W* w,
                           const W* b, int64_t rows, int64_t d, opmath_t<T> eps,
                           cudaStream_t stream) {
  constexpr int kGroups = BLOCK / TPR;
  const auto grid =
      static_cast<unsigned>(std::min<int64_t>((rows + kGroups - 1) / kGroups, int64_t{1} << 30));
  auto go = [&]<int P>(std::integral_constant<int, P>) {
    layer_norm_fwd_kernel<T, W, N, P, TPR, BLOCK, kRangeCheck>
        <<<grid, BLOCK, 0, stream>>>(y, mean, rstd, x, w, b, rows, d, eps);
    KILN_CUDA_LAUNCH_CHECK("layer_norm_fwd_kernel");
  };
  return with_packs<TPR>(d / N, std::integer_sequence<int, 1, 2, 4, 8, 16>{}, go);
}

// Launches the backward register kernel, TPR threads per row in blocks of BLOCK and R rows per
// iteration (1 where a thread holds more than 2 packs: two rows of 4 packs spill), with the
// smallest P of 1, 2, 4 that covers a row, over one wave of blocks; then the column sums of its
// partials into dw and db. False (nothing launched) where no P covers a row.
template <typename T, typename W, int N, int TPR, int BLOCK, int R>
bool launch_layer_norm_bwd(T* dx, W* dw, W* db, const T* dy, const T* x, const W* w,
                           const opmath_t<T>* mean, const opmath_t<T>* rstd, int64_t rows,
                           int64_t d, Device device, cudaStream_t stream) {
  using Acc = opmath_t<T>;
  auto go = [&]<int P>(std::integral_constant<int, P>) {
    constexpr int kRows = P <= 2 ? R : 1;
    const auto kernel = layer_norm_bwd_kernel<T, W, N, P, TPR, BLOCK, kRows>;
    // One wave, so that each block's partials are written once, at its end.
    const int64_t per_iter = static_cast<int64_t>(BLOCK / TPR) * kRows;
    const int64_t nb = std::min((rows + per_iter - 1) / per_iter, one_wave(kernel, BLOCK));
    const Tensor part = empty({2, nb, d}, TensorOptions(dtype_of<Acc>()).device(device));
    Acc* pp = static_cast<Acc*>(part.data_ptr());
    kernel<<<static_cast<unsigned>(nb), BLOCK, 0, stream>>>(dx, pp, pp + nb * d, dy, x, w, mean,
                                                            rstd, rows, d);
    KILN_CUDA_LAUNCH_CHECK("layer_norm_bwd_kernel");
    launch_column_sums<Acc, W>(dw, pp, db, pp + nb * d, nb, d, stream);
  };
  return with_packs<TPR>(d / N, std::integer_sequence<int, 1, 2, 4>{}, go);
}

}  // namespace kiln::cuda::internal
