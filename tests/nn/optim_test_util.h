// What tests/nn/optim_test.cpp and optim_checkpoint_test.cpp share: an Adam or AdamW optimizer
// with the options the state_in_param_dtype tests vary.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "nn/optim/adam.h"
#include "nn/optim/adamw.h"

namespace kiln::optimtest {

inline std::unique_ptr<optim::Optimizer> make_adam(bool decoupled, std::vector<Tensor> params,
                                                   double weight_decay, bool amsgrad, bool in_param,
                                                   double beta1 = 0.8) {
  if (decoupled) {
    return std::make_unique<optim::AdamW>(std::move(params), optim::AdamWOptions(0.02)
                                                                 .betas({beta1, 0.95})
                                                                 .weight_decay(weight_decay)
                                                                 .amsgrad(amsgrad)
                                                                 .state_in_param_dtype(in_param));
  }
  return std::make_unique<optim::Adam>(std::move(params), optim::AdamOptions(0.02)
                                                              .betas({beta1, 0.95})
                                                              .weight_decay(weight_decay)
                                                              .amsgrad(amsgrad)
                                                              .state_in_param_dtype(in_param));
}

}  // namespace kiln::optimtest
