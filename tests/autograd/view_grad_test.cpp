// Gradient checks of the views (autograd/view_backward.cpp), copies and the random fills:
// view/reshape, permute/transpose, expand, squeeze/unsqueeze, slice/narrow/select and the
// splits built on them, basic indexing, as_strided (overlapping outputs and inputs, offsets,
// non-contiguous inputs), to/clone/contiguous/copy_/fill_, and uniform_/normal_/random_/
// bernoulli_ on non-leaves. slice_backward/select_backward (the ops the slice and select rules
// emit) are checked through the second derivative.
#include "grad_test_util.h"

namespace kiln {
namespace {

using gradtest::check_grad;
using gradtest::leaf;
using gradtest::variable_list;
using indexing::Ellipsis;
using indexing::None;
using indexing::Slice;

// Weights the elements of `t` differently so that a gradient routed to the wrong element shows.
Tensor weigh(const Tensor& t) {
  return t * arange(1, t.numel() + 1, TensorOptions(kDouble)).reshape(t.sizes());
}

TEST(ViewGradTest, ViewReshapeFlatten) {
  Tensor x = leaf({2, 3, 2});
  EXPECT_TRUE(check_grad(
      {"view"},
      [](const variable_list& in) {
        return weigh(in[0].view({3, 4}));
      },
      {x}, true));
  EXPECT_TRUE(
      check_grad({"view"}, [](const variable_list& in) { return weigh(in[0].view({-1})); }, {x}));
  EXPECT_TRUE(check_grad(
      {"view"},
      [](const variable_list& in) {
        return weigh(in[0].transpose(0, 2).reshape({4, 3}));  // non-contiguous: copy, then view
      },
      {x}, true));
  EXPECT_TRUE(check_grad({"view"},
                         [](const variable_list& in) {
                           return weigh(in[0].flatten(1).unflatten(1, {2, 3}));
                         },
                         {x}));
  EXPECT_TRUE(check_grad({"view"},
                         [](const variable_list& in) {
                           return weigh(in[0].view({1, 1}));
                         },
                         {leaf({})}));
}

TEST(ViewGradTest, PermuteTranspose) {
  Tensor x = leaf({2, 3, 2});
  EXPECT_TRUE(check_grad(
      {"permute"},
      [](const variable_list& in) {
        return weigh(in[0].permute({2, 0, 1}));
      },
      {x}, true));
  EXPECT_TRUE(check_grad({"permute"},
                         [](const variable_list& in) {
                           return weigh(in[0].permute({-1, -3, 1}));
                         },
                         {x}));
  EXPECT_TRUE(check_grad({"permute"},
                         [](const variable_list& in) { return weigh(in[0].transpose(-1, 0).mT()); },
                         {x}));
  EXPECT_TRUE(check_grad(
      {"alias"}, [](const variable_list& in) { return weigh(in[0].t()); }, {leaf({4})}, true));
  EXPECT_TRUE(check_grad({"alias"}, [](const variable_list& in) { return in[0].transpose(0, -1); },
                         {leaf({})}));
}

TEST(ViewGradTest, ExpandSqueezeUnsqueeze) {
  Tensor x = leaf({3, 1});
  EXPECT_TRUE(check_grad(
      {"expand"},
      [](const variable_list& in) {
        return weigh(in[0].expand({2, 3, 4}));
      },
      {x}, true));
  EXPECT_TRUE(check_grad({"expand"},
                         [](const variable_list& in) {
                           return weigh(in[0].expand({-1, 2}));
                         },
                         {x}));
  EXPECT_TRUE(check_grad(
      {"expand"}, [](const variable_list& in) { return weigh(in[0].expand({3})); }, {leaf({})}));
  Tensor y = leaf({2, 1, 3, 1});
  EXPECT_TRUE(check_grad(
      {"squeeze"}, [](const variable_list& in) { return weigh(in[0].squeeze()); }, {y}, true));
  for (int64_t d : {1, -1, 0}) {  // dim 0 has size 2: a no-op squeeze
    EXPECT_TRUE(check_grad({"squeeze"},
                           [d](const variable_list& in) { return weigh(in[0].squeeze(d)); }, {y}));
  }
  for (int64_t d : {0, 2, -1, -3}) {
    EXPECT_TRUE(check_grad(
        {"unsqueeze"}, [d](const variable_list& in) { return weigh(in[0].t().unsqueeze(d)); },
        {leaf({3, 2})}, d == -1));
  }
  EXPECT_TRUE(check_grad({"unsqueeze"},
                         [](const variable_list& in) { return weigh(in[0].unsqueeze(0)); },
                         {leaf({})}));
}

TEST(ViewGradTest, SliceNarrowSelect) {
  Tensor x = leaf({4, 5});
  EXPECT_TRUE(check_grad(
      {"slice"}, [](const variable_list& in) { return weigh(in[0].slice(1, 1, 5, 2)); }, {x},
      true));
  EXPECT_TRUE(check_grad(
      {"slice"},
      [](const variable_list& in) { return weigh(in[0].t().slice(0, -3, std::nullopt)); }, {x}));
  EXPECT_TRUE(check_grad(
      {"slice"}, [](const variable_list& in) { return weigh(in[0].narrow(-2, 1, 2)); }, {x}));
  EXPECT_TRUE(check_grad(
      {"select"}, [](const variable_list& in) { return weigh(in[0].select(0, -1)); }, {x}, true));
  EXPECT_TRUE(check_grad(
      {"select"},
      [](const variable_list& in) { return weigh(in[0].t().select(-1, 2)) + in[0][1].sum(); },
      {x}));
}

TEST(ViewGradTest, Splits) {
  Tensor x = leaf({5, 2});
  EXPECT_TRUE(check_grad(
      {"slice"},
      [](const variable_list& in) {
        auto p = in[0].split(2);
        return cat({p[0] * 1.0, p[1] * 2.0, p[2].square()}, 0);
      },
      {x}, true));
  EXPECT_TRUE(check_grad({"slice"},
                         [](const variable_list& in) {
                           auto p = in[0].split_with_sizes({1, 4});
                           return p[1].sum({0}) * p[0];
                         },
                         {x}));
  EXPECT_TRUE(check_grad({"slice"},
                         [](const variable_list& in) {
                           auto p = in[0].t().chunk(2, -1);
                           return p[0].sum() *
                                  p[1];  // only some outputs of the split used together
                         },
                         {x}));
  EXPECT_TRUE(check_grad(
      {"select"},
      [](const variable_list& in) {
        auto p = in[0].unbind(1);
        return p[0] * p[1];
      },
      {x}, true));
  // One output of a split unused: its gradient is absent, the others still flow.
  EXPECT_TRUE(check_grad({"select"},
                         [](const variable_list& in) { return in[0].unbind(0)[3] * 2.0; }, {x}));
}

TEST(ViewGradTest, BasicIndexing) {
  Tensor x = leaf({3, 4, 2});
  EXPECT_TRUE(check_grad(
      {"slice", "select", "unsqueeze"},
      [](const variable_list& in) {
        return weigh(
            in[0].index({Slice(1, std::nullopt), None, Slice(std::nullopt, std::nullopt, 2), -1}));
      },
      {x}, true));
  EXPECT_TRUE(check_grad({"select"},
                         [](const variable_list& in) {
                           return weigh(in[0].index({Ellipsis, 0}));
                         },
                         {x}));
}

TEST(ViewGradTest, AsStrided) {
  Tensor x = leaf({6});
  // Non-overlapping, with an offset.
  EXPECT_TRUE(check_grad(
      {"as_strided"},
      [](const variable_list& in) {
        return weigh(in[0].as_strided({2, 2}, {1, 2}, 1));
      },
      {x}, true));
  // Overlapping windows: elements read several times accumulate.
  EXPECT_TRUE(check_grad(
      {"as_strided"},
      [](const variable_list& in) {
        return weigh(in[0].as_strided({4, 3}, {1, 1}));
      },
      {x}, true));
  // A stride of 0.
  EXPECT_TRUE(check_grad({"as_strided"},
                         [](const variable_list& in) {
                           return weigh(in[0].as_strided({3, 2}, {0, 3}, 0));
                         },
                         {x}));
  // Input a transposed view: positions are the storage's, not the view's.
  Tensor m = leaf({3, 4});
  EXPECT_TRUE(check_grad(
      {"as_strided"},
      [](const variable_list& in) {
        return weigh(in[0].t().as_strided({2, 3}, {4, 1}, 1));
      },
      {m}, true));
  // Input a narrowed view (offset 4) read inside its own extent.
  EXPECT_TRUE(check_grad(
      {"as_strided"},
      [](const variable_list& in) { return weigh(in[0].narrow(0, 1, 2).as_strided({3}, {3}, 5)); },
      {m}));
  // Input an expanded view (its elements share storage): they split the gradient evenly.
  Tensor v = leaf({3});
  EXPECT_TRUE(check_grad(
      {"as_strided"},
      [](const variable_list& in) {
        return weigh(in[0].expand({2, 3}).as_strided({2, 2}, {1, 1}));
      },
      {v}, true));
  // 0-d output and input.
  EXPECT_TRUE(check_grad({"as_strided"},
                         [](const variable_list& in) {
                           return in[0].as_strided({}, {}, 4) * in[0].as_strided({2}, {5}, 0).sum();
                         },
                         {x}));
  EXPECT_TRUE(check_grad({"as_strided"},
                         [](const variable_list& in) { return weigh(in[0].as_strided({3}, {0})); },
                         {leaf({})}));
  // Hand values: windows of 3 with stride 1 over 6 elements read element i min(i+1, 3, 6-i) times.
  Tensor g = gradtest::grad_of(
      [](const variable_list& in) {
        return in[0].as_strided({4, 3}, {1, 1});
      },
      x);
  EXPECT_EQ(g.to_vector<double>(), (std::vector<double>{1, 2, 3, 3, 2, 1}));
}

TEST(ViewGradTest, Copies) {
  Tensor x = leaf({2, 3});
  EXPECT_TRUE(check_grad(
      {"to_copy"}, [](const variable_list& in) { return weigh(in[0].to(kDouble, /*copy=*/true)); },
      {x}, true));
  EXPECT_TRUE(check_grad(
      {"to_copy"}, [](const variable_list& in) { return weigh(in[0].clone()); }, {x}, true));
  EXPECT_TRUE(check_grad(
      {"to_copy"}, [](const variable_list& in) { return weigh(in[0].t().contiguous()); }, {x}));
  // Through float32 and back: the gradient is cast back to float64.
  EXPECT_TRUE(check_grad(
      {"to_copy"}, [](const variable_list& in) { return weigh(in[0].to(kFloat).to(kDouble)); }, {x},
      false, {1e-3, 1e-3, 1e-2}));
  // copy_ into a non-leaf: the old values get no gradient, the broadcast source does.
  EXPECT_TRUE(check_grad(
      {"copy_"},
      [](const variable_list& in) {
        Tensor y = in[0] * 1.0;
        y.copy_(in[1]);
        return weigh(y) * in[0];
      },
      {x, leaf({3})}, true));
  EXPECT_TRUE(check_grad({"copy_"},
                         [](const variable_list& in) {
                           Tensor y = in[0].square();
                           y.copy_(in[1].t());
                           return weigh(y);
                         },
                         {x, leaf({3, 2})}));
  EXPECT_TRUE(check_grad(
      {"fill_"},
      [](const variable_list& in) {
        Tensor y = in[0] * 1.0;
        y.fill_(2.5);
        return y * in[0];
      },
      {x}, true));
  EXPECT_TRUE(check_grad({"fill_"},
                         [](const variable_list& in) {
                           Tensor y = in[0] * 1.0;
                           y.zero_();
                           return y + in[0].square();
                         },
                         {x}));
}

TEST(ViewGradTest, RandomFillsOverwrite) {
  // The new values do not depend on the old: zero gradient through the fill. Each evaluation
  // reseeds so that the finite differences see the same random values.
  Tensor x = leaf({2, 3});
  static const OpDef& random_op = KILN_OP(random_);
  const std::vector<std::pair<const char*, std::function<void(Tensor&)>>> fills = {
      {"uniform_", [](Tensor& y) { y.uniform_(-1.0, 1.0); }},
      {"normal_", [](Tensor& y) { y.normal_(0.0, 2.0); }},
      {"bernoulli_", [](Tensor& y) { y.bernoulli_(0.5); }},
      {"random_",
       [](Tensor& y) {
         call_op(random_op, {y}, {int64_t{0}, int64_t{10}, int64_t{7}, int64_t{0}});
       }},
  };
  for (const auto& [op, fill] : fills) {
    SCOPED_TRACE(op);
    auto fn = [f = fill](const variable_list& in) {
      manual_seed(11);
      Tensor y = in[0] * 2.0;
      f(y);
      return y * in[0] + in[0];
    };
    EXPECT_TRUE(check_grad({op}, fn, {x}));
  }
}

TEST(ViewGradTest, ScatterBackOpsOfSliceAndSelect) {
  // slice and select's rules emit slice_backward/select_backward; their own rules (slice and
  // select again) are what a second derivative runs.
  Tensor x = leaf({4, 3});
  EXPECT_TRUE(check_grad(
      {"slice_backward"},
      [](const variable_list& in) {
        AutoGradMode enable_grad(true);  // gradcheck's finite differences run under NoGradGuard
        Tensor y = in[0].slice(0, 1, 4, 2);
        return autograd::grad({y}, {in[0]}, {in[1]}, true, /*create_graph=*/true)[0];
      },
      {x, leaf({2, 3})}, true));
  EXPECT_TRUE(check_grad(
      {"select_backward"},
      [](const variable_list& in) {
        AutoGradMode enable_grad(true);
        Tensor y = in[0].select(1, -1);
        return autograd::grad({y}, {in[0]}, {in[1]}, true, /*create_graph=*/true)[0];
      },
      {x, leaf({4})}, true));
}

}  // namespace
}  // namespace kiln
