// Printing in PyTorch's format. Every expected string is the repr that Python PyTorch 2.11
// prints for the same tensor (with `torch.` spelled `kiln.`).
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <cmath>
#include <functional>
#include <limits>
#include <sstream>

#include "test_util.h"

namespace kiln {
namespace {

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// A float32 tensor whose element i is f(i), computed in float as PyTorch would.
Tensor values(int64_t n, const std::function<float(int64_t)>& f) {
  Tensor t = empty({n});
  float* p = t.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) p[i] = f(i);
  return t;
}

TEST(PrintTest, FloatStyles) {
  EXPECT_EQ(tensor({1., 2., 3.}).str(), R"x(tensor([1., 2., 3.]))x");
  EXPECT_EQ(tensor({1.5, 2.25}).str(), R"x(tensor([1.5000, 2.2500]))x");
  EXPECT_EQ(tensor({1e-5, 1e5}).str(), R"x(tensor([1.0000e-05, 1.0000e+05]))x");
  EXPECT_EQ(tensor({1e-5, 2e-5}).str(), R"x(tensor([1.0000e-05, 2.0000e-05]))x");
  EXPECT_EQ(tensor({1e9, 2e9}).str(), R"x(tensor([1.0000e+09, 2.0000e+09]))x");
  EXPECT_EQ(tensor({1., 2000.}).str(), R"x(tensor([1.0000e+00, 2.0000e+03]))x");
  EXPECT_EQ(tensor({1., 1e9}).str(), R"x(tensor([1.0000e+00, 1.0000e+09]))x");
  EXPECT_EQ(tensor({1e8, 1.5}).str(), R"x(tensor([1.0000e+08, 1.5000e+00]))x");
  EXPECT_EQ(tensor({0.001, 0.5}).str(), R"x(tensor([0.0010, 0.5000]))x");
  EXPECT_EQ(tensor({0.1, 200.5}).str(), R"x(tensor([1.0000e-01, 2.0050e+02]))x");
  EXPECT_EQ(tensor({0.00005, 0.12345, 2.5}).str(),
            R"x(tensor([5.0000e-05, 1.2345e-01, 2.5000e+00]))x");
  EXPECT_EQ(tensor({1.5, -10.25, 100.}).str(), R"x(tensor([  1.5000, -10.2500, 100.0000]))x");
  EXPECT_EQ(zeros({3}).str(), R"x(tensor([0., 0., 0.]))x");
  EXPECT_EQ(tensor({-0., 1.}).str(), R"x(tensor([-0., 1.]))x");
}

TEST(PrintTest, NonFinite) {
  EXPECT_EQ(tensor({1.5, kNan, kInf, -kInf}).str(),
            R"x(tensor([1.5000,    nan,    inf,   -inf]))x");
  EXPECT_EQ(tensor({1., kNan, -kInf}).str(), R"x(tensor([1., nan, -inf]))x");
  EXPECT_EQ(tensor({kNan, kInf}).str(), R"x(tensor([nan, inf]))x");
}

TEST(PrintTest, NestedRowsAndScalars) {
  EXPECT_EQ(tensor({{1., 2.}, {3., 4.}}).str(),
            R"x(tensor([[1., 2.],
        [3., 4.]]))x");
  EXPECT_EQ(arange(12.).reshape({2, 3, 2}).str(),
            R"x(tensor([[[ 0.,  1.],
         [ 2.,  3.],
         [ 4.,  5.]],

        [[ 6.,  7.],
         [ 8.,  9.],
         [10., 11.]]]))x");
  EXPECT_EQ(arange(6.).reshape({2, 3}).t().str(),
            R"x(tensor([[0., 3.],
        [1., 4.],
        [2., 5.]]))x");
  EXPECT_EQ(tensor({{-1e-7, 3.5e10}, {2., 0.}}).str(),
            R"x(tensor([[-1.0000e-07,  3.5000e+10],
        [ 2.0000e+00,  0.0000e+00]]))x");
  EXPECT_EQ(scalar_tensor(3.).str(), R"x(tensor(3.))x");
  EXPECT_EQ(scalar_tensor(-0.5).str(), R"x(tensor(-0.5000))x");
}

