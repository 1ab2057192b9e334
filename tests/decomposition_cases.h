// Decomposition == fused kernel, for every fused op: the calls each op's kernels take, run once
// by a named kernel (call_op_with_kernel) and once by the op's decomposition (call_decomposition),
// compared forward and backward (the gradients of random upstream gradients through the op's
// backward rule against those through the decomposition's ops). Used on the CPU
// (tests/tensor/decomposition_test.cpp) and on the GPU (tests/kernels/gpu_decomposition_test.cpp).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "autograd/engine.h"
#include "tensor/ops.h"
#include "tensor/registry.h"
#include "tensor/tensor_data.h"

namespace kiln::test {

struct FusedCase {
  std::string name;  // for the failure message
  std::string op;
  TensorVec inputs;  // floating inputs are differentiated
  absl::InlinedVector<Attr, 4> attrs;
  size_t grad_outputs = 1;  // the leading outputs the backward rule differentiates
  double tol = 1e-5;        // relative to the largest magnitude of the reference
};

// max |a - b| / max(max |b|, 1e-6), in f64 on the CPU.
inline double scaled_error(const Tensor& a, const Tensor& b) {
  if (b.numel() == 0) return 0;
  const Tensor a64 = a.detach().to(kCPU).to(kDouble);
  const Tensor b64 = b.detach().to(kCPU).to(kDouble);
  const double scale = std::max(b64.abs().max().item<double>(), 1e-6);
  return (a64 - b64).abs().max().item<double>() / scale;
}

// Fresh leaves requiring grad (floating, defined inputs) on `device`.
inline TensorVec leaves(const TensorVec& inputs, Device device) {
  TensorVec out;
  for (const Tensor& t : inputs) {
    if (!t.defined()) {
      out.push_back(t);
      continue;
    }
    Tensor c = t.to(device, /*non_blocking=*/false, /*copy=*/true);
    if (is_floating_point(c.dtype())) c.requires_grad_(true);
    out.push_back(c);
  }
  return out;
}

// Runs c through `kernel` (on `device`) and through the decomposition; expects the same outputs
// and the same input gradients.
inline void expect_decomposition_matches(const FusedCase& c, std::string_view kernel,
                                         Device device) {
  SCOPED_TRACE(c.name + " [" + c.op + ", kernel '" + std::string(kernel) + "' on " + device.str() +
               "]");
  const OpDef& op = Registry::get().op(c.op);
  ASSERT_NE(op.decomposition, nullptr) << c.op << " registers no decomposition";
  const TensorVec fin = leaves(c.inputs, device);
  const TensorVec din = leaves(c.inputs, device);
  const TensorVec fused = call_op_with_kernel(op, kernel, fin, c.attrs);
  const TensorVec decomposed = call_decomposition(op, din, c.attrs);
  ASSERT_EQ(fused.size(), decomposed.size());
  for (size_t i = 0; i < fused.size(); ++i) {
    EXPECT_EQ(fused[i].dtype(), decomposed[i].dtype()) << "output " << i;
    EXPECT_EQ(to_shape(fused[i].sizes()), to_shape(decomposed[i].sizes())) << "output " << i;
    EXPECT_LE(scaled_error(fused[i], decomposed[i]), c.tol) << "output " << i;
  }
  // Gradients of sum_i <out_i, g_i> over the differentiated outputs, g_i random.
  autograd::variable_list fo, dout, grads;
  for (size_t i = 0; i < c.grad_outputs && i < fused.size(); ++i) {
    if (!fused[i].requires_grad()) continue;
    fo.push_back(fused[i]);
    dout.push_back(decomposed[i]);
    grads.push_back(randn(fused[i].sizes(), TensorOptions(fused[i].dtype()).device(device)));
  }
  autograd::variable_list fx, dx;
  for (size_t i = 0; i < fin.size(); ++i) {
    if (fin[i].defined() && fin[i].requires_grad()) {
      fx.push_back(fin[i]);
      dx.push_back(din[i]);
    }
  }
  if (fo.empty() || fx.empty()) return;
  const auto fg = autograd::grad(fo, fx, grads, std::nullopt, false, /*allow_unused=*/true);
  const auto dg = autograd::grad(dout, dx, grads, std::nullopt, false, /*allow_unused=*/true);
  for (size_t i = 0; i < fg.size(); ++i) {
    ASSERT_EQ(fg[i].defined(), dg[i].defined()) << "gradient of differentiated input " << i;
    if (fg[i].defined()) {
      EXPECT_LE(scaled_error(fg[i], dg[i]), c.tol) << "gradient " << i;
    }
  }
}

// The fused ops' cases in `dtype` (f32: tight tolerance; f16/bf16: the kernels round once where
// the decomposition rounds at each op's output). Inputs are on the CPU; the checker moves them.
inline std::vector<FusedCase> fused_cases(ScalarType dtype) {
  const bool reduced = is_reduced_float(dtype);
  const double tol = dtype == kDouble ? 1e-10 : reduced ? 2e-2 : 2e-5;
  const TensorOptions o(dtype);
  const ScalarType pdt = reduced ? kFloat : dtype;  // a parameter dtype every kernel takes
  const TensorOptions po(pdt);
  std::vector<FusedCase> cases;
  // Norms: rows of odd length, 3-d input, weights of x's dtype and (f16/bf16) f32.
  cases.push_back({"rms_norm", "rms_norm", {randn({3, 5, 33}, o), randn({33}, o)}, {1e-5}, 1, tol});
  cases.push_back(
      {"rms_norm f32 weight", "rms_norm", {randn({4, 64}, o), randn({64}, po)}, {1e-6}, 1, tol});
  cases.push_back({"layer_norm",
                   "layer_norm",
                   {randn({6, 40}, o), randn({40}, o), randn({40}, o)},
                   {Shape{40}, 1e-5},
                   1,
                   tol});
  cases.push_back({"layer_norm two dims, no bias",
                   "layer_norm",
                   {randn({3, 4, 10}, o), randn({4, 10}, po), Tensor()},
                   {Shape{4, 10}, 1e-5},
                   1,
                   tol});
  // RoPE: [B, H, T, D] against [T, D] tables (and the [1, 1, T, D] form), both directions.
  const Tensor cos = randn({7, 16}, po), sin = randn({7, 16}, po);
  for (bool transpose : {false, true}) {
    const std::string t = transpose ? " transposed" : "";
    cases.push_back(
        {"rotary_emb" + t, "rotary_emb", {randn({2, 3, 7, 16}, o), cos, sin}, {transpose}, 1, tol});
    cases.push_back({"rotary_emb_qk" + t,
                     "rotary_emb_qk",
                     {randn({2, 4, 7, 16}, o), randn({2, 2, 7, 16}, o), cos.view({1, 1, 7, 16}),
                      sin.view({1, 1, 7, 16})},
                     {transpose},
                     2,
                     tol});
    // The heads of a [B, T, (H + 2G) D] projection with H = 4, G = 2, and back.
    cases.push_back({"split_qkv_rotary" + t,
                     "split_qkv_rotary",
                     {randn({2, 7, 128}, o), cos, sin},
                     {transpose, int64_t{4}, int64_t{2}},
                     3,
                     tol});
    cases.push_back({"merge_qkv_rotary" + t,
                     "merge_qkv_rotary",
                     {randn({2, 4, 7, 16}, o), randn({2, 2, 7, 16}, o), randn({2, 2, 7, 16}, o),
                      cos.view({1, 7, 16}), sin.view({1, 7, 16})},
                     {transpose},
                     1,
                     tol});
  }
  // Gated activations, gate over a range that reaches both tails of the activations.
  for (const char* glu : {"swiglu", "geglu_tanh"}) {
    cases.push_back({glu, glu, {randn({5, 48}, o) * 3.0, randn({5, 48}, o)}, {}, 1, tol});
  }
  // The recurrent cells: LSTM gates [B, 4H] with cx (both outputs differentiated), GRU gates.
  cases.push_back(
      {"lstm_cell_fused", "lstm_cell_fused", {randn({5, 24}, o) * 2.0, randn({5, 6}, o)}, {}, 2,
       tol});
  cases.push_back({"gru_cell_fused",
                   "gru_cell_fused",
                   {randn({5, 18}, o) * 2.0, randn({5, 18}, o) * 2.0, randn({5, 6}, o)},
                   {},
                   1,
                   tol});
  // Cross-entropy: [N, V] logits, int64 targets with an ignored row, the mean.
  const Tensor targets = tensor(std::vector<int64_t>{3, 0, -100, 7, 9, 1});
  cases.push_back({"cross_entropy_fused",
                   "cross_entropy_fused",
                   {randn({6, 11}, o) * 2.0, targets},
                   {int64_t{-100}},
                   1,
                   tol});
  return cases;
}

// Attention cases (the CPU reference's dtypes, or the CUDA kernels': f16/bf16 with head sizes
// 64 and 128): GQA, causal, sliding window, softcap, T != S, and the lse gradient.
inline std::vector<FusedCase> attention_cases(ScalarType dtype, int64_t head_size) {
  const double tol = dtype == kDouble ? 1e-10 : is_reduced_float(dtype) ? 2e-2 : 2e-5;
  const TensorOptions o(dtype);
  const int64_t d = head_size;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<FusedCase> cases;
  auto qkv = [&](int64_t b, int64_t h, int64_t hkv, int64_t t, int64_t s) {
    return TensorVec{randn({b, h, t, d}, o), randn({b, hkv, s, d}, o), randn({b, hkv, s, d}, o)};
  };
  cases.push_back({"attention",
                   "flash_attention",
                   qkv(2, 2, 2, 19, 19),
                   {scale, false, int64_t{0}, 0.0},
                   2,
                   tol});
  cases.push_back({"attention causal gqa",
                   "flash_attention",
                   qkv(1, 4, 2, 33, 33),
                   {scale, true, int64_t{0}, 0.0},
                   2,
                   tol});
  cases.push_back({"attention window softcap",
                   "flash_attention",
                   qkv(1, 2, 1, 40, 40),
                   {scale, true, int64_t{9}, 5.0},
                   2,
                   tol});
  cases.push_back({"attention T > S causal",
                   "flash_attention",
                   qkv(1, 2, 2, 21, 13),
                   {scale, true, int64_t{0}, 0.0},
                   2,
                   tol});
  return cases;
}

}  // namespace kiln::test
