// CPU micro-benchmarks of the eager tensor library, each beside its yardstick in the same
// binary: dispatch overhead of an op on a 1-element tensor, elementwise and reduction
// bandwidth against memcpy of the same bytes, matmul against Eigen called directly, and each
// instruction set's build of the CPU product side by side.
//
//   build/benchmarks/kiln_bench --benchmark_min_time=0.2
//   build/benchmarks/kiln_bench --benchmark_filter='Matmul' --benchmark_min_time=0.2
//
// Bandwidth benchmarks count bytes read + written (bytes_per_second is comparable across
// them); matmul reports FLOP/s. The last argument of the threaded benchmarks is the thread count
// (kiln::set_num_threads, which also sets Eigen's). Results: benchmarks/RESULTS.md.
#include <benchmark/benchmark.h>
#include <kiln/kiln.h>
#include <omp.h>

#include <Eigen/Core>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/gemm.h"

namespace {

constexpr int64_t k16M = int64_t{1} << 24;
constexpr int64_t kFloatBytes = sizeof(float);

void set_threads(const benchmark::State& state, int arg) {
  kiln::set_num_threads(static_cast<int>(state.range(arg)));
}

// --- Dispatch overhead: the whole eager path (registry, meta, allocation, kernel) -----------

void BM_DispatchAdd1(benchmark::State& state) {
  const kiln::Tensor a = kiln::full({1}, 1.0f), b = kiln::full({1}, 2.0f);
  for (auto _ : state) benchmark::DoNotOptimize(kiln::add(a, b));
}
BENCHMARK(BM_DispatchAdd1);

void BM_DispatchView1(benchmark::State& state) {
  const kiln::Tensor a = kiln::full({1}, 1.0f);
  for (auto _ : state) benchmark::DoNotOptimize(a.view({1, 1}));
}
BENCHMARK(BM_DispatchView1);

void BM_DispatchMm1(benchmark::State& state) {
  const kiln::Tensor a = kiln::full({1, 1}, 1.0f), b = kiln::full({1, 1}, 2.0f);
  for (auto _ : state) benchmark::DoNotOptimize(kiln::mm(a, b));
}
BENCHMARK(BM_DispatchMm1);

// --- Bandwidth over 16M f32 (64 MiB per operand) ---------------------------------------------

// The yardstick: memcpy of one 16M-float buffer (64 MiB read + 64 MiB written), split into
// one contiguous chunk per thread.
void BM_Memcpy16M(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  std::vector<float> src(k16M, 1.0f), dst(k16M, 0.0f);
  const int64_t chunk = k16M / threads;
  for (auto _ : state) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; ++t) {
      std::memcpy(dst.data() + t * chunk, src.data() + t * chunk, chunk * kFloatBytes);
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * 2 * k16M * kFloatBytes);
}
BENCHMARK(BM_Memcpy16M)->Arg(1)->Arg(2)->UseRealTime();

// out = a + b: 2 reads + 1 write. Allocates its output each call, as eager code does.
void BM_Add16M(benchmark::State& state) {
  set_threads(state, 0);
  const kiln::Tensor a = kiln::full({k16M}, 1.0f), b = kiln::full({k16M}, 2.0f);
  for (auto _ : state) benchmark::DoNotOptimize(kiln::add(a, b));
  state.SetBytesProcessed(state.iterations() * 3 * k16M * kFloatBytes);
}
BENCHMARK(BM_Add16M)->Arg(1)->Arg(2)->UseRealTime();

// a += b: the same traffic without the allocation (isolates the loop from page faults of a
// fresh 64 MiB output).
void BM_AddInplace16M(benchmark::State& state) {
  set_threads(state, 0);
  kiln::Tensor a = kiln::full({k16M}, 1.0f);
  const kiln::Tensor b = kiln::full({k16M}, 0.0f);
  for (auto _ : state) benchmark::DoNotOptimize(a.add_(b));
  state.SetBytesProcessed(state.iterations() * 3 * k16M * kFloatBytes);
}
BENCHMARK(BM_AddInplace16M)->Arg(1)->Arg(2)->UseRealTime();

// out = exp(a): 1 read + 1 write.
void BM_Exp16M(benchmark::State& state) {
  set_threads(state, 0);
  const kiln::Tensor a = kiln::full({k16M}, 0.5f);
  for (auto _ : state) benchmark::DoNotOptimize(kiln::exp(a));
  state.SetBytesProcessed(state.iterations() * 2 * k16M * kFloatBytes);
}
BENCHMARK(BM_Exp16M)->Arg(1)->Arg(2)->UseRealTime();

