// The autocast pass (compiler/autocast_pass.h): the listing before and after (casts explicit, no
// autocast state), compiled with the pass == compiled without it (the replayed state) == eager
// bit for bit, shared casts, the policy applied to a trace recorded without autocast against
// eager code under AutocastGuard, and the kiln-tiny training step under bf16-mixed autocast.
#include "compiler/autocast_pass.h"

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "compiler/compile.h"
#include "compiler/executor.h"
#include "compiler/passes.h"
#include "compiler/program.h"
#include "compiler/tracer.h"
#include "trace_test_util.h"
#include "kiln.h"
#include "models/gpt.h"
#include "nn/autocast.h"
#include "nn/optim/adamw.h"
#include "test_util.h"
#include "tiny_step.h"

namespace kiln {
namespace {

namespace F = nn::functional;
using compiler::Trace;
using test::count_ops;
using test::expect_bitwise;

bool any_autocast(const Trace& t) {
  for (const auto& op : t.ops) {
    if (op.autocast.any()) return true;
  }
  return false;
}

compiler::TraceResult trace_no_grad(const compiler::TraceBody& fn,
                                    const std::vector<Tensor>& args) {
  NoGradGuard no_grad;
  return compiler::trace_callable(fn, args);
}

std::vector<Tensor> run_trace(const Trace& t, const std::vector<Tensor>& externals,
                              const std::vector<Tensor>& args) {
  const std::vector<std::shared_ptr<const compiler::Executor>> eager{
      compiler::find_executor("eager")};
  const compiler::Program program(compiler::assign_executors(t, eager), externals, eager);
  NoGradGuard no_grad;
  return program.run(args);
}

TEST(AutocastPass, CastsBecomeExplicitAndTheStateGoes) {
  manual_seed(1);
  const Tensor a = randn({4, 8}), b = randn({8, 4});
  auto fn = [](const std::vector<Tensor>& in) {
    AutocastGuard guard(kCPU, kBFloat16);
    Tensor h = matmul(in[0], in[1]).relu();   // mm in bf16
    return std::vector<Tensor>{h, h.sum(1)};  // sum in f32
  };
  const compiler::TraceResult before = trace_no_grad(fn, {a, b});
  EXPECT_TRUE(any_autocast(before.trace));
  const Trace after = compiler::dce(compiler::autocast(before.trace));
  const std::string listing = after.str();
  EXPECT_FALSE(any_autocast(after)) << listing;
  EXPECT_EQ(listing.find("autocast("), std::string::npos) << listing;
  EXPECT_NE(listing.find("# dce: 6 ops"), std::string::npos) << listing;
  EXPECT_NE(listing.find("= to_copy(a0; bf16, cpu)"), std::string::npos) << listing;
  EXPECT_NE(listing.find("= to_copy(a1; bf16, cpu)"), std::string::npos) << listing;
  EXPECT_NE(listing.find("; f32, cpu)"), std::string::npos) << listing;  // sum's input
  EXPECT_EQ(count_ops(after, "to_copy"), 3) << listing;
  // Run without any autocast state: the values eager code computes under the guard.
  const std::vector<Tensor> got = run_trace(after, before.externals, {a, b});
  const std::vector<Tensor> want = fn({a, b});
  expect_bitwise(got[0], want[0], "relu(mm)");
  expect_bitwise(got[1], want[1], "sum");
}

TEST(AutocastPass, CompiledWithAndWithoutThePassMatchEager) {
  manual_seed(2);
  const Tensor x = randn({6, 8}), w1 = randn({16, 8}), w2 = randn({16, 4}), bias = randn({16});
  auto fn = [&](const Tensor& in) {
    AutocastGuard guard(kCPU, kBFloat16);
    Tensor h = linear(in, w1, bias).relu();
    Tensor y = matmul(h, w2) + matmul(h * 0.5, w2);  // w2 cast once
    return F::log_softmax(y, 1) + in.sum();
  };
  const Tensor want = fn(x);
  auto on = compile(fn);
  auto off = compile(fn, CompileOptions().skip_pass("autocast"));
  for (int call = 0; call < 2; ++call) {
    expect_bitwise(on(x), want, "pass on");
    expect_bitwise(off(x), want, "pass off");
  }
  const Trace& t = on.traces().back();
  EXPECT_FALSE(any_autocast(t)) << t.str();
  EXPECT_TRUE(any_autocast(off.traces().back()));
  int w2_casts = 0;
  for (const auto& op : t.ops) {
    w2_casts += op.name() == "to_copy" && t.value(op.inputs[0]).spec.sizes == Shape{16, 4};
  }
  EXPECT_EQ(w2_casts, 1) << t.str();
}

TEST(AutocastPass, PolicyOnAnF32TraceMatchesEagerUnderTheGuard) {
  manual_seed(3);
  const Tensor a = randn({4, 8}), b = randn({8, 6}), c = randn({4, 6});
  auto fn = [](const std::vector<Tensor>& in) {
    Tensor h = matmul(in[0], in[1]).relu() + in[2];  // bf16 mm, then f32 by promotion
    Tensor g = matmul(h, in[1].t()).exp();           // bf16 mm, exp in f32
    return std::vector<Tensor>{F::softmax(h, 1), g.mean(0), cat({h, h}, 0)};
  };
  const compiler::TraceResult f32 = trace_no_grad(fn, {a, b, c});
  EXPECT_EQ(count_ops(f32.trace, "to_copy"), 0) << f32.trace.str();
  const Trace cast = compiler::autocast(f32.trace, kCPU, kBFloat16);
  EXPECT_FALSE(any_autocast(cast)) << cast.str();
  EXPECT_GE(count_ops(cast, "to_copy"), 4) << cast.str();
  std::vector<Tensor> want;
  {
    AutocastGuard guard(kCPU, kBFloat16);
    want = fn({a, b, c});
  }
  const std::vector<Tensor> got = run_trace(cast, f32.externals, {a, b, c});
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i)
    expect_bitwise(got[i], want[i], "output " + std::to_string(i));
  // The same trace recorded under the guard, through the other overload: the same program.
  const compiler::TraceResult recorded = trace_no_grad(
      [&](const std::vector<Tensor>& in) {
        AutocastGuard guard(kCPU, kBFloat16);
        return fn(in);
      },
      {a, b, c});
  const std::vector<Tensor> again =
      run_trace(compiler::autocast(recorded.trace), recorded.externals, {a, b, c});
  for (size_t i = 0; i < want.size(); ++i) expect_bitwise(again[i], want[i], "recorded");
  EXPECT_KILN_ERROR(compiler::autocast(f32.trace, kCPU, kFloat), "bfloat16 or float16");
}

// kiln-tiny's training step under bf16-mixed autocast (forward and loss under the guard,
// backward and AdamW outside), compiled with the autocast pass on and off and run eagerly.
TEST(AutocastPass, TinyTrainingStepUnderAutocastIsBitIdentical) {
  const models::ModelConfig config = models::ModelConfig::from_name("tiny-llama");
  const test::MakeOptimizer adamw = test::adamw(optim::AdamWOptions(3e-3).weight_decay(0.1));
  test::TinyStep eager(config, adamw, kBFloat16), on(config, adamw, kBFloat16),
      off(config, adamw, kBFloat16);
  auto step_on = compile([&](const Tensor& x, const Tensor& y) { return on.step(x, y); },
                         CompileOptions().name("step_on"));
  auto step_off = compile([&](const Tensor& x, const Tensor& y) { return off.step(x, y); },
                          CompileOptions().name("step_off").skip_pass("autocast"));
  const auto names = eager.model->named_parameters().keys();
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    manual_seed(100 + i);
    const auto [x, y] = test::next_token_batch(config.vocab_size, 2, 16);
    const Tensor want = eager.step(x, y);
    expect_bitwise(step_on(x, y), want, "loss, pass on");
    expect_bitwise(step_off(x, y), want, "loss, pass off");
    const auto pe = eager.model->parameters(), p_on = on.model->parameters(),
               p_off = off.model->parameters();
    for (size_t p = 0; p < pe.size(); ++p) {
      expect_bitwise(p_on[p], pe[p], names[p] + ", pass on");
      expect_bitwise(p_off[p], pe[p], names[p] + ", pass off");
      expect_bitwise(p_on[p].grad(), pe[p].grad(), names[p] + ".grad, pass on");
    }
  }
  EXPECT_FALSE(any_autocast(step_on.traces().back())) << step_on.traces().back().str();
  EXPECT_TRUE(any_autocast(step_off.traces().back()));
}

