// ModelConfig: validation, derived numbers (scale, parameters, FLOPs) and the named registry.
// The Hugging Face config.json parsers live in models/hf_config.cpp.
#include "models/config.h"

#include <cmath>
#include <map>
#include <mutex>
#include <sstream>
#include <utility>

#include "tensor/error.h"

namespace kiln::models {
namespace {

// validate()'s bounds: far above any released model (Llama 3.1 405B has 126 layers, 16384
// wide, 53248 in the MLP, 128k positions), low enough that sizes computed from them cannot
// overflow and that a hostile config.json fails before any tensor is built.
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxDim = int64_t{1} << 30;
constexpr double kMaxParameters = 1e13;

// --- The families, at full size (numbers from MODELS.md / the published HF configs) --------

ModelConfig llama(std::string name, int64_t vocab, int64_t layers, int64_t d, int64_t heads,
                  int64_t groups, int64_t ffn, int64_t block, double rope_base) {
  ModelConfig c;
  c.name = std::move(name);
  c.vocab_size = vocab;
  c.padded_vocab_size = vocab;
  c.n_layer = layers;
  c.n_embd = d;
  c.n_head = heads;
  c.n_query_groups = groups;
  c.head_size = d / heads;
  c.intermediate_size = ffn;
  c.block_size = block;
  c.rope_base = rope_base;
  c.norm_eps = 1e-5;
  return c;
}

// Gemma's common part: GeGLU (tanh), (1 + w) norms with eps 1e-6, embeddings scaled by
// sqrt(d), tied head.
ModelConfig gemma(std::string name, int64_t vocab, int64_t layers, int64_t d, int64_t heads,
                  int64_t groups, int64_t head_size, int64_t ffn, int64_t block) {
  ModelConfig c = llama(std::move(name), vocab, layers, d, heads, groups, ffn, block, 10000.0);
  c.head_size = head_size;
  c.mlp_kind = MLPKind::kGeGLUTanh;
  c.norm_eps = 1e-6;
  c.norm_unit_offset = true;
  c.scale_embeddings = true;
  c.tie_embeddings = true;
  return c;
}

// Gemma 2 on top of Gemma: sandwich norms, softcaps 50 / 30, window on even layers, query
// scale query_pre_attn_scalar^-0.5.
void make_gemma2(ModelConfig& c, int64_t window, double query_pre_attn_scalar) {
  c.post_attention_norm = true;
  c.post_mlp_norm = true;
  c.attention_softcap = 50.0;
  c.final_softcap = 30.0;
  c.sliding_window = window;
  c.sliding_window_period = 2;
  c.attention_scale = 1.0 / std::sqrt(query_pre_attn_scalar);
}

// Toy sizes with the same code paths: 2 layers, d 64, 4 heads, 2 kv groups, ffn 172.
ModelConfig tiny(std::string name) {
  return llama(std::move(name), 320, 2, 64, 4, 2, 172, 128, 10000.0);
}

std::vector<ModelConfig> builtin_configs() {
  std::vector<ModelConfig> out;

  out.push_back(llama("llama-2-7b", 32000, 32, 4096, 32, 32, 11008, 4096, 10000.0));
  out.push_back(llama("llama-3-8b", 128256, 32, 4096, 32, 8, 14336, 8192, 500000.0));
  {
    ModelConfig c = llama("llama-3.2-1b", 128256, 16, 2048, 32, 8, 8192, 131072, 500000.0);
    c.tie_embeddings = true;
    c.rope_scaling = nn::functional::RopeScaling{32.0, 1.0, 4.0, 8192};
    out.push_back(c);
  }
  {
    // HF's max_position_embeddings is 32768, but the model was trained with 4096 positions
    // and a 4096 window (LitGPT's block_size).
    ModelConfig c = llama("mistral-7b-v0.1", 32000, 32, 4096, 32, 8, 14336, 4096, 10000.0);
    c.sliding_window = 4096;
    out.push_back(c);
  }
  out.push_back(gemma("gemma-2b", 256000, 18, 2048, 8, 1, 256, 16384, 8192));
  {
    ModelConfig c = gemma("gemma-2-2b", 256000, 26, 2304, 8, 4, 256, 9216, 8192);
    make_gemma2(c, 4096, 256.0);
    out.push_back(c);
  }
  out.push_back(llama("llama-160m", 32000, 12, 768, 12, 12, 2048, 1024, 10000.0));

  // --- Toys: each family's features at a size that runs in milliseconds ---------------------
  out.push_back(tiny("tiny-llama"));
  {
    // Llama 3.2: rope base 500000, llama3 scaling with a short original length so that the
    // 8 frequencies of head size 16 fall in all three bands (kept, interpolated, divided).
    ModelConfig c = tiny("tiny-llama3");
    c.rope_base = 500000.0;
    c.rope_scaling = nn::functional::RopeScaling{8.0, 1.0, 4.0, 64};
    c.tie_embeddings = true;
    out.push_back(c);
  }
  {
    ModelConfig c = tiny("tiny-mistral");
    c.sliding_window = 8;  // shorter than the test sequences
    out.push_back(c);
  }
  {
    ModelConfig c = gemma("tiny-gemma", 320, 2, 64, 4, 1, 16, 172, 128);  // MQA
    out.push_back(c);
  }
  {
    // head_size 32 with 4 heads (128 != d 64) as Gemma 2's 8 x 256 != 2304; the query scale
    // (1/sqrt(24)) differs from 1/sqrt(head_size).
    ModelConfig c = gemma("tiny-gemma2", 320, 2, 64, 4, 2, 32, 172, 128);
    make_gemma2(c, 8, 24.0);
    out.push_back(c);
  }

  // The default pretraining config: byte-level, ~4.5 M parameters.
  {
    ModelConfig c = llama(kDefaultConfig, 256, 6, 256, 8, 4, 688, 256, 10000.0);
    c.padded_vocab_size = 320;
    out.push_back(c);
  }
  return out;
}

struct Registry {
  std::mutex mutex;
  std::map<std::string, ModelConfig> configs;
};

Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry;
    for (ModelConfig& c : builtin_configs()) {
      c.validate();
      reg->configs.emplace(c.name, std::move(c));
    }
    return reg;
  }();
  return *r;
}

}  // namespace

