#include "autograd/engine.h"

#include <algorithm>
#include <queue>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "autograd/autograd_meta.h"
#include "autograd/backward_util.h"
#include "autograd/grad_mode.h"
#include "tensor/ops.h"

namespace kiln::autograd {
namespace internal {
namespace {

// The zeros run_backward made for the node it is applying on this thread (null outside a node's
// apply). Thread-local: the engine applies a node on the thread that called backward, and
// independent graphs may run backward on several threads at once.
thread_local variable_list* t_absent_grads = nullptr;

// Publishes `absent` for one node's apply; restores the enclosing node's list after it (a rule
// may run a nested backward, as checkpoint's recomputation does).
class AbsentGradsScope {
 public:
  explicit AbsentGradsScope(variable_list* absent) : previous_(t_absent_grads) {
    t_absent_grads = absent;
  }
  ~AbsentGradsScope() { t_absent_grads = previous_; }
  AbsentGradsScope(const AbsentGradsScope&) = delete;
  AbsentGradsScope& operator=(const AbsentGradsScope&) = delete;

 private:
  variable_list* previous_;
};

}  // namespace

bool is_absent_grad(const Tensor& grad) {
  if (!grad.defined() || t_absent_grads == nullptr) return false;
  for (const Tensor& z : *t_absent_grads) {
    if (z.impl() == grad.impl()) return true;
  }
  return false;
}

void note_absent_grad(const Tensor& zeros) {
  if (t_absent_grads != nullptr) t_absent_grads->push_back(zeros);
}

}  // namespace internal

namespace {

struct NodeState {
  int dependencies = 0;
  variable_list buffer;
  bool needed = true;
};

// Adds `g` into slot `i` of `buffer`. Out of place: `g` may be shared with other consumers.
void accumulate(variable_list& buffer, size_t i, Tensor g) {
  if (buffer.size() <= i) buffer.resize(i + 1);
  if (!buffer[i].defined()) {
    buffer[i] = std::move(g);
  } else {
    buffer[i] = buffer[i] + g;
  }
}

Tensor zeros_for(const InputMeta& m) {
  return zeros(m.sizes, TensorOptions(m.dtype).device(m.device));
}

// Runs the graph from `roots` (with their initial gradients). When `captures` is non-empty,
// the gradients arriving at those edges are returned instead of being passed on, and only
// the nodes leading to them run.
variable_list run_backward(const std::vector<Edge>& roots, const variable_list& root_grads,
                           bool keep_graph, bool create_graph, const std::vector<Edge>& captures,
                           bool accumulate_into_leaves) {
  AutoGradMode grad_mode(create_graph);
  absl::flat_hash_map<Node*, NodeState> state;
  // Discover the graph iteratively and count each node's incoming edges.
  std::vector<Node*> order;  // discovery order (parents before children)
  {
    std::vector<Node*> stack;
    for (const Edge& e : roots) {
      if (e.is_valid() && state.try_emplace(e.function.get()).second) {
        stack.push_back(e.function.get());
      }
    }
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      order.push_back(n);
      for (const Edge& e : n->next_edges()) {
        if (!e.is_valid()) continue;
        auto [it, inserted] = state.try_emplace(e.function.get());
        if (inserted) stack.push_back(e.function.get());
      }
    }
  }
  // For grad(): keep only the nodes from which a captured edge is reachable.
  absl::flat_hash_map<Node*, std::vector<size_t>> capture_slots;  // node -> capture indices
  for (size_t i = 0; i < captures.size(); ++i) {
    capture_slots[captures[i].function.get()].push_back(i);
  }
  const bool capturing = !captures.empty();
  if (capturing) {
    // A node is needed if it is captured or one of its children is needed. Children can come
    // after parents in `order` only if reached later, so iterate to a fixed point over a
    // reverse topological order computed by DFS post-order.
    absl::flat_hash_map<Node*, int> visit;  // 0 new, 1 open, 2 done
    std::vector<Node*> post;
    std::vector<std::pair<Node*, size_t>> stack;
    for (Node* r : order) {
      if (visit[r] != 0) continue;
      stack.push_back({r, 0});
      visit[r] = 1;
      while (!stack.empty()) {
        auto& [n, i] = stack.back();
        if (i < n->next_edges().size()) {
          const Edge& e = n->next_edges()[i++];
          if (e.is_valid() && visit[e.function.get()] == 0) {
            visit[e.function.get()] = 1;
            stack.push_back({e.function.get(), 0});
          }
        } else {
          visit[n] = 2;
          post.push_back(n);
          stack.pop_back();
        }
      }
    }
    for (Node* n : post) {  // children before parents
      bool needed = capture_slots.contains(n);
      for (const Edge& e : n->next_edges()) {
        if (e.is_valid() && state[e.function.get()].needed) needed = true;
      }
      state[n].needed = needed;
    }
  }
  for (Node* n : order) {
    if (!state[n].needed) continue;
    for (const Edge& e : n->next_edges()) {
      if (e.is_valid() && state[e.function.get()].needed) ++state[e.function.get()].dependencies;
    }
  }

