// kiln::models::GPT on the toy configs of every family: shapes, parameter names and init,
// gradients to every parameter, training on a toy task, save/load, the KV cache against the
// full forward (windowed layers included), one block against an f64 loop reference, bf16, and
// errors.
#include "models/gpt.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "autograd/grad_mode.h"
#include "kernels/cuda.h"
#include "nn/optim/adamw.h"
#include "nn/serialize.h"
#include "tensor/ops.h"
#include "test_util.h"

namespace kiln::models {
namespace {

const std::vector<std::string> kTinyConfigs = {"tiny-llama", "tiny-llama3", "tiny-mistral",
                                               "tiny-gemma", "tiny-gemma2"};

Tensor random_tokens(const ModelConfig& c, int64_t b, int64_t t) {
  return kiln::randint(c.vocab_size, {b, t}, kInt64);
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  return (a.to(kFloat64) - b.to(kFloat64)).abs().max().item<double>();
}

using Vec = std::vector<double>;

double max_abs(const Tensor& a) { return a.to(kFloat64).abs().max().item<double>(); }

class GPTTiny : public ::testing::TestWithParam<std::string> {
 protected:
  ModelConfig config() const { return ModelConfig::from_name(GetParam()); }
};

TEST_P(GPTTiny, ForwardShapeAndFiniteLoss) {
  manual_seed(0);
  const ModelConfig c = config();
  GPT model(c);
  EXPECT_EQ(model->num_parameters(), c.num_parameters());
  const Tensor idx = random_tokens(c, 2, 20);
  const Tensor logits = model(idx);
  EXPECT_EQ(logits.sizes(), Shape({2, 20, c.padded_vocab()}));
  EXPECT_EQ(logits.dtype(), kFloat32);
  EXPECT_TRUE(std::isfinite(max_abs(logits)));
  if (c.final_softcap > 0) {
    EXPECT_LE(max_abs(logits), c.final_softcap);
  }
  const Tensor loss = model->loss(idx, random_tokens(c, 2, 20));
  EXPECT_EQ(loss.dim(), 0);
  // At init the logits are small, so the loss is close to log(padded vocab).
  EXPECT_NEAR(loss.item<double>(), std::log(static_cast<double>(c.padded_vocab())), 0.5);
}

TEST_P(GPTTiny, KVCacheMatchesFullForward) {
  manual_seed(1);
  const ModelConfig c = config();
  GPT model(c);
  const int64_t T = 21;  // longer than the toy windows (8)
  const Tensor idx = random_tokens(c, 2, T);
  NoGradGuard no_grad;
  const Tensor full = model(idx);
  const double tol = 1e-5 * std::max(1.0, max_abs(full));

  // Prefill 5 positions, then one token at a time.
  KVCache cache = model->make_kv_cache(2, 32);
  std::vector<Tensor> parts = {model->forward(idx.narrow(1, 0, 5), cache)};
  EXPECT_EQ(cache.length, 5);
  for (int64_t t = 5; t < T; ++t) parts.push_back(model->forward(idx.narrow(1, t, 1), cache));
  EXPECT_EQ(cache.length, T);
  EXPECT_LE(max_abs_diff(kiln::cat(parts, 1), full), tol);

  // Chunks of 7 (crossing the window boundary mid-chunk), after reset.
  cache.reset();
  parts.clear();
  for (int64_t t = 0; t < T; t += 7) parts.push_back(model->forward(idx.narrow(1, t, 7), cache));
  EXPECT_LE(max_abs_diff(kiln::cat(parts, 1), full), tol);
}

TEST_P(GPTTiny, GradientsReachEveryParameter) {
  manual_seed(2);
  const ModelConfig c = config();
  GPT model(c);
  const Tensor idx = random_tokens(c, 2, 16);
  model->loss(idx, random_tokens(c, 2, 16)).backward();
  for (const auto& p : model->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_GT(max_abs(p.value().grad()), 0.0) << p.key();
  }
}

TEST_P(GPTTiny, KVCacheWithGradOnMatchesAndDoesNotCrash) {
  manual_seed(3);
  const ModelConfig c = config();
  GPT model(c);
  const Tensor idx = random_tokens(c, 1, 12);
  const Tensor full = model(idx);
  KVCache cache = model->make_kv_cache(1, 12);
  const Tensor a = model->forward(idx.narrow(1, 0, 9), cache);
  const Tensor b = model->forward(idx.narrow(1, 9, 3), cache);
  const Tensor both = kiln::cat({a, b}, 1);
  EXPECT_LE(max_abs_diff(both, full), 1e-5 * std::max(1.0, max_abs(full)));
  both.sum().backward();  // this step's keys and values keep their history
  EXPECT_TRUE(model->wte->weight.grad().defined());
}

TEST_P(GPTTiny, AdamWMemorisesAFixedBatch) {
  manual_seed(4);
  const ModelConfig c = config();
  GPT model(c);
  const Tensor idx = random_tokens(c, 2, 16);
  const Tensor targets = random_tokens(c, 2, 16);
  optim::AdamW opt(model->parameters(), optim::AdamWOptions(1e-2).weight_decay(0.0));
  double first = 0, last = 0;
  for (int step = 0; step < 12; ++step) {
    opt.zero_grad();
    const Tensor loss = model->loss(idx, targets);
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, 0.5 * first) << "first " << first << ", last " << last;
}

TEST_P(GPTTiny, SaveLoadRoundTripGivesIdenticalLogits) {
  const ModelConfig c = config();
  manual_seed(5);
  GPT a(c);
  manual_seed(6);
  GPT b(c);
  const Tensor idx = random_tokens(c, 2, 10);
  NoGradGuard no_grad;
  ASSERT_GT(max_abs_diff(a(idx), b(idx)), 0.0);
  const std::string path =
      (std::filesystem::temp_directory_path() / ("kiln_gpt_test_" + GetParam() + ".safetensors"))
          .string();
  kiln::save(a, path);
  kiln::load(b, path);
  std::filesystem::remove(path);
  EXPECT_TRUE(kiln::equal(a(idx), b(idx)));
}

TEST_P(GPTTiny, BFloat16ForwardBackwardAndCache) {
  const ModelConfig c = config();
  manual_seed(7);
  GPT f32(c);
  manual_seed(7);
  GPT bf16(c, TensorOptions().dtype(kBFloat16));
  // The same draws, rounded: the bf16 model is the f32 one converted.
  for (const auto& p : bf16->named_parameters()) {
    ASSERT_EQ(p.value().dtype(), kBFloat16) << p.key();
    EXPECT_TRUE(kiln::equal(p.value(), f32->named_parameters()[p.key()].to(kBFloat16))) << p.key();
  }
  const Tensor idx = random_tokens(c, 2, 12);
  const Tensor logits = bf16(idx);
  EXPECT_EQ(logits.dtype(), kBFloat16);
  const Tensor ref = f32(idx).detach();
  EXPECT_LE(max_abs_diff(logits, ref), 0.05 * std::max(1.0, max_abs(ref)));
  const Tensor loss = bf16->loss(idx, random_tokens(c, 2, 12));
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
  loss.backward();
  for (const auto& p : bf16->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_EQ(p.value().grad().dtype(), kBFloat16) << p.key();
  }
  NoGradGuard no_grad;
  KVCache cache = bf16->make_kv_cache(2, 12);
  EXPECT_EQ(cache.k[0].dtype(), kBFloat16);
  const Tensor a = bf16->forward(idx.narrow(1, 0, 6), cache);
  const Tensor b = bf16->forward(idx.narrow(1, 6, 6), cache);
  EXPECT_LE(max_abs_diff(kiln::cat({a, b}, 1), logits), 0.05 * std::max(1.0, max_abs(ref)));
}

INSTANTIATE_TEST_SUITE_P(Configs, GPTTiny, ::testing::ValuesIn(kTinyConfigs), [](const auto& info) {
  std::string s = info.param;
  for (char& ch : s) {
    if (ch == '-') ch = '_';
  }
  return s;
});

// --- Names and initialisation -----------------------------------------------------------------

TEST(GPT, ParameterNamesFollowTheHeader) {
  manual_seed(0);
  GPT gemma2(ModelConfig::from_name("tiny-gemma2"));
  const std::vector<std::string> want = {
      "transformer.wte.weight",
      "transformer.h.0.norm_1.weight",
      "transformer.h.0.attn.qkv.weight",
      "transformer.h.0.attn.proj.weight",
      "transformer.h.0.post_attention_norm.weight",
      "transformer.h.0.norm_2.weight",
      "transformer.h.0.mlp.fc_1.weight",
      "transformer.h.0.mlp.fc_2.weight",
      "transformer.h.0.mlp.proj.weight",
      "transformer.h.0.post_mlp_norm.weight",
  };
  const auto params = gemma2->named_parameters();
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(params.keys()[i], want[i]);
  EXPECT_TRUE(params.contains("transformer.ln_f.weight"));
  EXPECT_FALSE(params.contains("lm_head.weight"));  // tied
  EXPECT_EQ(params["transformer.h.1.attn.qkv.weight"].sizes(), Shape({(4 + 2 * 2) * 32, 64}));
  EXPECT_EQ(params["transformer.h.1.attn.proj.weight"].sizes(), Shape({64, 4 * 32}));
  EXPECT_EQ(params["transformer.h.1.mlp.fc_1.weight"].sizes(), Shape({172, 64}));
  EXPECT_EQ(params["transformer.h.1.mlp.proj.weight"].sizes(), Shape({64, 172}));

  GPT llama(ModelConfig::from_name("tiny-llama"));
  const auto lp = llama->named_parameters();
  EXPECT_EQ(lp["lm_head.weight"].sizes(), Shape({320, 64}));
  EXPECT_FALSE(lp.contains("transformer.h.0.post_attention_norm.weight"));
  EXPECT_EQ(lp.size(), 1 + 2 * 7 + 1 + 1u);
  EXPECT_EQ(llama->lm_head->weight.data_ptr(), lp["lm_head.weight"].data_ptr());
  EXPECT_EQ(llama->wte->weight.data_ptr(), lp["transformer.wte.weight"].data_ptr());
}

TEST(GPT, InitialisationAndReproducibility) {
  ModelConfig c = ModelConfig::from_name("kiln-tiny");  // d 256, 6 layers: enough samples
  manual_seed(11);
  GPT a(c);
  const auto p = a->named_parameters();
  const auto stdev = [](const Tensor& t) { return t.to(kFloat64).std().item<double>(); };
  const double small = std::sqrt(2.0 / (5.0 * 256)), out = 1.0 / std::sqrt(256.0) / 6;
  EXPECT_NEAR(stdev(p["transformer.wte.weight"]), small, 0.03 * small);
  EXPECT_NEAR(stdev(p["transformer.h.2.attn.qkv.weight"]), small, 0.03 * small);
  EXPECT_NEAR(stdev(p["transformer.h.2.mlp.fc_2.weight"]), small, 0.03 * small);
  EXPECT_NEAR(stdev(p["lm_head.weight"]), small, 0.03 * small);
  EXPECT_NEAR(stdev(p["transformer.h.2.attn.proj.weight"]), out, 0.03 * out);
  EXPECT_NEAR(stdev(p["transformer.h.2.mlp.proj.weight"]), out, 0.03 * out);
  EXPECT_TRUE(kiln::equal(p["transformer.h.3.norm_1.weight"], kiln::ones({256})));
  GPT gemma(ModelConfig::from_name("tiny-gemma"));  // unit offset: norm weights start at 0
  EXPECT_TRUE(kiln::equal(gemma->named_parameters()["transformer.ln_f.weight"], kiln::zeros({64})));
  manual_seed(11);
  GPT b(c);
  for (const auto& q : b->named_parameters()) {
    EXPECT_TRUE(kiln::equal(q.value(), p[q.key()])) << q.key();
  }
}

TEST(GPT, DefaultConfigForward) {
  manual_seed(12);
  const ModelConfig c = ModelConfig::from_name(kDefaultConfig);
  GPT model(c);
  NoGradGuard no_grad;
  const Tensor logits = model(kiln::randint(256, {1, 8}, kInt64));
  EXPECT_EQ(logits.sizes(), Shape({1, 8, c.padded_vocab()}));
  EXPECT_EQ(model->num_parameters(), c.num_parameters());
}

TEST(GPT, HandBuiltLayerNormConfig) {
  // padded_vocab_size and head_size left at 0, LayerNorm instead of RMSNorm.
  ModelConfig c;
  c.name = "hand-layernorm";
  c.vocab_size = 50;
  c.n_layer = 1;
  c.n_embd = 24;
  c.n_head = 3;
  c.n_query_groups = 3;
  c.intermediate_size = 40;
  c.block_size = 16;
  c.norm_kind = NormKind::kLayerNorm;
  manual_seed(13);
  GPT model(c, TensorOptions().dtype(kFloat64));
  EXPECT_EQ(model(kiln::randint(50, {2, 5}, kInt64)).sizes(), Shape({2, 5, 50}));
  NoGradGuard no_grad;
  model->ln_f->weight.copy_(kiln::randn({24}, kFloat64));
  const Tensor x = kiln::randn({3, 24}, kFloat64) * 2 + 1;
  const Vec got = model->ln_f(x).to_vector<double>();
  const Vec xv = x.to_vector<double>(), w = model->ln_f->weight.to_vector<double>();
  for (int64_t r = 0; r < 3; ++r) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < 24; ++i) mean += xv[r * 24 + i] / 24;
    for (int64_t i = 0; i < 24; ++i) var += (xv[r * 24 + i] - mean) * (xv[r * 24 + i] - mean) / 24;
    for (int64_t i = 0; i < 24; ++i) {
      const double want = (xv[r * 24 + i] - mean) / std::sqrt(var + c.norm_eps) * w[i];
      EXPECT_NEAR(got[r * 24 + i], want, 1e-10);
    }
  }
}

