// kiln::nn::functional scaled_dot_product_attention and rotary embeddings: the
// reference the CUDA attention kernels are checked against. Plain
// differentiable ops, scores and softmax in f32 for f16/bf16 inputs; the full
// [.., T, S] score matrix is materialised.
#include <cmath>
#include <limits>
#include <numbers>

#include "kernels/cuda/runtime.h"
#include "nn/functional.h"
#include "tensor/env_switch.h"

namespace kiln::nn::functional {
namespace {

constexpr const char *kSdpa = "scaled_dot_product_attention";

// [.., H_kv, S, D] -> [.., H_kv * rep, S, D]: kv head g serves query heads
// g*rep .. g*rep+rep-1 (repeat_interleave over the head dim, as PyTorch's
// enable_gqa).
Tensor repeat_kv(const Tensor &t, int64_t rep) {
  if (rep == 1)
    return t;
  Shape expanded(t.sizes().begin(), t.sizes().end());
  expanded.insert(expanded.end() - 2, rep);
  Shape merged(t.sizes().begin(), t.sizes().end());
  merged[merged.size() - 3] *= rep;
  return t.unsqueeze(-3).expand(expanded).reshape(merged);
}

// Whether the fused flash_attention op (tensor/ops/attention.cpp) computes this call: on CUDA,
// bf16/f16, [B, H, T, D] with D in {64, 128} (256 with a positive scale where
// kiln::cuda::flash_attention_supports_head_size says so: Hopper), no explicit mask, no
// dropout, H a multiple of H_kv. KILN_SDPA=math forces the composite below (debugging,
// comparisons); unset, empty or "flash" leaves the choice to these conditions.
bool use_flash(const Tensor &q, const Tensor &k, const Tensor &v,
               const Tensor &attn_mask, double dropout_p, bool enable_gqa,
               double scale) {
  if (!q.is_cuda() || attn_mask.defined() || dropout_p != 0.0 || q.dim() != 4)
    return false;
  if (q.dtype() != kBFloat16 && q.dtype() != kHalf)
    return false;
  const int64_t d = q.size(-1);
  if (v.sizes() != k.sizes() ||
      k.size(0) != q.size(0) || k.size(1) == 0 || q.size(1) % k.size(1) != 0)
    return false;
  // Without enable_gqa the composite only broadcasts a single kv head.
  if (!enable_gqa && k.size(1) != q.size(1) && k.size(1) != 1)
    return false;
  // Head size 256 needs the Hopper kernels and a positive scale.
  if (d != 64 && d != 128 &&
      (d != 256 || scale <= 0 ||
       !cuda::flash_attention_supports_head_size(d, q.device().index())))
    return false;
  static const kiln::internal::EnvChoice sdpa("KILN_SDPA", {"flash", "math"});
  return sdpa.get() != 1;
}

} // namespace

Tensor scaled_dot_product_attention(const Tensor &query, const Tensor &key,
                                    const Tensor &value,
                                    const Tensor &attn_mask, double dropout_p,
                                    bool is_causal, std::optional<double> scale,
                                    bool enable_gqa, int64_t sliding_window,
                                    double softcap) {
  KILN_CHECK(query.defined() && key.defined() && value.defined(), "[", kSdpa,
             "] query, key and value must be defined");
  KILN_CHECK(query.dim() >= 2 && key.dim() == query.dim() &&
                 value.dim() == query.dim(),
             "[", kSdpa,
             "] expected query, key and value of the same rank >= 2, got ",
             shape_str(query.sizes()), ", ", shape_str(key.sizes()), ", ",
             shape_str(value.sizes()));
  KILN_CHECK(
      query.is_floating_point() && key.dtype() == query.dtype() &&
          value.dtype() == query.dtype(),
      "[", kSdpa,
      "] expected floating-point query, key and value of one dtype, got ",
      dtype_name(query.dtype()), ", ", dtype_name(key.dtype()), ", ",
      dtype_name(value.dtype()));
  const int64_t t_len = query.size(-2), s_len = key.size(-2),
                d = query.size(-1);
  KILN_CHECK(key.size(-1) == d, "[", kSdpa,
             "] query and key must have the same head size, got ",
             shape_str(query.sizes()), " and ", shape_str(key.sizes()));
  KILN_CHECK(value.size(-2) == s_len, "[", kSdpa,
             "] key and value must have the same sequence length, got ",
             shape_str(key.sizes()), " and ", shape_str(value.sizes()));
  KILN_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "[", kSdpa,
             "] dropout_p must be in [0, 1), got ", dropout_p);
  KILN_CHECK(sliding_window >= 0, "[", kSdpa,
             "] sliding_window must be >= 0 (0 = off), got ", sliding_window);
  KILN_CHECK(softcap >= 0.0, "[", kSdpa,
             "] softcap must be >= 0 (0 = off), got ", softcap);
  KILN_CHECK(!(is_causal && attn_mask.defined()), "[", kSdpa,
             "] an explicit attn_mask should not be set when is_causal=true");
  if (attn_mask.defined()) {
    KILN_CHECK(attn_mask.dtype() == kBool ||
                   is_floating_point(attn_mask.dtype()),
               "[", kSdpa, "] attn_mask must be bool or floating, got ",
               dtype_name(attn_mask.dtype()));
  }

