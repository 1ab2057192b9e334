// nn::functional through the fused ops (F::rms_norm -> kiln::rms_norm, F::layer_norm -> the
// layer_norm op, F::cross_entropy -> kiln::cross_entropy_fused, F::apply_rotary_emb ->
// kiln::rotary_emb, F::swiglu/geglu_tanh): calls a kernel supports run it (the op's node is in the
// graph) and give the composite's answer and gradients; calls no kernel supports run the op's
// decomposition (its ops are in the graph, not the op's node).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "autograd/engine.h"
#include "autograd/node.h"
#include "nn/autocast.h"
#include "nn/functional.h"
#include "nn/nn.h"
#include "tensor/tensor_data.h"
#include "test_util.h"

namespace kiln {
namespace {

namespace F = nn::functional;
using autograd::variable_list;

// The grad_fn names of every node in the graph of `out`.
std::set<std::string> node_names(const Tensor& out) {
  std::set<std::string> names;
  std::vector<std::shared_ptr<autograd::Node>> stack;
  if (out.grad_fn()) stack.push_back(out.grad_fn());
  while (!stack.empty()) {
    auto n = stack.back();
    stack.pop_back();
    if (!names.insert(n->name()).second) continue;
    for (const auto& e : n->next_edges()) {
      if (e.is_valid()) stack.push_back(e.function);
    }
  }
  return names;
}

bool uses(const Tensor& out, std::string_view op) {
  return node_names(out).count(autograd::backward_node_name(op)) > 0;
}

void expect_close(const Tensor& got, const Tensor& want, double tol) {
  ASSERT_EQ(to_shape(got.sizes()), to_shape(want.sizes()));
  EXPECT_EQ(got.dtype(), want.dtype());
  const std::vector<double> g = got.to_vector<double>(), w = want.to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(g[i], w[i], tol * (1 + std::abs(w[i]))) << i;
}

Tensor leaf(IntArrayRef sizes, ScalarType dtype = kDouble) {
  return randn(sizes, TensorOptions(kDouble)).to(dtype).requires_grad_(true);
}

TEST(FusedRoute, RmsNormTakesTheFusedOpWhenItFits) {
  manual_seed(51);
  Tensor x = leaf({4, 3, 8}), w = leaf({3, 8});
  const Tensor y = F::rms_norm(x, {3, 8}, w, 1e-5);
  EXPECT_TRUE(uses(y, "rms_norm"));
  // The composite formula, written here.
  Tensor x2 = x.detach().requires_grad_(true), w2 = w.detach().requires_grad_(true);
  const Tensor ref = x2 * (x2.square().mean({1, 2}, true) + 1e-5).rsqrt() * w2;
  expect_close(y, ref, 1e-12);
  const Tensor dy = randn({4, 3, 8}, TensorOptions(kDouble));
  const variable_list g = autograd::grad({y}, {x, w}, {dy});
  const variable_list gr = autograd::grad({ref}, {x2, w2}, {dy});
  expect_close(g[0], gr[0], 1e-10);
  expect_close(g[1], gr[1], 1e-10);
  // bf16 input with an f32 weight and the default eps (bf16's machine epsilon) is fused too.
  const Tensor xb = randn({5, 16}).to(kBFloat16), wf = randn({16});
  const Tensor yb = F::rms_norm(xb, {16}, wf);
  EXPECT_EQ(yb.dtype(), kBFloat16);
  expect_close(yb.to(kDouble), rms_norm(xb, wf, 0.0078125).to(kDouble), 0);
  const Tensor xf = xb.to(kFloat);
  expect_close(
      yb.to(kFloat),
      (xf * (xf.square().mean({1}, true) + 0.0078125).rsqrt() * wf).to(kBFloat16).to(kFloat), 1e-2);
}

TEST(FusedRoute, RmsNormKeepsTheCompositeOtherwise) {
  manual_seed(52);
  Tensor x = leaf({3, 8});
  EXPECT_FALSE(uses(F::rms_norm(x, {8}), "rms_norm"));  // no weight
  // A weight of another dtype than the input (and not the f32-for-bf16 case).
  Tensor wb = leaf({8}, kBFloat16);
  const Tensor y = F::rms_norm(x, {8}, wb, 1e-6);
  EXPECT_FALSE(uses(y, "rms_norm"));
  EXPECT_EQ(y.dtype(), kDouble);
}

// LayerNorm as the composite computes it, written here (biased variance).
Tensor layer_norm_composite(const Tensor& x, std::vector<int64_t> dims, const Tensor& w,
                            const Tensor& b, double eps) {
  Tensor y = (x - x.mean(dims, true)) * (x.var(dims, 0, true) + eps).rsqrt();
  if (w.defined()) y = y * w;
  if (b.defined()) y = y + b;
  return y;
}

TEST(FusedRoute, LayerNormTakesTheFusedOpWhenItFits) {
  manual_seed(58);
  Tensor x = leaf({4, 3, 8}), w = leaf({3, 8}), b = leaf({3, 8});
  const Tensor y = F::layer_norm(x, {3, 8}, w, b, 1e-5);
  EXPECT_TRUE(uses(y, "layer_norm"));
  Tensor x2 = x.detach().requires_grad_(true), w2 = w.detach().requires_grad_(true),
         b2 = b.detach().requires_grad_(true);
  const Tensor ref = layer_norm_composite(x2, {1, 2}, w2, b2, 1e-5);
  expect_close(y, ref, 1e-12);
  const Tensor dy = randn({4, 3, 8}, TensorOptions(kDouble));
  const variable_list g = autograd::grad({y}, {x, w, b}, {dy});
  const variable_list gr = autograd::grad({ref}, {x2, w2, b2}, {dy});
  for (size_t i = 0; i < 3; ++i) expect_close(g[i], gr[i], 1e-10);
  // Without parameters, with either one, through the options and the module.
  for (const auto& [wi, bi] :
       std::vector<std::pair<Tensor, Tensor>>{{Tensor(), Tensor()}, {w, Tensor()}, {Tensor(), b}}) {
    const Tensor yi = F::layer_norm(x, {3, 8}, wi, bi, 1e-5);
    EXPECT_TRUE(uses(yi, "layer_norm"));
    const Tensor ri = layer_norm_composite(x2, {1, 2}, wi.defined() ? w2 : Tensor(),
                                           bi.defined() ? b2 : Tensor(), 1e-5);
    expect_close(yi, ri, 1e-12);
    expect_close(autograd::grad({yi}, {x}, {dy})[0], autograd::grad({ri}, {x2}, {dy})[0], 1e-10);
  }
  EXPECT_TRUE(
      uses(F::layer_norm(x, F::LayerNormFuncOptions({8}).weight(w.select(0, 0))), "layer_norm"));
  nn::LayerNorm ln(nn::LayerNormOptions({8}));
  EXPECT_TRUE(uses(ln->forward(randn({2, 8})), "layer_norm"));
  // bf16 input with f32 parameters is fused too, and returns bf16.
  const Tensor xb = randn({5, 16}).to(kBFloat16), wf = randn({16}), bf = randn({16});
  const Tensor yb = F::layer_norm(xb, {16}, wf, bf, 1e-5);
  EXPECT_EQ(yb.dtype(), kBFloat16);
  expect_close(yb.to(kDouble), layer_norm(xb, wf, bf, 1e-5).to(kDouble), 0);
  expect_close(yb.to(kFloat),
               layer_norm_composite(xb.to(kFloat), {1}, wf, bf, 1e-5).to(kBFloat16).to(kFloat),
               1e-2);
  // Under autocast the op's f32 policy makes it compute and return f32, as the composite did.
  {
    AutocastGuard guard(kCPU, kBFloat16);
    const Tensor ya = F::layer_norm(xb, {16}, wf.to(kBFloat16), bf.to(kBFloat16), 1e-5);
    EXPECT_EQ(ya.dtype(), kFloat);
    expect_close(ya,
                 layer_norm_composite(xb.to(kFloat), {1}, wf.to(kBFloat16).to(kFloat),
                                      bf.to(kBFloat16).to(kFloat), 1e-5),
                 1e-5);
  }
}

TEST(FusedRoute, LayerNormKeepsTheCompositeOtherwise) {
  manual_seed(59);
  Tensor x = leaf({3, 8});
  // A weight of another dtype than the input (and not the f32-for-bf16 case).
  Tensor wb = leaf({8}, kBFloat16);
  const Tensor y = F::layer_norm(x, {8}, wb, Tensor(), 1e-6);
  EXPECT_FALSE(uses(y, "layer_norm"));
  EXPECT_EQ(y.dtype(), kDouble);
  expect_close(y, layer_norm_composite(x, {1}, wb.to(kDouble), Tensor(), 1e-6), 1e-12);
  // Weight and bias of different dtypes (f32 and bf16 on a bf16 input).
  Tensor xb = randn({3, 8}).to(kBFloat16);
  const Tensor y2 = F::layer_norm(xb.requires_grad_(true), {8}, randn({8}).requires_grad_(true),
                                  randn({8}).to(kBFloat16).requires_grad_(true), 1e-5);
  EXPECT_FALSE(uses(y2, "layer_norm"));
  EXPECT_EQ(y2.dtype(), kBFloat16);
  // Bad shapes: the op's meta rule.
  EXPECT_KILN_ERROR(F::layer_norm(x, {3}),
                    "[layer_norm] normalized shape [3] does not match the trailing dims");
  EXPECT_KILN_ERROR(F::layer_norm(x, {8}, leaf({3})),
                    "[layer_norm] weight of shape [3] does not match the normalized shape [8]");
}

TEST(FusedRoute, CrossEntropyTakesTheFusedOpWhenItFits) {
  manual_seed(53);
  const Tensor targets = tensor(std::vector<int64_t>{3, 0, -100, 6, 2});
  for (ScalarType dt : {kDouble, kFloat, kBFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor x = leaf({5, 7}, dt);
    const Tensor loss = F::cross_entropy(x, targets);
    EXPECT_TRUE(uses(loss, "cross_entropy_fused"));
    EXPECT_EQ(loss.dtype(), dt);
    // A class weight of ones takes the composite path and means the same.
    Tensor x2 = x.detach().requires_grad_(true);
    const Tensor ref =
        F::cross_entropy(x2, targets, F::CrossEntropyFuncOptions().weight(ones({7}, dt)));
    EXPECT_FALSE(uses(ref, "cross_entropy_fused"));
    const double tol = dt == kDouble ? 1e-12 : dt == kFloat ? 1e-6 : 1e-2;
    expect_close(loss, ref, tol);
    expect_close(autograd::grad({loss}, {x})[0], autograd::grad({ref}, {x2})[0], tol);
  }
  // The top-level spelling routes too, and bad targets are the op's error.
  EXPECT_TRUE(uses(cross_entropy_loss(leaf({2, 3}), tensor(std::vector<int64_t>{0, 2})),
                   "cross_entropy_fused"));
  EXPECT_KILN_ERROR(F::cross_entropy(leaf({2, 3}), tensor(std::vector<int64_t>{0, 3})),
                    "[cross_entropy_fused] target 3 is out of bounds");
}

TEST(FusedRoute, CrossEntropyKeepsTheCompositeOtherwise) {
  manual_seed(54);
  Tensor x = leaf({4, 5});
  const Tensor t = tensor(std::vector<int64_t>{1, 0, 4, 2});
  using O = F::CrossEntropyFuncOptions;
  EXPECT_FALSE(uses(F::cross_entropy(x, t, O().label_smoothing(0.1)), "cross_entropy_fused"));
  EXPECT_FALSE(
      uses(F::cross_entropy(x, t, O().reduction(nn::Reduction::Sum)), "cross_entropy_fused"));
  EXPECT_FALSE(uses(F::cross_entropy(x, t.to(kInt32)), "cross_entropy_fused"));
  EXPECT_FALSE(uses(F::cross_entropy(leaf({2, 5, 3}),
                                     tensor(std::vector<int64_t>{0, 1, 2, 3, 4, 0}).view({2, 3})),
                    "cross_entropy_fused"));
  // Sum over the fused route's mean agrees with the composite's sum.
  const Tensor sum = F::cross_entropy(x, t, O().reduction(nn::Reduction::Sum));
  expect_close(F::cross_entropy(x, t) * 4.0, sum, 1e-12);
}

Tensor rope_composite(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const int64_t h = x.size(-1) / 2;
  return x * cos + cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1) * sin;
}

TEST(FusedRoute, ApplyRotaryEmbTakesTheFusedOpWhenItFits) {
  manual_seed(55);
  auto [cos, sin] = F::rope_cache(6, 8, 10000.0, std::nullopt, kDouble);
  // A strided [B, H, T, D] view of a qkv projection.
  Tensor qkv = leaf({2, 6, 3 * 2 * 8});
  const Tensor q = qkv.narrow(-1, 0, 16).view({2, 6, 2, 8}).transpose(1, 2);
  const Tensor y = F::apply_rotary_emb(q, cos, sin);
  EXPECT_TRUE(uses(y, "rotary_emb"));
  const Tensor ref = rope_composite(q, cos, sin);
  expect_close(y, ref, 1e-12);
  const Tensor dy = randn({2, 2, 6, 8}, TensorOptions(kDouble));
  expect_close(autograd::grad({y}, {qkv}, {dy})[0], autograd::grad({ref}, {qkv}, {dy})[0], 1e-12);
  // Tables with leading size-1 dims, and f32 tables on a bf16 input.
  EXPECT_TRUE(
      uses(F::apply_rotary_emb(q, cos.view({1, 1, 6, 8}), sin.view({1, 1, 6, 8})), "rotary_emb"));
  auto [c32, s32] = F::rope_cache(6, 8);
  const Tensor qb = q.detach().to(kBFloat16).requires_grad_(true);
  const Tensor yb = F::apply_rotary_emb(qb, c32, s32);
  EXPECT_TRUE(uses(yb, "rotary_emb"));
  EXPECT_EQ(yb.dtype(), kBFloat16);
  expect_close(yb.to(kDouble), rope_composite(qb.to(kFloat), c32, s32).to(kBFloat16).to(kDouble),
               1e-2);
  // Both at once.
  Tensor k = leaf({2, 1, 6, 8});
  auto [q2, k2] = F::apply_rotary_emb_qk(q, k, cos, sin);
  EXPECT_TRUE(uses(q2, "rotary_emb_qk"));
  expect_close(q2, ref, 1e-12);
  expect_close(k2, rope_composite(k, cos, sin), 1e-12);
}

TEST(FusedRoute, ApplyRotaryEmbKeepsTheCompositeOtherwise) {
  manual_seed(56);
  Tensor x = leaf({2, 6, 8});
  auto [cos, sin] = F::rope_cache(6, 8, 10000.0, std::nullopt, kDouble);
  // One position broadcast over T, and f64 tables on an f32 input.
  const Tensor y1 = F::apply_rotary_emb(x, cos.narrow(0, 2, 1), sin.narrow(0, 2, 1));
  EXPECT_FALSE(uses(y1, "rotary_emb"));
  expect_close(y1, rope_composite(x, cos.narrow(0, 2, 1), sin.narrow(0, 2, 1)), 1e-12);
  Tensor xf = leaf({2, 6, 8}, kFloat);
  EXPECT_FALSE(uses(F::apply_rotary_emb(xf, cos, sin), "rotary_emb"));
  auto [q2, k2] = F::apply_rotary_emb_qk(xf, x, cos, sin);  // dtypes differ: two composites
  EXPECT_FALSE(uses(q2, "rotary_emb_qk"));
  expect_close(k2, rope_composite(x, cos, sin), 1e-12);
}

TEST(FusedRoute, GatedActivations) {
  manual_seed(57);
  Tensor g = leaf({4, 9}), u = leaf({4, 9});
  const Tensor a = F::swiglu(g, u);
  EXPECT_TRUE(uses(a, "swiglu"));
  expect_close(a, F::silu(g) * u, 1e-12);
  const Tensor b = F::geglu_tanh(g, u);
  EXPECT_TRUE(uses(b, "geglu_tanh"));
  expect_close(b, F::gelu(g, F::GELUFuncOptions().approximate("tanh")) * u, 1e-12);
}

}  // namespace
}  // namespace kiln
