// The softmax CUDA kernels (kernels/cuda/softmax.cu) behind a launcher that takes the row load of
// the shared-memory kernel as an explicit choice. The ops pass kBulk: one bulk copy (the TMA unit)
// per row where the code runs on sm_90 or later, else 16-byte loads through registers. kRegisters
// takes the loads through registers on every GPU: the path of GPUs before sm_90, which the tests
// reach on Hopper through it.
//
//   kiln::cuda::internal::softmax_forward(x, -1, /*log=*/false, out, SoftmaxRowLoad::kRegisters);
//
// Includes no CUDA header. Internal to kiln.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace kiln::cuda::internal {

enum class SoftmaxRowLoad { kBulk, kRegisters };

// softmax (log_softmax where `log`) of x along `dim` into out (x's shape, contiguous, of a
// floating dtype that x is converted to first), on one GPU.
void softmax_forward(const Tensor& x, int64_t dim, bool log, const Tensor& out,
                     SoftmaxRowLoad load = SoftmaxRowLoad::kBulk);

}  // namespace kiln::cuda::internal
