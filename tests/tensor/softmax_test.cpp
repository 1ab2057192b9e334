// softmax and log_softmax against an f64 reference along every dim, for every floating dtype,
// non-contiguous and large inputs, extreme values, and the dtype argument.
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <cmath>
#include <limits>
#include <random>

#include "test_util.h"

namespace kiln {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

Tensor from_values(std::vector<double> v, IntArrayRef sizes, ScalarType dtype = kDouble) {
  return from_blob(v.data(), sizes, kDouble).clone().to(dtype);
}

Tensor random_tensor(IntArrayRef sizes, uint32_t seed, ScalarType dtype = kDouble,
                     double scale = 3) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist(0, scale);
  std::vector<double> v(static_cast<size_t>(numel_of(sizes)));
  for (double& x : v) x = dist(gen);
  return from_values(v, sizes, dtype);
}

// softmax (or log_softmax) of `t` along `dim`, in f64, in row-major order.
std::vector<double> reference(const Tensor& t, int64_t dim, bool log) {
  const std::vector<double> x = t.to_vector<double>();
  std::vector<double> y(x.size());
  if (t.dim() == 0) return {log ? 0.0 : 1.0};
  const int64_t d = (dim + t.dim()) % t.dim();
  int64_t inner = 1;
  for (int64_t i = d + 1; i < t.dim(); ++i) inner *= t.size(i);
  const int64_t n = t.size(d);
  for (int64_t i = 0; i < t.numel(); ++i) {
    if ((i / inner) % n != 0) continue;  // i starts a slice along dim
    double m = -kInf;
    for (int64_t r = 0; r < n; ++r) m = std::max(m, x[i + r * inner]);
    double s = 0;
    for (int64_t r = 0; r < n; ++r) s += std::exp(x[i + r * inner] - m);
    for (int64_t r = 0; r < n; ++r) {
      const double v = x[i + r * inner];
      y[i + r * inner] = log ? v - m - std::log(s) : std::exp(v - m) / s;
    }
  }
  return y;
}

void expect_close(const Tensor& got, const std::vector<double>& want, double tol,
                  const std::string& what) {
  const std::vector<double> v = got.to_vector<double>();
  ASSERT_EQ(v.size(), want.size()) << what;
  for (size_t i = 0; i < v.size(); ++i) {
    ASSERT_NEAR(v[i], want[i], tol * (1 + std::abs(want[i]))) << what << " at " << i;
  }
}

double tolerance(ScalarType dt) {
  switch (dt) {
    case kHalf:
      return 2e-3;
    case kBFloat16:
      return 1e-2;
    case kFloat:
      return 1e-6;
    default:
      return 1e-13;
  }
}

TEST(SoftmaxTest, EveryDimDtypeAndLayout) {
  for (ScalarType dt : {kDouble, kFloat, kHalf, kBFloat16}) {
    const Tensor base = random_tensor({4, 5, 6}, 1, dt);
    for (const Tensor& t : {base, random_tensor({6, 4, 5}, 2, dt).permute({1, 2, 0}),
                            random_tensor({4, 10, 7}, 3, dt).slice(1, 0, 10, 2)}) {
      for (int64_t dim : {0, 1, 2, -1, -2, -3}) {
        const std::string what = std::string(dtype_name(dt)) + " " + shape_str(t.sizes()) +
                                 " dim " + std::to_string(dim);
        const Tensor s = t.softmax(dim);
        const Tensor ls = t.log_softmax(dim);
        EXPECT_EQ(s.dtype(), dt);
        EXPECT_EQ(ls.dtype(), dt);
        EXPECT_EQ(to_shape(s.sizes()), to_shape(t.sizes()));
        expect_close(s, reference(t, dim, false), tolerance(dt), "softmax " + what);
        expect_close(ls, reference(t, dim, true), tolerance(dt), "log_softmax " + what);
      }
    }
  }
}

