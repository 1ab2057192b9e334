// The CUDA kernels of softmax and log_softmax. kernels/cuda/softmax.cu picks one per call from
// the shape; the kernel lab (benchmarks/lab/softmax_lab.cu) also runs the shared-memory kernel at
// other thread counts. Along the middle dim of a contiguous [A, R, K] block, in opmath_t (float
// for f16/bf16):
//
//   y = exp(x - m) / s   or   y = (x - m) - log(s),   m = max(x), s = sum(exp(x - m))
//
//   - softmax_warp_kernel (K == 1, short rows): one warp per row, shuffle reductions;
//   - softmax_smem_kernel (K == 1, rows that fit in shared memory): one block per row; the row is
//     read from global memory once into shared memory (bulk: on sm_90 by one bulk copy of the TMA
//     unit, the whole row in flight at once; else, or without bulk, by 16-byte loads through
//     registers), m and s come from that copy, y is written with 16-byte stores: one read and one
//     write of global memory, as a copy;
//   - softmax_online_kernel (K == 1, longer rows): one block per row, m and s in one pass (s is
//     rescaled when m grows), y in a second (two reads);
//   - softmax_columns_kernel (K > 1): one thread per column (a, k), neighbouring threads on
//     neighbouring k.
// A row of -inf gives nan, as on the CPU and in PyTorch.
// Internal to kernels/cuda/ and the kernel lab.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>

#include "kernels/cuda/check.h"
#include "kernels/cuda/fused_util.cuh"
#include "kernels/cuda/loops.cuh"

namespace kiln::cuda::internal {

namespace dm = loops::dmath;

inline constexpr int kSoftmaxWarp = 32;
inline constexpr int64_t kSoftmaxWarpRowMax = 1024;  // rows up to this length: a warp each

template <typename M>
__device__ __forceinline__ M warp_max(M v) {
#pragma unroll
  for (int o = kSoftmaxWarp / 2; o > 0; o >>= 1) {
    const M u = __shfl_xor_sync(0xffffffffu, v, o);
    v = u > v ? u : v;
  }
  return v;
}

// All threads of the block get the result. `kMax`: maximum, else sum.
template <bool kMax, typename M>
__device__ __forceinline__ M block_all_reduce(M v, M* smem) {
  const int lane = threadIdx.x % kSoftmaxWarp, warp = threadIdx.x / kSoftmaxWarp;
  const int nwarps = (blockDim.x + kSoftmaxWarp - 1) / kSoftmaxWarp;
  v = kMax ? warp_max(v) : warp_sum(v);
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (warp == 0) {
    M w = lane < nwarps ? smem[lane] : (kMax ? -std::numeric_limits<M>::infinity() : M(0));
    w = kMax ? warp_max(w) : warp_sum(w);
    if (lane == 0) smem[0] = w;
  }
  __syncthreads();
  const M r = smem[0];
  __syncthreads();
  return r;
}

// exp(x) for the values of T's rows: for f16/bf16 through exp2f, which is the hardware's ex2 (2
// ulp in float) after one multiply, an error far below the result's rounding to 16 bits and
// fewer instructions than expf (long rows are close to issue-bound otherwise); expf/exp else.
template <typename T>
__device__ __forceinline__ opmath_t<T> exp_for(opmath_t<T> x) {
  if constexpr (sizeof(T) == 2) {
    return exp2f(x * 1.4426950408889634f);
  } else {
    return dm::exp(x);
  }
}

template <typename T, bool kLog>
__device__ __forceinline__ T softmax_value(T x, opmath_t<T> m, opmath_t<T> s_or_log) {
  using M = opmath_t<T>;
  const M v = static_cast<M>(x);
  if constexpr (kLog) {
    // (x - m) - log(s), not x - (m + log(s)): m may be large next to log(s).
    return T((v - m) - s_or_log);
  } else {
    return T(exp_for<T>(v - m) * s_or_log);
  }
}

// log(s) for log_softmax, 1 / s for softmax.
template <bool kLog, typename M>
__device__ __forceinline__ M finish_sum(M s) {
  if constexpr (kLog) {
    return dm::log(s);
  } else {
    return M(1) / s;
  }
}

template <typename T, bool kLog>
__global__ void softmax_warp_kernel(const T* x, T* y, int64_t A, int64_t R) {
  using M = opmath_t<T>;
  const int lane = threadIdx.x % kSoftmaxWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kSoftmaxWarp);
  for (int64_t a = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kSoftmaxWarp) +
                   threadIdx.x / kSoftmaxWarp;
       a < A; a += warps) {
    const T* xr = x + a * R;
    T* yr = y + a * R;
    M m = -std::numeric_limits<M>::infinity();
    for (int64_t r = lane; r < R; r += kSoftmaxWarp) {
      const M v = static_cast<M>(xr[r]);
      m = v > m ? v : m;
    }
    m = warp_max(m);
    M s = 0;
    for (int64_t r = lane; r < R; r += kSoftmaxWarp) s += exp_for<T>(static_cast<M>(xr[r]) - m);
    s = finish_sum<kLog>(warp_sum(s));
    for (int64_t r = lane; r < R; r += kSoftmaxWarp) yr[r] = softmax_value<T, kLog>(xr[r], m, s);
  }
}

