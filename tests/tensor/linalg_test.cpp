// Linear algebra: mm, bmm, addmm, matmul, linear, outer and dot against f64 triple-loop
// references: every matmul case of PyTorch's semantics, transposed, sliced and expanded
// operands, empty dims, each dtype, and every misuse.
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "tensor/registry.h"
#include "test_util.h"

namespace kiln {
namespace {

// Deterministic test data: normal floats, or small integers for integral dtypes (so integer
// products are exact and float references are exact too).
Tensor random_tensor(IntArrayRef sizes, ScalarType dtype = kFloat, uint32_t seed = 1) {
  std::mt19937 gen(seed);
  std::vector<float> v(numel_of(sizes));
  if (is_integral(dtype, /*include_bool=*/true)) {
    std::uniform_int_distribution<int> d(dtype == kBool ? 0 : -4, dtype == kBool ? 1 : 4);
    for (float& x : v) x = static_cast<float>(d(gen));
  } else {
    std::normal_distribution<float> d;
    for (float& x : v) x = d(gen);
  }
  return from_blob(v.data(), sizes, kFloat).clone().to(dtype);
}

// torch.matmul by plain f64 loops, with its 1-D promotion and batch broadcasting. `abs` gets
// sum |a||b| per output element: the scale that rounding errors are relative to.
struct Reference {
  Shape sizes;
  std::vector<double> values, abs;
};

Reference ref_matmul(const Tensor& a, const Tensor& b) {
  const std::vector<double> av = a.to_vector<double>(), bv = b.to_vector<double>();
  Shape as = to_shape(a.sizes()), bs = to_shape(b.sizes());
  if (a.dim() == 1) as.insert(as.begin(), 1);
  if (b.dim() == 1) bs.push_back(1);
  const int64_t n = as[as.size() - 2], k = as.back(), p = bs.back();
  const Shape a_batch(as.begin(), as.end() - 2), b_batch(bs.begin(), bs.end() - 2);
  const size_t nd = std::max(a_batch.size(), b_batch.size());
  Shape batch(nd), ab(nd, 1), bb(nd, 1);
  std::copy(a_batch.begin(), a_batch.end(), ab.begin() + (nd - a_batch.size()));
  std::copy(b_batch.begin(), b_batch.end(), bb.begin() + (nd - b_batch.size()));
  for (size_t d = 0; d < nd; ++d) batch[d] = ab[d] == 1 ? bb[d] : ab[d];
  Reference r;
  r.sizes = batch;
  if (a.dim() > 1) r.sizes.push_back(n);
  if (b.dim() > 1) r.sizes.push_back(p);
  const int64_t nb = numel_of(batch);
  r.values.assign(nb * n * p, 0.0);
  r.abs.assign(nb * n * p, 0.0);
  for (int64_t i = 0; i < nb; ++i) {
    // Broadcast batch index -> offsets into a and b (size-1 dims repeat).
    int64_t rem = i, ia = 0, ib = 0, sa = 1, sb = 1;
    for (int64_t d = static_cast<int64_t>(nd) - 1; d >= 0; --d) {
      const int64_t idx = rem % batch[d];
      rem /= batch[d];
      ia += (ab[d] == 1 ? 0 : idx) * sa;
      ib += (bb[d] == 1 ? 0 : idx) * sb;
      sa *= ab[d];
      sb *= bb[d];
    }
    for (int64_t r0 = 0; r0 < n; ++r0) {
      for (int64_t c = 0; c < p; ++c) {
        double s = 0, sabs = 0;
        for (int64_t j = 0; j < k; ++j) {
          const double x = av[(ia * n + r0) * k + j], y = bv[(ib * k + j) * p + c];
          s += x * y;
          sabs += std::abs(x * y);
        }
        r.values[(i * n + r0) * p + c] = s;
        r.abs[(i * n + r0) * p + c] = sabs;
      }
    }
  }
  return r;
}

// Relative rounding allowance per dtype, applied to sum |a||b|.
double tolerance(ScalarType t) {
  switch (t) {
    case kDouble:
      return 1e-12;
    case kFloat:
      return 1e-5;
    case kHalf:
      return 1.5e-3;  // one f16 rounding of the f32 result (2^-11) plus f32 sums
    case kBFloat16:
      return 6e-3;  // one bf16 rounding (2^-9) plus f32 sums
    default:
      return 0;  // integers are exact
  }
}

void expect_matches(const Tensor& got, const Reference& want, ScalarType dtype) {
  ASSERT_EQ(to_shape(got.sizes()), want.sizes);
  ASSERT_EQ(got.dtype(), dtype);
  const std::vector<double> g = got.to_vector<double>();
  ASSERT_EQ(g.size(), want.values.size());
  const double tol = tolerance(dtype);
  for (size_t i = 0; i < g.size(); ++i) {
    ASSERT_NEAR(g[i], want.values[i], tol * want.abs[i] + 1e-30) << "element " << i;
  }
}

void check_matmul(const Tensor& a, const Tensor& b) {
  expect_matches(matmul(a, b), ref_matmul(a, b), a.dtype());
}

constexpr ScalarType kAllDtypes[] = {kFloat, kDouble, kHalf, kBFloat16, kInt32, kInt64};

using test::OpRecorder;

TEST(LinalgTest, MmKnownValues) {
  const Tensor a = tensor({{1.0f, 2.0f}, {3.0f, 4.0f}});
  const Tensor b = tensor({{5.0f, 6.0f}, {7.0f, 8.0f}});
  EXPECT_EQ(mm(a, b).to_vector<float>(), (std::vector<float>{19, 22, 43, 50}));
  EXPECT_EQ(a.mm(b).to_vector<float>(), (std::vector<float>{19, 22, 43, 50}));
  EXPECT_EQ(a.matmul(b.t()).to_vector<float>(), (std::vector<float>{17, 23, 39, 53}));
}

TEST(LinalgTest, MmEveryDtype) {
  for (ScalarType t : kAllDtypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const Tensor a = random_tensor({5, 7}, t, 1), b = random_tensor({7, 3}, t, 2);
    expect_matches(mm(a, b), ref_matmul(a, b), t);
    // Large enough for Eigen's blocked, multi-threaded GEMM (output > 32768 elements).
    const Tensor c = random_tensor({256, 96}, t, 3), d = random_tensor({96, 160}, t, 4);
    expect_matches(mm(c, d), ref_matmul(c, d), t);
  }
}

TEST(LinalgTest, MmTransposedSlicedAndExpandedOperands) {
  for (ScalarType t : {kFloat, kDouble, kHalf, kInt64}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const Tensor at = random_tensor({7, 5}, t, 5).t();  // column-major [5, 7]
    const Tensor bt = random_tensor({3, 7}, t, 6).t();  // column-major [7, 3]
    const Tensor a = random_tensor({5, 7}, t, 7), b = random_tensor({7, 3}, t, 8);
    expect_matches(mm(at, b), ref_matmul(at, b), t);
    expect_matches(mm(a, bt), ref_matmul(a, bt), t);
    expect_matches(mm(at, bt), ref_matmul(at, bt), t);
    // Column slice: row-major with a leading dimension wider than the row.
    const Tensor as = random_tensor({5, 12}, t, 9).slice(1, 2, 9);
    expect_matches(mm(as, b), ref_matmul(as, b), t);
    // Row slice of a transposed matrix: column-major with a wide leading dimension.
    const Tensor bs = random_tensor({10, 9}, t, 10).t().slice(0, 1, 8).slice(1, 2, 5);
    expect_matches(mm(a, bs), ref_matmul(a, bs), t);
    // Neither dim has stride 1: copied before the GEMM.
    const Tensor stepped = random_tensor({10, 14}, t, 11).slice(0, 0, 10, 2).slice(1, 0, 14, 2);
    expect_matches(mm(stepped, b), ref_matmul(stepped, b), t);
    // Expanded (stride 0) operands.
    const Tensor row = random_tensor({1, 7}, t, 12).expand({5, 7});
    const Tensor col = random_tensor({7, 1}, t, 13).expand({7, 3});
    expect_matches(mm(row, col), ref_matmul(row, col), t);
  }
  // The operands are read, never written.
  const Tensor a = random_tensor({4, 4}, kFloat, 14);
  const std::vector<float> before = a.to_vector<float>();
  mm(a.t(), a);
  EXPECT_EQ(a.to_vector<float>(), before);
}

TEST(LinalgTest, EmptyDims) {
  for (ScalarType t : kAllDtypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    EXPECT_EQ(to_shape(mm(random_tensor({0, 3}, t), random_tensor({3, 4}, t)).sizes()),
              (Shape{0, 4}));
    EXPECT_EQ(to_shape(mm(random_tensor({2, 3}, t), random_tensor({3, 0}, t)).sizes()),
              (Shape{2, 0}));
    // k = 0: a sum of no products is 0.
    const Tensor z = mm(random_tensor({2, 0}, t), random_tensor({0, 3}, t));
    EXPECT_EQ(to_shape(z.sizes()), (Shape{2, 3}));
    EXPECT_EQ(z.to_vector<double>(), std::vector<double>(6, 0.0));
    const Tensor zb = bmm(random_tensor({2, 3, 0}, t), random_tensor({2, 0, 4}, t));
    EXPECT_EQ(zb.to_vector<double>(), std::vector<double>(24, 0.0));
    const Tensor zd = dot(random_tensor({0}, t), random_tensor({0}, t));
    EXPECT_EQ(zd.dim(), 0);
    EXPECT_EQ(zd.item<double>(), 0.0);
    // k = 0 in addmm leaves beta * self.
    const Tensor s = random_tensor({2, 3}, t, 3);
    const Tensor y = addmm(s, random_tensor({2, 0}, t), random_tensor({0, 3}, t), 2, 3);
    const std::vector<double> sv = s.to_vector<double>(), yv = y.to_vector<double>();
    for (size_t i = 0; i < sv.size(); ++i) EXPECT_NEAR(yv[i], 2 * sv[i], 1e-2 * std::abs(sv[i]));
  }
  check_matmul(random_tensor({0, 3, 4}), random_tensor({4, 5}));
  check_matmul(random_tensor({2, 0, 4}), random_tensor({2, 4, 5}));
  check_matmul(random_tensor({3, 0, 4}), random_tensor({4}));
}

TEST(LinalgTest, Bmm) {
  for (ScalarType t : kAllDtypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const Tensor a = random_tensor({4, 3, 5}, t, 1), b = random_tensor({4, 5, 2}, t, 2);
    expect_matches(bmm(a, b), ref_matmul(a, b), t);
    expect_matches(a.bmm(b), ref_matmul(a, b), t);
    // Transposed matrices and a permuted batch dim.
    const Tensor at = random_tensor({4, 5, 3}, t, 3).transpose(1, 2);
    const Tensor bp = random_tensor({5, 4, 2}, t, 4).permute({1, 0, 2});
    expect_matches(bmm(at, bp), ref_matmul(at, bp), t);
    // A shared right operand as a batch-stride-0 view.
    const Tensor shared = random_tensor({1, 5, 2}, t, 5).expand({4, 5, 2});
    expect_matches(bmm(a, shared), ref_matmul(a, shared), t);
  }
  // Many small products: the batch is split across threads.
  const Tensor a = random_tensor({1100, 8, 8}, kFloat, 6),
               b = random_tensor({1100, 8, 8}, kFloat, 7);
  expect_matches(bmm(a, b), ref_matmul(a, b), kFloat);
  // A few large ones: Eigen threads each product.
  const Tensor c = random_tensor({2, 140, 130}, kDouble, 8),
               d = random_tensor({2, 130, 120}, kDouble, 9);
  expect_matches(bmm(c, d), ref_matmul(c, d), kDouble);
}

TEST(LinalgTest, MatmulVectorCases) {
  for (ScalarType t : kAllDtypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const Tensor v = random_tensor({6}, t, 1), w = random_tensor({6}, t, 2);
    const Tensor m = random_tensor({4, 6}, t, 3), mt = random_tensor({6, 4}, t, 4);
    const Tensor d = matmul(v, w);  // dot
    EXPECT_EQ(d.dim(), 0);
    check_matmul(v, w);
    check_matmul(m, v);   // mv
    check_matmul(v, mt);  // vector @ matrix
    check_matmul(m, mt);  // mm
    check_matmul(mt.t(), v);
    check_matmul(v, m.t());
  }
}

TEST(LinalgTest, MatmulBatchedCases) {
  for (ScalarType t : kAllDtypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    check_matmul(random_tensor({2, 3, 4, 5}, t, 1), random_tensor({5, 6}, t, 2));   // fold
    check_matmul(random_tensor({2, 3, 5}, t, 3), random_tensor({5}, t, 4));         // batched mv
    check_matmul(random_tensor({5}, t, 5), random_tensor({2, 3, 5, 4}, t, 6));      // vec @ batch
    check_matmul(random_tensor({3, 5}, t, 7), random_tensor({2, 5, 4}, t, 8));      // mat @ batch
    check_matmul(random_tensor({3, 4, 5}, t, 9), random_tensor({3, 5, 2}, t, 10));  // bmm
    // Batch broadcasting: [j, 1, n, m] @ [k, m, p] -> [j, k, n, p].
    check_matmul(random_tensor({2, 1, 3, 4}, t, 11), random_tensor({5, 4, 6}, t, 12));
    check_matmul(random_tensor({1, 3, 4}, t, 13), random_tensor({2, 1, 4, 2}, t, 14));
    check_matmul(random_tensor({3, 1, 2, 3, 4}, t, 15), random_tensor({2, 1, 4, 3}, t, 16));
  }
  // Non-contiguous batched operands (folding needs a copy; bmm reads strided batches).
  const Tensor a = random_tensor({5, 2, 3}, kFloat, 17).permute({1, 2, 0});  // [2, 3, 5]
  const Tensor b = random_tensor({6, 5}, kFloat, 18).t();                    // [5, 6]
  check_matmul(a, b);
  check_matmul(a, random_tensor({2, 6, 5}, kFloat, 19).transpose(1, 2));
  check_matmul(random_tensor({4, 3}, kFloat, 20).expand({2, 4, 3}), random_tensor({3, 2}));
  // Large enough that the folded GEMM is threaded: [8, 64, 96] @ [96, 80].
  check_matmul(random_tensor({8, 64, 96}, kFloat, 21), random_tensor({96, 80}, kFloat, 22));
}

TEST(LinalgTest, MatmulMapsToOneGemmWithoutCopies) {
  const Tensor x = random_tensor({4, 16, 32}), w = random_tensor({32, 8});
  const Tensor wt = random_tensor({8, 32}).t();
  {
    OpRecorder rec;
    matmul(x, w);
    EXPECT_EQ(rec.count("mm"), 1);
    EXPECT_EQ(rec.count("to_copy"), 0);
    EXPECT_EQ(rec.count("bmm"), 0);
  }
  {
    OpRecorder rec;
    matmul(x, wt);  // a transposed weight is read in place
    EXPECT_EQ(rec.count("mm"), 1);
    EXPECT_EQ(rec.count("to_copy"), 0);
  }
  {
    OpRecorder rec;
    matmul(x[0], w);
    EXPECT_EQ(OpRecorder::names(), (std::vector<std::string>{"select", "mm"}));
  }
  {
    // A broadcast left operand stays a stride-0 view.
    OpRecorder rec;
    matmul(w.t(), x.transpose(1, 2));
    EXPECT_EQ(rec.count("bmm"), 1);
    EXPECT_EQ(rec.count("to_copy"), 0);
  }
  {
    const Tensor weight = random_tensor({8, 32}), bias = random_tensor({8});
    OpRecorder rec;
    linear(x, weight, bias);
    EXPECT_EQ(rec.count("addmm"), 1);
    EXPECT_EQ(rec.count("to_copy"), 0);
  }
}

// mm_with_bias_grad (a Linear layer's weight and bias gradients in one call): the product and
// the sums over k of the chosen operand, against the plain-loop reference and f64 sums; the meta
// rule's errors.
TEST(LinalgTest, MmWithBiasGrad) {
  static const OpDef& op = KILN_OP(mm_with_bias_grad);
  for (ScalarType t : {kFloat, kDouble, kBFloat16}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const Tensor a = random_tensor({5, 7}, t, 5), b = random_tensor({7, 3}, t, 6);
    for (int64_t operand : {0, 1}) {
      const TensorVec r = call_op(op, {a, b}, {operand});
      expect_matches(r[0], ref_matmul(a, b), t);
      const Tensor want = operand == 0 ? a.to(kDouble).sum({1}) : b.to(kDouble).sum({0});
      ASSERT_EQ(r[1].sizes(), want.sizes());
      EXPECT_EQ(r[1].dtype(), t);
      const double tol = t == kBFloat16 ? 1e-2 : 1e-6;
      EXPECT_TRUE(allclose(r[1].to(kDouble), want, tol, tol)) << operand;
    }
    // A transposed operand (a Linear layer's g^T) reads in place.
    const TensorVec r = call_op(op, {a.t().contiguous().t(), b}, {int64_t{0}});
    expect_matches(r[0], ref_matmul(a, b), t);
  }
  const Tensor a = random_tensor({2, 3}), b = random_tensor({3, 4});
  EXPECT_KILN_ERROR(call_op(op, {a, b}, {int64_t{2}}), "[mm_with_bias_grad] operand must be 0");
  EXPECT_KILN_ERROR(call_op(op, {a, b.t()}, {int64_t{0}}), "cannot be multiplied");
  EXPECT_KILN_ERROR(call_op(op, {a.to(kInt64), b.to(kInt64)}, {int64_t{0}}),
                    "[mm_with_bias_grad] expected floating-point operands, got int64");
  EXPECT_KILN_ERROR(call_op(op, {a, b.unsqueeze(0)}, {int64_t{0}}), "expected 2-D tensors");
}

// addmm_activation (matmul_epilogue's mm or addmm with relu / tanh-gelu): relu(addmm) and
// gelu(addmm, "tanh") on the CPU (the decomposition), and the meta rule's errors.
TEST(LinalgTest, AddmmActivation) {
  static const OpDef& op = KILN_OP(addmm_activation);
  const Tensor self = random_tensor({3}, kDouble, 7), a = random_tensor({4, 5}, kDouble, 8),
               b = random_tensor({5, 3}, kDouble, 9);
  const Tensor pre = addmm(self, a, b, 0.5, 2.0);
  EXPECT_TRUE(allclose(call_op1(op, {self, a, b}, {Scalar(0.5), Scalar(2.0), false}), relu(pre)));
  EXPECT_TRUE(
      allclose(call_op1(op, {self, a, b}, {Scalar(0.5), Scalar(2.0), true}), gelu(pre, "tanh")));
  EXPECT_KILN_ERROR(call_op1(op, {self.to(kInt64), a.to(kInt64), b.to(kInt64)},
                             {Scalar(int64_t{1}), Scalar(int64_t{1}), false}),
                    "[addmm_activation] expected floating-point operands, got int64");
  EXPECT_KILN_ERROR(call_op1(op, {self, a, b.t()}, {Scalar(1.0), Scalar(1.0), false}),
                    "cannot be multiplied");
}

// addmm_gelu_aux and mm_dgelu (matmul_epilogue's tanh-gelu layer with gradients) on the CPU
// (the decompositions): (gelu(p, "tanh"), p) and gelu_backward(a @ b, pre, "tanh"), and the meta
// rules' errors.
TEST(LinalgTest, GeluAuxAndDgelu) {
  static const OpDef& aux = KILN_OP(addmm_gelu_aux);
  static const OpDef& dgelu = KILN_OP(mm_dgelu);
  static const OpDef& gelu_grad = KILN_OP(gelu_backward);
  const Tensor self = random_tensor({3}, kDouble, 7), a = random_tensor({4, 5}, kDouble, 8),
               b = random_tensor({5, 3}, kDouble, 9), pre = random_tensor({4, 3}, kDouble, 10);
  const Tensor p = addmm(self, a, b, 0.5, 2.0);
  const TensorVec r = call_op(aux, {self, a, b}, {Scalar(0.5), Scalar(2.0)});
  ASSERT_EQ(r.size(), 2u);
  EXPECT_TRUE(allclose(r[0], gelu(p, "tanh")));
  EXPECT_TRUE(allclose(r[1], p));
  EXPECT_TRUE(allclose(call_op1(dgelu, {a, b, pre}),
                       call_op1(gelu_grad, {mm(a, b), pre}, {std::string("tanh")})));
  EXPECT_KILN_ERROR(call_op(aux, {self.to(kInt64), a.to(kInt64), b.to(kInt64)},
                            {Scalar(int64_t{1}), Scalar(int64_t{1})}),
                    "[addmm_gelu_aux] expected floating-point operands, got int64");
  EXPECT_KILN_ERROR(call_op1(dgelu, {a, b, pre.t()}),
                    "[mm_dgelu] pre (float64 [3, 4]) must be the product's float64 [4, 3]");
  EXPECT_KILN_ERROR(call_op1(dgelu, {a, b.t(), pre}), "cannot be multiplied");
  EXPECT_KILN_ERROR(call_op1(dgelu, {a, b, pre.to(kFloat)}), "[mm_dgelu] pre (float32");
}

TEST(LinalgTest, Addmm) {
  for (ScalarType t : kAllDtypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const bool integral = is_integral(t, false);
    const Tensor a = random_tensor({4, 6}, t, 1), b = random_tensor({6, 3}, t, 2);
    const Reference prod = ref_matmul(a, b);
    const Scalar beta = integral ? Scalar(2) : Scalar(0.5),
                 alpha = integral ? Scalar(-3) : Scalar(1.5);
    for (const Shape& self_shape : {Shape{4, 3}, Shape{3}, Shape{1, 3}, Shape{4, 1}, Shape{}}) {
      SCOPED_TRACE(shape_str(self_shape));
      const Tensor self = random_tensor(self_shape, t, 3);
      const std::vector<double> sv = self.expand({4, 3}).to_vector<double>();
      Reference want = prod;
      for (size_t i = 0; i < want.values.size(); ++i) {
        want.values[i] = beta.toDouble() * sv[i] + alpha.toDouble() * prod.values[i];
        want.abs[i] = std::abs(beta.toDouble() * sv[i]) + std::abs(alpha.toDouble()) * prod.abs[i];
      }
      expect_matches(addmm(self, a, b, beta, alpha), want, t);
      expect_matches(self.addmm(a.t().contiguous().t(), b, beta, alpha), want, t);
    }
    // Defaults beta = alpha = 1.
    const Tensor self = random_tensor({4, 3}, t, 4);
    const std::vector<double> sv = self.to_vector<double>();
    Reference want = prod;
    for (size_t i = 0; i < sv.size(); ++i) {
      want.values[i] += sv[i];
      want.abs[i] += std::abs(sv[i]);
    }
    expect_matches(addmm(self, a, b), want, t);
  }
  // beta = 0 ignores self, NaNs included (as PyTorch).
  const Tensor nan_self = full({2, 2}, NAN);
  const Tensor a = tensor({{1.0f, 2.0f}, {3.0f, 4.0f}});
  EXPECT_EQ(addmm(nan_self, a, a, 0, 1).to_vector<float>(), (std::vector<float>{7, 10, 15, 22}));
}

TEST(LinalgTest, Linear) {
  for (ScalarType t : {kFloat, kDouble, kHalf, kBFloat16, kInt64}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const Tensor w = random_tensor({5, 7}, t, 1), bias = random_tensor({5}, t, 2);
    const std::vector<double> bv = bias.to_vector<double>();
    for (const Shape& in_shape : {Shape{7}, Shape{3, 7}, Shape{2, 3, 7}, Shape{2, 1, 2, 7}}) {
      SCOPED_TRACE(shape_str(in_shape));
      const Tensor x = random_tensor(in_shape, t, 3);
      const Reference no_bias = ref_matmul(x, w.t());
      expect_matches(linear(x, w), no_bias, t);
      Reference want = no_bias;
      for (size_t i = 0; i < want.values.size(); ++i) {
        want.values[i] += bv[i % 5];
        want.abs[i] += std::abs(bv[i % 5]);
      }
      expect_matches(linear(x, w, bias), want, t);
    }
  }
  // A transposed input (copied when its rows cannot be folded), a 0-d bias, empty batches.
  const Tensor x = random_tensor({7, 3}).t(), w = random_tensor({2, 7});
  const Reference r = ref_matmul(x, w.t());
  Reference want = r;
  for (double& v : want.values) v += 0.25;
  expect_matches(linear(x, w, full({}, 0.25f)), want, kFloat);
  EXPECT_EQ(to_shape(linear(random_tensor({0, 4, 7}), w, random_tensor({2})).sizes()),
            (Shape{0, 4, 2}));
}

TEST(LinalgTest, DotAndOuter) {
  for (ScalarType t : kAllDtypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const Tensor v = random_tensor({9}, t, 1), w = random_tensor({9}, t, 2);
    const Tensor d = dot(v, w);
    EXPECT_EQ(d.dim(), 0);
    expect_matches(d, ref_matmul(v, w), t);
    expect_matches(v.dot(w), ref_matmul(v, w), t);
    const Tensor u = random_tensor({4}, t, 3);
    expect_matches(outer(v, u), ref_matmul(v.unsqueeze(1), u.unsqueeze(0)), t);
    expect_matches(v.outer(u.slice(0, 0, 4, 2)),
                   ref_matmul(v.unsqueeze(1), u.slice(0, 0, 4, 2).unsqueeze(0)), t);
  }
  EXPECT_EQ(dot(tensor({1.0, 2.0, 3.0}), tensor({4.0, 5.0, 6.0})).item<double>(), 32.0);
  // outer multiplies, so its operands promote; bool is logical and.
  const Tensor mixed = outer(tensor({int64_t{1}, int64_t{2}}), tensor({1.5f}));
  EXPECT_EQ(mixed.dtype(), kFloat);
  EXPECT_EQ(mixed.to_vector<float>(), (std::vector<float>{1.5f, 3.0f}));
  const Tensor lb = outer(tensor({true, false}), tensor({true, true}));
  EXPECT_EQ(lb.dtype(), kBool);
  EXPECT_EQ(lb.to_vector<bool>(), (std::vector<bool>{true, true, false, false}));
}

TEST(LinalgTest, MultiThreadedMatchesSingleThreaded) {
  const int saved = get_num_threads();
  const Tensor a = random_tensor({300, 200}, kFloat, 1), b = random_tensor({200, 150}, kFloat, 2);
  set_num_threads(1);
  const std::vector<float> one = mm(a, b).to_vector<float>();
  set_num_threads(2);
  const Reference want = ref_matmul(a, b);
  expect_matches(mm(a, b), want, kFloat);
  const std::vector<float> two = mm(a, b).to_vector<float>();
  for (size_t i = 0; i < one.size(); ++i) ASSERT_NEAR(one[i], two[i], 1e-5 * want.abs[i]);
  set_num_threads(saved);
}

TEST(LinalgTest, Errors) {
  const Tensor a = random_tensor({2, 3}), b = random_tensor({4, 5});
  EXPECT_KILN_ERROR(mm(a, b), "[mm] shapes [2, 3] and [4, 5] cannot be multiplied");
  EXPECT_KILN_ERROR(mm(a, random_tensor({3, 2}, kDouble)),
                    "[mm] expected both operands to have the same dtype, got float32 and float64");
  EXPECT_KILN_ERROR(mm(random_tensor({2, 3, 4}), b), "[mm] expected 2-D tensors, got 3-D and 2-D");
  EXPECT_KILN_ERROR(mm(random_tensor({3}), b), "[mm] expected 2-D");
  EXPECT_KILN_ERROR(mm(random_tensor({2, 2}, kBool), random_tensor({2, 2}, kBool)),
                    "[mm] is not implemented for bool");
  EXPECT_KILN_ERROR(bmm(a, b), "[bmm] expected 3-D tensors");
  EXPECT_KILN_ERROR(bmm(random_tensor({2, 3, 4}), random_tensor({3, 4, 5})),
                    "[bmm] batch sizes of [2, 3, 4] and [3, 4, 5] do not match");
  EXPECT_KILN_ERROR(bmm(random_tensor({2, 3, 4}), random_tensor({2, 5, 6})),
                    "[bmm] shapes [2, 3, 4] and [2, 5, 6] cannot be multiplied");
  EXPECT_KILN_ERROR(bmm(random_tensor({2, 3, 4}, kHalf), random_tensor({2, 4, 6})),
                    "[bmm] expected both operands to have the same dtype, got float16 and float32");
  EXPECT_KILN_ERROR(matmul(a, b), "[matmul] shapes [2, 3] and [4, 5] cannot be multiplied");
  EXPECT_KILN_ERROR(matmul(random_tensor({3}), random_tensor({4})),
                    "[matmul] shapes [3] and [4] cannot be multiplied");
  EXPECT_KILN_ERROR(matmul(random_tensor({2, 3, 4}), random_tensor({5})), "[matmul] shapes");
  EXPECT_KILN_ERROR(matmul(full({}, 1.0f), a), "[matmul] both arguments need to be at least 1-D");
  EXPECT_KILN_ERROR(
      matmul(a, random_tensor({3, 2}, kInt64)),
      "[matmul] expected both operands to have the same dtype, got float32 and int64");
  EXPECT_KILN_ERROR(matmul(random_tensor({2, 2, 3}), random_tensor({3, 3, 4})), "[matmul]");
  EXPECT_KILN_ERROR(addmm(random_tensor({3, 3}), a, random_tensor({3, 4})),
                    "[addmm] self of shape [3, 3] cannot be broadcast to [2, 4]");
  EXPECT_KILN_ERROR(addmm(random_tensor({1, 2, 4}), a, random_tensor({3, 4})),
                    "[addmm] self of shape [1, 2, 4] cannot be broadcast");
  EXPECT_KILN_ERROR(addmm(random_tensor({2, 4}, kDouble), a, random_tensor({3, 4})),
                    "[addmm] expected self to have the operands' dtype float32, got float64");
  EXPECT_KILN_ERROR(addmm(random_tensor({2, 4}), a, random_tensor({4, 4})),
                    "[addmm] shapes [2, 3] and [4, 4] cannot be multiplied");
  const Tensor ia = random_tensor({2, 2}, kInt64);
  EXPECT_KILN_ERROR(addmm(ia, ia, ia, 0.5, 1), "[addmm] for integral tensors, beta and alpha");
  EXPECT_KILN_ERROR(linear(random_tensor({2, 4}), random_tensor({5, 3})),
                    "[linear] input of shape [2, 4] does not match weight of shape [5, 3]");
  EXPECT_KILN_ERROR(linear(random_tensor({2, 3}), random_tensor({3})),
                    "[linear] weight must be 2-D");
  EXPECT_KILN_ERROR(linear(full({}, 1.0f), random_tensor({5, 3})),
                    "[linear] input must be at least 1-D");
  EXPECT_KILN_ERROR(linear(random_tensor({2, 3}), random_tensor({5, 3}), random_tensor({4})),
                    "[linear] bias of shape [4] does not match out_features (5)");
  EXPECT_KILN_ERROR(
      linear(random_tensor({2, 3}), random_tensor({5, 3}), random_tensor({5}, kDouble)),
      "[linear] expected bias to have the input's dtype float32, got float64");
  EXPECT_KILN_ERROR(linear(random_tensor({2, 3}, kDouble), random_tensor({5, 3})),
                    "[linear] expected both operands to have the same dtype");
  EXPECT_KILN_ERROR(dot(random_tensor({3}), random_tensor({4})),
                    "[dot] shapes [3] and [4] have different numbers of elements");
  EXPECT_KILN_ERROR(dot(a, a), "[dot] expected 1-D tensors, got 2-D and 2-D");
  EXPECT_KILN_ERROR(dot(random_tensor({3}), random_tensor({3}, kDouble)),
                    "[dot] expected both operands to have the same dtype");
  EXPECT_KILN_ERROR(outer(a, random_tensor({3})), "[outer] expected 1-D tensors, got 2-D and 1-D");
  EXPECT_KILN_ERROR(mm(a, empty({3, 2}, Device(kMeta))),
                    "[mm] expected all tensors on the same device");
}

// run_into (tensor/registry.h): a functional op's kernel writing into tensors the caller holds,
// as linear_cross_entropy's chunks do: rows of a larger output, addmm's sum into a third tensor.
TEST(RunInto, WritesTheOpsResultIntoTheGivenOutputs) {
  const Tensor a = random_tensor({3, 4}, kFloat, 2), b = random_tensor({4, 5}, kFloat, 3);
  const Tensor c = random_tensor({3, 5}, kFloat, 4);
  Tensor out = full({7, 5}, 9.0);
  run_into(KILN_OP(mm), {a, b}, {out.narrow(0, 2, 3)});
  EXPECT_TRUE(allclose(out.narrow(0, 2, 3), mm(a, b), 1e-6, 1e-6));
  EXPECT_TRUE(equal(out.narrow(0, 0, 2), full({2, 5}, 9.0)));  // the other rows untouched
  EXPECT_TRUE(equal(out.narrow(0, 5, 2), full({2, 5}, 9.0)));
  Tensor sum = empty({3, 5});
  run_into(KILN_OP(addmm), {c, a, b}, {sum}, {Scalar(1), Scalar(1)});
  EXPECT_TRUE(allclose(sum, addmm(c, a, b), 1e-6, 1e-6));
  EXPECT_FALSE(a.requires_grad());
}

TEST(RunInto, ErrorsNameTheOpAndTheOutput) {
  const Tensor a = random_tensor({3, 4}), b = random_tensor({4, 5});
  const OpDef& mm_op = KILN_OP(mm);
  EXPECT_KILN_ERROR(run_into(mm_op, {a, b}, {empty({3, 4})}),
                    "[mm] run_into's output 0 must be a contiguous float32 tensor of shape [3, 5]");
  EXPECT_KILN_ERROR(run_into(mm_op, {a, b}, {empty({3, 5}, kDouble)}), "got float64 [3, 5]");
  EXPECT_KILN_ERROR(run_into(mm_op, {a, b}, {empty({5, 3}).t()}), "got float32 [3, 5] strided");
  EXPECT_KILN_ERROR(run_into(mm_op, {a, b}, {}), "[mm] run_into got 0 outputs for an op with 1");
  EXPECT_KILN_ERROR(run_into(mm_op, {a, random_tensor({3, 5})}, {empty({3, 5})}),
                    "[mm] shapes [3, 4] and [3, 5] cannot be multiplied");
  const Tensor square = random_tensor({4, 4});
  Tensor into = square.clone();
  EXPECT_KILN_ERROR(run_into(mm_op, {into, square}, {into}),
                    "[mm] run_into's output 0 overlaps input 0 in memory");
  Tensor rows = empty({8, 4});
  EXPECT_KILN_ERROR(run_into(mm_op, {rows.narrow(0, 2, 4), square}, {rows.narrow(0, 4, 4)}),
                    "overlaps input 0");
  run_into(mm_op, {rows.narrow(0, 0, 4).fill_(1.0), square}, {rows.narrow(0, 4, 4)});  // apart
  EXPECT_TRUE(allclose(rows.narrow(0, 4, 4), mm(ones({4, 4}), square), 1e-6, 1e-6));
  EXPECT_KILN_ERROR(run_into(KILN_OP(index_add_), {empty({3, 5})}, {empty({3, 5})}),
                    "[index_add_] run_into takes functional ops only");
}

}  // namespace
}  // namespace kiln
