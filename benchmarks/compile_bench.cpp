// kiln::compile on the CPU: the kiln-tiny training step (zero_grad, forward, cross-entropy,
// backward, AdamW) compiled against eager on the same batch, the compile time per stage
// (CompiledFunction::stats().stage_ms), what a cache hit adds to a call (one add, compiled
// against eager), a new size of a dynamic dimension (shared program against a compilation), and
// remat: kiln-tiny's loss compiled with its backward node, the forward saving
// every value the backward reads (kSaveAll) or a minimum cut (kMinCut, recomputing the rest).
//
//   OMP_NUM_THREADS=1 build/benchmarks/kiln_bench --benchmark_filter=Compile
//
// The only executor today is eager: a compiled program replays the kernels eager code runs, so
// the step can only gain what eager code spends around its kernels (the autograd graph, the
// dispatcher's layers above the kernels) and loses the per-op cost of the replay loop.
#include <benchmark/benchmark.h>
#include <kiln/kiln.h>

#include <memory>
#include <string>
#include <vector>

#include "compiler/compile.h"
#include "models/gpt.h"
#include "nn/optim/adamw.h"

namespace {

constexpr int64_t kBatch = 8, kSeq = 128;  // kiln pretrain's default batch

// kiln-tiny and AdamW, initialised from manual_seed(0), with one fixed batch.
struct TinyStep {
  kiln::models::GPT model{nullptr};
  std::unique_ptr<kiln::optim::AdamW> opt;
  kiln::Tensor x, y;

  TinyStep() {
    kiln::manual_seed(0);
    const auto config = kiln::models::ModelConfig::from_name(kiln::models::kDefaultConfig);
    model = kiln::models::GPT(config);
    model->train();
    opt = std::make_unique<kiln::optim::AdamW>(model->parameters(),
                                               kiln::optim::AdamWOptions(1e-4).weight_decay(0.1));
    const kiln::Tensor tokens = kiln::randint(config.vocab_size, {kBatch, kSeq + 1}, kiln::kInt64);
    x = tokens.narrow(1, 0, kSeq).contiguous();
    y = tokens.narrow(1, 1, kSeq).contiguous();
  }

