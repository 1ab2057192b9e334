// Shared pieces of the GPU test suites in tests/kernels: the fixture every Gpu* suite derives
// from (it skips, with the reason, where there is no usable GPU), the device, the dtype lists,
// random CPU inputs, tolerances, the layouts a CPU input is tried in and their GPU copies, and
// the comparisons. Each test runs an op on CPU inputs and on their GPU copies and compares.
//
//   class GpuThing : public kiln::test::GpuTest {};
//   TEST_F(GpuThing, MatchesCpu) { Tensor x = random_cpu({7, 33}, kBFloat16, 1); ... }
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "kernels/cuda/runtime.h"
#include "kernels/disk_cache.h"
#include "tensor/ops.h"
#include "tensor/tensor_data.h"
#include "test_util.h"

namespace kiln::test {

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  }
};

inline const Device kGpu(kCUDA, 0);

inline const std::vector<ScalarType> kFloatDtypes = {kFloat, kDouble, kHalf, kBFloat16};
inline const std::vector<ScalarType> kAllDtypes = {kFloat, kDouble, kHalf,  kBFloat16,
                                                   kInt64, kInt32,  kUInt8, kBool};
inline const std::vector<ScalarType> kNumericDtypes = {kFloat, kDouble, kHalf, kBFloat16,
                                                       kInt64, kInt32,  kUInt8};

// Random CPU values of `dtype`: floats uniform in [lo, hi), integers in [lo, hi] (for uint8 the
// part of it in [0, 255], else [0, 3]), bools 50/50.
inline Tensor random_cpu(IntArrayRef sizes, ScalarType dtype, uint64_t seed, double lo = -3,
                         double hi = 3) {
  manual_seed(seed);
  if (dtype == kBool) return randint(0, 2, sizes, TensorOptions(kInt64)).to(kBool);
  if (dtype == kUInt8) {
    const int64_t l = std::clamp<int64_t>(static_cast<int64_t>(lo), 0, 255);
    const int64_t h = std::clamp<int64_t>(static_cast<int64_t>(hi), 0, 255);
    return h > l ? randint(l, h + 1, sizes, TensorOptions(kUInt8))
                 : randint(0, 4, sizes, TensorOptions(kUInt8));
  }
  if (!is_floating_point(dtype)) {
    return randint(static_cast<int64_t>(lo), static_cast<int64_t>(hi) + 1, sizes,
                   TensorOptions(dtype));
  }
  return rand(sizes, TensorOptions(kDouble)).mul(hi - lo).add(lo).to(dtype);
}

struct Tol {
  double rtol, atol;
};

// Tolerances of float math that CUDA's library computes within an ulp or two of glibc's.
inline Tol tol_for(ScalarType dtype) {
  switch (dtype) {
    case kFloat:
      return {2e-5, 1e-6};
    case kDouble:
      return {1e-12, 1e-13};
    case kHalf:
      return {2e-3, 1e-3};
    case kBFloat16:
      return {1.6e-2, 1e-2};
    default:
      return {0, 0};
  }
}

// x (CPU) in several layouts with the same values: contiguous, and for 1-d and 2-d tensors a
// strided view (every other element of a larger tensor) or a transposed one.
inline std::vector<std::pair<std::string, Tensor>> layouts(const Tensor& x) {
  std::vector<std::pair<std::string, Tensor>> out = {{"contiguous", x}};
  if (x.dim() == 2) out.push_back({"transposed", x.t().contiguous().t()});
  if (x.dim() == 1 && x.numel() > 1) {
    const Tensor wide = cat({x.unsqueeze(1), x.unsqueeze(1)}, 1).reshape({-1});
    out.push_back({"strided", wide.slice(0, 0, std::nullopt, 2)});
  }
  return out;
}

// A CPU tensor's GPU copy with the same layout (the CUDA copy of a strided view is contiguous,
// so views are re-made on the GPU from a copy of their base when the layout matters).
inline Tensor to_gpu_like(const std::string& layout, const Tensor& x) {
  if (layout == "transposed") return x.t().contiguous().cuda().t();
  if (layout == "strided") {
    const Tensor wide = cat({x.unsqueeze(1), x.unsqueeze(1)}, 1).reshape({-1}).cuda();
    return wide.slice(0, 0, std::nullopt, 2);
  }
  return x.cuda();
}

// "op dtype shape layout", naming a case in a failure message.
inline std::string name_of(const std::string& op, ScalarType dt, const Shape& shape,
                           const std::string& layout) {
  return op + " " + std::string(dtype_name(dt)) + " " + shape_str(shape) + " " + layout;
}

