// The autograd graph: nodes (grad_fn) and the edges between them.
//
// Every differentiable op run with grad mode on creates a Node that knows how to turn the
// gradients of its outputs into gradients of its inputs; its edges point at the nodes that
// produced those inputs (or at the AccumulateGrad node of a leaf). The engine
// (autograd/engine.h) walks this graph from the roots of a backward call.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tensor/registry.h"

namespace kiln::autograd {

class Node;
using variable_list = std::vector<Tensor>;
using tensor_list = std::vector<Tensor>;

struct Edge {
  std::shared_ptr<Node> function;
  uint32_t input_nr = 0;
  bool is_valid() const { return function != nullptr; }
};

// Shape, dtype and device of a node's input, for zero-filling absent gradients and checking
// that a rule returned gradients of the right shape.
struct InputMeta {
  Shape sizes;
  ScalarType dtype;
  Device device;
};

class Node : public std::enable_shared_from_this<Node> {
 public:
  Node();
  virtual ~Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  // Gradients of the inputs (one per next edge) from the gradients of the outputs.
  virtual variable_list apply(variable_list&& grad_outputs) = 0;
  // "MulBackward0", "AccumulateGrad", ...
  virtual std::string name() const = 0;
  // Frees what was saved for backward (unless the graph is retained).
  virtual void release_variables() {}
  // Whether apply() takes undefined gradients for outputs that received none and makes their
  // zeros itself, only where it reads them (op nodes: BackwardCall::grad). Otherwise the engine
  // gives apply() zeros for them.
  virtual bool makes_absent_grads() const { return false; }

  const std::vector<Edge>& next_edges() const { return next_edges_; }
  std::vector<Edge>& mutable_next_edges() { return next_edges_; }
  const Edge& next_edge(size_t i) const { return next_edges_[i]; }
  size_t num_outputs() const { return next_edges_.size(); }
  // Later nodes run first when several are ready (as PyTorch orders by sequence number).
  uint64_t sequence_nr() const { return sequence_nr_; }

  // Hooks on the gradient arriving for output `nr` (registered through Tensor::register_hook
  // on a non-leaf).
  using PreHook = std::function<Tensor(const Tensor&)>;
  unsigned add_pre_hook(uint32_t output_nr, PreHook hook);
  bool remove_pre_hook(unsigned handle);
  void run_pre_hooks(variable_list& grads);

  // Per-output metadata (the shapes of what this node produced), for zero-filling.
  std::vector<InputMeta>& output_metas() { return output_metas_; }

 protected:
  // For the destructors of nodes with edges (OpNode, CppNode), once they dropped what they saved.
  // Freed recursively, a long chain (a loop unrolled 100000 times) would overflow the stack: each
  // node's edges and saved tensors release the next node from inside its destructor. Here the
  // nodes that only the edges still hold are taken off them and released one at a time, each
  // dropping what it saved first (drop_saved), so the depth stays bounded (PyTorch's deleteNode
  // does the same). Another owner only delays a node's release.
  void release_edges();
  // What a node being freed lets go of before its edges: every tensor it saved (a saved input
  // holds the node that the input's edge holds too).
  virtual void drop_saved() { release_variables(); }

  std::vector<Edge> next_edges_;
  std::vector<InputMeta> output_metas_;

 private:
  struct Hook {
    unsigned handle;
    uint32_t output_nr;
    PreHook fn;
  };
  std::vector<Hook> pre_hooks_;
  uint64_t sequence_nr_;
};

// The sink of a leaf's gradient: adds what arrives into the leaf's grad().
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<TensorImpl> leaf);
  variable_list apply(variable_list&& grads) override;
  std::string name() const override { return "AccumulateGrad"; }
  const std::shared_ptr<TensorImpl>& variable() const { return leaf_; }

 private:
  std::shared_ptr<TensorImpl> leaf_;
};

// A node whose backward fails: for ops registered without a backward rule.
class NotImplementedNode final : public Node {
 public:
  explicit NotImplementedNode(std::string op) : op_(std::move(op)) {}
  variable_list apply(variable_list&& grads) override;
  std::string name() const override { return "NotImplemented"; }

 private:
  std::string op_;
};

// A tensor saved for backward. Checks on unpacking that it was not modified in place since
// (version counter). A saved output of the node itself is stored without its grad_fn (which
// would be a reference cycle) and gets it back on unpacking.
class SavedVariable {
 public:
  SavedVariable() = default;
  SavedVariable(const Tensor& t, bool is_output);
  Tensor unpack(const std::shared_ptr<Node>& owner, const std::string& op) const;
  void reset() {
    data_ = Tensor();
    released_ = true;
  }
  bool defined() const { return data_.defined(); }

 private:
  Tensor data_;  // shares storage; no autograd history when is_output_
  uint64_t version_ = 0;
  bool is_output_ = false;
  bool requires_grad_ = false;
  uint32_t output_nr_ = 0;
  std::shared_ptr<Node> grad_fn_;  // for saved inputs that are not leaves
  std::weak_ptr<Node> grad_accumulator_;
  bool released_ = false;
  bool was_defined_ = false;
};

// "mul" -> "MulBackward0", "log_softmax" -> "LogSoftmaxBackward0", "add_" -> "AddBackward0".
std::string backward_node_name(std::string_view op);

}  // namespace kiln::autograd
