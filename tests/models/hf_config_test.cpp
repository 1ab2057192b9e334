// Hugging Face config.json (models/hf_config.cpp): parsing of each family field by field and its
// errors, and the export, which parses back to the same model for every registered config.
#include <gtest/gtest.h>

#include <cmath>
#include <regex>
#include <string>
#include <vector>

#include "models/hf.h"
#include "models/hf_test_util.h"
#include "test_util.h"

namespace kiln::models {
namespace {

using hftest::expect_same_model;
using hftest::TempDir;
using hftest::write_text;

// A Llama 2 7B config as published, plus keys kiln ignores.
constexpr const char* kLlama2Json = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 11008,
  "max_position_embeddings": 4096,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 32,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 10000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "float16",
  "transformers_version": "4.31.0.dev0",
  "use_cache": true,
  "vocab_size": 32000,
  "quantization_config": {"nested": [1, 2, {"x": null}]}
})";

TEST(HfConfig, LlamaFieldByField) {
  const ModelConfig c = ModelConfig::from_hf_config_json(kLlama2Json, "llama2");
  EXPECT_EQ(c.name, "llama2");
  EXPECT_EQ(c.vocab_size, 32000);
  EXPECT_EQ(c.padded_vocab(), 32000);
  EXPECT_EQ(c.n_layer, 32);
  EXPECT_EQ(c.n_embd, 4096);
  EXPECT_EQ(c.n_head, 32);
  EXPECT_EQ(c.n_query_groups, 32);
  EXPECT_EQ(c.head_dim(), 128);
  EXPECT_EQ(c.intermediate_size, 11008);
  EXPECT_EQ(c.block_size, 4096);
  EXPECT_EQ(c.mlp_kind, MLPKind::kSwiGLU);
  EXPECT_EQ(c.norm_kind, NormKind::kRMSNorm);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-5);
  EXPECT_FALSE(c.norm_unit_offset);
  EXPECT_FALSE(c.post_attention_norm);
  EXPECT_FALSE(c.post_mlp_norm);
  EXPECT_DOUBLE_EQ(c.rope_base, 10000.0);
  EXPECT_FALSE(c.rope_scaling.has_value());
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.attention_softcap, 0.0);
  EXPECT_FALSE(c.attention_scale.has_value());
  EXPECT_FALSE(c.scale_embeddings);
  EXPECT_FALSE(c.tie_embeddings);
  EXPECT_EQ(c.final_softcap, 0.0);
  // The same numbers as the registry's llama-2-7b.
  const ModelConfig reg = ModelConfig::from_name("llama-2-7b");
  EXPECT_EQ(c.num_parameters(), reg.num_parameters());
}

TEST(HfConfig, Llama32WithRopeScalingAndTiedEmbeddings) {
  const std::string json = R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": true, "hidden_act": "silu", "mlp_bias": false})";
  const ModelConfig c = ModelConfig::from_hf_config_json(json);
  EXPECT_EQ(c.name, "hf");
  EXPECT_EQ(c.n_query_groups, 8);
  EXPECT_EQ(c.head_dim(), 64);
  EXPECT_EQ(c.block_size, 131072);
  EXPECT_DOUBLE_EQ(c.rope_base, 500000.0);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(c.rope_scaling->factor, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling->original_max_seq_len, 8192);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_EQ(c.num_parameters(), ModelConfig::from_name("llama-3.2-1b").num_parameters());
}

TEST(HfConfig, TransformersFiveRopeParameters) {
  // transformers 5 moves rope_theta and the scaling into rope_parameters; the legacy "type"
  // key spells rope_type in older configs.
  const std::string json = R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}})";
  const ModelConfig c = ModelConfig::from_hf_config_json(json);
  EXPECT_DOUBLE_EQ(c.rope_base, 500000.0);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(c.rope_scaling->factor, 8.0);
  // Llama's defaults for the keys left out.
  EXPECT_EQ(c.n_query_groups, 2);
  EXPECT_EQ(c.head_dim(), 16);
  EXPECT_EQ(c.block_size, 2048);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-6);
  EXPECT_FALSE(c.tie_embeddings);

  const ModelConfig d = ModelConfig::from_hf_config_json(
      R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 2,
          "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}})");
  EXPECT_DOUBLE_EQ(d.rope_base, 1000.0);
  EXPECT_FALSE(d.rope_scaling.has_value());
}

