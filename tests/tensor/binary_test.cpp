// Binary elementwise ops against f64 reference loops: type promotion, broadcasting, strided,
// expanded, 0-d, empty and multi-threaded inputs, each dtype, in-place forms and every error.
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numbers>
#include <vector>

#include "test_util.h"

namespace kiln {
namespace {

constexpr ScalarType kNumeric[] = {kFloat, kDouble, kHalf, kBFloat16, kInt32, kInt64};

// Deterministic test values: multiples of 1/8 in [-6, 6) for floats (exact in every float
// dtype), integers in [-6, 6) otherwise; `nonzero` skips 0 (divisors).
Tensor make(IntArrayRef shape, ScalarType dt, uint64_t seed, bool nonzero = false) {
  std::vector<double> v(static_cast<size_t>(numel_of(shape)));
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (double& x : v) {
    do {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      const int64_t r = static_cast<int64_t>((s >> 33) % 96) - 48;
      x = is_floating_point(dt) ? r / 8.0 : static_cast<double>(r / 8);
    } while (nonzero && x == 0);
  }
  return from_blob(v.data(), shape, kDouble).to(dt, /*copy=*/true);
}

// Elements of `t` broadcast to `shape`, row-major, as doubles.
std::vector<double> values(const Tensor& t, IntArrayRef shape) {
  return t.expand(shape).to_vector<double>();
}

double tolerance(ScalarType dt) {
  switch (dt) {
    case kHalf: return 1e-3;
    case kBFloat16: return 8e-3;
    case kFloat: return 1e-6;
    case kDouble: return 1e-12;
    default: return 0;
  }
}

// out[i] == ref(a[i], b[i]) (relative tolerance `tol`), a and b broadcast to out's shape.
::testing::AssertionResult matches(const Tensor& out, const Tensor& a, const Tensor& b,
                                   const std::function<double(double, double)>& ref, double tol) {
  const std::vector<double> va = values(a, out.sizes()), vb = values(b, out.sizes());
  const std::vector<double> vo = out.to_vector<double>();
  if (vo.size() != va.size()) return ::testing::AssertionFailure() << "size mismatch";
  if (vo.empty()) return ::testing::AssertionFailure() << "nothing compared";
  for (size_t i = 0; i < vo.size(); ++i) {
    const double e = ref(va[i], vb[i]);
    const bool ok = std::isnan(e)
                        ? std::isnan(vo[i])
                        : (vo[i] == e || std::abs(vo[i] - e) <= tol * std::max(1.0, std::abs(e)));
    if (!ok) {
      return ::testing::AssertionFailure() << "element " << i << ": got " << vo[i] << ", expected "
                                           << e << " from " << va[i] << " and " << vb[i];
    }
  }
  return ::testing::AssertionSuccess();
}

double trunc_div(double x, double y) { return std::trunc(x / y); }
double floor_div(double x, double y) { return std::floor(x / y); }

TEST(BinaryReferenceTest, DetectsWrongResults) {
  Tensor a = make({3, 4}, kFloat, 1), b = make({4}, kFloat, 2);
  EXPECT_TRUE(matches(a + b, a, b, std::plus<double>(), 0));
  EXPECT_FALSE(matches(a + b, a, b, std::minus<double>(), 1e-3));
  EXPECT_FALSE(matches(zeros({0}), zeros({0}), zeros({0}), std::plus<double>(), 0));
}

// --- Type promotion --------------------------------------------------------------------------

TEST(BinaryResultTypeTest, TensorsFollowPromoteTypes) {
  constexpr ScalarType kAll[] = {kBool, kUInt8, kInt32, kInt64, kHalf, kBFloat16, kFloat, kDouble};
  for (ScalarType x : kAll) {
    for (ScalarType y : kAll) {
      EXPECT_EQ(result_type(zeros({2}, x), zeros({2}, y)), promote_types(x, y));
      EXPECT_EQ(result_type(zeros({}, x), zeros({}, y)), promote_types(x, y));
      EXPECT_EQ((zeros({2}, x) == zeros({2}, y)).dtype(), kBool);
    }
  }
  EXPECT_EQ((zeros({2}, kInt32) + zeros({2}, kBFloat16)).dtype(), kBFloat16);
  EXPECT_EQ((zeros({2}, kHalf) * zeros({2}, kBFloat16)).dtype(), kFloat);
}

TEST(BinaryResultTypeTest, ZeroDimTensorsAndScalarsRankLower) {
  // A 0-d tensor only counts when it is of a higher category.
  EXPECT_EQ(result_type(zeros({3}, kFloat), zeros({}, kDouble)), kFloat);
  EXPECT_EQ(result_type(zeros({3}, kInt32), zeros({}, kInt64)), kInt32);
  EXPECT_EQ(result_type(zeros({3}, kInt32), zeros({}, kDouble)), kDouble);
  EXPECT_EQ(result_type(zeros({3}, kBool), zeros({}, kInt32)), kInt32);
  EXPECT_EQ(result_type(zeros({3}, kHalf), zeros({}, kDouble)), kHalf);
  EXPECT_EQ((zeros({3}, kFloat) + zeros({}, kDouble)).dtype(), kFloat);
  // Scalars: floats count as the default dtype, integers as int64, below 0-d tensors.
  EXPECT_EQ(result_type(zeros({3}, kInt32), 2.5), kFloat);
  EXPECT_EQ(result_type(zeros({3}, kInt32), 2), kInt32);
  EXPECT_EQ(result_type(zeros({3}, kHalf), 2.5), kHalf);
  EXPECT_EQ(result_type(zeros({3}, kBool), 2), kInt64);
  EXPECT_EQ(result_type(zeros({3}, kBool), true), kBool);
  EXPECT_EQ(result_type(zeros({}, kDouble), 2.5), kDouble);
  EXPECT_EQ(result_type(zeros({}, kInt32), 2.5), kFloat);
  EXPECT_EQ(result_type(zeros({}, kInt32), 7), kInt32);
  EXPECT_EQ((zeros({3}, kInt32) + 2).dtype(), kInt32);
  EXPECT_EQ((zeros({3}, kInt32) * 2.5).dtype(), kFloat);
  EXPECT_EQ((2.5 - zeros({3}, kInt64)).dtype(), kFloat);
  EXPECT_EQ((1 / zeros({3}, kInt64)).dtype(), kFloat);
  EXPECT_EQ((zeros({3}, kBFloat16) + 1.5).dtype(), kBFloat16);
  set_default_dtype(kDouble);
  EXPECT_EQ(result_type(zeros({3}, kInt64), 2.5), kDouble);
  EXPECT_EQ((zeros({3}, kInt64) / 2).dtype(), kDouble);
  set_default_dtype(kFloat);
}

// --- Arithmetic ------------------------------------------------------------------------------

TEST(BinaryArithmeticTest, EachDtypeAgainstReference) {
  for (ScalarType dt : kNumeric) {
    SCOPED_TRACE(dtype_name(dt));
    const double tol = tolerance(dt);
    Tensor a = make({3, 4}, dt, 1), b = make({4}, dt, 2, /*nonzero=*/true);
    Tensor r = add(a, b, 2);
    EXPECT_EQ(r.dtype(), dt);
    EXPECT_TRUE(matches(
        r, a, b, [](double x, double y) { return x + 2 * y; }, tol));
    EXPECT_TRUE(matches(
        sub(a, b, 3), a, b, [](double x, double y) { return x - 3 * y; }, tol));
    EXPECT_TRUE(matches(a * b, a, b, std::multiplies<double>(), tol));
    EXPECT_TRUE(matches(
        a.maximum(b), a, b, [](double x, double y) { return std::max(x, y); }, 0));
    EXPECT_TRUE(matches(
        a.minimum(b), a, b, [](double x, double y) { return std::min(x, y); }, 0));
    Tensor q = a / b;
    EXPECT_EQ(q.dtype(), is_floating_point(dt) ? dt : kFloat);
    EXPECT_TRUE(matches(q, a, b, std::divides<double>(), std::max(tol, 1e-6)));
    EXPECT_TRUE(matches(a.div(b, "trunc"), a, b, trunc_div, tol));
    EXPECT_TRUE(matches(a.div(b, "floor"), a, b, floor_div, tol));
    EXPECT_TRUE(matches(a.floor_divide(b), a, b, floor_div, tol));
    Tensor t = a.atan2(b);
    EXPECT_EQ(t.dtype(), is_floating_point(dt) ? dt : kFloat);
    EXPECT_TRUE(matches(
        t, a, b, [](double y, double x) { return std::atan2(y, x); }, std::max(tol, 1e-6)));
  }
}

TEST(BinaryArithmeticTest, BoolArithmeticIsLogical) {
  Tensor a = tensor({true, true, false, false}), b = tensor({true, false, true, false});
  EXPECT_EQ((a + b).dtype(), kBool);
  EXPECT_EQ((a + b).to_vector<bool>(), (std::vector<bool>{true, true, true, false}));
  EXPECT_EQ((a * b).to_vector<bool>(), (std::vector<bool>{true, false, false, false}));
  EXPECT_EQ(a.maximum(b).to_vector<bool>(), (std::vector<bool>{true, true, true, false}));
  EXPECT_EQ((a + 1).dtype(), kInt64);
  EXPECT_EQ((a + 1).to_vector<int64_t>(), (std::vector<int64_t>{2, 2, 1, 1}));
  EXPECT_EQ((a / b).dtype(), kFloat);
}

TEST(BinaryArithmeticTest, Broadcasting) {
  Tensor a = make({3, 1}, kFloat, 3), b = make({1, 4}, kFloat, 4);
  Tensor r = a + b;
  EXPECT_EQ(to_shape(r.sizes()), (Shape{3, 4}));
  EXPECT_TRUE(matches(r, a, b, std::plus<double>(), 0));
  Tensor c = make({4}, kFloat, 5), d = make({2, 3, 4}, kInt64, 6);
  Tensor s = c - d;
  EXPECT_EQ(to_shape(s.sizes()), (Shape{2, 3, 4}));
  EXPECT_EQ(s.dtype(), kFloat);
  EXPECT_TRUE(matches(s, c, d, std::minus<double>(), 0));
  EXPECT_TRUE(matches(d * c, d, c, std::multiplies<double>(), 0));
  EXPECT_KILN_ERROR(zeros({2, 3}) + zeros({4}), "[add] shapes [2, 3] and [4] cannot be broadcast");
  EXPECT_KILN_ERROR(zeros({2}) == zeros({3}), "[eq] shapes [2] and [3]");
}

TEST(BinaryArithmeticTest, StridedExpandedZeroDimAndEmpty) {
  Tensor base = make({4, 3}, kFloat, 7);
  Tensor at = base.t();  // [3, 4], non-contiguous
  ASSERT_FALSE(at.is_contiguous());
  Tensor b = make({3, 4}, kFloat, 8);
  EXPECT_TRUE(matches(at * b, at, b, std::multiplies<double>(), 0));
  EXPECT_TRUE(matches(b - at, b, at, std::minus<double>(), 0));
  Tensor e = make({3, 1}, kFloat, 9).expand({3, 4});
  EXPECT_TRUE(matches(at + e, at, e, std::plus<double>(), 0));
  Tensor sliced = make({3, 8}, kDouble, 10).slice(1, 0, 8, 2);
  EXPECT_TRUE(matches(sliced / b, sliced, b, std::divides<double>(), 1e-12));
  // 0-d with 0-d, and 0-d on either side of a dimensioned tensor.
  Tensor z = full({}, 2.5), w = full({}, 4.0);
  Tensor zz = z * w;
  EXPECT_EQ(zz.dim(), 0);
  EXPECT_EQ(zz.item<double>(), 10.0);
  EXPECT_TRUE(matches(z - b, z, b, std::minus<double>(), 0));
  EXPECT_TRUE(matches(b / z, b, z, std::divides<double>(), 1e-6));
  // Empty tensors broadcast to empty results.
  Tensor empty_sum = zeros({0, 3}) + zeros({3});
  EXPECT_EQ(to_shape(empty_sum.sizes()), (Shape{0, 3}));
  EXPECT_EQ((zeros({0}) < 1).numel(), 0);
  EXPECT_EQ(to_shape((zeros({2, 0}) * zeros({1, 0}, kInt32)).sizes()), (Shape{2, 0}));
}

TEST(BinaryArithmeticTest, MultiThreadedSizes) {
  // 41120 elements: above the 32768-element grain, so the loops split across threads.
  Tensor a = make({257, 160}, kFloat, 11), b = make({160}, kFloat, 12, true);
  EXPECT_TRUE(matches(
      add(a, b, 0.5), a, b, [](double x, double y) { return x + 0.5 * y; }, 1e-6));
  EXPECT_TRUE(matches(a / b, a, b, std::divides<double>(), 1e-6));
  Tensor at = make({160, 257}, kFloat, 13).t();
  EXPECT_TRUE(matches(at * a, at, a, std::multiplies<double>(), 0));
  EXPECT_TRUE(matches(at >= a, at, a, std::greater_equal<double>(), 0));
  Tensor ai = make({257, 160}, kInt64, 14), bi = make({257, 160}, kInt64, 15, true);
  EXPECT_TRUE(matches(ai.div(bi, "floor"), ai, bi, floor_div, 0));
  Tensor h = make({257, 160}, kBFloat16, 16);
  EXPECT_TRUE(matches(h * 3, h, full({}, 3.0), std::multiplies<double>(), 8e-3));
}

TEST(BinaryArithmeticTest, ScalarOperandsOnEitherSide) {
  Tensor a = make({2, 3}, kFloat, 17), s = full({}, 2.0);
  EXPECT_TRUE(matches(a + 2, a, s, std::plus<double>(), 0));
  EXPECT_TRUE(matches(2 + a, a, s, std::plus<double>(), 0));
  EXPECT_TRUE(matches(a - 2, a, s, std::minus<double>(), 0));
  EXPECT_TRUE(matches(2 - a, s, a, std::minus<double>(), 0));
  EXPECT_TRUE(matches(a * 2, a, s, std::multiplies<double>(), 0));
  EXPECT_TRUE(matches(2 * a, a, s, std::multiplies<double>(), 0));
  EXPECT_TRUE(matches(a / 2, a, s, std::divides<double>(), 0));
  EXPECT_TRUE(matches(2 / a, s, a, std::divides<double>(), 1e-6));
  EXPECT_TRUE(matches(
      a.add(2, 3), a, s, [](double x, double y) { return x + 3 * y; }, 0));
  EXPECT_TRUE(matches(
      a.sub(2, 3), a, s, [](double x, double y) { return x - 3 * y; }, 0));
  EXPECT_TRUE(matches(a.div(2, "floor"), a, s, floor_div, 0));
  Tensor i = make({5}, kInt32, 18);
  EXPECT_EQ((i * 3).dtype(), kInt32);
  EXPECT_TRUE(matches(i * 3, i, full({}, 3), std::multiplies<double>(), 0));
  EXPECT_TRUE(matches(i * 0.5, i, full({}, 0.5), std::multiplies<double>(), 0));
  // Arithmetic uses the scalar at opmath (float) precision: no rounding to half first.
  Tensor h = make({64}, kHalf, 19);
  const std::vector<float> hv = h.to_vector<float>(), prod = (h * 0.1).to_vector<float>();
  for (size_t k = 0; k < hv.size(); ++k) {
    EXPECT_EQ(prod[k], static_cast<float>(Half(hv[k] * 0.1f))) << k;
  }
  // A float64 scalar is used exactly with float64 tensors.
  EXPECT_EQ((full({1}, 1.0, kDouble) * 0.1).item<double>(), 0.1);
}

TEST(BinaryArithmeticTest, SubAndAlphaErrors) {
  Tensor m = tensor({true, false});
  EXPECT_KILN_ERROR(m - m, "[sub] subtraction, the `-` operator, with two bool tensors");
  EXPECT_KILN_ERROR(m - 1, "[sub] subtraction, the `-` operator, with a bool tensor");
  EXPECT_KILN_ERROR(1 - m, "[sub] subtraction");
  EXPECT_KILN_ERROR(zeros({2}) - m, "[sub] subtraction");
  EXPECT_KILN_ERROR(m.sub_(m), "[sub_] subtraction");
  EXPECT_KILN_ERROR(add(zeros({2}, kInt64), zeros({2}, kInt64), 0.5), "[add] for integral");
  EXPECT_KILN_ERROR(add(zeros({2}), zeros({2}), true), "[add] boolean alpha");
  EXPECT_EQ(add(m, m, true).to_vector<bool>(), (std::vector<bool>{true, false}));
  EXPECT_KILN_ERROR(add(Tensor(), zeros({2})), "[add] got an undefined tensor");
  EXPECT_KILN_ERROR(zeros({2}) * Tensor(), "[mul] got an undefined tensor");
}

TEST(BinaryDivisionTest, RoundingModesAndSpecialValues) {
  Tensor a = tensor({7.0, -7.0, 7.0, -7.0, 7.5, -0.5, 0.0}, kDouble);
  Tensor b = tensor({2.0, 2.0, -2.0, -2.0, 0.5, 3.0, -1.0}, kDouble);
  EXPECT_EQ(a.div(b, "trunc").to_vector<double>(),
            (std::vector<double>{3, -3, -3, 3, 15, -0.0, -0.0}));
  EXPECT_EQ(a.div(b, "floor").to_vector<double>(),
            (std::vector<double>{3, -4, -4, 3, 15, -1, -0.0}));
  EXPECT_TRUE(std::signbit(a.div(b, "floor").to_vector<double>()[6]));
  Tensor inf = tensor({1.0, -1.0, 0.0}) / 0.0;
  const std::vector<float> iv = inf.to_vector<float>();
  EXPECT_EQ(iv[0], std::numeric_limits<float>::infinity());
  EXPECT_EQ(iv[1], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(iv[2]));
  EXPECT_EQ((tensor({1.0, -1.0}).div(0.0, "floor")).to_vector<float>()[0],
            std::numeric_limits<float>::infinity());
  Tensor ia = tensor({7, -7, 7, -7}, kInt32), ib = tensor({2, 2, -2, -2}, kInt32);
  EXPECT_EQ(ia.div(ib, "trunc").to_vector<int32_t>(), (std::vector<int32_t>{3, -3, -3, 3}));
  EXPECT_EQ(ia.div(ib, "floor").to_vector<int32_t>(), (std::vector<int32_t>{3, -4, -4, 3}));
  EXPECT_EQ(ia.div(ib, "floor").dtype(), kInt32);
  EXPECT_EQ((ia / ib).to_vector<float>(), (std::vector<float>{3.5, -3.5, -3.5, 3.5}));
  // The most negative integer divided by -1 wraps instead of trapping.
  const int64_t kMin = std::numeric_limits<int64_t>::min();
  EXPECT_EQ(tensor({kMin}, kInt64).div(tensor({int64_t{-1}}), "trunc").item<int64_t>(), kMin);
  EXPECT_EQ(tensor({kMin}, kInt64).div(-1, "floor").item<int64_t>(), kMin);
  EXPECT_KILN_ERROR(ia.div(tensor({1, 0, 1, 1}, kInt32), "trunc"),
                    "[div] integer division by zero");
  EXPECT_KILN_ERROR(floor_divide(ia, zeros({4}, kInt32)), "[div] integer division by zero");
  EXPECT_KILN_ERROR(ia.div(0, "floor"), "[div] integer division by zero");
  EXPECT_KILN_ERROR(a.div(b, "round"),
                    "[div] expected rounding_mode to be one of None, 'trunc', "
                    "or 'floor' but found 'round'");
}

TEST(BinaryPowTest, FloatIntegerAndScalarBase) {
  Tensor a = tensor({2.0, 4.0, 9.0, 0.5}), e = tensor({3.0, 0.5, -0.5, 2.0});
  EXPECT_TRUE(matches(
      a.pow(e), a, e, [](double x, double y) { return std::pow(x, y); }, 1e-6));
  Tensor ab = a.to(kBFloat16), eb = e.to(kBFloat16);
  EXPECT_TRUE(matches(
      ab.pow(eb), ab, eb, [](double x, double y) { return std::pow(x, y); }, 8e-3));
  Tensor i = tensor({2, -2, 3, 1, -1, -1, 5}), ie = tensor({10, 3, 0, -4, -3, -2, -1});
  EXPECT_EQ(i.pow(ie).to_vector<int64_t>(), (std::vector<int64_t>{1024, -8, 1, 1, -1, 1, 0}));
  EXPECT_EQ(i.pow(ie).dtype(), kInt64);
  EXPECT_EQ(pow(tensor({2}, kInt32), tensor({31}, kInt32)).item<int64_t>(),
            std::numeric_limits<int32_t>::min());  // wraps like two's complement
  Tensor p = pow(2, tensor({0, 1, 2, 10}, kInt32));
  EXPECT_EQ(p.dtype(), kInt32);
  EXPECT_EQ(p.to_vector<int32_t>(), (std::vector<int32_t>{1, 2, 4, 1024}));
  Tensor pf = pow(2.5, tensor({0, 1, 2}, kInt32));
  EXPECT_EQ(pf.dtype(), kFloat);
  EXPECT_EQ(pf.to_vector<float>(), (std::vector<float>{1, 2.5, 6.25}));
  EXPECT_DOUBLE_EQ(pow(2, tensor({0.5}, kDouble)).item<double>(), std::sqrt(2.0));
  EXPECT_EQ(pow(tensor({2.0}), tensor({3}, kInt64)).dtype(), kFloat);
  EXPECT_KILN_ERROR(pow(tensor({true}), tensor({true})), "[pow] not implemented for bool");
}

TEST(BinaryMaxMinTest, NanPropagatesAndTypesPromote) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor a = tensor({1.0f, nan, 3.0f, nan}), b = tensor({2.0f, 1.0f, nan, nan});
  for (const Tensor& r : {maximum(a, b), minimum(a, b), a.maximum(b)}) {
    const std::vector<float> v = r.to_vector<float>();
    EXPECT_FALSE(std::isnan(v[0]));
    EXPECT_TRUE(std::isnan(v[1]) && std::isnan(v[2]) && std::isnan(v[3]));
  }
  EXPECT_EQ(maximum(a, b).to_vector<float>()[0], 2.0f);
  EXPECT_EQ(minimum(a, b).to_vector<float>()[0], 1.0f);
  Tensor i = tensor({1, 5}, kInt32), f = tensor({2.5, 2.5}, kDouble);
  EXPECT_EQ(maximum(i, f).dtype(), kDouble);
  EXPECT_EQ(maximum(i, f).to_vector<double>(), (std::vector<double>{2.5, 5}));
  EXPECT_EQ(atan2(tensor({1}), tensor({1})).dtype(), kFloat);
  EXPECT_NEAR(atan2(tensor({1}), tensor({-1})).item<double>(), 3 * std::numbers::pi / 4, 1e-6);
}

// --- Comparisons and logical ops ------------------------------------------------------------

TEST(BinaryCompareTest, AllOpsTensorsAndScalars) {
  using Cmp = std::function<double(double, double)>;
  const std::vector<std::pair<Tensor (*)(const Tensor&, const Tensor&), Cmp>> ops = {
      {eq, std::equal_to<double>()}, {ne, std::not_equal_to<double>()},
      {lt, std::less<double>()},     {le, std::less_equal<double>()},
      {gt, std::greater<double>()},  {ge, std::greater_equal<double>()}};
  for (ScalarType dt : {kFloat, kHalf, kBFloat16, kInt32, kInt64, kUInt8, kDouble, kBool}) {
    Tensor a = make({3, 4}, dt, 20), b = make({4}, dt, 21);
    Tensor at = make({4, 3}, dt, 22).t();
    for (const auto& [op, ref] : ops) {
      Tensor r = op(a, b);
      EXPECT_EQ(r.dtype(), kBool);
      EXPECT_TRUE(matches(r, a, b, ref, 0)) << dtype_name(dt);
      EXPECT_TRUE(matches(op(at, a), at, a, ref, 0)) << dtype_name(dt);
    }
  }
  Tensor a = make({2, 5}, kInt64, 23), s = full({}, 0.5);
  // An int tensor against a float scalar compares in float.
  EXPECT_TRUE(matches(a < 0.5, a, s, std::less<double>(), 0));
  EXPECT_TRUE(matches(a.le(0.5), a, s, std::less_equal<double>(), 0));
  EXPECT_TRUE(matches(a > 0.5, a, s, std::greater<double>(), 0));
  EXPECT_TRUE(matches(a.ge(0.5), a, s, std::greater_equal<double>(), 0));
  EXPECT_TRUE(matches(0.5 < a, s, a, std::less<double>(), 0));
  EXPECT_TRUE(matches(0.5 <= a, s, a, std::less_equal<double>(), 0));
  EXPECT_TRUE(matches(0.5 > a, s, a, std::greater<double>(), 0));
  EXPECT_TRUE(matches(0.5 >= a, s, a, std::greater_equal<double>(), 0));
  Tensor one = full({}, 1);
  EXPECT_TRUE(matches(a == 1, a, one, std::equal_to<double>(), 0));
  EXPECT_TRUE(matches(1 == a, a, one, std::equal_to<double>(), 0));
  EXPECT_TRUE(matches(a != 1, a, one, std::not_equal_to<double>(), 0));
  EXPECT_TRUE(matches(1 != a, a, one, std::not_equal_to<double>(), 0));
  EXPECT_TRUE(matches(a.eq(1), a, one, std::equal_to<double>(), 0));
  EXPECT_TRUE(matches(a.ne(1), a, one, std::not_equal_to<double>(), 0));
  // Comparisons round the scalar to the tensor's dtype, as PyTorch.
  EXPECT_TRUE(full({1}, 0.1, kHalf).eq(0.1).item<bool>());
  EXPECT_TRUE((full({1}, 0.1, kBFloat16) == 0.1).item<bool>());
  EXPECT_FALSE((tensor({std::numeric_limits<float>::quiet_NaN()}) == tensor({0.0f})).item<bool>());
  EXPECT_TRUE((tensor({std::numeric_limits<float>::quiet_NaN()}) != 1.0).item<bool>());
}

TEST(BinaryLogicalTest, AnyDtypeGivesBool) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor f = tensor({0.0f, 2.0f, nan, 0.0f}), i = tensor({0, 0, 3, 5}, kInt32);
  EXPECT_EQ(logical_and(f, i).to_vector<bool>(), (std::vector<bool>{false, false, true, false}));
  EXPECT_EQ(logical_or(f, i).to_vector<bool>(), (std::vector<bool>{false, true, true, true}));
  EXPECT_EQ(logical_xor(f, i).to_vector<bool>(), (std::vector<bool>{false, true, false, true}));
  EXPECT_EQ(f.logical_and(i).dtype(), kBool);
  EXPECT_EQ(tensor({1e-300}, kDouble).logical_or(tensor({0.0}, kDouble)).item<bool>(), true);
  Tensor a = make({3, 1}, kBFloat16, 24), b = make({4}, kInt64, 25);
  auto truthy = [](double x) { return x != 0; };
  EXPECT_TRUE(matches(
      a.logical_and(b), a, b, [&](double x, double y) { return double(truthy(x) && truthy(y)); },
      0));
  EXPECT_TRUE(matches(
      a.logical_or(b), a, b, [&](double x, double y) { return double(truthy(x) || truthy(y)); },
      0));
  EXPECT_TRUE(matches(
      a.logical_xor(b), a, b, [&](double x, double y) { return double(truthy(x) != truthy(y)); },
      0));
  Tensor p = tensor({true, true, false, false}), q = tensor({true, false, true, false});
  EXPECT_EQ((p & q).to_vector<bool>(), (std::vector<bool>{true, false, false, false}));
  EXPECT_EQ((p | q).to_vector<bool>(), (std::vector<bool>{true, true, true, false}));
  EXPECT_EQ((p ^ q).to_vector<bool>(), (std::vector<bool>{false, true, true, false}));
  EXPECT_KILN_ERROR(i & i, "[bitwise_and] is only implemented for bool tensors");
  EXPECT_KILN_ERROR(p | i, "[bitwise_or]");
  EXPECT_KILN_ERROR(f ^ p, "[bitwise_xor]");
}