  // PyTorch's order: the node created last runs first, except that a leaf's AccumulateGrad runs
  // as soon as it is ready (its sequence number dates from the parameter's first use, which would
  // put every parameter's gradient, and the hooks that follow it, such as DDP's bucket
  // all-reduces and FSDP's reduce-scatters, at the end of backward). The gradients are the same
  // either way: a node runs once all of its inputs have arrived.
  struct Ready {
    bool leaf;
    uint64_t sequence_nr;
    Node* node;
  };
  auto lower = [](const Ready& a, const Ready& b) {
    return a.leaf != b.leaf ? b.leaf : a.sequence_nr < b.sequence_nr;
  };
  std::priority_queue<Ready, std::vector<Ready>, decltype(lower)> queue(lower);
  struct ReadyQueue {
    decltype(queue)& q;
    void push(Node* n) {
      q.push({dynamic_cast<AccumulateGrad*>(n) != nullptr, n->sequence_nr(), n});
    }
    bool empty() const { return q.empty(); }
    Node* top() const { return q.top().node; }
    void pop() { q.pop(); }
  } ready{queue};
  for (size_t i = 0; i < roots.size(); ++i) {
    if (!roots[i].is_valid()) continue;
    NodeState& s = state[roots[i].function.get()];
    if (!s.needed) continue;
    accumulate(s.buffer, roots[i].input_nr, root_grads[i]);
  }
  {
    absl::flat_hash_set<Node*> queued;
    for (const Edge& r : roots) {
      Node* n = r.function.get();
      if (n != nullptr && state[n].needed && state[n].dependencies == 0 && queued.insert(n).second) {
        ready.push(n);
      }
    }
  }

  variable_list captured(captures.size());
  while (!ready.empty()) {
    Node* n = ready.top();
    ready.pop();
    NodeState& s = state[n];
    variable_list grads = std::move(s.buffer);
    grads.resize(std::max<size_t>(grads.size(), n->output_metas().size()));
    n->run_pre_hooks(grads);
    if (auto it = capture_slots.find(n); it != capture_slots.end()) {
      for (size_t ci : it->second) {
        const uint32_t slot = captures[ci].input_nr;
        if (slot < grads.size()) captured[ci] = grads[slot];
      }
      // A captured leaf accumulator is not run: grad() does not touch .grad.
      if (dynamic_cast<AccumulateGrad*>(n) != nullptr) continue;
    }
    if (!accumulate_into_leaves && dynamic_cast<AccumulateGrad*>(n) != nullptr) continue;
    // Absent output gradients become zeros so that every node sees defined gradients: here, or
    // when a registry rule first reads one (Node::makes_absent_grads: BackwardCall::grad). A node
    // can tell them from real ones (internal::is_absent_grad) to skip work they would cause.
    bool any_defined = false;
    for (const Tensor& g : grads) any_defined |= g.defined();
    variable_list inputs_grads;
    if (any_defined) {
      variable_list absent;  // holds the zeros, so their addresses stay theirs during apply
      const bool engine_zeros = !n->makes_absent_grads();
      for (size_t i = 0; i < grads.size() && engine_zeros; ++i) {
        if (!grads[i].defined() && i < n->output_metas().size()) {
          grads[i] = zeros_for(n->output_metas()[i]);
          absent.push_back(grads[i]);
        }
      }
      internal::AbsentGradsScope scope(&absent);
      inputs_grads = n->apply(std::move(grads));
    }
    if (!keep_graph) n->release_variables();
    const auto& edges = n->next_edges();
    for (size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.is_valid()) continue;
      NodeState& child = state[e.function.get()];
      if (!child.needed) continue;
      if (i < inputs_grads.size() && inputs_grads[i].defined()) {
        accumulate(child.buffer, e.input_nr, std::move(inputs_grads[i]));
      }
      if (--child.dependencies == 0) ready.push(e.function.get());
    }
  }
  return captured;
}