  const double sc = scale.value_or(1.0 / std::sqrt(static_cast<double>(d)));
  if (use_flash(query, key, value, attn_mask, dropout_p, enable_gqa, sc)) {
    return std::get<0>(kiln::flash_attention(query, key, value, sc, is_causal,
                                             sliding_window, softcap));
  }

  Tensor k = key, v = value;
  if (query.dim() >= 3) {
    const int64_t hq = query.size(-3), hkv = key.size(-3);
    KILN_CHECK(value.size(-3) == hkv, "[", kSdpa,
               "] key and value must have the same heads, ", "got ",
               shape_str(key.sizes()), " and ", shape_str(value.sizes()));
    if (enable_gqa && hq != hkv) {
      KILN_CHECK(hkv > 0 && hq % hkv == 0, "[", kSdpa,
                 "] with enable_gqa, the query heads (", hq,
                 ") must be a multiple of the key/value heads (", hkv, ")");
      k = repeat_kv(key, hq / hkv);
      v = repeat_kv(value, hq / hkv);
    } else {
      KILN_CHECK(hq == hkv || hkv == 1 || hq == 1, "[", kSdpa, "] query has ",
                 hq, " heads but key/value have ", hkv,
                 "; pass enable_gqa=true for grouped-query ", "attention");
    }
  }

  const ScalarType dtype = query.dtype();
  const ScalarType ct =
      (dtype == kFloat16 || dtype == kBFloat16) ? kFloat32 : dtype;
  Tensor scores = query.to(ct).matmul(k.to(ct).transpose(-2, -1)) * sc;
  if (softcap > 0.0)
    scores = (scores / softcap).tanh() * softcap;

  // Which keys each query may attend (bool, broadcast against the scores).
  Tensor allowed;
  if (is_causal || sliding_window > 0) {
    const TensorOptions o = TensorOptions(kInt64).device(query.device());
    const Tensor i = arange(t_len, o).view({t_len, 1});
    const Tensor j = arange(s_len, o).view({1, s_len});
    allowed = j <= i;
    if (sliding_window > 0)
      allowed = allowed & (j > i - sliding_window);
  }
  if (attn_mask.defined()) {
    if (attn_mask.dtype() == kBool) {
      allowed = allowed.defined() ? (allowed & attn_mask) : attn_mask;
    } else {
      scores = scores + attn_mask.to(ct);
    }
  }
  if (allowed.defined()) {
    scores = kiln::where(allowed, scores,
                         Scalar(-std::numeric_limits<double>::infinity()));
  }
  Tensor probs;
  if (allowed.defined() || attn_mask.defined()) {
    // A row with every key masked attends nothing (zeros, as PyTorch's math
    // backend); its scores are replaced before the softmax so that no NaN
    // enters the graph.
    const Tensor dead = scores.detach().amax({-1}, /*keepdim=*/true) ==
                        Scalar(-std::numeric_limits<double>::infinity());
    probs =
        kiln::where(dead, Scalar(0.0),
                    kiln::softmax(kiln::where(dead, Scalar(0.0), scores), -1));
  } else {
    probs = kiln::softmax(scores, -1);
  }
  if (dropout_p > 0.0)
    probs = functional::dropout(
        probs, DropoutFuncOptions().p(dropout_p).training(true));
  return probs.to(dtype).matmul(v);
}

std::tuple<Tensor, Tensor> rope_cache(int64_t seq_len, int64_t head_size,
                                      double base,
                                      std::optional<RopeScaling> scaling,
                                      const TensorOptions &options) {
  KILN_CHECK(seq_len >= 0, "[rope_cache] seq_len must be non-negative, got ",
             seq_len);
  KILN_CHECK(head_size > 0 && head_size % 2 == 0,
             "[rope_cache] head_size must be positive and even, got ",
             head_size);
  KILN_CHECK(base > 0, "[rope_cache] base must be positive, got ", base);
  const int64_t half = head_size / 2;
  std::vector<double> inv_freq(half);
  for (int64_t i = 0; i < half; ++i) {
    inv_freq[i] = 1.0 / std::pow(base, static_cast<double>(2 * i) /
                                           static_cast<double>(head_size));
  }
  if (scaling) {
    const RopeScaling &s = *scaling;
    KILN_CHECK(
        s.factor > 0 && s.low_freq_factor > 0 && s.original_max_seq_len > 0 &&
            s.high_freq_factor > s.low_freq_factor,
        "[rope_cache] llama3 scaling needs factor > 0, 0 < low_freq_factor < ",
        "high_freq_factor and original_max_seq_len > 0, got factor ", s.factor,
        ", low_freq_factor ", s.low_freq_factor, ", high_freq_factor ",
        s.high_freq_factor, ", original_max_seq_len ", s.original_max_seq_len);
    const double old_len = static_cast<double>(s.original_max_seq_len);
    const double low_freq_wavelen = old_len / s.low_freq_factor;
    const double high_freq_wavelen = old_len / s.high_freq_factor;
    for (double &f : inv_freq) {
      const double wavelen = 2.0 * std::numbers::pi / f;
      if (wavelen < high_freq_wavelen)
        continue; // high frequencies are kept
      if (wavelen > low_freq_wavelen) {
        f /= s.factor; // low frequencies are slowed down by `factor`
        continue;
      }
      const double smooth = (old_len / wavelen - s.low_freq_factor) /
                            (s.high_freq_factor - s.low_freq_factor);
      f = (1.0 - smooth) * f / s.factor + smooth * f;
    }
  }
  std::vector<double> cos_v(seq_len * head_size), sin_v(seq_len * head_size);
  for (int64_t t = 0; t < seq_len; ++t) {
    for (int64_t i = 0; i < head_size; ++i) {
      const double angle = static_cast<double>(t) * inv_freq[i % half];
      cos_v[t * head_size + i] = std::cos(angle);
      sin_v[t * head_size + i] = std::sin(angle);
    }
  }
  const TensorOptions out =
      TensorOptions(options.dtype()).device(options.device());
  const auto make = [&](std::vector<double> &v) {
    return from_blob(v.data(), {seq_len, head_size}, kFloat64)
        .to(out, /*copy=*/true);
  };
  return {make(cos_v), make(sin_v)};
}

