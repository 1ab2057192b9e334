// Multi-tensor ops, as libtorch's torch::_foreach_*: one call for a whole list of tensors (a
// model's gradients), run by one multi-tensor kernel where a plain loop over the tensors would
// launch one or more kernels per tensor.
//
//   std::vector<Tensor> norms = kiln::foreach_norm(grads);        // one 0-d norm per gradient
//   Tensor total = kiln::stack(norms).to(kFloat64).norm();
//   kiln::foreach_mul_(grads, (max_norm / (total + 1e-6)).clamp_max(1.0));  // no host sync
//
// foreach_norm(tensors, ord) returns t.norm(ord) of every tensor, as 0-d tensors on their device:
// f64 for f64 tensors, f32 for f32, bf16 and f16 ones (for a 16-bit t, the f32 value that
// t.norm(ord) rounds to t's dtype; the CPU accumulates in f64 and gives t.to(kFloat).norm(ord)
// bit for bit, the GPU accumulates in f32, as the norm kernels do).
// foreach_mul_(tensors, scale) does t.mul_(scale) for every tensor, with the same bits: scale is
// a 0-d floating tensor, on the tensors' device (read there: nothing waits for the GPU) or on the
// CPU, read in the tensors' arithmetic type (f32 for bf16/f16 tensors).
//
// Pitfalls: one call takes floating tensors of one dtype on one device (split a mixed list with
// foreach_groups first); the kernels take contiguous tensors and the others are run one by one
// (t.norm, t.mul_), with the same results. Neither op has a gradient: call them under
// NoGradGuard on tensors that do not require grad. Ops: tensor/ops/foreach.cpp.
#pragma once

#include <vector>

#include "tensor/tensor.h"

namespace kiln {

std::vector<Tensor> foreach_norm(TensorList tensors, double ord = 2.0);
void foreach_mul_(TensorList tensors, const Tensor& scale);

// `tensors` split into lists of one dtype and device, each in the order of the input, the lists
// in the order of their first tensor: what one foreach call takes.
std::vector<std::vector<Tensor>> foreach_groups(TensorList tensors);

}  // namespace kiln
