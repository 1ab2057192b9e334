// RNN, LSTM and GRU (nn/modules/rnn.h); the fused cells are registry ops (tensor/ops/rnn.cpp).
#include "nn/modules/rnn.h"

#include <cmath>

#include "tensor/ops.h"

namespace kiln::nn {
namespace internal {
namespace {

int64_t gate_count(RnnMode mode) {
  switch (mode) {
    case RnnMode::kLstm:
      return 4;
    case RnnMode::kGru:
      return 3;
    default:
      return 1;
  }
}

}  // namespace

const char* RNNImplBase::name() const {
  switch (config_.mode) {
    case RnnMode::kLstm:
      return "LSTM";
    case RnnMode::kGru:
      return "GRU";
    default:
      return "RNN";
  }
}

RNNImplBase::RNNImplBase(const RnnConfig& config) : config_(config) {
  const char* n = name();
  const RnnConfig& c = config_;
  KILN_CHECK(c.input_size > 0, "[", n, "] input_size must be positive, got ", c.input_size);
  KILN_CHECK(c.hidden_size > 0, "[", n, "] hidden_size must be positive, got ", c.hidden_size);
  KILN_CHECK(c.num_layers > 0, "[", n, "] num_layers must be positive, got ", c.num_layers);
  KILN_CHECK(c.dropout >= 0.0 && c.dropout <= 1.0, "[", n,
             "] dropout should be a number in range [0, 1] representing the probability of an "
             "element being zeroed, got ",
             c.dropout);
  KILN_CHECK(c.proj_size >= 0, "[", n, "] proj_size must be non-negative, got ", c.proj_size);
  KILN_CHECK(c.proj_size < c.hidden_size, "[", n, "] proj_size (", c.proj_size,
             ") has to be smaller than hidden_size (", c.hidden_size, ")");
  const int64_t gates = gate_count(c.mode) * c.hidden_size;
  const int64_t out = c.proj_size > 0 ? c.proj_size : c.hidden_size;
  const int64_t dirs = c.bidirectional ? 2 : 1;
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    const int64_t in = layer == 0 ? c.input_size : out * dirs;
    for (int64_t dir = 0; dir < dirs; ++dir) {
      const std::string s = std::to_string(layer) + (dir == 1 ? "_reverse" : "");
      Weights w;
      w.w_ih = register_parameter("weight_ih_l" + s, kiln::empty({gates, in}));
      w.w_hh = register_parameter("weight_hh_l" + s, kiln::empty({gates, out}));
      if (c.bias) {
        w.b_ih = register_parameter("bias_ih_l" + s, kiln::empty({gates}));
        w.b_hh = register_parameter("bias_hh_l" + s, kiln::empty({gates}));
      }
      if (c.proj_size > 0) {
        w.w_hr = register_parameter("weight_hr_l" + s, kiln::empty({c.proj_size, c.hidden_size}));
      }
      weights_.push_back(w);
    }
  }
  reset_parameters();
}

void RNNImplBase::reset_parameters() {
  const double bound = 1.0 / std::sqrt(static_cast<double>(config_.hidden_size));
  for (Tensor& p : parameters()) init::uniform_(p, -bound, bound);
}

std::vector<Tensor> RNNImplBase::all_weights() const { return parameters(); }

void RNNImplBase::pretty_print(std::ostream& stream) const {
  const RnnConfig& c = config_;
  stream << std::boolalpha << "kiln::nn::" << name() << "(input_size=" << c.input_size
         << ", hidden_size=" << c.hidden_size << ", num_layers=" << c.num_layers
         << ", bias=" << c.bias << ", batch_first=" << c.batch_first << ", dropout=" << c.dropout
         << ", bidirectional=" << c.bidirectional;
  if (c.mode == RnnMode::kRnnRelu) stream << ", nonlinearity=relu";
  if (c.proj_size > 0) stream << ", proj_size=" << c.proj_size;
  stream << ")";
}

std::tuple<Tensor, Tensor, Tensor> RNNImplBase::run(const Tensor& input, const Tensor& hx_in,
                                                    const Tensor& cx_in) const {
  const char* n = name();
  const RnnConfig& c = config_;
  const Tensor& w0 = weights_[0].w_ih;
  KILN_CHECK(input.defined(), "[", n, "] input is undefined");
  KILN_CHECK(input.dim() == 2 || input.dim() == 3, "[", n,
             "] expected a 3-D (batched) or 2-D (unbatched) input, got shape ",
             shape_str(input.sizes()));
  KILN_CHECK(input.dtype() == w0.dtype(), "[", n, "] input must have the dtype of the parameters (",
             dtype_name(w0.dtype()), "), got ", dtype_name(input.dtype()));
  KILN_CHECK(input.device() == w0.device(), "[", n, "] input is on ", input.device().str(),
             " but the parameters are on ", w0.device().str());
  KILN_CHECK(input.size(-1) == c.input_size, "[", n, "] input.size(-1) must be equal to ",
             "input_size. Expected ", c.input_size, ", got ", input.size(-1), " (input shape ",
             shape_str(input.sizes()), ")");
  const bool unbatched = input.dim() == 2;
  // Time-major [T, B, in] from here on.
  const Tensor x = unbatched ? input.unsqueeze(1) : c.batch_first ? input.transpose(0, 1) : input;
  const int64_t steps = x.size(0), batch = x.size(1);
  KILN_CHECK(steps > 0, "[", n, "] expected a sequence length larger than 0, got input shape ",
             shape_str(input.sizes()));
  const int64_t dirs = c.bidirectional ? 2 : 1;
  const int64_t out_size = c.proj_size > 0 ? c.proj_size : c.hidden_size;
  const auto state = [&](const Tensor& s, int64_t features, const char* what) {
    const Shape want = unbatched ? Shape{c.num_layers * dirs, features}
                                 : Shape{c.num_layers * dirs, batch, features};
    if (!s.defined()) {
      return kiln::zeros({c.num_layers * dirs, batch, features},
                         TensorOptions(x.dtype()).device(x.device()));
    }
    KILN_CHECK(s.sizes() == want, "[", n, "] expected ", what, " of shape ", shape_str(want),
               ", got ", shape_str(s.sizes()), " (input shape ", shape_str(input.sizes()), ")");
    KILN_CHECK(s.dtype() == x.dtype() && s.device() == x.device(), "[", n, "] ", what, " (",
               dtype_name(s.dtype()), " on ", s.device().str(), ") must match the input (",
               dtype_name(x.dtype()), " on ", x.device().str(), ")");
    return unbatched ? s.unsqueeze(1) : s;
  };
  const Tensor h0 = state(hx_in, out_size, c.mode == RnnMode::kLstm ? "h_0" : "hx");
  const Tensor c0 = c.mode == RnnMode::kLstm ? state(cx_in, c.hidden_size, "c_0") : Tensor();

  std::vector<Tensor> h_n, c_n;
  Tensor layer_input = x;
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    std::vector<Tensor> dir_outputs;
    for (int64_t dir = 0; dir < dirs; ++dir) {
      const int64_t idx = layer * dirs + dir;
      const Weights& w = weights_[idx];
      // All time steps' input projections in one GEMM. LSTM and RNN fold both biases into it;
      // GRU keeps b_hh with the hidden projection (r gates its n part).
      Tensor bias;
      if (c.bias) bias = c.mode == RnnMode::kGru ? w.b_ih : w.b_ih + w.b_hh;
      // [T, B, G * H], split into steps by unbind_copy: its gradient is one stack.
      const std::vector<Tensor> xproj = kiln::unbind_copy(kiln::linear(layer_input, w.w_ih, bias));
      const Tensor w_hh_t = w.w_hh.t();
      Tensor h = h0.select(0, idx), cell = c0.defined() ? c0.select(0, idx) : Tensor();
      std::vector<Tensor> hs(steps);
      for (int64_t s = 0; s < steps; ++s) {
        const int64_t t = dir == 0 ? s : steps - 1 - s;
        const Tensor& xt = xproj[t];
        switch (c.mode) {
          case RnnMode::kLstm: {
            auto [hy, cy] = kiln::lstm_cell_fused(kiln::addmm(xt, h, w_hh_t), cell);
            h = w.w_hr.defined() ? hy.matmul(w.w_hr.t()) : hy;
            cell = cy;
            break;
          }
          case RnnMode::kGru:
            h = kiln::gru_cell_fused(xt, kiln::linear(h, w.w_hh, c.bias ? w.b_hh : Tensor()), h);
            break;
          case RnnMode::kRnnTanh:
            h = kiln::addmm(xt, h, w_hh_t).tanh();
            break;
          case RnnMode::kRnnRelu:
            h = kiln::addmm(xt, h, w_hh_t).relu();
            break;
        }
        hs[t] = h;
      }
      dir_outputs.push_back(kiln::stack(hs, 0));
      h_n.push_back(h);
      if (cell.defined()) c_n.push_back(cell);
    }
    layer_input = dirs == 1 ? dir_outputs[0] : kiln::cat(dir_outputs, 2);
    if (c.dropout > 0 && is_training() && layer + 1 < c.num_layers) {
      layer_input = functional::dropout(layer_input, functional::DropoutFuncOptions().p(c.dropout));
    }
  }
  Tensor output = layer_input, hn = kiln::stack(h_n, 0);
  Tensor cn = c_n.empty() ? Tensor() : kiln::stack(c_n, 0);
  if (unbatched) {
    output = output.squeeze(1);
    hn = hn.squeeze(1);
    if (cn.defined()) cn = cn.squeeze(1);
  } else if (c.batch_first) {
    output = output.transpose(0, 1);
  }
  return {output, hn, cn};
}

}  // namespace internal

