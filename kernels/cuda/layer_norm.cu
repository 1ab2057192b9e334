// CUDA kernels of layer_norm and layer_norm_backward (tensor/ops/norm.cpp; reference:
// kernels/cpu/norm.cpp). Arithmetic in f32 for f16/bf16 (f64 for f64).
//
// Forward: a group of TPR threads per row (one warp for rows under 2048 elements, else 128
// threads, or 512 for very long rows), every thread holding P 16-byte packs of its row in
// registers: x is read once, the mean and then the variance about it are two passes over the
// registers (no E[x^2] - E[x]^2 cancellation), y is written once.
// Backward: the same row groups (one warp under 2048 elements, else 256 threads per row, or 512)
// over a grid of one wave of blocks, each group looping over rows with a fixed thread -> column
// mapping, so that every thread accumulates dweight and dbias of its columns in f32 across all
// the rows of its group (in private shared-memory slots, with the weight in registers, where
// they fit: kSumsInShared; else in registers). A group of 256 threads takes two rows per
// iteration where a thread holds at most 2 packs (both rows' loads in flight together, one
// exchange of the four row sums, one update of the shared sums; KILN_LAYERNORM_BWD, see
// bwd_rows()). x and dy are read once; dx is written per row from the registers. Packs stay
// raw 16-byte words in registers (RawPack) and each element is widened where it is used. The
// groups of a block add their sums into the block's partial row in group order; the per-block
// partials [grid, D] are then summed by column in a second small kernel, in a fixed order
// (deterministic, no atomics). KILN_LAYERNORM_THREADS (32, 128, 256 or 512; cached, see
// threads_switch()) forces the threads per row of both passes where the row fits, for timing
// side by side (benchmarks/gpu). Rows whose length or pointers do not
// allow 16-byte packs run the same kernels with packs of one element. Rows too long for the
// register kernels, and f64, take block-per-row kernels that loop over the row (x is read three
// times forward, twice backward; L1/L2 serve the repeats).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <type_traits>
#include <utility>

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
using internal::Pack;
using internal::packable;
using internal::raw_elem;
using internal::RawPack;
using internal::rsqrt_of;
using internal::store_pack;
using internal::visit_x_weight;
using internal::warp_sum;
using loops::multiprocessor_count;

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

// Register cap of the forward register kernel (as resident blocks per SM for
// __launch_bounds__): a memory-bound kernel needs many rows in flight, and without a cap the
// compiler keeps f32 copies of the row (125 registers at 4 packs: 4 resident blocks). Up to 4
// packs: 64 registers. The backward's caps are below its kernel (kBwdMinBlocks).
template <int P, int BLOCK>
constexpr int kFwdMinBlocks = P <= 4 ? 65536 / (BLOCK * 64) : 1;

// Forward for rows of at most TPR * P packs of N elements: groups of TPR threads, one row per
// group at a time, BLOCK / TPR groups per block. The loop is uniform over the block (rows past
// the end are masked) so that group_sum's barriers are safe. w and b may be null (1 and 0).
template <typename T, typename W, int N, int P, int TPR, int BLOCK>
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
    const Acc m = s[0] * inv_d;
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
    const Acc r = rsqrt_of(ss[0] * inv_d + eps);
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
    const Acc m = block_sum(s, smem) * inv_d;
    Acc ss = 0;
    for (int64_t j = tid; j < d; j += bd) {
      const Acc c = static_cast<Acc>(xr[j]) - m;
      ss += c * c;
    }
    const Acc r = rsqrt_of(block_sum(ss, smem) * inv_d + eps);
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

// The smallest P of `Ps` (ascending) with TPR * P >= nvec; calls f(integral_constant<P>) and
// returns true, or returns false where none is large enough.
template <int TPR, int... Ps, typename F>
bool with_packs(int64_t nvec, std::integer_sequence<int, Ps...>, F&& f) {
  bool done = false;
  ((!done && nvec <= static_cast<int64_t>(TPR) * Ps
        ? (f(std::integral_constant<int, Ps>{}), done = true)
        : false),
   ...);
  return done;
}

