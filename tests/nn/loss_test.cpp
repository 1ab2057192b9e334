// nn::functional losses against f64 references computed in the test, gradients
// by gradcheck, and misuse errors.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "autograd/gradcheck.h"
#include "nn/functional.h"
#include "test_util.h"

namespace kiln {
namespace {

namespace F = nn::functional;
using autograd::gradcheck;

Tensor rand64(IntArrayRef sizes, bool grad = true) {
  return randn(sizes, dtype(kFloat64).requires_grad(grad));
}

Tensor ints(std::vector<int64_t> v, IntArrayRef sizes) {
  return from_blob(v.data(), sizes, kInt64).clone();
}

double sum_of(const std::vector<double> &v) {
  double s = 0;
  for (double e : v) s += e;
  return s;
}

void expect_close(const Tensor &got, const std::vector<double> &want, double tol = 1e-10) {
  const std::vector<double> g = got.to_vector<double>();
  ASSERT_EQ(g.size(), want.size());
  for (size_t i = 0; i < g.size(); ++i) {
    EXPECT_NEAR(g[i], want[i], tol * (1 + std::abs(want[i]))) << "at " << i;
  }
}

void expect_reductions(const std::function<Tensor(nn::Reduction)> &loss,
                       const std::vector<double> &elems) {
  expect_close(loss(kNone), elems);
  expect_close(loss(kSum), {sum_of(elems)});
  expect_close(loss(kMean), {sum_of(elems) / static_cast<double>(elems.size())});
}

TEST(LossRegression, MseL1SmoothL1MatchFormulas) {
  manual_seed(1);
  Tensor x = rand64({3, 4}), y = rand64({3, 4});
  const std::vector<double> xv = x.to_vector<double>(), yv = y.to_vector<double>();
  std::vector<double> mse, l1, sl1;
  for (size_t i = 0; i < xv.size(); ++i) {
    const double d = std::abs(xv[i] - yv[i]);
    mse.push_back(d * d);
    l1.push_back(d);
    sl1.push_back(d < 0.5 ? 0.5 * d * d / 0.5 : d - 0.25);
  }
  expect_reductions([&](nn::Reduction r) { return kiln::mse_loss(x, y, r); }, mse);
  expect_reductions(
      [&](nn::Reduction r) { return F::l1_loss(x, y, F::L1LossFuncOptions().reduction(r)); }, l1);
  expect_reductions([&](nn::Reduction r) { return kiln::smooth_l1_loss(x, y, r, 0.5); }, sl1);
  expect_close(F::smooth_l1_loss(x, y, F::SmoothL1LossFuncOptions().beta(0)), {sum_of(l1) / 12});
  EXPECT_TRUE(gradcheck(
      [](const auto &in) {
        return F::smooth_l1_loss(in[0], in[1], F::SmoothL1LossFuncOptions().beta(0.5));
      },
      {x, y}));
  EXPECT_TRUE(gradcheck([](const auto &in) { return F::mse_loss(in[0], in[1]); }, {x, y}));
  EXPECT_KILN_ERROR(F::mse_loss(ones({2}, kInt64), ones({2}, kInt64)), "[mse_loss] expected");
  EXPECT_KILN_ERROR(F::mse_loss(x, y, F::MSELossFuncOptions().reduction(kBatchMean)),
                    "[mse_loss] reduction 'batchmean'");
  EXPECT_KILN_ERROR(kiln::smooth_l1_loss(x, y, kMean, -1), "[smooth_l1_loss] beta");
}

// log-probabilities lp [N, C], targets, class weights: per-sample -w[y] lp[y],
// and the total weight of the non-ignored targets.
struct NllRef {
  std::vector<double> elems;
  double weight_sum = 0;
};
NllRef nll_ref(const std::vector<double> &lp, int64_t c, const std::vector<int64_t> &t,
               const std::vector<double> &w, int64_t ignore) {
  NllRef r;
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i] == ignore) {
      r.elems.push_back(0);
      continue;
    }
    const double wi = w.empty() ? 1.0 : w[t[i]];
    r.elems.push_back(-wi * lp[i * c + t[i]]);
    r.weight_sum += wi;
  }
  return r;
}

