// RNN, LSTM and GRU (nn/modules/rnn.h); the fused cells are registry ops (tensor/ops/rnn.cpp).
#include "nn/modules/rnn.h"

#include <algorithm>
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
                                                    const Tensor& cx_in,
                                                    const std::vector<int64_t>* lengths) const {
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
  KILN_CHECK(lengths == nullptr || !unbatched, "[", n, "] a packed input must be batched");
  const bool batch_first = c.batch_first && lengths == nullptr;
  // Time-major [T, B, in] from here on.
  const Tensor x = unbatched ? input.unsqueeze(1) : batch_first ? input.transpose(0, 1) : input;
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
  // Packed inputs: at step t only the first active[t] sequences (the longest) take a step; the
  // others keep their state, masks[t] marking who moves.
  std::vector<int64_t> active;
  std::vector<Tensor> masks;
  if (lengths != nullptr) {
    const Tensor rows = kiln::arange(batch, TensorOptions(kInt64).device(x.device()));
    for (int64_t t = 0; t < steps; ++t) {
      active.push_back(
          std::count_if(lengths->begin(), lengths->end(), [t](int64_t len) { return len > t; }));
      masks.push_back(active.back() < batch ? rows.lt(active.back()).unsqueeze(1) : Tensor());
    }
  }

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
        const Tensor h_prev = h, c_prev = cell;
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
        if (!masks.empty() && masks[t].defined()) {
          h = kiln::where(masks[t], h, h_prev);
          if (cell.defined()) cell = kiln::where(masks[t], cell, c_prev);
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
  } else if (batch_first) {
    output = output.transpose(0, 1);
  }
  return {output, hn, cn};
}

std::tuple<utils::rnn::PackedSequence, Tensor, Tensor> RNNImplBase::run_packed(
    const utils::rnn::PackedSequence& input, const Tensor& hx, const Tensor& cx) const {
  namespace rnn = utils::rnn;
  // Padded in sorted order (longest first), as run() wants it.
  const auto [padded, lengths_tensor] =
      rnn::pad_packed_sequence(rnn::PackedSequence(input.data(), input.batch_sizes()));
  const std::vector<int64_t> lengths = lengths_tensor.to_vector<int64_t>();
  const auto reorder = [](const Tensor& s, const Tensor& index) {
    return s.defined() && index.defined() ? s.index_select(1, index) : s;
  };
  auto [output, h_n, c_n] = run(padded, reorder(hx, input.sorted_indices()),
                                reorder(cx, input.sorted_indices()), &lengths);
  return {
      rnn::PackedSequence(rnn::pack_padded_sequence(output, lengths).data(), input.batch_sizes(),
                          input.sorted_indices(), input.unsorted_indices()),
      reorder(h_n, input.unsorted_indices()), reorder(c_n, input.unsorted_indices())};
}

}  // namespace internal

namespace {

internal::RnnMode rnn_mode(init::Nonlinearity nonlinearity, const char* module) {
  KILN_CHECK(nonlinearity == init::Nonlinearity::kTanh || nonlinearity == init::Nonlinearity::kReLU,
             "[", module, "] nonlinearity must be kiln::kTanh or kiln::kReLU");
  return nonlinearity == init::Nonlinearity::kTanh ? internal::RnnMode::kRnnTanh
                                                   : internal::RnnMode::kRnnRelu;
}

}  // namespace

RNNImpl::RNNImpl(const RNNOptions& o)
    : RNNImplBase({rnn_mode(o.nonlinearity(), "RNN"), o.input_size(), o.hidden_size(),
                   o.num_layers(), o.bias(), o.batch_first(), o.dropout(), o.bidirectional(), 0}),
      options(o) {}

std::tuple<Tensor, Tensor> RNNImpl::forward(const Tensor& input, const Tensor& hx) {
  auto [output, h_n, c_n] = run(input, hx, Tensor());
  return {output, h_n};
}

