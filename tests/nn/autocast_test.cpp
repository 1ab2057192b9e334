// Autocast (nn/autocast.h) on the CPU, as torch.autocast("cpu", torch.bfloat16): result dtypes
// inside and outside guards, nesting, disabled guards, gradients reaching f32 parameters, a
// small model's loss against f32; and bf16-true training (bf16 parameters, f32 AdamW state).
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <cmath>
#include <string_view>
#include <thread>
#include <vector>

#include "tensor/registry.h"
#include "test_util.h"

namespace kiln {
namespace {

namespace F = nn::functional;

TEST(Autocast, DtypesInsideAndOutside) {
  manual_seed(0);
  const Tensor a = randn({5, 7}), b = randn({7, 3}), bias = randn({3});
  const Tensor batch = randn({2, 5, 7}), batch2 = randn({2, 7, 4});
  EXPECT_FALSE(is_autocast_enabled(kCPU));
  {
    AutocastGuard guard(kCPU, kBFloat16);
    EXPECT_TRUE(is_autocast_enabled(kCPU));
    EXPECT_FALSE(is_autocast_enabled(kCUDA));
    EXPECT_EQ(autocast_dtype(kCPU), kBFloat16);
    // Lower precision: the matmul family.
    EXPECT_EQ(mm(a, b).dtype(), kBFloat16);
    EXPECT_EQ(matmul(a, b).dtype(), kBFloat16);
    EXPECT_EQ(bmm(batch, batch2).dtype(), kBFloat16);
    EXPECT_EQ(addmm(bias, a, b).dtype(), kBFloat16);
    EXPECT_EQ(F::linear(a, b.t(), bias).dtype(), kBFloat16);
    const Tensor low = mm(a, b);
    // Mixed operands (a bf16 activation, f32 weights) are cast alike.
    EXPECT_EQ(matmul(low.t(), zeros({5, 2})).dtype(), kBFloat16);
    EXPECT_EQ(F::linear(low, zeros({2, 3}), zeros({2})).dtype(), kBFloat16);
    EXPECT_EQ(F::linear(batch.to(kBFloat16), b.t()).dtype(), kBFloat16);
    // f32: softmax, reductions, lossy pointwise ops, norms, losses.
    EXPECT_EQ(softmax(low, 1).dtype(), kFloat32);
    EXPECT_EQ(log_softmax(low, 1).dtype(), kFloat32);
    EXPECT_EQ(low.sum().dtype(), kFloat32);
    EXPECT_EQ(low.mean().dtype(), kFloat32);
    EXPECT_EQ(low.exp().dtype(), kFloat32);
    EXPECT_EQ(F::layer_norm(low, {3}, Tensor(), Tensor(), 1e-5).dtype(), kFloat32);
    EXPECT_EQ(F::rms_norm(low, {3}, Tensor(), 1e-6).dtype(), kFloat32);
    const Tensor target = tensor({0, 2, 1, 1, 0}, kInt64);
    EXPECT_EQ(F::cross_entropy(low, target).dtype(), kFloat32);
    EXPECT_EQ(F::mse_loss(low, zeros({5, 3})).dtype(), kFloat32);
    // Other ops run on their inputs' types; binary ops promote.
    EXPECT_EQ(low.relu().dtype(), kBFloat16);
    EXPECT_EQ((low + zeros({5, 3})).dtype(), kFloat32);
    EXPECT_EQ((low * 2.0).dtype(), kBFloat16);
    // Promote: cat of bf16 and f32 is f32.
    EXPECT_EQ(cat({low, zeros({5, 3})}, 0).dtype(), kFloat32);
    // An explicit dtype wins; f64 and integers are never cast.
    EXPECT_EQ(softmax(low, 1, kBFloat16).dtype(), kBFloat16);
    EXPECT_EQ(mm(a.to(kDouble), b.to(kDouble)).dtype(), kDouble);
    EXPECT_EQ(tensor({1, 2}, kInt64).sum().dtype(), kInt64);
  }
  EXPECT_FALSE(is_autocast_enabled(kCPU));
  EXPECT_EQ(mm(a, b).dtype(), kFloat32);
  EXPECT_EQ(mm(a, b).to(kBFloat16).sum().dtype(), kBFloat16);
}

TEST(Autocast, ValuesAreTheCastInputs) {
  manual_seed(1);
  const Tensor a = randn({6, 9}), b = randn({9, 4});
  Tensor inside;
  {
    AutocastGuard guard(kCPU, kBFloat16);
    inside = mm(a, b);
  }
  const Tensor expected = mm(a.to(kBFloat16), b.to(kBFloat16));
  EXPECT_TRUE(equal(inside, expected));
  {
    AutocastGuard guard(kCPU, kHalf);
    EXPECT_TRUE(equal(mm(a, b), mm(a.to(kHalf), b.to(kHalf))));
  }
}

TEST(Autocast, GuardsNestAndRestore) {
  const Tensor a = randn({4, 4});
  AutocastGuard outer(kCPU, kBFloat16);
  EXPECT_EQ(mm(a, a).dtype(), kBFloat16);
  {
    AutocastGuard inner(kCPU, kHalf);
    EXPECT_EQ(mm(a, a).dtype(), kHalf);
    {
      AutocastGuard off(kCPU, kBFloat16, /*enabled=*/false);
      EXPECT_FALSE(is_autocast_enabled(kCPU));
      EXPECT_EQ(mm(a, a).dtype(), kFloat32);
    }
    EXPECT_TRUE(is_autocast_enabled(kCPU));
    EXPECT_EQ(mm(a, a).dtype(), kHalf);
  }
  EXPECT_EQ(autocast_dtype(kCPU), kBFloat16);
  EXPECT_EQ(mm(a, a).dtype(), kBFloat16);
}

TEST(Autocast, DisabledGuardAndOtherDevicesChangeNothing) {
  const Tensor a = randn({4, 4});
  {
    AutocastGuard guard(kCPU, kBFloat16, /*enabled=*/false);
    EXPECT_FALSE(is_autocast_enabled(kCPU));
    EXPECT_EQ(mm(a, a).dtype(), kFloat32);
  }
  {
    AutocastGuard guard(kCUDA, kBFloat16);  // CPU tensors are not affected
    EXPECT_TRUE(is_autocast_enabled(kCUDA));
    EXPECT_FALSE(is_autocast_enabled(kCPU));
    EXPECT_EQ(mm(a, a).dtype(), kFloat32);
  }
  EXPECT_FALSE(is_autocast_enabled(kCUDA));
}

TEST(Autocast, ThreadLocal) {
  AutocastGuard guard(kCPU, kBFloat16);
  bool other_enabled = true;
  ScalarType other_dtype = kBFloat16;
  std::thread t([&] {
    other_enabled = is_autocast_enabled(kCPU);
    other_dtype = mm(ones({2, 2}), ones({2, 2})).dtype();
  });
  t.join();
  EXPECT_FALSE(other_enabled);
  EXPECT_EQ(other_dtype, kFloat32);
  EXPECT_EQ(mm(ones({2, 2}), ones({2, 2})).dtype(), kBFloat16);
}

TEST(Autocast, RejectsBadArguments) {
  EXPECT_KILN_ERROR(AutocastGuard(kCPU, kFloat32), "[autocast]");
  EXPECT_KILN_ERROR(AutocastGuard(DeviceType::Meta, kBFloat16), "[autocast]");
}

// Every op the policy table names is a defined op: the table resolves (a misspelled name would
// make every enabled guard throw, naming the op).
TEST(Autocast, PolicyTableNamesDefinedOps) {
  const std::vector<std::string_view> ops = internal::autocast_policy_ops();
  ASSERT_FALSE(ops.empty());
  for (std::string_view op : ops) {
    const OpDef& def = Registry::get().op(op);
    EXPECT_NE(def.meta, nullptr) << op;
  }
  EXPECT_EQ(internal::resolved_autocast_policies(), ops.size());
}

TEST(Autocast, GradientsReachF32Parameters) {
  manual_seed(2);
  nn::Linear fc1(8, 16), fc2(16, 4);
  const Tensor x = randn({10, 8});
  const Tensor target = tensor({0, 1, 2, 3, 0, 1, 2, 3, 0, 1}, kInt64);
  auto loss_of = [&] { return F::cross_entropy(fc2->forward(fc1->forward(x).relu()), target); };
  Tensor loss;
  {
    AutocastGuard guard(kCPU, kBFloat16);
    loss = loss_of();
  }
  EXPECT_EQ(loss.dtype(), kFloat32);
  loss.backward();
  std::vector<Tensor> params = fc1->parameters();
  for (const Tensor& p : fc2->parameters()) params.push_back(p);
  std::vector<Tensor> mixed;
  for (Tensor& p : params) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.dtype(), kFloat32);
    EXPECT_EQ(p.grad().dtype(), kFloat32);
    mixed.push_back(p.grad().clone());
    p.mutable_grad() = Tensor();
  }
  loss_of().backward();  // the same in f32
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor ref = params[i].grad();
    const double scale = ref.abs().max().item<double>();
    const double err = (mixed[i] - ref).abs().max().item<double>();
    EXPECT_LE(err, 3e-2 * scale + 1e-4) << "parameter " << i;
  }
}

