// kiln::models::GPT: Proj, Norm, CausalSelfAttention, MLP, Block and the model, built from
// registry ops (matmul, the fused RMSNorm, RoPE, SwiGLU/GeGLU and cross-entropy ops, and
// F::scaled_dot_product_attention, which takes the flash-attention kernel on CUDA) so that
// autograd and every backend work without model-specific code.
#include "models/gpt.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>

#include "autograd/grad_mode.h"
#include "models/gpt_hooks.h"
#include "nn/functional.h"
#include "tensor/half.h"
#include "tensor/linear_cross_entropy.h"
#include "tensor/ops.h"

namespace kiln::models {
namespace F = nn::functional;

namespace {

// N(0, std) drawn in f32 on the target device, then converted: a bf16 model is the rounded f32
// one, whatever the dtype the same seed gives the same model.
Tensor normal_init(IntArrayRef sizes, double std, const TensorOptions& options) {
  Tensor w = kiln::empty(sizes, TensorOptions(kFloat32).device(options.device()));
  w.normal_(0.0, std);
  return options.dtype() == kFloat32 ? w : w.to(options.dtype());
}

// Draws a new value for an existing parameter (the output projections' smaller init).
void redraw(Tensor& weight, double std) {
  const Tensor w = normal_init(weight.sizes(), std, weight.options());
  NoGradGuard no_grad;
  weight.copy_(w);
}

// The output projections' init: N(0, 1 / sqrt(n_embd) / n_layer).
double out_proj_std(const ModelConfig& c) {
  return 1.0 / std::sqrt(static_cast<double>(c.n_embd)) / static_cast<double>(c.n_layer);
}

bool is_half(ScalarType t) { return t == kFloat16 || t == kBFloat16; }

// `v` as a 0-d tensor of `dtype` holds it (kiln::scalar_tensor(v, dtype).item<double>()).
double round_to_dtype(double v, ScalarType dtype) {
  if (dtype == kBFloat16) return static_cast<float>(BFloat16(static_cast<float>(v)));
  if (dtype == kFloat16) return static_cast<float>(Half(static_cast<float>(v)));
  if (dtype == kFloat32) return static_cast<float>(v);
  return v;
}

}  // namespace

// --- Proj -------------------------------------------------------------------------------------

ProjImpl::ProjImpl(int64_t in_features, int64_t out_features, const TensorOptions& options) {
  KILN_CHECK(in_features > 0 && out_features > 0, "[GPT] Proj sizes must be positive, got in ",
             in_features, ", out ", out_features);
  // GPT-NeoX's small init N(0, sqrt(2 / (5 d))); in_features is n_embd for every Proj whose
  // init is not redrawn by its owner.
  weight = register_parameter(
      "weight", normal_init({out_features, in_features},
                            std::sqrt(2.0 / (5.0 * static_cast<double>(in_features))), options));
}

Tensor ProjImpl::forward(const Tensor& x) { return kiln::linear(x, weight); }

// --- Norm -------------------------------------------------------------------------------------

NormImpl::NormImpl(const ModelConfig& config, const TensorOptions& options)
    : kind_(config.norm_kind), eps_(config.norm_eps), unit_offset_(config.norm_unit_offset) {
  weight = register_parameter("weight", unit_offset_ ? kiln::zeros({config.n_embd}, options)
                                                     : kiln::ones({config.n_embd}, options));
}

Tensor NormImpl::forward(const Tensor& x) {
  Tensor w = weight;
  if (unit_offset_) {
    // Gemma multiplies by (1 + w) in f32 (HF: `* (1.0 + self.weight.float())`); the norms'
    // kernels take an f32 weight for f16/bf16 inputs.
    w = (is_half(w.dtype()) ? w.to(kFloat32) : w) + 1.0;
  }
  if (kind_ == NormKind::kRMSNorm) return F::rms_norm(x, {x.size(-1)}, w, eps_);
  return F::layer_norm(x, {x.size(-1)}, w, {}, eps_);
}

// --- Attention --------------------------------------------------------------------------------

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const ModelConfig& config, int64_t layer,
                                                 const TensorOptions& options)
    : config_(config), layer_(layer) {
  const int64_t hs = config.head_dim();
  qkv = register_module(
      "qkv", Proj(config.n_embd, (config.n_head + 2 * config.n_query_groups) * hs, options));
  proj = register_module("proj", Proj(config.n_head * hs, config.n_embd, options));
  redraw(proj->weight, out_proj_std(config));
}

