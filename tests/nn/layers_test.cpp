// The layers of nn/modules: each forward against a plain f64 reference computed here, the
// parameter counts and the default initialisation of each, the containers, printing, and a
// port of the libtorch MNIST example's network trained for a few steps.
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <cmath>
#include <numbers>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace kiln {
namespace {

namespace F = nn::functional;

// A f64 tensor of `sizes` holding `values` (row-major).
Tensor make(std::vector<double> values, IntArrayRef sizes) {
  return from_blob(values.data(), sizes, kDouble).clone();
}

std::string printed(const nn::Module& m) {
  std::ostringstream os;
  m.pretty_print(os);
  return os.str();
}

int64_t count_parameters(const nn::Module& m) {
  int64_t n = 0;
  for (const Tensor& p : m.parameters()) n += p.numel();
  return n;
}

// Every element within [-bound, bound], and the sample std close to a uniform's bound/sqrt(3).
void expect_uniform(const Tensor& t, double bound, const std::string& what) {
  const auto v = t.to_vector<double>();
  double sum = 0, sq = 0;
  for (double x : v) {
    ASSERT_LE(std::abs(x), bound) << what;
    sum += x;
    sq += x * x;
  }
  const double n = static_cast<double>(v.size());
  const double std = std::sqrt(sq / n - (sum / n) * (sum / n));
  EXPECT_NEAR(std, bound / std::sqrt(3.0), 0.05 * bound) << what;
  EXPECT_NEAR(sum / n, 0.0, 0.05 * bound) << what;
}

// --- Linear, Identity, Flatten --------------------------------------------------------------

TEST(LayersTest, LinearForwardMatchesReference) {
  manual_seed(1);
  nn::Linear fc(4, 3);
  fc->to(kDouble);
  Tensor x = randn({2, 5, 4}, kDouble);
  Tensor y = fc(x);
  ASSERT_EQ(y.sizes(), (Shape{2, 5, 3}));
  const auto xv = x.to_vector<double>(), wv = fc->weight.to_vector<double>(),
             bv = fc->bias.to_vector<double>();
  std::vector<double> ref(2 * 5 * 3);
  for (int r = 0; r < 10; ++r) {
    for (int o = 0; o < 3; ++o) {
      double acc = bv[o];
      for (int i = 0; i < 4; ++i) acc += xv[r * 4 + i] * wv[o * 4 + i];
      ref[r * 3 + o] = acc;
    }
  }
  EXPECT_TRUE(allclose(y, make(ref, {2, 5, 3}), 1e-12, 1e-12));
  // The gradient of sum(y): dW = sum of the inputs over rows, db = row count.
  y.sum().backward();
  EXPECT_TRUE(allclose(fc->weight.grad(), x.reshape({10, 4}).sum({0}).expand({3, 4}), 1e-12));
  EXPECT_TRUE(allclose(fc->bias.grad(), full({3}, 10.0, kDouble)));
}

TEST(LayersTest, LinearParametersInitAndPrinting) {
  manual_seed(2);
  nn::Linear fc(300, 200);
  EXPECT_EQ(count_parameters(*fc), 300 * 200 + 200);
  EXPECT_EQ(fc->weight.sizes(), (Shape{200, 300}));
  EXPECT_EQ(fc->weight.dtype(), kFloat);
  // kaiming_uniform_(a = sqrt(5)) gives U(-1/sqrt(in), 1/sqrt(in)); so does the bias.
  const double bound = 1.0 / std::sqrt(300.0);
  expect_uniform(fc->weight, bound, "weight");
  for (double b : fc->bias.to_vector<double>()) EXPECT_LE(std::abs(b), bound);
  EXPECT_EQ(printed(*fc), "kiln::nn::Linear(in_features=300, out_features=200, bias=true)");

  nn::Linear nobias(nn::LinearOptions(3, 2).bias(false));
  EXPECT_EQ(count_parameters(*nobias), 6);
  EXPECT_FALSE(nobias->bias.defined());
  EXPECT_EQ(printed(*nobias), "kiln::nn::Linear(in_features=3, out_features=2, bias=false)");
  Tensor x = randn({4, 3});
  EXPECT_TRUE(allclose(nobias(x), x.matmul(nobias->weight.t())));
  // reset_parameters draws again.
  const Tensor before = fc->weight.clone();
  fc->reset_parameters();
  EXPECT_FALSE(equal(before, fc->weight));
  EXPECT_KILN_ERROR(nn::Linear(-1, 2), "[Linear]");
}

TEST(LayersTest, IdentityAndFlatten) {
  Tensor x = randn({2, 3, 4, 5});
  nn::Identity id;
  EXPECT_TRUE(id(x).is_same(x));
  EXPECT_EQ(printed(*id), "kiln::nn::Identity()");
  nn::Flatten flat;
  EXPECT_EQ(flat(x).sizes(), (Shape{2, 60}));
  nn::Flatten mid(nn::FlattenOptions().start_dim(1).end_dim(2));
  EXPECT_EQ(mid(x).sizes(), (Shape{2, 12, 5}));
  EXPECT_TRUE(equal(mid(x), x.reshape({2, 12, 5})));
  EXPECT_EQ(printed(*mid), "kiln::nn::Flatten(start_dim=1, end_dim=2)");
  EXPECT_EQ(count_parameters(*flat), 0);
}

// --- Embedding ----------------------------------------------------------------------------

TEST(LayersTest, EmbeddingLooksUpRowsAndInitialisesNormal) {
  manual_seed(3);
  nn::Embedding emb(nn::EmbeddingOptions(1000, 64).padding_idx(-1));
  EXPECT_EQ(*emb->options.padding_idx(), 999);  // normalised
  EXPECT_EQ(count_parameters(*emb), 64000);
  // N(0, 1) apart from the padding row, which starts at zero.
  const auto w = emb->weight.to_vector<double>();
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < 999 * 64; ++i) sum += w[i], sq += w[i] * w[i];
  const double n = 999 * 64;
  EXPECT_NEAR(sum / n, 0.0, 0.02);
  EXPECT_NEAR(std::sqrt(sq / n), 1.0, 0.02);
  EXPECT_TRUE(equal(emb->weight[999], zeros({64})));

