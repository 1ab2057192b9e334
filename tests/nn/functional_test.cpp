// nn::functional layers, activations, conv/pool and norms against f64
// references computed in the test (explicit loops), gradients by gradcheck, and
// misuse errors.
#include "nn/functional.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "autograd/gradcheck.h"
#include "test_util.h"

namespace kiln {
namespace {

namespace F = nn::functional;
using autograd::gradcheck;

Tensor rand64(IntArrayRef sizes, bool grad = true) {
  return randn(sizes, dtype(kFloat64).requires_grad(grad));
}

void expect_close(const Tensor &got, const std::vector<double> &want, double tol = 1e-10) {
  const std::vector<double> g = got.to_vector<double>();
  ASSERT_EQ(g.size(), want.size());
  for (size_t i = 0; i < g.size(); ++i) {
    EXPECT_NEAR(g[i], want[i], tol * (1 + std::abs(want[i]))) << "at " << i;
  }
}

TEST(FunctionalLinear, MatchesLoopsAndGradcheck) {
  manual_seed(1);
  Tensor x = rand64({3, 4}), w = rand64({2, 4}), b = rand64({2});
  std::vector<double> xv = x.to_vector<double>(), wv = w.to_vector<double>(),
                      bv = b.to_vector<double>(), ref;
  for (int i = 0; i < 3; ++i) {
    for (int o = 0; o < 2; ++o) {
      double s = bv[o];
      for (int k = 0; k < 4; ++k) s += xv[i * 4 + k] * wv[o * 4 + k];
      ref.push_back(s);
    }
  }
  expect_close(F::linear(x, w, b), ref);
  EXPECT_TRUE(gradcheck([](const auto &in) { return F::linear(in[0], in[1], in[2]); }, {x, w, b}));
}

TEST(FunctionalEmbedding, PaddingRowGetsNoGradient) {
  Tensor w = rand64({5, 3});
  Tensor idx = from_blob(std::vector<int64_t>{1, 4, 1, 0, 4}.data(), {5}, kInt64).clone();
  Tensor out = F::embedding(idx, w, F::EmbeddingFuncOptions().padding_idx(-1));  // row 4
  EXPECT_TRUE(equal(out, w.detach().index_select(0, idx)));
  out.sum().backward();
  const std::vector<double> g = w.grad().to_vector<double>();
  const double counts[5] = {1, 2, 0, 0, 0};
  for (int r = 0; r < 5; ++r) {
    for (int c = 0; c < 3; ++c) EXPECT_EQ(g[r * 3 + c], counts[r]) << r;
  }
  EXPECT_KILN_ERROR(F::embedding(idx, w, F::EmbeddingFuncOptions().padding_idx(5)),
                    "[embedding] padding_idx");
}

TEST(FunctionalSoftmax, MatchesFormula) {
  Tensor x = rand64({2, 3}, false);
  std::vector<double> xv = x.to_vector<double>(), sm, lsm;
  for (int r = 0; r < 2; ++r) {
    double z = 0;
    for (int c = 0; c < 3; ++c) z += std::exp(xv[r * 3 + c]);
    for (int c = 0; c < 3; ++c) {
      sm.push_back(std::exp(xv[r * 3 + c]) / z);
      lsm.push_back(xv[r * 3 + c] - std::log(z));
    }
  }
  expect_close(F::softmax(x, 1), sm);
  expect_close(F::log_softmax(x, F::LogSoftmaxFuncOptions(-1)), lsm);
  EXPECT_EQ(F::softmax(x.to(kFloat32), 1, kFloat64).dtype(), kFloat64);
}

TEST(FunctionalDropout, ScalesKeptElementsAndMasksGradient) {
  manual_seed(3);
  Tensor x = ones({100, 100}, dtype(kFloat32).requires_grad(true));
  Tensor y = F::dropout(x, F::DropoutFuncOptions().p(0.25));
  const std::vector<float> v = y.to_vector<float>();
  int64_t kept = 0;
  for (float e : v) {
    EXPECT_TRUE(e == 0.0f || std::abs(e - 1.0f / 0.75f) < 1e-6f) << e;
    kept += e != 0.0f;
  }
  EXPECT_NEAR(static_cast<double>(kept) / 10000.0, 0.75, 0.03);
  y.sum().backward();
  EXPECT_TRUE(allclose(x.grad(), y.detach()));  // d y / d x is the scaled mask
  EXPECT_TRUE(F::dropout(x, F::DropoutFuncOptions().training(false)).is_same(x));
  EXPECT_EQ(F::dropout(x, F::DropoutFuncOptions().p(1.0)).abs().sum().item<float>(), 0.0f);
  EXPECT_TRUE(kiln::dropout(x, 0.5, false).is_same(x));
  Tensor z = ones({10});
  F::dropout(z, F::DropoutFuncOptions().p(0.5).inplace(true));
  for (float e : z.to_vector<float>()) EXPECT_TRUE(e == 0.0f || e == 2.0f);
  EXPECT_KILN_ERROR(F::dropout(x, F::DropoutFuncOptions().p(1.5)), "[dropout]");
}

TEST(FunctionalLayerNorm, MatchesLoopsGradcheckAndBf16) {
  manual_seed(4);
  Tensor x = rand64({2, 3, 4}), w = rand64({3, 4}), b = rand64({3, 4});
  const std::vector<double> xv = x.to_vector<double>(), wv = w.to_vector<double>(),
                            bv = b.to_vector<double>();
  std::vector<double> ref;
  for (int n = 0; n < 2; ++n) {
    double mean = 0, var = 0;
    for (int i = 0; i < 12; ++i) mean += xv[n * 12 + i] / 12;
    for (int i = 0; i < 12; ++i) var += std::pow(xv[n * 12 + i] - mean, 2) / 12;
    for (int i = 0; i < 12; ++i) {
      ref.push_back((xv[n * 12 + i] - mean) / std::sqrt(var + 1e-5) * wv[i] + bv[i]);
    }
  }
  expect_close(F::layer_norm(x, F::LayerNormFuncOptions({3, 4}).weight(w).bias(b)), ref);
  EXPECT_TRUE(
      gradcheck([](const auto &in) { return F::layer_norm(in[0], {4}, in[1], in[2], 1e-5); },
                {rand64({3, 4}), rand64({4}), rand64({4})}));
  Tensor y16 = kiln::layer_norm(x.detach().to(kBFloat16), {3, 4}, w.detach(), b.detach());
  EXPECT_EQ(y16.dtype(), kBFloat16);
  expect_close(y16, ref, 3e-2);
  EXPECT_KILN_ERROR(F::layer_norm(x, {4, 3}),
                    "[layer_norm] normalized shape [4, 3] does not match the "
                    "trailing dims of input of shape [2, 3, 4]");
  EXPECT_KILN_ERROR(F::layer_norm(x, {4}, rand64({3})),
                    "[layer_norm] weight of shape [3] does not match the "
                    "normalized shape [4]");
}

TEST(FunctionalRmsNorm, MatchesLoopsGradcheckAndComputesInF32) {
  manual_seed(5);
  Tensor x = rand64({3, 8}), w = rand64({8});
  const std::vector<double> xv = x.to_vector<double>(), wv = w.to_vector<double>();
  std::vector<double> ref;
  for (int n = 0; n < 3; ++n) {
    double ms = 0;
    for (int i = 0; i < 8; ++i) ms += xv[n * 8 + i] * xv[n * 8 + i] / 8;
    for (int i = 0; i < 8; ++i) ref.push_back(xv[n * 8 + i] / std::sqrt(ms + 1e-6) * wv[i]);
  }
  expect_close(F::rms_norm(x, F::RMSNormFuncOptions({8}).weight(w).eps(1e-6)), ref);
  EXPECT_TRUE(
      gradcheck([](const auto &in) { return F::rms_norm(in[0], {8}, in[1], 1e-6); }, {x, w}));
  // bf16 in, bf16 out, but the mean of squares is not rounded: large values of
  // one row would overflow nothing and the result stays within bf16 rounding of
  // the f64 reference.
  Tensor y = F::rms_norm(x.detach().to(kBFloat16) * 100, {8}, w.detach().to(kBFloat16), 1e-6);
  EXPECT_EQ(y.dtype(), kBFloat16);
  expect_close(y, ref, 2e-2);
  // Default eps is the dtype's machine epsilon: rows of zeros stay finite (0).
  expect_close(F::rms_norm(zeros({2, 4}), {4}), std::vector<double>(8, 0.0));
  EXPECT_KILN_ERROR(F::rms_norm(x, {3}), "[rms_norm]");
}

TEST(FunctionalActivations, GeluSiluReluMatchFormulas) {
  Tensor x = rand64({20}, false);
  std::vector<double> xv = x.to_vector<double>(), g, s, r;
  for (double v : xv) {
    g.push_back(0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))));
    s.push_back(v / (1 + std::exp(-v)));
    r.push_back(std::max(v, 0.0));
  }
  expect_close(F::gelu(x, F::GELUFuncOptions().approximate("tanh")), g);
  expect_close(F::silu(x), s);
  expect_close(F::relu(x), r);
}

