// ConvTranspose1d/2d and F::conv_transpose1d/2d (nn/functional_conv.cpp, nn/modules/
// conv_transpose.h), and LeakyReLU / F::leaky_relu: against f64 loops written here from the
// definition (every input pixel scatters its weighted kernel into the output), the adjoint
// identity with conv2d, gradients against finite differences, output_size, printing, and misuse.
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <string>
#include <vector>

#include "autograd/grad_test_util.h"
#include "test_util.h"

namespace kiln {
namespace {

namespace F = nn::functional;
using gradtest::check_grad;
using gradtest::variable_list;

std::vector<double> values(const Tensor& t) {
  return t.detach().to(kDouble).contiguous().to_vector<double>();
}

struct Args {
  int64_t sh, sw, ph, pw, oph, opw, dh, dw, groups;
};

// y[n, g * og + o, ih * s - p + kh * d, ...] += x[n, g * cg + c, ih, iw] * w[g * cg + c, o, kh,
// kw].
std::vector<double> reference(const Tensor& xt, const Tensor& wt, const Tensor& bt, const Args& a,
                              int64_t oh, int64_t ow) {
  const std::vector<double> x = values(xt), w = values(wt);
  const int64_t n = xt.size(0), c = xt.size(1), h = xt.size(2), wd = xt.size(3);
  const int64_t og = wt.size(1), kh = wt.size(2), kw = wt.size(3), cg = c / a.groups;
  const int64_t oc = og * a.groups;
  std::vector<double> y(n * oc * oh * ow, 0.0);
  if (bt.defined()) {
    const std::vector<double> b = values(bt);
    for (int64_t i = 0; i < n * oc * oh * ow; ++i) y[i] = b[(i / (oh * ow)) % oc];
  }
  for (int64_t b = 0; b < n; ++b)
    for (int64_t ci = 0; ci < c; ++ci)
      for (int64_t ih = 0; ih < h; ++ih)
        for (int64_t iw = 0; iw < wd; ++iw)
          for (int64_t o = 0; o < og; ++o)
            for (int64_t i = 0; i < kh; ++i)
              for (int64_t j = 0; j < kw; ++j) {
                const int64_t y0 = ih * a.sh - a.ph + i * a.dh, x0 = iw * a.sw - a.pw + j * a.dw;
                if (y0 < 0 || y0 >= oh || x0 < 0 || x0 >= ow) continue;
                const int64_t co = (ci / cg) * og + o;
                y[((b * oc + co) * oh + y0) * ow + x0] +=
                    x[((b * c + ci) * h + ih) * wd + iw] * w[((ci * og + o) * kh + i) * kw + j];
              }
  return y;
}

F::ConvTranspose2dFuncOptions options_of(const Args& a, const Tensor& bias) {
  return F::ConvTranspose2dFuncOptions()
      .bias(bias)
      .stride({a.sh, a.sw})
      .padding({a.ph, a.pw})
      .output_padding({a.oph, a.opw})
      .dilation({a.dh, a.dw})
      .groups(a.groups);
}

TEST(ConvTransposeTest, Conv2dMatchesReference) {
  manual_seed(1);
  const std::vector<Args> cases = {
      {1, 1, 0, 0, 0, 0, 1, 1, 1}, {2, 2, 1, 1, 0, 0, 1, 1, 1}, {2, 3, 1, 0, 1, 2, 1, 1, 1},
      {3, 2, 2, 1, 0, 1, 2, 1, 2}, {1, 2, 0, 1, 0, 0, 2, 3, 3}, {2, 2, 3, 3, 1, 1, 1, 1, 1},
  };
  for (const Args& a : cases) {
    SCOPED_TRACE("stride " + std::to_string(a.sh) + "x" + std::to_string(a.sw) + " groups " +
                 std::to_string(a.groups));
    const int64_t c = 2 * a.groups, og = 2, h = 4, w = 5, kh = 3, kw = 2;
    const Tensor x = randn({2, c, h, w}, kDouble);
    const Tensor wt = randn({c, og, kh, kw}, kDouble);
    const Tensor bias = randn({og * a.groups}, kDouble);
    const int64_t oh = (h - 1) * a.sh - 2 * a.ph + a.dh * (kh - 1) + a.oph + 1;
    const int64_t ow = (w - 1) * a.sw - 2 * a.pw + a.dw * (kw - 1) + a.opw + 1;
    const Tensor y = F::conv_transpose2d(x, wt, options_of(a, bias));
    ASSERT_EQ(y.sizes(), (Shape{2, og * a.groups, oh, ow}));
    const std::vector<double> want = reference(x, wt, bias, a, oh, ow), got = values(y);
    for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-12) << i;
    // Unbatched input, and float32.
    const Tensor y1 = F::conv_transpose2d(x[1], wt, options_of(a, bias));
    EXPECT_TRUE(allclose(y1, y[1], 1e-12, 1e-12));
    const Tensor yf =
        F::conv_transpose2d(x.to(kFloat), wt.to(kFloat), options_of(a, bias.to(kFloat)));
    EXPECT_EQ(yf.dtype(), kFloat);
    EXPECT_TRUE(allclose(yf.to(kDouble), y, 1e-4, 1e-5));
  }
}

// <conv2d(y, w), x> == <y, conv_transpose2d(x, w)>: the transposed convolution is conv2d's
// adjoint for the same stride, padding, dilation and groups.
TEST(ConvTransposeTest, IsTheAdjointOfConv2d) {
  manual_seed(2);
  const Tensor w = randn({4, 3, 3, 3}, kDouble);  // conv2d: 6 -> 4 channels with groups 2
  const Tensor y = randn({2, 6, 9, 8}, kDouble);
  const Tensor cy = F::conv2d(
      y, w, F::Conv2dFuncOptions().stride({2, 3}).padding({1, 2}).dilation({1, 2}).groups(2));
  const Tensor x = randn(cy.sizes(), kDouble);
  // output_padding makes the transposed output cover y's full size.
  const Tensor tx = F::conv_transpose2d(x, w,
                                        F::ConvTranspose2dFuncOptions()
                                            .stride({2, 3})
                                            .padding({1, 2})
                                            .dilation({1, 2})
                                            .groups(2)
                                            .output_padding({0, 1}));
  ASSERT_EQ(tx.sizes(), y.sizes());
  EXPECT_NEAR((cy * x).sum().item<double>(), (y * tx).sum().item<double>(), 1e-9);
}

TEST(ConvTransposeTest, Conv1dMatchesTheTwoDimensionalForm) {
  manual_seed(3);
  const Tensor x = randn({2, 4, 7}, kDouble), w = randn({4, 3, 3}, kDouble);
  const Tensor b = randn({6}, kDouble);
  const Tensor y = F::conv_transpose1d(x, w,
                                       F::ConvTranspose1dFuncOptions()
                                           .bias(b)
                                           .stride(3)
                                           .padding(1)
                                           .output_padding(1)
                                           .groups(2)
                                           .dilation(2));
  ASSERT_EQ(y.sizes(), (Shape{2, 6, (7 - 1) * 3 - 2 + 2 * 2 + 1 + 1}));
  const std::vector<double> want =
      reference(x.unsqueeze(2), w.unsqueeze(2), b, {1, 3, 0, 1, 0, 1, 1, 2, 2}, 1, y.size(2));
  const std::vector<double> got = values(y);
  for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-12) << i;
  EXPECT_TRUE(allclose(kiln::conv_transpose1d(x[0], w, b, 3, 1, 1, 2, 2), y[0], 1e-12, 1e-12));
}