// A small MLP with a LayerNorm trains under autocast; its loss stays close to the f32 loss.
TEST(Autocast, SmallModelLossCloseToF32) {
  manual_seed(3);
  nn::Sequential net(nn::Linear(16, 32), nn::LayerNorm(nn::LayerNormOptions({32})), nn::GELU(),
                     nn::Linear(32, 5));
  const Tensor x = randn({64, 16});
  const Tensor target = randint(0, 5, {64});
  optim::AdamW opt(net->parameters(), optim::AdamWOptions(2e-2));
  double first = 0, last = 0;
  for (int step = 0; step < 40; ++step) {
    Tensor mixed, full;
    {
      AutocastGuard guard(kCPU, kBFloat16);
      mixed = F::cross_entropy(net->forward(x), target);
    }
    {
      NoGradGuard no_grad;
      full = F::cross_entropy(net->forward(x), target);
    }
    const double m = mixed.item<double>(), f = full.item<double>();
    EXPECT_NEAR(m, f, 5e-2 * std::abs(f) + 5e-3) << "step " << step;
    if (step == 0) first = m;
    last = m;
    opt.zero_grad();
    mixed.backward();
    opt.step();
  }
  EXPECT_LT(last, 0.7 * first);
  for (const Tensor& p : net->parameters()) EXPECT_EQ(p.dtype(), kFloat32);
}

