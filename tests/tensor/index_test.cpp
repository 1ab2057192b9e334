// Indexing ops against plain reference loops: Tensor::index / index_put_ (basic, advanced and
// mask indices), index_select, gather, scatter, scatter_add, index_add, masked_fill,
// masked_select, embedding, triu/tril, one_hot.
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "tensor/registry.h"
#include "test_util.h"

namespace kiln {
namespace {

using namespace kiln::indexing;  // NOLINT
using Vec = std::vector<double>;
using IVec = std::vector<int64_t>;

// Deterministic pseudo-random values in [lo, hi) (integers when `integral`).
Vec random_values(int64_t n, uint64_t seed, double lo = -10, double hi = 10, bool integral = true) {
  Vec v(static_cast<size_t>(n));
  uint64_t s = seed * 6364136223846793005ULL + 1442695040888963407ULL;
  for (double& x : v) {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    const double u = static_cast<double>(s >> 11) / static_cast<double>(1ULL << 53);
    x = lo + u * (hi - lo);
    if (integral) x = std::floor(x);
  }
  return v;
}

Tensor make(IntArrayRef sizes, ScalarType dt = kFloat, uint64_t seed = 1) {
  const Vec v = random_values(numel_of(sizes), seed);
  return tensor(v, kDouble).reshape(sizes).to(dt);
}

Tensor ints(const IVec& v, IntArrayRef sizes = {}) {
  const Tensor t = tensor(v, kInt64);
  return sizes.empty() ? t : t.reshape(sizes);
}

Vec vals(const Tensor& t) { return t.to_vector<double>(); }

// t > 0 as a bool tensor, built by hand (comparison ops are another family's).
Tensor positive(const Tensor& t) {
  IVec v;
  for (double x : vals(t)) v.push_back(x > 0);
  return tensor(v, kInt64).reshape(t.sizes()).to(kBool);
}
Shape shape(const Tensor& t) { return to_shape(t.sizes()); }

// Row-major multi-index <-> linear index.
IVec unravel(int64_t i, IntArrayRef sizes) {
  IVec idx(sizes.size());
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    idx[d] = i % sizes[d];
    i /= sizes[d];
  }
  return idx;
}
int64_t ravel(const IVec& idx, IntArrayRef sizes) {
  int64_t i = 0;
  for (size_t d = 0; d < sizes.size(); ++d) i = i * sizes[d] + idx[d];
  return i;
}

const ScalarType kDtypes[] = {kFloat, kDouble, kBFloat16, kInt64, kBool};

// --- Tensor::index: basic indices ----------------------------------------------------------

TEST(IndexTest, BasicIndicesGiveViews) {
  Tensor x = arange(60).reshape({3, 4, 5});
  Tensor a = x.index({1});
  EXPECT_EQ(shape(a), (Shape{4, 5}));
  EXPECT_EQ(vals(a)[0], 20);
  EXPECT_EQ(vals(x.index({-1, -2, -3})), (Vec{52}));
  Tensor b = x.index({Slice(0, 2), None, Ellipsis, 1});
  EXPECT_EQ(shape(b), (Shape{2, 1, 4}));
  EXPECT_EQ(vals(b), (Vec{1, 6, 11, 16, 21, 26, 31, 36}));
  Tensor c = x.index({Ellipsis, Slice(std::nullopt, std::nullopt, 2)});
  EXPECT_EQ(shape(c), (Shape{3, 4, 3}));
  EXPECT_EQ(vals(c)[4], 7);
  Tensor d = x.index({Slice(-2), Slice(-10, -2)});
  EXPECT_EQ(shape(d), (Shape{2, 2, 5}));
  EXPECT_EQ(vals(d)[0], 20);
  EXPECT_EQ(shape(x.index({None, Ellipsis, None})), (Shape{1, 3, 4, 5, 1}));
  EXPECT_EQ(shape(x.index({true})), (Shape{1, 3, 4, 5}));
  EXPECT_EQ(shape(x.index({false})), (Shape{0, 3, 4, 5}));
  EXPECT_EQ(shape(x.index({Slice(), true, 2})), (Shape{3, 1, 5}));
  // Views share storage; an empty index list or a lone ellipsis aliases.
  Tensor e = x.index({Ellipsis});
  EXPECT_FALSE(e.is_same(x));
  EXPECT_EQ(e.data_ptr(), x.data_ptr());
  x.index({0, 0}).fill_(-1);
  EXPECT_EQ(vals(x.index({0, 0, Slice(0, 2)})), (Vec{-1, -1}));
  // A 0-d integer tensor selects.
  EXPECT_EQ(shape(x.index({ints({2}).reshape({})})), (Shape{4, 5}));
}

TEST(IndexTest, ZeroDimSelf) {
  Tensor s = tensor(3.5);
  EXPECT_EQ(shape(s.index({None})), (Shape{1}));
  EXPECT_EQ(shape(s.index({Ellipsis})), (Shape{}));
  EXPECT_EQ(vals(s.index({true})), (Vec{3.5}));
  EXPECT_EQ(shape(s.index({false})), (Shape{0}));
  EXPECT_EQ(vals(s.index({tensor(true)})), (Vec{3.5}));
  EXPECT_KILN_ERROR(s.index({0}), "[index] too many indices for tensor of dimension 0");
}

TEST(IndexTest, BasicErrors) {
  Tensor x = zeros({3, 4});
  EXPECT_KILN_ERROR(x.index({5}), "[index] index 5 is out of bounds for dimension 0 with size 3");
  EXPECT_KILN_ERROR(x.index({0, -5}),
                    "[index] index -5 is out of bounds for dimension 1 with size 4");
  EXPECT_KILN_ERROR(x.index({0, 0, 0}), "[index] too many indices");
  EXPECT_KILN_ERROR(x.index({Ellipsis, 0, Ellipsis}),
                    "[index] an index can only have a single ellipsis");
  EXPECT_KILN_ERROR(x.index({Slice(0, 2, 0)}), "[index] slice step must be positive");
  EXPECT_KILN_ERROR(x.index({Slice(0, 2, -1)}), "[index] slice step must be positive");
  EXPECT_KILN_ERROR(x.index({ones({2})}),
                    "[index] tensors used as indices must be int64, int32 or bool");
  EXPECT_KILN_ERROR(x.index({Tensor()}), "[index] got an undefined index tensor");
}

// --- Tensor::index: advanced indices ---------------------------------------------------------

TEST(IndexTest, SingleTensorIndexOnEachDim) {
  for (ScalarType dt : kDtypes) {
    Tensor x = make({3, 4, 5}, dt);
    const Vec xv = vals(x);
    Tensor idx = ints({0, 2, -1, 1, 1, -3}, {2, 3});
    const IVec iv = {0, 2, -1, 1, 1, -3};
    for (int64_t dim = 0; dim < 3; ++dim) {
      std::vector<TensorIndex> list(static_cast<size_t>(dim), Slice());
      list.push_back(idx);
      Tensor r = x.index(list);
      Shape want = to_shape(x.sizes());
      want.erase(want.begin() + dim);
      want.insert(want.begin() + dim, {2, 3});
      ASSERT_EQ(shape(r), want) << dtype_name(dt);
      EXPECT_EQ(r.dtype(), dt);
      const Vec rv = vals(r);
      for (int64_t i = 0; i < r.numel(); ++i) {
        IVec o = unravel(i, r.sizes());
        int64_t v = iv[o[dim] * 3 + o[dim + 1]];
        if (v < 0) v += x.sizes()[dim];
        IVec src(o.begin(), o.begin() + dim);
        src.push_back(v);
        src.insert(src.end(), o.begin() + dim + 2, o.end());
        ASSERT_EQ(rv[i], xv[ravel(src, x.sizes())]) << dtype_name(dt) << " dim " << dim;
      }
    }
  }
}

TEST(IndexTest, AdjacentTensorsBroadcastInPlace) {
  Tensor x = make({3, 4, 5});
  const Vec xv = vals(x);
  Tensor i1 = ints({0, 3}, {2, 1});
  Tensor i2 = tensor(std::vector<int32_t>{4, -1, 2}, kInt32);  // int32 is accepted too
  Tensor r = x.index({Slice(), i1, i2});
  ASSERT_EQ(shape(r), (Shape{3, 2, 3}));
  const IVec a = {0, 3}, b = {4, 4, 2};
  const Vec rv = vals(r);
  for (int64_t p = 0; p < 3; ++p) {
    for (int64_t i = 0; i < 2; ++i) {
      for (int64_t j = 0; j < 3; ++j) {
        EXPECT_EQ(rv[(p * 2 + i) * 3 + j], xv[(p * 4 + a[i]) * 5 + b[j]]);
      }
    }
  }
  // The same through operator[] and a leading pair of index tensors.
  Tensor r2 = x[ints({2, 0})];
  EXPECT_EQ(vals(r2.index({0})), vals(x.index({2})));
}

TEST(IndexTest, NonAdjacentTensorsGoFirst) {
  Tensor x = make({3, 4, 5});
  const Vec xv = vals(x);
  Tensor i0 = ints({2, 0, 1}), i2 = ints({1, -1, 3});
  Tensor r = x.index({i0, Slice(), i2});
  ASSERT_EQ(shape(r), (Shape{3, 4}));
  const IVec a = {2, 0, 1}, c = {1, 4, 3};
  const Vec rv = vals(r);
  for (int64_t b = 0; b < 3; ++b) {
    for (int64_t m = 0; m < 4; ++m) EXPECT_EQ(rv[b * 4 + m], xv[(a[b] * 4 + m) * 5 + c[b]]);
  }
  // With a None between them as well: still broadcast dims first.
  EXPECT_EQ(shape(x.index({i0, None, Slice(), i2})), (Shape{3, 1, 4}));
}

TEST(IndexTest, BoolMasks) {
  Tensor x = make({3, 4, 5});
  const Vec xv = vals(x);
  Tensor mask = positive(make({3, 4}, kInt64, 7));
  const Vec mv = vals(mask);
  Tensor r = x.index({mask});
  int64_t n = 0;
  for (double m : mv) n += m != 0;
  ASSERT_EQ(shape(r), (Shape{n, 5}));
  const Vec rv = vals(r);
  int64_t row = 0;
  for (int64_t i = 0; i < 12; ++i) {
    if (mv[i] == 0) continue;
    for (int64_t k = 0; k < 5; ++k) EXPECT_EQ(rv[row * 5 + k], xv[i * 5 + k]);
    ++row;
  }
  // A mask over the trailing dims, and one that matches nothing.
  Tensor m2 = zeros({4, 5}, kBool);
  m2.index_put_({1, 2}, true);
  m2.index_put_({3, 0}, true);
  Tensor r2 = x.index({Slice(), m2});
  ASSERT_EQ(shape(r2), (Shape{3, 2}));
  EXPECT_EQ(vals(r2), (Vec{xv[7], xv[15], xv[27], xv[35], xv[47], xv[55]}));
  EXPECT_EQ(shape(x.index({zeros({3}, kBool)})), (Shape{0, 4, 5}));
  EXPECT_KILN_ERROR(x.index({zeros({4}, kBool)}),
                    "[index] the shape of the mask [4] at index 0 "
                    "does not match the shape of the indexed tensor");
}

TEST(IndexTest, NonContiguousSelfAndIndex) {
  Tensor base = make({5, 6});
  Tensor x = base.t();  // [6, 5], strides [1, 6]
  const Vec xv = vals(x);
  Tensor idx = ints({0, 5, 2, 3, 1, 4}, {2, 3}).t();  // [3, 2] transposed
  const Vec iv = vals(idx);
  Tensor r = x.index({idx, Slice(1, 4)});
  ASSERT_EQ(shape(r), (Shape{3, 2, 3}));
  const Vec rv = vals(r);
  for (int64_t i = 0; i < 6; ++i) {
    for (int64_t k = 0; k < 3; ++k) {
      EXPECT_EQ(rv[i * 3 + k], xv[static_cast<int64_t>(iv[i]) * 5 + 1 + k]);
    }
  }
}

TEST(IndexTest, EmptyAndErrors) {
  Tensor x = make({3, 4});
  EXPECT_EQ(shape(x.index({empty({0}, kInt64)})), (Shape{0, 4}));
  EXPECT_EQ(shape(x.index({Slice(), empty({2, 0}, kInt64)})), (Shape{3, 2, 0}));
  EXPECT_EQ(shape(zeros({0, 4}).index({Slice(), ints({1, 2})})), (Shape{0, 2}));
  EXPECT_KILN_ERROR(x[ints({0, 5})],
                    "[index] index 5 is out of bounds for dimension 0 with size 3");
  EXPECT_KILN_ERROR(x[ints({-4})], "[index] index -4 is out of bounds for dimension 0 with size 3");
  EXPECT_KILN_ERROR(x.index({ints({0, 1}), ints({0, 1, 2})}),
                    "[index] shapes [2] and [3] cannot be broadcast");
  EXPECT_KILN_ERROR(zeros({0}).index({ints({0})}),
                    "[index] index 0 is out of bounds for dimension 0 with size 0");
}

TEST(IndexTest, LargeGatherGoesParallel) {
  Tensor x = make({512, 130});
  const Vec xv = vals(x);
  const Vec rows = random_values(400, 3, 0, 512);
  Tensor idx = tensor(rows, kDouble).to(kInt64);
  Tensor r = x[idx];
  ASSERT_EQ(shape(r), (Shape{400, 130}));
  const Vec rv = vals(r);
  for (int64_t i = 0; i < 400; ++i) {
    for (int64_t k = 0; k < 130; ++k) {
      ASSERT_EQ(rv[i * 130 + k], xv[static_cast<int64_t>(rows[i]) * 130 + k]);
    }
  }
}

// --- index_put_ -------------------------------------------------------------------------------

TEST(IndexPutTest, BasicIndicesWriteThroughViews) {
  Tensor x = zeros({3, 4});
  const uint64_t v0 = x._version();
  x.index_put_({Slice(), 0}, 5);
  x.index_put_({1}, tensor({1.0, 2.0, 3.0, 4.0}));
  x.index_put_({-1, Slice(2)}, tensor({{7.0, 8.0}}));  // leading size-1 dims are dropped
  EXPECT_EQ(vals(x), (Vec{5, 0, 0, 0, 1, 2, 3, 4, 5, 0, 7, 8}));
  EXPECT_GT(x._version(), v0);
  EXPECT_KILN_ERROR(x.index_put_({0}, zeros({3})), "[copy_]");
  EXPECT_KILN_ERROR(x.index_put_({4}, 1), "[index_put_] index 4 is out of bounds for dimension 0");
}

TEST(IndexPutTest, AdvancedIndicesAndMasks) {
  for (ScalarType dt : kDtypes) {
    Tensor x = zeros({3, 4}, dt);
    x.index_put_({ints({2, 0}), ints({-1, 1})}, tensor({1, 1}).to(dt));
    x.index_put_({Slice(), ints({2})}, ones({3, 1}, dt));
    Vec want(12, 0);
    want[2 * 4 + 3] = want[0 * 4 + 1] = 1;
    want[2] = want[6] = want[10] = 1;
    EXPECT_EQ(vals(x), want) << dtype_name(dt);
  }
  Tensor y = arange(12, kFloat).reshape({3, 4});
  y.index_put_({positive(arange(-5, 7).reshape({3, 4}))}, -1.0);
  EXPECT_EQ(vals(y), (Vec{0, 1, 2, 3, 4, 5, -1, -1, -1, -1, -1, -1}));
  // Broadcast value row into selected rows; non-contiguous destination writes through.
  Tensor base = zeros({4, 3});
  Tensor t = base.t();  // [3, 4]
  t.index_put_({ints({0, 2})}, tensor({1.0, 2.0, 3.0, 4.0}));
  EXPECT_EQ(vals(base), (Vec{1, 0, 1, 2, 0, 2, 3, 0, 3, 4, 0, 4}));
}

TEST(IndexPutTest, AccumulateThroughTheRegistryOp) {
  Tensor x = zeros({4});
  OpCall call;
  call.op = &Registry::get().op("index_put_");
  call.inputs = {x, tensor({1.0, 2.0, 3.0}), ints({1, 1, -1})};
  call.attrs = {Shape{0}, true};
  dispatch(call);
  EXPECT_EQ(vals(x), (Vec{0, 3, 0, 3}));
}

TEST(IndexPutTest, Errors) {
  Tensor x = zeros({3, 4});
  EXPECT_KILN_ERROR(x.index_put_({ints({0})}, zeros({4}, kDouble)),
                    "[index_put_] index put requires the source and destination dtypes match");
  EXPECT_KILN_ERROR(x.index_put_({ints({0, 1})}, zeros({3, 4})),
                    "[index_put_] shape mismatch: value tensor of shape [3, 4] cannot be broadcast "
                    "to indexing result of shape [2, 4]");
  EXPECT_KILN_ERROR(x.index_put_({ints({3})}, 1.0),
                    "[index_put_] index 3 is out of bounds for dimension 0 with size 3");
  EXPECT_KILN_ERROR(x.index_put_({ones({1})}, 1.0), "[index_put_] tensors used as indices");
}

// --- index_select, embedding ------------------------------------------------------------------

TEST(IndexSelectTest, MatchesReference) {
  for (ScalarType dt : kDtypes) {
    Tensor x = make({3, 4, 5}, dt).transpose(0, 2);  // [5, 4, 3], non-contiguous
    const Vec xv = vals(x);
    for (int64_t dim = -3; dim < 3; ++dim) {
      const int64_t d = dim < 0 ? dim + 3 : dim;
      Tensor idx = ints({2, 0, 2});
      if (dim == 1) idx = tensor(std::vector<int32_t>{2, 0, 2}, kInt32);
      Tensor r = x.index_select(dim, idx);
      Shape want = shape(x);
      want[d] = 3;
      ASSERT_EQ(shape(r), want);
      const Vec rv = vals(r);
      for (int64_t i = 0; i < r.numel(); ++i) {
        IVec o = unravel(i, r.sizes());
        o[d] = IVec{2, 0, 2}[o[d]];
        ASSERT_EQ(rv[i], xv[ravel(o, x.sizes())]) << dtype_name(dt) << " dim " << dim;
      }
    }
  }
  // Strided index, empty index, 0-d index, 0-d self, and a large table.
  Tensor x = arange(12, kFloat).reshape({4, 3});
  EXPECT_EQ(vals(x.index_select(0, ints({3, 9, 1, 9}).slice(0, 0, 4, 2))),
            (Vec{9, 10, 11, 3, 4, 5}));
  EXPECT_EQ(shape(x.index_select(1, empty({0}, kInt64))), (Shape{4, 0}));
  EXPECT_EQ(shape(x.index_select(0, ints({2}).reshape({}))), (Shape{1, 3}));
  EXPECT_EQ(vals(tensor(2.5).index_select(0, ints({0}))), (Vec{2.5}));
  Tensor big = make({300, 200});
  Tensor rb = big.index_select(0, ints({299, 0, 150}));
  EXPECT_EQ(vals(rb.index({1})), vals(big.index({0})));
  EXPECT_EQ(vals(rb.index({0})), vals(big.index({299})));
}

TEST(IndexSelectTest, Errors) {
  Tensor x = zeros({3, 4});
  EXPECT_KILN_ERROR(x.index_select(0, ints({3})),
                    "[index_select] index 3 is out of bounds for dimension 0 with size 3");
  EXPECT_KILN_ERROR(x.index_select(1, ints({-1})), "[index_select] index -1 is out of bounds");
  EXPECT_KILN_ERROR(x.index_select(0, ints({0, 1}, {1, 2})),
                    "[index_select] index is supposed to be a vector");
  EXPECT_KILN_ERROR(x.index_select(0, zeros({1})), "[index_select] expected dtype int64 or int32");
  EXPECT_KILN_ERROR(x.index_select(2, ints({0})), "[index_select]");
  EXPECT_KILN_ERROR(tensor(1.0).index_select(0, ints({0, 0})),
                    "[index_select] index to a 0-d tensor");
}

TEST(EmbeddingTest, LooksUpRows) {
  for (ScalarType dt : {kFloat, kBFloat16, kDouble}) {
    Tensor w = make({6, 4}, dt);
    const Vec wv = vals(w);
    Tensor idx = ints({5, 0, 3, 3, 1, 2}, {2, 3});
    Tensor r = embedding(w, idx);
    ASSERT_EQ(shape(r), (Shape{2, 3, 4}));
    const Vec rv = vals(r);
    const IVec iv = {5, 0, 3, 3, 1, 2};
    for (int64_t i = 0; i < 6; ++i) {
      for (int64_t k = 0; k < 4; ++k) EXPECT_EQ(rv[i * 4 + k], wv[iv[i] * 4 + k]);
    }
  }
  // Transposed weight, int32 and 0-d and empty indices.
  Tensor w = arange(12, kFloat).reshape({3, 4}).t();  // [4, 3]
  EXPECT_EQ(vals(embedding(w, tensor(std::vector<int32_t>{1}, kInt32))), (Vec{1, 5, 9}));
  EXPECT_EQ(shape(embedding(w, ints({2}).reshape({}))), (Shape{3}));
  EXPECT_EQ(shape(embedding(w, empty({0, 2}, kInt64))), (Shape{0, 2, 3}));
  EXPECT_KILN_ERROR(embedding(w, ints({4})),
                    "[embedding] index 4 is out of bounds for dimension 0 with size 4");
  EXPECT_KILN_ERROR(embedding(w, ints({-1})), "[embedding] index -1 is out of bounds");
  EXPECT_KILN_ERROR(embedding(zeros({4}), ints({0})), "[embedding] 'weight' must be 2-D");
  EXPECT_KILN_ERROR(embedding(w, zeros({2})), "[embedding] expected dtype int64 or int32");
}

// --- gather, scatter, scatter_add, index_add --------------------------------------------------

TEST(GatherTest, MatchesReferenceOnEveryDim) {
  for (ScalarType dt : kDtypes) {
    Tensor x = make({4, 5, 3}, dt, 2).permute({2, 0, 1});  // [3, 4, 5], non-contiguous
    const Vec xv = vals(x);
    for (int64_t dim = 0; dim < 3; ++dim) {
      Shape isz{2, 3, 4};
      isz[dim] = 6;  // longer than self along dim is fine
      Tensor idx = tensor(random_values(numel_of(isz), 9 + dim, 0, x.sizes()[dim]), kDouble)
                       .to(kInt64)
                       .reshape(isz);
      const Vec iv = vals(idx);
      Tensor r = x.gather(dim - 3, idx);
      ASSERT_EQ(shape(r), isz);
      const Vec rv = vals(r);
      for (int64_t i = 0; i < r.numel(); ++i) {
        IVec o = unravel(i, isz);
        o[dim] = static_cast<int64_t>(iv[i]);
        ASSERT_EQ(rv[i], xv[ravel(o, x.sizes())]) << dtype_name(dt) << " dim " << dim;
      }
    }
  }
  // Transposed index, 0-d and empty.
  Tensor x = arange(6, kFloat).reshape({2, 3});
  Tensor idx = ints({2, 0, 1, 1}, {2, 2}).t();  // [[2, 1], [0, 1]]
  EXPECT_EQ(vals(x.gather(1, idx)), (Vec{2, 1, 3, 4}));
  EXPECT_EQ(vals(tensor(4.0).gather(0, ints({0}).reshape({}))), (Vec{4}));
  EXPECT_EQ(shape(x.gather(0, empty({0, 3}, kInt64))), (Shape{0, 3}));
  // Large enough for several threads.
  Tensor big = make({256, 160});
  Tensor bi = tensor(random_values(256 * 160, 4, 0, 160), kDouble).to(kInt64).reshape({256, 160});
  const Vec bv = vals(big), biv = vals(bi), br = vals(big.gather(1, bi));
  for (int64_t i = 0; i < 256 * 160; ++i)
    ASSERT_EQ(br[i], bv[(i / 160) * 160 + static_cast<int64_t>(biv[i])]);
}

TEST(GatherTest, Errors) {
  Tensor x = zeros({3, 4});
  EXPECT_KILN_ERROR(x.gather(1, ints({4}, {1, 1})),
                    "[gather] index 4 is out of bounds for dimension 1 with size 4");
  EXPECT_KILN_ERROR(x.gather(1, ints({-1}, {1, 1})), "[gather] index -1 is out of bounds");
  EXPECT_KILN_ERROR(x.gather(0, ints({0})),
                    "[gather] index tensor must have the same number of dimensions");
  EXPECT_KILN_ERROR(
      x.gather(0, zeros({4, 5}, kInt64)),
      "[gather] expected index [4, 5] to be no larger than self [3, 4] apart from dimension 0");
  EXPECT_KILN_ERROR(x.gather(0, zeros({1, 1}, kInt32)), "[gather] expected dtype int64 for index");
  EXPECT_KILN_ERROR(x.gather(2, zeros({1, 1}, kInt64)), "[gather]");
}

// Reference scatter along `dim` of 2-D tensors: self[idx[i][j] at dim] (op)= src[i][j].
Vec scatter_reference(Vec self, IntArrayRef ssz, const Vec& idx, IntArrayRef isz, const Vec& src,
                      IntArrayRef srcsz, int64_t dim, bool add) {
  for (int64_t i = 0; i < isz[0]; ++i) {
    for (int64_t j = 0; j < isz[1]; ++j) {
      IVec t{i, j};
      t[dim] = static_cast<int64_t>(idx[i * isz[1] + j]);
      double& to = self[ravel(t, ssz)];
      const double v = src[i * srcsz[1] + j];
      to = add ? to + v : v;
    }
  }
  return self;
}

TEST(ScatterTest, MatchesReference) {
  for (ScalarType dt : {kFloat, kDouble, kBFloat16, kInt64}) {
    for (int64_t dim = 0; dim < 2; ++dim) {
      Tensor self = make({4, 5}, dt, 3);
      Tensor src = make({3, 6}, dt, 4);
      Shape isz{3, 4};
      // Distinct indices along dim for plain scatter (repeats would make the winner unspecified).
      Tensor idx = dim == 0 ? ints({0, 1, 2, 3, 3, 2, 1, 0, 1, 3, 0, 2}, isz)
                            : ints({4, 0, 2, 1, 0, 1, 2, 3, 3, 4, 0, 1}, isz);
      const Vec want = scatter_reference(vals(self), self.sizes(), vals(idx), isz, vals(src),
                                         src.sizes(), dim, false);
      EXPECT_EQ(vals(self.scatter(dim, idx, src)), want) << dtype_name(dt);
      Tensor inplace = self.clone();
      inplace.scatter_(dim, idx, src);
      EXPECT_EQ(vals(inplace), want);
      // scatter_add with repeated indices.
      Tensor rep = ints({0, 0, 1, 1, 2, 2, 2, 2, 3, 0, 3, 0}, isz);
      const Vec want_add = scatter_reference(vals(self), self.sizes(), vals(rep), isz, vals(src),
                                             src.sizes(), dim, true);
      const Vec got = vals(self.scatter_add(dim, rep, src));
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_NEAR(got[i], want_add[i], dt == kBFloat16 ? 0.25 : 1e-9) << dtype_name(dt);
      }
    }
  }
}