// --- where, clamp, lerp ------------------------------------------------------------------------

TEST(BinaryWhereTest, OverloadsBroadcastAndPromote) {
  Tensor cond = tensor({true, false, true}).view({3, 1});
  Tensor a = make({3, 4}, kFloat, 26), b = make({4}, kInt64, 27);
  Tensor r = where(cond, a, b);
  EXPECT_EQ(r.dtype(), kFloat);
  EXPECT_EQ(to_shape(r.sizes()), (Shape{3, 4}));
  const std::vector<double> va = values(a, {3, 4}), vb = values(b, {3, 4}),
                            vr = r.to_vector<double>();
  for (size_t k = 0; k < vr.size(); ++k) EXPECT_EQ(vr[k], (k / 4 != 1) ? va[k] : vb[k]);
  EXPECT_EQ(a.where(cond, b).to_vector<double>(), vr);
  Tensor i = tensor({1, 2, 3}, kInt32), m = tensor({true, false, true});
  EXPECT_EQ(where(m, i, 0).dtype(), kInt32);
  EXPECT_EQ(where(m, i, 0).to_vector<int32_t>(), (std::vector<int32_t>{1, 0, 3}));
  EXPECT_EQ(where(m, i, 0.5).dtype(), kFloat);
  EXPECT_EQ(where(m, i, 0.5).to_vector<float>(), (std::vector<float>{1, 0.5, 3}));
  EXPECT_EQ(where(m, -1, i).to_vector<int32_t>(), (std::vector<int32_t>{-1, 2, -1}));
  EXPECT_EQ(where(m, i, full({}, 2.5, kDouble)).dtype(), kDouble);  // 0-d float beats int
  Tensor big = make({300, 130}, kHalf, 28), mask = big > 0;
  EXPECT_TRUE(matches(
      where(mask, big, 0), big, big, [](double x, double) { return x > 0 ? x : 0; }, 0));
  for (ScalarType dt : {kFloat, kDouble, kHalf, kBFloat16, kInt32, kInt64, kUInt8, kBool}) {
    Tensor x = make({2, 3}, dt, 43), y = make({3, 2}, dt, 44).t(), c = make({3}, kInt64, 45) > 0;
    Tensor w = where(c, x, y);
    EXPECT_EQ(w.dtype(), dt);
    const std::vector<double> vx = x.to_vector<double>(), vy = y.to_vector<double>();
    const std::vector<double> vc = values(c, {2, 3}), vw = w.to_vector<double>();
    for (size_t k = 0; k < vw.size(); ++k) EXPECT_EQ(vw[k], vc[k] ? vx[k] : vy[k]) << k;
  }
  EXPECT_KILN_ERROR(where(tensor({1.0f}), a, b), "[where] expected condition to be a boolean");
  EXPECT_KILN_ERROR(where(zeros({2}, kBool), zeros({3}), 0), "[where] shapes [2] and [3]");
}

