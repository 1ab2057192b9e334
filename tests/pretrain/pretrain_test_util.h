// Helpers of the pretrain tests: a fresh temporary directory per test, whole-file reads and
// writes, and shards whose tokens say where they are.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "pretrain/shard.h"

namespace kiln::test {

class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           ("kiln_pretrain_test_" + std::to_string(::getpid()) + "_" + info->test_suite_name() +
            "_" + info->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  const std::filesystem::path& dir() const { return dir_; }
  std::string file(const std::string& name) const { return (dir_ / name).string(); }

 private:
  std::filesystem::path dir_;
};

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// A shard of `n` tokens counting up from `first` (mod vocab_size), one document, no eos: token
// values tell which window a row came from.
inline void write_counting_shard(const std::string& path, int64_t first, int64_t n,
                                 int64_t vocab_size = 1 << 20) {
  pretrain::ShardWriter w(path, {.vocab_size = vocab_size, .eos_id = -1});
  std::vector<int64_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = (first + i) % vocab_size;
  w.append_document(ids);
  w.finish();
}

}  // namespace kiln::test
