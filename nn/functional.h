// kiln::nn::functional: the stateless building blocks of layers and losses, as
// libtorch's torch::nn::functional (users write `namespace F =
// kiln::nn::functional;`).
//
//   auto h = F::relu(F::linear(x, w1, b1));
//   h = F::dropout(h, F::DropoutFuncOptions().p(0.5).training(is_training()));
//   auto loss = F::cross_entropy(F::linear(h, w2), labels,
//                                F::CrossEntropyFuncOptions().label_smoothing(0.1));
//   auto y = F::scaled_dot_product_attention(q, k, v, {}, 0.0,
//   /*is_causal=*/true);
//
// Everything here is a composition of registry ops (matmul, softmax,
// index_select, cat, ...), so autograd differentiates it and the compiler
// traces it without extra rules. The attention and RoPE functions are the
// reference that the fused CUDA kernels are checked against: they compute the
// softmax in f32 for f16/bf16 inputs and favour clarity over speed.
//
// The top-level spellings libtorch has (kiln::mse_loss, kiln::conv2d,
// kiln::dropout, ...) are declared at the end, as thin wrappers. Misuse throws
// kiln::Error with "[function]" first.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "tensor/ops.h"

// Declares an option `name` of type T with a fluent setter `name(value)`
// returning *this and a getter `name()`, as libtorch's TORCH_ARG.
#ifndef KILN_ARG
#define KILN_ARG(T, name)                                         \
 public:                                                          \
  inline auto name(const T &new_##name)->decltype(*this) {        \
    this->name##_ = new_##name;                                   \
    return *this;                                                 \
  }                                                               \
  inline auto name(T &&new_##name)->decltype(*this) {             \
    this->name##_ = std::move(new_##name);                        \
    return *this;                                                 \
  }                                                               \
  inline const T &name() const noexcept { return this->name##_; } \
  inline T &name() noexcept { return this->name##_; }             \
                                                                  \
 private:                                                         \
  T name##_
#endif

namespace kiln {

// D integers given as one value (repeated) or as exactly D values: `3`, `{3,
// 5}`.
template <size_t D, typename T = int64_t>
class ExpandingArray {
 public:
  ExpandingArray(T value) { values_.fill(value); }  // NOLINT: implicit, as libtorch's
  ExpandingArray(std::initializer_list<T> list) {
    KILN_CHECK(list.size() == D, "[ExpandingArray] expected ", D, " values, got ", list.size());
    std::copy(list.begin(), list.end(), values_.begin());
  }
  ExpandingArray(const std::vector<T> &list) {  // NOLINT
    KILN_CHECK(list.size() == D, "[ExpandingArray] expected ", D, " values, got ", list.size());
    std::copy(list.begin(), list.end(), values_.begin());
  }
  ExpandingArray(const std::array<T, D> &values) : values_(values) {}  // NOLINT
  T &operator[](size_t i) { return values_[i]; }
  const T &operator[](size_t i) const { return values_[i]; }
  static constexpr size_t size() { return D; }
  const T *data() const { return values_.data(); }
  const std::array<T, D> &operator*() const { return values_; }
  std::vector<T> vec() const { return std::vector<T>(values_.begin(), values_.end()); }
  bool operator==(const ExpandingArray &) const = default;

 private:
  std::array<T, D> values_{};
};

namespace nn {

// How a loss reduces its elementwise values. BatchMean (sum / batch size) is
// kl_div's only.
enum class Reduction { None, Mean, Sum, BatchMean };
std::string_view reduction_name(Reduction r);

}  // namespace nn

// libtorch's spellings: `.reduction(kiln::kSum)`.
inline constexpr nn::Reduction kNone = nn::Reduction::None;
inline constexpr nn::Reduction kMean = nn::Reduction::Mean;
inline constexpr nn::Reduction kSum = nn::Reduction::Sum;
inline constexpr nn::Reduction kBatchMean = nn::Reduction::BatchMean;
// kiln::Reduction::Sum, as libtorch's torch::Reduction::Sum.
using nn::Reduction;

namespace nn::functional {

// ================================ Layers and activations
// =====================================

// y = x W^T + b, W of shape [out, in].
Tensor linear(const Tensor &input, const Tensor &weight, const Tensor &bias = {});

struct EmbeddingFuncOptions {
  // Row padding_idx (negative counts from the end) is looked up but gets no
  // gradient.
  KILN_ARG(std::optional<int64_t>, padding_idx) = std::nullopt;
};
// Rows of weight [num, dim] picked by integer `input` (any shape):
// [*input.shape, dim].
Tensor embedding(const Tensor &input, const Tensor &weight,
                 const EmbeddingFuncOptions &options = {});

struct SoftmaxFuncOptions {
  SoftmaxFuncOptions(int64_t dim) : dim_(dim) {}  // NOLINT
  KILN_ARG(int64_t, dim);
  KILN_ARG(std::optional<ScalarType>, dtype) = std::nullopt;
};
using LogSoftmaxFuncOptions = SoftmaxFuncOptions;
using SoftminFuncOptions = SoftmaxFuncOptions;
Tensor softmax(const Tensor &input, const SoftmaxFuncOptions &options);
Tensor softmax(const Tensor &input, int64_t dim, std::optional<ScalarType> dtype = std::nullopt);
Tensor log_softmax(const Tensor &input, const LogSoftmaxFuncOptions &options);
Tensor log_softmax(const Tensor &input, int64_t dim,
                   std::optional<ScalarType> dtype = std::nullopt);

struct DropoutFuncOptions {
  KILN_ARG(double, p) = 0.5;
  KILN_ARG(bool, training) = true;
  KILN_ARG(bool, inplace) = false;
};
// Zeroes each element with probability p and scales the rest by 1/(1-p) when
// training; the identity otherwise.
Tensor dropout(const Tensor &input, const DropoutFuncOptions &options = {});

struct LayerNormFuncOptions {
  LayerNormFuncOptions(std::vector<int64_t> normalized_shape)  // NOLINT
      : normalized_shape_(std::move(normalized_shape)) {}
  KILN_ARG(std::vector<int64_t>, normalized_shape);
  KILN_ARG(Tensor, weight) = {};
  KILN_ARG(Tensor, bias) = {};
  KILN_ARG(double, eps) = 1e-5;
};
// Normalises over the trailing dims `normalized_shape` (biased variance), then
// * weight + bias: the layer_norm op (tensor/ops/norm.cpp). f16/bf16 inputs are
// computed in f32 and returned in their dtype.
Tensor layer_norm(const Tensor &input, const LayerNormFuncOptions &options);
Tensor layer_norm(const Tensor &input, IntArrayRef normalized_shape, const Tensor &weight = {},
                  const Tensor &bias = {}, double eps = 1e-5);

struct RMSNormFuncOptions {
  RMSNormFuncOptions(std::vector<int64_t> normalized_shape)  // NOLINT
      : normalized_shape_(std::move(normalized_shape)) {}
  KILN_ARG(std::vector<int64_t>, normalized_shape);
  KILN_ARG(Tensor, weight) = {};
  // nullopt: the machine epsilon of the input's dtype, as PyTorch.
  KILN_ARG(std::optional<double>, eps) = std::nullopt;
};
// x * rsqrt(mean(x^2 over normalized_shape) + eps) * weight: the rms_norm op
// (tensor/ops/norm.cpp), computed in f32 for f16/bf16 and returned in the
// input's dtype.
Tensor rms_norm(const Tensor &input, const RMSNormFuncOptions &options);
Tensor rms_norm(const Tensor &input, IntArrayRef normalized_shape, const Tensor &weight = {},
                std::optional<double> eps = std::nullopt);

struct GELUFuncOptions {
  KILN_ARG(std::string, approximate) = "none";  // "none" (erf) or "tanh"
};
Tensor gelu(const Tensor &input, const GELUFuncOptions &options = {});
Tensor silu(const Tensor &input);
// The gated MLP activations, fused (kiln::swiglu / kiln::geglu_tanh): silu(gate)
// * up (Llama) and gelu(gate, "tanh") * up (Gemma), gate and up of one shape.
Tensor swiglu(const Tensor &gate, const Tensor &up);
Tensor geglu_tanh(const Tensor &gate, const Tensor &up);
Tensor relu(const Tensor &input, bool inplace = false);

struct LeakyReLUFuncOptions {
  KILN_ARG(double, negative_slope) = 1e-2;
  KILN_ARG(bool, inplace) = false;
};
// x where x > 0, negative_slope * x elsewhere (the gradient at 0 is negative_slope, as
// PyTorch's). inplace writes the result into input and returns it.
Tensor leaky_relu(const Tensor &input, const LeakyReLUFuncOptions &options = {});

struct PadFuncOptions {
  PadFuncOptions(std::vector<int64_t> pad) : pad_(std::move(pad)) {}  // NOLINT
  // (left, right) pairs starting from the last dim, as PyTorch; negative values
  // crop.
  KILN_ARG(std::vector<int64_t>, pad);
  KILN_ARG(std::string, mode) = "constant";  // only "constant" is supported
  KILN_ARG(double, value) = 0;
};
Tensor pad(const Tensor &input, const PadFuncOptions &options);
Tensor pad(const Tensor &input, IntArrayRef pad, double value = 0);

struct NormalizeFuncOptions {
  KILN_ARG(double, p) = 2.0;
  KILN_ARG(int64_t, dim) = 1;
  KILN_ARG(double, eps) = 1e-12;
};
// x / max(||x||_p over dim, eps).
Tensor normalize(const Tensor &input, const NormalizeFuncOptions &options = {});

// int64 indices in [0, num_classes) -> int64 one-hot rows; num_classes -1
// infers max + 1.
Tensor one_hot(const Tensor &tensor, int64_t num_classes = -1);

// ================================ Convolution, pooling, batch norm
// =========================== Inputs are [N, C, H, W] or unbatched [C, H, W].

struct Conv2dFuncOptions {
  KILN_ARG(Tensor, bias) = {};
  KILN_ARG(ExpandingArray<2>, stride) = 1;
  KILN_ARG(ExpandingArray<2>, padding) = 0;  // zeros on both sides
  KILN_ARG(ExpandingArray<2>, dilation) = 1;
  KILN_ARG(int64_t, groups) = 1;
};
// weight [out, in / groups, kh, kw] (cross-correlation, as PyTorch).
Tensor conv2d(const Tensor &input, const Tensor &weight, const Conv2dFuncOptions &options = {});

// Transposed convolution ("deconvolution"), the adjoint of conv2d with the same stride,
// padding, dilation and groups: weight [in, out / groups, kh, kw] (PyTorch's layout), output
// size (in - 1) * stride - 2 * padding + dilation * (k - 1) + output_padding + 1.
// output_padding (each < stride or < dilation, as PyTorch) adds rows/columns at the end.
struct ConvTranspose2dFuncOptions {
  KILN_ARG(Tensor, bias) = {};
  KILN_ARG(ExpandingArray<2>, stride) = 1;
  KILN_ARG(ExpandingArray<2>, padding) = 0;
  KILN_ARG(ExpandingArray<2>, output_padding) = 0;
  KILN_ARG(int64_t, groups) = 1;
  KILN_ARG(ExpandingArray<2>, dilation) = 1;
};
// input [N, C_in, H, W] or [C_in, H, W].
Tensor conv_transpose2d(const Tensor &input, const Tensor &weight,
                        const ConvTranspose2dFuncOptions &options = {});

struct ConvTranspose1dFuncOptions {
  KILN_ARG(Tensor, bias) = {};
  KILN_ARG(ExpandingArray<1>, stride) = 1;
  KILN_ARG(ExpandingArray<1>, padding) = 0;
  KILN_ARG(ExpandingArray<1>, output_padding) = 0;
  KILN_ARG(int64_t, groups) = 1;
  KILN_ARG(ExpandingArray<1>, dilation) = 1;
};
// input [N, C_in, L] or [C_in, L]; weight [in, out / groups, k]: conv_transpose2d over a
// height of 1.
Tensor conv_transpose1d(const Tensor &input, const Tensor &weight,
                        const ConvTranspose1dFuncOptions &options = {});

struct MaxPool2dFuncOptions {
  MaxPool2dFuncOptions(ExpandingArray<2> kernel_size)  // NOLINT
      : kernel_size_(kernel_size), stride_(kernel_size) {}
  KILN_ARG(ExpandingArray<2>, kernel_size);
  KILN_ARG(ExpandingArray<2>, stride);  // defaults to kernel_size
  KILN_ARG(ExpandingArray<2>,
           padding) = 0;  // implicit -inf, at most half the kernel
  KILN_ARG(ExpandingArray<2>, dilation) = 1;
  KILN_ARG(bool, ceil_mode) = false;
};
// The gradient goes to one maximum of each window (the first, in row-major
// order).
Tensor max_pool2d(const Tensor &input, const MaxPool2dFuncOptions &options);
// (values, flat indices into each input plane of H * W), as
// max_pool2d_with_indices.
std::tuple<Tensor, Tensor> max_pool2d_with_indices(const Tensor &input,
                                                   const MaxPool2dFuncOptions &options);

struct AvgPool2dFuncOptions {
  AvgPool2dFuncOptions(ExpandingArray<2> kernel_size)  // NOLINT
      : kernel_size_(kernel_size), stride_(kernel_size) {}
  KILN_ARG(ExpandingArray<2>, kernel_size);
  KILN_ARG(ExpandingArray<2>, stride);  // defaults to kernel_size
  KILN_ARG(ExpandingArray<2>, padding) = 0;
  KILN_ARG(bool, ceil_mode) = false;
  KILN_ARG(bool, count_include_pad) = true;
  KILN_ARG(std::optional<int64_t>, divisor_override) = std::nullopt;
};
Tensor avg_pool2d(const Tensor &input, const AvgPool2dFuncOptions &options);

struct BatchNormFuncOptions {
  KILN_ARG(Tensor, weight) = {};
  KILN_ARG(Tensor, bias) = {};
  KILN_ARG(bool, training) = false;
  // running = (1 - momentum) * running + momentum * batch statistic (unbiased
  // variance).
  KILN_ARG(double, momentum) = 0.1;
  KILN_ARG(double, eps) = 1e-5;
};
// Input [N, C, *]. Training normalises with the batch statistics over all dims
// but 1 and updates running_mean/var in place (when defined); eval uses the
// running statistics.
Tensor batch_norm(const Tensor &input, const Tensor &running_mean, const Tensor &running_var,
                  const BatchNormFuncOptions &options = {});

// ================================ Losses
// ===================================================== input/target shapes as
// PyTorch; reduction Mean unless set.

struct MSELossFuncOptions {
  KILN_ARG(nn::Reduction, reduction) = nn::Reduction::Mean;
};
Tensor mse_loss(const Tensor &input, const Tensor &target, const MSELossFuncOptions &options = {});

struct L1LossFuncOptions {
  KILN_ARG(nn::Reduction, reduction) = nn::Reduction::Mean;
};
Tensor l1_loss(const Tensor &input, const Tensor &target, const L1LossFuncOptions &options = {});

struct SmoothL1LossFuncOptions {
  KILN_ARG(nn::Reduction, reduction) = nn::Reduction::Mean;
  KILN_ARG(double, beta) = 1.0;  // 0 gives l1_loss
};
// 0.5 d^2 / beta where |d| < beta, |d| - 0.5 beta elsewhere.
Tensor smooth_l1_loss(const Tensor &input, const Tensor &target,
                      const SmoothL1LossFuncOptions &options = {});

struct NLLLossFuncOptions {
  KILN_ARG(Tensor, weight) = {};  // per class, [C]
  KILN_ARG(int64_t, ignore_index) = -100;
  KILN_ARG(nn::Reduction, reduction) = nn::Reduction::Mean;
};
// input: log-probabilities [N, C] / [N, C, d1, ...] / [C]; target: class
// indices [N] / [N, d1, ...] / []. Mean divides by the summed weights of the
// non-ignored targets.
Tensor nll_loss(const Tensor &input, const Tensor &target, const NLLLossFuncOptions &options = {});

struct CrossEntropyFuncOptions {
  KILN_ARG(Tensor, weight) = {};
  KILN_ARG(int64_t, ignore_index) = -100;
  KILN_ARG(nn::Reduction, reduction) = nn::Reduction::Mean;
  KILN_ARG(double, label_smoothing) = 0.0;
};
// input: logits [N, C] / [N, C, d1, ...] / [C]; target: class indices (integer,
// as nll_loss) or class probabilities (floating, same shape as input). The
// softmax is over dim 1 (dim 0 for unbatched input).
Tensor cross_entropy(const Tensor &input, const Tensor &target,
                     const CrossEntropyFuncOptions &options = {});

struct BinaryCrossEntropyFuncOptions {
  KILN_ARG(Tensor, weight) = {};  // broadcast to input
  KILN_ARG(nn::Reduction, reduction) = nn::Reduction::Mean;
};
// input: probabilities in [0, 1]; log terms are clamped at -100, as PyTorch.
Tensor binary_cross_entropy(const Tensor &input, const Tensor &target,
                            const BinaryCrossEntropyFuncOptions &options = {});

struct BinaryCrossEntropyWithLogitsFuncOptions {
  KILN_ARG(Tensor, weight) = {};
  KILN_ARG(nn::Reduction, reduction) = nn::Reduction::Mean;
  KILN_ARG(Tensor, pos_weight) = {};  // weight of positive examples, broadcast over classes
};
// Numerically stable: uses log(sigmoid(x)) = -softplus(-x) without forming
// sigmoid(x).
Tensor binary_cross_entropy_with_logits(
    const Tensor &input, const Tensor &target,
    const BinaryCrossEntropyWithLogitsFuncOptions &options = {});

struct KLDivFuncOptions {
  KILN_ARG(nn::Reduction,
           reduction) = nn::Reduction::Mean;  // BatchMean is the true KL
  KILN_ARG(bool, log_target) = false;
};
// input: log-probabilities; target: probabilities (log-probabilities when
// log_target). Pointwise target * (log target - input), 0 where target is 0.
Tensor kl_div(const Tensor &input, const Tensor &target, const KLDivFuncOptions &options = {});

// ================================ Attention and rotary embeddings
// ============================

// softmax(q k^T * scale + mask) v over the last two dims, as
// torch.nn.functional.scaled_dot_product_attention:
//   query [..., H, T, D], key [..., H_kv, S, D], value [..., H_kv, S, Dv] ->
//   [..., H, T, Dv]. attn_mask: bool (true = attend) or floating (added to the
//   scores), broadcastable to
//     [..., H, T, S].
//   is_causal: query i attends keys j <= i (top-left aligned when T != S, as
//   PyTorch). scale: defaults to 1/sqrt(D). enable_gqa: H may be a multiple of
//   H_kv; query head h uses kv head h / (H / H_kv). sliding_window (kiln, 0 =
//   off): query i attends keys j with i - window < j <= i
//     (implies the causal bound).
//   softcap (kiln, 0 = off): scores = tanh(scores / softcap) * softcap before
//   masking.
// Rows whose keys are all masked give zeros (as PyTorch's math backend), not
// NaN. Dropout with probability dropout_p applies to the attention weights
// whenever it is > 0.
Tensor scaled_dot_product_attention(const Tensor &query, const Tensor &key, const Tensor &value,
                                    const Tensor &attn_mask = {}, double dropout_p = 0.0,
                                    bool is_causal = false,
                                    std::optional<double> scale = std::nullopt,
                                    bool enable_gqa = false, int64_t sliding_window = 0,
                                    double softcap = 0.0);

// Llama 3 ("llama3" rope_type) frequency scaling: wavelengths above
// original_max_seq_len / low_freq_factor are divided by factor, those below
// original_max_seq_len / high_freq_factor are kept, those between are
// interpolated.
struct RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_seq_len = 8192;
};

// (cos, sin), each [seq_len, head_size] in the rotate-half layout: angle(t, i)
// = t * theta_i with theta_i = base^(-2i / head_size) for i < head_size / 2,
// repeated for the second half. Computed in f64 and converted to options' dtype
// (default float32).
std::tuple<Tensor, Tensor> rope_cache(int64_t seq_len, int64_t head_size, double base = 10000.0,
                                      std::optional<RopeScaling> scaling = std::nullopt,
                                      const TensorOptions &options = {});

// x * cos + cat(-x2, x1) * sin where x1, x2 are the halves of the last dim of x
// [..., T, D]; cos/sin broadcast to x (e.g. [T, D] from rope_cache, sliced to
// the positions of x). When cos/sin are [T, D] (leading size-1 dims allowed) of
// x's dtype, or f32 for a f16/bf16 x, this is the fused kiln::rotary_emb (x read
// in place through its strides, f32 arithmetic); otherwise plain ops.
Tensor apply_rotary_emb(const Tensor &x, const Tensor &cos, const Tensor &sin);
// apply_rotary_emb of q and of k; one fused launch for both (kiln::rotary_emb_qk)
// when both fit the fused op.
std::tuple<Tensor, Tensor> apply_rotary_emb_qk(const Tensor &q, const Tensor &k, const Tensor &cos,
                                               const Tensor &sin);

}  // namespace nn::functional

// ================================ libtorch's top-level spellings
// =============================

Tensor dropout(const Tensor &input, double p, bool train);
Tensor conv2d(const Tensor &input, const Tensor &weight, const Tensor &bias = {},
              ExpandingArray<2> stride = 1, ExpandingArray<2> padding = 0,
              ExpandingArray<2> dilation = 1, int64_t groups = 1);
Tensor conv_transpose2d(const Tensor &input, const Tensor &weight, const Tensor &bias = {},
                        ExpandingArray<2> stride = 1, ExpandingArray<2> padding = 0,
                        ExpandingArray<2> output_padding = 0, int64_t groups = 1,
                        ExpandingArray<2> dilation = 1);
Tensor conv_transpose1d(const Tensor &input, const Tensor &weight, const Tensor &bias = {},
                        ExpandingArray<1> stride = 1, ExpandingArray<1> padding = 0,
                        ExpandingArray<1> output_padding = 0, int64_t groups = 1,
                        ExpandingArray<1> dilation = 1);
Tensor leaky_relu(const Tensor &input, double negative_slope = 1e-2);
Tensor &leaky_relu_(Tensor &input, double negative_slope = 1e-2);
Tensor max_pool2d(const Tensor &input, ExpandingArray<2> kernel_size,
                  std::optional<ExpandingArray<2>> stride = std::nullopt,
                  ExpandingArray<2> padding = 0, ExpandingArray<2> dilation = 1,
                  bool ceil_mode = false);
Tensor avg_pool2d(const Tensor &input, ExpandingArray<2> kernel_size,
                  std::optional<ExpandingArray<2>> stride = std::nullopt,
                  ExpandingArray<2> padding = 0, bool ceil_mode = false,
                  bool count_include_pad = true,
                  std::optional<int64_t> divisor_override = std::nullopt);
Tensor batch_norm(const Tensor &input, const Tensor &weight, const Tensor &bias,
                  const Tensor &running_mean, const Tensor &running_var, bool training,
                  double momentum, double eps);
// kiln::layer_norm and kiln::rms_norm with a normalized_shape are the ops'
// own wrappers (tensor/ops.h).
Tensor mse_loss(const Tensor &input, const Tensor &target, nn::Reduction reduction = kMean);
Tensor l1_loss(const Tensor &input, const Tensor &target, nn::Reduction reduction = kMean);
Tensor smooth_l1_loss(const Tensor &input, const Tensor &target, nn::Reduction reduction = kMean,
                      double beta = 1.0);
Tensor nll_loss(const Tensor &input, const Tensor &target, const Tensor &weight = {},
                nn::Reduction reduction = kMean, int64_t ignore_index = -100);
Tensor cross_entropy_loss(const Tensor &input, const Tensor &target, const Tensor &weight = {},
                          nn::Reduction reduction = kMean, int64_t ignore_index = -100,
                          double label_smoothing = 0.0);
Tensor binary_cross_entropy(const Tensor &input, const Tensor &target, const Tensor &weight = {},
                            nn::Reduction reduction = kMean);
Tensor binary_cross_entropy_with_logits(const Tensor &input, const Tensor &target,
                                        const Tensor &weight = {}, const Tensor &pos_weight = {},
                                        nn::Reduction reduction = kMean);
Tensor kl_div(const Tensor &input, const Tensor &target, nn::Reduction reduction = kMean,
              bool log_target = false);
Tensor scaled_dot_product_attention(const Tensor &query, const Tensor &key, const Tensor &value,
                                    const Tensor &attn_mask = {}, double dropout_p = 0.0,
                                    bool is_causal = false,
                                    std::optional<double> scale = std::nullopt,
                                    bool enable_gqa = false);

}  // namespace kiln
