// kiln::nn::init: the initialisers, each a few registry ops under NoGradGuard.
#include "nn/init.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

#include "autograd/grad_mode.h"
#include "tensor/ops.h"

namespace kiln::nn::init {

namespace {

void check_defined(const Tensor& t, const char* op) {
  KILN_CHECK(t.defined(), "[", op, "] the tensor is undefined");
}

// 0 for a tensor without elements: there is nothing to fill (PyTorch warns and returns).
int64_t fan(const Tensor& t, FanMode mode) {
  const auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(t);
  return mode == FanMode::kFanIn ? fan_in : fan_out;
}

// The inverse of erf on (-1, 1): Giles' single-precision approximation ("Approximating the erfinv
// function", 2010), refined by two Newton steps on std::erf to double precision.
double erfinv(double y) {
  if (y <= -1) return -std::numeric_limits<double>::infinity();
  if (y >= 1) return std::numeric_limits<double>::infinity();
  double w = -std::log((1 - y) * (1 + y));
  double p;
  if (w < 5) {
    w -= 2.5;
    p = 2.81022636e-08;
    for (double c : {3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
                     -0.00417768164, 0.246640727, 1.50140941}) {
      p = c + p * w;
    }
  } else {
    w = std::sqrt(w) - 3;
    p = -0.000200214257;
    for (double c : {0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
                     0.00943887047, 1.00167406, 2.83297682}) {
      p = c + p * w;
    }
  }
  double x = p * y;
  const double k = 2 / std::sqrt(std::numbers::pi);
  for (int i = 0; i < 2; ++i) x -= (std::erf(x) - y) / (k * std::exp(-x * x));
  return x;
}

}  // namespace

double calculate_gain(Nonlinearity nonlinearity, double param) {
  switch (nonlinearity) {
    case Nonlinearity::kTanh:
      return 5.0 / 3.0;
    case Nonlinearity::kReLU:
      return std::sqrt(2.0);
    case Nonlinearity::kLeakyReLU:
      return std::sqrt(2.0 / (1 + param * param));
    case Nonlinearity::kSELU:
      return 3.0 / 4.0;
    default:  // linear, convolutions, sigmoid
      return 1.0;
  }
}

std::tuple<int64_t, int64_t> calculate_fan_in_and_fan_out(const Tensor& tensor) {
  check_defined(tensor, "calculate_fan_in_and_fan_out");
  KILN_CHECK(tensor.dim() >= 2,
             "[calculate_fan_in_and_fan_out] fan in and fan out cannot be computed for a tensor "
             "with fewer than 2 dimensions, got shape ",
             shape_str(tensor.sizes()));
  int64_t receptive_field = 1;
  for (int64_t d = 2; d < tensor.dim(); ++d) receptive_field *= tensor.size(d);
  return {tensor.size(1) * receptive_field, tensor.size(0) * receptive_field};
}

Tensor uniform_(Tensor tensor, double low, double high) {
  check_defined(tensor, "init::uniform_");
  NoGradGuard no_grad;
  tensor.uniform_(low, high);
  return tensor;
}

Tensor normal_(Tensor tensor, double mean, double std) {
  check_defined(tensor, "init::normal_");
  NoGradGuard no_grad;
  tensor.normal_(mean, std);
  return tensor;
}

Tensor constant_(Tensor tensor, Scalar value) {
  check_defined(tensor, "init::constant_");
  NoGradGuard no_grad;
  tensor.fill_(value);
  return tensor;
}

Tensor zeros_(Tensor tensor) { return constant_(std::move(tensor), 0); }
Tensor ones_(Tensor tensor) { return constant_(std::move(tensor), 1); }

Tensor eye_(Tensor tensor) {
  check_defined(tensor, "init::eye_");
  KILN_CHECK(tensor.dim() == 2, "[init::eye_] only tensors with 2 dimensions are supported, got ",
             shape_str(tensor.sizes()));
  NoGradGuard no_grad;
  tensor.copy_(eye(tensor.size(0), tensor.size(1), tensor.options()));
  return tensor;
}

Tensor xavier_uniform_(Tensor tensor, double gain) {
  check_defined(tensor, "init::xavier_uniform_");
  const auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(tensor);
  if (tensor.numel() == 0) return tensor;
  const double a = gain * std::sqrt(6.0 / static_cast<double>(fan_in + fan_out));
  return uniform_(std::move(tensor), -a, a);
}

Tensor xavier_normal_(Tensor tensor, double gain) {
  check_defined(tensor, "init::xavier_normal_");
  const auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(tensor);
  if (tensor.numel() == 0) return tensor;
  const double std = gain * std::sqrt(2.0 / static_cast<double>(fan_in + fan_out));
  return normal_(std::move(tensor), 0, std);
}

Tensor kaiming_uniform_(Tensor tensor, double a, FanMode mode, Nonlinearity nonlinearity) {
  check_defined(tensor, "init::kaiming_uniform_");
  const int64_t f = fan(tensor, mode);
  if (tensor.numel() == 0) return tensor;
  const double bound = calculate_gain(nonlinearity, a) * std::sqrt(3.0 / static_cast<double>(f));
  return uniform_(std::move(tensor), -bound, bound);
}

Tensor kaiming_normal_(Tensor tensor, double a, FanMode mode, Nonlinearity nonlinearity) {
  check_defined(tensor, "init::kaiming_normal_");
  const int64_t f = fan(tensor, mode);
  if (tensor.numel() == 0) return tensor;
  const double std = calculate_gain(nonlinearity, a) / std::sqrt(static_cast<double>(f));
  return normal_(std::move(tensor), 0, std);
}

Tensor trunc_normal_(Tensor tensor, double mean, double std, double a, double b) {
  check_defined(tensor, "init::trunc_normal_");
  KILN_CHECK(std > 0 && a < b, "[init::trunc_normal_] expects std > 0 and a < b, got std ", std,
             ", a ", a, ", b ", b);
  if (tensor.numel() == 0) return tensor;
  NoGradGuard no_grad;
  auto norm_cdf = [](double x) { return (1 + std::erf(x / std::sqrt(2.0))) / 2; };
  const double l = norm_cdf((a - mean) / std);
  const double u = norm_cdf((b - mean) / std);
  // Uniform over [2l - 1, 2u - 1], mapped through the inverse CDF: mean + std * sqrt(2) * erfinv(v)
  // is then normal, truncated to [a, b].
  Tensor v = kiln::empty(tensor.sizes(), kDouble).uniform_(2 * l - 1, 2 * u - 1);
  double* p = v.data_ptr<double>();
  for (int64_t i = 0; i < v.numel(); ++i) {
    p[i] = std::clamp(mean + std * std::sqrt(2.0) * erfinv(p[i]), a, b);
  }
  tensor.copy_(v);
  return tensor;
}

}  // namespace kiln::nn::init
