// Recurrent layers RNN (tanh or ReLU), LSTM and GRU, as libtorch's: multi-layer, optionally
// bidirectional, with dropout between layers, over [T, B, input_size] inputs ([B, T, *] with
// batch_first, or unbatched [T, input_size]).
//
//   kiln::nn::LSTM lstm(kiln::nn::LSTMOptions(/*input_size=*/32, /*hidden_size=*/64)
//                           .num_layers(2).batch_first(true).bidirectional(true));
//   auto [output, state] = lstm(x);            // x [B, T, 32] -> output [B, T, 128]
//   auto [h_n, c_n] = state;                   // each [2 * 2, B, 64]
//   auto [out2, h2] = gru(x, h0);              // GRU and RNN: (output, h_n)
//
// Returns libtorch's conventions: RNN and GRU give (output, h_n), LSTM (output, (h_n, c_n)).
// output holds the last layer's h at every step (both directions concatenated on the last dim);
// h_n and c_n are [num_layers * num_directions, B, H] (no batch dim for unbatched inputs), layer
// by layer, forward direction first. Initial states are optional (zeros when absent).
//
// Parameters (PyTorch's names and layouts, so that state dicts match): weight_ih_l{k} [G * H,
// in], weight_hh_l{k} [G * H, H'], bias_ih_l{k} and bias_hh_l{k} [G * H] (G = 4 for LSTM with
// gates i, f, g, o; 3 for GRU with r, z, n; 1 for RNN), suffixed _reverse for the backward
// direction; LSTM with proj_size P > 0 adds weight_hr_l{k} [P, H] and H' = P. All initialised
// U(-1/sqrt(H), 1/sqrt(H)).
//
// The single-step cells RNNCell, LSTMCell and GRUCell, as libtorch's, follow the layers:
//
//   kiln::nn::LSTMCell cell(kiln::nn::LSTMCellOptions(/*input_size=*/32, /*hidden_size=*/64));
//   auto [h, c] = cell(x);                     // x [B, 32] (or [32]) -> h, c [B, 64]
//   std::tie(h, c) = cell(x2, std::make_tuple(h, c));
//   kiln::nn::GRUCell gru_cell(32, 64);
//   h = gru_cell(x, h);                        // RNNCell likewise: Tensor forward(x, hx = {})
//
// Their parameters are weight_ih [G * H, in], weight_hh [G * H, H], bias_ih, bias_hh [G * H]
// (undefined without bias), U(-1/sqrt(H), 1/sqrt(H)); a step is the same addmm and fused cell
// kernel as the layers'.
//
// Speed: each layer and direction projects the inputs of all time steps in one GEMM; a step is
// then one GEMM with the hidden state (addmm) and one fused cell kernel (kiln::lstm_cell_fused,
// kiln::gru_cell_fused) forward and backward.
//
// Sequences of different lengths: forward_with_packed_input takes a PackedSequence
// (nn/utils/rnn.h, libtorch's torch::nn::utils::rnn) and returns one; each sequence runs over its
// own steps only (h_n is the state at its last step, the reverse direction starts there).
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "nn/functional.h"
#include "nn/init.h"
#include "nn/module.h"
#include "nn/utils/rnn.h"

