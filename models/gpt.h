// kiln::models::GPT: one decoder-only transformer for every family of models/config.h.
//
//   kiln::manual_seed(0);
//   kiln::models::GPT model(kiln::models::ModelConfig::from_name("tiny-llama"));
//   auto logits = model(idx);                      // idx [B, T] int64 -> [B, T, padded_vocab]
//   auto loss = model->loss(idx, targets);         // mean next-token cross-entropy
//   loss.backward();
//
//   // Straight on the GPU in bf16 (no f32 copy on the host first):
//   kiln::models::GPT big(cfg, kiln::TensorOptions().device(kiln::kCUDA).dtype(kiln::kBFloat16));
//
//   // Decoding with a KV cache: prefill, then one token at a time.
//   auto cache = model->make_kv_cache(/*batch=*/1, /*max_seq_len=*/256);
//   auto l = model->forward(prompt, cache);        // positions 0 .. T-1, cache.length = T
//   l = model->forward(next_token, cache);         // position T
//
// Parameter names (state_dict), LitGPT-style; models/hf.h maps them to Hugging Face's:
//   transformer.wte.weight                         [padded_vocab, n_embd]
//   transformer.h.{i}.norm_1.weight                [n_embd]
//   transformer.h.{i}.attn.qkv.weight              [(n_head + 2 n_query_groups) head_size, n_embd]
//                                                  rows: all q heads, then all k, then all v
//   transformer.h.{i}.attn.proj.weight             [n_embd, n_head head_size]
//   transformer.h.{i}.post_attention_norm.weight   [n_embd]   (config.post_attention_norm)
//   transformer.h.{i}.norm_2.weight                [n_embd]
//   transformer.h.{i}.mlp.fc_1.weight              [intermediate_size, n_embd]   gate
//   transformer.h.{i}.mlp.fc_2.weight              [intermediate_size, n_embd]   up
//   transformer.h.{i}.mlp.proj.weight              [n_embd, intermediate_size]   down
//   transformer.h.{i}.post_mlp_norm.weight         [n_embd]   (config.post_mlp_norm)
//   transformer.ln_f.weight                        [n_embd]
//   lm_head.weight                                 [padded_vocab, n_embd]   (absent when tied)
// Norm weights are stored as Hugging Face stores them: with norm_unit_offset (Gemma) the norm
// multiplies by 1 + weight and the weight starts at 0.
//
// Block (pre-norm): x = x + post_attention_norm(attn(norm_1(x)));
//                   x = x + post_mlp_norm(mlp(norm_2(x)))   (post norms only when configured).
// Attention: q, k, v from one qkv matmul; RoPE (rotate-half, config.rope_base / rope_scaling)
// on q and k; causal softmax(q k^T * attn_scale()) v with GQA, the layer's sliding window and
// attention softcap; output projection. The RoPE tables are computed per device and dtype on
// first use (not part of the state_dict).
//
// Initialisation (the constructor; reproducible with kiln::manual_seed): every linear and the
// embedding ~ N(0, sqrt(2 / (5 n_embd))); attn.proj and mlp.proj ~ N(0, 1 / sqrt(n_embd) /
// n_layer); norm weights 1 (0 with norm_unit_offset). Draws happen in f32 and are converted to
// the requested dtype, so a bf16 model is the rounded f32 one.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "models/config.h"
#include "nn/module.h"
#include "nn/modules/container.h"
#include "tensor/tensor.h"

namespace kiln::models {

// Keys and values of past positions, per layer: k[l], v[l] are [batch, n_query_groups,
// max_seq_len, head_size] in the model's dtype and device; positions [0, length) are filled.
struct KVCache {
  std::vector<Tensor> k, v;
  int64_t length = 0;

  int64_t batch() const { return k.empty() ? 0 : k[0].size(0); }
  int64_t max_seq_len() const { return k.empty() ? 0 : k[0].size(2); }
  void reset() { length = 0; }
};

// A bias-free projection whose weight [out_features, in_features] is created directly with the
// model's options (no f32 host copy first). forward: x @ weight^T. The embedding table and the
// untied LM head are Projs too (the table is indexed instead of multiplied).
class ProjImpl : public nn::Module {
 public:
  ProjImpl(int64_t in_features, int64_t out_features, const TensorOptions& options);
  Tensor forward(const Tensor& x);
  Tensor weight;
};
KILN_MODULE(Proj);

// A norm of config.norm_kind over the last dim, with config's eps and unit offset.
class NormImpl : public nn::Module {
 public:
  NormImpl(const ModelConfig& config, const TensorOptions& options);
  Tensor forward(const Tensor& x);
  Tensor weight;