// --- One block against an f64 loop reference --------------------------------------------------

Vec ref_norm(const Vec& x, int64_t rows, int64_t d, const Vec& w, const ModelConfig& c) {
  Vec y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (int64_t i = 0; i < d; ++i) ms += x[r * d + i] * x[r * d + i];
    const double inv = 1.0 / std::sqrt(ms / static_cast<double>(d) + c.norm_eps);
    for (int64_t i = 0; i < d; ++i) {
      y[r * d + i] = x[r * d + i] * inv * (c.norm_unit_offset ? 1.0 + w[i] : w[i]);
    }
  }
  return y;
}

// y[r, o] = sum_i x[r, i] w[o, i]
Vec ref_linear(const Vec& x, int64_t rows, int64_t in, const Vec& w, int64_t out) {
  Vec y(static_cast<size_t>(rows * out), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double s = 0;
      for (int64_t i = 0; i < in; ++i) s += x[r * in + i] * w[o * in + i];
      y[r * out + o] = s;
    }
  }
  return y;
}

// Rotate-half RoPE of one head vector at position t, theta_i = base^(-2i / hs) (no scaling).
void ref_rope(double* v, int64_t hs, int64_t t, double base) {
  const int64_t half = hs / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double a = static_cast<double>(t) * std::pow(base, -2.0 * i / static_cast<double>(hs));
    const double x1 = v[i], x2 = v[i + half];
    v[i] = x1 * std::cos(a) - x2 * std::sin(a);
    v[i + half] = x2 * std::cos(a) + x1 * std::sin(a);
  }
}

