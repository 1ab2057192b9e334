// A tiny GPT, its optimizer and its training step (zero_grad, forward, cross-entropy, backward,
// optimizer step), for the tests that compile a whole step and compare it with eager code. Two
// TinySteps made alike start from the same weights (kiln::manual_seed(0)), so a compiled step and
// an eager one agree bit for bit.
//
//   const auto config = models::ModelConfig::from_name("tiny-llama");
//   test::TinyStep eager(config, test::adamw(optim::AdamWOptions(3e-3))), compiled(...same...);
//   auto step = compile([&](const Tensor& x, const Tensor& y) { return compiled.step(x, y); });
//   manual_seed(100);
//   const auto [x, y] = test::next_token_batch(config.vocab_size, 2, 16);
//   EXPECT_TRUE(equal(step(x, y), eager.step(x, y)));
//
// Pitfall: the RoPE tables are built on the model's first forward from a from_blob over a
// temporary buffer (copied when traced); the constructor builds them eagerly so that the
// compiled and eager runs' first steps are alike.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "autograd/grad_mode.h"
#include "models/gpt.h"
#include "nn/autocast.h"
#include "nn/optim/adamw.h"
#include "nn/optim/optimizer.h"
#include "tensor/ops.h"

namespace kiln::test {

using MakeOptimizer = std::function<std::unique_ptr<optim::Optimizer>(std::vector<Tensor>)>;

inline MakeOptimizer adamw(const optim::AdamWOptions& options) {
  return [options](std::vector<Tensor> params) -> std::unique_ptr<optim::Optimizer> {
    return std::make_unique<optim::AdamW>(std::move(params), options);
  };
}

struct TinyStep {
  models::GPT model{nullptr};
  std::unique_ptr<optim::Optimizer> opt;
  // Set: the forward and the loss run under AutocastGuard(kCPU, *autocast), the backward and the
  // optimizer step outside it (bf16-mixed training).
  std::optional<ScalarType> autocast;

  // `options`: the model's device and dtype (the CPU and f32 by default).
  TinyStep(const models::ModelConfig& config, const MakeOptimizer& make,
           std::optional<ScalarType> autocast_dtype = std::nullopt,
           const TensorOptions& options = {})
      : autocast(autocast_dtype) {
    manual_seed(0);
    model = models::GPT(config, options);
    model->train();
    opt = make(model->parameters());
    NoGradGuard no_grad;
    // The RoPE tables (see the pitfall above).
    (void)model(zeros({1, 1}, TensorOptions().dtype(kInt64).device(options.device())));
  }

  // One training step on tokens `x` with targets `y`; returns the loss.
  Tensor step(const Tensor& x, const Tensor& y) {
    opt->zero_grad();
    Tensor loss;
    if (autocast) {
      AutocastGuard guard(kCPU, *autocast);
      loss = model->loss(x, y);
    } else {
      loss = model->loss(x, y);
    }
    loss.backward();
    opt->step();
    return loss;
  }
};

// A batch of `batch` random sequences of `seq` tokens below `vocab`, and their next tokens as
// targets: (x, y), both contiguous [batch, seq].
inline std::pair<Tensor, Tensor> next_token_batch(int64_t vocab, int64_t batch, int64_t seq) {
  const Tensor tokens = randint(vocab, {batch, seq + 1}, kInt64);
  return {tokens.narrow(1, 0, seq).contiguous(), tokens.narrow(1, 1, seq).contiguous()};
}

}  // namespace kiln::test
