// The reducer of foreach_norm (tensor/ops/foreach.cpp), shared by its CPU kernel
// (kernels/cpu/foreach.cpp, on the CPU's reduction loop) and its CUDA kernel
// (kernels/cuda/foreach.cu): norm's reducer (kernels/reduce_fn.h), whose fold it keeps, finishing
// into the op's result type O (f32 for f32/bf16/f16 tensors, f64 for f64) instead of the tensor's.
//
//   const ForeachNormReducer<BFloat16, double, float, NormKind::kTwo> red{{nullptr, 2.0}, out};
//   cpu::reduce_loop<BFloat16>(red, x, 1, numel, 1);   // *out: the norm, rounded once to f32
//
// Internal to kernels/.
#pragma once

#include <cstdint>

#include "kernels/reduce_fn.h"

namespace kiln::scalar {

// A norm accumulator finished (NormReducer::finish before its rounding to T).
template <NormKind kKind, typename F>
KILN_SCALAR_HD F norm_value(F a, F p) {
  if constexpr (kKind == NormKind::kTwo) {
    return math::sqrt(a);
  } else if constexpr (kKind == NormKind::kGeneral) {
    return math::pow(a, F(1) / p);
  } else {
    return a;
  }
}

// NormReducer<T, F, kKind>'s init, step and merge (its `out` unused); finish writes result[i] in
// O. For O = float this is the value t.to(kFloat).norm(p) stores: the same accumulator rounded
// once, which t.norm(p) rounds again to a 16-bit t's dtype.
template <typename T, typename F, typename O, NormKind kKind>
struct ForeachNormReducer : NormReducer<T, F, kKind> {
  O* result;
  KILN_SCALAR_HD void finish(F a, int64_t i) const {
    result[i] = static_cast<O>(norm_value<kKind>(a, this->p));
  }
};

}  // namespace kiln::scalar