  Tensor idx = from_blob(std::vector<int64_t>{3, 999, 3, 0, 7, 1}.data(), {2, 3}, kInt64).clone();
  Tensor y = emb(idx);
  ASSERT_EQ(y.sizes(), (Shape{2, 3, 64}));
  const std::vector<int64_t> rows = {3, 999, 3, 0, 7, 1};
  for (int k = 0; k < 6; ++k) {
    EXPECT_TRUE(equal(y.reshape({6, 64})[k], emb->weight[rows[k]])) << k;
  }
  // The padding row gets no gradient.
  y.sum().backward();
  EXPECT_TRUE(equal(emb->weight.grad()[999], zeros({64})));
  EXPECT_TRUE(equal(emb->weight.grad()[3], full({64}, 2.0f)));
  EXPECT_EQ(printed(*emb),
            "kiln::nn::Embedding(num_embeddings=1000, embedding_dim=64, "
            "padding_idx=999)");
  EXPECT_KILN_ERROR(nn::Embedding(nn::EmbeddingOptions(4, 2).padding_idx(4)), "[Embedding]");
  // Starting from given weights.
  Tensor w0 = arange(6, kFloat).reshape({3, 2});
  nn::Embedding pre(nn::EmbeddingOptions(3, 2)._weight(w0));
  EXPECT_TRUE(equal(pre->weight, w0));
  EXPECT_TRUE(pre->weight.requires_grad());
  EXPECT_KILN_ERROR(nn::Embedding(nn::EmbeddingOptions(4, 2)._weight(w0)), "_weight");
}

// --- Normalisation ------------------------------------------------------------------------

TEST(LayersTest, LayerNormMatchesReference) {
  manual_seed(4);
  nn::LayerNorm ln(nn::LayerNormOptions({2, 3}).eps(1e-3));
  EXPECT_EQ(count_parameters(*ln), 12);
  EXPECT_TRUE(equal(ln->weight, ones({2, 3})));
  EXPECT_TRUE(equal(ln->bias, zeros({2, 3})));
  ln->to(kDouble);
  {
    NoGradGuard g;
    ln->weight.normal_();
    ln->bias.normal_();
  }
  Tensor x = randn({4, 2, 3}, kDouble) * 3 + 1;
  const auto xv = x.to_vector<double>(), wv = ln->weight.to_vector<double>(),
             bv = ln->bias.to_vector<double>();
  std::vector<double> ref(24);
  for (int r = 0; r < 4; ++r) {
    double mean = 0, var = 0;
    for (int i = 0; i < 6; ++i) mean += xv[r * 6 + i] / 6;
    for (int i = 0; i < 6; ++i) var += (xv[r * 6 + i] - mean) * (xv[r * 6 + i] - mean) / 6;
    for (int i = 0; i < 6; ++i) {
      ref[r * 6 + i] = (xv[r * 6 + i] - mean) / std::sqrt(var + 1e-3) * wv[i] + bv[i];
    }
  }
  EXPECT_TRUE(allclose(ln(x), make(ref, {4, 2, 3}), 1e-10, 1e-10));
  EXPECT_EQ(printed(*ln), "kiln::nn::LayerNorm([2, 3], eps=0.001, elementwise_affine=true)");

  nn::LayerNorm plain(nn::LayerNormOptions({3}).elementwise_affine(false));
  EXPECT_EQ(count_parameters(*plain), 0);
  nn::LayerNorm nobias(nn::LayerNormOptions({3}).bias(false));
  EXPECT_EQ(count_parameters(*nobias), 3);
  EXPECT_EQ(printed(*nobias),
            "kiln::nn::LayerNorm([3], eps=1e-05, elementwise_affine=true, bias=false)");
}

TEST(LayersTest, RMSNormMatchesReference) {
  manual_seed(5);
  nn::RMSNorm norm(nn::RMSNormOptions({5}).eps(1e-6));
  EXPECT_EQ(count_parameters(*norm), 5);
  EXPECT_TRUE(equal(norm->weight, ones({5})));
  norm->to(kDouble);
  {
    NoGradGuard g;
    norm->weight.uniform_(0.5, 1.5);
  }
  Tensor x = randn({3, 5}, kDouble);
  const auto xv = x.to_vector<double>(), wv = norm->weight.to_vector<double>();
  std::vector<double> ref(15);
  for (int r = 0; r < 3; ++r) {
    double ms = 0;
    for (int i = 0; i < 5; ++i) ms += xv[r * 5 + i] * xv[r * 5 + i] / 5;
    for (int i = 0; i < 5; ++i) ref[r * 5 + i] = xv[r * 5 + i] / std::sqrt(ms + 1e-6) * wv[i];
  }
  EXPECT_TRUE(allclose(norm(x), make(ref, {3, 5}), 1e-10, 1e-10));
  EXPECT_EQ(printed(*norm), "kiln::nn::RMSNorm([5], eps=1e-06, elementwise_affine=true)");
  nn::RMSNorm plain(nn::RMSNormOptions({5}).elementwise_affine(false));
  EXPECT_EQ(count_parameters(*plain), 0);
  EXPECT_EQ(printed(*plain), "kiln::nn::RMSNorm([5], eps=None, elementwise_affine=false)");
}

