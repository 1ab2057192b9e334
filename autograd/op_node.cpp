// Records registry ops into the autograd graph: the Autograd dispatch handler and OpNode, the
// node that runs an op's registered backward rule.
#include <algorithm>
#include <memory>
#include <vector>

#include "autograd/autograd_meta.h"
#include "autograd/backward_util.h"
#include "autograd/grad_mode.h"
#include "tensor/ops.h"

namespace kiln::autograd {
namespace {

class OpNode final : public Node {
 public:
  OpNode(const OpCall& call, const Tensor& original_self)
      : op_(call.op), attrs_(call.attrs) {
    const OpDef& op = *call.op;
    const uint32_t saved = op.save_inputs_fn != nullptr ? op.save_inputs_fn(call) : op.saved_inputs;
    inputs_.reserve(call.inputs.size());
    next_edges_.reserve(call.inputs.size());
    for (size_t i = 0; i < call.inputs.size(); ++i) {
      const Tensor& in = call.inputs[i];
      const bool save = i < 32 && (saved >> i) & 1u;
      const Tensor& value = (i == 0 && original_self.defined()) ? original_self : in;
      inputs_.push_back({SavedVariable(save ? value : Tensor(), false),
                         in.defined() ? InputMeta{in.impl()->sizes(), in.dtype(), in.device()}
                                      : InputMeta{{}, kFloat, Device(kCPU)},
                         in.defined()});
      next_edges_.push_back(internal::gradient_edge(in));
    }
  }

  // Outputs are saved after set_history, so that a saved output can restore its grad_fn.
  void save_outputs(const TensorVec& outputs) {
    for (const Tensor& out : outputs) {
      output_metas_.push_back({out.impl()->sizes(), out.dtype(), out.device()});
      outputs_.emplace_back(op_->saved_outputs ? out : Tensor(), true);
    }
  }

  // The saved tensors first, then the graph only the edges hold, one node at a time
  // (Node::release_edges).
  ~OpNode() override {
    release_variables();
    release_edges();
  }

  variable_list apply(variable_list&& grads) override {
    KILN_CHECK(!released_, "[backward] trying to backward through the graph a second time "
               "(or to access saved tensors after they have been freed): the saved tensors of ",
               name(), " were freed by the first backward. Pass retain_graph=true to the "
               "first backward() or autograd::grad() call to keep them.");
    auto self = shared_from_this();
    // Tensors the rule does not read arrive as meta tensors carrying shape and dtype.
    auto meta_tensor = [](const InputMeta& m) {
      return empty(m.sizes, TensorOptions(m.dtype).device(Device(kMeta)));
    };
    OpCall fwd;
    fwd.op = op_;
    fwd.attrs = attrs_;
    absl::InlinedVector<bool, 4> needs_grad;
    for (size_t i = 0; i < inputs_.size(); ++i) {
      const Input& in = inputs_[i];
      fwd.inputs.push_back(in.saved.defined() ? in.saved.unpack(self, name())
                           : in.defined       ? meta_tensor(in.meta)
                                              : Tensor());
      needs_grad.push_back(next_edges_[i].is_valid());
    }
    for (size_t i = 0; i < outputs_.size(); ++i) {
      fwd.outputs.push_back(outputs_[i].defined() ? outputs_[i].unpack(self, name())
                                                  : meta_tensor(output_metas_[i]));
    }
    // Zeros for an output that received no gradient, made when the rule reads it.
    grads.resize(std::max(grads.size(), output_metas().size()));
    struct Absent {
      variable_list& grads;
      const std::vector<InputMeta>& metas;
    } absent{grads, output_metas()};
    BackwardCall call{fwd, TensorList(grads.data(), grads.size()),
                      absl::Span<const bool>(needs_grad.data(), needs_grad.size())};
    call.materialize = [](void* context, size_t i) {
      auto& a = *static_cast<Absent*>(context);
      if (i >= a.metas.size()) return;
      const InputMeta& m = a.metas[i];
      a.grads[i] = zeros(m.sizes, TensorOptions(m.dtype).device(m.device));
      internal::note_absent_grad(a.grads[i]);
    };
    call.materialize_context = &absent;
    TensorVec result = op_->backward(call);
    variable_list out(inputs_.size());
    for (size_t i = 0; i < inputs_.size() && i < result.size(); ++i) {
      if (!needs_grad[i] || !result[i].defined()) continue;
      Tensor g = std::move(result[i]);
      const InputMeta& m = inputs_[i].meta;
      KILN_CHECK(g.impl()->sizes() == m.sizes, "[", op_->name, "] the backward rule returned a "
                 "gradient of shape ", shape_str(g.sizes()), " for input ", i, " of shape ",
                 shape_str(m.sizes));
      if (g.dtype() != m.dtype) g = g.to(m.dtype);
      if (g.device() != m.device) g = g.to(m.device);  // e.g. to_copy across devices
      out[i] = std::move(g);
    }
    return out;
  }

