// Sizes that overflow int64 (issue 21, point 5), and numbers that do not fit the integer they are
// converted to (point 8): every shape, numel, stride and byte count is
// checked, so that no overflowing tensor can be made and no out-of-bounds access follows from
// one. Each case failed before: empty({1 << 62, 4}) returned an empty tensor (2^64 wrapped to
// 0), and an as_strided view whose extent wrapped negative passed its bounds check.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kiln.h"
#include "test_util.h"

namespace kiln {
namespace {

constexpr int64_t kHuge = int64_t{1} << 62;

TEST(SizeOverflow, FactoriesRejectShapesWhoseElementCountOverflows) {
  EXPECT_KILN_ERROR(empty({kHuge, 4}), "more elements than an int64 can count");
  EXPECT_KILN_ERROR(zeros({kHuge, 4}), "more elements than an int64 can count");
  EXPECT_KILN_ERROR(ones({4, kHuge, 4}), "more elements than an int64 can count");
  // numel fits, bytes do not: 2^62 floats are 2^64 bytes.
  EXPECT_KILN_ERROR(empty({kHuge}), "more bytes than an int64 can count");
  // A 0 anywhere: no elements, whatever the other sizes (as PyTorch), but the strides of the
  // other dims still overflow.
  EXPECT_EQ(numel_of({kHuge, kHuge, 0}), 0);
  EXPECT_KILN_ERROR(empty({0, kHuge, 8}), "strides of [0, 4611686018427387904, 8] overflow");
  EXPECT_EQ(empty({kHuge, 0}).numel(), 0);
}

TEST(SizeOverflow, ViewsRejectOverflowingShapes) {
  const Tensor x = zeros({2, 3});
  EXPECT_KILN_ERROR(x.reshape({kHuge, kHuge, 6}), "more elements than an int64 can count");
  EXPECT_KILN_ERROR(x.view({kHuge, 8, 2, 3}), "more elements than an int64 can count");
  // 3 * 6148914691236517206 wraps to 2: without the check, a view of 2 elements.
  EXPECT_KILN_ERROR(zeros({2}).view({3, 6148914691236517206}), "more elements than an int64");
  EXPECT_KILN_ERROR(zeros({2}).reshape({-1, 3, 6148914691236517206}), "more elements");
  EXPECT_KILN_ERROR(zeros({1}).expand({kHuge, 4}), "more elements than an int64 can count");
}

TEST(SizeOverflow, AsStridedChecksItsExtentWithoutWrapping) {
  const Tensor x = zeros({16});
  // (2 - 1) * 2^62 + (3 - 1) * 2^62 wraps to a small value without the check.
  EXPECT_KILN_ERROR(x.as_strided({2, 3}, {kHuge, kHuge}), "span more elements than an int64");
  EXPECT_KILN_ERROR(x.as_strided({2}, {1}, INT64_MAX), "overflows an int64");
  EXPECT_KILN_ERROR(x.as_strided({4, 4}, {4, 2}), "reads element 18 of a storage holding 16");
  EXPECT_EQ(x.as_strided({4, 4}, {4, 1}).sum().item<double>(), 0.0);
}

TEST(SizeOverflow, FromBlobChecksItsExtent) {
  std::vector<float> buf(4);
  EXPECT_KILN_ERROR(from_blob(buf.data(), {kHuge, 4}), "the strides of [4611686018427387904, 4] overflow");
  EXPECT_KILN_ERROR(from_blob(buf.data(), {2, 2}, {kHuge, kHuge}),
                    "span more elements than an int64");
  EXPECT_KILN_ERROR(from_blob(buf.data(), {kHuge}, {1}), "more bytes than an int64 can count");
}

TEST(SizeOverflow, LayoutHelpers) {
  EXPECT_EQ(layout_extent({2, 3}, {3, 1}, "t"), 6);
  EXPECT_EQ(layout_extent({2, 3}, {0, 1}, "t"), 3);
  EXPECT_EQ(layout_extent({2, 0}, {3, 1}, "t"), 0);
  EXPECT_KILN_ERROR(layout_extent({2}, {-1}, "myop"), "[myop] negative size or stride");
  EXPECT_KILN_ERROR(layout_extent({2}, {1, 1}, "myop"), "different lengths");
  EXPECT_EQ(nbytes_of({2, 3}, 4, "t"), 24u);
  EXPECT_KILN_ERROR(nbytes_of({kHuge, 2}, 1, "myop"), "more elements");
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

// item<int64_t>() of NaN, an infinity or an out-of-range value is an error (issue 21, point 8),
// not the undefined behaviour of a float-to-int cast.
TEST(ScalarConversion, NonFiniteOrOutOfRangeToIntegerIsAnError) {
  EXPECT_KILN_ERROR(full({}, std::nan("")).item<int64_t>(), "cannot be converted to a 64-bit");
  EXPECT_KILN_ERROR(full({}, INFINITY).item<int64_t>(), "NaN, infinite or out of range");
  EXPECT_KILN_ERROR(full({}, 1e19).item<int64_t>(), "cannot be converted");
  EXPECT_KILN_ERROR(full({}, 3e9).item<int32_t>(), "cannot be converted to a 32-bit");
  // uint8 follows c10: floats in [0, 255], integers in [-255, 255] (negatives wrap).
  EXPECT_KILN_ERROR(Scalar(-1.0).to<uint8_t>(), "cannot be converted to uint8 without overflow");
  EXPECT_KILN_ERROR(Scalar(255.5).to<uint8_t>(), "cannot be converted to uint8");
  EXPECT_KILN_ERROR(Scalar(256).to<uint8_t>(), "the value 256 cannot be converted to uint8");
  EXPECT_EQ(Scalar(255.0).to<uint8_t>(), 255);
  EXPECT_EQ(Scalar(-1).to<uint8_t>(), 255);
  EXPECT_EQ(full({}, -2.75).item<int64_t>(), -2);  // truncation, as a C++ cast
  EXPECT_EQ(full({}, -9.2233720368547758e18).item<int64_t>(), INT64_MIN);
  EXPECT_TRUE(std::isnan(full({}, std::nan("")).item<double>()));
}

}  // namespace
}  // namespace kiln
