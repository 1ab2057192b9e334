// sort, argsort and topk against std::stable_sort references: every dim, both directions,
// stability with ties, NaN placement, dtypes, non-contiguous, empty and 0-d inputs, a large
// multi-threaded case, and every misuse.
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "test_util.h"

namespace kiln {
namespace {

using Vec = std::vector<double>;
using IVec = std::vector<int64_t>;

// Values with many ties: integers in [-4, 4).
Tensor make(IntArrayRef sizes, ScalarType dt, uint64_t seed) {
  Vec v(static_cast<size_t>(numel_of(sizes)));
  uint64_t s = seed * 2862933555777941757ULL + 3037000493ULL;
  for (double& x : v) {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    x = static_cast<double>(static_cast<int64_t>(s >> 33) % 8) - 4;
  }
  return tensor(v, kDouble).reshape(sizes).to(dt);
}
Vec vals(const Tensor& t) { return t.to_vector<double>(); }
IVec ivals(const Tensor& t) { return t.to_vector<int64_t>(); }
Shape shape(const Tensor& t) { return to_shape(t.sizes()); }

bool less_nan_last(double a, double b) { return std::isnan(b) ? !std::isnan(a) : a < b; }

// Stable order of row positions of x (contiguous, [outer, n, inner]) along the middle dim.
struct Sorted {
  Vec values;
  IVec indices;
};
Sorted reference(const Tensor& x, int64_t dim, bool descending, int64_t k = -1) {
  const Vec v = vals(x);
  const int64_t n = x.dim() == 0 ? 1 : x.sizes()[dim];
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= x.sizes()[d];
  for (int64_t d = dim + 1; d < x.dim(); ++d) inner *= x.sizes()[d];
  if (k < 0) k = n;
  Sorted s{Vec(static_cast<size_t>(outer * k * inner)),
           IVec(static_cast<size_t>(outer * k * inner))};
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t i = 0; i < inner; ++i) {
      IVec p(static_cast<size_t>(n));
      std::iota(p.begin(), p.end(), 0);
      auto at = [&](int64_t j) { return v[(o * n + j) * inner + i]; };
      std::stable_sort(p.begin(), p.end(), [&](int64_t a, int64_t b) {
        return descending ? less_nan_last(at(b), at(a)) : less_nan_last(at(a), at(b));
      });
      for (int64_t j = 0; j < k; ++j) {
        s.values[(o * k + j) * inner + i] = at(p[j]);
        s.indices[(o * k + j) * inner + i] = p[j];
      }
    }
  }
  return s;
}

void expect_same(const Vec& got, const Vec& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(got[i])) << i;
    } else {
      EXPECT_EQ(got[i], want[i]) << i;
    }
  }
}

TEST(SortTest, EveryDimBothDirectionsStable) {
  for (ScalarType dt : {kFloat, kDouble, kBFloat16, kInt64, kInt32, kUInt8, kBool}) {
    Tensor x = make({4, 6, 5}, dt, 1);
    for (int64_t dim = -3; dim < 3; ++dim) {
      const int64_t d = dim < 0 ? dim + 3 : dim;
      for (bool desc : {false, true}) {
        auto [values, indices] = x.sort(dim, desc, /*stable=*/true);
        EXPECT_EQ(values.dtype(), dt);
        EXPECT_EQ(indices.dtype(), kInt64);
        ASSERT_EQ(shape(values), shape(x));
        const Sorted want = reference(x, d, desc);
        expect_same(vals(values), want.values);
        EXPECT_EQ(ivals(indices), want.indices) << dtype_name(dt) << " dim " << dim;
        EXPECT_EQ(ivals(argsort(x, dim, desc, true)), want.indices);
      }
    }
  }
}

