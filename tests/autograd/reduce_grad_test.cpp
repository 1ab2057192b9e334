// Gradient checks of the reductions, cumsum and softmax (autograd/reduce_backward.cpp): all
// dims and dim lists, keepdim true/false, negative dims, non-contiguous and 0-d inputs, the
// special points of prod (zeros) and of the extrema (ties, checked against hand values), and
// second derivatives of the smooth ones.
#include <cmath>
#include <limits>

#include "grad_test_util.h"

namespace kiln {
namespace {

using gradtest::check_grad;
using gradtest::distinct_leaf;
using gradtest::leaf;
using gradtest::leaf_of;
using gradtest::variable_list;

constexpr double kInf = std::numeric_limits<double>::infinity();
using ReduceFn = std::function<Tensor(const Tensor&, IntArrayRef, bool)>;

// f(x, dims, keepdim) over: all dims; {1}; {-1, 0} of a [2,3,2]; a transposed input; a 0-d input.
void check_reduction(const char* op, const ReduceFn& f, bool smooth,
                     const std::function<Tensor(IntArrayRef)>& make) {
  SCOPED_TRACE(op);
  for (bool keepdim : {false, true}) {
    SCOPED_TRACE(keepdim);
    Tensor x = make({2, 3, 2});
    EXPECT_TRUE(check_grad(
        {op}, [f, keepdim](const variable_list& in) { return f(in[0], {}, keepdim); }, {x},
        smooth));
    EXPECT_TRUE(check_grad(
        {op}, [f, keepdim](const variable_list& in) { return f(in[0], {1}, keepdim); }, {x},
        smooth && keepdim));
    EXPECT_TRUE(check_grad({op},
                           [f, keepdim](const variable_list& in) {
                             return f(in[0], {-1, 0}, keepdim);
                           },
                           {x}));
    EXPECT_TRUE(check_grad(
        {op},
        [f, keepdim](const variable_list& in) { return f(in[0].transpose(0, 2), {1}, keepdim); },
        {x}));
  }
  Tensor s = make({});
  EXPECT_TRUE(check_grad({op}, [f](const variable_list& in) { return f(in[0], {}, false); }, {s}));
}

Tensor random_leaf(IntArrayRef sizes) { return leaf(sizes); }

TEST(ReduceGradTest, SumMean) {
  check_reduction(
      "sum", [](const Tensor& x, IntArrayRef d, bool k) { return x.sum(d, k); }, true, random_leaf);
  check_reduction(
      "mean", [](const Tensor& x, IntArrayRef d, bool k) { return x.mean(d, k); }, true,
      random_leaf);
  Tensor x = leaf({3, 4});
  EXPECT_TRUE(check_grad(
      {"sum"}, [](const variable_list& in) { return in[0].sum(); }, {x}, true));
  EXPECT_TRUE(check_grad(
      {"mean"}, [](const variable_list& in) { return in[0].mean(); }, {x}, true));
  // An output dtype different from the input's.
  EXPECT_TRUE(check_grad(
      {"sum"}, [](const variable_list& in) { return in[0].sum({0}, false, kFloat).to(kDouble); },
      {x}, false, {1e-3, 1e-3, 1e-2}));
  // A broadcast (expanded) input: every element of x is read 4 times.
  EXPECT_TRUE(check_grad(
      {"sum", "expand"},
      [](const variable_list& in) {
        return in[0].expand({4, 3, 4}).sum({0, 2});
      },
      {x}, true));
}

TEST(ReduceGradTest, Prod) {
  // Values away from 0, then slices with one zero and with two zeros.
  check_reduction(
      "prod",
      [](const Tensor& x, IntArrayRef d, bool k) {
        if (d.size() == 1) return x.prod(d[0], k);
        if (d.empty()) return x.prod();
        return x.prod(d[0], k).prod(d[1], k);  // {-1, 0}: dim 0 is still dim 0
      },
      true, [](IntArrayRef s) { return leaf(s, 0.5, 1.0); });
  Tensor one_zero = leaf_of({2.0, 0.0, 3.0, 1.5, -0.5, 2.0}, {2, 3});
  Tensor two_zeros = leaf_of({0.0, 0.0, 3.0, 1.5, -0.5, 2.0}, {2, 3});
  for (const Tensor& x : {one_zero, two_zeros}) {
    // Second derivatives only with one zero: with two, the first derivative is 0 by a where()
    // (as in PyTorch), whose own derivative misses the product of the other elements.
    const bool gradgrad = x.is_same(one_zero);
    EXPECT_TRUE(check_grad(
        {"prod"}, [](const variable_list& in) { return in[0].prod(); }, {x}, gradgrad));
    EXPECT_TRUE(check_grad(
        {"prod"}, [](const variable_list& in) { return in[0].prod(1); }, {x}, gradgrad));
    EXPECT_TRUE(
        check_grad({"prod"}, [](const variable_list& in) { return in[0].t().prod(0, true); }, {x}));
  }
  // Hand values: d/dx_i prod = product of the others.
  Tensor g = gradtest::grad_of([](const variable_list& in) { return in[0].prod(1); }, one_zero);
  EXPECT_EQ(g.to_vector<double>(), (std::vector<double>{0.0, 6.0, 0.0, -1.0, 3.0, -0.75}));
  g = gradtest::grad_of([](const variable_list& in) { return in[0].prod(1); }, two_zeros);
  EXPECT_EQ(g.to_vector<double>(), (std::vector<double>{0.0, 0.0, 0.0, -1.0, 3.0, -0.75}));
}

TEST(ReduceGradTest, Extrema) {
  check_reduction(
      "amax", [](const Tensor& x, IntArrayRef d, bool k) { return x.amax(d, k); }, false,
      distinct_leaf);
  check_reduction(
      "amin", [](const Tensor& x, IntArrayRef d, bool k) { return x.amin(d, k); }, false,
      distinct_leaf);
  Tensor x = distinct_leaf({3, 4});
  EXPECT_TRUE(check_grad({"max"}, [](const variable_list& in) { return in[0].t().max(); }, {x}));
  EXPECT_TRUE(check_grad({"min"}, [](const variable_list& in) { return in[0].min(); }, {x}));
  for (bool keepdim : {false, true}) {
    for (int64_t dim : {0, 1, -1}) {
      EXPECT_TRUE(check_grad(
          {"max_dim"},
          [dim, keepdim](const variable_list& in) { return std::get<0>(in[0].max(dim, keepdim)); },
          {x}));
      EXPECT_TRUE(check_grad({"min_dim"},
                             [dim, keepdim](const variable_list& in) {
                               return std::get<0>(in[0].t().min(dim, keepdim));
                             },
                             {x}));
    }
  }
  Tensor s = leaf({});
  EXPECT_TRUE(check_grad({"max_dim"},
                         [](const variable_list& in) { return std::get<0>(in[0].max(0)); }, {s}));
}

TEST(ReduceGradTest, ExtremaTies) {
  // amax/amin/max/min share the gradient evenly among tied elements (PyTorch).
  Tensor x = leaf_of({1.0, 3.0, 3.0, -2.0, -2.0, 0.5, 3.0, -2.0}, {2, 4});
  auto grad = [&x](const gradtest::GradFn& f) {
    return gradtest::grad_of(f, x).to_vector<double>();
  };
  const double third = 1.0 / 3.0;
  EXPECT_EQ(grad([](const variable_list& in) { return in[0].max(); }),
            (std::vector<double>{0, third, third, 0, 0, 0, third, 0}));
  EXPECT_EQ(grad([](const variable_list& in) { return in[0].amin(); }),
            (std::vector<double>{0, 0, 0, third, third, 0, 0, third}));
  EXPECT_EQ(grad([](const variable_list& in) { return in[0].amax({1}); }),
            (std::vector<double>{0, 0.5, 0.5, 0, 0, 0, 1, 0}));
  EXPECT_EQ(grad([](const variable_list& in) { return in[0].min(); }),
            (std::vector<double>{0, 0, 0, third, third, 0, 0, third}));
  EXPECT_EQ(grad([](const variable_list& in) { return in[0].amin({1}, true); }),
            (std::vector<double>{0, 0, 0, 1, 0.5, 0, 0, 0.5}));
  // max(dim)/min(dim) send the whole gradient to the index they return.
  auto [values, indices] = x.max(1);
  (void)values;
  std::vector<double> want(8, 0.0);
  const auto idx = indices.to_vector<int64_t>();
  want[idx[0]] = 1.0;
  want[4 + idx[1]] = 1.0;
  EXPECT_EQ(grad([](const variable_list& in) { return std::get<0>(in[0].max(1)); }), want);
  auto [mvalues, mindices] = x.min(1, true);
  (void)mvalues;
  std::fill(want.begin(), want.end(), 0.0);
  const auto midx = mindices.to_vector<int64_t>();
  want[midx[0]] = 1.0;
  want[4 + midx[1]] = 1.0;
  EXPECT_EQ(grad([](const variable_list& in) { return std::get<0>(in[0].min(1, true)); }), want);
}

TEST(ReduceGradTest, VarStd) {
  for (int64_t correction : {0, 1, 2}) {
    SCOPED_TRACE(correction);
    check_reduction(
        "var",
        [correction](const Tensor& x, IntArrayRef d, bool k) {
          return x.dim() == 0 ? x.var(d, 0, k) : x.var(d, correction, k);
        },
        true, random_leaf);
    check_reduction(
        "std",
        [correction](const Tensor& x, IntArrayRef d, bool k) {
          return x.dim() == 0 ? x.std({}, 0, k) + x : x.std(d, correction, k);
        },
        true, [](IntArrayRef s) { return s.empty() ? leaf(s) : distinct_leaf(s); });
  }
}

TEST(ReduceGradTest, Norm) {
  // p = 1 and inf away from 0 and from ties; 2, 3 and a fractional p anywhere but 0.
  for (double p : {1.0, 2.0, 3.0, 1.5, kInf, -kInf}) {
    SCOPED_TRACE(p);
    check_reduction(
        "norm", [p](const Tensor& x, IntArrayRef d, bool k) { return x.norm(p, d, k); }, p == 2.0,
        distinct_leaf);
  }
  Tensor x = leaf_of({0.5, -1.5, 2.0, -0.25, 1.0, 3.0}, {2, 3});
  EXPECT_TRUE(check_grad(
      {"norm"}, [](const variable_list& in) { return in[0].norm(); }, {x}, true));
  EXPECT_TRUE(check_grad(
      {"norm"}, [](const variable_list& in) { return in[0].norm(3, {1}); }, {x}, true));
  EXPECT_TRUE(
      check_grad({"norm"}, [](const variable_list& in) { return in[0].norm(0, {1}); }, {x}));
  // The 2-norm of a zero vector has gradient 0 (not nan).
  Tensor z = leaf_of({0.0, 0.0, 0.0}, {3});
  Tensor g = gradtest::grad_of([](const variable_list& in) { return in[0].norm(); }, z);
  EXPECT_EQ(g.to_vector<double>(), (std::vector<double>{0.0, 0.0, 0.0}));
  // inf-norm ties split the gradient, with the sign of each element.
  Tensor t = leaf_of({2.0, -2.0, 1.0}, {3});
  g = gradtest::grad_of([](const variable_list& in) { return in[0].norm(kInf); }, t);
  EXPECT_EQ(g.to_vector<double>(), (std::vector<double>{0.5, -0.5, 0.0}));
}

TEST(ReduceGradTest, LogSumExp) {
  check_reduction(
      "logsumexp", [](const Tensor& x, IntArrayRef d, bool k) { return x.logsumexp(d, k); }, true,
      random_leaf);
}

TEST(ReduceGradTest, Cumsum) {
  Tensor x = leaf({3, 4});
  for (int64_t dim : {0, 1, -1, -2}) {
    EXPECT_TRUE(check_grad(
        {"cumsum"}, [dim](const variable_list& in) { return in[0].cumsum(dim); }, {x}, true));
    EXPECT_TRUE(check_grad({"cumsum"},
                           [dim](const variable_list& in) { return in[0].t().cumsum(dim); }, {x}));
  }
  EXPECT_TRUE(
      check_grad({"cumsum"}, [](const variable_list& in) { return in[0].cumsum(0); }, {leaf({})}));
}

TEST(ReduceGradTest, SoftmaxLogSoftmax) {
  Tensor x = leaf({3, 4});
  for (int64_t dim : {0, 1, -1}) {
    SCOPED_TRACE(dim);
    EXPECT_TRUE(check_grad(
        {"softmax"}, [dim](const variable_list& in) { return in[0].softmax(dim); }, {x}, true));
    EXPECT_TRUE(check_grad(
        {"log_softmax"}, [dim](const variable_list& in) { return in[0].log_softmax(dim); }, {x},
        true));
    EXPECT_TRUE(check_grad({"softmax"},
                           [dim](const variable_list& in) { return in[0].t().softmax(dim); }, {x}));
    EXPECT_TRUE(check_grad({"log_softmax"},
                           [dim](const variable_list& in) { return in[0].t().log_softmax(dim); },
                           {x}));
  }
  Tensor b = leaf({2, 1, 3});
  EXPECT_TRUE(check_grad(
      {"softmax"},
      [](const variable_list& in) {
        return in[0].expand({2, 4, 3}).softmax(1);
      },
      {b}, true));
  EXPECT_TRUE(check_grad({"log_softmax"},
                         [](const variable_list& in) { return in[0].log_softmax(0); }, {leaf({})}));
}

}  // namespace
}  // namespace kiln
