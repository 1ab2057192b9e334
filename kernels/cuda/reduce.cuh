// The CUDA kernels of the reductions (kernels/cuda/reduce.cu picks one per call from the shape of
// the [A, R, K] block; the kernel lab, benchmarks/lab/reduce_lab.cu, also runs the row kernels at
// other thread counts). Each reduces the middle dim R of a contiguous [A, R, K] block with a
// reducer of kernels/reduce_fn.h (init/step/merge/finish; merge must not depend on which side
// covers lower indices except through explicit indices, as argmax's):
//   - rows_warp_kernel (K == 1): one warp per row, lanes striding along it, a shuffle tree;
//   - rows_block_kernel (K == 1): one block per row, or per chunk of a row (partial accumulators
//     written to a workspace), a block-wide tree through shared memory;
//   - columns_kernel (K > 1): blocks of 32 columns x 8 row slices (coalesced along K), optionally
//     per chunk of R; columns_packed_kernel the same on 16-byte packs of V columns a thread, when
//     K is a multiple of V and x is 16-byte aligned;
//   - finalize_kernel, finalize_block_kernel: merge the chunks' partials of each output in a fixed
//     order (deterministic).
// Rows are read with 16-byte loads (8 bf16/f16, 4 f32) after a scalar head up to the first 16-byte
// boundary, and a scalar tail, for every reducer (argmax/argmin included: each thread meets its
// elements in increasing index order); 32-bit offsets within a row (chunk), and a 32-register cap
// for the plain sums so that a multiprocessor holds 2048 threads of loads.
// Internal to kernels/cuda/ and the kernel lab.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/check.h"
#include "kernels/cuda/loops.cuh"
#include "kernels/reduce_fn.h"

namespace kiln::cuda::internal {

inline constexpr int kReduceWarp = 32;
inline constexpr int kRowThreads = 512;      // threads of a block that reduces one (long) row
inline constexpr int kColX = 32, kColY = 8;  // the column kernel's block

using scalar::NormKind;

template <typename Red>
using red_acc_t = typename Red::acc_t;

template <typename Red>
__device__ __forceinline__ red_acc_t<Red> warp_reduce(const Red& red, red_acc_t<Red> a) {
#pragma unroll
  for (int o = kReduceWarp / 2; o > 0; o >>= 1) a = red.merge(a, loops::shfl_down(a, o));
  return a;
}

// The merged accumulator of the whole block, valid in thread 0.
template <typename Red>
__device__ __forceinline__ red_acc_t<Red> block_reduce(const Red& red, red_acc_t<Red> a) {
  using Acc = red_acc_t<Red>;
  __shared__ alignas(16) unsigned char smem[kReduceWarp * sizeof(Acc)];
  Acc* s = reinterpret_cast<Acc*>(smem);
  const int tid = threadIdx.x + threadIdx.y * blockDim.x;
  const int nthreads = blockDim.x * blockDim.y;
  const int lane = tid % kReduceWarp, warp = tid / kReduceWarp,
            nwarps = (nthreads + kReduceWarp - 1) / kReduceWarp;
  a = warp_reduce(red, a);
  if (lane == 0) s[warp] = a;
  __syncthreads();
  if (warp == 0) {
    a = lane < nwarps ? s[lane] : red.init();
    a = warp_reduce(red, a);
  }
  __syncthreads();
  return a;
}

template <typename Red>
__global__ void empty_kernel(Red red, int64_t outputs) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < outputs;
       i += step) {
    red.finish(red.init(), i);
  }
}

constexpr int kRowUnroll = 4;  // 16-byte loads each thread keeps in flight

