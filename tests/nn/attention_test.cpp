// scaled_dot_product_attention against a naive f64 loop implementation (causal,
// masks, GQA, sliding window, softcap, scale), gradients by gradcheck, and
// rotary embeddings (rope_cache with and without Llama 3 scaling,
// apply_rotary_emb) against independent formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <optional>
#include <vector>

#include "autograd/gradcheck.h"
#include "nn/functional.h"
#include "tensor/registry.h"
#include "test_util.h"

namespace kiln {
namespace {

namespace F = nn::functional;
using autograd::gradcheck;

Tensor rand64(IntArrayRef sizes, bool grad = false) {
  return randn(sizes, dtype(kFloat64).requires_grad(grad));
}

void expect_close(const Tensor &got, const std::vector<double> &want, double tol = 1e-10) {
  const std::vector<double> g = got.to_vector<double>();
  ASSERT_EQ(g.size(), want.size());
  for (size_t i = 0; i < g.size(); ++i) {
    EXPECT_NEAR(g[i], want[i], tol * (1 + std::abs(want[i]))) << "at " << i;
  }
}

struct AttnArgs {
  Tensor mask;  // [T, S], bool or float
  bool causal = false;
  std::optional<double> scale;
  int64_t window = 0;
  double softcap = 0;
};

// q [B, H, T, D], k/v [B, Hkv, S, D]: one query at a time, the way the formulas
// read.
std::vector<double> naive_attention(const Tensor &q, const Tensor &k, const Tensor &v,
                                    const AttnArgs &a) {
  const int64_t b_n = q.size(0), h_n = q.size(1), t_n = q.size(2), d_n = q.size(3);
  const int64_t hkv = k.size(1), s_n = k.size(2);
  const std::vector<double> qv = q.to_vector<double>(), kv = k.to_vector<double>(),
                            vv = v.to_vector<double>();
  std::vector<double> mv;
  bool bool_mask = false;
  if (a.mask.defined()) {
    bool_mask = a.mask.dtype() == kBool;
    mv = a.mask.to_vector<double>();
  }
  const double scale = a.scale.value_or(1.0 / std::sqrt(static_cast<double>(d_n)));
  std::vector<double> out;
  for (int64_t b = 0; b < b_n; ++b) {
    for (int64_t h = 0; h < h_n; ++h) {
      const int64_t g = h / (h_n / hkv);
      for (int64_t i = 0; i < t_n; ++i) {
        std::vector<double> s(s_n);
        std::vector<bool> ok(s_n, true);
        for (int64_t j = 0; j < s_n; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < d_n; ++d) {
            dot +=
                qv[((b * h_n + h) * t_n + i) * d_n + d] * kv[((b * hkv + g) * s_n + j) * d_n + d];
          }
          s[j] = dot * scale;
          if (a.softcap > 0) s[j] = std::tanh(s[j] / a.softcap) * a.softcap;
          if (a.causal && j > i) ok[j] = false;
          if (a.window > 0 && (j > i || j <= i - a.window)) ok[j] = false;
          if (bool_mask && mv[i * s_n + j] == 0) ok[j] = false;
          if (!bool_mask && !mv.empty()) s[j] += mv[i * s_n + j];
          if (std::isinf(s[j]) && s[j] < 0) ok[j] = false;
        }
        double mx = -INFINITY;
        for (int64_t j = 0; j < s_n; ++j) {
          if (ok[j]) mx = std::max(mx, s[j]);
        }
        double z = 0;
        std::vector<double> p(s_n, 0.0);
        for (int64_t j = 0; j < s_n; ++j) {
          if (ok[j]) z += (p[j] = std::exp(s[j] - mx));
        }
        for (int64_t d = 0; d < v.size(3); ++d) {
          double acc = 0;
          for (int64_t j = 0; j < s_n; ++j) {
            if (ok[j]) acc += p[j] / z * vv[((b * hkv + g) * s_n + j) * v.size(3) + d];
          }
          out.push_back(acc);
        }
      }
    }
  }
  return out;
}

Tensor sdpa(const Tensor &q, const Tensor &k, const Tensor &v, const AttnArgs &a, bool gqa) {
  return F::scaled_dot_product_attention(q, k, v, a.mask, 0.0, a.causal, a.scale, gqa, a.window,
                                         a.softcap);
}

TEST(Attention, PlainAndCausalTopLeftAligned) {
  manual_seed(1);
  Tensor q = rand64({2, 2, 3, 4}), k = rand64({2, 2, 5, 4}), v = rand64({2, 2, 5, 3});
  expect_close(kiln::scaled_dot_product_attention(q, k, v), naive_attention(q, k, v, {}));
  AttnArgs causal;
  causal.causal = true;
  // T=3 < S=5: query i sees keys 0..i (PyTorch's tril(ones(T, S))).
  expect_close(sdpa(q, k, v, causal, false), naive_attention(q, k, v, causal));
}

TEST(Attention, BoolAndFloatMasksGqaAndDeadRows) {
  manual_seed(2);
  Tensor q = rand64({1, 4, 4, 8}), k = rand64({1, 2, 6, 8}), v = rand64({1, 2, 6, 8});
  AttnArgs a;
  a.mask = rand(IntArrayRef{4, 6}) > 0.4;
  a.mask[2] = false;  // a query row with no key: zeros, not NaN
  expect_close(sdpa(q, k, v, a, true), naive_attention(q, k, v, a));
  Tensor out = sdpa(q, k, v, a, true);
  EXPECT_EQ(out.select(2, 2).abs().sum().item<double>(), 0.0);
  AttnArgs f;
  f.mask = rand64({4, 6});
  f.mask[1][3] = -INFINITY;
  f.mask[0] = -INFINITY;
  expect_close(sdpa(q, k, v, f, true), naive_attention(q, k, v, f));
}

TEST(Attention, SlidingWindowSoftcapScale) {
  manual_seed(3);
  Tensor q = rand64({2, 2, 7, 4}) * 3, k = rand64({2, 1, 7, 4}) * 3, v = rand64({2, 1, 7, 4});
  AttnArgs a;
  a.window = 3;
  a.softcap = 2.0;
  a.scale = 0.7;
  expect_close(sdpa(q, k, v, a, true), naive_attention(q, k, v, a));
  a.causal = true;  // the window already implies the causal bound
  expect_close(sdpa(q, k, v, a, true), naive_attention(q, k, v, a));
}

TEST(Attention, Gradcheck) {
  manual_seed(4);
  Tensor q = rand64({1, 2, 3, 2}, true), k = rand64({1, 1, 4, 2}, true),
         v = rand64({1, 1, 4, 2}, true);
  EXPECT_TRUE(gradcheck(
      [](const auto &in) {
        return F::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.0, true, std::nullopt,
                                               true, 2, 1.5);
      },
      {q, k, v}));
  Tensor mask = ones({3, 4}, kBool);
  mask[1] = false;  // a dead row: gradients stay finite (and zero through it)
  mask[0][2] = false;
  EXPECT_TRUE(gradcheck(
      [&](const auto &in) {
        return F::scaled_dot_product_attention(in[0], in[1], in[2], mask, 0.0, false, 0.5, true);
      },
      {q, k, v}));
  Tensor fmask = rand64({3, 4}, true);
  EXPECT_TRUE(gradcheck(
      [](const auto &in) { return F::scaled_dot_product_attention(in[0], in[1], in[2], in[3]); },
      {q, k, v, fmask}));
}

