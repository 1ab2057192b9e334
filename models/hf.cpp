// Hugging Face interop: config.json <-> ModelConfig, HF <-> kiln tensor names, and the
// single-file / sharded safetensors checkpoints of transformers.
#include "models/hf.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "autograd/grad_mode.h"
#include "nn/json.h"
#include "tensor/error.h"
#include "tensor/ops.h"

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
    KILN_CHECK(scalar > 0, "query_pre_attn_scalar must be positive, got ", scalar);
    cfg.attention_scale = 1.0 / std::sqrt(scalar);
  }
  cfg.validate();
  return cfg;
}

std::string read_text_file(const std::string& path, const char* op) {
  std::ifstream in(path, std::ios::binary);
  KILN_CHECK(in.good(), "[", op, "] ", path, ": cannot open the file");
  std::ostringstream ss;
  ss << in.rdbuf();
  KILN_CHECK(!in.bad(), "[", op, "] ", path, ": cannot read the file");
  return ss.str();
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

// ================================ tensor names ================================

// One kiln tensor and the HF tensors it is made of (row blocks, in order). A vocab entry has
// vocab_size rows in HF and padded_vocab rows in kiln.
struct Entry {
  std::string kiln;
  std::vector<std::string> hf;
  std::vector<Shape> hf_shapes;
  bool vocab_rows = false;
};

std::vector<Entry> name_plan(const ModelConfig& cfg, const char* op) {
  KILN_CHECK(cfg.post_attention_norm == cfg.post_mlp_norm, "[", op, "] ", cfg.name,
             ": Hugging Face checkpoints have both post norms (Gemma 2) or neither");
  const int64_t d = cfg.n_embd, hs = cfg.head_dim(), ffn = cfg.intermediate_size;
  const Shape vec{d};
  std::vector<Entry> plan;
  plan.push_back(
      {"transformer.wte.weight", {"model.embed_tokens.weight"}, {{cfg.vocab_size, d}}, true});
  for (int64_t i = 0; i < cfg.n_layer; ++i) {
    const std::string k = "transformer.h." + std::to_string(i) + ".";
    const std::string h = "model.layers." + std::to_string(i) + ".";
    plan.push_back({k + "norm_1.weight", {h + "input_layernorm.weight"}, {vec}});
    plan.push_back(
        {k + "attn.qkv.weight",
         {h + "self_attn.q_proj.weight", h + "self_attn.k_proj.weight",
          h + "self_attn.v_proj.weight"},
         {{cfg.n_head * hs, d}, {cfg.n_query_groups * hs, d}, {cfg.n_query_groups * hs, d}}});
    plan.push_back(
        {k + "attn.proj.weight", {h + "self_attn.o_proj.weight"}, {{d, cfg.n_head * hs}}});
    if (cfg.post_attention_norm) {
      plan.push_back(
          {k + "post_attention_norm.weight", {h + "post_attention_layernorm.weight"}, {vec}});
      plan.push_back({k + "norm_2.weight", {h + "pre_feedforward_layernorm.weight"}, {vec}});
      plan.push_back(
          {k + "post_mlp_norm.weight", {h + "post_feedforward_layernorm.weight"}, {vec}});
    } else {
      plan.push_back({k + "norm_2.weight", {h + "post_attention_layernorm.weight"}, {vec}});
    }
    plan.push_back({k + "mlp.fc_1.weight", {h + "mlp.gate_proj.weight"}, {{ffn, d}}});
    plan.push_back({k + "mlp.fc_2.weight", {h + "mlp.up_proj.weight"}, {{ffn, d}}});
    plan.push_back({k + "mlp.proj.weight", {h + "mlp.down_proj.weight"}, {{d, ffn}}});
  }
  plan.push_back({"transformer.ln_f.weight", {"model.norm.weight"}, {vec}});
  if (!cfg.tie_embeddings) {
    plan.push_back({"lm_head.weight", {"lm_head.weight"}, {{cfg.vocab_size, d}}, true});
  }
  return plan;
}

// Tensors a checkpoint may carry that kiln does not need.
bool ignorable(const std::string& hf_name, const ModelConfig& cfg) {
  const std::string inv = "rotary_emb.inv_freq";
  if (hf_name.size() >= inv.size() && hf_name.ends_with(inv)) return true;
  return cfg.tie_embeddings && hf_name == "lm_head.weight";
}

// Checks a checkpoint's names and shapes against the plan; "" when it fits, else a message
// listing every problem.
std::string check_names(const std::vector<Entry>& plan, const std::map<std::string, Shape>& have,
                        const ModelConfig& cfg) {
  std::vector<std::string> missing, mis_shaped, unexpected;
  std::set<std::string> used;
  for (const Entry& e : plan) {
    for (size_t j = 0; j < e.hf.size(); ++j) {
      used.insert(e.hf[j]);
      auto it = have.find(e.hf[j]);
      if (it == have.end()) {
        missing.push_back(e.hf[j]);
      } else if (it->second != e.hf_shapes[j]) {
        mis_shaped.push_back(e.hf[j] + " is " + shape_str(it->second) + ", expected " +
                             shape_str(e.hf_shapes[j]));
      }
    }
  }
  for (const auto& [name, shape] : have) {
    if (!used.contains(name) && !ignorable(name, cfg)) unexpected.push_back(name);
  }
  std::string msg;
  auto list = [&](const char* what, const std::vector<std::string>& names) {
    if (names.empty()) return;
    msg +=
        std::string(msg.empty() ? "" : "; ") + what + " (" + std::to_string(names.size()) + "): ";
    for (size_t i = 0; i < names.size(); ++i) msg += (i ? ", " : "") + names[i];
  };
  list("missing tensors", missing);
  list("unexpected tensors", unexpected);
  list("mis-shaped tensors", mis_shaped);
  return msg;
}

std::map<std::string, Tensor> parameters_of(const GPTImpl& model) {
  std::map<std::string, Tensor> params;
  for (const auto& item : model.named_parameters()) params.emplace(item.key(), item.value());
  return params;
}

// The model's tensors under HF names, in plan order (layer by layer, for contiguous shards).
std::vector<std::pair<std::string, Tensor>> hf_tensors(const GPTImpl& model, const char* op) {
  const ModelConfig& cfg = model.config();
  const std::map<std::string, Tensor> params = parameters_of(model);
  std::vector<std::pair<std::string, Tensor>> out;
  for (const Entry& e : name_plan(cfg, op)) {
    auto it = params.find(e.kiln);
    KILN_CHECK(it != params.end(), "[", op, "] ", cfg.name, ": the model has no parameter ",
               e.kiln);
    const Tensor t = it->second.detach();
    int64_t row = 0;
    for (size_t j = 0; j < e.hf.size(); ++j) {
      const int64_t rows = e.hf_shapes[j][0];
      out.emplace_back(e.hf[j], t.narrow(0, row, rows));
      row += rows;
    }
  }
  return out;
}

// ================================ checkpoint files ================================

struct IndexJson {
  std::vector<std::pair<std::string, std::string>> weight_map;  // tensor -> shard file
};

IndexJson parse_index(const std::string& text) {
  IndexJson index;
  bool has_map = false;
  JsonReader r(text);
  r.begin_object();
  while (auto key = r.next_key()) {
    if (*key != "weight_map") {
      r.skip_value();
      continue;
    }
    has_map = true;
    r.begin_object();
    while (auto name = r.next_key()) {
      if (r.peek_kind() != '"') r.fail("weight_map['" + *name + "'] is not a string");
      index.weight_map.emplace_back(*name, r.read_string());
    }
  }
  r.end_document();
  if (!has_map) r.fail("no 'weight_map' object");
  return index;
}

// The safetensors files of a checkpoint and which tensor lives where.
struct Checkpoint {
  std::vector<SafetensorsFile> files;
  std::map<std::string, size_t> where;  // tensor -> index into files
};

Checkpoint open_checkpoint(const std::string& path) {
  constexpr const char* op = "load_hf_weights";
  fs::path p(path);
  std::error_code ec;
  std::optional<fs::path> index_path;
  Checkpoint ck;
  if (fs::is_directory(p, ec)) {
    if (fs::exists(p / "model.safetensors", ec)) {
      p = p / "model.safetensors";
    } else if (fs::exists(p / "model.safetensors.index.json", ec)) {
      index_path = p / "model.safetensors.index.json";
    } else {
      KILN_FAIL("[", op, "] ", path,
                ": no model.safetensors or model.safetensors.index.json in this directory");
    }
  } else if (p.extension() == ".json") {
    index_path = p;
  }
  if (!index_path) {
    KILN_CHECK(fs::exists(p, ec), "[", op, "] ", p.string(), ": no such file");
    ck.files.emplace_back(p.string());
    for (const std::string& k : ck.files[0].keys()) ck.where.emplace(k, 0);
    return ck;
  }

  const std::string ipath = index_path->string();
  IndexJson index;
  try {
    index = parse_index(read_text_file(ipath, op));
  } catch (const JsonError& e) {
    KILN_FAIL("[", op, "] ", ipath, ": malformed index: ", e.what());
  }
  std::map<std::string, size_t> file_of_name;
  for (const auto& [tensor, file] : index.weight_map) {
    // Shards live beside the index: a hostile index must not name files elsewhere.
    KILN_CHECK(!file.empty() && file.find('/') == std::string::npos &&
                   file.find('\\') == std::string::npos && file != "." && file != "..",
               "[", op, "] ", ipath, ": weight_map['", tensor, "'] names '", file,
               "', which is not a file name beside the index");
    if (!file_of_name.contains(file)) {
      const fs::path shard = index_path->parent_path() / file;
      KILN_CHECK(fs::exists(shard, ec), "[", op, "] ", ipath, ": names the shard '", file,
                 "', which does not exist");
      file_of_name.emplace(file, ck.files.size());
      ck.files.emplace_back(shard.string());
    }
  }
  KILN_CHECK(!ck.files.empty(), "[", op, "] ", ipath, ": the weight_map is empty");
  for (size_t f = 0; f < ck.files.size(); ++f) {
    for (const std::string& k : ck.files[f].keys()) {
      auto [it, fresh] = ck.where.emplace(k, f);
      KILN_CHECK(fresh, "[", op, "] ", ipath, ": tensor ", k, " is in both ",
                 ck.files[it->second].name(), " and ", ck.files[f].name());
    }
  }
  for (const auto& [tensor, file] : index.weight_map) {
    const size_t f = file_of_name.at(file);
    KILN_CHECK(ck.files[f].contains(tensor), "[", op, "] ", ipath, ": weight_map puts ", tensor,
               " in ", file, ", which does not contain it");
  }
  return ck;
}

void remove_stale_weights(const fs::path& dir, const std::set<std::string>& keep) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string n = entry.path().filename().string();
    const bool ours = n == "model.safetensors" || n == "model.safetensors.index.json" ||
                      (n.starts_with("model-") && n.ends_with(".safetensors") &&
                       n.find("-of-") != std::string::npos);
    if (ours && !keep.contains(n)) fs::remove(entry.path(), ec);
  }
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
  const std::string text = read_text_file(p.string(), "from_hf_config");
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
    // transformers 5 types this field int: write integral values (all published ones) as such.
    const double scalar = 1.0 / (scale * scale);
    const double rounded = std::round(scalar);
    kv["query_pre_attn_scalar"] = std::abs(scalar - rounded) <= 1e-9 * scalar
                                      ? std::to_string(static_cast<int64_t>(rounded))
                                      : json_double(scalar);
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