// --- Long rows ----------------------------------------------------------------------------------

inline constexpr int kMaxRowThreads = 1024;
inline constexpr int kSoftmaxUnroll = 4;  // 16-byte loads each thread keeps in flight
// The shared-memory kernel: at most 512 threads, capped at 40 registers so that three blocks fit a
// multiprocessor (three 64 KiB rows of 32768 bf16 fill its shared memory): 48 warps to hide the
// latency of the passes over shared memory, where 256-thread blocks gave 24. Not for f64, whose
// exp spills at 40 registers and whose rows fill shared memory at a third of the length.
inline constexpr int kSmemRowThreads = 512;
template <typename T>
inline constexpr int kSmemRowMinBlocks = sizeof(T) <= 4 ? 3 : 1;

template <typename T>
inline constexpr int kVec = static_cast<int>(16 / sizeof(T));

template <typename T>
using VecOf = loops::Vec<T, kVec<T>>;

using loops::head_of;

template <typename M>
__device__ __forceinline__ M max_of(M m, M v) {
  return v > m ? v : m;
}

// exp(x) for the sum s = sum exp(x - m) of 16-bit rows: the hardware's ex2 alone
// (ex2.approx.ftz: one instruction, where exp2f adds three to keep results below 2^-126
// subnormal). Flushing those to zero moves s by less than R * 2^-126, while s >= 1 (the maximum
// contributes exp(0)) is rounded to 2^-24: far below the summation-order rounding. The values
// written, which can be that small, keep exp_for.
template <typename T>
__device__ __forceinline__ opmath_t<T> exp_for_sum(opmath_t<T> x) {
  if constexpr (sizeof(T) == 2) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x * 1.4426950408889634f));
    return r;
  } else {
    return dm::exp(x);
  }
}

// The bulk copy (sm_90's TMA unit) of the 16-byte-aligned body of a row into shared memory,
// completing on an mbarrier: the whole row is in flight at once, without registers, where
// 16-byte loads through registers (kSoftmaxUnroll per thread) took four round trips per row.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KILN_SOFTMAX_BULK_COPY 1
#endif

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#if defined(KILN_SOFTMAX_BULK_COPY)
// Starts the copy of `bytes` (a multiple of 16; src and dst 16-byte aligned) on the barrier `bar`
// (initialised for one arrival): one thread arrives, announcing the bytes, and issues the copies.
__device__ __forceinline__ void bulk_load_start(void* dst, const void* src, uint32_t bytes,
                                                uint64_t* bar) {
  constexpr uint32_t kChunk = 16384;
  const uint32_t b = smem_address(bar);
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes)
               : "memory");
  for (uint32_t off = 0; off < bytes; off += kChunk) {
    const uint32_t n = bytes - off < kChunk ? bytes - off : kChunk;
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(smem_address(static_cast<char*>(dst) + off)),
        "l"(static_cast<const char*>(src) + off), "r"(n), "r"(b)
        : "memory");
  }
}

// Waits until phase 0 of `bar` has completed (the copy has landed and is visible).
__device__ __forceinline__ void bulk_load_wait(uint64_t* bar) {
  const uint32_t b = smem_address(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(b), "r"(0u)
        : "memory");
  } while (done == 0);
}
#endif

