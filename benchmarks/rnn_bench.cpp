// Recurrent layers: LSTM forward + backward at a word-language-model size (batch 32, 35 steps,
// input and hidden 256, f32, CPU), three ways side by side:
//   - NaiveLoop: the loop of small ops a port writes by hand, x_t W_ih^T + b_ih + h W_hh^T + b_hh
//     then chunk, three sigmoids, two tanh and the products, per step;
//   - HoistedInput: the input projection of all steps as one GEMM (addmm per step for h), split
//     into steps with select, the cell still as separate ops;
//   - HoistedUnbound: the same, split with unbind_copy (whose backward is one stack, where each
//     select's gives back a zero-filled tensor of the whole projection's size);
//   - Module: nn::LSTM, the hoisted GEMM, unbind_copy, and the fused cell (kiln::lstm_cell_fused,
//   one kernel
//     forward and one backward per step).
// GRU and RNN (tanh) modules at the same size for scale.
//
//   build/benchmarks/kiln_bench --benchmark_filter=Rnn
#include <benchmark/benchmark.h>
#include <kiln/kiln.h>

#include <tuple>
#include <vector>

namespace {

constexpr int64_t kBatch = 32, kSteps = 35, kInput = 256, kHidden = 256;

struct Fixture {
  kiln::nn::LSTM lstm{kiln::nn::LSTMOptions(kInput, kHidden)};
  kiln::Tensor x = kiln::randn({kSteps, kBatch, kInput});
  kiln::Tensor w_ih = lstm->named_parameters()["weight_ih_l0"];
  kiln::Tensor w_hh = lstm->named_parameters()["weight_hh_l0"];
  kiln::Tensor b_ih = lstm->named_parameters()["bias_ih_l0"];
  kiln::Tensor b_hh = lstm->named_parameters()["bias_hh_l0"];
};

std::tuple<kiln::Tensor, kiln::Tensor> composed_cell(const kiln::Tensor& gates,
                                                     const kiln::Tensor& c) {
  const std::vector<kiln::Tensor> g = gates.chunk(4, 1);
  const kiln::Tensor cy = g[1].sigmoid() * c + g[0].sigmoid() * g[2].tanh();
  return {g[3].sigmoid() * cy.tanh(), cy};
}

// output.sum() of the naive loop.
kiln::Tensor naive_loop(const Fixture& f) {
  kiln::Tensor h = kiln::zeros({kBatch, kHidden}), c = kiln::zeros({kBatch, kHidden});
  std::vector<kiln::Tensor> hs;
  for (int64_t t = 0; t < kSteps; ++t) {
    const kiln::Tensor gates =
        kiln::linear(f.x.select(0, t), f.w_ih, f.b_ih) + kiln::linear(h, f.w_hh, f.b_hh);
    std::tie(h, c) = composed_cell(gates, c);
    hs.push_back(h);
  }
  return kiln::stack(hs, 0).sum();
}

kiln::Tensor hoisted_loop(const Fixture& f) {
  kiln::Tensor h = kiln::zeros({kBatch, kHidden}), c = kiln::zeros({kBatch, kHidden});
  const kiln::Tensor xproj = kiln::linear(f.x, f.w_ih, f.b_ih + f.b_hh);
  const kiln::Tensor w_hh_t = f.w_hh.t();
  std::vector<kiln::Tensor> hs;
  for (int64_t t = 0; t < kSteps; ++t) {
    std::tie(h, c) = composed_cell(kiln::addmm(xproj.select(0, t), h, w_hh_t), c);
    hs.push_back(h);
  }
  return kiln::stack(hs, 0).sum();
}

// The hoisted GEMM split into steps by unbind_copy (one stack in backward instead of T
// zero-filled select gradients), the cell still as separate ops.
kiln::Tensor unbound_loop(const Fixture& f) {
  kiln::Tensor h = kiln::zeros({kBatch, kHidden}), c = kiln::zeros({kBatch, kHidden});
  const std::vector<kiln::Tensor> xproj =
      kiln::unbind_copy(kiln::linear(f.x, f.w_ih, f.b_ih + f.b_hh));
  const kiln::Tensor w_hh_t = f.w_hh.t();
  std::vector<kiln::Tensor> hs;
  for (int64_t t = 0; t < kSteps; ++t) {
    std::tie(h, c) = composed_cell(kiln::addmm(xproj[t], h, w_hh_t), c);
    hs.push_back(h);
  }
  return kiln::stack(hs, 0).sum();
}

void set_counters(benchmark::State& state) {
  state.counters["steps_per_s"] = benchmark::Counter(
      static_cast<double>(kSteps) * state.iterations(), benchmark::Counter::kIsRate);
}

void BM_RnnLstmNaiveLoop(benchmark::State& state) {
  kiln::manual_seed(0);
  Fixture f;
  for (auto _ : state) {
    naive_loop(f).backward();
    f.lstm->zero_grad();
  }
  set_counters(state);
}
BENCHMARK(BM_RnnLstmNaiveLoop)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_RnnLstmHoistedInput(benchmark::State& state) {
  kiln::manual_seed(0);
  Fixture f;
  for (auto _ : state) {
    hoisted_loop(f).backward();
    f.lstm->zero_grad();
  }
  set_counters(state);
}
BENCHMARK(BM_RnnLstmHoistedInput)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_RnnLstmHoistedUnbound(benchmark::State& state) {
  kiln::manual_seed(0);
  Fixture f;
  for (auto _ : state) {
    unbound_loop(f).backward();
    f.lstm->zero_grad();
  }
  set_counters(state);
}
BENCHMARK(BM_RnnLstmHoistedUnbound)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_RnnLstmModule(benchmark::State& state) {
  kiln::manual_seed(0);
  Fixture f;
  for (auto _ : state) {
    std::get<0>(f.lstm(f.x)).sum().backward();
    f.lstm->zero_grad();
  }
  set_counters(state);
}
BENCHMARK(BM_RnnLstmModule)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_RnnGruModule(benchmark::State& state) {
  kiln::manual_seed(0);
  kiln::nn::GRU gru(kInput, kHidden);
  const kiln::Tensor x = kiln::randn({kSteps, kBatch, kInput});
  for (auto _ : state) {
    std::get<0>(gru(x)).sum().backward();
    gru->zero_grad();
  }
  set_counters(state);
}
BENCHMARK(BM_RnnGruModule)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_RnnTanhModule(benchmark::State& state) {
  kiln::manual_seed(0);
  kiln::nn::RNN rnn(kInput, kHidden);
  const kiln::Tensor x = kiln::randn({kSteps, kBatch, kInput});
  for (auto _ : state) {
    std::get<0>(rnn(x)).sum().backward();
    rnn->zero_grad();
  }
  set_counters(state);
}
BENCHMARK(BM_RnnTanhModule)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
