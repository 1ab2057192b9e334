// Each GPT family's training step compiled on CUDA against eager (issue 19, point 7): the tiny
// configs of Llama, Llama 3, Mistral, Gemma and Gemma 2, and a Llama with head size 64 (so that
// attention runs its CUDA kernels instead of the decomposition), zero_grad, forward,
// cross-entropy, backward and AdamW traced whole by kiln::compile.
//   - f32: the compiled step equals eager's to f32 rounding (the CUDA executors round once where
//     eager rounds per op, e.g. matmul_epilogue's residual add, so not bit for bit);
//   - bf16: the compiled step's distance from an f32 run of the same weights is within twice eager
//     bf16's own distance from it, plus a little: compiling adds no error beyond bf16's.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "compiler/compile.h"
#include "kernels/cuda.h"
#include "models/gpt.h"
#include "tensor/ops.h"
#include "tensor/random.h"
#include "tiny_step.h"

namespace kiln {
namespace {

using models::ModelConfig;

constexpr int kSteps = 3;
constexpr int64_t kBatch = 2, kSeq = 128;

ModelConfig config_of(const std::string& name) {
  if (name != "tiny-llama-hs64") return ModelConfig::from_name(name);
  ModelConfig c = ModelConfig::from_name("tiny-llama");
  c.n_embd = 128;
  c.n_head = 2;
  c.n_query_groups = 1;
  c.head_size = 64;
  return c;
}

double max_abs(const Tensor& t) { return t.abs().max().to(kDouble).cpu().item<double>(); }
double distance(const Tensor& a, const Tensor& b) {
  return max_abs(a.to(kFloat).cpu() - b.to(kFloat).cpu());
}

test::MakeOptimizer make_adamw() { return test::adamw(optim::AdamWOptions(3e-3).weight_decay(0.1)); }

class GpuCompiledTraining : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  }
};

TEST_P(GpuCompiledTraining, F32StepMatchesEager) {
  const ModelConfig config = config_of(GetParam());
  const TensorOptions on_gpu = TensorOptions().device(Device(kCUDA));
  test::TinyStep eager(config, make_adamw(), std::nullopt, on_gpu);
  test::TinyStep compiled(config, make_adamw(), std::nullopt, on_gpu);
  auto step = compile([&](const Tensor& x, const Tensor& y) { return compiled.step(x, y); },
                      CompileOptions().name("gpu_train_step"));
  const auto names = eager.model->named_parameters().keys();
  for (int i = 0; i < kSteps; ++i) {
    SCOPED_TRACE(GetParam() + ", step " + std::to_string(i + 1));
    manual_seed(200 + i);
    auto [x, y] = test::next_token_batch(config.vocab_size, kBatch, kSeq);
    x = x.cuda();
    y = y.cuda();
    const double want = eager.step(x, y).cpu().item<double>();
    const double got = step(x, y).cpu().item<double>();
    EXPECT_NEAR(got, want, 1e-5 * std::max(1.0, std::abs(want))) << "loss";
    const std::vector<Tensor> pe = eager.model->parameters(), pc = compiled.model->parameters();
    ASSERT_EQ(pe.size(), pc.size());
    for (size_t p = 0; p < pe.size(); ++p) {
      ASSERT_TRUE(pc[p].grad().defined()) << names[p];
      const double g = std::max(1e-6, max_abs(pe[p].grad()));
      EXPECT_LE(distance(pc[p].grad(), pe[p].grad()), 1e-4 * g) << names[p] << ".grad";
      EXPECT_LE(distance(pc[p], pe[p]), 1e-5 * std::max(1.0, max_abs(pe[p]))) << names[p];
    }
  }
  EXPECT_FALSE(step.stats().fell_back_to_eager);
}

TEST_P(GpuCompiledTraining, Bf16StepWithinEagerBf16Error) {
  const ModelConfig config = config_of(GetParam());
  const TensorOptions f32 = TensorOptions().device(Device(kCUDA));
  const TensorOptions bf16 = TensorOptions().device(Device(kCUDA)).dtype(kBFloat16);
  test::TinyStep reference(config, make_adamw(), std::nullopt, f32);
  test::TinyStep eager(config, make_adamw(), std::nullopt, bf16);
  test::TinyStep compiled(config, make_adamw(), std::nullopt, bf16);
  auto step = compile([&](const Tensor& x, const Tensor& y) { return compiled.step(x, y); },
                      CompileOptions().name("gpu_train_step_bf16"));
  const auto names = eager.model->named_parameters().keys();
  for (int i = 0; i < kSteps; ++i) {
    SCOPED_TRACE(GetParam() + ", step " + std::to_string(i + 1));
    manual_seed(300 + i);
    auto [x, y] = test::next_token_batch(config.vocab_size, kBatch, kSeq);
    x = x.cuda();
    y = y.cuda();
    const double want = reference.step(x, y).cpu().item<double>();
    const double e = eager.step(x, y).to(kDouble).cpu().item<double>();
    const double c = step(x, y).to(kDouble).cpu().item<double>();
    EXPECT_LE(std::abs(c - want), 2 * std::abs(e - want) + 2e-2) << "loss " << c << " eager " << e;
    const std::vector<Tensor> pr = reference.model->parameters(), pe = eager.model->parameters(),
                              pc = compiled.model->parameters();
    for (size_t p = 0; p < pe.size(); ++p) {
      const double scale = std::max(1e-6, max_abs(pr[p].grad()));
      const double de = distance(pe[p].grad(), pr[p].grad());
      EXPECT_LE(distance(pc[p].grad(), pr[p].grad()), 2 * de + 1e-2 * scale)
          << names[p] << ".grad (eager bf16's distance " << de << ")";
    }
  }
  EXPECT_FALSE(step.stats().fell_back_to_eager);
}

INSTANTIATE_TEST_SUITE_P(Families, GpuCompiledTraining,
                         ::testing::Values("tiny-llama", "tiny-llama3", "tiny-mistral",
                                           "tiny-gemma", "tiny-gemma2", "tiny-llama-hs64"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

}  // namespace
}  // namespace kiln