Tensor CausalSelfAttentionImpl::forward(const Tensor& x, const Tensor& cos, const Tensor& sin,
                                        KVCache* cache) {
  const int64_t B = x.size(0), T = x.size(1);
  const int64_t H = config_.n_head, G = config_.n_query_groups, hs = config_.head_dim();
  // One matmul for q, k and v; one kernel splits its heads and applies RoPE to q and k (and its
  // backward writes the whole qkv gradient at once: narrow views of qkv_out would cost three
  // zero-filled [B, T, (H + 2G) hs] gradients and their sum, a quarter of llama-160m's GPU step).
  auto [q, k, v] = kiln::split_qkv_rotary(qkv(x), cos, sin, H, G);  // [B, H|G, T, hs]

  const int64_t window = config_.uses_sliding_window(layer_) ? config_.sliding_window : 0;
  const bool gqa = H != G;
  Tensor y;
  if (cache == nullptr) {
    y = F::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, config_.attn_scale(),
                                        gqa, window, config_.attention_softcap);
  } else {
    const int64_t start = cache->length, total = start + T;
    Tensor& kc = cache->k[static_cast<size_t>(layer_)];
    Tensor& vc = cache->v[static_cast<size_t>(layer_)];
    {
      NoGradGuard no_grad;  // the cache holds values, not history
      kc.narrow(2, start, T).copy_(k.detach());
      vc.narrow(2, start, T).copy_(v.detach());
    }
    Tensor keys = kc.narrow(2, 0, total), values = vc.narrow(2, 0, total);
    if (GradMode::is_enabled() && (k.requires_grad() || v.requires_grad())) {
      // With grad on, this step's keys and values keep their history (the past is constant).
      keys = kiln::cat({kc.narrow(2, 0, start), k}, 2);
      values = kiln::cat({vc.narrow(2, 0, start), v}, 2);
    }
    // sdpa's is_causal is top-left aligned: query i sits at absolute position start + i.
    const TensorOptions io = TensorOptions(kInt64).device(x.device());
    const Tensor qpos = kiln::arange(start, total, io).view({T, 1});
    const Tensor kpos = kiln::arange(total, io).view({1, total});
    Tensor allowed = kpos <= qpos;
    if (window > 0) allowed = allowed & (kpos > qpos - window);
    y = F::scaled_dot_product_attention(q, keys, values, allowed, 0.0, /*is_causal=*/false,
                                        config_.attn_scale(), gqa, /*sliding_window=*/0,
                                        config_.attention_softcap);
  }
  return proj(y.transpose(1, 2).reshape({B, T, H * hs}));
}

// --- MLP --------------------------------------------------------------------------------------

MLPImpl::MLPImpl(const ModelConfig& config, const TensorOptions& options) : kind_(config.mlp_kind) {
  fc_1 = register_module("fc_1", Proj(config.n_embd, config.intermediate_size, options));
  fc_2 = register_module("fc_2", Proj(config.n_embd, config.intermediate_size, options));
  proj = register_module("proj", Proj(config.intermediate_size, config.n_embd, options));
  redraw(proj->weight, out_proj_std(config));
}

Tensor MLPImpl::forward(const Tensor& x) {
  // act(gate) * up in one fused pass (and one fused backward).
  const Tensor gate = fc_1(x), up = fc_2(x);
  return proj(kind_ == MLPKind::kSwiGLU ? F::swiglu(gate, up) : F::geglu_tanh(gate, up));
}

// --- Block ------------------------------------------------------------------------------------

BlockImpl::BlockImpl(const ModelConfig& config, int64_t layer, const TensorOptions& options) {
  norm_1 = register_module("norm_1", Norm(config, options));
  attn = register_module("attn", CausalSelfAttention(config, layer, options));
  if (config.post_attention_norm) {
    post_attention_norm = register_module("post_attention_norm", Norm(config, options));
  }
  norm_2 = register_module("norm_2", Norm(config, options));
  mlp = register_module("mlp", MLP(config, options));
  if (config.post_mlp_norm) post_mlp_norm = register_module("post_mlp_norm", Norm(config, options));
}

Tensor BlockImpl::forward(const Tensor& x, const Tensor& cos, const Tensor& sin, KVCache* cache) {
  Tensor h = attn->forward(norm_1(x), cos, sin, cache);
  if (post_attention_norm) h = post_attention_norm(h);
  const Tensor x1 = x + h;
  Tensor m = mlp(norm_2(x1));
  if (post_mlp_norm) m = post_mlp_norm(m);
  return x1 + m;
}

// --- GPT --------------------------------------------------------------------------------------

GPTImpl::GPTImpl(ModelConfig config, const TensorOptions& options) : config_(std::move(config)) {
  config_.validate();
  KILN_CHECK(is_floating_point(options.dtype()), "[GPT] the model's dtype must be floating, got ",
             dtype_name(options.dtype()));
  nn::ModuleDict transformer;
  wte = Proj(config_.n_embd, config_.padded_vocab(), options);
  transformer->insert("wte", wte);
  h = nn::ModuleList();
  for (int64_t l = 0; l < config_.n_layer; ++l) h->push_back(Block(config_, l, options));
  transformer->insert("h", h);
  ln_f = Norm(config_, options);
  transformer->insert("ln_f", ln_f);
  register_module("transformer", transformer);
  if (!config_.tie_embeddings) {
    lm_head = register_module("lm_head", Proj(config_.n_embd, config_.padded_vocab(), options));
  }
}

