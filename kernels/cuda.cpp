// The runtime knobs of kernels/cuda.h, in every build (kernels/cuda/runtime.cpp and the CPU-only
// stand-in kernels/cpu/cuda_unavailable.cpp hold the rest of kiln::cuda). These are the only
// places where kernels/ reads the environment: once per knob, at its first use.
#include "kernels/cuda.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/choices.h"
#include "kernels/cuda/cublaslt.h"
#include "tensor/error.h"

namespace kiln::cuda {
namespace {

// A knob's initial value: true when the variable is set to anything but "" and "0".
bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

std::atomic<bool>& launch_sync_flag() {
  static std::atomic<bool> flag{env_flag("KILN_CUDA_SYNC")};
  return flag;
}

std::atomic<bool>& matmul_autotune_flag() {
  static std::atomic<bool> flag{env_flag("KILN_MATMUL_AUTOTUNE")};
  return flag;
}

std::atomic<bool> g_allow_tf32{false};
std::atomic<int> g_matmul_sm_carveout{0};

}  // namespace

bool launch_sync() { return launch_sync_flag().load(std::memory_order_relaxed); }
void set_launch_sync(bool enabled) { launch_sync_flag().store(enabled, std::memory_order_relaxed); }

bool matmul_autotune() { return matmul_autotune_flag().load(std::memory_order_relaxed); }
void set_matmul_autotune(bool enabled) {
  matmul_autotune_flag().store(enabled, std::memory_order_relaxed);
}

bool allow_tf32() { return g_allow_tf32.load(std::memory_order_relaxed); }
void set_allow_tf32(bool enabled) { g_allow_tf32.store(enabled, std::memory_order_relaxed); }

int matmul_sm_carveout() { return g_matmul_sm_carveout.load(std::memory_order_relaxed); }
void set_matmul_sm_carveout(int sms) {
  KILN_CHECK(sms >= 0, "[set_matmul_sm_carveout] expected a non-negative number of SMs, got ", sms);
  g_matmul_sm_carveout.store(sms, std::memory_order_relaxed);
}

namespace internal {
AutotuneCounters& autotune_counters() {
  static AutotuneCounters counters;
  return counters;
}
SetupCounters& setup_counters() {
  static SetupCounters counters;
  return counters;
}
}  // namespace internal

MatmulAutotuneStats matmul_autotune_stats() {
  const internal::AutotuneCounters& c = internal::autotune_counters();
  MatmulAutotuneStats s;
  s.tuned_shapes = c.tuned_shapes.load(std::memory_order_relaxed);
  s.cache_hits = c.cache_hits.load(std::memory_order_relaxed);
  s.skipped_in_capture = c.skipped_in_capture.load(std::memory_order_relaxed);
  s.candidates_timed = c.candidates_timed.load(std::memory_order_relaxed);
  return s;
}

KernelSetupStats kernel_setup_stats() {
  const internal::SetupCounters& c = internal::setup_counters();
  const auto seconds = [](const std::atomic<int64_t>& ns) {
    return static_cast<double>(ns.load(std::memory_order_relaxed)) * 1e-9;
  };
  KernelSetupStats s;
  s.matmul_shapes_timed = c.matmul_shapes.load(std::memory_order_relaxed);
  s.matmul_timing_s = seconds(c.matmul_ns);
  s.attention_plans_built = c.attention_plans.load(std::memory_order_relaxed);
  s.attention_build_s = seconds(c.attention_plan_ns);
  s.attention_shapes_timed = c.attention_shapes.load(std::memory_order_relaxed);
  s.attention_timing_s = seconds(c.attention_timing_ns);
  s.choices_read = c.choices_read.load(std::memory_order_relaxed);
  s.choices_written = c.choices_written.load(std::memory_order_relaxed);
  return s;
}

void reset_matmul_autotune_stats() {
  internal::AutotuneCounters& c = internal::autotune_counters();
  c.tuned_shapes = 0;
  c.cache_hits = 0;
  c.skipped_in_capture = 0;
  c.candidates_timed = 0;
}

}  // namespace kiln::cuda