// flash_attention_backward's decomposition (what runs on CUDA with deterministic algorithms)
// against the CPU kernel (f64 loops in f64, blocked f32 products in f32): plain, causal, sliding
// window, softcap, GQA, T != S, with and without a gradient on lse, in f64 and f32.
TEST(Attention, BackwardDecompositionMatchesTheKernel) {
  const OpDef& fwd = KILN_OP(flash_attention);
  const OpDef& bwd = KILN_OP(flash_attention_backward);
  struct Case {
    int64_t h, hkv, t, s;
    bool causal;
    int64_t window;
    double softcap;
  };
  const Case cases[] = {{2, 2, 7, 9, false, 0, 0.0}, {4, 2, 9, 9, true, 0, 0.0},
                        {4, 1, 12, 12, true, 4, 0.0}, {2, 2, 8, 8, true, 0, 5.0},
                        {6, 3, 5, 11, false, 0, 2.0}};
  uint64_t seed = 70;
  for (ScalarType dt : {kDouble, kFloat}) {
    for (const Case& c : cases) {
      for (bool with_dlse : {false, true}) {
        manual_seed(seed++);
        const Tensor q = randn({2, c.h, c.t, 8}, dt), k = randn({2, c.hkv, c.s, 8}, dt),
                     v = randn({2, c.hkv, c.s, 8}, dt);
        const absl::InlinedVector<Attr, 4> attrs = {0.3, c.causal, c.window, c.softcap};
        const TensorVec r = call_op(fwd, {q, k, v}, attrs);
        const Tensor dout = randn(q.sizes(), dt);
        const Tensor dlse = with_dlse ? randn(r[1].sizes(), r[1].dtype()) : Tensor();
        const TensorVec in = {dout, q, k, v, r[0], r[1], dlse};
        const TensorVec want = call_op(bwd, in, attrs);
        const TensorVec got = call_decomposition(bwd, in, attrs);
        const double tol = dt == kDouble ? 1e-10 : 1e-4;
        for (int i = 0; i < 3; ++i) {
          ASSERT_EQ(got[i].sizes(), want[i].sizes()) << i;
          EXPECT_EQ(got[i].dtype(), dt);
          EXPECT_TRUE(allclose(got[i], want[i], tol, tol))
              << "d" << "qkv"[i] << " " << dtype_name(dt) << " H" << c.h << "/" << c.hkv << " T"
              << c.t << " S" << c.s << (c.causal ? " causal" : "") << " window " << c.window
              << " softcap " << c.softcap << (with_dlse ? " dlse" : "");
        }
      }
    }
  }
}

