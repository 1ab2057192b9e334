// Gradients of the fused ops (tensor/ops/{norm,cross_entropy,rotary,glu}.cpp), whose backward
// rules call fused backward kernels.
#include "grad_test_util.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

using gradtest::check_grad;
using gradtest::leaf;
using gradtest::variable_list;

TEST(FusedGradTest, RmsNorm) {
  Tensor x = leaf({3, 5}, 1.0, 0.2);
  Tensor w = leaf({5}, 0.5, 1.0);
  EXPECT_TRUE(check_grad(
      {"rms_norm"}, [](const variable_list& in) { return rms_norm(in[0], in[1], 1e-6); }, {x, w}));
  // Through a non-contiguous input.
  Tensor xt = leaf({5, 3}, 1.0, -0.3);
  EXPECT_TRUE(check_grad({"rms_norm"},
                         [](const variable_list& in) { return rms_norm(in[0].t(), in[1], 1e-5); },
                         {xt, w}));
}

// layer_norm with weight and bias, with either alone and with neither (through the op call
// with a normalized shape), over two trailing dims, and through a non-contiguous input.
TEST(FusedGradTest, LayerNorm) {
  Tensor x = leaf({3, 5}, 1.0, 0.2);
  Tensor w = leaf({5}, 0.5, 1.0);
  Tensor b = leaf({5}, 0.5);
  EXPECT_TRUE(check_grad(
      {"layer_norm"}, [](const variable_list& in) { return layer_norm(in[0], in[1], in[2], 1e-6); },
      {x, w, b}));
  EXPECT_TRUE(check_grad(
      {"layer_norm"},
      [](const variable_list& in) { return layer_norm(in[0], in[1], Tensor(), 1e-6); }, {x, w}));
  EXPECT_TRUE(check_grad(
      {"layer_norm"},
      [](const variable_list& in) { return layer_norm(in[0], Tensor(), in[1], 1e-6); }, {x, b}));
  EXPECT_TRUE(check_grad({"layer_norm"},
                         [](const variable_list& in) {
                           static const OpDef& op = KILN_OP(layer_norm);
                           return call_op(op, {in[0], Tensor(), Tensor()}, {Shape{5}, 1e-6})[0];
                         },
                         {x}));
  Tensor x3 = leaf({2, 3, 4}, 1.0, -0.5);
  Tensor w2 = leaf({3, 4}, 0.5, 1.0);
  Tensor b2 = leaf({3, 4});
  EXPECT_TRUE(check_grad(
      {"layer_norm"}, [](const variable_list& in) { return layer_norm(in[0], in[1], in[2], 1e-5); },
      {x3, w2, b2}));
  Tensor xt = leaf({5, 3}, 1.0, -0.3);
  EXPECT_TRUE(
      check_grad({"layer_norm"},
                 [](const variable_list& in) { return layer_norm(in[0].t(), in[1], in[2], 1e-5); },
                 {xt, w, b}));
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

TEST(FusedGradTest, RotaryEmb) {
  // Every input differentiable, cos/sin with unequal halves (nothing assumes rope_cache's
  // layout); the leading dims of x are summed into the tables' gradients.
  Tensor x = leaf({2, 3, 4, 6});
  Tensor cos = leaf({4, 6});
  Tensor sin = leaf({4, 6});
  EXPECT_TRUE(check_grad(
      {"rotary_emb"}, [](const variable_list& in) { return rotary_emb(in[0], in[1], in[2]); },
      {x, cos, sin},
      /*gradgrad=*/true));
  // A strided view of x (the q part of a fused qkv projection, transposed to [B, H, T, D]).
  Tensor qkv = leaf({2, 4, 3 * 2 * 6});
  EXPECT_TRUE(check_grad({"rotary_emb"},
                         [](const variable_list& in) {
                           return rotary_emb(
                               in[0].narrow(-1, 12, 12).view({2, 4, 2, 6}).transpose(1, 2), in[1],
                               in[2]);
                         },
                         {qkv, cos, sin}));
}

TEST(FusedGradTest, RotaryEmbQk) {
  Tensor q = leaf({2, 4, 3, 4});
  Tensor k = leaf({2, 2, 3, 4});
  Tensor cos = leaf({3, 4});
  Tensor sin = leaf({3, 4});
  EXPECT_TRUE(check_grad(
      {"rotary_emb_qk"},
      [](const variable_list& in) {
        auto [q2, k2] = rotary_emb_qk(in[0], in[1], in[2], in[3]);
        return cat({q2.flatten(), (k2 * 1.5).flatten()});
      },
      {q, k, cos, sin}, /*gradgrad=*/true));
  // Only one output used: the other's gradient is zero.
  EXPECT_TRUE(check_grad({"rotary_emb_qk"},
                         [](const variable_list& in) {
                           return std::get<1>(rotary_emb_qk(in[0], in[1], in[2], in[3]));
                         },
                         {q, k, cos, sin}));
}

TEST(FusedGradTest, SplitAndMergeQkvRotary) {
  // qkv [B, T, (H + 2G) D] with H = 4, G = 2, D = 4; tables with unequal halves, requiring grad
  // (the rules then save the rotated tensors) and not.
  Tensor qkv = leaf({2, 3, 8 * 4});
  Tensor cos = leaf({3, 4});
  Tensor sin = leaf({3, 4});
  const auto split = [](const variable_list& in) {
    auto [q, k, v] = split_qkv_rotary(in[0], in[1], in[2], 4, 2);
    return cat({q.flatten(), (k * 1.5).flatten(), (v * -0.5).flatten()});
  };
  EXPECT_TRUE(check_grad({"split_qkv_rotary"}, split, {qkv, cos, sin}, /*gradgrad=*/true));
  EXPECT_TRUE(check_grad({"split_qkv_rotary"}, split, {qkv, cos.detach(), sin.detach()},
                         /*gradgrad=*/true));
  // Only v used: q and k receive zero gradients.
  EXPECT_TRUE(check_grad({"split_qkv_rotary"},
                         [](const variable_list& in) {
                           return std::get<2>(split_qkv_rotary(in[0], in[1], in[2], 4, 2));
                         },
                         {qkv, cos, sin}));
  Tensor dq = leaf({2, 4, 3, 4});
  Tensor dk = leaf({2, 2, 3, 4});
  Tensor dv = leaf({2, 2, 3, 4});
  EXPECT_TRUE(check_grad(
      {"merge_qkv_rotary"},
      [](const variable_list& in) { return merge_qkv_rotary(in[0], in[1], in[2], in[3], in[4]); },
      {dq, dk, dv, cos, sin}, /*gradgrad=*/true));
}

TEST(FusedGradTest, LinearCrossEntropy) {
  // Rows 2 and 5 ignored; the default chunking (one chunk at this size) and the gradients the
  // forward stored, scaled by the loss's gradient.
  Tensor x = leaf({6, 4});
  Tensor w = leaf({7, 4});
  const Tensor t = tensor({3, 0, -100, 6, 1, -100}, kInt64);
  EXPECT_TRUE(check_grad(
      {"linear_cross_entropy"},
      [t](const variable_list& in) { return linear_cross_entropy(in[0], in[1], t) * 2.5; },
      {x, w}));
}

TEST(FusedGradTest, SwigluAndGegluTanh) {
  Tensor gate = leaf({3, 7}, 2.0);
  Tensor up = leaf({3, 7});
  EXPECT_TRUE(check_grad({"swiglu"}, [](const variable_list& in) { return swiglu(in[0], in[1]); },
                         {gate, up}));
  EXPECT_TRUE(check_grad({"geglu_tanh"},
                         [](const variable_list& in) { return geglu_tanh(in[0], in[1]); },
                         {gate, up}));
  // gate and up as the two halves of one projection (strided views).
  Tensor both = leaf({4, 10}, 2.0);
  EXPECT_TRUE(check_grad(
      {"swiglu"},
      [](const variable_list& in) { return swiglu(in[0].narrow(1, 0, 5), in[0].narrow(1, 5, 5)); },
      {both}));
  EXPECT_TRUE(check_grad({"geglu_tanh"},
                         [](const variable_list& in) {
                           return geglu_tanh(in[0].narrow(1, 0, 5).t(), in[0].narrow(1, 5, 5).t());
                         },
                         {both}));
}

}  // namespace
}  // namespace kiln