TEST(PrintTest, IntegersAndBools) {
  EXPECT_EQ(tensor({true, false}).str(), R"x(tensor([ True, False]))x");
  EXPECT_EQ(tensor({true, true}).str(), R"x(tensor([True, True]))x");
  EXPECT_EQ(tensor({{true}, {false}}).str(),
            R"x(tensor([[ True],
        [False]]))x");
  EXPECT_EQ(tensor({1, -20, 300}).str(), R"x(tensor([  1, -20, 300]))x");
  EXPECT_EQ(tensor({1, 2}, kInt32).str(), R"x(tensor([1, 2], dtype=kiln.int32))x");
  EXPECT_EQ(tensor({int64_t{4611686018427387905}, int64_t{-5}}).str(),
            R"x(tensor([4611686018427387905,                  -5]))x");
  EXPECT_EQ(tensor({7}).str(), R"x(tensor([7]))x");
}

TEST(PrintTest, EmptyTensors) {
  EXPECT_EQ(empty({0}).str(), R"x(tensor([]))x");
  EXPECT_EQ(empty({0}, kInt64).str(), R"x(tensor([], dtype=kiln.int64))x");
  EXPECT_EQ(zeros({2, 0}).str(), R"x(tensor([], size=(2, 0)))x");
  EXPECT_EQ(zeros({0, 3}, kFloat64).str(), R"x(tensor([], size=(0, 3), dtype=kiln.float64))x");
}

TEST(PrintTest, DtypeDeviceAndGradSuffixes) {
  EXPECT_EQ(tensor({1., 2.}, kFloat64).str(), R"x(tensor([1., 2.], dtype=kiln.float64))x");
  EXPECT_EQ(tensor({0.1, 2.}, kHalf).str(), R"x(tensor([0.1000, 2.0000], dtype=kiln.float16))x");
  EXPECT_EQ(tensor({0.1, 2.}, kBFloat16).str(),
            R"x(tensor([0.1001, 2.0000], dtype=kiln.bfloat16))x");
  EXPECT_EQ(tensor({1e-5, 1.}, kHalf).str(),
            R"x(tensor([1.0014e-05, 1.0000e+00], dtype=kiln.float16))x");
  EXPECT_EQ(tensor({1., 2.}, requires_grad(true)).str(),
            R"x(tensor([1., 2.], requires_grad=True))x");
  EXPECT_EQ(tensor({1., 2.}, dtype(kFloat64).requires_grad(true)).str(),
            R"x(tensor([1., 2.], dtype=kiln.float64, requires_grad=True))x");
  EXPECT_EQ(empty({2, 3}, Device(kMeta)).str(), R"x(tensor(..., device='meta', size=(2, 3)))x");
  EXPECT_EQ(empty({4}, dtype(kInt64).device(Device(kMeta))).str(),
            R"x(tensor(..., device='meta', size=(4,), dtype=kiln.int64))x");
}

TEST(PrintTest, LinesWrapAtEightyColumns) {
  EXPECT_EQ(values(30, [](int64_t i) { return 1.5f * static_cast<float>(i); }).str(),
            R"x(tensor([ 0.0000,  1.5000,  3.0000,  4.5000,  6.0000,  7.5000,  9.0000, 10.5000,
        12.0000, 13.5000, 15.0000, 16.5000, 18.0000, 19.5000, 21.0000, 22.5000,
        24.0000, 25.5000, 27.0000, 28.5000, 30.0000, 31.5000, 33.0000, 34.5000,
        36.0000, 37.5000, 39.0000, 40.5000, 42.0000, 43.5000]))x");
  EXPECT_EQ(arange(40).str(),
            R"x(tensor([ 0,  1,  2,  3,  4,  5,  6,  7,  8,  9, 10, 11, 12, 13, 14, 15, 16, 17,
        18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35,
        36, 37, 38, 39]))x");
  EXPECT_EQ(values(12, [](int64_t i) { return 1.25f * static_cast<float>(i); })
                .to(kFloat64)
                .view({1, 12})
                .str(),
            R"x(tensor([[ 0.0000,  1.2500,  2.5000,  3.7500,  5.0000,  6.2500,  7.5000,  8.7500,
         10.0000, 11.2500, 12.5000, 13.7500]], dtype=kiln.float64))x");
  EXPECT_EQ(
      tensor({123456.7, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5}, dtype(kFloat64).requires_grad(true))
          .str(),
      R"x(tensor([1.2346e+05, 1.5000e+00, 2.5000e+00, 3.5000e+00, 4.5000e+00, 5.5000e+00,
        6.5000e+00, 7.5000e+00], dtype=kiln.float64, requires_grad=True))x");
}

