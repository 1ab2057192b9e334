// Gradient checks of the binary elementwise ops (autograd/binary_backward.cpp): same shapes,
// broadcasting ([3,1] with [1,4], a 0-d operand, leading dims), non-contiguous operands,
// scalar operands, alpha, in-place forms on non-leaves, and second derivatives.
#include <cmath>

#include "grad_test_util.h"

namespace kiln {
namespace {

using gradtest::check_grad;
using gradtest::leaf;
using gradtest::leaf_of;
using gradtest::variable_list;

using BinaryFn = Tensor (*)(const Tensor&, const Tensor&);

// f(a, b) on: equal shapes; [3,1] with [1,4]; a transposed [4,3]->[3,4] with a 0-d b; [4]
// with [2,3,4] (leading dims). Operands are randn * 0.5 + shift_a / shift_b.
void check_binary(const char* op, BinaryFn f, double shift_a, double shift_b, bool smooth) {
  SCOPED_TRACE(op);
  auto fn = [f](const variable_list& in) { return f(in[0], in[1]); };
  EXPECT_TRUE(
      check_grad({op}, fn, {leaf({2, 3}, 0.5, shift_a), leaf({2, 3}, 0.5, shift_b)}, smooth));
  EXPECT_TRUE(
      check_grad({op}, fn, {leaf({3, 1}, 0.5, shift_a), leaf({1, 4}, 0.5, shift_b)}, smooth));
  EXPECT_TRUE(check_grad({op}, [f](const variable_list& in) { return f(in[0].t(), in[1]); },
                         {leaf({4, 3}, 0.5, shift_a), leaf({}, 0.5, shift_b)}));
  EXPECT_TRUE(check_grad({op}, fn, {leaf({4}, 0.5, shift_a), leaf({2, 3, 4}, 0.5, shift_b)}));
  // Only one operand requires grad; the other is a sliced (non-contiguous) constant.
  Tensor other = (randn({3, 8}, kDouble) * 0.5 + shift_b).slice(1, 0, 8, 2);
  EXPECT_TRUE(check_grad({op}, [f, other](const variable_list& in) { return f(in[0], other); },
                         {leaf({3, 4}, 0.5, shift_a)}));
}

TEST(BinaryGradTest, Arithmetic) {
  check_binary(
      "add", [](const Tensor& a, const Tensor& b) { return a + b; }, 0, 0, true);
  check_binary(
      "add", [](const Tensor& a, const Tensor& b) { return a.add(b, 2.5); }, 0, 0, true);
  check_binary(
      "sub", [](const Tensor& a, const Tensor& b) { return a - b; }, 0, 0, true);
  check_binary(
      "sub", [](const Tensor& a, const Tensor& b) { return a.sub(b, -1.5); }, 0, 0, true);
  check_binary(
      "mul", [](const Tensor& a, const Tensor& b) { return a * b; }, 0, 0, true);
  check_binary(
      "div", [](const Tensor& a, const Tensor& b) { return a / b; }, 0, 2.0, true);
  check_binary(
      "pow", [](const Tensor& a, const Tensor& b) { return a.pow(b); }, 2.0, 0, true);
  check_binary(
      "atan2", [](const Tensor& a, const Tensor& b) { return a.atan2(b); }, 0, 1.5, true);
}

TEST(BinaryGradTest, ScalarOperands) {
  Tensor x = leaf({2, 3}, 0.5, 2.0);
  EXPECT_TRUE(check_grad(
      {"add"}, [](const variable_list& in) { return in[0] + 3.0; }, {x}, true));
  EXPECT_TRUE(check_grad({"add"}, [](const variable_list& in) { return 2 + in[0]; }, {x}));
  EXPECT_TRUE(
      check_grad({"add"}, [](const variable_list& in) { return in[0].add(1.0, 3.0); }, {x}));
  EXPECT_TRUE(check_grad({"sub"}, [](const variable_list& in) { return in[0] - 3.0; }, {x}));
  EXPECT_TRUE(check_grad(
      {"sub"}, [](const variable_list& in) { return 3.0 - in[0]; }, {x}, true));
  EXPECT_TRUE(check_grad(
      {"mul"}, [](const variable_list& in) { return in[0] * -1.5; }, {x}, true));
  EXPECT_TRUE(check_grad({"div"}, [](const variable_list& in) { return in[0] / 4.0; }, {x}));
  EXPECT_TRUE(check_grad(
      {"div"}, [](const variable_list& in) { return 4.0 / in[0]; }, {x}, true));
  EXPECT_TRUE(check_grad(
      {"pow"}, [](const variable_list& in) { return pow(2.0, in[0]); }, {x}, true));
  // f32 scalar-like operand mixed in: the gradient comes back as float64.
  Tensor f32 = full({3}, 0.5, kFloat);
  EXPECT_TRUE(check_grad({"mul"}, [f32](const variable_list& in) { return in[0] * f32; }, {x}));
}

TEST(BinaryGradTest, PowAtZero) {
  // 0^0: the base gets 0 (not nan), the exponent gets 0 (the limit of a^b log a); 0^2: the base
  // gets 0 and the exponent 0.
  Tensor a = leaf_of({0.0, 0.0, 2.0}, {3});
  Tensor b = leaf_of({0.0, 2.0, 0.0}, {3});
  auto g = autograd::grad({a.pow(b).sum()}, {a, b});
  EXPECT_EQ(g[0].to_vector<double>(), (std::vector<double>{0.0, 0.0, 0.0}));
  EXPECT_EQ(g[1].to_vector<double>(), (std::vector<double>{0.0, 0.0, std::log(2.0)}));
}

TEST(BinaryGradTest, RoundedDivisionHasZeroGradient) {
  Tensor a = leaf_of({1.3, -2.7, 5.2, 7.9}, {4});
  Tensor b = leaf_of({0.7, 1.1, -1.9, 2.3}, {4});
  for (const char* mode : {"floor", "trunc"}) {
    auto fn = [mode](const variable_list& in) { return in[0].div(in[1], mode) * in[0]; };
    EXPECT_TRUE(check_grad({"div"}, fn, {a, b}));
    Tensor y = a.div(b, mode).sum();
    auto g = autograd::grad({y}, {a, b});
    EXPECT_TRUE(allclose(g[0], zeros({4}, kDouble)));
    EXPECT_TRUE(allclose(g[1], zeros({4}, kDouble)));
  }
}

TEST(BinaryGradTest, MaximumMinimum) {
  // No ties: gradcheck. Values drawn apart so that finite differences never cross.
  Tensor a = leaf_of({0.1, 2.0, -1.0, 3.5, -2.2, 0.9}, {2, 3});
  Tensor b = leaf_of({1.0, -1.0, 0.5, 2.0, -3.0, 1.7}, {2, 3});
  auto mx = [](const variable_list& in) { return in[0].maximum(in[1]); };
  auto mn = [](const variable_list& in) { return in[0].minimum(in[1].t().t()); };
  EXPECT_TRUE(check_grad({"maximum"}, mx, {a, b}, true));
  EXPECT_TRUE(check_grad({"minimum"}, mn, {a, b}, true));
  Tensor col = leaf_of({0.25, -0.75}, {2, 1});
  EXPECT_TRUE(check_grad({"maximum"}, mx, {a, col}));
  // Ties split the gradient evenly (PyTorch's rule).
  Tensor p = leaf_of({1.0, 2.0, 3.0}, {3});
  Tensor q = leaf_of({1.0, 0.0, 4.0}, {3});
  auto g = autograd::grad({p.maximum(q).sum()}, {p, q});
  EXPECT_EQ(g[0].to_vector<double>(), (std::vector<double>{0.5, 1.0, 0.0}));
  EXPECT_EQ(g[1].to_vector<double>(), (std::vector<double>{0.5, 0.0, 1.0}));
  g = autograd::grad({p.minimum(q).sum()}, {p, q});
  EXPECT_EQ(g[0].to_vector<double>(), (std::vector<double>{0.5, 0.0, 1.0}));
  EXPECT_EQ(g[1].to_vector<double>(), (std::vector<double>{0.5, 1.0, 0.0}));
}

TEST(BinaryGradTest, Where) {
  Tensor cond = tensor({true, false, true, false}, kBool).reshape({1, 4});
  auto fn = [cond](const variable_list& in) { return where(cond, in[0], in[1]); };
  EXPECT_TRUE(check_grad({"where"}, fn, {leaf({3, 1}), leaf({3, 4})}, true));
  EXPECT_TRUE(check_grad({"where"}, fn, {leaf({}), leaf({4})}, true));
  // A non-contiguous condition and operand, and the scalar forms.
  Tensor c2 = tensor({true, false, false, true, true, false}, kBool).reshape({2, 3}).t();
  EXPECT_TRUE(check_grad({"where"},
                         [c2](const variable_list& in) {
                           return where(c2, in[0].t(), 2.0) + where(c2, -1.0, in[0].t());
                         },
                         {leaf({2, 3})}));
  EXPECT_TRUE(check_grad({"where"},
                         [c2](const variable_list& in) { return in[0].t().where(c2, in[1]); },
                         {leaf({2, 3}), leaf({1})}));
}

TEST(BinaryGradTest, Clamp) {
  // Inputs away from the bounds -0.5 and 0.5.
  Tensor x = leaf_of({-1.0, -0.2, 0.3, 0.9, -0.7, 0.1, 1.4, -2.0}, {2, 4});
  auto both = [](const variable_list& in) { return in[0].t().clamp(-0.5, 0.5); };
  auto lo = [](const variable_list& in) { return in[0].clamp_min(-0.5); };
  auto hi = [](const variable_list& in) { return in[0].clamp_max(0.5); };
  EXPECT_TRUE(check_grad({"clamp"}, both, {x}, true));
  EXPECT_TRUE(check_grad({"clamp"}, lo, {x}));
  EXPECT_TRUE(check_grad({"clamp"}, hi, {x}));
  Tensor g = gradtest::grad_of(both, x);
  EXPECT_EQ(g.to_vector<double>(), (std::vector<double>{0, 1, 1, 0, 0, 1, 0, 0}));
}

TEST(BinaryGradTest, Lerp) {
  auto scalar_w = [](const variable_list& in) { return in[0].lerp(in[1], 0.3); };
  auto tensor_w = [](const variable_list& in) { return in[0].lerp(in[1], in[2]); };
  EXPECT_TRUE(check_grad({"lerp"}, scalar_w, {leaf({2, 3}), leaf({2, 3})}, true));
  EXPECT_TRUE(check_grad({"lerp"}, scalar_w, {leaf({3, 1}), leaf({1, 4})}));
  EXPECT_TRUE(check_grad({"lerp"}, tensor_w, {leaf({2, 3}), leaf({2, 3}), leaf({2, 3})}, true));
  EXPECT_TRUE(check_grad({"lerp"}, tensor_w, {leaf({3, 1}), leaf({1, 4}), leaf({})}));
  EXPECT_TRUE(check_grad({"lerp"},
                         [](const variable_list& in) { return in[0].t().lerp(in[1], in[2].t()); },
                         {leaf({3, 2}), leaf({2, 3}), leaf({3, 2})}));
}

TEST(BinaryGradTest, InplaceOnNonLeaf) {
  auto leafs = [] { return variable_list{leaf({2, 3}, 0.5, 1.5), leaf({3}, 0.5, 2.0)}; };
  EXPECT_TRUE(check_grad(
      {"add_"},
      [](const variable_list& in) {
        Tensor y = in[0] * 1.0;
        y.add_(in[1], 2.0);
        return y;
      },
      leafs(), true));
  EXPECT_TRUE(check_grad(
      {"add_"},
      [](const variable_list& in) {
        Tensor y = in[0] * 1.0;
        y += 3.0;
        return y * in[0];
      },
      leafs()));
  EXPECT_TRUE(check_grad(
      {"sub_"},
      [](const variable_list& in) {
        Tensor y = in[0] * 1.0;
        y.sub_(in[1], 0.5);
        return y;
      },
      leafs(), true));
  EXPECT_TRUE(check_grad(
      {"sub_"},
      [](const variable_list& in) {
        Tensor y = in[0] * 1.0;
        y -= 1.0;
        return y.square();
      },
      leafs()));
  EXPECT_TRUE(check_grad(
      {"mul_"},
      [](const variable_list& in) {
        Tensor y = in[0] * 1.0;
        y.mul_(in[1]);
        return y;
      },
      leafs(), true));
  EXPECT_TRUE(check_grad(
      {"mul_"},
      [](const variable_list& in) {
        Tensor y = in[0].square();
        y *= -2.0;
        return y;
      },
      leafs()));
  EXPECT_TRUE(check_grad(
      {"div_"},
      [](const variable_list& in) {
        Tensor y = in[0] * 1.0;
        y.div_(in[1]);
        return y;
      },
      leafs(), true));
  EXPECT_TRUE(check_grad(
      {"div_"},
      [](const variable_list& in) {
        Tensor y = in[0].square();
        y /= 4.0;
        return y;
      },
      leafs()));
  EXPECT_TRUE(check_grad(
      {"clamp_"},
      [](const variable_list& in) {
        Tensor y = in[0] * 1.0;
        y.clamp_(0.0, 100.0);  // the inputs are far inside: identity
        return y;
      },
      leafs()));
  Tensor x = leaf_of({-1.0, -0.2, 0.3, 0.9}, {4});
  EXPECT_TRUE(check_grad({"clamp_"},
                         [](const variable_list& in) {
                           Tensor y = in[0] * 2.0;
                           y.clamp_(-0.5, 1.0);
                           return y;
                         },
                         {x}));
  EXPECT_TRUE(check_grad(
      {"lerp_"},
      [](const variable_list& in) {
        Tensor y = in[0] * 1.0;
        y.lerp_(in[1], 0.25);
        return y;
      },
      leafs(), true));
}

}  // namespace
}  // namespace kiln
