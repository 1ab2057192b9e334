// Each GPT family's training step (the tiny configs of Llama, Mistral, Gemma and Gemma 2),
// compiled against eager from the same initial weights: zero_grad, forward, cross-entropy,
// backward and the optimizer step, traced whole by kiln::compile. The compiled program replays
// the kernels eager code runs, so losses, gradients and updated weights are equal bit for bit.
// The lr changes between steps (a schedule), which a replayed step must see. At the end, the
// compiler bugs found while compiling the models, as regression tests.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "compiler/compile.h"
#include "models/gpt.h"
#include "nn/autocast.h"
#include "nn/optim/adamw.h"
#include "nn/optim/sgd.h"
#include "tensor/ops.h"
#include "tensor/random.h"
#include "tiny_step.h"

namespace kiln {
namespace {

using models::ModelConfig;

constexpr int kSteps = 4;
constexpr int64_t kBatch = 2, kSeq = 16;

std::unique_ptr<optim::Optimizer> make_sgd(std::vector<Tensor> params) {
  return std::make_unique<optim::SGD>(std::move(params),
                                      optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01));
}

std::unique_ptr<optim::Optimizer> make_adamw(std::vector<Tensor> params) {
  return std::make_unique<optim::AdamW>(std::move(params),
                                        optim::AdamWOptions(3e-3).weight_decay(0.1));
}

void expect_bitwise(const Tensor& compiled, const Tensor& eager, const std::string& what) {
  ASSERT_EQ(compiled.defined(), eager.defined()) << what;
  if (!eager.defined()) return;
  ASSERT_EQ(compiled.sizes(), eager.sizes()) << what;
  EXPECT_TRUE(equal(compiled, eager))
      << what << ": max |compiled - eager| = " << (compiled - eager).abs().max().item<double>();
}

void check_family(const std::string& name, const test::MakeOptimizer& make) {
  const ModelConfig config = ModelConfig::from_name(name);
  test::TinyStep eager(config, make), compiled(config, make);
  auto step = compile([&](const Tensor& x, const Tensor& y) { return compiled.step(x, y); },
                      CompileOptions().name("train_step"));
  const auto names = eager.model->named_parameters().keys();
  for (int i = 0; i < kSteps; ++i) {
    SCOPED_TRACE(name + ", step " + std::to_string(i + 1));
    manual_seed(100 + i);
    const auto [x, y] = test::next_token_batch(config.vocab_size, kBatch, kSeq);
    const Tensor want = eager.step(x, y);
    const Tensor got = step(x, y);
    expect_bitwise(got, want, "loss");
    const std::vector<Tensor> pe = eager.model->parameters(), pc = compiled.model->parameters();
    ASSERT_EQ(pe.size(), pc.size());
    for (size_t p = 0; p < pe.size(); ++p) {
      expect_bitwise(pc[p], pe[p], names[p]);
      expect_bitwise(pc[p].grad(), pe[p].grad(), names[p] + ".grad");
    }
    // A schedule: the next step's lr differs, and the replayed program must read it.
    const double lr = eager.opt->param_groups()[0].options().get_lr() * 0.7;
    eager.opt->set_lr(lr);
    compiled.opt->set_lr(lr);
  }
  // Step 1 runs without gradients and creates the optimizer state (state that outlives the
  // call), so step 2 is traced again; the later steps replay step 2's program.
  EXPECT_EQ(step.stats().misses, 2);
  EXPECT_EQ(step.stats().hits, kSteps - 2);
  EXPECT_FALSE(step.stats().fell_back_to_eager);
}

class CompiledTraining : public ::testing::TestWithParam<std::string> {};

TEST_P(CompiledTraining, SgdMomentumStepMatchesEager) { check_family(GetParam(), make_sgd); }

TEST_P(CompiledTraining, AdamWStepMatchesEager) { check_family(GetParam(), make_adamw); }

INSTANTIATE_TEST_SUITE_P(Families, CompiledTraining,
                         ::testing::Values("tiny-llama", "tiny-mistral", "tiny-gemma",
                                           "tiny-gemma2"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

// A tensor that the callable makes with from_blob over its own buffer is copied when the trace
// captures it (tensor/borrowed.h): the program reads the values the buffer held while tracing,
// not the buffer, which may be freed by the time the program runs (rope_cache's std::vector).
TEST(CompiledConstants, FromBlobInsideTheCallableIsCopiedWhenTraced) {
  auto fn = [](const Tensor& x) {
    std::vector<float> buffer(4, 1.0f);
    Tensor out = x + from_blob(buffer.data(), {4}, kFloat);
    std::fill(buffer.begin(), buffer.end(), 100.0f);  // as if freed and reused
    return out;
  };
  auto f = compile(fn);
  const Tensor x = zeros({4});
  EXPECT_TRUE(equal(f(x), fn(x))) << f(x);  // compiled: 100s; eager: 1s
}

// An AutocastGuard inside the compiled callable is replayed: each bound op keeps the autocast
// state it was traced under (the program used to run every op under the caller's state, off,
// and returned f32 where eager code gives bf16).
TEST(CompiledAutocast, GuardInsideTheCallableIsReplayed) {
  manual_seed(0);
  const Tensor w = randn({3, 4}), x = randn({2, 4});
  auto fn = [&](const Tensor& a) {
    AutocastGuard autocast(kCPU, kBFloat16);
    return linear(a, w);
  };
  auto f = compile(fn);
  const Tensor want = fn(x);
  ASSERT_EQ(want.dtype(), kBFloat16);
  const Tensor got = f(x);
  EXPECT_EQ(got.dtype(), kBFloat16);
  EXPECT_TRUE(got.dtype() == want.dtype() && equal(got, want));
}

// With backward() inside the callable as well (what bf16-mixed training does): tracing used to
// fail with "[compile] a tensor of shape [2, 4] aliases a traced value but was made outside the
// op registry" (the backward of linear read a cast that autocast made inside the recorded call).
TEST(CompiledAutocast, GuardAndBackwardInsideTheCallable) {
  manual_seed(0);
  Tensor w = randn({3, 4}).requires_grad_(true);
  const Tensor x = randn({2, 4});
  auto fn = [&](const Tensor& a) {
    Tensor y;
    {
      AutocastGuard autocast(kCPU, kBFloat16);
      y = linear(a, w);
    }
    Tensor loss = y.sum();
    loss.backward();
    return loss;
  };
  auto f = compile(fn);
  const Tensor got = f(x);
  const Tensor got_grad = w.grad().clone();
  w.mutable_grad() = Tensor();
  EXPECT_TRUE(equal(got, fn(x)));
  EXPECT_TRUE(equal(got_grad, w.grad()));
}

}  // namespace
}  // namespace kiln
