// The fuse_qkv_rotary pass (compiler/passes.h): split_qkv_rotary becomes rotary_qkv_ and views of
// qkv, and merge_qkv_rotary of a flash_attention_backward's results becomes one
// flash_attention_backward_qkv. tiny-llama's training step compiled on the CPU keeps eager's bits
// with both rewrites in every layer; what the pass must leave as it was: qkv read again or an
// argument, a head handed out, a gradient read again or handed out, an in-place op between the
// backward and the merge; skipped by name. On a GPU: an attention block of head size 64 in bf16
// (cuDNN writes the gradients into the merged one once it is measured faster) compiled equals
// eager.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "compiler/compile.h"
#include "compiler/passes.h"
#include "compiler/tracer.h"
#include "kernels/cuda.h"
#include "kiln.h"
#include "tiny_step.h"
#include "trace_test_util.h"

namespace kiln {
namespace {

using compiler::Trace;
using test::count_ops;
using test::stage;

TEST(FuseQkvRotary, TinyLlamaTrainsAsEager) {
  const auto config = models::ModelConfig::from_name("tiny-llama");
  test::TinyStep eager(config, test::adamw(optim::AdamWOptions(3e-3)));
  test::TinyStep compiled(config, test::adamw(optim::AdamWOptions(3e-3)));
  auto step = compile([&](const Tensor& x, const Tensor& y) { return compiled.step(x, y); });
  manual_seed(100);
  for (int i = 0; i < 3; ++i) {
    const auto [x, y] = test::next_token_batch(config.vocab_size, 2, 16);
    test::expect_bitwise(step(x, y), eager.step(x, y), "loss of step " + std::to_string(i));
  }
  const std::vector<Tensor> pe = eager.model->parameters(), pc = compiled.model->parameters();
  ASSERT_EQ(pc.size(), pe.size());
  for (size_t k = 0; k < pc.size(); ++k) {
    test::expect_bitwise(pc[k], pe[k], "parameter " + std::to_string(k));
  }
  const int layers = static_cast<int>(config.n_layer);
  const Trace& before = stage(step.traces(), "fold_index_add");
  const Trace& after = stage(step.traces(), "fuse_qkv_rotary");
  EXPECT_EQ(count_ops(before, "split_qkv_rotary"), layers) << before.str();
  EXPECT_EQ(count_ops(before, "merge_qkv_rotary"), layers) << before.str();
  EXPECT_EQ(count_ops(after, "split_qkv_rotary"), 0) << after.str();
  EXPECT_EQ(count_ops(after, "rotary_qkv_"), layers) << after.str();
  EXPECT_EQ(count_ops(after, "merge_qkv_rotary"), 0) << after.str();
  EXPECT_EQ(count_ops(after, "flash_attention_backward"), 0) << after.str();
  EXPECT_EQ(count_ops(after, "flash_attention_backward_qkv"), layers) << after.str();
  // Skipped by name, the split and the merge stay.
  test::TinyStep plain(config, test::adamw(optim::AdamWOptions(3e-3)));
  auto unfused = compile([&](const Tensor& x, const Tensor& y) { return plain.step(x, y); },
                         CompileOptions().skip_pass("fuse_qkv_rotary"));
  const auto [x, y] = test::next_token_batch(config.vocab_size, 2, 16);
  unfused(x, y);
  EXPECT_EQ(count_ops(unfused.traces().back(), "split_qkv_rotary"), layers);
  EXPECT_EQ(count_ops(unfused.traces().back(), "merge_qkv_rotary"), layers);
}

constexpr int64_t kB = 2, kT = 5, kH = 4, kG = 2, kD = 8, kE = 16;

// One attention block's forward and, by hand, its backward: x [B, T, E] projected by w [E,
// (H + 2G) D] into qkv, split with RoPE, attended; dout's gradient through the attention merged
// into qkv's. `what` says which values it also returns or which op it adds (see below).
std::vector<Tensor> attention_block(const std::vector<Tensor>& in, const std::string& what) {
  static const OpDef& bwd = KILN_OP(flash_attention_backward);
  const Tensor qkv = what == "qkv an argument" ? in[5] : in[0].matmul(in[1]);
  auto [q, k, v] = split_qkv_rotary(qkv, in[2], in[3], kH, kG);
  auto [o, lse] = flash_attention(q, k, v, 0.3, true);
  const TensorVec d =
      call_op(bwd, {in[4], q, k, v, o, lse, Tensor()}, {0.3, true, int64_t{0}, 0.0});
  std::vector<Tensor> out = {o};
  if (what == "an in-place op between") out.push_back(in[0].exp().mul_(2.0));
  out.push_back(merge_qkv_rotary(d[0], d[1], d[2], in[2], in[3]));
  if (what == "qkv read again") out.push_back(qkv.sum());
  if (what == "a head handed out") out.push_back(k);
  if (what == "a gradient read again") out.push_back(d[2].sum());
  if (what == "a gradient handed out") out.push_back(d[0]);
  return out;
}

Trace passed(const std::string& what) {
  const Device cpu(kCPU);
  const int64_t n = (kH + 2 * kG) * kD;
  const std::vector<Tensor> args = {compiler::proxy_of({{kB, kT, kE}, kFloat, cpu}),
                                    compiler::proxy_of({{kE, n}, kFloat, cpu}),
                                    compiler::proxy_of({{kT, kD}, kFloat, cpu}),
                                    compiler::proxy_of({{kT, kD}, kFloat, cpu}),
                                    compiler::proxy_of({{kB, kH, kT, kD}, kFloat, cpu}),
                                    compiler::proxy_of({{kB, kT, n}, kFloat, cpu})};
  NoGradGuard no_grad;
  return compiler::fuse_qkv_rotary(
      compiler::trace_callable(
          [&](const std::vector<Tensor>& in) { return attention_block(in, what); }, args)
          .trace);
}

TEST(FuseQkvRotary, RewritesOnlyWhereNothingElseSeesTheChange) {
  auto expect = [](const std::string& what, bool split_fused, bool merge_fused) {
    const Trace t = passed(what);
    EXPECT_EQ(t.stage, "fuse_qkv_rotary") << what;  // also where it leaves the trace as it was
    EXPECT_EQ(count_ops(t, "rotary_qkv_"), split_fused ? 1 : 0) << what << "\n" << t.str();
    EXPECT_EQ(count_ops(t, "split_qkv_rotary"), split_fused ? 0 : 1) << what << "\n" << t.str();
    EXPECT_EQ(count_ops(t, "flash_attention_backward_qkv"), merge_fused ? 1 : 0) << what << "\n"
                                                                                 << t.str();
    EXPECT_EQ(count_ops(t, "merge_qkv_rotary"), merge_fused ? 0 : 1) << what << "\n" << t.str();
    EXPECT_EQ(count_ops(t, "flash_attention_backward"), merge_fused ? 0 : 1) << what << "\n"
                                                                             << t.str();
  };
  expect("both", true, true);
  expect("qkv read again", false, true);
  expect("qkv an argument", false, true);
  // A head's layout changes with the rewrite: handed out, the whole trace stays as it was.
  expect("a head handed out", false, false);
  expect("a gradient read again", true, false);
  expect("a gradient handed out", true, false);
  expect("an in-place op between", true, false);
  // The heads are views of qkv in its layout: q [B, H, T, D] with qkv's row stride.
  const Trace t = passed("both");
  for (const auto& op : t.ops) {
    if (op.name() != "flash_attention") continue;
    const TensorSpec& q = t.value(op.inputs[0]).spec;
    EXPECT_EQ(q.sizes, (Shape{kB, kH, kT, kD}));
    EXPECT_EQ(q.strides, (Shape{kT * (kH + 2 * kG) * kD, kD, (kH + 2 * kG) * kD, 1})) << t.str();
  }
}

// ||got - want|| / ||want|| in f64.
double rel_error(const Tensor& got, const Tensor& want) {
  const Tensor g = got.to(kDouble).cpu(), w = want.to(kDouble).cpu();
  return (g - w).square().sum().sqrt().item<double>() / w.square().sum().sqrt().item<double>();
}

TEST(GpuFuseQkvRotary, AttentionBlockMatchesEager) {
  if (!cuda::is_available()) GTEST_SKIP() << "needs a GPU";
  const Device gpu(kCUDA, 0);
  manual_seed(21);
  // Head size 64 in bf16: cuDNN's shapes (and the hand kernels'), GQA 2:1, llama's f32 tables.
  const int64_t b = 2, t = 96, h = 4, g = 2, d = 64, e = 128, n = (h + 2 * g) * d;
  const Tensor x = randn({b, t, e}).to(kBFloat16).to(gpu);
  const Tensor w = (randn({e, n}) / 8).to(kBFloat16).to(gpu);
  auto [c, s] = nn::functional::rope_cache(t, d);
  const Tensor dout = randn({b, h, t, d}).to(kBFloat16).to(gpu);
  auto fn = [&](const Tensor& xi) {
    static const OpDef& bwd = KILN_OP(flash_attention_backward);
    const Tensor qkv = xi.matmul(w);
    auto [q, k, v] = split_qkv_rotary(qkv, c.to(gpu), s.to(gpu), h, g);
    auto [o, lse] = flash_attention(q, k, v, 0.125, true);
    const TensorVec dq =
        call_op(bwd, {dout, q, k, v, o, lse, Tensor()}, {0.125, true, int64_t{0}, 0.0});
    return std::vector<Tensor>{o, merge_qkv_rotary(dq[0], dq[1], dq[2], c.to(gpu), s.to(gpu))};
  };
  const std::vector<Tensor> want = fn(x);
  auto f = compile([&](const Tensor& xi) { return fn(xi); });
  for (int call = 0; call < 4; ++call) {  // the first calls measure; cuDNN in place after
    const std::vector<Tensor> got = f(x);
    ASSERT_EQ(got.size(), want.size());
    for (size_t k = 0; k < got.size(); ++k) {
      EXPECT_LE(rel_error(got[k], want[k]), 2e-2) << "call " << call << " " << k;
    }
  }
  const Trace& t2 = stage(f.traces(), "fuse_qkv_rotary");
  EXPECT_EQ(count_ops(t2, "rotary_qkv_"), 1) << t2.str();
  EXPECT_EQ(count_ops(t2, "flash_attention_backward_qkv"), 1) << t2.str();
}

}  // namespace
}  // namespace kiln