// Steps acc over p[0, n) (the elements r0 + 0 ... r0 + n - 1 of a row; n < 2^31) as thread t of
// nt: a scalar head up to the first 16-byte boundary, then 16-byte packs (V = 16 / sizeof(T)
// elements: 8 bf16/f16, 4 f32, 2 f64), kRowUnroll of them loaded before their use, then a scalar
// tail. Offsets are 32-bit (fewer instructions per pack: the kernels are issue-bound at 16-bit
// widths), and the full rounds run without bounds checks. Each thread meets its elements in
// increasing index order, as the reducers' step expects (argmax keeps the first of equal values;
// the index r0 + e is computed only by reducers that read it).
template <typename T, typename Red>
__device__ __forceinline__ void step_range(const Red& red, red_acc_t<Red>& acc, const T* p,
                                           int64_t r0, int n, int t, int nt) {
  constexpr int V = static_cast<int>(16 / sizeof(T));
  using Vt = loops::Vec<T, V>;
  const int h = loops::head_of(p, n);
  const int nv = (n - h) / V;
  for (int e = t; e < h; e += nt) red.step(acc, p[e], r0 + e);
  const Vt* v = reinterpret_cast<const Vt*>(p + h);
  const int64_t rv = r0 + h;
  int i0 = t;
#pragma unroll 1
  for (; i0 + (kRowUnroll - 1) * nt < nv; i0 += kRowUnroll * nt) {
    Vt buf[kRowUnroll];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) buf[u] = v[i0 + u * nt];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const int64_t e = rv + static_cast<int64_t>(i0 + u * nt) * V;
#pragma unroll
      for (int j = 0; j < V; ++j) red.step(acc, buf[u].v[j], e + j);
    }
  }
  if (i0 < nv) {  // the last, partial round: its loads also issued before their use
    Vt buf[kRowUnroll];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      if (i0 + u * nt < nv) buf[u] = v[i0 + u * nt];
    }
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      if (i0 + u * nt < nv) {
        const int64_t e = rv + static_cast<int64_t>(i0 + u * nt) * V;
#pragma unroll
        for (int j = 0; j < V; ++j) red.step(acc, buf[u].v[j], e + j);
      }
    }
  }
  for (int e = h + nv * V + t; e < n; e += nt) red.step(acc, p[e], r0 + e);
}

// Register caps. At 32 registers a multiprocessor holds 2048 threads, each with kRowUnroll 16-byte
// loads in flight (128 KiB per multiprocessor); uncapped, the row kernels of the sums took 37-52
// registers, which left a quarter to a half of that (the 512-thread block of a 16-bit row sum
// fitted 3 per multiprocessor). The caps are for the reducers whose kernels fit 32 registers
// without spilling (ptxas -v, sm_90a): the plain sums (sum, mean, prod, the 0-, 1- and 2-norms)
// over elements of 2 to 8 bytes in the block kernel, of 2 bytes in the warp kernel. The others
// (extrema with indices, var, logsumexp, ...) keep the compiler's choice.
template <typename Red>
struct IsPlainSum : std::false_type {};
template <typename T, typename F>
struct IsPlainSum<scalar::SumReducer<T, F>> : std::true_type {};
template <typename T, typename F>
struct IsPlainSum<scalar::ProdReducer<T, F>> : std::true_type {};
template <typename T, typename F, NormKind kKind>
struct IsPlainSum<scalar::NormReducer<T, F, kKind>>
    : std::bool_constant<kKind == NormKind::kZero || kKind == NormKind::kOne ||
                         kKind == NormKind::kTwo> {};

template <typename T, typename Red>
inline constexpr int kReduceWarpRowMinBlocks = IsPlainSum<Red>::value && sizeof(T) == 2
                                                   ? 2048 / loops::kThreads
                                                   : 1;
template <typename T, typename Red>
inline constexpr int kRowMinBlocks = IsPlainSum<Red>::value && sizeof(T) >= 2 ? 2048 / kRowThreads
                                                                              : 1;

// One warp per row (any length below 2^31).
template <typename T, typename Red>
__global__ void __launch_bounds__(loops::kThreads, kReduceWarpRowMinBlocks<T, Red>)
    rows_warp_kernel(Red red, const T* x, int64_t A, int R) {
  const int lane = threadIdx.x % kReduceWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kReduceWarp);
  for (int64_t a = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kReduceWarp) +
                   threadIdx.x / kReduceWarp;
       a < A; a += warps) {
    red_acc_t<Red> acc = red.init();
    step_range(red, acc, x + a * R, 0, R, lane, kReduceWarp);
    acc = warp_reduce(red, acc);
    if (lane == 0) red.finish(acc, a);
  }
}

