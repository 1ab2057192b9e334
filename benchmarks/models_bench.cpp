// The default pretraining model (kiln-tiny, ~4.5 M parameters) on the CPU: forward and
// forward + backward at batch 8 x seq 256, in tokens per second.
//
//   build/benchmarks/kiln_bench --benchmark_filter=GPT
#include <benchmark/benchmark.h>
#include <kiln/kiln.h>

#include "models/gpt.h"

namespace {

constexpr int64_t kBatch = 8, kSeq = 256;

void set_tokens_counter(benchmark::State& state) {
  state.counters["tokens/s"] = benchmark::Counter(
      static_cast<double>(kBatch * kSeq) * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate);
}

struct TinyRun {
  kiln::models::GPT model{nullptr};
  kiln::Tensor idx, targets;

  TinyRun() {
    kiln::manual_seed(0);
    const auto config = kiln::models::ModelConfig::from_name(kiln::models::kDefaultConfig);
    model = kiln::models::GPT(config);
    idx = kiln::randint(config.vocab_size, {kBatch, kSeq}, kiln::kInt64);
    targets = kiln::randint(config.vocab_size, {kBatch, kSeq}, kiln::kInt64);
  }
};

// Inference-style forward (no graph): logits for every position.
void BM_GPTTinyForward(benchmark::State& state) {
  TinyRun run;
  kiln::NoGradGuard no_grad;
  for (auto _ : state) benchmark::DoNotOptimize(run.model(run.idx).impl());
  set_tokens_counter(state);
}
BENCHMARK(BM_GPTTinyForward)->Unit(benchmark::kMillisecond)->UseRealTime();

// One training step without the optimizer: loss forward with the graph, then backward.
void BM_GPTTinyForwardBackward(benchmark::State& state) {
  TinyRun run;
  for (auto _ : state) {
    run.model->zero_grad();
    kiln::Tensor loss = run.model->loss(run.idx, run.targets);
    loss.backward();
    benchmark::DoNotOptimize(loss.impl());
  }
  set_tokens_counter(state);
}
BENCHMARK(BM_GPTTinyForwardBackward)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