TEST(ConvTransposeTest, Gradcheck) {
  manual_seed(4);
  const Tensor x = gradtest::leaf({1, 4, 3, 3}), w = gradtest::leaf({4, 1, 2, 3});
  const Tensor b = gradtest::leaf({2});
  EXPECT_TRUE(check_grad({"index_add", "bmm"},
                         [](const variable_list& in) {
                           return F::conv_transpose2d(in[0], in[1],
                                                      F::ConvTranspose2dFuncOptions()
                                                          .bias(in[2])
                                                          .stride({2, 1})
                                                          .padding({1, 1})
                                                          .output_padding({1, 0})
                                                          .groups(2));
                         },
                         {x, w, b}));
  const Tensor x1 = gradtest::leaf({2, 2, 4}), w1 = gradtest::leaf({2, 2, 3});
  EXPECT_TRUE(check_grad({"index_add"},
                         [](const variable_list& in) {
                           return F::conv_transpose1d(
                               in[0], in[1], F::ConvTranspose1dFuncOptions().stride(2).dilation(2));
                         },
                         {x1, w1}));
}

TEST(ConvTransposeTest, ModulesInitialiseOutputSizeAndPrint) {
  manual_seed(5);
  nn::ConvTranspose2d up(nn::ConvTranspose2dOptions(8, 4, 4).stride(2).padding(1));
  EXPECT_EQ(up->weight.sizes(), (Shape{8, 4, 4, 4}));
  EXPECT_EQ(up->bias.sizes(), (Shape{4}));
  // kaiming_uniform_(a = sqrt(5)): bound 1 / sqrt(fan_in), fan_in = 4 * 16.
  EXPECT_LE(up->weight.abs().max().item<double>(), 1.0 / 8.0);
  EXPECT_LE(up->bias.abs().max().item<double>(), 1.0 / 8.0);
  const Tensor x = randn({2, 8, 5, 6});
  EXPECT_EQ(up(x).sizes(), (Shape{2, 4, 10, 12}));
  EXPECT_EQ(up(x, std::vector<int64_t>{11, 13}).sizes(), (Shape{2, 4, 11, 13}));
  EXPECT_EQ(up(x, std::vector<int64_t>{2, 4, 11, 12}).sizes(), (Shape{2, 4, 11, 12}));
  EXPECT_TRUE(allclose(
      up(x, std::vector<int64_t>{11, 13}),
      F::conv_transpose2d(
          x, up->weight,
          F::ConvTranspose2dFuncOptions().bias(up->bias).stride(2).padding(1).output_padding(1))));
  EXPECT_KILN_ERROR(up(x, std::vector<int64_t>{12, 12}),
                    "[ConvTranspose2d] requested an output size [12, 12], but valid sizes of dim "
                    "0 range from 10 to 11");
  std::ostringstream os;
  up->pretty_print(os);
  EXPECT_EQ(os.str(),
            "kiln::nn::ConvTranspose2d(8, 4, kernel_size=[4, 4], stride=[2, 2], "
            "padding=[1, 1])");
  nn::ConvTranspose1d up1(nn::ConvTranspose1dOptions(4, 6, 3).groups(2).bias(false));
  EXPECT_EQ(up1->weight.sizes(), (Shape{4, 3, 3}));
  EXPECT_FALSE(up1->bias.defined());
  EXPECT_EQ(up1->parameters().size(), 1u);
  EXPECT_EQ(up1(randn({4, 5})).sizes(), (Shape{6, 7}));
  std::ostringstream os1;
  up1->pretty_print(os1);
  EXPECT_EQ(os1.str(),
            "kiln::nn::ConvTranspose1d(4, 6, kernel_size=[3], stride=[1], groups=2, bias=false)");
}