// One block per row, the row cached in (dynamic) shared memory: global memory is read once and
// written once with 16-byte stores. On sm_90 the row's aligned body comes in by one bulk copy
// (bulk_load_start) while the threads fetch the scalar head and tail; elsewhere by 16-byte loads
// through registers (kSoftmaxUnroll in flight per thread). Then three passes over shared memory:
// the maximum m, the sum s of exp(x - m), and y. Shared memory holds element e at row[e], with row
// shifted so that row + hx is 16-byte aligned like xr + hx (hx: the scalar head of xr). Offsets
// are 32-bit (the row fits in shared memory).
template <typename T, bool kLog>
__global__ void __launch_bounds__(kSmemRowThreads, kSmemRowMinBlocks<T>)
    softmax_smem_kernel(const T* __restrict__ x, T* __restrict__ y, int R, bool bulk) {
  using M = opmath_t<T>;
  using Vt = VecOf<T>;
  constexpr int V = kVec<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ M red[kSoftmaxWarp];
  const T* xr = x + static_cast<int64_t>(blockIdx.x) * R;
  T* yr = y + static_cast<int64_t>(blockIdx.x) * R;
  const int hx = head_of(xr, R);
  T* row = reinterpret_cast<T*>(smem_raw) + (V - hx) % V;
  const int nv = (R - hx) / V;
  const int tail = hx + nv * V;
  const int tid = threadIdx.x, nt = blockDim.x;
  const Vt* xv = reinterpret_cast<const Vt*>(xr + hx);
  Vt* sv = reinterpret_cast<Vt*>(row + hx);

  M m = -std::numeric_limits<M>::infinity();
  static_cast<void>(bulk);  // without sm_90, always the loads through registers
#if defined(KILN_SOFTMAX_BULK_COPY)
  __shared__ alignas(8) uint64_t bar;
  if (bulk) {
    if (tid == 0) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(&bar)) : "memory");
      // The initialised barrier visible to the async proxy (the copy engine) before its use.
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      if (nv > 0) bulk_load_start(sv, xv, static_cast<uint32_t>(nv) * 16u, &bar);
    }
    for (int e = tid; e < hx; e += nt) row[e] = xr[e];
    for (int e = tail + tid; e < R; e += nt) row[e] = xr[e];
    __syncthreads();  // the head and tail (and the barrier's initialisation) visible
    if (nv > 0) bulk_load_wait(&bar);
    for (int e = tid; e < hx; e += nt) m = max_of(m, static_cast<M>(row[e]));
#pragma unroll 4
    for (int i = tid; i < nv; i += nt) {
      const Vt v = sv[i];
#pragma unroll
      for (int j = 0; j < V; ++j) m = max_of(m, static_cast<M>(v.v[j]));
    }
    for (int e = tail + tid; e < R; e += nt) m = max_of(m, static_cast<M>(row[e]));
  } else  // the loads through registers
#endif
  {
    for (int e = tid; e < hx; e += nt) {
      const T v = xr[e];
      row[e] = v;
      m = max_of(m, static_cast<M>(v));
    }
    for (int i0 = tid; i0 < nv; i0 += kSoftmaxUnroll * nt) {
      Vt v[kSoftmaxUnroll];
#pragma unroll
      for (int u = 0; u < kSoftmaxUnroll; ++u) {
        const int i = i0 + u * nt;
        if (i < nv) v[u] = xv[i];
      }
#pragma unroll
      for (int u = 0; u < kSoftmaxUnroll; ++u) {
        const int i = i0 + u * nt;
        if (i < nv) {
          sv[i] = v[u];
#pragma unroll
          for (int j = 0; j < V; ++j) m = max_of(m, static_cast<M>(v[u].v[j]));
        }
      }
    }
    for (int e = tail + tid; e < R; e += nt) {
      const T v = xr[e];
      row[e] = v;
      m = max_of(m, static_cast<M>(v));
    }
  }
  m = block_all_reduce<true>(m, red);  // its barriers also publish `row`

  M s = 0;
  for (int e = tid; e < hx; e += nt) s += exp_for_sum<T>(static_cast<M>(row[e]) - m);