TEST(BinaryClampTest, BoundsNanAndPromotion) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor a = tensor({-3.0f, -0.5f, 0.25f, 2.0f, nan});
  const std::vector<float> both = a.clamp(-1, 1).to_vector<float>();
  EXPECT_EQ(std::vector<float>(both.begin(), both.end() - 1),
            (std::vector<float>{-1, -0.5, 0.25, 1}));
  EXPECT_TRUE(std::isnan(both[4]));
  EXPECT_EQ(a.clamp_min(0).to_vector<float>()[0], 0.0f);
  EXPECT_EQ(a.clamp_min(0).to_vector<float>()[3], 2.0f);
  EXPECT_EQ(a.clamp_max(0).to_vector<float>()[3], 0.0f);
  EXPECT_EQ(a.clamp(std::nullopt, 0).to_vector<float>()[0], -3.0f);
  EXPECT_EQ(clamp(a, 2, 1).to_vector<float>()[0], 1.0f);  // min > max gives max
  for (ScalarType dt : kNumeric) {
    Tensor x = make({4, 5}, dt, 29).t();
    EXPECT_TRUE(matches(
        x.clamp(-2, 3), x, x, [](double v, double) { return std::min(std::max(v, -2.0), 3.0); }, 0))
        << dtype_name(dt);
  }
  Tensor i = tensor({1, 2, 3}, kInt64);
  EXPECT_EQ(i.clamp(2).dtype(), kInt64);
  EXPECT_EQ(i.clamp(0.5, 2.5).dtype(), kFloat);
  EXPECT_EQ(i.clamp(0.5, 2.5).to_vector<float>(), (std::vector<float>{1, 2, 2.5}));
  EXPECT_EQ(tensor({true, false}).clamp(1).dtype(), kInt64);
  Tensor big = make({257, 160}, kFloat, 30);
  Tensor copy = big.clone();
  copy.clamp_(-1, 1);
  EXPECT_TRUE(matches(
      copy, big, big, [](double v, double) { return std::min(std::max(v, -1.0), 1.0); }, 0));
  EXPECT_KILN_ERROR(a.clamp(std::nullopt, std::nullopt), "[clamp] at least one of 'min' or 'max'");
  EXPECT_KILN_ERROR(i.clamp_(0.5),
                    "[clamp_] result type Float can't be cast to the desired "
                    "output type Long");
  EXPECT_KILN_ERROR(tensor({true}).clamp(false, true), "[clamp] is not implemented for bool");
}