// out = -a: 1 read + 1 write, no math: the unary loop at memory speed.
void BM_Neg16M(benchmark::State& state) {
  set_threads(state, 0);
  const kiln::Tensor a = kiln::full({k16M}, 0.5f);
  for (auto _ : state) benchmark::DoNotOptimize(kiln::neg(a));
  state.SetBytesProcessed(state.iterations() * 2 * k16M * kFloatBytes);
}
BENCHMARK(BM_Neg16M)->Arg(1)->Arg(2)->UseRealTime();

// gelu's gradient over 16M f32 (2 reads + 1 write): the gelu_backward op (Arg 0: exact, 1: tanh;
// Arg 1: threads) against its formula in plain ops (the decomposition: gelu's backward before
// gelu_backward was one op).
void gelu_backward_bench(benchmark::State& state, bool one_op) {
  static const kiln::OpDef& op = KILN_OP(gelu_backward);
  set_threads(state, 1);
  const std::string approximate = state.range(0) == 0 ? "none" : "tanh";
  const kiln::Tensor g = kiln::randn({k16M}), x = kiln::randn({k16M}) * 3;
  for (auto _ : state) {
    benchmark::DoNotOptimize(one_op ? kiln::call_op1(op, {g, x}, {approximate})
                                    : kiln::call_decomposition(op, {g, x}, {approximate})[0]);
  }
  state.SetBytesProcessed(state.iterations() * 3 * k16M * kFloatBytes);
}
void BM_GeluBackward16M(benchmark::State& state) { gelu_backward_bench(state, true); }
void BM_GeluBackwardOps16M(benchmark::State& state) { gelu_backward_bench(state, false); }
BENCHMARK(BM_GeluBackward16M)->ArgsProduct({{0, 1}, {1, 2}})->UseRealTime();
BENCHMARK(BM_GeluBackwardOps16M)->ArgsProduct({{0, 1}, {1, 2}})->UseRealTime();

// --- Reductions over 16M f32 (bytes read; the outputs are tiny) -------------------------------

void BM_SumAll16M(benchmark::State& state) {
  set_threads(state, 0);
  const kiln::Tensor a = kiln::full({k16M}, 1.0f);
  for (auto _ : state) benchmark::DoNotOptimize(a.sum());
  state.SetBytesProcessed(state.iterations() * k16M * kFloatBytes);
}
BENCHMARK(BM_SumAll16M)->Arg(1)->Arg(2)->UseRealTime();

// Row-wise: [4096, 4096] summed over the last dim (contiguous rows).
void BM_SumRows16M(benchmark::State& state) {
  set_threads(state, 0);
  const kiln::Tensor a = kiln::full({4096, 4096}, 1.0f);
  for (auto _ : state) benchmark::DoNotOptimize(a.sum({1}));
  state.SetBytesProcessed(state.iterations() * (k16M + 4096) * kFloatBytes);
}
BENCHMARK(BM_SumRows16M)->Arg(1)->Arg(2)->UseRealTime();

// amax over the rows of [4096, 4096] (the order-free pick: +0 above -0, NaN wins).
void BM_AmaxRows16M(benchmark::State& state) {
  set_threads(state, 0);
  kiln::manual_seed(0);
  const kiln::Tensor a = kiln::randn({4096, 4096});
  for (auto _ : state) benchmark::DoNotOptimize(a.amax({1}));
  state.SetBytesProcessed(state.iterations() * (k16M + 4096) * kFloatBytes);
}
BENCHMARK(BM_AmaxRows16M)->Arg(1)->Arg(2)->UseRealTime();

// --- Matmul: kiln::matmul against Eigen on the same row-major data -----------------------------

void set_flops(benchmark::State& state, int64_t n) {
  state.counters["FLOP/s"] = benchmark::Counter(2.0 * static_cast<double>(n * n * n),
                                                benchmark::Counter::kIsIterationInvariantRate);
}

// Args: {n, threads}. Multiplies [n, n] @ [n, n] f32, allocating the output per call.
void BM_KilnMatmul(benchmark::State& state) {
  set_threads(state, 1);
  const int64_t n = state.range(0);
  const kiln::Tensor a = kiln::full({n, n}, 0.5f), b = kiln::full({n, n}, 0.25f);
  for (auto _ : state) benchmark::DoNotOptimize(kiln::matmul(a, b));
  set_flops(state, n);
}

// Eigen directly: row-major maps over the same kind of buffers, C.noalias() = A * B.
void BM_EigenMatmul(benchmark::State& state) {
  set_threads(state, 1);
  const int64_t n = state.range(0);
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n, 0.0f);
  Eigen::Map<const RowMajor> A(a.data(), n, n), B(b.data(), n, n);
  Eigen::Map<RowMajor> C(c.data(), n, n);
  for (auto _ : state) {
    C.noalias() = A * B;
    benchmark::ClobberMemory();
  }
  set_flops(state, n);
}

