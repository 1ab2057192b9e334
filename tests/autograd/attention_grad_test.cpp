// flash_attention's backward rule (autograd/attention_backward.cpp) and the dlse it passes to
// flash_attention_backward: undefined when lse received no gradient (the engine's zeros, told
// apart by autograd::internal::is_absent_grad), defined when lse is part of the loss. A test-only
// hook wraps the op's CPU kernel to see what each call got; gradchecks cover both outputs.
// (The gradchecks of out and out + lse: fused_grad_test.cpp, FusedGradTest.FlashAttention.)
#include <cmath>
#include <vector>

#include "grad_test_util.h"
#include "nn/functional.h"

namespace kiln {
namespace {

using gradtest::check_grad;
using gradtest::leaf;
using gradtest::variable_list;

namespace F = nn::functional;

// While alive, records for every CPU call of flash_attention_backward whether its dlse (input 6)
// was defined, by wrapping the op's CPU kernel (restored on destruction; tests are one thread).
class DlseRecorder {
 public:
  DlseRecorder() : kernel_(cpu_kernel()) {
    original_ = kernel_.fn;
    kernel_.fn = &record;
    calls().clear();
  }
  ~DlseRecorder() { kernel_.fn = original_; }
  DlseRecorder(const DlseRecorder&) = delete;
  DlseRecorder& operator=(const DlseRecorder&) = delete;

  // One entry per call: whether dlse was defined.
  static std::vector<bool>& calls() {
    static std::vector<bool> seen;
    return seen;
  }

 private:
  static KernelDef& cpu_kernel() {
    KernelList& cpu =
        Registry::get().entry("flash_attention_backward").kernels[static_cast<int>(kCPU)];
    EXPECT_EQ(cpu.size(), 1u);
    return cpu.front();
  }
  static void record(OpCall& c) {
    calls().push_back(c.input(6).defined());
    original_(c);
  }

  KernelDef& kernel_;
  static inline KernelFn original_ = nullptr;
};

// Training's case: only out reaches the loss, so lse's gradient is absent and the rule passes an
// undefined dlse; the gradients are those of the composite.
TEST(AttentionGradTest, SdpaBackwardPassesAnUndefinedDlse) {
  manual_seed(71);
  const Tensor q = leaf({2, 4, 6, 8}), k = leaf({2, 2, 6, 8}), v = leaf({2, 2, 6, 8});
  const Tensor dy = randn({2, 4, 6, 8}, kDouble);
  variable_list got;
  {
    DlseRecorder recorder;
    const Tensor y = F::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true,
                                                     std::nullopt, /*enable_gqa=*/true);
    got = autograd::grad({y}, {q, k, v}, {dy});
    EXPECT_EQ(DlseRecorder::calls(), std::vector<bool>{false}) << "one call, without dlse";
  }
  // The same gradients from the op with explicit zeros for dlse (bitwise: zeros are zeros).
  const auto [out, lse] = flash_attention(q.detach(), k.detach(), v.detach(), 1.0 / std::sqrt(8.0),
                                          /*causal=*/true);
  const TensorVec want =
      call_op(KILN_OP(flash_attention_backward),
              {dy, q.detach(), k.detach(), v.detach(), out, lse, zeros(lse.sizes(), kDouble)},
              {1.0 / std::sqrt(8.0), true, int64_t{0}, 0.0});
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(equal(got[i], want[i])) << "input " << i;
}

// lse in the loss: its gradient arrives and the rule passes it on (a defined dlse), out's alone
// or with lse's; a gradient that is explicitly zero is a gradient, not an absent one.
TEST(AttentionGradTest, LseInTheLossPassesItsGradient) {
  manual_seed(72);
  const Tensor q = leaf({1, 2, 5, 4}), k = leaf({1, 2, 5, 4}), v = leaf({1, 2, 5, 4});
  DlseRecorder recorder;
  {
    auto [out, lse] = flash_attention(q, k, v, 0.5, true);
    (out.sum() + lse.sum()).backward();
  }
  {
    auto [out, lse] = flash_attention(q, k, v, 0.5, true);
    lse.sum().backward();  // out's gradient is the absent one: zeros, dlse defined
  }
  {
    auto [out, lse] = flash_attention(q, k, v, 0.5, true);
    (void)autograd::grad({out, lse}, {q}, {ones_like(out), zeros_like(lse)});
  }
  EXPECT_EQ(DlseRecorder::calls(), (std::vector<bool>{true, true, true}));
}

// The lse used in the loss still gives the right gradient, alone (out's gradient absent) and with
// out, over GQA, causal, a window and softcap.
TEST(AttentionGradTest, GradcheckThroughLse) {
  manual_seed(73);
  const Tensor q = leaf({1, 4, 5, 3}, 0.8), k = leaf({1, 2, 4, 3}, 0.8), v = leaf({1, 2, 4, 3});
  EXPECT_TRUE(check_grad({"flash_attention"},
                         [](const variable_list& in) {
                           return std::get<1>(flash_attention(in[0], in[1], in[2], 0.7, true));
                         },
                         {q, k, v}));
  EXPECT_TRUE(check_grad({"flash_attention"},
                         [](const variable_list& in) {
                           auto [o, lse] = flash_attention(in[0], in[1], in[2], 0.6, true,
                                                           /*sliding_window=*/2, /*softcap=*/1.5);
                           return o.sum({-1}) * 0.5 + lse * 2.0;
                         },
                         {q, k, v}));
  // Out alone (lse's gradient absent: an undefined dlse), without a mask.
  EXPECT_TRUE(check_grad({"flash_attention"},
                         [](const variable_list& in) {
                           return std::get<0>(flash_attention(in[0], in[1], in[2], 0.9));
                         },
                         {q, k, v}));
}

}  // namespace
}  // namespace kiln
