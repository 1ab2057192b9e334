// cat and stack against reference loops: dims (negative too), type promotion, legacy empty
// inputs, non-contiguous inputs, a large multi-threaded case, and every misuse.
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <cstdint>
#include <vector>

#include "test_util.h"

namespace kiln {
namespace {

using Vec = std::vector<double>;

Tensor seq(IntArrayRef sizes, double start = 0, ScalarType dt = kFloat) {
  return arange(start, start + static_cast<double>(numel_of(sizes)), kDouble).reshape(sizes).to(dt);
}
Vec vals(const Tensor& t) { return t.to_vector<double>(); }
Shape shape(const Tensor& t) { return to_shape(t.sizes()); }

// Reference cat of row-major value lists along `dim`.
Vec cat_reference(const std::vector<Tensor>& ts, int64_t dim) {
  int64_t outer = 1;
  for (int64_t k = 0; k < dim; ++k) outer *= ts[0].sizes()[k];
  Vec out;
  std::vector<Vec> vs;
  for (const Tensor& t : ts) vs.push_back(vals(t));
  for (int64_t o = 0; o < outer; ++o) {
    for (size_t i = 0; i < ts.size(); ++i) {
      const int64_t chunk = ts[i].numel() / outer;
      out.insert(out.end(), vs[i].begin() + o * chunk, vs[i].begin() + (o + 1) * chunk);
    }
  }
  return out;
}

TEST(CatTest, EveryDimMatchesReference) {
  for (ScalarType dt : {kFloat, kDouble, kBFloat16, kInt64, kInt32, kUInt8, kBool, kHalf}) {
    for (int64_t dim = -3; dim < 3; ++dim) {
      const int64_t d = dim < 0 ? dim + 3 : dim;
      Shape s1{2, 3, 4}, s2{2, 3, 4};
      s2[d] = 1;
      // The second input is a transposed (non-contiguous) view.
      std::vector<Tensor> ts{seq(s1, 0, dt), seq({s2[2], s2[1], s2[0]}, 50, dt).permute({2, 1, 0})};
      Tensor r = cat(ts, dim);
      Shape want = s1;
      want[d] += 1;
      ASSERT_EQ(shape(r), want);
      EXPECT_EQ(r.dtype(), dt);
      EXPECT_EQ(vals(r), cat_reference(ts, d)) << dtype_name(dt) << " dim " << dim;
    }
  }
  EXPECT_EQ(vals(cat({seq({2}), seq({0}), seq({3}, 10)})), (Vec{0, 1, 10, 11, 12}));
  EXPECT_EQ(shape(cat({seq({2, 0}), seq({2, 0})}, 1)), (Shape{2, 0}));
  EXPECT_EQ(shape(cat({seq({1, 3})})), (Shape{1, 3}));
}

TEST(CatTest, PromotesTypes) {
  Tensor i = tensor({1, 2});
  Tensor f = tensor({0.5});
  EXPECT_EQ(cat({i, f}).dtype(), kFloat);
  EXPECT_EQ(vals(cat({i, f})), (Vec{1, 2, 0.5}));
  EXPECT_EQ(cat({tensor({true}), i}).dtype(), kInt64);
  EXPECT_EQ(cat({f.to(kHalf), f.to(kBFloat16)}).dtype(), kFloat);
  EXPECT_EQ(cat({i.to(kInt32), i}).dtype(), kInt64);
  EXPECT_EQ(cat({f, f.to(kDouble)}).dtype(), kDouble);
  // A skipped legacy empty tensor still takes part in promotion (as in PyTorch).
  Tensor r = cat({seq({2, 2}), empty({0}, kDouble)});
  EXPECT_EQ(r.dtype(), kDouble);
  EXPECT_EQ(shape(r), (Shape{2, 2}));
  Tensor e = cat({empty({0}, kInt64), empty({0})});
  EXPECT_EQ(shape(e), (Shape{0}));
  EXPECT_EQ(e.dtype(), kFloat);
}

TEST(CatTest, LargeInputsGoParallel) {
  Tensor a = seq({300, 200}), b = seq({300, 100}, 1e5);
  Tensor r = cat({a, b.to(kDouble).t().contiguous().t()}, 1);
  ASSERT_EQ(shape(r), (Shape{300, 300}));
  EXPECT_EQ(r.dtype(), kDouble);
  EXPECT_EQ(vals(r), cat_reference({a, b}, 1));
}

TEST(SplitCopyTest, SlicesAreFreshContiguousCopies) {
  const Tensor x = arange(0, 24, kFloat).view({2, 3, 4}).transpose(1, 2);  // [2, 4, 3], strided
  const std::vector<Tensor> p = split_with_sizes_copy(x, {1, 0, 3}, 1);
  ASSERT_EQ(p.size(), 3u);
  EXPECT_TRUE(equal(p[0], x.narrow(1, 0, 1)));
  EXPECT_EQ(p[1].sizes(), IntArrayRef({2, 0, 3}));
  EXPECT_TRUE(equal(p[2], x.narrow(1, 1, 3)));
  for (const Tensor& t : p) EXPECT_TRUE(t.is_contiguous());
  EXPECT_NE(p[2].data_ptr(), x.data_ptr());
  EXPECT_TRUE(equal(cat({p[0], p[1], p[2]}, 1), x));
  EXPECT_KILN_ERROR(split_with_sizes_copy(x, {1, 2}, 1),
                    "[split_with_sizes_copy] sizes [1, 2] sum to 3 but dimension 1 of [2, 4, 3] "
                    "has size 4");
  EXPECT_KILN_ERROR(split_with_sizes_copy(x, {5, -1}, 1), "negative size");
  EXPECT_KILN_ERROR(split_with_sizes_copy(tensor(1.0), {1}, 0), "cannot split a 0-d tensor");
}

TEST(CatTest, Errors) {
  EXPECT_KILN_ERROR(cat({}), "[cat] expected a non-empty list of tensors");
  EXPECT_KILN_ERROR(cat({tensor(1.0)}),
                    "[cat] zero-dimensional tensor (at position 0) cannot be concatenated");
  EXPECT_KILN_ERROR(
      cat({zeros({2, 3}), zeros({2, 4})}, 0),
      "[cat] shapes [2, 3] (tensor 0) and [2, 4] (tensor 1) must match except in dimension 0");
  EXPECT_KILN_ERROR(cat({zeros({2, 3}), zeros({3})}, 0),
                    "[cat] tensors must have the same number of dimensions: got shapes [2, 3] "
                    "(tensor 0) and [3] (tensor 1)");
  EXPECT_KILN_ERROR(cat({zeros({2, 3}), zeros({2, 3})}, 2), "[cat]");
  EXPECT_KILN_ERROR(cat({zeros({2, 3}), zeros({2, 3})}, -3), "[cat]");
}

TEST(StackTest, InsertsANewDim) {
  Tensor a = seq({2, 3}), b = seq({3, 2}, 10).t();
  for (int64_t dim = -3; dim < 3; ++dim) {
    const int64_t d = dim < 0 ? dim + 3 : dim;
    Tensor r = stack({a, b}, dim);
    Shape want{2, 3};
    want.insert(want.begin() + d, 2);
    ASSERT_EQ(shape(r), want);
    EXPECT_EQ(vals(r), cat_reference({a.unsqueeze(d), b.unsqueeze(d)}, d)) << dim;
  }
  EXPECT_EQ(vals(stack({tensor(1.0), tensor(2.0)})), (Vec{1, 2}));
  EXPECT_EQ(stack({tensor({1}), tensor({0.5})}).dtype(), kFloat);
  EXPECT_KILN_ERROR(stack({}), "[stack] expects a non-empty list of tensors");
  EXPECT_KILN_ERROR(
      stack({zeros({2}), zeros({3})}),
      "[stack] expects each tensor to be equal size, but got [2] at entry 0 and [3] at entry 1");
  EXPECT_KILN_ERROR(stack({zeros({2}), zeros({2})}, 2), "[stack]");
}

}  // namespace
}  // namespace kiln