TEST(BinaryLerpTest, ScalarAndTensorWeights) {
  auto lerp_ref = [](double s, double e, double w) { return s + w * (e - s); };
  for (ScalarType dt : {kFloat, kDouble, kHalf, kBFloat16}) {
    Tensor s = make({3, 4}, dt, 31), e = make({4}, dt, 32);
    for (double w : {0.25, 0.75}) {
      EXPECT_TRUE(matches(
          lerp(s, e, w), s, e, [&](double x, double y) { return lerp_ref(x, y, w); },
          tolerance(dt)))
          << dtype_name(dt) << " " << w;
    }
  }
  Tensor s = make({3, 4}, kFloat, 33), e = make({3, 4}, kFloat, 34);
  Tensor w = tensor({0.0f, 0.25f, 0.75f, 1.0f});
  const std::vector<double> vs = values(s, {3, 4}), ve = values(e, {3, 4}), vw = values(w, {3, 4});
  const std::vector<double> vr = s.lerp(e, w).to_vector<double>();
  for (size_t k = 0; k < vr.size(); ++k) EXPECT_NEAR(vr[k], lerp_ref(vs[k], ve[k], vw[k]), 1e-6);
  EXPECT_EQ(lerp(tensor({1.0f}), tensor({3.0f}), 1.0).item<float>(), 3.0f);  // exact at w = 1
  Tensor acc = s.clone();
  const uint64_t v0 = acc._version();
  acc.lerp_(e, 0.5);
  EXPECT_GT(acc._version(), v0);
  EXPECT_TRUE(matches(
      acc, s, e, [](double x, double y) { return (x + y) / 2; }, 1e-6));
  EXPECT_KILN_ERROR(lerp(zeros({2}, kInt64), zeros({2}, kInt64), 0.5),
                    "[lerp] expected a floating-point dtype, got int64");
  EXPECT_KILN_ERROR(lerp(zeros({2}), zeros({2}, kDouble), 0.5),
                    "[lerp] expected dtype float32 for `end` but got dtype float64");
  EXPECT_KILN_ERROR(lerp(zeros({2}), zeros({2}), zeros({2}, kDouble)), "for `weight`");
  EXPECT_KILN_ERROR(zeros({2}).lerp_(zeros({3, 2}), 0.5), "[lerp_] output with shape [2]");
}

