// The fused CUDA kernels of layer_norm and layer_norm_backward (kernels/cuda/layer_norm.cu)
// against their CPU kernels (kernels/cpu/norm.cpp) on the same fresh random inputs: every
// floating dtype, f32 parameters on f16/bf16 inputs, either parameter or none, row lengths from
// 1 to past the register kernels (packed, unpacked, one warp, 128, 256 and 512 threads per row,
// one and two rows per iteration, the looping kernels), 1 to 17000 rows, non-contiguous and
// misaligned inputs, bitwise repeatable parameter gradients, and F::layer_norm through autograd
// and autocast on the GPU, and rows out of the f32 range (|x| around 1e20 and beyond, or 1e-30
// with eps 0). (The threads per row and rows per iteration the library does not choose: the
// kernel lab, benchmarks/lab/layer_norm_lab.cu.)
//
// Suites named Gpu* carry the ctest label `gpu` and skip without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "autograd/engine.h"
#include "kernels/gpu_test_util.h"
#include "nn/autocast.h"
#include "nn/functional.h"
#include "tensor/ops.h"
#include "tensor/registry.h"
#include "test_util.h"

namespace kiln {
namespace {

using test::kGpu;
using test::rel_error;

class GpuLayerNorm : public test::GpuTest {};

// GPU vs CPU on the same inputs: the same two-pass algorithm in the same precision, so the
// error is the rounding of the output dtype and of sums taken in another order (f32: up to
// 70000 terms per row, whose order changes rstd by a few 1e-6).
double tolerance(ScalarType t) {
  switch (t) {
    case kDouble:
      return 1e-12;
    case kFloat:
      return 3e-5;
    default:
      return 8e-3;
  }
}

void expect_near_cpu(const Tensor& gpu, const Tensor& cpu, double tol, const char* what) {
  SCOPED_TRACE(what);
  ASSERT_TRUE(gpu.defined());
  EXPECT_TRUE(gpu.is_cuda());
  EXPECT_EQ(gpu.dtype(), cpu.dtype());
  ASSERT_EQ(to_shape(gpu.sizes()), to_shape(cpu.sizes()));
  EXPECT_LE(rel_error(gpu, cpu), tol);
}

Tensor on_gpu(const Tensor& t) { return t.defined() ? t.to(kGpu) : Tensor(); }

// Forward and backward of layer_norm, normalised over `normalized`, on the CPU inputs x, w, b
// (w and b may be undefined) and on xg, the same values on the GPU (by default x copied there;
// tests pass strided or misaligned GPU views of the same base).
void check_ln(const Tensor& x, const Tensor& w, const Tensor& b, const Shape& normalized,
              const Tensor& xg_in = Tensor(), double eps = 1e-5) {
  SCOPED_TRACE(std::string(dtype_name(x.dtype())) + " x " + shape_str(x.sizes()) +
               (w.defined() ? ", " + std::string(dtype_name(w.dtype())) + " w" : ", no w") +
               (b.defined() ? ", " + std::string(dtype_name(b.dtype())) + " b" : ", no b"));
  static const OpDef& fwd = KILN_OP(layer_norm);
  static const OpDef& bwd = KILN_OP(layer_norm_backward);
  const Tensor xg = xg_in.defined() ? xg_in : x.to(kGpu);
  const Tensor wg = on_gpu(w), bg = on_gpu(b);
  const TensorVec c = call_op(fwd, {x, w, b}, {normalized, eps});
  const TensorVec g = call_op(fwd, {xg, wg, bg}, {normalized, eps});
  const double tol = tolerance(x.dtype());
  expect_near_cpu(g[0], c[0], tol, "y");
  // The statistics: f32 sums added in another order (rms_norm's rstd measured 1.2e-5 at 40000
  // elements on the H100). A row's mean is near 0 for zero-mean data, so its error is measured
  // against the spread of x (about 1), elementwise.
  const bool f64 = x.dtype() == kDouble;
  test::expect_match(g[1], c[1], f64 ? 1e-12 : 1e-5, f64 ? 1e-13 : 1e-6, "mean");
  expect_near_cpu(g[2], c[2], f64 ? 1e-12 : 5e-5, "rstd");
  const Tensor dy = randn(x.sizes()).to(x.dtype());
  const TensorVec dc = call_op(bwd, {dy, x, w, c[1], c[2]});
  const TensorVec dg = call_op(bwd, {dy.to(kGpu), xg, wg, g[1], g[2]});
  expect_near_cpu(dg[0], dc[0], tol, "dx");
  const double ptol = dc[1].dtype() == kDouble ? 1e-10 : std::max(tolerance(dc[1].dtype()), 1e-4);
  expect_near_cpu(dg[1], dc[1], ptol, "dweight");
  expect_near_cpu(dg[2], dc[2], ptol, "dbias");
}

// The common case: weight and bias of dtype pt over the last dim of x.
void check_ln2(int64_t rows, int64_t d, ScalarType xt, ScalarType pt) {
  check_ln(randn({rows, d}).to(xt), randn({d}).to(pt), randn({d}).to(pt), {d});
}

TEST_F(GpuLayerNorm, EveryDtypePackedAndUnpacked) {
  manual_seed(61);
  for (ScalarType dt : {kFloat, kDouble, kHalf, kBFloat16}) {
    check_ln2(37, 64, dt, dt);  // 16-byte packs
    check_ln2(19, 37, dt, dt);  // odd length: one element each
    check_ln(randn({7, 3, 40}).to(dt), randn({3, 40}).to(dt), randn({3, 40}).to(dt), {3, 40});
    // Rows with a large mean: the two-pass variance on both devices.
    check_ln(randn({9, 96}).add(50.0).to(dt), randn({96}).to(dt), randn({96}).to(dt), {96});
  }
  check_ln2(33, 96, kBFloat16, kFloat);  // f32 parameters
  check_ln2(33, 96, kHalf, kFloat);
}

TEST_F(GpuLayerNorm, OptionalParameters) {
  manual_seed(62);
  for (ScalarType dt : {kFloat, kBFloat16, kDouble}) {
    for (int64_t d : {64, 37, 2048, 20000}) {
      check_ln(randn({5, d}).to(dt), randn({d}).to(dt), Tensor(), {d});
      check_ln(randn({5, d}).to(dt), Tensor(), randn({d}).to(dt), {d});
      check_ln(randn({5, d}).to(dt), Tensor(), Tensor(), {d});
    }
  }
  check_ln(randn({6, 128}).to(kBFloat16), Tensor(), randn({128}), {128});  // f32 bias alone
  check_ln(randn({6, 128}).to(kHalf), randn({128}), Tensor(), {128});
}

// Row lengths across every kernel: d = 1, 7, 33 (unpacked, one warp), 768 (one warp, idle
// lanes), 2048 (forward 128 threads per row, backward 256), 4100 (unpacked, 512 threads), 8192
// (backward 256 threads, 4 packs each), 16384, 20000 and 70000 (past the register kernels: the
// looping ones); 1, 3 and 257 rows.
TEST_F(GpuLayerNorm, OddSizes) {
  manual_seed(63);
  for (int64_t d : {1, 7, 33, 768, 2048, 4100, 8192, 16384, 20000, 70000}) {
    for (int64_t rows : {1, 3, 257}) {
      check_ln2(rows, d, kBFloat16, kBFloat16);
      check_ln2(rows, d, kBFloat16, kFloat);
    }
    check_ln2(3, d, kFloat, kFloat);
    check_ln2(3, d, kHalf, kHalf);
  }
  // Every pack count of the register kernels (1 to 16 per thread), with idle threads.
  for (int64_t d : {8, 24, 256, 264, 1000, 1032, 3000, 4096, 6000, 12000, 32768, 40000}) {
    check_ln2(13, d, kBFloat16, kBFloat16);
    check_ln2(5, d, kFloat, kFloat);
  }
}

TEST_F(GpuLayerNorm, ManyRows) {
  manual_seed(64);
  // More rows than resident groups (the backward's grid is about one wave, so every block
  // loops), with idle lanes and f32 parameters.
  check_ln2(10000, 2048, kBFloat16, kBFloat16);
  check_ln2(9001, 1000, kBFloat16, kFloat);
  check_ln2(17000, 264, kHalf, kHalf);
  check_ln2(17000, 512, kFloat, kFloat);
  check_ln2(5003, 128, kBFloat16, kBFloat16);
  check_ln2(2049, 8192, kBFloat16, kBFloat16);
  check_ln2(300, 20000, kBFloat16, kFloat);
}

TEST_F(GpuLayerNorm, StridedAndMisalignedInputs) {
  manual_seed(65);
  // Transposed and sliced inputs, built on the GPU from the same base as on the CPU.
  const Tensor base = randn({64, 40}).to(kBFloat16);
  const Tensor w = randn({64}).to(kBFloat16), b = randn({64}).to(kBFloat16);
  check_ln(base.t(), w, b, {64}, base.to(kGpu).t());
  const Tensor wide = randn({50, 1024}).to(kBFloat16);
  const Tensor w5 = randn({512}).to(kBFloat16), b5 = randn({512}).to(kBFloat16);
  check_ln(wide.slice(1, 0, 512), w5, b5, {512}, wide.to(kGpu).slice(1, 0, 512));
  const Tensor wide32 = randn({30, 2 * 2048});
  check_ln(wide32.slice(1, 2048, 4096), randn({2048}), randn({2048}), {2048},
           wide32.to(kGpu).slice(1, 2048, 4096));
  // Rows one element off 16-byte alignment on the GPU (a contiguous view at offset 1): the
  // one-element kernels, forward and backward.
  const Tensor flat = randn({1 + 21 * 256}).to(kBFloat16);
  const Tensor w2 = randn({256}).to(kBFloat16), b2 = randn({256}).to(kBFloat16);
  const Tensor xc = flat.slice(0, 1, 1 + 21 * 256).view({21, 256});
  check_ln(xc, w2, b2, {256}, flat.to(kGpu).slice(0, 1, 1 + 21 * 256).view({21, 256}));
  // A misaligned dy with aligned x.
  static const OpDef& fwd = KILN_OP(layer_norm);
  static const OpDef& bwd = KILN_OP(layer_norm_backward);
  const Tensor x = randn({21, 256}).to(kBFloat16);
  const TensorVec f = call_op(fwd, {x, w2, b2}, {Shape{256}, 1e-5});
  const TensorVec want = call_op(bwd, {xc, x, w2, f[1], f[2]});
  const TensorVec got = call_op(bwd, {flat.to(kGpu).slice(0, 1, 1 + 21 * 256).view({21, 256}),
                                      x.to(kGpu), w2.to(kGpu), f[1].to(kGpu), f[2].to(kGpu)});
  expect_near_cpu(got[0], want[0], tolerance(kBFloat16), "dx");
  expect_near_cpu(got[1], want[1], tolerance(kBFloat16), "dweight");
  expect_near_cpu(got[2], want[2], tolerance(kBFloat16), "dbias");
}

// The register kernels at the row lengths of their configurations (forward 128 threads per row
// from 2048 elements; backward 256 threads, two rows per iteration up to 2 packs per thread and
// one row at 4 packs): one to four packs per thread, idle threads, more rows than the one-wave grid
// holds, odd row counts (a group whose second row is past the end), fewer rows than blocks, f32
// parameters, optional parameters, and rows past them (a warp under 2048 elements, 512 threads
// for 20000).
TEST_F(GpuLayerNorm, RegisterKernelsAtManyRowCounts) {
  manual_seed(68);
  check_ln2(3001, 2048, kBFloat16, kBFloat16);
  check_ln2(2999, 4096, kBFloat16, kBFloat16);
  check_ln2(3, 8192, kBFloat16, kBFloat16);
  check_ln2(701, 1000, kBFloat16, kFloat);
  check_ln2(65, 768, kFloat, kFloat);
  check_ln2(1, 512, kHalf, kHalf);
  check_ln2(9, 20000, kBFloat16, kBFloat16);
  check_ln(randn({33, 4096}).to(kBFloat16), Tensor(), randn({4096}).to(kBFloat16), {4096});
  check_ln(randn({2001, 3000}).to(kBFloat16), randn({3000}).to(kBFloat16), Tensor(), {3000});
}

// The parameter gradients are sums of per-block partials in a fixed order: bitwise the same on
// every run.
TEST_F(GpuLayerNorm, ParameterGradientsAreRepeatable) {
  manual_seed(66);
  static const OpDef& fwd = KILN_OP(layer_norm);
  static const OpDef& bwd = KILN_OP(layer_norm_backward);
  for (int64_t d : {768, 2048, 20000}) {
    const Tensor x = randn({3001, d}).to(kBFloat16).to(kGpu), dy = randn({3001, d}).to(kGpu);
    const Tensor w = randn({d}).to(kGpu), b = randn({d}).to(kGpu);
    const TensorVec f = call_op(fwd, {x, w, b}, {Shape{d}, 1e-5});
    const TensorVec g1 = call_op(bwd, {dy.to(kBFloat16), x, w, f[1], f[2]});
    const TensorVec g2 = call_op(bwd, {dy.to(kBFloat16), x, w, f[1], f[2]});
    test::expect_same(g2[0], g1[0].cpu(), "dx");
    test::expect_same(g2[1], g1[1].cpu(), "dweight");
    test::expect_same(g2[2], g1[2].cpu(), "dbias");
  }
}

// layer_norm and its backward on x (CPU, [rows, d]) on both devices, with weight and bias, for
// rows far from magnitude 1: the mean compared in units of the row's spread ((mean_gpu -
// mean_cpu) * rstd, y's error from it), everything else relative.
void check_ln_range(const Tensor& x, double eps) {
  const int64_t d = x.size(-1);
  SCOPED_TRACE(std::string(dtype_name(x.dtype())) + " x " + shape_str(x.sizes()) + ", eps " +
               std::to_string(eps));
  static const OpDef& fwd = KILN_OP(layer_norm);
  static const OpDef& bwd = KILN_OP(layer_norm_backward);
  const Tensor w = randn({d}), b = randn({d});
  const TensorVec c = call_op(fwd, {x, w, b}, {Shape{d}, eps});
  const TensorVec g = call_op(fwd, {x.to(kGpu), w.to(kGpu), b.to(kGpu)}, {Shape{d}, eps});
  const double tol = tolerance(x.dtype());
  expect_near_cpu(g[0], c[0], tol, "y");
  EXPECT_LE(((g[1].cpu() - c[1]) * c[2]).abs().max().item<double>(), 3e-5) << "mean";
  test::expect_match(g[2], c[2], 5e-5, 0.0, "rstd");
  const Tensor dy = randn(x.sizes()).to(x.dtype());
  const TensorVec dc = call_op(bwd, {dy, x, w, c[1], c[2]});
  const TensorVec dg = call_op(bwd, {dy.to(kGpu), x.to(kGpu), w.to(kGpu), g[1], g[2]});
  expect_near_cpu(dg[0], dc[0], tol, "dx");
  expect_near_cpu(dg[1], dc[1], 1e-4, "dweight");
  expect_near_cpu(dg[2], dc[2], 1e-4, "dbias");
}

// Rows whose f32 sums leave their accurate range (kernels/norm_range.h): |x - mean| around 1e20
// to 1e36 (the sum of squared deviations overflows; torch's f32 layer_norm gives zeros or NaN),
// an offset of 3e36 (the row's sum overflows too), around 1e-25 and 1e-30 with eps 0 (the sum of
// squares underflows), rows of equal values near 1e30 with a tiny eps (the deviations are zero:
// y = b; scaling x up would overflow), and rows of every scale in one batch (each row as if alone).
// Every kernel: a warp per row packed (64) and unpacked (37), 128 threads (2048), 512 threads
// packed (20000) and unpacked (4101), the loop kernel (65536), bf16 through the register
// kernels, against the CPU kernel, which takes such rows in f64 (tests/tensor/fused_ops_test.cpp
// checks it against an f64 reference).
TEST_F(GpuLayerNorm, LargeAndTinyMagnitudes) {
  manual_seed(69);
  for (int64_t d : {64, 37, 2048, 20000, 4101, 65536}) {
    SCOPED_TRACE("d " + std::to_string(d));
    for (const auto& [scale, eps] :
         {std::pair{1e20, 1e-5}, std::pair{1e30, 1e-5}, std::pair{1e36, 0.0}, std::pair{1e-25, 0.0},
          std::pair{1e-30, 0.0}, std::pair{1e-30, 1e-5}}) {
      check_ln_range(randn({9, d}) * scale, eps);
      check_ln_range(randn({3, d}) * scale + 3 * scale, eps);
      if (d == 64 || d == 2048) check_ln_range((randn({9, d}) * scale).to(kBFloat16), eps);
    }
    if ((d & (d - 1)) == 0) {
      // Rows of 2^100: their sums and means are exact on both devices (d a power of two), so
      // the deviations are zero, and y is the bias.
      const Tensor equal_rows = full({3, d}, 0x1p100);
      check_ln_range(equal_rows, 1e-20);
      const Tensor b = randn({d});
      const TensorVec y = call_op(KILN_OP(layer_norm), {equal_rows.to(kGpu), Tensor(), b.to(kGpu)},
                                  {Shape{d}, 1e-20});
      test::expect_same(y[0].select(0, 2), b, "rows of 2^100: y = b");
    }
    float scale_values[4] = {1e20f, 1.0f, 1e-30f, 1e36f};
    const Tensor x = randn({4, d}) * from_blob(scale_values, {4, 1}).clone();
    check_ln_range(x, 0.0);
    const Tensor xg = x.to(kGpu), w = randn({d}).to(kGpu), b = randn({d}).to(kGpu);
    const Tensor y = layer_norm(xg, w, b, 0.0);
    for (int64_t i = 0; i < 4; ++i) {
      test::expect_same(y.select(0, i), layer_norm(xg.select(0, i), w, b, 0.0).cpu(),
                        "row " + std::to_string(i) + " alone");
    }
  }
}

TEST_F(GpuLayerNorm, FunctionalUsesTheFusedOpsThroughAutograd) {
  manual_seed(67);
  namespace F = nn::functional;
  Tensor x = randn({64, 256}).to(kBFloat16).to(kGpu).requires_grad_(true);
  Tensor w = randn({256}).to(kGpu).requires_grad_(true);
  Tensor b = randn({256}).to(kGpu).requires_grad_(true);
  const Tensor dy = randn({64, 256}).to(kBFloat16);
  const Tensor y = F::layer_norm(x, {256}, w, b, 1e-6);
  EXPECT_EQ(y.dtype(), kBFloat16);
  const autograd::variable_list g = autograd::grad({y}, {x, w, b}, {dy.to(kGpu)});
  static const OpDef& fwd = KILN_OP(layer_norm);
  static const OpDef& bwd = KILN_OP(layer_norm_backward);
  const Tensor xc = x.detach().cpu(), wc = w.detach().cpu(), bc = b.detach().cpu();
  const TensorVec c = call_op(fwd, {xc, wc, bc}, {Shape{256}, 1e-6});
  const TensorVec dc = call_op(bwd, {dy, xc, wc, c[1], c[2]});
  expect_near_cpu(y.detach(), c[0], 8e-3, "y");
  expect_near_cpu(g[0], dc[0], 8e-3, "dx");
  expect_near_cpu(g[1], dc[1], 1e-4, "dweight");
  expect_near_cpu(g[2], dc[2], 1e-4, "dbias");
  // Under autocast on the GPU: computed and returned in f32, as the composite did.
  AutocastGuard guard(kCUDA, kBFloat16);
  const Tensor ya = F::layer_norm(x.detach(), {256}, w.detach().to(kBFloat16), Tensor(), 1e-6);
  EXPECT_EQ(ya.dtype(), kFloat);
  const TensorVec ca =
      call_op(fwd, {xc.to(kFloat), wc.to(kBFloat16).to(kFloat), Tensor()}, {Shape{256}, 1e-6});
  expect_near_cpu(ya, ca[0], 1e-5, "y under autocast");
}

}  // namespace
}  // namespace kiln