// One block of layer `layer` on x [1, T, d], the formulas of MODELS.md written as loops.
Vec ref_block(const ModelConfig& c, int64_t layer, BlockImpl& blk, const Vec& x, int64_t T) {
  const int64_t d = c.n_embd, H = c.n_head, G = c.n_query_groups, hs = c.head_dim();
  const int64_t F = c.intermediate_size;
  const auto w = [](const Tensor& t) { return t.to_vector<double>(); };
  const Vec h1 = ref_norm(x, T, d, w(blk.norm_1->weight), c);
  const int64_t qkv_n = (H + 2 * G) * hs;
  Vec qkv = ref_linear(h1, T, d, w(blk.attn->qkv->weight), qkv_n);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t head = 0; head < H + G; ++head) {  // q heads, then k heads
      ref_rope(&qkv[t * qkv_n + head * hs], hs, t, c.rope_base);
    }
  }
  const bool windowed = c.sliding_window > 0 && layer % c.sliding_window_period == 0;
  const double scale = c.attention_scale.value_or(1.0 / std::sqrt(static_cast<double>(hs)));
  Vec att(static_cast<size_t>(T * H * hs), 0.0);
  for (int64_t head = 0; head < H; ++head) {
    const int64_t g = head / (H / G);
    for (int64_t i = 0; i < T; ++i) {
      Vec p(static_cast<size_t>(T), 0.0);
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j <= i; ++j) {
        if (windowed && j <= i - c.sliding_window) continue;
        double s = 0;
        for (int64_t e = 0; e < hs; ++e) {
          s += qkv[i * qkv_n + head * hs + e] * qkv[j * qkv_n + (H + g) * hs + e];
        }
        s *= scale;
        if (c.attention_softcap > 0) s = std::tanh(s / c.attention_softcap) * c.attention_softcap;
        p[j] = s;
        mx = std::max(mx, s);
      }
      double z = 0;
      for (int64_t j = 0; j <= i; ++j) {
        if (windowed && j <= i - c.sliding_window) {
          p[j] = 0;
          continue;
        }
        p[j] = std::exp(p[j] - mx);
        z += p[j];
      }
      for (int64_t j = 0; j <= i; ++j) {
        for (int64_t e = 0; e < hs; ++e) {
          att[i * H * hs + head * hs + e] += p[j] / z * qkv[j * qkv_n + (H + G + g) * hs + e];
        }
      }
    }
  }
  Vec a = ref_linear(att, T, H * hs, w(blk.attn->proj->weight), d);
  if (c.post_attention_norm) a = ref_norm(a, T, d, w(blk.post_attention_norm->weight), c);
  Vec x1(x.size());
  for (size_t i = 0; i < x.size(); ++i) x1[i] = x[i] + a[i];
  const Vec h2 = ref_norm(x1, T, d, w(blk.norm_2->weight), c);
  const Vec gate = ref_linear(h2, T, d, w(blk.mlp->fc_1->weight), F);
  const Vec up = ref_linear(h2, T, d, w(blk.mlp->fc_2->weight), F);
  Vec act(gate.size());
  for (size_t i = 0; i < gate.size(); ++i) {
    const double u = gate[i];
    const double g =
        c.mlp_kind == MLPKind::kSwiGLU
            ? u / (1.0 + std::exp(-u))
            : 0.5 * u * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (u + 0.044715 * u * u * u)));
    act[i] = g * up[i];
  }
  Vec m = ref_linear(act, T, F, w(blk.mlp->proj->weight), d);
  if (c.post_mlp_norm) m = ref_norm(m, T, d, w(blk.post_mlp_norm->weight), c);
  for (size_t i = 0; i < x1.size(); ++i) x1[i] += m[i];
  return x1;
}

