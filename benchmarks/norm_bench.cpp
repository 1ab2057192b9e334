// CPU benchmarks of the fused norms (kernels/cpu/norm.cpp): rms_norm and layer_norm forward and
// rms_norm's backward op on f32 rows of ordinary magnitude (the path every row takes unless its
// f32 sums leave their range, kernels/norm_range.h), and rms_norm on rows at 1e20 (each row
// summed again in f64), one thread so that the numbers do not depend on the shared cores.
//
//   build/benchmarks/kiln_bench --benchmark_filter='Norm' --benchmark_min_time=0.5
//
// Bytes counted: x read and y written (the backward: dy and x read, dx written). Results:
// benchmarks/RESULTS.md.
#include <benchmark/benchmark.h>
#include <kiln/kiln.h>

namespace {

// rows x d f32, scaled by `scale`.
kiln::Tensor rows_of(int64_t rows, int64_t d, double scale) {
  kiln::manual_seed(0);
  return kiln::randn({rows, d}) * scale;
}

void forward_bench(benchmark::State& state, bool layer, double scale) {
  kiln::set_num_threads(1);
  const int64_t rows = state.range(0), d = state.range(1);
  const kiln::Tensor x = rows_of(rows, d, scale), w = kiln::randn({d}), b = kiln::randn({d});
  for (auto _ : state) {
    benchmark::DoNotOptimize(layer ? kiln::layer_norm(x, w, b, 1e-5) : kiln::rms_norm(x, w, 1e-5));
  }
  state.SetBytesProcessed(state.iterations() * rows * d * 2 * 4);
}

void BM_RmsNormForward(benchmark::State& state) { forward_bench(state, false, 1.0); }
BENCHMARK(BM_RmsNormForward)->Args({4096, 1024})->Args({512, 8192})->UseRealTime();

void BM_RmsNormForwardAt1e20(benchmark::State& state) { forward_bench(state, false, 1e20); }
BENCHMARK(BM_RmsNormForwardAt1e20)->Args({4096, 1024})->UseRealTime();

void BM_LayerNormForward(benchmark::State& state) { forward_bench(state, true, 1.0); }
BENCHMARK(BM_LayerNormForward)->Args({4096, 1024})->Args({512, 8192})->UseRealTime();

void BM_RmsNormBackward(benchmark::State& state) {
  kiln::set_num_threads(1);
  const int64_t rows = state.range(0), d = state.range(1);
  const kiln::Tensor x = rows_of(rows, d, 1.0), w = kiln::randn({d}), dy = kiln::randn({rows, d});
  static const kiln::OpDef& fwd = KILN_OP(rms_norm);
  static const kiln::OpDef& bwd = KILN_OP(rms_norm_backward);
  const kiln::TensorVec out = kiln::call_op(fwd, {x, w}, {1e-5});
  for (auto _ : state) benchmark::DoNotOptimize(kiln::call_op(bwd, {dy, x, w, out[1]}));
  state.SetBytesProcessed(state.iterations() * rows * d * 3 * 4);
}
BENCHMARK(BM_RmsNormBackward)->Args({4096, 1024})->UseRealTime();

}  // namespace