// --- isclose, allclose, equal -------------------------------------------------------------------

TEST(BinaryCloseTest, IscloseAllcloseEqual) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  Tensor a = tensor({1.0, 1.0, inf, inf, nan, 100.0, 0.0}, kDouble);
  Tensor b = tensor({1.0 + 1e-9, 1.1, inf, -inf, nan, 100.001, 1e-9}, kDouble);
  EXPECT_EQ(isclose(a, b).to_vector<bool>(),
            (std::vector<bool>{true, false, true, false, false, true, true}));
  EXPECT_EQ(isclose(a, b, 1e-5, 1e-8, /*equal_nan=*/true).to_vector<bool>()[4], true);
  EXPECT_EQ(isclose(a, b, 0, 0).to_vector<bool>()[0], false);
  EXPECT_TRUE(allclose(tensor({1.0f, 2.0f}), tensor({1.0f, 2.00001f})));
  EXPECT_FALSE(allclose(tensor({1.0f, 2.0f}), tensor({1.0f, 2.1f})));
  EXPECT_TRUE(allclose(tensor({1, 2}), tensor({1, 2})));
  EXPECT_TRUE(allclose(zeros({3, 1}), zeros({4})));  // broadcasts
  // half(1.0005) is 1 + 2^-10: close for rtol 1e-3 (each step rounded to half), not for 1e-4.
  EXPECT_TRUE(allclose(tensor({1.0f}, kHalf), tensor({1.0005f}, kHalf), 1e-3));
  EXPECT_FALSE(allclose(tensor({1.0f}, kHalf), tensor({1.0005f}, kHalf), 1e-4));
  EXPECT_TRUE(allclose(tensor({1.0f, 3.0f}, kBFloat16), tensor({1.0f, 3.0f}, kBFloat16), 0, 0));
  EXPECT_EQ(isclose(tensor({10, 11}), tensor({10, 12}), 0.1, 0).to_vector<bool>(),
            (std::vector<bool>{true, true}));
  EXPECT_TRUE(equal(tensor({1, 2, 3}), tensor({1, 2, 3})));
  EXPECT_TRUE(equal(tensor({1, 2, 3}), tensor({1.0, 2.0, 3.0})));  // promotes
  EXPECT_FALSE(equal(tensor({1, 2, 3}), tensor({1, 2, 4})));
  EXPECT_FALSE(equal(tensor({1, 2}), tensor({{1, 2}})));  // sizes differ
  EXPECT_FALSE(equal(tensor({nan}), tensor({nan})));
  EXPECT_TRUE(equal(zeros({0}), zeros({0})));
  Tensor big = make({257, 160}, kFloat, 35);
  EXPECT_TRUE(equal(big, big.t().contiguous().t()));
  EXPECT_KILN_ERROR(isclose(zeros({2}), zeros({2}, kDouble)),
                    "[isclose] float32 did not match float64");
  EXPECT_KILN_ERROR(isclose(zeros({2}), zeros({2}), -1), "[isclose] rtol must be greater");
  EXPECT_KILN_ERROR(allclose(zeros({2}), zeros({2}), 1e-5, -1), "[isclose] atol must be greater");
  EXPECT_KILN_ERROR(equal(Tensor(), zeros({2})), "[equal] got an undefined tensor");
}

