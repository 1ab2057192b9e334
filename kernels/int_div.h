// Division of non-negative 32-bit indices by a divisor fixed before a kernel launch, as one
// multiply-high, one add and one shift (the round-up method of Granlund and Montgomery, "Division
// by invariant integers using multiplication", 1994). GPUs have no integer divide instruction: a
// 32-bit `/` or `%` by a runtime value costs about twenty instructions, which made the index
// arithmetic of strided kernels (kernels/cuda/loops.cuh, kernels/cuda/rotary.cu) the busiest
// pipe of memory-bound loops.
//
//   const IntDivider rows(n_cols);                // on the host; 1 <= divisor <= 2^31
//   uint32_t q, r;
//   rows.divmod(i, q, r);                         // q = i / n_cols, r = i % n_cols, i < 2^31
//
// __host__ __device__ under nvcc (the host side is what tests/kernels/int_div_test.cpp checks),
// plain inline under the host compiler. Internal to kernels/.
#pragma once

#include <cstdint>

#include "kernels/scalar_fn.h"  // KILN_SCALAR_HD
#include "tensor/error.h"

namespace kiln::internal {

struct IntDivider {
  uint32_t divisor = 1;
  uint32_t multiplier = 0;  // ceil(2^(32 + shift) / divisor) - 2^32
  uint32_t shift = 0;       // ceil(log2(divisor))

  IntDivider() = default;
  explicit IntDivider(int64_t d) {
    KILN_CHECK(d >= 1 && d <= (int64_t{1} << 31), "[IntDivider] divisor ", d,
               " out of range [1, 2^31]");
    divisor = static_cast<uint32_t>(d);
    while ((uint64_t{1} << shift) < divisor) ++shift;
    multiplier = static_cast<uint32_t>(
        (uint64_t{1} << 32) * ((uint64_t{1} << shift) - divisor) / divisor + 1);
  }

  // n / divisor for n < 2^31 (the sum below then stays under 2^32).
  KILN_SCALAR_HD uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(n, multiplier);
#else
    const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(n) * multiplier) >> 32);
#endif
    return (hi + n) >> shift;
  }

  KILN_SCALAR_HD void divmod(uint32_t n, uint32_t& q, uint32_t& r) const {
    q = div(n);
    r = n - q * divisor;
  }
};

}  // namespace kiln::internal
