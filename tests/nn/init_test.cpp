// kiln::nn::init: gains, fans, and each initialiser's bounds and statistics.
#include "nn/init.h"

#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <cmath>
#include <numbers>
#include <vector>

#include "test_util.h"

namespace kiln {
namespace {

namespace init = nn::init;

struct Stats {
  double mean, std, min, max;
};

Stats stats(const Tensor& t) {
  const auto v = t.to_vector<double>();
  double sum = 0, sq = 0, mn = 1e300, mx = -1e300;
  for (double x : v) {
    sum += x;
    sq += x * x;
    mn = std::min(mn, x);
    mx = std::max(mx, x);
  }
  const double n = static_cast<double>(v.size());
  return {sum / n, std::sqrt(sq / n - (sum / n) * (sum / n)), mn, mx};
}

Tensor param(IntArrayRef sizes, ScalarType dtype = kFloat) {
  return empty(sizes, dtype).requires_grad_(true);
}

TEST(InitTest, CalculateGain) {
  EXPECT_DOUBLE_EQ(init::calculate_gain(kLinear), 1.0);
  EXPECT_DOUBLE_EQ(init::calculate_gain(kConv2D), 1.0);
  EXPECT_DOUBLE_EQ(init::calculate_gain(kSigmoid), 1.0);
  EXPECT_DOUBLE_EQ(init::calculate_gain(kTanh), 5.0 / 3.0);
  EXPECT_DOUBLE_EQ(init::calculate_gain(kReLU), std::sqrt(2.0));
  EXPECT_DOUBLE_EQ(init::calculate_gain(kLeakyReLU), std::sqrt(2.0 / (1 + 0.01 * 0.01)));
  EXPECT_DOUBLE_EQ(init::calculate_gain(kLeakyReLU, std::sqrt(5.0)), std::sqrt(2.0 / 6.0));
  EXPECT_DOUBLE_EQ(init::calculate_gain(kSELU), 0.75);
}

TEST(InitTest, FanInAndFanOut) {
  EXPECT_EQ(init::calculate_fan_in_and_fan_out(empty({3, 5})), std::make_tuple(5, 3));
  EXPECT_EQ(init::calculate_fan_in_and_fan_out(empty({8, 4, 3, 2})), std::make_tuple(24, 48));
  EXPECT_KILN_ERROR(init::calculate_fan_in_and_fan_out(empty({7})),
                    "[calculate_fan_in_and_fan_out] fan in and fan out cannot be computed");
  EXPECT_KILN_ERROR(init::kaiming_uniform_(param({7})), "fewer than 2 dimensions");
  EXPECT_KILN_ERROR(init::zeros_(Tensor()), "[init::constant_] the tensor is undefined");
}

TEST(InitTest, SimpleFillsWorkOnParameters) {
  Tensor w = param({4, 6});
  init::constant_(w, 0.25);
  EXPECT_TRUE(equal(w, full({4, 6}, 0.25)));
  // In place under no-grad: still a leaf, no history recorded.
  EXPECT_TRUE(w.is_leaf());
  EXPECT_TRUE(w.requires_grad());
  EXPECT_EQ(w.grad_fn(), nullptr);
  init::zeros_(w);
  EXPECT_TRUE(equal(w, zeros({4, 6})));
  init::ones_(w);
  EXPECT_TRUE(equal(w, ones({4, 6})));
  init::eye_(w);
  EXPECT_TRUE(equal(w, eye(4, 6)));
  EXPECT_KILN_ERROR(init::eye_(param({2, 2, 2})), "[init::eye_]");
  // The returned tensor is the argument itself.
  EXPECT_TRUE(init::zeros_(w).is_same(w));
}

TEST(InitTest, UniformAndNormal) {
  manual_seed(1);
  Tensor w = param({200, 300});
  init::uniform_(w, -0.5, 1.5);
  Stats s = stats(w);
  EXPECT_GE(s.min, -0.5);
  EXPECT_LT(s.max, 1.5);
  EXPECT_NEAR(s.mean, 0.5, 0.01);
  EXPECT_NEAR(s.std, 2 / std::sqrt(12.0), 0.01);
  init::normal_(w, 3, 0.5);
  s = stats(w);
  EXPECT_NEAR(s.mean, 3, 0.01);
  EXPECT_NEAR(s.std, 0.5, 0.01);
}

TEST(InitTest, Xavier) {
  manual_seed(2);
  Tensor w = param({256, 128, 3});  // fan_in 384, fan_out 768
  init::xavier_uniform_(w, 2.0);
  const double a = 2.0 * std::sqrt(6.0 / (384 + 768));
  Stats s = stats(w);
  EXPECT_GE(s.min, -a);
  EXPECT_LE(s.max, a);
  EXPECT_NEAR(s.std, a / std::sqrt(3.0), 0.02 * a);
  init::xavier_normal_(w);
  s = stats(w);
  EXPECT_NEAR(s.std, std::sqrt(2.0 / (384 + 768)), 0.01 * std::sqrt(2.0 / 1152));
  EXPECT_NEAR(s.mean, 0, 0.01);
}

TEST(InitTest, Kaiming) {
  manual_seed(3);
  Tensor w = param({64, 32, 5, 5});  // fan_in 800, fan_out 1600
  init::kaiming_uniform_(w, /*a=*/0, kFanIn, kReLU);
  double bound = std::sqrt(2.0) * std::sqrt(3.0 / 800);
  Stats s = stats(w);
  EXPECT_GE(s.min, -bound);
  EXPECT_LE(s.max, bound);
  EXPECT_NEAR(s.std, bound / std::sqrt(3.0), 0.02 * bound);
  // PyTorch's Linear/Conv default: a = sqrt(5), leaky ReLU -> bound 1/sqrt(fan_in).
  init::kaiming_uniform_(w, std::sqrt(5.0));
  s = stats(w);
  EXPECT_LE(std::max(-s.min, s.max), 1 / std::sqrt(800.0));
  EXPECT_GT(std::max(-s.min, s.max), 0.99 / std::sqrt(800.0));
  init::kaiming_normal_(w, 0, kFanOut, kReLU);
  s = stats(w);
  EXPECT_NEAR(s.std, std::sqrt(2.0 / 1600), 0.02 * std::sqrt(2.0 / 1600));
  EXPECT_NEAR(s.mean, 0, 0.01 * std::sqrt(2.0 / 1600));
  init::kaiming_normal_(w, 0.2, kFanIn, kLeakyReLU);
  s = stats(w);
  const double expected = std::sqrt(2.0 / 1.04) / std::sqrt(800.0);
  EXPECT_NEAR(s.std, expected, 0.02 * expected);
  // Tensors without elements are left alone (PyTorch warns and returns).
  Tensor none = param({0, 4});
  EXPECT_TRUE(init::kaiming_uniform_(none).is_same(none));
  EXPECT_TRUE(init::xavier_normal_(none).is_same(none));
}

TEST(InitTest, TruncNormal) {
  manual_seed(4);
  Tensor w = param({100000});
  init::trunc_normal_(w, /*mean=*/0, /*std=*/0.02, /*a=*/-0.04, /*b=*/0.04);
  Stats s = stats(w);
  EXPECT_GE(s.min, -0.04);
  EXPECT_LE(s.max, 0.04);
  // The std of N(0, 1) truncated to [-2, 2]: sqrt(1 - 2 * 2 phi(2) / (2 Phi(2) - 1)).
  const double phi2 = std::exp(-2.0) / std::sqrt(2 * std::numbers::pi);
  const double z = std::erf(2 / std::sqrt(2.0));
  const double trunc_std = std::sqrt(1 - 4 * phi2 / z);
  EXPECT_NEAR(s.std, 0.02 * trunc_std, 0.02 * 0.01);
  EXPECT_NEAR(s.mean, 0, 0.0005);
  // One-sided and shifted: N(1, 1) truncated to [1, 3] has mean 1 + (phi(0) - phi(2)) /
  // (Phi(2) - Phi(0)).
  init::trunc_normal_(w, 1, 1, 1, 3);
  s = stats(w);
  EXPECT_GE(s.min, 1);
  EXPECT_LE(s.max, 3);
  const double phi0 = 1 / std::sqrt(2 * std::numbers::pi);
  EXPECT_NEAR(s.mean, 1 + (phi0 - phi2) / (z / 2), 0.01);
  // Far in the tail: the inverse CDF stays finite and within bounds.
  init::trunc_normal_(w, 0, 1, 6, 7);
  s = stats(w);
  EXPECT_GE(s.min, 6);
  EXPECT_LE(s.max, 7);
  EXPECT_LT(s.mean, 6.3);
  EXPECT_KILN_ERROR(init::trunc_normal_(w, 0, 1, 2, 1), "[init::trunc_normal_]");
  EXPECT_TRUE(w.is_leaf());
}

TEST(InitTest, ReproducibleAndEveryFloatingDtype) {
  for (ScalarType dt : {kFloat, kDouble, kHalf, kBFloat16}) {
    Tensor a = param({16, 16}, dt), b = param({16, 16}, dt);
    manual_seed(5);
    init::kaiming_uniform_(a);
    init::trunc_normal_(a.detach().narrow(0, 0, 8), 0, 0.02, -0.04, 0.04);  // a view
    manual_seed(5);
    init::kaiming_uniform_(b);
    init::trunc_normal_(b.detach().narrow(0, 0, 8), 0, 0.02, -0.04, 0.04);
    EXPECT_TRUE(equal(a, b)) << dtype_name(dt);
    EXPECT_EQ(a.dtype(), dt);
    // The view wrote into the parameter: the first rows are now tiny.
    EXPECT_LE(a.narrow(0, 0, 8).abs().max().item<double>(), 0.04 + 1e-3) << dtype_name(dt);
  }
}

}  // namespace
}  // namespace kiln