TEST(Attention, Bf16ComputesSoftmaxInF32) {
  manual_seed(5);
  Tensor q = rand64({1, 2, 5, 8}), k = rand64({1, 2, 5, 8}), v = rand64({1, 2, 5, 8});
  AttnArgs a;
  a.causal = true;
  Tensor out = F::scaled_dot_product_attention(q.to(kBFloat16), k.to(kBFloat16), v.to(kBFloat16),
                                               {}, 0.0, true);
  EXPECT_EQ(out.dtype(), kBFloat16);
  const Tensor r = q.to(kBFloat16).to(kFloat64);
  expect_close(
      out, naive_attention(r, k.to(kBFloat16).to(kFloat64), v.to(kBFloat16).to(kFloat64), a), 2e-2);
}

TEST(Attention, DropoutIsSeededAndScalesWeights) {
  Tensor q = rand64({1, 1, 4, 4}), k = rand64({1, 1, 4, 4});
  Tensor v = eye(4, kFloat64).view({1, 1, 4, 4});  // output = the attention weights
  manual_seed(6);
  Tensor a = F::scaled_dot_product_attention(q, k, v, {}, 0.5);
  manual_seed(6);
  Tensor b = F::scaled_dot_product_attention(q, k, v, {}, 0.5);
  EXPECT_TRUE(equal(a, b));
  const Tensor p = F::scaled_dot_product_attention(q, k, v);
  // Each weight is dropped (0) or doubled.
  const std::vector<double> av = a.to_vector<double>(), pv = p.to_vector<double>();
  for (size_t i = 0; i < av.size(); ++i) {
    EXPECT_TRUE(av[i] == 0.0 || std::abs(av[i] - 2 * pv[i]) < 1e-12) << i;
  }
}

TEST(Attention, Errors) {
  Tensor q = rand64({1, 4, 3, 8}), k = rand64({1, 3, 3, 8});
  EXPECT_KILN_ERROR(F::scaled_dot_product_attention(q, k, k, {}, 0, false, std::nullopt, true),
                    "[flash_attention] the query heads (4) must be a multiple of the "
                    "key/value heads (3)");
  Tensor k2 = rand64({1, 2, 3, 8});
  EXPECT_KILN_ERROR(F::scaled_dot_product_attention(q, k2, k2), "pass enable_gqa=true");
  EXPECT_KILN_ERROR(
      F::scaled_dot_product_attention(q, q, q, ones({3, 3}, kBool), 0, true),
      "[flash_attention] an explicit attn_mask should not be set when is_causal=true");
  EXPECT_KILN_ERROR(F::scaled_dot_product_attention(q, q, q, ones({3, 3}, kInt64)),
                    "[flash_attention] attn_mask must be bool or floating");
  EXPECT_KILN_ERROR(F::scaled_dot_product_attention(q, q.to(kFloat32), q),
                    "[flash_attention] expected floating-point q, k and v of one dtype");
  EXPECT_KILN_ERROR(F::scaled_dot_product_attention(q, rand64({1, 4, 3, 4}), q),
                    "[flash_attention] q [1, 4, 3, 8] and k [1, 4, 3, 4] must agree in "
                    "batch and head size");
  EXPECT_KILN_ERROR(F::scaled_dot_product_attention(q, q, q, {}, 1.0), "dropout_p");
}

// --- Rotary embeddings
// -------------------------------------------------------------------------

