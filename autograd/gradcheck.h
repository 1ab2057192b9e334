// Gradient checks: compare autograd's gradients with central finite differences.
//
//   auto x = kiln::randn({3, 4}, kiln::dtype(kiln::kFloat64).requires_grad(true));
//   kiln::autograd::gradcheck([](const auto& in) { return in[0].tanh(); }, {x});
//   kiln::autograd::gradgradcheck([](const auto& in) { return in[0].tanh(); }, {x});
//
// Inputs should be float64. gradcheck builds the full Jacobian both ways (one backward per
// output element, two evaluations per input element), so keep tensors small. On mismatch it
// throws kiln::Error naming the input, the element and both values.
#pragma once

#include <functional>

#include "autograd/engine.h"

namespace kiln::autograd {

struct GradcheckOptions {
  double eps = 1e-6;
  double atol = 1e-5;
  double rtol = 1e-3;
};

using GradcheckFn = std::function<Tensor(const variable_list&)>;

// Checks d fn(inputs) / d inputs for every input that requires grad. Returns true or throws.
bool gradcheck(const GradcheckFn& fn, const variable_list& inputs,
               const GradcheckOptions& options = {});

// Checks the second derivative: gradcheck of the vector-Jacobian product
// (inputs, v) -> grad(fn(inputs), inputs, v, create_graph=true).
bool gradgradcheck(const GradcheckFn& fn, const variable_list& inputs,
                   const GradcheckOptions& options = {});

}  // namespace kiln::autograd
