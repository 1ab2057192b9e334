// Device helpers shared by kiln's fused CUDA kernels (norm.cu, cross_entropy.cu): 16-byte
// packed loads and stores, and block-wide sums. Internal to kernels/cuda/.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tensor/dtype.h"

namespace kiln::cuda::internal {

// N elements of T moved as one aligned access (16 bytes for N * sizeof(T) == 16).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int N, typename T, typename Acc>
__device__ __forceinline__ void load_pack(const T* p, Acc (&out)[N]) {
  const Pack<T, N> pk = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = static_cast<Acc>(pk.v[i]);
}

template <int N, typename T, typename Acc>
__device__ __forceinline__ void store_pack(T* p, const Acc (&in)[N]) {
  Pack<T, N> pk;
#pragma unroll
  for (int i = 0; i < N; ++i) pk.v[i] = T(in[i]);
  *reinterpret_cast<Pack<T, N>*>(p) = pk;
}

// Whether p can be accessed in packs of `bytes`.
inline bool aligned_to(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

template <typename Acc>
__device__ __forceinline__ Acc warp_sum(Acc v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// The sum of v over the block, returned to every thread. blockDim.x is a multiple of 32;
// `smem` holds 32 values and may be reused by the next call (the leading barrier protects it).
template <typename Acc>
__device__ __forceinline__ Acc block_sum(Acc v, Acc* smem) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  const int warps = static_cast<int>(blockDim.x >> 5);
  return warp_sum(lane < warps ? smem[lane] : Acc(0));
}

}  // namespace kiln::cuda::internal
