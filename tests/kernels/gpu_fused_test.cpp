// The fused CUDA kernels rms_norm(+backward), cross_entropy_fused(+backward), rotary_emb(_qk)
// and swiglu/geglu_tanh(+backward) (kernels/cuda/{norm,cross_entropy,rotary,glu}.cu) against
// their CPU kernels on the same fresh random inputs: every floating dtype, packed (16-byte) and
// unpacked row lengths, rows longer than the register cache, many rows per block,
// non-contiguous inputs (built on the GPU from the same base as on the CPU), ignore_index, and
// gradients through autograd on the GPU. Every RMSNorm kernel is also run directly, through the
// launchers of kernels/cuda/norm.h, on rows the op would send to another kernel.
//
// Suites named Gpu* carry the ctest label `gpu` and skip without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "autograd/engine.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/runtime.h"
#include "kernels/gpu_test_util.h"
#include "nn/functional.h"
#include "tensor/ops.h"
#include "tensor/ops/rotary.h"
#include "tensor/registry.h"
#include "test_util.h"

namespace kiln {
namespace {

using test::kGpu;
using test::rel_error;

class GpuFixture : public test::GpuTest {};
class GpuRmsNorm : public GpuFixture {};
class GpuCrossEntropy : public GpuFixture {};
class GpuRotaryEmb : public GpuFixture {};
class GpuGlu : public GpuFixture {};

// GPU vs CPU on the same inputs: the same algorithm in the same precision, so the error is
// rounding of the output dtype (and fast exp on the GPU).
double tolerance(ScalarType t) {
  switch (t) {
    case kDouble:
      return 1e-12;
    case kFloat:
      return 1e-5;
    default:
      return 8e-3;
  }
}

void expect_match(const Tensor& gpu, const Tensor& cpu, double tol) {
  ASSERT_TRUE(gpu.is_cuda());
  EXPECT_EQ(gpu.dtype(), cpu.dtype());
  ASSERT_EQ(to_shape(gpu.sizes()), to_shape(cpu.sizes()));
  EXPECT_LE(rel_error(gpu, cpu), tol);
}

// Forward and backward of rms_norm on x ([..., d] on the CPU) and w, on both devices.
void check_rms(const Tensor& x, const Tensor& w, double eps = 1e-5) {
  SCOPED_TRACE(std::string(dtype_name(x.dtype())) + " x " + shape_str(x.sizes()) + ", " +
               std::string(dtype_name(w.dtype())) + " w");
  static const OpDef& fwd = KILN_OP(rms_norm);
  static const OpDef& bwd = KILN_OP(rms_norm_backward);
  const TensorVec c = call_op(fwd, {x, w}, {eps});
  const TensorVec g = call_op(fwd, {x.to(kGpu), w.to(kGpu)}, {eps});
  const double tol = tolerance(x.dtype());
  expect_match(g[0], c[0], tol);
  // rstd: f32 sums of squares added in another order; the rounding grows with the row length
  // (1.2e-5 measured at 40000 elements on the H100).
  expect_match(g[1], c[1], x.dtype() == kDouble ? 1e-12 : 5e-5);
  const Tensor dy = randn(x.sizes()).to(x.dtype());
  const TensorVec dc = call_op(bwd, {dy, x, w, c[1]});
  const TensorVec dg = call_op(bwd, {dy.to(kGpu), x.to(kGpu), w.to(kGpu), g[1]});
  expect_match(dg[0], dc[0], tol);
  expect_match(dg[1], dc[1], w.dtype() == kDouble ? 1e-10 : std::max(tol, 1e-4));
}

TEST_F(GpuRmsNorm, EveryDtypePackedAndUnpacked) {
  manual_seed(21);
  for (ScalarType dt : {kFloat, kDouble, kHalf, kBFloat16}) {
    check_rms(randn({37, 64}).to(dt), randn({64}).to(dt));       // 16-byte packs
    check_rms(randn({19, 37}).to(dt), randn({37}).to(dt));       // odd length: one element each
    check_rms(randn({7, 3, 40}).to(dt), randn({3, 40}).to(dt));  // two normalised dims
  }
  check_rms(randn({33, 96}).to(kBFloat16), randn({96}));  // f32 weight
  check_rms(randn({33, 96}).to(kHalf), randn({96}));
  // One warp per row, 1 to 16 packs per lane, with and without idle lanes.
  for (int64_t d : {2048, 4096, 1000, 3000, 264}) {
    check_rms(randn({70, d}).to(kBFloat16), randn({d}).to(kBFloat16));
    check_rms(randn({21, d}).to(kBFloat16), randn({d}));
    check_rms(randn({13, d}), randn({d}));
  }
}

TEST_F(GpuRmsNorm, LongRowsManyRowsAndLayouts) {
  manual_seed(22);
  // Longer than the register cache (forward: 2 packs x 1024 threads; backward: 1 pack).
  check_rms(randn({6, 16392}).to(kBFloat16), randn({16392}).to(kBFloat16));
  check_rms(randn({5, 9000}), randn({9000}));
  // Many rows per block in the backward (its grid is about one wave).
  check_rms(randn({5000, 128}).to(kBFloat16), randn({128}).to(kBFloat16));
  // A 1-D input and a transposed one.
  check_rms(randn({48}), randn({48}));
  check_rms(randn({64, 24}).t(), randn({64}));
}

TEST_F(GpuRmsNorm, ManyRows) {
  manual_seed(27);
  // More rows than resident warps, with idle lanes (1000, 264) and f32 weights.
  check_rms(randn({10000, 2048}).to(kBFloat16), randn({2048}).to(kBFloat16));
  check_rms(randn({9001, 1000}).to(kBFloat16), randn({1000}));
  check_rms(randn({17000, 264}).to(kHalf), randn({264}).to(kHalf));
  check_rms(randn({17000, 512}), randn({512}));
}

// Rows one element off 16-byte alignment on the GPU (a contiguous view at offset 1): the
// one-element loop kernels, forward and backward (x, then dy misaligned).
TEST_F(GpuRmsNorm, MisalignedRows) {
  manual_seed(31);
  const Tensor flat = randn({1 + 21 * 256}).to(kBFloat16), wb = randn({256}).to(kBFloat16);
  const Tensor xc = flat.slice(0, 1, 1 + 21 * 256).view({21, 256});
  const Tensor xg = flat.to(kGpu).slice(0, 1, 1 + 21 * 256).view({21, 256});
  const TensorVec got = call_op(KILN_OP(rms_norm), {xg, wb.to(kGpu)}, {1e-5});
  const TensorVec want = call_op(KILN_OP(rms_norm), {xc, wb}, {1e-5});
  expect_match(got[0], want[0], tolerance(kBFloat16));
  expect_match(got[1], want[1], 1e-5);
  const Tensor x = randn({21, 256}).to(kBFloat16);
  const TensorVec f = call_op(KILN_OP(rms_norm), {x, wb}, {1e-5});
  const TensorVec dwant = call_op(KILN_OP(rms_norm_backward), {xc, x, wb, f[1]});
  const TensorVec dgot =
      call_op(KILN_OP(rms_norm_backward), {xg, x.to(kGpu), wb.to(kGpu), f[1].to(kGpu)});
  expect_match(dgot[0], dwant[0], tolerance(kBFloat16));
  expect_match(dgot[1], dwant[1], tolerance(kBFloat16));
  // A misaligned residual sends the rows to the unpacked loop kernel.
  const Tensor rflat = randn({1 + 21 * 256}).to(kBFloat16);
  const Tensor rc = rflat.slice(0, 1, 1 + 21 * 256).view({21, 256});
  const Tensor rg = rflat.to(kGpu).slice(0, 1, 1 + 21 * 256).view({21, 256});
  const TensorVec rwant = call_op(KILN_OP(rms_norm_backward), {xc, x, wb, f[1], rc});
  const TensorVec rgot =
      call_op(KILN_OP(rms_norm_backward), {xg, x.to(kGpu), wb.to(kGpu), f[1].to(kGpu), rg});
  expect_match(rgot[0], rwant[0], tolerance(kBFloat16));
  expect_match(rgot[1], dwant[1], tolerance(kBFloat16));
}

#if defined(KILN_WITH_CUDA)
using cuda::internal::RmsNormBackward;
using cuda::internal::RmsNormForward;

// Forward and backward through the internal launchers with the kernels given (kernels/cuda/norm.h)
// against the CPU kernels, on x ([..., d] on the CPU) and w.
void check_rms_kernels(const Tensor& x, const Tensor& w, RmsNormForward fk, RmsNormBackward bk,
                       double eps = 1e-5) {
  SCOPED_TRACE(std::string(dtype_name(x.dtype())) + " x " + shape_str(x.sizes()) + ", " +
               std::string(dtype_name(w.dtype())) + " w, kernels " +
               std::to_string(static_cast<int>(fk)) + "/" + std::to_string(static_cast<int>(bk)) +
               ", eps " + std::to_string(eps));
  const TensorVec c = call_op(KILN_OP(rms_norm), {x, w}, {eps});
  const Tensor xg = x.to(kGpu), wg = w.to(kGpu);
  const Tensor y = empty(x.sizes(), TensorOptions(x.dtype()).device(kGpu));
  const Tensor rstd = empty(c[1].sizes(), TensorOptions(c[1].dtype()).device(kGpu));
  cuda::internal::rms_norm_forward(xg, wg, eps, y, rstd, fk);
  const double tol = tolerance(x.dtype());
  expect_match(y, c[0], tol);
  expect_match(rstd, c[1], x.dtype() == kDouble ? 1e-12 : 5e-5);
  const Tensor dy = randn(x.sizes()).to(x.dtype());
  const TensorVec dc = call_op(KILN_OP(rms_norm_backward), {dy, x, w, c[1]});
  const Tensor dx = empty(x.sizes(), TensorOptions(x.dtype()).device(kGpu));
  const Tensor dw = empty(w.sizes(), TensorOptions(w.dtype()).device(kGpu));
  cuda::internal::rms_norm_backward(dy.to(kGpu), xg, wg, rstd, dx, dw, bk);
  expect_match(dx, dc[0], tol);
  expect_match(dw, dc[1], w.dtype() == kDouble ? 1e-10 : std::max(tol, 1e-4));
  // With a residual added to dx before the rounding (fuse_norm_residual, compiler/passes.h).
  const Tensor res = randn(x.sizes()).to(x.dtype());
  const TensorVec rc = call_op(KILN_OP(rms_norm_backward), {dy, x, w, c[1], res});
  const Tensor dxr = empty(x.sizes(), TensorOptions(x.dtype()).device(kGpu));
  const Tensor dwr = empty(w.sizes(), TensorOptions(w.dtype()).device(kGpu));
  cuda::internal::rms_norm_backward(dy.to(kGpu), xg, wg, rstd, dxr, dwr, bk, res.to(kGpu));
  expect_match(dxr, rc[0], tol);
  expect_match(dwr, dc[1], w.dtype() == kDouble ? 1e-10 : std::max(tol, 1e-4));
}

// Whether rows of d elements of x's dtype fit a register kernel of `threads` threads per row and
// at most `packs` 16-byte packs per thread (fresh tensors are aligned).
bool fits(int64_t d, ScalarType dt, int64_t threads, int64_t packs) {
  const int64_t n = 16 / static_cast<int64_t>(element_size(dt));
  return d % n == 0 && d / n <= threads * packs;
}

// Every kernel of the library, forward (a warp per row, a group of 128 threads per row, the loop
// kernel) and backward (the row groups, the loop kernel), on every row it fits, also rows that the
// op sends to another kernel: each pack count per thread (1 to 16 forward, 1 to 4 backward), idle
// threads, partial last blocks and steps, several steps per block, unpacked lengths, f32 weights,
// f64, and strided inputs. A kernel that cannot run a call is an error.
TEST_F(GpuRmsNorm, EveryKernel) {
  const std::vector<std::pair<RmsNormForward, RmsNormBackward>> kernels = {
      {RmsNormForward::kWarp, RmsNormBackward::kRows},
      {RmsNormForward::kGroup, RmsNormBackward::kLoop},
      {RmsNormForward::kLoop, RmsNormBackward::kAuto}};
  for (const auto& [fk, bk] : kernels) {
    manual_seed(33);
    const int64_t fwd_threads = fk == RmsNormForward::kWarp ? 32 : 128;
    // The kernels given where they fit the row, else the op's choice. fk and bk are structured
    // bindings: captured by name for clang before 16.
    auto check = [&, fk = fk, bk = bk](const Tensor& x, const Tensor& w) {
      const int64_t d = w.numel();
      const bool fwd_fits = fk == RmsNormForward::kLoop || fits(d, x.dtype(), fwd_threads, 16);
      const bool bwd_fits = bk != RmsNormBackward::kRows || fits(d, x.dtype(), 128, 4) ||
                            (d > 2048 && fits(d, x.dtype(), 256, 4));
      check_rms_kernels(x, w, fwd_fits ? fk : RmsNormForward::kAuto,
                        bwd_fits ? bk : RmsNormBackward::kAuto);
    };
    for (ScalarType dt : {kFloat, kDouble, kHalf, kBFloat16}) {
      check(randn({37, 64}).to(dt), randn({64}).to(dt));
      check(randn({19, 37}).to(dt), randn({37}).to(dt));  // unpacked: the loop kernels alone
      check(randn({11, 1000}).to(dt), randn({1000}).to(dt));
      check(randn({3, 3, 40}).to(dt), randn({3, 40}).to(dt));
      if (dt == kHalf || dt == kBFloat16) check(randn({9, 768}).to(dt), randn({768}));
    }
    for (int64_t d : {8, 24, 256, 264, 768, 1032, 2048, 3000, 4096, 8192, 8200, 16384, 16392}) {
      check(randn({13, d}).to(kBFloat16), randn({d}).to(kBFloat16));
    }
    for (int64_t d : {128, 2048, 4104}) {
      check(randn({1, d}).to(kBFloat16), randn({d}));
      check(randn({7, d}), randn({d}));
      check(randn({5, d}).to(kDouble), randn({d}).to(kDouble));
    }
    check(randn({1025, 2048}).to(kBFloat16), randn({2048}).to(kBFloat16));
    check(randn({2049, 768}).to(kBFloat16), randn({768}).to(kBFloat16));
    check(randn({301, 768}).to(kHalf), randn({768}));
    check(randn({5003, 128}).to(kBFloat16), randn({128}).to(kBFloat16));
    check(randn({40000, 264}).to(kBFloat16), randn({264}).to(kBFloat16));
    check(randn({64, 40}).t().to(kBFloat16), randn({64}).to(kBFloat16));
    check(randn({50, 2 * 512}).to(kBFloat16).slice(1, 0, 512), randn({512}).to(kBFloat16));
  }
  const Tensor x = randn({4, 37}).to(kGpu), w = randn({37}).to(kGpu);
  const Tensor y = empty_like(x), rstd = empty({4}, TensorOptions(kFloat).device(kGpu));
  EXPECT_KILN_ERROR(cuda::internal::rms_norm_forward(x, w, 1e-5, y, rstd, RmsNormForward::kWarp),
                    "[rms_norm] the warp kernel cannot run rows of 37 unpackable elements");
  const Tensor xl = randn({2, 40000}).to(kGpu), wl = randn({40000}).to(kGpu);
  const Tensor yl = empty_like(xl), rl = empty({2}, TensorOptions(kFloat).device(kGpu));
  EXPECT_KILN_ERROR(cuda::internal::rms_norm_forward(xl, wl, 1e-5, yl, rl, RmsNormForward::kGroup),
                    "[rms_norm] the group kernel cannot run rows of 40000 elements");
  EXPECT_KILN_ERROR(cuda::internal::rms_norm_backward(xl, xl, wl, rl, empty_like(xl),
                                                      empty_like(wl), RmsNormBackward::kRows),
                    "[rms_norm_backward] the row-group kernel cannot run rows of 40000 elements");
}

// Rows whose f32 sum of squares overflows (|x| ~ 1e20 and beyond) or underflows (|x| ~ 1e-25
// with eps 0) take the scaled second sum (kernels/cuda/norm.cuh), and the backward of rows whose
// r^3 leaves the f32 range the scaled product: every kernel against the CPU kernels, which take
// such rows in f64 (tests/tensor/fused_ops_test.cpp checks those against an f64 reference). The
// CUDA backward needs a finite dot(dy * w, x): scales up to 1e33 here (the CPU test goes to 3e37).
TEST_F(GpuRmsNorm, LargeAndTinyMagnitudes) {
  manual_seed(34);
  const std::vector<std::pair<RmsNormForward, RmsNormBackward>> kernels = {
      {RmsNormForward::kWarp, RmsNormBackward::kRows},
      {RmsNormForward::kGroup, RmsNormBackward::kLoop},
      {RmsNormForward::kLoop, RmsNormBackward::kAuto}};
  for (const auto& [fk, bk] : kernels) {
    for (int64_t d : {64, 1000, 4096}) {
      const bool fwd_fits = fk == RmsNormForward::kLoop ||
                            fits(d, kFloat, fk == RmsNormForward::kWarp ? 32 : 128, 16);
      const RmsNormForward f = fwd_fits ? fk : RmsNormForward::kAuto;
      const RmsNormBackward b =
          bk == RmsNormBackward::kRows && !fits(d, kFloat, 128, 4) ? RmsNormBackward::kAuto : bk;
      for (const auto& [scale, eps] :
           {std::pair{1e20, 1e-5}, std::pair{1e30, 1e-5}, std::pair{1e33, 0.0},
            std::pair{1e-25, 0.0}, std::pair{1e-30, 1e-5}}) {
        check_rms_kernels(randn({9, d}) * scale, randn({d}), f, b, eps);
        check_rms_kernels((randn({9, d}) * scale).to(kBFloat16), randn({d}), f, b, eps);
      }
      // Rows of every scale in one tensor.
      float scales[4] = {1e20f, 1.0f, 1e-25f, 1e33f};
      check_rms_kernels(randn({4, d}) * from_blob(scales, {4, 1}).clone(), randn({d}), f, b, 0.0);
    }
  }
}
#endif

TEST_F(GpuRmsNorm, AutogradUsesTheFusedBackward) {
  manual_seed(23);
  Tensor x = randn({64, 256}).to(kBFloat16).to(kGpu).requires_grad_(true);
  Tensor w = randn({256}).to(kBFloat16).to(kGpu).requires_grad_(true);
  const Tensor dy = randn({64, 256}).to(kBFloat16);
  const Tensor y = rms_norm(x, w, 1e-6);
  const autograd::variable_list g = autograd::grad({y}, {x, w}, {dy.to(kGpu)});
  static const OpDef& fwd = KILN_OP(rms_norm);
  static const OpDef& bwd = KILN_OP(rms_norm_backward);
  const Tensor xc = x.detach().cpu(), wc = w.detach().cpu();
  const TensorVec c = call_op(fwd, {xc, wc}, {1e-6});
  const TensorVec dc = call_op(bwd, {dy, xc, wc, c[1]});
  expect_match(y.detach(), c[0], 8e-3);
  expect_match(g[0], dc[0], 8e-3);
  expect_match(g[1], dc[1], 8e-3);
}

// Forward (loss, lse) and backward of cross_entropy_fused on both devices.
void check_ce(const Tensor& logits, const Tensor& targets, int64_t ignore = -100) {
  SCOPED_TRACE(std::string(dtype_name(logits.dtype())) + " " + shape_str(logits.sizes()));
  static const OpDef& fwd = KILN_OP(cross_entropy_fused);
  static const OpDef& bwd = KILN_OP(cross_entropy_fused_backward);
  const TensorVec c = call_op(fwd, {logits, targets}, {ignore});
  const TensorVec g = call_op(fwd, {logits.to(kGpu), targets.to(kGpu)}, {ignore});
  // Loss and lse against the f64 reference (the CPU kernel's sequential f32 sum over a long row
  // is itself ~1e-5 off; the GPU's per-thread sums and tree merge are closer).
  const TensorVec r = call_op(fwd, {logits.to(kDouble), targets}, {ignore});
  const double tol = logits.dtype() == kDouble ? 1e-12 : 1e-5;
  EXPECT_LE(rel_error(g[0], r[0]), tol);
  EXPECT_LE(rel_error(g[1], r[1]), tol);
  EXPECT_EQ(g[0].dtype(), c[0].dtype());
  const ScalarType ct = c[0].dtype();
  const Tensor grad = full({}, 1.7, TensorOptions(ct));
  const Tensor dc = call_op1(bwd, {grad, logits, targets, c[1]}, {ignore});
  const Tensor dg =
      call_op1(bwd, {grad.to(kGpu), logits.to(kGpu), targets.to(kGpu), g[1]}, {ignore});
  expect_match(dg, dc, tolerance(logits.dtype()));
}

Tensor targets_for(int64_t n, int64_t v, int64_t ignore_every = 0) {
  std::vector<int64_t> t;
  for (int64_t i = 0; i < n; ++i) {
    t.push_back(ignore_every > 0 && i % ignore_every == 1 ? -100 : (i * 7919 + 13) % v);
  }
  return from_blob(t.data(), {n}, kInt64).clone();
}

TEST_F(GpuCrossEntropy, EveryDtypePackedAndUnpacked) {
  manual_seed(24);
  for (ScalarType dt : {kFloat, kDouble, kHalf, kBFloat16}) {
    check_ce((randn({64, 4096}) * 4).to(dt), targets_for(64, 4096, 5));  // packed
    check_ce((randn({37, 1001}) * 4).to(dt), targets_for(37, 1001, 3));  // odd V
    check_ce((randn({5, 3}) * 4).to(dt), targets_for(5, 3));             // tiny V
  }
}

TEST_F(GpuCrossEntropy, LargeVocabularyAndLayouts) {
  manual_seed(25);
  // The Llama-3 vocabulary, bf16 logits.
  check_ce((randn({96, 128256}) * 3).to(kBFloat16), targets_for(96, 128256, 7));
  // Rows with a stride larger than V (a column slice): read in place.
  const Tensor wide = (randn({40, 1040}) * 3).to(kBFloat16);
  check_ce(wide.narrow(1, 0, 1024), targets_for(40, 1024));
  check_ce(wide.narrow(1, 8, 1000), targets_for(40, 1000));
  // Transposed logits: copied to rows first.
  check_ce((randn({300, 20}) * 2).t(), targets_for(20, 300));
  // Extreme values and a custom ignore_index.
  const Tensor big =
      from_blob(std::vector<float>{1000, -1000, 999, 0, -1e4, 50}.data(), {2, 3}, kFloat).clone();
  check_ce(big, from_blob(std::vector<int64_t>{0, 2}.data(), {2}, kInt64).clone(), 0);
}

TEST_F(GpuCrossEntropy, NanForAllIgnoredAndOutOfRangeTargets) {
  const Tensor logits = randn({3, 8}).to(kGpu);
  const Tensor ignored = full({3}, int64_t{-100}, TensorOptions(kInt64)).to(kGpu);
  EXPECT_TRUE(std::isnan(cross_entropy_fused(logits, ignored).item<double>()));
  const Tensor bad = from_blob(std::vector<int64_t>{0, 8, 1}.data(), {3}, kInt64).clone().to(kGpu);
  EXPECT_TRUE(std::isnan(cross_entropy_fused(logits, bad).item<double>()));
}

TEST_F(GpuCrossEntropy, AutogradUsesTheFusedBackward) {
  manual_seed(26);
  Tensor logits = (randn({32, 5000}) * 3).to(kBFloat16).to(kGpu).requires_grad_(true);
  const Tensor t = targets_for(32, 5000, 4);
  const Tensor loss = cross_entropy_fused(logits, t.to(kGpu));
  const autograd::variable_list g = autograd::grad({loss}, {logits});
  static const OpDef& fwd = KILN_OP(cross_entropy_fused);
  static const OpDef& bwd = KILN_OP(cross_entropy_fused_backward);
  const Tensor lc = logits.detach().cpu();
  const TensorVec c = call_op(fwd, {lc, t}, {int64_t{-100}});
  const Tensor dc =
      call_op1(bwd, {full({}, 1.0, TensorOptions(kFloat)), lc, t, c[1]}, {int64_t{-100}});
  EXPECT_NEAR(loss.item<double>(), c[0].item<double>(), 1e-5);
  EXPECT_EQ(g[0].dtype(), kBFloat16);
  expect_match(g[0], dc, 8e-3);
}

// --- rotary_emb(_qk), swiglu, geglu_tanh ------------------------------------------------------

using ViewFn = std::function<TensorVec(const TensorVec&)>;

TensorVec no_view(const TensorVec& t) { return t; }

// Runs op(view(bases), attrs) on the CPU and on view(bases copied to the GPU) (so that strided
// views have the same layout on both devices) and compares every output.
void check_both(const OpDef& op, const TensorVec& bases, const ViewFn& view,
                absl::InlinedVector<Attr, 4> attrs, double tol) {
  TensorVec gpu_bases;
  for (const Tensor& b : bases) gpu_bases.push_back(b.to(kGpu));
  const TensorVec cin = view(bases), gin = view(gpu_bases);
  for (size_t i = 0; i < cin.size(); ++i) {
    ASSERT_EQ(to_shape(cin[i].strides()), to_shape(gin[i].strides())) << "input " << i;
  }
  const TensorVec c = call_op(op, cin, attrs);
  const TensorVec g = call_op(op, gin, attrs);
  ASSERT_EQ(c.size(), g.size());
  for (size_t i = 0; i < c.size(); ++i) {
    SCOPED_TRACE(op.name + " output " + std::to_string(i));
    EXPECT_EQ(to_shape(g[i].strides()), to_shape(c[i].strides()));  // the same layout
    expect_match(g[i], c[i], tol);
  }
}

// rotary_emb forward and transposed (the backward) on view(x, cos, sin).
void check_rope(const Tensor& x, const Tensor& cos, const Tensor& sin,
                const ViewFn& view = no_view) {
  SCOPED_TRACE(std::string(dtype_name(x.dtype())) + " x " + shape_str(x.sizes()) + ", " +
               std::string(dtype_name(cos.dtype())) + " tables");
  static const OpDef& op = KILN_OP(rotary_emb);
  for (bool transpose : {false, true}) {
    check_both(op, {x, cos, sin}, view, {transpose}, tolerance(x.dtype()));
  }
}

TEST_F(GpuRotaryEmb, EveryDtypePackedAndUnpacked) {
  manual_seed(41);
  for (ScalarType dt : {kFloat, kDouble, kHalf, kBFloat16}) {
    // Tables with unequal halves (the kernel reads both).
    check_rope(randn({2, 3, 37, 64}).to(dt), randn({37, 64}).to(dt), randn({37, 64}).to(dt));
    check_rope(randn({5, 9, 10}).to(dt), randn({9, 10}).to(dt), randn({9, 10}).to(dt));
    check_rope(randn({7, 2}).to(dt), randn({7, 2}).to(dt), randn({7, 2}).to(dt));
  }
  for (ScalarType dt : {kHalf, kBFloat16}) {  // f32 tables
    check_rope(randn({3, 4, 33, 128}).to(dt), randn({33, 128}), randn({33, 128}));
    check_rope(randn({3, 11, 6}).to(dt), randn({11, 6}), randn({11, 6}));
  }
}

TEST_F(GpuRotaryEmb, StridedViewsAndQkForm) {
  manual_seed(42);
  // q, k as views of one [B, T, (H + 2 Hkv) * D] projection, [B, H, T, D] (llama-3.2-1b's
  // grouping at a small size): read in place, packed.
  const int64_t b = 2, t = 19, h = 8, hkv = 2, d = 64;
  for (ScalarType dt : {kBFloat16, kFloat}) {
    const Tensor qkv = randn({b, t, (h + 2 * hkv) * d}).to(dt);
    const Tensor cos = randn({t, d}), sin = randn({t, d});
    const Tensor c = cos.to(dt), s = sin.to(dt);
    auto qk_view = [=](int64_t offset) {
      return [=](const TensorVec& in) -> TensorVec {
        return {in[0].narrow(-1, offset, h * d).view({b, t, h, d}).transpose(1, 2),
                in[0].narrow(-1, offset + h * d, hkv * d).view({b, t, hkv, d}).transpose(1, 2),
                in[1], in[2]};
      };
    };
    static const OpDef& qk = KILN_OP(rotary_emb_qk);
    for (bool transpose : {false, true}) {
      check_both(qk, {qkv, c, s}, qk_view(0), {transpose}, tolerance(dt));
      // Shifted by one element: no 16-byte packs.
      check_both(qk, {qkv, c, s}, qk_view(1), {transpose}, tolerance(dt));
    }
    check_rope(qkv, c, s, [=](const TensorVec& in) -> TensorVec {
      return {in[0].narrow(-1, h * d, hkv * d).view({b, t, hkv, d}).transpose(1, 2), in[1], in[2]};
    });
    // A last dim that is not dense (copied first), and a 2-D x.
    check_rope(randn({3, d, t}).to(dt), c, s, [](const TensorVec& in) -> TensorVec {
      return {in[0].transpose(1, 2), in[1], in[2]};
    });
    check_rope(randn({t, d}).to(dt), c, s);
  }
  // 24 head rows per position: groups of 8 rows sharing a position, the second group crossing
  // from batch 0 into batch 1, read through a [B, T, H, D] -> [B, H, T, D] transpose.
  check_rope(randn({2, 37, 12, 64}).to(kBFloat16), randn({37, 64}).to(kBFloat16),
             randn({37, 64}).to(kBFloat16), [](const TensorVec& in) -> TensorVec {
               return {in[0].transpose(1, 2), in[1], in[2]};
             });
  // rope_cache tables, a long sequence.
  auto [c, s] = nn::functional::rope_cache(2048, 64, 500000.0);
  check_rope(randn({1, 4, 2048, 64}).to(kBFloat16), c, s);
}

TEST_F(GpuRotaryEmb, AutogradUsesTheFusedKernels) {
  manual_seed(43);
  const Tensor qkv = randn({2, 7, 6 * 16}).to(kBFloat16);
  auto [c, s] = nn::functional::rope_cache(7, 16);
  auto grads_on = [&, &c = c, &s = s](Device dev) {  // bindings by name: clang before 16
    Tensor base = qkv.to(dev).requires_grad_(true);
    const Tensor q = base.narrow(-1, 0, 64).view({2, 7, 4, 16}).transpose(1, 2);
    const Tensor k = base.narrow(-1, 64, 16).view({2, 7, 1, 16}).transpose(1, 2);
    auto [q2, k2] = rotary_emb_qk(q, k, c.to(dev), s.to(dev));
    const Tensor loss = (q2.to(kFloat) * q2.to(kFloat)).sum() + (k2.to(kFloat) * 3).sum();
    return autograd::grad({loss}, {base})[0];
  };
  expect_match(grads_on(kGpu), grads_on(Device(kCPU)), 8e-3);
}

// split_qkv_rotary and merge_qkv_rotary, both directions: llama-3.2-1b's grouping (packed),
// D = 6 (no 16-byte packs), a qkv whose rows are not dense (a narrowed wider tensor), f32
// tables on bf16 heads, and dq/dk/dv in flash attention's [B, H, T, D] and in the split's
// [B, T, H, D] layout.
TEST_F(GpuRotaryEmb, SplitAndMergeQkv) {
  manual_seed(44);
  static const OpDef& split = KILN_OP(split_qkv_rotary);
  static const OpDef& merge = KILN_OP(merge_qkv_rotary);
  for (ScalarType dt : {kBFloat16, kFloat}) {
    for (int64_t d : {64, 6}) {
      const int64_t b = 2, t = 19, h = 8, g = 2;
      SCOPED_TRACE(std::string(dtype_name(dt)) + " D " + std::to_string(d));
      const Tensor c = randn({t, d}).to(dt), s = randn({t, d}).to(dt);
      const Tensor qkv = randn({b, t, (h + 2 * g) * d}).to(dt);
      const Tensor wide = randn({b, t, (h + 2 * g) * d + 8}).to(dt);
      for (bool transpose : {false, true}) {
        check_both(split, {qkv, c, s}, no_view, {transpose, h, g}, tolerance(dt));
        check_both(
            split, {wide, c, s},
            [&](const TensorVec& in) -> TensorVec {
              return {in[0].narrow(-1, 8, (h + 2 * g) * d), in[1], in[2]};
            },
            {transpose, h, g}, tolerance(dt));
        const Tensor dq = randn({b, h, t, d}).to(dt), dk = randn({b, g, t, d}).to(dt),
                     dv = randn({b, g, t, d}).to(dt);
        check_both(merge, {dq, dk, dv, c, s}, no_view, {transpose}, tolerance(dt));
        check_both(
            merge, {dq, dk, dv, c, s},
            [](const TensorVec& in) -> TensorVec {
              return {in[0].transpose(1, 2).contiguous().transpose(1, 2),
                      in[1].transpose(1, 2).contiguous().transpose(1, 2), in[2], in[3], in[4]};
            },
            {transpose}, tolerance(dt));
      }
    }
  }
  // f32 rope_cache tables on bf16 heads, a long sequence (llama-160m's heads).
  auto [c, s] = nn::functional::rope_cache(1024, 64);
  check_both(split, {randn({2, 1024, 36 * 64}).to(kBFloat16), c, s}, no_view,
             {false, int64_t{12}, int64_t{12}}, tolerance(kBFloat16));
}

// rotary_qkv_, split_qkv_rotary in place (the compiler's): the CUDA kernel against the CPU's,
// both directions, packed and not (D 64 and 6), a qkv whose rows are not dense, f32 tables on
// bf16 heads; the v heads are left as they were.
TEST_F(GpuRotaryEmb, RotaryQkvInPlace) {
  manual_seed(46);
  static const OpDef& op = KILN_OP(rotary_qkv_);
  for (ScalarType dt : {kBFloat16, kFloat}) {
    for (int64_t d : {64, 6}) {
      for (bool transpose : {false, true}) {
        const int64_t b = 2, t = 19, h = 8, g = 2, n = h + 2 * g;
        SCOPED_TRACE(std::string(dtype_name(dt)) + " D " + std::to_string(d) +
                     (transpose ? " transposed" : ""));
        const Tensor c = randn({t, d}).to(dt), s = randn({t, d}).to(dt);
        const Tensor wide = randn({b, t, n * d + 8}).to(dt);
        for (bool dense : {true, false}) {
          const Tensor cpu =
              dense ? wide.narrow(-1, 8, n * d).contiguous() : wide.clone().narrow(-1, 8, n * d);
          const Tensor base = dense ? cpu.to(kGpu) : wide.to(kGpu).narrow(-1, 8, n * d);
          const Tensor before = base.cpu();
          call_op(op, {cpu, c, s}, {transpose, h, g});
          call_op(op, {base, c.to(kGpu), s.to(kGpu)}, {transpose, h, g});
          for (const auto& [first, heads] : {std::pair{int64_t{0}, h}, std::pair{h, g}}) {
            EXPECT_LE(rel_error(::kiln::internal::qkv_heads(base, first, heads, n),
                                ::kiln::internal::qkv_heads(cpu, first, heads, n)),
                      tolerance(dt))
                << "heads from " << first;
          }
          EXPECT_TRUE(equal(::kiln::internal::qkv_heads(base, h + g, g, n).cpu(),
                            ::kiln::internal::qkv_heads(before, h + g, g, n)));
        }
      }
    }
  }
  auto [c, s] = nn::functional::rope_cache(1024, 64);
  const Tensor cpu = randn({2, 1024, 36 * 64}).to(kBFloat16);
  const Tensor gpu = cpu.to(kGpu);
  call_op(op, {cpu, c, s}, {false, int64_t{12}, int64_t{12}});
  call_op(op, {gpu, c.to(kGpu), s.to(kGpu)}, {false, int64_t{12}, int64_t{12}});
  EXPECT_LE(rel_error(gpu, cpu), tolerance(kBFloat16));
}

TEST_F(GpuRotaryEmb, SplitQkvAutogradUsesTheFusedKernels) {
  manual_seed(45);
  const Tensor qkv = randn({2, 7, 6 * 16}).to(kBFloat16);
  auto [c, s] = nn::functional::rope_cache(7, 16);
  auto grads_on = [&, &c = c, &s = s](Device dev) {  // bindings by name: clang before 16
    Tensor base = qkv.to(dev).requires_grad_(true);
    auto [q, k, v] = split_qkv_rotary(base, c.to(dev), s.to(dev), 4, 1);
    const Tensor loss =
        (q.to(kFloat) * q.to(kFloat)).sum() + (k.to(kFloat) * 3).sum() + (v.to(kFloat) * -2).sum();
    return autograd::grad({loss}, {base})[0];
  };
  expect_match(grads_on(kGpu), grads_on(Device(kCPU)), 8e-3);
}

// cross_entropy_fused_with_grad on the GPU: the one-pass kernel (rows held in registers: up to
// 32768 f16/bf16 classes, 16384 f32) and the forward and backward kernels beyond it, against the
// f64 reference, the CPU, and the GPU's two ops.
void check_ce_with_grad(const Tensor& logits, const Tensor& targets, int64_t ignore = -100) {
  SCOPED_TRACE(std::string(dtype_name(logits.dtype())) + " " + shape_str(logits.sizes()));
  static const OpDef& fwd = KILN_OP(cross_entropy_fused);
  static const OpDef& bwd = KILN_OP(cross_entropy_fused_backward);
  const ScalarType ct = logits.dtype() == kDouble ? kDouble : kFloat;
  const Tensor grad = full({}, 1.7, TensorOptions(ct));
  const auto [lc, sc, dc] = cross_entropy_fused_with_grad(logits, targets, grad, ignore);
  const auto [lg, sg, dg] =
      cross_entropy_fused_with_grad(logits.to(kGpu), targets.to(kGpu), grad.to(kGpu), ignore);
  const TensorVec r = call_op(fwd, {logits.to(kDouble), targets}, {ignore});
  const double tol = logits.dtype() == kDouble ? 1e-12 : 1e-5;
  EXPECT_LE(rel_error(lg, r[0]), tol);
  EXPECT_LE(rel_error(sg, r[1]), tol);
  EXPECT_EQ(to_shape(sg.sizes()), Shape({logits.size(0)}));
  EXPECT_EQ(dg.dtype(), logits.dtype());
  expect_match(dg, dc, tolerance(logits.dtype()));
  const TensorVec f = call_op(fwd, {logits.to(kGpu), targets.to(kGpu)}, {ignore});
  const Tensor b =
      call_op1(bwd, {grad.to(kGpu), logits.to(kGpu), targets.to(kGpu), f[1]}, {ignore});
  expect_match(dg, b.cpu(), tolerance(logits.dtype()));
}

TEST_F(GpuCrossEntropy, WithGradInOnePass) {
  manual_seed(27);
  for (ScalarType dt : {kBFloat16, kHalf, kFloat, kDouble}) {
    check_ce_with_grad((randn({64, 4096}) * 4).to(dt), targets_for(64, 4096, 5));
    check_ce_with_grad((randn({37, 1001}) * 4).to(dt), targets_for(37, 1001, 3));  // odd V
  }
  // Llama-2's vocabulary (512 threads, the last of their 8 packs partly used), the largest rows
  // held in registers, and rows just beyond them (the two kernels).
  check_ce_with_grad((randn({24, 32000}) * 3).to(kBFloat16), targets_for(24, 32000, 7));
  check_ce_with_grad((randn({8, 32768}) * 3).to(kBFloat16), targets_for(8, 32768));
  check_ce_with_grad((randn({8, 32776}) * 3).to(kBFloat16), targets_for(8, 32776));
  check_ce_with_grad((randn({8, 16384}) * 3).to(kFloat), targets_for(8, 16384, 3));
  check_ce_with_grad((randn({8, 16388}) * 3).to(kFloat), targets_for(8, 16388, 3));
  // Rows with a stride larger than V, read in place; a few classes (one warp).
  const Tensor wide = (randn({40, 1040}) * 3).to(kBFloat16);
  check_ce_with_grad(wide.narrow(1, 0, 1024), targets_for(40, 1024));
  check_ce_with_grad((randn({9, 16}) * 3).to(kBFloat16), targets_for(9, 16, 2));
  // Extreme values (the maximum keeps exp() finite) and a custom ignore_index.
  const Tensor big =
      from_blob(std::vector<float>{1000, -1000, 999, 0, -1e4, 50, 3, 2}.data(), {2, 4}, kFloat)
          .clone();
  check_ce_with_grad(big, from_blob(std::vector<int64_t>{0, 2}.data(), {2}, kInt64).clone(), 0);
  // Every row ignored: a NaN loss and a zero gradient; a target out of range: a NaN loss.
  const Tensor grad = full({}, 1.0, TensorOptions(kFloat)).to(kGpu);
  const Tensor logits = randn({3, 64}).to(kBFloat16).to(kGpu);
  const auto [loss, lse, dlogits] = cross_entropy_fused_with_grad(
      logits, full({3}, int64_t{-100}, TensorOptions(kInt64)).to(kGpu), grad);
  EXPECT_TRUE(std::isnan(loss.item<double>()));
  EXPECT_EQ(dlogits.abs().sum().item<double>(), 0.0);
  const Tensor bad = from_blob(std::vector<int64_t>{0, 64, 1}.data(), {3}, kInt64).clone();
  EXPECT_TRUE(std::isnan(
      std::get<0>(cross_entropy_fused_with_grad(logits, bad.to(kGpu), grad)).item<double>()));
  // A NaN logit makes its row's lse NaN, and only its row's, wherever it falls in the row.
  for (int64_t at : {0, 7, 2047, 4095}) {
    Tensor with_nan = (randn({3, 4096}) * 3).to(kBFloat16);
    with_nan.select(0, 1).narrow(0, at, 1).fill_(std::nan(""));
    const Tensor lse_nan = std::get<1>(
        cross_entropy_fused_with_grad(with_nan.to(kGpu), targets_for(3, 4096).to(kGpu), grad));
    const std::vector<float> l = lse_nan.cpu().to_vector<float>();
    EXPECT_TRUE(std::isfinite(l[0]) && std::isnan(l[1]) && std::isfinite(l[2]))
        << at << ": " << l[0] << " " << l[1] << " " << l[2];
  }
}

// linear_cross_entropy on the GPU (cuBLASLt and the fused cross-entropy kernels per chunk)
// against the CPU: loss, dx and dweight, with ignored targets and chunks that split the rows
// unevenly (300 rows in chunks of 128).
TEST_F(GpuCrossEntropy, LinearCrossEntropyMatchesTheCpu) {
  manual_seed(46);
  static const OpDef& op = KILN_OP(linear_cross_entropy);
  for (ScalarType dt : {kBFloat16, kFloat}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor x = randn({300, 64}).to(dt), w = (randn({1000, 64}) * 0.2).to(dt);
    Tensor t = randint(0, 1000, {300});
    t.narrow(0, 0, 150).masked_fill_(rand({150}) > 0.7, -100);
    for (int64_t rows : {0, 128}) {
      const TensorVec c = call_op(op, {x, w, t}, {int64_t{-100}, true, rows});
      const TensorVec g =
          call_op(op, {x.to(kGpu), w.to(kGpu), t.to(kGpu)}, {int64_t{-100}, true, rows});
      for (size_t i = 0; i < 3; ++i) expect_match(g[i], c[i], dt == kFloat ? 1e-4 : 2e-2);
    }
  }
}

// swiglu / geglu_tanh forward and backward on view(gate, up) (and a dy of the output's shape).
void check_glu(const Tensor& gate, const Tensor& up, const ViewFn& view = no_view) {
  SCOPED_TRACE(std::string(dtype_name(gate.dtype())) + " " + shape_str(gate.sizes()));
  static const OpDef& sw = KILN_OP(swiglu);
  static const OpDef& swb = KILN_OP(swiglu_backward);
  static const OpDef& ge = KILN_OP(geglu_tanh);
  static const OpDef& geb = KILN_OP(geglu_tanh_backward);
  const double tol = tolerance(gate.dtype());
  check_both(sw, {gate, up}, view, {}, tol);
  check_both(ge, {gate, up}, view, {}, tol);
  const Tensor shaped = view({gate, up})[0];
  const Tensor dy = randn(shaped.sizes()).to(gate.dtype());
  const ViewFn bwd_view = [&](const TensorVec& in) -> TensorVec {
    const TensorVec v = view({in[1], in[2]});
    return {in[0], v[0], v[1]};
  };
  check_both(swb, {dy, gate, up}, bwd_view, {}, tol);
  check_both(geb, {dy, gate, up}, bwd_view, {}, tol);
}

TEST_F(GpuGlu, EveryDtypePackedAndUnpacked) {
  manual_seed(44);
  for (ScalarType dt : {kFloat, kDouble, kHalf, kBFloat16}) {
    check_glu((randn({64, 128}) * 3).to(dt), randn({64, 128}).to(dt));    // 16-byte packs
    check_glu((randn({1000, 37}) * 3).to(dt), randn({1000, 37}).to(dt));  // odd: one element
    check_glu((randn({}) * 3).to(dt), randn({}).to(dt));                  // 0-d
  }
  // Saturation: large arguments give no NaN on either device.
  const Tensor g =
      from_blob(std::vector<float>{-200, -30, -5, 0, 5, 30, 200, 1e-3}.data(), {8}, kFloat).clone();
  check_glu(g, randn({8}));
  check_glu(g.to(kBFloat16), randn({8}).to(kBFloat16));
  // A large input (many blocks).
  check_glu(randn({3000, 4104}).to(kBFloat16), randn({3000, 4104}).to(kBFloat16));
}

TEST_F(GpuGlu, StridedLayouts) {
  manual_seed(45);
  for (ScalarType dt : {kBFloat16, kFloat}) {
    // gate and up as the halves of one [N, 2F] projection: packed rows at a pitch (F % 8 == 0),
    // then unpacked (F odd).
    for (int64_t f : {64, 35}) {
      const Tensor both = randn({33, 2 * f}).to(dt);
      check_glu(both, both, [f](const TensorVec& in) -> TensorVec {
        return {in[0].narrow(1, 0, f), in[1].narrow(1, f, f)};
      });
    }
    // Transposed, and broadcast (stride 0) inputs.
    check_glu(randn({40, 24}).to(dt), randn({40, 24}).to(dt), [](const TensorVec& in) -> TensorVec {
      return {in[0].t(), in[1].t()};
    });
    check_glu(randn({1, 48}).to(dt), randn({16, 48}).to(dt), [](const TensorVec& in) -> TensorVec {
      return {in[0].expand({16, 48}), in[1]};
    });
  }
}

TEST_F(GpuGlu, AutogradUsesTheFusedKernels) {
  manual_seed(46);
  const Tensor both = randn({128, 2 * 256}).to(kBFloat16);
  for (bool gelu_variant : {false, true}) {
    auto grads_on = [&](Device dev) {
      Tensor base = both.to(dev).requires_grad_(true);
      const Tensor g = base.narrow(1, 0, 256), u = base.narrow(1, 256, 256);
      const Tensor y = gelu_variant ? geglu_tanh(g, u) : swiglu(g, u);
      const Tensor loss = (y.to(kFloat) * y.to(kFloat)).sum();
      return autograd::grad({loss}, {base})[0];
    };
    expect_match(grads_on(kGpu), grads_on(Device(kCPU)), 8e-3);
  }
}

}  // namespace
}  // namespace kiln