TEST(LayersTest, BatchNorm2dTrainsAndEvaluates) {
  manual_seed(6);
  nn::BatchNorm2d bn(nn::BatchNorm2dOptions(3).momentum(0.2).eps(1e-4));
  EXPECT_EQ(count_parameters(*bn), 6);
  EXPECT_EQ(bn->named_buffers().keys(),
            (std::vector<std::string>{"running_mean", "running_var", "num_batches_tracked"}));
  bn->to(kDouble);
  EXPECT_EQ(bn->num_batches_tracked.dtype(), kInt64);
  {
    NoGradGuard g;
    bn->weight.uniform_(0.5, 1.5);
    bn->bias.normal_();
  }
  Tensor x = randn({4, 3, 2, 5}, kDouble) * 2 + 0.5;
  const auto xv = x.to_vector<double>(), wv = bn->weight.to_vector<double>(),
             bv = bn->bias.to_vector<double>();
  // Per-channel batch statistics over N, H, W (40 values each).
  std::vector<double> mean(3, 0), var(3, 0), ref(xv.size());
  auto at = [](int n, int c, int s) { return (n * 3 + c) * 10 + s; };
  for (int c = 0; c < 3; ++c) {
    for (int n = 0; n < 4; ++n)
      for (int s = 0; s < 10; ++s) mean[c] += xv[at(n, c, s)] / 40;
    for (int n = 0; n < 4; ++n)
      for (int s = 0; s < 10; ++s) var[c] += std::pow(xv[at(n, c, s)] - mean[c], 2) / 40;
    for (int n = 0; n < 4; ++n)
      for (int s = 0; s < 10; ++s)
        ref[at(n, c, s)] = (xv[at(n, c, s)] - mean[c]) / std::sqrt(var[c] + 1e-4) * wv[c] + bv[c];
  }
  EXPECT_TRUE(allclose(bn(x), make(ref, {4, 3, 2, 5}), 1e-10, 1e-10));
  // Running statistics: 0.8 * old + 0.2 * batch (unbiased variance).
  std::vector<double> rm(3), rv(3);
  for (int c = 0; c < 3; ++c) {
    rm[c] = 0.2 * mean[c];
    rv[c] = 0.8 + 0.2 * var[c] * 40 / 39;
  }
  EXPECT_TRUE(allclose(bn->running_mean, make(rm, {3}), 1e-10, 1e-12));
  EXPECT_TRUE(allclose(bn->running_var, make(rv, {3}), 1e-10, 1e-12));
  EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), 1);
  // Eval: the running statistics, nothing updated.
  bn->eval();
  Tensor y = bn(x);
  std::vector<double> eref(xv.size());
  for (int n = 0; n < 4; ++n)
    for (int c = 0; c < 3; ++c)
      for (int s = 0; s < 10; ++s)
        eref[at(n, c, s)] = (xv[at(n, c, s)] - rm[c]) / std::sqrt(rv[c] + 1e-4) * wv[c] + bv[c];
  EXPECT_TRUE(allclose(y, make(eref, {4, 3, 2, 5}), 1e-10, 1e-10));
  EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), 1);
  EXPECT_EQ(printed(*bn),
            "kiln::nn::BatchNorm2d(3, eps=0.0001, momentum=0.2, affine=true, "
            "track_running_stats=true)");
  EXPECT_KILN_ERROR(bn(randn({4, 3, 5}, kDouble)), "[BatchNorm2d] expected a 4-D input");
  EXPECT_KILN_ERROR(bn(randn({4, 2, 2, 2}, kDouble)), "[BatchNorm2d] expected 3 channels");
}

TEST(LayersTest, BatchNorm2dCumulativeAverageAndNoRunningStats) {
  manual_seed(7);
  nn::BatchNorm2d bn(nn::BatchNorm2dOptions(2).momentum(std::nullopt));
  bn->to(kDouble);
  Tensor a = randn({3, 2, 2, 2}, kDouble), b = randn({3, 2, 2, 2}, kDouble) + 1;
  bn(a);
  bn(b);
  // momentum None: the plain average of the batch means.
  Tensor expected = (a.mean({0, 2, 3}) + b.mean({0, 2, 3})) / 2;
  EXPECT_TRUE(allclose(bn->running_mean, expected, 1e-10, 1e-12));
  EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), 2);
  bn->reset_running_stats();
  EXPECT_TRUE(equal(bn->running_mean, zeros({2}, kDouble)));
  EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), 0);

  nn::BatchNorm2d stateless(nn::BatchNorm2dOptions(2).affine(false).track_running_stats(false));
  EXPECT_EQ(count_parameters(*stateless), 0);
  EXPECT_TRUE(stateless->named_buffers().is_empty());
  EXPECT_TRUE(stateless->state_dict().empty());
  stateless->eval();  // still normalises with the batch statistics
  Tensor x = randn({4, 2, 3, 3});
  Tensor y = stateless(x);
  EXPECT_TRUE(allclose(y.mean({0, 2, 3}), zeros({2}), 1e-5, 1e-5));
}