TEST(SoftmaxTest, DtypeArgument) {
  const Tensor h = random_tensor({3, 8}, 4, kHalf);
  const Tensor s = h.softmax(1, kFloat);
  EXPECT_EQ(s.dtype(), kFloat);
  expect_close(s, reference(h, 1, false), 1e-6, "half -> float");
  const Tensor ls = kiln::log_softmax(h, 0, kDouble);
  EXPECT_EQ(ls.dtype(), kDouble);
  expect_close(ls, reference(h, 0, true), 1e-12, "half -> double");
  // Integers need a floating dtype.
  const Tensor i = from_values({1, 2, 3, 4}, {2, 2}, kInt64);
  const Tensor si = kiln::softmax(i, -1, kFloat);
  EXPECT_EQ(si.dtype(), kFloat);
  expect_close(si, reference(i, -1, false), 1e-6, "int64 -> float");
  EXPECT_KILN_ERROR(i.softmax(0), "[softmax] expected a floating-point");
  EXPECT_KILN_ERROR(i.log_softmax(0), "[log_softmax] expected a floating-point");
  EXPECT_KILN_ERROR(h.softmax(0, kInt32), "[softmax] expected a floating-point dtype");
}

TEST(SoftmaxTest, ExtremeValuesAreStable) {
  const Tensor t = from_values({1000, 1001, 999, -1000, -1001, -999}, {2, 3}, kFloat);
  const std::vector<double> want = reference(t, 1, false);
  expect_close(t.softmax(1), want, 1e-6, "large");
  expect_close(t.log_softmax(1), reference(t, 1, true), 1e-6, "large log");
  // Masked entries (-inf) get probability 0 and log-probability -inf.
  const Tensor masked = from_values({0, -kInf, 1, -kInf}, {4}, kFloat);
  const auto s = masked.softmax(0).to_vector<double>();
  EXPECT_EQ(s[1], 0.0);
  EXPECT_EQ(s[3], 0.0);
  EXPECT_NEAR(s[0], 1 / (1 + std::exp(1.0)), 1e-6);
  EXPECT_EQ(masked.log_softmax(0).to_vector<double>()[1], -kInf);
  // A row entirely -inf has no distribution: nan, as PyTorch.
  for (double v : from_values({-kInf, -kInf}, {2}).softmax(0).to_vector<double>()) {
    EXPECT_TRUE(std::isnan(v));
  }
  // Rows sum to 1.
  const auto rows = random_tensor({16, 33}, 5, kFloat, 20).softmax(1).to_vector<double>();
  for (int r = 0; r < 16; ++r) {
    double sum = 0;
    for (int c = 0; c < 33; ++c) sum += rows[r * 33 + c];
    EXPECT_NEAR(sum, 1.0, 1e-6);
  }
}

TEST(SoftmaxTest, ZeroDimAndEmpty) {
  const Tensor s = scalar_tensor(3.5, kFloat);
  EXPECT_EQ(s.softmax(0).item<float>(), 1.0f);
  EXPECT_EQ(s.log_softmax(-1).item<float>(), 0.0f);
  EXPECT_EQ(s.softmax(0).dim(), 0);
  EXPECT_KILN_ERROR(s.softmax(1), "[softmax]");
  const Tensor e = zeros({0, 4});
  EXPECT_EQ(to_shape(e.softmax(0).sizes()), (Shape{0, 4}));
  EXPECT_EQ(to_shape(e.log_softmax(1).sizes()), (Shape{0, 4}));
}

TEST(SoftmaxTest, LargeInputsSplitAcrossThreads) {
  // Last-dim rows and a leading dim (columns), each over more than 32768 elements.
  const Tensor t = random_tensor({300, 257}, 6, kFloat);
  expect_close(t.softmax(1), reference(t, 1, false), 1e-6, "rows");
  expect_close(t.log_softmax(0), reference(t, 0, true), 1e-5, "columns");
  const Tensor u = random_tensor({3, 100, 300}, 7, kFloat);
  expect_close(u.softmax(1), reference(u, 1, false), 1e-6, "middle dim");
}

TEST(SoftmaxTest, Errors) {
  const Tensor t = zeros({2, 3});
  EXPECT_KILN_ERROR(t.softmax(2), "[softmax]");
  EXPECT_KILN_ERROR(t.softmax(-3), "[softmax]");
  EXPECT_KILN_ERROR(t.log_softmax(5), "[log_softmax]");
}

}  // namespace
}  // namespace kiln
