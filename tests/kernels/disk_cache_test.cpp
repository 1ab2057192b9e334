// kiln's disk cache (kernels/disk_cache.h): keys of any number of parts, rejected files, the
// directory's precedence. No GPU needed; the generated kernels' use of it is tested in
// tests/compiler/fused_cuda_test.cpp (FusedCudaCache).
#include "kernels/disk_cache.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

namespace kiln {
namespace {

std::string fresh_dir(const std::string& name) {
  const std::filesystem::path p = std::filesystem::temp_directory_path() /
                                  ("kiln_disk_cache_" + name + "_" + std::to_string(getpid()));
  std::filesystem::remove_all(p);
  return p.string();
}

TEST(DiskCache, KeysOfAnyNumberOfPartsRoundTrip) {
  const std::string dir = fresh_dir("parts");
  const disk_cache::Key a{{"cublaslt", "NVIDIA H100, sm_90, 132 SMs", "cublasLt 130000", "1 0"},
                          ".choice"};
  const disk_cache::Key fewer{{"cublaslt", "NVIDIA H100, sm_90, 132 SMs", "cublasLt 130000"},
                              ".choice"};
  // Parts are not concatenated text: moving a boundary makes another key.
  const disk_cache::Key moved{{"cublaslt", "NVIDIA H100, sm_90, 132 SMscublasLt 130000", "", "1 0"},
                              ".choice"};
  EXPECT_NE(a.file_name(), fewer.file_name());
  EXPECT_NE(a.file_name(), moved.file_name());
  EXPECT_EQ(a.file_name().substr(a.file_name().size() - 7), ".choice");
  EXPECT_FALSE(disk_cache::read(dir, a).has_value());  // no directory yet
  const std::string payload("engine\0 8", 9);
  ASSERT_TRUE(disk_cache::write(dir, a, payload));
  bool rejected = true;
  EXPECT_EQ(disk_cache::read(dir, a, &rejected), payload);
  EXPECT_FALSE(rejected);
  EXPECT_FALSE(disk_cache::read(dir, fewer, &rejected).has_value());
  EXPECT_FALSE(rejected);  // another file: missing, not rejected
  // The file of another key under this key's name (as a hash collision would leave it): rejected.
  ASSERT_TRUE(disk_cache::write(dir, fewer, payload));
  std::filesystem::copy_file(dir + "/" + fewer.file_name(), dir + "/" + a.file_name(),
                             std::filesystem::copy_options::overwrite_existing);
  EXPECT_FALSE(disk_cache::read(dir, a, &rejected).has_value());
  EXPECT_TRUE(rejected);
  // An empty payload is a payload.
  ASSERT_TRUE(disk_cache::write(dir, a, ""));
  EXPECT_EQ(disk_cache::read(dir, a, &rejected), "");
  // A file of the first format (a generated kernel's, before keys had any number of parts).
  {
    std::ofstream(dir + "/" + a.file_name(), std::ios::binary | std::ios::trunc)
        << std::string("KILNKRN\n\x01\0\0\0", 12);
  }
  EXPECT_FALSE(disk_cache::read(dir, a, &rejected).has_value());
  EXPECT_TRUE(rejected);
  std::filesystem::remove_all(dir);
}

TEST(DiskCache, NoneIsOffAndAnUnwritableDirectoryIsSkipped) {
  const disk_cache::Key k{{"x"}, ".choice"};
  EXPECT_FALSE(disk_cache::write("none", k, "p"));
  EXPECT_FALSE(disk_cache::read("none", k).has_value());
  EXPECT_FALSE(std::filesystem::exists("none"));
  // A path under a regular file cannot be a directory.
  const std::string file = fresh_dir("file");
  { std::ofstream(file) << "a file"; }
  EXPECT_FALSE(disk_cache::write(file + "/sub", k, "p"));
  EXPECT_FALSE(disk_cache::read(file + "/sub", k).has_value());
  std::filesystem::remove(file);
}

TEST(DiskCache, DirectoryFollowsTheSetterThenTheEnvironment) {
  const char* saved = std::getenv("KILN_KERNEL_CACHE");
  const std::string keep = saved != nullptr ? saved : "";
  setenv("KILN_KERNEL_CACHE", "/tmp/kiln_env_cache", 1);
  EXPECT_EQ(disk_cache::dir(), "/tmp/kiln_env_cache");
  disk_cache::set_dir("/tmp/kiln_set_cache");
  EXPECT_EQ(disk_cache::dir(), "/tmp/kiln_set_cache");
  disk_cache::set_dir("");
  EXPECT_EQ(disk_cache::dir(), "/tmp/kiln_env_cache");
  if (saved != nullptr) {
    setenv("KILN_KERNEL_CACHE", keep.c_str(), 1);
  } else {
    unsetenv("KILN_KERNEL_CACHE");
  }
}

}  // namespace
}  // namespace kiln