// --- Dropout --------------------------------------------------------------------------------

TEST(LayersTest, DropoutTrainAndEval) {
  manual_seed(8);
  nn::Dropout drop(0.3);
  Tensor x = ones({200, 200});
  Tensor y = drop(x);
  const auto v = y.to_vector<double>();
  int64_t zeros_count = 0;
  for (double e : v) {
    if (e == 0) {
      ++zeros_count;
    } else {
      EXPECT_NEAR(e, 1 / 0.7, 1e-6);
    }
  }
  EXPECT_NEAR(static_cast<double>(zeros_count) / v.size(), 0.3, 0.01);
  drop->eval();
  EXPECT_TRUE(equal(drop(x), x));
  EXPECT_EQ(printed(*drop), "kiln::nn::Dropout(p=0.3, inplace=false)");
  EXPECT_KILN_ERROR(nn::Dropout(1.5), "[Dropout] dropout probability has to be between 0 and 1");

  nn::Dropout2d drop2d(nn::Dropout2dOptions(0.5));
  Tensor img = ones({8, 16, 4, 4});
  Tensor out = drop2d(img);
  // Whole channels: each [4, 4] plane is all zeros or all 2.
  const Tensor planes = out.reshape({128, 16});
  const Tensor mins = planes.amin({1}), maxs = planes.amax({1});
  EXPECT_TRUE(equal(mins, maxs));
  const double kept = (maxs > 0).to(kDouble).mean().item<double>();
  EXPECT_GT(kept, 0.3);
  EXPECT_LT(kept, 0.7);
  EXPECT_TRUE(((maxs == 0) | (maxs == 2)).all().item<bool>());
  drop2d->eval();
  EXPECT_TRUE(equal(drop2d(img), img));
  EXPECT_KILN_ERROR(drop2d(ones({4, 4})), "[Dropout2d]");
}

// --- Activations ------------------------------------------------------------------------------

TEST(LayersTest, ActivationsMatchReference) {
  manual_seed(9);
  Tensor x = randn({3, 7}, kDouble) * 3;
  const auto xv = x.to_vector<double>();
  auto check = [&](const Tensor& y, auto fn, const char* what) {
    const auto yv = y.to_vector<double>();
    ASSERT_EQ(yv.size(), xv.size());
    for (size_t i = 0; i < xv.size(); ++i) EXPECT_NEAR(yv[i], fn(xv[i]), 1e-12) << what << i;
  };
  check(
      nn::ReLU()(x), [](double v) { return v > 0 ? v : 0; }, "relu");
  check(
      nn::GELU()(x), [](double v) { return 0.5 * v * (1 + std::erf(v / std::sqrt(2.0))); }, "gelu");
  check(
      nn::GELU(nn::GELUOptions().approximate("tanh"))(x),
      [](double v) {
        const double k = std::sqrt(2 / std::numbers::pi);
        return 0.5 * v * (1 + std::tanh(k * (v + 0.044715 * v * v * v)));
      },
      "gelu_tanh");
  check(
      nn::SiLU()(x), [](double v) { return v / (1 + std::exp(-v)); }, "silu");
  check(
      nn::Tanh()(x), [](double v) { return std::tanh(v); }, "tanh");
  check(
      nn::Sigmoid()(x), [](double v) { return 1 / (1 + std::exp(-v)); }, "sigmoid");

  std::vector<double> sm(21), lsm(21);
  for (int r = 0; r < 3; ++r) {
    double mx = -1e300, z = 0;
    for (int i = 0; i < 7; ++i) mx = std::max(mx, xv[r * 7 + i]);
    for (int i = 0; i < 7; ++i) z += std::exp(xv[r * 7 + i] - mx);
    for (int i = 0; i < 7; ++i) {
      sm[r * 7 + i] = std::exp(xv[r * 7 + i] - mx) / z;
      lsm[r * 7 + i] = xv[r * 7 + i] - mx - std::log(z);
    }
  }
  EXPECT_TRUE(allclose(nn::Softmax(1)(x), make(sm, {3, 7}), 1e-12, 1e-12));
  EXPECT_TRUE(allclose(nn::Softmax(-1)(x), make(sm, {3, 7}), 1e-12, 1e-12));
  EXPECT_TRUE(allclose(nn::LogSoftmax(1)(x), make(lsm, {3, 7}), 1e-12, 1e-12));
  EXPECT_TRUE(allclose(nn::Softmax(0)(x).sum({0}), ones({7}, kDouble)));

  // In place: ReLU(inplace) writes into its input.
  Tensor z = x.clone();
  nn::ReLU(nn::ReLUOptions(true))(z);
  EXPECT_TRUE(equal(z, x.relu()));

  EXPECT_EQ(printed(*nn::ReLU()), "kiln::nn::ReLU()");
  EXPECT_EQ(printed(*nn::ReLU(true)), "kiln::nn::ReLU(inplace=true)");
  EXPECT_EQ(printed(*nn::GELU()), "kiln::nn::GELU()");
  EXPECT_EQ(printed(*nn::GELU(nn::GELUOptions().approximate("tanh"))),
            "kiln::nn::GELU(approximate='tanh')");
  EXPECT_EQ(printed(*nn::SiLU()), "kiln::nn::SiLU()");
  EXPECT_EQ(printed(*nn::Tanh()), "kiln::nn::Tanh()");
  EXPECT_EQ(printed(*nn::Sigmoid()), "kiln::nn::Sigmoid()");
  EXPECT_EQ(printed(*nn::Softmax(1)), "kiln::nn::Softmax(dim=1)");
  EXPECT_EQ(printed(*nn::LogSoftmax(1)), "kiln::nn::LogSoftmax(dim=1)");
  EXPECT_KILN_ERROR(nn::GELU(nn::GELUOptions().approximate("fast")), "[GELU]");
}

