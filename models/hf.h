// Hugging Face interop: read and write the checkpoints of transformers' LlamaForCausalLM,
// MistralForCausalLM, GemmaForCausalLM and Gemma2ForCausalLM (config.json + safetensors).
//
//   // A published checkpoint (directory with config.json and model.safetensors, or sharded
//   // model-0000i-of-0000n.safetensors + model.safetensors.index.json), straight to bf16 GPU:
//   auto model = kiln::models::load_hf_checkpoint(
//       "Llama-3.2-1B", kiln::TensorOptions().dtype(kiln::kBFloat16).device(kiln::kCUDA));
//
//   // What kiln trained, in a layout transformers' from_pretrained loads:
//   kiln::models::save_hf_checkpoint(*model, "out/my-llama");
//
//   // Weights only, into a model built from a registry config:
//   kiln::models::GPT m(kiln::models::ModelConfig::from_name("llama-3.2-1b"));
//   kiln::models::load_hf_weights(*m, "Llama-3.2-1B");
//
// Name mapping (HF -> kiln, per layer i; see models/gpt.h for the kiln side):
//   model.embed_tokens.weight                       -> transformer.wte.weight
//   model.layers.i.input_layernorm.weight           -> transformer.h.i.norm_1.weight
//   model.layers.i.self_attn.{q,k,v}_proj.weight    -> transformer.h.i.attn.qkv.weight (rows
//                                                      q, then k, then v)
//   model.layers.i.self_attn.o_proj.weight          -> transformer.h.i.attn.proj.weight
//   model.layers.i.post_attention_layernorm.weight  -> norm_2 (Llama, Mistral, Gemma) or
//                                                      post_attention_norm (Gemma 2)
//   model.layers.i.pre_feedforward_layernorm.weight -> norm_2 (Gemma 2)
//   model.layers.i.post_feedforward_layernorm.weight-> post_mlp_norm (Gemma 2)
//   model.layers.i.mlp.{gate,up,down}_proj.weight   -> transformer.h.i.mlp.{fc_1,fc_2,proj}
//   model.norm.weight                               -> transformer.ln_f.weight
//   lm_head.weight                                  -> lm_head.weight (absent when tied)
// kiln's embedding and head may have more rows than HF's vocab_size (padded_vocab_size): the
// extra rows are zero on import and cut on export.
//
// Pitfalls:
// - Errors list every missing, unexpected and mis-shaped tensor at once, before any weight is
//   copied, so a failed load leaves the model as it was.
// - A tied checkpoint that still carries lm_head.weight loads (transformers ignores that
//   tensor too); rotary_emb.inv_freq buffers of old conversions are ignored.
// - save_hf_checkpoint replaces the directory as a whole: the new checkpoint is written into a
//   sibling directory, synced, and swapped in by one rename, so that a save killed at any point
//   leaves the previous checkpoint or the new one, never a mix of their shards
//   (models/hf_weights.cpp, "publishing", has the steps). The files of the directory that are
//   not weights, an index or config.json (tokenizer.json, README.md, ...) are carried over;
//   model*.safetensors files of the previous save are not (transformers would otherwise pick a
//   stale model.safetensors over a new index). Hidden ".<name>.kiln-*" siblings left by a killed
//   save are removed by the next save into the directory. The directory is a new one after each
//   save: a handle opened on the old one (another process's working directory) sees the old
//   checkpoint, removed. Saving needs write access to the parent directory as well.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "models/config.h"
#include "models/gpt.h"
#include "nn/safetensors.h"

namespace kiln::models {

// config.json text of the Hugging Face architecture that matches `config` (Llama, Mistral,
// Gemma or Gemma 2, chosen from its features); `dtype`, when given, is written as torch_dtype.
// Throws "[to_hf_config_json] <name>: ..." when no supported architecture expresses the config
// (e.g. a LayerNorm model, or a softcap without Gemma 2's sandwich norms).
std::string to_hf_config_json(const ModelConfig& config,
                              std::optional<ScalarType> dtype = std::nullopt);

// HF-named tensors -> kiln-named tensors for `config` (q/k/v concatenated, vocab rows padded
// with zeros). Tensors keep their dtype and device. Throws "[from_hf_state_dict] ..." listing
// every missing, unexpected and mis-shaped tensor.
TensorMap from_hf_state_dict(const TensorMap& hf, const ModelConfig& config);
// The model's parameters under HF names (views where possible; vocab rows cut to vocab_size).
TensorMap to_hf_state_dict(const GPTImpl& model);

// Copies the weights at `path` into `model` (converting to its dtype and device). `path` is a
// directory holding model.safetensors or model.safetensors.index.json, a .safetensors file, or
// an index .json file; shards are read one after the other. Throws "[load_hf_weights] ...".
void load_hf_weights(GPTImpl& model, const std::string& path);

// config.json + weights of the directory `dir` -> a model created with `options`.
GPT load_hf_checkpoint(const std::string& dir, const TensorOptions& options = {});

// Writes config.json and model.safetensors, or, when the weights exceed max_shard_bytes,
// model-0000i-of-0000n.safetensors + model.safetensors.index.json, in the model's dtype, and
// publishes them as a whole (see Pitfalls). Creates `dir` and its parents if needed. Throws
// "[save_hf_checkpoint] ...".
void save_hf_checkpoint(const GPTImpl& model, const std::string& dir,
                        int64_t max_shard_bytes = 5'000'000'000);

namespace internal {
// Test seams of save_hf_checkpoint (tests/models/hf_publish_test.cpp kills a process at each
// step). at_step is called after each step of publishing: "staged" (the new directory is
// complete and synced), "moved-aside" (two renames only: the previous one is out of the way),
// "published" (the new one is in place), "cleaned" (the previous one is removed). two_renames
// uses the way of file systems that cannot exchange two directories. Set it before saving, not
// while a save runs.
struct HfPublishHooks {
  void (*at_step)(const char* step) = nullptr;
  bool two_renames = false;
};
void set_hf_publish_hooks(const HfPublishHooks& hooks);
}  // namespace internal

}  // namespace kiln::models
