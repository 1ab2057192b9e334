// The autograd engine: recording, backward, grad(), hooks, higher order, errors, memory.
#include <gtest/gtest.h>
#include <pthread.h>

#include <memory>
#include <thread>

#include <kiln/kiln.h>

#include "autograd/backward_util.h"
#include "test_util.h"

namespace kiln {
namespace {

using autograd::variable_list;

Tensor leaf(IntArrayRef sizes, ScalarType dt = kDouble) {
  return randn(sizes, TensorOptions(dt)).requires_grad_(true);
}

TEST(EngineTest, RecordsGraphOnlyWhenNeeded) {
  Tensor x = leaf({3});
  Tensor c = randn({3}, kDouble);
  EXPECT_TRUE(x.is_leaf());
  EXPECT_EQ(x.grad_fn(), nullptr);
  Tensor y = x * c;
  EXPECT_FALSE(y.is_leaf());
  EXPECT_TRUE(y.requires_grad());
  EXPECT_NE(y.grad_fn(), nullptr);
  EXPECT_FALSE((c * c).requires_grad());
  {
    NoGradGuard no_grad;
    EXPECT_FALSE((x * c).requires_grad());
    AutoGradMode on(true);
    EXPECT_TRUE((x * c).requires_grad());
  }
  {
    InferenceMode guard;
    EXPECT_TRUE(InferenceMode::is_enabled());
    EXPECT_FALSE((x * c).requires_grad());
  }
  // Integer results carry no gradient.
  EXPECT_FALSE(x.argmax().requires_grad());
  EXPECT_FALSE((x > 0).requires_grad());
}

TEST(EngineTest, AccumulatesIntoLeaves) {
  Tensor x = leaf({2, 3});
  (x * 2).sum().backward();
  (x * 3).sum().backward();
  EXPECT_TRUE(allclose(x.grad(), full({2, 3}, 5.0, kDouble)));
  x.mutable_grad().zero_();
  EXPECT_TRUE(allclose(x.grad(), zeros({2, 3}, kDouble)));
  // A leaf used twice in one graph gets the sum of both paths.
  Tensor z = leaf({4});
  (z * z + z).sum().backward();
  EXPECT_TRUE(allclose(z.grad(), z.detach() * 2 + 1));
}

TEST(EngineTest, BackwardWithGradientAndInputs) {
  Tensor x = leaf({3}), w = leaf({3});
  Tensor y = x * w;
  Tensor g = tensor({1.0, 2.0, 3.0}, kDouble);
  y.backward(g, /*retain_graph=*/true, false, {x});
  EXPECT_TRUE(allclose(x.grad(), g * w.detach()));
  EXPECT_FALSE(w.grad().defined());
  EXPECT_KILN_ERROR(y.backward(), "grad can be implicitly created only for outputs with one");
  EXPECT_KILN_ERROR(y.backward(ones({2}, kDouble)), "[backward] gradient of shape [2]");
}

TEST(EngineTest, GradDoesNotTouchDotGrad) {
  Tensor x = leaf({3});
  Tensor y = (x * x).sum();
  auto g = autograd::grad({y}, {x});
  EXPECT_TRUE(allclose(g[0], x.detach() * 2));
  EXPECT_FALSE(x.grad().defined());
  EXPECT_FALSE(g[0].requires_grad());
}

TEST(EngineTest, GradAllowUnused) {
  Tensor x = leaf({2}), unused = leaf({2});
  Tensor y = (x * 2).sum();
  EXPECT_KILN_ERROR(autograd::grad({y}, {x, unused}, {}, true),
                    "appears to not have been used in the graph");
  auto g = autograd::grad({y}, {x, unused}, {}, true, false, /*allow_unused=*/true);
  EXPECT_TRUE(g[0].defined());
  EXPECT_FALSE(g[1].defined());
  Tensor c = ones({2});
  EXPECT_KILN_ERROR(autograd::grad({c.sum()}, {x}), "does not require grad");
}

TEST(EngineTest, GradOfNonLeafInput) {
  Tensor x = leaf({3});
  Tensor h = x.exp();
  Tensor y = (h * h).sum();
  auto g = autograd::grad({y}, {h});
  EXPECT_TRUE(allclose(g[0], h.detach() * 2));
}

TEST(EngineTest, HigherOrderHessianVectorProduct) {
  // f(x) = sum(x^3): gradient 3x^2, Hessian diag(6x); Hv = 6 x v.
  Tensor x = leaf({4});
  Tensor v = randn({4}, kDouble);
  Tensor y = x.pow(3).sum();
  auto g = autograd::grad({y}, {x}, {}, true, /*create_graph=*/true);
  EXPECT_TRUE(g[0].requires_grad());
  auto hv = autograd::grad({(g[0] * v).sum()}, {x}, {}, /*retain_graph=*/true);
  EXPECT_TRUE(allclose(hv[0], x.detach() * v * 6));
  // Third order through create_graph twice: d3/dx3 sum(x^3) = 6.
  auto g2 = autograd::grad({g[0].sum()}, {x}, {}, true, true);
  auto g3 = autograd::grad({g2[0].sum()}, {x});
  EXPECT_TRUE(allclose(g3[0], full({4}, 6.0, kDouble)));
}

TEST(EngineTest, BackwardTwiceNeedsRetainGraph) {
  Tensor x = leaf({3});
  Tensor y = (x.exp() * x).sum();
  y.backward(Tensor(), /*retain_graph=*/true);
  y.backward();
  EXPECT_TRUE(allclose(x.grad(), (x.detach().exp() * (x.detach() + 1)) * 2));
  EXPECT_KILN_ERROR(y.backward(), "retain_graph=true");
}

TEST(EngineTest, InplaceOnSavedTensorIsDetected) {
  Tensor x = leaf({3});
  Tensor h = x * 2;
  Tensor y = (h * h).sum();  // saves h
  {
    NoGradGuard no_grad;
    h.add_(1);
  }
  EXPECT_KILN_ERROR(y.backward(), "modified by an inplace operation");
}

TEST(EngineTest, InplaceOnLeafIsRefused) {
  Tensor x = leaf({3});
  EXPECT_KILN_ERROR(x.add_(1), "a leaf Variable that requires grad is being used in an in-place");
  {
    NoGradGuard no_grad;
    x.add_(1);  // fine outside the graph (as an optimizer does)
  }
}

TEST(EngineTest, InplaceOnNonLeafRecordsHistory) {
  Tensor x = leaf({3});
  Tensor y = x * 2;
  y.mul_(x);  // y = 2 x^2
  EXPECT_EQ(y.grad_fn()->name(), "MulBackward0");
  y.sum().backward();
  EXPECT_TRUE(allclose(x.grad(), x.detach() * 4));
}

TEST(EngineTest, HooksSeeAndReplaceGradients) {
  Tensor x = leaf({3});
  Tensor y = x * 3;
  Tensor seen;
  y.register_hook([&](const Tensor& g) { seen = g.clone(); });
  const unsigned h = x.register_hook([](const Tensor& g) { return g * 10; });
  y.sum().backward();
  EXPECT_TRUE(allclose(seen, ones({3}, kDouble)));
  EXPECT_TRUE(allclose(x.grad(), full({3}, 30.0, kDouble)));
  x.remove_hook(h);
  x.mutable_grad().zero_();
  (x * 3).sum().backward();
  EXPECT_TRUE(allclose(x.grad(), full({3}, 3.0, kDouble)));
  Tensor c = ones({2});
  EXPECT_KILN_ERROR(c.register_hook([](const Tensor& g) { return g; }), "[register_hook]");
}

TEST(EngineTest, RetainGradOnNonLeaf) {
  Tensor x = leaf({3});
  Tensor y = x * 2;
  y.retain_grad();
  EXPECT_TRUE(y.retains_grad());
  (y * y).sum().backward();
  EXPECT_TRUE(allclose(y.grad(), y.detach() * 2));
  Tensor z = (x * 2);
  (z * z).sum().backward();
  EXPECT_FALSE(z.grad().defined());  // not retained
}

TEST(EngineTest, DetachAndRequiresGradFlags) {
  Tensor x = leaf({3});
  Tensor y = x * 2;
  Tensor d = y.detach();
  EXPECT_FALSE(d.requires_grad());
  EXPECT_EQ(d.data_ptr(), y.data_ptr());
  EXPECT_KILN_ERROR(y.requires_grad_(false), "only change requires_grad flags of leaf");
  y.detach_();
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(y.is_leaf());
}

TEST(EngineTest, MissingBackwardRuleFailsAtBackward) {
  // An op with a floating output and no rule fails only when backward reaches it. Every op
  // has a rule now (tests/autograd/coverage_test.cpp), so as_strided's is taken away here.
  struct RuleRemoved {
    OpDef& op = Registry::get().entry("as_strided");
    BackwardFn saved = op.backward;
    RuleRemoved() { op.backward = nullptr; }
    ~RuleRemoved() { op.backward = saved; }
  } removed;
  Tensor x = leaf({2, 2});
  Tensor y = x.as_strided({2}, {1});
  EXPECT_TRUE(y.requires_grad());
  EXPECT_KILN_ERROR(y.sum().backward(), "is not implemented");
}

TEST(EngineTest, LongChainHasNoRecursionLimit) {
  Tensor x = leaf({1});
  Tensor y = x;
  for (int i = 0; i < 100000; ++i) y = y * 1.0;
  y.sum().backward();
  EXPECT_DOUBLE_EQ(x.grad().item<double>(), 1.0);
}

// Frees *y (and the graph only it holds) on a thread with a 1 MiB stack.
void free_on_small_stack(std::unique_ptr<Tensor>& y) {
  pthread_attr_t attr;
  ASSERT_EQ(pthread_attr_init(&attr), 0);
  ASSERT_EQ(pthread_attr_setstacksize(&attr, 1 << 20), 0);
  pthread_t thread;
  auto free_chain = [](void* p) -> void* {
    static_cast<std::unique_ptr<Tensor>*>(p)->reset();
    return nullptr;
  };
  ASSERT_EQ(pthread_create(&thread, &attr, free_chain, &y), 0);
  ASSERT_EQ(pthread_join(thread, nullptr), 0);
  pthread_attr_destroy(&attr);
  EXPECT_EQ(y, nullptr);
}

// The chain is freed on a thread with a 1 MiB stack: released node by node from inside each
// other's destructors, 100000 nodes need several times that (the sanitizer build overflowed
// 8 MiB in LongChainHasNoRecursionLimit).
TEST(EngineTest, LongChainIsFreedWithoutDeepRecursion) {
  Tensor x = leaf({1});
  auto y = std::make_unique<Tensor>(x);
  for (int i = 0; i < 100000; ++i) *y = *y * 1.0;
  free_on_small_stack(y);
}

// x * 1 as a custom function that keeps its input for backward twice: saved (with its version
// check) and in saved_data. Both hold the input's grad_fn, as the node's edge does.
struct KeepsInput : public autograd::Function<KeepsInput> {
  static Tensor forward(autograd::AutogradContext* ctx, Tensor x) {
    ctx->save_for_backward({x});
    ctx->saved_data["x"] = x;
    return x * 1.0;
  }
  static variable_list backward(autograd::AutogradContext* ctx, variable_list grads) {
    EXPECT_EQ(ctx->get_saved_variables().size(), 1u);
    return {grads[0]};
  }
};

// Custom function nodes are freed one at a time too (~CppNode), in a chain of them alone and in
// one mixed with op nodes (each kind of node releasing the other), on a 1 MiB stack; the chain
// still runs backward.
TEST(EngineTest, LongChainOfCustomFunctionsIsFreedWithoutDeepRecursion) {
  Tensor x = leaf({1});
  auto y = std::make_unique<Tensor>(x);
  for (int i = 0; i < 100000; ++i) *y = KeepsInput::apply(*y);
  free_on_small_stack(y);
  y = std::make_unique<Tensor>(x);
  for (int i = 0; i < 100000; ++i) *y = i % 3 == 0 ? *y * 1.0 : KeepsInput::apply(*y);
  y->sum().backward(Tensor(), /*retain_graph=*/true);
  EXPECT_DOUBLE_EQ(x.grad().item<double>(), 1.0);
  free_on_small_stack(y);
}

TEST(EngineTest, SavedTensorsAreFreedAfterBackward) {
  Tensor x = leaf({1000});
  std::weak_ptr<StorageImpl> saved;
  Tensor y;
  {
    Tensor h = x.exp();  // exp saves its output, held only by the graph after this scope
    saved = h.impl()->storage();
    y = (h * h).sum();
  }
  EXPECT_FALSE(saved.expired());
  y.backward();
  EXPECT_TRUE(saved.expired());
  // With retain_graph the saved tensors stay until the graph goes.
  std::weak_ptr<StorageImpl> kept;
  {
    Tensor h = x.exp();
    kept = h.impl()->storage();
    Tensor z = (h * h).sum();
    z.backward(Tensor(), /*retain_graph=*/true);
    EXPECT_FALSE(kept.expired());
  }
  EXPECT_TRUE(kept.expired());
}

TEST(EngineTest, IndependentGraphsRunConcurrently) {
  std::vector<std::thread> threads;
  std::vector<bool> ok(4, false);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t, &ok] {
      Tensor x = full({64}, static_cast<double>(t + 1), TensorOptions(kDouble)).requires_grad_(true);
      Tensor y = x;
      for (int i = 0; i < 200; ++i) y = (y * 1.01).tanh();
      y.sum().backward();
      ok[t] = x.grad().defined() && x.grad().numel() == 64;
    });
  }
  for (auto& th : threads) th.join();
  for (bool b : ok) EXPECT_TRUE(b);
}

