// Gradients of the fused ops (tensor/ops/norm.cpp, tensor/ops/cross_entropy.cpp), whose
// backward rules call fused backward kernels.
#include "grad_test_util.h"

namespace kiln {
namespace {

using gradtest::check_grad;
using gradtest::leaf;
using gradtest::variable_list;

TEST(FusedGradTest, RmsNorm) {
  Tensor x = leaf({3, 5}, 1.0, 0.2);
  Tensor w = leaf({5}, 0.5, 1.0);
  EXPECT_TRUE(check_grad({"rms_norm"},
                         [](const variable_list& in) { return rms_norm(in[0], in[1], 1e-6); },
                         {x, w}));
  // Through a non-contiguous input.
  Tensor xt = leaf({5, 3}, 1.0, -0.3);
  EXPECT_TRUE(check_grad(
      {"rms_norm"},
      [](const variable_list& in) { return rms_norm(in[0].t(), in[1], 1e-5); }, {xt, w}));
}

TEST(FusedGradTest, CrossEntropyFused) {
  Tensor logits = leaf({4, 6}, 2.0);
  Tensor targets = tensor({1, 5, -100, 0});  // one ignored row
  EXPECT_TRUE(check_grad(
      {"cross_entropy_fused"},
      [targets](const variable_list& in) { return cross_entropy_fused(in[0], targets, -100); },
      {logits}));
}

// flash_attention (tensor/ops/attention.cpp): both outputs (out, and lse through a broadcast
// add), with GQA, causal with T != S, a window and softcap, and a strided q.
TEST(FusedGradTest, FlashAttention) {
  Tensor q = leaf({1, 4, 5, 3}, 0.8);
  Tensor k = leaf({1, 2, 4, 3}, 0.8);
  Tensor v = leaf({1, 2, 4, 3});
  EXPECT_TRUE(check_grad({"flash_attention"},
                         [](const variable_list& in) {
                           auto [o, lse] =
                               flash_attention(in[0], in[1], in[2], 0.7, /*causal=*/true);
                           return o + lse.unsqueeze(-1);
                         },
                         {q, k, v}));
  EXPECT_TRUE(check_grad({"flash_attention"},
                         [](const variable_list& in) {
                           auto [o, lse] =
                               flash_attention(in[0], in[1], in[2], 0.6, true, /*sliding_window=*/2,
                                               /*softcap=*/1.5);
                           return o * 2.0 + lse.unsqueeze(-1);
                         },
                         {q, k, v}));
  Tensor qt = leaf({1, 5, 4, 3}, 0.8);  // transposed to [1, 4, 5, 3]
  EXPECT_TRUE(check_grad({"flash_attention"},
                         [](const variable_list& in) {
                           return std::get<0>(
                               flash_attention(in[0].transpose(1, 2), in[1], in[2], 0.5));
                         },
                         {qt, k, v}));
}

}  // namespace
}  // namespace kiln