namespace {

// cos/sin as the [T, D] tables of the fused rotary_emb op for x, or undefined
// when the call does not fit it (broadcast positions, other dtypes, devices).
std::tuple<Tensor, Tensor> fused_tables(const Tensor &x, const Tensor &cos,
                                        const Tensor &sin) {
  if (x.dim() < 2 || cos.dim() < 2 || cos.sizes() != sin.sizes() ||
      cos.dtype() != sin.dtype() || cos.size(-2) != x.size(-2) ||
      cos.size(-1) != x.size(-1) || cos.device() != x.device() ||
      sin.device() != x.device())
    return {};
  if (cos.dtype() != x.dtype() &&
      !(is_reduced_float(x.dtype()) && cos.dtype() == kFloat32))
    return {};
  for (int64_t d = 0; d + 2 < cos.dim(); ++d) {
    if (cos.size(d) != 1)
      return {};
  }
  const Shape table{x.size(-2), x.size(-1)};
  return {cos.reshape(table), sin.reshape(table)};
}

} // namespace

Tensor apply_rotary_emb(const Tensor &x, const Tensor &cos, const Tensor &sin) {
  KILN_CHECK(x.defined() && cos.defined() && sin.defined(),
             "[apply_rotary_emb] x, cos and sin must be defined");
  KILN_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0,
             "[apply_rotary_emb] the last dim of x must ",
             "be even (the two rotated halves), got shape ",
             shape_str(x.sizes()));
  KILN_CHECK(x.is_floating_point(),
             "[apply_rotary_emb] expected a floating-point x, got ",
             dtype_name(x.dtype()));
  KILN_CHECK(cos.sizes() == sin.sizes(), "[apply_rotary_emb] cos ",
             shape_str(cos.sizes()), " and sin ", shape_str(sin.sizes()),
             " must have the same shape");
  bool fits =
      cos.dim() >= 1 && cos.dim() <= x.dim() && cos.size(-1) == x.size(-1);
  for (int64_t i = 1; fits && i <= cos.dim(); ++i) {
    fits = cos.size(-i) == x.size(-i) || cos.size(-i) == 1;
  }
  KILN_CHECK(fits, "[apply_rotary_emb] cos/sin of shape ",
             shape_str(cos.sizes()), " must broadcast to x of shape ",
             shape_str(x.sizes()));
  if (auto [c, s] = fused_tables(x, cos, sin); c.defined())
    return kiln::rotary_emb(x, c, s);
  const int64_t half = x.size(-1) / 2;
  const Tensor x1 = x.narrow(-1, 0, half);
  const Tensor x2 = x.narrow(-1, half, half);
  const Tensor rotated = cat({-x2, x1}, -1);
  return (x * cos + rotated * sin).to(x.dtype());
}

std::tuple<Tensor, Tensor> apply_rotary_emb_qk(const Tensor &q, const Tensor &k,
                                               const Tensor &cos,
                                               const Tensor &sin) {
  KILN_CHECK(q.defined() && k.defined() && cos.defined() && sin.defined(),
             "[apply_rotary_emb_qk] q, k, cos and sin must be defined");
  if (q.dim() >= 2 && k.dim() >= 2 && q.dtype() == k.dtype() &&
      q.is_floating_point() && q.size(-1) % 2 == 0 &&
      k.size(-2) == q.size(-2) && k.size(-1) == q.size(-1)) {
    if (auto [c, s] = fused_tables(q, cos, sin); c.defined())
      return kiln::rotary_emb_qk(q, k, c, s);
  }
  return {apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)};
}

} // namespace kiln::nn::functional
