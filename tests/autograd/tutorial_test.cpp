// A port of the libtorch autograd tutorial ("Autograd in C++ Frontend", pytorch.org), with its
// printed values asserted. The code below compiles against libtorch by renaming kiln:: to
// torch:: and <kiln/kiln.h> to <torch/torch.h> (the Linear module is spelled out with tensors
// here, as kiln's nn layer comes with a later change).
#include <gtest/gtest.h>

#include <cmath>

#include <kiln/kiln.h>

namespace {

using kiln::autograd::AutogradContext;
using kiln::autograd::Function;
using kiln::autograd::tensor_list;

TEST(AutogradTutorial, BasicOperations) {
  auto x = kiln::ones({2, 2}, kiln::requires_grad());
  auto y = x + 2;
  EXPECT_EQ(y.grad_fn()->name(), "AddBackward0");
  auto z = y * y * 3;
  auto out = z.mean();
  EXPECT_EQ(z.grad_fn()->name(), "MulBackward0");
  EXPECT_EQ(out.grad_fn()->name(), "MeanBackward0");
  EXPECT_DOUBLE_EQ(out.item<double>(), 27.0);

  auto a = kiln::randn({2, 2});
  a = ((a * 3) / (a - 1));
  EXPECT_FALSE(a.requires_grad());
  a.requires_grad_(true);
  EXPECT_TRUE(a.requires_grad());
  auto b = (a * a).sum();
  EXPECT_EQ(b.grad_fn()->name(), "SumBackward0");

  out.backward();
  EXPECT_TRUE(kiln::allclose(x.grad(), kiln::full({2, 2}, 4.5)));

  x = kiln::randn(3, kiln::requires_grad());
  y = x * 2;
  int doublings = 1;
  while (y.norm().item<double>() < 1000) {
    y = y * 2;
    ++doublings;
  }
  EXPECT_EQ(y.grad_fn()->name(), "MulBackward0");
  auto v = kiln::tensor({0.1, 1.0, 0.0001}, kiln::kFloat);
  y.backward(v);
  EXPECT_TRUE(kiln::allclose(x.grad(), v * std::pow(2.0, doublings)));

  EXPECT_TRUE(x.requires_grad());
  EXPECT_TRUE(x.pow(2).requires_grad());
  {
    kiln::NoGradGuard no_grad;
    EXPECT_FALSE(x.pow(2).requires_grad());
  }
  y = x.detach();
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(x.eq(y).all().item<bool>());
}

TEST(AutogradTutorial, HigherOrderGradients) {
  kiln::manual_seed(0);
  auto weight = kiln::randn({3, 4}).requires_grad_(true);
  auto bias = kiln::randn({3}).requires_grad_(true);
  auto input = kiln::randn({3, 4}).requires_grad_(true);
  auto output = kiln::linear(input, weight, bias);
  auto target = kiln::randn({3, 3});
  auto loss = (output - target).pow(2).mean();
  auto grad_output = kiln::ones_like(output);
  auto gradient = kiln::autograd::grad({output}, {input}, {grad_output}, /*retain_graph=*/true,
                                       /*create_graph=*/true);
  auto gradient_penalty = kiln::pow((gradient[0].norm(2, {1}) - 1), 2).mean();
  auto combined_loss = loss + gradient_penalty;
  combined_loss.backward();
  // d/dinput of the penalty is 0 (the gradient of a linear map does not depend on its input);
  // d/dinput of the loss is 2/9 (output - target) W.
  auto expected = ((output - target) * (2.0 / 9.0)).detach().matmul(weight.detach());
  EXPECT_TRUE(kiln::allclose(input.grad(), expected, 1e-5, 1e-6));
  // The weight's gradient is the loss part plus the penalty's: the input gradient is
  // ones(3, 3) @ W for every input, so penalty(W) = mean_rows((||ones(3) @ W|| - 1)^2), whose
  // own gradient is checked against finite differences and then compared.
  auto penalty = [](const kiln::autograd::variable_list& in) {
    auto g = kiln::ones({3, 3}, kiln::kFloat64).matmul(in[0]);
    return kiln::pow(g.norm(2, {1}) - 1, 2).mean();
  };
  auto w = weight.detach().to(kiln::kFloat64).requires_grad_(true);
  EXPECT_TRUE(kiln::autograd::gradcheck(penalty, {w}));
  auto penalty_grad = kiln::autograd::grad({penalty({w})}, {w})[0].to(kiln::kFloat);
  auto loss_grad = ((output - target) * (2.0 / 9.0)).detach().t().matmul(input.detach());
  EXPECT_TRUE(kiln::allclose(weight.grad(), loss_grad + penalty_grad, 1e-4, 1e-5));
}

class LinearFunction : public Function<LinearFunction> {
 public:
  static kiln::Tensor forward(AutogradContext* ctx, kiln::Tensor input, kiln::Tensor weight,
                              kiln::Tensor bias = kiln::Tensor()) {
    ctx->save_for_backward({input, weight, bias});
    auto output = input.mm(weight.t());
    if (bias.defined()) {
      output += bias.unsqueeze(0).expand_as(output);
    }
    return output;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    auto input = saved[0];
    auto weight = saved[1];
    auto bias = saved[2];
    auto grad_output = grad_outputs[0];
    auto grad_input = grad_output.mm(weight);
    auto grad_weight = grad_output.t().mm(input);
    auto grad_bias = kiln::Tensor();
    if (bias.defined()) {
      grad_bias = grad_output.sum(0);
    }
    return {grad_input, grad_weight, grad_bias};
  }
};

class MulConstant : public Function<MulConstant> {
 public:
  static kiln::Tensor forward(AutogradContext* ctx, kiln::Tensor tensor, double constant) {
    ctx->saved_data["constant"] = constant;
    return tensor * constant;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs) {
    return {grad_outputs[0] * ctx->saved_data["constant"].toDouble(), kiln::Tensor()};
  }
};

TEST(AutogradTutorial, CustomFunctions) {
  auto x = kiln::randn({2, 3}).requires_grad_();
  auto weight = kiln::randn({4, 3}).requires_grad_();
  auto y = LinearFunction::apply(x, weight);
  y.sum().backward();
  EXPECT_TRUE(kiln::allclose(x.grad(), kiln::ones({2, 4}).mm(weight.detach())));
  EXPECT_TRUE(kiln::allclose(weight.grad(), kiln::ones({4, 2}).mm(x.detach())));
  EXPECT_EQ(y.grad_fn()->name(), "LinearFunctionBackward");

  auto bias = kiln::randn({4}).requires_grad_();
  auto y2 = LinearFunction::apply(x, weight, bias);
  y2.sum().backward();
  EXPECT_TRUE(kiln::allclose(bias.grad(), kiln::full({4}, 2.0)));

  auto x2 = kiln::randn({2}).requires_grad_();
  auto y3 = MulConstant::apply(x2, 5.5);
  y3.sum().backward();
  EXPECT_TRUE(kiln::allclose(x2.grad(), kiln::full({2}, 5.5)));
}

}  // namespace