TEST(FunctionalPad, ConstantPaddingCroppingAndGradcheck) {
  Tensor x = arange(6, kFloat64).view({2, 3});
  // Last dim: 1 left, 2 right; dim 0: crop 1 at the top.
  Tensor y = F::pad(x, F::PadFuncOptions({1, 2, -1, 0}).value(9));
  ASSERT_EQ(y.sizes(), IntArrayRef({1, 6}));
  expect_close(y, {9, 3, 4, 5, 9, 9});
  Tensor z = F::pad(x, {0, 0, 1, 1});
  ASSERT_EQ(z.sizes(), IntArrayRef({4, 3}));
  expect_close(z, {0, 0, 0, 0, 1, 2, 3, 4, 5, 0, 0, 0});
  EXPECT_TRUE(gradcheck(
      [](const auto &in) {
        return F::pad(in[0], {2, -1, 1, 0}, 0.5);
      },
      {rand64({2, 3})}));
  EXPECT_KILN_ERROR(F::pad(x, {1}), "[pad] padding length must be divisible by 2");
  EXPECT_KILN_ERROR(F::pad(x, {1, 1, 1, 1, 1, 1}), "[pad] padding length 6 is too large");
  EXPECT_KILN_ERROR(F::pad(x, F::PadFuncOptions({1, 1}).mode("reflect")), "[pad] mode 'reflect'");
  EXPECT_KILN_ERROR(F::pad(x, {-2, -2}), "[pad]");
}

