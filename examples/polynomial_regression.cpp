// Polynomial regression: a port of libtorch's "regression" example (pytorch/examples,
// cpp/regression), which compiles against libtorch by renaming kiln:: to torch::. A Linear
// layer learns y = w1 x + w2 x^2 + w3 x^3 + w4 x^4 + b from batches of random points, with
// SGD on the smooth L1 loss, until the loss falls below 1e-3.
//
//   build/examples/polynomial_regression [seed]
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <kiln/kiln.h>

namespace {

constexpr int64_t kPolyDegree = 4;
constexpr int64_t kMaxBatches = 200000;

// Builds features [x, x^2, x^3, x^4] for a batch x of shape [B].
kiln::Tensor make_features(kiln::Tensor x) {
  x = x.unsqueeze(1);
  std::vector<kiln::Tensor> xs;
  for (int64_t i = 0; i < kPolyDegree; ++i) xs.push_back(x.pow(i + 1));
  return kiln::cat(xs, 1);
}

// The target function.
kiln::Tensor f(const kiln::Tensor& x, const kiln::Tensor& w_target, const kiln::Tensor& b_target) {
  return x.mm(w_target) + b_target.item();
}

// "y = +1.23 x^1 -0.45 x^2 ... +6.78".
std::string poly_desc(const kiln::Tensor& w, const kiln::Tensor& b) {
  std::ostringstream os;
  os << "y = ";
  const auto ws = w.to_vector<float>();
  for (size_t i = 0; i < ws.size(); ++i) {
    char term[48];
    std::snprintf(term, sizeof(term), "%+.2f x^%zu ", ws[i], i + 1);
    os << term;
  }
  char bias[24];
  std::snprintf(bias, sizeof(bias), "%+.2f", b.item<float>());
  os << bias;
  return os.str();
}

// A batch of random points and their targets.
std::pair<kiln::Tensor, kiln::Tensor> get_batch(const kiln::Tensor& w_target,
                                                const kiln::Tensor& b_target,
                                                int64_t batch_size = 32) {
  auto random = kiln::randn({batch_size});
  auto x = make_features(random);
  auto y = f(x, w_target, b_target);
  return std::make_pair(x, y);
}

}  // namespace

int main(int argc, char** argv) {
  kiln::manual_seed(argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 0);
  auto w_target = kiln::randn({kPolyDegree, 1}) * 5;
  auto b_target = kiln::randn({1}) * 5;

  auto fc = kiln::nn::Linear(w_target.size(0), 1);
  kiln::optim::SGD optim(fc->parameters(), .1);

  float loss = 0;
  int64_t batch_idx = 0;
  while (++batch_idx <= kMaxBatches) {
    auto [batch_x, batch_y] = get_batch(w_target, b_target);
    optim.zero_grad();
    auto output = kiln::smooth_l1_loss(fc(batch_x), batch_y);
    loss = output.item<float>();
    output.backward();
    optim.step();
    if (batch_idx % 100 == 0) std::cout << "batch " << batch_idx << "  loss " << loss << "\n";
    if (loss < 1e-3f) break;
  }
  std::cout << "Loss: " << loss << " after " << batch_idx << " batches\n";
  std::cout << "==> Learned function:\t" << poly_desc(fc->weight.view({-1}), fc->bias) << "\n";
  std::cout << "==> Actual function:\t" << poly_desc(w_target.view({-1}), b_target) << "\n";
  return loss < 1e-3f ? 0 : 1;
}