TEST(ScatterTest, ValueInplaceAndNonContiguous) {
  Tensor base = zeros({4, 3});
  Tensor t = base.t();  // [3, 4]
  const uint64_t v0 = base._version();
  t.scatter_(1, ints({3, 0, 1}, {3, 1}), 7);
  EXPECT_EQ(vals(t), (Vec{0, 0, 0, 7, 7, 0, 0, 0, 0, 7, 0, 0}));
  EXPECT_GT(base._version(), v0);
  Tensor s = zeros({2, 3}, kBool).scatter(0, ints({1, 0, 1}, {1, 3}), true);
  EXPECT_EQ(vals(s), (Vec{0, 1, 0, 1, 0, 1}));
  Tensor acc = zeros({3});
  acc.scatter_add_(0, ints({0, 2, 0, 0}), tensor({1.0, 2.0, 3.0, 4.0}));
  EXPECT_EQ(vals(acc), (Vec{8, 0, 2}));
  // Transposed index and src.
  Tensor idx = ints({0, 1, 1, 0}, {2, 2}).t();
  Tensor src = tensor({{1.0, 2.0}, {3.0, 4.0}}).t();  // [[1, 3], [2, 4]]
  EXPECT_EQ(vals(zeros({2, 2}).scatter(1, idx, src)), (Vec{1, 3, 4, 2}));
  // Empty index: a copy of self; 0-d.
  EXPECT_EQ(vals(ones({2}).scatter(0, empty({0}, kInt64), 5)), (Vec{1, 1}));
  EXPECT_EQ(vals(tensor(1.0).scatter(0, ints({0}).reshape({}), 3)), (Vec{3}));
}