TEST(FunctionalNormalize, MatchesLoopsAndGradcheck) {
  Tensor x = rand64({3, 4});
  const std::vector<double> xv = x.to_vector<double>();
  std::vector<double> ref(12);
  for (int c = 0; c < 4; ++c) {  // dim 0
    double n = 0;
    for (int r = 0; r < 3; ++r) n += xv[r * 4 + c] * xv[r * 4 + c];
    for (int r = 0; r < 3; ++r) ref[r * 4 + c] = xv[r * 4 + c] / std::max(std::sqrt(n), 1e-12);
  }
  expect_close(F::normalize(x, F::NormalizeFuncOptions().dim(0)), ref);
  EXPECT_TRUE(gradcheck([](const auto &in) { return F::normalize(in[0]); }, {x}));
  EXPECT_EQ(F::one_hot(arange(3), 4).sum().item<int64_t>(), 3);
}

// --- conv2d
// ----------------------------------------------------------------------------------

std::vector<double> conv_ref(const Tensor &x, const Tensor &w, const Tensor &b, int sh, int sw,
                             int ph, int pw, int dh, int dw, int groups) {
  const int64_t n = x.size(0), c = x.size(1), h = x.size(2), wd = x.size(3);
  const int64_t o = w.size(0), cg = w.size(1), kh = w.size(2), kw = w.size(3);
  const int64_t oh = (h + 2 * ph - dh * (kh - 1) - 1) / sh + 1;
  const int64_t ow = (wd + 2 * pw - dw * (kw - 1) - 1) / sw + 1;
  const std::vector<double> xv = x.to_vector<double>(), wv = w.to_vector<double>();
  std::vector<double> out;
  for (int64_t ni = 0; ni < n; ++ni) {
    for (int64_t oc = 0; oc < o; ++oc) {
      const int64_t g = oc / (o / groups);
      for (int64_t y = 0; y < oh; ++y) {
        for (int64_t xq = 0; xq < ow; ++xq) {
          double s = b.defined() ? b.to_vector<double>()[oc] : 0.0;
          for (int64_t ic = 0; ic < cg; ++ic) {
            for (int64_t i = 0; i < kh; ++i) {
              for (int64_t j = 0; j < kw; ++j) {
                const int64_t r = y * sh - ph + i * dh, col = xq * sw - pw + j * dw;
                if (r < 0 || r >= h || col < 0 || col >= wd) continue;
                s += xv[((ni * c + g * cg + ic) * h + r) * wd + col] *
                     wv[((oc * cg + ic) * kh + i) * kw + j];
              }
            }
          }
          out.push_back(s);
        }
      }
    }
  }
  return out;
}

