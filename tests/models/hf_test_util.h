// What tests/models/hf_config_test.cpp and hf_weights_test.cpp share: a temporary directory,
// a file writer, and the comparison of two ModelConfigs on the fields a config.json carries.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "models/config.h"

namespace kiln::models::hftest {

namespace fs = std::filesystem;

// A fresh empty directory, removed with the object.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = "kiln_hf_" + std::string(info->test_suite_name()) + "_" + info->name() +
                       "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++);
    std::replace(name.begin(), name.end(), '/', '_');
    path_ = fs::temp_directory_path() / name;
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string str() const { return path_.string(); }
  fs::path operator/(const std::string& s) const { return path_ / s; }

 private:
  fs::path path_;
};

inline void write_text(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
}

// The fields a config.json carries (not the name, and padded vocab is kiln's own).
inline void expect_same_model(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.n_layer, b.n_layer);
  EXPECT_EQ(a.n_embd, b.n_embd);
  EXPECT_EQ(a.n_head, b.n_head);
  EXPECT_EQ(a.n_query_groups, b.n_query_groups);
  EXPECT_EQ(a.head_dim(), b.head_dim());
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.block_size, b.block_size);
  EXPECT_EQ(a.mlp_kind, b.mlp_kind);
  EXPECT_EQ(a.norm_kind, b.norm_kind);
  EXPECT_DOUBLE_EQ(a.norm_eps, b.norm_eps);
  EXPECT_EQ(a.norm_unit_offset, b.norm_unit_offset);
  EXPECT_EQ(a.post_attention_norm, b.post_attention_norm);
  EXPECT_EQ(a.post_mlp_norm, b.post_mlp_norm);
  EXPECT_DOUBLE_EQ(a.rope_base, b.rope_base);
  ASSERT_EQ(a.rope_scaling.has_value(), b.rope_scaling.has_value());
  if (a.rope_scaling) {
    EXPECT_DOUBLE_EQ(a.rope_scaling->factor, b.rope_scaling->factor);
    EXPECT_DOUBLE_EQ(a.rope_scaling->low_freq_factor, b.rope_scaling->low_freq_factor);
    EXPECT_DOUBLE_EQ(a.rope_scaling->high_freq_factor, b.rope_scaling->high_freq_factor);
    EXPECT_EQ(a.rope_scaling->original_max_seq_len, b.rope_scaling->original_max_seq_len);
  }
  EXPECT_EQ(a.sliding_window, b.sliding_window);
  for (int64_t l = 0; l < a.n_layer; ++l) {
    EXPECT_EQ(a.uses_sliding_window(l), b.uses_sliding_window(l)) << "layer " << l;
  }
  EXPECT_DOUBLE_EQ(a.attention_softcap, b.attention_softcap);
  EXPECT_NEAR(a.attn_scale(), b.attn_scale(), 1e-15);
  EXPECT_EQ(a.scale_embeddings, b.scale_embeddings);
  EXPECT_EQ(a.tie_embeddings, b.tie_embeddings);
  EXPECT_DOUBLE_EQ(a.final_softcap, b.final_softcap);
}

}  // namespace kiln::models::hftest