namespace kiln::nn {

struct RNNOptions {
  RNNOptions(int64_t input_size, int64_t hidden_size)
      : input_size_(input_size), hidden_size_(hidden_size) {}
  KILN_ARG(int64_t, input_size);
  KILN_ARG(int64_t, hidden_size);
  KILN_ARG(int64_t, num_layers) = 1;
  // kiln::kTanh or kiln::kReLU.
  KILN_ARG(init::Nonlinearity, nonlinearity) = init::Nonlinearity::kTanh;
  KILN_ARG(bool, bias) = true;
  KILN_ARG(bool, batch_first) = false;
  // Dropout on the outputs of every layer but the last, while training.
  KILN_ARG(double, dropout) = 0.0;
  KILN_ARG(bool, bidirectional) = false;
};

struct LSTMOptions {
  LSTMOptions(int64_t input_size, int64_t hidden_size)
      : input_size_(input_size), hidden_size_(hidden_size) {}
  KILN_ARG(int64_t, input_size);
  KILN_ARG(int64_t, hidden_size);
  KILN_ARG(int64_t, num_layers) = 1;
  KILN_ARG(bool, bias) = true;
  KILN_ARG(bool, batch_first) = false;
  KILN_ARG(double, dropout) = 0.0;
  KILN_ARG(bool, bidirectional) = false;
  // > 0: h is projected to proj_size features after each step (h_n and output use them).
  KILN_ARG(int64_t, proj_size) = 0;
};

struct GRUOptions {
  GRUOptions(int64_t input_size, int64_t hidden_size)
      : input_size_(input_size), hidden_size_(hidden_size) {}
  KILN_ARG(int64_t, input_size);
  KILN_ARG(int64_t, hidden_size);
  KILN_ARG(int64_t, num_layers) = 1;
  KILN_ARG(bool, bias) = true;
  KILN_ARG(bool, batch_first) = false;
  KILN_ARG(double, dropout) = 0.0;
  KILN_ARG(bool, bidirectional) = false;
};

namespace internal {

enum class RnnMode { kRnnTanh, kRnnRelu, kLstm, kGru };

// The options every recurrent layer shares.
struct RnnConfig {
  RnnMode mode;
  int64_t input_size, hidden_size, num_layers;
  bool bias, batch_first;
  double dropout;
  bool bidirectional;
  int64_t proj_size;
};

// Parameters and the step loop of RNN, LSTM and GRU.
class RNNImplBase : public Module {
 public:
  explicit RNNImplBase(const RnnConfig& config);
  // U(-1/sqrt(hidden_size), 1/sqrt(hidden_size)) for every parameter.
  void reset_parameters();
  // No-op: kiln keeps no fused weight buffer to re-pack (libtorch's cuDNN one).
  void flatten_parameters() {}
  // The parameters in registration order (layer, direction, then ih, hh, bias_ih, bias_hh, hr).
  std::vector<Tensor> all_weights() const;
  void pretty_print(std::ostream& stream) const override;

 protected:
  // (output, h_n, c_n); c_n only for LSTM. hx and cx: undefined for zeros.
  // lengths (non-increasing, one per batch entry) marks a padded time-major input [T, B, in] made
  // from a PackedSequence: each sequence's state stops at its last step (and, reversed, starts
  // there), whatever batch_first says.
  std::tuple<Tensor, Tensor, Tensor> run(const Tensor& input, const Tensor& hx, const Tensor& cx,
                                         const std::vector<int64_t>* lengths = nullptr) const;
  // run() over a PackedSequence: (packed output, h_n, c_n), the states in the caller's order.
  std::tuple<utils::rnn::PackedSequence, Tensor, Tensor> run_packed(
      const utils::rnn::PackedSequence& input, const Tensor& hx, const Tensor& cx) const;
  const char* name() const;

