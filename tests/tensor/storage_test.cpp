// The CPU block cache's limit (tensor/storage.cpp): KILN_CPU_CACHE_MB is read once, at the first
// CPU allocation, so each case runs in a fresh process (the threadsafe death-test style re-runs
// the test binary up to the EXPECT_EXIT) that allocates nothing before the EXPECT_EXIT.
#include "tensor/storage.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "tensor/ops.h"
#include "test_util.h"

namespace kiln {
namespace {

using test::ScopedEnv;

// Frees three live 4 MiB blocks at once and exits with 0 when the cache then holds
// `expected_bytes`; a kiln::Error is printed and exits with 3.
[[noreturn]] void exit_with_cached_bytes(size_t expected_bytes) {
  try {
    {
      const Tensor a = empty({1 << 20}, kFloat), b = empty({1 << 20}, kFloat),
                   c = empty({1 << 20}, kFloat);
    }
    std::exit(cpu_cached_bytes() == expected_bytes ? 0 : 1);
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    std::exit(3);
  }
}

class CpuCacheLimit : public ::testing::Test {
 protected:
  void SetUp() override {
    style_ = GTEST_FLAG_GET(death_test_style);
    GTEST_FLAG_SET(death_test_style, "threadsafe");
  }
  void TearDown() override { GTEST_FLAG_SET(death_test_style, style_); }

 private:
  std::string style_;
};

TEST_F(CpuCacheLimit, UnsetOrEmptyKeepsOneGiB) {
  const char* const unset_or_empty[] = {nullptr, ""};
  for (const char* value : unset_or_empty) {
    const ScopedEnv env("KILN_CPU_CACHE_MB", value);
    EXPECT_EXIT(exit_with_cached_bytes(size_t{12} << 20), ::testing::ExitedWithCode(0), "");
  }
}

TEST_F(CpuCacheLimit, ValueIsTheLimitInMiB) {
  {
    const ScopedEnv env("KILN_CPU_CACHE_MB", "8");  // two of the three blocks fit
    EXPECT_EXIT(exit_with_cached_bytes(size_t{8} << 20), ::testing::ExitedWithCode(0), "");
  }
  {
    const ScopedEnv env("KILN_CPU_CACHE_MB", "0");  // no cache
    EXPECT_EXIT(exit_with_cached_bytes(0), ::testing::ExitedWithCode(0), "");
  }
}

TEST_F(CpuCacheLimit, MalformedValueFailsTheFirstAllocationNamingTheVariable) {
  for (const char* value : {"12x", "-1", "1.5", "16777217"}) {
    const ScopedEnv env("KILN_CPU_CACHE_MB", value);
    EXPECT_EXIT(exit_with_cached_bytes(0), ::testing::ExitedWithCode(3),
                "KILN_CPU_CACHE_MB must be an integer from 0 to 16777216")
        << "value \"" << value << "\"";
  }
}

}  // namespace
}  // namespace kiln
