// The row-reduction launch configurations that lost (kernels/cuda/reduce.cu ships the winner): the
// library's row kernels (kernels/cuda/reduce.cuh) at other thread counts, validated against an f64
// reference computed by kiln ops on the CPU and timed beside the library's choice, for the row sum
// of an 8192 x 8192 matrix (bf16 and f32).
//
// The library: one warp per row up to 4096 elements, else a block sized so that each thread has
// a full round of 16-byte loads (8192 bf16: 256 threads, 8192 f32: 512). The variants: one warp
// per row at any length, and blocks of 128 or 512 threads. Column sums (sum over the first dim):
// the library's packed column kernel (16-byte loads, V columns a thread) against the kernel of one
// element a thread it had before session 45, and against other row chunks.
// measurements: benchmarks/RESULTS.md (sessions 5 and the H100 table after it, "Row sums").
#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
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

// Column sums of x [R, K] (sum over the first dim) by the column kernel (`packed`: on 16-byte
// packs) split along R into chunks of at least `min_chunk` rows, as many as fill the GPU in one
// wave (reduce.cu's rule), the partials merged by finalize_kernel in a fixed order. Returns the
// number of chunks.
template <typename T>
int64_t column_sums(const Tensor& x, const Tensor& out, bool packed, int64_t min_chunk) {
  using Red = scalar::SumReducer<T, float>;
  using cuda::internal::kColX;
  using cuda::internal::kColY;
  const Red red{static_cast<T*>(out.data_ptr()), 1.0f};
  const int64_t R = x.size(0), K = x.size(1);
  const int64_t width = packed ? kColX * static_cast<int64_t>(16 / sizeof(T)) : kColX;
  const int64_t kblocks = (K + width - 1) / width;
  const int64_t sms = cuda::loops::multiprocessor_count();
  const int64_t per_sm = packed ? cuda::internal::resident_blocks(
                                      cuda::internal::columns_packed_kernel<T, Red>, kColX * kColY)
                                : cuda::internal::resident_blocks(
                                      cuda::internal::columns_kernel<T, Red>, kColX * kColY);
  int64_t splits = 1;
  if (kblocks < 2 * sms) {
    splits = std::clamp<int64_t>(std::min((R + min_chunk - 1) / min_chunk, per_sm * sms / kblocks),
                                 1, 65535);
  }
  const int64_t chunk = (R + splits - 1) / splits;
  splits = (R + chunk - 1) / chunk;
  Tensor workspace;
  float* partial = nullptr;
  if (splits > 1) {
    workspace = empty({splits * K}, TensorOptions(kFloat).device(x.device()));
    partial = static_cast<float*>(workspace.data_ptr());
  }
  const dim3 grid(static_cast<unsigned>(kblocks), 1, static_cast<unsigned>(splits));
  const T* px = static_cast<const T*>(x.data_ptr());
  if (packed) {
    cuda::internal::columns_packed_kernel<T, Red>
        <<<grid, dim3(kColX, kColY)>>>(red, px, 1, R, K, chunk, partial);
    KILN_CUDA_LAUNCH_CHECK("columns_packed_kernel");
  } else {
    cuda::internal::columns_kernel<T, Red>
        <<<grid, dim3(kColX, kColY)>>>(red, px, 1, R, K, chunk, partial);
    KILN_CUDA_LAUNCH_CHECK("columns_kernel");
  }
  if (splits > 1) {
    cuda::internal::finalize_kernel<<<cuda::loops::grid_for(K), cuda::loops::kThreads>>>(
        red, partial, splits, K);
    KILN_CUDA_LAUNCH_CHECK("finalize_kernel");
  }
  return splits;
}

// The contenders: the element-a-thread kernel the library ran before session 45 (chunks of at
// least 256 rows), and the packed kernel with shorter and longer chunks than the library's.
const std::vector<std::tuple<std::string, bool, int64_t>> kColumnVariants = {
    {"element a thread, 256-row chunks", false, 256},
    {"packed, 128-row chunks", true, 128},
    {"packed, 256-row chunks", true, 256},
    {"packed, 512-row chunks", true, 512}};

void run_columns(ScalarType dt) {
  const std::string tn = dt == kFloat ? "f32" : "bf16";
  const double rtol = dt == kFloat ? 1e-5 : 8e-3, atol = dt == kFloat ? 1e-4 : 5e-2;
  visit_floating(dt, "reduce_lab", [&]<typename T>(TypeTag<T>) {
    for (const auto& [R, K] : std::vector<std::pair<int64_t, int64_t>>{
             {8192, 2048}, {8192, 8192}, {16384, 768}, {1000, 4104}}) {
      const Tensor x = bench::random({R, K}, dt);
      const std::string shape = std::to_string(R) + "x" + std::to_string(K);
      const std::string base = "sum columns " + shape + " " + tn;
      const Tensor ref = sum(x.to(kCPU).to(kDouble), {0});
      const Tensor out = empty({K}, TensorOptions(dt).device(x.device()));
      check(base + " [library]", sum(x, {0}), ref, atol, rtol);
      const double bytes = static_cast<double>(x.nbytes());
      bench::report(base + " [library]", bench::time_ms([&](int) { (void)sum(x, {0}); }), 0, bytes);
      for (const auto& [name, packed, min_chunk] : kColumnVariants) {
        const int64_t splits = column_sums<T>(x, out, packed, min_chunk);
        check(base + " [" + name + "]", out, ref, atol, rtol);
        bench::report(base + " [" + name + ": " + std::to_string(splits) + " chunks]",
                      bench::time_ms([&, p = packed, c = min_chunk](int) {
                        (void)column_sums<T>(x, out, p, c);
                      }),
                      0, bytes);
      }
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