TEST(ScatterTest, Errors) {
  Tensor x = zeros({3, 4});
  EXPECT_KILN_ERROR(x.scatter(0, ints({3}, {1, 1}), zeros({1, 1})),
                    "[scatter] index 3 is out of bounds for dimension 0 with size 3");
  EXPECT_KILN_ERROR(x.scatter(0, ints({0}, {1, 1}), zeros({1, 1}, kDouble)),
                    "[scatter] expected self.dtype to be equal to src.dtype");
  EXPECT_KILN_ERROR(x.scatter(0, zeros({2, 2}, kInt64), zeros({1, 4})),
                    "[scatter] expected index [2, 2] to be no larger than src [1, 4]");
  EXPECT_KILN_ERROR(x.scatter(1, zeros({4, 1}, kInt64), 1.0),
                    "[scatter_value] expected index [4, 1] to be no larger than self [3, 4] apart "
                    "from dimension 1");
  EXPECT_KILN_ERROR(x.scatter_(0, zeros({1}, kInt64), 1.0),
                    "[scatter_value_] index tensor must have the same number of dimensions");
  EXPECT_KILN_ERROR(x.scatter_(0, zeros({1, 1}, kInt32), zeros({1, 1})),
                    "[scatter_] expected dtype int64 for index");
  EXPECT_KILN_ERROR(x.scatter_add(0, ints({-1}, {1, 1}), zeros({1, 1})),
                    "[scatter_add] index -1 is out of bounds");
  EXPECT_KILN_ERROR(x.scatter_add_(5, ints({0}, {1, 1}), zeros({1, 1})), "[scatter_add_]");
}