void make_roots(const variable_list& outputs, const variable_list& grad_outputs,
                const char* op, std::vector<Edge>& roots, variable_list& grads) {
  KILN_CHECK(grad_outputs.empty() || grad_outputs.size() == outputs.size(), "[", op,
             "] got ", grad_outputs.size(), " gradients for ", outputs.size(), " outputs");
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Tensor& out = outputs[i];
    KILN_CHECK(out.defined(), "[", op, "] output ", i, " is undefined");
    KILN_CHECK(out.requires_grad(), "[", op, "] element ", i,
               " of tensors does not require grad and does not have a grad_fn");
    Tensor g = grad_outputs.empty() ? Tensor() : grad_outputs[i];
    if (!g.defined()) {
      KILN_CHECK(out.numel() == 1, "[", op, "] grad can be implicitly created only for outputs "
                 "with one element; output ", i, " has shape ", shape_str(out.sizes()));
      g = ones_like(out);
    } else {
      KILN_CHECK(g.sizes() == out.sizes(), "[", op, "] gradient of shape ",
                 shape_str(g.sizes()), " does not match output ", i, " of shape ",
                 shape_str(out.sizes()));
    }
    roots.push_back(internal::gradient_edge(out));
    grads.push_back(std::move(g));
  }
}

}  // namespace

void backward(const variable_list& outputs, const variable_list& grad_outputs,
              std::optional<bool> retain_graph, bool create_graph, const variable_list& inputs) {
  std::vector<Edge> roots;
  variable_list grads;
  make_roots(outputs, grad_outputs, "backward", roots, grads);
  const bool keep = retain_graph.value_or(create_graph);
  if (inputs.empty()) {
    run_backward(roots, grads, keep, create_graph, {}, /*accumulate_into_leaves=*/true);
    return;
  }
  // Only the given inputs accumulate: capture at their edges and add into their grad().
  std::vector<Edge> captures;
  for (const Tensor& in : inputs) {
    KILN_CHECK(in.requires_grad(), "[backward] an input does not require grad");
    captures.push_back(internal::gradient_edge(in));
  }
  variable_list got = run_backward(roots, grads, keep, create_graph, captures, false);
  NoGradGuard no_grad;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!got[i].defined()) continue;
    Tensor& g = internal::meta(inputs[i]).grad;
    g = g.defined() ? g + got[i] : got[i].detach().clone();
  }
}

variable_list grad(const variable_list& outputs, const variable_list& inputs,
                   const variable_list& grad_outputs, std::optional<bool> retain_graph,
                   bool create_graph, bool allow_unused) {
  std::vector<Edge> roots;
  variable_list grads;
  make_roots(outputs, grad_outputs, "autograd::grad", roots, grads);
  std::vector<Edge> captures;
  for (size_t i = 0; i < inputs.size(); ++i) {
    KILN_CHECK(inputs[i].defined() && inputs[i].requires_grad(), "[autograd::grad] input ", i,
               " does not require grad");
    captures.push_back(internal::gradient_edge(inputs[i]));
  }
  variable_list got = run_backward(roots, grads, retain_graph.value_or(create_graph),
                                   create_graph, captures, false);
  for (size_t i = 0; i < got.size(); ++i) {
    KILN_CHECK(got[i].defined() || allow_unused, "[autograd::grad] one of the differentiated "
               "tensors (input ", i, ") appears to not have been used in the graph; set "
               "allow_unused=true if this is the desired behavior");
    if (got[i].defined() && !create_graph) got[i] = got[i].detach();
  }
  return got;
}

}  // namespace kiln::autograd
