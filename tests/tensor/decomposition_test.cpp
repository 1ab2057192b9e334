// The registry's kernel choice and decompositions (tensor/registry.h) on the CPU: every fused
// op's decomposition against its CPU kernel, forward and gradients (decomposition_cases.h); calls
// no kernel supports running the decomposition, with gradients through its ops; support rules,
// preference order, forced kernels and their errors; in-place ops that write several inputs.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "autograd/engine.h"
#include "decomposition_cases.h"
#include "nn/functional.h"
#include "tensor/ops.h"
#include "tensor/registry.h"
#include "test_util.h"

namespace kiln {
namespace {

namespace F = nn::functional;

TEST(Decomposition, EveryFusedOpRegistersOne) {
  for (const char* name :
       {"rms_norm", "layer_norm", "rotary_emb", "rotary_emb_qk", "split_qkv_rotary",
        "merge_qkv_rotary", "swiglu", "geglu_tanh", "cross_entropy_fused", "flash_attention",
        "adam_update_", "sgd_update_", "lstm_cell_fused", "gru_cell_fused"}) {
    EXPECT_NE(Registry::get().op(name).decomposition, nullptr) << name;
  }
}

TEST(Decomposition, MatchesTheCpuKernels) {
  manual_seed(1);
  for (ScalarType dtype : {kFloat, kDouble, kBFloat16}) {
    for (const test::FusedCase& c : test::fused_cases(dtype)) {
      test::expect_decomposition_matches(c, "fused", Device(kCPU));
    }
  }
}

TEST(Decomposition, AttentionMatchesTheCpuReference) {
  manual_seed(2);
  for (ScalarType dtype : {kFloat, kDouble}) {
    for (const test::FusedCase& c : test::attention_cases(dtype, 16)) {
      test::expect_decomposition_matches(c, "blocked", Device(kCPU));
    }
  }
}

// Calls outside every kernel's support rule run the decomposition, and autograd differentiates
// its ops: the result is the decomposition's, and gradients reach the inputs.
TEST(Decomposition, RunsWhereNoKernelSupportsTheCall) {
  manual_seed(3);
  // rms_norm without a weight, and with a bf16 weight for an f32 input.
  Tensor x = randn({4, 8}).requires_grad_(true);
  const Tensor y = F::rms_norm(x, {8}, Tensor(), 1e-6);
  const Tensor ref = x / (x.square().mean({-1}, true) + 1e-6).sqrt();
  EXPECT_LE(test::scaled_error(y, ref), 1e-6);
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_EQ(y.grad_fn()->name().find("RmsNorm"), std::string::npos) << y.grad_fn()->name();
  y.sum().backward();
  EXPECT_TRUE(x.grad().defined());
  const Tensor wb = randn({8}).to(kBFloat16);
  EXPECT_LE(test::scaled_error(kiln::rms_norm(x.detach(), wb, 1e-6), ref.detach() * wb.to(kFloat)),
            1e-5);

  // Rotary tables per batch ([B, 1, T, D]) and attention with a mask or dropout.
  const Tensor q = randn({2, 3, 5, 8});
  const Tensor cos = randn({2, 1, 5, 8}), sin = randn({2, 1, 5, 8});
  const Tensor r = kiln::rotary_emb(q, cos, sin);
  const Tensor rotated = cat({-q.narrow(-1, 4, 4), q.narrow(-1, 0, 4)}, -1);
  EXPECT_LE(test::scaled_error(r, q * cos + rotated * sin), 1e-6);

  const Tensor k = randn({2, 3, 6, 8}), v = randn({2, 3, 6, 8});
  const Tensor mask = randn({5, 6}) > Scalar(0.0);
  const Tensor out = F::scaled_dot_product_attention(q, k, v, mask);
  const Tensor scores = q.matmul(k.transpose(-2, -1)) / std::sqrt(8.0);
  const Tensor dead = mask.logical_not().all({-1}, /*keepdim=*/true);
  const Tensor probs = kiln::where(
      dead, Scalar(0.0),
      softmax(kiln::where(mask, scores, Scalar(-std::numeric_limits<double>::infinity())), -1));
  EXPECT_LE(test::scaled_error(out, kiln::where(dead, Scalar(0.0), probs).matmul(v)), 1e-5);

  // Cross-entropy with class weights, smoothing and every reduction, against the composite of
  // log_softmax and nll_loss.
  const Tensor logits = randn({6, 5, 3});
  const Tensor targets = randint(0, 5, {6, 3});
  const Tensor weight = rand({5}) + 0.5;
  for (nn::Reduction reduction : {kiln::kMean, kiln::kSum, kiln::kNone}) {
    const Tensor got = F::cross_entropy(
        logits, targets, F::CrossEntropyFuncOptions().weight(weight).reduction(reduction));
    const Tensor want = F::nll_loss(log_softmax(logits, 1), targets,
                                    F::NLLLossFuncOptions().weight(weight).reduction(reduction));
    EXPECT_LE(test::scaled_error(got, want), 1e-6);
  }
}

// A test op with two CPU kernels and a decomposition: y = 2 x. Kernel "even" runs calls with an
// even numel, "any" runs calls of up to 100 elements; larger odd calls run the decomposition.
// Each kernel marks which ran by the constant it adds (0 for "even", 0 for "any" too, but counted).
int g_even_runs = 0;
int g_any_runs = 0;

SpecList test_double_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 1 && c.input(0).defined(), "[test_double] expected one input");
  return {{to_shape(c.input(0).sizes()), c.input(0).dtype(), c.input(0).device()}};
}
void test_double_even(OpCall& c) {
  ++g_even_runs;
  c.outputs[0].copy_(c.input(0) * 2.0);
}
void test_double_any(OpCall& c) {
  ++g_any_runs;
  c.outputs[0].copy_(c.input(0) * 2.0);
}
bool even_numel(const OpCall& c) { return c.input(0).numel() % 2 == 0; }
bool small_numel(const OpCall& c) { return c.input(0).numel() <= 100; }
TensorVec test_double_decomposition(const OpCall& c) { return {c.input(0) * 2.0}; }