TEST(IndexAddTest, MatchesReference) {
  for (ScalarType dt : {kFloat, kDouble, kBFloat16, kInt64}) {
    for (int64_t dim = 0; dim < 3; ++dim) {
      Tensor self = make({3, 4, 2}, dt, 5);
      Shape ssz{3, 4, 2};
      ssz[dim] = 5;
      Tensor src = make(ssz, dt, 6).transpose(0, 2).contiguous().transpose(0, 2);  // strided
      const IVec iv = {1, 0, 1, 1, 0};
      Tensor idx = dim == 1 ? tensor(std::vector<int32_t>{1, 0, 1, 1, 0}, kInt32) : ints(iv);
      const Scalar alpha = is_floating_point(dt) ? Scalar(0.5) : Scalar(2);
      Vec want = vals(self);
      const Vec sv = vals(src);
      for (int64_t i = 0; i < src.numel(); ++i) {
        IVec o = unravel(i, ssz);
        o[dim] = iv[o[dim]];
        want[ravel(o, self.sizes())] += alpha.toDouble() * sv[i];
      }
      const Vec got = vals(self.index_add(dim, idx, src, alpha));
      Tensor inplace = self.clone();
      inplace.index_add_(dim - 3, idx, src, alpha);
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_NEAR(got[i], want[i], dt == kBFloat16 ? 0.25 : 1e-9) << dtype_name(dt);
      }
      EXPECT_EQ(vals(inplace), got);
    }
  }
  EXPECT_EQ(vals(zeros({2}).index_add(0, empty({0}, kInt64), zeros({0}))), (Vec{0, 0}));
  EXPECT_EQ(vals(tensor(1.0).index_add(0, ints({0}), tensor(2.0))), (Vec{3}));
}