#pragma unroll 4
  for (int i = tid; i < nv; i += nt) {
    const Vt v = sv[i];
#pragma unroll
    for (int j = 0; j < V; ++j) s += exp_for_sum<T>(static_cast<M>(v.v[j]) - m);
  }
  for (int e = tail + tid; e < R; e += nt) s += exp_for_sum<T>(static_cast<M>(row[e]) - m);
  s = finish_sum<kLog>(block_all_reduce<false>(s, red));

  // y may be aligned differently from x (x can be a view at any element offset).
  const int hy = head_of(yr, R);
  const int nvy = (R - hy) / V;
  for (int e = tid; e < hy; e += nt) yr[e] = softmax_value<T, kLog>(row[e], m, s);
  Vt* yv = reinterpret_cast<Vt*>(yr + hy);
  if (hy == hx) {
#pragma unroll 2
    for (int i = tid; i < nvy; i += nt) {
      const Vt v = sv[i];
      Vt o;
#pragma unroll
      for (int j = 0; j < V; ++j) o.v[j] = softmax_value<T, kLog>(v.v[j], m, s);
      yv[i] = o;
    }
  } else {
    for (int i = tid; i < nvy; i += nt) {
      const T* src = row + hy + i * V;
      Vt o;
#pragma unroll
      for (int j = 0; j < V; ++j) o.v[j] = softmax_value<T, kLog>(src[j], m, s);
      yv[i] = o;
    }
  }
  for (int e = hy + nvy * V + tid; e < R; e += nt) {
    yr[e] = softmax_value<T, kLog>(row[e], m, s);
  }
}

// Online maximum and sum: (m, s) with s = sum exp(v - m) over the values seen. A +inf value
// makes s nan, as exp(inf - inf) does in the two-pass form (and on the CPU).
template <typename M>
__device__ __forceinline__ void online_step(M& m, M& s, M v) {
  constexpr M kInf = std::numeric_limits<M>::infinity();
  if (v > m) {
    s = s * dm::exp(m - v) + (v == kInf ? std::numeric_limits<M>::quiet_NaN() : M(1));
    m = v;
  } else {
    s += v == -kInf ? M(0) : dm::exp(v - m);  // -inf adds 0 (also while m is still -inf); nan, nan
  }
}

template <typename M>
__device__ __forceinline__ void online_merge(M& m, M& s, M m2, M s2) {
  const M mm = max_of(m, m2);
  const M a = m == mm ? s : s * dm::exp(m - mm);  // m == mm also covers m == mm == +-inf
  const M b = m2 == mm ? s2 : s2 * dm::exp(m2 - mm);
  m = mm;
  s = a + b;
}

// All threads of the block get the merged (m, s).
template <typename M>
__device__ __forceinline__ void block_all_reduce_online(M& m, M& s, M* sm, M* ss) {
  const int lane = threadIdx.x % kSoftmaxWarp, warp = threadIdx.x / kSoftmaxWarp;
  const int nwarps = (blockDim.x + kSoftmaxWarp - 1) / kSoftmaxWarp;
#pragma unroll
  for (int o = kSoftmaxWarp / 2; o > 0; o >>= 1) {
    const M m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const M s2 = __shfl_xor_sync(0xffffffffu, s, o);
    online_merge(m, s, m2, s2);
  }
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < nwarps ? sm[lane] : -std::numeric_limits<M>::infinity();
    s = lane < nwarps ? ss[lane] : M(0);
#pragma unroll
    for (int o = kSoftmaxWarp / 2; o > 0; o >>= 1) {
      const M m2 = __shfl_xor_sync(0xffffffffu, m, o);
      const M s2 = __shfl_xor_sync(0xffffffffu, s, o);
      online_merge(m, s, m2, s2);
    }
    if (lane == 0) {
      sm[0] = m;
      ss[0] = s;
    }
  }
  __syncthreads();
  m = sm[0];
  s = ss[0];
}

