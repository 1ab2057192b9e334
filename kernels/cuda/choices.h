// The kernels' choices made by measurement: cuBLASLt's algorithm per product shape
// (cublaslt.cpp), cuDNN's attention engine and cuDNN-or-hand-kernel per attention shape
// (cudnn_attention.cpp). What they cost the host is counted for kernel_setup_stats()
// (kernels/cuda.h; kernels/cuda.cpp holds the counters, for every build). The algorithms and the
// engines (with their plans' JSON) are kept in kiln's disk cache (kernels/disk_cache.h), so that
// a program's first step on a machine that has run it before does not time or build them again:
// a cached choice is used only where it is still one of the candidates (a library or driver that
// offers others makes the program time again). cuDNN against the hand kernel is timed in every
// process, so that a rebuilt hand kernel is measured again. Internal to kiln's CUDA code.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kiln::cuda::internal {

// What kernel_setup_stats() reports (kernels/cuda.cpp holds them): counts and nanoseconds.
struct SetupCounters {
  std::atomic<int64_t> matmul_shapes{0}, matmul_ns{0};
  std::atomic<int64_t> attention_plans{0}, attention_plan_ns{0};
  std::atomic<int64_t> attention_shapes{0}, attention_timing_ns{0};
  std::atomic<int64_t> choices_read{0}, choices_written{0};  // in the disk cache
};
SetupCounters& setup_counters();

// Adds one to `count` and the host time from construction to destruction to `ns`.
class SetupTimer {
 public:
  SetupTimer(std::atomic<int64_t>& count, std::atomic<int64_t>& ns)
      : ns_(ns), start_(std::chrono::steady_clock::now()) {
    count.fetch_add(1, std::memory_order_relaxed);
  }
  ~SetupTimer() {
    ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now() - start_)
                      .count(),
                  std::memory_order_relaxed);
  }
  SetupTimer(const SetupTimer&) = delete;
  SetupTimer& operator=(const SetupTimer&) = delete;

 private:
  std::atomic<int64_t>& ns_;
  std::chrono::steady_clock::time_point start_;
};

// The disk cache's choice of `kind` ("cublaslt", "cudnn-attention-engine") for `key` on `device`,
// made with `library` (the version of what offered the candidates), or nullopt. The cache's key
// also holds the device's name, compute capability and SM count and the driver's version. Counts
// choices_read.
std::optional<std::string> read_choice(std::string_view kind, int device,
                                       const std::string& library, const std::string& key);
// Stores a choice there (counts choices_written); a cache that cannot be written is skipped.
void write_choice(std::string_view kind, int device, const std::string& library,
                  const std::string& key, const std::string& payload);

}  // namespace kiln::cuda::internal
