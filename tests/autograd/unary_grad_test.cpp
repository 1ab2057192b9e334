// Gradient checks of the unary elementwise ops (autograd/unary_backward.cpp): each op on a
// plain, a transposed (non-contiguous) and a 0-d input, the in-place forms on non-leaves, and
// second derivatives of the smooth ops.
#include "grad_test_util.h"

namespace kiln {
namespace {

using gradtest::check_grad;
using gradtest::leaf;
using gradtest::leaf_of;
using gradtest::variable_list;

using UnaryFn = Tensor (*)(const Tensor&);

struct UnaryCase {
  const char* op;
  UnaryFn fn;
  double shift;  // inputs are randn * 0.5 + shift, kept away from the op's singular points
  bool smooth;   // gradgradcheck too
};

// Inputs of shape [3, 2] read through a transpose, [4] and 0-d.
void check_unary(const UnaryCase& c) {
  SCOPED_TRACE(c.op);
  const UnaryFn f = c.fn;
  Tensor a = leaf({3, 2}, 0.5, c.shift);
  EXPECT_TRUE(check_grad(
      {c.op}, [f](const variable_list& in) { return f(in[0].t()); }, {a}, c.smooth));
  Tensor b = leaf({4}, 0.5, c.shift);
  EXPECT_TRUE(check_grad({c.op}, [f](const variable_list& in) { return f(in[0]); }, {b}));
  Tensor s = leaf({}, 0.5, c.shift);
  EXPECT_TRUE(check_grad({c.op}, [f](const variable_list& in) { return f(in[0]); }, {s}));
}

TEST(UnaryGradTest, SmoothOps) {
  const UnaryCase cases[] = {
      {"exp", [](const Tensor& x) { return x.exp(); }, 0.0, true},
      {"log", [](const Tensor& x) { return x.log(); }, 2.0, true},
      {"log1p", [](const Tensor& x) { return x.log1p(); }, 1.0, true},
      {"expm1", [](const Tensor& x) { return x.expm1(); }, 0.0, true},
      {"sqrt", [](const Tensor& x) { return x.sqrt(); }, 2.0, true},
      {"rsqrt", [](const Tensor& x) { return x.rsqrt(); }, 2.0, true},
      {"sin", [](const Tensor& x) { return x.sin(); }, 0.0, true},
      {"cos", [](const Tensor& x) { return x.cos(); }, 0.0, true},
      {"tanh", [](const Tensor& x) { return x.tanh(); }, 0.0, true},
      {"sigmoid", [](const Tensor& x) { return x.sigmoid(); }, 0.0, true},
      {"erf", [](const Tensor& x) { return x.erf(); }, 0.0, true},
      {"reciprocal", [](const Tensor& x) { return x.reciprocal(); }, 2.0, true},
      {"silu", [](const Tensor& x) { return x.silu(); }, 0.0, true},
      {"gelu", [](const Tensor& x) { return x.gelu(); }, 0.0, true},
      {"gelu", [](const Tensor& x) { return x.gelu("tanh"); }, 0.0, true},
      {"square", [](const Tensor& x) { return x.square(); }, 0.0, true},
      {"neg", [](const Tensor& x) { return -x; }, 0.0, true},
  };
  for (const UnaryCase& c : cases) check_unary(c);
}

// gelu_backward (gelu's gradient op) with respect to both inputs, second derivatives too: its
// rule's gelu'' in both approximations, at inputs spread over [-3, 3].
TEST(UnaryGradTest, GeluBackwardOp) {
  static const OpDef& op = KILN_OP(gelu_backward);
  for (const char* approximate : {"none", "tanh"}) {
    SCOPED_TRACE(approximate);
    const std::string a = approximate;
    Tensor g = leaf({3, 2}, 1.0), x = leaf({3, 2}, 1.5);
    EXPECT_TRUE(check_grad(
        {"gelu_backward"},
        [a](const variable_list& in) {
          return call_op1(op, {in[0], in[1].t().t()}, {a});
        },
        {g, x}, true));
  }
}

TEST(UnaryGradTest, PiecewiseOps) {
  // abs and relu away from 0; sign/floor/ceil/round (zero gradient) away from their jumps.
  Tensor pos = leaf_of({0.3, -1.2, 2.1, -0.7, 1.4, -2.6}, {2, 3});
  auto on_t = [](UnaryFn f) { return [f](const variable_list& in) { return f(in[0].t()); }; };
  EXPECT_TRUE(check_grad({"abs"}, on_t([](const Tensor& x) { return x.abs(); }), {pos}, true));
  EXPECT_TRUE(check_grad({"relu"}, on_t([](const Tensor& x) { return x.relu(); }), {pos}, true));
  EXPECT_TRUE(check_grad({"sign"}, on_t([](const Tensor& x) { return x.sign() * x; }), {pos}));
  EXPECT_TRUE(check_grad({"floor"}, on_t([](const Tensor& x) { return x.floor() + x; }), {pos}));
  EXPECT_TRUE(check_grad({"ceil"}, on_t([](const Tensor& x) { return x.ceil(); }), {pos}));
  EXPECT_TRUE(check_grad({"round"}, on_t([](const Tensor& x) { return x.round(); }), {pos}));
  // The zero gradients themselves.
  for (UnaryFn f : {UnaryFn([](const Tensor& x) { return x.sign(); }),
                    UnaryFn([](const Tensor& x) { return x.floor(); }),
                    UnaryFn([](const Tensor& x) { return x.ceil(); }),
                    UnaryFn([](const Tensor& x) { return x.round(); })}) {
    Tensor g = gradtest::grad_of([f](const variable_list& in) { return f(in[0]); }, pos);
    EXPECT_TRUE(allclose(g, zeros({2, 3}, kDouble)));
  }
  // relu's and abs's hand values.
  Tensor g = gradtest::grad_of([](const variable_list& in) { return in[0].relu(); }, pos);
  EXPECT_EQ(g.to_vector<double>(), (std::vector<double>{1, 0, 1, 0, 1, 0}));
  g = gradtest::grad_of([](const variable_list& in) { return in[0].abs(); }, pos);
  EXPECT_EQ(g.to_vector<double>(), (std::vector<double>{1, -1, 1, -1, 1, -1}));
}

TEST(UnaryGradTest, PowTensorScalar) {
  Tensor x = leaf({2, 3}, 0.5, 2.0);  // positive: fractional powers are defined
  for (double p : {2.0, 3.0, 0.5, -1.5, 1.0, 0.0}) {
    SCOPED_TRACE(p);
    EXPECT_TRUE(check_grad(
        {"pow_tensor_scalar"}, [p](const variable_list& in) { return in[0].t().pow(p); }, {x},
        true));
  }
  // Integer exponents on inputs of both signs.
  Tensor y = leaf({5});
  EXPECT_TRUE(check_grad(
      {"pow_tensor_scalar"}, [](const variable_list& in) { return in[0].pow(3); }, {y}, true));
  // x^0 has zero gradient even at 0 (PyTorch's convention).
  Tensor z = leaf_of({0.0, 1.5}, {2});
  Tensor g = gradtest::grad_of([](const variable_list& in) { return in[0].pow(0.0); }, z);
  EXPECT_EQ(g.to_vector<double>(), (std::vector<double>{0.0, 0.0}));
}

TEST(UnaryGradTest, InplaceOnNonLeaf) {
  Tensor x = leaf({2, 3}, 0.5, 1.5);
  EXPECT_TRUE(check_grad(
      {"exp_"},
      [](const variable_list& in) {
        Tensor y = in[0] * 1.0;
        y.exp_();
        return y;
      },
      {x}, true));
  EXPECT_TRUE(check_grad(
      {"sqrt_"},
      [](const variable_list& in) {
        Tensor y = in[0] * 2.0;
        y.sqrt_();
        return y * in[0];
      },
      {x}, true));
  EXPECT_TRUE(check_grad(
      {"neg_"},
      [](const variable_list& in) {
        Tensor y = in[0].square();
        y.neg_();
        return y;
      },
      {x}, true));
  Tensor s = leaf_of({0.5, -1.0, 2.0, -0.25}, {4});
  EXPECT_TRUE(check_grad({"relu_"},
                         [](const variable_list& in) {
                           Tensor y = in[0] * 3.0;
                           y.relu_();
                           return y;
                         },
                         {s}));
  // An in-place op on a non-leaf computed from a transposed input.
  EXPECT_TRUE(check_grad({"exp_"},
                         [](const variable_list& in) {
                           Tensor y = in[0].t() * 1.0;
                           return y.exp_();
                         },
                         {x}));
}

}  // namespace
}  // namespace kiln
