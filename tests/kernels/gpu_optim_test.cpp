// The multi-tensor Adam/AdamW CUDA kernel (kernels/cuda/optim.cu) against the CPU optimizer:
// the same parameters and gradients, several steps, f32, bf16 and f16 parameters, AdamW and
// Adam (L2), amsgrad, more tensors than one launch takes, unaligned and empty parameters,
// parameters that miss a step; and bf16-true training on the GPU. With state_in_param_dtype
// (16-bit moments, f32 arithmetic) the GPU gives the CPU's bits exactly. Suites are Gpu*
// (ctest label gpu) and skip without a GPU. The ops themselves (tensor/ops/optim.cpp): the CUDA
// kernel of adam_update_ against the CPU kernel (bit for bit) and against the decomposition on
// the GPU, with and without a gradient factor (GPU or CPU); sgd_update_ (its decomposition on the
// GPU) against the CPU kernel.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/cuda/optim.h"
#include "kernels/cuda/runtime.h"
#include "kernels/gpu_test_util.h"
#include "nn/functional.h"
#include "nn/modules/activation.h"
#include "nn/modules/container.h"
#include "nn/modules/linear.h"
#include "nn/optim/adam.h"
#include "nn/optim/adamw.h"
#include "tensor/ops.h"
#include "tensor/ops/optim.h"
#include "tensor/registry.h"
#include "test_util.h"

