// The layers of issue 22 on the GPU: LSTM, GRU and RNN (the fused cells' CUDA kernels,
// kernels/cuda/rnn.cu), ConvTranspose1d/2d and LeakyReLU, each run on the CPU and on the GPU with
// the same parameters and inputs: outputs, final states and every gradient compared. The fused
// cells alone in every floating dtype, forward and backward. (Their decompositions against the
// CUDA kernels run in tests/kernels/gpu_decomposition_test.cpp, from decomposition_cases.h.)
//
// Suites named Gpu* carry the ctest label `gpu` and skip without a GPU.
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <functional>
#include <string>
#include <vector>

#include "kernels/gpu_test_util.h"
#include "test_util.h"

namespace kiln {
namespace {

namespace F = nn::functional;
using test::kGpu;

class GpuRnnLayers : public test::GpuTest {};

double max_diff(const Tensor& a, const Tensor& b) {
  return (a.detach().to(kCPU).to(kDouble) - b.detach().to(kCPU).to(kDouble))
      .abs()
      .max()
      .item<double>();
}

// Runs `fn` (outputs to compare, whose sum is differentiated) on the CPU, then moves `m` and the
// inputs to the GPU and runs it again; compares outputs and the gradients of m's parameters and
// of the inputs.
void expect_gpu_matches_cpu(
    nn::Module& m, std::vector<Tensor> inputs,
    const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& fn, double tol,
    const std::string& what) {
  SCOPED_TRACE(what);
  for (Tensor& t : inputs) t.requires_grad_(true);
  const std::vector<Tensor> cpu = fn(inputs);
  Tensor loss = cpu[0].sum();
  for (size_t i = 1; i < cpu.size(); ++i) loss = loss + cpu[i].sum() * 0.5;
  loss.backward();
  std::vector<Tensor> cpu_grads;
  for (const Tensor& p : m.parameters()) cpu_grads.push_back(p.grad().clone());
  for (const Tensor& t : inputs) cpu_grads.push_back(t.grad().clone());
  m.zero_grad();
  m.to(kGpu);
  std::vector<Tensor> gin;
  for (const Tensor& t : inputs) gin.push_back(t.detach().to(kGpu).requires_grad_(true));
  const std::vector<Tensor> gpu = fn(gin);
  ASSERT_EQ(gpu.size(), cpu.size());
  Tensor gloss = gpu[0].sum();
  for (size_t i = 1; i < gpu.size(); ++i) gloss = gloss + gpu[i].sum() * 0.5;
  gloss.backward();
  for (size_t i = 0; i < cpu.size(); ++i) {
    EXPECT_TRUE(gpu[i].device().is_cuda()) << "output " << i;
    EXPECT_EQ(gpu[i].sizes(), cpu[i].sizes()) << "output " << i;
    EXPECT_LE(max_diff(gpu[i], cpu[i]), tol) << "output " << i;
  }
  std::vector<Tensor> gpu_grads;
  for (const Tensor& p : m.parameters()) gpu_grads.push_back(p.grad());
  for (const Tensor& t : gin) gpu_grads.push_back(t.grad());
  for (size_t i = 0; i < cpu_grads.size(); ++i) {
    ASSERT_TRUE(gpu_grads[i].defined()) << "gradient " << i;
    EXPECT_LE(max_diff(gpu_grads[i], cpu_grads[i]), tol) << "gradient " << i;
  }
}

TEST_F(GpuRnnLayers, LstmMatchesCpu) {
  for (const ScalarType dt : {kFloat, kDouble}) {
    manual_seed(1);
    nn::LSTM lstm(nn::LSTMOptions(5, 16).num_layers(2).bidirectional(true).batch_first(true));
    lstm->to(dt);
    const double tol = dt == kFloat ? 1e-4 : 1e-10;
    expect_gpu_matches_cpu(
        *lstm, {randn({3, 7, 5}, dt), randn({4, 3, 16}, dt), randn({4, 3, 16}, dt)},
        [&](const std::vector<Tensor>& in) {
          auto [out, hc] = lstm(in[0], std::make_tuple(in[1], in[2]));
          return std::vector<Tensor>{out, std::get<0>(hc), std::get<1>(hc)};
        },
        tol, std::string("LSTM ") + std::string(dtype_name(dt)));
    manual_seed(2);
    nn::LSTM proj(nn::LSTMOptions(5, 16).proj_size(4));
    proj->to(dt);
    expect_gpu_matches_cpu(
        *proj, {randn({6, 2, 5}, dt)},
        [&](const std::vector<Tensor>& in) {
          auto [out, hc] = proj(in[0]);
          return std::vector<Tensor>{out, std::get<1>(hc)};
        },
        tol, std::string("LSTM proj_size ") + std::string(dtype_name(dt)));
  }
}

TEST_F(GpuRnnLayers, GruAndRnnMatchCpu) {
  for (const ScalarType dt : {kFloat, kDouble}) {
    const double tol = dt == kFloat ? 1e-4 : 1e-10;
    manual_seed(3);
    nn::GRU gru(nn::GRUOptions(5, 12).num_layers(2).bidirectional(true));
    gru->to(dt);
    expect_gpu_matches_cpu(
        *gru, {randn({7, 3, 5}, dt), randn({4, 3, 12}, dt)},
        [&](const std::vector<Tensor>& in) {
          auto [out, h] = gru(in[0], in[1]);
          return std::vector<Tensor>{out, h};
        },
        tol, std::string("GRU ") + std::string(dtype_name(dt)));
    for (const auto nl : {kiln::kTanh, kiln::kReLU}) {
      manual_seed(4);
      nn::RNN rnn(nn::RNNOptions(5, 12).num_layers(2).nonlinearity(nl));
      rnn->to(dt);
      expect_gpu_matches_cpu(
          *rnn, {randn({7, 3, 5}, dt)},
          [&](const std::vector<Tensor>& in) {
            auto [out, h] = rnn(in[0]);
            return std::vector<Tensor>{out, h};
          },
          tol, std::string("RNN ") + std::string(dtype_name(dt)));
    }
  }
}

TEST_F(GpuRnnLayers, FusedCellsMatchCpuInEveryDtype) {
  for (const ScalarType dt : test::kFloatDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    const double tol = dt == kDouble ? 1e-12 : dt == kFloat ? 1e-5 : 2e-2;
    manual_seed(5);
    const Tensor gates = (randn({33, 4 * 70}) * 2).to(dt), cx = randn({33, 70}).to(dt);
    const Tensor ghy = randn({33, 70}).to(dt), gcy = randn({33, 70}).to(dt);
    auto [hy, cy] = lstm_cell_fused(gates, cx);
    auto [ghy2, gcy2] = lstm_cell_fused(gates.to(kGpu), cx.to(kGpu));
    EXPECT_LE(max_diff(ghy2, hy), tol);
    EXPECT_LE(max_diff(gcy2, cy), tol);
    // The backward reads the forward's workspace (its output 2: the saved activations).
    const OpDef& fwd = Registry::get().op("lstm_cell_fused");
    const OpDef& bwd = Registry::get().op("lstm_cell_fused_backward");
    const TensorVec wc = call_op(fwd, {gates, cx});
    const TensorVec wg = call_op(fwd, {gates.to(kGpu), cx.to(kGpu)});
    EXPECT_LE(max_diff(wg[2], wc[2]), tol) << "lstm workspace";
    const TensorVec c = call_op(bwd, {ghy, gcy, wc[2], cx});
    const TensorVec g = call_op(bwd, {ghy.to(kGpu), gcy.to(kGpu), wg[2], cx.to(kGpu)});
    for (size_t i = 0; i < 2; ++i) EXPECT_LE(max_diff(g[i], c[i]), tol) << "lstm grad " << i;
    // Strided gates (a transposed view) take the copy path.
    const Tensor ig = (randn({3 * 40, 9}) * 2).to(dt).t(), hg = (randn({9, 3 * 40}) * 2).to(dt);
    const Tensor hx = randn({9, 40}).to(dt), gy = randn({9, 40}).to(dt);
    EXPECT_LE(
        max_diff(gru_cell_fused(ig.to(kGpu), hg.to(kGpu), hx.to(kGpu)), gru_cell_fused(ig, hg, hx)),
        tol);
    const OpDef& gbwd = Registry::get().op("gru_cell_fused_backward");
    const TensorVec gc = call_op(gbwd, {gy, ig, hg, hx});
    const TensorVec gg = call_op(gbwd, {gy.to(kGpu), ig.to(kGpu), hg.to(kGpu), hx.to(kGpu)});
    for (size_t i = 0; i < 3; ++i) EXPECT_LE(max_diff(gg[i], gc[i]), tol) << "gru grad " << i;
  }
}

TEST_F(GpuRnnLayers, ConvTransposeAndLeakyReluMatchCpu) {
  manual_seed(6);
  nn::ConvTranspose2d up(nn::ConvTranspose2dOptions(6, 4, 4).stride(2).padding(1).groups(2));
  up->to(kDouble);
  expect_gpu_matches_cpu(
      *up, {randn({2, 6, 5, 7}, kDouble)},
      [&](const std::vector<Tensor>& in) {
        return std::vector<Tensor>{up(in[0], std::vector<int64_t>{11, 14})};
      },
      1e-10, "ConvTranspose2d");
  nn::ConvTranspose1d up1(nn::ConvTranspose1dOptions(3, 5, 3).stride(3).dilation(2));
  expect_gpu_matches_cpu(
      *up1, {randn({2, 3, 9})},
      [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{up1(in[0])}; }, 1e-4,
      "ConvTranspose1d");
  nn::LeakyReLU act(nn::LeakyReLUOptions().negative_slope(0.2));
  expect_gpu_matches_cpu(
      *act, {randn({4, 9})},
      [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{act(in[0] * 2.0)}; }, 1e-6,
      "LeakyReLU");
}

}  // namespace
}  // namespace kiln