KILN_DEFINE_OP(test_double, OpKind::kFunctional, test_double_meta);
KILN_REGISTER_DECOMPOSITION(test_double, test_double_decomposition);
// Registered in the opposite order of their priorities: priority decides.
KILN_REGISTER_KERNEL_IF(test_double, kCPU, "any", test_double_any, small_numel, 1);
KILN_REGISTER_KERNEL_IF(test_double, kCPU, "even", test_double_even, even_numel, 0);

TEST(KernelChoice, SupportRulesAndPriorities) {
  static const OpDef& op = KILN_OP(test_double);
  ASSERT_EQ(op.kernels[static_cast<int>(kCPU)].size(), 2u);
  EXPECT_EQ(op.kernels[static_cast<int>(kCPU)][0].name, "even");
  g_even_runs = g_any_runs = 0;
  (void)call_op1(op, {ones({4})});  // even: the first kernel
  EXPECT_EQ(g_even_runs, 1);
  (void)call_op1(op, {ones({5})});  // odd and small: the second
  EXPECT_EQ(g_any_runs, 1);
  const Tensor big = arange(101, TensorOptions(kFloat));  // odd and large: the decomposition
  const Tensor y = call_op1(op, {big});
  EXPECT_EQ(g_even_runs + g_any_runs, 2);
  EXPECT_TRUE(equal(y, big * 2.0));
  // Gradients through the decomposition's ops (the op itself has no backward rule).
  Tensor x = arange(101, TensorOptions(kFloat)).requires_grad_(true);
  call_op1(op, {x}).sum().backward();
  EXPECT_TRUE(equal(x.grad(), full({101}, 2.0)));
}

TEST(KernelChoice, PreferenceOrderAndForcedKernels) {
  static const OpDef& op = KILN_OP(test_double);
  Registry::get().set_kernel_order("test_double", kCPU, {"any"});
  g_even_runs = g_any_runs = 0;
  (void)call_op1(op, {ones({4})});
  EXPECT_EQ(g_any_runs, 1);
  Registry::get().set_kernel_order("test_double", kCPU, {"even", "any"});
  (void)call_op_with_kernel(op, "any", {ones({4})});
  EXPECT_EQ(g_any_runs, 2);
  EXPECT_EQ(g_even_runs, 0);
  EXPECT_KILN_ERROR(call_op_with_kernel(op, "even", {ones({3})}),
                    "kernel 'even' does not support this call");
  EXPECT_KILN_ERROR(call_op_with_kernel(op, "nope", {ones({3})}), "no cpu kernel named 'nope'");
  EXPECT_KILN_ERROR(Registry::get().set_kernel_order("test_double", kCPU, {"nope"}),
                    "no cpu kernel named 'nope'");
  EXPECT_KILN_ERROR(call_decomposition(KILN_OP(add), {ones({1}), ones({1})}),
                    "[add] has no decomposition");
  // The meta rule's checks come before any kernel or decomposition.
  EXPECT_KILN_ERROR(call_op1(op, {Tensor()}), "[test_double] expected one input");
}

// An in-place op writing its first two inputs: both are outputs and both versions move.
SpecList test_swap_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 2 && c.input(0).sizes() == c.input(1).sizes(),
             "[test_swap_] expected two tensors of one shape");
  return {};
}
void test_swap_mutated(const OpCall& c, TensorVec& mutated) {
  mutated.push_back(c.input(0));
  mutated.push_back(c.input(1));
}
void test_swap_cpu(OpCall& c) {
  const Tensor a = c.input(0).clone();
  c.inputs[0].copy_(c.input(1));
  c.inputs[1].copy_(a);
}
KILN_DEFINE_OP(test_swap_, OpKind::kInplace, test_swap_meta, OpFlags{.mutated = test_swap_mutated});
KILN_REGISTER_KERNEL(test_swap_, kCPU, test_swap_cpu);

TEST(KernelChoice, InplaceOpsWriteSeveralInputs) {
  Tensor a = zeros({3}), b = ones({3});
  const int64_t va = a.impl()->version(), vb = b.impl()->version();
  const TensorVec out = call_op(KILN_OP(test_swap_), {a, b});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(out[0].is_same(a));
  EXPECT_TRUE(out[1].is_same(b));
  EXPECT_TRUE(equal(a, ones({3})));
  EXPECT_TRUE(equal(b, zeros({3})));
  EXPECT_GT(a.impl()->version(), va);
  EXPECT_GT(b.impl()->version(), vb);
}

}  // namespace
}  // namespace kiln