TEST(HfConfig, MistralSlidingWindow) {
  const std::string base = R"({"architectures": ["MistralForCausalLM"], "vocab_size": 32000,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": false)";
  const ModelConfig c = ModelConfig::from_hf_config_json(base + R"(, "sliding_window": 4096})");
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_EQ(c.sliding_window_period, 1);
  EXPECT_TRUE(c.uses_sliding_window(0));
  EXPECT_TRUE(c.uses_sliding_window(31));
  EXPECT_EQ(c.n_query_groups, 8);
  EXPECT_EQ(c.block_size, 32768);
  EXPECT_EQ(c.mlp_kind, MLPKind::kSwiGLU);
  EXPECT_EQ(c.num_parameters(), ModelConfig::from_name("mistral-7b-v0.1").num_parameters());
  // Mistral v0.2+ write null: no window.
  EXPECT_EQ(ModelConfig::from_hf_config_json(base + R"(, "sliding_window": null})").sliding_window,
            0);
  // Absent: transformers' default, 4096.
  EXPECT_EQ(ModelConfig::from_hf_config_json(base + "}").sliding_window, 4096);
}

TEST(HfConfig, GemmaFieldByField) {
  const std::string json = R"({"architectures": ["GemmaForCausalLM"], "model_type": "gemma",
    "vocab_size": 256000, "hidden_size": 2048, "intermediate_size": 16384,
    "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1,
    "head_dim": 256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": true, "torch_dtype": "bfloat16"})";
  const ModelConfig c = ModelConfig::from_hf_config_json(json);
  EXPECT_EQ(c.mlp_kind, MLPKind::kGeGLUTanh);
  EXPECT_TRUE(c.norm_unit_offset);
  EXPECT_TRUE(c.scale_embeddings);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_EQ(c.n_query_groups, 1);
  EXPECT_EQ(c.head_dim(), 256);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-6);
  EXPECT_FALSE(c.post_attention_norm);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.attention_softcap, 0.0);
  EXPECT_FALSE(c.attention_scale.has_value());
  EXPECT_EQ(c.num_parameters(), ModelConfig::from_name("gemma-2b").num_parameters());

  // head_dim defaults to 256 for Gemma (not hidden / heads); an unset hidden_activation makes
  // transformers run the tanh approximation even when hidden_act says "gelu".
  const ModelConfig d = ModelConfig::from_hf_config_json(
      R"({"model_type": "gemma", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 1, "num_attention_heads": 2, "hidden_act": "gelu",
          "hidden_activation": null})");
  EXPECT_EQ(d.head_dim(), 256);
  EXPECT_EQ(d.mlp_kind, MLPKind::kGeGLUTanh);
  EXPECT_TRUE(d.tie_embeddings);
}

constexpr const char* kGemma2Json = R"({
  "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
  "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
  "cache_implementation": "hybrid", "head_dim": 256,
  "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 2304, "intermediate_size": 9216, "max_position_embeddings": 8192,
  "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
  "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
  "sliding_window": 4096, "vocab_size": 256000)";

// kGemma2Json without the number-valued `keys`, so that a test can give them other values: a key
// twice in one object is an error (nn/json.h).
std::string gemma2_without(const std::vector<std::string>& keys) {
  std::string json = kGemma2Json;
  for (const std::string& key : keys) {
    json = std::regex_replace(json, std::regex("\"" + key + "\": [^,]*, ?"), "");
  }
  return json;
}

