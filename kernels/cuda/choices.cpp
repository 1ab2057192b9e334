#include "kernels/cuda/choices.h"

#include <cuda_runtime_api.h>

#include <array>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "kernels/disk_cache.h"

namespace kiln::cuda::internal {
namespace {

// "NVIDIA H100 80GB HBM3, sm_90, 132 SMs, driver 13000" (queried once per device), or "" when it
// cannot be. The driver is in it because cuDNN's restored plans hold kernels it compiled.
std::string device_text(int device) {
  constexpr int kMaxDevices = 64;
  static std::mutex mu;
  static std::array<std::string, kMaxDevices> texts;
  if (device < 0 || device >= kMaxDevices) return "";
  std::lock_guard<std::mutex> lock(mu);
  std::string& t = texts[static_cast<size_t>(device)];
  if (t.empty()) {
    cudaDeviceProp p{};
    int driver = 0;
    if (cudaGetDeviceProperties(&p, device) != cudaSuccess ||
        cudaDriverGetVersion(&driver) != cudaSuccess) {
      (void)cudaGetLastError();
      return "";
    }
    t = absl::StrCat(p.name, ", sm_", p.major, p.minor, ", ", p.multiProcessorCount,
                     " SMs, driver ", driver);
  }
  return t;
}

disk_cache::Key choice_key(std::string_view kind, const std::string& device,
                           const std::string& library, const std::string& key) {
  return {{std::string(kind), device, library, key}, ".choice"};
}

}  // namespace

std::optional<std::string> read_choice(std::string_view kind, int device,
                                       const std::string& library, const std::string& key) {
  const std::string d = device_text(device);
  if (d.empty()) return std::nullopt;
  std::optional<std::string> payload =
      disk_cache::read(disk_cache::dir(), choice_key(kind, d, library, key));
  if (payload) setup_counters().choices_read.fetch_add(1, std::memory_order_relaxed);
  return payload;
}

void write_choice(std::string_view kind, int device, const std::string& library,
                  const std::string& key, const std::string& payload) {
  const std::string d = device_text(device);
  if (d.empty()) return;
  if (disk_cache::write(disk_cache::dir(), choice_key(kind, d, library, key), payload)) {
    setup_counters().choices_written.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace kiln::cuda::internal