class GPTReference : public ::testing::TestWithParam<std::string> {};

TEST_P(GPTReference, BlocksMatchF64Loops) {
  const ModelConfig c = ModelConfig::from_name(GetParam());
  ASSERT_FALSE(c.rope_scaling.has_value());
  manual_seed(21);
  GPT model(c, TensorOptions().dtype(kFloat64));
  {
    // Random norm weights: the init values (1, or 0 with the unit offset) would hide mistakes.
    NoGradGuard no_grad;
    for (auto& p : model->named_parameters()) {
      if (p.value().dim() == 1) p.value().copy_(kiln::randn({c.n_embd}, kFloat64) * 0.5 + 0.3);
    }
  }
  const int64_t T = 12;  // longer than the toy window (8)
  const Tensor x = kiln::randn({1, T, c.n_embd}, kFloat64);
  auto [cos, sin] = nn::functional::rope_cache(T, c.head_dim(), c.rope_base, std::nullopt,
                                               TensorOptions().dtype(kFloat64));
  for (int64_t layer = 0; layer < c.n_layer; ++layer) {
    auto& blk = *model->h->ptr<BlockImpl>(static_cast<size_t>(layer));
    const Vec want = ref_block(c, layer, blk, x.to_vector<double>(), T);
    const Vec got = blk.forward(x, cos, sin).to_vector<double>();
    ASSERT_EQ(got.size(), want.size());
    double err = 0;
    for (size_t i = 0; i < got.size(); ++i) err = std::max(err, std::abs(got[i] - want[i]));
    EXPECT_LT(err, 1e-10) << "layer " << layer;
  }

  // The model around the blocks: (scaled) embedding, final norm, (tied) head, final softcap.
  const Tensor idx = random_tokens(c, 1, T);
  Tensor h = kiln::index_select(model->wte->weight, 0, idx.view({T})).view({1, T, c.n_embd});
  if (c.scale_embeddings) h = h * std::sqrt(static_cast<double>(c.n_embd));
  for (int64_t layer = 0; layer < c.n_layer; ++layer) {
    h = model->h->ptr<BlockImpl>(static_cast<size_t>(layer))->forward(h, cos, sin);
  }
  const Vec hn =
      ref_norm(h.to_vector<double>(), T, c.n_embd, model->ln_f->weight.to_vector<double>(), c);
  const Tensor head = c.tie_embeddings ? model->wte->weight : model->lm_head->weight;
  Vec logits = ref_linear(hn, T, c.n_embd, head.to_vector<double>(), c.padded_vocab());
  if (c.final_softcap > 0) {
    for (double& l : logits) l = std::tanh(l / c.final_softcap) * c.final_softcap;
  }
  const Vec got = model(idx).to_vector<double>();
  ASSERT_EQ(got.size(), logits.size());
  double err = 0;
  for (size_t i = 0; i < got.size(); ++i) err = std::max(err, std::abs(got[i] - logits[i]));
  EXPECT_LT(err, 1e-10);
}