// actual (any device) against expected (CPU): same dtype and shape; integers and bools, or any
// dtype when rtol == atol == 0, bit for bit; floats within |x - y| <= atol + rtol |y| (NaNs in
// the same places, infinities equal).
inline void expect_match(const Tensor& actual_any, const Tensor& expected, Tol tol,
                         const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_TRUE(actual_any.defined());
  const Tensor actual = actual_any.cpu();
  ASSERT_EQ(actual.dtype(), expected.dtype());
  ASSERT_EQ(to_shape(actual.sizes()), to_shape(expected.sizes()));
  const Tensor a = actual.contiguous(), e = expected.contiguous();
  const int64_t n = a.numel();
  int64_t bad = 0, first = -1;
  if (!is_floating_point(a.dtype()) || (tol.rtol == 0 && tol.atol == 0)) {
    const size_t w = element_size(a.dtype());
    for (int64_t i = 0; i < n; ++i) {
      if (std::memcmp(static_cast<const char*>(a.data_ptr()) + i * w,
                      static_cast<const char*>(e.data_ptr()) + i * w, w) != 0) {
        if (first < 0) first = i;
        ++bad;
      }
    }
    EXPECT_EQ(bad, 0) << "first mismatch at " << first << " of " << n << " ("
                      << dtype_name(a.dtype()) << ")";
    return;
  }
  const Tensor ad = a.to(kDouble), ed = e.to(kDouble);
  const double* pa = ad.data_ptr<double>();
  const double* pe = ed.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    const double x = pa[i], y = pe[i];
    const bool ok = std::isnan(y)   ? std::isnan(x)
                    : std::isinf(y) ? x == y
                                    : std::abs(x - y) <= tol.atol + tol.rtol * std::abs(y);
    if (!ok) {
      if (first < 0) first = i;
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << "first mismatch at " << first << " of " << n << " (" << dtype_name(a.dtype())
                    << "): gpu " << (first >= 0 ? pa[first] : 0.0) << " cpu "
                    << (first >= 0 ? pe[first] : 0.0);
}
inline void expect_match(const Tensor& actual, const Tensor& expected, double rtol, double atol,
                         const std::string& what) {
  expect_match(actual, expected, Tol{rtol, atol}, what);
}
// Relative L2 error ||got - want|| / ||want|| over the elements (the absolute L2 error where want
// is all zeros), both read on the CPU. NaN must meet NaN and an infinity the same infinity (those
// elements are then left out); otherwise the error is infinite.
inline double rel_error(const Tensor& got, const Tensor& want) {
  const std::vector<double> g = got.to(kCPU).to_vector<double>();
  const std::vector<double> w = want.to(kCPU).to_vector<double>();
  EXPECT_EQ(g.size(), w.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < g.size() && i < w.size(); ++i) {
    if (std::isnan(g[i]) || std::isnan(w[i])) {
      if (std::isnan(g[i]) != std::isnan(w[i])) return INFINITY;
      continue;
    }
    if (std::isinf(w[i]) || std::isinf(g[i])) {
      if (g[i] != w[i]) return INFINITY;
      continue;
    }
    num += (g[i] - w[i]) * (g[i] - w[i]);
    den += w[i] * w[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

inline void expect_same(const Tensor& actual, const Tensor& expected, const std::string& what) {
  expect_match(actual, expected, Tol{0, 0}, what);
}

// Points kiln's disk cache (kernels/disk_cache.h) at `dir` for the scope ("none": off), and back
// at the default after it; a directory it points at is removed at the end. fresh(name): a new
// directory of this process under the system's temporary directory.
class DiskCacheScope {
 public:
  explicit DiskCacheScope(std::string dir) : dir_(std::move(dir)) { disk_cache::set_dir(dir_); }
  static std::string fresh(const std::string& name) {
    return (std::filesystem::temp_directory_path() /
            ("kiln_" + name + "_" + std::to_string(getpid())))
        .string();
  }
  ~DiskCacheScope() {
    disk_cache::set_dir("");
    std::error_code ec;
    if (dir_ != "none") std::filesystem::remove_all(dir_, ec);
  }
  DiskCacheScope(const DiskCacheScope&) = delete;
  DiskCacheScope& operator=(const DiskCacheScope&) = delete;
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
};

// flash_attention or flash_attention_backward on the CPU as the GPU attention tests' reference:
// the CPU kernel's f64 loops on the inputs widened to f64, the results rounded to the dtypes the
// kernels return (out and the gradients in q's dtype, lse in f32). The CPU kernel's f32 path
// (what f32/bf16/f16 inputs run) rounds where the exact result cancels: with one key, dq and dk
// are exactly 0 and the f32 path gives rounding noise, which the GPU kernels' own noise cannot
// match in relative terms.
inline TensorVec attention_reference(const OpDef& op, const TensorVec& inputs,
                                     absl::InlinedVector<Attr, 4> attrs) {
  TensorVec wide;
  for (const Tensor& t : inputs) wide.push_back(t.defined() ? t.to(kCPU).to(kDouble) : Tensor());
  const bool forward = op.name == "flash_attention";
  const ScalarType dtype = inputs[forward ? 0 : 1].dtype();
  TensorVec out = call_op(op, std::move(wide), std::move(attrs));
  for (size_t i = 0; i < out.size(); ++i) out[i] = out[i].to(forward && i == 1 ? kFloat : dtype);
  return out;
}

}  // namespace kiln::test