TensorMap from_hf_state_dict(const TensorMap& hf, const ModelConfig& config) {
  config.validate();
  const std::vector<Entry> plan = name_plan(config, "from_hf_state_dict");
  std::map<std::string, Shape> have;
  for (const auto& [name, t] : hf) have.emplace(name, to_shape(t.sizes()));
  const std::string problems = check_names(plan, have, config);
  KILN_CHECK(problems.empty(), "[from_hf_state_dict] ", config.name, ": ", problems);
  TensorMap out;
  for (const Entry& e : plan) {
    Tensor t;
    if (e.hf.size() == 1) {
      t = hf.at(e.hf[0]);
    } else {
      std::vector<Tensor> parts;
      for (const std::string& n : e.hf) parts.push_back(hf.at(n).to(hf.at(e.hf[0]).dtype()));
      t = cat(parts, 0);
    }
    if (e.vocab_rows && config.padded_vocab() > config.vocab_size) {
      t = cat({t, zeros({config.padded_vocab() - config.vocab_size, config.n_embd}, t.options())},
              0);
    }
    out.emplace(e.kiln, t);
  }
  return out;
}

TensorMap to_hf_state_dict(const GPTImpl& model) {
  TensorMap out;
  for (auto& [name, t] : hf_tensors(model, "to_hf_state_dict")) out.emplace(name, t);
  return out;
}