// KILN_LAYERNORM_THREADS (cached; reload_env_switches() after a setenv): the threads per row of
// the register kernels, forward and backward, for timing side by side; unset: the default of
// threads_per_row. A value whose packs do not fit (or a warp for a row too long) falls back to
// the default.
int threads_switch() {
  static const kiln::internal::EnvChoice choice("KILN_LAYERNORM_THREADS",
                                                {"32", "128", "256", "512"});
  constexpr int kThreads[] = {32, 128, 256, 512};
  const int i = choice.get();
  return i < 0 ? 0 : kThreads[i];
}

// KILN_LAYERNORM_BWD (cached; reload_env_switches() after a setenv): the rows each group of the
// backward register kernel takes per iteration, "rows1" or "rows2", for timing side by side;
// rows of more than 2 packs per thread always take one (two would spill). Unset: two for
// 256-thread groups (1.07x at 32768 x 4096, 1.14x at 8192 x 2048 bf16 on the H200; at 512
// threads two rows were slower: benchmarks/RESULTS.md), else one. Returns the rows, 0 where
// unset.
int bwd_rows() {
  static const kiln::internal::EnvChoice choice("KILN_LAYERNORM_BWD", {"rows1", "rows2"});
  return choice.get() + 1;
}

// Threads per row of the register kernels: a warp for rows under 2048 elements whose packs fit
// `max_p` per lane (several rows per block), then `long_rows` threads (forward 128, backward 256:
// the RMSNorm and LayerNorm measurements in benchmarks/RESULTS.md), then 512; 0: too long for
// the register kernels. KILN_LAYERNORM_THREADS overrides where its value fits.
int threads_per_row(int64_t d, int64_t nvec, int max_p, int long_rows) {
  const int forced = threads_switch();
  if (forced > 0 && nvec <= static_cast<int64_t>(forced) * max_p) return forced;
  if (d < 2048 && nvec <= 32 * max_p) return 32;
  if (nvec <= static_cast<int64_t>(long_rows) * max_p) return long_rows;
  if (nvec <= 512 * max_p) return 512;
  return 0;
}

// Calls go(integral_constant<TPR>, integral_constant<BLOCK>) for the threads per row `tpr` of
// threads_per_row: a warp in 256-thread blocks, 128 threads in blocks of kBlock128, 256 and 512
// alone in their blocks; false (nothing launched) for 0.
template <int kBlock128, typename F>
bool with_row_threads(int tpr, F&& go) {
  switch (tpr) {
    case 32:
      return go(std::integral_constant<int, 32>{}, std::integral_constant<int, 256>{});
    case 128:
      return go(std::integral_constant<int, 128>{}, std::integral_constant<int, kBlock128>{});
    case 256:
      return go(std::integral_constant<int, 256>{}, std::integral_constant<int, 256>{});
    case 512:
      return go(std::integral_constant<int, 512>{}, std::integral_constant<int, 512>{});
    default:
      return false;
  }
}

// Blocks of `kernel` (BLOCK threads) resident at once on the device, at least one per SM: the
// backward's grid, so that every block writes its parameter partials once, at its end.
template <typename Kernel>
int64_t one_wave(Kernel kernel, int block) {
  int per_sm = 0;
  KILN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block, 0));
  return static_cast<int64_t>(multiprocessor_count()) * std::max(1, per_sm);
}

