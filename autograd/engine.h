// The autograd engine: runs the graph backwards from some outputs.
//
//   loss.backward();                                       // grads into the leaves' grad()
//   auto g = kiln::autograd::grad({y}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
//
// Execution is iterative (no recursion: a chain of 100,000 ops is fine), dependency-counted
// (a node runs once all gradients for its outputs have arrived) and, among ready nodes, the
// most recently created runs first. Saved tensors are freed as each node finishes unless the
// graph is retained. Independent graphs can run backward on different threads at once.
#pragma once

#include <optional>
#include <vector>

#include "autograd/node.h"

namespace kiln::autograd {

// Accumulates d(sum_i <outputs[i], grad_outputs[i]>)/d(leaf) into each leaf's grad() (or only
// into `inputs` when given). An undefined grad_output means ones for a one-element output.
void backward(const variable_list& outputs, const variable_list& grad_outputs = {},
              std::optional<bool> retain_graph = std::nullopt, bool create_graph = false,
              const variable_list& inputs = {});

// Returns d(sum_i <outputs[i], grad_outputs[i]>)/d(inputs[j]) for each input, without touching
// grad(). allow_unused: an input the outputs do not depend on gets an undefined tensor instead
// of an error.
variable_list grad(const variable_list& outputs, const variable_list& inputs,
                   const variable_list& grad_outputs = {},
                   std::optional<bool> retain_graph = std::nullopt, bool create_graph = false,
                   bool allow_unused = false);

}  // namespace kiln::autograd