double ModelConfig::attn_scale() const {
  return attention_scale.value_or(1.0 / std::sqrt(static_cast<double>(head_dim())));
}

void ModelConfig::validate() const {
  const std::string who =
      "[ModelConfig] " + (name.empty() ? std::string("(unnamed)") : name) + ": ";
  KILN_CHECK(vocab_size > 0, who, "vocab_size must be positive, got ", vocab_size);
  KILN_CHECK(padded_vocab_size >= 0, who, "padded_vocab_size must be >= 0 (0 = vocab_size), got ",
             padded_vocab_size);
  KILN_CHECK(padded_vocab() >= vocab_size, who, "padded_vocab_size ", padded_vocab_size,
             " is below vocab_size ", vocab_size);
  KILN_CHECK(n_layer > 0, who, "n_layer must be positive, got ", n_layer);
  KILN_CHECK(n_embd > 0, who, "n_embd must be positive, got ", n_embd);
  KILN_CHECK(n_head > 0, who, "n_head must be positive, got ", n_head);
  KILN_CHECK(n_query_groups > 0, who, "n_query_groups must be positive, got ", n_query_groups);
  KILN_CHECK(n_head % n_query_groups == 0, who, "n_head ", n_head,
             " is not a multiple of n_query_groups ", n_query_groups);
  KILN_CHECK(head_size >= 0, who, "head_size must be >= 0 (0 = n_embd / n_head), got ", head_size);
  KILN_CHECK(head_size > 0 || n_embd % n_head == 0, who, "n_embd ", n_embd,
             " is not a multiple of n_head ", n_head, " (set head_size explicitly)");
  KILN_CHECK(head_dim() > 0 && head_dim() % 2 == 0, who,
             "head_size must be positive and even (RoPE rotates halves), got ", head_dim());
  KILN_CHECK(intermediate_size > 0, who, "intermediate_size must be positive, got ",
             intermediate_size);
  KILN_CHECK(block_size > 0, who, "block_size must be positive, got ", block_size);
  KILN_CHECK(norm_eps > 0 && std::isfinite(norm_eps), who, "norm_eps must be positive, got ",
             norm_eps);
  KILN_CHECK(rope_base > 0 && std::isfinite(rope_base), who, "rope_base must be positive, got ",
             rope_base);
  if (rope_scaling) {
    const auto& s = *rope_scaling;
    KILN_CHECK(s.factor > 0 && s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor &&
                   s.original_max_seq_len > 0,
               who,
               "rope_scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
               "original_max_seq_len > 0, got factor ",
               s.factor, ", low_freq_factor ", s.low_freq_factor, ", high_freq_factor ",
               s.high_freq_factor, ", original_max_seq_len ", s.original_max_seq_len);
  }
  KILN_CHECK(sliding_window >= 0, who, "sliding_window must be >= 0 (0 = none), got ",
             sliding_window);
  KILN_CHECK(sliding_window_period >= 1, who, "sliding_window_period must be >= 1, got ",
             sliding_window_period);
  KILN_CHECK(attention_softcap >= 0, who, "attention_softcap must be >= 0 (0 = off), got ",
             attention_softcap);
  KILN_CHECK(final_softcap >= 0, who, "final_softcap must be >= 0 (0 = off), got ", final_softcap);
  KILN_CHECK(!attention_scale || (*attention_scale > 0 && std::isfinite(*attention_scale)), who,
             "attention_scale must be positive, got ", attention_scale.value_or(0.0));
  // Bounds far above any real model, so that a damaged or hostile config.json fails here
  // instead of overflowing a size or building layers for hours.
  KILN_CHECK(n_layer <= kMaxLayers, who, "n_layer ", n_layer, " exceeds the limit ", kMaxLayers);
  for (const auto& [key, value] :
       {std::pair{"vocab_size", padded_vocab()}, std::pair{"n_embd", n_embd},
        std::pair{"n_head", n_head}, std::pair{"head_size", head_dim()},
        std::pair{"intermediate_size", intermediate_size}, std::pair{"block_size", block_size}}) {
    KILN_CHECK(value <= kMaxDim, who, key, " ", value, " exceeds the limit ", kMaxDim);
  }
  // Counted in floating point: with the bounds above the exact count may not fit in int64.
  const double d = static_cast<double>(n_embd), hs = static_cast<double>(head_dim());
  const double per_layer = (static_cast<double>(n_head) + 2.0 * n_query_groups) * hs * d +
                           d * n_head * hs + 3.0 * d * static_cast<double>(intermediate_size);
  const double params = static_cast<double>(n_layer) * per_layer +
                        (tie_embeddings ? 1.0 : 2.0) * static_cast<double>(padded_vocab()) * d;
  KILN_CHECK(params <= kMaxParameters, who, "about ", params, " parameters, more than the limit ",
             kMaxParameters);
}