  kiln::Tensor operator()(const kiln::Tensor& idx, const kiln::Tensor& targets) {
    opt->zero_grad();
    kiln::Tensor loss = model->loss(idx, targets);
    loss.backward();
    opt->step();
    return loss;
  }
};

void set_tokens_counter(benchmark::State& state) {
  state.counters["tokens/s"] = benchmark::Counter(
      static_cast<double>(kBatch * kSeq) * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate);
}

void BM_CompileTinyTrainStepEager(benchmark::State& state) {
  TinyStep step;
  for (int i = 0; i < 2; ++i) step(step.x, step.y);  // as the compiled one: state exists
  for (auto _ : state) benchmark::DoNotOptimize(step(step.x, step.y).impl());
  set_tokens_counter(state);
}
BENCHMARK(BM_CompileTinyTrainStepEager)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_CompileTinyTrainStepCompiled(benchmark::State& state) {
  TinyStep step;
  auto compiled =
      kiln::compile([&](const kiln::Tensor& x, const kiln::Tensor& y) { return step(x, y); });
  for (int i = 0; i < 2; ++i) compiled(step.x, step.y);  // steps 1 and 2 trace
  for (auto _ : state) benchmark::DoNotOptimize(compiled(step.x, step.y).impl());
  if (compiled.stats().misses != 2) state.SkipWithError("the compiled step was traced again");
  set_tokens_counter(state);
}
BENCHMARK(BM_CompileTinyTrainStepCompiled)->Unit(benchmark::kMillisecond)->UseRealTime();

// Compiling the step: the first two calls (step 1 traces and runs, creating AdamW's state; step 2
// traces the steady program, compiles and runs it). The counters are the second compilation's
// stages in ms; the time includes both steps' kernels.
void BM_CompileTinyTrainStepCompileTime(benchmark::State& state) {
  std::vector<std::pair<std::string, double>> stage_sum;
  for (auto _ : state) {
    state.PauseTiming();
    auto step = std::make_unique<TinyStep>();
    auto compiled =
        kiln::compile([&](const kiln::Tensor& x, const kiln::Tensor& y) { return (*step)(x, y); });
    state.ResumeTiming();
    compiled(step->x, step->y);
    compiled(step->x, step->y);
    state.PauseTiming();
    const auto& stages = compiled.stats().stage_ms;
    if (stage_sum.empty())
      stage_sum.assign(stages.begin(), stages.end());
    else {
      for (size_t i = 0; i < stages.size() && i < stage_sum.size(); ++i) {
        stage_sum[i].second += stages[i].second;
      }
    }
    state.ResumeTiming();
  }
  // Stage names repeat (the forward's and the backward's passes): number them in order.
  for (size_t i = 0; i < stage_sum.size(); ++i) {
    state.counters[std::to_string(i) + "_" + stage_sum[i].first + "_ms"] =
        stage_sum[i].second / static_cast<double>(state.iterations());
  }
}
BENCHMARK(BM_CompileTinyTrainStepCompileTime)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(3);

// A new sequence length for the compiled step: with the batch's dimension 1 marked dynamic
// (Arg 1), sizes after the first two share one fitted program (compiler/symbolic.h), so T = 96
// costs an instantiation; unmarked (Arg 0), it traces and compiles again. Setup (steps at
// T = 128, 128 and 64) is not timed; the time is the call at T = 96 with its kernels, and
// `prepare_ms` the instantiation's or the compilation's own time.
void BM_CompileTinyTrainStepNewSize(benchmark::State& state) {
  const bool dynamic = state.range(0) != 0;
  double prepare = 0;
  for (auto _ : state) {
    state.PauseTiming();
    auto step = std::make_unique<TinyStep>();
    kiln::CompileOptions options;
    if (dynamic) options.dynamic(0, 1).dynamic(1, 1);
    auto compiled = kiln::compile(
        [&](const kiln::Tensor& x, const kiln::Tensor& y) { return (*step)(x, y); }, options);
    auto batch = [&](int64_t t) {
      return std::pair{step->x.narrow(1, 0, t).contiguous(), step->y.narrow(1, 0, t).contiguous()};
    };
    for (int64_t t : {kSeq, kSeq, kSeq / 2}) {
      const auto [x, y] = batch(t);
      compiled(x, y);
    }
    const auto [x, y] = batch(kSeq * 3 / 4);
    state.ResumeTiming();
    benchmark::DoNotOptimize(compiled(x, y).impl());
    state.PauseTiming();
    const auto& stats = compiled.stats();
    if (dynamic) {
      if (stats.dynamic_instances != 1) state.SkipWithError("the new size did not share");
      prepare += stats.instantiate_ms;
    } else {
      for (const auto& [stage, ms] : stats.stage_ms) prepare += ms;
    }
    state.ResumeTiming();
  }
  state.counters["prepare_ms"] = prepare / static_cast<double>(state.iterations());
}
BENCHMARK(BM_CompileTinyTrainStepNewSize)
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(5);

// kiln-tiny's loss compiled as a function with a backward node (forward program, then the
// compiled backward through loss.backward()), per remat policy (0: kSaveAll, 1: kMinCut). The
// counters are what the forward saves for the backward and the ops the backward recomputes.
void BM_CompileTinyLossRemat(benchmark::State& state) {
  TinyStep step;
  {
    kiln::NoGradGuard no_grad;  // builds the RoPE tables eagerly: no state escapes the trace
    (void)step.model->loss(step.x, step.y);
  }
  const auto policy = state.range(0) == 0 ? kiln::compiler::RematPolicy::kSaveAll
                                          : kiln::compiler::RematPolicy::kMinCut;
  auto loss = kiln::compile(
      [&](const kiln::Tensor& x, const kiln::Tensor& y) { return step.model->loss(x, y); },
      kiln::CompileOptions().remat(policy));
  auto run = [&] {
    step.model->zero_grad();
    kiln::Tensor l = loss(step.x, step.y);
    l.backward();
    return l;
  };
  run();  // traces and compiles
  for (auto _ : state) benchmark::DoNotOptimize(run().impl());
  if (loss.stats().misses != 1) state.SkipWithError("the compiled loss was traced again");
  state.counters["saved_MB"] = static_cast<double>(loss.stats().saved_bytes) / 1e6;
  state.counters["recomputed_ops"] = loss.stats().recomputed_ops;
  set_tokens_counter(state);
}
BENCHMARK(BM_CompileTinyLossRemat)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

// A cache hit's cost: one add of two [1] tensors, compiled (signature, guards, the program's
// frame and one eager step) against the add called eagerly.
void BM_CompileAddEager(benchmark::State& state) {
  const kiln::Tensor a = kiln::ones({1}), b = kiln::ones({1});
  for (auto _ : state) benchmark::DoNotOptimize(kiln::add(a, b).impl());
}
BENCHMARK(BM_CompileAddEager);

void BM_CompileAddCompiledHit(benchmark::State& state) {
  const kiln::Tensor a = kiln::ones({1}), b = kiln::ones({1});
  auto add = kiln::compile([](const kiln::Tensor& x, const kiln::Tensor& y) { return x + y; });
  add(a, b);  // traced once; every timed call is a hit
  for (auto _ : state) benchmark::DoNotOptimize(add(a, b).impl());
  if (add.stats().misses != 1) state.SkipWithError("the add was traced again");
}
BENCHMARK(BM_CompileAddCompiledHit);

// Fusion on the CPU: a layer norm with a scaled residual written with plain ops over
// [16384, 1024] f32 (10 ops: 2 row reductions, 8 pointwise, each memory-bound in eager code),
// eager against compiled with the fused_cpu executor (one region in row blocks) and compiled
// without the fuse pass (the same kernels, one full-size pass each).
kiln::Tensor norm_residual(const kiln::Tensor& x, const kiln::Tensor& g, const kiln::Tensor& b) {
  const kiln::Tensor c = x - x.mean({1}, true);
  const kiln::Tensor h = c * (c.square().mean({1}, true) + 1e-5).rsqrt() * g + b;
  return h * 0.5 + x;
}

struct NormInputs {
  kiln::Tensor x = kiln::randn({16384, 1024}), g = kiln::randn({1024}), b = kiln::randn({1024});
};

void BM_CompileFusedChainEager(benchmark::State& state) {
  NormInputs in;
  for (auto _ : state) benchmark::DoNotOptimize(norm_residual(in.x, in.g, in.b).impl());
}
BENCHMARK(BM_CompileFusedChainEager)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_CompileFusedChainCompiled(benchmark::State& state) {
  NormInputs in;
  const bool fuse = state.range(0) != 0;
  auto f = kiln::compile(norm_residual, fuse ? kiln::CompileOptions()
                                         : kiln::CompileOptions().skip_pass("fuse"));
  f(in.x, in.g, in.b);
  for (auto _ : state) benchmark::DoNotOptimize(f(in.x, in.g, in.b).impl());
}
BENCHMARK(BM_CompileFusedChainCompiled)
    ->ArgName("fuse")
    ->Arg(1)
    ->Arg(0)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
