// Shared pieces of the GPU test suites in tests/kernels: the fixture every Gpu* suite derives
// from (it skips, with the reason, where there is no usable GPU), the device, the dtype lists
// and random CPU inputs. Each test runs an op on CPU inputs and on their GPU copies and compares.
//
//   class GpuThing : public kiln::test::GpuTest {};
//   TEST_F(GpuThing, MatchesCpu) { Tensor x = random_cpu({7, 33}, kBFloat16, 1); ... }
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kernels/cuda/runtime.h"
#include "tensor/ops.h"

namespace kiln::test {

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  }
};

inline const Device kGpu(kCUDA, 0);

inline const std::vector<ScalarType> kFloatDtypes = {kFloat, kDouble, kHalf, kBFloat16};
inline const std::vector<ScalarType> kAllDtypes = {kFloat, kDouble, kHalf, kBFloat16,
                                                   kInt64, kInt32,  kBool};
inline const std::vector<ScalarType> kNumericDtypes = {kFloat,    kDouble, kHalf,
                                                       kBFloat16, kInt64,  kInt32};

// Random CPU values of `dtype`: floats uniform in [lo, hi), integers in [lo, hi], bools 50/50.
inline Tensor random_cpu(IntArrayRef sizes, ScalarType dtype, uint64_t seed, double lo = -3,
                         double hi = 3) {
  manual_seed(seed);
  if (dtype == kBool) return randint(0, 2, sizes, TensorOptions(kInt64)).to(kBool);
  if (!is_floating_point(dtype)) {
    return randint(static_cast<int64_t>(lo), static_cast<int64_t>(hi) + 1, sizes,
                   TensorOptions(dtype));
  }
  return rand(sizes, TensorOptions(kDouble)).mul(hi - lo).add(lo).to(dtype);
}

}  // namespace kiln::test
