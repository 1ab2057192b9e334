// kiln::nn::functional: layers and activations (linear, embedding, softmax,
// dropout, norms, pad, normalize), and libtorch's top-level spellings of every
// function in nn/functional.h. Losses, convolution/pooling and attention live
// in functional_{loss,conv,attention}.cpp.
#include "nn/functional.h"

#include <limits>

#include "nn/autocast.h"
#include "tensor/registry.h"

namespace kiln {
namespace nn {

std::string_view reduction_name(Reduction r) {
  switch (r) {
    case Reduction::None:
      return "none";
    case Reduction::Mean:
      return "mean";
    case Reduction::Sum:
      return "sum";
    case Reduction::BatchMean:
      return "batchmean";
  }
  return "?";
}

}  // namespace nn

namespace nn::functional {
namespace {}  // namespace

Tensor linear(const Tensor &input, const Tensor &weight, const Tensor &bias) {
  return kiln::linear(input, weight, bias);
}

Tensor embedding(const Tensor &input, const Tensor &weight, const EmbeddingFuncOptions &options) {
  KILN_CHECK(input.defined() && weight.defined(), "[embedding] input and weight must be defined");
  KILN_CHECK(weight.dim() == 2, "[embedding] 'weight' must be 2-D, got shape ",
             shape_str(weight.sizes()));
  Tensor out = kiln::embedding(weight, input);
  if (!options.padding_idx()) return out;
  const int64_t num = weight.size(0);
  int64_t pad = *options.padding_idx();
  KILN_CHECK(pad >= -num && pad < num, "[embedding] padding_idx ", pad,
             " must be within the number of embeddings ", num);
  if (pad < 0) pad += num;
  // Same values, but the padding row's lookups are cut from the graph.
  const Tensor keep = (input != Scalar(pad)).unsqueeze(-1);
  return kiln::where(keep, out, out.detach());
}

Tensor softmax(const Tensor &input, const SoftmaxFuncOptions &options) {
  return kiln::softmax(input, options.dim(), options.dtype());
}
Tensor softmax(const Tensor &input, int64_t dim, std::optional<ScalarType> dtype) {
  return kiln::softmax(input, dim, dtype);
}
Tensor log_softmax(const Tensor &input, const LogSoftmaxFuncOptions &options) {
  return kiln::log_softmax(input, options.dim(), options.dtype());
}
Tensor log_softmax(const Tensor &input, int64_t dim, std::optional<ScalarType> dtype) {
  return kiln::log_softmax(input, dim, dtype);
}

Tensor dropout(const Tensor &input, const DropoutFuncOptions &options) {
  const double p = options.p();
  KILN_CHECK(p >= 0.0 && p <= 1.0, "[dropout] probability has to be between 0 and 1, but got ", p);
  KILN_CHECK(input.defined(), "[dropout] input is undefined");
  if (!options.training() || p == 0.0) return input;
  KILN_CHECK(input.is_floating_point(), "[dropout] expected a floating-point input, got ",
             dtype_name(input.dtype()));
  Tensor scaled_mask;
  if (p == 1.0) {
    scaled_mask = zeros_like(input.detach());
  } else {
    scaled_mask = kiln::bernoulli(input.detach(), 1.0 - p).mul_(1.0 / (1.0 - p));
  }
  if (options.inplace()) {
    Tensor self = input;
    return self.mul_(scaled_mask);
  }
  return input * scaled_mask;
}

Tensor layer_norm(const Tensor &input, const LayerNormFuncOptions &options) {
  return functional::layer_norm(input, options.normalized_shape(), options.weight(), options.bias(),
                                options.eps());
}

Tensor layer_norm(const Tensor &input, IntArrayRef normalized_shape, const Tensor &weight,
                  const Tensor &bias, double eps) {
  return kiln::layer_norm(input, normalized_shape, weight, bias, eps);
}

Tensor rms_norm(const Tensor &input, const RMSNormFuncOptions &options) {
  return functional::rms_norm(input, options.normalized_shape(), options.weight(), options.eps());
}

Tensor rms_norm(const Tensor &input, IntArrayRef normalized_shape, const Tensor &weight,
                std::optional<double> eps) {
  return kiln::rms_norm(input, normalized_shape, weight, eps);
}

Tensor gelu(const Tensor &input, const GELUFuncOptions &options) {
  return kiln::gelu(input, options.approximate());
}
Tensor silu(const Tensor &input) { return kiln::silu(input); }
Tensor swiglu(const Tensor &gate, const Tensor &up) { return kiln::swiglu(gate, up); }
Tensor geglu_tanh(const Tensor &gate, const Tensor &up) { return kiln::geglu_tanh(gate, up); }
Tensor relu(const Tensor &input, bool inplace) {
  if (inplace) {
    Tensor self = input;
    return self.relu_();
  }
  return kiln::relu(input);
}

Tensor leaky_relu(const Tensor &input, const LeakyReLUFuncOptions &options) {
  KILN_CHECK(input.defined(), "[leaky_relu] input is undefined");
  KILN_CHECK(input.is_floating_point(), "[leaky_relu] expected a floating-point input, got ",
             dtype_name(input.dtype()), " with shape ", shape_str(input.sizes()));
  const double slope = options.negative_slope();
  if (options.inplace()) {
    // x * (x > 0 ? 1 : slope): the same values as the out-of-place form, written through mul_
    // so that autograd records the in-place write (the factor is computed before it).
    Tensor self = input;
    return self.mul_(kiln::where(input > Scalar(0), kiln::ones_like(input), Scalar(slope)));
  }
  return kiln::where(input > Scalar(0), input, input * slope);
}

Tensor pad(const Tensor &input, const PadFuncOptions &options) {
  KILN_CHECK(options.mode() == "constant", "[pad] mode '", options.mode(),
             "' is not supported (only 'constant')");
  return functional::pad(input, options.pad(), options.value());
}

Tensor pad(const Tensor &input, IntArrayRef pad, double value) {
  KILN_CHECK(input.defined(), "[pad] input is undefined");
  const int64_t n = static_cast<int64_t>(pad.size());
  KILN_CHECK(n % 2 == 0, "[pad] padding length must be divisible by 2, got ", n);
  KILN_CHECK(n / 2 <= input.dim(), "[pad] padding length ", n, " is too large for a ", input.dim(),
             "-D input");
  Tensor out = input;
  for (int64_t i = 0; i < n / 2; ++i) {
    const int64_t dim = input.dim() - 1 - i;
    const int64_t left = pad[2 * i], right = pad[2 * i + 1];
    const int64_t size = out.size(dim);
    KILN_CHECK(size + left + right >= 0, "[pad] padding ", shape_str(pad), " of input shape ",
               shape_str(input.sizes()), " gives a negative size in dim ", dim);
    // Negative padding crops; positive padding joins blocks of `value`.
    const int64_t start = std::min<int64_t>(std::max<int64_t>(-left, 0), size);
    const int64_t end = std::max<int64_t>(size - std::max<int64_t>(-right, 0), start);
    if (start != 0 || end != size) out = out.slice(dim, start, end);
    if (left <= 0 && right <= 0) continue;
    std::vector<Tensor> parts;
    Shape block(out.sizes().begin(), out.sizes().end());
    if (left > 0) {
      block[dim] = left;
      parts.push_back(full(block, value, out.options()));
    }
    parts.push_back(out);
    if (right > 0) {
      block[dim] = right;
      parts.push_back(full(block, value, out.options()));
    }
    out = cat(parts, dim);
  }
  return out;
}

Tensor normalize(const Tensor &input, const NormalizeFuncOptions &options) {
  KILN_CHECK(input.defined(), "[normalize] input is undefined");
  KILN_CHECK(input.is_floating_point(), "[normalize] expected a floating-point input, got ",
             dtype_name(input.dtype()));
  const int64_t dim = wrap_dim(options.dim(), input.dim(), "normalize");
  const Tensor denom = input.norm(options.p(), {dim}, /*keepdim=*/true).clamp_min(options.eps());
  return input / denom;
}

Tensor one_hot(const Tensor &tensor, int64_t num_classes) {
  return kiln::one_hot(tensor, num_classes);
}

}  // namespace nn::functional

// --- libtorch's top-level spellings
// -------------------------------------------------------------
namespace F = nn::functional;

Tensor dropout(const Tensor &input, double p, bool train) {
  return F::dropout(input, F::DropoutFuncOptions().p(p).training(train));
}

Tensor conv2d(const Tensor &input, const Tensor &weight, const Tensor &bias,
              ExpandingArray<2> stride, ExpandingArray<2> padding, ExpandingArray<2> dilation,
              int64_t groups) {
  return F::conv2d(
      input, weight,
      F::Conv2dFuncOptions().bias(bias).stride(stride).padding(padding).dilation(dilation).groups(
          groups));
}

Tensor conv_transpose2d(const Tensor &input, const Tensor &weight, const Tensor &bias,
                        ExpandingArray<2> stride, ExpandingArray<2> padding,
                        ExpandingArray<2> output_padding, int64_t groups,
                        ExpandingArray<2> dilation) {
  return F::conv_transpose2d(input, weight,
                             F::ConvTranspose2dFuncOptions()
                                 .bias(bias)
                                 .stride(stride)
                                 .padding(padding)
                                 .output_padding(output_padding)
                                 .groups(groups)
                                 .dilation(dilation));
}

Tensor conv_transpose1d(const Tensor &input, const Tensor &weight, const Tensor &bias,
                        ExpandingArray<1> stride, ExpandingArray<1> padding,
                        ExpandingArray<1> output_padding, int64_t groups,
                        ExpandingArray<1> dilation) {
  return F::conv_transpose1d(input, weight,
                             F::ConvTranspose1dFuncOptions()
                                 .bias(bias)
                                 .stride(stride)
                                 .padding(padding)
                                 .output_padding(output_padding)
                                 .groups(groups)
                                 .dilation(dilation));
}

Tensor leaky_relu(const Tensor &input, double negative_slope) {
  return F::leaky_relu(input, F::LeakyReLUFuncOptions().negative_slope(negative_slope));
}

Tensor &leaky_relu_(Tensor &input, double negative_slope) {
  F::leaky_relu(input, F::LeakyReLUFuncOptions().negative_slope(negative_slope).inplace(true));
  return input;
}

Tensor max_pool2d(const Tensor &input, ExpandingArray<2> kernel_size,
                  std::optional<ExpandingArray<2>> stride, ExpandingArray<2> padding,
                  ExpandingArray<2> dilation, bool ceil_mode) {
  return F::max_pool2d(input, F::MaxPool2dFuncOptions(kernel_size)
                                  .stride(stride.value_or(kernel_size))
                                  .padding(padding)
                                  .dilation(dilation)
                                  .ceil_mode(ceil_mode));
}

Tensor avg_pool2d(const Tensor &input, ExpandingArray<2> kernel_size,
                  std::optional<ExpandingArray<2>> stride, ExpandingArray<2> padding,
                  bool ceil_mode, bool count_include_pad, std::optional<int64_t> divisor_override) {
  return F::avg_pool2d(input, F::AvgPool2dFuncOptions(kernel_size)
                                  .stride(stride.value_or(kernel_size))
                                  .padding(padding)
                                  .ceil_mode(ceil_mode)
                                  .count_include_pad(count_include_pad)
                                  .divisor_override(divisor_override));
}

Tensor batch_norm(const Tensor &input, const Tensor &weight, const Tensor &bias,
                  const Tensor &running_mean, const Tensor &running_var, bool training,
                  double momentum, double eps) {
  return F::batch_norm(
      input, running_mean, running_var,
      F::BatchNormFuncOptions().weight(weight).bias(bias).training(training).momentum(momentum).eps(
          eps));
}

Tensor mse_loss(const Tensor &input, const Tensor &target, nn::Reduction reduction) {
  return F::mse_loss(input, target, F::MSELossFuncOptions().reduction(reduction));
}

Tensor l1_loss(const Tensor &input, const Tensor &target, nn::Reduction reduction) {
  return F::l1_loss(input, target, F::L1LossFuncOptions().reduction(reduction));
}

Tensor smooth_l1_loss(const Tensor &input, const Tensor &target, nn::Reduction reduction,
                      double beta) {
  return F::smooth_l1_loss(input, target,
                           F::SmoothL1LossFuncOptions().reduction(reduction).beta(beta));
}

Tensor nll_loss(const Tensor &input, const Tensor &target, const Tensor &weight,
                nn::Reduction reduction, int64_t ignore_index) {
  return F::nll_loss(
      input, target,
      F::NLLLossFuncOptions().weight(weight).reduction(reduction).ignore_index(ignore_index));
}

Tensor cross_entropy_loss(const Tensor &input, const Tensor &target, const Tensor &weight,
                          nn::Reduction reduction, int64_t ignore_index, double label_smoothing) {
  return F::cross_entropy(input, target,
                          F::CrossEntropyFuncOptions()
                              .weight(weight)
                              .reduction(reduction)
                              .ignore_index(ignore_index)
                              .label_smoothing(label_smoothing));
}

Tensor binary_cross_entropy(const Tensor &input, const Tensor &target, const Tensor &weight,
                            nn::Reduction reduction) {
  return F::binary_cross_entropy(
      input, target, F::BinaryCrossEntropyFuncOptions().weight(weight).reduction(reduction));
}

Tensor binary_cross_entropy_with_logits(const Tensor &input, const Tensor &target,
                                        const Tensor &weight, const Tensor &pos_weight,
                                        nn::Reduction reduction) {
  return F::binary_cross_entropy_with_logits(input, target,
                                             F::BinaryCrossEntropyWithLogitsFuncOptions()
                                                 .weight(weight)
                                                 .pos_weight(pos_weight)
                                                 .reduction(reduction));
}

Tensor kl_div(const Tensor &input, const Tensor &target, nn::Reduction reduction, bool log_target) {
  return F::kl_div(input, target,
                   F::KLDivFuncOptions().reduction(reduction).log_target(log_target));
}

Tensor scaled_dot_product_attention(const Tensor &query, const Tensor &key, const Tensor &value,
                                    const Tensor &attn_mask, double dropout_p, bool is_causal,
                                    std::optional<double> scale, bool enable_gqa) {
  return F::scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                         enable_gqa);
}

}  // namespace kiln
