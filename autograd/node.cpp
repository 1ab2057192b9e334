#include "autograd/node.h"

#include <algorithm>
#include <cctype>

#include "autograd/autograd_meta.h"
#include "autograd/grad_mode.h"
#include "tensor/ops.h"

namespace kiln::autograd {

namespace {
std::atomic<uint64_t> g_sequence{0};
}

Node::Node() : sequence_nr_(g_sequence.fetch_add(1, std::memory_order_relaxed)) {}

unsigned Node::add_pre_hook(uint32_t output_nr, PreHook hook) {
  const unsigned h = internal::next_hook_handle();
  pre_hooks_.push_back({h, output_nr, std::move(hook)});
  return h;
}

bool Node::remove_pre_hook(unsigned handle) {
  auto it = std::find_if(pre_hooks_.begin(), pre_hooks_.end(),
                         [&](const Hook& h) { return h.handle == handle; });
  if (it == pre_hooks_.end()) return false;
  pre_hooks_.erase(it);
  return true;
}

void Node::run_pre_hooks(variable_list& grads) {
  for (const Hook& h : pre_hooks_) {
    if (h.output_nr >= grads.size() || !grads[h.output_nr].defined()) continue;
    Tensor replaced = h.fn(grads[h.output_nr]);
    if (replaced.defined()) grads[h.output_nr] = std::move(replaced);
  }
}

void Node::release_edges() {
  // Moves the nodes that nothing but `edges` holds out of them, into `sole`.
  std::vector<std::shared_ptr<Node>> sole;
  auto take_sole_owned = [&sole](std::vector<Edge>& edges) {
    for (Edge& e : edges) {
      if (e.function != nullptr && e.function.use_count() == 1)
        sole.push_back(std::move(e.function));
    }
  };
  take_sole_owned(next_edges_);
  while (!sole.empty()) {
    std::shared_ptr<Node> node = std::move(sole.back());
    sole.pop_back();
    node->drop_saved();
    take_sole_owned(node->next_edges_);
  }
}

AccumulateGrad::AccumulateGrad(std::shared_ptr<TensorImpl> leaf) : leaf_(std::move(leaf)) {}

namespace {
void accumulate(AutogradMeta& m, const Tensor& leaf, const Tensor& g) {
  std::lock_guard<std::mutex> lock(m.mu);
  if (!GradMode::is_enabled()) {
    // Plain accumulation: the first gradient is taken over (copied when someone else still
    // holds it, so that a later in-place add cannot change their tensor), the next added in
    // place.
    if (!m.grad.defined()) {
      const bool sole_owner = g.impl()->storage().use_count() == 1 && g.is_contiguous();
      m.grad = sole_owner ? g.detach() : g.detach().to(leaf.dtype(), /*copy=*/true);
      if (m.grad.dtype() != leaf.dtype()) m.grad = m.grad.to(leaf.dtype());
    } else {
      m.grad.add_(g.detach());
    }
  } else {
    // create_graph: keep the gradient's own history so it can be differentiated again.
    m.grad = m.grad.defined() ? m.grad + g : g;
  }
}
}  // namespace

variable_list AccumulateGrad::apply(variable_list&& grads) {
  Tensor g = std::move(grads[0]);
  if (!g.defined()) return {};
  Tensor leaf(leaf_);
  AutogradMeta& m = internal::meta(leaf);
  for (const auto& hook : m.leaf_hooks) {
    Tensor replaced = hook.fn(g);
    if (replaced.defined()) g = std::move(replaced);
  }
  KILN_CHECK(g.sizes() == leaf.sizes(), "[backward] gradient of shape ", shape_str(g.sizes()),
             " does not match the leaf's shape ", shape_str(leaf.sizes()));
  accumulate(m, leaf, g);
  // After the lock: a hook may read or rewrite grad (DDP copies it out and back).
  for (const auto& hook : m.post_accumulate_hooks) hook.fn(leaf);
  return {};
}

variable_list NotImplementedNode::apply(variable_list&&) {
  KILN_FAIL("[", op_, "] the derivative of ", op_,
            " is not implemented (no backward rule is registered)");
}

SavedVariable::SavedVariable(const Tensor& t, bool is_output) : is_output_(is_output) {
  was_defined_ = t.defined();
  if (!t.defined()) return;
  version_ = t._version();
  requires_grad_ = t.requires_grad();
  if (is_output) {
    // Without grad_fn: the node itself is the grad_fn, restored in unpack.
    data_ = Tensor(std::make_shared<TensorImpl>(t.impl()->storage(), t.impl()->sizes(),
                                                t.impl()->strides(), t.storage_offset(),
                                                t.dtype()));
    output_nr_ = static_cast<uint32_t>(t.output_nr());
  } else {
    data_ = t;
  }
}

Tensor SavedVariable::unpack(const std::shared_ptr<Node>& owner, const std::string& op) const {
  if (released_) {
    KILN_FAIL("[backward] trying to backward through the graph a second time (or to access "
              "saved tensors after they have been freed): the saved tensors of ",
              op, " were freed by the first backward. Pass retain_graph=true to the first "
              "backward() or autograd::grad() call to keep them.");
  }
  if (!was_defined_) return Tensor();
  if (data_._version() != version_) {
    KILN_FAIL("[backward] one of the variables needed for gradient computation has been "
              "modified by an inplace operation: a tensor of shape ",
              shape_str(data_.sizes()), " saved by ", op, " is at version ",
              data_._version(), "; expected version ", version_, " instead");
  }
  if (!is_output_ || !requires_grad_) return data_;
  Tensor t = Tensor(std::make_shared<TensorImpl>(data_.impl()->storage(), data_.impl()->sizes(),
                                                 data_.impl()->strides(), data_.storage_offset(),
                                                 data_.dtype()));
  internal::set_history(t, owner, output_nr_);
  return t;
}

std::string backward_node_name(std::string_view op) {
  std::string name;
  bool upper = true;
  for (char c : op) {
    if (c == '_') {
      upper = true;
      continue;
    }
    name += upper ? static_cast<char>(std::toupper(static_cast<unsigned char>(c))) : c;
    upper = false;
  }
  return name + "Backward0";
}

}  // namespace kiln::autograd