TEST(IndexAddTest, Errors) {
  Tensor x = zeros({3, 4});
  EXPECT_KILN_ERROR(x.index_add(0, ints({3}), zeros({1, 4})),
                    "[index_add] index 3 is out of bounds for dimension 0 with size 3");
  EXPECT_KILN_ERROR(x.index_add(0, ints({0, 1}), zeros({1, 4})),
                    "[index_add] number of indices (2) should be equal to source.size(0) (1)");
  EXPECT_KILN_ERROR(
      x.index_add(0, ints({0}), zeros({1, 3})),
      "[index_add] source of shape [1, 3] must match self of shape [3, 4] except in dimension 0");
  EXPECT_KILN_ERROR(x.index_add(0, ints({0}), zeros({1, 4}, kDouble)),
                    "[index_add] self (float32) and source (float64) must have the same dtype");
  EXPECT_KILN_ERROR(x.index_add_(0, ints({0}, {1, 1}), zeros({1, 4})),
                    "[index_add_] index is supposed to be a vector");
  EXPECT_KILN_ERROR(x.index_add_(0, zeros({1}), zeros({1, 4})),
                    "[index_add_] expected dtype int64 or int32");
  EXPECT_KILN_ERROR(
      zeros({2}, kInt64).index_add(0, ints({0}), zeros({1}, kInt64), 0.5),
      "[index_add] for integral input tensors, argument alpha must not be a floating point number");
}

