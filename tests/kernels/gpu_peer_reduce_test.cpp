// peer_sum (kernels/cuda/peer_reduce.cu), the reduction step of dist's copy-engine all-reduce,
// against the same sum on the CPU: every input count the kernel is compiled for (1 to 8), f32,
// f64, bf16 and f16, lengths below one pack, around the unrolled iteration and odd ones, data not
// 16-byte aligned (the element path), a second output and an output that is an input. The
// kernel adds in input order in f32 (f64 for f64) and rounds once, as the CPU reference below
// does, so the bits match. Suite Gpu* (ctest label gpu); skips without a GPU.
#include <gtest/gtest.h>

#include <vector>

#include "kernels/gpu_test_util.h"
#include "tensor/ops.h"
#include "test_util.h"

#if defined(KILN_WITH_CUDA)
#include "kernels/cuda/peer_reduce.h"
#endif

namespace kiln {
namespace {

using test::kGpu;

class GpuPeerSum : public test::GpuTest {};

#if defined(KILN_WITH_CUDA)
// scale * (x[0] + x[1] + ...), added left to right in the accumulation type, rounded once.
Tensor reference(const std::vector<Tensor>& xs, double scale) {
  const ScalarType acc = xs[0].dtype() == kDouble ? kDouble : kFloat;
  Tensor sum = xs[0].cpu().to(acc);
  for (size_t j = 1; j < xs.size(); ++j) sum = sum + xs[j].cpu().to(acc);
  return (sum * full({}, scale, acc)).to(xs[0].dtype());
}

void expect_same_bits(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  const Tensor g = got.cpu().to(kDouble), w = want.to(kDouble);
  const auto gv = g.to_vector<double>(), wv = w.to_vector<double>();
  for (size_t i = 0; i < gv.size(); ++i) {
    ASSERT_EQ(gv[i], wv[i]) << what << ": element " << i;
  }
}
#endif

TEST_F(GpuPeerSum, MatchesTheCpuSumBitForBit) {
#if defined(KILN_WITH_CUDA)
  manual_seed(5);
  for (ScalarType dt : {kFloat, kDouble, kBFloat16, kHalf}) {
    for (int k = 1; k <= cuda::internal::kMaxPeerInputs; ++k) {
      for (int64_t n : {int64_t{1}, int64_t{5}, int64_t{4096}, int64_t{512 * 8 * 4 * 33 + 13}}) {
        for (int64_t offset : {0, 1}) {
          std::vector<Tensor> storage, xs;
          std::vector<const void*> ptrs;
          for (int j = 0; j < k; ++j) {
            storage.push_back(randn({n + offset}).to(dt).to(kGpu));
            xs.push_back(storage.back().narrow(0, offset, n));
            ptrs.push_back(xs.back().data_ptr());
          }
          Tensor out = empty({n + offset}, TensorOptions(dt).device(kGpu)).narrow(0, offset, n);
          const double scale = 1.0 / k;
          const Tensor want = reference(xs, scale);
          // out1 = the first input, summed in place.
          cuda::internal::peer_sum(dt, ptrs.data(), k, out.data_ptr(), xs[0].data_ptr(), n, scale,
                                   cuda::current_stream());
          const std::string what = std::string(dtype_name(dt)) + " k=" + std::to_string(k) +
                                   " n=" + std::to_string(n) + " offset=" + std::to_string(offset);
          expect_same_bits(out, want, what);
          expect_same_bits(xs[0], want, what + " (in place)");
        }
      }
    }
  }
  const void* none[1] = {nullptr};
  EXPECT_THROW(
      cuda::internal::peer_sum(kFloat, none, 0, nullptr, nullptr, 1, 1.0, cuda::current_stream()),
      Error);
  Tensor i = zeros({4}, TensorOptions(kInt32).device(kGpu));
  const void* one[1] = {i.data_ptr()};
  EXPECT_THROW(cuda::internal::peer_sum(kInt32, one, 1, i.data_ptr(), nullptr, 4, 1.0,
                                        cuda::current_stream()),
               Error);
#endif
}

}  // namespace
}  // namespace kiln
