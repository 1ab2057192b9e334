#include "models/generate.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "autograd/grad_mode.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/random.h"

namespace kiln::models {
namespace {

// With a seed, switches the global generator to the stream (seed, offset 0) and restores the
// previous state on scope exit; without, leaves the global stream to be drawn from.
class ScopedRngStream {
 public:
  explicit ScopedRngStream(const std::optional<uint64_t>& seed) {
    if (seed) {
      saved_ = get_rng_state();
      set_rng_state(RngState{*seed, 0});
    }
  }
  ~ScopedRngStream() {
    if (saved_) set_rng_state(*saved_);
  }
  ScopedRngStream(const ScopedRngStream&) = delete;
  ScopedRngStream& operator=(const ScopedRngStream&) = delete;

 private:
  std::optional<RngState> saved_;
};

// The filtered distribution of one row: probabilities over the row's V entries.
void filtered_probs(const float* logits, int64_t v, const GenerateOptions& o, float* out) {
  std::vector<double> z(v);
  for (int64_t i = 0; i < v; ++i) z[i] = static_cast<double>(logits[i]) / o.temperature;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  if (o.top_k > 0 && o.top_k < v) {
    std::vector<double> sorted = z;
    std::nth_element(sorted.begin(), sorted.begin() + (o.top_k - 1), sorted.end(),
                     std::greater<double>());
    const double kth = sorted[o.top_k - 1];
    for (double& x : z) {
      if (x < kth) x = neg_inf;
    }
  }
  const double mx = *std::max_element(z.begin(), z.end());
  KILN_CHECK(mx > neg_inf, "[generate] every logit of a row is -inf: nothing to sample");
  std::vector<double> p(v);
  double sum = 0;
  for (int64_t i = 0; i < v; ++i) sum += p[i] = std::exp(z[i] - mx);
  for (double& x : p) x /= sum;
  if (o.top_p < 1.0) {
    std::vector<int64_t> order(v);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
    double before = 0;  // the mass of the tokens ranked above this one
    for (int64_t r = 0; r < v; ++r) {
      const int64_t i = order[r];
      const double pi = p[i];
      if (r > 0 && before >= o.top_p) p[i] = 0;
      before += pi;
    }
  }
  for (int64_t i = 0; i < v; ++i) out[i] = static_cast<float>(p[i]);
}

// Samples from the global stream (the caller has set it up).
Tensor sample_impl(const Tensor& logits, const GenerateOptions& o) {
  KILN_CHECK(logits.defined() && logits.dim() == 2 && logits.size(1) > 0,
             "[generate] logits must be [batch, vocab], got ",
             logits.defined() ? shape_str(logits.sizes()) : std::string("undefined"));
  KILN_CHECK(is_floating_point(logits.dtype()), "[generate] logits must be floating point, got ",
             dtype_name(logits.dtype()));
  const Tensor l = logits.to(Device(kCPU), kFloat).contiguous();
  const int64_t b = l.size(0), v = l.size(1);
  const float* pl = l.data_ptr<float>();
  for (int64_t i = 0; i < b * v; ++i) {
    KILN_CHECK(!std::isnan(pl[i]), "[generate] the logits contain NaN (row ", i / v, ")");
  }
  Tensor next = empty({b}, kInt64);
  int64_t* pn = next.data_ptr<int64_t>();
  if (o.temperature == 0.0) {
    for (int64_t r = 0; r < b; ++r) {
      const float* row = pl + r * v;
      pn[r] = std::max_element(row, row + v) - row;  // the first maximum
    }
  } else {
    Tensor probs = empty({b, v}, kFloat);
    float* pp = probs.data_ptr<float>();
    for (int64_t r = 0; r < b; ++r) filtered_probs(pl + r * v, v, o, pp + r * v);
    next = multinomial(probs, 1, /*replacement=*/true).reshape({b});
  }
  return logits.is_cpu() ? next : next.to(logits.device());
}

}  // namespace

void GenerateOptions::validate() const {
  KILN_CHECK(max_new_tokens >= 0, "[generate] max_new_tokens must be >= 0, got ", max_new_tokens);
  KILN_CHECK(std::isfinite(temperature) && temperature >= 0.0,
             "[generate] temperature must be finite and >= 0 (0 = greedy), got ", temperature);
  // logits / temperature overflows to inf for a tiny one (inf - inf = NaN in the softmax); far
  // above that, sampling is already greedy in effect.
  KILN_CHECK(temperature == 0.0 || temperature >= kMinTemperature, "[generate] temperature ",
             temperature, " is below ", kMinTemperature, ": use 0 for greedy decoding");
  KILN_CHECK(top_k >= 0, "[generate] top_k must be >= 0 (0 = off), got ", top_k);
  KILN_CHECK(top_p > 0.0 && top_p <= 1.0, "[generate] top_p must be in (0, 1] (1 = off), got ",
             top_p);
}

Tensor sample_next_token(const Tensor& logits, const GenerateOptions& options) {
  options.validate();
  ScopedRngStream stream(options.seed);
  return sample_impl(logits, options);
}

std::vector<int64_t> generate(GPTImpl& model, const std::vector<int64_t>& prompt,
                              const GenerateOptions& options) {
  options.validate();
  const ModelConfig& cfg = model.config();
  KILN_CHECK(!prompt.empty(), "[generate] the prompt is empty: give at least one token");
  KILN_CHECK(static_cast<int64_t>(prompt.size()) <= cfg.block_size, "[generate] the prompt has ",
             prompt.size(), " tokens, more than the model's block_size ", cfg.block_size);
  for (size_t i = 0; i < prompt.size(); ++i) {
    KILN_CHECK(prompt[i] >= 0 && prompt[i] < cfg.vocab_size, "[generate] prompt token ", prompt[i],
               " at position ", i, " is outside the vocabulary [0, ", cfg.vocab_size, ")");
  }
  NoGradGuard no_grad;
  ScopedRngStream stream(options.seed);
  const Device device = model.parameters().front().device();
  const auto prompt_len = static_cast<int64_t>(prompt.size());
  // prompt_len + max_new_tokens may overflow int64: compare with what is left instead.
  const int64_t total = options.max_new_tokens >= cfg.block_size - prompt_len
                            ? cfg.block_size
                            : prompt_len + options.max_new_tokens;
  std::vector<int64_t> out = prompt;
  if (total == prompt_len) return out;

  auto as_input = [&](const int64_t* ids, int64_t n) {
    Tensor t = empty({1, n}, kInt64);
    std::copy(ids, ids + n, t.data_ptr<int64_t>());
    return device.is_cpu() ? t : t.to(device);
  };
  // The last position's logits over the real vocabulary: [1, vocab_size].
  auto last_logits = [&](const Tensor& logits) {
    const int64_t t = logits.size(1);
    return logits.select(1, t - 1).narrow(1, 0, cfg.vocab_size);
  };

  KVCache cache;
  Tensor logits;
  if (options.use_kv_cache) {
    cache = model.make_kv_cache(1, total);
    logits = last_logits(model.forward(as_input(out.data(), prompt_len), cache));
  } else {
    logits = last_logits(model.forward(as_input(out.data(), prompt_len)));
  }
  while (true) {
    const int64_t next = sample_impl(logits, options).cpu().item<int64_t>();
    out.push_back(next);
    const bool stop = std::find(options.stop_tokens.begin(), options.stop_tokens.end(), next) !=
                      options.stop_tokens.end();
    if (stop || static_cast<int64_t>(out.size()) >= total) break;
    if (options.use_kv_cache) {
      logits = last_logits(model.forward(as_input(&next, 1), cache));
    } else {
      logits = last_logits(model.forward(as_input(out.data(), static_cast<int64_t>(out.size()))));
    }
  }
  return out;
}

}  // namespace kiln::models
