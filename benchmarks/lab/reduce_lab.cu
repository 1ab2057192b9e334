// The row-reduction launch configurations that lost (kernels/cuda/reduce.cu ships the winner): the
// library's row kernels (kernels/cuda/reduce.cuh) at other thread counts, validated against an f64
// reference computed by kiln ops on the CPU and timed beside the library's choice, for the row sum
// of an 8192 x 8192 matrix (bf16 and f32).
//
// The library: one warp per row up to 4096 elements, else a block sized so that each thread has
// a full round of 16-byte loads (8192 bf16: 256 threads, 8192 f32: 512). The variants: one warp
// per row at any length, and blocks of 128 or 512 threads. Column sums (sum over the first dim):
// the library's split of the rows against the one it had before session 43 (chunks of at least
// 4096 rows, 4 blocks per multiprocessor).
// measurements: benchmarks/RESULTS.md (sessions 5 and the H100 table after it, "Row sums").
#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/reduce.cuh"
#include "lab/lab.h"
#include "tensor/ops.h"

namespace kiln::lab {
namespace {

// Row sums of x [A, R] into out [A] by one warp per row (threads == 32) or one block of `threads`
// per row.
template <typename T>
void row_sums(const Tensor& x, const Tensor& out, int threads) {
  using Red = scalar::SumReducer<T, float>;
  const Red red{static_cast<T*>(out.data_ptr()), 1.0f};
  const int64_t A = x.size(0), R = x.size(1);
  const T* px = static_cast<const T*>(x.data_ptr());
  if (threads == 32) {
    constexpr int kWarpsPerBlock = cuda::loops::kThreads / 32;
    cuda::internal::rows_warp_kernel<T, Red>
        <<<cuda::loops::grid_for(A, kWarpsPerBlock), cuda::loops::kThreads>>>(red, px, A,
                                                                              static_cast<int>(R));
    KILN_CUDA_LAUNCH_CHECK("rows_warp_kernel");
  } else {
    cuda::internal::rows_block_kernel<T, Red>
        <<<static_cast<unsigned>(A), threads>>>(red, px, R, static_cast<int>(R), nullptr, A);
    KILN_CUDA_LAUNCH_CHECK("rows_block_kernel");
  }
}

// Column sums of x [R, K] (sum over the first dim) by the column kernel split along R into
// `splits` chunks, the partials merged by finalize_kernel in a fixed order.
template <typename T>
void column_sums(const Tensor& x, const Tensor& out, int64_t splits) {
  using Red = scalar::SumReducer<T, float>;
  const Red red{static_cast<T*>(out.data_ptr()), 1.0f};
  const int64_t R = x.size(0), K = x.size(1);
  const int64_t chunk = (R + splits - 1) / splits;
  splits = (R + chunk - 1) / chunk;
  Tensor workspace;
  float* partial = nullptr;
  if (splits > 1) {
    workspace = empty({splits * K}, TensorOptions(kFloat).device(x.device()));
    partial = static_cast<float*>(workspace.data_ptr());
  }
  const dim3 grid(static_cast<unsigned>((K + cuda::internal::kColX - 1) / cuda::internal::kColX), 1,
                  static_cast<unsigned>(splits));
  cuda::internal::columns_kernel<T, Red>
      <<<grid, dim3(cuda::internal::kColX, cuda::internal::kColY)>>>(
          red, static_cast<const T*>(x.data_ptr()), 1, R, K, chunk, partial);
  KILN_CUDA_LAUNCH_CHECK("columns_kernel");
  if (splits > 1) {
    cuda::internal::finalize_kernel<<<cuda::loops::grid_for(K), cuda::loops::kThreads>>>(
        red, partial, splits, K);
    KILN_CUDA_LAUNCH_CHECK("finalize_kernel");
  }
}

// The split the library used before session 43 for one row block: chunks of at least 4096 rows,
// 4 blocks per multiprocessor.
int64_t splits_before(int64_t R, int64_t K) {
  const int64_t sms = cuda::loops::multiprocessor_count();
  const int64_t natural = (K + cuda::internal::kColX - 1) / cuda::internal::kColX;
  if (natural >= 2 * sms) return 1;
  return std::clamp<int64_t>(std::min((R + 4095) / 4096, 4 * sms / natural), 1, 65535);
}

void run_columns(ScalarType dt) {
  const std::string tn = dt == kFloat ? "f32" : "bf16";
  const double rtol = dt == kFloat ? 1e-5 : 8e-3, atol = dt == kFloat ? 1e-4 : 5e-2;
  visit_floating(dt, "reduce_lab", [&]<typename T>(TypeTag<T>) {
    for (const auto& [R, K] :
         std::vector<std::pair<int64_t, int64_t>>{{8192, 2048}, {8192, 8192}}) {
      const Tensor x = bench::random({R, K}, dt);
      const std::string shape = std::to_string(R) + "x" + std::to_string(K);
      const Tensor ref = sum(x.to(kCPU).to(kDouble), {0});
      const Tensor out = empty({K}, TensorOptions(dt).device(x.device()));
      const int64_t before = splits_before(R, K);
      column_sums<T>(x, out, before);
      check("sum columns " + shape + " " + tn + " [4096-row chunks]", out, ref, atol, rtol);
      check("sum columns " + shape + " " + tn + " [library]", sum(x, {0}), ref, atol, rtol);
      const double bytes = static_cast<double>(x.nbytes());
      const std::string base = "sum columns " + shape + " " + tn;
      bench::report(base + " [library]", bench::time_ms([&](int) { (void)sum(x, {0}); }), 0, bytes);
      bench::report(base + " [4096-row chunks, 4 blocks/SM: " + std::to_string(before) + " splits]",
                    bench::time_ms([&](int) { column_sums<T>(x, out, before); }), 0, bytes);
    }
  });
}

const std::vector<std::pair<std::string, int>> kVariants = {
    {"warp", 32}, {"128 threads", 128}, {"512 threads", 512}};

void run_case(ScalarType dt) {
  const std::string tn = dt == kFloat ? "f32" : "bf16";
  const double rtol = dt == kFloat ? 1e-5 : 8e-3, atol = dt == kFloat ? 1e-4 : 5e-2;
  visit_floating(dt, "reduce_lab", [&]<typename T>(TypeTag<T>) {
    // Each variant against the reference: odd lengths (rows at every alignment), short rows.
    for (const auto& [rows, n] :
         std::vector<std::pair<int64_t, int64_t>>{{300, 8199}, {64, 37}, {33, 20001}}) {
      const Tensor x = bench::random({rows, n}, dt);
      const Tensor ref = sum(x.to(kCPU).to(kDouble), {1});
      const std::string shape = std::to_string(rows) + "x" + std::to_string(n);
      for (const auto& [name, threads] : kVariants) {
        const Tensor out = empty({rows}, TensorOptions(dt).device(x.device()));
        row_sums<T>(x, out, threads);
        check("sum rows " + shape + " " + tn + " [" + name + "]", out, ref, atol, rtol);
      }
    }
    // Timed: the GPU benchmark's row sum (64M elements read).
    const int64_t n = 8192;
    const Tensor m = bench::random({n, n}, dt);
    const double bytes = static_cast<double>(m.nbytes());
    const std::string base = "sum rows 8192x8192 " + tn;
    bench::report(base + " [library]", bench::time_ms([&](int) { (void)sum(m, {1}); }), 0, bytes);
    const Tensor out = empty({n}, TensorOptions(dt).device(m.device()));
    for (const auto& [name, threads] : kVariants) {
      bench::report(base + " [" + name + "]",
                    bench::time_ms([&, t = threads](int) { row_sums<T>(m, out, t); }), 0, bytes);
    }
  });
}

KILN_LAB_CASE(reduce, [] {
  run_case(kBFloat16);
  run_case(kFloat);
  run_columns(kBFloat16);
  run_columns(kFloat);
});

}  // namespace
}  // namespace kiln::lab