void layer_norm_cuda(OpCall& c) {
  const Tensor x = c.input(0).contiguous();
  const Tensor w = c.input(1).defined() ? c.input(1).contiguous() : Tensor();
  const Tensor b = c.input(2).defined() ? c.input(2).contiguous() : Tensor();
  const Tensor& y = c.outputs[0];
  const Tensor& mean = c.outputs[1];
  const Tensor& rstd = c.outputs[2];
  const int64_t rows = mean.numel();
  if (rows == 0) return;
  const int64_t d = x.numel() / rows;
  DeviceGuard guard(x.device().index());
  const cudaStream_t stream = current_stream();
  const ScalarType pt = w.defined() ? w.dtype() : b.defined() ? b.dtype() : x.dtype();
  visit_x_weight("layer_norm", x.dtype(), pt, [&]<typename T, typename W>(TypeTag<T>, TypeTag<W>) {
    using Acc = opmath_t<T>;
    const Acc eps = static_cast<Acc>(c.attr<double>(1));
    T* py = static_cast<T*>(y.data_ptr());
    Acc* pm = static_cast<Acc*>(mean.data_ptr());
    Acc* pr = static_cast<Acc*>(rstd.data_ptr());
    const T* px = static_cast<const T*>(x.data_ptr());
    const W* pw = w.defined() ? static_cast<const W*>(w.data_ptr()) : nullptr;
    const W* pb = b.defined() ? static_cast<const W*>(b.data_ptr()) : nullptr;
    if constexpr (!std::is_same_v<T, double>) {
      constexpr int kPack = 16 / sizeof(T);
      const bool packed = packable<T, W>(d, {px, py}, {pw, pb});
      auto run = [&]<int N>(std::integral_constant<int, N>) {
        const int64_t nvec = d / N;
        const int tpr = d == 0 ? 0 : threads_per_row(d, nvec, 16, 128);
        auto go = [&]<int TPR, int BLOCK>(std::integral_constant<int, TPR>,
                                          std::integral_constant<int, BLOCK>) {
          constexpr int kGroups = BLOCK / TPR;
          const unsigned grid = static_cast<unsigned>(
              std::min<int64_t>((rows + kGroups - 1) / kGroups, int64_t{1} << 30));
          return with_packs<TPR>(nvec, std::integer_sequence<int, 1, 2, 4, 8, 16>{},
                                 [&]<int P>(std::integral_constant<int, P>) {
                                   layer_norm_fwd_kernel<T, W, N, P, TPR, BLOCK>
                                       <<<grid, BLOCK, 0, stream>>>(py, pm, pr, px, pw, pb, rows, d,
                                                                    eps);
                                   KILN_CUDA_LAUNCH_CHECK("layer_norm_fwd_kernel");
                                 });
        };
        return with_row_threads<128>(tpr, go);
      };
      if (packed ? run(std::integral_constant<int, kPack>{})
                 : run(std::integral_constant<int, 1>{})) {
        return;
      }
    }
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, int64_t{1} << 20));
    layer_norm_fwd_loop_kernel<T, W>
        <<<grid, 256, 0, stream>>>(py, pm, pr, px, pw, pb, rows, d, eps);
    KILN_CUDA_LAUNCH_CHECK("layer_norm_fwd_loop_kernel");
  });
}

