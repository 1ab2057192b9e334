// Hugging Face config.json <-> ModelConfig: the four families (Llama, Mistral, Gemma, Gemma 2),
// config.json parsing with each family's defaults (legacy rope_scaling and transformers 5
// rope_parameters, layer_types), and the export that picks the architecture expressing a
// ModelConfig. Tensor names and checkpoint files: models/hf_weights.cpp; API: models/hf.h.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "models/hf.h"
#include "nn/safetensors.h"
#include "nn/json.h"
#include "tensor/error.h"

namespace kiln::models {
namespace {

namespace fs = std::filesystem;
using nn::json_string;
using nn::JsonError;
using nn::JsonReader;

enum class Family { kLlama, kMistral, kGemma, kGemma2 };

struct FamilyInfo {
  Family family;
  const char* architecture;
  const char* model_type;
};

constexpr FamilyInfo kFamilies[] = {
    {Family::kLlama, "LlamaForCausalLM", "llama"},
    {Family::kMistral, "MistralForCausalLM", "mistral"},
    {Family::kGemma, "GemmaForCausalLM", "gemma"},
    {Family::kGemma2, "Gemma2ForCausalLM", "gemma2"},
};

const FamilyInfo& info_of(Family f) {
  for (const FamilyInfo& i : kFamilies) {
    if (i.family == f) return i;
  }
  KILN_FAIL("[hf] unknown family");
}

std::string supported_architectures() {
  std::string s;
  for (const FamilyInfo& i : kFamilies) s += std::string(s.empty() ? "" : ", ") + i.architecture;
  return s;
}

// ================================ config.json -> ModelConfig ================================

// The rope_scaling (legacy) or rope_parameters (transformers 5) object.
struct RopeSpec {
  std::optional<std::string> type;  // rope_type, or the legacy "type"
  std::optional<double> theta;      // rope_parameters carries rope_theta
  std::optional<double> factor, low_freq_factor, high_freq_factor;
  std::optional<int64_t> original_max_position_embeddings;
};

// The keys of config.json that kiln reads; everything else is checked and skipped.
struct HfConfigJson {
  std::optional<std::string> architecture, model_type;
  std::optional<int64_t> vocab_size, hidden_size, intermediate_size, num_hidden_layers,
      num_attention_heads, num_key_value_heads, head_dim, max_position_embeddings;
  std::optional<double> rms_norm_eps, rope_theta, query_pre_attn_scalar;
  std::optional<RopeSpec> rope_scaling, rope_parameters;
  std::optional<bool> tie_word_embeddings, attention_bias, mlp_bias;
  bool sliding_window_present = false;  // the key is there (possibly null)
  std::optional<int64_t> sliding_window;
  std::optional<std::vector<std::string>> layer_types;
  std::optional<std::string> hidden_act, hidden_activation;
  bool attn_softcap_present = false, final_softcap_present = false;
  std::optional<double> attn_logit_softcapping, final_logit_softcapping;
};

// Whether the next value is null (then consumed).
bool take_null(JsonReader& r) {
  if (r.peek_kind() != 'z') return false;
  r.read_null();
  return true;
}

RopeSpec parse_rope(JsonReader& r, const std::string& what) {
  RopeSpec spec;
  r.begin_object();
  while (auto key = r.next_key()) {
    const std::string k = what + "." + *key;
    if (*key == "rope_type" || *key == "type") {
      spec.type = r.read_string();
    } else if (*key == "rope_theta") {
      spec.theta = r.read_double(k);
    } else if (*key == "factor") {
      spec.factor = r.read_double(k);
    } else if (*key == "low_freq_factor") {
      spec.low_freq_factor = r.read_double(k);
    } else if (*key == "high_freq_factor") {
      spec.high_freq_factor = r.read_double(k);
    } else if (*key == "original_max_position_embeddings") {
      spec.original_max_position_embeddings = r.read_int64(k);
    } else {
      r.skip_value();
    }
  }
  return spec;
}

HfConfigJson parse_config_json(const std::string& text) {
  HfConfigJson c;
  JsonReader r(text);
  r.begin_object();
  while (auto key = r.next_key()) {
    const std::string& k = *key;
    auto opt_int = [&](std::optional<int64_t>& out) {
      out = take_null(r) ? std::nullopt : std::optional<int64_t>(r.read_int64(k));
    };
    auto opt_double = [&](std::optional<double>& out) {
      out = take_null(r) ? std::nullopt : std::optional<double>(r.read_double(k));
    };
    auto opt_bool = [&](std::optional<bool>& out) {
      out = take_null(r) ? std::nullopt : std::optional<bool>(r.read_bool(k));
    };
    auto opt_string = [&](std::optional<std::string>& out) {
      out.reset();
      if (take_null(r)) return;
      if (r.peek_kind() != '"') r.fail(k + " is not a string");
      out = r.read_string();
    };
    // A repeated key overrides the earlier one, as in Python's json.
    if (k == "architectures") {
      c.architecture.reset();
      if (take_null(r)) continue;
      r.begin_array();
      while (r.next_element()) {
        if (r.peek_kind() != '"') r.fail("architectures holds a non-string");
        std::string a = r.read_string();
        if (!c.architecture) c.architecture = std::move(a);
      }
    } else if (k == "model_type") {
      opt_string(c.model_type);
    } else if (k == "vocab_size") {
      opt_int(c.vocab_size);
    } else if (k == "hidden_size") {
      opt_int(c.hidden_size);
    } else if (k == "intermediate_size") {
      opt_int(c.intermediate_size);
    } else if (k == "num_hidden_layers") {
      opt_int(c.num_hidden_layers);
    } else if (k == "num_attention_heads") {
      opt_int(c.num_attention_heads);
    } else if (k == "num_key_value_heads") {
      opt_int(c.num_key_value_heads);
    } else if (k == "head_dim") {
      opt_int(c.head_dim);
    } else if (k == "max_position_embeddings") {
      opt_int(c.max_position_embeddings);
    } else if (k == "rms_norm_eps") {
      opt_double(c.rms_norm_eps);
    } else if (k == "rope_theta") {
      opt_double(c.rope_theta);
    } else if (k == "query_pre_attn_scalar") {
      opt_double(c.query_pre_attn_scalar);
    } else if (k == "rope_scaling" || k == "rope_parameters") {
      std::optional<RopeSpec>& spec = k == "rope_scaling" ? c.rope_scaling : c.rope_parameters;
      spec.reset();
      if (take_null(r)) continue;
      if (r.peek_kind() != '{') r.fail(k + " is not an object");
      spec = parse_rope(r, k);
    } else if (k == "tie_word_embeddings") {
      opt_bool(c.tie_word_embeddings);
    } else if (k == "attention_bias") {
      opt_bool(c.attention_bias);
    } else if (k == "mlp_bias") {
      opt_bool(c.mlp_bias);
    } else if (k == "sliding_window") {
      c.sliding_window_present = true;
      opt_int(c.sliding_window);
    } else if (k == "layer_types") {
      c.layer_types.reset();
      if (take_null(r)) continue;
      std::vector<std::string> types;
      r.begin_array();
      while (r.next_element()) {
        if (r.peek_kind() != '"') r.fail("layer_types holds a non-string");
        types.push_back(r.read_string());
      }
      c.layer_types = std::move(types);
    } else if (k == "hidden_act") {
      opt_string(c.hidden_act);
    } else if (k == "hidden_activation") {
      opt_string(c.hidden_activation);
    } else if (k == "attn_logit_softcapping") {
      c.attn_softcap_present = true;
      opt_double(c.attn_logit_softcapping);
    } else if (k == "final_logit_softcapping") {
      c.final_softcap_present = true;
      opt_double(c.final_logit_softcapping);
    } else {
      r.skip_value();
    }
  }
  r.end_document();
  return c;
}

Family family_of(const HfConfigJson& c) {
  if (c.architecture) {
    for (const FamilyInfo& i : kFamilies) {
      if (*c.architecture == i.architecture) return i.family;
    }
    KILN_FAIL("unsupported architecture '", *c.architecture,
              "' (kiln loads: ", supported_architectures(), ")");
  }
  if (c.model_type) {
    for (const FamilyInfo& i : kFamilies) {
      if (*c.model_type == i.model_type) return i.family;
    }
    KILN_FAIL("unsupported model_type '", *c.model_type,
              "' (kiln loads: ", supported_architectures(), ")");
  }
  KILN_FAIL("neither 'architectures' nor 'model_type' says which model this is");
}

template <typename T>
T required(const std::optional<T>& v, const char* key) {
  KILN_CHECK(v.has_value(), "missing required key '", key, "'");
  return *v;
}

void apply_rope(const HfConfigJson& c, ModelConfig& cfg) {
  cfg.rope_base = c.rope_theta.value_or(10000.0);
  // transformers 5 writes rope_parameters; older versions rope_theta + rope_scaling.
  const std::optional<RopeSpec>& spec = c.rope_parameters ? c.rope_parameters : c.rope_scaling;
  if (!spec) return;
  if (spec->theta) cfg.rope_base = *spec->theta;
  const std::string type = spec->type.value_or("default");
  if (type == "default") return;
  KILN_CHECK(type == "llama3", "unsupported rope_type '", type,
             "' (kiln supports the default RoPE and 'llama3' scaling)");
  nn::functional::RopeScaling s;
  s.factor = required(spec->factor, "rope_scaling.factor");
  s.low_freq_factor = required(spec->low_freq_factor, "rope_scaling.low_freq_factor");
  s.high_freq_factor = required(spec->high_freq_factor, "rope_scaling.high_freq_factor");
  s.original_max_seq_len = required(spec->original_max_position_embeddings,
                                    "rope_scaling.original_max_position_embeddings");
  KILN_CHECK(s.factor > 0 && s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor &&
                 s.original_max_seq_len > 0,
             "invalid llama3 rope_scaling (factor ", s.factor, ", low_freq_factor ",
             s.low_freq_factor, ", high_freq_factor ", s.high_freq_factor,
             ", original_max_position_embeddings ", s.original_max_seq_len,
             "): needs positive values and high_freq_factor > low_freq_factor");
  cfg.rope_scaling = s;
}

// Which layers use the window, from layer_types ("sliding_attention" / "full_attention").
void apply_layer_types(const std::vector<std::string>& types, ModelConfig& cfg) {
  KILN_CHECK(static_cast<int64_t>(types.size()) == cfg.n_layer, "layer_types has ", types.size(),
             " entries for ", cfg.n_layer, " layers");
  std::vector<bool> sliding;
  for (const std::string& t : types) {
    KILN_CHECK(t == "sliding_attention" || t == "full_attention", "unsupported layer type '", t,
               "' in layer_types");
    sliding.push_back(t == "sliding_attention");
  }
  const bool any = std::find(sliding.begin(), sliding.end(), true) != sliding.end();
  if (!any) {
    cfg.sliding_window = 0;
    return;
  }
  KILN_CHECK(cfg.sliding_window > 0, "layer_types has sliding layers but sliding_window is null");
  for (const int64_t period : {1, 2}) {
    bool match = true;
    for (size_t l = 0; l < sliding.size(); ++l) match &= sliding[l] == (l % period == 0);
    if (match) {
      cfg.sliding_window_period = period;
      return;
    }
  }
  KILN_FAIL("unsupported layer_types pattern: kiln windows every layer or the even ones");
}

ModelConfig config_from_json(const HfConfigJson& c, const std::string& name) {
  const Family family = family_of(c);
  const bool gemma = family == Family::kGemma || family == Family::kGemma2;
  ModelConfig cfg;
  cfg.name = name;
  cfg.vocab_size = required(c.vocab_size, "vocab_size");
  cfg.padded_vocab_size = cfg.vocab_size;
  cfg.n_layer = required(c.num_hidden_layers, "num_hidden_layers");
  cfg.n_embd = required(c.hidden_size, "hidden_size");
  cfg.n_head = required(c.num_attention_heads, "num_attention_heads");
  cfg.intermediate_size = required(c.intermediate_size, "intermediate_size");
  KILN_CHECK(cfg.n_head > 0, "num_attention_heads must be positive, got ", cfg.n_head);
  cfg.n_query_groups = c.num_key_value_heads.value_or(cfg.n_head);
  // Gemma's configs default head_dim to 256; Llama's and Mistral's to hidden / heads.
  if (c.head_dim) {
    cfg.head_size = *c.head_dim;
  } else if (gemma) {
    cfg.head_size = 256;
  } else {
    KILN_CHECK(cfg.n_embd % cfg.n_head == 0, "hidden_size ", cfg.n_embd,
               " is not a multiple of num_attention_heads ", cfg.n_head, " and head_dim is unset");
    cfg.head_size = cfg.n_embd / cfg.n_head;
  }
  const int64_t default_context = family == Family::kLlama     ? 2048
                                  : family == Family::kMistral ? 4096 * 32
                                                               : 8192;
  cfg.block_size = c.max_position_embeddings.value_or(default_context);
  cfg.norm_kind = NormKind::kRMSNorm;
  cfg.norm_eps = c.rms_norm_eps.value_or(1e-6);
  KILN_CHECK(!c.attention_bias.value_or(false),
             "attention_bias is true: kiln's projections have no bias");
  KILN_CHECK(!c.mlp_bias.value_or(false), "mlp_bias is true: kiln's projections have no bias");
  apply_rope(c, cfg);

  // The activation: Gemma reads hidden_activation first; when that is unset, transformers runs
  // Gemma 1 with the tanh approximation even if hidden_act says "gelu".
  const std::string act = c.hidden_activation ? *c.hidden_activation
                          : c.hidden_act      ? *c.hidden_act
                          : gemma             ? "gelu_pytorch_tanh"
                                              : "silu";
  if (gemma) {
    const bool tanh_gelu = act == "gelu_pytorch_tanh" || act == "gelu_new" ||
                           (family == Family::kGemma && !c.hidden_activation && act == "gelu");
    KILN_CHECK(tanh_gelu, "unsupported activation '", act,
               "' (kiln's Gemma MLP is GeGLU with tanh-approximate GELU: gelu_pytorch_tanh)");
    cfg.mlp_kind = MLPKind::kGeGLUTanh;
    cfg.norm_unit_offset = true;
    cfg.scale_embeddings = true;
    cfg.tie_embeddings = c.tie_word_embeddings.value_or(true);
  } else {
    KILN_CHECK(act == "silu", "unsupported activation '", act,
               "' (kiln's Llama and Mistral MLP is SwiGLU: silu)");
    cfg.mlp_kind = MLPKind::kSwiGLU;
    cfg.tie_embeddings = c.tie_word_embeddings.value_or(false);
  }

  if (family == Family::kMistral || family == Family::kGemma2) {
    // An absent key takes the architecture's default (4096); null means no window.
    cfg.sliding_window = c.sliding_window_present ? c.sliding_window.value_or(0) : 4096;
    KILN_CHECK(cfg.sliding_window >= 0, "sliding_window must not be negative, got ",
               cfg.sliding_window);
    cfg.sliding_window_period = family == Family::kGemma2 ? 2 : 1;
    if (c.layer_types) apply_layer_types(*c.layer_types, cfg);
  }
  if (family == Family::kGemma2) {
    cfg.post_attention_norm = true;
    cfg.post_mlp_norm = true;
    cfg.attention_softcap = c.attn_softcap_present ? c.attn_logit_softcapping.value_or(0) : 50.0;
    cfg.final_softcap = c.final_softcap_present ? c.final_logit_softcapping.value_or(0) : 30.0;
    const double scalar = c.query_pre_attn_scalar.value_or(256.0);
    // The scale of q k^T is its inverse square root: within these bounds the scale, its square
    // and the exported value (1 / scale^2) are normal doubles, so the config exports and reads
    // back as the same model.
    KILN_CHECK(scalar >= 1e-300 && scalar <= 1e300,
               "query_pre_attn_scalar must be between 1e-300 and 1e300, got ", scalar);
    cfg.attention_scale = 1.0 / std::sqrt(scalar);
  }
  cfg.validate();
  return cfg;
}

// ================================ ModelConfig -> config.json ================================

// Numbers as Python's json writes them: integral doubles keep a ".0", others the shortest
// representation that reads back exactly.
std::string json_double(double v) {
  KILN_CHECK(std::isfinite(v), "[to_hf_config_json] cannot write the non-finite number ", v);
  if (v == std::floor(v) && std::abs(v) < 1e16) {
    return std::to_string(static_cast<int64_t>(v)) + ".0";
  }
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  KILN_CHECK(ec == std::errc(), "[to_hf_config_json] cannot format ", v);
  return std::string(buf, end);
}

const char* torch_dtype_name(ScalarType t) {
  switch (t) {
    case kFloat:
      return "float32";
    case kBFloat16:
      return "bfloat16";
    case kHalf:
      return "float16";
    case kDouble:
      return "float64";
    default:
      KILN_FAIL("[to_hf_config_json] no torch dtype for ", dtype_name(t));
  }
}

// The architecture that expresses `cfg`, or an error naming every feature it cannot.
Family export_family(const ModelConfig& cfg) {
  std::vector<std::string> problems;
  Family f;
  const bool default_scale =
      !cfg.attention_scale ||
      std::abs(*cfg.attention_scale * std::sqrt(static_cast<double>(cfg.head_dim())) - 1) < 1e-12;
  if (cfg.mlp_kind == MLPKind::kGeGLUTanh) {
    const bool gemma2 = cfg.post_attention_norm || cfg.post_mlp_norm || cfg.attention_softcap > 0 ||
                        cfg.final_softcap > 0 || !default_scale || cfg.sliding_window > 0;
    f = gemma2 ? Family::kGemma2 : Family::kGemma;
    if (!cfg.norm_unit_offset) problems.push_back("Gemma's norms use the unit offset");
    if (!cfg.scale_embeddings) problems.push_back("Gemma scales the embeddings");
    if (gemma2) {
      if (!cfg.post_attention_norm || !cfg.post_mlp_norm) {
        problems.push_back("Gemma 2 has both post-attention and post-MLP norms");
      }
      if (cfg.sliding_window > 0 && cfg.sliding_window_period != 2) {
        problems.push_back("Gemma 2 windows the even layers (sliding_window_period 2)");
      }
    }
  } else {
    f = cfg.sliding_window > 0 ? Family::kMistral : Family::kLlama;
    if (cfg.norm_unit_offset) problems.push_back("Llama/Mistral norms have no unit offset");
    if (cfg.scale_embeddings) problems.push_back("Llama/Mistral do not scale the embeddings");
    if (cfg.post_attention_norm || cfg.post_mlp_norm) {
      problems.push_back("Llama/Mistral have no post norms");
    }
    if (cfg.attention_softcap > 0 || cfg.final_softcap > 0) {
      problems.push_back("Llama/Mistral have no logit softcaps");
    }
    if (!default_scale) problems.push_back("Llama/Mistral scale attention by 1/sqrt(head_size)");
    if (cfg.sliding_window > 0 && cfg.sliding_window_period != 1) {
      problems.push_back("Mistral windows every layer (sliding_window_period 1)");
    }
  }
  if (cfg.norm_kind != NormKind::kRMSNorm) problems.push_back("every family uses RMSNorm");
  if (!problems.empty()) {
    std::string all;
    for (const std::string& p : problems) all += (all.empty() ? "" : "; ") + p;
    KILN_FAIL("[to_hf_config_json] ", cfg.name, ": no Hugging Face architecture matches (closest ",
              info_of(f).architecture, "): ", all);
  }
  return f;
}

}  // namespace

// ================================ public API ================================

ModelConfig ModelConfig::from_hf_config_json(const std::string& json_text,
                                             const std::string& name) {
  try {
    return config_from_json(parse_config_json(json_text), name);
  } catch (const JsonError& e) {
    KILN_FAIL("[from_hf_config] ", name, ": malformed config.json: ", e.what());
  } catch (const Error& e) {
    const std::string what = e.what();
    if (what.starts_with("[from_hf_config]")) throw;
    KILN_FAIL("[from_hf_config] ", name, ": ", what);
  }
}

ModelConfig ModelConfig::from_hf_config(const std::string& path) {
  fs::path p(path);
  std::error_code ec;
  if (fs::is_directory(p, ec)) p /= "config.json";
  const std::string text = read_file(p.string(), "from_hf_config");
  std::string name = p.parent_path().filename().string();
  if (name.empty() || name == ".") name = "hf";
  try {
    return from_hf_config_json(text, name);
  } catch (const Error& e) {
    // Name the file, not the model, in the message.
    std::string what = e.what();
    const std::string prefix = "[from_hf_config] " + name + ": ";
    if (what.starts_with(prefix)) what = what.substr(prefix.size());
    KILN_FAIL("[from_hf_config] ", p.string(), ": ", what);
  }
}

std::string to_hf_config_json(const ModelConfig& config, std::optional<ScalarType> dtype) {
  config.validate();
  const Family f = export_family(config);
  const bool gemma = f == Family::kGemma || f == Family::kGemma2;
  std::map<std::string, std::string> kv;  // sorted keys, as save_pretrained writes them
  auto i = [](int64_t v) { return std::to_string(v); };
  kv["architectures"] = std::string("[\n    ") + json_string(info_of(f).architecture) + "\n  ]";
  kv["model_type"] = json_string(info_of(f).model_type);
  kv["vocab_size"] = i(config.vocab_size);
  kv["hidden_size"] = i(config.n_embd);
  kv["intermediate_size"] = i(config.intermediate_size);
  kv["num_hidden_layers"] = i(config.n_layer);
  kv["num_attention_heads"] = i(config.n_head);
  kv["num_key_value_heads"] = i(config.n_query_groups);
  kv["head_dim"] = i(config.head_dim());
  kv["max_position_embeddings"] = i(config.block_size);
  kv["rms_norm_eps"] = json_double(config.norm_eps);
  kv["rope_theta"] = json_double(config.rope_base);
  if (config.rope_scaling) {
    const auto& s = *config.rope_scaling;
    kv["rope_scaling"] =
        "{\n    \"factor\": " + json_double(s.factor) +
        ",\n    \"high_freq_factor\": " + json_double(s.high_freq_factor) +
        ",\n    \"low_freq_factor\": " + json_double(s.low_freq_factor) +
        ",\n    \"original_max_position_embeddings\": " + i(s.original_max_seq_len) +
        ",\n    \"rope_type\": \"llama3\"\n  }";
  } else {
    kv["rope_scaling"] = "null";
  }
  kv["tie_word_embeddings"] = config.tie_embeddings ? "true" : "false";
  kv["attention_bias"] = "false";
  kv["attention_dropout"] = "0.0";
  kv["use_cache"] = "true";
  if (dtype) kv["torch_dtype"] = json_string(torch_dtype_name(*dtype));
  if (gemma) {
    kv["hidden_act"] = kv["hidden_activation"] = json_string("gelu_pytorch_tanh");
  } else {
    kv["hidden_act"] = json_string("silu");
    kv["mlp_bias"] = "false";
  }
  if (f == Family::kMistral) kv["sliding_window"] = i(config.sliding_window);
  if (f == Family::kGemma2) {
    const double scale = config.attn_scale();
    // transformers 5 types this field int: write integral values (all published ones) as such,
    // below 2^53 (where every integral double converts to int64 exactly); others as doubles.
    // Integral within 1e-13 relative: 1 / scale^2 is the scalar read within a few ulps, and an
    // integer that close reads back as the same scale within 1e-12 (a looser 1e-9 wrote
    // 922337203.85 as 922337204: a fuzz finding).
    const double scalar = 1.0 / (scale * scale);
    const double rounded = std::round(scalar);
    const bool integral = std::abs(scalar - rounded) <= 1e-13 * scalar && rounded < 0x1p53;
    kv["query_pre_attn_scalar"] =
        integral ? std::to_string(static_cast<int64_t>(rounded)) : json_double(scalar);
    kv["attn_logit_softcapping"] =
        config.attention_softcap > 0 ? json_double(config.attention_softcap) : "null";
    kv["final_logit_softcapping"] =
        config.final_softcap > 0 ? json_double(config.final_softcap) : "null";
    // Older transformers window the even layers by sliding_window alone; newer ones read
    // layer_types. A window as long as the context is no window in both.
    kv["sliding_window"] = i(config.sliding_window > 0 ? config.sliding_window : config.block_size);
    std::string types = "[";
    for (int64_t l = 0; l < config.n_layer; ++l) {
      types += std::string(l ? "," : "") + "\n    " +
               json_string(config.uses_sliding_window(l) ? "sliding_attention" : "full_attention");
    }
    kv["layer_types"] = types + "\n  ]";
  }
  std::string out = "{";
  bool first = true;
  for (const auto& [k, v] : kv) {
    out += std::string(first ? "" : ",") + "\n  " + json_string(k) + ": " + v;
    first = false;
  }
  return out + "\n}\n";
}

}  // namespace kiln::models
