// Stable row sorting on the device (CUB radix sorts), shared by sort/topk (kernels/cuda/sort.cu),
// multinomial and randperm (kernels/cuda/random.cu) and index_put_ (kernels/cuda/index_adv.cu).
//
//   // keys: rows * size unsigned keys in device memory, row after row
//   Tensor pos = internal::sort_positions(keys, sizeof(uint32_t), rows, size, false, device);
//   // pos (kInt32 when size fits, else kInt64): pos[r * size + j] is the column of row r's
//   // j-th smallest key; equal keys keep their order
//
// Values are sorted through order-preserving unsigned keys (ordered_key): the unsigned order
// of the keys is the order kernels/cpu/sort.cpp sorts in: NaN above every number (all NaNs
// equal), -0.0 equal to +0.0, signed integers by value. Internal to kernels/cuda/.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/loops.cuh"

namespace kiln::cuda::internal {

// Sorts each row of keys (key_bytes = 1, 2, 4 or 8 bytes each) stably, ascending or
// descending, and returns the sorted columns (see above). Runs on the current stream.
// `key_bits` > 0: a single row's keys (rows == 1) are below 2^key_bits, and only those low bits
// are sorted on (one radix pass per 8 bits instead of one per key byte).
Tensor sort_positions(const void* keys, int key_bytes, int64_t rows, int64_t size, bool descending,
                      Device device, int key_bits = 0);

// Uninitialised device memory of `bytes` bytes, as a tensor that owns it.
inline Tensor device_bytes(int64_t bytes, Device device) {
  return loops::empty_on({std::max<int64_t>((bytes + 7) / 8, 1)}, kInt64, device);
}

// --- Order-preserving keys ---------------------------------------------------------------------

// A float's bits (of width B) made unsigned-ordered: NaN -> all ones, -0.0 -> +0.0, negative
// numbers bit-flipped, positive ones with the sign bit set.
template <typename B>
__device__ __forceinline__ B float_bits_key(B bits, bool nan, bool zero) {
  constexpr B kSign = B(1) << (sizeof(B) * 8 - 1);
  if (nan) return static_cast<B>(~B(0));
  if (zero) bits = 0;
  return (bits & kSign) ? static_cast<B>(~bits) : static_cast<B>(bits | kSign);
}

__device__ __forceinline__ uint8_t ordered_key(bool v) { return v ? 1 : 0; }
__device__ __forceinline__ uint8_t ordered_key(uint8_t v) { return v; }
__device__ __forceinline__ uint32_t ordered_key(int32_t v) {
  return static_cast<uint32_t>(v) ^ 0x80000000u;
}
__device__ __forceinline__ uint64_t ordered_key(int64_t v) {
  return static_cast<uint64_t>(v) ^ 0x8000000000000000ull;
}
__device__ __forceinline__ uint32_t ordered_key(float v) {
  return float_bits_key<uint32_t>(__float_as_uint(v), v != v, v == 0.0f);
}
__device__ __forceinline__ uint64_t ordered_key(double v) {
  return float_bits_key<uint64_t>(static_cast<uint64_t>(__double_as_longlong(v)), v != v, v == 0.0);
}
// 16-bit floats straight from their bits (exponent all ones with a mantissa: NaN).
__device__ __forceinline__ uint16_t ordered_key(Half v) {
  const unsigned magnitude = v.x & 0x7fffu;
  return float_bits_key<uint16_t>(v.x, magnitude > 0x7c00u, magnitude == 0);
}
__device__ __forceinline__ uint16_t ordered_key(BFloat16 v) {
  const unsigned magnitude = v.x & 0x7fffu;
  return float_bits_key<uint16_t>(v.x, magnitude > 0x7f80u, magnitude == 0);
}

// The unsigned key type of T.
template <typename T>
using KeyOf = decltype(ordered_key(T()));

}  // namespace kiln::cuda::internal
