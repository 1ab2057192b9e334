// Helpers of the gradient-check suites (tests/autograd/*_grad_test.cpp): float64 leaves and
// check_grad, which runs gradcheck (and optionally gradgradcheck) after making sure that the
// ops the test claims to cover really are in the recorded graph.
#pragma once

#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace kiln::gradtest {

using autograd::variable_list;
using GradFn = std::function<Tensor(const variable_list&)>;

// A float64 leaf that requires grad, randn * scale + shift.
inline Tensor leaf(IntArrayRef sizes, double scale = 1.0, double shift = 0.0) {
  Tensor t;
  {
    NoGradGuard no_grad;
    t = randn(sizes, kDouble) * scale + shift;
  }
  return t.requires_grad_(true);
}

// A float64 leaf with the given values (row-major) and shape.
inline Tensor leaf_of(const std::vector<double>& values, IntArrayRef sizes) {
  return tensor(values, kDouble).reshape(sizes).contiguous().detach().requires_grad_(true);
}

// A float64 leaf whose elements are spread apart, in a random order: no ties, no two elements
// and no two absolute values within 0.1 of each other, none within 0.1 of 0. For max/min, sort,
// topk and the norms.
inline Tensor distinct_leaf(IntArrayRef sizes) {
  Tensor t;
  {
    NoGradGuard no_grad;
    const int64_t n = numel_of(sizes);
    t = (randperm(n).to(kDouble) * 0.5 - (0.25 * static_cast<double>(n) - 0.1)).reshape(sizes);
  }
  return t.contiguous().requires_grad_(true);
}

// The grad_fn names ("MulBackward0", ...) of every node in the graph of `out`.
inline std::set<std::string> graph_node_names(const Tensor& out) {
  std::set<std::string> names;
  std::vector<std::shared_ptr<autograd::Node>> stack;
  std::set<const autograd::Node*> seen;
  if (out.grad_fn()) stack.push_back(out.grad_fn());
  while (!stack.empty()) {
    auto n = stack.back();
    stack.pop_back();
    if (!seen.insert(n.get()).second) continue;
    names.insert(n->name());
    for (const auto& e : n->next_edges()) {
      if (e.is_valid()) stack.push_back(e.function);
    }
  }
  return names;
}

// gradcheck of fn at inputs (and gradgradcheck when `gradgrad`), after checking that the graph
// of fn(inputs) holds a node of each op in `ops` (registry names; "mul_" is "MulBackward0").
// For gradgradcheck the ops are looked for in the graph of the vector-Jacobian product too.
inline ::testing::AssertionResult check_grad(const std::vector<std::string>& ops, const GradFn& fn,
                                             const variable_list& inputs, bool gradgrad = false,
                                             autograd::GradcheckOptions options = {}) {
  try {
    const Tensor out = fn(inputs);
    const std::set<std::string> names = graph_node_names(out);
    for (const std::string& op : ops) {
      if (!names.count(autograd::backward_node_name(op))) {
        std::string all;
        for (const auto& n : names) all += n + " ";
        return ::testing::AssertionFailure()
               << "op " << op << " is not in the graph (nodes: " << all << ")";
      }
    }
    autograd::gradcheck(fn, inputs, options);
    if (gradgrad) autograd::gradgradcheck(fn, inputs, options);
  } catch (const Error& e) {
    std::string list;
    for (const auto& op : ops) list += op + " ";
    return ::testing::AssertionFailure() << "[" << list << "] " << e.what();
  }
  return ::testing::AssertionSuccess();
}

// The gradient of sum(fn(x) * w) with respect to x, for hand-computed expectations.
inline Tensor grad_of(const GradFn& fn, const Tensor& x) {
  const Tensor out = fn({x});
  const Tensor w = ones_like(out);
  return autograd::grad({out}, {x}, {w})[0];
}

}  // namespace kiln::gradtest