// --- Convolution and pooling -------------------------------------------------------------------

// Direct convolution in f64: input [N, C, H, W], weight [O, C / g, kh, kw].
std::vector<double> conv_ref(const Tensor& x, const Tensor& w, const Tensor& b, int stride, int pad,
                             int dil, int groups, Shape* out_shape) {
  const int64_t n = x.size(0), c = x.size(1), h = x.size(2), wd = x.size(3);
  const int64_t o = w.size(0), cg = w.size(1), kh = w.size(2), kw = w.size(3);
  const int64_t oh = (h + 2 * pad - dil * (kh - 1) - 1) / stride + 1;
  const int64_t ow = (wd + 2 * pad - dil * (kw - 1) - 1) / stride + 1;
  *out_shape = {n, o, oh, ow};
  const auto xv = x.to_vector<double>(), wv = w.to_vector<double>();
  const auto bv = b.defined() ? b.to_vector<double>() : std::vector<double>(o, 0.0);
  std::vector<double> out(n * o * oh * ow);
  const int64_t og = o / groups;
  for (int64_t in = 0; in < n; ++in)
    for (int64_t oc = 0; oc < o; ++oc)
      for (int64_t y = 0; y < oh; ++y)
        for (int64_t xx = 0; xx < ow; ++xx) {
          double acc = bv[oc];
          const int64_t g = oc / og;
          for (int64_t ic = 0; ic < cg; ++ic)
            for (int64_t i = 0; i < kh; ++i)
              for (int64_t j = 0; j < kw; ++j) {
                const int64_t iy = y * stride - pad + i * dil, ix = xx * stride - pad + j * dil;
                if (iy < 0 || iy >= h || ix < 0 || ix >= wd) continue;
                acc += xv[((in * c + g * cg + ic) * h + iy) * wd + ix] *
                       wv[((oc * cg + ic) * kh + i) * kw + j];
              }
          out[((in * o + oc) * oh + y) * ow + xx] = acc;
        }
  return out;
}

TEST(LayersTest, Conv2dMatchesReference) {
  manual_seed(10);
  struct Case {
    int in, out, k, stride, pad, dil, groups;
    bool bias;
  };
  for (const Case& cs : {Case{3, 4, 3, 1, 0, 1, 1, true}, Case{2, 6, 3, 2, 1, 1, 1, false},
                         Case{4, 4, 2, 1, 2, 2, 2, true}}) {
    nn::Conv2d conv(nn::Conv2dOptions(cs.in, cs.out, cs.k)
                        .stride(cs.stride)
                        .padding(cs.pad)
                        .dilation(cs.dil)
                        .groups(cs.groups)
                        .bias(cs.bias));
    EXPECT_EQ(count_parameters(*conv),
              cs.out * cs.in / cs.groups * cs.k * cs.k + (cs.bias ? cs.out : 0));
    conv->to(kDouble);
    Tensor x = randn({2, cs.in, 7, 6}, kDouble);
    Shape shape;
    const auto ref =
        conv_ref(x, conv->weight, conv->bias, cs.stride, cs.pad, cs.dil, cs.groups, &shape);
    Tensor y = conv(x);
    ASSERT_EQ(y.sizes(), shape);
    EXPECT_TRUE(allclose(y, make(ref, shape), 1e-10, 1e-10)) << cs.in << " " << cs.out;
  }
  nn::Conv2d c(nn::Conv2dOptions(2, 3, {3, 2}));
  EXPECT_EQ(c->weight.sizes(), (Shape{3, 2, 3, 2}));
  EXPECT_KILN_ERROR(nn::Conv2d(nn::Conv2dOptions(3, 4, 3).groups(2)), "divisible by groups");
}

TEST(LayersTest, Conv2dInitAndPrinting) {
  manual_seed(11);
  nn::Conv2d conv(nn::Conv2dOptions(16, 64, 5));
  // fan_in = 16 * 5 * 5: weight and bias U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
  const double bound = 1 / std::sqrt(400.0);
  expect_uniform(conv->weight, bound, "conv weight");
  for (double b : conv->bias.to_vector<double>()) EXPECT_LE(std::abs(b), bound);
  EXPECT_EQ(printed(*conv), "kiln::nn::Conv2d(16, 64, kernel_size=[5, 5], stride=[1, 1])");
  nn::Conv2d other(
      nn::Conv2dOptions(4, 8, {3, 1}).stride(2).padding({1, 0}).dilation(2).groups(4).bias(false));
  EXPECT_EQ(printed(*other),
            "kiln::nn::Conv2d(4, 8, kernel_size=[3, 1], stride=[2, 2], padding=[1, 0], "
            "dilation=[2, 2], groups=4, bias=false)");
}

