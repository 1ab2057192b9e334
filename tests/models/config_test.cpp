// ModelConfig: the registry (names, lookup errors, registration), validation of every field,
// the published parameter counts, the FLOPs formula on a hand-computed case.
#include "models/config.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

namespace kiln::models {
namespace {

TEST(ModelConfigRegistry, NamesAreSortedAndComplete) {
  const std::vector<std::string> names = config_names();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  for (const char* want : {"llama-2-7b", "llama-3-8b", "llama-3.2-1b", "mistral-7b-v0.1",
                           "gemma-2b", "gemma-2-2b", "llama-160m", "tiny-llama", "tiny-llama3",
                           "tiny-mistral", "tiny-gemma", "tiny-gemma2", kDefaultConfig}) {
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
    EXPECT_EQ(ModelConfig::from_name(want).name, want);
  }
}

TEST(ModelConfigRegistry, UnknownNameListsTheKnownOnes) {
  EXPECT_KILN_ERROR(ModelConfig::from_name("llama-9000"),
                    "[ModelConfig] unknown config 'llama-9000'; known configs: ");
  EXPECT_KILN_ERROR(ModelConfig::from_name("llama-9000"), "gemma-2-2b, gemma-2b, kiln-tiny");
}

TEST(ModelConfigRegistry, RegisterValidatesAndRefusesDuplicates) {
  ModelConfig c = ModelConfig::from_name("tiny-llama");
  c.name = "test-registered";
  c.n_layer = 3;
  register_config(c);
  EXPECT_EQ(ModelConfig::from_name("test-registered").n_layer, 3);
  EXPECT_KILN_ERROR(register_config(c), "'test-registered' is already registered");
  c.n_layer = 5;
  register_config(c, /*replace=*/true);
  EXPECT_EQ(ModelConfig::from_name("test-registered").n_layer, 5);
  c.name = "test-invalid";
  c.n_embd = 0;
  EXPECT_KILN_ERROR(register_config(c), "[ModelConfig] test-invalid: n_embd must be positive");
  EXPECT_KILN_ERROR(ModelConfig::from_name("test-invalid"), "unknown config");
  c = ModelConfig::from_name("tiny-llama");
  c.name = "";
  EXPECT_KILN_ERROR(register_config(c), "needs a named config");
  // A copy is returned: changing it leaves the registry alone.
  ModelConfig copy = ModelConfig::from_name("tiny-llama");
  copy.n_layer = 99;
  EXPECT_EQ(ModelConfig::from_name("tiny-llama").n_layer, 2);
}

TEST(ModelConfigRegistry, ConcurrentRegistrationAndLookup) {
  std::vector<std::thread> threads;
  std::atomic<int> found{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t, &found] {
      for (int i = 0; i < 25; ++i) {
        ModelConfig c = ModelConfig::from_name("tiny-mistral");
        c.name = "test-thread-" + std::to_string(t) + "-" + std::to_string(i);
        register_config(c);
        if (ModelConfig::from_name(c.name).sliding_window == 8) ++found;
        (void)config_names();
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(found.load(), 100);
}

TEST(ModelConfig, FamilyFields) {
  const ModelConfig l32 = ModelConfig::from_name("llama-3.2-1b");
  ASSERT_TRUE(l32.rope_scaling.has_value());
  EXPECT_EQ(l32.rope_scaling->factor, 32.0);
  EXPECT_EQ(l32.rope_scaling->low_freq_factor, 1.0);
  EXPECT_EQ(l32.rope_scaling->high_freq_factor, 4.0);
  EXPECT_EQ(l32.rope_scaling->original_max_seq_len, 8192);
  EXPECT_TRUE(l32.tie_embeddings);
  EXPECT_EQ(l32.rope_base, 500000.0);
  EXPECT_EQ(l32.head_dim(), 64);

  const ModelConfig mistral = ModelConfig::from_name("mistral-7b-v0.1");
  EXPECT_EQ(mistral.sliding_window, 4096);
  EXPECT_TRUE(mistral.uses_sliding_window(0));
  EXPECT_TRUE(mistral.uses_sliding_window(31));

  const ModelConfig g2 = ModelConfig::from_name("gemma-2-2b");
  EXPECT_TRUE(g2.uses_sliding_window(0));
  EXPECT_FALSE(g2.uses_sliding_window(1));
  EXPECT_TRUE(g2.uses_sliding_window(2));
  EXPECT_EQ(g2.attention_softcap, 50.0);
  EXPECT_EQ(g2.final_softcap, 30.0);
  EXPECT_DOUBLE_EQ(g2.attn_scale(), 1.0 / 16.0);
  EXPECT_TRUE(g2.post_attention_norm && g2.post_mlp_norm && g2.norm_unit_offset);
  EXPECT_EQ(g2.mlp_kind, MLPKind::kGeGLUTanh);
  EXPECT_EQ(g2.head_dim(), 256);  // not n_embd / n_head = 288

  const ModelConfig gemma = ModelConfig::from_name("gemma-2b");
  EXPECT_EQ(gemma.n_query_groups, 1);
  EXPECT_TRUE(gemma.scale_embeddings && gemma.tie_embeddings && gemma.norm_unit_offset);
  EXPECT_EQ(gemma.norm_eps, 1e-6);
  EXPECT_FALSE(gemma.uses_sliding_window(0));

  const ModelConfig tiny = ModelConfig::from_name(kDefaultConfig);
  EXPECT_EQ(tiny.vocab_size, 256);
  EXPECT_GE(tiny.padded_vocab(), 256);
  EXPECT_GT(tiny.num_parameters(), 2'000'000);
  EXPECT_LT(tiny.num_parameters(), 10'000'000);

  EXPECT_DOUBLE_EQ(ModelConfig::from_name("tiny-llama").attn_scale(), 0.25);  // 1/sqrt(16)
  EXPECT_DOUBLE_EQ(ModelConfig::from_name("tiny-gemma2").attn_scale(), 1.0 / std::sqrt(24.0));
}

TEST(ModelConfig, DefaultsOfAHandBuiltConfig) {
  ModelConfig c;
  c.name = "hand";
  c.vocab_size = 100;
  c.n_layer = 1;
  c.n_embd = 32;
  c.n_head = 4;
  c.n_query_groups = 4;
  c.intermediate_size = 64;
  c.block_size = 16;
  c.validate();
  EXPECT_EQ(c.padded_vocab(), 100);
  EXPECT_EQ(c.head_dim(), 8);
  EXPECT_FALSE(c.uses_sliding_window(0));
}

// Published sizes, to three significant digits.
TEST(ModelConfig, PublishedParameterCounts) {
  const auto billions = [](const char* name) {
    const double n = static_cast<double>(ModelConfig::from_name(name).num_parameters()) / 1e9;
    return std::round(n * 100) / 100;
  };
  EXPECT_DOUBLE_EQ(billions("llama-2-7b"), 6.74);
  EXPECT_DOUBLE_EQ(billions("llama-3-8b"), 8.03);
  EXPECT_DOUBLE_EQ(billions("llama-3.2-1b"), 1.24);
  EXPECT_DOUBLE_EQ(billions("mistral-7b-v0.1"), 7.24);
  EXPECT_DOUBLE_EQ(billions("gemma-2b"), 2.51);
  EXPECT_DOUBLE_EQ(billions("gemma-2-2b"), 2.61);
  // Exact: the well-known 6,738,415,616 of Llama 2 7B.
  EXPECT_EQ(ModelConfig::from_name("llama-2-7b").num_parameters(), 6'738'415'616);
}

TEST(ModelConfig, ParametersAndFlopsByHand) {
  // tiny-llama: V 320, d 64, 4 heads x 16, 2 kv groups, ffn 172, 2 layers, untied.
  // Per layer: 2 norms 128 + qkv (4 + 4) * 16 * 64 = 8192 + proj 4096 + MLP 3 * 64 * 172 = 33024
  // = 45440; total 2 * 45440 + wte 20480 + ln_f 64 + head 20480 = 131904.
  const ModelConfig c = ModelConfig::from_name("tiny-llama");
  EXPECT_EQ(c.num_parameters(), 131904);
  // 6 * (131904 - 20480 for the embedding lookup) + 12 * 2 layers * 4 heads * 16 * 128 positions.
  EXPECT_DOUBLE_EQ(c.flops_per_token(128), 6.0 * 111424 + 12.0 * 2 * 4 * 16 * 128);
  // Tied (tiny-gemma): the table is also the head, so it counts.
  const ModelConfig g = ModelConfig::from_name("tiny-gemma");
  EXPECT_DOUBLE_EQ(g.flops_per_token(64),
                   6.0 * static_cast<double>(g.num_parameters()) + 12.0 * 2 * 4 * 16 * 64);
  // Gemma 2's sandwich norms add 2 d per layer.
  ModelConfig g2 = ModelConfig::from_name("tiny-gemma2");
  const int64_t with_post = g2.num_parameters();
  g2.post_attention_norm = g2.post_mlp_norm = false;
  EXPECT_EQ(with_post - g2.num_parameters(), 2 * 2 * 64);
}

// Each inconsistent field gets an error naming it.
TEST(ModelConfig, ValidateNamesTheInconsistentField) {
  struct Case {
    std::function<void(ModelConfig&)> mutate;
    const char* message;
  };
  const std::vector<Case> cases = {
      {[](ModelConfig& c) { c.vocab_size = 0; }, "vocab_size must be positive"},
      {[](ModelConfig& c) { c.padded_vocab_size = 100; }, "padded_vocab_size 100 is below"},
      {[](ModelConfig& c) { c.padded_vocab_size = -1; }, "padded_vocab_size must be >= 0"},
      {[](ModelConfig& c) { c.n_layer = 0; }, "n_layer must be positive"},
      {[](ModelConfig& c) { c.n_embd = -64; }, "n_embd must be positive"},
      {[](ModelConfig& c) { c.n_head = 0; }, "n_head must be positive"},
      {[](ModelConfig& c) { c.n_query_groups = 0; }, "n_query_groups must be positive"},
      {[](ModelConfig& c) { c.n_query_groups = 3; },
       "n_head 4 is not a multiple of n_query_groups 3"},
      {[](ModelConfig& c) { c.head_size = -2; }, "head_size must be >= 0"},
      {[](ModelConfig& c) { c.head_size = 15; }, "head_size must be positive and even"},
      {[](ModelConfig& c) {
         c.head_size = 0;
         c.n_embd = 66;
       },
       "n_embd 66 is not a multiple of n_head 4"},
      {[](ModelConfig& c) { c.intermediate_size = 0; }, "intermediate_size must be positive"},
      {[](ModelConfig& c) { c.block_size = 0; }, "block_size must be positive"},
      {[](ModelConfig& c) { c.norm_eps = 0; }, "norm_eps must be positive"},
      {[](ModelConfig& c) { c.rope_base = -1; }, "rope_base must be positive"},
      {[](ModelConfig& c) {
         c.rope_scaling = nn::functional::RopeScaling{8.0, 4.0, 1.0, 64};
       },
       "rope_scaling needs"},
      {[](ModelConfig& c) { c.sliding_window = -1; }, "sliding_window must be >= 0"},
      {[](ModelConfig& c) { c.sliding_window_period = 0; }, "sliding_window_period must be >= 1"},
      {[](ModelConfig& c) { c.attention_softcap = -50; }, "attention_softcap must be >= 0"},
      {[](ModelConfig& c) { c.final_softcap = -30; }, "final_softcap must be >= 0"},
      {[](ModelConfig& c) { c.attention_scale = 0.0; }, "attention_scale must be positive"},
      // Absurd sizes (a hostile config.json) fail here, not after hours of building layers or
      // in an overflowing size.
      {[](ModelConfig& c) { c.n_layer = int64_t{1} << 40; },
       "n_layer 1099511627776 exceeds the limit 4096"},
      {[](ModelConfig& c) { c.block_size = int64_t{1} << 62; },
       "block_size 4611686018427387904 exceeds the limit 1073741824"},
      {[](ModelConfig& c) { c.intermediate_size = int64_t{1} << 31; },
       "intermediate_size 2147483648 exceeds the limit"},
      {[](ModelConfig& c) {
         c.n_layer = 4096;
         c.n_embd = 1 << 20;
         c.head_size = 0;
       },
       "about 1.3513e+16 parameters, more than the limit 1e+13"},
  };
  for (const Case& k : cases) {
    ModelConfig c = ModelConfig::from_name("tiny-llama");
    c.validate();
    k.mutate(c);
    EXPECT_KILN_ERROR(c.validate(), std::string("[ModelConfig] tiny-llama: ") + k.message);
  }
  ModelConfig unnamed = ModelConfig::from_name("tiny-llama");
  unnamed.name.clear();
  unnamed.n_layer = 0;
  EXPECT_KILN_ERROR(unnamed.validate(), "[ModelConfig] (unnamed): n_layer");
}

}  // namespace
}  // namespace kiln::models
