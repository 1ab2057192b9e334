// The head views of a fused qkv projection, shared by split_qkv_rotary / merge_qkv_rotary's
// decompositions (tensor/ops/rotary.cpp), kernels (kernels/cpu/rotary.cpp,
// kernels/cuda/rotary.cu), backward rules (autograd/rotary_backward.cpp), the fused attention
// backward flash_attention_backward_qkv (tensor/ops/attention.cpp) and the compiler's
// fuse_qkv_rotary pass:
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

// Checks cos/sin against positions T and head size D for `op`: [T, D] with leading dims of 1, one
// dtype and shape, floating point, on `device`.
void check_rotary_tables(const char* op, const Tensor& cos, const Tensor& sin, int64_t t, int64_t d,
                         Device device);

}  // namespace kiln::internal
