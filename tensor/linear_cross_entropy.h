// The LM head and its cross-entropy in one op that never holds the logits whole: kiln's form of
// Liger's fused linear cross-entropy (and of the chunked loss torch.compile users write by hand).
//
//   // x [N, C] final hidden states, weight [V, C] the LM head (or the tied embedding table),
//   // targets [N] int64: the mean cross-entropy of x @ weight^T, as
//   // cross_entropy_fused(linear(x, weight), targets, ignore_index).
//   Tensor loss = kiln::linear_cross_entropy(x, weight, targets);
//   loss.backward();                       // x.grad() and weight.grad() as through the logits
//
// The logits are computed a chunk of rows at a time (about 512 MiB of them), each chunk's loss
// and, when x or weight require grad, its gradient dlogits = (softmax - onehot) / count right
// away; dlogits then gives the chunk's dx and its share of dweight and is freed.
// The forward therefore does the backward's work too, and backward only scales the stored dx
// and dweight by the loss's gradient: no matmul is recomputed. llama-3.2-1b's [8192, 128256]
// bf16 logits are 2 GiB, and their gradient as much again.
//
// Pitfalls: the mean over the targets that are not ignore_index (NaN when all are, as
// cross_entropy); no class weights or label smoothing (use F::cross_entropy on the logits); no
// double backward (the stored gradients are constants); under autocast the op runs in the
// lower precision, as linear does. Op: tensor/ops/linear_cross_entropy.cpp; kernel (chunks of
// registry ops, for every device): kernels/linear_cross_entropy.cpp; backward rule:
// autograd/linear_cross_entropy_backward.cpp; tests: tests/tensor/linear_cross_entropy_test.cpp.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace kiln {

Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& targets,
                            int64_t ignore_index = -100);

}  // namespace kiln
