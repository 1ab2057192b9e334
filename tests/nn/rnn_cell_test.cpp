// RNNCell, LSTMCell and GRUCell (nn/modules/rnn.h): one step against PyTorch's equations written
// here with plain f64 ops; every option (bias, nonlinearity, initial state or zeros, unbatched
// input); gradients against finite differences; the same step as the full RNN / LSTM / GRU layers
// given the same weights, and a loop of cells as a whole layer; names, shapes, initialisation,
// printing and misuse.
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <cmath>
#include <sstream>
#include <string>
#include <tuple>

#include "autograd/grad_test_util.h"
#include "kernels/cuda.h"
#include "test_util.h"

namespace kiln {
namespace {

using gradtest::check_grad;
using gradtest::variable_list;

// The cell's parameters in f64, with zeros for an absent bias.
struct Params {
  Tensor w_ih, w_hh, b_ih, b_hh;
};

Params params_of(const nn::internal::RNNCellImplBase& cell) {
  const auto d = [](const Tensor& t) { return t.detach().to(kDouble); };
  Params p{d(cell.weight_ih), d(cell.weight_hh), {}, {}};
  const int64_t gates = cell.weight_ih.size(0);
  p.b_ih = cell.bias_ih.defined() ? d(cell.bias_ih) : zeros({gates}, kDouble);
  p.b_hh = cell.bias_hh.defined() ? d(cell.bias_hh) : zeros({gates}, kDouble);
  return p;
}

// PyTorch's equations (torch.nn.LSTMCell / GRUCell / RNNCell docs), x [B, I], h and c [B, H].
std::tuple<Tensor, Tensor> lstm_reference(const Params& p, const Tensor& x, const Tensor& h,
                                          const Tensor& c) {
  const Tensor g = x.matmul(p.w_ih.t()) + p.b_ih + h.matmul(p.w_hh.t()) + p.b_hh;
  const int64_t n = h.size(-1);
  const Tensor i = g.narrow(-1, 0, n).sigmoid(), f = g.narrow(-1, n, n).sigmoid();
  const Tensor gg = g.narrow(-1, 2 * n, n).tanh(), o = g.narrow(-1, 3 * n, n).sigmoid();
  const Tensor c2 = f * c + i * gg;
  return {o * c2.tanh(), c2};
}

Tensor gru_reference(const Params& p, const Tensor& x, const Tensor& h) {
  const Tensor gi = x.matmul(p.w_ih.t()) + p.b_ih, gh = h.matmul(p.w_hh.t()) + p.b_hh;
  const int64_t n = h.size(-1);
  const auto part = [n](const Tensor& t, int64_t k) { return t.narrow(-1, k * n, n); };
  const Tensor r = (part(gi, 0) + part(gh, 0)).sigmoid();
  const Tensor z = (part(gi, 1) + part(gh, 1)).sigmoid();
  const Tensor nn_ = (part(gi, 2) + r * part(gh, 2)).tanh();
  return (1.0 - z) * nn_ + z * h;
}

Tensor rnn_reference(const Params& p, const Tensor& x, const Tensor& h, bool relu) {
  const Tensor pre = x.matmul(p.w_ih.t()) + p.b_ih + h.matmul(p.w_hh.t()) + p.b_hh;
  return relu ? pre.relu() : pre.tanh();
}

bool close(const Tensor& a, const Tensor& b, double tol = 2e-6) {
  return a.sizes() == b.sizes() && allclose(a.to(kDouble), b.to(kDouble), tol, tol);
}

TEST(RnnCellTest, LSTMCellMatchesItsEquations) {
  manual_seed(1);
  for (const bool bias : {true, false}) {
    SCOPED_TRACE(bias ? "bias" : "no bias");
    nn::LSTMCell cell(nn::LSTMCellOptions(3, 5).bias(bias));
    const Params p = params_of(*cell);
    const Tensor x = randn({4, 3}), h = randn({4, 5}), c = randn({4, 5});
    auto [hy, cy] = cell(x, std::make_tuple(h, c));
    auto [href, cref] = lstm_reference(p, x.to(kDouble), h.to(kDouble), c.to(kDouble));
    EXPECT_EQ(hy.dtype(), kFloat);
    EXPECT_TRUE(close(hy, href));
    EXPECT_TRUE(close(cy, cref));
    // No state: zeros.
    auto [h0, c0] = cell(x);
    const Tensor z = zeros({4, 5}, kDouble);
    auto [h0ref, c0ref] = lstm_reference(p, x.to(kDouble), z, z);
    EXPECT_TRUE(close(h0, h0ref));
    EXPECT_TRUE(close(c0, c0ref));
    // Unbatched: [I] -> [H], the batched step's row.
    auto [h1, c1] = cell(x[1], std::make_tuple(h[1], c[1]));
    EXPECT_EQ(h1.sizes(), Shape({5}));
    EXPECT_TRUE(close(h1, href[1]));
    EXPECT_TRUE(close(c1, cref[1]));
  }
}

TEST(RnnCellTest, GRUCellAndRNNCellMatchTheirEquations) {
  manual_seed(2);
  const Tensor x = randn({4, 3}), h = randn({4, 5});
  for (const bool bias : {true, false}) {
    SCOPED_TRACE(bias ? "bias" : "no bias");
    nn::GRUCell gru(nn::GRUCellOptions(3, 5).bias(bias));
    const Params pg = params_of(*gru);
    EXPECT_TRUE(close(gru(x, h), gru_reference(pg, x.to(kDouble), h.to(kDouble))));
    EXPECT_TRUE(close(gru(x), gru_reference(pg, x.to(kDouble), zeros({4, 5}, kDouble))));
    const Tensor one = gru(x[2], h[2]);
    EXPECT_EQ(one.sizes(), Shape({5}));
    EXPECT_TRUE(close(one, gru_reference(pg, x.to(kDouble), h.to(kDouble))[2]));
    for (const auto nl : {kiln::kTanh, kiln::kReLU}) {
      nn::RNNCell rnn(nn::RNNCellOptions(3, 5).bias(bias).nonlinearity(nl));
      const Params pr = params_of(*rnn);
      const bool relu = nl == kiln::kReLU;
      EXPECT_TRUE(close(rnn(x, h), rnn_reference(pr, x.to(kDouble), h.to(kDouble), relu)));
      EXPECT_TRUE(close(rnn(x), rnn_reference(pr, x.to(kDouble), zeros({4, 5}, kDouble), relu)));
      EXPECT_TRUE(close(rnn(x[0]), rnn_reference(pr, x.to(kDouble)[0].unsqueeze(0),
                                                 zeros({1, 5}, kDouble), relu)[0]));
    }
  }
}

// Input, states and every parameter against finite differences, in f64.
TEST(RnnCellTest, Gradcheck) {
  manual_seed(3);
  const Tensor x = gradtest::leaf({2, 3}), h = gradtest::leaf({2, 4}), c = gradtest::leaf({2, 4});
  {
    nn::LSTMCell cell(3, 4);
    cell->to(kDouble);
    variable_list inputs{x, h, c};
    for (const Tensor& p : cell->parameters()) inputs.push_back(p);
    EXPECT_TRUE(check_grad(
        {"lstm_cell_fused", "addmm"},
        [&](const variable_list& in) {
          auto [hy, cy] = cell(in[0], std::make_tuple(in[1], in[2]));
          return cat({hy.flatten(), cy.flatten()});
        },
        inputs));
    // Unbatched, only h' used.
    EXPECT_TRUE(check_grad(
        {"lstm_cell_fused"}, [&](const variable_list& in) { return std::get<0>(cell(in[0][1])); },
        inputs));
  }
  {
    nn::GRUCell cell(nn::GRUCellOptions(3, 4).bias(false));
    cell->to(kDouble);
    variable_list inputs{x, h};
    for (const Tensor& p : cell->parameters()) inputs.push_back(p);
    EXPECT_TRUE(check_grad(
        {"gru_cell_fused"}, [&](const variable_list& in) { return cell(in[0], in[1]); }, inputs));
  }
  for (const auto nl : {kiln::kTanh, kiln::kReLU}) {
    nn::RNNCell cell(nn::RNNCellOptions(3, 4).nonlinearity(nl));
    cell->to(kDouble);
    variable_list inputs{x, h};
    for (const Tensor& p : cell->parameters()) inputs.push_back(p);
    EXPECT_TRUE(check_grad(
        {"addmm"}, [&](const variable_list& in) { return cell(in[0], in[1]); }, inputs));
  }
}

// Copies a cell's weights into layer 0 of a one-layer RNN / LSTM / GRU.
void copy_into_layer(const nn::internal::RNNCellImplBase& cell, nn::Module& layer) {
  NoGradGuard no_grad;
  auto p = layer.named_parameters();
  p["weight_ih_l0"].copy_(cell.weight_ih);
  p["weight_hh_l0"].copy_(cell.weight_hh);
  if (cell.bias_ih.defined()) {
    p["bias_ih_l0"].copy_(cell.bias_ih);
    p["bias_hh_l0"].copy_(cell.bias_hh);
  }
}

// A loop of cell steps is the layer: one step, and a whole sequence.
TEST(RnnCellTest, StepsMatchTheFullLayers) {
  manual_seed(4);
  const int64_t steps = 6, batch = 3, in = 4, hid = 5;
  const Tensor x = randn({steps, batch, in}), h0 = randn({batch, hid}), c0 = randn({batch, hid});
  {
    nn::LSTMCell cell(in, hid);
    nn::LSTM layer(in, hid);
    copy_into_layer(*cell, *layer);
    Tensor h = h0, c = c0;
    for (int64_t t = 0; t < steps; ++t) {
      std::tie(h, c) = cell(x[t], std::make_tuple(h, c));
      if (t == 0) {
        auto [out1, hc1] =
            layer(x.narrow(0, 0, 1), std::make_tuple(h0.unsqueeze(0), c0.unsqueeze(0)));
        EXPECT_TRUE(close(out1[0], h, 1e-6));
        EXPECT_TRUE(close(std::get<1>(hc1)[0], c, 1e-6));
      }
    }
    auto [out, hc] = layer(x, std::make_tuple(h0.unsqueeze(0), c0.unsqueeze(0)));
    EXPECT_TRUE(close(std::get<0>(hc)[0], h, 1e-5));
    EXPECT_TRUE(close(std::get<1>(hc)[0], c, 1e-5));
  }
  {
    nn::GRUCell cell(nn::GRUCellOptions(in, hid).bias(false));
    nn::GRU layer(nn::GRUOptions(in, hid).bias(false));
    copy_into_layer(*cell, *layer);
    Tensor h = h0;
    for (int64_t t = 0; t < steps; ++t) h = cell(x[t], h);
    auto [out, hn] = layer(x, h0.unsqueeze(0));
    EXPECT_TRUE(close(hn[0], h, 1e-5));
    EXPECT_TRUE(
        close(std::get<0>(layer(x.narrow(0, 0, 1), h0.unsqueeze(0)))[0], cell(x[0], h0), 1e-6));
  }
  for (const auto nl : {kiln::kTanh, kiln::kReLU}) {
    nn::RNNCell cell(nn::RNNCellOptions(in, hid).nonlinearity(nl));
    nn::RNN layer(nn::RNNOptions(in, hid).nonlinearity(nl));
    copy_into_layer(*cell, *layer);
    Tensor h;  // zeros at the first step
    for (int64_t t = 0; t < steps; ++t) h = cell(x[t], h);
    auto [out, hn] = layer(x);
    EXPECT_TRUE(close(hn[0], h, 1e-5));
    EXPECT_TRUE(close(out[steps - 1], h, 1e-5));
  }
}

TEST(RnnCellTest, ParametersInitialisationAndPrinting) {
  manual_seed(5);
  nn::LSTMCell lstm(3, 16);
  const auto names = lstm->named_parameters().keys();
  EXPECT_EQ(names, (std::vector<std::string>{"weight_ih", "weight_hh", "bias_ih", "bias_hh"}));
  EXPECT_EQ(lstm->weight_ih.sizes(), Shape({64, 3}));
  EXPECT_EQ(lstm->weight_hh.sizes(), Shape({64, 16}));
  EXPECT_EQ(lstm->bias_hh.sizes(), Shape({64}));
  EXPECT_EQ(nn::GRUCell(3, 16)->weight_ih.size(0), 48);
  EXPECT_EQ(nn::RNNCell(3, 16)->weight_hh.sizes(), Shape({16, 16}));
  for (const Tensor& p : lstm->parameters()) {
    EXPECT_LE(p.abs().max().item<float>(), 0.25f);  // U(-1/sqrt(16), 1/sqrt(16))
    EXPECT_GT(p.abs().max().item<float>(), 0.2f);
  }
  nn::GRUCell no_bias(nn::GRUCellOptions(3, 4).bias(false));
  EXPECT_EQ(no_bias->parameters().size(), 2u);
  EXPECT_FALSE(no_bias->bias_ih.defined());
  std::ostringstream s;
  s << *nn::RNNCell(nn::RNNCellOptions(3, 4).nonlinearity(kiln::kReLU).bias(false)) << " " << *lstm;
  EXPECT_EQ(s.str(),
            "kiln::nn::RNNCell(input_size=3, hidden_size=4, bias=false, nonlinearity=relu) "
            "kiln::nn::LSTMCell(input_size=3, hidden_size=16, bias=true)");
}

// The same cells cloned onto the GPU (skips without one): outputs and gradients as on the CPU.
TEST(GpuRnnCell, CudaMatchesCpu) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  manual_seed(6);
  const Tensor x = randn({3, 4}), h = randn({3, 5}), c = randn({3, 5});
  nn::LSTMCell lstm(4, 5);
  auto gpu = std::dynamic_pointer_cast<nn::LSTMCellImpl>(lstm->clone(Device(kCUDA)));
  ASSERT_NE(gpu, nullptr);
  EXPECT_TRUE(gpu->weight_ih.is_cuda());
  auto [h1, c1] = lstm(x, std::make_tuple(h, c));
  auto [h2, c2] = gpu->forward(x.cuda(), std::make_tuple(h.cuda(), c.cuda()));
  EXPECT_TRUE(allclose(h2.cpu(), h1, 1e-5, 1e-6));
  EXPECT_TRUE(allclose(c2.cpu(), c1, 1e-5, 1e-6));
  (h1.sum() + c1.square().sum()).backward();
  (h2.sum() + c2.square().sum()).backward();
  EXPECT_TRUE(allclose(gpu->weight_hh.grad().cpu(), lstm->weight_hh.grad(), 1e-4, 1e-5));
  nn::GRUCell gru(4, 5);
  auto gru_gpu = std::dynamic_pointer_cast<nn::GRUCellImpl>(gru->clone(Device(kCUDA)));
  ASSERT_NE(gru_gpu, nullptr);
  EXPECT_TRUE(allclose(gru_gpu->forward(x.cuda(), h.cuda()).cpu(), gru(x, h), 1e-5, 1e-6));
}

TEST(RnnCellTest, Misuse) {
  nn::LSTMCell lstm(3, 4);
  nn::GRUCell gru(3, 4);
  EXPECT_KILN_ERROR(lstm(randn({2, 5})), "[LSTMCell] input has inconsistent input_size: got 5");
  EXPECT_KILN_ERROR(lstm(randn({2, 2, 3})), "[LSTMCell] expected a 2-D (batched) or 1-D");
  EXPECT_KILN_ERROR(lstm(randn({2, 3}, kDouble)), "[LSTMCell] input must have the dtype");
  EXPECT_KILN_ERROR(lstm(randn({2, 3}), std::make_tuple(randn({2, 4}), Tensor())),
                    "[LSTMCell] the state (h, c) must have both");
  EXPECT_KILN_ERROR(lstm(randn({2, 3}), std::make_tuple(randn({2, 4}), randn({3, 4}))),
                    "[LSTMCell] expected c_0 of shape [2, 4], got [3, 4]");
  EXPECT_KILN_ERROR(lstm(randn({3}), std::make_tuple(randn({1, 4}), randn({1, 4}))),
                    "[LSTMCell] expected h_0 of shape [4], got [1, 4]");
  EXPECT_KILN_ERROR(gru(randn({2, 3}), randn({2, 5})), "[GRUCell] expected hx of shape [2, 4]");
  EXPECT_KILN_ERROR(gru(randn({2, 3}), randn({2, 4}, kDouble)), "[GRUCell] hx (float64");
  EXPECT_KILN_ERROR(nn::GRUCell(3, 0), "[GRUCell] hidden_size must be positive, got 0");
  EXPECT_KILN_ERROR(nn::RNNCell(nn::RNNCellOptions(3, 4).nonlinearity(kiln::kSigmoid)),
                    "[RNNCell] nonlinearity must be kiln::kTanh or kiln::kReLU");
}

}  // namespace
}  // namespace kiln