// What the backward of TwoOutputs saw on this thread: per call, is_absent_grad of each gradient.
thread_local std::vector<std::vector<bool>> t_absent_seen;

// (x * 2, x * 3), whose backward records which of its gradients the engine made up as zeros;
// with `nested`, it runs a whole other backward in between (as checkpoint's recomputation does)
// and records again after it.
struct TwoOutputs : public autograd::Function<TwoOutputs> {
  static variable_list forward(autograd::AutogradContext* ctx, Tensor x, bool nested) {
    ctx->saved_data["nested"] = nested;
    return {x * 2.0, x * 3.0};
  }
  static variable_list backward(autograd::AutogradContext* ctx, variable_list grads) {
    auto seen = [&] {
      return std::vector<bool>{autograd::internal::is_absent_grad(grads[0]),
                               autograd::internal::is_absent_grad(grads[1])};
    };
    t_absent_seen.push_back(seen());
    if (ctx->saved_data["nested"].toBool()) {
      AutoGradMode enable(true);
      Tensor z = full({2}, 1.0, TensorOptions(kDouble)).requires_grad_(true);
      (void)autograd::grad({TwoOutputs::apply(z, false)[1].sum()}, {z});
      t_absent_seen.push_back(seen());
    }
    return {grads[0] * 2.0 + grads[1] * 3.0, Tensor()};
  }
};

