// kiln::checkpoint: gradients equal the plain function's (inputs and captured parameters), the
// recomputation draws the same dropout mask, and compiled code honours it.
#include "autograd/checkpoint.h"

#include <gtest/gtest.h>

#include "kiln.h"
#include "test_util.h"

namespace kiln {
namespace {

namespace F = nn::functional;

TEST(Checkpoint, GradientsMatchThePlainFunction) {
  manual_seed(4);
  nn::Linear fc(6, 6);
  auto block = [&](const Tensor& x) { return F::gelu(fc(x)) * x; };
  const Tensor x0 = randn({3, 6}), go = randn({3, 6});
  Tensor xa = x0.clone().requires_grad_(true), xb = x0.clone().requires_grad_(true);
  const Tensor ya = checkpoint(block, xa);
  EXPECT_EQ(ya.grad_fn()->name(), "CheckpointBackward");
  ya.backward(go);
  const Tensor gw = fc->weight.grad().clone(), gb = fc->bias.grad().clone();
  fc->zero_grad();
  const Tensor yb = block(xb);
  yb.backward(go);
  EXPECT_TRUE(equal(ya.detach(), yb.detach()));
  EXPECT_TRUE(allclose(xa.grad(), xb.grad(), 1e-6, 1e-7));
  EXPECT_TRUE(allclose(gw, fc->weight.grad(), 1e-6, 1e-7));
  EXPECT_TRUE(allclose(gb, fc->bias.grad(), 1e-6, 1e-7));
}

TEST(Checkpoint, RecomputationDrawsTheSameDropoutMask) {
  auto block = [](const Tensor& x) {
    return F::dropout(x, F::DropoutFuncOptions().p(0.5).training(true)) * 3.0;
  };
  manual_seed(8);
  Tensor x = ones({256}).requires_grad_(true);
  const Tensor y = checkpoint(block, x);
  const Tensor after_forward = randn({1});  // the generator moves on; backward must not care
  y.sum().backward();
  // d(sum(mask * x * 3 / (1 - p)))/dx is 6 where the forward kept an element, else 0.
  EXPECT_TRUE(equal(x.grad(), (y.detach() != 0.0).to(kFloat) * 6.0));
}

TEST(Checkpoint, WithoutGradModeItIsThePlainCall) {
  NoGradGuard no_grad;
  const Tensor x = randn({4});
  const Tensor y = checkpoint([](const Tensor& t) { return t.exp(); }, x);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(equal(y, x.exp()));
}

TEST(Checkpoint, SecondBackwardIsAClearError) {
  Tensor x = randn({3}).requires_grad_(true);
  const Tensor y = checkpoint([](const Tensor& t) { return t.sin(); }, x).sum();
  y.backward();
  EXPECT_KILN_ERROR(y.backward(), "backward");
}

TEST(Checkpoint, CompiledStepHonoursIt) {
  manual_seed(21);
  nn::Linear a(5, 5), b(5, 5);
  auto step = [&](const Tensor& x, bool use_checkpoint) {
    a->zero_grad();
    b->zero_grad();
    auto block = [&](const Tensor& h) { return F::gelu(a(h)); };
    const Tensor h = use_checkpoint ? checkpoint(block, x) : block(x);
    Tensor loss = b(h).square().mean();
    loss.backward();
    return loss;
  };
  const Tensor x = randn({4, 5});
  auto compiled = compile([&](const Tensor& in) { return step(in, true); });
  const Tensor lc = compiled(x);
  const Tensor ga = a->weight.grad().clone(), gb = b->weight.grad().clone();
  const Tensor le = step(x, false);
  EXPECT_TRUE(allclose(lc, le, 1e-6, 1e-7));
  EXPECT_TRUE(allclose(ga, a->weight.grad(), 1e-5, 1e-7));
  EXPECT_TRUE(allclose(gb, b->weight.grad(), 1e-5, 1e-7));
  // The recomputation is part of the compiled program: gelu runs twice, once in the backward.
  int gelus = 0;
  for (const auto& op : compiled.traces().front().ops) gelus += op.name() == "gelu";
  EXPECT_EQ(gelus, 2) << compiled.traces().front().str();
}

TEST(Checkpoint, CompiledFunctionRecomputesTheSameDropoutInItsBackward) {
  auto fn = [](const Tensor& x) {
    return checkpoint(
        [](const Tensor& h) {
          return F::dropout(h, F::DropoutFuncOptions().p(0.5).training(true)).tanh();
        },
        x);
  };
  auto compiled = compile(fn);
  for (int i = 0; i < 2; ++i) {
    const Tensor x0 = randn({64});
    Tensor xc = x0.clone().requires_grad_(true), xe = x0.clone().requires_grad_(true);
    manual_seed(30 + i);
    const Tensor yc = compiled(xc);
    yc.sum().backward();
    manual_seed(30 + i);
    const Tensor ye = fn(xe);
    ye.sum().backward();
    EXPECT_TRUE(equal(yc.detach(), ye.detach()));
    EXPECT_TRUE(allclose(xc.grad(), xe.grad(), 1e-6, 1e-7));
  }
  EXPECT_EQ(compiled.stats().hits, 1);
}

}  // namespace
}  // namespace kiln