TEST(ConvTransposeTest, RejectsMisuse) {
  const Tensor x = randn({1, 4, 3, 3});
  EXPECT_KILN_ERROR(F::conv_transpose2d(x, randn({4, 2, 3})),
                    "[conv_transpose2d] expected a 4-D weight");
  EXPECT_KILN_ERROR(F::conv_transpose2d(x, randn({3, 2, 3, 3})),
                    "[conv_transpose2d] input of shape [1, 4, 3, 3] has 4 channels, but weight of "
                    "shape [3, 2, 3, 3] expects 3");
  EXPECT_KILN_ERROR(
      F::conv_transpose2d(x, randn({4, 2, 3, 3}), F::ConvTranspose2dFuncOptions().groups(3)),
      "[conv_transpose2d] in_channels 4 must be divisible by groups 3");
  EXPECT_KILN_ERROR(
      F::conv_transpose2d(x, randn({4, 2, 3, 3}),
                          F::ConvTranspose2dFuncOptions().output_padding(1)),
      "[conv_transpose2d] output_padding must be non-negative and smaller than either stride or "
      "dilation");
  EXPECT_KILN_ERROR(
      F::conv_transpose2d(x, randn({4, 2, 3, 3}), F::ConvTranspose2dFuncOptions().padding(3)),
      "[conv_transpose2d] input of shape [1, 4, 3, 3] with kernel [3, 3] and padding [3, 3] gives "
      "a non-positive output size");
  EXPECT_KILN_ERROR(F::conv_transpose2d(x, randn({4, 2, 3, 3}, kDouble)),
                    "[conv_transpose2d] input (float32) and weight (float64)");
  EXPECT_KILN_ERROR(
      F::conv_transpose2d(x, randn({4, 2, 3, 3}), F::ConvTranspose2dFuncOptions().bias(randn({3}))),
      "[conv_transpose2d] expected a bias of shape [2]");
  EXPECT_KILN_ERROR(F::conv_transpose1d(x, randn({4, 2, 3})),
                    "[conv_transpose1d] expected a 2-D (unbatched) or 3-D (batched) input");
  EXPECT_KILN_ERROR(F::conv_transpose1d(arange(12).view({1, 4, 3}), randn({4, 2, 3})),
                    "[conv_transpose1d] expected a floating-point input");
  EXPECT_KILN_ERROR(nn::ConvTranspose2d(nn::ConvTranspose2dOptions(4, 3, 3).groups(2)),
                    "[ConvTranspose2d] in_channels (4) and out_channels (3) must be divisible by "
                    "groups (2)");
  EXPECT_KILN_ERROR(nn::ConvTranspose1d(nn::ConvTranspose1dOptions(4, 4, 3).output_padding(1)),
                    "[ConvTranspose1d] output_padding must be non-negative and smaller");
}