TEST(HfConfig, Gemma2FieldByField) {
  const ModelConfig c = ModelConfig::from_hf_config_json(std::string(kGemma2Json) + "}");
  EXPECT_EQ(c.mlp_kind, MLPKind::kGeGLUTanh);
  EXPECT_TRUE(c.norm_unit_offset);
  EXPECT_TRUE(c.scale_embeddings);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_TRUE(c.post_attention_norm);
  EXPECT_TRUE(c.post_mlp_norm);
  EXPECT_DOUBLE_EQ(c.attention_softcap, 50.0);
  EXPECT_DOUBLE_EQ(c.final_softcap, 30.0);
  ASSERT_TRUE(c.attention_scale.has_value());
  EXPECT_DOUBLE_EQ(*c.attention_scale, 1.0 / 16.0);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_EQ(c.sliding_window_period, 2);
  EXPECT_TRUE(c.uses_sliding_window(0));
  EXPECT_FALSE(c.uses_sliding_window(1));
  EXPECT_TRUE(c.uses_sliding_window(24));
  EXPECT_EQ(c.head_dim(), 256);
  EXPECT_EQ(c.n_query_groups, 4);
  EXPECT_EQ(c.num_parameters(), ModelConfig::from_name("gemma-2-2b").num_parameters());

  // Null softcaps switch them off; query_pre_attn_scalar need not be head_dim.
  const ModelConfig d = ModelConfig::from_hf_config_json(
      gemma2_without(
          {"attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"}) +
      R"(, "attn_logit_softcapping": null, "final_logit_softcapping": null,
          "query_pre_attn_scalar": 224})");
  EXPECT_EQ(d.attention_softcap, 0.0);
  EXPECT_EQ(d.final_softcap, 0.0);
  EXPECT_DOUBLE_EQ(*d.attention_scale, 1.0 / std::sqrt(224.0));
}

TEST(HfConfig, Gemma2LayerTypes) {
  std::string types = R"(, "num_hidden_layers": 4, "layer_types": [)";
  auto with = [&](const std::vector<std::string>& t) {
    std::string j =
        gemma2_without({"num_hidden_layers"}) + R"(, "num_hidden_layers": 4, "layer_types": [)";
    for (size_t i = 0; i < t.size(); ++i) j += (i ? ", \"" : "\"") + t[i] + "\"";
    return j + "]}";
  };
  const std::string s = "sliding_attention", f = "full_attention";
  const ModelConfig even = ModelConfig::from_hf_config_json(with({s, f, s, f}));
  EXPECT_EQ(even.sliding_window_period, 2);
  EXPECT_EQ(even.sliding_window, 4096);
  const ModelConfig all = ModelConfig::from_hf_config_json(with({s, s, s, s}));
  EXPECT_EQ(all.sliding_window_period, 1);
  const ModelConfig none = ModelConfig::from_hf_config_json(with({f, f, f, f}));
  EXPECT_EQ(none.sliding_window, 0);
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config_json(with({f, s, f, s})),
                    "unsupported layer_types pattern");
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config_json(with({s, f})), "layer_types has 2 entries");
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config_json(with({s, f, s, "chunked_attention"})),
                    "unsupported layer type 'chunked_attention'");
}