// --- In-place ------------------------------------------------------------------------------------

TEST(BinaryInplaceTest, BroadcastStridedAndCasting) {
  Tensor base = make({4, 3}, kFloat, 36);
  Tensor orig = base.clone();
  Tensor view = base.t();  // [3, 4] non-contiguous: writes go through strides
  Tensor other = make({4}, kFloat, 37);
  const uint64_t v0 = base._version();
  Tensor& ret = view.add_(other, 2);
  EXPECT_TRUE(ret.is_same(view));
  EXPECT_GT(base._version(), v0);
  EXPECT_TRUE(matches(
      base.t(), orig.t(), other, [](double x, double y) { return x + 2 * y; }, 0));
  Tensor x = make({2, 3}, kFloat, 38), x0 = x.clone(), y = make({3}, kFloat, 39, true);
  x.sub_(y);
  EXPECT_TRUE(matches(x, x0, y, std::minus<double>(), 0));
  x.mul_(y);
  x.div_(y);
  x += y;
  EXPECT_TRUE(matches(
      x, x0, y, [](double p, double) { return p; }, 1e-6));
  x -= 1;
  x *= 2;
  x /= 2;
  x += 1;
  x.add_(1, 2).sub_(2).mul_(3).div_(3).sub_(1, -1).sub_(1);
  EXPECT_TRUE(matches(
      x, x0, y, [](double p, double) { return p; }, 1e-6));
  // Integer results narrow into the tensor's own dtype; float results into a float tensor.
  Tensor i32 = tensor({1, 2, 3}, kInt32);
  i32 += tensor({10, 20, 30}, kInt64);
  EXPECT_EQ(i32.dtype(), kInt32);
  EXPECT_EQ(i32.to_vector<int32_t>(), (std::vector<int32_t>{11, 22, 33}));
  Tensor h = tensor({1.0f, 2.0f}, kHalf);
  h.mul_(tensor({0.5, 4.0}, kDouble));
  EXPECT_EQ(h.to_vector<float>(), (std::vector<float>{0.5, 8}));
  Tensor f = tensor({1.0f, 2.0f});
  f.add_(tensor({1, 2}, kInt64));
  EXPECT_EQ(f.to_vector<float>(), (std::vector<float>{2, 4}));
  Tensor big = make({257, 160}, kFloat, 40), big0 = big.clone(), row = make({160}, kFloat, 41);
  big.add_(row);
  EXPECT_TRUE(matches(big, big0, row, std::plus<double>(), 0));
  Tensor self_alias = make({5}, kDouble, 42), s0 = self_alias.clone();
  self_alias.mul_(self_alias);
  EXPECT_TRUE(matches(self_alias, s0, s0, std::multiplies<double>(), 0));
}

