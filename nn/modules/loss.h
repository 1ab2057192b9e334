// Loss modules: the functional losses (nn/functional.h) with their options held, as
// torch::nn::MSELoss and friends. forward(input, target) returns the loss.
//
//   kiln::nn::CrossEntropyLoss criterion(
//       kiln::nn::CrossEntropyLossOptions().ignore_index(0).label_smoothing(0.1));
//   auto loss = criterion(logits, labels);
//
// Class weights (and BCEWithLogitsLoss's pos_weight) given in the options are registered as
// buffers named "weight" / "pos_weight", so to() moves them with the module.
#pragma once

#include <ostream>

#include "nn/functional.h"
#include "nn/module.h"

namespace kiln::nn {

using MSELossOptions = functional::MSELossFuncOptions;
using L1LossOptions = functional::L1LossFuncOptions;
using SmoothL1LossOptions = functional::SmoothL1LossFuncOptions;
using NLLLossOptions = functional::NLLLossFuncOptions;
using CrossEntropyLossOptions = functional::CrossEntropyFuncOptions;
using BCELossOptions = functional::BinaryCrossEntropyFuncOptions;
using BCEWithLogitsLossOptions = functional::BinaryCrossEntropyWithLogitsFuncOptions;
using KLDivLossOptions = functional::KLDivFuncOptions;

#define KILN_DECLARE_LOSS(Name)                                             \
  class Name##Impl : public Module {                                        \
   public:                                                                  \
    explicit Name##Impl(Name##Options options = {});                        \
    Tensor forward(const Tensor& input, const Tensor& target);              \
    void pretty_print(std::ostream& stream) const override;                 \
    std::shared_ptr<Module> clone(                                          \
        const std::optional<Device>& device = std::nullopt) const override; \
                                                                            \
    Name##Options options;                                                  \
  };                                                                        \
  KILN_MODULE(Name)

KILN_DECLARE_LOSS(MSELoss);
KILN_DECLARE_LOSS(L1Loss);
KILN_DECLARE_LOSS(SmoothL1Loss);
KILN_DECLARE_LOSS(NLLLoss);
KILN_DECLARE_LOSS(CrossEntropyLoss);
KILN_DECLARE_LOSS(BCELoss);
KILN_DECLARE_LOSS(BCEWithLogitsLoss);
KILN_DECLARE_LOSS(KLDivLoss);

#undef KILN_DECLARE_LOSS

}  // namespace kiln::nn
