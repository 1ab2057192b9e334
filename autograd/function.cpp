#include "autograd/function.h"

#include <cxxabi.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <vector>

#include "tensor/ops.h"

namespace kiln::autograd {

double IValue::toDouble() const {
  if (auto* d = std::get_if<double>(&v_)) return *d;
  if (auto* i = std::get_if<int64_t>(&v_)) return static_cast<double>(*i);
  KILN_FAIL("[IValue] toDouble() on a value that is not a number");
}

int64_t IValue::toInt() const {
  if (auto* i = std::get_if<int64_t>(&v_)) return *i;
  if (auto* b = std::get_if<bool>(&v_)) return *b;
  KILN_FAIL("[IValue] toInt() on a value that is not an integer");
}

bool IValue::toBool() const {
  if (auto* b = std::get_if<bool>(&v_)) return *b;
  KILN_FAIL("[IValue] toBool() on a value that is not a bool");
}

const std::string& IValue::toStringRef() const {
  if (auto* s = std::get_if<std::string>(&v_)) return *s;
  KILN_FAIL("[IValue] toStringRef() on a value that is not a string");
}

Tensor IValue::toTensor() const {
  if (auto* t = std::get_if<Tensor>(&v_)) return *t;
  KILN_FAIL("[IValue] toTensor() on a value that is not a tensor");
}

void AutogradContext::save_for_backward(const variable_list& tensors) { to_save_ = tensors; }

variable_list AutogradContext::get_saved_variables() const {
  KILN_CHECK(!released_, "[backward] trying to backward through the graph a second time (or "
             "to access saved tensors after they have been freed); pass retain_graph=true to "
             "the first backward() call");
  variable_list out;
  auto node = node_.lock();
  for (const SavedVariable& s : saved_) out.push_back(s.unpack(node, "custom Function"));
  if (saved_.empty()) out = to_save_;  // forward ran without recording
  return out;
}

void AutogradContext::mark_dirty(const variable_list& tensors) {
  for (const Tensor& t : tensors) dirty_.push_back(t.impl());
}

void AutogradContext::mark_non_differentiable(const variable_list& tensors) {
  for (const Tensor& t : tensors) non_differentiable_.push_back(t.impl());
}

struct AutogradContext::Internal {
  static void finish(AutogradContext& ctx, const std::shared_ptr<Node>& node,
                     const variable_list& outputs) {
    ctx.node_ = node;
    for (const Tensor& t : ctx.to_save_) {
      const bool is_output = std::any_of(outputs.begin(), outputs.end(), [&](const Tensor& o) {
        return o.defined() && t.defined() && o.impl() == t.impl();
      });
      ctx.saved_.emplace_back(t, is_output);
    }
    ctx.to_save_.clear();
  }
  static bool is_dirty(const AutogradContext& ctx, const TensorImpl* t) {
    return std::find(ctx.dirty_.begin(), ctx.dirty_.end(), t) != ctx.dirty_.end();
  }
  static bool non_differentiable(const AutogradContext& ctx, const TensorImpl* t) {
    return std::find(ctx.non_differentiable_.begin(), ctx.non_differentiable_.end(), t) !=
           ctx.non_differentiable_.end();
  }
  static std::vector<bool>& needs(AutogradContext& ctx) { return ctx.needs_input_grad_; }
  static void release(AutogradContext& ctx) {
    for (auto& s : ctx.saved_) s.reset();
    ctx.released_ = !ctx.saved_.empty();
  }
  // Drops every tensor the context holds (a node being freed): saved inputs and saved_data
  // tensors hold their grad_fn.
  static void clear(AutogradContext& ctx) {
    ctx.saved_.clear();
    ctx.to_save_.clear();
    ctx.saved_data.clear();
  }
};

namespace internal {

std::string demangle_function_name(const char* mangled) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> d(abi::__cxa_demangle(mangled, nullptr, nullptr, &status),
                                           std::free);
  std::string name = status == 0 && d ? d.get() : mangled;
  const auto colon = name.rfind("::");
  return colon == std::string::npos ? name : name.substr(colon + 2);
}

variable_list CppNode::apply(variable_list&& grads) {
  variable_list result = backward_(&ctx, std::move(grads));
  // Extra trailing undefined gradients (for defaulted arguments that were not passed) are
  // dropped, as in libtorch.
  while (result.size() > num_args && !result.back().defined()) result.pop_back();
  KILN_CHECK(result.size() == num_args, "[", name(), "] backward returned ", result.size(),
             " gradients but forward took ", num_args, " arguments (return an undefined "
             "Tensor for arguments without a gradient)");
  for (size_t i = 0; i < result.size(); ++i) {
    if (result[i].defined() && i < next_edges_.size() && next_edges_[i].is_valid()) {
      const Edge& e = next_edges_[i];
      const InputMeta& m = e.function->output_metas().size() > e.input_nr
                               ? e.function->output_metas()[e.input_nr]
                               : InputMeta{to_shape(result[i].sizes()), result[i].dtype(),
                                           result[i].device()};
      KILN_CHECK(result[i].impl()->sizes() == m.sizes, "[", name(), "] backward returned a "
                 "gradient of shape ", shape_str(result[i].sizes()), " for argument ", i,
                 " of shape ", shape_str(m.sizes));
    } else {
      result[i] = Tensor();
    }
  }
  return result;
}

void CppNode::release_variables() { AutogradContext::Internal::release(ctx); }

void CppNode::drop_saved() {
  AutogradContext::Internal::release(ctx);
  AutogradContext::Internal::clear(ctx);
}

// The context first: a saved input (or a tensor in saved_data) holds the node its edge holds
// too. Then the graph only the edges hold, one node at a time (Node::release_edges), each custom
// node's context emptied first likewise.
CppNode::~CppNode() {
  AutogradContext::Internal::clear(ctx);
  release_edges();
}

void wire_custom_function(const std::shared_ptr<CppNode>& node,
                          const std::vector<const Tensor*>& args, variable_list& outputs) {
  std::vector<bool>& needs = AutogradContext::Internal::needs(node->ctx);
  for (const Tensor* t : args) {
    Edge e = t != nullptr && t->defined() ? gradient_edge(*t) : Edge{};
    if (t != nullptr && t->defined() && AutogradContext::Internal::is_dirty(node->ctx, t->impl())) {
      KILN_CHECK(!(t->requires_grad() && t->is_leaf()), "[", node->name(),
                 "] a leaf Variable that requires grad has been modified in place (mark_dirty)");
    }
    needs.push_back(e.is_valid());
    node->mutable_next_edges().push_back(std::move(e));
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    Tensor& out = outputs[i];
    node->output_metas().push_back(
        out.defined() ? InputMeta{out.impl()->sizes(), out.dtype(), out.device()}
                      : InputMeta{{}, kFloat, Device(kCPU)});
    if (!out.defined() || !is_floating_point(out.dtype())) continue;
    if (AutogradContext::Internal::non_differentiable(node->ctx, out.impl())) continue;
    // An output that is an unmarked input is returned as a view so the input keeps its history.
    const bool is_input = std::any_of(args.begin(), args.end(), [&](const Tensor* a) {
      return a != nullptr && a->defined() && a->impl() == out.impl();
    });
    if (is_input && !AutogradContext::Internal::is_dirty(node->ctx, out.impl())) {
      AutoGradMode off(false);
      out = out.alias();
    }
    set_history(out, node, static_cast<uint32_t>(i));
  }
  AutogradContext::Internal::finish(node->ctx, node, outputs);
}

}  // namespace internal
}  // namespace kiln::autograd