int64_t ModelConfig::num_parameters() const {
  const int64_t d = n_embd, hs = head_dim();
  int64_t per_layer = 2 * d;                            // norm_1, norm_2
  per_layer += (n_head + 2 * n_query_groups) * hs * d;  // qkv
  per_layer += d * n_head * hs;                         // attn.proj
  per_layer += 3 * d * intermediate_size;               // fc_1, fc_2, proj
  if (post_attention_norm) per_layer += d;
  if (post_mlp_norm) per_layer += d;
  int64_t n = padded_vocab() * d + n_layer * per_layer + d;  // wte, blocks, ln_f
  if (!tie_embeddings) n += padded_vocab() * d;              // lm_head
  return n;
}

double ModelConfig::flops_per_token(int64_t seq_len) const {
  // The embedding table is a lookup, not a matmul: leave it out, unless it is also the head.
  const int64_t matmul_params = num_parameters() - (tie_embeddings ? 0 : padded_vocab() * n_embd);
  return 6.0 * static_cast<double>(matmul_params) +
         12.0 * static_cast<double>(n_layer) * static_cast<double>(n_head) *
             static_cast<double>(head_dim()) * static_cast<double>(seq_len);
}

ModelConfig ModelConfig::from_name(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.configs.find(name);
  if (it == r.configs.end()) {
    std::ostringstream known;
    for (auto k = r.configs.begin(); k != r.configs.end(); ++k) {
      known << (k == r.configs.begin() ? "" : ", ") << k->first;
    }
    KILN_FAIL("[ModelConfig] unknown config '", name, "'; known configs: ", known.str());
  }
  return it->second;
}

std::vector<std::string> config_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> names;
  names.reserve(r.configs.size());
  for (const auto& [k, v] : r.configs) names.push_back(k);
  return names;  // std::map: sorted
}

void register_config(const ModelConfig& config, bool replace) {
  KILN_CHECK(!config.name.empty(), "[ModelConfig] register_config needs a named config");
  config.validate();
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.configs.find(config.name);
  if (it != r.configs.end()) {
    KILN_CHECK(replace, "[ModelConfig] a config named '", config.name,
               "' is already registered (pass replace = true to overwrite it)");
    it->second = config;
    return;
  }
  r.configs.emplace(config.name, config);
}

}  // namespace kiln::models