void load_hf_weights(GPTImpl& model, const std::string& path) {
  constexpr const char* op = "load_hf_weights";
  const ModelConfig& cfg = model.config();
  const std::vector<Entry> plan = name_plan(cfg, op);
  Checkpoint ck = open_checkpoint(path);
  std::map<std::string, Shape> have;
  for (const auto& [name, f] : ck.where) have.emplace(name, ck.files[f].info(name).shape);
  const std::string problems = check_names(plan, have, cfg);
  KILN_CHECK(problems.empty(), "[", op, "] ", path, ": does not fit ", cfg.name, ": ", problems);

  std::map<std::string, Tensor> params = parameters_of(model);
  // Where each HF tensor goes: a row block of one parameter.
  struct Target {
    Tensor dst;
    std::string hf;
  };
  std::vector<std::vector<Target>> by_file(ck.files.size());
  for (const Entry& e : plan) {
    auto it = params.find(e.kiln);
    KILN_CHECK(it != params.end(), "[", op, "] ", cfg.name, ": the model has no parameter ",
               e.kiln);
    const Tensor& p = it->second;
    int64_t row = 0;
    for (size_t j = 0; j < e.hf.size(); ++j) {
      const int64_t rows = e.hf_shapes[j][0];
      by_file[ck.where.at(e.hf[j])].push_back({p.narrow(0, row, rows), e.hf[j]});
      row += rows;
    }
  }
  NoGradGuard no_grad;
  for (size_t f = 0; f < ck.files.size(); ++f) {
    for (Target& t : by_file[f]) {
      t.dst.copy_(ck.files[f].get(t.hf).to(t.dst.device(), t.dst.dtype()));
    }
  }
  if (cfg.padded_vocab() > cfg.vocab_size) {
    const int64_t pad = cfg.padded_vocab() - cfg.vocab_size;
    params.at("transformer.wte.weight").narrow(0, cfg.vocab_size, pad).zero_();
    if (!cfg.tie_embeddings) params.at("lm_head.weight").narrow(0, cfg.vocab_size, pad).zero_();
  }
}