 private:
  NormKind kind_;
  double eps_;
  bool unit_offset_;
};
KILN_MODULE(Norm);

class CausalSelfAttentionImpl : public nn::Module {
 public:
  CausalSelfAttentionImpl(const ModelConfig& config, int64_t layer, const TensorOptions& options);
  // x [B, T, n_embd]; cos/sin [T, head_size] for the positions of x. With a cache, the new
  // keys/values are written at positions [cache.length, cache.length + T) of layer `layer_`
  // and attention runs over [0, cache.length + T) (the caller advances cache.length).
  Tensor forward(const Tensor& x, const Tensor& cos, const Tensor& sin, KVCache* cache = nullptr);
  Proj qkv{nullptr}, proj{nullptr};

 private:
  ModelConfig config_;
  int64_t layer_;
};
KILN_MODULE(CausalSelfAttention);

class MLPImpl : public nn::Module {
 public:
  MLPImpl(const ModelConfig& config, const TensorOptions& options);
  Tensor forward(const Tensor& x);
  Proj fc_1{nullptr}, fc_2{nullptr}, proj{nullptr};  // gate, up, down

 private:
  MLPKind kind_;
};
KILN_MODULE(MLP);

class BlockImpl : public nn::Module {
 public:
  BlockImpl(const ModelConfig& config, int64_t layer, const TensorOptions& options);
  Tensor forward(const Tensor& x, const Tensor& cos, const Tensor& sin, KVCache* cache = nullptr);
  Norm norm_1{nullptr}, norm_2{nullptr};
  Norm post_attention_norm{nullptr}, post_mlp_norm{nullptr};  // null unless configured
  CausalSelfAttention attn{nullptr};
  MLP mlp{nullptr};
};
KILN_MODULE(Block);

class GPTImpl : public nn::Module {
 public:
  // Validates the config; creates every parameter directly with `options` (dtype, device).
  explicit GPTImpl(ModelConfig config, const TensorOptions& options = {});

  // idx [B, T] (int64, on the model's device), T <= block_size -> logits [B, T, padded_vocab]
  // in the model's dtype (after the final softcap). Errors name the offending shape, dtype
  // or device.
  Tensor forward(const Tensor& idx);
  // The same for positions [cache.length, cache.length + T), attending to the cached ones;
  // appends this step's keys and values and advances cache.length by T. Errors when the cache
  // was made for another batch size or would overflow.
  Tensor forward(const Tensor& idx, KVCache& cache);
  // Mean next-token cross-entropy of forward(idx) against targets [B, T] (int64; entries equal
  // to ignore_index are left out), through the fused cross-entropy op. A 0-d f32 tensor.
  Tensor loss(const Tensor& idx, const Tensor& targets, int64_t ignore_index = -100);

  // An empty cache for `batch` sequences of up to max_seq_len (<= block_size) positions, in the
  // model's dtype and on its device.
  KVCache make_kv_cache(int64_t batch, int64_t max_seq_len) const;

  const ModelConfig& config() const { return config_; }
  // The model's parameter count (config.num_parameters(), checked against the tensors).
  int64_t num_parameters() const;
  double flops_per_token(int64_t seq_len) const { return config_.flops_per_token(seq_len); }

  // transformer.{wte, h, ln_f} (members point into the "transformer" child); lm_head is null
  // when the embeddings are tied (then wte's weight is the head).
  Proj wte{nullptr};
  nn::ModuleList h{nullptr};
  Norm ln_f{nullptr};
  Proj lm_head{nullptr};

 private:
  // The final hidden states (after ln_f) of idx; the logits; the LM head's weight.
  Tensor hidden(const Tensor& idx, KVCache* cache);
  Tensor run(const Tensor& idx, KVCache* cache);
  const Tensor& head_weight() const;
  // cos/sin [T, head_size] for positions [start, start + T), cached per device and dtype.
  std::pair<Tensor, Tensor> rope(int64_t start, int64_t length, const Tensor& like);

  ModelConfig config_;
  Tensor rope_cos_, rope_sin_;
};
KILN_MODULE(GPT);

}  // namespace kiln::models
