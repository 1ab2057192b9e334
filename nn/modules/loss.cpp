// Loss modules.
#include "nn/modules/loss.h"

namespace kiln::nn {

namespace {

// Registers `t` (possibly undefined) as the buffer `name`. The options keep a handle to the same
// tensor, and to() converts buffers in place, so forward() sees the moved weights.
void register_weight(Module& m, const char* name, Tensor& t) { t = m.register_buffer(name, t); }

// The options with their weight tensors (which alias this module's buffers) replaced by copies,
// so that a clone's buffers are its own.
template <typename Options>
Options fresh_weights(Options options) {
  auto copy = [](const Tensor& t) { return t.defined() ? t.detach().clone() : Tensor(); };
  if constexpr (requires { options.weight(); }) options.weight(copy(options.weight()));
  if constexpr (requires { options.pos_weight(); }) options.pos_weight(copy(options.pos_weight()));
  return options;
}

}  // namespace

#define KILN_LOSS_BASICS(Name, call)                                                               \
  Tensor Name##Impl::forward(const Tensor& input, const Tensor& target) {                          \
    return functional::call(input, target, options);                                               \
  }                                                                                                \
  void Name##Impl::pretty_print(std::ostream& stream) const { stream << "kiln::nn::" #Name "()"; } \
  std::shared_ptr<Module> Name##Impl::clone(const std::optional<Device>& device) const {           \
    return internal::clone_layer(*this, std::make_shared<Name##Impl>(fresh_weights(options)),      \
                                 device);                                                          \
  }

MSELossImpl::MSELossImpl(MSELossOptions options_) : options(std::move(options_)) {}
KILN_LOSS_BASICS(MSELoss, mse_loss)

L1LossImpl::L1LossImpl(L1LossOptions options_) : options(std::move(options_)) {}
KILN_LOSS_BASICS(L1Loss, l1_loss)

SmoothL1LossImpl::SmoothL1LossImpl(SmoothL1LossOptions options_) : options(std::move(options_)) {
  KILN_CHECK(options.beta() >= 0, "[SmoothL1Loss] beta must be non-negative, got ", options.beta());
}
KILN_LOSS_BASICS(SmoothL1Loss, smooth_l1_loss)

NLLLossImpl::NLLLossImpl(NLLLossOptions options_) : options(std::move(options_)) {
  register_weight(*this, "weight", options.weight());
}
KILN_LOSS_BASICS(NLLLoss, nll_loss)

CrossEntropyLossImpl::CrossEntropyLossImpl(CrossEntropyLossOptions options_)
    : options(std::move(options_)) {
  KILN_CHECK(options.label_smoothing() >= 0 && options.label_smoothing() <= 1,
             "[CrossEntropyLoss] label_smoothing must be within [0, 1], got ",
             options.label_smoothing());
  register_weight(*this, "weight", options.weight());
}
KILN_LOSS_BASICS(CrossEntropyLoss, cross_entropy)

BCELossImpl::BCELossImpl(BCELossOptions options_) : options(std::move(options_)) {
  register_weight(*this, "weight", options.weight());
}
KILN_LOSS_BASICS(BCELoss, binary_cross_entropy)

BCEWithLogitsLossImpl::BCEWithLogitsLossImpl(BCEWithLogitsLossOptions options_)
    : options(std::move(options_)) {
  register_weight(*this, "weight", options.weight());
  register_weight(*this, "pos_weight", options.pos_weight());
}
KILN_LOSS_BASICS(BCEWithLogitsLoss, binary_cross_entropy_with_logits)

KLDivLossImpl::KLDivLossImpl(KLDivLossOptions options_) : options(std::move(options_)) {}
KILN_LOSS_BASICS(KLDivLoss, kl_div)

#undef KILN_LOSS_BASICS

}  // namespace kiln::nn