INSTANTIATE_TEST_SUITE_P(Families, GPTReference,
                         ::testing::Values("tiny-llama", "tiny-mistral", "tiny-gemma",
                                           "tiny-gemma2"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& ch : s) {
                             if (ch == '-') ch = '_';
                           }
                           return s;
                         });

TEST(GPT, Llama3RopeScalingChangesTheModel) {
  // tiny-llama3's scaled frequencies against the same weights without scaling: the scaled
  // model must use F::rope_cache's llama3 tables (checked in nn/attention_test.cpp).
  ModelConfig c = ModelConfig::from_name("tiny-llama3");
  manual_seed(31);
  GPT scaled(c);
  c.rope_scaling.reset();
  c.name = "tiny-llama3-unscaled";
  GPT plain(c);
  kiln::NoGradGuard no_grad;
  for (auto& p : plain->named_parameters()) p.value().copy_(scaled->named_parameters()[p.key()]);
  const Tensor idx = random_tokens(c, 1, 40);
  const Tensor a = scaled(idx), b = plain(idx);
  // Position 0 is not rotated at all, later positions are.
  EXPECT_LT(max_abs_diff(a.narrow(1, 0, 1), b.narrow(1, 0, 1)), 1e-6);
  EXPECT_GT(max_abs_diff(a.narrow(1, 20, 20), b.narrow(1, 20, 20)), 1e-4);
}