TEST(HfConfig, Errors) {
  const std::string tail = R"("vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4)";
  auto llama = [&](const std::string& extra) {
    return std::string(R"({"architectures": ["LlamaForCausalLM"], )") + tail + extra + "}";
  };
  EXPECT_NO_THROW(ModelConfig::from_hf_config_json(llama("")));
  // An absurd layer count is rejected at once (it built layers until memory ran out).
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config_json(
                        std::string(R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 100,
                          "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                          "num_hidden_layers": 1000000000})"),
                        "absurd"),
                    "n_layer 1000000000 exceeds the limit 4096");
  // Two readers could disagree on which of two equal keys wins: rejected.
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config_json(llama(R"(, "hidden_size": 128)")),
                    "duplicate key \"hidden_size\"");
  EXPECT_KILN_ERROR(
      ModelConfig::from_hf_config_json(R"({"architectures": ["GPT2LMHeadModel"], )" + tail + "}",
                                       "gpt2"),
      "[from_hf_config] gpt2: unsupported architecture 'GPT2LMHeadModel' (kiln loads: "
      "LlamaForCausalLM, MistralForCausalLM, GemmaForCausalLM, Gemma2ForCausalLM)");
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config_json(R"({"model_type": "qwen2", )" + tail + "}"),
                    "unsupported model_type 'qwen2'");
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config_json("{" + tail + "}"),
                    "neither 'architectures' nor 'model_type'");
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config_json(R"({"model_type": "llama", "vocab_size": 100,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4})"),
                    "[from_hf_config] hf: missing required key 'hidden_size'");
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config_json(llama(R"(, "rope_scaling": {"type": "linear",
          "factor": 2.0})")),
                    "unsupported rope_type 'linear'");
  EXPECT_KILN_ERROR(
      ModelConfig::from_hf_config_json(llama(R"(, "rope_scaling": {"rope_type": "yarn",
          "factor": 4.0, "original_max_position_embeddings": 4096})")),
      "unsupported rope_type 'yarn'");
  EXPECT_KILN_ERROR(
      ModelConfig::from_hf_config_json(llama(R"(, "rope_scaling": {"rope_type": "llama3",
          "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})")),
      "missing required key 'rope_scaling.original_max_position_embeddings'");
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config_json(llama(R"(, "hidden_act": "gelu")")),
                    "unsupported activation 'gelu'");
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config_json(llama(R"(, "attention_bias": true)")),
                    "attention_bias is true");
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config_json(llama(R"(, "num_key_value_heads": 3)")),
                    "[from_hf_config] hf: [ModelConfig]");
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config_json(
                        R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 100,
                          "hidden_size": "64", "intermediate_size": 128, "num_hidden_layers": 2,
                          "num_attention_heads": 4})"),
                    "malformed config.json");
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config_json(
                        R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 100,
                          "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2.5,
                          "num_attention_heads": 4})"),
                    "num_hidden_layers is not an integer");
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config_json(llama(R"(, "tie_word_embeddings": 1)")),
                    "tie_word_embeddings is not a boolean");
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config_json(llama("").substr(0, 40)),
                    "malformed config.json");
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config_json(R"({"architectures": ["GemmaForCausalLM"], )" +
                                                     tail + R"(, "hidden_activation": "gelu"})"),
                    "unsupported activation 'gelu'");

  // From a file: the error names the file.
  TempDir dir;
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config((dir / "config.json").string()),
                    "[from_hf_config] " + (dir / "config.json").string() + ": cannot open");
  write_text(dir / "config.json", R"({"architectures": ["BertModel"]})");
  EXPECT_KILN_ERROR(ModelConfig::from_hf_config(dir.str()),
                    "[from_hf_config] " + (dir / "config.json").string() +
                        ": unsupported architecture 'BertModel'");
  write_text(dir / "config.json", llama(""));
  const ModelConfig c = ModelConfig::from_hf_config(dir.str());  // a directory works too
  EXPECT_EQ(c.name, dir.str().substr(dir.str().rfind('/') + 1));
}

