// Helpers shared by the test suites.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "tensor/error.h"
#include "tensor/registry.h"

// Expects `stmt` to throw kiln::Error whose message contains `substr`.
#define EXPECT_KILN_ERROR(stmt, substr)                                                   \
  do {                                                                                    \
    try {                                                                                 \
      (void)(stmt);                                                                       \
      ADD_FAILURE() << "expected kiln::Error containing \"" << (substr) << "\" from " #stmt; \
    } catch (const ::kiln::Error& e) {                                                    \
      EXPECT_NE(std::string(e.what()).find(substr), std::string::npos)                    \
          << "message: " << e.what();                                                     \
    }                                                                                     \
  } while (0)

namespace kiln::test {

// Sets an environment variable (unsets it when `value` is nullptr) for its lifetime, then
// restores it. For the variables kiln reads once (the CUDA knobs, KILN_CPU_CACHE_MB), a test sees
// its value in a fresh process: the threadsafe death-test style re-runs the binary up to the
// EXPECT_EXIT.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value == nullptr) {
      unsetenv(name);
    } else {
      setenv(name, value, 1);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// Records the names of the ops dispatched while alive (one at a time), to check what a composite
// op or a backward runs.
class OpRecorder {
 public:
  OpRecorder() {
    names().clear();
    set_dispatch_handler(DispatchKey::Trace, &handler_);
  }
  ~OpRecorder() { set_dispatch_handler(DispatchKey::Trace, nullptr); }
  OpRecorder(const OpRecorder&) = delete;
  OpRecorder& operator=(const OpRecorder&) = delete;
  static std::vector<std::string>& names() {
    static std::vector<std::string> n;
    return n;
  }
  int64_t count(const std::string& name) const {
    return std::count(names().begin(), names().end(), name);
  }

 private:
  static bool active(const OpCall& call) {
    names().push_back(call.name());
    return false;  // only watch: the call continues down the chain
  }
  DispatchHandler handler_{&active, nullptr};
};

}  // namespace kiln::test