// One block per row for rows too long for shared memory: pass 1 reads the row once for m and s
// together (online), pass 2 reads it again and writes y; 16-byte accesses where x and y share
// their alignment.
template <typename T, bool kLog>
__global__ void __launch_bounds__(kMaxRowThreads)
    softmax_online_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t R) {
  using M = opmath_t<T>;
  using Vt = VecOf<T>;
  constexpr int V = kVec<T>;
  __shared__ M sm[kSoftmaxWarp], ss[kSoftmaxWarp];
  const T* xr = x + static_cast<int64_t>(blockIdx.x) * R;
  T* yr = y + static_cast<int64_t>(blockIdx.x) * R;
  const int64_t tid = threadIdx.x, nt = blockDim.x;
  const int64_t hx = head_of(xr, R);
  const bool vec = hx == head_of(yr, R);
  const int64_t h = vec ? hx : R;  // without a common alignment, everything is "head"
  const int64_t nv = (R - h) / V;
  const int64_t tail = h + nv * V;

  M m = -std::numeric_limits<M>::infinity(), s = 0;
  for (int64_t e = tid; e < h; e += nt) online_step(m, s, static_cast<M>(xr[e]));
  const Vt* xv = reinterpret_cast<const Vt*>(xr + h);
  for (int64_t i0 = tid; i0 < nv; i0 += kSoftmaxUnroll * nt) {
    Vt v[kSoftmaxUnroll];
#pragma unroll
    for (int u = 0; u < kSoftmaxUnroll; ++u) {
      const int64_t i = i0 + u * nt;
      if (i < nv) v[u] = xv[i];
    }
#pragma unroll
    for (int u = 0; u < kSoftmaxUnroll; ++u) {
      if (i0 + u * nt < nv) {
#pragma unroll
        for (int j = 0; j < V; ++j) online_step(m, s, static_cast<M>(v[u].v[j]));
      }
    }
  }
  for (int64_t e = tail + tid; e < R; e += nt) online_step(m, s, static_cast<M>(xr[e]));
  block_all_reduce_online(m, s, sm, ss);
  s = finish_sum<kLog>(s);

  for (int64_t e = tid; e < h; e += nt) yr[e] = softmax_value<T, kLog>(xr[e], m, s);
  Vt* yv = reinterpret_cast<Vt*>(yr + h);
  for (int64_t i = tid; i < nv; i += nt) {
    const Vt v = xv[i];
    Vt o;
#pragma unroll
    for (int j = 0; j < V; ++j) o.v[j] = softmax_value<T, kLog>(v.v[j], m, s);
    yv[i] = o;
  }
  for (int64_t e = tail + tid; e < R; e += nt) yr[e] = softmax_value<T, kLog>(xr[e], m, s);
}

// Dynamic shared memory a block may use on the current device (cached per device), less room
// for the kernels' static shared memory.
inline int64_t max_row_smem() {
  return std::max(loops::device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>() - 1024, 1);
}

// Lets softmax_smem_kernel<T, kLog> use all of max_row_smem() on the current device, and asks
// for the largest shared-memory carveout (the kernel does not use L1 beyond it); once per
// device, instantiation and translation unit. `static`: each binary that launches the kernel
// (libkiln, the kernel lab) has its own copy of the kernel and must set the attribute on it; a
// shared "done" flag (what an inline template's static would become across libkiln and an
// executable that includes this header) let the lab's call skip the library's, whose launch with
// more than 48 KiB of shared memory then failed with cudaErrorInvalidValue.
template <typename T, bool kLog>
static void prepare_smem_kernel() {
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> done[kMaxDevices] = {};
  int device = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= kMaxDevices) device = kMaxDevices - 1;
  if (done[device].load(std::memory_order_acquire)) return;
  KILN_CUDA_CHECK(cudaFuncSetAttribute(softmax_smem_kernel<T, kLog>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(max_row_smem())));
  KILN_CUDA_CHECK(cudaFuncSetAttribute(softmax_smem_kernel<T, kLog>,
                                       cudaFuncAttributePreferredSharedMemoryCarveout,
                                       cudaSharedmemCarveoutMaxShared));
  done[device].store(true, std::memory_order_release);
}

// Threads for a row of nv 16-byte vectors in shared memory: about 8 vectors per thread, from 128
// to kSmemRowThreads (32768 bf16: 512 threads, three blocks of 64 KiB per multiprocessor).
inline int smem_row_threads(int64_t nv) {
  const int64_t t = ((nv + 7) / 8 + kSoftmaxWarp - 1) / kSoftmaxWarp * kSoftmaxWarp;
  return static_cast<int>(std::clamp<int64_t>(t, 128, kSmemRowThreads));
}

template <typename T, bool kLog>
__global__ void softmax_columns_kernel(const T* x, T* y, int64_t A, int64_t R, int64_t K) {
  using M = opmath_t<T>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < A * K;
       i += step) {
    const int64_t a = i / K, k = i % K;
    const T* xc = x + a * R * K + k;
    T* yc = y + a * R * K + k;
    M m = -std::numeric_limits<M>::infinity();
    for (int64_t r = 0; r < R; ++r) {
      const M v = static_cast<M>(xc[r * K]);
      m = v > m ? v : m;
    }
    M s = 0;
    for (int64_t r = 0; r < R; ++r) s += exp_for<T>(static_cast<M>(xc[r * K]) - m);
    s = finish_sum<kLog>(s);
    for (int64_t r = 0; r < R; ++r) yc[r * K] = softmax_value<T, kLog>(xc[r * K], m, s);
  }
}

}  // namespace kiln::cuda::internal
