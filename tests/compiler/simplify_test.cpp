// The simplify pass (compiler/passes.h): a product by the constant one a backward seeds is its
// other factor (a linear_cross_entropy training step's head and hidden-state gradients), bit for
// bit as eager; products it must keep (another constant, an argument, a product of another dtype,
// a factor written in place, by a single or a multi-tensor in-place op) stay, and a product written
// in place is its factor when nothing else reads that; an optimizer update
// writes its parameters and moments, not the gradients it reads. Also: an op's backward that
// never reads the gradient of an output that received none makes no zeros for it
// (BackwardCall::grad, autograd/engine.cpp).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "compiler/compile.h"
#include "compiler/passes.h"
#include "compiler/tracer.h"
#include "trace_test_util.h"
#include "kiln.h"

namespace kiln {
namespace {

using compiler::Trace;
using test::count_ops;
using test::stage;
using test::expect_bitwise;

// The head and loss of a language model: its backward scales the stored dx and dweight by the
// loss's gradient, a constant one in a compiled step.
TEST(Simplify, LinearCrossEntropyStepScalesByNoOne) {
  manual_seed(3);
  const Tensor w0 = randn({40, 16}), x0 = randn({12, 16});
  const Tensor targets = randint(0, 40, {12});
  Tensor w_eager = w0.clone().requires_grad_(), w_compiled = w0.clone().requires_grad_();
  auto step_fn = [&](Tensor& w, const Tensor& x) {
    w.mutable_grad() = Tensor();
    Tensor xr = x.clone().requires_grad_();
    Tensor loss = linear_cross_entropy(xr, w, targets);
    loss.backward();
    return std::vector<Tensor>{loss, xr.grad()};
  };
  auto step = compile([&](const Tensor& x) { return step_fn(w_compiled, x); });
  for (int i = 0; i < 3; ++i) {
    const Tensor x = x0 * static_cast<double>(i + 1);
    const std::vector<Tensor> want = step_fn(w_eager, x);
    const std::vector<Tensor> got = step(x);
    expect_bitwise(got[0], want[0], "loss");
    expect_bitwise(got[1], want[1], "dx");
    expect_bitwise(w_compiled.grad(), w_eager.grad(), "dweight");
  }
  const Trace& before = stage(step.traces(), "functionalize");
  const Trace& after = stage(step.traces(), "simplify");
  EXPECT_EQ(count_ops(before, "mul"), 2) << before.str();
  EXPECT_EQ(count_ops(after, "mul"), 0) << after.str();
  // The gradients of the op's dx and dweight outputs (which nothing read) are not made.
  EXPECT_EQ(count_ops(stage(step.traces(), "traced"), "fill_"), 1)
      << stage(step.traces(), "traced").str();
}

Trace simplified(const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& fn,
                 const std::vector<Tensor>& args) {
  NoGradGuard no_grad;
  return compiler::simplify(compiler::trace_callable(fn, args).trace);
}

// A 0-d f32 constant as the engine seeds a backward (ones_like: empty, then fill_, in the trace).
Tensor constant(const Tensor& like, double value) {
  Tensor c = empty_like(like.sum().to(kFloat));
  c.fill_(value);
  return c;
}

TEST(Simplify, KeepsProductsThatAreNotTheirFactor) {
  const Tensor a = randn({3, 4});
  // By one: an intermediate factor goes, in either order.
  Trace t = simplified(
      [](const std::vector<Tensor>& in) {
        const Tensor one = constant(in[0], 1.0);
        return std::vector<Tensor>{in[0].exp() * one, one * in[0].sin()};
      },
      {a});
  EXPECT_EQ(count_ops(t, "mul"), 0) << t.str();
  // By another constant; an argument; a product of another dtype (int64 * f32 one is f32).
  t = simplified(
      [](const std::vector<Tensor>& in) {
        return std::vector<Tensor>{in[0].exp() * constant(in[0], 2.0), in[0] * constant(in[0], 1.0),
                                   in[1].abs() * constant(in[0], 1.0)};
      },
      {a, randint(0, 5, {3})});
  EXPECT_EQ(count_ops(t, "mul"), 3) << t.str();
  // A factor written in place after the product (the product must keep the old values).
  t = simplified(
      [](const std::vector<Tensor>& in) {
        Tensor e = in[0].exp();
        Tensor p = e * constant(in[0], 1.0);
        e.add_(1.0);
        return std::vector<Tensor>{p, e};
      },
      {a});
  EXPECT_EQ(count_ops(t, "mul"), 1) << t.str();
}

// A product written in place (compiled DDP's in-place all-reduce of a tied table's gradient)
// goes when nothing else reads its factor: the factor is written instead. It stays when the
// factor is read elsewhere, handed out, or when another product by one reads the written one.
TEST(Simplify, ProductWrittenInPlaceIsItsFactorWhenNothingElseReadsIt) {
  const Tensor a = randn({3, 4});
  auto written_product = [](const std::vector<Tensor>& in) {
    Tensor p = in[0].exp() * constant(in[0], 1.0);
    p.add_(1.0);
    return std::vector<Tensor>{p, p.sin()};
  };
  Trace t = simplified(written_product, {a});
  EXPECT_EQ(count_ops(t, "mul"), 0) << t.str();
  {
    NoGradGuard no_grad;
    auto compiled = compile(written_product);
    for (int i = 0; i < 2; ++i) {
      const std::vector<Tensor> want = written_product({a});
      const std::vector<Tensor> got = compiled(std::vector<Tensor>{a});
      expect_bitwise(got[0], want[0], "p");
      expect_bitwise(got[1], want[1], "p.sin()");
    }
  }
  // The factor read after the write, or handed out; a second product keeping the old values.
  for (const bool hand_out : {false, true}) {
    t = simplified(
        [hand_out](const std::vector<Tensor>& in) {
          Tensor e = in[0].exp();
          Tensor p = e * constant(in[0], 1.0);
          p.add_(1.0);
          return std::vector<Tensor>{p, hand_out ? e : e.sin()};
        },
        {a});
    EXPECT_EQ(count_ops(t, "mul"), 1) << (hand_out ? "handed out: " : "read: ") << t.str();
  }
  t = simplified(
      [](const std::vector<Tensor>& in) {
        const Tensor one = constant(in[0], 1.0);
        Tensor p = in[0].exp() * one;
        const Tensor q = p * one;  // p's values before the add
        p.add_(1.0);
        return std::vector<Tensor>{p, q};
      },
      {a});
  EXPECT_EQ(count_ops(t, "mul"), 1) << t.str();
}

// A multi-tensor in-place op writes only the inputs its OpDef::mutated names: foreach_mul_ writes
// its tensors, not its scale, so a product by one that only the scale reads goes, while one whose
// factor foreach_mul_ writes afterwards stays.
TEST(Simplify, MultiTensorInPlaceOpsWriteOnlyTheirMutatedInputs) {
  const Tensor a = randn({3, 4});
  const Trace t = simplified(
      [](const std::vector<Tensor>& in) {
        const Tensor one = constant(in[0], 1.0);
        Tensor written = in[0].exp();
        const Tensor kept = written * one;             // its factor is written below: stays
        const Tensor scale = in[0].sum().sin() * one;  // only read by foreach_mul_: goes
        Tensor other = in[0].cos();
        foreach_mul_({written, other}, scale);
        return std::vector<Tensor>{kept, written, other};
      },
      {a});
  EXPECT_EQ(count_ops(t, "mul"), 1) << t.str();
}

// A training step with its AdamW update in the program: the update reads the head's weight
// gradient (its product by the loss's gradient of one goes) and writes the parameter and moments.
TEST(Simplify, OptimizerUpdateReadsTheGradientsItDoesNotWrite) {
  manual_seed(5);
  const Tensor w0 = randn({40, 16}), x0 = randn({12, 16});
  const Tensor targets = randint(0, 40, {12});
  Tensor w_eager = w0.clone().requires_grad_(), w_compiled = w0.clone().requires_grad_();
  optim::AdamW opt_eager({w_eager}, optim::AdamWOptions(1e-2));
  optim::AdamW opt_compiled({w_compiled}, optim::AdamWOptions(1e-2));
  auto step_fn = [&](optim::AdamW& opt, Tensor& w, const Tensor& x) {
    opt.zero_grad();
    Tensor loss = linear_cross_entropy(x, w, targets);
    loss.backward();
    opt.step();
    return loss;
  };
  auto step = compile([&](const Tensor& x) { return step_fn(opt_compiled, w_compiled, x); });
  for (int i = 0; i < 3; ++i) {
    const Tensor x = x0 * static_cast<double>(i + 1);
    expect_bitwise(step(x), step_fn(opt_eager, w_eager, x), "loss");
    expect_bitwise(w_compiled, w_eager, "weight after the update");
    expect_bitwise(w_compiled.grad(), w_eager.grad(), "dweight");
  }
  const Trace& before = stage(step.traces(), "functionalize");
  const Trace& after = stage(step.traces(), "simplify");
  EXPECT_EQ(count_ops(before, "mul"), 1) << before.str();
  EXPECT_EQ(count_ops(after, "mul"), 0) << after.str();
}

// Two parameters whose gradients are the same computation (two biases added to one input):
// the compiled step hands out two tensors, with and without an optimizer update in the program,
// so that changing one gradient in place (a clip, an accumulation) leaves the other.
TEST(Cse, GradientsOfTwoParametersStayTwoTensors) {
  const Tensor x = randn({3, 4});
  for (bool with_update : {false, true}) {
    SCOPED_TRACE(with_update ? "with AdamW in the program" : "backward only");
    Tensor b1 = zeros({4}).requires_grad_(), b2 = zeros({4}).requires_grad_();
    optim::AdamW opt({b1, b2}, optim::AdamWOptions(1e-2));
    auto step = compile([&](const Tensor& in) {
      opt.zero_grad();
      Tensor loss = ((in + b1) + b2).square().sum();  // both gradients: dy summed over rows
      loss.backward();
      if (with_update) opt.step();
      return loss;
    });
    for (int i = 0; i < 2; ++i) (void)step(x);
    ASSERT_TRUE(b1.grad().defined() && b2.grad().defined());
    EXPECT_FALSE(b1.grad().is_same(b2.grad()));
    EXPECT_NE(b1.grad().data_ptr(), b2.grad().data_ptr());
    const Tensor before = b2.grad().clone();
    b1.grad().mul_(3.0);
    expect_bitwise(b2.grad(), before, "b2's gradient after b1's is scaled");
  }
}

// Two returned results that are the same computation stay two tensors, as eager code returns.
TEST(Cse, ReturnedTensorsStayTwoTensors) {
  const Tensor x = randn({3, 4});
  auto fn = compile([](const Tensor& in) { return std::vector<Tensor>{in.exp(), in.exp()}; });
  std::vector<Tensor> out = fn(x);
  EXPECT_NE(out[0].data_ptr(), out[1].data_ptr());
  out[0].mul_(2.0);
  expect_bitwise(out[1], x.exp(), "the second result after the first is scaled");
}

TEST(Simplify, CompiledEqualsEagerWithAndWithoutThePass) {
  auto fn = [](const Tensor& x) {
    const Tensor one = constant(x, 1.0);
    Tensor e = x.exp() * one;
    return e + (one * x.sin()) * 2.0;
  };
  const Tensor x = randn({5, 7});
  auto on = compile(fn);
  auto off = compile(fn, CompileOptions().skip_pass("simplify"));
  for (int i = 0; i < 2; ++i) {
    expect_bitwise(on(x), fn(x), "simplify on");
    expect_bitwise(off(x), fn(x), "simplify off");
  }
  EXPECT_EQ(count_ops(on.traces().back(), "mul"), 1) << on.traces().back().str();
}

}  // namespace
}  // namespace kiln