// --- masked_fill, masked_select -------------------------------------------------------------

TEST(MaskedTest, FillBroadcastsAndWritesInPlace) {
  for (ScalarType dt : kDtypes) {
    Tensor x = make({3, 4}, dt);
    const Vec xv = vals(x);
    Tensor mask = tensor({true, false, false, true});
    Tensor r = x.masked_fill(mask, 1);
    Vec want = xv;
    for (int64_t i = 0; i < 3; ++i) want[i * 4] = want[i * 4 + 3] = 1;
    EXPECT_EQ(vals(r), want) << dtype_name(dt);
    x.masked_fill_(mask, 1);
    EXPECT_EQ(vals(x), want);
  }
  // Functional broadcasts self too; in-place into a transposed view.
  EXPECT_EQ(shape(zeros({3, 1}).masked_fill(ones({1, 4}, kBool), 2.0)), (Shape{3, 4}));
  Tensor base = zeros({2, 3});
  base.t().masked_fill_(tensor({{true, false}, {false, false}, {false, true}}), -1.5);
  EXPECT_EQ(vals(base), (Vec{-1.5, 0, 0, 0, 0, -1.5}));
  EXPECT_EQ(vals(tensor(1.0).masked_fill(tensor(true), 3)), (Vec{3}));
  // Large.
  Tensor big = zeros({200, 200});
  Tensor bm = positive(make({200, 200}, kInt64, 8));
  const Vec bmv = vals(bm), got = vals(big.masked_fill(bm, 1.0));
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], bmv[i]);
}

