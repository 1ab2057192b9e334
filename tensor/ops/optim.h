// The call layout of the optimizer-update ops adam_update_ and sgd_update_ (tensor/ops/optim.cpp),
// decoded in one place for their meta rules, decompositions and kernels (kernels/cpu/optim.cpp,
// kernels/cuda/optim.cu). Internal to kiln's op families.
//
//   const internal::AdamUpdateCall a(call);        // the lists, hyper-parameters, lr and steps
//   for (size_t i = 0; i < a.params.size(); ++i) {
//     const internal::AdamStepScalars k = a.step_scalars(i);   // from tensor i's step count
//     ... a.params[i], a.grads[i], a.exp_avgs[i], a.exp_avg_sqs[i], k.step_size ...
//   }
//
// The learning rate and the step counts change from step to step, so they are inputs, not
// attributes: 0-d tensors (f64 lr, int64 counts) that a recorded step (kiln::compile) reads
// afresh each time it replays. sgd_update_'s lr is on the CPU. adam_update_'s lr and counts are
// all on the CPU (read on the host when the kernel is launched) or all on the parameters' device
// (read by the CUDA kernel when it runs: a CUDA graph replays them with their current values, as
// PyTorch's capturable Adam; the optimizer keeps a GPU parameter's count there). Decoding them
// reads tensor data, which a meta rule must never do (it runs on data-less proxies while
// tracing): meta rules decode with OptimDecode::kLayout, the CUDA kernel with kHostValues (the
// values of host scalars only), the CPU kernel and the decompositions with kValues (the
// default: device scalars are copied to the host, which waits for the device), which also
// checks the values (lr >= 0, counts >= 1). Decoding checks the layout (attribute types, list
// lengths); the meta rules check the tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tensor/registry.h"
#include "tensor/tensor.h"

namespace kiln::internal {

// The dtype the update computes in: f64 for f64 parameters, f32 for f32, bf16 and f16 ones (a
// call holds parameters of one dtype). The kernels compute in f32; f64 runs the decomposition.
ScalarType optim_compute_dtype(const OpCall& call);

// What a decoder reads: the layout and attributes only (meta rules), or also the values of the
// lr and step-count tensors (kernels and decompositions), or those values only when they are on
// the host (the CUDA kernel, which reads device ones on the device).
enum class OptimDecode { kValues, kLayout, kHostValues };

// The scalars of one parameter's Adam step t, derived in double as PyTorch derives them in
// Python; every kernel and the decomposition round them to the compute dtype the same way.
struct AdamStepScalars {
  double decay;      // AdamW: 1 - lr * weight_decay
  double step_size;  // lr / (1 - beta1^t)
  double bc2_sqrt;   // sqrt(1 - beta2^t)
};

// adam_update_(params[n], grads[n], exp_avgs[n], exp_avg_sqs[n], max_exp_avg_sqs[n, amsgrad
// only], state_steps[n], lr[, grad_factor]; n, beta1, beta2, eps, weight_decay,
// decoupled_weight_decay, amsgrad). The gradient factor is optional: a call without it (one
// input fewer) updates with the gradients as they are.
struct AdamUpdateCall {
  explicit AdamUpdateCall(const OpCall& call, OptimDecode decode = OptimDecode::kValues);
  AdamUpdateCall(const AdamUpdateCall&) = delete;  // steps points into this object
  AdamUpdateCall& operator=(const AdamUpdateCall&) = delete;
  AdamStepScalars step_scalars(size_t i) const;  // values decoded only

  TensorList params, grads, exp_avgs, exp_avg_sqs;
  TensorList max_exp_avg_sqs;  // empty unless amsgrad
  TensorList state_steps;      // each parameter's step count: 0-d int64 tensors
  Tensor lr_tensor;            // 0-d f64
  // The lr and the step counts are on the parameters' device, not the CPU (a GPU call: read on
  // the device). False for a call without parameters.
  bool device_scalars = false;
  // 0-d floating, on the parameters' device or the CPU; undefined when the call has none
  // (a factor of 1). Never decoded: the CUDA kernel reads a device factor on the device.
  Tensor grad_factor;
  // Decoded from state_steps (kValues, and kHostValues for host counts; else empty): each
  // parameter's step count t, already incremented (t >= 1).
  IntArrayRef steps;
  double lr;  // decoded from lr_tensor as the steps are (NaN when not decoded)
  double beta1, beta2, eps, weight_decay;
  bool decoupled_weight_decay;  // AdamW
  bool amsgrad;

 private:
  std::vector<int64_t> step_values_;  // what steps points to
};

// sgd_update_(params[n], grads[n], momentum_buffers[n, momentum != 0 only], lr; n, momentum,
// dampening, weight_decay, nesterov, new_buffers[n, momentum != 0 only]).
struct SgdUpdateCall {
  explicit SgdUpdateCall(const OpCall& call, OptimDecode decode = OptimDecode::kValues);

  TensorList params, grads;
  TensorList momentum_buffers;  // empty when momentum == 0
  Tensor lr_tensor;             // 0-d f64 CPU
  IntArrayRef new_buffers;      // 1: the buffer is new and takes the gradient; 0: it carries over
  double lr;                    // decoded from lr_tensor (kValues; NaN for kLayout)
  double momentum, dampening, weight_decay;
  bool nesterov;
};

}  // namespace kiln::internal

namespace kiln {

// adam_update_ (tensor/ops.h) with a gradient factor: when defined (a 0-d floating tensor on the
// parameters' device or the CPU), it multiplies every gradient as the update reads it, with the
// bits of foreach_mul_(grads, grad_factor) before the call; the grads are not written (gradient
// clipping folded into the update). Undefined: the plain call. Declared here rather than as a
// default argument in tensor/ops.h, which nearly every file includes.
void adam_update_(TensorList params, TensorList grads, TensorList exp_avgs, TensorList exp_avg_sqs,
                  TensorList max_exp_avg_sqs, TensorList state_steps, const Tensor& lr,
                  double beta1, double beta2, double weight_decay, double eps, bool amsgrad,
                  bool decoupled_weight_decay, const Tensor& grad_factor);

}  // namespace kiln
