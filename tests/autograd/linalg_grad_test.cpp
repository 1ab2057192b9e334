// Gradient checks of the matrix products (mm, bmm, addmm rules in autograd/binary_backward.cpp)
// and of the compositions built on them (matmul in every rank combination with batch
// broadcasting, linear, outer, dot), with transposed (non-contiguous) and expanded operands,
// and second derivatives.
#include "grad_test_util.h"
#include "test_util.h"

namespace kiln {
namespace {

using gradtest::check_grad;
using gradtest::leaf;
using gradtest::variable_list;

TEST(LinalgGradTest, Mm) {
  auto mm2 = [](const variable_list& in) { return in[0].mm(in[1]); };
  EXPECT_TRUE(check_grad({"mm"}, mm2, {leaf({2, 3}), leaf({3, 4})}, true));
  EXPECT_TRUE(check_grad(
      {"mm"}, [](const variable_list& in) { return in[0].t().mm(in[1].t()); },
      {leaf({3, 2}), leaf({4, 3})}, true));
  EXPECT_TRUE(check_grad({"mm"},
                         [](const variable_list& in) {
                           return in[0].mm(in[1].expand({3, 2}));  // a broadcast (stride 0) operand
                         },
                         {leaf({2, 3}), leaf({1, 2})}));
  Tensor c = randn({3, 2}, kDouble);
  EXPECT_TRUE(
      check_grad({"mm"}, [c](const variable_list& in) { return in[0].mm(c); }, {leaf({1, 3})}));
}

TEST(LinalgGradTest, Bmm) {
  EXPECT_TRUE(check_grad(
      {"bmm"}, [](const variable_list& in) { return in[0].bmm(in[1]); },
      {leaf({2, 2, 3}), leaf({2, 3, 2})}, true));
  EXPECT_TRUE(check_grad({"bmm"},
                         [](const variable_list& in) {
                           return in[0].transpose(1, 2).bmm(in[1].permute({1, 0, 2}));
                         },
                         {leaf({2, 3, 2}), leaf({3, 2, 2})}));
}

TEST(LinalgGradTest, Addmm) {
  for (const auto& coeffs : {std::pair{1.0, 1.0}, std::pair{0.5, -2.0}, std::pair{0.0, 1.5}}) {
    const double beta = coeffs.first, alpha = coeffs.second;
    SCOPED_TRACE(beta);
    auto fn = [beta, alpha](const variable_list& in) {
      return in[0].addmm(in[1], in[2], beta, alpha);
    };
    EXPECT_TRUE(check_grad({"addmm"}, fn, {leaf({2, 4}), leaf({2, 3}), leaf({3, 4})}, true));
    EXPECT_TRUE(check_grad({"addmm"}, fn, {leaf({4}), leaf({2, 3}), leaf({3, 4})}));
    EXPECT_TRUE(check_grad({"addmm"}, fn, {leaf({2, 1}), leaf({2, 3}), leaf({3, 4})}));
    EXPECT_TRUE(check_grad({"addmm"}, fn, {leaf({}), leaf({2, 3}), leaf({3, 4})}));
  }
  EXPECT_TRUE(check_grad(
      {"addmm"},
      [](const variable_list& in) { return addmm(in[0].t(), in[1].t(), in[2], 2.0, 0.5); },
      {leaf({4, 2}), leaf({3, 2}), leaf({3, 4})}));
}

// mm_with_bias_grad, what addmm's backward calls for a Linear layer's bias on a GPU: its own
// gradients (both outputs used, either operand summed), first and second order.
TEST(LinalgGradTest, MmWithBiasGrad) {
  static const OpDef& op = KILN_OP(mm_with_bias_grad);
  for (int64_t operand : {0, 1}) {
    SCOPED_TRACE(operand);
    auto fn = [operand](const variable_list& in) {
      const TensorVec r = call_op(op, {in[0], in[1]}, {operand});
      return cat({r[0].reshape({-1}), r[1] * 3.0});
    };
    EXPECT_TRUE(check_grad({"mm_with_bias_grad"}, fn, {leaf({2, 3}), leaf({3, 4})}, true));
    EXPECT_TRUE(check_grad(
        {"mm_with_bias_grad"},
        [operand](const variable_list& in) {
          return call_op(op, {in[0].t(), in[1]}, {operand})[1];  // the sums alone
        },
        {leaf({3, 2}), leaf({3, 4})}, true));
  }
}

// The backward of a Linear layer with a bias multiplies by beta and alpha only when they are not
// 1 (no pass over g, dX or dW for it).
TEST(LinalgGradTest, LinearBackwardScalesOnlyByCoefficientsOtherThanOne) {
  const Tensor x = randn({4, 3}).requires_grad_(true), w = randn({5, 3}).requires_grad_(true);
  const Tensor bias = randn({5}).requires_grad_(true);
  const Tensor y = linear(x, w, bias);
  {
    test::OpRecorder rec;
    autograd::backward({y.sum()});
    EXPECT_EQ(rec.count("mul"), 0);
    EXPECT_EQ(rec.count("mm"), 2);
  }
  EXPECT_TRUE(allclose(bias.grad(), full({5}, 4.0f)));
  const Tensor z = addmm(bias, x, w.t(), 0.5, 2.0);
  test::OpRecorder rec;
  autograd::backward({z.sum()});
  EXPECT_EQ(rec.count("mul"), 3);
}

TEST(LinalgGradTest, Matmul) {
  auto mm = [](const variable_list& in) { return in[0].matmul(in[1]); };
  struct Shapes {
    Shape a, b;
  };
  const Shapes cases[] = {
      {{3}, {3}},                 // dot
      {{2, 3}, {3}},              // matrix-vector
      {{3}, {3, 2}},              // vector-matrix
      {{2, 3}, {3, 2}},           // mm
      {{2, 2, 3}, {3, 2}},        // batch dims fold into the rows
      {{2, 2, 3}, {3}},           // batched matrix-vector
      {{3}, {2, 3, 2}},           // vector-batched matrix
      {{2, 1, 2, 3}, {3, 3, 2}},  // batch broadcast [2,1] with [3]
      {{1, 2, 3}, {2, 3, 2}},     // size-1 batch broadcast
  };
  for (const Shapes& s : cases) {
    SCOPED_TRACE(shape_str(s.a) + " @ " + shape_str(s.b));
    EXPECT_TRUE(check_grad({}, mm, {leaf(s.a), leaf(s.b)}, s.a.size() + s.b.size() <= 5));
  }
  EXPECT_TRUE(check_grad({"bmm"}, mm, {leaf({2, 2, 3}), leaf({2, 3, 2})}, true));
  EXPECT_TRUE(check_grad({"bmm"},
                         [](const variable_list& in) {
                           return in[0].mT().matmul(in[1].mT());  // non-contiguous batched operands
                         },
                         {leaf({2, 3, 2}), leaf({2, 2, 3})}));
  EXPECT_TRUE(check_grad({"bmm"},
                         [](const variable_list& in) {
                           return in[0].matmul(in[1].expand({2, 3, 2}));
                         },
                         {leaf({2, 2, 3}), leaf({3, 2})}));
}

TEST(LinalgGradTest, LinearOuterDot) {
  auto with_bias = [](const variable_list& in) { return linear(in[0], in[1], in[2]); };
  auto no_bias = [](const variable_list& in) { return linear(in[0], in[1], Tensor()); };
  EXPECT_TRUE(check_grad({"addmm"}, with_bias, {leaf({2, 3}), leaf({4, 3}), leaf({4})}, true));
  EXPECT_TRUE(check_grad({"addmm", "view"}, with_bias, {leaf({2, 2, 3}), leaf({4, 3}), leaf({4})}));
  EXPECT_TRUE(check_grad({"mm"}, no_bias, {leaf({2, 3}), leaf({4, 3})}, true));
  EXPECT_TRUE(check_grad({"mm"}, no_bias, {leaf({3}), leaf({2, 3})}));
  EXPECT_TRUE(check_grad({"addmm"},
                         [](const variable_list& in) { return linear(in[0].t(), in[1], in[2]); },
                         {leaf({3, 2}), leaf({4, 3}), leaf({})}));
  EXPECT_TRUE(check_grad(
      {"mm"}, [](const variable_list& in) { return in[0].outer(in[1]); }, {leaf({3}), leaf({2})},
      true));
  EXPECT_TRUE(check_grad(
      {"mm"}, [](const variable_list& in) { return in[0].dot(in[1]); }, {leaf({4}), leaf({4})},
      true));
  EXPECT_TRUE(check_grad(
      {"mm"},
      [](const variable_list& in) {
        return in[0].select(1, 0).dot(in[0].select(1, 1));  // strided operands, one shared leaf
      },
      {leaf({3, 2})}, true));
}

}  // namespace
}  // namespace kiln
