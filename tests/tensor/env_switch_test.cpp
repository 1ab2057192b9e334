// Environment switches (tensor/env_switch.h): parsing, the unset default, errors naming the
// variable and the allowed values, the cache and its reload, concurrent readers.
#include "tensor/env_switch.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

namespace kiln::internal {
namespace {

// Sets (nullptr: unsets) a variable and reloads the switches, as tests and benchmarks do.
void set_and_reload(const char* name, const char* value) {
  if (value == nullptr) {
    unsetenv(name);
  } else {
    setenv(name, value, 1);
  }
  reload_env_switches();
}

// Each test uses its own variable and leaves it unset.
class EnvSwitchTest : public ::testing::Test {
 protected:
  void TearDown() override {
    for (const char* name : {"KILN_TEST_SWITCH_INT", "KILN_TEST_SWITCH_CHOICE"}) {
      set_and_reload(name, nullptr);
    }
  }
};

TEST_F(EnvSwitchTest, IntUnsetOrEmptyGivesTheDefault) {
  set_and_reload("KILN_TEST_SWITCH_INT", nullptr);
  const EnvInt s("KILN_TEST_SWITCH_INT", -1, 0, 6);
  EXPECT_EQ(s.get(), -1);
  set_and_reload("KILN_TEST_SWITCH_INT", "");
  EXPECT_EQ(s.get(), -1);
  // The default need not lie in the range (-1 is "the measured default" for KILN_RMSNORM_FWD).
  EXPECT_STREQ(s.name(), "KILN_TEST_SWITCH_INT");
}

TEST_F(EnvSwitchTest, IntParsesEveryValueOfTheRange) {
  const EnvInt s("KILN_TEST_SWITCH_INT", 100, -3, 6);
  for (int v = -3; v <= 6; ++v) {
    set_and_reload("KILN_TEST_SWITCH_INT", std::to_string(v).c_str());
    EXPECT_EQ(s.get(), v);
  }
  set_and_reload("KILN_TEST_SWITCH_INT", "0004");
  EXPECT_EQ(s.get(), 4);
}

TEST_F(EnvSwitchTest, IntRejectsValuesOutsideTheRangeOrNotIntegers) {
  const EnvInt s("KILN_TEST_SWITCH_INT", -1, 0, 6);
  for (const char* bad :
       {"7", "-1", "abc", "3x", " 3", "3 ", "+3", "2.0", "99999999999999999999"}) {
    SCOPED_TRACE(bad);
    set_and_reload("KILN_TEST_SWITCH_INT", bad);
    EXPECT_KILN_ERROR(s.get(), "KILN_TEST_SWITCH_INT must be an integer from 0 to 6");
    EXPECT_KILN_ERROR(s.get(), std::string("got '") + bad + "'");
  }
}

TEST_F(EnvSwitchTest, ValueIsCachedUntilReload) {
  set_and_reload("KILN_TEST_SWITCH_INT", "2");
  const EnvInt s("KILN_TEST_SWITCH_INT", -1, 0, 6);
  EXPECT_EQ(s.get(), 2);
  setenv("KILN_TEST_SWITCH_INT", "5", 1);
  EXPECT_EQ(s.get(), 2);  // not reloaded: the cached value
  reload_env_switches();
  EXPECT_EQ(s.get(), 5);
  unsetenv("KILN_TEST_SWITCH_INT");
  EXPECT_EQ(s.get(), 5);
  reload_env_switches();
  EXPECT_EQ(s.get(), -1);
}

TEST_F(EnvSwitchTest, SwitchNeverReadReadsTheEnvironmentWithoutReload) {
  setenv("KILN_TEST_SWITCH_INT", "3", 1);  // no reload before the switch exists
  const EnvInt s("KILN_TEST_SWITCH_INT", -1, 0, 6);
  EXPECT_EQ(s.get(), 3);
}

TEST_F(EnvSwitchTest, BadValueKeepsFailingUntilFixedAndReloaded) {
  const EnvInt s("KILN_TEST_SWITCH_INT", -1, 0, 6);
  set_and_reload("KILN_TEST_SWITCH_INT", "1");
  EXPECT_EQ(s.get(), 1);
  set_and_reload("KILN_TEST_SWITCH_INT", "9");
  EXPECT_KILN_ERROR(s.get(), "KILN_TEST_SWITCH_INT");
  EXPECT_KILN_ERROR(s.get(), "KILN_TEST_SWITCH_INT");  // the failure is not cached as a value
  set_and_reload("KILN_TEST_SWITCH_INT", "6");
  EXPECT_EQ(s.get(), 6);
}

TEST_F(EnvSwitchTest, ChoiceGivesTheIndexOfTheValue) {
  const EnvChoice s("KILN_TEST_SWITCH_CHOICE", {"v1", "fwd_v1", "bwd_v1"});
  set_and_reload("KILN_TEST_SWITCH_CHOICE", nullptr);
  EXPECT_EQ(s.get(), -1);
  set_and_reload("KILN_TEST_SWITCH_CHOICE", "");
  EXPECT_EQ(s.get(), -1);
  set_and_reload("KILN_TEST_SWITCH_CHOICE", "v1");
  EXPECT_EQ(s.get(), 0);
  set_and_reload("KILN_TEST_SWITCH_CHOICE", "fwd_v1");
  EXPECT_EQ(s.get(), 1);
  set_and_reload("KILN_TEST_SWITCH_CHOICE", "bwd_v1");
  EXPECT_EQ(s.get(), 2);
}

TEST_F(EnvSwitchTest, ChoiceRejectsOtherValuesNamingTheChoices) {
  const EnvChoice s("KILN_TEST_SWITCH_CHOICE", {"v1", "fwd_v1", "bwd_v1"});
  for (const char* bad : {"v2", "V1", "v1 ", "fwd"}) {
    SCOPED_TRACE(bad);
    set_and_reload("KILN_TEST_SWITCH_CHOICE", bad);
    EXPECT_KILN_ERROR(s.get(), "KILN_TEST_SWITCH_CHOICE must be v1, fwd_v1 or bwd_v1");
    EXPECT_KILN_ERROR(s.get(), std::string("got '") + bad + "'");
  }
}

TEST_F(EnvSwitchTest, ConstructorsRejectEmptyRangesAndChoices) {
  EXPECT_KILN_ERROR(EnvInt("KILN_TEST_SWITCH_INT", 0, 5, 4), "KILN_TEST_SWITCH_INT");
  EXPECT_KILN_ERROR(EnvChoice("KILN_TEST_SWITCH_CHOICE", {}), "KILN_TEST_SWITCH_CHOICE");
}

// Readers on several threads while another thread keeps invalidating the cache: every read sees
// the variable's value (the environment itself is not changed while threads read it: setenv is
// not thread-safe).
TEST_F(EnvSwitchTest, ConcurrentReadersDuringReloadsSeeTheValue) {
  set_and_reload("KILN_TEST_SWITCH_INT", "4");
  const EnvInt s("KILN_TEST_SWITCH_INT", -1, 0, 6);
  std::atomic<bool> stop{false};
  std::atomic<int64_t> wrong{0}, reads{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 4; ++t) {
    readers.emplace_back([&] {
      while (!stop.load()) {
        if (s.get() != 4) wrong.fetch_add(1);
        reads.fetch_add(1);
      }
    });
  }
  for (int i = 0; i < 20000; ++i) reload_env_switches();
  while (reads.load() < 20000) std::this_thread::yield();
  stop.store(true);
  for (std::thread& t : readers) t.join();
  EXPECT_EQ(wrong.load(), 0);
}

}  // namespace
}  // namespace kiln::internal