namespace kiln {
namespace {

class GpuOptimTest : public test::GpuTest {};
class GpuAdamW : public GpuOptimTest {};
class GpuAdam : public GpuOptimTest {};
class GpuBf16True : public GpuOptimTest {};
class GpuAdamUpdateOp : public GpuOptimTest {};
class GpuSgdUpdateOp : public GpuOptimTest {};

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

// `in_param`: state_in_param_dtype (moments in the parameters' dtype).
std::unique_ptr<optim::Optimizer> make_opt(const Case& c, std::vector<Tensor> ps,
                                           bool in_param = false) {
  if (c.adamw) {
    return std::make_unique<optim::AdamW>(std::move(ps), optim::AdamWOptions(3e-2)
                                                             .betas({c.beta1, 0.95})
                                                             .weight_decay(c.weight_decay)
                                                             .amsgrad(c.amsgrad)
                                                             .state_in_param_dtype(in_param));
  }
  return std::make_unique<optim::Adam>(std::move(ps), optim::AdamOptions(3e-2)
                                                          .betas({c.beta1, 0.95})
                                                          .weight_decay(c.weight_decay)
                                                          .amsgrad(c.amsgrad)
                                                          .state_in_param_dtype(in_param));
}

// The GPU result equals the CPU one bit for bit (same dtype, shape and values).
void expect_same_bits(const Tensor& gpu, const Tensor& cpu, const std::string& what) {
  ASSERT_TRUE(gpu.is_cuda()) << what;
  ASSERT_EQ(gpu.dtype(), cpu.dtype()) << what;
  ASSERT_EQ(gpu.sizes(), cpu.sizes()) << what;
  EXPECT_TRUE(equal(gpu.cpu(), cpu))
      << what << ": max abs diff "
      << (gpu.cpu().to(kDouble) - cpu.to(kDouble)).abs().max().item<double>();
}

// Runs `steps` steps of the optimizer of `c` on CPU and GPU copies of the same parameters
// with the same gradients (parameter 1 gets none on step 2, so step counts differ), then
// compares parameters and every state buffer.
// With `in_param` (state_in_param_dtype) the moments take the parameters' dtype and every
// parameter and buffer must equal the CPU's bit for bit (the tolerances are unused).
void run_case(const Case& c, ScalarType dtype, int extra_small, double p_rtol, double p_atol,
              bool in_param = false) {
  const std::vector<Tensor> cpu = make_params(dtype, 11, extra_small);
  const std::vector<Tensor> gpu = to_gpu(cpu);
  auto cpu_opt = make_opt(c, cpu, in_param);
  auto gpu_opt = make_opt(c, gpu, in_param);
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
                           " " + std::string(dtype_name(dtype)) +
                           (in_param ? " state_in_param_dtype" : "");
  const ScalarType state_dtype = in_param ? dtype : kFloat;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const std::string what = name + " parameter " + std::to_string(i);
    if (in_param) {
      expect_same_bits(gpu[i], cpu[i], what);
    } else {
      expect_close(gpu[i], cpu[i], p_rtol, p_atol, what);
    }
    const auto& sc = cpu_opt->state().at(cpu[i].impl());
    const auto& sg = gpu_opt->state().at(gpu[i].impl());
    EXPECT_EQ(sc.step_count(), sg.step_count()) << what;
    // A GPU parameter's count lives on its GPU (capturable), a CPU one's on the CPU.
    EXPECT_EQ(sg.step.device(), gpu[i].device()) << what;
    EXPECT_TRUE(sc.step.is_cpu()) << what;
    ASSERT_EQ(sc.buffers.size(), sg.buffers.size()) << what;
    for (const auto& [key, buf] : sc.buffers) {
      EXPECT_EQ(sg.buffers.at(key).dtype(), state_dtype) << what << " " << key;
      EXPECT_EQ(buf.dtype(), state_dtype) << what << " " << key;
      if (in_param) {
        expect_same_bits(sg.buffers.at(key), buf, what + " " + key);
      } else {
        expect_close(sg.buffers.at(key), buf, 1e-5, 1e-7, what + " " + key);
      }
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

// state_in_param_dtype: bf16/f16 moments, 8 elements (16 bytes of each of p, g, m, v, v_max)
// per vectorised access, odd sizes with tails, an unaligned parameter (the scalar path), empty
// parameters and missed steps; bit for bit the CPU's f32 arithmetic rounded when stored.
TEST_F(GpuAdamW, ParamDtypeStateMatchesCpuBf16) {
  for (const Case& c : kCases) run_case(c, kBFloat16, 3, 0, 0, /*in_param=*/true);
}

TEST_F(GpuAdamW, ParamDtypeStateMatchesCpuF16) {
  for (const Case& c : kCases) run_case(c, kHalf, 3, 0, 0, /*in_param=*/true);
}

// More parameters than one launch's table holds (36): several launches.
TEST_F(GpuAdamW, ParamDtypeStateManyTensorsNeedSeveralLaunches) {
  run_case(kCases[0], kBFloat16, 80, 0, 0, /*in_param=*/true);
  run_case(kCases[1], kHalf, 80, 0, 0, /*in_param=*/true);
  run_case(kCases[3], kBFloat16, 80, 0, 0, /*in_param=*/true);  // Adam, amsgrad
}

// f32 parameters with the option keep f32 state: the f32 kernel, the CPU's bits.
TEST_F(GpuAdamW, ParamDtypeStateF32ParamsKeepF32State) {
  run_case(kCases[1], kFloat, 3, 0, 0, /*in_param=*/true);
  run_case(kCases[2], kFloat, 3, 0, 0, /*in_param=*/true);
}

// One group of f32, bf16 and f16 parameters with the option: one batch per (dtype, state
// dtype), f32 state for the f32 parameters, 16-bit for the others; a non-contiguous bf16
// parameter takes the kernel on f32 copies, rounded when copied back.
void run_mixed_group(bool adamw, bool amsgrad) {
  manual_seed(8);
  std::vector<Tensor> cpu = {randn({1001}),
                             randn({8193}).to(kBFloat16),
                             randn({77}).to(kHalf),
                             randn({3, 8192 + 3}).to(kBFloat16),
                             randn({5}),
                             randn({31, 9}).to(kBFloat16)};
  for (Tensor& p : cpu) p = p.detach().requires_grad_(true);
  std::vector<Tensor> gpu;
  for (const Tensor& p : cpu) gpu.push_back(p.detach().cuda().requires_grad_(true));
  // The last one transposed on both sides: a non-contiguous parameter.
  cpu.back() = cpu.back().detach().t().contiguous().t().requires_grad_(true);
  gpu.back() = gpu.back().detach().t().contiguous().t().requires_grad_(true);
  ASSERT_FALSE(gpu.back().is_contiguous());
  const Case c{adamw, amsgrad, 0.1, 0.9};
  auto cpu_opt = make_opt(c, cpu, /*in_param=*/true);
  auto gpu_opt = make_opt(c, gpu, /*in_param=*/true);
  for (int step = 0; step < 4; ++step) {
    manual_seed(200 + step);
    for (size_t i = 0; i < cpu.size(); ++i) {
      const Tensor g = randn(cpu[i].sizes()).to(cpu[i].dtype());
      cpu[i].mutable_grad() = g;
      gpu[i].mutable_grad() = g.cuda();
    }
    cpu_opt->step();
    gpu_opt->step();
  }
  const std::string name = std::string(adamw ? "AdamW" : "Adam") + (amsgrad ? " amsgrad" : "");
  for (size_t i = 0; i < cpu.size(); ++i) {
    const std::string what = name + " parameter " + std::to_string(i);
    expect_same_bits(gpu[i], cpu[i], what);
    const auto& sc = cpu_opt->state().at(cpu[i].impl()).buffers;
    const auto& sg = gpu_opt->state().at(gpu[i].impl()).buffers;
    ASSERT_EQ(sc.size(), amsgrad ? 3u : 2u) << what;
    for (const auto& [key, buf] : sc) {
      EXPECT_EQ(buf.dtype(), cpu[i].dtype()) << what << " " << key;
      expect_same_bits(sg.at(key), buf, what + " " + key);
    }
  }
}

TEST_F(GpuAdamW, ParamDtypeStateMixedGroup) {
  run_mixed_group(/*adamw=*/true, /*amsgrad=*/false);
  run_mixed_group(/*adamw=*/true, /*amsgrad=*/true);
}

TEST_F(GpuAdam, ParamDtypeStateMixedGroup) {
  run_mixed_group(/*adamw=*/false, /*amsgrad=*/false);
  run_mixed_group(/*adamw=*/false, /*amsgrad=*/true);
}

// A checkpoint of bf16 state written on the GPU resumes on the CPU (and back) bit-exactly.
TEST_F(GpuAdamW, ParamDtypeStateCheckpointAcrossDevices) {
  manual_seed(9);
  const Tensor init = randn({4099}).to(kBFloat16);
  Tensor g_param = init.cuda().requires_grad_(true);
  Tensor c_param = init.clone().requires_grad_(true);
  const Case c{true, true, 0.1, 0.9};
  auto gpu_opt = make_opt(c, {g_param}, true);
  auto cpu_opt = make_opt(c, {c_param}, true);
  std::vector<Tensor> grads;
  for (int s = 0; s < 4; ++s) grads.push_back(randn({4099}).to(kBFloat16));
  for (int s = 0; s < 2; ++s) {
    g_param.mutable_grad() = grads[s].cuda();
    gpu_opt->step();
  }
  SafetensorsMetadata meta;
  const TensorMap tensors = gpu_opt->state_dict(&meta);
  c_param.detach().copy_(g_param.detach().cpu());
  cpu_opt->load_state_dict(tensors, meta);
  EXPECT_EQ(cpu_opt->state().at(c_param.impl()).buffers.at("exp_avg").dtype(), kBFloat16);
  EXPECT_TRUE(cpu_opt->state().at(c_param.impl()).buffers.at("exp_avg").is_cpu());
  for (int s = 2; s < 4; ++s) {
    g_param.mutable_grad() = grads[s].cuda();
    c_param.mutable_grad() = grads[s];
    gpu_opt->step();
    cpu_opt->step();
  }
  expect_same_bits(g_param, c_param, "parameter");
  for (const auto& [key, buf] : cpu_opt->state().at(c_param.impl()).buffers) {
    expect_same_bits(gpu_opt->state().at(g_param.impl()).buffers.at(key), buf, key);
  }
}

// Checkpoints keep the step counts as numbers: a GPU optimizer's counts (on its GPU) are saved as
// before and load onto the GPU again, or onto the CPU for a CPU optimizer, and the training goes
// on (the same bits on the GPU; the CPU's update within rounding, as MatchesCpuF32).
TEST_F(GpuAdamW, StepCountsOnTheGpuCheckpointAsNumbers) {
  manual_seed(10);
  const Tensor init = randn({777});
  Tensor a = init.cuda().requires_grad_(true), b = init.cuda().requires_grad_(true);
  Tensor c = init.clone().requires_grad_(true);
  optim::AdamW opt_a({a}, optim::AdamWOptions(1e-2)), opt_b({b}, optim::AdamWOptions(1e-2));
  optim::AdamW opt_c({c}, optim::AdamWOptions(1e-2));
  std::vector<Tensor> grads;
  for (int s = 0; s < 5; ++s) grads.push_back(randn({777}));
  for (int s = 0; s < 3; ++s) {
    a.mutable_grad() = grads[s].cuda();
    opt_a.step();
  }
  ASSERT_TRUE(opt_a.state().at(a.impl()).step.is_cuda());
  SafetensorsMetadata meta;
  const TensorMap tensors = opt_a.state_dict(&meta);
  EXPECT_EQ(meta.at("state.0.step"), "3");
  b.detach().copy_(a.detach());
  c.detach().copy_(a.detach().cpu());
  opt_b.load_state_dict(tensors, meta);
  opt_c.load_state_dict(tensors, meta);
  EXPECT_TRUE(opt_b.state().at(b.impl()).step.is_cuda());
  EXPECT_TRUE(opt_c.state().at(c.impl()).step.is_cpu());
  EXPECT_EQ(opt_b.state().at(b.impl()).step_count(), 3);
  EXPECT_EQ(opt_c.state().at(c.impl()).step_count(), 3);
  for (int s = 3; s < 5; ++s) {
    a.mutable_grad() = grads[s].cuda();
    b.mutable_grad() = grads[s].cuda();
    c.mutable_grad() = grads[s];
    opt_a.step();
    opt_b.step();
    opt_c.step();
  }
  expect_same_bits(b, a.detach().cpu(), "reloaded on the GPU");
  expect_close(a, c.detach(), 2e-6, 1e-7, "reloaded on the CPU");
  EXPECT_EQ(opt_b.state().at(b.impl()).step_count(), 5);
}

// The kernel refuses state that is neither f32 nor the parameters' dtype rather than misread it.
TEST_F(GpuAdamW, ParamDtypeStateKernelRejectsOtherStateDtypes) {
#if defined(KILN_WITH_CUDA)
  Tensor p = zeros({8}, TensorOptions(kBFloat16).device(Device(kCUDA)));
  Tensor m = zeros({8}, TensorOptions(kHalf).device(Device(kCUDA)));
  const std::vector<cuda::internal::AdamTensor> ts = {
      {p.data_ptr(), p.data_ptr(), m.data_ptr(), m.data_ptr(), nullptr, 8, -1e-3f, 1.0f}};
  const cuda::internal::AdamHyper h{1.0f, 0.0f, 0.1f, 0.999f, 0.001f, 1e-8f, true, false};
  EXPECT_KILN_ERROR(cuda::internal::multi_tensor_adam(kBFloat16, kHalf, 0, ts, h),
                    "[adam] the multi-tensor CUDA kernel keeps the state in f32 or in the "
                    "parameters' dtype (bfloat16), got float16");
  EXPECT_KILN_ERROR(cuda::internal::multi_tensor_adam(kFloat, kBFloat16, 0, ts, h),
                    "keeps the state in f32 or in the parameters' dtype");
  EXPECT_KILN_ERROR(cuda::internal::multi_tensor_adam(kDouble, kDouble, 0, ts, h),
                    "takes f32, bf16 or f16 parameters");
#endif
  // A hand-made f16 state for a bf16 parameter is converted at the step (the option decides the
  // dtype), never read as bf16.
  Tensor q = randn({8}).to(kBFloat16).cuda().requires_grad_(true);
  Tensor q_cpu = q.detach().cpu().requires_grad_(true);
  optim::AdamW opt({q}, optim::AdamWOptions(1e-2).state_in_param_dtype(true));
  optim::AdamW ref({q_cpu}, optim::AdamWOptions(1e-2).state_in_param_dtype(true));
  const Tensor m16 = randn({8}).abs();
  for (optim::Optimizer* o :
       {static_cast<optim::Optimizer*>(&opt), static_cast<optim::Optimizer*>(&ref)}) {
    const Tensor& param = o == &opt ? q : q_cpu;
    auto& st = o->state()[param.impl()];
    st.step = scalar_tensor(int64_t{1}, kInt64);
    st.buffers["exp_avg"] = m16.to(param.device(), kHalf);
    st.buffers["exp_avg_sq"] = m16.to(param.device(), kHalf);
  }
  const Tensor g = randn({8}).to(kBFloat16);
  q.mutable_grad() = g.cuda();
  q_cpu.mutable_grad() = g;
  opt.step();
  ref.step();
  EXPECT_EQ(opt.state().at(q.impl()).buffers.at("exp_avg").dtype(), kBFloat16);
  expect_same_bits(q, q_cpu, "parameter");
  expect_same_bits(opt.state().at(q.impl()).buffers.at("exp_avg_sq"),
                   ref.state().at(q_cpu.impl()).buffers.at("exp_avg_sq"), "exp_avg_sq");
}

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

// --- The ops: adam_update_ and sgd_update_ -------------------------------------------------------

using Attrs = absl::InlinedVector<Attr, 4>;

// `values` in a fresh tensor of `dtype` on `device`: contiguous, or strided (transposed for 2-D,
// every other element of a larger buffer for 1-D).
Tensor op_layout(const Tensor& values, ScalarType dtype, Device device, bool strided) {
  const Tensor v = values.to(device, dtype, /*non_blocking=*/false, /*copy=*/true);
  if (!strided || v.numel() < 2) return v;
  if (v.dim() == 2) return v.t().contiguous().t();
  Tensor t = zeros({v.numel(), 2}, TensorOptions(dtype).device(device)).select(1, 0);
  t.copy_(v);
  return t;
}

// Lists of one tensor per shape (list k in dtypes[k], values abs() where positive[k]) on
// `device`; the same values for the same seed on every device.
std::vector<std::vector<Tensor>> op_lists(const std::vector<ScalarType>& dtypes,
                                          const std::vector<bool>& positive, Device device,
                                          bool strided, uint64_t seed) {
  manual_seed(seed);
  std::vector<std::vector<Tensor>> lists(dtypes.size());
  for (const Shape& s : std::vector<Shape>{{0}, {}, {7}, {33, 17}, {3 * 8192 + 5}, {150, 201}}) {
    for (size_t k = 0; k < dtypes.size(); ++k) {
      const Tensor v = positive[k] ? randn(s).abs() : randn(s);
      lists[k].push_back(op_layout(v, dtypes[k], device, strided));
    }
  }
  return lists;
}

TensorVec flatten(const std::vector<std::vector<Tensor>>& lists) {
  TensorVec in;
  for (const auto& l : lists) in.insert(in.end(), l.begin(), l.end());
  return in;
}

// How a GPU run is checked against the CPU one: bit for bit, or within a tolerance.
void expect_lists(const std::vector<std::vector<Tensor>>& gpu,
                  const std::vector<std::vector<Tensor>>& cpu, bool same_bits,
                  const std::string& what) {
  for (size_t k = 0; k < gpu.size(); ++k) {
    for (size_t i = 0; i < gpu[k].size(); ++i) {
      const std::string w = what + " list " + std::to_string(k) + " tensor " + std::to_string(i);
      if (same_bits) {
        expect_same_bits(gpu[k][i], cpu[k][i], w);
      } else {
        const ScalarType dt = cpu[k][i].dtype();
        // rtol, and an atol for the entries near zero (momentum buffers): the decomposition's
        // CUDA ops may contract a * b + c into one FMA where the CPU kernel rounds twice.
        const double tol = dt == kDouble ? 1e-12 : dt == kFloat ? 1e-5 : 1e-2;
        expect_close(gpu[k][i], cpu[k][i], tol, tol * 1e-1, w);
      }
    }
  }
}

struct OpCase {
  bool decoupled, amsgrad;
  double weight_decay, beta1;
};
const std::vector<OpCase> kOpCases = {
    {true, false, 0.1, 0.9}, {true, true, 0.1, 0.9},  {false, false, 0.05, 0.9},
    {false, true, 0.0, 0.9}, {true, false, 0.0, 0.2},
};

Attrs op_adam_attrs(const OpCase& c, int64_t n) {
  return {n, c.beta1, 0.95, 1e-8, c.weight_decay, c.decoupled, c.amsgrad};
}

// `inputs` followed by the step counts `steps` (Adam; none for SGD) and the lr: 0-d CPU tensors,
// whatever the device of the other inputs, or with `device_scalars` on the GPU.
TensorVec with_scalars(TensorVec inputs, const Shape& steps, double lr,
                       bool device_scalars = false) {
  const Device d = device_scalars ? test::kGpu : Device(kCPU);
  for (int64_t t : steps) inputs.push_back(scalar_tensor(t, kInt64).to(d));
  inputs.push_back(scalar_tensor(lr, kDouble).to(d));
  return inputs;
}

// Three steps of adam_update_ on GPU and CPU lists of the same values, the GPU through
// `gpu_path` ("multi_tensor" for the CUDA kernel, "" for the decomposition), the CPU through its
// fused kernel (or, for f64, its decomposition); parameter i is at step t + i.
// With `factor` (a 0-d CPU tensor), both calls take a gradient factor: the GPU one the factor on
// the GPU, or, with `host_factor`, the CPU tensor itself. With `device_scalars` the GPU call
// takes its lr and step counts on the GPU (capturable: the kernel reads them there) and the lr
// changes from step to step.
void run_adam_op(ScalarType dtype, ScalarType state, bool strided, const std::string& gpu_path,
                 bool same_bits, const Tensor& factor = Tensor(), bool host_factor = false,
                 bool device_scalars = false) {
  static const OpDef& op = KILN_OP(adam_update_);
  for (const OpCase& c : kOpCases) {
    std::vector<ScalarType> dtypes = {dtype, dtype, state, state};
    std::vector<bool> positive = {false, false, false, true};
    if (c.amsgrad) {
      dtypes.push_back(state);
      positive.push_back(true);
    }
    auto gpu = op_lists(dtypes, positive, test::kGpu, strided, 12);
    auto cpu = op_lists(dtypes, positive, Device(kCPU), strided, 12);
    const int64_t n = static_cast<int64_t>(cpu[0].size());
    for (int64_t t = 1; t <= 3; ++t) {
      manual_seed(40 + t);
      Shape steps;
      for (int64_t i = 0; i < n; ++i) {
        const Tensor g = randn(cpu[0][i].sizes()).to(dtype);
        cpu[1][i] = g;
        gpu[1][i] = g.cuda();
        steps.push_back(t + i);
      }
      const double lr = device_scalars ? 0.01 * static_cast<double>(t) + 0.003 : 0.02;
      TensorVec cpu_in = with_scalars(flatten(cpu), steps, lr);
      TensorVec gpu_in = with_scalars(flatten(gpu), steps, lr, device_scalars);
      if (factor.defined()) {
        cpu_in.push_back(factor);
        gpu_in.push_back(host_factor ? factor : factor.cuda());
      }
      if (dtype == kDouble) {
        call_op(op, cpu_in, op_adam_attrs(c, n));
      } else {
        call_op_with_kernel(op, "fused", cpu_in, op_adam_attrs(c, n));
      }
      if (gpu_path.empty()) {
        call_decomposition(op, gpu_in, op_adam_attrs(c, n));
      } else {
        call_op_with_kernel(op, gpu_path, gpu_in, op_adam_attrs(c, n));
      }
    }
    std::string what = std::string(dtype_name(dtype)) + " params, " +
                       std::string(dtype_name(state)) + " state" + (strided ? ", strided" : "") +
                       (c.decoupled ? ", AdamW" : ", Adam") + (c.amsgrad ? " amsgrad" : "") +
                       (device_scalars ? ", lr and steps on the GPU" : "");
    if (factor.defined()) {
      what += ", " + std::string(dtype_name(factor.dtype())) + (host_factor ? " CPU" : " GPU") +
              " grad factor";
    }
    expect_lists(gpu, cpu, same_bits, what);
  }
}

// The CUDA kernel gives the CPU kernel's bits, contiguous or strided (f32 copies).
TEST_F(GpuAdamUpdateOp, KernelMatchesCpuKernel) {
  for (bool strided : {false, true}) {
    run_adam_op(kFloat, kFloat, strided, "multi_tensor", true);
    run_adam_op(kBFloat16, kFloat, strided, "multi_tensor", true);
    run_adam_op(kBFloat16, kBFloat16, strided, "multi_tensor", true);
    run_adam_op(kHalf, kHalf, strided, "multi_tensor", true);
  }
  run_adam_op(kHalf, kFloat, false, "multi_tensor", true);
}

// Capturable calls: the lr and step counts on the GPU, read by the kernel, which derives the bias
// corrections on the device in f64 as the host does. The CPU kernel's bits at every step (with an
// lr that changes), contiguous and strided, with a GPU or CPU gradient factor; the f64
// decomposition reads them on the host.
TEST_F(GpuAdamUpdateOp, DeviceScalarsKernelMatchesCpuKernel) {
  for (bool strided : {false, true}) {
    run_adam_op(kFloat, kFloat, strided, "multi_tensor", true, Tensor(), false, true);
    run_adam_op(kBFloat16, kFloat, strided, "multi_tensor", true, Tensor(), false, true);
    run_adam_op(kBFloat16, kBFloat16, strided, "multi_tensor", true, Tensor(), false, true);
    run_adam_op(kHalf, kHalf, strided, "multi_tensor", true, Tensor(), false, true);
  }
  const Tensor f = scalar_tensor(0.37, kDouble);
  run_adam_op(kBFloat16, kFloat, false, "multi_tensor", true, f, false, true);
  run_adam_op(kFloat, kFloat, true, "multi_tensor", true, f, true, true);
  run_adam_op(kDouble, kDouble, false, "", false, Tensor(), false, true);
}

// Many step counts (more than one launch's table) and counts in the billions: the device
// derivation's bias corrections equal the host's over a range of steps.
TEST_F(GpuAdamUpdateOp, DeviceScalarsOverManySteps) {
  static const OpDef& op = KILN_OP(adam_update_);
  for (const OpCase& c : kOpCases) {
    auto gpu = op_lists({kFloat, kFloat, kFloat, kFloat}, {false, false, false, true}, test::kGpu,
                        false, 14);
    auto cpu = op_lists({kFloat, kFloat, kFloat, kFloat}, {false, false, false, true}, Device(kCPU),
                        false, 14);
    const int64_t n = static_cast<int64_t>(cpu[0].size());
    for (int64_t base :
         {int64_t{1}, int64_t{97}, int64_t{1000}, int64_t{123456}, int64_t{3000000000}}) {
      Shape steps;
      for (int64_t i = 0; i < n; ++i) steps.push_back(base + 7 * i);
      call_op_with_kernel(op, "fused", with_scalars(flatten(cpu), steps, 3e-4),
                          {n, c.beta1, 0.95, 1e-8, c.weight_decay, c.decoupled, false});
      call_op_with_kernel(op, "multi_tensor", with_scalars(flatten(gpu), steps, 3e-4, true),
                          {n, c.beta1, 0.95, 1e-8, c.weight_decay, c.decoupled, false});
      expect_lists(gpu, cpu, true, "steps from " + std::to_string(base));
    }
  }
}

// increment_ on the GPU: one kernel for a call's counts, several launches past 480 of them.
TEST_F(GpuAdamUpdateOp, IncrementOnTheGpu) {
  std::vector<Tensor> counts;
  for (int64_t i = 0; i < 1000; ++i) counts.push_back(scalar_tensor(i, kInt64).cuda());
  increment_(counts);
  increment_({counts[3]});
  for (int64_t i = 0; i < 1000; ++i) {
    EXPECT_EQ(counts[static_cast<size_t>(i)].item<int64_t>(), i + 1 + (i == 3 ? 1 : 0)) << i;
  }
}

// The decomposition on the GPU (kiln's CUDA elementwise ops, which may contract a * b + c into an
// FMA) computes the same update.
TEST_F(GpuAdamUpdateOp, DecompositionMatchesCpuKernel) {
  run_adam_op(kFloat, kFloat, false, "", false);
  run_adam_op(kFloat, kFloat, true, "", false);
  run_adam_op(kBFloat16, kFloat, false, "", false);
  run_adam_op(kBFloat16, kBFloat16, true, "", false);
}

// With a gradient factor (clipping's coefficient folded into the update): the CUDA kernel, reading
// a GPU factor on the device or a CPU one from its arguments, gives the CPU kernel's bits, for
// f64, f32 and bf16 factors, contiguous and strided (the f32 copies take pre-multiplied grads).
TEST_F(GpuAdamUpdateOp, GradFactorKernelMatchesCpuKernel) {
  for (ScalarType fd : {kDouble, kFloat, kBFloat16}) {
    const Tensor f = scalar_tensor(0.37, kDouble).to(fd);
    for (bool strided : {false, true}) {
      run_adam_op(kFloat, kFloat, strided, "multi_tensor", true, f);
      run_adam_op(kBFloat16, kFloat, strided, "multi_tensor", true, f);
      run_adam_op(kBFloat16, kBFloat16, strided, "multi_tensor", true, f);
      run_adam_op(kHalf, kHalf, strided, "multi_tensor", true, f);
    }
    run_adam_op(kBFloat16, kFloat, false, "multi_tensor", true, f, /*host_factor=*/true);
    run_adam_op(kFloat, kFloat, true, "multi_tensor", true, f, /*host_factor=*/true);
  }
  // The decomposition on the GPU (possibly FMA-contracted) and f64 (decomposition only).
  const Tensor f = scalar_tensor(0.37, kDouble);
  run_adam_op(kBFloat16, kFloat, false, "", false, f);
  run_adam_op(kDouble, kDouble, false, "", false, f);
}

// The grads are read, not written; the factor must be on the parameters' device or the CPU.
TEST_F(GpuAdamUpdateOp, GradFactorLeavesTheGradsAndChecksItsDevice) {
  const TensorOptions gpu = TensorOptions(kBFloat16).device(test::kGpu);
  Tensor p = randn({1000}).to(gpu), g = randn({1000}).to(gpu);
  Tensor m = zeros({1000}, TensorOptions(kFloat).device(test::kGpu)), v = m.clone();
  const Tensor g0 = g.clone();
  const Tensor step = scalar_tensor(int64_t{1}, kInt64), lr = scalar_tensor(0.1, kDouble);
  adam_update_({p}, {g}, {m}, {v}, {}, {step}, lr, 0.9, 0.999, 0, 1e-8, false, true,
               scalar_tensor(0.25, kDouble).cuda());
  EXPECT_TRUE(equal(g.cpu(), g0.cpu()));
  const Tensor pc = zeros({4});
  EXPECT_KILN_ERROR(
      adam_update_({pc}, {pc.clone()}, {pc.clone()}, {pc.clone()}, {}, {step}, lr, 0.9, 0.999, 0,
                   1e-8, false, true, scalar_tensor(0.25, kDouble).cuda()),
      "[adam_update_]");
}

// f64 has no CUDA kernel: the op runs its decomposition, as on the CPU.
TEST_F(GpuAdamUpdateOp, F64RunsTheDecomposition) {
  static const OpDef& op = KILN_OP(adam_update_);
  const Tensor p = zeros({4}, TensorOptions(kDouble).device(test::kGpu));
  EXPECT_KILN_ERROR(call_op_with_kernel(op, "multi_tensor", with_scalars({p, p, p, p}, {1}, 0.02),
                                        op_adam_attrs(kOpCases[0], 1)),
                    "[adam_update_] the cuda kernel 'multi_tensor' does not support this call");
  run_adam_op(kDouble, kDouble, false, "", false);
}

TEST_F(GpuAdamUpdateOp, OneDevicePerCall) {
  const Tensor p = zeros({4}, TensorOptions(kFloat).device(test::kGpu));
  const Tensor g = zeros({4});
  const Tensor step = scalar_tensor(int64_t{1}, kInt64), lr = scalar_tensor(0.1, kDouble);
  EXPECT_KILN_ERROR(adam_update_({p}, {g}, {p.clone()}, {p.clone()}, {}, {step}, lr, 0.9, 0.999, 0,
                                 1e-8, false, true),
                    "[adam_update_] expected all tensors on the same device");
  // The step counts and the lr: all on the host or all on the parameters' GPU, never split.
  adam_update_({p}, {p.clone()}, {p.clone()}, {p.clone()}, {}, {step.cuda()}, lr.cuda(), 0.9, 0.999,
               0, 1e-8, false, true);
  EXPECT_KILN_ERROR(adam_update_({p}, {p.clone()}, {p.clone()}, {p.clone()}, {}, {step.cuda()}, lr,
                                 0.9, 0.999, 0, 1e-8, false, true),
                    "[adam_update_] state_steps[0] must be a 0-d int64 CPU tensor");
  EXPECT_KILN_ERROR(adam_update_({p}, {p.clone()}, {p.clone()}, {p.clone()}, {}, {step}, lr.cuda(),
                                 0.9, 0.999, 0, 1e-8, false, true),
                    "[adam_update_] state_steps[0] must be a 0-d int64 tensor on cuda:0");
}

// sgd_update_ has no CUDA kernel: on the GPU it runs its decomposition.
TEST_F(GpuSgdUpdateOp, DecompositionMatchesCpuKernel) {
  static const OpDef& op = KILN_OP(sgd_update_);
  struct C {
    double momentum, dampening, weight_decay;
    bool nesterov;
  };
  for (const C& c :
       std::vector<C>{{0, 0, 0.1, false}, {0.9, 0.25, 0.01, false}, {0.9, 0, 0.01, true}}) {
    for (ScalarType dtype : {kFloat, kBFloat16}) {
      const bool momentum = c.momentum != 0;
      std::vector<ScalarType> dtypes = {dtype, dtype};
      if (momentum) dtypes.push_back(kFloat);
      const std::vector<bool> positive(dtypes.size(), false);
      auto gpu = op_lists(dtypes, positive, test::kGpu, false, 13);
      auto cpu = op_lists(dtypes, positive, Device(kCPU), false, 13);
      const int64_t n = static_cast<int64_t>(cpu[0].size());
      for (int64_t t = 1; t <= 3; ++t) {
        manual_seed(60 + t);
        Shape fresh;
        for (int64_t i = 0; i < n; ++i) {
          const Tensor g = randn(cpu[0][i].sizes()).to(dtype);
          cpu[1][i] = g;
          gpu[1][i] = g.cuda();
          if (momentum) fresh.push_back(t == 1 ? 1 : 0);
        }
        const Attrs attrs = {n, c.momentum, c.dampening, c.weight_decay, c.nesterov, fresh};
        call_op_with_kernel(op, "fused", with_scalars(flatten(cpu), {}, 0.05), attrs);
        call_op(op, with_scalars(flatten(gpu), {}, 0.05), attrs);
      }
      expect_lists(gpu, cpu, false,
                   "SGD " + std::string(dtype_name(dtype)) + " momentum " +
                       std::to_string(c.momentum) + (c.nesterov ? " nesterov" : ""));
    }
  }
}

}  // namespace
}  // namespace kiln
