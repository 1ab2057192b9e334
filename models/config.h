// kiln::models::ModelConfig: every number that decides the shape and arithmetic of one GPT of
// the Llama 2, Llama 3 / 3.1 / 3.2, Mistral, Gemma and Gemma 2 families, and the registry of
// named configs.
//
//   auto cfg = kiln::models::ModelConfig::from_name("llama-3.2-1b");
//   auto tiny = kiln::models::ModelConfig::from_name("tiny-gemma2");   // toy, same code paths
//   auto hf = kiln::models::ModelConfig::from_hf_config("ckpt/config.json");  // models/hf.h
//   for (const auto& name : kiln::models::config_names()) std::cout << name << "\n";
//
// A config is plain data: build one by hand, then validate() it (GPT's constructor does).
// Field names follow LitGPT's where it has one, with the Hugging Face name in the comment.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "nn/functional.h"

namespace kiln::models {

// The feed-forward block: down(act(gate(x)) * up(x)).
enum class MLPKind {
  kSwiGLU,     // act = silu (Llama, Mistral)
  kGeGLUTanh,  // act = tanh-approximate GELU (Gemma, Gemma 2)
};

enum class NormKind {
  kRMSNorm,    // x * rsqrt(mean(x^2) + eps) * w, in f32 (w -> 1 + w with norm_unit_offset)
  kLayerNorm,  // layer_norm without bias
};

struct ModelConfig {
  std::string name;

  // --- Sizes -----------------------------------------------------------------------------
  int64_t vocab_size = 0;         // the tokenizer's (HF vocab_size)
  int64_t padded_vocab_size = 0;  // rows of the embedding and of the LM head, >= vocab_size;
                                  // 0 in a hand-built config means vocab_size
  int64_t n_layer = 0;            // num_hidden_layers
  int64_t n_embd = 0;             // hidden_size (d)
  int64_t n_head = 0;             // num_attention_heads
  int64_t n_query_groups = 0;     // num_key_value_heads: == n_head MHA, 1 MQA, else GQA
  int64_t head_size = 0;          // head_dim; 0 in a hand-built config means n_embd / n_head
  int64_t intermediate_size = 0;  // the MLP's hidden width (ffn)
  int64_t block_size = 0;         // context length (max_position_embeddings)

  // --- Blocks ----------------------------------------------------------------------------
  MLPKind mlp_kind = MLPKind::kSwiGLU;
  NormKind norm_kind = NormKind::kRMSNorm;
  double norm_eps = 1e-5;          // rms_norm_eps
  bool norm_unit_offset = false;   // Gemma: the norms multiply by (1 + weight)
  bool post_attention_norm = false;  // Gemma 2 sandwich norms on the branch outputs
  bool post_mlp_norm = false;

  // --- Attention -------------------------------------------------------------------------
  double rope_base = 10000.0;                      // rope_theta
  std::optional<nn::functional::RopeScaling> rope_scaling;  // "llama3" rope_type
  int64_t sliding_window = 0;  // 0: none; else query i attends keys j > i - sliding_window
  // Which layers use the window: layer l does when l % sliding_window_period == 0 (1: every
  // layer, as Mistral; 2: layers 0, 2, 4, ..., as Gemma 2).
  int64_t sliding_window_period = 1;
  double attention_softcap = 0.0;  // 0: off; else scores = tanh(s / c) * c (Gemma 2: 50)
  // The scale of q k^T; nullopt means 1 / sqrt(head_size). Gemma 2: query_pre_attn_scalar^-0.5.
  std::optional<double> attention_scale;

  // --- Embedding and head ----------------------------------------------------------------
  bool scale_embeddings = false;  // Gemma: embeddings * sqrt(n_embd), rounded to their dtype
  bool tie_embeddings = false;    // the LM head reuses the embedding matrix
  double final_softcap = 0.0;     // 0: off; else logits = tanh(l / c) * c (Gemma 2: 30)

  // The resolved sizes: padded_vocab_size and head_size with their defaults applied.
  int64_t padded_vocab() const { return padded_vocab_size > 0 ? padded_vocab_size : vocab_size; }
  int64_t head_dim() const { return head_size > 0 ? head_size : n_embd / n_head; }
  bool uses_sliding_window(int64_t layer) const {
    return sliding_window > 0 && layer % sliding_window_period == 0;
  }
  double attn_scale() const;

  // Throws kiln::Error "[ModelConfig] <name>: ..." naming the first inconsistent field
  // (non-positive sizes, n_head not a multiple of n_query_groups, odd head size, padded vocab
  // below vocab, negative softcaps or window, ...).
  void validate() const;

  // Parameter count of a GPT built from this config (tied embeddings counted once).
  int64_t num_parameters() const;
  // Training FLOPs per token at sequence length seq_len, for MFU: 6 N (N without the embedding
  // table, which is a lookup; a tied head is a matmul and counts) plus attention's
  // 12 * n_layer * n_head * head_size * seq_len (forward + backward of q k^T and p v, with causal
  // attention counted in full as PaLM's and LitGPT's formulas do).
  double flops_per_token(int64_t seq_len) const;

  // The registry: a copy of the named config. Unknown names throw an error listing the
  // known ones.
  static ModelConfig from_name(const std::string& name);
  // Parses a Hugging Face config.json (a file path) of a LlamaForCausalLM,
  // MistralForCausalLM, GemmaForCausalLM or Gemma2ForCausalLM (defined in models/hf_config.cpp).
  static ModelConfig from_hf_config(const std::string& path);
  static ModelConfig from_hf_config_json(const std::string& json_text,
                                         const std::string& name = "hf");
};

// Names of the registered configs, sorted.
std::vector<std::string> config_names();
// Adds (or, with replace, overwrites) a named config; it is validated first.
void register_config(const ModelConfig& config, bool replace = false);

// The config kiln pretrains by default (the README's main job): a few million parameters,
// byte-level vocabulary, trains visibly on a CPU in minutes.
inline constexpr const char* kDefaultConfig = "kiln-tiny";

}  // namespace kiln::models