TEST(FunctionalConv2d, MatchesLoopsWithStridePaddingDilationGroups) {
  manual_seed(6);
  Tensor x = rand64({2, 4, 7, 6}, false), w = rand64({6, 2, 3, 2}, false), b = rand64({6}, false);
  Tensor y = F::conv2d(
      x, w,
      F::Conv2dFuncOptions().bias(b).stride({2, 1}).padding({1, 2}).dilation({1, 2}).groups(2));
  EXPECT_EQ(y.sizes(), IntArrayRef({2, 6, 4, 8}));
  expect_close(y, conv_ref(x, w, b, 2, 1, 1, 2, 1, 2, 2));
  Tensor w1 = rand64({3, 4, 3, 3}, false);
  expect_close(kiln::conv2d(x, w1), conv_ref(x, w1, {}, 1, 1, 0, 0, 1, 1, 1));
  // Unbatched input.
  Tensor y3 = F::conv2d(x[0], w1, F::Conv2dFuncOptions().padding(1));
  EXPECT_EQ(y3.sizes(), IntArrayRef({3, 7, 6}));
  expect_close(y3, conv_ref(x.slice(0, 0, 1), w1, {}, 1, 1, 1, 1, 1, 1, 1));
}

TEST(FunctionalConv2d, Gradcheck) {
  manual_seed(7);
  EXPECT_TRUE(gradcheck(
      [](const auto &in) {
        return F::conv2d(in[0], in[1],
                         F::Conv2dFuncOptions().bias(in[2]).stride(2).padding(1).groups(2));
      },
      {rand64({1, 4, 5, 4}), rand64({2, 2, 3, 3}), rand64({2})}));
}

TEST(FunctionalConv2d, Errors) {
  Tensor x = rand64({1, 4, 5, 5}, false);
  EXPECT_KILN_ERROR(F::conv2d(x, rand64({2, 3, 3, 3}, false)), "[conv2d] input of shape");
  EXPECT_KILN_ERROR(F::conv2d(x, rand64({3, 2, 3, 3}, false), F::Conv2dFuncOptions().groups(2)),
                    "[conv2d] out_channels 3 must be divisible by groups 2");
  EXPECT_KILN_ERROR(F::conv2d(x, rand64({2, 4, 6, 6}, false)), "[conv2d] kernel size");
  EXPECT_KILN_ERROR(F::conv2d(x, rand64({2, 4, 3}, false)), "[conv2d] expected a 4-D weight");
  EXPECT_KILN_ERROR(F::conv2d(x, rand64({2, 4, 3, 3}, false), F::Conv2dFuncOptions().stride(0)),
                    "[conv2d] stride must be positive");
  EXPECT_KILN_ERROR(F::conv2d(x.to(kFloat32), rand64({2, 4, 3, 3}, false)), "[conv2d] input");
}

// --- pooling
// ---------------------------------------------------------------------------------

struct PoolRef {
  std::vector<double> max, avg;
  std::vector<int64_t> argmax;
};