void matmul_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "threads"});
  for (int64_t n : {1024, 2048}) {
    for (int64_t t : {1, 2}) b->Args({n, t});
  }
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}
BENCHMARK(BM_KilnMatmul)->Apply(matmul_args);
BENCHMARK(BM_EigenMatmul)->Apply(matmul_args);

// Each instruction set's build of the CPU product (kernels/cpu/gemm.h) that this CPU runs, side
// by side. Args: {build (0 = the chosen, widest; then narrower down to the baseline), n, k, p,
// threads}: [n, k] @ [k, p] f32, row-major, accumulating into c. The label names the build.
//   build/benchmarks/kiln_bench --benchmark_filter='CpuGemmBuild' --benchmark_min_time=0.5
void BM_CpuGemmBuild(benchmark::State& state) {
  const std::vector<kiln::cpu::GemmVariant> builds = kiln::cpu::gemm_variants();
  const auto which = static_cast<size_t>(state.range(0));
  if (which >= builds.size()) {
    state.SkipWithError("this CPU runs fewer builds");
    return;
  }
  set_threads(state, 4);
  const int64_t n = state.range(1), k = state.range(2), p = state.range(3);
  std::vector<float> a(n * k, 0.5f), b(k * p, 0.25f), c(n * p, 0.0f);
  for (auto _ : state) {
    builds[which].f32(c.data(), p, a.data(), true, k, b.data(), true, p, n, k, p, 1.0f);
    benchmark::ClobberMemory();
  }
  state.SetLabel(builds[which].isa);
  state.counters["FLOP/s"] = benchmark::Counter(2.0 * static_cast<double>(n * k * p),
                                                benchmark::Counter::kIsIterationInvariantRate);
}
void cpu_gemm_build_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"build", "n", "k", "p", "threads"});
  for (int64_t build : {0, 1, 2}) {
    for (int64_t threads : {1, 2}) {
      b->Args({build, 1024, 1024, 1024, threads});
      b->Args({build, 1024, 256, 688, threads});  // kiln-tiny's MLP: 8 x 128 tokens, d 256
    }
  }
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}
BENCHMARK(BM_CpuGemmBuild)->Apply(cpu_gemm_build_args);

// The CPU attention kernel, forward and backward, at kiln-tiny's shape (8 x 128 tokens, 8 heads
// of 32, 4 kv heads, causal), f32: the blocked f32 path (arg 0) against the f64 loops on the same
// inputs widened (arg 1; the arithmetic every dtype ran before session 44). Arg 2: threads.
//   build/benchmarks/kiln_bench --benchmark_filter='CpuAttention' --benchmark_min_time=0.5
void BM_CpuAttention(benchmark::State& state) {
  set_threads(state, 1);
  kiln::manual_seed(0);
  const kiln::ScalarType dtype = state.range(0) == 0 ? kiln::kFloat : kiln::kDouble;
  const kiln::TensorOptions o(dtype);
  const kiln::Tensor q = kiln::randn({8, 8, 128, 32}, o), k = kiln::randn({8, 4, 128, 32}, o),
                     v = kiln::randn({8, 4, 128, 32}, o), dout = kiln::randn({8, 8, 128, 32}, o);
  static const kiln::OpDef& bwd = KILN_OP(flash_attention_backward);
  const double scale = 1.0 / std::sqrt(32.0);
  for (auto _ : state) {
    auto [out, lse] = kiln::flash_attention(q, k, v, scale, true);
    benchmark::DoNotOptimize(kiln::call_op(bwd, {dout, q, k, v, out, lse, kiln::Tensor()},
                                           {scale, true, int64_t{0}, 0.0}));
  }
  state.SetLabel(state.range(0) == 0 ? "blocked f32" : "f64 loops");
}
BENCHMARK(BM_CpuAttention)
    ->ArgNames({"f64", "threads"})
    ->Args({0, 1})
    ->Args({1, 1})
    ->Args({0, 2})
    ->Args({1, 2})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// Batch dims folded into one GEMM: [8, 512, 1024] @ [1024, 1024] (a linear layer's shape).
void BM_KilnMatmulFolded(benchmark::State& state) {
  set_threads(state, 0);
  const kiln::Tensor x = kiln::full({8, 512, 1024}, 0.5f), w = kiln::full({1024, 1024}, 0.25f);
  for (auto _ : state) benchmark::DoNotOptimize(kiln::matmul(x, w));
  state.counters["FLOP/s"] =
      benchmark::Counter(2.0 * 4096 * 1024 * 1024, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_KilnMatmulFolded)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
