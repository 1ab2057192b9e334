#include "autograd/checkpoint.h"

#include <memory>
#include <utility>

#include "autograd/autograd_meta.h"
#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "tensor/random.h"

namespace kiln {
namespace {

// The node of a checkpointed call: recomputes the function and differentiates it.
class CheckpointBackward final : public autograd::Node {
 public:
  CheckpointBackward(CheckpointFn fn, std::vector<Tensor> inputs, RngState rng)
      : fn_(std::move(fn)), inputs_(std::move(inputs)), rng_(rng) {}

  autograd::variable_list apply(autograd::variable_list&& grads) override {
    KILN_CHECK(!released_,
               "[checkpoint] trying to backward through a checkpointed function a "
               "second time; pass retain_graph=true to the first backward");
    // Fresh leaves over the inputs' data: the recomputed graph ends at them.
    std::vector<Tensor> leaves;
    leaves.reserve(inputs_.size());
    for (const Tensor& in : inputs_) {
      Tensor leaf = in.defined() ? in.detach() : Tensor();
      if (leaf.defined() && is_floating_point(leaf.dtype()) && in.requires_grad()) {
        leaf.requires_grad_(true);
      }
      leaves.push_back(std::move(leaf));
    }
    std::vector<Tensor> outputs;
    {
      const RngState now = get_rng_state();
      set_rng_state(rng_);
      struct Restore {
        RngState s;
        ~Restore() { set_rng_state(s); }
      } restore{now};
      AutoGradMode enable(true);
      outputs = fn_(leaves);
    }
    std::vector<Tensor> roots, root_grads;
    for (size_t i = 0; i < outputs.size() && i < grads.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grads[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    if (!roots.empty()) autograd::backward(roots, root_grads);
    autograd::variable_list result;
    result.reserve(leaves.size());
    for (const Tensor& leaf : leaves) result.push_back(leaf.defined() ? leaf.grad() : Tensor());
    return result;
  }

  std::string name() const override { return "CheckpointBackward"; }
  void release_variables() override {
    released_ = true;
    inputs_.clear();
  }

 private:
  CheckpointFn fn_;
  std::vector<Tensor> inputs_;
  RngState rng_;
  bool released_ = false;
};

}  // namespace

std::vector<Tensor> checkpoint(const CheckpointFn& fn, const std::vector<Tensor>& inputs) {
  KILN_CHECK(fn != nullptr, "[checkpoint] the function is empty");
  if (!GradMode::is_enabled()) return fn(inputs);
  const RngState rng = get_rng_state();
  std::vector<Tensor> outputs;
  {
    NoGradGuard no_grad;
    outputs = fn(inputs);
  }
  auto node = std::make_shared<CheckpointBackward>(fn, inputs, rng);
  for (const Tensor& in : inputs) {
    node->mutable_next_edges().push_back(autograd::internal::gradient_edge(in));
  }
  // Captured parameters need no edge: the recomputation's backward accumulates into them. A
  // node without any edge still runs when an output is differentiated, so it is always set.
  for (size_t k = 0; k < outputs.size(); ++k) {
    Tensor& out = outputs[k];
    node->output_metas().push_back(
        out.defined() ? autograd::InputMeta{out.impl()->sizes(), out.dtype(), out.device()}
                      : autograd::InputMeta{{}, kFloat, Device(kCPU)});
    if (out.defined() && is_floating_point(out.dtype())) {
      autograd::internal::set_history(out, node, static_cast<uint32_t>(k));
    }
  }
  return outputs;
}

}  // namespace kiln
