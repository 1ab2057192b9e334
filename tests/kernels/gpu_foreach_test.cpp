// The CUDA kernels of foreach_norm and foreach_mul_ (kernels/cuda/foreach.cu) against their CPU
// kernels (kernels/cpu/foreach.cpp): lists longer than one launch's table (160 tensors), sizes
// around the 16 KiB chunk (8192 bf16/f16, 4096 f32, 2048 f64 elements) and odd ones, empty and
// 0-d tensors, data not 16-byte aligned (the scalar path), f32, bf16, f16 and f64, every kind of
// ord. foreach_norm accumulates in f32 on the GPU (f64 for f64) and in f64 on the CPU: within
// rounding. foreach_mul_ gives the CPU's bits and t.mul_(scale)'s, with the scale on the GPU (read
// there, any floating dtype) or on the CPU. And nn::utils::clip_grad_norm_ on the GPU against the
// CPU. Suites are Gpu* (ctest label gpu) and skip without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/gpu_test_util.h"
#include "nn/utils/clip_grad.h"
#include "tensor/foreach.h"
#include "tensor/ops.h"
#include "tensor/registry.h"
#include "test_util.h"

namespace kiln {
namespace {

using test::expect_match;
using test::kGpu;
using Attrs = absl::InlinedVector<Attr, 4>;

class GpuForeachNorm : public test::GpuTest {};
class GpuForeachMul : public test::GpuTest {};
class GpuForeachClip : public test::GpuTest {};

// Elements per block of the CUDA kernels (16 KiB).
int64_t chunk_of(ScalarType dtype) { return 16384 / static_cast<int64_t>(element_size(dtype)); }

// A list of `count` tensors (count > 160: two tables) of sizes around the chunk of `dtype`,
// odd sizes, empty (unless `nonempty`) and 0-d ones, 2-D ones; random values, some zero.
std::vector<Tensor> make_list(ScalarType dtype, int count, uint64_t seed, bool nonempty = false) {
  const int64_t c = chunk_of(dtype);
  const std::vector<Shape> shapes = {{1}, {7}, {c - 1},  {c},      {c + 1}, {3 * c + 5},
                                     {0}, {},  {33, 17}, {100003}, {2, c},  {13}};
  manual_seed(seed);
  std::vector<Tensor> out;
  for (int i = 0; static_cast<int>(out.size()) < count; ++i) {
    const Shape& s = shapes[i % shapes.size()];
    if (nonempty && numel_of(s) == 0) continue;
    Tensor t = randn(s) * 2.0;
    t = where(t.abs() < 0.2, 0.0, t);
    out.push_back(t.to(dtype));
  }
  return out;
}

std::vector<Tensor> to_gpu(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const Tensor& t : ts) out.push_back(t.cuda());
  return out;
}

// One tensor whose data starts 1 element into its storage (not 16-byte aligned), on both devices.
std::pair<Tensor, Tensor> unaligned(ScalarType dtype, int64_t n, uint64_t seed) {
  manual_seed(seed);
  const Tensor base = randn({n + 1}).to(dtype);
  return {base.narrow(0, 1, n), base.cuda().narrow(0, 1, n)};
}

TensorVec vec(const std::vector<Tensor>& ts) { return TensorVec(ts.begin(), ts.end()); }

TEST_F(GpuForeachNorm, MatchesTheCpuKernel) {
  const OpDef& op = KILN_OP(foreach_norm);
  for (ScalarType dtype : {kFloat, kBFloat16, kHalf, kDouble}) {
    for (double ord : {2.0, 1.0, 0.0, 3.0, double(INFINITY), -double(INFINITY)}) {
      std::vector<Tensor> cpu = make_list(dtype, 200, 3, /*nonempty=*/std::isinf(ord));
      std::vector<Tensor> gpu = to_gpu(cpu);
      const auto [uc, ug] = unaligned(dtype, 3 * chunk_of(dtype) + 3, 4);
      cpu.push_back(uc);
      gpu.push_back(ug);
      const Attrs attrs{static_cast<int64_t>(cpu.size()), ord};
      const TensorVec want = call_op_with_kernel(op, "multi_tensor", vec(cpu), attrs);
      const TensorVec got = call_op_with_kernel(op, "multi_tensor", vec(gpu), attrs);
      const TensorVec decomposed = call_decomposition(op, vec(gpu), attrs);
      ASSERT_EQ(got.size(), cpu.size());
      // f32 accumulation over up to 1e5 elements against f64; counts (ord 0) and maxima exact.
      const test::Tol tol = dtype == kDouble              ? test::Tol{1e-12, 0}
                            : ord == 0 || std::isinf(ord) ? test::Tol{0, 0}
                                                          : test::Tol{2e-5, 0};
      for (size_t i = 0; i < cpu.size(); ++i) {
        const std::string what = std::string(dtype_name(dtype)) + " ord " + std::to_string(ord) +
                                 " tensor " + std::to_string(i) + " " + shape_str(cpu[i].sizes());
        ASSERT_TRUE(got[i].is_cuda()) << what;
        expect_match(got[i], want[i], tol, what);
        expect_match(decomposed[i], want[i], tol, what + " (decomposition on the GPU)");
      }
    }
  }
}

TEST_F(GpuForeachNorm, NanInfAndTheApi) {
  Tensor a = randn({50000}).to(kBFloat16);
  a.narrow(0, 40000, 1).fill_(NAN);
  Tensor b = randn({9000});
  b.narrow(0, 8999, 1).fill_(INFINITY);
  const std::vector<Tensor> n = foreach_norm({a.cuda(), ones({3}, kBFloat16).cuda()}, 2.0);
  EXPECT_TRUE(std::isnan(n[0].item<double>()));
  EXPECT_NEAR(n[1].item<double>(), std::sqrt(3.0), 1e-6);
  EXPECT_EQ(n[0].dtype(), kFloat);
  EXPECT_TRUE(std::isnan(foreach_norm({a.cuda()}, INFINITY)[0].item<double>()));
  EXPECT_TRUE(std::isinf(foreach_norm({b.cuda()}, 2.0)[0].item<double>()));
  EXPECT_TRUE(std::isinf(foreach_norm({b.cuda()}, INFINITY)[0].item<double>()));
  // Strided tensors run the decomposition, on the GPU.
  const Tensor t = randn({300, 70});
  const std::vector<Tensor> s = foreach_norm({t.cuda().t()}, 2.0);
  expect_match(s[0], t.norm(2.0), {2e-5, 0}, "transposed");
}

TEST_F(GpuForeachMul, MatchesTheCpuKernelAndMulBitForBit) {
  const OpDef& op = KILN_OP(foreach_mul_);
  for (ScalarType dtype : {kFloat, kBFloat16, kHalf, kDouble}) {
    for (ScalarType sdtype : {kDouble, kFloat, kBFloat16}) {
      for (bool scale_on_gpu : {true, false}) {
        const double value = 0.3183098861837907;
        std::vector<Tensor> cpu = make_list(dtype, 170, 5);
        if (promote_types(dtype, sdtype) != dtype) {  // 0-d tensors would widen: decomposition
          std::erase_if(cpu, [](const Tensor& t) { return t.dim() == 0; });
        }
        const auto [uc, ug] = unaligned(dtype, 2 * chunk_of(dtype) + 7, 6);
        cpu.push_back(uc.clone());
        std::vector<Tensor> gpu = to_gpu(cpu);
        gpu.back() = ug;  // the unaligned view itself
        std::vector<Tensor> gpu_mul = to_gpu(cpu);
        const Tensor scale = full({}, value, sdtype);
        const Tensor gscale = scale_on_gpu ? scale.cuda() : scale;
        TensorVec cin = vec(cpu), gin = vec(gpu);
        cin.push_back(scale);
        gin.push_back(gscale);
        const Attrs attrs{static_cast<int64_t>(cpu.size())};
        call_op_with_kernel(op, "multi_tensor", cin, attrs);
        call_op_with_kernel(op, "multi_tensor", gin, attrs);
        for (size_t i = 0; i < cpu.size(); ++i) {
          Tensor(gpu_mul[i]).mul_(gscale);
          const std::string what = std::string(dtype_name(dtype)) + " * " +
                                   std::string(dtype_name(sdtype)) +
                                   (scale_on_gpu ? " (gpu scale)" : " (cpu scale)") + " tensor " +
                                   std::to_string(i) + " " + shape_str(cpu[i].sizes());
          expect_match(gpu[i], cpu[i], {0, 0}, what);
          expect_match(gpu_mul[i], cpu[i], {0, 0}, what + " vs mul_");
        }
      }
    }
  }
}

TEST_F(GpuForeachMul, ZeroDimTensorsThatWidenAndNanScale) {
  Tensor t = full({}, 1.3, kBFloat16).cuda(), u = randn({5000}).to(kBFloat16).cuda();
  Tensor et = t.clone(), eu = u.clone();
  const Tensor s = full({}, 0.7001, kDouble).cuda();
  foreach_mul_({t, u}, s);
  et.mul_(s);
  eu.mul_(s);
  expect_match(t, et.cpu(), {0, 0}, "0-d bf16 * f64");
  expect_match(u, eu.cpu(), {0, 0}, "bf16 * f64");
  foreach_mul_({u}, full({}, NAN).cuda());
  EXPECT_TRUE((u != u).all().item<bool>());  // nan everywhere
}

// A llama-160m-like list of bf16 gradients (> one table) clipped on the GPU and on the CPU.
TEST_F(GpuForeachClip, ClipGradNormMatchesCpu) {
  manual_seed(9);
  std::vector<Tensor> cpu_params, gpu_params;
  auto add = [&](const Shape& s) {
    const Tensor g = (randn(s) * 1e-2).to(kBFloat16);
    Tensor c = zeros(s, kBFloat16), d = zeros(s, kBFloat16).cuda();
    c.mutable_grad() = g.clone();
    d.mutable_grad() = g.cuda();
    cpu_params.push_back(c);
    gpu_params.push_back(d);
  };
  add({8000, 768});
  for (int layer = 0; layer < 12; ++layer) {
    for (const Shape& s : std::vector<Shape>{{768, 768},
                                             {256, 768},
                                             {256, 768},
                                             {768, 768},
                                             {2048, 768},
                                             {2048, 768},
                                             {768, 2048},
                                             {768},
                                             {768}}) {
      add(s);
    }
  }
  add({768});
  add({});  // a 0-d gradient: its own decomposed call
  for (double p : {2.0, double(INFINITY), 1.0}) {
    std::vector<Tensor> c = cpu_params, g = gpu_params;
    for (size_t i = 0; i < c.size(); ++i) {
      c[i].mutable_grad() = c[i].grad().clone();
      g[i].mutable_grad() = g[i].grad().clone();
    }
    const double want = nn::utils::clip_grad_norm_(c, 0.1, p);
    const double got = nn::utils::clip_grad_norm_(g, 0.1, p);
    EXPECT_NEAR(got, want, (std::isinf(p) ? 0 : 2e-5) * want) << p;
    for (size_t i = 0; i < c.size(); i += 17) {
      // The coefficient may differ in its last bits: bf16 rounding of the scaled values.
      expect_match(g[i].grad(), c[i].grad(), {1e-2, 1e-6}, "grad " + std::to_string(i));
    }
  }
}

}  // namespace
}  // namespace kiln