// The block and embedding hooks (models/gpt_hooks.h), by model: side tables, so that GPTImpl's
// layout (and everything that includes gpt.h) stays as it is.
namespace {
std::mutex g_hooks_mu;
std::unordered_map<const GPTImpl*, std::shared_ptr<const BlockHook>>& block_hooks() {
  static auto* hooks = new std::unordered_map<const GPTImpl*, std::shared_ptr<const BlockHook>>();
  return *hooks;
}
std::shared_ptr<const BlockHook> block_hook_of(const GPTImpl* model) {
  std::lock_guard<std::mutex> lock(g_hooks_mu);
  const auto it = block_hooks().find(model);
  return it == block_hooks().end() ? nullptr : it->second;
}

std::unordered_map<const GPTImpl*, std::shared_ptr<const EmbeddingHook>>& embedding_hooks() {
  static auto* hooks =
      new std::unordered_map<const GPTImpl*, std::shared_ptr<const EmbeddingHook>>();
  return *hooks;
}
std::shared_ptr<const EmbeddingHook> embedding_hook_of(const GPTImpl* model) {
  std::lock_guard<std::mutex> lock(g_hooks_mu);
  const auto it = embedding_hooks().find(model);
  return it == embedding_hooks().end() ? nullptr : it->second;
}
template <typename Hook>
void set_hook(std::unordered_map<const GPTImpl*, std::shared_ptr<const Hook>>& hooks,
              const GPTImpl& model, Hook hook) {
  std::lock_guard<std::mutex> lock(g_hooks_mu);
  if (hook) {
    hooks[&model] = std::make_shared<const Hook>(std::move(hook));
  } else {
    hooks.erase(&model);
  }
}
}  // namespace

void set_block_hook(const GPTImpl& model, BlockHook hook) {
  set_hook(block_hooks(), model, std::move(hook));
}

void set_embedding_hook(const GPTImpl& model, EmbeddingHook hook) {
  set_hook(embedding_hooks(), model, std::move(hook));
}

Tensor GPTImpl::forward(const Tensor& idx) { return run(idx, nullptr); }

Tensor GPTImpl::forward(const Tensor& idx, KVCache& cache) { return run(idx, &cache); }

Tensor GPTImpl::loss(const Tensor& idx, const Tensor& targets, int64_t ignore_index) {
  KILN_CHECK(targets.defined() && targets.dtype() == kInt64, "[GPT] expected int64 targets, got ",
             targets.defined() ? dtype_name(targets.dtype()) : std::string("an undefined tensor"));
  KILN_CHECK(idx.defined() && targets.sizes() == idx.sizes(), "[GPT] targets of shape ",
             shape_str(targets.sizes()), " do not match idx of shape ",
             idx.defined() ? shape_str(idx.sizes()) : std::string("(undefined)"));
  KILN_CHECK(targets.device() == idx.device(), "[GPT] targets are on ", targets.device().str(),
             " but idx is on ", idx.device().str());
  const int64_t n = idx.size(0) * idx.size(1);
  if (config_.final_softcap > 0) {
    const Tensor logits = run(idx, nullptr);
    return kiln::cross_entropy_fused(logits.reshape({n, logits.size(2)}), targets.reshape({n}),
                                     ignore_index);
  }
  // The LM head and the loss in chunks of rows: the [B T, vocab] logits are never held whole.
  const Tensor x = hidden(idx, nullptr);
  return kiln::linear_cross_entropy(x.reshape({n, x.size(2)}), head_weight(), targets.reshape({n}),
                                    ignore_index);
}