TEST(LossNll, WeightsIgnoreIndexAndReductions) {
  manual_seed(2);
  Tensor lp = rand64({5, 3});
  Tensor w = rand64({3}, false).abs();
  Tensor t = ints({0, 2, -100, 1, 2}, {5});
  const NllRef r =
      nll_ref(lp.to_vector<double>(), 3, t.to_vector<int64_t>(), w.to_vector<double>(), -100);
  const auto opts = F::NLLLossFuncOptions().weight(w);
  expect_close(F::nll_loss(lp, t, F::NLLLossFuncOptions(opts).reduction(kNone)), r.elems);
  expect_close(F::nll_loss(lp, t, F::NLLLossFuncOptions(opts).reduction(kSum)), {sum_of(r.elems)});
  expect_close(F::nll_loss(lp, t, opts), {sum_of(r.elems) / r.weight_sum});
  Tensor t2 = ints({0, 2, 1, 1, 2}, {5});  // ignore_index 2: three targets count
  expect_close(
      kiln::nll_loss(lp, t2, {}, kMean, 2),
      {sum_of(nll_ref(lp.to_vector<double>(), 3, t2.to_vector<int64_t>(), {}, 2).elems) / 3});
  // Unbatched [C] with a 0-d target.
  expect_close(F::nll_loss(lp[1], t[1]), {-lp[1][2].item<double>()});
  EXPECT_TRUE(gradcheck([&](const auto &in) { return F::nll_loss(in[0], t, opts); }, {lp}));
  EXPECT_KILN_ERROR(F::nll_loss(lp, ints({0, 3, 0, 0, 0}, {5})),
                    "[nll_loss] target 3 is out of bounds for 3 classes");
  EXPECT_KILN_ERROR(F::nll_loss(lp, ints({0, 1}, {2})), "[nll_loss] expected target of shape [5]");
  EXPECT_KILN_ERROR(F::nll_loss(lp, rand64({5}, false)), "[nll_loss] expected integer class");
  EXPECT_KILN_ERROR(F::nll_loss(lp, t, F::NLLLossFuncOptions().weight(ones({2}, kFloat64))),
                    "[nll_loss] expected a weight of shape [3]");
}

TEST(LossCrossEntropy, IndicesWithIgnoreIndexSmoothingAndWeights) {
  manual_seed(3);
  // [N, C, d] = [2, 4, 3]: classes on dim 1; flattened to rows (n, d) for the
  // reference.
  Tensor x = rand64({2, 4, 3});
  Tensor t = ints({0, 3, 1, -1, 2, 3}, {2, 3});
  Tensor w = rand64({4}, false).abs() + 0.1;
  const double ls = 0.2;
  const std::vector<double> xv = x.to_vector<double>(), wv = w.to_vector<double>();
  const std::vector<int64_t> tv = t.to_vector<int64_t>();
  std::vector<double> lp;  // rows (n, d), columns c
  for (int n = 0; n < 2; ++n) {
    for (int d = 0; d < 3; ++d) {
      double z = 0;
      for (int c = 0; c < 4; ++c) z += std::exp(xv[(n * 4 + c) * 3 + d]);
      for (int c = 0; c < 4; ++c) lp.push_back(xv[(n * 4 + c) * 3 + d] - std::log(z));
    }
  }
  const NllRef r = nll_ref(lp, 4, tv, wv, -1);
  std::vector<double> smooth;
  for (size_t i = 0; i < tv.size(); ++i) {
    double s = 0;
    for (int c = 0; c < 4; ++c) s -= wv[c] * lp[i * 4 + c];
    smooth.push_back(tv[i] == -1 ? 0.0 : s);
  }
  std::vector<double> none;
  for (size_t i = 0; i < tv.size(); ++i) none.push_back((1 - ls) * r.elems[i] + ls / 4 * smooth[i]);
  const auto opts = F::CrossEntropyFuncOptions().weight(w).ignore_index(-1).label_smoothing(ls);
  expect_close(F::cross_entropy(x, t, F::CrossEntropyFuncOptions(opts).reduction(kNone)), none);
  expect_close(F::cross_entropy(x, t, F::CrossEntropyFuncOptions(opts).reduction(kSum)),
               {sum_of(none)});
  expect_close(F::cross_entropy(x, t, opts), {sum_of(none) / r.weight_sum});
  EXPECT_TRUE(gradcheck([&](const auto &in) { return F::cross_entropy(in[0], t, opts); }, {x}));
  // Without options: plain mean of -log p[target] over the [N, d] positions.
  const NllRef plain = nll_ref(lp, 4, {0, 3, 1, 0, 2, 3}, {}, -100);
  expect_close(kiln::cross_entropy_loss(x, ints({0, 3, 1, 0, 2, 3}, {2, 3})),
               {sum_of(plain.elems) / 6});
}

