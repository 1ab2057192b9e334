// Device helpers shared by kiln's fused CUDA kernels (norm.cu, cross_entropy.cu): 16-byte
// packed loads and stores, and block-wide sums. Internal to kernels/cuda/.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "tensor/dtype.h"
#include "tensor/half.h"

namespace kiln::cuda::internal {

// N elements of T moved as one aligned access (16 bytes for N * sizeof(T) == 16).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// A 16-byte pack kept as its raw words (uint4) where N * sizeof(T) == 16, else as Pack<T, N>.
// Raw words are not default-initialised (BFloat16 and Half members are zeroed on default
// construction, which costs an instruction per element where a pack is loaded conditionally),
// and raw_elem widens an element straight from its word (one shift or mask for bf16) instead of
// first unpacking every 16-bit element into a register of its own.
template <typename T, int N>
using RawPack = std::conditional_t<sizeof(T) * N == 16, uint4, Pack<T, N>>;

// Element i (a compile-time index after unrolling) of raw pack r, as Acc (T's opmath type).
template <typename T, int N, typename Acc>
__device__ __forceinline__ Acc raw_elem(const RawPack<T, N>& r, int i) {
  if constexpr (sizeof(T) * N == 16 && sizeof(T) == 2) {
    const uint32_t w = reinterpret_cast<const uint32_t*>(&r)[i / 2];
    if constexpr (std::is_same_v<T, BFloat16>) {
      return __uint_as_float(i % 2 == 0 ? w << 16 : w & 0xffff0000u);
    } else {
      return static_cast<Acc>(T::from_bits(static_cast<uint16_t>(i % 2 == 0 ? w : w >> 16)));
    }
  } else if constexpr (sizeof(T) * N == 16) {  // f32, f64
    return static_cast<Acc>(reinterpret_cast<const T*>(&r)[i]);
  } else {
    return static_cast<Acc>(r.v[i]);
  }
}

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

// io[i] += p[i] for a pack of N elements at p (a residual added before the rounding).
template <int N, typename T, typename Acc>
__device__ __forceinline__ void add_pack(Acc (&io)[N], const T* p) {
  Acc v[N];
  load_pack<N>(p, v);
#pragma unroll
  for (int i = 0; i < N; ++i) io[i] += v[i];
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