// The zeros the engine gives a rule for an output that received no gradient are told apart from
// gradients that arrived (even zero ones), per node and per thread; nothing is absent outside a
// rule.
TEST(EngineTest, AbsentGradientsAreToldApartFromZeros) {
  Tensor x = leaf({3});
  t_absent_seen.clear();
  TwoOutputs::apply(x, false)[0].sum().backward();
  TwoOutputs::apply(x, false)[1].sum().backward();
  {
    variable_list y = TwoOutputs::apply(x, false);
    (y[0].sum() + y[1].sum()).backward();
  }
  {
    variable_list y = TwoOutputs::apply(x, false);
    (void)autograd::grad(y, {x}, {ones_like(y[0]), zeros_like(y[1])});  // a zero gradient
  }
  using Seen = std::vector<std::vector<bool>>;
  EXPECT_EQ(t_absent_seen, (Seen{{false, true}, {true, false}, {false, false}, {false, false}}));
  EXPECT_TRUE(allclose(x.grad(), full({3}, 10.0, kDouble)));
  EXPECT_FALSE(autograd::internal::is_absent_grad(zeros({3})));
  EXPECT_FALSE(autograd::internal::is_absent_grad(Tensor()));

  // A backward nested in a rule sees its own absent gradients and leaves the outer rule's.
  t_absent_seen.clear();
  TwoOutputs::apply(x, true)[0].sum().backward();
  EXPECT_EQ(t_absent_seen, (Seen{{false, true}, {true, false}, {false, true}}));

  // Threads running backward at once each see their own.
  std::vector<std::thread> threads;
  std::vector<Seen> per_thread(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t, &per_thread] {
      Tensor z = full({8}, 1.0, TensorOptions(kDouble)).requires_grad_(true);
      for (int i = 0; i < 50; ++i) TwoOutputs::apply(z, false)[t % 2].sum().backward();
      per_thread[t] = t_absent_seen;
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) {
    EXPECT_EQ(per_thread[t], Seen(50, {t % 2 == 1, t % 2 == 0})) << "thread " << t;
  }
}

TEST(EngineTest, NodeNamesFollowPyTorch) {
  Tensor x = leaf({2, 3});
  EXPECT_EQ((x * 2).grad_fn()->name(), "MulBackward0");
  EXPECT_EQ(x.sum().grad_fn()->name(), "SumBackward0");
  EXPECT_EQ(x.log_softmax(1).grad_fn()->name(), "LogSoftmaxBackward0");
  EXPECT_EQ(x.t().grad_fn()->name(), "PermuteBackward0");
  EXPECT_EQ(x.view({-1}).grad_fn()->name(), "ViewBackward0");
}

}  // namespace
}  // namespace kiln