TEST(BinaryInplaceTest, Errors) {
  Tensor l = tensor({1, 2}, kInt64);
  EXPECT_KILN_ERROR(l.add_(1.5),
                    "[add_] result type Float can't be cast to the desired output "
                    "type Long");
  EXPECT_KILN_ERROR(l.add_(tensor({0.5f, 1.5f})), "[add_] result type Float can't be cast");
  EXPECT_KILN_ERROR(l.div_(2),
                    "[div_] result type Float can't be cast to the desired output "
                    "type Long");
  EXPECT_KILN_ERROR(l.mul_(tensor({1.0}, kDouble)), "[mul_] result type Double");
  EXPECT_KILN_ERROR(tensor({true}).add_(1),
                    "[add_] result type Long can't be cast to the "
                    "desired output type Bool");
  EXPECT_KILN_ERROR(zeros({3}).add_(zeros({2, 3})),
                    "[add_] output with shape [3] doesn't match the broadcast shape [2, 3]");
  EXPECT_KILN_ERROR(zeros({3}).mul_(zeros({2})), "[mul_] shapes [3] and [2] cannot be broadcast");
  EXPECT_KILN_ERROR(zeros({1}).expand({3}).add_(1), "[add_] unsupported operation: more than one");
  Tensor t = arange(6, kFloat);
  EXPECT_KILN_ERROR(t.slice(0, 0, 5).add_(t.slice(0, 1, 6)),
                    "[add_] unsupported operation: some "
                    "elements of the input tensor");
  EXPECT_KILN_ERROR(zeros({2}).div_(Tensor()), "[div_] got an undefined tensor");
}

}  // namespace
}  // namespace kiln