// On CUDA tensors under a kCUDA guard (skips without a GPU): compiled with the pass on and off
// == eager, and the policy applied to an f32 trace == eager under the guard. A CPU 0-d tensor
// joining CUDA inputs is not cast (the policy reads it as a scalar).
TEST(GpuAutocastPass, CudaProgramsMatchEager) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  manual_seed(9);
  const Tensor a = randn({33, 64}).cuda(), w = randn({64, 48}).cuda(), s = full({}, 0.5);
  auto body = [&](const Tensor& x) {
    Tensor h = matmul(x, w).relu();
    return F::log_softmax(h * s, 1) + x.sum() + F::layer_norm(h, {48}, Tensor(), Tensor(), 1e-5);
  };
  auto fn = [&](const Tensor& x) {
    AutocastGuard guard(kCUDA, kBFloat16);
    return body(x);
  };
  const Tensor want = fn(a);
  auto on = compile(fn);
  auto off = compile(fn, CompileOptions().skip_pass("autocast"));
  for (int call = 0; call < 2; ++call) {
    expect_bitwise(on(a), want, "pass on");
    expect_bitwise(off(a), want, "pass off");
  }
  EXPECT_FALSE(any_autocast(on.traces().back())) << on.traces().back().str();
  const compiler::TraceResult f32 = trace_no_grad(
      [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{body(in[0])}; }, {a});
  const Trace cast = compiler::autocast(f32.trace, kCUDA, kBFloat16);
  expect_bitwise(run_trace(cast, f32.externals, {a})[0], want, "f32 trace, policy applied");
}

}  // namespace
}  // namespace kiln
