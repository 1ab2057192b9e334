// AutogradMeta: the autograd state of one tensor (its gradient, the node that produced it,
// hooks), hung off TensorImpl. Internal to autograd/.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "autograd/node.h"

namespace kiln::autograd {

struct AutogradMeta {
  Tensor grad;
  std::shared_ptr<Node> grad_fn;  // null for leaves
  std::weak_ptr<Node> grad_accumulator;
  uint32_t output_nr = 0;
  bool retains_grad = false;
  bool is_view = false;  // made by a view op while recording: in-place writes are refused
  unsigned retain_grad_hook = 0;
  // Hooks of a leaf (run by its AccumulateGrad before accumulating).
  struct LeafHook {
    unsigned handle;
    std::function<Tensor(const Tensor&)> fn;
  };
  std::vector<LeafHook> leaf_hooks;
  // Hooks of a leaf run after its AccumulateGrad has updated grad (autograd/hooks.h).
  struct PostAccumulateHook {
    unsigned handle;
    std::function<void(const Tensor&)> fn;
  };
  std::vector<PostAccumulateHook> post_accumulate_hooks;
  std::mutex mu;  // guards grad when several backward passes accumulate into one leaf
};

namespace internal {
// The meta of `t`, created if absent.
AutogradMeta& meta(const Tensor& t);
AutogradMeta* meta_or_null(const Tensor& t);
AutogradMeta* meta_or_null(const TensorImpl* t);
// Where a gradient for `t` goes: its grad_fn's input slot, or its leaf accumulator (created on
// demand); invalid for tensors that do not require grad.
Edge gradient_edge(const Tensor& t);
// Makes `t` an output (number `nr`) of `node`.
void set_history(const Tensor& t, const std::shared_ptr<Node>& node, uint32_t nr);
std::shared_ptr<Node> grad_accumulator(const Tensor& t);
unsigned next_hook_handle();
// Called with a tensor whose grad is about to be written through mutable_grad(), before the
// write (kiln::compile's tracer captures the tensor, so that zero_grad() inside a traced step
// is recorded instead of clearing the real gradient). At most one hook; nullptr removes it.
using GradWriteHook = void (*)(const Tensor& t);
void set_grad_write_hook(GradWriteHook hook);
}  // namespace internal

}  // namespace kiln::autograd
