// The kernel lab's driver (lab.h): runs every registered family, or those named by --only, and
// exits non-zero when a variant's check failed.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "kernels/cuda/check.h"
#include "lab/lab.h"
#include "tensor/ops.h"

namespace kiln::lab {
namespace {

std::map<std::string, std::vector<std::function<void()>>>& cases() {
  static std::map<std::string, std::vector<std::function<void()>>> c;
  return c;
}
int g_failures = 0;

}  // namespace

bool register_case(const char* family, std::function<void()> run) {
  cases()[family].push_back(std::move(run));
  return true;
}

void check(const std::string& what, const Tensor& got, const Tensor& ref, double atol,
           double rtol) {
  if (got.sizes() != ref.sizes()) {
    std::printf("  FAIL %s: shape %s, expected %s\n", what.c_str(), shape_str(got.sizes()).c_str(),
                shape_str(ref.sizes()).c_str());
    ++g_failures;
    return;
  }
  const Tensor g = got.to(kCPU).to(kDouble);
  const Tensor r = ref.to(kCPU).to(kDouble);
  const Tensor err = (g - r).abs();
  const double max_err = got.numel() > 0 ? err.max().item<double>() : 0.0;
  const bool ok = got.numel() == 0 || (err <= r.abs() * rtol + atol).all().item<bool>();
  std::printf("  %s %s: max |error| %.3g\n", ok ? "ok  " : "FAIL", what.c_str(), max_err);
  if (!ok) ++g_failures;
}

}  // namespace kiln::lab

int main(int argc, char** argv) {
  std::vector<std::string> only;
  const char* json_path = nullptr;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--only" && i + 1 < argc) {
      const std::string list = argv[++i];
      for (size_t start = 0; start <= list.size();) {
        const size_t end = std::min(list.find(',', start), list.size());
        only.push_back(list.substr(start, end - start));
        start = end + 1;
      }
    } else if (arg.rfind("--", 0) == 0) {
      std::fprintf(stderr, "usage: kiln_kernel_lab [--only FAMILIES] [results.json]\n");
      return 2;
    } else {
      json_path = argv[i];
    }
  }
  auto& all = kiln::lab::cases();
  for (const std::string& name : only) {
    if (!all.contains(name)) {
      std::fprintf(stderr, "kiln_kernel_lab: unknown family '%s'; the families are:", name.c_str());
      for (const auto& [family, runs] : all) std::fprintf(stderr, " %s", family.c_str());
      std::fprintf(stderr, "\n");
      return 2;
    }
  }
  cudaDeviceProp prop{};
  KILN_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("kiln kernel lab on %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  for (const auto& [family, runs] : all) {
    if (!only.empty() && std::find(only.begin(), only.end(), family) == only.end()) continue;
    std::printf("== %s\n", family.c_str());
    for (const auto& run : runs) run();
  }
  if (json_path != nullptr && !kiln::bench::write_json(json_path, prop.name)) return 1;
  if (kiln::lab::g_failures > 0) {
    std::printf("kiln_kernel_lab: %d check(s) failed\n", kiln::lab::g_failures);
    return 1;
  }
  return 0;
}