TEST(LayersTest, PoolingMatchesReference) {
  manual_seed(12);
  Tensor x = randn({2, 3, 6, 5}, kDouble);
  const auto xv = x.to_vector<double>();
  // 2x2 windows, stride 2: output [2, 3, 3, 2].
  std::vector<double> mx(36), av(36);
  for (int p = 0; p < 6; ++p)
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 2; ++j) {
        double m = -1e300, s = 0;
        for (int a = 0; a < 2; ++a)
          for (int b = 0; b < 2; ++b) {
            const double v = xv[(p * 6 + 2 * i + a) * 5 + 2 * j + b];
            m = std::max(m, v);
            s += v;
          }
        mx[(p * 3 + i) * 2 + j] = m;
        av[(p * 3 + i) * 2 + j] = s / 4;
      }
  nn::MaxPool2d pool(nn::MaxPool2dOptions(2));
  EXPECT_TRUE(allclose(pool(x), make(mx, {2, 3, 3, 2}), 0, 0));
  nn::MaxPool2d pool2(2);
  EXPECT_TRUE(equal(pool2(x), pool(x)));
  nn::AvgPool2d avg(nn::AvgPool2dOptions(2));
  EXPECT_TRUE(allclose(avg(x), make(av, {2, 3, 3, 2}), 1e-12, 1e-12));
  auto [values, indices] = pool->forward_with_indices(x);
  EXPECT_TRUE(equal(values, pool(x)));
  EXPECT_EQ(indices.dtype(), kInt64);
  // Stride 1 and padding: 3x3 windows keep the size.
  nn::MaxPool2d same(nn::MaxPool2dOptions(3).stride(1).padding(1));
  EXPECT_EQ(same(x).sizes(), x.sizes());
  EXPECT_EQ(printed(*pool),
            "kiln::nn::MaxPool2d(kernel_size=[2, 2], stride=[2, 2], "
            "padding=[0, 0], dilation=[1, 1], ceil_mode=false)");
  EXPECT_EQ(printed(*avg),
            "kiln::nn::AvgPool2d(kernel_size=[2, 2], stride=[2, 2], "
            "padding=[0, 0])");
  EXPECT_EQ(count_parameters(*pool), 0);
}

// --- Losses ---------------------------------------------------------------------------------

TEST(LayersTest, LossModulesMatchReference) {
  manual_seed(13);
  Tensor a = randn({4, 3}, kDouble), b = randn({4, 3}, kDouble);
  const auto av = a.to_vector<double>(), bv = b.to_vector<double>();
  double mse = 0, l1 = 0, sl1 = 0;
  for (size_t i = 0; i < av.size(); ++i) {
    const double d = av[i] - bv[i];
    mse += d * d / 12;
    l1 += std::abs(d) / 12;
    sl1 += (std::abs(d) < 0.5 ? 0.5 * d * d / 0.5 : std::abs(d) - 0.25) / 12;
  }
  EXPECT_NEAR(nn::MSELoss()(a, b).item<double>(), mse, 1e-12);
  EXPECT_NEAR(nn::MSELoss(nn::MSELossOptions().reduction(kSum))(a, b).item<double>(), mse * 12,
              1e-10);
  EXPECT_NEAR(nn::L1Loss()(a, b).item<double>(), l1, 1e-12);
  EXPECT_NEAR(nn::SmoothL1Loss(nn::SmoothL1LossOptions().beta(0.5))(a, b).item<double>(), sl1,
              1e-12);
  EXPECT_EQ(nn::MSELoss(nn::MSELossOptions().reduction(kNone))(a, b).sizes(), (Shape{4, 3}));

  // Cross entropy with class weights and an ignored target.
  const std::vector<int64_t> tv = {2, 0, 1, 2};
  Tensor target = from_blob(const_cast<int64_t*>(tv.data()), {4}, kInt64).clone();
  Tensor w = make({0.5, 1.0, 2.0}, {3});
  double num = 0, den = 0, nll_num = 0, nll_den = 0;
  for (int r = 0; r < 4; ++r) {
    double mx = -1e300, z = 0;
    for (int c = 0; c < 3; ++c) mx = std::max(mx, av[r * 3 + c]);
    for (int c = 0; c < 3; ++c) z += std::exp(av[r * 3 + c] - mx);
    const double logp = av[r * 3 + tv[r]] - mx - std::log(z);
    const double wt = std::vector<double>{0.5, 1.0, 2.0}[tv[r]];
    if (r != 1) num += -logp * wt, den += wt;  // row 1's target (0) is ignored below
    nll_num += -av[r * 3 + tv[r]] * wt, nll_den += wt;
  }
  nn::CrossEntropyLoss ce(nn::CrossEntropyLossOptions().weight(w).ignore_index(0));
  EXPECT_NEAR(ce(a, target).item<double>(), num / den, 1e-12);
  EXPECT_EQ(ce->named_buffers().keys(), std::vector<std::string>{"weight"});
  nn::NLLLoss nll(nn::NLLLossOptions().weight(w));
  EXPECT_NEAR(nll(a, target).item<double>(), nll_num / nll_den, 1e-12);
  EXPECT_TRUE(nn::CrossEntropyLoss()->named_buffers().is_empty());

  // Binary cross entropy on probabilities and on logits.
  Tensor p = a.sigmoid(), y = (b > 0).to(kDouble);
  const auto pv = p.to_vector<double>(), yv = y.to_vector<double>();
  double bce = 0, kl = 0;
  for (size_t i = 0; i < pv.size(); ++i) {
    bce += -(yv[i] * std::log(pv[i]) + (1 - yv[i]) * std::log(1 - pv[i])) / 12;
  }
  EXPECT_NEAR(nn::BCELoss()(p, y).item<double>(), bce, 1e-12);
  EXPECT_NEAR(nn::BCEWithLogitsLoss()(a, y).item<double>(), bce, 1e-12);
  nn::BCEWithLogitsLoss weighted(
      nn::BCEWithLogitsLossOptions().pos_weight(full({3}, 2.0, kDouble)));
  EXPECT_EQ(weighted->named_buffers().keys(), std::vector<std::string>{"pos_weight"});
  // KL divergence, batchmean: sum(t * (log t - input)) / N.
  Tensor logq = a.log_softmax(1), t = b.softmax(1);
  const auto lq = logq.to_vector<double>(), tt = t.to_vector<double>();
  for (size_t i = 0; i < lq.size(); ++i) kl += tt[i] * (std::log(tt[i]) - lq[i]) / 4;
  EXPECT_NEAR(nn::KLDivLoss(nn::KLDivLossOptions().reduction(kBatchMean))(logq, t).item<double>(),
              kl, 1e-12);
  EXPECT_EQ(printed(*nn::MSELoss()), "kiln::nn::MSELoss()");
  EXPECT_EQ(printed(*ce), "kiln::nn::CrossEntropyLoss()");
  EXPECT_KILN_ERROR(nn::CrossEntropyLoss(nn::CrossEntropyLossOptions().label_smoothing(2)),
                    "[CrossEntropyLoss]");
  // Loss weights move with the module.
  ce->to(kFloat);
  EXPECT_EQ(ce->options.weight().dtype(), kFloat);
  EXPECT_NEAR(ce(a.to(kFloat), target).item<double>(), num / den, 1e-5);
}

