// The CUDA kernel of cat (kernels/cuda/join.cu) against the CPU's, bit for bit, where its two
// paths meet: many small inputs copied by one launch per table (stack of 300 0-d tensors, as
// stack(foreach_norm(grads)) makes), small inputs of odd byte sizes and unaligned data beside
// large ones (cudaMemcpy2DAsync), along inner dims (several rows per input) and with inputs of
// other dtypes converted first. Suites are Gpu* (ctest label gpu) and skip without a GPU.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kernels/gpu_test_util.h"
#include "tensor/ops.h"
#include "test_util.h"

namespace kiln {
namespace {

using test::expect_match;

class GpuCatTest : public test::GpuTest {};

std::vector<Tensor> to_gpu(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const Tensor& t : ts) out.push_back(t.cuda());
  return out;
}

TEST_F(GpuCatTest, StackOfManyScalars) {
  manual_seed(1);
  for (ScalarType dtype : {kFloat, kBFloat16, kDouble}) {
    std::vector<Tensor> cpu;
    for (int i = 0; i < 300; ++i) cpu.push_back(randn({}).to(dtype));
    expect_match(stack(to_gpu(cpu)), stack(cpu), {0, 0}, "stack of 300 0-d tensors");
  }
}

TEST_F(GpuCatTest, SmallAndLargeInputsAlongEachDim) {
  manual_seed(2);
  for (ScalarType dtype : {kFloat, kBFloat16}) {
    // Widths along dim 1 of [3, w] inputs: odd byte counts, one large input (memcpy), one of
    // another dtype (converted first), one whose data starts 1 element into its storage.
    std::vector<Tensor> cpu, gpu;
    for (int64_t w : {1, 3, 8, 5, 40000, 2, 7}) {
      const Tensor t = randn({3, w}).to(dtype);
      cpu.push_back(t);
      gpu.push_back(t.cuda());
    }
    const Tensor other = randn({3, 4}, kDouble);
    cpu.push_back(other);
    gpu.push_back(other.cuda());
    const Tensor base = randn({3 * 5 + 1}).to(dtype);
    cpu.push_back(base.narrow(0, 1, 15).view({3, 5}));
    gpu.push_back(base.cuda().narrow(0, 1, 15).view({3, 5}));
    expect_match(cat(gpu, 1), cat(cpu, 1), {0, 0}, "cat dim 1 " + std::string(dtype_name(dtype)));
    // Along dim 0: one row band per input.
    std::vector<Tensor> cpu0, gpu0;
    for (int64_t r : {1, 2, 30000, 3}) {
      const Tensor t = randn({r, 5}).to(dtype);
      cpu0.push_back(t);
      gpu0.push_back(t.cuda());
    }
    expect_match(cat(gpu0, 0), cat(cpu0, 0), {0, 0}, "cat dim 0 " + std::string(dtype_name(dtype)));
  }
}

}  // namespace
}  // namespace kiln