TEST(MaskedTest, SelectAndErrors) {
  Tensor x = arange(6, kFloat).reshape({2, 3});
  EXPECT_EQ(vals(x.masked_select(tensor({{true, false, true}, {false, false, true}}))),
            (Vec{0, 2, 5}));
  EXPECT_EQ(vals(x.t().masked_select(tensor({true, false}))), (Vec{0, 1, 2}));
  EXPECT_EQ(vals(x.masked_select(tensor({{true}, {false}}))), (Vec{0, 1, 2}));
  Tensor bf = x.to(kBFloat16).masked_select(tensor({{false, false, false}, {true, true, true}}));
  EXPECT_EQ(bf.dtype(), kBFloat16);
  EXPECT_EQ(vals(bf), (Vec{3, 4, 5}));
  EXPECT_EQ(shape(x.masked_select(zeros({3}, kBool))), (Shape{0}));
  EXPECT_EQ(shape(zeros({0, 3}).masked_select(ones({3}, kBool))), (Shape{0}));
  EXPECT_KILN_ERROR(x.masked_select(ones({3})),
                    "[masked_select] expected a bool mask, got float32");
  EXPECT_KILN_ERROR(x.masked_select(ones({4}, kBool)), "[masked_select] shapes [2, 3] and [4]");
  EXPECT_KILN_ERROR(x.masked_fill(ones({3}, kInt64), 1),
                    "[masked_fill] expected a bool mask, got int64");
  EXPECT_KILN_ERROR(x.masked_fill(ones({4}, kBool), 1), "[masked_fill] shapes [2, 3] and [4]");
  EXPECT_KILN_ERROR(
      x.masked_fill_(ones({2, 2, 3}, kBool), 1),
      "[masked_fill_] mask of shape [2, 2, 3] cannot be broadcast to self of shape [2, 3]");
}

