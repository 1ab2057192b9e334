// Hooks that run after a leaf's gradient has been accumulated, as PyTorch's
// Tensor.register_post_accumulate_grad_hook:
//
//   auto h = kiln::autograd::register_post_accumulate_grad_hook(w, [](const kiln::Tensor& p) {
//     std::cout << p.grad() << "\n";       // the gradient accumulated so far, this pass included
//   });
//   loss.backward();
//   kiln::autograd::remove_post_accumulate_grad_hook(w, h);
//
// The hook gets the leaf itself (not the incoming gradient) once per backward pass that reaches
// it, after grad() has been updated; it may read grad() or write it in place (DDP copies it into
// its buckets and writes the averaged gradient back). Hooks run in registration order, on the
// thread running the backward pass.
#pragma once

#include <functional>

#include "tensor/tensor.h"

namespace kiln::autograd {

// `leaf` must be a leaf that requires grad. Returns a handle for the removal.
unsigned register_post_accumulate_grad_hook(const Tensor& leaf,
                                            std::function<void(const Tensor&)> hook);
// False when `handle` was not registered on `leaf` (or was removed already).
bool remove_post_accumulate_grad_hook(const Tensor& leaf, unsigned handle);

}  // namespace kiln::autograd
