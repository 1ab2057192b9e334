// Gradient checks of indexing, joining and sorting (autograd/index_backward.cpp): advanced
// indexing with index tensors (repeated indices accumulate) and masks, index_put_ with and
// without accumulation, gather/scatter/scatter_add/index_add/index_select, masked_fill and
// masked_select with broadcast masks, embedding, triu/tril, cat/stack, sort/topk values, and
// the in-place forms on non-leaves.
#include "grad_test_util.h"

namespace kiln {
namespace {

using gradtest::check_grad;
using gradtest::distinct_leaf;
using gradtest::leaf;
using gradtest::leaf_of;
using gradtest::variable_list;
using indexing::Slice;

Tensor idx(std::vector<int64_t> v) { return tensor(v, kInt64); }

// split_with_sizes_copy: every slice's gradient, one slice's alone (the others' are zeros), and a
// non-contiguous input.
TEST(IndexGradTest, SplitWithSizesCopy) {
  Tensor x = leaf({3, 7});
  EXPECT_TRUE(check_grad({"split_with_sizes_copy"}, [](const variable_list& in) {
    const std::vector<Tensor> p = split_with_sizes_copy(in[0], {2, 0, 5}, 1);
    return p[0].sum(1) * 2.0 + p[2].square().sum(1);
  }, {x}));
  EXPECT_TRUE(check_grad({"split_with_sizes_copy"}, [](const variable_list& in) {
    return split_with_sizes_copy(in[0].t(), {4, 3}, 0)[1];
  }, {x}));
}

TEST(IndexGradTest, AdvancedIndex) {
  Tensor x = leaf({4, 3});
  Tensor rows = idx({2, 0, 2, 3});  // row 2 twice: its gradient accumulates
  EXPECT_TRUE(check_grad(
      {"index"}, [rows](const variable_list& in) { return in[0].index({rows}); }, {x}, true));
  EXPECT_TRUE(check_grad(
      {"index"},
      [rows](const variable_list& in) {
        return in[0].t().index({Slice(), rows});  // non-contiguous self, second dim
      },
      {x}, true));
  Tensor r2 = idx({0, 3, 3}).reshape({3, 1}), c2 = idx({1, 2});  // broadcast index tensors
  EXPECT_TRUE(check_grad({"index"},
                         [r2, c2](const variable_list& in) {
                           return in[0].index({r2, c2});
                         },
                         {x}));
  Tensor y = leaf({2, 3, 4});
  Tensor a = idx({1, 0, 1}), b = idx({3, 3, 0});  // non-adjacent indexed dims
  EXPECT_TRUE(check_grad({"index"},
                         [a, b](const variable_list& in) {
                           return in[0].index({a, Slice(), b});
                         },
                         {y}));
  Tensor mask =
      tensor({true, false, true, true, false, false, true, false, true, false, true, true}, kBool)
          .reshape({4, 3});
  EXPECT_TRUE(check_grad(
      {"index"}, [mask](const variable_list& in) { return in[0].index({mask}); }, {x}, true));
  Tensor row_mask = tensor({false, true, true, false}, kBool);
  EXPECT_TRUE(check_grad({"index"},
                         [row_mask](const variable_list& in) {
                           return in[0].index({row_mask, 1});
                         },
                         {x}));
  // Hand values: repeated rows accumulate.
  Tensor g = gradtest::grad_of([rows](const variable_list& in) { return in[0].index({rows}); }, x);
  EXPECT_EQ(g.sum({1}).to_vector<double>(), (std::vector<double>{3, 0, 6, 3}));
}

TEST(IndexGradTest, IndexPut) {
  Tensor rows = idx({2, 0});
  // self and a broadcast value ([3] into rows of [4, 3]); the overwritten elements of self get 0.
  EXPECT_TRUE(check_grad(
      {"index_put_"},
      [rows](const variable_list& in) {
        Tensor y = in[0] * 1.0;
        y.index_put_({rows}, in[1]);
        return y;
      },
      {leaf({4, 3}), leaf({3})}, true));
  // Two index tensors into a non-leaf computed from a transposed input, a transposed value.
  // (A slice among the indices would write through a view, which kiln refuses on tensors
  // that require grad.)
  Tensor r2 = idx({0, 2, 1}), c2 = idx({3, 0, 3});
  EXPECT_TRUE(check_grad({"index_put_"},
                         [r2, c2](const variable_list& in) {
                           Tensor y = in[0].t() * 1.0;
                           y.index_put_({r2, c2}, in[1].t().select(0, 1));
                           return y;
                         },
                         {leaf({4, 3}), leaf({3, 2})}));
  Tensor mask = tensor({true, false, false, true, true, false}, kBool).reshape({2, 3});
  EXPECT_TRUE(check_grad({"index_put_"},
                         [mask](const variable_list& in) {
                           Tensor y = in[0] * 2.0;
                           y.index_put_({mask}, in[1]);
                           return y;
                         },
                         {leaf({2, 3}), leaf({})}));
  // accumulate=true (the registry op itself): repeated indices add up.
  static const OpDef& put = KILN_OP(index_put_);
  Tensor rep = idx({1, 1, 3});
  EXPECT_TRUE(check_grad(
      {"index_put_"},
      [rep](const variable_list& in) {
        Tensor y = in[0] * 1.0;
        call_op(put, {y, in[1], rep}, {Shape{0}, true});
        return y;
      },
      {leaf({4, 2}), leaf({3, 2})}, true));
  Tensor g = gradtest::grad_of(
      [rows](const variable_list& in) {
        Tensor y = in[0] * 1.0;
        y.index_put_({rows}, zeros({3}, kDouble));
        return y;
      },
      leaf({4, 3}));
  EXPECT_EQ(g.sum({1}).to_vector<double>(), (std::vector<double>{0, 3, 0, 3}));
}

TEST(IndexGradTest, IndexSelectGather) {
  Tensor x = leaf({4, 3});
  for (int64_t dim : {0, 1, -1}) {
    Tensor i = idx({2, 0, 2});
    EXPECT_TRUE(check_grad(
        {"index_select"}, [dim, i](const variable_list& in) { return in[0].index_select(dim, i); },
        {x}, true));
    EXPECT_TRUE(check_grad(
        {"index_select"},
        [dim, i](const variable_list& in) { return in[0].t().index_select(dim, i); }, {x}));
  }
  EXPECT_TRUE(check_grad({"index_select"},
                         [](const variable_list& in) { return in[0].index_select(0, idx({0})); },
                         {leaf({})}));
  Tensor gi = idx({0, 2, 1, 1, 0, 0}).reshape({3, 2});  // repeats accumulate
  EXPECT_TRUE(check_grad(
      {"gather"}, [gi](const variable_list& in) { return in[0].gather(1, gi); }, {x}, true));
  Tensor gi0 = idx({3, 0, 1, 3, 2, 2}).reshape({2, 3});
  EXPECT_TRUE(check_grad({"gather"},
                         [gi0](const variable_list& in) { return in[0].gather(-2, gi0); }, {x}));
  EXPECT_TRUE(check_grad({"gather"},
                         [gi](const variable_list& in) {
                           return in[0].t().gather(0, gi.t().contiguous().narrow(0, 0, 1));
                         },
                         {x}));
}

TEST(IndexGradTest, Scatter) {
  // Distinct indices per column/row for scatter (a repeated target has no defined winner).
  Tensor si = idx({0, 2, 1, 1, 0, 2}).reshape({2, 3});  // dim 0 targets, unique per column
  auto fns = std::vector<std::pair<const char*, gradtest::GradFn>>{
      {"scatter", [si](const variable_list& in) { return in[0].scatter(0, si, in[1]); }},
      {"scatter_add", [si](const variable_list& in) { return in[0].scatter_add(0, si, in[1]); }},
      {"scatter_value",
       [si](const variable_list& in) { return in[0].scatter(0, si, 2.5) * in[1].sum(); }},
  };
  for (const auto& [op, fn] : fns) {
    SCOPED_TRACE(op);
    EXPECT_TRUE(check_grad({op}, fn, {leaf({3, 3}), leaf({2, 3})}, true));
    // src larger than the index (only its leading part is read).
    EXPECT_TRUE(check_grad({op}, fn, {leaf({3, 3}), leaf({3, 4})}));
  }
  Tensor col = idx({1, 0, 0, 2}).reshape({2, 2});  // dim 1, negative dim
  EXPECT_TRUE(check_grad(
      {"scatter"}, [col](const variable_list& in) { return in[0].t().scatter(-1, col, in[1].t()); },
      {leaf({3, 2}), leaf({2, 2})}));
  Tensor rep = idx({1, 1, 1, 0}).reshape({2, 2});  // scatter_add: repeats accumulate
  EXPECT_TRUE(check_grad(
      {"scatter_add"}, [rep](const variable_list& in) { return in[0].scatter_add(1, rep, in[1]); },
      {leaf({2, 3}), leaf({2, 2})}, true));
  // In-place forms on non-leaves.
  EXPECT_TRUE(check_grad(
      {"scatter_"},
      [si](const variable_list& in) {
        Tensor y = in[0] * 1.0;
        y.scatter_(0, si, in[1]);
        return y;
      },
      {leaf({3, 3}), leaf({2, 3})}, true));
  EXPECT_TRUE(check_grad({"scatter_value_"},
                         [si](const variable_list& in) {
                           Tensor y = in[0] * 1.0;
                           y.scatter_(0, si, -1.0);
                           return y;
                         },
                         {leaf({3, 3})}));
  EXPECT_TRUE(check_grad(
      {"scatter_add_"},
      [rep](const variable_list& in) {
        Tensor y = in[0] * 1.0;
        y.scatter_add_(1, rep, in[1]);
        return y;
      },
      {leaf({2, 3}), leaf({2, 2})}, true));
}

TEST(IndexGradTest, IndexAdd) {
  Tensor i = idx({2, 0, 2});  // repeats accumulate
  EXPECT_TRUE(check_grad(
      {"index_add"}, [i](const variable_list& in) { return in[0].index_add(0, i, in[1]); },
      {leaf({4, 2}), leaf({3, 2})}, true));
  EXPECT_TRUE(check_grad(
      {"index_add"},
      [i](const variable_list& in) {
        return in[0].t().index_add(-1, i, in[1], 2.5);  // alpha, non-contiguous self
      },
      {leaf({4, 2}), leaf({2, 3})}, true));
  EXPECT_TRUE(check_grad(
      {"index_add_"},
      [i](const variable_list& in) {
        Tensor y = in[0] * 1.0;
        y.index_add_(1, i, in[1], -0.5);
        return y;
      },
      {leaf({2, 4}), leaf({2, 3})}, true));
}

TEST(IndexGradTest, Masked) {
  Tensor mask = tensor({true, false, true, false}, kBool);  // broadcast over rows
  EXPECT_TRUE(check_grad(
      {"masked_fill"}, [mask](const variable_list& in) { return in[0].masked_fill(mask, 3.0); },
      {leaf({3, 4})}, true));
  EXPECT_TRUE(check_grad({"masked_fill"},
                         [mask](const variable_list& in) {
                           return in[0].t().masked_fill(mask.reshape({4, 1}), -1.0);
                         },
                         {leaf({3, 4})}));
  // self broadcast by the mask: [4] with a [2, 4] mask gives [2, 4].
  Tensor mask2 =
      tensor({true, false, false, true, false, true, true, false}, kBool).reshape({2, 4});
  EXPECT_TRUE(check_grad({"masked_fill"},
                         [mask2](const variable_list& in) { return in[0].masked_fill(mask2, 0.5); },
                         {leaf({4})}));
  EXPECT_TRUE(check_grad(
      {"masked_fill_"},
      [mask](const variable_list& in) {
        Tensor y = in[0] * 1.0;
        y.masked_fill_(mask, 0.0);
        return y;
      },
      {leaf({2, 4})}, true));
  EXPECT_TRUE(check_grad(
      {"masked_select"}, [mask](const variable_list& in) { return in[0].masked_select(mask); },
      {leaf({3, 4})}, true));
  EXPECT_TRUE(check_grad({"masked_select"},
                         [mask2](const variable_list& in) {
                           return in[0].masked_select(
                               mask2);  // self broadcast: gradients of repeats add up
                         },
                         {leaf({4})}));
  EXPECT_TRUE(check_grad(
      {"masked_select"},
      [mask2](const variable_list& in) { return in[0].t().masked_select(mask2); }, {leaf({4, 2})}));
}

TEST(IndexGradTest, Embedding) {
  Tensor ids = idx({1, 4, 1, 0, 2, 4}).reshape({2, 3});  // repeats accumulate
  EXPECT_TRUE(check_grad(
      {"embedding"}, [ids](const variable_list& in) { return embedding(in[0], ids); },
      {leaf({5, 2})}, true));
  EXPECT_TRUE(check_grad({"embedding"},
                         [](const variable_list& in) {
                           return embedding(in[0].t(), idx({2, 0}));
                         },
                         {leaf({3, 3})}));
  EXPECT_TRUE(check_grad(
      {"embedding"}, [](const variable_list& in) { return embedding(in[0], tensor(1, kInt64)); },
      {leaf({3, 2})}));
}

TEST(IndexGradTest, Triangles) {
  for (int64_t diag : {-1, 0, 1}) {
    EXPECT_TRUE(check_grad(
        {"triu"}, [diag](const variable_list& in) { return in[0].triu(diag); }, {leaf({3, 4})},
        true));
    EXPECT_TRUE(check_grad(
        {"tril"}, [diag](const variable_list& in) { return in[0].t().tril(diag); }, {leaf({3, 4})},
        true));
  }
  EXPECT_TRUE(check_grad({"tril"}, [](const variable_list& in) { return in[0].tril(); },
                         {leaf({2, 2, 3})}));
}

TEST(IndexGradTest, CatStack) {
  auto three = [] { return variable_list{leaf({2, 3}), leaf({1, 3}), leaf({2, 3})}; };
  EXPECT_TRUE(check_grad(
      {"cat"},
      [](const variable_list& in) {
        return cat({in[0], in[1], in[2]}, 0);
      },
      three(), true));
  EXPECT_TRUE(check_grad(
      {"cat"},
      [](const variable_list& in) {
        return cat({in[0].t(), in[1].t(), in[2].t()}, -1);
      },
      three()));
  // The legacy empty [0] input is skipped; a constant input gets nothing.
  Tensor k = ones({2, 2}, kDouble);
  EXPECT_TRUE(check_grad({"cat"},
                         [k](const variable_list& in) {
                           return cat({in[0], empty({0}, kDouble), k, in[1]}, 1);
                         },
                         {leaf({2, 3}), leaf({2, 1})}));
  for (int64_t dim : {0, 1, 2, -1}) {
    EXPECT_TRUE(check_grad(
        {"cat"},
        [dim](const variable_list& in) {
          return stack({in[0], in[1].t()}, dim);
        },
        {leaf({2, 3}), leaf({3, 2})}, dim == 0));
  }
  EXPECT_TRUE(check_grad({"cat"},
                         [](const variable_list& in) {
                           return stack({in[0], in[1]}, 0);
                         },
                         {leaf({}), leaf({})}));
}

TEST(IndexGradTest, SortTopk) {
  Tensor x = distinct_leaf({3, 4});
  for (bool descending : {false, true}) {
    for (int64_t dim : {0, 1, -1}) {
      EXPECT_TRUE(check_grad(
          {"sort"},
          [dim, descending](const variable_list& in) {
            return std::get<0>(in[0].sort(dim, descending));
          },
          {x}, dim == 1));
      EXPECT_TRUE(check_grad({"sort"},
                             [dim, descending](const variable_list& in) {
                               return std::get<0>(in[0].t().sort(dim, descending));
                             },
                             {x}));
    }
  }
  EXPECT_TRUE(check_grad(
      {"sort"}, [](const variable_list& in) { return std::get<0>(in[0].sort()); }, {leaf({})}));
  for (bool largest : {true, false}) {
    for (int64_t dim : {0, -1}) {
      EXPECT_TRUE(check_grad(
          {"topk"},
          [dim, largest](const variable_list& in) {
            return std::get<0>(in[0].topk(2, dim, largest));
          },
          {x}, dim == -1));
      EXPECT_TRUE(check_grad({"topk"},
                             [dim, largest](const variable_list& in) {
                               return std::get<0>(in[0].t().topk(1, dim, largest, false));
                             },
                             {x}));
    }
  }
}

}  // namespace
}  // namespace kiln