// --- Errors -----------------------------------------------------------------------------------

TEST(GPT, Errors) {
  manual_seed(0);
  ModelConfig c = ModelConfig::from_name("tiny-llama");
  GPT model(c);
  EXPECT_KILN_ERROR(model(kiln::zeros({1, 4}, kInt32)), "[GPT] expected int64");
  EXPECT_KILN_ERROR(model(kiln::zeros({1, 4}, kFloat32)), "[GPT] expected int64");
  EXPECT_KILN_ERROR(model(kiln::zeros({4}, kInt64)), "[GPT] expected idx of shape [B, T]");
  EXPECT_KILN_ERROR(model(kiln::zeros({1, 2, 4}, kInt64)), "[GPT] expected idx of shape");
  EXPECT_KILN_ERROR(model(kiln::zeros({1, 129}, kInt64)), "more than block_size 128");
  EXPECT_KILN_ERROR(model(Tensor()), "[GPT] idx is undefined");
  // Another device (meta tensors carry no data, so no GPU is needed to see the check).
  EXPECT_KILN_ERROR(model(kiln::empty({1, 4}, TensorOptions(kInt64).device(kMeta))),
                    "[GPT] idx is on meta but the model is on cpu");
  EXPECT_KILN_ERROR(model->loss(kiln::zeros({1, 4}, kInt64), kiln::zeros({1, 5}, kInt64)),
                    "[GPT] targets of shape [1, 5] do not match idx of shape [1, 4]");
  EXPECT_KILN_ERROR(model->loss(kiln::zeros({1, 4}, kInt64), kiln::zeros({1, 4}, kInt32)),
                    "[GPT] expected int64 targets");
  EXPECT_KILN_ERROR(model->make_kv_cache(1, 129), "[GPT] make_kv_cache");
  EXPECT_KILN_ERROR(model->make_kv_cache(0, 8), "[GPT] make_kv_cache");

  KVCache cache = model->make_kv_cache(2, 8);
  EXPECT_KILN_ERROR(model->forward(kiln::zeros({1, 4}, kInt64), cache),
                    "[GPT] the KV cache was made for batch 2");
  model->forward(kiln::zeros({2, 6}, kInt64), cache);
  EXPECT_KILN_ERROR(model->forward(kiln::zeros({2, 3}, kInt64), cache),
                    "[GPT] the KV cache overflows");
  EXPECT_EQ(cache.length, 6);  // a failed call leaves the cache as it was
  KVCache wrong;
  EXPECT_KILN_ERROR(model->forward(kiln::zeros({2, 3}, kInt64), wrong),
                    "[GPT] the KV cache has 0 layers");

  c.n_query_groups = 3;
  EXPECT_KILN_ERROR(GPT{c}, "[ModelConfig] tiny-llama: n_head 4 is not a multiple");
  EXPECT_KILN_ERROR(GPT(ModelConfig::from_name("tiny-llama"), TensorOptions().dtype(kInt64)),
                    "[GPT] the model's dtype must be floating");
}

