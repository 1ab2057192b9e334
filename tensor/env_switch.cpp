// Environment switches: the reload generation, the cache refresh and the parsers.
#include "tensor/env_switch.h"

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "tensor/error.h"

namespace kiln::internal {
namespace {

// Starts at 1 so that a switch never read (generation 0) is always stale.
std::atomic<uint64_t> g_generation{1};

// Serialises refreshes: two threads re-reading one switch store the same value in turn, and a
// refresh never lands a value of an older generation after a newer one.
std::mutex& refresh_mutex() {
  static std::mutex mu;
  return mu;
}

}  // namespace

void reload_env_switches() { g_generation.fetch_add(1, std::memory_order_acq_rel); }

int64_t EnvSwitch::cached() const {
  // value_ is stored before generation_ (release), so a current generation_ (acquire) shows a
  // value of that generation or a later one.
  if (generation_.load(std::memory_order_acquire) == g_generation.load(std::memory_order_acquire)) {
    return value_.load(std::memory_order_relaxed);
  }
  return refresh();
}

int64_t EnvSwitch::refresh() const {
  std::lock_guard<std::mutex> lock(refresh_mutex());
  const uint64_t now = g_generation.load(std::memory_order_acquire);
  if (generation_.load(std::memory_order_relaxed) == now) {
    return value_.load(std::memory_order_relaxed);
  }
  const int64_t value = parse(std::getenv(name_.c_str()));
  value_.store(value, std::memory_order_relaxed);
  generation_.store(now, std::memory_order_release);
  return value;
}

EnvInt::EnvInt(const char* name, int64_t unset, int64_t min, int64_t max)
    : EnvSwitch(name), unset_(unset), min_(min), max_(max) {
  KILN_CHECK(min <= max, "[environment] ", name, ": empty range [", min, ", ", max, "]");
}

int64_t EnvInt::parse(const char* value) const {
  if (value == nullptr || *value == '\0') return unset_;
  const char* end = value + std::strlen(value);
  int64_t n = 0;
  const auto [ptr, ec] = std::from_chars(value, end, n);
  KILN_CHECK(ec == std::errc() && ptr == end && n >= min_ && n <= max_, "[environment] ", name(),
             " must be an integer from ", min_, " to ", max_,
             " (unset or empty for the default), got '", value, "'");
  return n;
}

EnvChoice::EnvChoice(const char* name, std::initializer_list<const char*> choices)
    : EnvSwitch(name), choices_(choices.begin(), choices.end()) {
  KILN_CHECK(!choices_.empty(), "[environment] ", name, ": no choices");
}

int64_t EnvChoice::parse(const char* value) const {
  if (value == nullptr || *value == '\0') return -1;
  for (size_t i = 0; i < choices_.size(); ++i) {
    if (choices_[i] == value) return static_cast<int64_t>(i);
  }
  std::string allowed;
  for (size_t i = 0; i < choices_.size(); ++i) {
    allowed += (i == 0 ? "" : i + 1 == choices_.size() ? " or " : ", ") + choices_[i];
  }
  KILN_FAIL("[environment] ", name(), " must be ", allowed,
            " (unset or empty for the default), got '", value, "'");
}

}  // namespace kiln::internal
