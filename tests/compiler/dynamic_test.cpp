// Dimensions marked dynamic (CompileOptions::dynamic, compiler/symbolic.h): the first two sizes
// compile, further sizes share one fitted program without tracing, and every result equals
// eager's, random draws included. Where sharing is impossible (a constant that follows the size
// but not as an integer, a meta rule that rejects the fitted attributes, several dimensions
// changing differently), the size compiles on its own and the recompile reason says why.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "compiler/compile.h"
#include "compiler/symbolic.h"
#include "compiler/tracer.h"
#include "kiln.h"
#include "models/gpt.h"
#include "nn/optim/adamw.h"
#include "test_util.h"
#include "tiny_step.h"

namespace kiln {
namespace {

void expect_equal(const Tensor& a, const Tensor& b, const std::string& what = "") {
  ASSERT_TRUE(a.defined() && b.defined()) << what;
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  EXPECT_TRUE(equal(a, b)) << what << "\ncompiled:\n" << a << "\neager:\n" << b;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

std::string reasons(const compiler::CompileStats& s) {
  std::string out;
  for (const std::string& r : s.recompile_reasons) out += "\n  " + r;
  return out;
}

// A sequence model's shapes: [B, T, C] flattened to [B * T, C] for a matmul, a slice of a
// table by T, a softmax over T, a reduction, and back.
Tensor sequence_fn(const Tensor& x, const Tensor& w, const Tensor& table) {
  const int64_t b = x.size(0), t = x.size(1), c = x.size(2);
  Tensor h = matmul(x.reshape({b * t, c}), w).reshape({b, t, -1});
  h = h + table.narrow(0, 0, t).unsqueeze(0);
  Tensor p = softmax(h.transpose(1, 2), -1);  // [B, C', T]
  return (p.sum(-1) + h.mean(1)).relu();
}

TEST(DynamicShapes, SizesAfterTheSecondShareOneProgram) {
  manual_seed(0);
  const Tensor w = randn({6, 5}), table = randn({64, 5});
  auto f = compile([&](const Tensor& x) { return sequence_fn(x, w, table); },
                   CompileOptions().dynamic(0, 1).recompile_limit(2));
  for (int64_t t : {8, 16, 12, 5, 40, 16, 1}) {
    SCOPED_TRACE("T = " + std::to_string(t));
    const Tensor x = randn({3, t, 6});
    expect_equal(f(x), sequence_fn(x, w, table));
  }
  const compiler::CompileStats& s = f.stats();
  EXPECT_EQ(s.misses, 2) << reasons(s);  // 8 and 16 compile; 16 again is a cache hit
  EXPECT_EQ(s.dynamic_instances, 4);     // 12, 5, 40 and 1 share the fitted program
  EXPECT_EQ(s.hits, 1);
  EXPECT_FALSE(s.fell_back_to_eager);
  ASSERT_EQ(s.recompile_reasons.size(), 1u);
  EXPECT_TRUE(contains(s.recompile_reasons[0], "fit one program to every size"))
      << s.recompile_reasons[0];
}

TEST(DynamicShapes, GradientsThroughTheSharedProgram) {
  manual_seed(1);
  Tensor w = randn({6, 5}).requires_grad_(), table = randn({64, 5});
  auto f = compile([&](const Tensor& x) { return sequence_fn(x, w, table).sum(); },
                   CompileOptions().dynamic(0, 1));
  // (At T = 4 against 9 the partitioner saves different values for the backward, so those two
  // would not share: the bytes it weighs grow with T while w's stay.)
  for (int64_t t : {9, 7, 12, 30}) {
    SCOPED_TRACE("T = " + std::to_string(t));
    Tensor x = randn({2, t, 6}).requires_grad_();
    Tensor got = f(x);
    got.backward();
    const Tensor gx = x.grad(), gw = w.grad();
    x.mutable_grad() = Tensor();
    w.mutable_grad() = Tensor();
    Tensor want = sequence_fn(x, w, table).sum();
    want.backward();
    expect_equal(got, want, "loss");
    expect_equal(gx, x.grad(), "x.grad");
    expect_equal(gw, w.grad(), "w.grad");
    w.mutable_grad() = Tensor();
  }
  EXPECT_EQ(f.stats().misses, 2) << reasons(f.stats());
  EXPECT_EQ(f.stats().dynamic_instances, 2);
}

// A Llama training step (forward, loss, backward, AdamW) over sequence lengths: one program
// serves them all, bit for bit equal to eager.
TEST(DynamicShapes, TrainingStepOverSequenceLengths) {
  const models::ModelConfig config = models::ModelConfig::from_name("tiny-llama");
  const test::MakeOptimizer adamw = test::adamw(optim::AdamWOptions(3e-3));
  test::TinyStep eager(config, adamw), compiled(config, adamw);
  auto step = compile([&](const Tensor& x, const Tensor& y) { return compiled.step(x, y); },
                      CompileOptions().name("train_step").dynamic(0, 1).dynamic(1, 1));
  // The first step creates the optimizer state (traced again once it exists); 16 and 8
  // compile; 12, 5 and 16 (a cache hit) run shared or cached programs.
  const std::vector<int64_t> lengths = {16, 16, 8, 12, 5, 16};
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t t = lengths[i];
    SCOPED_TRACE("step " + std::to_string(i) + ", T = " + std::to_string(t));
    manual_seed(100 + static_cast<int>(i));
    const auto [x, y] = test::next_token_batch(config.vocab_size, 2, t);
    const Tensor want = eager.step(x, y);
    expect_equal(step(x, y), want, "loss");
    const std::vector<Tensor> pe = eager.model->parameters(), pc = compiled.model->parameters();
    for (size_t p = 0; p < pe.size(); ++p) expect_equal(pc[p], pe[p], "parameter");
  }
  const compiler::CompileStats& s = step.stats();
  EXPECT_EQ(s.misses, 3) << reasons(s);
  EXPECT_EQ(s.dynamic_instances, 2);
  EXPECT_EQ(s.hits, 1);
}

// T * T is affine in T at two sizes one apart (4 and 9 at T = 2 and 3: slope 5) but not at
// T = 5, where the meta rule of view (reshape's) rejects the fitted 19 elements: that size compiles
// on its own and says which op refused.
TEST(DynamicShapes, AMetaRuleRejectingTheFitCompilesThatSize) {
  auto fn = [](const Tensor& x) {
    const int64_t t = x.size(0);
    return (x.unsqueeze(1) * x.unsqueeze(0)).reshape({t * t}).cumsum(0);
  };
  auto f = compile(fn, CompileOptions().dynamic(0, 0));
  for (int64_t t : {2, 3, 5}) {
    const Tensor x = randn({t});
    expect_equal(f(x), fn(x));
  }
  const compiler::CompileStats& s = f.stats();
  EXPECT_EQ(s.misses, 3);
  EXPECT_EQ(s.dynamic_instances, 0);
  ASSERT_EQ(s.recompile_reasons.size(), 2u);
  EXPECT_TRUE(contains(s.recompile_reasons[1], "does not serve this size") &&
              contains(s.recompile_reasons[1], "view") &&
              contains(s.recompile_reasons[1], "rejects the size 5"))
      << s.recompile_reasons[1];
}

TEST(DynamicShapes, WhatCannotBeSharedSaysWhy) {
  {  // a scale computed from the size: a constant that follows it, but not as an integer
    auto fn = [](const Tensor& x) { return x * (1.0 / static_cast<double>(x.size(1))); };
    auto f = compile(fn, CompileOptions().dynamic(0, 1));
    for (int64_t t : {2, 3, 4}) {
      const Tensor x = randn({2, t});
      expect_equal(f(x), fn(x));
    }
    EXPECT_EQ(f.stats().misses, 3);
    EXPECT_TRUE(contains(f.stats().recompile_reasons[0], "captured constant") &&
                contains(f.stats().recompile_reasons[0], "0.500000 and 0.333333"))
        << f.stats().recompile_reasons[0];
  }
  {  // two marked dimensions changing to different sizes: one size at a time is shared
    auto fn = [](const Tensor& x) { return x.sum(0); };
    auto f = compile(fn, CompileOptions().dynamic(0, 0).dynamic(0, 1));
    expect_equal(f(ones({2, 3})), fn(ones({2, 3})));
    expect_equal(f(ones({4, 5})), fn(ones({4, 5})));
    EXPECT_TRUE(contains(f.stats().recompile_reasons[0], "changed, to different sizes"))
        << f.stats().recompile_reasons[0];
  }
}

// Dropout over the dynamic dimension: each size's program draws the Philox blocks eager code
// reserves (offsets derived again per size), so compiled dropout equals eager dropout at sizes
// the program was never compiled for, sizes not a multiple of a block's 4 elements included.
TEST(DynamicShapes, RandomOpsDrawWhatEagerDraws) {
  const Tensor fixed = ones({5});
  auto fn = [&](const Tensor& x) {
    Tensor a = kiln::dropout(x, 0.5, true);         // size-dependent blocks
    Tensor b = kiln::dropout(fixed, 0.3, true);     // fixed blocks, after it
    Tensor c = kiln::dropout(x * 2.0, 0.25, true);  // size-dependent again
    return a.sum(-1) + b.sum() + c.sum(-1);
  };
  auto f = compile(fn, CompileOptions().dynamic(0, 1));
  for (int64_t t : {64, 128, 66, 257, 1, 128}) {
    SCOPED_TRACE("T = " + std::to_string(t));
    const Tensor x = ones({3, t});
    manual_seed(7);
    const Tensor got = f(x);
    const RngState after_compiled = get_rng_state();
    manual_seed(7);
    expect_equal(got, fn(x));
    EXPECT_EQ(get_rng_state().offset, after_compiled.offset);  // the same blocks reserved
  }
  EXPECT_EQ(f.stats().misses, 2) << reasons(f.stats());
  EXPECT_EQ(f.stats().dynamic_instances, 3);
}

// fit_sizes and instantiate on their own: the fitted attribute, and shapes and strides derived
// by the meta rules.
TEST(DynamicShapes, FitAndInstantiate) {
  auto trace_at = [](int64_t t) {
    compiler::TraceResult r = compiler::trace_callable(
        [](const std::vector<Tensor>& in) {
          const Tensor& x = in[0];
          return std::vector<Tensor>{x.reshape({x.size(0) * 2, -1}).transpose(0, 1) * 3.0};
        },
        {randn({t, 4})}, "fn", /*joint=*/false);
    return r.trace;
  };
  const compiler::Trace a = trace_at(3), b = trace_at(5);
  compiler::SizeFit fit;
  ASSERT_EQ(compiler::fit_sizes(a, 3, b, 5, fit), "");
  EXPECT_EQ(fit.at, 5);
  compiler::Trace c;
  ASSERT_EQ(compiler::instantiate(b, fit, 9, {TensorSpec{{9, 4}, kFloat, Device(kCPU), {4, 1}}}, c),
            "");
  const compiler::Trace want = trace_at(9);
  ASSERT_EQ(c.values.size(), want.values.size());
  for (size_t v = 0; v < c.values.size(); ++v) {
    EXPECT_EQ(c.values[v].spec.sizes, want.values[v].spec.sizes) << c.values[v].name;
    EXPECT_EQ(c.values[v].spec.strides, want.values[v].spec.strides) << c.values[v].name;
  }
  EXPECT_EQ(c.str(), want.str());
}

}  // namespace
}  // namespace kiln
