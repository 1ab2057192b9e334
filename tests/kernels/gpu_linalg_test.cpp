// mm, bmm, addmm, matmul and linear on the GPU (cuBLASLt, kernels/cuda/linalg.cu) against an f64
// CPU reference on fresh random inputs: every dtype, odd sizes, transposed, sliced (unaligned)
// and broadcast operands, every addmm epilogue path, k == 0, the TF32 flag, and per-shape
// autotuning (same results as the heuristic's choice, chosen once per shape).
//
// Suites named Gpu* carry the ctest label `gpu` and skip without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <utility>
#include <vector>

#include "autograd/engine.h"
#include "kernels/cuda.h"
#include "kernels/cuda/cublaslt.h"
#include "kernels/gpu_test_util.h"
#include "tensor/ops.h"
#include "test_util.h"

namespace kiln {
namespace {

using test::kGpu;
using test::rel_error;

class GpuFixture : public test::GpuTest {};
class GpuLinalg : public GpuFixture {};

double tolerance(ScalarType t) {
  switch (t) {
    case kDouble:
      return 1e-12;
    case kFloat:
      return 2e-6;  // TF32 off: full f32 products
    case kHalf:
      return 2e-3;
    case kBFloat16:
      return 1e-2;
    default:
      return 0;  // integers: exact
  }
}

Tensor rand_cpu(IntArrayRef sizes, ScalarType dt) {
  if (is_integral(dt, false)) return randint(-5, 6, sizes, TensorOptions(dt));
  return randn(sizes).to(dt);
}

// The f64 reference of op on CPU copies of the inputs (rounded to the dtype first).
Tensor ref64(const Tensor& t) { return t.cpu().to(kDouble); }

void expect_gpu_close(const Tensor& got, const Tensor& want, ScalarType dt) {
  ASSERT_TRUE(got.is_cuda());
  EXPECT_EQ(got.dtype(), dt);
  ASSERT_EQ(to_shape(got.sizes()), to_shape(want.sizes()));
  EXPECT_LE(rel_error(got, want), tolerance(dt)) << dtype_name(dt);
}

const std::vector<ScalarType> kGemmDtypes = {kFloat, kDouble, kHalf, kBFloat16, kInt32, kInt64};

TEST_F(GpuLinalg, MmEveryDtypeAndTransposes) {
  manual_seed(11);
  for (ScalarType dt : kGemmDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t m = 37, k = 53, n = 29;
    const Tensor a = rand_cpu({m, k}, dt).to(kGpu), b = rand_cpu({k, n}, dt).to(kGpu);
    const Tensor at = rand_cpu({k, m}, dt).to(kGpu).t(), bt = rand_cpu({n, k}, dt).to(kGpu).t();
    expect_gpu_close(mm(a, b), ref64(a).mm(ref64(b)), dt);
    expect_gpu_close(mm(at, b), ref64(at).mm(ref64(b)), dt);
    expect_gpu_close(mm(a, bt), ref64(a).mm(ref64(bt)), dt);
    expect_gpu_close(mm(at, bt), ref64(at).mm(ref64(bt)), dt);
  }
}

TEST_F(GpuLinalg, SlicedUnalignedAndStridedViews) {
  manual_seed(12);
  for (ScalarType dt : {kFloat, kHalf, kBFloat16, kDouble}) {
    SCOPED_TRACE(dtype_name(dt));
    // Column slices starting one element in: the data pointer is only element-aligned.
    const Tensor big_a = rand_cpu({40, 70}, dt).to(kGpu), big_b = rand_cpu({70, 90}, dt).to(kGpu);
    const Tensor a = big_a.narrow(1, 1, 65), b = big_b.narrow(0, 3, 65).narrow(1, 1, 81);
    expect_gpu_close(mm(a, b), ref64(a).mm(ref64(b)), dt);
    // Neither dim has unit stride: copied once, still right.
    const Tensor as = big_a.slice(0, 0, 40, 2).slice(1, 0, 70, 2);  // [20, 35]
    const Tensor bs = big_b.slice(0, 0, 70, 2).slice(1, 0, 90, 3);  // [35, 30]
    expect_gpu_close(mm(as, bs), ref64(as).mm(ref64(bs)), dt);
    // Row and column vectors.
    const Tensor row = rand_cpu({1, 65}, dt).to(kGpu), col = rand_cpu({65, 1}, dt).to(kGpu);
    expect_gpu_close(mm(row, b), ref64(row).mm(ref64(b)), dt);
    expect_gpu_close(mm(a, col), ref64(a).mm(ref64(col)), dt);
  }
}

TEST_F(GpuLinalg, LargeBf16AndF16AgainstF64) {
  manual_seed(13);
  for (ScalarType dt : {kBFloat16, kHalf}) {
    const Tensor a = rand_cpu({512, 768}, dt).to(kGpu), w = rand_cpu({1024, 768}, dt).to(kGpu);
    // The Linear layer's product: x @ w^T with w read in place.
    expect_gpu_close(mm(a, w.t()), ref64(a).mm(ref64(w).t()), dt);
  }
}

TEST_F(GpuLinalg, BmmStridedTransposedAndBroadcast) {
  manual_seed(14);
  for (ScalarType dt : kGemmDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor a = rand_cpu({5, 17, 23}, dt).to(kGpu), b = rand_cpu({5, 23, 19}, dt).to(kGpu);
    expect_gpu_close(bmm(a, b), ref64(a).bmm(ref64(b)), dt);
    const Tensor at = rand_cpu({5, 23, 17}, dt).to(kGpu).transpose(1, 2);
    expect_gpu_close(bmm(at, b), ref64(at).bmm(ref64(b)), dt);
    // Broadcast right operand: batch stride 0, never materialised.
    const Tensor shared = rand_cpu({1, 23, 19}, dt).to(kGpu).expand({5, 23, 19});
    expect_gpu_close(bmm(a, shared), ref64(a).bmm(ref64(shared)), dt);
    // matmul: [B, T, K] @ [K, N] folds into one GEMM; [B, T, K] @ [B, K, N] is a bmm.
    const Tensor w = rand_cpu({23, 11}, dt).to(kGpu);
    expect_gpu_close(matmul(a, w), ref64(a).matmul(ref64(w)), dt);
    expect_gpu_close(matmul(a, b), ref64(a).matmul(ref64(b)), dt);
  }
}

TEST_F(GpuLinalg, AddmmEveryPath) {
  manual_seed(15);
  for (ScalarType dt : kGemmDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    const bool integral = is_integral(dt, false);
    const int64_t m = 33, k = 40, n = 24;
    const Tensor a = rand_cpu({m, k}, dt).to(kGpu), b = rand_cpu({n, k}, dt).to(kGpu).t();
    const Tensor bias = rand_cpu({n}, dt).to(kGpu);
    const Tensor full = rand_cpu({m, n}, dt).to(kGpu);
    const Tensor column = rand_cpu({m, 1}, dt).to(kGpu);
    const Scalar two = integral ? Scalar(int64_t{2}) : Scalar(2.0);
    const Scalar three = integral ? Scalar(int64_t{3}) : Scalar(0.5);
    auto ref = [&](const Tensor& self, const Scalar& beta, const Scalar& alpha) {
      return ref64(self) * beta.toDouble() + ref64(a).mm(ref64(b)) * alpha.toDouble();
    };
    // Bias epilogue (beta = alpha = 1), scaled bias (C path), full residual (C = self),
    // broadcast column, beta = 0 (self ignored), a CPU 0-d self.
    expect_gpu_close(addmm(bias, a, b), ref(bias, 1, 1), dt);
    expect_gpu_close(addmm(bias, a, b, three, two), ref(bias, three, two), dt);
    expect_gpu_close(addmm(full, a, b), ref(full, 1, 1), dt);
    expect_gpu_close(addmm(full, a, b, three, two), ref(full, three, two), dt);
    expect_gpu_close(addmm(column, a, b), ref(column, 1, 1), dt);
    expect_gpu_close(addmm(full.t().contiguous().t(), a, b), ref(full, 1, 1), dt);
    const Tensor cpu_scalar = rand_cpu({}, dt);
    expect_gpu_close(addmm(cpu_scalar, a, b), ref(cpu_scalar, 1, 1), dt);
    if (!integral) {
      const Tensor nan_self = full_like(full, NAN);
      expect_gpu_close(addmm(nan_self, a, b, 0, 1), ref64(a).mm(ref64(b)), dt);
      // The bias of a sliced view (offset pointer): not 16-byte aligned, so not the epilogue.
      const Tensor odd_bias = rand_cpu({n + 1}, dt).to(kGpu).narrow(0, 1, n);
      expect_gpu_close(addmm(odd_bias, a, b), ref(odd_bias, 1, 1), dt);
      const Tensor x3 = rand_cpu({2, 5, k}, dt).to(kGpu);
      const Tensor w = rand_cpu({n, k}, dt).to(kGpu);
      expect_gpu_close(linear(x3, w, bias), ref64(x3).matmul(ref64(w).t()) + ref64(bias), dt);
    }
  }
}

// mm_with_bias_grad on the GPU: the product and one operand's sums over k from cuBLASLt's bias
// gradient epilogue (no separate sum where cuBLASLt has the algorithm: bf16 and f16, either
// operand, the transposed g^T of a Linear's backward), else mm and sum (f64); against f64.
TEST_F(GpuLinalg, MmWithBiasGradEpilogue) {
  manual_seed(18);
  static const OpDef& op = KILN_OP(mm_with_bias_grad);
  for (ScalarType dt : {kBFloat16, kHalf, kFloat, kDouble}) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t tokens = 300, in = 72, out = 40;
    const Tensor g = rand_cpu({tokens, out}, dt).to(kGpu), x = rand_cpu({tokens, in}, dt).to(kGpu);
    for (int64_t operand : {0, 1}) {
      SCOPED_TRACE(operand);
      // operand 0: g^T [out, tokens] @ x (sums of g^T's rows); 1: x^T @ g (sums of g's columns).
      const Tensor a = operand == 0 ? g.t() : x.t(), b = operand == 0 ? x : g;
      test::OpRecorder rec;
      const TensorVec r = call_op(op, {a, b}, {operand});
      const int64_t sums_run = rec.count("sum");
      expect_gpu_close(r[0], ref64(a).mm(ref64(b)), dt);
      expect_gpu_close(r[1], ref64(g).sum({0}), dt);
      if (dt == kBFloat16 || dt == kHalf) {
        EXPECT_EQ(sums_run, 0) << "the epilogue was not used";
      }
    }
  }
}

// A Linear layer with a bias on the GPU: its backward takes the weight's and the bias's gradients
// from one mm_with_bias_grad, and they match the CPU's in f64.
TEST_F(GpuLinalg, LinearBiasBackwardInOneCall) {
  manual_seed(19);
  const Tensor x = randn({2, 50, 64}), w = randn({48, 64}), bias = randn({48});
  auto grads = [&](Device d, ScalarType dt) {
    const Tensor xd = x.to(d).to(dt).requires_grad_(true);
    const Tensor wd = w.to(d).to(dt).requires_grad_(true);
    const Tensor bd = bias.to(d).to(dt).requires_grad_(true);
    const Tensor y = linear(xd, wd, bd);
    autograd::backward({(y * y).sum()});
    return std::vector<Tensor>{xd.grad(), wd.grad(), bd.grad()};
  };
  const std::vector<Tensor> want = grads(kCPU, kDouble);
  for (ScalarType dt : {kFloat, kBFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    test::OpRecorder rec;
    const std::vector<Tensor> got = grads(kGpu, dt);
    EXPECT_EQ(rec.count("mm_with_bias_grad"), 1);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_LE(rel_error(got[i], want[i]), dt == kFloat ? 1e-5 : 3e-2) << i;
    }
  }
}

// addmm_activation on the GPU: relu and tanh-gelu from cuBLASLt's epilogue (after the bias
// vector, or with no self), with no separate activation dispatched for bf16, f16 and f32;
// against f64 (f32 tight enough to tell tanh-gelu from erf-gelu); a full C (beta 0.5) and f64
// take the fallback.
TEST_F(GpuLinalg, AddmmActivationEpilogue) {
  manual_seed(20);
  static const OpDef& op = KILN_OP(addmm_activation);
  for (ScalarType dt : {kFloat, kBFloat16, kHalf, kDouble}) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t m = 96, k = 80, n = 48;
    const Tensor a = rand_cpu({m, k}, dt).to(kGpu), b = rand_cpu({n, k}, dt).to(kGpu).t();
    const Tensor bias = rand_cpu({n}, dt).to(kGpu), full = rand_cpu({m, n}, dt).to(kGpu);
    const Tensor zero = zeros({}, TensorOptions(dt).device(kGpu));
    for (bool use_gelu : {false, true}) {
      SCOPED_TRACE(use_gelu ? "gelu tanh" : "relu");
      auto act = [&](const Tensor& t) { return use_gelu ? gelu(t, "tanh") : relu(t); };
      const Tensor prod = ref64(a).mm(ref64(b));
      // f64: the fallback's tanh on the GPU against the CPU's differs by ~1e-11.
      const double tol = dt == kFloat ? 1e-5 : dt == kDouble ? 1e-10 : tolerance(dt);
      test::OpRecorder rec;
      const Tensor with_bias = call_op1(op, {bias, a, b}, {Scalar(1.0), Scalar(1.0), use_gelu});
      const Tensor no_self = call_op1(op, {zero, a, b}, {Scalar(0.0), Scalar(2.0), use_gelu});
      const int64_t separate = rec.count("relu") + rec.count("gelu");
      EXPECT_LE(rel_error(with_bias, act(prod + ref64(bias))), tol);
      EXPECT_LE(rel_error(no_self, act(prod * 2.0)), tol);
      if (dt != kDouble) {
        EXPECT_EQ(separate, 0) << "the epilogue was not used";
      }
      const Tensor c_path = call_op1(op, {full, a, b}, {Scalar(0.5), Scalar(1.0), use_gelu});
      EXPECT_LE(rel_error(c_path, act(prod + ref64(full) * 0.5)), tol);
    }
  }
}

