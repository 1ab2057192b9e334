// Helpers shared by the CUDA indexing kernels (kernels/cuda/index.cu, index_adv.cu, sort.cu):
// dispatch on an element's width or an index dtype, and atomic accumulation in every dtype.
//
//   internal::visit_bytes(t.dtype(), [&]<typename U>(TypeTag<U>) { /* move U-sized words */ });
//   internal::atomic_accumulate<T>(out + offset, static_cast<opmath_t<T>>(value));
//
// Internal to kernels/cuda/.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/loops.cuh"

namespace kiln::cuda::internal {

// Calls f(TypeTag<U>) with an unsigned integer type as wide as one element of `dtype`.
template <typename F>
inline void visit_bytes(ScalarType dtype, F&& f) {
  switch (element_size(dtype)) {
    case 1:
      return f(TypeTag<uint8_t>{});
    case 2:
      return f(TypeTag<uint16_t>{});
    case 4:
      return f(TypeTag<uint32_t>{});
    case 8:
      return f(TypeTag<uint64_t>{});
    default:
      KILN_FAIL("[index] unsupported element size ", element_size(dtype));
  }
}

template <typename F>
inline void visit_index(ScalarType dtype, F&& f) {
  if (dtype == kInt32) return f(TypeTag<int32_t>{});
  return f(TypeTag<int64_t>{});
}

// *p = T(M(*p) + add) atomically, the CPU's add_values with alpha folded into `add` (for bool:
// *p = *p || add).
template <typename T>
__device__ __forceinline__ void atomic_accumulate(T* p, opmath_t<T> add) {
  if constexpr (std::is_same_v<T, bool>) {
    if (add) *p = true;  // every writer stores the same value
  } else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    atomicAdd(p, add);
  } else if constexpr (std::is_same_v<T, int32_t>) {
    atomicAdd(reinterpret_cast<int*>(p), static_cast<int>(add));
  } else if constexpr (std::is_same_v<T, int64_t>) {
    atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(add));
  } else if constexpr (std::is_same_v<T, uint8_t>) {
    // uint8 (no byte atomics): a compare-and-swap loop on the aligned 32-bit word holding the
    // byte; the sum wraps modulo 256, as the CPU's.
    const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
    unsigned int* word = reinterpret_cast<unsigned int*>(addr & ~uintptr_t{3});
    const unsigned int shift = static_cast<unsigned int>(addr & 3) * 8u;
    unsigned int old = *word, assumed;
    do {
      assumed = old;
      const unsigned int next = ((assumed >> shift) + static_cast<unsigned int>(add)) & 0xffu;
      old = atomicCAS(word, assumed, (assumed & ~(0xffu << shift)) | (next << shift));
    } while (old != assumed);
  } else {
    // Half, BFloat16: a compare-and-swap loop on the aligned 32-bit word holding the element,
    // rounding M(old) + add once, as the CPU does.
    const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
    unsigned int* word = reinterpret_cast<unsigned int*>(addr & ~uintptr_t{3});
    const unsigned int shift = (addr & 2) ? 16u : 0u;
    unsigned int old = *word, assumed;
    do {
      assumed = old;
      const T cur = T::from_bits(static_cast<uint16_t>((assumed >> shift) & 0xffffu));
      const T next = T(static_cast<float>(cur) + add);
      const unsigned int updated =
          (assumed & ~(0xffffu << shift)) | (static_cast<unsigned int>(next.x) << shift);
      old = atomicCAS(word, assumed, updated);
    } while (old != assumed);
  }
}

}  // namespace kiln::cuda::internal
