// The fuse_norm_residual pass (compiler/passes.h): the residual stream's gradient added to an
// rms_norm's input gradient becomes rms_norm_backward's fifth input. Two pre-norm blocks trained
// compiled against eager on the CPU (bit for bit: f32 and f64 fused, bf16 left alone), and the
// adds it must keep: a gradient read twice or handed out, a residual made after the norm's
// backward, an in-place op between them, alpha other than one, a broadcast residual.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "compiler/compile.h"
#include "compiler/passes.h"
#include "compiler/tracer.h"
#include "kiln.h"
#include "trace_test_util.h"

namespace kiln {
namespace {

using compiler::Trace;
using test::count_ops;
using test::stage;

// rms_norm_backward ops of t that take a residual.
int fused_norms(const Trace& t) {
  int n = 0;
  for (const auto& op : t.ops) n += op.name() == "rms_norm_backward" && op.inputs.size() == 5;
  return n;
}

struct Block {
  Tensor w1, w2, n1, n2;  // projections [d, d], norm weights [d]
};

// Two pre-norm blocks, h = x + proj(norm(x)), and the gradients of a weighted sum of the result:
// the loss and x's gradient returned, the parameters' in their grad().
std::vector<Tensor> blocks_step(std::vector<Block>& blocks, const Tensor& x0, const Tensor& c) {
  for (Block& b : blocks) {
    for (Tensor* p : {&b.w1, &b.w2, &b.n1, &b.n2}) p->mutable_grad() = Tensor();
  }
  Tensor x = x0.clone().requires_grad_();
  Tensor h = x;
  for (Block& b : blocks) {
    h = h + mm(rms_norm(h, b.n1, 1e-5), b.w1);
    h = h + mm(rms_norm(h, b.n2, 1e-5), b.w2).tanh();
  }
  Tensor loss = (h * c).sum();
  loss.backward();
  return {loss, x.grad()};
}

std::vector<Tensor> grads(const std::vector<Tensor>& step_out, const std::vector<Block>& blocks) {
  std::vector<Tensor> out = step_out;
  for (const Block& b : blocks) {
    for (const Tensor* p : {&b.w1, &b.w2, &b.n1, &b.n2}) out.push_back(p->grad());
  }
  return out;
}

std::vector<Block> make_blocks(int n, int64_t d, ScalarType dt) {
  std::vector<Block> blocks;
  for (int i = 0; i < n; ++i) {
    blocks.push_back(
        {(randn({d, d}) / 8).to(dt).requires_grad_(), (randn({d, d}) / 8).to(dt).requires_grad_(),
         (randn({d}) + 1).to(dt).requires_grad_(), (randn({d}) + 1).to(dt).requires_grad_()});
  }
  return blocks;
}

std::vector<Block> copy_blocks(const std::vector<Block>& from) {
  std::vector<Block> out;
  for (const Block& b : from) {
    out.push_back({b.w1.detach().clone().requires_grad_(), b.w2.detach().clone().requires_grad_(),
                   b.n1.detach().clone().requires_grad_(), b.n2.detach().clone().requires_grad_()});
  }
  return out;
}

TEST(FuseNormResidual, PreNormBlocksTrainAsEager) {
  // On the CPU compiled code keeps eager's bits: f32 and f64 fuse (one rounding of the sum is
  // eager's), bf16 keeps its adds.
  for (ScalarType dt : {kDouble, kFloat, kBFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    manual_seed(7);
    const int64_t d = 24;
    std::vector<Block> eager = make_blocks(2, d, dt);
    std::vector<Block> compiled = copy_blocks(eager);
    const Tensor c = randn({6, d}).to(dt);
    auto step = compile([&](const Tensor& x) { return blocks_step(compiled, x, c); });
    for (int i = 0; i < 2; ++i) {
      const Tensor x = randn({6, d}).to(dt);
      const std::vector<Tensor> want = grads(blocks_step(eager, x, c), eager);
      const std::vector<Tensor> got = grads(step(x), compiled);
      ASSERT_EQ(got.size(), want.size());
      for (size_t k = 0; k < got.size(); ++k) {
        test::expect_bitwise(got[k], want[k], "result " + std::to_string(k));
      }
    }
    // Every norm's input gradient meets the residual stream's gradient: four adds go.
    const Trace& before = stage(step.traces(), "cse");
    const Trace& after = stage(step.traces(), "fuse_norm_residual");
    const int fused = dt == kBFloat16 ? 0 : 4;
    EXPECT_EQ(fused_norms(before), 0);
    EXPECT_EQ(count_ops(before, "rms_norm_backward"), 4) << before.str();
    EXPECT_EQ(fused_norms(after), fused) << after.str();
    EXPECT_EQ(count_ops(after, "add"), count_ops(before, "add") - fused) << after.str();
  }
  // Skipped by name, the adds stay.
  manual_seed(8);
  std::vector<Block> blocks = make_blocks(1, 8, kFloat);
  const Tensor c = randn({3, 8});
  auto step = compile([&](const Tensor& x) { return blocks_step(blocks, x, c); },
                      CompileOptions().skip_pass("fuse_norm_residual"));
  step(randn({3, 8}));
  EXPECT_EQ(fused_norms(step.traces().back()), 0);
}

Trace passed(const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& fn,
             const std::vector<Tensor>& args) {
  NoGradGuard no_grad;
  return compiler::fuse_norm_residual(compiler::trace_callable(fn, args).trace);
}

TEST(FuseNormResidual, KeepsTheAddsItMustKeep) {
  manual_seed(9);
  const Tensor x = randn({5, 16}), w = randn({16}), dy = randn({5, 16}), r0 = randn({5, 16});
  const std::vector<Tensor> args{x, w, dy, r0};
  static const OpDef& bwd = KILN_OP(rms_norm_backward);
  auto norm_dx = [](const std::vector<Tensor>& in) {
    const Tensor rstd = call_op(KILN_OP(rms_norm), {in[0], in[1]}, {1e-5})[1];
    return call_op(bwd, {in[2], in[0], in[1], rstd})[0];
  };
  // The residual made before: fused, in either order of the add's inputs.
  Trace t = passed(
      [&](const std::vector<Tensor>& in) {
        const Tensor r = in[3].exp();
        return std::vector<Tensor>{(r + norm_dx(in)).sin(), (norm_dx(in) + r).cos()};
      },
      args);
  EXPECT_EQ(fused_norms(t), 2) << t.str();
  EXPECT_EQ(count_ops(t, "add"), 0) << t.str();
  // An argument as the residual, and the sum returned: fused.
  t = passed(
      [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{norm_dx(in) + in[3]}; },
      args);
  EXPECT_EQ(fused_norms(t), 1) << t.str();
  // The gradient read twice; handed out itself.
  t = passed(
      [&](const std::vector<Tensor>& in) {
        const Tensor g = norm_dx(in);
        return std::vector<Tensor>{g + in[3], g.exp()};
      },
      args);
  EXPECT_EQ(fused_norms(t), 0) << t.str();
  t = passed(
      [&](const std::vector<Tensor>& in) {
        const Tensor g = norm_dx(in);
        return std::vector<Tensor>{g + in[3], g};
      },
      args);
  EXPECT_EQ(fused_norms(t), 0) << t.str();
  // The residual made after the norm's backward.
  t = passed(
      [&](const std::vector<Tensor>& in) {
        const Tensor g = norm_dx(in);
        return std::vector<Tensor>{g + in[3].exp()};
      },
      args);
  EXPECT_EQ(fused_norms(t), 0) << t.str();
  // An in-place op between the two (on another value: any in-place op keeps the add).
  t = passed(
      [&](const std::vector<Tensor>& in) {
        const Tensor r = in[3].exp();
        const Tensor g = norm_dx(in);
        Tensor other = in[0].cos();
        other.mul_(2.0);
        return std::vector<Tensor>{g + r, other};
      },
      args);
  EXPECT_EQ(fused_norms(t), 0) << t.str();
  // alpha 2; a broadcast row as the residual; a residual of another dtype.
  t = passed(
      [&](const std::vector<Tensor>& in) {
        const Tensor r = in[3].exp();
        return std::vector<Tensor>{add(r, norm_dx(in), 2.0), norm_dx(in) + in[1].exp(),
                                   norm_dx(in) + r.to(kDouble)};
      },
      args);
  EXPECT_EQ(fused_norms(t), 0) << t.str();
}

}  // namespace
}  // namespace kiln
