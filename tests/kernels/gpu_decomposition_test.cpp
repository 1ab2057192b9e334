// Decomposition == fused kernel on the GPU, for every fused op (decomposition_cases.h): each
// CUDA kernel against the op's decomposition run on the GPU, forward and gradients; flash
// attention's kernels at their head sizes; and calls no CUDA kernel supports (f32 attention, a
// mask) running the decomposition on the GPU.
#include <gtest/gtest.h>

#include <cmath>

#include "decomposition_cases.h"
#include "gpu_test_util.h"
#include "nn/functional.h"

namespace kiln {
namespace {

class GpuDecomposition : public test::GpuTest {};

TEST_F(GpuDecomposition, MatchesTheCudaKernels) {
  manual_seed(11);
  for (ScalarType dtype : {kFloat, kBFloat16, kHalf}) {
    for (const test::FusedCase& c : test::fused_cases(dtype)) {
      test::expect_decomposition_matches(c, "fused", test::kGpu);
    }
  }
}

// Every CUDA kernel of flash_attention that supports the case, at the head sizes the kernels
// take (the decomposition in f32 is the reference: the kernels round P to bf16/f16 once).
TEST_F(GpuDecomposition, AttentionMatchesEveryFlashKernel) {
  manual_seed(12);
  const OpDef& op = KILN_OP(flash_attention);
  int checked = 0;
  for (ScalarType dtype : {kBFloat16, kHalf}) {
    for (int64_t d : {64, 128, 256}) {
      for (test::FusedCase c : test::attention_cases(dtype, d)) {
        c.tol = 3e-2;
        OpCall call;
        call.op = &op;
        call.inputs = test::leaves(c.inputs, test::kGpu);
        call.attrs = c.attrs;
        for (const KernelDef& k : op.kernels[static_cast<int>(kCUDA)]) {
          if (!k.accepts(call)) continue;
          test::expect_decomposition_matches(c, k.name, test::kGpu);
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 0) << "no CUDA flash kernel took any case";
}

TEST_F(GpuDecomposition, UnsupportedCallsRunTheDecompositionOnTheGpu) {
  manual_seed(13);
  namespace F = nn::functional;
  // f32 attention (the flash kernels take f16/bf16) and a bool mask: the decomposition, on the
  // GPU, equals the same on the CPU.
  const Tensor q = randn({2, 4, 9, 32}), k = randn({2, 2, 9, 32}), v = randn({2, 2, 9, 32});
  const Tensor mask = randn({9, 9}) > Scalar(-0.5);
  for (const Tensor& m : {Tensor(), mask}) {
    const Tensor cpu = F::scaled_dot_product_attention(q, k, v, m, 0.0, !m.defined(), {}, true);
    const Tensor gpu = F::scaled_dot_product_attention(
        q.to(test::kGpu), k.to(test::kGpu), v.to(test::kGpu),
        m.defined() ? m.to(test::kGpu) : Tensor(), 0.0, !m.defined(), {}, true);
    EXPECT_TRUE(gpu.is_cuda());
    EXPECT_LE(test::scaled_error(gpu, cpu), 1e-5);
  }
  // rms_norm without a weight on the GPU.
  const Tensor x = randn({5, 24});
  EXPECT_LE(test::scaled_error(F::rms_norm(x.to(test::kGpu), {24}, Tensor(), 1e-6),
                               F::rms_norm(x, {24}, Tensor(), 1e-6)),
            1e-6);
}

}  // namespace
}  // namespace kiln