std::tuple<utils::rnn::PackedSequence, Tensor> RNNImpl::forward_with_packed_input(
    const utils::rnn::PackedSequence& packed_input, const Tensor& hx) {
  auto [output, h_n, c_n] = run_packed(packed_input, hx, Tensor());
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

std::tuple<utils::rnn::PackedSequence, std::tuple<Tensor, Tensor>>
LSTMImpl::forward_with_packed_input(const utils::rnn::PackedSequence& packed_input,
                                    std::optional<std::tuple<Tensor, Tensor>> hx_opt) {
  Tensor h0, c0;
  if (hx_opt) std::tie(h0, c0) = *hx_opt;
  KILN_CHECK(h0.defined() == c0.defined(),
             "[LSTM] the initial state (h_0, c_0) must have both tensors defined, or neither");
  auto [output, h_n, c_n] = run_packed(packed_input, h0, c0);
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

std::tuple<utils::rnn::PackedSequence, Tensor> GRUImpl::forward_with_packed_input(
    const utils::rnn::PackedSequence& packed_input, const Tensor& hx) {
  auto [output, h_n, c_n] = run_packed(packed_input, hx, Tensor());
  return {output, h_n};
}

// Built from the same options, then given this module's values (nn/module.h, clone_layer).
std::shared_ptr<Module> RNNImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<RNNImpl>(options), device);
}
std::shared_ptr<Module> LSTMImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<LSTMImpl>(options), device);
}
std::shared_ptr<Module> GRUImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<GRUImpl>(options), device);
}

// --- Cells ---------------------------------------------------------------------------------------

namespace internal {

RNNCellImplBase::RNNCellImplBase(RnnMode mode, int64_t input_size, int64_t hidden_size, bool bias)
    : mode_(mode), input_size_(input_size), hidden_size_(hidden_size) {
  const char* n = cell_name();
  KILN_CHECK(input_size > 0, "[", n, "] input_size must be positive, got ", input_size);
  KILN_CHECK(hidden_size > 0, "[", n, "] hidden_size must be positive, got ", hidden_size);
  const int64_t gates = gate_count(mode) * hidden_size;
  weight_ih = register_parameter("weight_ih", kiln::empty({gates, input_size}));
  weight_hh = register_parameter("weight_hh", kiln::empty({gates, hidden_size}));
  bias_ih = bias ? register_parameter("bias_ih", kiln::empty({gates}))
                 : register_parameter("bias_ih", Tensor(), /*requires_grad=*/false);
  bias_hh = bias ? register_parameter("bias_hh", kiln::empty({gates}))
                 : register_parameter("bias_hh", Tensor(), /*requires_grad=*/false);
  reset_parameters();
}

const char* RNNCellImplBase::cell_name() const {
  switch (mode_) {
    case RnnMode::kLstm:
      return "LSTMCell";
    case RnnMode::kGru:
      return "GRUCell";
    default:
      return "RNNCell";
  }
}

void RNNCellImplBase::reset_parameters() {
  const double bound = 1.0 / std::sqrt(static_cast<double>(hidden_size_));
  for (Tensor& p : parameters()) init::uniform_(p, -bound, bound);
}

void RNNCellImplBase::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "kiln::nn::" << cell_name() << "(input_size=" << input_size_
         << ", hidden_size=" << hidden_size_ << ", bias=" << bias_ih.defined();
  if (mode_ == RnnMode::kRnnRelu) stream << ", nonlinearity=relu";
  stream << ")";
}

