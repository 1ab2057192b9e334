// Mixed precision: autocast, as torch.autocast.
//
//   {
//     kiln::AutocastGuard guard(kiln::kCUDA, kiln::kBFloat16);  // or (kiln::kCPU, kBFloat16)
//     Tensor logits = model->forward(x);   // matmuls in bf16, norms and softmax in f32
//     Tensor loss = F::cross_entropy(logits, y);  // f32
//   }
//   loss.backward();  // gradients reach the f32 parameters in f32
//
// While a guard for a device type is enabled, every registry op whose inputs are on that
// device type runs under one of these policies (the lists follow PyTorch's autocast op
// reference):
//   - lower precision: mm, bmm, addmm (so matmul, linear, conv and attention's matmuls) cast
//     their f32/f16/bf16 inputs to the autocast dtype.
//   - f32: softmax, log_softmax, rms_norm, layer_norm, reductions (sum, mean, prod, var, std,
//     norm, logsumexp, cumsum) and pointwise ops that lose accuracy in low precision (exp, log,
//     log1p, expm1, rsqrt, reciprocal, pow) cast f16/bf16 inputs to f32, so their results are
//     f32. Composite norms and losses (F::layer_norm, F::rms_norm, F::cross_entropy, ...)
//     follow from their parts, and F::layer_norm / F::rms_norm return f32 under autocast.
//   - promote: cat, where, lerp, atan2, maximum, minimum, scatter_add, index_add and the fused
//     recurrent cells (lstm_cell_fused, gru_cell_fused: low-precision gates from addmm meet the
//     f32 cell state) cast their floating inputs to the widest floating dtype among them.
//   - everything else runs on its inputs as they are (kiln's binary ops promote by
//     themselves: a bf16 matmul result plus an f32 residual is f32).
// f64 and non-floating inputs are never cast; ops given an explicit dtype attribute (softmax
// with a dtype, sum with a dtype) and in-place ops are not autocast. The casts are ordinary
// to() ops recorded by autograd, so gradients flow back through them in the inputs' dtypes.
// The fused cross-entropy op already reads low-precision logits with f32 arithmetic and
// returns an f32 loss, so it runs as it is (casting would materialise an f32 copy of the
// logits).
//
// Guards are thread-local and nest: an inner guard (another dtype, or enabled=false to run a
// region in full precision) is undone when it goes out of scope. The state is per device
// type: a kCUDA guard does not change ops on CPU tensors.
//
// bf16-true training (every parameter bf16, no autocast): module->to(kBFloat16); the Adam and
// AdamW optimizers keep their moments in f32 for bf16 parameters (see nn/optim/adam.h).
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>
#include <vector>

#include "tensor/autocast_state.h"  // is_autocast_enabled, autocast_dtype
#include "tensor/device.h"
#include "tensor/dtype.h"
#include "tensor/registry.h"

namespace kiln {

class AutocastGuard {
 public:
  // Autocast to `dtype` (kBFloat16 or kFloat16) for ops on `device` tensors while the guard
  // lives; enabled=false turns autocast off for the scope instead.
  AutocastGuard(DeviceType device, ScalarType dtype = kBFloat16, bool enabled = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  DeviceType device_;
  bool prev_enabled_;
  ScalarType prev_dtype_;
};

// is_autocast_enabled(device) and autocast_dtype(device) (tensor/autocast_state.h) read the
// state the guards set.

namespace internal {
// The ops of the policy table above, by name (for tests).
std::vector<std::string_view> autocast_policy_ops();
// Builds the policy table if no guard has yet (resolving every name to its registry entry; a
// name without a defined op is a kiln::Error) and returns its number of ops.
size_t resolved_autocast_policies();

// One input of a call as the policy sees it (defined = false: an absent optional input).
struct AutocastInput {
  bool defined = false;
  ScalarType dtype = kFloat;
  DeviceType device = kCPU;
};
// The policy for one call of `op`, autocast being on at `dtype` for the call's device type (that
// of its first defined input; the caller checks it is on): per input, the dtype autocast casts
// it to with to(), or nullopt where it stays as it is (no entry at all when the op runs as it
// is). The dispatch handler and the compiler's autocast pass (compiler/autocast_pass.h) both
// apply it, so the two cannot disagree.
std::vector<std::optional<ScalarType>> autocast_input_casts(
    const OpDef& op, const std::vector<AutocastInput>& inputs,
    const absl::InlinedVector<Attr, 4>& attrs, ScalarType dtype);
}  // namespace internal

}  // namespace kiln
