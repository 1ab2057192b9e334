// Autograd overhead: the cost the engine adds per recorded node, measured on a long chain of
// tiny ops (one-element tensors, so kernels cost next to nothing).
//
//   build/benchmarks/kiln_bench --benchmark_filter=Autograd
#include <benchmark/benchmark.h>

#include <kiln/kiln.h>

namespace {

constexpr int kChain = 1000;

kiln::Tensor run_chain(const kiln::Tensor& x) {
  kiln::Tensor y = x;
  for (int i = 0; i < kChain; ++i) y = y * 1.0001;
  return y;
}

void set_per_node_counter(benchmark::State& state) {
  state.counters["ns_per_node"] = benchmark::Counter(
      static_cast<double>(kChain) * state.iterations(),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

// Forward of the chain with recording, without backward: the cost of building nodes.
void BM_AutogradRecordChain(benchmark::State& state) {
  kiln::Tensor x = kiln::ones({1}, kiln::requires_grad());
  for (auto _ : state) benchmark::DoNotOptimize(run_chain(x).impl());
  set_per_node_counter(state);
}
BENCHMARK(BM_AutogradRecordChain)->Unit(benchmark::kMicrosecond);

// The same chain without grad: the baseline of the ops themselves.
void BM_AutogradNoGradChain(benchmark::State& state) {
  kiln::Tensor x = kiln::ones({1});
  for (auto _ : state) benchmark::DoNotOptimize(run_chain(x).impl());
  set_per_node_counter(state);
}
BENCHMARK(BM_AutogradNoGradChain)->Unit(benchmark::kMicrosecond);

// Backward alone over a recorded chain (the graph is rebuilt outside the timed region).
void BM_AutogradBackwardChain(benchmark::State& state) {
  kiln::Tensor x = kiln::ones({1}, kiln::requires_grad());
  for (auto _ : state) {
    state.PauseTiming();
    kiln::Tensor y = run_chain(x);
    state.ResumeTiming();
    y.backward();
  }
  set_per_node_counter(state);
}
BENCHMARK(BM_AutogradBackwardChain)->Unit(benchmark::kMicrosecond);

}  // namespace