std::tuple<Tensor, Tensor> RNNCellImplBase::step(const Tensor& input, const Tensor& hx_in,
                                                 const Tensor& cx_in) const {
  const char* n = cell_name();
  KILN_CHECK(input.defined(), "[", n, "] input is undefined");
  KILN_CHECK(input.dim() == 1 || input.dim() == 2, "[", n,
             "] expected a 2-D (batched) or 1-D (unbatched) input, got shape ",
             shape_str(input.sizes()));
  KILN_CHECK(input.dtype() == weight_ih.dtype(), "[", n,
             "] input must have the dtype of the parameters (", dtype_name(weight_ih.dtype()),
             "), got ", dtype_name(input.dtype()));
  KILN_CHECK(input.device() == weight_ih.device(), "[", n, "] input is on ", input.device().str(),
             " but the parameters are on ", weight_ih.device().str());
  KILN_CHECK(input.size(-1) == input_size_, "[", n, "] input has inconsistent input_size: got ",
             input.size(-1), " expected ", input_size_, " (input shape ", shape_str(input.sizes()),
             ")");
  const bool unbatched = input.dim() == 1;
  const Tensor x = unbatched ? input.unsqueeze(0) : input;
  const int64_t batch = x.size(0);
  const auto state = [&](const Tensor& s, const char* what) {
    if (!s.defined()) {
      return kiln::zeros({batch, hidden_size_}, TensorOptions(x.dtype()).device(x.device()));
    }
    const Shape want = unbatched ? Shape{hidden_size_} : Shape{batch, hidden_size_};
    KILN_CHECK(s.sizes() == want, "[", n, "] expected ", what, " of shape ", shape_str(want),
               ", got ", shape_str(s.sizes()), " (input shape ", shape_str(input.sizes()), ")");
    KILN_CHECK(s.dtype() == x.dtype() && s.device() == x.device(), "[", n, "] ", what, " (",
               dtype_name(s.dtype()), " on ", s.device().str(), ") must match the input (",
               dtype_name(x.dtype()), " on ", x.device().str(), ")");
    return unbatched ? s.unsqueeze(0) : s;
  };
  const Tensor h = state(hx_in, mode_ == RnnMode::kLstm ? "h_0" : "hx");
  Tensor hy, cy;
  switch (mode_) {
    case RnnMode::kLstm: {
      const Tensor bias = bias_ih.defined() ? bias_ih + bias_hh : Tensor();
      const Tensor gates = kiln::addmm(kiln::linear(x, weight_ih, bias), h, weight_hh.t());
      std::tie(hy, cy) = kiln::lstm_cell_fused(gates, state(cx_in, "c_0"));
      break;
    }
    case RnnMode::kGru:
      // b_hh stays with the hidden projection: r gates its n part.
      hy = kiln::gru_cell_fused(kiln::linear(x, weight_ih, bias_ih),
                                kiln::linear(h, weight_hh, bias_hh), h);
      break;
    case RnnMode::kRnnTanh:
    case RnnMode::kRnnRelu: {
      const Tensor bias = bias_ih.defined() ? bias_ih + bias_hh : Tensor();
      const Tensor pre = kiln::addmm(kiln::linear(x, weight_ih, bias), h, weight_hh.t());
      hy = mode_ == RnnMode::kRnnTanh ? pre.tanh() : pre.relu();
      break;
    }
  }
  if (unbatched) {
    hy = hy.squeeze(0);
    if (cy.defined()) cy = cy.squeeze(0);
  }
  return {hy, cy};
}

}  // namespace internal

RNNCellImpl::RNNCellImpl(const RNNCellOptions& o)
    : RNNCellImplBase(rnn_mode(o.nonlinearity(), "RNNCell"), o.input_size(), o.hidden_size(),
                      o.bias()),
      options(o) {}

Tensor RNNCellImpl::forward(const Tensor& input, const Tensor& hx) {
  return std::get<0>(step(input, hx, Tensor()));
}

LSTMCellImpl::LSTMCellImpl(const LSTMCellOptions& o)
    : RNNCellImplBase(internal::RnnMode::kLstm, o.input_size(), o.hidden_size(), o.bias()),
      options(o) {}

std::tuple<Tensor, Tensor> LSTMCellImpl::forward(const Tensor& input,
                                                 std::optional<std::tuple<Tensor, Tensor>> hx_opt) {
  Tensor h0, c0;
  if (hx_opt) std::tie(h0, c0) = *hx_opt;
  KILN_CHECK(h0.defined() == c0.defined(),
             "[LSTMCell] the state (h, c) must have both tensors defined, or neither");
  return step(input, h0, c0);
}

GRUCellImpl::GRUCellImpl(const GRUCellOptions& o)
    : RNNCellImplBase(internal::RnnMode::kGru, o.input_size(), o.hidden_size(), o.bias()),
      options(o) {}

Tensor GRUCellImpl::forward(const Tensor& input, const Tensor& hx) {
  return std::get<0>(step(input, hx, Tensor()));
}

std::shared_ptr<Module> RNNCellImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<RNNCellImpl>(options), device);
}
std::shared_ptr<Module> LSTMCellImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<LSTMCellImpl>(options), device);
}
std::shared_ptr<Module> GRUCellImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<GRUCellImpl>(options), device);
}

}  // namespace kiln::nn
