// A kernel for any device made of an op's decomposition (tensor/registry.h), for a fused op where
// its device has no fused kernel, or as a fused kernel's fallback (mm_with_bias_grad and
// addmm_activation where cuBLASLt has no algorithm, kernels/cuda/linalg.cu).
#pragma once

#include "tensor/registry.h"

namespace kiln {

// Writes the op's decomposition into the call's outputs, its ops off the caller's graph (no
// autograd). Fails for an op without a decomposition.
void decomposition_kernel(OpCall& call);

}  // namespace kiln
