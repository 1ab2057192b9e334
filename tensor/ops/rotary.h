// The head views of a fused qkv projection, shared by split_qkv_rotary / merge_qkv_rotary's
// decompositions (tensor/ops/rotary.cpp), kernels (kernels/cpu/rotary.cpp,
// kernels/cuda/rotary.cu) and backward rules (autograd/rotary_backward.cpp):
//
//   Tensor k = internal::qkv_heads(qkv, H, G, H + 2 * G);   // [..., G, T, D] view of k's heads
//
// qkv is [..., T, total * D] (any strides: splitting its last dim is always a view).
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace kiln::internal {

// The [..., heads, T, D] view of heads [first, first + heads) of qkv.
inline Tensor qkv_heads(const Tensor& qkv, int64_t first, int64_t heads, int64_t total) {
  return qkv.unflatten(-1, {total, qkv.size(-1) / total})
      .narrow(-2, first, heads)
      .transpose(-3, -2);
}

}  // namespace kiln::internal
