// libFuzzer target for the Hugging Face config.json reader (ModelConfig::from_hf_config_json,
// models/hf_config.cpp): arbitrary bytes must be rejected with a kiln::Error that names the file
// ("[from_hf_config] <name>: ...") or give a validated config; an accepted config that kiln can
// export (to_hf_config_json) must read back as the same model. Any crash, over-read
// (AddressSanitizer), other exception or mismatch (abort) is a finding.
//
//   D=tests/models/data F=build-fuzz/hf_config_fuzz
//   $F -max_total_time=60 -dict=$D/hf_config.dict -seed_inputs=$D/hf/llama/config.json
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "models/config.h"
#include "models/hf.h"

namespace {

void check(bool ok, const char* what, const std::string& detail) {
  if (!ok) {
    std::fprintf(stderr, "hf_config_fuzz: %s\n%s\n", what, detail.c_str());
    std::abort();
  }
}

bool close(double a, double b) { return a == b || std::abs(a - b) <= 1e-12 * std::abs(a); }

// The fields a config.json carries, as tests/models/hf_test_util.h compares them.
bool same_model(const kiln::models::ModelConfig& a, const kiln::models::ModelConfig& b) {
  bool same =
      a.vocab_size == b.vocab_size && a.n_layer == b.n_layer && a.n_embd == b.n_embd &&
      a.n_head == b.n_head && a.n_query_groups == b.n_query_groups &&
      a.head_dim() == b.head_dim() && a.intermediate_size == b.intermediate_size &&
      a.block_size == b.block_size && a.mlp_kind == b.mlp_kind && a.norm_kind == b.norm_kind &&
      a.norm_eps == b.norm_eps && a.norm_unit_offset == b.norm_unit_offset &&
      a.post_attention_norm == b.post_attention_norm && a.post_mlp_norm == b.post_mlp_norm &&
      a.rope_base == b.rope_base && a.rope_scaling.has_value() == b.rope_scaling.has_value() &&
      a.sliding_window == b.sliding_window && a.attention_softcap == b.attention_softcap &&
      a.final_softcap == b.final_softcap && close(a.attn_scale(), b.attn_scale()) &&
      a.scale_embeddings == b.scale_embeddings && a.tie_embeddings == b.tie_embeddings;
  for (int64_t l = 0; same && l < a.n_layer && l < 4096; ++l) {
    same = a.uses_sliding_window(l) == b.uses_sliding_window(l);
  }
  if (same && a.rope_scaling) {
    same = a.rope_scaling->factor == b.rope_scaling->factor &&
           a.rope_scaling->low_freq_factor == b.rope_scaling->low_freq_factor &&
           a.rope_scaling->high_freq_factor == b.rope_scaling->high_freq_factor &&
           a.rope_scaling->original_max_seq_len == b.rope_scaling->original_max_seq_len;
  }
  return same;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kiln::Error;
  using kiln::models::ModelConfig;
  const std::string text(reinterpret_cast<const char*>(data), size);
  ModelConfig cfg;
  try {
    cfg = ModelConfig::from_hf_config_json(text, "fuzz.json");
  } catch (const Error& e) {
    check(std::string(e.what()).starts_with("[from_hf_config] fuzz.json: "),
          "an error that does not name the file", e.what());
    return 0;
  }
  std::string exported;
  try {
    exported = kiln::models::to_hf_config_json(cfg);
  } catch (const Error& e) {
    check(std::string(e.what()).starts_with("[to_hf_config_json] "),
          "an export error that does not name the op", e.what());
    return 0;  // not every config that loads has an architecture to export to
  }
  ModelConfig back;
  try {
    back = ModelConfig::from_hf_config_json(exported, "exported.json");
  } catch (const Error& e) {
    check(false, "the export does not read back", std::string(e.what()) + "\n" + exported);
  }
  check(same_model(cfg, back), "the export reads back as another model", text + "\n" + exported);
  return 0;
}
