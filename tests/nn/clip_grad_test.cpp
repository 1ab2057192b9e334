// clip_grad_norm_ and clip_grad_value_ against hand-computed values, including the inf norm,
// other p, and non-finite gradients; gradients of several dtypes, empty and 0-d (the foreach ops
// run per dtype), scaled as g.mul_(coef) scales them.
#include "nn/utils/clip_grad.h"

#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "test_util.h"

namespace kiln {
namespace {

using nn::utils::clip_grad_norm_;
using nn::utils::clip_grad_value_;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Two parameters with gradients [3, 4] and [[12]] (total 2-norm 13), and one without.
std::vector<Tensor> params_with_grads(ScalarType dtype = kFloat64) {
  Tensor a = zeros({2}, dtype), b = zeros({1, 1}, dtype), c = zeros({3}, dtype);
  a.mutable_grad() = tensor({3.0, -4.0}, dtype);
  b.mutable_grad() = tensor({{12.0}}, dtype);
  return {a, b, c};
}

TEST(ClipGradNorm, TwoNormClips) {
  std::vector<Tensor> p = params_with_grads();
  const double total = clip_grad_norm_(p, /*max_norm=*/6.5);
  EXPECT_DOUBLE_EQ(total, 13.0);
  const double coef = 6.5 / (13.0 + 1e-6);
  EXPECT_DOUBLE_EQ(p[0].grad()[0].item<double>(), 3.0 * coef);
  EXPECT_DOUBLE_EQ(p[0].grad()[1].item<double>(), -4.0 * coef);
  EXPECT_DOUBLE_EQ(p[1].grad().view({-1})[0].item<double>(), 12.0 * coef);
  EXPECT_FALSE(p[2].grad().defined());
  // After clipping the norm is max_norm (up to the 1e-6).
  EXPECT_NEAR(clip_grad_norm_(p, 100.0), 6.5, 1e-6);
}

TEST(ClipGradNorm, BelowMaxNormLeavesGradsAlone) {
  std::vector<Tensor> p = params_with_grads(kFloat32);
  EXPECT_NEAR(clip_grad_norm_(p, 13.5), 13.0, 1e-5);
  EXPECT_EQ(p[0].grad()[0].item<float>(), 3.0f);
  EXPECT_EQ(p[1].grad().view({-1})[0].item<float>(), 12.0f);
}

TEST(ClipGradNorm, InfAndOtherNorms) {
  {
    std::vector<Tensor> p = params_with_grads();
    EXPECT_DOUBLE_EQ(clip_grad_norm_(p, 6.0, kInf), 12.0);
    EXPECT_DOUBLE_EQ(p[1].grad().view({-1})[0].item<double>(), 12.0 * 6.0 / (12.0 + 1e-6));
  }
  {
    std::vector<Tensor> p = params_with_grads();
    EXPECT_DOUBLE_EQ(clip_grad_norm_(p, 100.0, 1.0), 19.0);
  }
  {
    std::vector<Tensor> p = params_with_grads();
    const double want = std::cbrt(27.0 + 64.0 + 1728.0);
    EXPECT_NEAR(clip_grad_norm_(p, 1.0, 3.0), want, 1e-12);
    EXPECT_NEAR(p[0].grad()[1].item<double>(), -4.0 / (want + 1e-6), 1e-15);
  }
  {
    // A single tensor, as libtorch's overload.
    Tensor t = zeros({2});
    t.mutable_grad() = tensor({6.0, 8.0});
    EXPECT_NEAR(clip_grad_norm_(t, 5.0), 10.0, 1e-6);
    EXPECT_NEAR(t.grad()[1].item<float>(), 8.0 * 5.0 / 10.0, 1e-6);
  }
}

TEST(ClipGradNorm, NoGradientsGiveZero) {
  Tensor a = zeros({3});
  EXPECT_EQ(clip_grad_norm_(std::vector<Tensor>{a}, 1.0), 0.0);
  EXPECT_EQ(clip_grad_norm_(std::vector<Tensor>{}, 1.0, kInf), 0.0);
}

TEST(ClipGradNorm, NonFiniteNorms) {
  {
    std::vector<Tensor> p = params_with_grads();
    p[0].mutable_grad()[1] = kInf;
    EXPECT_KILN_ERROR(clip_grad_norm_(p, 1.0, 2.0, /*error_if_nonfinite=*/true),
                      "[clip_grad_norm_] the total norm of order 2 for gradients from "
                      "`parameters` is non-finite");
    EXPECT_EQ(p[0].grad()[0].item<double>(), 3.0);  // the error comes before any change
    EXPECT_KILN_ERROR(clip_grad_norm_(p, 1.0, kInf, true), "the total norm of order inf");
    // Without the flag, PyTorch's behaviour: scaled by max_norm / inf = 0.
    EXPECT_EQ(clip_grad_norm_(p, 1.0), kInf);
    EXPECT_EQ(p[0].grad()[0].item<double>(), 0.0);
    EXPECT_TRUE(std::isnan(p[0].grad()[1].item<double>()));  // inf * 0
    EXPECT_EQ(p[1].grad().view({-1})[0].item<double>(), 0.0);
  }
  {
    std::vector<Tensor> p = params_with_grads();
    p[1].mutable_grad().view({-1})[0] = std::nan("");
    EXPECT_TRUE(std::isnan(clip_grad_norm_(p, 1.0)));
    EXPECT_TRUE(std::isnan(p[0].grad()[0].item<double>()));  // nan everywhere
    std::vector<Tensor> q = params_with_grads();
    q[1].mutable_grad().view({-1})[0] = std::nan("");
    EXPECT_TRUE(std::isnan(clip_grad_norm_(q, 1.0, kInf)));
    EXPECT_KILN_ERROR(clip_grad_norm_(q, 1.0, 2.0, true), "is non-finite");
  }
}

TEST(ClipGradNorm, MixedDtypesEmptyAndZeroDimGradients) {
  manual_seed(5);
  const std::vector<Tensor> grads = {
      randn({5}),    randn({3, 4}).to(kBFloat16), randn({2}, kDouble),
      zeros({0}),    full({}, -2.5, kBFloat16),   randn({7}).to(kBFloat16),
      full({}, 0.75)};
  for (double p : {2.0, 1.0, 3.0, kInf, -kInf, 0.0}) {
    std::vector<Tensor> params;
    for (const Tensor& g : grads) {
      Tensor t = zeros(g.sizes(), g.dtype());
      t.mutable_grad() = g.clone();
      params.push_back(t);
    }
    // The reference: every element in f64, as if concatenated.
    std::vector<double> all;
    for (const Tensor& g : grads) {
      for (double v : g.to(kDouble).flatten().to_vector<double>()) all.push_back(std::abs(v));
    }
    double want = 0;
    if (std::isinf(p)) {
      want = p > 0 ? *std::max_element(all.begin(), all.end())
                   : *std::min_element(all.begin(), all.end());
    } else if (p == 0) {
      for (double v : all) want += v != 0 ? 1 : 0;
    } else {
      for (double v : all) want += std::pow(v, p);
      want = std::pow(want, 1 / p);
    }
    const double max_norm = 0.5;
    const double total = clip_grad_norm_(params, max_norm, p);
    EXPECT_NEAR(total, want, 1e-6 * want) << p;
    const double coef = max_norm / (total + 1e-6);
    for (size_t i = 0; i < grads.size(); ++i) {
      Tensor expected = grads[i].clone();
      if (coef < 1) expected.mul_(coef);  // the Scalar form: coef read in the grad's opmath
      EXPECT_TRUE(equal(params[i].grad(), expected)) << "p " << p << " grad " << i;
    }
  }
}

TEST(ClipGradValue, Clamps) {
  std::vector<Tensor> p = params_with_grads();
  clip_grad_value_(p, 3.5);
  EXPECT_EQ(p[0].grad().to_vector<double>(), (std::vector<double>{3.0, -3.5}));
  EXPECT_EQ(p[1].grad().view({-1})[0].item<double>(), 3.5);
  EXPECT_FALSE(p[2].grad().defined());
  Tensor t = zeros({3});
  t.mutable_grad() = tensor({-1.0, 0.25, 2.0});
  clip_grad_value_(t, 0.5);
  EXPECT_EQ(t.grad().to_vector<float>(), (std::vector<float>{-0.5f, 0.25f, 0.5f}));
}

}  // namespace
}  // namespace kiln
