// ConvTranspose1d and ConvTranspose2d (the functions: nn/functional_conv.cpp).
#include "nn/modules/conv_transpose.h"

#include <cmath>

#include "nn/init.h"
#include "tensor/ops.h"

namespace kiln::nn {

namespace {

template <size_t D>
std::ostream& operator<<(std::ostream& stream, const ExpandingArray<D>& a) {
  stream << "[";
  for (size_t i = 0; i < D; ++i) stream << (i ? ", " : "") << a[i];
  return stream << "]";
}

template <size_t D>
const char* class_name() {
  return D == 1 ? "ConvTranspose1d" : "ConvTranspose2d";
}

}  // namespace

template <size_t D>
ConvTransposeImplBase<D>::ConvTransposeImplBase(const ConvTransposeOptions<D>& options_)
    : options(options_) {
  const char* name = class_name<D>();
  const int64_t in = options.in_channels(), out = options.out_channels(), g = options.groups();
  KILN_CHECK(g > 0, "[", name, "] groups must be positive, got ", g);
  KILN_CHECK(in > 0 && out > 0, "[", name, "] in_channels and out_channels must be positive, got ",
             in, " and ", out);
  KILN_CHECK(in % g == 0 && out % g == 0, "[", name, "] in_channels (", in, ") and out_channels (",
             out, ") must be divisible by groups (", g, ")");
  Shape shape{in, out / g};
  for (size_t i = 0; i < D; ++i) {
    const int64_t k = options.kernel_size()[i], s = options.stride()[i], p = options.padding()[i],
                  d = options.dilation()[i], op = options.output_padding()[i];
    KILN_CHECK(k > 0, "[", name, "] kernel_size must be positive, got ",
               shape_str(options.kernel_size().vec()));
    KILN_CHECK(s > 0 && d > 0 && p >= 0, "[", name,
               "] stride and dilation must be positive and padding non-negative, got stride ",
               shape_str(options.stride().vec()), ", dilation ",
               shape_str(options.dilation().vec()), ", padding ",
               shape_str(options.padding().vec()));
    KILN_CHECK(op >= 0 && (op < s || op < d), "[", name,
               "] output_padding must be non-negative and smaller than either stride or "
               "dilation, got output_padding ",
               shape_str(options.output_padding().vec()), ", stride ",
               shape_str(options.stride().vec()), ", dilation ",
               shape_str(options.dilation().vec()));
    shape.push_back(k);
  }
  weight = register_parameter("weight", kiln::empty(shape));
  bias = options.bias() ? register_parameter("bias", kiln::empty({out}))
                        : register_parameter("bias", Tensor(), /*requires_grad=*/false);
  reset_parameters();
}

template <size_t D>
void ConvTransposeImplBase<D>::reset_parameters() {
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    const auto [fan_in, fan_out] = init::calculate_fan_in_and_fan_out(weight);
    const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    init::uniform_(bias, -bound, bound);
  }
}

template <size_t D>
ExpandingArray<D> ConvTransposeImplBase<D>::output_padding_for(
    const Tensor& input, const std::optional<std::vector<int64_t>>& output_size,
    const char* name) const {
  if (!output_size) return options.output_padding();
  KILN_CHECK(input.defined() && (input.dim() == D + 1 || input.dim() == D + 2), "[", name,
             "] expected a ", D + 1, "-D (unbatched) or ", D + 2, "-D (batched) input, got ",
             input.defined() ? shape_str(input.sizes()) : std::string("undefined"));
  std::vector<int64_t> size = *output_size;
  const size_t given = size.size();
  if (given == D + 2) size.erase(size.begin(), size.begin() + 2);
  KILN_CHECK(size.size() == D, "[", name, "] output_size must have ", D, " or ", D + 2,
             " elements, got ", given);
  ExpandingArray<D> result(0);
  for (size_t i = 0; i < D; ++i) {
    const int64_t in = input.size(input.dim() - static_cast<int64_t>(D) + static_cast<int64_t>(i));
    const int64_t s = options.stride()[i];
    const int64_t min_size = (in - 1) * s - 2 * options.padding()[i] +
                             options.dilation()[i] * (options.kernel_size()[i] - 1) + 1;
    const int64_t max_size = min_size + s - 1;
    KILN_CHECK(size[i] >= min_size && size[i] <= max_size, "[", name, "] requested an output size ",
               shape_str(size), ", but valid sizes of dim ", i, " range from ", min_size, " to ",
               max_size, " for an input of shape ", shape_str(input.sizes()));
    result[i] = size[i] - min_size;
  }
  return result;
}

template <size_t D>
void ConvTransposeImplBase<D>::pretty_print(std::ostream& stream) const {
  stream << "kiln::nn::" << class_name<D>() << "(" << options.in_channels() << ", "
         << options.out_channels() << ", kernel_size=" << options.kernel_size()
         << ", stride=" << options.stride();
  if (options.padding() != ExpandingArray<D>(0)) stream << ", padding=" << options.padding();
  if (options.output_padding() != ExpandingArray<D>(0)) {
    stream << ", output_padding=" << options.output_padding();
  }
  if (options.dilation() != ExpandingArray<D>(1)) stream << ", dilation=" << options.dilation();
  if (options.groups() != 1) stream << ", groups=" << options.groups();
  if (!options.bias()) stream << ", bias=false";
  stream << ")";
}

template class ConvTransposeImplBase<1>;
template class ConvTransposeImplBase<2>;

Tensor ConvTranspose1dImpl::forward(const Tensor& input,
                                    const std::optional<std::vector<int64_t>>& output_size) {
  return functional::conv_transpose1d(
      input, weight,
      functional::ConvTranspose1dFuncOptions()
          .bias(bias)
          .stride(options.stride())
          .padding(options.padding())
          .output_padding(output_padding_for(input, output_size, "ConvTranspose1d"))
          .groups(options.groups())
          .dilation(options.dilation()));
}

Tensor ConvTranspose2dImpl::forward(const Tensor& input,
                                    const std::optional<std::vector<int64_t>>& output_size) {
  return functional::conv_transpose2d(
      input, weight,
      functional::ConvTranspose2dFuncOptions()
          .bias(bias)
          .stride(options.stride())
          .padding(options.padding())
          .output_padding(output_padding_for(input, output_size, "ConvTranspose2d"))
          .groups(options.groups())
          .dilation(options.dilation()));
}

// Built from the same options, then given this module's values (nn/module.h, clone_layer).
std::shared_ptr<Module> ConvTranspose1dImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<ConvTranspose1dImpl>(options), device);
}
std::shared_ptr<Module> ConvTranspose2dImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<ConvTranspose2dImpl>(options), device);
}

}  // namespace kiln::nn
