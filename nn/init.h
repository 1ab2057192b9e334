// kiln::nn::init: in-place initialisers for parameters, as torch.nn.init / torch::nn::init.
//
//   namespace init = kiln::nn::init;
//   init::kaiming_normal_(conv->weight, /*a=*/0, kiln::kFanOut, kiln::kReLU);
//   init::zeros_(conv->bias);
//   init::trunc_normal_(emb->weight, /*mean=*/0, /*std=*/0.02);
//
// Each fills its argument in place under NoGradGuard (so parameters that require gradients
// can be initialised) and returns it. Draws come from kiln's generator: kiln::manual_seed makes
// them reproducible. Fans follow PyTorch: for a weight [out, in, k...], fan_in = in * prod(k)
// and fan_out = out * prod(k).
#pragma once

#include <string_view>
#include <tuple>

#include "tensor/tensor.h"

namespace kiln::nn::init {

enum class FanMode { kFanIn, kFanOut };
enum class Nonlinearity {
  kLinear,
  kConv1D,
  kConv2D,
  kConv3D,
  kConvTranspose1D,
  kConvTranspose2D,
  kConvTranspose3D,
  kSigmoid,
  kTanh,
  kReLU,
  kLeakyReLU,
  kSELU,
};

// The recommended gain for a nonlinearity: 1 for linear/conv/sigmoid, 5/3 for tanh, sqrt(2) for
// ReLU, sqrt(2 / (1 + slope^2)) for leaky ReLU (`param` is the slope, default 0.01), 3/4 for SELU.
double calculate_gain(Nonlinearity nonlinearity, double param = 0.01);

// (fan_in, fan_out) of a tensor of at least 2 dims.
std::tuple<int64_t, int64_t> calculate_fan_in_and_fan_out(const Tensor& tensor);

Tensor uniform_(Tensor tensor, double low = 0, double high = 1);
Tensor normal_(Tensor tensor, double mean = 0, double std = 1);
Tensor constant_(Tensor tensor, Scalar value);
Tensor zeros_(Tensor tensor);
Tensor ones_(Tensor tensor);
// The identity (or as much of it as fits) for a 2-D tensor.
Tensor eye_(Tensor tensor);

// U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)) (Glorot and Bengio, 2010).
Tensor xavier_uniform_(Tensor tensor, double gain = 1.0);
// N(0, std^2) with std = gain * sqrt(2 / (fan_in + fan_out)).
Tensor xavier_normal_(Tensor tensor, double gain = 1.0);

// U(-b, b) with b = gain * sqrt(3 / fan), gain = calculate_gain(nonlinearity, a) (He et al., 2015).
// PyTorch's Linear and Conv use a = sqrt(5) with leaky ReLU: b = 1 / sqrt(fan_in).
Tensor kaiming_uniform_(Tensor tensor, double a = 0, FanMode mode = FanMode::kFanIn,
                        Nonlinearity nonlinearity = Nonlinearity::kLeakyReLU);
// N(0, std^2) with std = gain / sqrt(fan).
Tensor kaiming_normal_(Tensor tensor, double a = 0, FanMode mode = FanMode::kFanIn,
                       Nonlinearity nonlinearity = Nonlinearity::kLeakyReLU);

// N(mean, std^2) truncated to [a, b] (exactly, by inverting the normal CDF on a uniform draw over
// the truncated interval, as PyTorch).
Tensor trunc_normal_(Tensor tensor, double mean = 0, double std = 1, double a = -2, double b = 2);

}  // namespace kiln::nn::init

namespace kiln {
// libtorch's spellings: init::kaiming_normal_(w, 0, kiln::kFanOut, kiln::kReLU).
inline constexpr nn::init::FanMode kFanIn = nn::init::FanMode::kFanIn;
inline constexpr nn::init::FanMode kFanOut = nn::init::FanMode::kFanOut;
inline constexpr nn::init::Nonlinearity kLinear = nn::init::Nonlinearity::kLinear;
inline constexpr nn::init::Nonlinearity kConv1D = nn::init::Nonlinearity::kConv1D;
inline constexpr nn::init::Nonlinearity kConv2D = nn::init::Nonlinearity::kConv2D;
inline constexpr nn::init::Nonlinearity kConv3D = nn::init::Nonlinearity::kConv3D;
inline constexpr nn::init::Nonlinearity kConvTranspose1D = nn::init::Nonlinearity::kConvTranspose1D;
inline constexpr nn::init::Nonlinearity kConvTranspose2D = nn::init::Nonlinearity::kConvTranspose2D;
inline constexpr nn::init::Nonlinearity kConvTranspose3D = nn::init::Nonlinearity::kConvTranspose3D;
inline constexpr nn::init::Nonlinearity kSigmoid = nn::init::Nonlinearity::kSigmoid;
inline constexpr nn::init::Nonlinearity kTanh = nn::init::Nonlinearity::kTanh;
inline constexpr nn::init::Nonlinearity kReLU = nn::init::Nonlinearity::kReLU;
inline constexpr nn::init::Nonlinearity kLeakyReLU = nn::init::Nonlinearity::kLeakyReLU;
inline constexpr nn::init::Nonlinearity kSELU = nn::init::Nonlinearity::kSELU;
}  // namespace kiln
