// The multi-tensor Adam/AdamW launcher behind adam_update_'s CUDA kernel (kernels/cuda/optim.cu):
// one launch updates many parameters of one device and dtype.
//
//   std::vector<kiln::cuda::internal::AdamTensor> ts = ...;  // one entry per parameter
//   kiln::cuda::internal::multi_tensor_adam(kBFloat16, /*state_dtype=*/kFloat, /*device=*/0, ts,
//                                           hyper);
//
// Internal to kiln's kernels (and their tests): the library calls the op, kiln::adam_update_
// (tensor/ops.h). Includes no CUDA header.
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/dtype.h"

namespace kiln::cuda::internal {

// One parameter of an Adam/AdamW step: contiguous param and grad of the batch's dtype, state
// of the batch's state dtype (f32, or the parameter's dtype) of the same numel, and the
// per-parameter scalars that depend on its step count: derived on the host (neg_step_size,
// bc2_sqrt), or, with AdamHyper::lr set, on the device from the count at `step`.
struct AdamTensor {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* max_exp_avg_sq;  // null unless amsgrad
  int64_t numel;
  float neg_step_size;  // -lr / (1 - beta1^t)
  float bc2_sqrt;       // sqrt(1 - beta2^t)
  // The step count t (already incremented) in device memory, read when the kernel runs (with
  // AdamHyper::lr; the scalars above are then unused).
  const int64_t* step = nullptr;
};

// The scalars shared by a call, as float: the CPU kernel's (kernels/cpu/optim.cpp).
struct AdamHyper {
  float decay;  // 1 - lr * weight_decay (decoupled)
  float wd;     // weight_decay (L2, Adam)
  float w1;     // 1 - beta1
  float b2;     // beta2
  float w2;     // 1 - beta2
  float eps;
  bool decoupled;  // AdamW
  bool amsgrad;
  // The gradient factor (adam_update_'s optional input), when `scaled`: each gradient g becomes
  // T(g * s), s the factor as f32 and T the grad's dtype (foreach_mul_'s product). s is read on
  // the device from `grad_factor` (a 0-d tensor of grad_factor_dtype, f64, f32, bf16 or f16), by
  // every thread once, or is host_grad_factor when grad_factor is null (a CPU factor).
  bool scaled = false;
  const void* grad_factor = nullptr;
  ScalarType grad_factor_dtype = kFloat;
  float host_grad_factor = 1.0f;
  // Device scalars (capturable: a CUDA graph replays them with their current values): the lr, an
  // f64 in device memory, and every tensor's step count (AdamTensor::step). One thread per block
  // derives decay, -lr / (1 - beta1^t) and sqrt(1 - beta2^t) from them in f64, each operation
  // rounded as the host's (no FMA), with CUDA's f64 pow (within 2 ulp of the host's, see
  // optim.cu); `decay` above and the tensors' host scalars are then unused. Null: host scalars.
  const double* lr = nullptr;
  double beta1 = 0, beta2 = 0, weight_decay = 0;  // as f64, for the device derivation
};

// Updates every tensor of `tensors` (all on cuda:`device`, parameters and grads of
// `param_dtype`: f32, bf16 or f16; state of `state_dtype`: f32 or `param_dtype`) with the
// arithmetic of the CPU kernel in f32, each value rounded once when stored, on the current
// stream, in ceil(count / kMaxTensorsPerLaunch) launches.
void multi_tensor_adam(ScalarType param_dtype, ScalarType state_dtype, int device,
                       const std::vector<AdamTensor>& tensors, const AdamHyper& hyper);

}  // namespace kiln::cuda::internal
