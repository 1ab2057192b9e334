// Environment switches: variables that pick a kernel variant or a code path (KILN_SDPA,
// KILN_FLASH_KERNEL, KILN_RMSNORM_FWD, ...), parsed once and cached, so that the launch path
// reads two atomics instead of scanning the environment and parsing on every call.
//
//   int forward_variant() {
//     // -1 when unset or empty; otherwise an integer from 0 to 6, else a kiln::Error.
//     static const kiln::internal::EnvInt variant("KILN_RMSNORM_FWD", -1, 0, 6);
//     return static_cast<int>(variant.get());
//   }
//   // -1 when unset or empty; otherwise the index of the value among the choices.
//   static const kiln::internal::EnvChoice kernel("KILN_FLASH_KERNEL", {"v1", "fwd_v1"});
//
// Changing a switch in-process (tests, the GPU benchmark timing every variant): setenv, then
// kiln::internal::reload_env_switches(); every switch re-reads the environment at its next get().
// Without the reload a switch keeps the value it last read.
//
// A bad value raises a kiln::Error naming the variable, the allowed values and the value, at
// every get() until the environment is fixed and reloaded. get() is safe from several threads at
// once; setenv is not (POSIX), so change the environment only where no other thread reads it.
#pragma once

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace kiln::internal {

// Makes every switch re-read the environment at its next get().
void reload_env_switches();

// What the switches share: the cached parsed value and the reload generation it was read in.
class EnvSwitch {
 public:
  EnvSwitch(const EnvSwitch&) = delete;
  EnvSwitch& operator=(const EnvSwitch&) = delete;

  const char* name() const { return name_.c_str(); }

 protected:
  explicit EnvSwitch(const char* name) : name_(name) {}
  ~EnvSwitch() = default;

  // The cached value, or parse(getenv(name)) when the cache is older than the last reload. A
  // parse that throws leaves the cache as it was.
  int64_t cached() const;
  // `value` is nullptr when the variable is unset.
  virtual int64_t parse(const char* value) const = 0;

 private:
  int64_t refresh() const;

  std::string name_;
  mutable std::atomic<uint64_t> generation_{0};  // 0: never read
  mutable std::atomic<int64_t> value_{0};
};

// An integer switch: `unset` when the variable is unset or empty, else a decimal integer in
// [min, max].
class EnvInt final : public EnvSwitch {
 public:
  EnvInt(const char* name, int64_t unset, int64_t min, int64_t max);
  int64_t get() const { return cached(); }

 private:
  int64_t parse(const char* value) const override;

  int64_t unset_, min_, max_;
};

// A switch with named values: -1 when the variable is unset or empty, else the index of its value
// among `choices` (compared exactly).
class EnvChoice final : public EnvSwitch {
 public:
  EnvChoice(const char* name, std::initializer_list<const char*> choices);
  int get() const { return static_cast<int>(cached()); }

 private:
  int64_t parse(const char* value) const override;

  std::vector<std::string> choices_;
};

}  // namespace kiln::internal
