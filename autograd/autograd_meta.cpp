// AutogradMeta and the autograd methods of Tensor.
#include "autograd/autograd_meta.h"

#include <atomic>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "tensor/ops.h"

namespace kiln {
namespace autograd::internal {

namespace {
std::mutex g_meta_mu;  // creation of metas (rare) is serialised
std::atomic<unsigned> g_hook_handle{1};
}  // namespace

unsigned next_hook_handle() { return g_hook_handle.fetch_add(1); }

AutogradMeta* meta_or_null(const TensorImpl* t) { return t->autograd_meta().get(); }
AutogradMeta* meta_or_null(const Tensor& t) { return meta_or_null(t.impl()); }

AutogradMeta& meta(const Tensor& t) {
  KILN_CHECK(t.defined(), "[autograd] the tensor is undefined");
  if (AutogradMeta* m = meta_or_null(t)) return *m;
  std::lock_guard<std::mutex> lock(g_meta_mu);
  if (!t.impl()->autograd_meta()) t.impl()->set_autograd_meta(std::make_shared<AutogradMeta>());
  return *t.impl()->autograd_meta();
}

std::shared_ptr<Node> grad_accumulator(const Tensor& t) {
  AutogradMeta& m = meta(t);
  std::lock_guard<std::mutex> lock(m.mu);
  if (auto acc = m.grad_accumulator.lock()) return acc;
  auto acc = std::make_shared<AccumulateGrad>(t.impl_ptr());
  acc->output_metas().push_back({t.impl()->sizes(), t.dtype(), t.device()});
  m.grad_accumulator = acc;
  return acc;
}

Edge gradient_edge(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return {};
  AutogradMeta* m = meta_or_null(t);
  if (m != nullptr && m->grad_fn) return {m->grad_fn, m->output_nr};
  return {grad_accumulator(t), 0};
}

void set_history(const Tensor& t, const std::shared_ptr<Node>& node, uint32_t nr) {
  AutogradMeta& m = meta(t);
  m.grad_fn = node;
  m.output_nr = nr;
  t.impl()->set_requires_grad(true);
}

}  // namespace autograd::internal

using autograd::internal::meta;
using autograd::internal::meta_or_null;

Tensor& Tensor::requires_grad_(bool r) {
  KILN_CHECK(!r || kiln::is_floating_point(dtype()),
             "[requires_grad_] only floating-point tensors can require gradients, got dtype ",
             dtype_name(dtype()));
  KILN_CHECK(r || is_leaf(), "[requires_grad_] you can only change requires_grad flags of leaf "
             "variables; use detach() to get a tensor that does not require grad");
  impl()->set_requires_grad(r);
  return *this;
}

const Tensor& Tensor::grad() const {
  static const Tensor undefined;
  autograd::AutogradMeta* m = meta_or_null(*this);
  return m != nullptr ? m->grad : undefined;
}

namespace autograd::internal {
namespace {
std::atomic<GradWriteHook> g_grad_write_hook{nullptr};
}  // namespace
void set_grad_write_hook(GradWriteHook hook) { g_grad_write_hook.store(hook); }
}  // namespace autograd::internal

Tensor& Tensor::mutable_grad() {
  if (auto hook = autograd::internal::g_grad_write_hook.load(std::memory_order_relaxed)) {
    hook(*this);
  }
  return meta(*this).grad;
}

const std::shared_ptr<autograd::Node>& Tensor::grad_fn() const {
  static const std::shared_ptr<autograd::Node> none;
  autograd::AutogradMeta* m = meta_or_null(*this);
  return m != nullptr ? m->grad_fn : none;
}

bool Tensor::is_leaf() const { return grad_fn() == nullptr; }

int64_t Tensor::output_nr() const {
  autograd::AutogradMeta* m = meta_or_null(*this);
  return m != nullptr ? m->output_nr : 0;
}

void Tensor::retain_grad() const {
  KILN_CHECK(requires_grad(), "[retain_grad] can't retain_grad on a tensor that has "
             "requires_grad=false");
  if (is_leaf()) return;  // leaves keep their grad anyway
  autograd::AutogradMeta& m = meta(*this);
  if (m.retains_grad) return;
  m.retains_grad = true;
  std::weak_ptr<TensorImpl> weak = impl_ptr();
  m.retain_grad_hook = m.grad_fn->add_pre_hook(m.output_nr, [weak](const Tensor& g) {
    if (auto self = weak.lock()) {
      Tensor t(self);
      autograd::AutogradMeta& mm = meta(t);
      mm.grad = mm.grad.defined() ? mm.grad + g.detach() : g.detach().clone();
    }
    return Tensor();
  });
}

bool Tensor::retains_grad() const {
  autograd::AutogradMeta* m = meta_or_null(*this);
  return m != nullptr && m->retains_grad;
}

Tensor Tensor::detach() const {
  return Tensor(std::make_shared<TensorImpl>(impl()->storage(), impl()->sizes(),
                                             impl()->strides(), storage_offset(), dtype()));
}

Tensor& Tensor::detach_() {
  if (autograd::AutogradMeta* m = meta_or_null(*this)) {
    m->grad_fn.reset();
    m->output_nr = 0;
  }
  impl()->set_requires_grad(false);
  return *this;
}

unsigned Tensor::add_grad_hook(std::function<Tensor(const Tensor&)> hook) const {
  KILN_CHECK(requires_grad(), "[register_hook] cannot register a hook on a tensor that doesn't "
             "require gradient");
  autograd::AutogradMeta& m = meta(*this);
  if (m.grad_fn) return m.grad_fn->add_pre_hook(m.output_nr, std::move(hook));
  const unsigned h = autograd::internal::next_hook_handle();
  m.leaf_hooks.push_back({h, std::move(hook)});
  return h;
}

void Tensor::remove_hook(unsigned handle) const {
  autograd::AutogradMeta& m = meta(*this);
  if (m.grad_fn && m.grad_fn->remove_pre_hook(handle)) return;
  std::erase_if(m.leaf_hooks, [&](const auto& h) { return h.handle == handle; });
}

void Tensor::backward(const Tensor& gradient, std::optional<bool> retain_graph, bool create_graph,
                      std::vector<Tensor> inputs) const {
  autograd::backward({*this}, {gradient}, retain_graph, create_graph, inputs);
}

}  // namespace kiln