// --- CUDA against the CPU ----------------------------------------------------------------------

// The same weights (loaded from the CPU model's state_dict) on the GPU: logits, loss, gradients
// and the KV cache must match the CPU model's; bf16 on the GPU stays within bf16 tolerance.
class GpuGPT : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  }
};

TEST_P(GpuGPT, MatchesTheCpuModel) {
  const ModelConfig c = ModelConfig::from_name(GetParam());
  manual_seed(41);
  GPT cpu(c);
  GPT gpu(c, TensorOptions().device(Device(kCUDA)));
  gpu->load_state_dict(cpu->state_dict());
  EXPECT_TRUE(gpu->wte->weight.is_cuda());
  const Tensor idx = random_tokens(c, 2, 20), targets = random_tokens(c, 2, 20);

  const Tensor want = cpu(idx).detach();
  const double scale = std::max(1.0, max_abs(want));
  const Tensor got = gpu(idx.cuda());
  ASSERT_TRUE(got.is_cuda());
  EXPECT_LE(max_abs_diff(got.cpu(), want), 1e-4 * scale);

  const Tensor lc = cpu->loss(idx, targets), lg = gpu->loss(idx.cuda(), targets.cuda());
  EXPECT_NEAR(lg.cpu().item<double>(), lc.item<double>(), 1e-4);
  lc.backward();
  lg.backward();
  const auto gp = gpu->named_parameters();
  for (const auto& p : cpu->named_parameters()) {
    const Tensor gc = p.value().grad(), gg = gp[p.key()].grad();
    ASSERT_TRUE(gg.defined()) << p.key();
    EXPECT_LE(max_abs_diff(gg.cpu(), gc), 1e-3 * std::max(1e-6, max_abs(gc))) << p.key();
  }

  NoGradGuard no_grad;
  const Tensor full = gpu(idx.cuda());
  KVCache cache = gpu->make_kv_cache(2, 24);
  EXPECT_TRUE(cache.k[0].is_cuda());
  std::vector<Tensor> parts = {gpu->forward(idx.cuda().narrow(1, 0, 5), cache)};
  for (int64_t t = 5; t < 20; ++t) parts.push_back(gpu->forward(idx.cuda().narrow(1, t, 1), cache));
  EXPECT_LE(max_abs_diff(kiln::cat(parts, 1).cpu(), full.cpu()), 1e-4 * scale);
}