  std::string name() const override { return backward_node_name(op_->name); }
  bool makes_absent_grads() const override { return true; }

  void release_variables() override {
    // A node that saved nothing can run again; one that did fails clearly after this.
    for (auto& in : inputs_) released_ |= in.saved.defined();
    for (auto& out : outputs_) released_ |= out.defined();
    for (auto& in : inputs_) in.saved.reset();
    for (auto& out : outputs_) out.reset();
  }

 private:
  struct Input {
    SavedVariable saved;  // undefined unless the rule reads this input
    InputMeta meta;
    bool defined;  // optional inputs (e.g. no bias) are undefined tensors
  };

  const OpDef* op_;
  absl::InlinedVector<Attr, 4> attrs_;
  std::vector<Input> inputs_;
  std::vector<SavedVariable> outputs_;
  bool released_ = false;
};

bool any_input_requires_grad(const OpCall& call) {
  for (const Tensor& t : call.inputs) {
    if (t.defined() && t.requires_grad()) return true;
  }
  return false;
}

bool autograd_active(const OpCall& call) {
  return GradMode::is_enabled() && any_input_requires_grad(call);
}

void autograd_handle(OpCall& call) {
  const OpDef& op = *call.op;
  Tensor original_self;
  if (op.kind == OpKind::kInplace) {
    const Tensor& self = call.inputs[0];
    KILN_CHECK(!(self.requires_grad() && self.is_leaf()), "[", op.name,
               "] a leaf Variable that requires grad is being used in an in-place operation");
    AutogradMeta* m = internal::meta_or_null(self);
    KILN_CHECK(m == nullptr || !m->is_view || !self.requires_grad(), "[", op.name,
               "] in-place operation on a view of a tensor that requires grad is not supported; "
               "use the out-of-place op (e.g. `x = x.mul(y)`)");
    // The rule may need self's value from before the write. The copy is recorded (grad mode
    // is on here), so that a second derivative through the saved value reaches self's history.
    if (op.backward != nullptr && (op.saved_inputs & 1u)) original_self = self.clone();
  }
  {
    AutoGradMode off(false);
    dispatch_after(call, DispatchKey::Autograd);
  }
  bool differentiable = false;
  for (const Tensor& out : call.outputs) {
    differentiable |= out.defined() && is_floating_point(out.dtype());
  }
  if (!differentiable) return;
  std::shared_ptr<Node> node;
  OpNode* op_node = nullptr;
  if (op.backward != nullptr) {
    auto n = std::make_shared<OpNode>(call, original_self);
    op_node = n.get();
    node = std::move(n);
  } else {
    node = std::make_shared<NotImplementedNode>(op.name);
    for (const Tensor& in : call.inputs) {
      node->mutable_next_edges().push_back(internal::gradient_edge(in));
    }
    for (const Tensor& out : call.outputs) {
      node->output_metas().push_back({out.impl()->sizes(), out.dtype(), out.device()});
    }
  }
  for (size_t i = 0; i < call.outputs.size(); ++i) {
    const Tensor& out = call.outputs[i];
    if (!out.defined() || !is_floating_point(out.dtype())) continue;
    internal::set_history(out, node, static_cast<uint32_t>(i));
    if (op.kind == OpKind::kView) internal::meta(out).is_view = true;
  }
  if (op_node != nullptr) op_node->save_outputs(call.outputs);
}

const DispatchHandler kAutogradHandler{autograd_active, autograd_handle};

struct Install {
  Install() { set_dispatch_handler(DispatchKey::Autograd, &kAutogradHandler); }
} install;

}  // namespace
}  // namespace kiln::autograd