// addmm_gelu_aux and mm_dgelu on the GPU: cuBLASLt's GELU_AUX(_BIAS) writes gelu(p) and p, DGELU
// the product times gelu'(pre), with nothing else dispatched for bf16, f16 and f32; against f64.
// A width that is no multiple of 8 (cuBLASLt's aux needs one), a full C and f64 take the
// fallback.
TEST_F(GpuLinalg, GeluAuxAndDgeluEpilogues) {
  manual_seed(21);
  static const OpDef& aux_op = KILN_OP(addmm_gelu_aux);
  static const OpDef& dgelu_op = KILN_OP(mm_dgelu);
  static const OpDef& gelu_grad = KILN_OP(gelu_backward);
  for (ScalarType dt : {kFloat, kBFloat16, kHalf, kDouble}) {
    for (int64_t n : {48, 44}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " n " + std::to_string(n));
      const int64_t m = 96, k = 80;
      const Tensor a = rand_cpu({m, k}, dt).to(kGpu), b = rand_cpu({n, k}, dt).to(kGpu).t();
      const Tensor bias = rand_cpu({n}, dt).to(kGpu), full = rand_cpu({m, n}, dt).to(kGpu);
      const Tensor pre = (rand_cpu({m, n}, dt) * 3).to(kGpu);
      const Tensor zero = zeros({}, TensorOptions(dt).device(kGpu));
      const Tensor prod = ref64(a).mm(ref64(b));
      const double tol = dt == kFloat ? 1e-5 : dt == kDouble ? 1e-10 : tolerance(dt);
      const bool epilogue = dt != kDouble && n % 8 == 0;
      test::OpRecorder rec;
      const TensorVec with_bias = call_op(aux_op, {bias, a, b}, {Scalar(1.0), Scalar(1.0)});
      const TensorVec no_self = call_op(aux_op, {zero, a, b}, {Scalar(0.0), Scalar(2.0)});
      const Tensor dgelu = call_op1(dgelu_op, {a, b, pre});
      const int64_t separate = rec.count("gelu") + rec.count("gelu_backward") + rec.count("mm");
      if (epilogue) {
        EXPECT_EQ(separate, 0) << "an epilogue was not used";
      }
      const Tensor p1 = prod + ref64(bias), p2 = prod * 2.0;
      EXPECT_LE(rel_error(with_bias[0], gelu(p1, "tanh")), tol);
      EXPECT_LE(rel_error(with_bias[1], p1), tol);
      EXPECT_LE(rel_error(no_self[0], gelu(p2, "tanh")), tol);
      EXPECT_LE(rel_error(no_self[1], p2), tol);
      const Tensor want = call_op1(gelu_grad, {prod, ref64(pre)}, {std::string("tanh")});
      // f64: cuBLASLt's DGELU against the CPU's f64 gelu' differs by ~2e-10.
      EXPECT_LE(rel_error(dgelu, want), dt == kDouble ? 1e-9 : tol);
      const TensorVec c_path = call_op(aux_op, {full, a, b}, {Scalar(0.5), Scalar(1.0)});
      EXPECT_LE(rel_error(c_path[0], gelu(prod + ref64(full) * 0.5, "tanh")), tol);
    }
  }
}