// --- Containers -------------------------------------------------------------------------------

TEST(LayersTest, SequentialChainsAndIndexes) {
  manual_seed(14);
  nn::Sequential seq(nn::Linear(4, 8), nn::Functional(kiln::relu), nn::Linear(8, 2));
  EXPECT_EQ(seq->size(), 3u);
  Tensor x = randn({5, 4});
  Tensor ref = seq->at<nn::LinearImpl>(2).forward(seq->at<nn::LinearImpl>(0).forward(x).relu());
  EXPECT_TRUE(allclose(seq(x), ref));
  EXPECT_EQ(seq->named_parameters().keys(),
            (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"}));
  EXPECT_NE(seq[0]->as<nn::LinearImpl>(), nullptr);
  EXPECT_EQ(seq->ptr(1)->as<nn::LinearImpl>(), nullptr);
  EXPECT_EQ(seq->ptr<nn::LinearImpl>(2)->options.out_features(), 2);
  EXPECT_KILN_ERROR(seq->at<nn::LinearImpl>(1), "[Sequential] module '1' is a");
  EXPECT_KILN_ERROR(seq[3], "[Sequential] index 3 is out of range");
  // Plain callables and functions with bound arguments become Functional.
  seq->push_back([](Tensor t) { return t * 2; });
  seq->push_back("act", nn::Functional(kiln::gelu, "tanh"));
  seq->push_back(nn::Softmax(1));
  EXPECT_EQ(seq->size(), 6u);
  EXPECT_TRUE(allclose(seq(x), (ref * 2).gelu("tanh").softmax(1)));
  EXPECT_TRUE(seq->named_children().contains("act"));
  int visited = 0;
  for (const nn::AnyModule& m : *seq) visited += m.ptr() != nullptr;
  EXPECT_EQ(visited, 6);
  // Named construction, extension, nesting.
  nn::Sequential named({{"fc", nn::Linear(2, 3)}, {"act", nn::ReLU()}});
  EXPECT_EQ(named->named_children().keys(), (std::vector<std::string>{"fc", "act"}));
  nn::Sequential outer(seq, named);
  EXPECT_EQ(outer(x).sizes(), (Shape{5, 3}));
  named->extend(*named);  // the same modules twice
  EXPECT_EQ(named->size(), 4u);
  EXPECT_EQ(named->parameters().size(), 2u);
  EXPECT_KILN_ERROR(nn::Sequential()(x), "[Sequential] cannot call forward() on an empty");
  std::ostringstream os;
  os << *nn::Sequential(nn::Linear(1, 2), nn::Sequential(nn::ReLU()));
  EXPECT_EQ(os.str(),
            "kiln::nn::Sequential(\n"
            "  (0): kiln::nn::Linear(in_features=1, out_features=2, bias=true)\n"
            "  (1): kiln::nn::Sequential(\n"
            "    (0): kiln::nn::ReLU()\n"
            "  )\n"
            ")");
}

TEST(LayersTest, ModuleListHoldsAnyModule) {
  nn::ModuleList list(nn::Linear(2, 2), nn::MSELoss());
  list->push_back(nn::Conv2d(1, 1, 1));
  list->push_back(std::make_shared<nn::LinearImpl>(3, 3));
  EXPECT_EQ(list->size(), 4u);
  EXPECT_NE(list[2]->as<nn::Conv2dImpl>(), nullptr);
  EXPECT_EQ(list->at<nn::LinearImpl>(3).options.in_features(), 3);
  EXPECT_KILN_ERROR(list->at<nn::LinearImpl>(1), "[ModuleList] module '1' is a");
  EXPECT_KILN_ERROR(list[4], "[ModuleList] index 4 is out of range");
  list->insert(1, nn::Tanh());
  EXPECT_EQ(list->named_children().keys(), (std::vector<std::string>{"0", "1", "2", "3", "4"}));
  EXPECT_NE(list[1]->as<nn::TanhImpl>(), nullptr);
  EXPECT_NE(list[2]->as<nn::MSELossImpl>(), nullptr);
  EXPECT_EQ(
      list->named_parameters().keys(),
      (std::vector<std::string>{"0.weight", "0.bias", "3.weight", "3.bias", "4.weight", "4.bias"}));
  size_t n = 0;
  for (const auto& m : *list) n += m != nullptr;
  EXPECT_EQ(n, 5u);
  nn::ModuleList more;
  more->extend(*list);
  EXPECT_EQ(more->size(), 5u);
  EXPECT_EQ(printed(*more), "kiln::nn::ModuleList");
}

TEST(LayersTest, ModuleDictByName) {
  nn::ModuleDict dict({{"enc", nn::Linear(4, 2).ptr()}, {"act", nn::ReLU().ptr()}});
  EXPECT_EQ(dict->keys(), (std::vector<std::string>{"enc", "act"}));
  EXPECT_TRUE(dict->contains("enc"));
  EXPECT_EQ(dict->at<nn::LinearImpl>("enc").options.out_features(), 2);
  EXPECT_NE(dict["act"]->as<nn::ReLUImpl>(), nullptr);
  EXPECT_KILN_ERROR(dict["nope"], "[ModuleDict] no module named 'nope'");
  EXPECT_KILN_ERROR(dict->at<nn::LinearImpl>("act"), "[ModuleDict] module 'act' is a");
  dict->insert("dec", nn::Linear(2, 4));
  dict->update({{"enc", nn::Linear(4, 3).ptr()}});  // replaces in place
  EXPECT_EQ(dict->keys(), (std::vector<std::string>{"enc", "act", "dec"}));
  EXPECT_EQ(dict->at<nn::LinearImpl>("enc").options.out_features(), 3);
  EXPECT_EQ(dict->named_parameters().keys(),
            (std::vector<std::string>{"enc.weight", "enc.bias", "dec.weight", "dec.bias"}));
  auto popped = dict->pop("act");
  EXPECT_NE(popped->as<nn::ReLUImpl>(), nullptr);
  EXPECT_EQ(dict->size(), 2u);
  EXPECT_FALSE(dict->named_children().contains("act"));
  std::vector<std::string> seen;
  for (const auto& item : *dict) seen.push_back(item.key());
  EXPECT_EQ(seen, (std::vector<std::string>{"enc", "dec"}));
  dict->clear();
  EXPECT_TRUE(dict->is_empty());
  EXPECT_TRUE(dict->children().empty());
}

// --- The libtorch MNIST example's network, trained on generated data ---------------------------

struct MnistNetImpl : nn::Module {
  MnistNetImpl()
      : conv1(nn::Conv2dOptions(1, 10, /*kernel_size=*/5)),
        conv2(nn::Conv2dOptions(10, 20, /*kernel_size=*/5)),
        fc1(320, 50),
        fc2(50, 10) {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("conv2_drop", conv2_drop);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }

  Tensor forward(Tensor x) {
    x = kiln::relu(kiln::max_pool2d(conv1->forward(x), 2));
    x = kiln::relu(kiln::max_pool2d(conv2_drop->forward(conv2->forward(x)), 2));
    x = x.view({-1, 320});
    x = kiln::relu(fc1->forward(x));
    x = kiln::dropout(x, /*p=*/0.5, /*train=*/is_training());
    x = fc2->forward(x);
    return kiln::log_softmax(x, /*dim=*/1);
  }

  nn::Conv2d conv1;
  nn::Conv2d conv2;
  nn::Dropout2d conv2_drop;
  nn::Linear fc1;
  nn::Linear fc2;
};

TEST(LayersTest, MnistNetTrainsWithSgd) {
  manual_seed(15);
  auto model = std::make_shared<MnistNetImpl>();
  EXPECT_EQ(count_parameters(*model), 260 + 5020 + 16050 + 510);
  // Ten classes, each a fixed smooth random 28x28 pattern (7x7 blocks of 4x4 pixels) plus
  // pixel noise; one batch of ten images, one per class.
  Tensor prototypes =
      randn({10, 1, 7, 1, 7, 1}).expand({10, 1, 7, 4, 7, 4}).reshape({10, 1, 28, 28});
  Tensor labels = arange(10, kInt64);
  Tensor images = prototypes + 0.5 * randn({10, 1, 28, 28});

  auto eval_loss = [&] {
    NoGradGuard no_grad;
    model->eval();
    const double loss = kiln::nll_loss(model->forward(images), labels).item<double>();
    model->train();
    return loss;
  };
  const double initial = eval_loss();
  EXPECT_NEAR(initial, std::log(10.0), 0.5);  // about uniform before training
  // SGD with momentum, written out: v = 0.9 v + g; p -= lr v (dropout on, as in training).
  const double lr = 0.05, momentum = 0.9;
  std::vector<Tensor> velocity;
  for (const Tensor& p : model->parameters()) velocity.push_back(zeros_like(p));
  for (int step = 0; step < 20; ++step) {
    model->zero_grad();
    Tensor loss = kiln::nll_loss(model->forward(images), labels);
    ASSERT_TRUE(std::isfinite(loss.item<double>())) << step;
    loss.backward();
    NoGradGuard no_grad;
    auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      velocity[i].mul_(momentum).add_(params[i].grad());
      params[i] -= lr * velocity[i];
    }
  }
  const double final_loss = eval_loss();
  EXPECT_LT(final_loss, 0.6 * initial) << "initial " << initial << ", final " << final_loss;
  // The parameters are still the leaves the module registered.
  EXPECT_TRUE(model->fc2->weight.is_leaf());
  EXPECT_TRUE(model->fc2->weight.grad().defined());
}

}  // namespace
}  // namespace kiln
