#include "autograd/hooks.h"

#include <algorithm>

#include "autograd/autograd_meta.h"
#include "tensor/error.h"

namespace kiln::autograd {

unsigned register_post_accumulate_grad_hook(const Tensor& leaf,
                                            std::function<void(const Tensor&)> hook) {
  KILN_CHECK(leaf.defined(), "[register_post_accumulate_grad_hook] the tensor is undefined");
  KILN_CHECK(leaf.requires_grad() && leaf.is_leaf(),
             "[register_post_accumulate_grad_hook] the tensor must be a leaf that requires grad "
             "(requires_grad=", leaf.requires_grad(), ", is_leaf=", leaf.is_leaf(), ")");
  KILN_CHECK(hook != nullptr, "[register_post_accumulate_grad_hook] the hook is empty");
  AutogradMeta& m = internal::meta(leaf);
  const unsigned handle = internal::next_hook_handle();
  m.post_accumulate_hooks.push_back({handle, std::move(hook)});
  return handle;
}

bool remove_post_accumulate_grad_hook(const Tensor& leaf, unsigned handle) {
  AutogradMeta* m = internal::meta_or_null(leaf);
  if (m == nullptr) return false;
  auto& hooks = m->post_accumulate_hooks;
  auto it = std::find_if(hooks.begin(), hooks.end(),
                         [handle](const auto& h) { return h.handle == handle; });
  if (it == hooks.end()) return false;
  hooks.erase(it);
  return true;
}

}  // namespace kiln::autograd
