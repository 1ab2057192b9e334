// kiln::nn::functional scaled_dot_product_attention and rotary embeddings. Both call the
// fused ops (tensor/ops/attention.cpp, tensor/ops/rotary.cpp), which choose a kernel or run
// their decomposition; this file only brings the arguments to the ops' forms.
#include <algorithm>
#include <cmath>
#include <numbers>

#include "nn/functional.h"

namespace kiln::nn::functional {
namespace {

constexpr const char *kSdpa = "scaled_dot_product_attention";

// t [batch..., tail...] (tail: its last `keep` dims) expanded over `batch` and viewed as
// [prod(batch), tail...].
Tensor flatten_batch(const Tensor &t, const Shape &batch, int64_t keep) {
  Shape full = batch;
  full.insert(full.end(), t.sizes().end() - keep, t.sizes().end());
  Shape flat{numel_of(batch)};
  flat.insert(flat.end(), t.sizes().end() - keep, t.sizes().end());
  return t.expand(full).reshape(flat);
}

}  // namespace

Tensor scaled_dot_product_attention(const Tensor &query, const Tensor &key, const Tensor &value,
                                    const Tensor &attn_mask, double dropout_p, bool is_causal,
                                    std::optional<double> scale, bool enable_gqa,
                                    int64_t sliding_window, double softcap) {
  KILN_CHECK(query.defined() && key.defined() && value.defined(), "[", kSdpa,
             "] query, key and value must be defined");
  KILN_CHECK(query.dim() >= 2 && key.dim() == query.dim() && value.dim() == query.dim(), "[", kSdpa,
             "] expected query, key and value of the same rank >= 2, got ",
             shape_str(query.sizes()), ", ", shape_str(key.sizes()), ", ",
             shape_str(value.sizes()));
  // The op takes [B, H, T, D] with H a multiple of H_kv: leading dims are
  // broadcast and flattened into B, a missing head dim is 1, and without
  // enable_gqa only equal head counts or a single head on either side
  // broadcast (as PyTorch).
  const int64_t rank = query.dim();
  const int64_t hq = rank >= 3 ? query.size(-3) : 1;
  const int64_t hkv = rank >= 3 ? key.size(-3) : 1;
  KILN_CHECK(enable_gqa || hq == hkv || hkv == 1 || hq == 1, "[", kSdpa, "] query has ", hq,
             " heads but key/value have ", hkv,
             "; pass enable_gqa=true for grouped-query attention");
  // The leading dims before [H, T, D] (none below rank 4), broadcast.
  const int64_t lead = std::max<int64_t>(rank - 3, 0);
  Shape batch(query.sizes().begin(), query.sizes().begin() + lead);
  for (const Tensor *t : {&key, &value}) {
    batch = broadcast_shapes(batch, t->sizes().subspan(0, static_cast<size_t>(lead)), kSdpa);
  }
  // [batch..., H, T, D] (or [T, D]) -> [prod(batch), heads, T, D].
  auto as_4d = [&](const Tensor &t, int64_t heads) {
    Tensor h = rank >= 3 ? t : t.unsqueeze(0);
    if (h.size(-3) != heads) {
      Shape s = to_shape(h.sizes());
      s[s.size() - 3] = heads;
      h = h.expand(s);
    }
    return flatten_batch(h, batch, 3);
  };
  // One query head against several kv heads: the query broadcasts.
  const int64_t heads = std::max(hq, hkv);
  const Tensor q = as_4d(query, hq == 1 ? heads : hq);
  const Tensor k = as_4d(key, hkv);
  const Tensor v = as_4d(value, hkv);
  Tensor mask;
  if (attn_mask.defined()) {
    KILN_CHECK(attn_mask.dim() <= rank, "[", kSdpa, "] attn_mask of shape ",
               shape_str(attn_mask.sizes()), " has more dims than the query ",
               shape_str(query.sizes()));
    Tensor m = attn_mask;
    while (m.dim() < std::max<int64_t>(rank, 3)) m = m.unsqueeze(0);
    if (rank <= 4) {
      mask = rank == 4 ? m : m.unsqueeze(0);
    } else {
      Shape full = batch;
      full.insert(full.end(), {heads, q.size(2), k.size(2)});
      mask = flatten_batch(m.expand(full), batch, 3);
    }
  }
  const double sc = scale.value_or(1.0 / std::sqrt(static_cast<double>(query.size(-1))));
  Tensor out = std::get<0>(
      kiln::flash_attention(q, k, v, mask, sc, is_causal, sliding_window, softcap, dropout_p));
  Shape out_shape = batch;
  if (rank >= 3) out_shape.push_back(heads);
  out_shape.insert(out_shape.end(), {query.size(-2), value.size(-1)});
  return out.view(out_shape);
}

std::tuple<Tensor, Tensor> rope_cache(int64_t seq_len, int64_t head_size, double base,
                                      std::optional<RopeScaling> scaling,
                                      const TensorOptions &options) {
  KILN_CHECK(seq_len >= 0, "[rope_cache] seq_len must be non-negative, got ", seq_len);
  KILN_CHECK(head_size > 0 && head_size % 2 == 0,
             "[rope_cache] head_size must be positive and even, got ", head_size);
  KILN_CHECK(base > 0, "[rope_cache] base must be positive, got ", base);
  const int64_t half = head_size / 2;
  std::vector<double> inv_freq(half);
  for (int64_t i = 0; i < half; ++i) {
    inv_freq[i] = 1.0 / std::pow(base, static_cast<double>(2 * i) / static_cast<double>(head_size));
  }
  if (scaling) {
    const RopeScaling &s = *scaling;
    KILN_CHECK(s.factor > 0 && s.low_freq_factor > 0 && s.original_max_seq_len > 0 &&
                   s.high_freq_factor > s.low_freq_factor,
               "[rope_cache] llama3 scaling needs factor > 0, 0 < low_freq_factor < ",
               "high_freq_factor and original_max_seq_len > 0, got factor ", s.factor,
               ", low_freq_factor ", s.low_freq_factor, ", high_freq_factor ", s.high_freq_factor,
               ", original_max_seq_len ", s.original_max_seq_len);
    const double old_len = static_cast<double>(s.original_max_seq_len);
    const double low_freq_wavelen = old_len / s.low_freq_factor;
    const double high_freq_wavelen = old_len / s.high_freq_factor;
    for (double &f : inv_freq) {
      const double wavelen = 2.0 * std::numbers::pi / f;
      if (wavelen < high_freq_wavelen) continue;  // high frequencies are kept
      if (wavelen > low_freq_wavelen) {
        f /= s.factor;  // low frequencies are slowed down by `factor`
        continue;
      }
      const double smooth =
          (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
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
  const TensorOptions out = TensorOptions(options.dtype()).device(options.device());
  const auto make = [&](std::vector<double> &v) {
    return from_blob(v.data(), {seq_len, head_size}, kFloat64).to(out, /*copy=*/true);
  };
  return {make(cos_v), make(sin_v)};
}

Tensor apply_rotary_emb(const Tensor &x, const Tensor &cos, const Tensor &sin) {
  return kiln::rotary_emb(x, cos, sin);
}

std::tuple<Tensor, Tensor> apply_rotary_emb_qk(const Tensor &q, const Tensor &k, const Tensor &cos,
                                               const Tensor &sin) {
  return kiln::rotary_emb_qk(q, k, cos, sin);
}

}  // namespace kiln::nn::functional
