// The softmax configurations that lost (kernels/cuda/softmax.cu ships the winner): the library's
// shared-memory kernel (kernels/cuda/softmax.cuh) with the row read through registers instead of
// one bulk copy, and at other thread counts, validated against an f64 reference composed of kiln
// ops on the CPU and timed beside the library's choice over 8192 x 32768 bf16 (read + write).
//
// The library: on sm_90 one bulk copy (TMA) per row into shared memory, about 8 16-byte vectors per
// thread (32768 bf16: 512 threads). The variants: 16-byte loads through registers (the library's
// path before sm_90), 128 or 256 threads with either load.
// measurements: benchmarks/RESULTS.md (session 5 and the H100 table after it, "Softmax").
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/softmax.cuh"
#include "lab/lab.h"
#include "tensor/ops.h"

namespace kiln::lab {
namespace {

struct Variant {
  std::string name;
  bool bulk;
  int threads;  // 0: the library's count
};
const std::vector<Variant> kVariants = {{"registers", false, 0},
                                        {"bulk,128", true, 128},
                                        {"bulk,256", true, 256},
                                        {"registers,256", false, 256}};

// softmax of x [A, R] (bf16, contiguous) along its rows into y by the shared-memory kernel.
void smem_softmax(const Tensor& x, const Tensor& y, const Variant& v) {
  using T = BFloat16;
  namespace ci = cuda::internal;
  const int64_t A = x.size(0), R = x.size(1);
  const int64_t smem = ((R + ci::kVec<T>)*static_cast<int64_t>(sizeof(T)) + 15) / 16 * 16;
  ci::prepare_smem_kernel<T, false>();
  const int threads = v.threads > 0 ? v.threads : ci::smem_row_threads(R / ci::kVec<T>);
  ci::softmax_smem_kernel<T, false><<<static_cast<unsigned>(A), threads, smem>>>(
      static_cast<const T*>(x.data_ptr()), static_cast<T*>(y.data_ptr()), static_cast<int>(R),
      v.bulk);
  KILN_CUDA_LAUNCH_CHECK("softmax_smem_kernel");
}

KILN_LAB_CASE(softmax, [] {
  // Each variant against the reference: rows at every alignment (odd lengths), a row length
  // that is not a multiple of the threads' vectors.
  for (const auto& [rows, n] :
       std::vector<std::pair<int64_t, int64_t>>{{37, 32768}, {9, 12345}, {12, 2056}}) {
    const Tensor x = bench::random({rows, n}, kBFloat16, 8.0f);
    const Tensor xd = x.to(kCPU).to(kDouble);
    const Tensor e = exp(xd - std::get<0>(xd.max(1)).unsqueeze(1));
    const Tensor ref = e / sum(e, {1}, true);
    const std::string shape = std::to_string(rows) + "x" + std::to_string(n);
    for (const Variant& v : kVariants) {
      const Tensor y = empty_like(x);
      smem_softmax(x, y, v);
      check("softmax " + shape + " bf16 [" + v.name + "]", y, ref, 1e-7, 1e-2);
    }
  }
  const Tensor x = bench::random({8192, 32768}, kBFloat16, 8.0f);
  const double bytes = 2.0 * static_cast<double>(x.nbytes());
  bench::report("softmax 8192x32768 bf16 [library]",
                bench::time_ms([&](int) { (void)softmax(x, -1); }), 0, bytes);
  const Tensor y = empty_like(x);
  for (const Variant& v : kVariants) {
    bench::report("softmax 8192x32768 bf16 [" + v.name + "]",
                  bench::time_ms([&](int) { smem_softmax(x, y, v); }), 0, bytes);
  }
});

}  // namespace
}  // namespace kiln::lab
