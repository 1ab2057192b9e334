// Optimizer and training-step costs on the CPU (results: benchmarks/RESULTS.md).
//
// - AdamW step over 10M f32 parameters (10 tensors of 1M, as a model's layers): the adam_update_
//   op's fused CPU kernel (kernels/cpu/optim.cpp) against the same update written as separate
//   kiln ops (the op's decomposition), on the same contiguous tensors. Bytes counted: p, g, m, v
//   read and p, m, v written, 28 bytes per parameter.
// - SGD step with momentum over the same parameters: the sgd_update_ op's fused CPU kernel
//   against its decomposition (kiln ops). Bytes: p, g, buf read and p, buf written, 20 per
//   parameter.
// - Linear forward + backward, x [256, 1024] @ W^T [1024, 1024] + b, loss = sum, gradients of
//   x, W and b: 3 GEMMs of 2 * 256 * 1024 * 1024 flops.
//
//   build/benchmarks/kiln_bench --benchmark_filter='AdamW|SGD|Linear'
// Argument: the thread count (kiln::set_num_threads).
#include <benchmark/benchmark.h>

#include <kiln/kiln.h>

#include <cmath>
#include <vector>

#include "nn/optim/adamw.h"
#include "nn/optim/sgd.h"
#include "tensor/registry.h"

namespace {

constexpr int64_t kTensors = 10;
constexpr int64_t kPerTensor = 1'000'000;

std::vector<kiln::Tensor> make_params() {
  kiln::manual_seed(0);
  std::vector<kiln::Tensor> params;
  for (int64_t i = 0; i < kTensors; ++i) {
    kiln::Tensor p = kiln::randn({kPerTensor});
    p.mutable_grad() = kiln::randn({kPerTensor}) * 1e-3;
    params.push_back(p);
  }
  return params;
}

void set_counters(benchmark::State& state, int64_t bytes_per_param = 28) {
  state.SetBytesProcessed(state.iterations() * kTensors * kPerTensor * bytes_per_param);
  state.counters["ns_per_param"] = benchmark::Counter(
      static_cast<double>(kTensors * kPerTensor) * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void BM_AdamWStep10M(benchmark::State& state) {
  kiln::set_num_threads(static_cast<int>(state.range(0)));
  std::vector<kiln::Tensor> params = make_params();
  kiln::optim::AdamW opt(params, kiln::optim::AdamWOptions(1e-3).weight_decay(0.1));
  opt.step();  // creates the state outside the timed loop
  for (auto _ : state) opt.step();
  set_counters(state);
}
BENCHMARK(BM_AdamWStep10M)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

// The yardstick: AdamW as the op's decomposition computes it, one kiln op per line.
void BM_AdamWStep10MOps(benchmark::State& state) {
  kiln::set_num_threads(static_cast<int>(state.range(0)));
  std::vector<kiln::Tensor> params = make_params();
  std::vector<kiln::Tensor> m, v;
  for (const kiln::Tensor& p : params) {
    m.push_back(kiln::zeros_like(p));
    v.push_back(kiln::zeros_like(p));
  }
  const double lr = 1e-3, wd = 0.1, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  kiln::NoGradGuard no_grad;
  int64_t t = 0;
  for (auto _ : state) {
    ++t;
    const double step_size = lr / (1 - std::pow(b1, t));
    const double bc2_sqrt = std::sqrt(1 - std::pow(b2, t));
    for (size_t i = 0; i < params.size(); ++i) {
      kiln::Tensor& p = params[i];
      const kiln::Tensor& g = p.grad();
      p.mul_(1 - lr * wd);
      m[i].lerp_(g, 1 - b1);
      v[i].mul_(b2).add_(g * g, 1 - b2);
      kiln::Tensor denom = v[i].sqrt();
      denom.div_(bc2_sqrt).add_(eps);
      p.add_(m[i] / denom, -step_size);
    }
  }
  set_counters(state);
}
BENCHMARK(BM_AdamWStep10MOps)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_SGDMomentumStep10M(benchmark::State& state) {
  kiln::set_num_threads(static_cast<int>(state.range(0)));
  std::vector<kiln::Tensor> params = make_params();
  kiln::optim::SGD opt(params, kiln::optim::SGDOptions(1e-2).momentum(0.9).weight_decay(1e-4));
  opt.step();  // creates the momentum buffers outside the timed loop
  for (auto _ : state) opt.step();
  set_counters(state, 20);
}
BENCHMARK(BM_SGDMomentumStep10M)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

// The yardstick: the same sgd_update_ call through the op's decomposition (kiln ops).
void BM_SGDMomentumStep10MDecomposition(benchmark::State& state) {
  kiln::set_num_threads(static_cast<int>(state.range(0)));
  std::vector<kiln::Tensor> params = make_params();
  kiln::TensorVec inputs(params.begin(), params.end());
  for (const kiln::Tensor& p : params) inputs.push_back(p.grad());
  for (const kiln::Tensor& p : params) inputs.push_back(kiln::zeros_like(p));
  inputs.push_back(kiln::scalar_tensor(1e-2, kiln::kDouble));  // the lr
  const kiln::Shape fresh(params.size(), 0);
  static const kiln::OpDef& op = KILN_OP(sgd_update_);
  kiln::NoGradGuard no_grad;
  for (auto _ : state) {
    kiln::call_decomposition(op, inputs, {kTensors, 0.9, 0.0, 1e-4, false, fresh});
  }
  set_counters(state, 20);
}
BENCHMARK(BM_SGDMomentumStep10MDecomposition)
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_LinearForwardBackward(benchmark::State& state) {
  kiln::set_num_threads(static_cast<int>(state.range(0)));
  kiln::manual_seed(0);
  kiln::Tensor x = kiln::randn({256, 1024}, kiln::requires_grad());
  kiln::Tensor w = (kiln::randn({1024, 1024}) * 0.03).requires_grad_();
  kiln::Tensor b = kiln::zeros({1024}, kiln::requires_grad());
  for (auto _ : state) {
    x.mutable_grad() = kiln::Tensor();
    w.mutable_grad() = kiln::Tensor();
    b.mutable_grad() = kiln::Tensor();
    kiln::linear(x, w, b).sum().backward();
    benchmark::DoNotOptimize(w.grad().impl());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      3.0 * 2 * 256 * 1024 * 1024 * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_LinearForwardBackward)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