PoolRef pool_ref(const Tensor &x, int k, int s, int p, int d, bool ceil_mode,
                 bool count_include_pad) {
  const int64_t planes = x.size(0) * x.size(1), h = x.size(2), w = x.size(3);
  const auto out_size = [&](int64_t in) {
    const int64_t span = in + 2 * p - d * (k - 1) - 1;
    int64_t o = (span + (ceil_mode ? s - 1 : 0)) / s + 1;
    if (ceil_mode && (o - 1) * s >= in + p) --o;
    return o;
  };
  const int64_t oh = out_size(h), ow = out_size(w);
  const std::vector<double> xv = x.to_vector<double>();
  PoolRef r;
  for (int64_t pl = 0; pl < planes; ++pl) {
    for (int64_t y = 0; y < oh; ++y) {
      for (int64_t z = 0; z < ow; ++z) {
        double best = -std::numeric_limits<double>::infinity(), sum = 0;
        int64_t arg = -1, inside = 0, padded = 0;
        for (int i = 0; i < k; ++i) {
          for (int j = 0; j < k; ++j) {
            const int64_t row = y * s - p + i * d, col = z * s - p + j * d;
            if (row >= -p && row < h + p && col >= -p && col < w + p) ++padded;
            if (row < 0 || row >= h || col < 0 || col >= w) continue;
            const double v = xv[(pl * h + row) * w + col];
            ++inside;
            sum += v;
            if (v > best) best = v, arg = row * w + col;
          }
        }
        r.max.push_back(best);
        r.argmax.push_back(arg);
        r.avg.push_back(sum / static_cast<double>(count_include_pad ? padded : inside));
      }
    }
  }
  return r;
}

TEST(FunctionalPool, MaxPoolMatchesLoopsWithIndices) {
  manual_seed(8);
  Tensor x = rand64({2, 3, 7, 6}, false);
  for (bool ceil_mode : {false, true}) {
    auto opts = F::MaxPool2dFuncOptions(3).stride(2).padding(1).dilation(1).ceil_mode(ceil_mode);
    auto [v, idx] = F::max_pool2d_with_indices(x, opts);
    const PoolRef r = pool_ref(x, 3, 2, 1, 1, ceil_mode, true);
    expect_close(v, r.max);
    EXPECT_EQ(idx.to_vector<int64_t>(), r.argmax);
  }
  auto opts = F::MaxPool2dFuncOptions(2).stride(1).dilation(2);
  expect_close(F::max_pool2d(x, opts), pool_ref(x, 2, 1, 0, 2, false, true).max);
  EXPECT_EQ(kiln::max_pool2d(x, 2).sizes(), IntArrayRef({2, 3, 3, 3}));
  EXPECT_EQ(kiln::max_pool2d(x[0], 2).sizes(), IntArrayRef({3, 3, 3}));
}

TEST(FunctionalPool, MaxPoolGradientGoesToTheArgmax) {
  // Overlapping windows share maxima: the gradient counts how often each
  // element wins.
  Tensor x =
      from_blob(std::vector<double>{1, 5, 2, 0, 3, 4, 9, 6, 7}.data(), {1, 1, 3, 3}, kFloat64)
          .clone()
          .requires_grad_();
  F::max_pool2d(x, F::MaxPool2dFuncOptions(2).stride(1)).sum().backward();
  expect_close(x.grad(), {0, 2, 0, 0, 0, 0, 1, 0, 1});
  EXPECT_TRUE(gradcheck(
      [](const auto &in) {
        return F::max_pool2d(in[0], F::MaxPool2dFuncOptions(3).stride(2).padding(1));
      },
      {rand64({1, 2, 5, 5})}));
}

TEST(FunctionalPool, AvgPoolMatchesLoopsAndGradcheck) {
  manual_seed(9);
  Tensor x = rand64({2, 2, 7, 6}, false);
  for (bool ceil_mode : {false, true}) {
    for (bool include : {false, true}) {
      auto opts =
          F::AvgPool2dFuncOptions(3).stride(2).padding(1).ceil_mode(ceil_mode).count_include_pad(
              include);
      expect_close(F::avg_pool2d(x, opts), pool_ref(x, 3, 2, 1, 1, ceil_mode, include).avg);
    }
  }
  Tensor y = kiln::avg_pool2d(x, 2, std::nullopt, 0, false, true, 3);
  std::vector<double> ref = pool_ref(x, 2, 2, 0, 1, false, true).avg;
  for (double &v : ref) v = v * 4 / 3;
  expect_close(y, ref);
  EXPECT_TRUE(gradcheck(
      [](const auto &in) {
        return F::avg_pool2d(in[0], F::AvgPool2dFuncOptions(2).stride(1).padding(1));
      },
      {rand64({1, 1, 3, 4})}));
}