// --- triu, tril, one_hot --------------------------------------------------------------------

TEST(TriangleTest, MatchesReference) {
  for (ScalarType dt : kDtypes) {
    Tensor x = make({2, 5, 3}, dt).transpose(1, 2);  // [2, 3, 5] batched, non-contiguous
    const Vec xv = vals(x);
    for (int64_t diag : {-1, 0, 2, -5, 7}) {
      const Vec up = vals(x.triu(diag)), lo = vals(tril(x, diag));
      for (int64_t i = 0; i < x.numel(); ++i) {
        const IVec o = unravel(i, x.sizes());
        const int64_t off = o[2] - o[1];
        ASSERT_EQ(up[i], off >= diag ? xv[i] : 0) << dtype_name(dt) << " diag " << diag;
        ASSERT_EQ(lo[i], off <= diag ? xv[i] : 0) << dtype_name(dt) << " diag " << diag;
      }
    }
  }
  EXPECT_EQ(vals(ones({2, 2}).triu(1)), (Vec{0, 1, 0, 0}));
  EXPECT_EQ(shape(ones({0, 3}).tril()), (Shape{0, 3}));
  EXPECT_KILN_ERROR(ones({3}).triu(), "[triu] input tensor must have at least 2 dimensions");
  EXPECT_KILN_ERROR(tril(tensor(1.0)), "[tril] input tensor must have at least 2 dimensions");
}

TEST(OneHotTest, EncodesAndInfers) {
  Tensor r = one_hot(ints({2, 0, 1, 2}, {2, 2}), 4);
  EXPECT_EQ(r.dtype(), kInt64);
  EXPECT_EQ(shape(r), (Shape{2, 2, 4}));
  EXPECT_EQ(vals(r), (Vec{0, 0, 1, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0}));
  EXPECT_EQ(shape(one_hot(ints({3, 1}))), (Shape{2, 4}));
  EXPECT_EQ(vals(one_hot(ints({1}).reshape({}))), (Vec{0, 1}));
  EXPECT_EQ(shape(one_hot(empty({0}, kInt64), 3)), (Shape{0, 3}));
  EXPECT_EQ(vals(one_hot(ints({0, 2, 1}).slice(0, 0, 3, 2), 3)), (Vec{1, 0, 0, 0, 1, 0}));
  EXPECT_KILN_ERROR(one_hot(ints({-1}), 3), "[one_hot] class values must be non-negative");
  EXPECT_KILN_ERROR(one_hot(ints({-1})), "[one_hot] class values must be non-negative");
  EXPECT_KILN_ERROR(one_hot(ints({3}), 3),
                    "[one_hot] class values must be smaller than num_classes (3)");
  EXPECT_KILN_ERROR(one_hot(empty({0}, kInt64)),
                    "[one_hot] cannot infer the total number of classes");
  EXPECT_KILN_ERROR(one_hot(tensor(std::vector<int32_t>{1}, kInt32), 3),
                    "[one_hot] is only applicable to index tensors of dtype int64");
  EXPECT_KILN_ERROR(one_hot(ints({1}), -2), "[one_hot] num_classes must be non-negative");
}

}  // namespace
}  // namespace kiln
