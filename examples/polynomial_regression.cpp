// Polynomial regression, in the style of libtorch's "regression" example: fit
//   y = w1 x + w2 x^2 + w3 x^3 + w4 x^4 + b
// to a random target polynomial from batches of random points, by SGD on the mean squared
// error. The gradient of the loss is written out by hand in tensor ops (no autograd), so the
// whole step is visible:
//   r = X w + b - y                 residuals of the batch, X = [x, x^2, x^3, x^4]
//   loss = mean(r^2)
//   dloss/dw = 2/B X^T r,  dloss/db = 2 mean(r)
//
//   build/examples/polynomial_regression [seed]
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include <kiln/kiln.h>

namespace {

constexpr int64_t kDegree = 4;
constexpr int64_t kBatchSize = 64;
constexpr double kLearningRate = 0.3;
constexpr double kTargetLoss = 1e-3;
constexpr int64_t kMaxSteps = 100000;
constexpr int64_t kPrintEvery = 100;

// Features [x, x^2, x^3, x^4] of a batch x of shape [B]: shape [B, kDegree].
kiln::Tensor make_features(const kiln::Tensor& x) {
  const kiln::Tensor exponents = kiln::arange(1, kDegree + 1, kiln::kFloat);
  return x.unsqueeze(1).pow(exponents);
}

// The polynomial with weights w (shape [kDegree, 1]) and bias b (shape [1]) as text.
std::string describe(const kiln::Tensor& w, const kiln::Tensor& b) {
  std::string s = "y =";
  char term[64];
  const kiln::Tensor flat = w.view({-1});
  for (int64_t i = 0; i < kDegree; ++i) {
    std::snprintf(term, sizeof(term), " %+.3f x^%lld", flat[i].item<double>(),
                  static_cast<long long>(i + 1));
    s += term;
  }
  std::snprintf(term, sizeof(term), " %+.3f", b.item<double>());
  return s + term;
}

}  // namespace

int main(int argc, char** argv) {
  kiln::manual_seed(argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 0);

  const kiln::Tensor w_target = kiln::randn({kDegree, 1}) * 5;
  const kiln::Tensor b_target = kiln::randn({1}) * 5;
  kiln::Tensor w = kiln::zeros({kDegree, 1});
  kiln::Tensor b = kiln::zeros({1});

  double loss = 0;
  int64_t step = 0;
  while (step < kMaxSteps) {
    ++step;
    // x uniform in [-1, 1): x^4 of a normal sample has tails heavy enough to make plain SGD
    // on the squared error diverge at any useful learning rate.
    const kiln::Tensor x = kiln::rand({kBatchSize}) * 2 - 1;
    const kiln::Tensor features = make_features(x);                     // [B, 4]
    const kiln::Tensor y = features.matmul(w_target) + b_target;        // [B, 1]
    const kiln::Tensor residual = features.matmul(w) + b - y;           // [B, 1]
    loss = residual.pow(2).mean().item<double>();
    if (step % kPrintEvery == 0 || step == 1) {
      std::cout << "step " << step << "  loss " << loss << "\n";
    }
    if (loss < kTargetLoss) break;

    const kiln::Tensor grad_w = features.t().matmul(residual) * (2.0 / kBatchSize);  // [4, 1]
    const kiln::Tensor grad_b = residual.mean({0}) * 2.0;                           // [1]
    w.sub_(grad_w, kLearningRate);
    b.sub_(grad_b, kLearningRate);
  }

  std::cout << "Loss " << loss << " after " << step << " batches\n";
  std::cout << "==> Learned function: " << describe(w, b) << "\n";
  std::cout << "==> Target function:  " << describe(w_target, b_target) << "\n";
  if (loss >= kTargetLoss) {
    std::cerr << "did not reach a loss below " << kTargetLoss << " in " << kMaxSteps
              << " steps\n";
    return EXIT_FAILURE;
  }
  return EXIT_SUCCESS;
}