TEST_F(GpuLinalg, EmptyInnerDimension) {
  for (ScalarType dt : {kFloat, kBFloat16, kInt64}) {
    const Tensor a = empty({3, 0}, TensorOptions(dt).device(kGpu));
    const Tensor b = empty({0, 4}, TensorOptions(dt).device(kGpu));
    expect_gpu_close(mm(a, b), zeros({3, 4}, kDouble), dt);
    const Tensor self = rand_cpu({4}, dt);
    expect_gpu_close(addmm(self.to(kGpu), a, b, 2, 1), (ref64(self) * 2).expand({3, 4}), dt);
    EXPECT_EQ(mm(empty({0, 5}, TensorOptions(dt).device(kGpu)),
                 empty({5, 2}, TensorOptions(dt).device(kGpu)))
                  .numel(),
              0);
  }
}

TEST_F(GpuLinalg, Tf32FlagTradesPrecisionForSpeed) {
  manual_seed(16);
  EXPECT_FALSE(cuda::allow_tf32());  // PyTorch's matmul default
  const Tensor a = randn({256, 512}).to(kGpu), b = randn({512, 256}).to(kGpu);
  const Tensor want = ref64(a).mm(ref64(b));
  const double exact = rel_error(mm(a, b), want);
  cuda::set_allow_tf32(true);
  const double tf32 = rel_error(mm(a, b), want);
  cuda::set_allow_tf32(false);
  EXPECT_LT(exact, 2e-6);
  EXPECT_LT(tf32, 5e-3);
  EXPECT_GT(tf32, exact);                      // the flag really switched to the TF32 path
  EXPECT_LT(rel_error(mm(a, b), want), 2e-6);  // and back (a separate cached plan)
}

