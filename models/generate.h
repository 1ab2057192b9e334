// Text generation with a GPT: greedy or sampled decoding, with a KV cache.
//
//   kiln::models::GenerateOptions opts;
//   opts.max_new_tokens = 100;
//   opts.temperature = 0.8;                    // 0: greedy (argmax)
//   opts.top_k = 50;                           // 0: off
//   opts.top_p = 0.95;                         // 1: off
//   opts.stop_tokens = {0};                    // stop after emitting one of these
//   opts.seed = 1234;                          // reproducible, global RNG left untouched
//   std::vector<int64_t> out = kiln::models::generate(*model, prompt, opts);
//   // out = prompt followed by the generated tokens
//
// generate runs under NoGradGuard. With use_kv_cache it feeds the prompt once (prefill) and
// then one token at a time, attending to the cached keys and values; without, it re-runs the
// whole sequence for every new token (slower, the reference the cache is tested against). It
// stops after a stop token (which is included in the output), after max_new_tokens new tokens,
// or when the sequence reaches the model's block_size. Only the first config.vocab_size logits
// are candidates: the rows added by padded_vocab_size are never sampled.
//
// Sampling (sample_next_token): logits / temperature, then top-k (keep the k largest; ties
// with the k-th are kept), then top-p (nucleus: keep the most probable tokens, in decreasing
// order, while the probability mass before each is below p; the most probable token is always
// kept), then one multinomial draw from the softmax of what is left. It runs on the CPU in f32
// (the logits are copied there) and draws from kiln's Philox stream: the global one, or with a
// seed a private stream (seed, offset 0); the global state is saved and restored around it, so
// a seeded call neither depends on nor disturbs kiln::manual_seed's stream.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "models/gpt.h"
#include "tensor/tensor.h"

namespace kiln::models {

// The smallest non-zero temperature: below it logits / temperature can overflow.
inline constexpr double kMinTemperature = 1e-6;

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  double temperature = 1.0;  // 0 = greedy; else >= kMinTemperature
  int64_t top_k = 0;         // 0 = off
  double top_p = 1.0;        // in (0, 1]; 1 = off
  std::vector<int64_t> stop_tokens;
  std::optional<uint64_t> seed;
  bool use_kv_cache = true;

  // Throws "[generate] ..." naming the first bad option.
  void validate() const;
};

// Returns the prompt followed by the generated tokens. Errors "[generate] ..." for an empty
// prompt, a prompt longer than block_size, token ids outside the vocabulary or bad options.
std::vector<int64_t> generate(GPTImpl& model, const std::vector<int64_t>& prompt,
                              const GenerateOptions& options);
inline std::vector<int64_t> generate(GPT& model, const std::vector<int64_t>& prompt,
                                     const GenerateOptions& options) {
  return generate(*model, prompt, options);
}

// logits [B, V] (any float dtype and device) -> int64 [B] on the logits' device, one token per
// row, by the rule above (temperature 0: argmax, lowest index on ties).
Tensor sample_next_token(const Tensor& logits, const GenerateOptions& options);

}  // namespace kiln::models
