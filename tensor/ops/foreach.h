// The call layout of the multi-tensor ops foreach_norm and foreach_mul_ (tensor/ops/foreach.cpp),
// decoded in one place for their meta rules, decompositions and kernels (kernels/cpu/foreach.cpp,
// kernels/cuda/foreach.cu), and their kernels' one support rule. Internal to kiln's op families.
//
//   const internal::ForeachMulCall m(call);   // m.tensors (the list), m.scale (0-d)
//   if (!internal::foreach_supported(call)) ...  // (the dispatcher asks, not the kernels)
#pragma once

#include "tensor/registry.h"
#include "tensor/tensor.h"

namespace kiln::internal {

// foreach_norm(tensors[n]; n, ord).
struct ForeachNormCall {
  explicit ForeachNormCall(const OpCall& call);
  TensorList tensors;
  double ord;
};

// foreach_mul_(tensors[n], scale; n).
struct ForeachMulCall {
  explicit ForeachMulCall(const OpCall& call);
  TensorList tensors;
  Tensor scale;  // 0-d, floating; on the tensors' device or a CPU tensor
};

// The dtype of foreach_norm's results for tensors of `dtype`: f64 for f64, f32 otherwise (f32,
// bf16, f16), the dtype the CPU's norm kernel accumulates in rounded once: foreach_norm(t)[0] is
// t.to(kFloat).norm(ord), which t.norm(ord) rounds to t's dtype.
ScalarType foreach_norm_result_dtype(ScalarType dtype);

// The kernels' rule, for both ops and both devices: every tensor of the list is contiguous; for
// foreach_mul_, also no 0-d tensor whose product with the scale has a wider dtype than its own
// (t.mul_(s) of a 0-d bf16 t and a 0-d f64 s computes in f64: the decomposition runs it). Other
// calls run the decomposition.
bool foreach_supported(const OpCall& call);

}  // namespace kiln::internal
