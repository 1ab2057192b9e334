// CUDA kernels of softmax and log_softmax (CPU: kernels/cpu/softmax.cpp): y = exp(x - m) / s and
// y = (x - m) - log(s), with m the maximum along the dim and s = sum exp(x - m), in opmath_t
// (float for f16/bf16). The input is a contiguous [A, R, K] block with the softmax dim in the
// middle:
//   - K == 1 and R <= 1024: one warp per row (shuffle reductions for m and s);
//   - K == 1, longer rows: one block per row (warp shuffles, then shared memory);
//   - K > 1: one thread per column (a, k), neighbouring threads on neighbouring k.
// A row of -inf gives nan, as on the CPU and in PyTorch.
#include <limits>

#include "kernels/cuda/loops.cuh"

namespace kiln::cuda {
namespace {

namespace dm = loops::dmath;

constexpr int kWarp = 32;
constexpr int kBlockRowThreads = 512;
constexpr int64_t kWarpRowMax = 1024;

template <typename M>
__device__ __forceinline__ M warp_max(M v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const M u = __shfl_xor_sync(0xffffffffu, v, o);
    v = u > v ? u : v;
  }
  return v;
}

template <typename M>
__device__ __forceinline__ M warp_sum(M v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// All threads of the block get the result. `kMax`: maximum, else sum.
template <bool kMax, typename M>
__device__ __forceinline__ M block_all_reduce(M v, M* smem) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int nwarps = (blockDim.x + kWarp - 1) / kWarp;
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

template <typename T, bool kLog>
__device__ __forceinline__ T softmax_value(T x, opmath_t<T> m, opmath_t<T> s_or_log) {
  using M = opmath_t<T>;
  const M v = static_cast<M>(x);
  if constexpr (kLog) {
    // (x - m) - log(s), not x - (m + log(s)): m may be large next to log(s).
    return T((v - m) - s_or_log);
  } else {
    return T(dm::exp(v - m) * s_or_log);
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
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t a = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
       a < A; a += warps) {
    const T* xr = x + a * R;
    T* yr = y + a * R;
    M m = -std::numeric_limits<M>::infinity();
    for (int64_t r = lane; r < R; r += kWarp) {
      const M v = static_cast<M>(xr[r]);
      m = v > m ? v : m;
    }
    m = warp_max(m);
    M s = 0;
    for (int64_t r = lane; r < R; r += kWarp) s += dm::exp(static_cast<M>(xr[r]) - m);
    s = finish_sum<kLog>(warp_sum(s));
    for (int64_t r = lane; r < R; r += kWarp) yr[r] = softmax_value<T, kLog>(xr[r], m, s);
  }
}

template <typename T, bool kLog>
__global__ void __launch_bounds__(kBlockRowThreads)
    softmax_block_kernel(const T* x, T* y, int64_t R) {
  using M = opmath_t<T>;
  __shared__ M smem[kWarp];
  const int64_t a = blockIdx.x;
  const T* xr = x + a * R;
  T* yr = y + a * R;
  M m = -std::numeric_limits<M>::infinity();
  for (int64_t r = threadIdx.x; r < R; r += blockDim.x) {
    const M v = static_cast<M>(xr[r]);
    m = v > m ? v : m;
  }
  m = block_all_reduce<true>(m, smem);
  M s = 0;
  for (int64_t r = threadIdx.x; r < R; r += blockDim.x) s += dm::exp(static_cast<M>(xr[r]) - m);
  s = finish_sum<kLog>(block_all_reduce<false>(s, smem));
  for (int64_t r = threadIdx.x; r < R; r += blockDim.x) yr[r] = softmax_value<T, kLog>(xr[r], m, s);
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
    for (int64_t r = 0; r < R; ++r) s += dm::exp(static_cast<M>(xc[r * K]) - m);
    s = finish_sum<kLog>(s);
    for (int64_t r = 0; r < R; ++r) yc[r * K] = softmax_value<T, kLog>(xc[r * K], m, s);
  }
}

template <bool kLog>
void softmax_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  if (out.numel() == 0) return;
  DeviceGuard guard(out.device().index());
  const Tensor x = loops::as_dtype(c.input(0), out.dtype()).contiguous();
  const int64_t dim = wrap_dim(c.attr<int64_t>(0), x.dim(), c.name().c_str());
  const int64_t R = x.dim() == 0 ? 1 : x.sizes()[dim];
  const int64_t K = x.dim() == 0 ? 1 : numel_of(x.sizes().subspan(dim + 1));
  const int64_t A = x.numel() / (R * K);
  const cudaStream_t stream = current_stream();
  visit_floating(out.dtype(), c.name(), [&]<typename T>(TypeTag<T>) {
    const T* in = static_cast<const T*>(x.data_ptr());
    T* o = static_cast<T*>(out.data_ptr());
    if (K == 1 && R <= kWarpRowMax) {
      softmax_warp_kernel<T, kLog>
          <<<loops::grid_for(A, loops::kThreads / kWarp), loops::kThreads, 0, stream>>>(in, o, A,
                                                                                        R);
      KILN_CUDA_LAUNCH_CHECK("softmax_warp_kernel");
    } else if (K == 1) {
      KILN_CHECK(A < (int64_t{1} << 31), "[", c.name(), "] too many rows for the CUDA kernel: ", A);
      softmax_block_kernel<T, kLog>
          <<<static_cast<unsigned>(A), kBlockRowThreads, 0, stream>>>(in, o, R);
      KILN_CUDA_LAUNCH_CHECK("softmax_block_kernel");
    } else {
      softmax_columns_kernel<T, kLog>
          <<<loops::grid_for(A * K), loops::kThreads, 0, stream>>>(in, o, A, R, K);
      KILN_CUDA_LAUNCH_CHECK("softmax_columns_kernel");
    }
  });
}

}  // namespace

KILN_REGISTER_KERNEL(softmax, kCUDA, softmax_cuda<false>);
KILN_REGISTER_KERNEL(log_softmax, kCUDA, softmax_cuda<true>);

}  // namespace kiln::cuda