TEST(LossCrossEntropy, ProbabilityTargets) {
  manual_seed(4);
  Tensor x = rand64({3, 5});
  Tensor p = softmax(rand64({3, 5}, false), 1);
  Tensor w = rand64({5}, false).abs();
  const double ls = 0.1;
  const std::vector<double> xv = x.to_vector<double>(), pv = p.to_vector<double>(),
                            wv = w.to_vector<double>();
  std::vector<double> elems;
  for (int n = 0; n < 3; ++n) {
    double z = 0, s = 0;
    for (int c = 0; c < 5; ++c) z += std::exp(xv[n * 5 + c]);
    for (int c = 0; c < 5; ++c) {
      const double target = pv[n * 5 + c] * (1 - ls) + ls / 5;
      s -= wv[c] * target * (xv[n * 5 + c] - std::log(z));
    }
    elems.push_back(s);
  }
  const auto opts = F::CrossEntropyFuncOptions().weight(w).label_smoothing(ls);
  expect_close(F::cross_entropy(x, p, opts), {sum_of(elems) / 3});
  expect_close(F::cross_entropy(x, p, F::CrossEntropyFuncOptions(opts).reduction(kNone)), elems);
  EXPECT_TRUE(gradcheck([&](const auto &in) { return F::cross_entropy(in[0], in[1], opts); },
                        {x, p.clone().requires_grad_()}));
  EXPECT_KILN_ERROR(F::cross_entropy(x, rand64({3, 4}, false)),
                    "[cross_entropy] target of shape [3, 4]");
  EXPECT_KILN_ERROR(F::cross_entropy(x, p, F::CrossEntropyFuncOptions().label_smoothing(1.5)),
                    "[cross_entropy] label_smoothing");
  EXPECT_KILN_ERROR(F::cross_entropy(x, ints({0, 5, 1}, {3})), "[cross_entropy_fused] target 5");
}