  RnnConfig config_;
  // Per layer and direction (index layer * directions + direction).
  struct Weights {
    Tensor w_ih, w_hh, b_ih, b_hh, w_hr;
  };
  std::vector<Weights> weights_;
};

}  // namespace internal

// h' = tanh(x W_ih^T + b_ih + h W_hh^T + b_hh) (or relu).
class RNNImpl : public internal::RNNImplBase {
 public:
  RNNImpl(int64_t input_size, int64_t hidden_size) : RNNImpl(RNNOptions(input_size, hidden_size)) {}
  explicit RNNImpl(const RNNOptions& options);
  // input [T, B, input_size] ([B, T, *] with batch_first; or [T, input_size]); hx [L * D, B, H]
  // ([L * D, H] unbatched). Returns (output [T, B, D * H], h_n).
  std::tuple<Tensor, Tensor> forward(const Tensor& input, const Tensor& hx = {});
  // A PackedSequence (nn/utils/rnn.h) of [*, input_size] steps: (packed output, h_n).
  std::tuple<utils::rnn::PackedSequence, Tensor> forward_with_packed_input(
      const utils::rnn::PackedSequence& packed_input, const Tensor& hx = {});
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  RNNOptions options;
};
KILN_MODULE(RNN);

class LSTMImpl : public internal::RNNImplBase {
 public:
  LSTMImpl(int64_t input_size, int64_t hidden_size)
      : LSTMImpl(LSTMOptions(input_size, hidden_size)) {}
  explicit LSTMImpl(const LSTMOptions& options);
  // hx_opt: (h_0 [L * D, B, H'], c_0 [L * D, B, H]). Returns (output, (h_n, c_n)).
  std::tuple<Tensor, std::tuple<Tensor, Tensor>> forward(
      const Tensor& input, std::optional<std::tuple<Tensor, Tensor>> hx_opt = {});
  std::tuple<utils::rnn::PackedSequence, std::tuple<Tensor, Tensor>> forward_with_packed_input(
      const utils::rnn::PackedSequence& packed_input,
      std::optional<std::tuple<Tensor, Tensor>> hx_opt = {});
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  LSTMOptions options;
};
KILN_MODULE(LSTM);

class GRUImpl : public internal::RNNImplBase {
 public:
  GRUImpl(int64_t input_size, int64_t hidden_size) : GRUImpl(GRUOptions(input_size, hidden_size)) {}
  explicit GRUImpl(const GRUOptions& options);
  std::tuple<Tensor, Tensor> forward(const Tensor& input, const Tensor& hx = {});
  std::tuple<utils::rnn::PackedSequence, Tensor> forward_with_packed_input(
      const utils::rnn::PackedSequence& packed_input, const Tensor& hx = {});
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  GRUOptions options;
};
KILN_MODULE(GRU);

// --- Cells ---------------------------------------------------------------------------------------

struct RNNCellOptions {
  RNNCellOptions(int64_t input_size, int64_t hidden_size)
      : input_size_(input_size), hidden_size_(hidden_size) {}
  KILN_ARG(int64_t, input_size);
  KILN_ARG(int64_t, hidden_size);
  KILN_ARG(bool, bias) = true;
  // kiln::kTanh or kiln::kReLU.
  KILN_ARG(init::Nonlinearity, nonlinearity) = init::Nonlinearity::kTanh;
};

struct LSTMCellOptions {
  LSTMCellOptions(int64_t input_size, int64_t hidden_size)
      : input_size_(input_size), hidden_size_(hidden_size) {}
  KILN_ARG(int64_t, input_size);
  KILN_ARG(int64_t, hidden_size);
  KILN_ARG(bool, bias) = true;
};

struct GRUCellOptions {
  GRUCellOptions(int64_t input_size, int64_t hidden_size)
      : input_size_(input_size), hidden_size_(hidden_size) {}
  KILN_ARG(int64_t, input_size);
  KILN_ARG(int64_t, hidden_size);
  KILN_ARG(bool, bias) = true;
};

namespace internal {

// Parameters and the step of RNNCell, LSTMCell and GRUCell.
class RNNCellImplBase : public Module {
 public:
  RNNCellImplBase(RnnMode mode, int64_t input_size, int64_t hidden_size, bool bias);
  // U(-1/sqrt(hidden_size), 1/sqrt(hidden_size)) for every parameter.
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  Tensor weight_ih;  // [G * H, input_size]
  Tensor weight_hh;  // [G * H, hidden_size]
  Tensor bias_ih;    // [G * H], undefined without bias
  Tensor bias_hh;    // [G * H], undefined without bias

 protected:
  // One step: (h', c'), c' only for LSTM. hx and cx: undefined for zeros.
  std::tuple<Tensor, Tensor> step(const Tensor& input, const Tensor& hx, const Tensor& cx) const;
  // "RNNCell", "LSTMCell" or "GRUCell", for errors.
  const char* cell_name() const;

  RnnMode mode_;
  int64_t input_size_, hidden_size_;
};

}  // namespace internal

// h' = tanh(x W_ih^T + b_ih + h W_hh^T + b_hh) (or relu), one step.
class RNNCellImpl : public internal::RNNCellImplBase {
 public:
  RNNCellImpl(int64_t input_size, int64_t hidden_size)
      : RNNCellImpl(RNNCellOptions(input_size, hidden_size)) {}
  explicit RNNCellImpl(const RNNCellOptions& options);
  // input [B, input_size] or [input_size]; hx [B, H] or [H] (zeros when undefined). Returns h'.
  Tensor forward(const Tensor& input, const Tensor& hx = {});
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  RNNCellOptions options;
};
KILN_MODULE(RNNCell);

class LSTMCellImpl : public internal::RNNCellImplBase {
 public:
  LSTMCellImpl(int64_t input_size, int64_t hidden_size)
      : LSTMCellImpl(LSTMCellOptions(input_size, hidden_size)) {}
  explicit LSTMCellImpl(const LSTMCellOptions& options);
  // hx_opt: (h [B, H], c [B, H]) (no batch dim for an unbatched input). Returns (h', c').
  std::tuple<Tensor, Tensor> forward(const Tensor& input,
                                     std::optional<std::tuple<Tensor, Tensor>> hx_opt = {});
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  LSTMCellOptions options;
};
KILN_MODULE(LSTMCell);

class GRUCellImpl : public internal::RNNCellImplBase {
 public:
  GRUCellImpl(int64_t input_size, int64_t hidden_size)
      : GRUCellImpl(GRUCellOptions(input_size, hidden_size)) {}
  explicit GRUCellImpl(const GRUCellOptions& options);
  Tensor forward(const Tensor& input, const Tensor& hx = {});
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  GRUCellOptions options;
};
KILN_MODULE(GRUCell);

}  // namespace kiln::nn