TEST(PrintTest, SummarisesLargeTensors) {
  EXPECT_EQ(arange(2000.).str(),
            R"x(tensor([0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., 1.9970e+03, 1.9980e+03,
        1.9990e+03]))x");
  EXPECT_EQ(arange(2000).reshape({40, 50}).str(),
            R"x(tensor([[   0,    1,    2,  ...,   47,   48,   49],
        [  50,   51,   52,  ...,   97,   98,   99],
        [ 100,  101,  102,  ...,  147,  148,  149],
        ...,
        [1850, 1851, 1852,  ..., 1897, 1898, 1899],
        [1900, 1901, 1902,  ..., 1947, 1948, 1949],
        [1950, 1951, 1952,  ..., 1997, 1998, 1999]]))x");
  EXPECT_EQ(arange(1200).reshape({2, 600}).str(),
            R"x(tensor([[   0,    1,    2,  ...,  597,  598,  599],
        [ 600,  601,  602,  ..., 1197, 1198, 1199]]))x");
  EXPECT_EQ(values(3000, [](int64_t i) { return static_cast<float>(i) / 7.0f; })
                .reshape({10, 10, 30})
                .str(),
            R"x(tensor([[[0.0000e+00, 1.4286e-01, 2.8571e-01,  ..., 3.8571e+00,
          4.0000e+00, 4.1429e+00],
         [4.2857e+00, 4.4286e+00, 4.5714e+00,  ..., 8.1429e+00,
          8.2857e+00, 8.4286e+00],
         [8.5714e+00, 8.7143e+00, 8.8571e+00,  ..., 1.2429e+01,
          1.2571e+01, 1.2714e+01],
         ...,
         [3.0000e+01, 3.0143e+01, 3.0286e+01,  ..., 3.3857e+01,
          3.4000e+01, 3.4143e+01],
         [3.4286e+01, 3.4429e+01, 3.4571e+01,  ..., 3.8143e+01,
          3.8286e+01, 3.8429e+01],
         [3.8571e+01, 3.8714e+01, 3.8857e+01,  ..., 4.2429e+01,
          4.2571e+01, 4.2714e+01]],

        [[4.2857e+01, 4.3000e+01, 4.3143e+01,  ..., 4.6714e+01,
          4.6857e+01, 4.7000e+01],
         [4.7143e+01, 4.7286e+01, 4.7429e+01,  ..., 5.1000e+01,
          5.1143e+01, 5.1286e+01],
         [5.1429e+01, 5.1571e+01, 5.1714e+01,  ..., 5.5286e+01,
          5.5429e+01, 5.5571e+01],
         ...,
         [7.2857e+01, 7.3000e+01, 7.3143e+01,  ..., 7.6714e+01,
          7.6857e+01, 7.7000e+01],
         [7.7143e+01, 7.7286e+01, 7.7429e+01,  ..., 8.1000e+01,
          8.1143e+01, 8.1286e+01],
         [8.1429e+01, 8.1571e+01, 8.1714e+01,  ..., 8.5286e+01,
          8.5429e+01, 8.5571e+01]],

        [[8.5714e+01, 8.5857e+01, 8.6000e+01,  ..., 8.9571e+01,
          8.9714e+01, 8.9857e+01],
         [9.0000e+01, 9.0143e+01, 9.0286e+01,  ..., 9.3857e+01,
          9.4000e+01, 9.4143e+01],
         [9.4286e+01, 9.4429e+01, 9.4571e+01,  ..., 9.8143e+01,
          9.8286e+01, 9.8429e+01],
         ...,
         [1.1571e+02, 1.1586e+02, 1.1600e+02,  ..., 1.1957e+02,
          1.1971e+02, 1.1986e+02],
         [1.2000e+02, 1.2014e+02, 1.2029e+02,  ..., 1.2386e+02,
          1.2400e+02, 1.2414e+02],
         [1.2429e+02, 1.2443e+02, 1.2457e+02,  ..., 1.2814e+02,
          1.2829e+02, 1.2843e+02]],

        ...,

        [[3.0000e+02, 3.0014e+02, 3.0029e+02,  ..., 3.0386e+02,
          3.0400e+02, 3.0414e+02],
         [3.0429e+02, 3.0443e+02, 3.0457e+02,  ..., 3.0814e+02,
          3.0829e+02, 3.0843e+02],
         [3.0857e+02, 3.0871e+02, 3.0886e+02,  ..., 3.1243e+02,
          3.1257e+02, 3.1271e+02],
         ...,
         [3.3000e+02, 3.3014e+02, 3.3029e+02,  ..., 3.3386e+02,
          3.3400e+02, 3.3414e+02],
         [3.3429e+02, 3.3443e+02, 3.3457e+02,  ..., 3.3814e+02,
          3.3829e+02, 3.3843e+02],
         [3.3857e+02, 3.3871e+02, 3.3886e+02,  ..., 3.4243e+02,
          3.4257e+02, 3.4271e+02]],

        [[3.4286e+02, 3.4300e+02, 3.4314e+02,  ..., 3.4671e+02,
          3.4686e+02, 3.4700e+02],
         [3.4714e+02, 3.4729e+02, 3.4743e+02,  ..., 3.5100e+02,
          3.5114e+02, 3.5129e+02],
         [3.5143e+02, 3.5157e+02, 3.5171e+02,  ..., 3.5529e+02,
          3.5543e+02, 3.5557e+02],
         ...,
         [3.7286e+02, 3.7300e+02, 3.7314e+02,  ..., 3.7671e+02,
          3.7686e+02, 3.7700e+02],
         [3.7714e+02, 3.7729e+02, 3.7743e+02,  ..., 3.8100e+02,
          3.8114e+02, 3.8129e+02],
         [3.8143e+02, 3.8157e+02, 3.8171e+02,  ..., 3.8529e+02,
          3.8543e+02, 3.8557e+02]],

        [[3.8571e+02, 3.8586e+02, 3.8600e+02,  ..., 3.8957e+02,
          3.8971e+02, 3.8986e+02],
         [3.9000e+02, 3.9014e+02, 3.9029e+02,  ..., 3.9386e+02,
          3.9400e+02, 3.9414e+02],
         [3.9429e+02, 3.9443e+02, 3.9457e+02,  ..., 3.9814e+02,
          3.9829e+02, 3.9843e+02],
         ...,
         [4.1571e+02, 4.1586e+02, 4.1600e+02,  ..., 4.1957e+02,
          4.1971e+02, 4.1986e+02],
         [4.2000e+02, 4.2014e+02, 4.2029e+02,  ..., 4.2386e+02,
          4.2400e+02, 4.2414e+02],
         [4.2429e+02, 4.2443e+02, 4.2457e+02,  ..., 4.2814e+02,
          4.2829e+02, 4.2843e+02]]]))x");
}

TEST(PrintTest, StreamOperatorAndUndefined) {
  std::ostringstream os;
  os << tensor({1.5, 2.25});
  EXPECT_EQ(os.str(), "tensor([1.5000, 2.2500])");
  std::ostringstream undefined;
  undefined << Tensor();
  EXPECT_EQ(undefined.str(), "[ Tensor (undefined) ]");
}

TEST(PrintTest, StridedAndReducedPrecisionSummaries) {
  // A strided view prints its logical order; a large bf16 tensor summarises in float.
  Tensor t = arange(20.).view({4, 5}).slice(1, 0, 5, 2);
  EXPECT_EQ(t.str(),
            "tensor([[ 0.,  2.,  4.],\n        [ 5.,  7.,  9.],\n"
            "        [10., 12., 14.],\n        [15., 17., 19.]])");
  Tensor b = ones({1001}, kBFloat16);
  EXPECT_EQ(b.str(), "tensor([1., 1., 1.,  ..., 1., 1., 1.], dtype=kiln.bfloat16)");
}

}  // namespace
}  // namespace kiln