TEST(LossBinary, BceAndWithLogitsMatchFormulasAndAreStable) {
  manual_seed(5);
  Tensor logits = rand64({4, 3});
  Tensor prob = sigmoid(logits.detach()).requires_grad_();
  Tensor t = rand(IntArrayRef{4, 3}, kFloat64);
  Tensor w = rand64({3}, false).abs();
  Tensor pw = rand64({3}, false).abs() + 0.5;
  const std::vector<double> xv = logits.to_vector<double>(), tv = t.to_vector<double>(),
                            wv = w.to_vector<double>(), pwv = pw.to_vector<double>();
  std::vector<double> bce, bcel;
  for (size_t i = 0; i < xv.size(); ++i) {
    const double s = 1 / (1 + std::exp(-xv[i]));
    const size_t c = i % 3;
    bce.push_back(-wv[c] * (tv[i] * std::log(s) + (1 - tv[i]) * std::log(1 - s)));
    bcel.push_back(-wv[c] * (pwv[c] * tv[i] * std::log(s) + (1 - tv[i]) * std::log(1 - s)));
  }
  expect_reductions([&](nn::Reduction r) { return kiln::binary_cross_entropy(prob, t, w, r); },
                    bce);
  expect_reductions(
      [&](nn::Reduction r) { return kiln::binary_cross_entropy_with_logits(logits, t, w, pw, r); },
      bcel);
  EXPECT_TRUE(gradcheck(
      [&](const auto &in) {
        return F::binary_cross_entropy_with_logits(
            in[0], in[1], F::BinaryCrossEntropyWithLogitsFuncOptions().weight(w).pos_weight(pw));
      },
      {logits, t.clone().requires_grad_()}));
  EXPECT_TRUE(gradcheck([&](const auto &in) { return F::binary_cross_entropy(in[0], t); }, {prob}));
  // Saturated logits: finite, and equal to the asymptotic values.
  Tensor big = from_blob(std::vector<double>{800, -800}.data(), {2}, kFloat64).clone();
  Tensor tb = from_blob(std::vector<double>{0, 0}.data(), {2}, kFloat64).clone();
  expect_close(F::binary_cross_entropy_with_logits(
                   big, tb, F::BinaryCrossEntropyWithLogitsFuncOptions().reduction(kNone)),
               {800, 0});
  // bce clamps its log terms at -100.
  expect_close(F::binary_cross_entropy(zeros({1}, kFloat64), ones({1}, kFloat64)), {100});
  EXPECT_KILN_ERROR(F::binary_cross_entropy(full({2}, 1.5, kFloat64), ones({2}, kFloat64)),
                    "[binary_cross_entropy] all elements of input should be between 0 and 1");
  EXPECT_KILN_ERROR(F::binary_cross_entropy_with_logits(logits, ones({4}, kFloat64)),
                    "[binary_cross_entropy_with_logits] target of shape [4]");
}

TEST(LossKlDiv, TargetsLogTargetsAndBatchMean) {
  manual_seed(6);
  Tensor input = log_softmax(rand64({3, 4}, false), 1).requires_grad_();
  Tensor p = softmax(rand64({3, 4}, false), 1);
  p[0][0] = 0.0;  // a zero probability contributes 0
  const std::vector<double> iv = input.to_vector<double>(), pv = p.to_vector<double>();
  std::vector<double> elems;
  for (size_t i = 0; i < iv.size(); ++i) {
    elems.push_back(pv[i] > 0 ? pv[i] * (std::log(pv[i]) - iv[i]) : 0.0);
  }
  expect_reductions([&](nn::Reduction r) { return kiln::kl_div(input, p, r); }, elems);
  expect_close(F::kl_div(input, p, F::KLDivFuncOptions().reduction(kBatchMean)),
               {sum_of(elems) / 3});
  Tensor logp = p.clamp_min(1e-3).log();
  std::vector<double> log_elems;
  const std::vector<double> lv = logp.to_vector<double>();
  for (size_t i = 0; i < iv.size(); ++i) log_elems.push_back(std::exp(lv[i]) * (lv[i] - iv[i]));
  expect_close(F::kl_div(input, logp, F::KLDivFuncOptions().log_target(true).reduction(kSum)),
               {sum_of(log_elems)});
  EXPECT_TRUE(gradcheck(
      [&](const auto &in) {
        return F::kl_div(in[0], in[1], F::KLDivFuncOptions().reduction(kBatchMean));
      },
      {input, softmax(rand64({3, 4}, false), 1).requires_grad_()}));
  EXPECT_TRUE(gradcheck(
      [&](const auto &in) {
        return F::kl_div(in[0], in[1], F::KLDivFuncOptions().log_target(true));
      },
      {input, logp.clone().requires_grad_()}));
  EXPECT_KILN_ERROR(F::kl_div(ones({2}, kInt64), p), "[kl_div]");
}

}  // namespace
}  // namespace kiln