TEST(SortTest, NanSortsAsLargestAndNonContiguous) {
  Tensor x = tensor({3.0, NAN, -1.0, NAN, 2.0, -INFINITY});
  auto [v, i] = sort(x);
  expect_same(vals(v), Vec{-INFINITY, -1, 2, 3, NAN, NAN});
  EXPECT_EQ(ivals(i), (IVec{5, 2, 4, 0, 1, 3}));
  auto [vd, id] = x.sort(0, /*descending=*/true, /*stable=*/true);
  expect_same(vals(vd), Vec{NAN, NAN, 3, 2, -1, -INFINITY});
  EXPECT_EQ(ivals(id), (IVec{1, 3, 0, 4, 2, 5}));
  // Transposed input, sorted along its (strided) last dim.
  Tensor base = make({7, 3}, kFloat, 3);
  Tensor t = base.t();
  auto [tv, ti] = t.sort(-1);
  const Sorted want = reference(t.contiguous(), 1, false);
  expect_same(vals(tv), want.values);
  EXPECT_EQ(ivals(ti), want.indices);
}

TEST(SortTest, EmptyZeroDimAndLarge) {
  auto [ev, ei] = empty({3, 0}).sort(1);
  EXPECT_EQ(shape(ev), (Shape{3, 0}));
  EXPECT_EQ(shape(ei), (Shape{3, 0}));
  auto [sv, si] = tensor(2.5).sort();
  EXPECT_EQ(vals(sv), (Vec{2.5}));
  EXPECT_EQ(ivals(si), (IVec{0}));
  EXPECT_EQ(shape(si), (Shape{}));
  Tensor big = make({256, 160}, kFloat, 5);
  auto [bv, bi] = big.sort(1, true);
  const Sorted want = reference(big, 1, true);
  EXPECT_EQ(vals(bv), want.values);
  EXPECT_EQ(ivals(bi), want.indices);
  EXPECT_KILN_ERROR(zeros({2, 3}).sort(2), "[sort]");
  EXPECT_KILN_ERROR(zeros({2, 3}).argsort(-3), "[sort]");
}

TEST(TopkTest, LargestAndSmallest) {
  for (ScalarType dt : {kFloat, kDouble, kBFloat16, kInt64, kBool}) {
    Tensor x = make({5, 7}, dt, 2).t();  // [7, 5], non-contiguous
    for (int64_t dim : {0, 1, -1}) {
      const int64_t d = dim < 0 ? dim + 2 : dim;
      for (bool largest : {true, false}) {
        for (int64_t k : {int64_t{0}, int64_t{1}, int64_t{3}, x.sizes()[d]}) {
          auto [v, i] = x.topk(k, dim, largest);
          Shape want_shape = shape(x);
          want_shape[d] = k;
          ASSERT_EQ(shape(v), want_shape);
          // Ties resolve to the lower position, as the stable reference does.
          const Sorted want = reference(x.contiguous(), d, largest, k);
          expect_same(vals(v), want.values);
          EXPECT_EQ(ivals(i), want.indices) << dtype_name(dt) << " k " << k;
        }
      }
    }
  }
  auto [nv, ni] = topk(tensor({1.0, NAN, 5.0}), 2);
  expect_same(vals(nv), Vec{NAN, 5});
  EXPECT_EQ(ivals(ni), (IVec{1, 2}));
  auto [sv, si] = tensor(4.0).topk(1);
  EXPECT_EQ(vals(sv), (Vec{4}));
  EXPECT_EQ(shape(si), (Shape{}));
  Tensor big = make({64, 1024}, kFloat, 7);
  auto [bv, bi] = big.topk(10, 1, false);
  const Sorted want = reference(big, 1, false, 10);
  EXPECT_EQ(vals(bv), want.values);
  EXPECT_EQ(ivals(bi), want.indices);
}

TEST(TopkTest, Errors) {
  Tensor x = zeros({2, 3});
  EXPECT_KILN_ERROR(x.topk(4), "[topk] selected index k out of range: k = 4 but dimension 1");
  EXPECT_KILN_ERROR(x.topk(-1), "[topk] selected index k out of range");
  EXPECT_KILN_ERROR(x.topk(3, 0), "[topk] selected index k out of range: k = 3 but dimension 0");
  EXPECT_KILN_ERROR(x.topk(1, 2), "[topk]");
  EXPECT_KILN_ERROR(tensor(1.0).topk(2), "[topk] selected index k out of range");
}

}  // namespace
}  // namespace kiln