void layer_norm_backward_cuda(OpCall& c) {
  const Tensor dy = c.input(0).contiguous();
  const Tensor x = c.input(1).contiguous();
  const Tensor w = c.input(2).defined() ? c.input(2).contiguous() : Tensor();
  const Tensor mean = c.input(3).contiguous();
  const Tensor rstd = c.input(4).contiguous();
  const Tensor& dx = c.outputs[0];
  const Tensor& dw = c.outputs[1];
  const Tensor& db = c.outputs[2];
  const int64_t d = dw.numel(), rows = rstd.numel();
  if (d == 0) return;
  DeviceGuard guard(x.device().index());
  const cudaStream_t stream = current_stream();
  if (rows == 0) {
    KILN_CUDA_CHECK(cudaMemsetAsync(dw.data_ptr(), 0, dw.nbytes(), stream));
    KILN_CUDA_CHECK(cudaMemsetAsync(db.data_ptr(), 0, db.nbytes(), stream));
    return;
  }
  visit_x_weight(
      "layer_norm", x.dtype(), dw.dtype(), [&]<typename T, typename W>(TypeTag<T>, TypeTag<W>) {
        using Acc = opmath_t<T>;
        T* pdx = static_cast<T*>(dx.data_ptr());
        const T* pdy = static_cast<const T*>(dy.data_ptr());
        const T* px = static_cast<const T*>(x.data_ptr());
        const W* pw = w.defined() ? static_cast<const W*>(w.data_ptr()) : nullptr;
        const Acc* pm = static_cast<const Acc*>(mean.data_ptr());
        const Acc* pr = static_cast<const Acc*>(rstd.data_ptr());
        // Sums the per-block partials [nb, d] into dweight and dbias.
        auto column_sums = [&](const Tensor& part, int64_t nb) {
          const Acc* p = static_cast<const Acc*>(part.data_ptr());
          launch_column_sums<Acc, W>(static_cast<W*>(dw.data_ptr()), p,
                                     static_cast<W*>(db.data_ptr()), p + nb * d, nb, d, stream);
        };
        auto partials = [&](int64_t nb) {
          return empty({2, nb, d}, TensorOptions(dtype_of<Acc>()).device(x.device()));
        };
        // Launches kernel_of(R) for the rows per iteration of bwd_rows() (or the default) and
        // sums its partials.
        auto launch_rows = [&](auto kernel_of, int block, int groups, int packs) {
          auto go = [&](auto kernel, int r) {
            // One wave, so that each block's partials are written once, at its end.
            const int64_t per_iter = static_cast<int64_t>(groups) * r;
            const int64_t nb = std::min((rows + per_iter - 1) / per_iter, one_wave(kernel, block));
            const Tensor part = partials(nb);
            Acc* pp = static_cast<Acc*>(part.data_ptr());
            kernel<<<static_cast<unsigned>(nb), block, 0, stream>>>(pdx, pp, pp + nb * d, pdy, px,
                                                                    pw, pm, pr, rows, d);
            KILN_CUDA_LAUNCH_CHECK("layer_norm_bwd_kernel");
            column_sums(part, nb);
          };
          int r = bwd_rows();
          if (r == 0) r = groups == 1 && block == 256 ? 2 : 1;
          if (packs > 2) r = 1;  // two rows of 3-4 packs per thread would spill
          if (r == 2) return go(kernel_of(std::integral_constant<int, 2>{}), 2);
          return go(kernel_of(std::integral_constant<int, 1>{}), 1);
        };
        if constexpr (!std::is_same_v<T, double>) {
          constexpr int kPack = 16 / sizeof(T);
          const bool packed = packable<T, W>(d, {px, pdy, pdx}, {pw});
          auto run = [&]<int N>(std::integral_constant<int, N>) {
            const int64_t nvec = d / N;
            auto go = [&]<int TPR, int BLOCK>(std::integral_constant<int, TPR>,
                                              std::integral_constant<int, BLOCK>) {
              constexpr int kGroups = BLOCK / TPR;
              return with_packs<TPR>(nvec, std::integer_sequence<int, 1, 2, 4>{},
                                     [&]<int P>(std::integral_constant<int, P>) {
                                       launch_rows(
                                           [&]<int R>(std::integral_constant<int, R>) {
                                             return layer_norm_bwd_kernel < T, W, N, P, TPR, BLOCK,
                                                    P <= 2 ? R : 1 > ;
                                           },
                                           BLOCK, kGroups, P);
                                     });
            };
            return with_row_threads<256>(threads_per_row(d, nvec, 4, 256), go);
          };
          if (packed ? run(std::integral_constant<int, kPack>{})
                     : run(std::integral_constant<int, 1>{})) {
            return;
          }
        }
        const int64_t nb =
            std::min<int64_t>(rows, static_cast<int64_t>(multiprocessor_count()) * 8);
        const Tensor part = partials(nb);
        Acc* pp = static_cast<Acc*>(part.data_ptr());
        layer_norm_bwd_loop_kernel<T, W><<<static_cast<unsigned>(nb), 256, 0, stream>>>(
            pdx, pp, pp + nb * d, pdy, px, pw, pm, pr, rows, d);
        KILN_CUDA_LAUNCH_CHECK("layer_norm_bwd_loop_kernel");
        column_sums(part, nb);
      });
}

}  // namespace

KILN_REGISTER_KERNEL_IF(layer_norm, kCUDA, "fused", layer_norm_cuda, layer_norm_supported);
KILN_REGISTER_KERNEL(layer_norm_backward, kCUDA, layer_norm_backward_cuda);

}  // namespace kiln::cuda
