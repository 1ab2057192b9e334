// linear_cross_entropy (tensor/linear_cross_entropy.h) against the unchunked composition it
// replaces, cross_entropy_fused(x W^T): the loss and the gradients of x and weight, over chunk
// sizes that split the rows unevenly, ignored targets (a whole chunk of them, and all of them),
// 16-bit dtypes, no-grad calls, autocast and the errors.
#include "tensor/linear_cross_entropy.h"

#include <gtest/gtest.h>

#include <cmath>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "nn/autocast.h"
#include "tensor/indexing.h"
#include "tensor/ops.h"
#include "tensor/registry.h"
#include "tensor/tensor_data.h"
#include "test_util.h"

namespace kiln {
namespace {

using autograd::variable_list;

struct Result {
  Tensor loss, dx, dw;
};

// The reference: the logits whole, in f64.
Result reference(const Tensor& x, const Tensor& w, const Tensor& t, double scale = 1.0) {
  const Tensor xd = x.detach().to(kDouble).requires_grad_(true);
  const Tensor wd = w.detach().to(kDouble).requires_grad_(true);
  const Tensor loss = cross_entropy_fused(mm(xd, wd.t()), t);
  const variable_list g = autograd::grad({loss * scale}, {xd, wd});
  return {loss.detach(), g[0], g[1]};
}

// The op through autograd with chunk_rows (0: the default).
Result fused(const Tensor& x, const Tensor& w, const Tensor& t, int64_t chunk_rows,
             double scale = 1.0) {
  static const OpDef& op = KILN_OP(linear_cross_entropy);
  const Tensor xl = x.detach().clone().requires_grad_(true);
  const Tensor wl = w.detach().clone().requires_grad_(true);
  const Tensor loss = call_op(op, {xl, wl, t}, {int64_t{-100}, true, chunk_rows})[0];
  const variable_list g = autograd::grad({loss * scale}, {xl, wl});
  return {loss.detach(), g[0], g[1]};
}

void expect_close(const Tensor& got, const Tensor& want, double tol) {
  ASSERT_EQ(to_shape(got.sizes()), to_shape(want.sizes()));
  EXPECT_TRUE(allclose(got.to(kDouble), want.to(kDouble), tol, tol))
      << "max |diff| " << (got.to(kDouble) - want.to(kDouble)).abs().max().item<double>();
}

TEST(LinearCrossEntropy, EqualsTheLogitsWholeOverChunkSizes) {
  manual_seed(70);
  const Tensor x = randn({13, 8}, kDouble), w = randn({11, 8}, kDouble);
  Tensor t = randint(0, 11, {13});
  t.index_put_({tensor({2, 7}, kInt64)}, -100);
  const Result want = reference(x, w, t, 1.5);
  for (int64_t rows : {0, 1, 3, 5, 13, 100}) {
    SCOPED_TRACE("chunk_rows " + std::to_string(rows));
    const Result got = fused(x, w, t, rows, 1.5);
    expect_close(got.loss, want.loss, 1e-12);
    expect_close(got.dx, want.dx, 1e-12);
    expect_close(got.dw, want.dw, 1e-12);
  }
  // The public form, with the default chunking.
  const Tensor xl = x.clone().requires_grad_(true);
  linear_cross_entropy(xl, w, t).backward();
  expect_close(xl.grad(), reference(x, w, t).dx, 1e-12);
}

TEST(LinearCrossEntropy, IgnoredChunksAndAllIgnored) {
  manual_seed(71);
  const Tensor x = randn({8, 4}, kDouble), w = randn({5, 4}, kDouble);
  // Rows 0-3 ignored: with chunks of 4 rows the first chunk has no target.
  const Tensor t = tensor({-100, -100, -100, -100, 1, 4, 0, 2}, kInt64);
  const Result want = reference(x, w, t);
  const Result got = fused(x, w, t, 4);
  expect_close(got.loss, want.loss, 1e-12);
  expect_close(got.dx, want.dx, 1e-12);
  expect_close(got.dw, want.dw, 1e-12);
  EXPECT_EQ(got.dx.narrow(0, 0, 4).abs().max().item<double>(), 0.0);
  // Every target ignored: a NaN loss, as cross_entropy; zero gradients.
  const Tensor none = full({8}, -100, kInt64);
  const Result all = fused(x, w, none, 3);
  EXPECT_TRUE(std::isnan(all.loss.item<double>()));
  EXPECT_TRUE(std::isnan(cross_entropy_fused(mm(x, w.t()), none).item<double>()));
  EXPECT_EQ(all.dx.abs().max().item<double>(), 0.0);
  EXPECT_EQ(all.dw.abs().max().item<double>(), 0.0);
}

TEST(LinearCrossEntropy, SixteenBitDtypes) {
  manual_seed(72);
  const Tensor x = randn({40, 16}), w = randn({24, 16}) * 0.5;
  const Tensor t = randint(0, 24, {40});
  const Result want = reference(x, w, t);
  for (ScalarType dtype : {kBFloat16, kHalf, kFloat}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Result got = fused(x.to(dtype), w.to(dtype), t, 16);
    EXPECT_EQ(got.loss.dtype(), kFloat);
    EXPECT_EQ(got.dx.dtype(), dtype);
    EXPECT_EQ(got.dw.dtype(), dtype);
    const double tol = dtype == kFloat ? 1e-5 : 3e-2;
    expect_close(got.loss, want.loss, tol);
    expect_close(got.dx, want.dx, tol);
    expect_close(got.dw, want.dw, tol);
  }
}

TEST(LinearCrossEntropy, WithoutGradStoresNothing) {
  manual_seed(73);
  const Tensor x = randn({6, 4}), w = randn({5, 4}).requires_grad_(true);
  const Tensor t = randint(0, 5, {6});
  static const OpDef& op = KILN_OP(linear_cross_entropy);
  {
    NoGradGuard no_grad;
    const TensorVec out = call_op(op, {x, w, t}, {int64_t{-100}, false, int64_t{0}});
    EXPECT_EQ(to_shape(out[1].sizes()), (Shape{0}));
    EXPECT_EQ(to_shape(out[2].sizes()), (Shape{0}));
    expect_close(out[0], cross_entropy_fused(mm(x, w.t()), t), 1e-6);
    EXPECT_FALSE(linear_cross_entropy(x, w, t).requires_grad());
  }
  // Neither input requires grad: no gradients are computed, the loss is the same.
  expect_close(linear_cross_entropy(x, w.detach(), t), cross_entropy_fused(mm(x, w.t()), t), 1e-6);
}

TEST(LinearCrossEntropy, AutocastRunsInTheLowerPrecision) {
  manual_seed(74);
  const Tensor x = randn({12, 8}), w = randn({9, 8});
  const Tensor t = randint(0, 9, {12});
  const Tensor want = cross_entropy_fused(mm(x.to(kBFloat16), w.to(kBFloat16).t()), t);
  const Tensor xl = x.clone().requires_grad_(true);
  Tensor loss;
  {
    AutocastGuard autocast(kCPU, kBFloat16);
    loss = linear_cross_entropy(xl, w, t);
  }
  expect_close(loss, want, 1e-5);
  loss.backward();
  EXPECT_EQ(xl.grad().dtype(), kFloat);  // cast back to the input's dtype, as for linear
}

TEST(LinearCrossEntropy, Errors) {
  const Tensor x = randn({6, 4}), w = randn({5, 4}), t = randint(0, 5, {6});
  EXPECT_KILN_ERROR(linear_cross_entropy(x, randn({5, 3}), t),
                    "[linear_cross_entropy] expected x [N, C] and weight [V, C], got [6, 4] and "
                    "[5, 3]");
  EXPECT_KILN_ERROR(linear_cross_entropy(x, w.to(kDouble), t),
                    "[linear_cross_entropy] expected x and weight of one floating-point dtype, "
                    "got float32 and float64");
  EXPECT_KILN_ERROR(linear_cross_entropy(x, w, t.to(kInt32)),
                    "[linear_cross_entropy] expected int64 targets [6], got int32 [6]");
  EXPECT_KILN_ERROR(linear_cross_entropy(x, w, randint(0, 5, {5})),
                    "[linear_cross_entropy] expected int64 targets [6], got int64 [5]");
  EXPECT_KILN_ERROR(linear_cross_entropy(x, w, tensor({0, 1, 2, 3, 4, 9}, kInt64)),
                    "[cross_entropy_fused] target 9");
  // No double backward: the gradients come from the forward.
  const Tensor xl = x.clone().requires_grad_(true);
  const Tensor loss = linear_cross_entropy(xl, w, t);
  EXPECT_KILN_ERROR(autograd::grad({loss}, {xl}, {}, true, /*create_graph=*/true),
                    "[linear_cross_entropy] has no double backward");
}

}  // namespace
}  // namespace kiln