TEST_F(GpuLinalg, SmCarveoutKeepsProductsCorrect) {
  manual_seed(17);
  EXPECT_EQ(cuda::matmul_sm_carveout(), 0);
  const Tensor a = randn({1024, 768}).to(kGpu).to(kBFloat16);
  const Tensor b = randn({768, 2048}).to(kGpu).to(kBFloat16);
  const Tensor want = ref64(a).mm(ref64(b));
  const double all_sms = rel_error(mm(a, b), want);
  for (int carveout : {8, 32, 100000}) {  // the last leaves one SM
    cuda::set_matmul_sm_carveout(carveout);
    const double err = rel_error(mm(a, b), want);
    cuda::set_matmul_sm_carveout(0);
    EXPECT_LT(err, 2 * all_sms + 1e-3) << "carveout " << carveout;
  }
  EXPECT_THROW(cuda::set_matmul_sm_carveout(-1), Error);
  EXPECT_EQ(cuda::matmul_sm_carveout(), 0);
}

// Sets the autotune flag for a scope and restores it (KILN_MATMUL_AUTOTUNE may have set it).
class AutotuneScope {
 public:
  explicit AutotuneScope(bool enabled) : previous_(cuda::matmul_autotune()) {
    cuda::set_matmul_autotune(enabled);
  }
  ~AutotuneScope() { cuda::set_matmul_autotune(previous_); }
  AutotuneScope(const AutotuneScope&) = delete;
  AutotuneScope& operator=(const AutotuneScope&) = delete;