// --- LeakyReLU ------------------------------------------------------------------------------

TEST(LeakyReluTest, MatchesDefinitionAndGradients) {
  const Tensor x = tensor(std::vector<double>{-2.0, -0.5, 0.0, 0.25, 3.0}, kDouble);
  const std::vector<double> want = {-0.4, -0.1, 0.0, 0.25, 3.0};
  const std::vector<double> got =
      values(F::leaky_relu(x, F::LeakyReLUFuncOptions().negative_slope(0.2)));
  for (size_t i = 0; i < want.size(); ++i) EXPECT_DOUBLE_EQ(got[i], want[i]);
  EXPECT_TRUE(allclose(kiln::leaky_relu(x),
                       tensor(std::vector<double>{-0.02, -0.005, 0.0, 0.25, 3.0}, kDouble)));
  // The gradient at 0 is the slope, as PyTorch's.
  const Tensor z = zeros({1}, kDouble).requires_grad_(true);
  F::leaky_relu(z, F::LeakyReLUFuncOptions().negative_slope(0.3)).sum().backward();
  EXPECT_DOUBLE_EQ(z.grad().item<double>(), 0.3);
  const Tensor leaf = gradtest::distinct_leaf({3, 4});
  EXPECT_TRUE(check_grad({"where"},
                         [](const variable_list& in) {
                           return F::leaky_relu(in[0],
                                                F::LeakyReLUFuncOptions().negative_slope(0.1));
                         },
                         {leaf}));
  // In place, on a non-leaf: the same values, and gradients through the write.
  EXPECT_TRUE(check_grad({"mul_"},
                         [](const variable_list& in) {
                           Tensor y = in[0] * 1.5;
                           Tensor& r = kiln::leaky_relu_(y, 0.1);
                           EXPECT_TRUE(r.is_same(y));
                           return y;
                         },
                         {leaf}));
}

TEST(LeakyReluTest, ModuleInPlaceAndFloat) {
  nn::LeakyReLU act(nn::LeakyReLUOptions().negative_slope(0.5).inplace(true));
  Tensor x = tensor(std::vector<float>{-1.0f, 2.0f});
  const Tensor y = act(x);
  EXPECT_TRUE(y.is_same(x));
  EXPECT_EQ(x.to_vector<float>(), (std::vector<float>{-0.5f, 2.0f}));
  nn::LeakyReLU plain;
  const Tensor u = tensor(std::vector<float>{-1.0f, 2.0f});
  EXPECT_EQ(plain(u).to_vector<float>(), (std::vector<float>{-0.01f, 2.0f}));
  EXPECT_EQ(u.to_vector<float>(), (std::vector<float>{-1.0f, 2.0f}));
  std::ostringstream os;
  act->pretty_print(os);
  EXPECT_EQ(os.str(), "kiln::nn::LeakyReLU(negative_slope=0.5, inplace=true)");
  EXPECT_KILN_ERROR(plain(arange(3)), "[leaky_relu] expected a floating-point input");
}

}  // namespace
}  // namespace kiln
