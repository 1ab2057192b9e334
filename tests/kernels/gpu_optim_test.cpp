// The multi-tensor Adam/AdamW CUDA kernel (kernels/cuda/optim.cu) against the CPU optimizer:
// the same parameters and gradients, several steps, f32, bf16 and f16 parameters, AdamW and
// Adam (L2), amsgrad, more tensors than one launch takes, unaligned and empty parameters,
// parameters that miss a step; and bf16-true training on the GPU. Suites are Gpu* (ctest
// label gpu) and skip without a GPU.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/cuda/runtime.h"
#include "kernels/gpu_test_util.h"
#include "nn/functional.h"
#include "nn/modules/activation.h"
#include "nn/modules/container.h"
#include "nn/modules/linear.h"
#include "nn/optim/adam.h"
#include "nn/optim/adamw.h"
#include "tensor/ops.h"
#include "test_util.h"

namespace kiln {
namespace {

class GpuOptimTest : public test::GpuTest {};
class GpuAdamW : public GpuOptimTest {};
class GpuAdam : public GpuOptimTest {};
class GpuBf16True : public GpuOptimTest {};

// Leaf parameters of many sizes: odd, a chunk boundary (8192), several chunks plus a tail,
// empty, 2-D, and one whose data starts 1 element into its storage (not 16-byte aligned).
std::vector<Tensor> make_params(ScalarType dtype, uint64_t seed, int extra_small = 0) {
  manual_seed(seed);
  std::vector<Tensor> ps;
  for (const Shape& s :
       std::vector<Shape>{{1}, {7}, {1000}, {8192}, {3 * 8192 + 5}, {0}, {33, 17}, {65537}}) {
    ps.push_back(randn(s).to(dtype));
  }
  ps.push_back(randn({1001}).to(dtype).narrow(0, 1, 1000));  // offset 1: the scalar path
  for (int i = 0; i < extra_small; ++i) ps.push_back(randn({5 + 3 * i}).to(dtype));
  for (Tensor& p : ps) p = p.detach().requires_grad_(true);
  return ps;
}

// The same parameters on the GPU (fresh leaves); one that starts inside its storage on the
// CPU does on the GPU too.
std::vector<Tensor> to_gpu(const std::vector<Tensor>& ps) {
  std::vector<Tensor> out;
  for (const Tensor& p : ps) {
    const int64_t offset = p.impl()->storage_offset();
    if (offset == 0) {
      out.push_back(p.detach().cuda().requires_grad_(true));
      continue;
    }
    Tensor big = zeros({p.numel() + offset}, TensorOptions(p.dtype()).device(Device(kCUDA)));
    Tensor view = big.narrow(0, offset, p.numel());
    view.copy_(p.detach());
    out.push_back(view.detach().requires_grad_(true));
  }
  return out;
}

void expect_close(const Tensor& gpu, const Tensor& cpu, double rtol, double atol,
                  const std::string& what) {
  ASSERT_TRUE(gpu.is_cuda()) << what;
  ASSERT_EQ(gpu.dtype(), cpu.dtype()) << what;
  ASSERT_EQ(gpu.sizes(), cpu.sizes()) << what;
  EXPECT_TRUE(allclose(gpu.cpu().to(kDouble), cpu.to(kDouble), rtol, atol))
      << what << ": max abs diff "
      << (gpu.cpu().to(kDouble) - cpu.to(kDouble)).abs().max().item<double>();
}

struct Case {
  bool adamw;
  bool amsgrad;
  double weight_decay;
  double beta1;
};

std::unique_ptr<optim::Optimizer> make_opt(const Case& c, std::vector<Tensor> ps) {
  if (c.adamw) {
    return std::make_unique<optim::AdamW>(std::move(ps), optim::AdamWOptions(3e-2)
                                                             .betas({c.beta1, 0.95})
                                                             .weight_decay(c.weight_decay)
                                                             .amsgrad(c.amsgrad));
  }
  return std::make_unique<optim::Adam>(std::move(ps), optim::AdamOptions(3e-2)
                                                          .betas({c.beta1, 0.95})
                                                          .weight_decay(c.weight_decay)
                                                          .amsgrad(c.amsgrad));
}

// Runs `steps` steps of the optimizer of `c` on CPU and GPU copies of the same parameters
// with the same gradients (parameter 1 gets none on step 2, so step counts differ), then
// compares parameters and every state buffer.
void run_case(const Case& c, ScalarType dtype, int extra_small, double p_rtol, double p_atol) {
  const std::vector<Tensor> cpu = make_params(dtype, 11, extra_small);
  const std::vector<Tensor> gpu = to_gpu(cpu);
  auto cpu_opt = make_opt(c, cpu);
  auto gpu_opt = make_opt(c, gpu);
  for (int step = 0; step < 4; ++step) {
    manual_seed(100 + step);
    for (size_t i = 0; i < cpu.size(); ++i) {
      Tensor pc = cpu[i], pg = gpu[i];
      if (i == 1 && step == 2) {
        pc.mutable_grad() = Tensor();
        pg.mutable_grad() = Tensor();
        continue;
      }
      const Tensor g = randn(cpu[i].sizes()).to(dtype);
      pc.mutable_grad() = g;
      pg.mutable_grad() = g.cuda();
    }
    cpu_opt->step();
    gpu_opt->step();
  }
  const std::string name = std::string(c.adamw ? "AdamW" : "Adam") + (c.amsgrad ? " amsgrad" : "") +
                           " " + std::string(dtype_name(dtype));
  for (size_t i = 0; i < cpu.size(); ++i) {
    const std::string what = name + " parameter " + std::to_string(i);
    expect_close(gpu[i], cpu[i], p_rtol, p_atol, what);
    const auto& sc = cpu_opt->state().at(cpu[i].impl());
    const auto& sg = gpu_opt->state().at(gpu[i].impl());
    EXPECT_EQ(sc.step, sg.step) << what;
    ASSERT_EQ(sc.buffers.size(), sg.buffers.size()) << what;
    for (const auto& [key, buf] : sc.buffers) {
      EXPECT_EQ(sg.buffers.at(key).dtype(), kFloat) << what << " " << key;
      expect_close(sg.buffers.at(key), buf, 1e-5, 1e-7, what + " " + key);
    }
  }
}

const std::vector<Case> kCases = {
    {true, false, 0.1, 0.9},    // AdamW
    {true, true, 0.1, 0.9},     // AdamW, amsgrad
    {false, false, 0.05, 0.9},  // Adam with L2 decay
    {false, true, 0.0, 0.9},    // Adam, amsgrad, no decay
    {true, false, 0.0, 0.2},    // lerp from the far end (1 - beta1 >= 0.5)
};

TEST_F(GpuAdamW, MatchesCpuF32) {
  for (const Case& c : kCases) run_case(c, kFloat, 0, 2e-6, 1e-7);
}

TEST_F(GpuAdamW, MatchesCpuBf16Params) {
  // The f32 update is rounded once into bf16 on both sides; allow one bf16 ulp.
  for (const Case& c : kCases) run_case(c, kBFloat16, 0, 8e-3, 1e-6);
}

TEST_F(GpuAdamW, MatchesCpuF16Params) { run_case(kCases[0], kHalf, 0, 1e-3, 1e-6); }

TEST_F(GpuAdamW, ManyTensorsNeedSeveralLaunches) {
  run_case(kCases[0], kFloat, 80, 2e-6, 1e-7);
  run_case(kCases[1], kBFloat16, 80, 8e-3, 1e-6);
}

TEST_F(GpuAdam, MatchesCpuF32) { run_case(kCases[2], kFloat, 5, 2e-6, 1e-7); }

// Parameters on the GPU and on the CPU in one group: each takes its own path.
TEST_F(GpuAdamW, MixedDevicesInOneGroup) {
  manual_seed(5);
  Tensor a = randn({300}).requires_grad_(true);
  Tensor b = randn({300}).cuda().requires_grad_(true);
  Tensor ref_a = a.detach().clone().requires_grad_(true);
  Tensor ref_b = b.detach().cpu().requires_grad_(true);
  optim::AdamW opt({a, b}, optim::AdamWOptions(1e-2));
  optim::AdamW ref({ref_a, ref_b}, optim::AdamWOptions(1e-2));
  for (int s = 0; s < 3; ++s) {
    const Tensor ga = randn({300}), gb = randn({300});
    a.mutable_grad() = ga;
    b.mutable_grad() = gb.cuda();
    ref_a.mutable_grad() = ga;
    ref_b.mutable_grad() = gb;
    opt.step();
    ref.step();
  }
  EXPECT_TRUE(equal(a, ref_a));
  expect_close(b, ref_b, 2e-6, 1e-7, "gpu parameter");
}

// bf16-true on the GPU: a module converted to bf16 trains with AdamW, the state stays f32.
TEST_F(GpuBf16True, ModuleTrainsWithAdamW) {
  manual_seed(6);
  nn::Sequential net(nn::Linear(16, 32), nn::GELU(), nn::Linear(32, 5));
  net->to(Device(kCUDA), kBFloat16);
  const Tensor x = randn({64, 16}).to(Device(kCUDA), kBFloat16);
  const Tensor target = randint(0, 5, {64}).cuda();
  optim::AdamW opt(net->parameters(), optim::AdamWOptions(1e-2));
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    Tensor loss = nn::functional::cross_entropy(net->forward(x), target);
    if (step == 0) first = loss.item<double>();
    last = loss.item<double>();
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  EXPECT_LT(last, 0.6 * first);
  for (const Tensor& p : net->parameters()) {
    EXPECT_EQ(p.dtype(), kBFloat16);
    EXPECT_TRUE(p.is_cuda());
    const auto& bufs = opt.state().at(p.impl()).buffers;
    EXPECT_EQ(bufs.at("exp_avg").dtype(), kFloat32);
    EXPECT_TRUE(bufs.at("exp_avg_sq").is_cuda());
  }
}

}  // namespace
}  // namespace kiln