TEST_P(GpuGPT, BFloat16MatchesTheCpuModel) {
  const ModelConfig c = ModelConfig::from_name(GetParam());
  manual_seed(42);
  GPT cpu(c);
  GPT gpu(c, TensorOptions().device(Device(kCUDA)).dtype(kBFloat16));
  gpu->load_state_dict(cpu->state_dict());
  const Tensor idx = random_tokens(c, 2, 16);
  const Tensor want = cpu(idx).detach();
  const Tensor got = gpu(idx.cuda());
  EXPECT_EQ(got.dtype(), kBFloat16);
  EXPECT_LE(max_abs_diff(got.cpu(), want), 0.05 * std::max(1.0, max_abs(want)));
  const Tensor loss = gpu->loss(idx.cuda(), random_tokens(c, 2, 16).cuda());
  loss.backward();
  EXPECT_TRUE(std::isfinite(loss.cpu().item<double>()));
  for (const auto& p : gpu->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_TRUE(std::isfinite(max_abs(p.value().grad()))) << p.key();
  }
}

// A bf16 training step on CUDA gives the same gradients on every run (bit-exact resume, issue 20):
// a tiny Llama with head size 64, so that attention runs its CUDA kernels, and batches with many
// repeated tokens, so that the embedding's gradient sums many rows per token. The names of the
// gradients that differ point at the kernel.
TEST(GpuGPTDeterminism, Bf16GradientsAreBitEqualRunToRun) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  ModelConfig c = ModelConfig::from_name("tiny-llama");
  c.n_embd = 128;
  c.n_head = 2;
  c.n_query_groups = 1;
  c.head_size = 64;
  c.block_size = 512;
  manual_seed(5);
  GPT gpu(c, TensorOptions().device(Device(kCUDA)).dtype(kBFloat16));
  const Tensor idx = random_tokens(c, 4, 512).cuda(), targets = random_tokens(c, 4, 512).cuda();
  auto step = [&] {
    gpu->zero_grad();
    gpu->loss(idx, targets).backward();
    std::vector<std::pair<std::string, Tensor>> out;
    for (const auto& p : gpu->named_parameters()) out.emplace_back(p.key(), p.value().grad().cpu());
    return out;
  };
  const auto first = step();
  for (int run = 0; run < 2; ++run) {
    const auto again = step();
    ASSERT_EQ(again.size(), first.size());
    std::string differ;
    for (size_t i = 0; i < first.size(); ++i) {
      if (!equal(again[i].second, first[i].second)) differ += " " + first[i].first;
    }
    EXPECT_EQ(differ, "") << "gradients that differ between runs:" << differ;
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, GpuGPT, ::testing::ValuesIn(kTinyConfigs), [](const auto& info) {
  std::string s = info.param;
  for (char& ch : s) {
    if (ch == '-') ch = '_';
  }
  return s;
});

}  // namespace
}  // namespace kiln::models