// Block (row blockIdx.x, chunk blockIdx.y of `chunk` elements, chunk < 2^31); with `partial`,
// writes the chunk's accumulator there instead of finishing. Any block size that is a multiple
// of 32 up to kRowThreads (row_threads picks it).
template <typename T, typename Red>
__global__ void __launch_bounds__(kRowThreads, kRowMinBlocks<T, Red>)
    rows_block_kernel(Red red, const T* x, int64_t R, int chunk, red_acc_t<Red>* partial,
                      int64_t outputs) {
  const int64_t a = blockIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * chunk;
  const int n = static_cast<int>(r0 + chunk < R ? chunk : R - r0);
  red_acc_t<Red> acc = red.init();
  step_range(red, acc, x + a * R + r0, r0, n, static_cast<int>(threadIdx.x),
             static_cast<int>(blockDim.x));
  acc = block_reduce(red, acc);
  if (threadIdx.x == 0) {
    if (partial != nullptr) {
      partial[static_cast<int64_t>(blockIdx.y) * outputs + a] = acc;
    } else {
      red.finish(acc, a);
    }
  }
}

template <typename T, typename Red>
__global__ void __launch_bounds__(kColX* kColY)
    columns_kernel(Red red, const T* x, int64_t A, int64_t R, int64_t K, int64_t chunk,
                   red_acc_t<Red>* partial) {
  using Acc = red_acc_t<Red>;
  __shared__ alignas(16) unsigned char smem[kColX * kColY * sizeof(Acc)];
  Acc* s = reinterpret_cast<Acc*>(smem);
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kColX + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.z) * chunk;
  const int64_t r1 = r0 + chunk < R ? r0 + chunk : R;
  const int64_t outputs = A * K;
  for (int64_t a = blockIdx.y; a < A; a += gridDim.y) {
    Acc acc = red.init();
    if (k < K) {
      const T* base = x + a * R * K + k;
      for (int64_t r = r0 + threadIdx.y; r < r1; r += kColY) red.step(acc, base[r * K], r);
    }
    s[threadIdx.y * kColX + threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && k < K) {
      for (int y = 1; y < kColY; ++y) acc = red.merge(acc, s[y * kColX + threadIdx.x]);
      if (partial != nullptr) {
        partial[static_cast<int64_t>(blockIdx.z) * outputs + a * K + k] = acc;
      } else {
        red.finish(acc, a * K + k);
      }
    }
    __syncthreads();
  }
}

// The column kernel on 16-byte packs: each thread owns V = 16 / sizeof(T) adjacent columns and
// reads one pack a row, kColUnroll packs in flight, so a block covers kColX * V columns (256 bf16,
// 128 f32). Needs K % V == 0 and a 16-byte aligned x (every row's packs are then aligned); the
// caller (reduce.cu's reduce_loop) checks both. Within a chunk, each column meets the same rows in
// the same order, and its kColY slices are merged in the same order, as in columns_kernel. The
// slices' V accumulators go through shared memory once; then each thread finishes one column.
// Reducers whose accumulators would take more than 16 KiB of shared memory (argmax and var of
// 16-bit values, for example) use columns_kernel (kColumnsPacked); this one is not instantiated
// for them.
inline constexpr int kColUnroll = 4;
template <typename T, typename Red>
inline constexpr bool kColumnsPacked = 16 % sizeof(T) == 0 && sizeof(T) <= 8 &&
                                       (16 / sizeof(T)) * kColX* kColY * sizeof(red_acc_t<Red>) <=
                                           16384;

