// The fused ops rms_norm, layer_norm, cross_entropy_fused, rotary_emb(_qk), swiglu and geglu_tanh
// on the CPU (their kernels are the reference for the CUDA ones): forward against f64 loops or f64
// compositions of plain ops written here, gradients by gradcheck (f64) and against the f64
// gradient of the composition (f32/f16/bf16), and misuse errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "autograd/engine.h"
#include "autograd/gradcheck.h"
#include "nn/functional.h"
#include "tensor/ops.h"
#include "tensor/ops/rotary.h"
#include "tensor/registry.h"
#include "test_util.h"

namespace kiln {
namespace {

using autograd::variable_list;

// Relative L2 error ||got - want|| / ||want||, got converted to f64.
double rel_error(const Tensor& got, const std::vector<double>& want) {
  const std::vector<double> g = got.to_vector<double>();
  EXPECT_EQ(g.size(), want.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < g.size() && i < want.size(); ++i) {
    num += (g[i] - want[i]) * (g[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

double tolerance(ScalarType t) {
  switch (t) {
    case kDouble:
      return 1e-12;
    case kFloat:
      return 1e-6;
    default:
      return 1e-2;
  }
}

struct RmsRef {
  std::vector<double> y, dx, dw;
};

// y, dx and dw of RMSNorm over rows of length d in f64, for upstream gradient dy.
RmsRef rms_reference(const std::vector<double>& x, const std::vector<double>& w,
                     const std::vector<double>& dy, int64_t d, double eps) {
  const int64_t rows = static_cast<int64_t>(x.size()) / d;
  RmsRef r{std::vector<double>(x.size()), std::vector<double>(x.size()),
           std::vector<double>(static_cast<size_t>(d), 0.0)};
  for (int64_t i = 0; i < rows; ++i) {
    double ss = 0, dot = 0;
    for (int64_t j = 0; j < d; ++j) ss += x[i * d + j] * x[i * d + j];
    const double rs = 1 / std::sqrt(ss / d + eps);
    for (int64_t j = 0; j < d; ++j) dot += dy[i * d + j] * w[j] * x[i * d + j];
    for (int64_t j = 0; j < d; ++j) {
      const size_t k = i * d + j;
      r.y[k] = x[k] * rs * w[j];
      r.dx[k] = rs * dy[k] * w[j] - x[k] * rs * rs * rs * dot / d;
      r.dw[j] += dy[k] * x[k] * rs;
    }
  }
  return r;
}

void check_rms_norm(const Tensor& x_in, const Tensor& w_in, double eps) {
  SCOPED_TRACE("x " + std::string(dtype_name(x_in.dtype())) + " " + shape_str(x_in.sizes()) +
               ", w " + std::string(dtype_name(w_in.dtype())));
  Tensor x = x_in.detach().requires_grad_(true);
  Tensor w = w_in.detach().requires_grad_(true);
  const Tensor y = rms_norm(x, w, eps);
  EXPECT_EQ(y.dtype(), x.dtype());
  EXPECT_EQ(to_shape(y.sizes()), to_shape(x.sizes()));
  const Tensor dy = randn(x.sizes(), TensorOptions(x.dtype()));
  const variable_list g = autograd::grad({y}, {x, w}, {dy});
  const RmsRef ref = rms_reference(x.to_vector<double>(), w.to_vector<double>(),
                                   dy.to_vector<double>(), w.numel(), eps);
  const double tol = tolerance(x.dtype());
  EXPECT_LT(rel_error(y, ref.y), tol);
  EXPECT_LT(rel_error(g[0], ref.dx), tol);
  EXPECT_LT(rel_error(g[1], ref.dw), w.dtype() == kFloat && tol > 1e-3 ? 2e-3 : tol);
  EXPECT_EQ(g[0].dtype(), x.dtype());
  EXPECT_EQ(g[1].dtype(), w.dtype());
}

TEST(FusedRmsNorm, MatchesReferenceEveryDtype) {
  manual_seed(3);
  for (ScalarType t : {kDouble, kFloat, kHalf, kBFloat16}) {
    check_rms_norm(randn({5, 7}, TensorOptions(t)), randn({7}, TensorOptions(t)), 1e-6);
  }
  // f16/bf16 activations with f32 weights (autocast's f32 norms).
  check_rms_norm(randn({4, 3, 24}, TensorOptions(kBFloat16)), randn({24}), 1e-5);
  check_rms_norm(randn({6, 16}, TensorOptions(kHalf)), randn({16}), 1e-5);
}

// f32 rows whose sum of squares overflows (|x| ~ 1e20 and beyond: torch's f32 RMSNorm returns
// zeros) or underflows (|x| ~ 1e-25, which matters with a small eps) are summed again in f64
// (kernels/norm_range.h): y, dx and dw match the f64 reference at every scale.
TEST(FusedRmsNorm, LargeAndTinyMagnitudes) {
  manual_seed(11);
  for (double scale : {1e20, 1e30, 1e36, 1e-20, 1e-25, 1e-30}) {
    for (double eps : {1e-6, 0.0}) {
      if (eps > 0 && scale < 1) continue;  // eps dominates: nothing to check beyond the above
      SCOPED_TRACE("scale " + std::to_string(scale) + ", eps " + std::to_string(eps));
      check_rms_norm(randn({6, 64}) * scale, randn({64}), eps);
      check_rms_norm((randn({3, 40}) * scale).to(kBFloat16), randn({40}), eps);
    }
  }
  check_rms_norm(randn({4, 16}) * 1e-25, randn({16}), 1e-6);  // underflow under eps: rsqrt(eps)
  // Rows of every scale in one tensor, and a row mixing scales: each row's y is its own.
  float scale_values[4] = {1e20f, 1.0f, 1e-25f, 3e37f};
  const Tensor scales = from_blob(scale_values, {4, 1}).clone();
  Tensor x = randn({4, 32}) * scales;
  x.select(0, 1).narrow(0, 0, 4).fill_(1e20);
  const Tensor w = randn({32});
  const Tensor y = rms_norm(x, w, 0.0);
  const RmsRef ref = rms_reference(x.to_vector<double>(), w.to_vector<double>(),
                                   std::vector<double>(x.numel(), 0.0), 32, 0.0);
  EXPECT_LT(rel_error(y, ref.y), 1e-6);
  for (int64_t i = 0; i < 4; ++i) {
    const Tensor row = y.select(0, i);
    EXPECT_TRUE(equal(row, rms_norm(x.select(0, i).unsqueeze(0), w, 0.0).squeeze(0)))
        << "row " << i << " depends on the other rows";
  }
  // An ordinary row keeps its f32 result bit for bit (the f32 formula, in the kernel's order).
  const Tensor n = randn({1, 32});
  const std::vector<float> xv = n.to_vector<float>(), wv = w.to_vector<float>();
  float ss = 0;
  for (float v : xv) ss += v * v;
  const float r = 1.0f / std::sqrt(ss / 32.0f + static_cast<float>(1e-5));
  const std::vector<float> got = rms_norm(n, w, 1e-5).to_vector<float>();
  for (size_t j = 0; j < xv.size(); ++j) EXPECT_EQ(got[j], xv[j] * r * wv[j]) << j;
}

TEST(FusedRmsNorm, ShapesAndLayouts) {
  manual_seed(4);
  // Normalised over two trailing dims.
  check_rms_norm(randn({3, 4, 5}, TensorOptions(kDouble)), randn({4, 5}, TensorOptions(kDouble)),
                 1e-5);
  // A 1-D input (one row, 0-d rstd) and a transposed (non-contiguous) one.
  check_rms_norm(randn({9}, TensorOptions(kFloat)), randn({9}), 1e-5);
  check_rms_norm(randn({6, 10}, TensorOptions(kFloat)).t(), randn({6}), 1e-5);
  // Multi-threaded: more than 32768 elements.
  check_rms_norm(randn({300, 257}, TensorOptions(kFloat)), randn({257}), 1e-5);
  // Empty rows.
  const Tensor y = rms_norm(randn({0, 8}), randn({8}), 1e-5);
  EXPECT_EQ(to_shape(y.sizes()), (Shape{0, 8}));
}

TEST(FusedRmsNorm, Gradcheck) {
  manual_seed(5);
  Tensor x = randn({3, 6}, TensorOptions(kDouble).requires_grad(true));
  Tensor w = randn({6}, TensorOptions(kDouble).requires_grad(true));
  EXPECT_TRUE(autograd::gradcheck(
      [](const variable_list& in) { return rms_norm(in[0], in[1], 1e-3); }, {x, w}));
}

// rms_norm_backward with a residual (compiler/passes.h, fuse_norm_residual): dx is the norm's
// gradient plus the residual, rounded once, against the f64 reference; dweight is unchanged, and
// an undefined fifth input is no residual. Also rows in the f64 fallback (|x| ~ 1e20).
TEST(FusedRmsNorm, BackwardWithResidual) {
  manual_seed(6);
  static const OpDef& bwd = KILN_OP(rms_norm_backward);
  for (ScalarType t : {kDouble, kFloat, kBFloat16}) {
    for (double scale : {1.0, 1e20}) {
      if (scale > 1 && t != kFloat) continue;
      SCOPED_TRACE(std::string(dtype_name(t)) + ", scale " + std::to_string(scale));
      const Tensor x = (randn({5, 48}) * scale).to(t), w = randn({48}).to(t);
      const Tensor dy = randn({5, 48}).to(t), res = randn({5, 48}).to(t);
      const Tensor rstd = call_op(KILN_OP(rms_norm), {x, w}, {1e-6})[1];
      const TensorVec plain = call_op(bwd, {dy, x, w, rstd});
      const TensorVec fused = call_op(bwd, {dy, x, w, rstd, res});
      const TensorVec undefined = call_op(bwd, {dy, x, w, rstd, Tensor()});
      const RmsRef ref = rms_reference(x.to_vector<double>(), w.to_vector<double>(),
                                       dy.to_vector<double>(), 48, 1e-6);
      std::vector<double> want = ref.dx;
      const std::vector<double> rv = res.to_vector<double>();
      for (size_t k = 0; k < want.size(); ++k) want[k] += rv[k];
      EXPECT_LT(rel_error(fused[0], want), tolerance(t));
      EXPECT_TRUE(equal(fused[1], plain[1]));
      EXPECT_TRUE(equal(undefined[0], plain[0]));
      EXPECT_TRUE(equal(undefined[1], plain[1]));
    }
  }
  // A transposed (non-contiguous) residual.
  const Tensor x = randn({6, 10}), w = randn({10}), dy = randn({6, 10});
  const Tensor rstd = call_op(KILN_OP(rms_norm), {x, w}, {1e-5})[1];
  const Tensor res = randn({10, 6}).t();
  EXPECT_TRUE(allclose(call_op(bwd, {dy, x, w, rstd, res})[0],
                       call_op(bwd, {dy, x, w, rstd})[0] + res, 1e-5, 1e-6));
  EXPECT_KILN_ERROR(call_op(bwd, {dy, x, w, rstd, randn({6, 9})}),
                    "[rms_norm_backward] the residual (float32 [6, 9] on cpu) must match x "
                    "(float32 [6, 10] on cpu)");
  EXPECT_KILN_ERROR(call_op(bwd, {dy, x, w, rstd, randn({6, 10}).to(kDouble)}),
                    "[rms_norm_backward] the residual (float64");
}

TEST(FusedRmsNorm, Errors) {
  EXPECT_KILN_ERROR(rms_norm(randn({2, 3}), randn({4}), 1e-5),
                    "[rms_norm] normalized shape [4] does not match the trailing dims");
  EXPECT_KILN_ERROR(rms_norm(randn({2, 3}), {3}, randn({4}), 1e-5),
                    "[rms_norm] weight of shape [4] does not match the normalized shape [3]");
  EXPECT_KILN_ERROR(rms_norm(randn({2, 3}), Tensor(), 1e-5),
                    "[rms_norm] without a weight the normalized shape must be given");
  EXPECT_KILN_ERROR(rms_norm(randn({2, 3}), randn({2, 3, 3}), 1e-5), "[rms_norm]");
  EXPECT_KILN_ERROR(rms_norm(ones({2, 3}, kInt64), ones({3}, kInt64), 1e-5),
                    "[rms_norm] expected a floating-point input");
  EXPECT_KILN_ERROR(rms_norm(randn({2, 3}), ones({3}, kInt64), 1e-5),
                    "[rms_norm] expected a floating-point weight, got int64");
  EXPECT_KILN_ERROR(rms_norm(randn({2, 3}), randn({3}), -1.0), "[rms_norm] eps");
  static const OpDef& bwd = KILN_OP(rms_norm_backward);
  EXPECT_KILN_ERROR(call_op(bwd, {randn({2, 3}), randn({2, 3}), randn({3}), randn({3})}),
                    "[rms_norm_backward] rstd");
}

struct LnRef {
  std::vector<double> y, mean, rstd, dx, dw, db;
};

// LayerNorm over rows of length d in f64 (two-pass mean and biased variance), with w and b
// empty for "absent", and its gradients for upstream gradient dy.
LnRef ln_reference(const std::vector<double>& x, const std::vector<double>& w,
                   const std::vector<double>& b, const std::vector<double>& dy, int64_t d,
                   double eps) {
  const int64_t rows = static_cast<int64_t>(x.size()) / d;
  const size_t n = x.size(), nd = static_cast<size_t>(d);
  LnRef r{std::vector<double>(n),      {}, {}, std::vector<double>(n), std::vector<double>(nd, 0.0),
          std::vector<double>(nd, 0.0)};
  for (int64_t i = 0; i < rows; ++i) {
    double s = 0, ss = 0, sg = 0, sgx = 0;
    for (int64_t j = 0; j < d; ++j) s += x[i * d + j];
    const double m = s / d;
    for (int64_t j = 0; j < d; ++j) ss += (x[i * d + j] - m) * (x[i * d + j] - m);
    const double rs = 1 / std::sqrt(ss / d + eps);
    r.mean.push_back(m);
    r.rstd.push_back(rs);
    for (int64_t j = 0; j < d; ++j) {
      const size_t k = i * d + j;
      const double xh = (x[k] - m) * rs, wj = w.empty() ? 1.0 : w[j];
      r.y[k] = xh * wj + (b.empty() ? 0.0 : b[j]);
      sg += dy[k] * wj;
      sgx += dy[k] * wj * xh;
      r.dw[j] += dy[k] * xh;
      r.db[j] += dy[k];
    }
    for (int64_t j = 0; j < d; ++j) {
      const size_t k = i * d + j;
      const double xh = (x[k] - m) * rs, wj = w.empty() ? 1.0 : w[j];
      r.dx[k] = rs * (dy[k] * wj - sg / d - xh * sgx / d);
    }
  }
  return r;
}

std::vector<double> values_or_empty(const Tensor& t) {
  return t.defined() ? t.to_vector<double>() : std::vector<double>{};
}

// The layer_norm op and its backward op on x with weight w and bias b (either may be
// undefined), normalised over `normalized`, against the f64 reference; and autograd through
// the op reaching the backward op.
void check_layer_norm(const Tensor& x_in, const Tensor& w_in, const Tensor& b_in, Shape normalized,
                      double eps) {
  SCOPED_TRACE("x " + std::string(dtype_name(x_in.dtype())) + " " + shape_str(x_in.sizes()) +
               (w_in.defined() ? ", w " + std::string(dtype_name(w_in.dtype())) : ", no w") +
               (b_in.defined() ? ", b " + std::string(dtype_name(b_in.dtype())) : ", no b"));
  static const OpDef& op = KILN_OP(layer_norm);
  Tensor x = x_in.detach().requires_grad_(true);
  Tensor w = w_in.defined() ? w_in.detach().requires_grad_(true) : Tensor();
  Tensor b = b_in.defined() ? b_in.detach().requires_grad_(true) : Tensor();
  const TensorVec out = call_op(op, {x, w, b}, {normalized, eps});
  const Tensor& y = out[0];
  EXPECT_EQ(y.dtype(), x.dtype());
  EXPECT_EQ(to_shape(y.sizes()), to_shape(x.sizes()));
  const ScalarType acc = x.dtype() == kDouble ? kDouble : kFloat;
  EXPECT_EQ(out[1].dtype(), acc);
  EXPECT_EQ(out[2].dtype(), acc);
  EXPECT_EQ(to_shape(out[1].sizes()),
            Shape(x.sizes().begin(), x.sizes().end() - static_cast<int64_t>(normalized.size())));
  const Tensor dy = randn(x.sizes(), TensorOptions(x.dtype()));
  autograd::variable_list inputs = {x};
  if (w.defined()) inputs.push_back(w);
  if (b.defined()) inputs.push_back(b);
  const variable_list g = autograd::grad({y}, inputs, {dy});
  const int64_t d = numel_of(normalized);
  const LnRef ref = ln_reference(x.to_vector<double>(), values_or_empty(w), values_or_empty(b),
                                 dy.to_vector<double>(), d, eps);
  const double tol = tolerance(x.dtype());
  EXPECT_LT(rel_error(y, ref.y), tol);
  EXPECT_LT(rel_error(out[1], ref.mean), x.dtype() == kDouble ? 1e-12 : 1e-5);
  EXPECT_LT(rel_error(out[2], ref.rstd), x.dtype() == kDouble ? 1e-12 : 1e-5);
  EXPECT_LT(rel_error(g[0], ref.dx), tol);
  EXPECT_EQ(g[0].dtype(), x.dtype());
  size_t k = 1;
  const auto param_tol = [&](const Tensor& p) {
    return p.dtype() == kFloat && tol > 1e-3 ? 2e-3 : tol;
  };
  if (w.defined()) {
    EXPECT_LT(rel_error(g[k], ref.dw), param_tol(w));
    EXPECT_EQ(g[k++].dtype(), w.dtype());
  }
  if (b.defined()) {
    EXPECT_LT(rel_error(g[k], ref.db), param_tol(b));
    EXPECT_EQ(g[k].dtype(), b.dtype());
  }
  // The backward op itself returns dweight and dbias even without the parameters.
  static const OpDef& bwd = KILN_OP(layer_norm_backward);
  const TensorVec gb = call_op(
      bwd, {dy, x.detach(), w.defined() ? w.detach() : Tensor(), out[1].detach(), out[2].detach()});
  EXPECT_LT(rel_error(gb[0], ref.dx), tol);
  EXPECT_LT(rel_error(gb[1], ref.dw), w.defined() ? param_tol(w) : 1e-5);
  EXPECT_LT(rel_error(gb[2], ref.db), w.defined() ? param_tol(w) : 1e-5);
  EXPECT_EQ(gb[1].dtype(), w.defined() ? w.dtype() : acc);
}

TEST(FusedLayerNorm, MatchesReferenceEveryDtype) {
  manual_seed(11);
  for (ScalarType t : {kDouble, kFloat, kHalf, kBFloat16}) {
    const TensorOptions o(t);
    // Rows with a mean far from zero: the two-pass variance keeps its accuracy.
    check_layer_norm(randn({5, 7}, o).add(3.0), randn({7}, o), randn({7}, o), {7}, 1e-5);
    check_layer_norm(randn({5, 7}, o), randn({7}, o), Tensor(), {7}, 1e-6);
    check_layer_norm(randn({5, 7}, o), Tensor(), randn({7}, o), {7}, 1e-6);
    check_layer_norm(randn({5, 7}, o), Tensor(), Tensor(), {7}, 1e-6);
  }
  // f16/bf16 activations with f32 parameters (autocast's f32 norms).
  check_layer_norm(randn({4, 3, 24}, TensorOptions(kBFloat16)), randn({24}), randn({24}), {24},
                   1e-5);
  check_layer_norm(randn({6, 16}, TensorOptions(kHalf)), randn({16}), randn({16}), {16}, 1e-5);
  check_layer_norm(randn({6, 16}, TensorOptions(kBFloat16)), Tensor(), randn({16}), {16}, 1e-5);
}

// f32 rows whose sums overflow (|x| ~ 1e20 and beyond) or whose sum of squared deviations
// underflows (|x - mean| ~ 1e-20 and below, with eps 0) take their mean and variance in f64
// (kernels/norm_range.h), with and without an offset far above the spread.
TEST(FusedLayerNorm, LargeAndTinyMagnitudes) {
  manual_seed(12);
  for (double scale : {1e20, 1e30, 1e36, 1e-20, 1e-25, 1e-30}) {
    for (double eps : {1e-5, 0.0}) {
      if (eps > 0 && scale < 1) continue;  // eps hides the underflow: the f32 path is exact
      SCOPED_TRACE("scale " + std::to_string(scale) + ", eps " + std::to_string(eps));
      check_layer_norm(randn({6, 48}) * scale, randn({48}), randn({48}), {48}, eps);
      check_layer_norm(randn({4, 32}) * scale + 3 * scale, Tensor(), Tensor(), {32}, eps);
      check_layer_norm((randn({3, 40}) * scale).to(kBFloat16), randn({40}), randn({40}), {40},
                       eps);
    }
  }
  check_layer_norm(randn({4, 16}) * 1e-30, randn({16}), randn({16}), {16}, 1e-6);  // rsqrt(eps)
  // Rows of every scale in one tensor, with eps 0: each row's y is its own.
  float scale_values[4] = {1e20f, 1.0f, 1e-30f, 1e36f};
  const Tensor x = randn({4, 32}) * from_blob(scale_values, {4, 1}).clone();
  check_layer_norm(x, randn({32}), randn({32}), {32}, 0.0);
  const Tensor w = randn({32}), b = randn({32});
  const Tensor y = layer_norm(x, w, b, 0.0);
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(equal(y.select(0, i), layer_norm(x.select(0, i), w, b, 0.0)))
        << "row " << i << " depends on the other rows";
  }
}

TEST(FusedLayerNorm, ShapesAndLayouts) {
  manual_seed(12);
  // Normalised over two trailing dims.
  const TensorOptions f64(kDouble);
  check_layer_norm(randn({3, 4, 5}, f64), randn({4, 5}, f64), randn({4, 5}, f64), {4, 5}, 1e-5);
  // Over every dim (one row, 0-d statistics), a 1-D input, and a transposed (non-contiguous) one.
  check_layer_norm(randn({3, 4}), randn({3, 4}), randn({3, 4}), {3, 4}, 1e-5);
  check_layer_norm(randn({9}), randn({9}), randn({9}), {9}, 1e-5);
  check_layer_norm(randn({6, 10}).t(), randn({6}), randn({6}), {6}, 1e-5);
  // Rows of one element (y = bias), and multi-threaded (more than 32768 elements).
  check_layer_norm(randn({4, 1}), randn({1}), randn({1}), {1}, 1e-5);
  check_layer_norm(randn({300, 257}), randn({257}), randn({257}), {257}, 1e-5);
  // Empty rows.
  const Tensor y = layer_norm(randn({0, 8}), randn({8}), randn({8}), 1e-5);
  EXPECT_EQ(to_shape(y.sizes()), (Shape{0, 8}));
  static const OpDef& bwd = KILN_OP(layer_norm_backward);
  const TensorVec g =
      call_op(bwd, {randn({0, 8}), randn({0, 8}), randn({8}), randn({0}), randn({0})});
  EXPECT_EQ(g[1].to_vector<double>(), std::vector<double>(8, 0.0));
  EXPECT_EQ(g[2].to_vector<double>(), std::vector<double>(8, 0.0));
  // A constant row: var = 0, y = bias (rstd = rsqrt(eps) times zero deviations).
  const Tensor c = layer_norm(full({2, 4}, 1.5), ones({4}), full({4}, 0.25), 1e-5);
  EXPECT_EQ(c.to_vector<double>(), std::vector<double>(8, 0.25));
}

TEST(FusedLayerNorm, Gradcheck) {
  manual_seed(13);
  Tensor x = randn({3, 6}, TensorOptions(kDouble).requires_grad(true));
  Tensor w = randn({6}, TensorOptions(kDouble).requires_grad(true));
  Tensor b = randn({6}, TensorOptions(kDouble).requires_grad(true));
  EXPECT_TRUE(autograd::gradcheck(
      [](const variable_list& in) { return layer_norm(in[0], in[1], in[2], 1e-3); }, {x, w, b}));
}

TEST(FusedLayerNorm, Errors) {
  static const OpDef& op = KILN_OP(layer_norm);
  EXPECT_KILN_ERROR(layer_norm(randn({2, 3}), randn({4}), Tensor(), 1e-5),
                    "[layer_norm] normalized shape [4] does not match the trailing dims of "
                    "input of shape [2, 3]");
  EXPECT_KILN_ERROR(layer_norm(randn({2, 3}), randn({3}), randn({2}), 1e-5),
                    "[layer_norm] bias of shape [2] does not match");
  EXPECT_KILN_ERROR(layer_norm(randn({2, 3}), Tensor(), Tensor(), 1e-5),
                    "[layer_norm] without weight and bias");
  EXPECT_KILN_ERROR(call_op(op, {randn({2, 3}), Tensor(), Tensor()}, {Shape{2}, 1e-5}),
                    "[layer_norm] normalized shape [2] does not match the trailing dims");
  EXPECT_KILN_ERROR(call_op(op, {randn({2, 3}), Tensor(), Tensor()}, {Shape{}, 1e-5}),
                    "[layer_norm] normalized shape [] does not match");
  EXPECT_KILN_ERROR(layer_norm(ones({2, 3}, kInt64), ones({3}, kInt64), Tensor(), 1e-5),
                    "[layer_norm] expected a floating-point input");
  EXPECT_KILN_ERROR(layer_norm(randn({2, 3}), ones({3}, kInt64), Tensor(), 1e-5),
                    "[layer_norm] expected a floating-point weight, got int64");
  EXPECT_KILN_ERROR(layer_norm(randn({2, 3}), randn({3}), randn({3}), -1.0), "[layer_norm] eps");
  static const OpDef& bwd = KILN_OP(layer_norm_backward);
  const Tensor x = randn({2, 3});
  EXPECT_KILN_ERROR(call_op(bwd, {x, x, randn({3}), randn({3}), randn({2})}),
                    "[layer_norm_backward] mean (float32 [3]) must be float32 of the leading dims");
  EXPECT_KILN_ERROR(call_op(bwd, {x, x, randn({3}), randn({2}), randn({3})}),
                    "[layer_norm_backward] rstd");
  EXPECT_KILN_ERROR(call_op(bwd, {randn({2, 4}), x, randn({3}), randn({2}), randn({2})}),
                    "[layer_norm_backward] dy (float32 [2, 4]) must match x (float32 [2, 3])");
  EXPECT_KILN_ERROR(call_op(bwd, {x, x, randn({4}), randn({2}), randn({2})}),
                    "[layer_norm_backward] weight of shape [4]");
}

// f64 reference: per-row logsumexp and the mean loss over non-ignored rows.
struct CeRef {
  std::vector<double> lse, dlogits;
  double loss = 0;
};

CeRef ce_reference(const std::vector<double>& x, const std::vector<int64_t>& t, int64_t v,
                   int64_t ignore, double g) {
  const int64_t n = static_cast<int64_t>(t.size());
  CeRef r;
  r.dlogits.assign(x.size(), 0.0);
  int64_t count = 0;
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    double m = -std::numeric_limits<double>::infinity(), s = 0;
    for (int64_t j = 0; j < v; ++j) m = std::max(m, x[i * v + j]);
    for (int64_t j = 0; j < v; ++j) s += std::exp(x[i * v + j] - m);
    r.lse.push_back(m + std::log(s));
    if (t[i] == ignore) continue;
    sum += r.lse[i] - x[i * v + t[i]];
    ++count;
  }
  r.loss = sum / static_cast<double>(count);
  for (int64_t i = 0; i < n; ++i) {
    if (t[i] == ignore) continue;
    for (int64_t j = 0; j < v; ++j) {
      const double p = std::exp(x[i * v + j] - r.lse[i]);
      r.dlogits[i * v + j] = (p - (j == t[i] ? 1.0 : 0.0)) * g / static_cast<double>(count);
    }
  }
  return r;
}

Tensor targets_of(const std::vector<int64_t>& t) {
  return from_blob(const_cast<int64_t*>(t.data()), {static_cast<int64_t>(t.size())}, kInt64)
      .clone();
}

void check_cross_entropy(const Tensor& logits_in, const std::vector<int64_t>& t, int64_t ignore) {
  SCOPED_TRACE(std::string(dtype_name(logits_in.dtype())) + " " + shape_str(logits_in.sizes()));
  Tensor logits = logits_in.detach().requires_grad_(true);
  const Tensor loss = cross_entropy_fused(logits, targets_of(t), ignore);
  const ScalarType ct = logits.dtype() == kDouble ? kDouble : kFloat;
  EXPECT_EQ(loss.dim(), 0);
  EXPECT_EQ(loss.dtype(), ct);
  const double g = 0.75;
  const variable_list grads = autograd::grad({loss}, {logits}, {full({}, g, TensorOptions(ct))});
  const CeRef ref = ce_reference(logits.to_vector<double>(), t, logits.size(1), ignore, g);
  const double tol = logits.dtype() == kDouble ? 1e-12 : 1e-5;
  EXPECT_NEAR(loss.item<double>(), ref.loss, tol * (1 + std::abs(ref.loss)));
  EXPECT_EQ(grads[0].dtype(), logits.dtype());
  EXPECT_LT(rel_error(grads[0], ref.dlogits), tolerance(logits.dtype()) * 5);
}

TEST(FusedCrossEntropy, MatchesReferenceEveryDtype) {
  manual_seed(6);
  const std::vector<int64_t> t = {0, 6, 3, -100, 2};
  for (ScalarType dt : {kDouble, kFloat, kHalf, kBFloat16}) {
    check_cross_entropy((randn({5, 7}) * 3).to(dt), t, -100);
  }
}

TEST(FusedCrossEntropy, LargeVocabularyNonContiguousAndIgnoreIndex) {
  manual_seed(7);
  std::vector<int64_t> t;
  for (int64_t i = 0; i < 8; ++i) t.push_back((i * 7919) % 5003);
  t[3] = 5;  // a custom ignore_index that is also a valid class elsewhere
  check_cross_entropy(randn({8, 5003}) * 4, t, 5);
  // Transposed logits (stride 1 along rows).
  check_cross_entropy((randn({9, 4}) * 2).t(), {1, 0, 8, 3}, -100);
  // Extreme logits: the running max must keep exp() finite.
  const Tensor big =
      from_blob(std::vector<double>{1000, -1000, 999, 0, -1e4, 50}.data(), {2, 3}, kDouble).clone();
  check_cross_entropy(big, {0, 2}, -100);
}

TEST(FusedCrossEntropy, AllIgnoredIsNan) {
  const Tensor loss = cross_entropy_fused(randn({3, 4}), targets_of({-100, -100, -100}));
  EXPECT_TRUE(std::isnan(loss.item<double>()));
}

TEST(FusedCrossEntropy, Gradcheck) {
  manual_seed(8);
  Tensor x = randn({4, 5}, TensorOptions(kDouble).requires_grad(true));
  const Tensor t = targets_of({4, -1, 0, 2});
  EXPECT_TRUE(autograd::gradcheck(
      [&](const variable_list& in) { return cross_entropy_fused(in[0], t, -1); }, {x}));
}

TEST(FusedCrossEntropy, Errors) {
  EXPECT_KILN_ERROR(cross_entropy_fused(randn({2, 3}), targets_of({0, 3})),
                    "[cross_entropy_fused] target 3 is out of bounds for 3 classes");
  EXPECT_KILN_ERROR(
      cross_entropy_fused(randn({2, 3}), targets_of({0})),
      "[cross_entropy_fused] expected targets of shape [2] for logits of shape [2, 3]");
  EXPECT_KILN_ERROR(cross_entropy_fused(randn({3}), targets_of({0})),
                    "[cross_entropy_fused] expected targets of shape [] for logits of shape [3]");
  EXPECT_KILN_ERROR(cross_entropy_fused(randn({2, 3}), ones({2}, kFloat)),
                    "[cross_entropy_fused] expected integer class indices as targets");
  EXPECT_KILN_ERROR(cross_entropy_fused(ones({2, 3}, kInt64), targets_of({0, 1})),
                    "[cross_entropy_fused] expected floating-point logits");
  EXPECT_KILN_ERROR(
      cross_entropy_fused(randn({2, 3}), targets_of({0, 1}), randn({2}), -100, "mean", 0.0),
      "[cross_entropy_fused] expected a floating-point weight of shape [3]");
  EXPECT_KILN_ERROR(
      cross_entropy_fused(randn({2, 3}), targets_of({0, 1}), Tensor(), -100, "batchmean", 0.0),
      "[cross_entropy_fused] reduction must be 'mean', 'sum' or 'none'");
  EXPECT_KILN_ERROR(
      cross_entropy_fused(randn({2, 3}), targets_of({0, 1}), Tensor(), -100, "mean", 1.5),
      "[cross_entropy_fused] label_smoothing must be in [0, 1]");
  // Outside the fused kernels (int32 targets, one sample): the decomposition, same loss.
  const Tensor logits = randn({2, 3});
  EXPECT_TRUE(allclose(cross_entropy_fused(logits, targets_of({2, 1}).to(kInt32)),
                       cross_entropy_fused(logits, targets_of({2, 1}))));
  EXPECT_TRUE(allclose(cross_entropy_fused(logits[1], targets_of({1})[0]),
                       cross_entropy_fused(logits.narrow(0, 1, 1), targets_of({1}))));
}

// cross_entropy_fused_with_grad: the loss, lse and gradient of one call against the f64 reference
// (the CPU runs the two ops), and its errors.
TEST(FusedCrossEntropy, WithGradEqualsForwardAndBackward) {
  manual_seed(9);
  const std::vector<int64_t> t = {0, 6, 3, -100, 2};
  for (ScalarType dt : {kDouble, kFloat, kBFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor logits = (randn({5, 7}) * 3).to(dt);
    const ScalarType ct = dt == kDouble ? kDouble : kFloat;
    const auto [loss, lse, dlogits] =
        cross_entropy_fused_with_grad(logits, targets_of(t), full({}, 0.75, TensorOptions(ct)));
    const Tensor r[3] = {loss, lse, dlogits};
    const CeRef ref = ce_reference(logits.to_vector<double>(), t, 7, -100, 0.75);
    const double tol = dt == kDouble ? 1e-12 : 1e-5;
    EXPECT_NEAR(r[0].item<double>(), ref.loss, tol * (1 + std::abs(ref.loss)));
    EXPECT_EQ(r[1].dtype(), ct);
    EXPECT_EQ(to_shape(r[1].sizes()), Shape({5}));
    EXPECT_EQ(r[2].dtype(), dt);
    EXPECT_LT(rel_error(r[2], ref.dlogits), tolerance(dt) * 5);
    EXPECT_TRUE(allclose(r[1], logsumexp(logits.to(ct), {1}), 1e-5, 1e-5));
  }
  const Tensor g = full({}, 1.0, TensorOptions(kFloat));
  EXPECT_KILN_ERROR(cross_entropy_fused_with_grad(randn({2, 3}), targets_of({0, 3}), g),
                    "[cross_entropy_fused_with_grad] target 3 is out of bounds for 3 classes");
  EXPECT_KILN_ERROR(cross_entropy_fused_with_grad(randn({2, 3}), targets_of({0}), g),
                    "[cross_entropy_fused_with_grad] targets of shape [1] do not match logits of "
                    "shape [2, 3]");
  EXPECT_KILN_ERROR(cross_entropy_fused_with_grad(randn({2, 3}), targets_of({0, 1}), ones({2})),
                    "[cross_entropy_fused_with_grad] expected a 0-d float32 grad, got float32 [2]");
  EXPECT_KILN_ERROR(cross_entropy_fused_with_grad(randn({2, 3}), targets_of({0, 1}).to(kInt32), g),
                    "[cross_entropy_fused_with_grad] expected int64 targets, got int32");
  EXPECT_KILN_ERROR(
      cross_entropy_fused_with_grad(randn({2, 3}, TensorOptions(kDouble)), targets_of({0, 1}), g),
      "[cross_entropy_fused_with_grad] expected a 0-d float64 grad, got float32 []");
}

// --- rotary_emb, swiglu, geglu_tanh against f64 compositions of plain ops ----------------------

using Fn = std::function<Tensor(const variable_list&)>;

// Runs `fused` on leaves with the dtypes of `values` and `reference` on f64 copies; compares
// the outputs and, for a random upstream gradient (rounded to the output dtype), the gradients
// of the inputs flagged in `grads`.
void check_against_reference(const Fn& fused, const Fn& reference,
                             const std::vector<Tensor>& values, const std::vector<bool>& grads,
                             double tol) {
  variable_list lo, hi, lo_req, hi_req;
  for (size_t i = 0; i < values.size(); ++i) {
    lo.push_back(values[i].detach().clone().requires_grad_(grads[i]));
    hi.push_back(values[i].detach().to(kDouble).requires_grad_(grads[i]));
    if (grads[i]) {
      lo_req.push_back(lo.back());
      hi_req.push_back(hi.back());
    }
  }
  const Tensor y = fused(lo);
  const Tensor r = reference(hi);
  EXPECT_EQ(y.dtype(), values[0].dtype());
  ASSERT_EQ(to_shape(y.sizes()), to_shape(r.sizes()));
  EXPECT_LT(rel_error(y, r.to_vector<double>()), tol);
  const Tensor dy = randn(y.sizes(), TensorOptions(kDouble)).to(y.dtype());
  const variable_list g = autograd::grad({y}, lo_req, {dy});
  const variable_list gr = autograd::grad({r}, hi_req, {dy.to(kDouble)});
  for (size_t i = 0; i < g.size(); ++i) {
    SCOPED_TRACE("gradient " + std::to_string(i));
    EXPECT_EQ(g[i].dtype(), lo_req[i].dtype());
    EXPECT_LT(rel_error(g[i], gr[i].to_vector<double>()), tol);
  }
}

Tensor rotate_half_ref(const Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

Tensor rope_ref(const variable_list& in) { return in[0] * in[1] + rotate_half_ref(in[0]) * in[2]; }

// rotary_emb(view(x), cos, sin) against the f64 composition, gradients of x (and of the tables
// when `table_grads`).
void check_rope(const Tensor& x, const Tensor& cos, const Tensor& sin,
                const std::function<Tensor(const Tensor&)>& view, bool table_grads) {
  SCOPED_TRACE(std::string(dtype_name(x.dtype())) + " x " + shape_str(x.sizes()) + ", " +
               std::string(dtype_name(cos.dtype())) + " tables");
  check_against_reference(
      [&](const variable_list& in) { return rotary_emb(view(in[0]), in[1], in[2]); },
      [&](const variable_list& in) {
        return rope_ref({view(in[0]), in[1], in[2]});
      },
      {x, cos, sin}, {true, table_grads, table_grads}, tolerance(x.dtype()) * 2);
}

Tensor same(const Tensor& t) { return t; }

TEST(FusedRotaryEmb, MatchesReferenceEveryDtype) {
  manual_seed(31);
  for (ScalarType t : {kDouble, kFloat, kHalf, kBFloat16}) {
    // Tables with unequal halves: the op must not assume rope_cache's layout.
    check_rope(randn({2, 3, 5, 8}).to(t), randn({5, 8}).to(t), randn({5, 8}).to(t), same,
               !is_reduced_float(t));
  }
  // f32 tables on f16/bf16 activations, from rope_cache.
  auto [c, s] = nn::functional::rope_cache(7, 16, 500000.0);
  check_rope(randn({2, 4, 7, 16}).to(kBFloat16), c, s, same, false);
  check_rope(randn({3, 7, 16}).to(kHalf), c, s, same, false);
}

TEST(FusedRotaryEmb, StridedViewsAndShapes) {
  manual_seed(32);
  // q, k and v as views of one [B, T, (H + 2 Hkv) * D] projection, moved to [B, H, T, D]: read in
  // place.
  const int64_t b = 2, t = 6, h = 4, hkv = 2, d = 8;
  const Tensor qkv = randn({b, t, (h + 2 * hkv) * d});
  const Tensor cos = randn({t, d}), sin = randn({t, d});
  check_rope(
      qkv, cos, sin,
      [=](const Tensor& x) {
        return x.narrow(-1, 0, h * d).view({b, t, h, d}).transpose(1, 2);
      },
      true);
  check_rope(
      qkv, cos, sin,
      [=](const Tensor& x) {
        return x.narrow(-1, h * d, hkv * d).view({b, t, hkv, d}).transpose(1, 2);
      },
      true);
  // A last dim that is not dense (a transposed [D, T] input), a 2-D x, and enough rows for
  // several threads.
  check_rope(
      randn({3, 8, 6}), cos, sin, [](const Tensor& x) { return x.transpose(1, 2); }, true);
  check_rope(randn({6, 8}), cos, sin, same, true);
  const Tensor long_cos = randn({512, 64}), long_sin = randn({512, 64});
  check_rope(randn({2, 512, 64}), long_cos, long_sin, same, false);
  // Empty leading dims.
  EXPECT_EQ(to_shape(rotary_emb(randn({0, 6, 8}), cos, sin).sizes()), (Shape{0, 6, 8}));
}

// The output follows x's memory order where x's last dim is dense (PyTorch's layout for
// elementwise outputs), so the [B, H, T, D] view of a projection gives a y stored [B, T, H, D].
TEST(FusedRotaryEmb, OutputLayoutFollowsTheInput) {
  manual_seed(33);
  const int64_t b = 2, t = 6, h = 4, hkv = 2, d = 8;
  const Tensor qkv = randn({b, t, (h + 2 * hkv) * d});
  const Tensor cos = randn({t, d}), sin = randn({t, d});
  const Tensor q = qkv.narrow(-1, 0, h * d).view({b, t, h, d}).transpose(1, 2);
  const Tensor y = rotary_emb(q, cos, sin);
  EXPECT_EQ(to_shape(y.sizes()), (Shape{b, h, t, d}));
  EXPECT_EQ(to_shape(y.strides()), (Shape{t * h * d, d, h * d, 1}));
  EXPECT_TRUE(y.transpose(1, 2).is_contiguous());
  EXPECT_TRUE(equal(y, rotary_emb(q.contiguous(), cos, sin)));
  auto [q2, k2] = rotary_emb_qk(
      q, qkv.narrow(-1, h * d, hkv * d).view({b, t, hkv, d}).transpose(1, 2), cos, sin);
  EXPECT_EQ(to_shape(q2.strides()), (Shape{t * h * d, d, h * d, 1}));
  EXPECT_EQ(to_shape(k2.strides()), (Shape{t * hkv * d, d, hkv * d, 1}));
  // Contiguous x, and x whose last dim is not dense: contiguous y.
  EXPECT_TRUE(rotary_emb(randn({b, h, t, d}), cos, sin).is_contiguous());
  EXPECT_TRUE(rotary_emb(randn({b, d, t}).transpose(1, 2), cos, sin).is_contiguous());
}

TEST(DenseStridesLike, PermutesToTheMemoryOrder) {
  EXPECT_EQ(dense_strides_like(Shape{2, 3, 4}, Shape{12, 4, 1}), (Shape{12, 4, 1}));
  // [B, H, T, D] view of [B, T, H, D]; of a narrowed [B, T, 3 H D] projection likewise.
  EXPECT_EQ(dense_strides_like(Shape{2, 4, 6, 8}, Shape{192, 8, 32, 1}), (Shape{192, 8, 32, 1}));
  EXPECT_EQ(dense_strides_like(Shape{2, 4, 6, 8}, Shape{576, 8, 96, 1}), (Shape{192, 8, 32, 1}));
  // A transposed matrix; size-1 dims take their contiguous place; ties keep the logical order.
  EXPECT_EQ(dense_strides_like(Shape{3, 5}, Shape{1, 3}), (Shape{1, 3}));
  EXPECT_EQ(dense_strides_like(Shape{3, 1, 5}, Shape{1, 7, 3}), (Shape{1, 15, 3}));
  EXPECT_EQ(dense_strides_like(Shape{2, 3}, Shape{1, 1}), (Shape{3, 1}));
  // Broadcast or negative strides: contiguous.
  EXPECT_EQ(dense_strides_like(Shape{4, 3}, Shape{0, 1}), (Shape{3, 1}));
  EXPECT_EQ(dense_strides_like(Shape{4, 3}, Shape{-3, 1}), (Shape{3, 1}));
  EXPECT_EQ(dense_strides_like(Shape{}, Shape{}), (Shape{}));
}

TEST(FusedRotaryEmb, QkFormEqualsTwoCalls) {
  manual_seed(33);
  const Tensor qkv = randn({2, 5, 6 * 4}).to(kBFloat16);
  const Tensor q = qkv.narrow(-1, 0, 16).view({2, 5, 4, 4}).transpose(1, 2);
  const Tensor k = qkv.narrow(-1, 16, 4).view({2, 5, 1, 4}).transpose(1, 2);
  auto [c, s] = nn::functional::rope_cache(5, 4);
  auto [q2, k2] = rotary_emb_qk(q, k, c, s);
  EXPECT_TRUE(equal(q2, rotary_emb(q, c, s)));
  EXPECT_TRUE(equal(k2, rotary_emb(k, c, s)));
  EXPECT_EQ(to_shape(k2.sizes()), (Shape{2, 1, 5, 4}));
  // Gradients through the qk form against the f64 composition.
  check_against_reference(
      [](const variable_list& in) {
        auto [a, b] = rotary_emb_qk(in[0], in[1], in[2], in[3]);
        return cat({a.flatten(), (b * 2).flatten()});
      },
      [](const variable_list& in) {
        return cat({rope_ref({in[0], in[2], in[3]}).flatten(),
                    (rope_ref({in[1], in[2], in[3]}) * 2).flatten()});
      },
      {randn({2, 3, 5, 4}), randn({2, 1, 5, 4}), randn({5, 4}), randn({5, 4})},
      {true, true, true, true}, 1e-5);
}

TEST(FusedRotaryEmb, Errors) {
  const Tensor c = randn({5, 8}), s = randn({5, 8});
  EXPECT_KILN_ERROR(rotary_emb(randn({5, 7}), randn({5, 7}), randn({5, 7})),
                    "[rotary_emb] the last dim of x must be even");
  EXPECT_KILN_ERROR(rotary_emb(randn({8}), c, s),
                    "[rotary_emb] cos/sin of shape [5, 8] must broadcast to x of shape [8]");
  EXPECT_KILN_ERROR(rotary_emb(randn({2, 4, 8}), c, s),
                    "[rotary_emb] cos/sin of shape [5, 8] must broadcast to x of shape [2, 4, 8]");
  EXPECT_KILN_ERROR(rotary_emb(randn({5, 8}), c, s.to(kDouble)),
                    "[rotary_emb] cos (float32 [5, 8]) and sin");
  EXPECT_KILN_ERROR(rotary_emb(randn({5, 8}), ones({5, 8}, kInt64), ones({5, 8}, kInt64)),
                    "[rotary_emb] expected floating-point cos/sin, got int64");
  EXPECT_KILN_ERROR(rotary_emb(ones({5, 8}, kInt64), c, s),
                    "[rotary_emb] expected a floating-point x");
  EXPECT_KILN_ERROR(rotary_emb_qk(randn({5, 8}), randn({4, 8}), c, s),
                    "[rotary_emb_qk] cos/sin of shape [5, 8] must broadcast to k of shape [4, 8]");
  // Outside the kernels (tables of another dtype, q and k of two dtypes, a table per batch):
  // the decomposition, in the compute dtype.
  const Tensor x = randn({2, 5, 8});
  const Tensor want = rotary_emb(x, c, s);
  EXPECT_TRUE(allclose(rotary_emb(x, c.to(kDouble), s.to(kDouble)), want, 1e-5, 1e-6));
  EXPECT_TRUE(
      allclose(rotary_emb(x, c.expand({2, 5, 8}).contiguous(), s.expand({2, 5, 8}).contiguous()),
               want, 1e-5, 1e-6));
  const auto [q2, k2] = rotary_emb_qk(x, x.to(kDouble), c, s);
  EXPECT_EQ(k2.dtype(), kDouble);
  EXPECT_TRUE(allclose(k2.to(kFloat), want, 1e-5, 1e-6));
}

// split_qkv_rotary equals the narrow views of the projection through rotary_emb_qk (bit for bit:
// one formula), in every dtype, with the outputs stored [B, T, heads, D]; merge_qkv_rotary is
// its adjoint: <split(x), a> = <x, merge(a)>.
TEST(FusedQkvRotary, SplitEqualsViewsThroughRotaryEmbQk) {
  manual_seed(34);
  const int64_t b = 2, t = 5, h = 4, g = 2, d = 8;
  for (ScalarType dtype : {kFloat, kDouble, kBFloat16, kHalf}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor qkv = randn({b, t, (h + 2 * g) * d}).to(dtype);
    const Tensor cos = randn({t, d}).to(dtype), sin = randn({t, d}).to(dtype);
    const Tensor heads = qkv.view({b, t, h + 2 * g, d});
    const Tensor q = heads.narrow(2, 0, h).transpose(1, 2);
    const Tensor k = heads.narrow(2, h, g).transpose(1, 2);
    const Tensor v = heads.narrow(2, h + g, g).transpose(1, 2);
    auto [q2, k2] = rotary_emb_qk(q, k, cos, sin);
    auto [q3, k3, v3] = split_qkv_rotary(qkv, cos, sin, h, g);
    EXPECT_TRUE(equal(q3, q2));
    EXPECT_TRUE(equal(k3, k2));
    EXPECT_TRUE(equal(v3, v));
    EXPECT_EQ(to_shape(q3.strides()), (Shape{t * h * d, d, h * d, 1}));
    EXPECT_EQ(to_shape(v3.strides()), (Shape{t * g * d, d, g * d, 1}));
    // v is a copy, not a view of qkv.
    EXPECT_NE(v3.data_ptr(), v.data_ptr());
  }
  // f32 tables on bf16 heads (rope_cache's tables), and a 2-d qkv (no batch).
  auto [c, s] = nn::functional::rope_cache(t, d);
  const Tensor qkv = randn({t, (h + 2 * g) * d}).to(kBFloat16);
  auto [q, k, v] = split_qkv_rotary(qkv, c, s, h, g);
  EXPECT_EQ(to_shape(q.sizes()), (Shape{h, t, d}));
  const Tensor want = rotary_emb(qkv.view({t, h + 2 * g, d}).narrow(1, 0, h).transpose(0, 1), c, s);
  EXPECT_TRUE(equal(q, want));
}

TEST(FusedQkvRotary, MergeIsTheAdjointOfSplit) {
  manual_seed(35);
  const int64_t b = 2, t = 6, h = 2, g = 1, d = 4;
  const Tensor x = randn({b, t, (h + 2 * g) * d}, kDouble);
  const Tensor cos = randn({t, d}, kDouble), sin = randn({t, d}, kDouble);
  const Tensor aq = randn({b, h, t, d}, kDouble), ak = randn({b, g, t, d}, kDouble),
               av = randn({b, g, t, d}, kDouble);
  auto [q, k, v] = split_qkv_rotary(x, cos, sin, h, g);
  const double lhs = ((q * aq).sum() + (k * ak).sum() + (v * av).sum()).item<double>();
  const Tensor m = merge_qkv_rotary(aq, ak, av, cos, sin);
  EXPECT_TRUE(m.is_contiguous());
  EXPECT_EQ(to_shape(m.sizes()), (Shape{b, t, (h + 2 * g) * d}));
  EXPECT_NEAR((x * m).sum().item<double>(), lhs, 1e-9 * std::abs(lhs) + 1e-12);
  // The gradient of split is merge, exactly.
  const Tensor xl = x.detach().requires_grad_(true);
  auto [q2, k2, v2] = split_qkv_rotary(xl, cos, sin, h, g);
  ((q2 * aq).sum() + (k2 * ak).sum() + (v2 * av).sum()).backward();
  EXPECT_TRUE(equal(xl.grad(), m));
}

TEST(FusedQkvRotary, Errors) {
  const Tensor c = randn({5, 8}), s = randn({5, 8});
  EXPECT_KILN_ERROR(split_qkv_rotary(randn({2, 5, 60}), c, s, 4, 2),
                    "[split_qkv_rotary] expected qkv [..., T, (n_head + 2 n_kv_head) D] with an "
                    "even D, got shape [2, 5, 60] for n_head 4 and n_kv_head 2");
  EXPECT_KILN_ERROR(split_qkv_rotary(randn({2, 5, 64}), c, s, 0, 2),
                    "[split_qkv_rotary] expected positive head counts, got n_head 0");
  EXPECT_KILN_ERROR(split_qkv_rotary(randn({2, 4, 64}), c, s, 4, 2),
                    "[split_qkv_rotary] expected cos/sin of shape [T, D] = [4, 8] (leading dims of "
                    "1 allowed), got [5, 8]");
  EXPECT_KILN_ERROR(split_qkv_rotary(ones({2, 5, 64}, kInt64), c, s, 4, 2),
                    "[split_qkv_rotary] expected a floating-point qkv, got int64");
  EXPECT_KILN_ERROR(split_qkv_rotary(randn({2, 5, 64}), c, s.to(kDouble), 4, 2),
                    "[split_qkv_rotary] cos (float32 [5, 8]) and sin (float64 [5, 8])");
  EXPECT_KILN_ERROR(
      merge_qkv_rotary(randn({2, 4, 5, 8}), randn({2, 2, 5, 8}), randn({2, 3, 5, 8}), c, s),
      "[merge_qkv_rotary] expected dq [..., H, T, D] and dk, dv [..., G, T, D] with an even D, "
      "got [2, 4, 5, 8], [2, 2, 5, 8], [2, 3, 5, 8]");
  EXPECT_KILN_ERROR(merge_qkv_rotary(randn({2, 4, 5, 8}), randn({2, 2, 5, 8}).to(kDouble),
                                     randn({2, 2, 5, 8}), c, s),
                    "[merge_qkv_rotary] expected dq, dk, dv of one floating-point dtype");
  // Tables of another dtype than the heads' (f64 on f32): the decomposition, in f64.
  const Tensor qkv = randn({2, 5, 64});
  auto [q, k, v] = split_qkv_rotary(qkv, c.to(kDouble), s.to(kDouble), 4, 2);
  auto [q2, k2, v2] = split_qkv_rotary(qkv, c, s, 4, 2);
  EXPECT_TRUE(allclose(q, q2, 1e-5, 1e-6));
  EXPECT_TRUE(equal(v, v2));
}

// rotary_qkv_ (the compiler's in-place split, tensor/ops/rotary.cpp): the q and k heads of qkv
// rotated where they are equal split_qkv_rotary's q and k bit for bit (one formula), the v heads
// are untouched, in every dtype and both directions, on a qkv whose rows are not dense too; and
// its errors: the split's checks under its own name, and no backward rule.
TEST(FusedQkvRotary, InPlaceRotationEqualsTheSplit) {
  manual_seed(36);
  static const OpDef& op = KILN_OP(rotary_qkv_);
  const int64_t b = 2, t = 5, h = 4, g = 2, d = 8, n = h + 2 * g;
  for (ScalarType dtype : {kFloat, kDouble, kBFloat16, kHalf}) {
    for (bool transpose : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (transpose ? " transposed" : ""));
      const Tensor cos = randn({t, d}).to(dtype), sin = randn({t, d}).to(dtype);
      const Tensor wide = randn({b, t, n * d + 8}).to(dtype);
      for (const Tensor& qkv : {randn({b, t, n * d}).to(dtype), wide.narrow(-1, 8, n * d)}) {
        static const OpDef& split = KILN_OP(split_qkv_rotary);
        const TensorVec want = call_op(split, {qkv, cos, sin}, {transpose, h, g});
        Tensor x = qkv.clone();
        if (!qkv.is_contiguous()) x = wide.clone().narrow(-1, 8, n * d);
        const TensorVec out = call_op(op, {x, cos, sin}, {transpose, h, g});
        ASSERT_EQ(out.size(), 1u);
        EXPECT_EQ(out[0].data_ptr(), x.data_ptr());  // in place
        EXPECT_TRUE(equal(internal::qkv_heads(x, 0, h, n), want[0]));
        EXPECT_TRUE(equal(internal::qkv_heads(x, h, g, n), want[1]));
        EXPECT_TRUE(equal(internal::qkv_heads(x, h + g, g, n), want[2]));
      }
    }
  }
  // f32 tables (rope_cache's) on bf16 heads.
  auto [c, s] = nn::functional::rope_cache(t, d);
  const Tensor qkv = randn({b, t, n * d}).to(kBFloat16);
  auto [q, k, v] = split_qkv_rotary(qkv, c, s, h, g);
  const Tensor x = qkv.clone();
  call_op(op, {x, c, s}, {false, h, g});
  EXPECT_TRUE(equal(internal::qkv_heads(x, 0, h, n), q));
  EXPECT_TRUE(equal(internal::qkv_heads(x, h, g, n), k));
  // Errors.
  EXPECT_KILN_ERROR(call_op(op, {randn({2, 5, 60}), c, s}, {false, h, g}),
                    "[rotary_qkv_] expected qkv [..., T, (n_head + 2 n_kv_head) D] with an even D, "
                    "got shape [2, 5, 60] for n_head 4 and n_kv_head 2");
  EXPECT_KILN_ERROR(call_op(op, {randn({2, 4, 64}), c, s}, {false, h, g}),
                    "[rotary_qkv_] expected cos/sin of shape [T, D] = [4, 8]");
  const Tensor leaf = randn({2, 5, 64}).requires_grad_(true);
  const Tensor y = leaf * 2;
  call_op(op, {y, c, s}, {false, h, g});
  EXPECT_KILN_ERROR(y.sum().backward(),
                    "[rotary_qkv_] the derivative of rotary_qkv_ is not implemented");
}

// flash_attention_backward_qkv: merge_qkv_rotary of flash_attention_backward's results, bit for
// bit (the CPU runs the two kernels), with GQA, with and without dlse, in f64, f32 and bf16; the
// decomposition gives the same; its errors.
TEST(FusedQkvRotary, AttentionBackwardMergedEqualsItsParts) {
  manual_seed(37);
  static const OpDef& fused = KILN_OP(flash_attention_backward_qkv);
  static const OpDef& bwd = KILN_OP(flash_attention_backward);
  static const OpDef& fwd = KILN_OP(flash_attention);
  static const OpDef& merge = KILN_OP(merge_qkv_rotary);
  const int64_t b = 2, t = 7, h = 4, g = 2, d = 8, n = h + 2 * g;
  for (ScalarType dtype : {kDouble, kFloat, kBFloat16}) {
    for (bool with_dlse : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (with_dlse ? " dlse" : ""));
      const Tensor qkv = randn({b, t, n * d}).to(dtype);
      const Tensor cos = randn({t, d}).to(dtype), sin = randn({t, d}).to(dtype);
      auto [q, k, v] = split_qkv_rotary(qkv, cos, sin, h, g);
      const absl::InlinedVector<Attr, 4> attrs = {0.4, true, int64_t{0}, 0.0};
      const TensorVec o = call_op(fwd, {q, k, v}, attrs);
      const Tensor dout = randn(q.sizes()).to(dtype);
      const Tensor dlse = with_dlse ? randn(o[1].sizes()).to(o[1].dtype()) : Tensor();
      const TensorVec parts = call_op(bwd, {dout, q, k, v, o[0], o[1], dlse}, attrs);
      const Tensor want = call_op1(merge, {parts[0], parts[1], parts[2], cos, sin}, {true});
      absl::InlinedVector<Attr, 4> all = attrs;
      all.push_back(true);
      const TensorVec in = {dout, q, k, v, o[0], o[1], dlse, cos, sin};
      const Tensor got = call_op1(fused, in, all);
      EXPECT_TRUE(got.is_contiguous());
      EXPECT_EQ(to_shape(got.sizes()), (Shape{b, t, n * d}));
      EXPECT_TRUE(equal(got, want));
      EXPECT_TRUE(equal(call_decomposition(fused, in, all)[0], want));
    }
  }
  // Errors: the backward's checks, keys other than the queries, the tables.
  const Tensor q = randn({2, 4, 5, 8}), k = randn({2, 2, 5, 8}), lse = randn({2, 4, 5});
  const Tensor c = randn({5, 8});
  const absl::InlinedVector<Attr, 4> attrs = {0.4, true, int64_t{0}, 0.0, true};
  EXPECT_KILN_ERROR(call_op(fused, {q, q, k, k, q, lse, Tensor(), c, c}, {0.4, true}),
                    "[flash_attention_backward_qkv] expected inputs (dout, q, k, v, out, lse, "
                    "dlse, cos, sin) and attributes (scale, causal, sliding_window, softcap, "
                    "transpose)");
  EXPECT_KILN_ERROR(call_op(fused, {q, q, k, k.to(kDouble), q, lse, Tensor(), c, c}, attrs),
                    "[flash_attention_backward] expected floating-point q, k and v of one dtype");
  const Tensor k6 = randn({2, 2, 6, 8});
  EXPECT_KILN_ERROR(call_op(fused, {q, q, k6, k6, q, lse, Tensor(), c, c}, attrs),
                    "[flash_attention_backward_qkv] expected as many keys as queries");
  EXPECT_KILN_ERROR(
      call_op(fused, {q, q, k, k, q, lse, Tensor(), randn({4, 8}), randn({4, 8})}, attrs),
      "[flash_attention_backward_qkv] expected cos/sin of shape [T, D] = [5, 8]");
}

Tensor swiglu_ref(const variable_list& in) { return silu(in[0]) * in[1]; }
Tensor geglu_ref(const variable_list& in) { return gelu(in[0], "tanh") * in[1]; }

void check_glu(const Tensor& gate, const Tensor& up,
               const std::function<Tensor(const Tensor&)>& view = same) {
  SCOPED_TRACE(std::string(dtype_name(gate.dtype())) + " " + shape_str(gate.sizes()));
  const double tol = tolerance(gate.dtype()) * 2;
  check_against_reference([&](const variable_list& in) { return swiglu(view(in[0]), view(in[1])); },
                          [&](const variable_list& in) {
                            return swiglu_ref({view(in[0]), view(in[1])});
                          },
                          {gate, up}, {true, true}, tol);
  check_against_reference(
      [&](const variable_list& in) { return geglu_tanh(view(in[0]), view(in[1])); },
      [&](const variable_list& in) {
        return geglu_ref({view(in[0]), view(in[1])});
      },
      {gate, up}, {true, true}, tol);
}

TEST(FusedGlu, MatchesReferenceEveryDtype) {
  manual_seed(34);
  for (ScalarType t : {kDouble, kFloat, kHalf, kBFloat16}) {
    check_glu((randn({7, 33}) * 3).to(t), randn({7, 33}).to(t));
  }
  // Large arguments: silu and gelu saturate without NaN (exp overflow, tanh at +-1).
  const Tensor g =
      from_blob(std::vector<double>{-200, -30, -5, 0, 5, 30, 200, 1e-3}.data(), {8}, kDouble)
          .clone();
  check_glu(g, randn({8}, TensorOptions(kDouble)));
  check_glu(g.to(kFloat), randn({8}));
}

TEST(FusedGlu, StridedShapes) {
  manual_seed(35);
  // gate and up as the two halves of one fused projection output (read in place), transposed
  // views, a 0-d pair, many elements (threads), and empty inputs.
  const Tensor both = randn({6, 2 * 20}).to(kBFloat16);
  check_against_reference(
      [](const variable_list& in) {
        return swiglu(in[0].narrow(1, 0, 20), in[0].narrow(1, 20, 20));
      },
      [](const variable_list& in) {
        return swiglu_ref({in[0].narrow(1, 0, 20), in[0].narrow(1, 20, 20)});
      },
      {both}, {true}, 2e-2);
  check_glu(randn({9, 5}), randn({9, 5}), [](const Tensor& t) { return t.t(); });
  check_glu(randn({}), randn({}));
  check_glu(randn({301, 257}), randn({301, 257}));
  EXPECT_EQ(to_shape(swiglu(randn({0, 4}), randn({0, 4})).sizes()), (Shape{0, 4}));
}

// The f32 / bf16 kernels compute exp and tanh in packets of the CPU's widest build: an element's
// result depends on its value only, so a tensor gives the same bits whole, split into row
// blocks of any size (as the compiler's fused_cpu executor runs it), and through a strided view.
TEST(FusedGlu, SameBitsWholeSplitOrStrided) {
  manual_seed(36);
  static const OpDef& swiglu_bwd = KILN_OP(swiglu_backward);
  static const OpDef& geglu_bwd = KILN_OP(geglu_tanh_backward);
  for (ScalarType t : {kFloat, kBFloat16}) {
    SCOPED_TRACE(dtype_name(t));
    const Tensor g = (randn({37, 301}) * 4).to(t), u = randn({37, 301}).to(t),
                 dy = randn({37, 301}).to(t);
    const Tensor g_t = g.t().contiguous().t(), u_t = u.t().contiguous().t();  // column-major
    for (const auto& [name, fwd, bwd] : {std::tuple{"swiglu", &swiglu, &swiglu_bwd},
                                         std::tuple{"geglu_tanh", &geglu_tanh, &geglu_bwd}}) {
      SCOPED_TRACE(name);
      const Tensor whole = fwd(g, u);
      const TensorVec grads = call_op(*bwd, {dy, g, u});
      std::vector<Tensor> parts, dg_parts, du_parts;
      for (int64_t r = 0; r < 37; r += 5) {
        const int64_t n = std::min<int64_t>(5, 37 - r);
        parts.push_back(fwd(g.narrow(0, r, n), u.narrow(0, r, n)));
        const TensorVec pg =
            call_op(*bwd, {dy.narrow(0, r, n), g.narrow(0, r, n), u.narrow(0, r, n)});
        dg_parts.push_back(pg[0]);
        du_parts.push_back(pg[1]);
      }
      EXPECT_TRUE(equal(cat(parts, 0), whole));
      EXPECT_TRUE(equal(cat(dg_parts, 0), grads[0]));
      EXPECT_TRUE(equal(cat(du_parts, 0), grads[1]));
      EXPECT_TRUE(equal(fwd(g_t, u_t), whole));
      const TensorVec strided = call_op(*bwd, {dy, g_t, u_t});
      EXPECT_TRUE(equal(strided[0], grads[0]));
      EXPECT_TRUE(equal(strided[1], grads[1]));
    }
  }
}

// The f32 kernels against the f64 ones within what f32 allows: the activation's argument x =
// exp_arg(g) carries a few ulp of rounding into exp(x), so an f32 result can be off by a few ulp
// times (1 + |x|) relative, as the function's condition number says (any f32 formula is). The
// bound is 5e-7 (1 + |x|) relative (1.1-1.6e-7 measured with the AVX-512 build), for the
// gradients relative to |dy * u| (dgate crosses zero). geglu_tanh's tanh form misses it by 10x at
// g = -3 and 500x at g = -4, where 1 + tanh(u) cancels: an ulp of tanh's error near -1 is a
// relative error of 2.5e-5 and 1.7e-3 there.
TEST(FusedGlu, F32IsWithinItsConditionOfF64) {
  manual_seed(37);
  static const OpDef& swiglu_bwd = KILN_OP(swiglu_backward);
  static const OpDef& geglu_bwd = KILN_OP(geglu_tanh_backward);
  const Tensor g = linspace(-6.0, 6.0, 4801, TensorOptions(kFloat));
  const Tensor u = randn({4801}), dy = randn({4801});
  const Tensor g64 = g.to(kDouble), u64 = u.to(kDouble), dy64 = dy.to(kDouble);
  // The largest |got - want| / scale over the elements, in units of (1 + |x|).
  auto worst = [](const Tensor& got, const Tensor& want, const Tensor& scale, const Tensor& x) {
    return ((got.to(kDouble) - want).abs() / (scale.abs() * (x.abs() + 1) + 1e-300))
        .max()
        .item<double>();
  };
  const double k = 0.7978845608028654;
  const Tensor x_silu = -g64, x_gelu = g64 * (g64 * g64 * 0.044715 + 1) * (-2 * k);
  for (const auto& [name, fwd, bwd, x] :
       {std::tuple{"swiglu", &swiglu, &swiglu_bwd, x_silu},
        std::tuple{"geglu_tanh", &geglu_tanh, &geglu_bwd, x_gelu}}) {
    SCOPED_TRACE(name);
    const Tensor want = fwd(g64, u64);
    EXPECT_LE(worst(fwd(g, u), want, want, x), 5e-7);
    const TensorVec got = call_op(*bwd, {dy, g, u}), grads = call_op(*bwd, {dy64, g64, u64});
    EXPECT_LE(worst(got[0], grads[0], dy64 * u64, x), 5e-7);
    EXPECT_LE(worst(got[1], grads[1], grads[1], x), 5e-7);
  }
}

TEST(FusedGlu, Errors) {
  EXPECT_KILN_ERROR(swiglu(randn({2, 3}), randn({3, 2})),
                    "[swiglu] gate (float32 [2, 3]) and up (float32 [3, 2])");
  EXPECT_KILN_ERROR(geglu_tanh(randn({2, 3}), randn({2, 3}).to(kDouble)),
                    "[geglu_tanh] gate (float32 [2, 3]) and up (float64 [2, 3])");
  EXPECT_KILN_ERROR(swiglu(ones({3}, kInt64), ones({3}, kInt64)),
                    "[swiglu] expected a floating-point gate");
  static const OpDef& bwd = KILN_OP(swiglu_backward);
  EXPECT_KILN_ERROR(call_op(bwd, {randn({2}), randn({3}), randn({3})}),
                    "[swiglu_backward] gate (float32 [3]) and dy (float32 [2])");
}

}  // namespace
}  // namespace kiln