TEST(FunctionalPool, Errors) {
  Tensor x = rand64({1, 1, 4, 4}, false);
  EXPECT_KILN_ERROR(F::max_pool2d(x, F::MaxPool2dFuncOptions(2).padding(2)),
                    "[max_pool2d] padding should be at most half");
  EXPECT_KILN_ERROR(F::max_pool2d(x, F::MaxPool2dFuncOptions(5)), "[max_pool2d] input of shape");
  EXPECT_KILN_ERROR(kiln::max_pool2d(rand64({4, 4}, false), 2), "[max_pool2d] expected a 3-D");
  EXPECT_KILN_ERROR(F::avg_pool2d(x, F::AvgPool2dFuncOptions(2).divisor_override(0)),
                    "[avg_pool2d] divisor_override");
  EXPECT_KILN_ERROR(F::avg_pool2d(x, F::AvgPool2dFuncOptions(0)), "[avg_pool2d] kernel_size");
}

// --- batch_norm
// ------------------------------------------------------------------------------

TEST(FunctionalBatchNorm, TrainingUpdatesRunningStatsEvalUsesThem) {
  manual_seed(10);
  Tensor x = rand64({4, 3, 2, 2}, false), w = rand64({3}, false), b = rand64({3}, false);
  Tensor rm = zeros({3}, kFloat64), rv = ones({3}, kFloat64);
  Tensor y = F::batch_norm(
      x, rm, rv, F::BatchNormFuncOptions().weight(w).bias(b).training(true).momentum(0.2));
  const std::vector<double> xv = x.to_vector<double>(), wv = w.to_vector<double>(),
                            bv = b.to_vector<double>();
  std::vector<double> ref(xv.size()), mean(3, 0), var(3, 0);
  for (int c = 0; c < 3; ++c) {
    const auto at = [&](int n, int i) { return (n * 3 + c) * 4 + i; };
    for (int n = 0; n < 4; ++n) {
      for (int i = 0; i < 4; ++i) mean[c] += xv[at(n, i)] / 16;
    }
    for (int n = 0; n < 4; ++n) {
      for (int i = 0; i < 4; ++i) var[c] += std::pow(xv[at(n, i)] - mean[c], 2) / 16;
    }
    for (int n = 0; n < 4; ++n) {
      for (int i = 0; i < 4; ++i) {
        ref[at(n, i)] = (xv[at(n, i)] - mean[c]) / std::sqrt(var[c] + 1e-5) * wv[c] + bv[c];
      }
    }
  }
  expect_close(y, ref);
  std::vector<double> rm_ref, rv_ref;
  for (int c = 0; c < 3; ++c) {
    rm_ref.push_back(0.2 * mean[c]);
    rv_ref.push_back(0.8 + 0.2 * var[c] * 16 / 15);
  }
  expect_close(rm, rm_ref);
  expect_close(rv, rv_ref);
  // Eval: the running statistics, no update.
  Tensor e = kiln::batch_norm(x, {}, {}, rm, rv, false, 0.2, 1e-5);
  std::vector<double> eref(xv.size());
  for (size_t i = 0; i < xv.size(); ++i) {
    const size_t c = (i / 4) % 3;
    eref[i] = (xv[i] - rm_ref[c]) / std::sqrt(rv_ref[c] + 1e-5);
  }
  expect_close(e, eref);
  expect_close(rm, rm_ref);
}

TEST(FunctionalBatchNorm, GradcheckAndErrors) {
  manual_seed(11);
  EXPECT_TRUE(gradcheck(
      [](const auto &in) {
        return F::batch_norm(in[0], {}, {},
                             F::BatchNormFuncOptions().weight(in[1]).bias(in[2]).training(true));
      },
      {rand64({3, 2, 2}), rand64({2}), rand64({2})}));
  EXPECT_KILN_ERROR(
      F::batch_norm(rand64({1, 3}, false), {}, {}, F::BatchNormFuncOptions().training(true)),
      "[batch_norm] expected more than 1 value per channel");
  EXPECT_KILN_ERROR(F::batch_norm(rand64({2, 3}, false), {}, {}), "[batch_norm] running_mean");
  EXPECT_KILN_ERROR(F::batch_norm(rand64({2, 3}, false), zeros({2}, kFloat64), ones({2}, kFloat64)),
                    "[batch_norm] expected running_mean of shape [3]");
}

}  // namespace
}  // namespace kiln