TEST(Rope, CacheMatchesTheFormula) {
  auto [cos, sin] = F::rope_cache(5, 6, 100.0, std::nullopt, kFloat64);
  ASSERT_EQ(cos.sizes(), IntArrayRef({5, 6}));
  std::vector<double> cr, sr;
  for (int t = 0; t < 5; ++t) {
    for (int i = 0; i < 6; ++i) {
      const double theta = std::pow(100.0, -2.0 * (i % 3) / 6.0);
      cr.push_back(std::cos(t * theta));
      sr.push_back(std::sin(t * theta));
    }
  }
  expect_close(cos, cr);
  expect_close(sin, sr);
  auto [c32, s32] = F::rope_cache(3, 4);
  EXPECT_EQ(c32.dtype(), kFloat32);
  EXPECT_KILN_ERROR(F::rope_cache(3, 5), "[rope_cache] head_size must be positive and even");
}

TEST(Rope, Llama3ScalingMatchesThePublishedRule) {
  // llama-3.2-1b: base 500000, head 64, factor 32, low 1, high 4, original
  // context 8192.
  const F::RopeScaling s{32.0, 1.0, 4.0, 8192};
  auto [cos, sin] = F::rope_cache(2, 64, 500000.0, s, kFloat64);
  // Row t=1 holds angle = inv_freq: recover it with atan2 (exact for small
  // angles).
  const std::vector<double> c = cos[1].to_vector<double>(), sn = sin[1].to_vector<double>();
  int kept = 0, divided = 0, blended = 0;
  for (int i = 0; i < 32; ++i) {
    const double f = std::pow(500000.0, -i / 32.0);
    const double wavelen = 2 * std::numbers::pi / f;
    double want;
    if (wavelen < 8192.0 / 4.0) {
      want = f, ++kept;
    } else if (wavelen > 8192.0 / 1.0) {
      want = f / 32.0, ++divided;
    } else {
      // Linear in the context-to-wavelength ratio between the two bounds.
      const double ratio = 8192.0 / wavelen;  // in [1, 4]
      const double alpha = (ratio - 1.0) / (4.0 - 1.0);
      want = f * (alpha + (1.0 - alpha) / 32.0), ++blended;
    }
    EXPECT_NEAR(std::atan2(sn[i], c[i]), want, 1e-12 * want + 1e-15) << i;
    EXPECT_NEAR(std::atan2(sn[i + 32], c[i + 32]), want, 1e-12 * want + 1e-15) << i;
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);
  // A hand-computed blended value: i = 15 has f = 500000^(-15/32) ~ 2.13e-3.
  const double f15 = std::pow(500000.0, -15.0 / 32.0);
  const double a15 = (8192.0 * f15 / (2 * std::numbers::pi) - 1.0) / 3.0;
  EXPECT_GT(a15, 0.5);
  EXPECT_LT(a15, 0.7);
  EXPECT_NEAR(std::atan2(sn[15], c[15]) / f15, a15 + (1 - a15) / 32, 1e-10);
}

TEST(Rope, ApplyRotaryEmbMatchesLoopsAndGradcheck) {
  manual_seed(7);
  Tensor x = rand64({1, 2, 3, 4}, true);
  auto [cos, sin] = F::rope_cache(3, 4, 10000.0, std::nullopt, kFloat64);
  const std::vector<double> xv = x.to_vector<double>(), cv = cos.to_vector<double>(),
                            sv = sin.to_vector<double>();
  std::vector<double> ref;
  for (int h = 0; h < 2; ++h) {
    for (int t = 0; t < 3; ++t) {
      const double *r = &xv[(h * 3 + t) * 4];
      for (int i = 0; i < 4; ++i) {
        const double other = i < 2 ? -r[i + 2] : r[i - 2];
        ref.push_back(r[i] * cv[t * 4 + i] + other * sv[t * 4 + i]);
      }
    }
  }
  expect_close(F::apply_rotary_emb(x, cos, sin), ref);
  // Structured bindings are captured by name (clang before 16 cannot capture them implicitly).
  EXPECT_TRUE(gradcheck(
      [&cos = cos, &sin = sin](const auto &in) { return F::apply_rotary_emb(in[0], cos, sin); },
      {x}));
  // f32 tables on a bf16 input keep the input's dtype.
  auto [c32, s32] = F::rope_cache(3, 4);
  EXPECT_EQ(F::apply_rotary_emb(x.detach().to(kBFloat16), c32, s32).dtype(), kBFloat16);
  EXPECT_KILN_ERROR(F::apply_rotary_emb(rand64({2, 3}), cos, sin),
                    "[rotary_emb] the last dim of x must be even");
  EXPECT_KILN_ERROR(F::apply_rotary_emb(x, cos.slice(0, 0, 2), sin.slice(0, 0, 2)),
                    "[rotary_emb] cos/sin of shape [2, 4] must broadcast to x");
}

}  // namespace
}  // namespace kiln
