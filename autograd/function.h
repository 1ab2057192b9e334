// Custom autograd functions, as torch::autograd::Function:
//
//   struct MulConstant : public kiln::autograd::Function<MulConstant> {
//     static kiln::Tensor forward(kiln::autograd::AutogradContext* ctx, kiln::Tensor x, double c) {
//       ctx->saved_data["c"] = c;
//       return x * c;
//     }
//     static kiln::autograd::variable_list backward(kiln::autograd::AutogradContext* ctx,
//                                                   kiln::autograd::variable_list grads) {
//       return {grads[0] * ctx->saved_data["c"].toDouble(), kiln::Tensor()};
//     }
//   };
//   auto y = MulConstant::apply(x, 5.5);
//
// forward runs without recording; its tensor outputs become outputs of one graph node whose
// backward calls T::backward with one gradient per output, and which must return one entry
// per forward argument (an undefined Tensor for non-tensor arguments and for inputs that need
// no gradient).
#pragma once

#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "autograd/autograd_meta.h"
#include "autograd/grad_mode.h"

namespace kiln::autograd {

// A value kept in ctx->saved_data: a number, bool, string or tensor.
class IValue {
 public:
  IValue() = default;
  IValue(double v) : v_(v) {}                      // NOLINT
  IValue(float v) : v_(static_cast<double>(v)) {}  // NOLINT
  template <typename T>
    requires(std::is_integral_v<T> && !std::is_same_v<T, bool>)
  IValue(T v) : v_(static_cast<int64_t>(v)) {}  // NOLINT
  IValue(bool v) : v_(v) {}                     // NOLINT
  IValue(std::string v) : v_(std::move(v)) {}   // NOLINT
  IValue(const char* v) : v_(std::string(v)) {} // NOLINT
  IValue(Tensor v) : v_(std::move(v)) {}        // NOLINT

  double toDouble() const;
  int64_t toInt() const;
  bool toBool() const;
  const std::string& toStringRef() const;
  Tensor toTensor() const;
  bool isTensor() const { return std::holds_alternative<Tensor>(v_); }
  bool isNone() const { return std::holds_alternative<std::monostate>(v_); }

 private:
  std::variant<std::monostate, double, int64_t, bool, std::string, Tensor> v_;
};

class AutogradContext {
 public:
  // Tensors needed by backward: saved with version checks (modifying them in place after
  // saving makes backward fail clearly).
  void save_for_backward(const variable_list& tensors);
  variable_list get_saved_variables() const;
  // Inputs modified in place by forward.
  void mark_dirty(const variable_list& tensors);
  // Outputs that have no gradient (for example integer indices).
  void mark_non_differentiable(const variable_list& tensors);
  // Whether forward input `i` (counting every argument) needs a gradient.
  bool needs_input_grad(size_t i) const { return i < needs_input_grad_.size() && needs_input_grad_[i]; }

  std::unordered_map<std::string, IValue> saved_data;

  // --- used by Function<T>::apply ---
  struct Internal;

 private:
  friend struct Internal;
  std::vector<Tensor> to_save_;
  std::vector<SavedVariable> saved_;
  std::vector<const TensorImpl*> dirty_;
  std::vector<const TensorImpl*> non_differentiable_;
  std::vector<bool> needs_input_grad_;
  std::weak_ptr<Node> node_;
  bool released_ = false;
};

namespace internal {

// The node of a custom function: calls the user's backward.
class CppNode : public Node {
 public:
  using Backward = variable_list (*)(AutogradContext*, variable_list);
  CppNode(std::string name, Backward backward) : name_(std::move(name)), backward_(backward) {}
  // Frees the nodes that only this one holds one at a time (Node::release_edges), as ~OpNode
  // does: a chain of 100000 custom functions is not freed 100000 destructors deep.
  ~CppNode() override;
  variable_list apply(variable_list&& grads) override;
  std::string name() const override { return name_; }
  void release_variables() override;
  AutogradContext ctx;
  // Which forward argument each next edge belongs to (one edge per argument).
  size_t num_args = 0;

 protected:
  // The context emptied whole: its saved inputs and saved_data hold their grad_fn.
  void drop_saved() override;

 private:
  std::string name_;
  Backward backward_;
};

std::string demangle_function_name(const char* mangled);

// Wires a custom function's outputs into the graph: edges from the tensor arguments, history
// on the outputs, saved tensors. Returns the outputs (possibly replaced by views for outputs
// that alias inputs).
void wire_custom_function(const std::shared_ptr<CppNode>& node,
                          const std::vector<const Tensor*>& args, variable_list& outputs);

inline void collect_tensor(std::vector<const Tensor*>& out, const Tensor& t) { out.push_back(&t); }
template <typename T>
void collect_tensor(std::vector<const Tensor*>& out, const T&) {
  out.push_back(nullptr);
}

inline variable_list to_list(const Tensor& t) { return {t}; }
inline variable_list to_list(const variable_list& v) { return v; }

}  // namespace internal

template <class T>
struct Function {
  template <typename... Args>
  static auto apply(Args&&... args) {
    std::vector<const Tensor*> tensor_args;
    (internal::collect_tensor(tensor_args, args), ...);
    auto node = std::make_shared<internal::CppNode>(
        internal::demangle_function_name(typeid(T).name()) + "Backward", &T::backward);
    node->num_args = sizeof...(Args);
    bool any_requires_grad = false;
    for (const Tensor* t : tensor_args) {
      any_requires_grad |= t != nullptr && t->defined() && t->requires_grad();
    }
    using Result = decltype(T::forward(&node->ctx, std::forward<Args>(args)...));
    variable_list outputs;
    Result result;
    {
      AutoGradMode off(false);
      result = T::forward(&node->ctx, std::forward<Args>(args)...);
    }
    outputs = internal::to_list(result);
    if (GradMode::is_enabled() && any_requires_grad) {
      internal::wire_custom_function(node, tensor_args, outputs);
    }
    if constexpr (std::is_same_v<Result, Tensor>) {
      return outputs[0];
    } else {
      return outputs;
    }
  }
};

}  // namespace kiln::autograd
