// RNN, LSTM and GRU (nn/modules/rnn.h) and their fused cells (tensor/ops/rnn.cpp): the layers'
// outputs and final states against a plain f64 loop written here from PyTorch's equations, for
// every option (layers, bidirectional, batch_first, proj_size, bias, initial states, unbatched);
// gradients against finite differences (gradcheck) through whole layers and through the fused
// cells; the fused cells against their decompositions; parameter names, shapes and
// initialisation; dropout between layers; and every misuse.
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "autograd/grad_test_util.h"
#include "test_util.h"

namespace kiln {
namespace {

using gradtest::check_grad;
using gradtest::variable_list;

std::vector<double> values(const Tensor& t) {
  return t.detach().to(kCPU).to(kDouble).contiguous().to_vector<double>();
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

enum class Mode { kTanh, kRelu, kLstm, kGru };

// The reference: PyTorch's equations as loops over doubles, reading the module's parameters by
// name. x is time-major [T][B][I]; returns output [T, B, D * H'], h_n, c_n as flat vectors.
struct Reference {
  std::vector<double> output, h_n, c_n;
};

Reference reference(const nn::Module& m, Mode mode, const std::vector<double>& x, int64_t steps,
                    int64_t batch, int64_t input_size, int64_t hidden, int64_t layers, bool bidir,
                    int64_t proj, const std::vector<double>& h0, const std::vector<double>& c0) {
  std::map<std::string, std::vector<double>> p;
  for (const auto& item : m.named_parameters()) p[item.key()] = values(item.value());
  const int64_t g = mode == Mode::kLstm ? 4 : mode == Mode::kGru ? 3 : 1;
  const int64_t dirs = bidir ? 2 : 1, out = proj > 0 ? proj : hidden;
  std::vector<double> in = x;
  int64_t in_size = input_size;
  Reference r;
  r.h_n.assign(layers * dirs * batch * out, 0.0);
  r.c_n.assign(layers * dirs * batch * hidden, 0.0);
  for (int64_t l = 0; l < layers; ++l) {
    std::vector<double> layer_out(steps * batch * dirs * out);
    for (int64_t d = 0; d < dirs; ++d) {
      const int64_t idx = l * dirs + d;
      const std::string s = std::to_string(l) + (d ? "_reverse" : "");
      const std::vector<double>& wih = p["weight_ih_l" + s];
      const std::vector<double>& whh = p["weight_hh_l" + s];
      const std::vector<double> zero(g * hidden, 0.0);
      const std::vector<double>& bih = p.count("bias_ih_l" + s) ? p["bias_ih_l" + s] : zero;
      const std::vector<double>& bhh = p.count("bias_hh_l" + s) ? p["bias_hh_l" + s] : zero;
      std::vector<double> h(h0.begin() + idx * batch * out, h0.begin() + (idx + 1) * batch * out);
      std::vector<double> c(batch * hidden, 0.0);
      if (mode == Mode::kLstm) {
        c.assign(c0.begin() + idx * batch * hidden, c0.begin() + (idx + 1) * batch * hidden);
      }
      for (int64_t st = 0; st < steps; ++st) {
        const int64_t t = d == 0 ? st : steps - 1 - st;
        std::vector<double> hnew(batch * out), cnew(batch * hidden);
        for (int64_t b = 0; b < batch; ++b) {
          std::vector<double> ig(g * hidden), hg(g * hidden);
          for (int64_t k = 0; k < g * hidden; ++k) {
            double a = bih[k], e = bhh[k];
            for (int64_t q = 0; q < in_size; ++q) {
              a += wih[k * in_size + q] * in[(t * batch + b) * in_size + q];
            }
            for (int64_t q = 0; q < out; ++q) e += whh[k * out + q] * h[b * out + q];
            ig[k] = a;
            hg[k] = e;
          }
          std::vector<double> hfull(hidden);
          for (int64_t j = 0; j < hidden; ++j) {
            if (mode == Mode::kLstm) {
              const auto gate = [&](int64_t k) { return ig[k * hidden + j] + hg[k * hidden + j]; };
              const double cc =
                  sigmoid(gate(1)) * c[b * hidden + j] + sigmoid(gate(0)) * std::tanh(gate(2));
              cnew[b * hidden + j] = cc;
              hfull[j] = sigmoid(gate(3)) * std::tanh(cc);
            } else if (mode == Mode::kGru) {
              const double rr = sigmoid(ig[j] + hg[j]);
              const double z = sigmoid(ig[hidden + j] + hg[hidden + j]);
              const double n = std::tanh(ig[2 * hidden + j] + rr * hg[2 * hidden + j]);
              hfull[j] = (1 - z) * n + z * h[b * out + j];
            } else {
              const double a = ig[j] + hg[j];
              hfull[j] = mode == Mode::kTanh ? std::tanh(a) : std::max(a, 0.0);
            }
          }
          for (int64_t j = 0; j < out; ++j) {
            double v = hfull[j];
            if (proj > 0) {
              const std::vector<double>& whr = p["weight_hr_l" + s];
              v = 0;
              for (int64_t q = 0; q < hidden; ++q) v += whr[j * hidden + q] * hfull[q];
            }
            hnew[b * out + j] = v;
            layer_out[(t * batch + b) * dirs * out + d * out + j] = v;
          }
        }
        h = hnew;
        if (mode == Mode::kLstm) c = cnew;
      }
      std::copy(h.begin(), h.end(), r.h_n.begin() + idx * batch * out);
      std::copy(c.begin(), c.end(), r.c_n.begin() + idx * batch * hidden);
    }
    in = layer_out;
    in_size = dirs * out;
  }
  r.output = in;
  return r;
}

void expect_near(const std::vector<double>& got, const std::vector<double>& want, double tol,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << what << " @" << i;
}

struct Config {
  int64_t layers;
  bool bidir, batch_first, bias, with_state;
  int64_t proj;
};

const Config kConfigs[] = {
    {1, false, false, true, false, 0}, {2, true, false, true, true, 0},
    {2, false, true, false, true, 0},  {1, true, true, true, false, 0},
    {3, true, false, true, true, 0},
};

TEST(RnnTest, LstmMatchesReference) {
  manual_seed(1);
  const int64_t steps = 5, batch = 3, in = 4, hidden = 6;
  std::vector<Config> configs(std::begin(kConfigs), std::end(kConfigs));
  configs.push_back({2, true, false, true, true, 3});  // proj_size
  configs.push_back({1, false, true, true, false, 2});
  for (const Config& cfg : configs) {
    SCOPED_TRACE("layers " + std::to_string(cfg.layers) + " bidir " + std::to_string(cfg.bidir) +
                 " batch_first " + std::to_string(cfg.batch_first) + " proj " +
                 std::to_string(cfg.proj));
    nn::LSTM lstm(nn::LSTMOptions(in, hidden)
                      .num_layers(cfg.layers)
                      .bidirectional(cfg.bidir)
                      .batch_first(cfg.batch_first)
                      .bias(cfg.bias)
                      .proj_size(cfg.proj));
    lstm->to(kDouble);
    const int64_t dirs = cfg.bidir ? 2 : 1, out = cfg.proj > 0 ? cfg.proj : hidden;
    const Tensor x = randn({steps, batch, in}, kDouble);
    Tensor h0 = zeros({cfg.layers * dirs, batch, out}, kDouble);
    Tensor c0 = zeros({cfg.layers * dirs, batch, hidden}, kDouble);
    std::optional<std::tuple<Tensor, Tensor>> state;
    if (cfg.with_state) {
      h0 = randn(h0.sizes(), kDouble);
      c0 = randn(c0.sizes(), kDouble);
      state = std::make_tuple(h0, c0);
    }
    auto [output, hc] = lstm(cfg.batch_first ? x.transpose(0, 1) : x, state);
    auto [h_n, c_n] = hc;
    ASSERT_EQ(output.sizes(), (cfg.batch_first ? Shape{batch, steps, dirs * out}
                                               : Shape{steps, batch, dirs * out}));
    ASSERT_EQ(h_n.sizes(), (Shape{cfg.layers * dirs, batch, out}));
    ASSERT_EQ(c_n.sizes(), (Shape{cfg.layers * dirs, batch, hidden}));
    const Reference r = reference(*lstm, Mode::kLstm, values(x), steps, batch, in, hidden,
                                  cfg.layers, cfg.bidir, cfg.proj, values(h0), values(c0));
    expect_near(values(cfg.batch_first ? output.transpose(0, 1) : output), r.output, 1e-12,
                "output");
    expect_near(values(h_n), r.h_n, 1e-12, "h_n");
    expect_near(values(c_n), r.c_n, 1e-12, "c_n");
  }
}

TEST(RnnTest, GruAndRnnMatchReference) {
  manual_seed(2);
  const int64_t steps = 4, batch = 2, in = 3, hidden = 5;
  for (const Mode mode : {Mode::kGru, Mode::kTanh, Mode::kRelu}) {
    for (const Config& cfg : kConfigs) {
      SCOPED_TRACE("mode " + std::to_string(static_cast<int>(mode)) + " layers " +
                   std::to_string(cfg.layers) + " bidir " + std::to_string(cfg.bidir));
      const int64_t dirs = cfg.bidir ? 2 : 1;
      const Tensor x = randn({steps, batch, in}, kDouble);
      const Tensor h0 = cfg.with_state ? randn({cfg.layers * dirs, batch, hidden}, kDouble)
                                       : zeros({cfg.layers * dirs, batch, hidden}, kDouble);
      const Tensor given = cfg.with_state ? h0 : Tensor();
      const Tensor xin = cfg.batch_first ? x.transpose(0, 1) : x;
      std::shared_ptr<nn::Module> m;
      Tensor output, h_n;
      if (mode == Mode::kGru) {
        nn::GRU gru(nn::GRUOptions(in, hidden)
                        .num_layers(cfg.layers)
                        .bidirectional(cfg.bidir)
                        .batch_first(cfg.batch_first)
                        .bias(cfg.bias));
        gru->to(kDouble);
        std::tie(output, h_n) = gru(xin, given);
        m = gru.ptr();
      } else {
        nn::RNN rnn(nn::RNNOptions(in, hidden)
                        .num_layers(cfg.layers)
                        .nonlinearity(mode == Mode::kTanh ? kiln::kTanh : kiln::kReLU)
                        .bidirectional(cfg.bidir)
                        .batch_first(cfg.batch_first)
                        .bias(cfg.bias));
        rnn->to(kDouble);
        std::tie(output, h_n) = rnn(xin, given);
        m = rnn.ptr();
      }
      const Reference r = reference(*m, mode, values(x), steps, batch, in, hidden, cfg.layers,
                                    cfg.bidir, 0, values(h0), {});
      expect_near(values(cfg.batch_first ? output.transpose(0, 1) : output), r.output, 1e-12,
                  "output");
      expect_near(values(h_n), r.h_n, 1e-12, "h_n");
    }
  }
}

TEST(RnnTest, UnbatchedInputDropsTheBatchDim) {
  manual_seed(3);
  nn::LSTM lstm(nn::LSTMOptions(3, 4).num_layers(2).batch_first(true));
  const Tensor x = randn({5, 3});
  const Tensor h0 = randn({2, 4}), c0 = randn({2, 4});
  auto [out, hc] = lstm(x, std::make_tuple(h0, c0));
  ASSERT_EQ(out.sizes(), (Shape{5, 4}));
  ASSERT_EQ(std::get<0>(hc).sizes(), (Shape{2, 4}));
  // The same as a batch of one.
  auto [out1, hc1] = lstm(x.unsqueeze(0), std::make_tuple(h0.unsqueeze(1), c0.unsqueeze(1)));
  EXPECT_TRUE(allclose(out, out1.squeeze(0), 1e-6, 1e-7));
  EXPECT_TRUE(allclose(std::get<1>(hc), std::get<1>(hc1).squeeze(1), 1e-6, 1e-7));
  nn::GRU gru(3, 4);
  auto [gout, gh] = gru(x);
  EXPECT_EQ(gout.sizes(), (Shape{5, 4}));
  EXPECT_EQ(gh.sizes(), (Shape{1, 4}));
}

TEST(RnnTest, ParametersFollowPyTorchNamesShapesAndInit) {
  manual_seed(4);
  nn::LSTM lstm(nn::LSTMOptions(3, 8).num_layers(2).bidirectional(true).proj_size(2));
  std::vector<std::string> names;
  for (const auto& item : lstm->named_parameters()) names.push_back(item.key());
  const std::vector<std::string> want = {
      "weight_ih_l0",         "weight_hh_l0",         "bias_ih_l0",
      "bias_hh_l0",           "weight_hr_l0",         "weight_ih_l0_reverse",
      "weight_hh_l0_reverse", "bias_ih_l0_reverse",   "bias_hh_l0_reverse",
      "weight_hr_l0_reverse", "weight_ih_l1",         "weight_hh_l1",
      "bias_ih_l1",           "bias_hh_l1",           "weight_hr_l1",
      "weight_ih_l1_reverse", "weight_hh_l1_reverse", "bias_ih_l1_reverse",
      "bias_hh_l1_reverse",   "weight_hr_l1_reverse"};
  EXPECT_EQ(names, want);
  const auto params = lstm->named_parameters();
  EXPECT_EQ(params["weight_ih_l0"].sizes(), (Shape{32, 3}));
  EXPECT_EQ(params["weight_hh_l0"].sizes(), (Shape{32, 2}));
  EXPECT_EQ(params["weight_hr_l0"].sizes(), (Shape{2, 8}));
  EXPECT_EQ(params["weight_ih_l1"].sizes(), (Shape{32, 4}));  // 2 directions * proj_size
  EXPECT_EQ(lstm->all_weights().size(), 20u);
  const double bound = 1.0 / std::sqrt(8.0);
  for (const Tensor& p : lstm->parameters()) {
    EXPECT_LE(p.abs().max().item<double>(), bound);
  }
  nn::GRU gru(nn::GRUOptions(5, 7).bias(false));
  EXPECT_EQ(gru->parameters().size(), 2u);
  EXPECT_EQ(gru->named_parameters()["weight_ih_l0"].sizes(), (Shape{21, 5}));
  nn::RNN rnn(5, 7);
  EXPECT_EQ(rnn->named_parameters()["weight_hh_l0"].sizes(), (Shape{7, 7}));
  std::ostringstream os;
  lstm->pretty_print(os);
  EXPECT_EQ(os.str(),
            "kiln::nn::LSTM(input_size=3, hidden_size=8, num_layers=2, bias=true, "
            "batch_first=false, dropout=0, bidirectional=true, proj_size=2)");
}

TEST(RnnTest, DropoutAppliesBetweenLayersOnlyWhileTraining) {
  manual_seed(5);
  nn::LSTM lstm(nn::LSTMOptions(3, 4).num_layers(2).dropout(1.0));
  nn::LSTM plain(nn::LSTMOptions(3, 4).num_layers(2));
  {
    NoGradGuard no_grad;
    for (size_t i = 0; i < plain->parameters().size(); ++i) {
      plain->parameters()[i].copy_(lstm->parameters()[i]);
    }
  }
  const Tensor x = randn({4, 2, 3});
  lstm->eval();
  EXPECT_TRUE(allclose(std::get<0>(lstm(x)), std::get<0>(plain(x))));
  lstm->train();
  // p = 1 zeroes the second layer's input: its output is that of a zero input.
  const Tensor trained = std::get<0>(lstm(x));
  nn::LSTM second(nn::LSTMOptions(4, 4));
  {
    NoGradGuard no_grad;
    for (size_t i = 0; i < 4; ++i) second->parameters()[i].copy_(lstm->parameters()[4 + i]);
  }
  EXPECT_TRUE(allclose(trained, std::get<0>(second(zeros({4, 2, 4}))), 1e-6, 1e-7));
  EXPECT_FALSE(allclose(trained, std::get<0>(plain(x)), 1e-3, 1e-3));
}

// Whole layers against finite differences: input, initial states and every parameter.
TEST(RnnTest, LayersGradcheck) {
  manual_seed(6);
  const Tensor x = gradtest::leaf({3, 2, 3});
  {
    nn::LSTM lstm(nn::LSTMOptions(3, 2).num_layers(2).bidirectional(true));
    lstm->to(kDouble);
    const Tensor h0 = gradtest::leaf({4, 2, 2}), c0 = gradtest::leaf({4, 2, 2});
    variable_list inputs{x, h0, c0};
    for (const Tensor& p : lstm->parameters()) inputs.push_back(p);
    EXPECT_TRUE(check_grad(
        {"lstm_cell_fused", "addmm"},
        [&](const variable_list& in) {
          auto [out, hc] = lstm(in[0], std::make_tuple(in[1], in[2]));
          return cat({out.flatten(), std::get<0>(hc).flatten(), std::get<1>(hc).flatten()});
        },
        inputs));
  }
  {
    nn::LSTM lstm(nn::LSTMOptions(3, 3).proj_size(2).batch_first(true));
    lstm->to(kDouble);
    variable_list inputs{x};
    for (const Tensor& p : lstm->parameters()) inputs.push_back(p);
    EXPECT_TRUE(check_grad(
        {"lstm_cell_fused"},
        [&](const variable_list& in) {
          auto [out, hc] = lstm(in[0]);
          return cat({out.flatten(), std::get<1>(hc).flatten()});
        },
        inputs));
  }
  {
    nn::GRU gru(nn::GRUOptions(3, 2).num_layers(2).bidirectional(true));
    gru->to(kDouble);
    const Tensor h0 = gradtest::leaf({4, 2, 2});
    variable_list inputs{x, h0};
    for (const Tensor& p : gru->parameters()) inputs.push_back(p);
    EXPECT_TRUE(check_grad(
        {"gru_cell_fused"},
        [&](const variable_list& in) {
          auto [out, h] = gru(in[0], in[1]);
          return cat({out.flatten(), h.flatten()});
        },
        inputs));
  }
  for (const auto nl : {kiln::kTanh, kiln::kReLU}) {
    nn::RNN rnn(nn::RNNOptions(3, 2).num_layers(2).nonlinearity(nl));
    rnn->to(kDouble);
    variable_list inputs{x};
    for (const Tensor& p : rnn->parameters()) inputs.push_back(p);
    EXPECT_TRUE(check_grad(
        {"addmm"},
        [&](const variable_list& in) {
          auto [out, h] = rnn(in[0]);
          return cat({out.flatten(), h.flatten()});
        },
        inputs));
  }
}

// The fused cells on their own (the coverage test lists them as gradchecked here), with gates
// read through strides.
TEST(RnnTest, FusedCellsGradcheck) {
  manual_seed(7);
  const Tensor gates = gradtest::leaf({3, 8}, 2.0), cx = gradtest::leaf({3, 2});
  EXPECT_TRUE(check_grad({"lstm_cell_fused"},
                         [](const variable_list& in) {
                           auto [hy, cy] = lstm_cell_fused(in[0], in[1]);
                           return cat({hy.flatten(), cy.flatten()});
                         },
                         {gates, cx}));
  // Only hy used: grad_cy arrives as zeros.
  EXPECT_TRUE(check_grad(
      {"lstm_cell_fused"},
      [](const variable_list& in) { return std::get<0>(lstm_cell_fused(in[0].t().t(), in[1])); },
      {gates, cx}));
  const Tensor ig = gradtest::leaf({9, 2}, 2.0), hg = gradtest::leaf({2, 9}, 2.0);
  const Tensor hx = gradtest::leaf({2, 3});
  EXPECT_TRUE(
      check_grad({"gru_cell_fused"},
                 [](const variable_list& in) { return gru_cell_fused(in[0].t(), in[1], in[2]); },
                 {ig, hg, hx}));
}

TEST(RnnTest, UnbindCopyGivesFreshSlicesAndStacksGradients) {
  manual_seed(11);
  const Tensor x = gradtest::leaf({3, 4, 2});
  const std::vector<Tensor> parts = unbind_copy(x.transpose(0, 1), 0);
  ASSERT_EQ(parts.size(), 4u);
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(equal(parts[i], x.select(1, i)));
    EXPECT_TRUE(parts[i].is_contiguous());
  }
  EXPECT_TRUE(check_grad({"unbind_copy"},
                         [](const variable_list& in) {
                           const std::vector<Tensor> p = unbind_copy(in[0], -1);
                           return p[0] * 2.0 + p[1].square();  // and a slice that gets no gradient
                         },
                         {x}));
  EXPECT_TRUE(check_grad({"unbind_copy"},
                         [](const variable_list& in) { return unbind_copy(in[0], 2)[1]; }, {x}));
  EXPECT_TRUE(unbind_copy(zeros({0, 3})).empty());
  EXPECT_KILN_ERROR(unbind_copy(tensor(1.0)), "[unbind_copy] cannot unbind a 0-d tensor");
}

TEST(RnnTest, FusedCellsMatchTheirEquationsInEveryDtype) {
  manual_seed(8);
  for (const ScalarType dt : {kFloat, kDouble, kBFloat16, kFloat16}) {
    const Tensor gates = (randn({4, 12}) * 2).to(dt), cx = randn({4, 3}).to(dt);
    auto [hy, cy] = lstm_cell_fused(gates, cx);
    ASSERT_EQ(hy.dtype(), dt);
    const Tensor g = gates.to(kDouble);
    const auto part = [&](int64_t k) { return g.narrow(1, 3 * k, 3); };
    const Tensor cref = part(1).sigmoid() * cx.to(kDouble) + part(0).sigmoid() * part(2).tanh();
    const Tensor href = part(3).sigmoid() * cref.tanh();
    const double tol = dt == kBFloat16 ? 2e-2 : dt == kFloat16 ? 2e-3 : 1e-6;
    EXPECT_TRUE(allclose(cy.to(kDouble), cref, tol, tol)) << dtype_name(dt);
    EXPECT_TRUE(allclose(hy.to(kDouble), href, tol, tol)) << dtype_name(dt);
    const Tensor ig = (randn({4, 9}) * 2).to(dt), hg = (randn({4, 9}) * 2).to(dt);
    const Tensor hx = randn({4, 3}).to(dt);
    const Tensor i = ig.to(kDouble), h = hg.to(kDouble);
    const Tensor r = (i.narrow(1, 0, 3) + h.narrow(1, 0, 3)).sigmoid();
    const Tensor z = (i.narrow(1, 3, 3) + h.narrow(1, 3, 3)).sigmoid();
    const Tensor n = (i.narrow(1, 6, 3) + r * h.narrow(1, 6, 3)).tanh();
    const Tensor gref = (1.0 - z) * n + z * hx.to(kDouble);
    EXPECT_TRUE(allclose(gru_cell_fused(ig, hg, hx).to(kDouble), gref, tol, tol)) << dtype_name(dt);
  }
}

TEST(RnnTest, RejectsMisuse) {
  nn::LSTM lstm(nn::LSTMOptions(3, 4).num_layers(2));
  EXPECT_KILN_ERROR(lstm(randn({5, 2, 7})), "[LSTM] input.size(-1) must be equal to input_size");
  EXPECT_KILN_ERROR(lstm(randn({5})), "[LSTM] expected a 3-D (batched) or 2-D (unbatched)");
  EXPECT_KILN_ERROR(lstm(randn({5, 2, 3}, kDouble)), "[LSTM] input must have the dtype");
  EXPECT_KILN_ERROR(lstm(randn({0, 2, 3})), "[LSTM] expected a sequence length larger than 0");
  EXPECT_KILN_ERROR(lstm(randn({5, 2, 3}), std::make_tuple(randn({1, 2, 4}), randn({2, 2, 4}))),
                    "[LSTM] expected h_0 of shape [2, 2, 4], got [1, 2, 4]");
  EXPECT_KILN_ERROR(lstm(randn({5, 2, 3}), std::make_tuple(randn({2, 2, 4}), randn({2, 3, 4}))),
                    "[LSTM] expected c_0 of shape [2, 2, 4]");
  EXPECT_KILN_ERROR(lstm(randn({5, 2, 3}), std::make_tuple(randn({2, 2, 4}), Tensor())),
                    "[LSTM] the initial state (h_0, c_0) must have both");
  nn::GRU gru(3, 4);
  EXPECT_KILN_ERROR(gru(randn({5, 2, 3}), randn({1, 2, 5})), "[GRU] expected hx of shape");
  EXPECT_KILN_ERROR(nn::LSTM(nn::LSTMOptions(3, 4).proj_size(4)),
                    "[LSTM] proj_size (4) has to be smaller than hidden_size (4)");
  EXPECT_KILN_ERROR(nn::GRU(nn::GRUOptions(3, 0)), "[GRU] hidden_size must be positive");
  EXPECT_KILN_ERROR(nn::RNN(nn::RNNOptions(3, 4).num_layers(0)), "[RNN] num_layers must be");
  EXPECT_KILN_ERROR(nn::RNN(nn::RNNOptions(3, 4).dropout(1.5)), "[RNN] dropout should be");
  EXPECT_KILN_ERROR(nn::RNN(nn::RNNOptions(3, 4).nonlinearity(kiln::kSigmoid)),
                    "[RNN] nonlinearity must be kiln::kTanh or kiln::kReLU");
  EXPECT_KILN_ERROR(lstm_cell_fused(randn({2, 7}), randn({2, 2})),
                    "[lstm_cell_fused] expected gates of shape [batch, 4 * hidden_size]");
  EXPECT_KILN_ERROR(lstm_cell_fused(randn({2, 8}), randn({3, 2})),
                    "[lstm_cell_fused] expected cx of shape [2, 2], got [3, 2]");
  EXPECT_KILN_ERROR(lstm_cell_fused(randn({2, 8}), randn({2, 2}, kDouble)),
                    "[lstm_cell_fused] cx (float64) must have the dtype of the gates (float32)");
  EXPECT_KILN_ERROR(gru_cell_fused(randn({2, 6}), randn({2, 3}), randn({2, 2})),
                    "[gru_cell_fused] expected hgates of shape [2, 6]");
  EXPECT_KILN_ERROR(
      gru_cell_fused(arange(6).view({1, 6}), arange(6).view({1, 6}), arange(2).view({1, 2})),
      "[gru_cell_fused] expected floating-point igates");
}

// Under CPU autocast the GEMMs run in bf16 and the cells take the promoted (f32) gates: the
// layers run, stay f32 where PyTorch's do, and stay close to the f32 results.
TEST(RnnTest, LayersRunUnderAutocast) {
  manual_seed(10);
  nn::LSTM lstm(nn::LSTMOptions(4, 8).num_layers(2));
  nn::GRU gru(4, 8);
  const Tensor x = randn({5, 3, 4});
  const Tensor want_lstm = std::get<0>(lstm(x)), want_gru = std::get<0>(gru(x));
  Tensor got_lstm, got_gru;
  {
    AutocastGuard autocast(kCPU, kBFloat16);
    got_lstm = std::get<0>(lstm(x));
    got_gru = std::get<0>(gru(x));
    (got_lstm.sum() + got_gru.sum()).backward();
  }
  EXPECT_EQ(got_lstm.dtype(), kFloat);
  EXPECT_TRUE(allclose(got_lstm, want_lstm, 0.05, 0.05));
  EXPECT_TRUE(allclose(got_gru.to(kFloat), want_gru, 0.05, 0.05));
  EXPECT_TRUE(lstm->parameters()[0].grad().defined());
}

// A tiny sequence task trains: the LSTM learns to output the running sum's sign.
TEST(RnnTest, LstmTrainsOnASequenceTask) {
  manual_seed(9);
  nn::LSTM lstm(nn::LSTMOptions(1, 8).batch_first(true));
  nn::Linear head(8, 1);
  std::vector<Tensor> params = lstm->parameters();
  for (const Tensor& p : head->parameters()) params.push_back(p);
  optim::Adam opt(params, optim::AdamOptions(0.05));
  const Tensor x = randn({16, 6, 1});
  const Tensor y = (x.cumsum(1) > 0).to(kFloat);
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    opt.zero_grad();
    const Tensor logits = head(std::get<0>(lstm(x)));
    const Tensor loss = binary_cross_entropy_with_logits(logits, y);
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, 0.5 * first);
}

}  // namespace
}  // namespace kiln