// bf16-true: every parameter bf16, no autocast; AdamW keeps f32 moments and the model learns.
TEST(Bf16True, ModuleTrainsWithAdamWAndF32State) {
  manual_seed(4);
  nn::Sequential net(nn::Linear(16, 32), nn::GELU(), nn::Linear(32, 5));
  net->to(kBFloat16);
  for (const Tensor& p : net->parameters()) ASSERT_EQ(p.dtype(), kBFloat16);
  const Tensor x = randn({64, 16}).to(kBFloat16);
  const Tensor target = randint(0, 5, {64});
  optim::AdamW opt(net->parameters(), optim::AdamWOptions(2e-2));
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    Tensor loss = F::cross_entropy(net->forward(x), target);
    if (step == 0) first = loss.item<double>();
    last = loss.item<double>();
    opt.zero_grad();
    loss.backward();
    for (const Tensor& p : net->parameters()) ASSERT_EQ(p.grad().dtype(), kBFloat16);
    opt.step();
  }
  EXPECT_LT(last, 0.6 * first);
  for (const Tensor& p : net->parameters()) {
    EXPECT_EQ(p.dtype(), kBFloat16);
    const auto& bufs = opt.state().at(p.impl()).buffers;
    EXPECT_EQ(bufs.at("exp_avg").dtype(), kFloat32);
    EXPECT_EQ(bufs.at("exp_avg_sq").dtype(), kFloat32);
  }
}

// The same guard on CUDA tensors (skips without a GPU).
TEST(GpuAutocast, CudaOpsFollowTheGuard) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  manual_seed(5);
  const Tensor a = randn({33, 65}), b = randn({65, 17});
  const Tensor ga = a.cuda(), gb = b.cuda();
  AutocastGuard guard(kCUDA, kBFloat16);
  const Tensor low = mm(ga, gb);
  EXPECT_EQ(low.dtype(), kBFloat16);
  EXPECT_TRUE(low.is_cuda());
  EXPECT_TRUE(allclose(low.cpu().to(kFloat), mm(a, b), 2e-2, 5e-2));
  EXPECT_EQ(softmax(low, 1).dtype(), kFloat32);
  EXPECT_EQ(low.sum().dtype(), kFloat32);
  EXPECT_EQ(F::layer_norm(low, {17}, Tensor(), Tensor(), 1e-5).dtype(), kFloat32);
  EXPECT_EQ(mm(a, b).dtype(), kFloat32);  // CPU ops are not under the CUDA guard
}

}  // namespace
}  // namespace kiln