 private:
  bool previous_;
};

// Every cuBLASLt path with autotuning on, on shapes no other test uses (so each key is tuned
// here): the first call times the candidates, the second reuses the choice; both agree with the
// f64 reference and with the heuristic's choice (autotune off). The accumulating paths catch a
// timing run that wrote into the output: C == out (broadcast or transposed self written into
// the output first) would then have added the product several times.
TEST_F(GpuLinalg, AutotuneMatchesHeuristicOnEveryPath) {
  const test::DiskCacheScope no_disk("none");  // every shape timed here, none read from disk
  for (ScalarType dt : {kFloat, kDouble, kHalf, kBFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    manual_seed(21);
    const int64_t m = 72, k = 104, n = 88, batch = 3;
    const Tensor a = rand_cpu({m, k}, dt).to(kGpu), b = rand_cpu({k, n}, dt).to(kGpu);
    const Tensor at = rand_cpu({k, m}, dt).to(kGpu).t(), bt = rand_cpu({n, k}, dt).to(kGpu).t();
    const Tensor ba = rand_cpu({batch, m, k}, dt).to(kGpu),
                 bb = rand_cpu({batch, k, n}, dt).to(kGpu);
    const Tensor shared = rand_cpu({1, k, n}, dt).to(kGpu).expand({batch, k, n});
    const Tensor bias = rand_cpu({n}, dt).to(kGpu), full = rand_cpu({m, n}, dt).to(kGpu);
    const Tensor column = rand_cpu({m, 1}, dt).to(kGpu);
    const Tensor full_t = full.t().contiguous().t();
    // Each entry: the GPU op and its f64 reference.
    const std::vector<std::pair<std::function<Tensor()>, Tensor>> cases = {
        {[&] { return mm(a, b); }, ref64(a).mm(ref64(b))},
        {[&] { return mm(at, b); }, ref64(at).mm(ref64(b))},
        {[&] { return mm(a, bt); }, ref64(a).mm(ref64(bt))},
        {[&] { return mm(at, bt); }, ref64(at).mm(ref64(bt))},
        {[&] { return bmm(ba, bb); }, ref64(ba).bmm(ref64(bb))},
        {[&] { return bmm(ba, shared); }, ref64(ba).bmm(ref64(shared))},
        {[&] { return bmm(ba.transpose(1, 2).contiguous().transpose(1, 2), bb); },
         ref64(ba).bmm(ref64(bb))},
        // Bias epilogue, separate C (scaled and beta = 1), C == out (broadcast column,
        // transposed self, scaled bias).
        {[&] { return addmm(bias, a, bt); }, ref64(bias) + ref64(a).mm(ref64(bt))},
        {[&] { return addmm(full, a, b, 0.5, 2.0); },
         ref64(full) * 0.5 + ref64(a).mm(ref64(b)) * 2},
        {[&] { return addmm(full, at, b); }, ref64(full) + ref64(at).mm(ref64(b))},
        {[&] { return addmm(column, a, b); }, ref64(column) + ref64(a).mm(ref64(b))},
        {[&] { return addmm(full_t, a, bt); }, ref64(full) + ref64(a).mm(ref64(bt))},
        {[&] { return addmm(bias, at, b, 0.5, 2.0); },
         ref64(bias) * 0.5 + ref64(at).mm(ref64(b)) * 2},
    };
    std::vector<Tensor> heuristic;
    {
      AutotuneScope off(false);
      const cuda::MatmulAutotuneStats before = cuda::matmul_autotune_stats();
      for (const auto& [op, want] : cases) {
        heuristic.push_back(op());
        expect_gpu_close(heuristic.back(), want, dt);
      }
      const cuda::MatmulAutotuneStats after = cuda::matmul_autotune_stats();
      EXPECT_EQ(after.tuned_shapes, before.tuned_shapes);  // off: nothing timed or cached
      EXPECT_EQ(after.cache_hits, before.cache_hits);
    }
    AutotuneScope on(true);
    const cuda::MatmulAutotuneStats s0 = cuda::matmul_autotune_stats();
    for (int pass = 0; pass < 2; ++pass) {
      SCOPED_TRACE(pass == 0 ? "tuning call" : "cached call");
      for (size_t i = 0; i < cases.size(); ++i) {
        SCOPED_TRACE(i);
        const Tensor got = cases[i].first();
        expect_gpu_close(got, cases[i].second, dt);
        EXPECT_LE(rel_error(got, ref64(heuristic[i])), tolerance(dt));
      }
      if (pass == 0) {
        const cuda::MatmulAutotuneStats s1 = cuda::matmul_autotune_stats();
        EXPECT_GE(s1.tuned_shapes - s0.tuned_shapes, static_cast<int64_t>(cases.size()) - 1);
      }
    }
    const cuda::MatmulAutotuneStats s2 = cuda::matmul_autotune_stats();
    EXPECT_GE(s2.cache_hits - s0.cache_hits, static_cast<int64_t>(cases.size()));
  }
}

TEST_F(GpuLinalg, AutotuneTimesOnceThenHitsTheCache) {
  const test::DiskCacheScope no_disk("none");
  manual_seed(22);
  // A product with several candidate algorithms, on a shape no other test uses.
  const Tensor a = rand_cpu({264, 520}, kBFloat16).to(kGpu);
  const Tensor w = rand_cpu({392, 520}, kBFloat16).to(kGpu);
  const Tensor want = ref64(a).mm(ref64(w).t());
  {
    AutotuneScope off(false);
    cuda::reset_matmul_autotune_stats();
    expect_gpu_close(mm(a, w.t()), want, kBFloat16);  // plan made, heuristic's first choice
    const cuda::MatmulAutotuneStats s = cuda::matmul_autotune_stats();
    EXPECT_EQ(s.tuned_shapes, 0);
    EXPECT_EQ(s.cache_hits, 0);
    EXPECT_EQ(s.candidates_timed, 0);
  }
  AutotuneScope on(true);
  EXPECT_TRUE(cuda::matmul_autotune());
  cuda::reset_matmul_autotune_stats();
  expect_gpu_close(mm(a, w.t()), want, kBFloat16);
  cuda::MatmulAutotuneStats s = cuda::matmul_autotune_stats();
  EXPECT_EQ(s.tuned_shapes, 1);
  EXPECT_EQ(s.cache_hits, 0);
  EXPECT_GE(s.candidates_timed, 2);  // the heuristic offers several algorithms for this shape
  EXPECT_EQ(s.skipped_in_capture, 0);
  const int64_t timed = s.candidates_timed;
  for (int i = 1; i <= 3; ++i) {
    expect_gpu_close(mm(a, w.t()), want, kBFloat16);
    s = cuda::matmul_autotune_stats();
    EXPECT_EQ(s.tuned_shapes, 1);
    EXPECT_EQ(s.cache_hits, i);
    EXPECT_EQ(s.candidates_timed, timed);  // nothing timed again
  }
  // Another layout of the same sizes is another key: tuned on its own.
  const Tensor wt = w.t().contiguous();
  expect_gpu_close(mm(a, wt), want, kBFloat16);
  EXPECT_EQ(cuda::matmul_autotune_stats().tuned_shapes, 2);
}

// The timed choice goes to the disk cache; a new process (the plans forgotten) takes it from
// there instead of timing again, and gets the same product. A cache that holds no choice for the
// shape, or is off, times again.
TEST_F(GpuLinalg, AutotuneChoiceIsKeptInTheDiskCache) {
  const test::DiskCacheScope cache(test::DiskCacheScope::fresh("choices"));
  manual_seed(23);
  // Shapes no other test uses, each with several candidate algorithms.
  const Tensor a = rand_cpu({152, 648}, kBFloat16).to(kGpu);
  const Tensor w = rand_cpu({328, 648}, kBFloat16).to(kGpu);
  const Tensor want = ref64(a).mm(ref64(w).t());
  AutotuneScope on(true);
  const cuda::KernelSetupStats s0 = cuda::kernel_setup_stats();
  const Tensor first = mm(a, w.t());
  expect_gpu_close(first, want, kBFloat16);
  const cuda::KernelSetupStats s1 = cuda::kernel_setup_stats();
  ASSERT_EQ(s1.matmul_shapes_timed, s0.matmul_shapes_timed + 1);
  EXPECT_GT(s1.matmul_timing_s, s0.matmul_timing_s);
  EXPECT_EQ(s1.choices_written, s0.choices_written + 1);
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(cache.dir()))
    files += e.is_regular_file();
  EXPECT_EQ(files, 1);

  cuda::internal::clear_plans();  // as a new process
  const Tensor again = mm(a, w.t());
  const cuda::KernelSetupStats s2 = cuda::kernel_setup_stats();
  EXPECT_EQ(s2.matmul_shapes_timed, s1.matmul_shapes_timed);  // not timed again
  EXPECT_EQ(s2.choices_read, s1.choices_read + 1);
  expect_gpu_close(again, want, kBFloat16);
  EXPECT_LE(rel_error(again, ref64(first)), tolerance(kBFloat16));

  // Another shape is not in the cache: timed.
  const Tensor w2 = rand_cpu({200, 648}, kBFloat16).to(kGpu);
  expect_gpu_close(mm(a, w2.t()), ref64(a).mm(ref64(w2).t()), kBFloat16);
  const cuda::KernelSetupStats s3 = cuda::kernel_setup_stats();
  EXPECT_EQ(s3.matmul_shapes_timed, s2.matmul_shapes_timed + 1);
  EXPECT_EQ(s3.choices_read, s2.choices_read);

  // With the cache off, a new process times again.
  {
    const test::DiskCacheScope off("none");
    cuda::internal::clear_plans();
    expect_gpu_close(mm(a, w.t()), want, kBFloat16);
    const cuda::KernelSetupStats s4 = cuda::kernel_setup_stats();
    EXPECT_EQ(s4.matmul_shapes_timed, s3.matmul_shapes_timed + 1);
    EXPECT_EQ(s4.choices_read, s3.choices_read);
    EXPECT_EQ(s4.choices_written, s3.choices_written);
  }
}

// The switch itself needs no GPU (it compiles and runs in CPU builds too).
TEST(CublasLtFlags, AutotuneSwitch) {
  const bool initial = cuda::matmul_autotune();
  cuda::set_matmul_autotune(true);
  EXPECT_TRUE(cuda::matmul_autotune());
  cuda::set_matmul_autotune(false);
  EXPECT_FALSE(cuda::matmul_autotune());
  cuda::set_matmul_autotune(initial);
}

TEST_F(GpuLinalg, ErrorsStillComeFromMeta) {
  const Tensor a = randn({2, 3}).to(kGpu);
  EXPECT_KILN_ERROR(mm(a, randn({4, 2}).to(kGpu)), "[mm] shapes");
  EXPECT_KILN_ERROR(mm(a, randn({3, 2}).to(kGpu).to(kDouble)), "[mm] expected both operands");
  EXPECT_KILN_ERROR(mm(a, randn({3, 2})), "[mm] expected all tensors on the same device");
}

}  // namespace
}  // namespace kiln