template <typename T, typename Red>
__global__ void __launch_bounds__(kColX* kColY)
    columns_packed_kernel(Red red, const T* x, int64_t A, int64_t R, int64_t K, int64_t chunk,
                          red_acc_t<Red>* partial) {
  static_assert(kColumnsPacked<T, Red>, "columns_packed_kernel: the accumulators do not fit");
  using Acc = red_acc_t<Red>;
  constexpr int V = static_cast<int>(16 / sizeof(T));
  constexpr int kCols = kColX * V;  // columns of a block
  using Vt = loops::Vec<T, V>;
  __shared__ alignas(16) unsigned char smem[kColY * kCols * sizeof(Acc)];
  Acc* s = reinterpret_cast<Acc*>(smem);
  const int64_t kv = static_cast<int64_t>(blockIdx.x) * kColX + threadIdx.x;  // its pack
  const int64_t KV = K / V;
  const int64_t r0 = static_cast<int64_t>(blockIdx.z) * chunk;
  const int64_t r1 = r0 + chunk < R ? r0 + chunk : R;
  const int64_t outputs = A * K;
  const int tid = threadIdx.y * kColX + threadIdx.x;
  for (int64_t a = blockIdx.y; a < A; a += gridDim.y) {
    Acc acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = red.init();
    if (kv < KV) {
      const Vt* base = reinterpret_cast<const Vt*>(x + a * R * K) + kv;
      int64_t r = r0 + threadIdx.y;
#pragma unroll 1
      for (; r + (kColUnroll - 1) * kColY < r1; r += kColUnroll * kColY) {
        Vt buf[kColUnroll];
#pragma unroll
        for (int u = 0; u < kColUnroll; ++u) buf[u] = base[(r + u * kColY) * KV];
#pragma unroll
        for (int u = 0; u < kColUnroll; ++u) {
#pragma unroll
          for (int j = 0; j < V; ++j) red.step(acc[j], buf[u].v[j], r + u * kColY);
        }
      }
      for (; r < r1; r += kColY) {
        const Vt b = base[r * KV];
#pragma unroll
        for (int j = 0; j < V; ++j) red.step(acc[j], b.v[j], r);
      }
    }
#pragma unroll
    for (int j = 0; j < V; ++j) s[threadIdx.y * kCols + threadIdx.x * V + j] = acc[j];
    __syncthreads();
    for (int c = tid; c < kCols; c += kColX * kColY) {
      const int64_t k = static_cast<int64_t>(blockIdx.x) * kCols + c;
      if (k < K) {
        Acc m = s[c];
        for (int y = 1; y < kColY; ++y) m = red.merge(m, s[y * kCols + c]);
        if (partial != nullptr) {
          partial[static_cast<int64_t>(blockIdx.z) * outputs + a * K + k] = m;
        } else {
          red.finish(m, a * K + k);
        }
      }
    }
    __syncthreads();
  }
}

template <typename Red>
__global__ void finalize_kernel(Red red, const red_acc_t<Red>* partial, int64_t splits,
                                int64_t outputs) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < outputs;
       i += step) {
    red_acc_t<Red> acc = partial[i];
    for (int64_t s = 1; s < splits; ++s) acc = red.merge(acc, partial[s * outputs + i]);
    red.finish(acc, i);
  }
}

// One block per output for few outputs: a long partial list is merged by many threads (in a
// fixed order: the result does not depend on timing).
constexpr int kFinalizeThreads = 256;
template <typename Red>
__global__ void __launch_bounds__(kFinalizeThreads)
    finalize_block_kernel(Red red, const red_acc_t<Red>* partial, int64_t splits, int64_t outputs) {
  const int64_t i = blockIdx.x;
  red_acc_t<Red> acc = red.init();
  for (int64_t s = threadIdx.x; s < splits; s += blockDim.x) {
    acc = red.merge(acc, partial[s * outputs + i]);
  }
  acc = block_reduce(red, acc);
  if (threadIdx.x == 0) red.finish(acc, i);
}

// Blocks of `kernel` with `threads` threads that fit on one multiprocessor at once.
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int threads) {
  int n = 0;
  KILN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0));
  return std::max(n, 1);
}

}  // namespace kiln::cuda::internal