namespace {

internal::RnnMode rnn_mode(const RNNOptions& o) {
  KILN_CHECK(o.nonlinearity() == init::Nonlinearity::kTanh ||
                 o.nonlinearity() == init::Nonlinearity::kReLU,
             "[RNN] nonlinearity must be kiln::kTanh or kiln::kReLU");
  return o.nonlinearity() == init::Nonlinearity::kTanh ? internal::RnnMode::kRnnTanh
                                                       : internal::RnnMode::kRnnRelu;
}

}  // namespace

RNNImpl::RNNImpl(const RNNOptions& o)
    : RNNImplBase({rnn_mode(o), o.input_size(), o.hidden_size(), o.num_layers(), o.bias(),
                   o.batch_first(), o.dropout(), o.bidirectional(), 0}),
      options(o) {}

std::tuple<Tensor, Tensor> RNNImpl::forward(const Tensor& input, const Tensor& hx) {
  auto [output, h_n, c_n] = run(input, hx, Tensor());
  return {output, h_n};
}

LSTMImpl::LSTMImpl(const LSTMOptions& o)
    : RNNImplBase({internal::RnnMode::kLstm, o.input_size(), o.hidden_size(), o.num_layers(),
                   o.bias(), o.batch_first(), o.dropout(), o.bidirectional(), o.proj_size()}),
      options(o) {}

std::tuple<Tensor, std::tuple<Tensor, Tensor>> LSTMImpl::forward(
    const Tensor& input, std::optional<std::tuple<Tensor, Tensor>> hx_opt) {
  Tensor h0, c0;
  if (hx_opt) std::tie(h0, c0) = *hx_opt;
  KILN_CHECK(h0.defined() == c0.defined(),
             "[LSTM] the initial state (h_0, c_0) must have both tensors defined, or neither");
  auto [output, h_n, c_n] = run(input, h0, c0);
  return {output, {h_n, c_n}};
}

GRUImpl::GRUImpl(const GRUOptions& o)
    : RNNImplBase({internal::RnnMode::kGru, o.input_size(), o.hidden_size(), o.num_layers(),
                   o.bias(), o.batch_first(), o.dropout(), o.bidirectional(), 0}),
      options(o) {}

std::tuple<Tensor, Tensor> GRUImpl::forward(const Tensor& input, const Tensor& hx) {
  auto [output, h_n, c_n] = run(input, hx, Tensor());
  return {output, h_n};
}

}  // namespace kiln::nn