Tensor GPTImpl::hidden(const Tensor& idx, KVCache* cache) {
  const Tensor& table = wte->weight;
  KILN_CHECK(idx.defined(), "[GPT] idx is undefined");
  KILN_CHECK(idx.dtype() == kInt64, "[GPT] expected int64 token ids, got ", dtype_name(idx.dtype()),
             " of shape ", shape_str(idx.sizes()));
  KILN_CHECK(idx.dim() == 2, "[GPT] expected idx of shape [B, T], got ", shape_str(idx.sizes()));
  KILN_CHECK(idx.device() == table.device(), "[GPT] idx is on ", idx.device().str(),
             " but the model is on ", table.device().str());
  const int64_t B = idx.size(0), T = idx.size(1);
  KILN_CHECK(B > 0 && T > 0, "[GPT] idx of shape ", shape_str(idx.sizes()), " is empty");
  KILN_CHECK(T <= config_.block_size, "[GPT] idx of shape ", shape_str(idx.sizes()), " has ", T,
             " positions, more than block_size ", config_.block_size, " of ", config_.name);
  int64_t start = 0;
  if (cache != nullptr) {
    KILN_CHECK(static_cast<int64_t>(cache->k.size()) == config_.n_layer &&
                   cache->v.size() == cache->k.size(),
               "[GPT] the KV cache has ", cache->k.size(), " layers, the model ", config_.n_layer,
               " (make it with make_kv_cache)");
    KILN_CHECK(cache->batch() == B, "[GPT] the KV cache was made for batch ", cache->batch(),
               " but idx has shape ", shape_str(idx.sizes()));
    KILN_CHECK(cache->length >= 0 && cache->length + T <= cache->max_seq_len(),
               "[GPT] the KV cache overflows: it holds ", cache->length, " of ",
               cache->max_seq_len(), " positions and idx of shape ", shape_str(idx.sizes()),
               " adds ", T);
    KILN_CHECK(cache->k[0].dtype() == table.dtype() && cache->k[0].device() == table.device(),
               "[GPT] the KV cache is ", dtype_name(cache->k[0].dtype()), " on ",
               cache->k[0].device().str(), " but the model is ", dtype_name(table.dtype()), " on ",
               table.device().str());
    start = cache->length;
  }

  const std::shared_ptr<const EmbeddingHook> embed = embedding_hook_of(this);
  Tensor x = embed ? (*embed)(table, idx) : kiln::embedding(table, idx);  // [B, T, d]
  if (config_.scale_embeddings) {
    // HF multiplies by sqrt(d) as a tensor of the activations' dtype: round the factor first
    // (on the host, not through a tensor whose value kiln::compile could not read).
    x = x * round_to_dtype(std::sqrt(static_cast<double>(config_.n_embd)), x.dtype());
  }
  const auto [cos, sin] = rope(start, T, x);
  const std::shared_ptr<const BlockHook> hook = block_hook_of(this);
  int64_t layer = 0;
  for (const auto& block : *h) {
    if (hook) (*hook)(layer, true);
    x = block->as<BlockImpl>()->forward(x, cos, sin, cache);
    if (hook) (*hook)(layer, false);
    ++layer;
  }
  return ln_f(x);
}

const Tensor& GPTImpl::head_weight() const {
  return config_.tie_embeddings ? wte->weight : lm_head->weight;
}

Tensor GPTImpl::run(const Tensor& idx, KVCache* cache) {
  Tensor logits = kiln::linear(hidden(idx, cache), head_weight());
  if (config_.final_softcap > 0) {
    logits = (logits / config_.final_softcap).tanh() * config_.final_softcap;
  }
  if (cache != nullptr) cache->length += idx.size(1);
  return logits;
}

std::pair<Tensor, Tensor> GPTImpl::rope(int64_t start, int64_t length, const Tensor& like) {
  const int64_t need = start + length;
  if (!rope_cos_.defined() || rope_cos_.dtype() != like.dtype() ||
      rope_cos_.device() != like.device() || rope_cos_.size(0) < need) {
    // Grown geometrically up to block_size rather than built for all of it at once: Llama 3.2's
    // 131072 positions would cost far more than short runs use.
    const int64_t have = rope_cos_.defined() ? rope_cos_.size(0) : 0;
    const int64_t rows = std::min(config_.block_size, std::max({need, 2 * have, int64_t{256}}));
    auto [c, s] = F::rope_cache(rows, config_.head_dim(), config_.rope_base, config_.rope_scaling,
                                like.options());
    rope_cos_ = c;
    rope_sin_ = s;
  }
  return {rope_cos_.narrow(0, start, length), rope_sin_.narrow(0, start, length)};
}

KVCache GPTImpl::make_kv_cache(int64_t batch, int64_t max_seq_len) const {
  KILN_CHECK(batch > 0, "[GPT] make_kv_cache needs a positive batch, got ", batch);
  KILN_CHECK(max_seq_len > 0 && max_seq_len <= config_.block_size,
             "[GPT] make_kv_cache: max_seq_len must be in [1, block_size ", config_.block_size,
             "], got ", max_seq_len);
  const TensorOptions o = wte->weight.options();
  KVCache cache;
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    cache.k.push_back(
        kiln::zeros({batch, config_.n_query_groups, max_seq_len, config_.head_dim()}, o));
    cache.v.push_back(
        kiln::zeros({batch, config_.n_query_groups, max_seq_len, config_.head_dim()}, o));
  }
  return cache;
}

int64_t GPTImpl::num_parameters() const {
  int64_t n = 0;
  for (const Tensor& p : parameters()) n += p.numel();
  KILN_CHECK(n == config_.num_parameters(), "[GPT] the model has ", n,
             " parameters but its config counts ", config_.num_parameters());
  return n;
}

}  // namespace kiln::models