// A query_pre_attn_scalar too large for an int64 (a fuzz finding: converting it was undefined)
// is exported as a double and reads back as the same model; a small integral one as an int; a
// large one that is not integral as a double (a fuzz finding: 922337203.85 was written as
// 922337204). One beyond [1e-300, 1e300] is refused: 1e-320's scale squared overflowed, and it
// exported as 0.
TEST(HfConfig, Gemma2ExportWritesTheQueryScalarThatFits) {
  for (const char* scalar : {"922337203685477580720", "1e300", "1e-300", "224",
                             "922337203.85477580720", "1000000.0001"}) {
    SCOPED_TRACE(scalar);
    const ModelConfig c = ModelConfig::from_hf_config_json(
        gemma2_without({"query_pre_attn_scalar"}) + ", \"query_pre_attn_scalar\": " + scalar + "}");
    const std::string json = to_hf_config_json(c);
    expect_same_model(c, ModelConfig::from_hf_config_json(json, "exported"));
    if (std::string(scalar) == "224") {
      EXPECT_NE(json.find("\"query_pre_attn_scalar\": 224,"), std::string::npos) << json;
    }
    if (std::string(scalar) == "922337203.85477580720") {
      EXPECT_EQ(json.find("\"query_pre_attn_scalar\": 922337204,"), std::string::npos) << json;
    }
  }
}

TEST(HfConfig, Gemma2QueryScalarOutOfRangeIsRefused) {
  for (const char* scalar : {"1e-320", "2e300", "0", "-4"}) {
    SCOPED_TRACE(scalar);
    EXPECT_KILN_ERROR(
        ModelConfig::from_hf_config_json(gemma2_without({"query_pre_attn_scalar"}) +
                                             ", \"query_pre_attn_scalar\": " + scalar + "}",
                                         "g.json"),
        "[from_hf_config] g.json: query_pre_attn_scalar must be between 1e-300 and 1e300, got");
  }
}

TEST(HfConfig, ExportParsesBackForEveryRegisteredConfig) {
  for (const std::string& name : config_names()) {
    SCOPED_TRACE(name);
    const ModelConfig c = ModelConfig::from_name(name);
    const std::string json = to_hf_config_json(c, kBFloat16);
    EXPECT_NE(json.find("\"torch_dtype\": \"bfloat16\""), std::string::npos);
    expect_same_model(c, ModelConfig::from_hf_config_json(json, name));
  }
  const auto arch = [](const std::string& name) {
    const std::string j = to_hf_config_json(ModelConfig::from_name(name));
    return j.substr(j.find("For") - 10, 30);
  };
  EXPECT_NE(arch("llama-3.2-1b").find("\"LlamaForCausalLM\""), std::string::npos);
  EXPECT_NE(arch("mistral-7b-v0.1").find("\"MistralForCausalLM\""), std::string::npos);
  EXPECT_NE(arch("gemma-2b").find("\"GemmaForCausalLM\""), std::string::npos);
  EXPECT_NE(arch("gemma-2-2b").find("\"Gemma2ForCausalLM\""), std::string::npos);
}

TEST(HfConfig, ExportRejectsWhatNoArchitectureExpresses) {
  ModelConfig ln = ModelConfig::from_name("tiny-llama");
  ln.norm_kind = NormKind::kLayerNorm;
  EXPECT_KILN_ERROR(to_hf_config_json(ln), "every family uses RMSNorm");
  ModelConfig cap = ModelConfig::from_name("tiny-llama");
  cap.final_softcap = 30;
  EXPECT_KILN_ERROR(to_hf_config_json(cap),
                    "[to_hf_config_json] tiny-llama: no Hugging Face architecture matches "
                    "(closest LlamaForCausalLM): Llama/Mistral have no logit softcaps");
  ModelConfig geglu = ModelConfig::from_name("tiny-llama");
  geglu.mlp_kind = MLPKind::kGeGLUTanh;
  EXPECT_KILN_ERROR(to_hf_config_json(geglu), "Gemma's norms use the unit offset");
  ModelConfig half_sandwich = ModelConfig::from_name("tiny-gemma2");
  half_sandwich.post_mlp_norm = false;
  EXPECT_KILN_ERROR(to_hf_config_json(half_sandwich), "both post-attention and post-MLP norms");
  ModelConfig every_layer = ModelConfig::from_name("tiny-gemma2");
  every_layer.sliding_window_period = 1;
  EXPECT_KILN_ERROR(to_hf_config_json(every_layer), "Gemma 2 windows the even layers");
}

}  // namespace
}  // namespace kiln::models