GPT load_hf_checkpoint(const std::string& dir, const TensorOptions& options) {
  const ModelConfig cfg = ModelConfig::from_hf_config((fs::path(dir) / "config.json").string());
  GPT model(cfg, options);
  load_hf_weights(*model, dir);
  return model;
}

void save_hf_checkpoint(const GPTImpl& model, const std::string& dir, int64_t max_shard_bytes) {
  constexpr const char* op = "save_hf_checkpoint";
  KILN_CHECK(max_shard_bytes > 0, "[", op, "] max_shard_bytes must be positive, got ",
             max_shard_bytes);
  const std::vector<std::pair<std::string, Tensor>> tensors = hf_tensors(model, op);
  const ScalarType dtype = tensors.front().second.dtype();
  const std::string config_json = to_hf_config_json(model.config(), dtype);
  std::error_code ec;
  const fs::path d(dir);
  fs::create_directories(d, ec);
  KILN_CHECK(fs::is_directory(d, ec), "[", op, "] ", dir, ": cannot create the directory");

  // Greedy shards in layer order, as transformers' save_pretrained: a tensor larger than
  // max_shard_bytes gets a shard of its own.
  std::vector<TensorMap> shards(1);
  int64_t shard_bytes = 0, total = 0;
  for (const auto& [name, t] : tensors) {
    const auto bytes = static_cast<int64_t>(t.nbytes());
    if (!shards.back().empty() && shard_bytes + bytes > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().emplace(name, t);
    shard_bytes += bytes;
    total += bytes;
  }
  const SafetensorsMetadata meta{{"format", "pt"}};
  std::set<std::string> written;
  if (shards.size() == 1) {
    save_safetensors(shards[0], (d / "model.safetensors").string(), meta);
    written.insert("model.safetensors");
  } else {
    std::map<std::string, std::string> weight_map;
    char buf[64];
    for (size_t s = 0; s < shards.size(); ++s) {
      std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
      save_safetensors(shards[s], (d / buf).string(), meta);
      written.insert(buf);
      for (const auto& [name, t] : shards[s]) weight_map.emplace(name, buf);
    }
    std::string index = "{\n  \"metadata\": {\n    \"total_size\": " + std::to_string(total) +
                        "\n  },\n  \"weight_map\": {";
    bool first = true;
    for (const auto& [name, file] : weight_map) {
      index +=
          std::string(first ? "" : ",") + "\n    " + json_string(name) + ": " + json_string(file);
      first = false;
    }
    index += "\n  }\n}\n";
    write_file_atomically((d / "model.safetensors.index.json").string(), index, op);
    written.insert("model.safetensors.index.json");
  }
  write_file_atomically((d / "config.json").string(), config_json, op);
  remove_stale_weights(d, written);
}

}  // namespace kiln::models
