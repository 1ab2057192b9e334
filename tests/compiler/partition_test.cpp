// remat (compiler/partition.h): the min-cut partitioner of a joint forward+backward trace. Each
// test compiles a function called from eager code with inputs that require grad, and checks
// what the forward saves (fewer bytes than saving every value the backward reads), what the
// backward recomputes (pointwise ops, never a matmul or a random op), that the backward program
// is well formed (every value defined before it is read, none twice), and that outputs and
// gradients equal eager ones bit for bit.
#include "compiler/partition.h"

#include <gtest/gtest.h>

#include <functional>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include "autograd/grad_mode.h"
#include "compiler/compile.h"
#include "kiln.h"
#include "models/gpt.h"
#include "test_util.h"

namespace kiln {
namespace {

using compiler::Partition;
using compiler::PartitionOptions;
using compiler::RematLevel;
using compiler::RematPolicy;
using compiler::Trace;
namespace F = nn::functional;

void expect_bits(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.defined(), want.defined()) << what;
  if (!want.defined()) return;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(equal(got, want)) << what << ": max |got - want| = "
                                << (got - want).abs().max().item<double>();
}

// The first trace of the last compilation at `stage` ("forward", "backward": before the passes).
// `stage` is not a std::string: GCC 13 would warn of a dangling reference at every caller.
template <typename Fn>
const Trace& stage_of(const CompiledFunction<Fn>& f, const char* stage) {
  for (const Trace& t : f.traces()) {
    if (t.stage == stage) return t;
  }
  ADD_FAILURE() << "no stage " << stage;
  return f.traces().front();
}

// The backward's copies of forward ops: ops whose outputs the forward's ops also produce.
std::vector<std::string> recomputed(const Trace& forward, const Trace& backward) {
  std::set<int> made;
  for (const auto& op : forward.ops) made.insert(op.outputs.begin(), op.outputs.end());
  std::vector<std::string> names;
  for (const auto& op : backward.ops) {
    if (!op.outputs.empty() && made.count(op.outputs[0])) names.push_back(op.name());
  }
  return names;
}

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// Every value an op reads is an argument, an external or an earlier op's output; none is
// defined twice; the outputs are defined.
void expect_well_formed(const Trace& t) {
  std::vector<bool> defined(t.values.size(), false);
  for (int v : t.arguments) defined[static_cast<size_t>(v)] = true;
  for (int v : t.externals) defined[static_cast<size_t>(v)] = true;
  for (const auto& op : t.ops) {
    for (int v : op.inputs) {
      if (v >= 0) {
        EXPECT_TRUE(defined[static_cast<size_t>(v)]) << op.name() << " reads t" << v;
      }
    }
    for (int v : op.outputs) {
      if (v < 0) continue;
      EXPECT_FALSE(defined[static_cast<size_t>(v)]) << op.name() << " redefines t" << v;
      defined[static_cast<size_t>(v)] = true;
    }
  }
  for (int v : t.outputs) {
    if (v >= 0) {
      EXPECT_TRUE(defined[static_cast<size_t>(v)]) << "output t" << v;
    }
  }
}

// Runs `f` on copies of `inputs` that require grad and backpropagates `seed_grad`; returns the
// output, then the inputs' gradients.
template <typename Fn>
std::vector<Tensor> run_with_grads(Fn&& f, const std::vector<Tensor>& inputs,
                                   const Tensor& seed_grad) {
  std::vector<Tensor> xs;
  for (const Tensor& x : inputs) xs.push_back(x.clone().requires_grad_(true));
  std::vector<Tensor> out{f(xs[0], xs[1])};
  autograd::backward({out[0]}, {seed_grad});
  for (const Tensor& x : xs) out.push_back(x.grad());
  return out;
}

template <typename Fn>
void expect_same_as_eager(Fn&& fn, CompileOptions options, const std::vector<Tensor>& inputs,
                          const Tensor& seed_grad, int64_t* saved_bytes = nullptr) {
  auto f = compile(fn, std::move(options));
  for (int call = 0; call < 2; ++call) {  // traced, then cached
    manual_seed(5);
    const std::vector<Tensor> got = run_with_grads(f, inputs, seed_grad);
    manual_seed(5);
    const std::vector<Tensor> want = run_with_grads(fn, inputs, seed_grad);
    for (size_t i = 0; i < got.size(); ++i) {
      expect_bits(got[i], want[i], i == 0 ? "output" : "grad " + std::to_string(i - 1));
    }
  }
  expect_well_formed(stage_of(f, "backward"));
  if (saved_bytes) *saved_bytes = f.stats().saved_bytes;
}

Tensor relu_times_sigmoid(const Tensor& x, const Tensor& w) {
  const Tensor h = matmul(x, w);
  return relu(h) * sigmoid(h);
}

TEST(Remat, SavesTheMatmulAndRecomputesThePointwiseChain) {
  manual_seed(1);
  const std::vector<Tensor> in = {randn({64, 32}), randn({32, 48})};
  const Tensor go = randn({64, 48});
  auto f = compile(relu_times_sigmoid);
  (void)run_with_grads(f, in, go);
  const Trace& fwd = stage_of(f, "forward");
  const Trace& bwd = stage_of(f, "backward");
  const std::vector<std::string> redo = recomputed(fwd, bwd);
  EXPECT_TRUE(contains(redo, "relu")) << bwd.str();
  EXPECT_TRUE(contains(redo, "sigmoid")) << bwd.str();
  EXPECT_FALSE(contains(redo, "mm")) << bwd.str();
  EXPECT_EQ(f.stats().recomputed_ops, static_cast<int>(redo.size()));
  // Saved: x and w (mm's backward reads them) and h = x @ w: 64*32 + 32*48 + 64*48 floats,
  // instead of also relu(h) and sigmoid(h).
  EXPECT_EQ(f.stats().saved_bytes, (64 * 32 + 32 * 48 + 64 * 48) * 4) << fwd.str() << bwd.str();
  bool timed = false;
  for (const auto& [stage, ms] : f.stats().stage_ms) timed |= stage == "partition";
  EXPECT_TRUE(timed);

  int64_t min_cut = 0, save_all = 0;
  expect_same_as_eager(relu_times_sigmoid, CompileOptions(), in, go, &min_cut);
  expect_same_as_eager(relu_times_sigmoid, CompileOptions().remat(RematPolicy::kSaveAll), in, go,
                       &save_all);
  std::cout << "relu(x @ w) * sigmoid(x @ w), x [64, 32], w [32, 48]: saved " << save_all
            << " bytes with kSaveAll, " << min_cut << " with kMinCut\n";
  EXPECT_LT(min_cut, save_all);
}

TEST(Remat, GeluTanhMlpRecomputesActivationsNotMatmuls) {
  manual_seed(2);
  const std::vector<Tensor> in = {randn({32, 64}), randn({64, 128})};
  // A captured weight that requires grad: mm's backward reads gelu's output for its gradient.
  const Tensor w2 = (randn({128, 64}) * 0.1).requires_grad_(true);
  auto mlp = [w2](const Tensor& x, const Tensor& w1) {
    const Tensor h = F::gelu(matmul(x, w1));
    return tanh(matmul(h, w2) + 1.0);
  };
  const Tensor go = randn({32, 64});
  int64_t min_cut = 0, save_all = 0;
  expect_same_as_eager(mlp, CompileOptions(), in, go, &min_cut);
  expect_same_as_eager(mlp, CompileOptions().remat(RematPolicy::kSaveAll), in, go, &save_all);
  EXPECT_LT(min_cut, save_all);
  auto f = compile(mlp);
  (void)run_with_grads(f, in, go);
  const std::vector<std::string> redo = recomputed(stage_of(f, "forward"), stage_of(f, "backward"));
  EXPECT_TRUE(contains(redo, "gelu"));
  EXPECT_FALSE(contains(redo, "mm"));
}

TEST(Remat, SaveAllIsTheSplitAtBackwardBegin) {
  manual_seed(3);
  const std::vector<Tensor> in = {randn({8, 4}), randn({4, 6})};
  auto f = compile(relu_times_sigmoid, CompileOptions().remat(RematPolicy::kSaveAll));
  (void)run_with_grads(f, in, randn({8, 6}));
  EXPECT_EQ(f.stats().recomputed_ops, 0);
  EXPECT_TRUE(recomputed(stage_of(f, "forward"), stage_of(f, "backward")).empty());
  EXPECT_KILN_ERROR(compile(relu_times_sigmoid,
                            CompileOptions().remat(RematPolicy::kSaveAll).activation_budget(1024))(
                        in[0].clone().requires_grad_(true), in[1]),
                    "[remat] activation_budget(1024) needs the min-cut policy");
}

// h = x @ w; exp(h - amax(h)): amax's backward reads h and its output, exp's its output. At
// the default level amax (a reduction to 1/64 of its input) is saved, not redone; a budget one
// byte below that cut makes the partitioner redo it too and save only h.
Tensor shifted_exp(const Tensor& x, const Tensor& w) {
  const Tensor h = matmul(x, w);
  return exp(h - h.amax({1}, /*keepdim=*/true));
}

compiler::TraceResult joint_trace(Tensor (*fn)(const Tensor&, const Tensor&),
                                  const std::vector<Tensor>& in) {
  std::vector<Tensor> args;
  for (const Tensor& x : in) args.push_back(x.clone().requires_grad_(true));
  return compiler::trace_callable(
      [fn](const std::vector<Tensor>& a) { return std::vector<Tensor>{fn(a[0], a[1])}; }, args,
      "fn", /*joint=*/true);
}

TEST(Remat, BudgetRecomputesMoreOrFailsClearly) {
  manual_seed(4);
  const std::vector<Tensor> in = {randn({16, 64}), randn({64, 64})};
  const compiler::TraceResult traced = joint_trace(shifted_exp, in);
  ASSERT_GE(traced.backward_begin, 0);
  const auto boundary = compiler::joint_boundary(traced);
  const Partition all =
      compiler::partition_joint(traced.trace, boundary, {.policy = RematPolicy::kSaveAll});
  const Partition cut = compiler::partition_joint(traced.trace, boundary, {});
  EXPECT_EQ(cut.level, RematLevel::kPointwise);
  EXPECT_LT(cut.saved_bytes, all.saved_bytes);
  const int64_t x_w_h = (16 * 64 + 64 * 64 + 16 * 64) * 4;
  EXPECT_EQ(cut.saved_bytes, x_w_h + 16 * 4);  // and amax's [16, 1]
  const Partition tight =
      compiler::partition_joint(traced.trace, boundary, {.activation_budget = cut.saved_bytes - 1});
  EXPECT_EQ(tight.level, RematLevel::kReductions);
  EXPECT_EQ(tight.saved_bytes, x_w_h);
  EXPECT_TRUE(contains(recomputed(tight.forward, tight.backward), "amax"));
  expect_well_formed(tight.backward);
  EXPECT_KILN_ERROR(compiler::partition_joint(traced.trace, boundary, {.activation_budget = 0}),
                    "[remat] activation_budget(0 bytes) is below what fn's backward must save: " +
                        std::to_string(x_w_h) + " bytes");

  // End to end: the budget's program gives eager's gradients; an impossible one fails to compile.
  const Tensor go = randn({16, 64});
  int64_t saved = 0;
  expect_same_as_eager(shifted_exp, CompileOptions().activation_budget(x_w_h), in, go, &saved);
  EXPECT_EQ(saved, x_w_h);
  EXPECT_KILN_ERROR(
      run_with_grads(compile(shifted_exp, CompileOptions().activation_budget(100)), in, go),
      "[remat] activation_budget(100 bytes)");
  EXPECT_KILN_ERROR(CompileOptions().activation_budget(-1), "[CompileOptions] activation_budget");
}

// Dropout's mask comes from a random op (bernoulli_) and an in-place scaling: neither is redone,
// so the backward draws nothing and the gradients are eager's.
Tensor dropout_mlp(const Tensor& x, const Tensor& w) {
  const Tensor h = matmul(x, w);
  return F::dropout(relu(h), F::DropoutFuncOptions().p(0.3).training(true)) * sigmoid(h);
}

TEST(Remat, RandomOpsAreNeverRecomputed) {
  manual_seed(6);
  const std::vector<Tensor> in = {randn({32, 16}), randn({16, 24})};
  const Tensor go = randn({32, 24});
  expect_same_as_eager(dropout_mlp, CompileOptions(), in, go);
  auto f = compile(dropout_mlp);
  manual_seed(5);
  (void)run_with_grads(f, in, go);
  const Trace& bwd = stage_of(f, "backward");
  for (const auto& op : bwd.ops) {
    EXPECT_FALSE(op.op->random) << op.name() << " in\n" << bwd.str();
    EXPECT_NE(op.op->kind, OpKind::kInplace) << op.name() << " in\n" << bwd.str();
  }
  EXPECT_TRUE(contains(recomputed(stage_of(f, "forward"), bwd), "relu")) << bwd.str();
}

// An op whose memory an in-place op writes later is never redone (the redone op would read or
// make other contents), nor a view of memory that an in-place op writes: here z = h + 1 is
// scaled in place by h; mul_'s backward reads the copy of z that autograd keeps, and the last
// mul's backward reads z's view, both saved, not recomputed from the scaled z.
Tensor scaled_in_place(const Tensor& x, const Tensor& w) {
  const Tensor h = matmul(x, w);
  Tensor z = h + 1.0;
  z.mul_(h);
  return (sigmoid(z) * h).view({-1}) + z.view({-1}) * h.view({-1}).exp();
}

TEST(Remat, InPlaceWritesKeepTheirInputsAndViewsSaved) {
  manual_seed(7);
  const std::vector<Tensor> in = {randn({8, 16}), randn({16, 8})};
  const Tensor go = randn({64});
  expect_same_as_eager([](const Tensor& x, const Tensor& w) { return scaled_in_place(x, w); },
                       CompileOptions(), in, go);
  auto f = compile(scaled_in_place);
  (void)run_with_grads(f, in, go);
  const Trace& fwd = stage_of(f, "forward");
  const Trace& bwd = stage_of(f, "backward");
  std::set<int> written;  // mul_'s input and output: z before and after
  for (const auto& op : fwd.ops) {
    if (op.name() != "mul_") continue;
    written.insert(op.inputs[0]);
    written.insert(op.outputs[0]);
  }
  ASSERT_EQ(written.size(), 2u) << fwd.str();
  std::set<int> made;
  for (const auto& op : fwd.ops) made.insert(op.outputs.begin(), op.outputs.end());
  for (const auto& op : bwd.ops) {
    if (!made.count(op.outputs[0])) continue;  // not recomputed
    for (int v : op.inputs) EXPECT_FALSE(written.count(v)) << op.name() << " in\n" << bwd.str();
    for (int v : op.outputs) EXPECT_FALSE(written.count(v)) << op.name() << " in\n" << bwd.str();
  }
}

// The bytes of the saved values (the forward's outputs after the first `user_outputs`) that are
// views of captured tensors: they hold no memory of their own.
int64_t saved_view_bytes(const Trace& forward, size_t user_outputs) {
  std::vector<bool> external_view(forward.values.size(), false);
  for (int v : forward.externals) external_view[static_cast<size_t>(v)] = true;
  for (const auto& op : forward.ops) {
    if (op.op->kind != OpKind::kView || op.inputs.empty() || op.inputs[0] < 0) continue;
    for (int v : op.outputs) {
      if (v >= 0)
        external_view[static_cast<size_t>(v)] = external_view[static_cast<size_t>(op.inputs[0])];
    }
  }
  int64_t bytes = 0;
  for (size_t k = user_outputs; k < forward.outputs.size(); ++k) {
    const int v = forward.outputs[k];
    if (v >= 0 && external_view[static_cast<size_t>(v)]) {
      bytes += compiler::value_bytes(forward.value(v));
    }
  }
  return bytes;
}

// The GPT families' forward and loss compiled, backward run eagerly through the compiled
// backward: parameters' gradients equal eager's bit for bit with fewer bytes saved.
void check_model(const std::string& name) {
  const models::ModelConfig config = models::ModelConfig::from_name(name);
  manual_seed(0);
  models::GPT model(config);
  model->train();
  {
    NoGradGuard no_grad;
    (void)model(zeros({1, 1}, kInt64));  // builds the RoPE tables eagerly
  }
  manual_seed(11);
  const Tensor tokens = randint(config.vocab_size, {2, 17}, kInt64);
  const Tensor x = tokens.narrow(1, 0, 16).contiguous(), y = tokens.narrow(1, 1, 16).contiguous();
  auto loss_fn = [&](const Tensor& a, const Tensor& b) { return model->loss(a, b); };
  auto grads = [&](auto&& f) {
    model->zero_grad();
    Tensor loss = f(x, y);
    loss.backward();
    std::vector<Tensor> g{loss.detach()};
    for (const Tensor& p : model->parameters()) {
      g.push_back(p.grad().defined() ? p.grad().clone() : Tensor());
    }
    return g;
  };
  const std::vector<Tensor> want = grads(loss_fn);
  int64_t saved[2] = {0, 0}, views[2] = {0, 0};
  int recomputed_ops = 0;
  for (RematPolicy policy : {RematPolicy::kSaveAll, RematPolicy::kMinCut}) {
    auto f = compile(loss_fn, CompileOptions().remat(policy));
    for (int call = 0; call < 2; ++call) {
      const std::vector<Tensor> got = grads(f);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        expect_bits(got[i], want[i], name + (i == 0 ? " loss" : " grad " + std::to_string(i)));
      }
    }
    expect_well_formed(stage_of(f, "backward"));
    saved[policy == RematPolicy::kMinCut] = f.stats().saved_bytes;
    views[policy == RematPolicy::kMinCut] = saved_view_bytes(stage_of(f, "forward"), 1);
    if (policy == RematPolicy::kMinCut) recomputed_ops = f.stats().recomputed_ops;
    for (const std::string& op : recomputed(stage_of(f, "forward"), stage_of(f, "backward"))) {
      EXPECT_TRUE(op != "mm" && op != "flash_attention") << name << " recomputes " << op;
    }
  }
  std::cout << name << " loss, batch 2 x 16 tokens: saved " << saved[0] << " bytes with kSaveAll ("
            << views[0] << " of them views of parameters), " << saved[1] << " with kMinCut ("
            << views[1] << "; " << recomputed_ops << " ops recomputed)\n";
  EXPECT_LT(saved[1], saved[0]);
}

TEST(Remat, ModelLossGradientsMatchEagerWithLessSaved) {
  for (const char* name :
       {"kiln-tiny", "tiny-llama", "tiny-mistral", "tiny-gemma", "tiny-gemma2"}) {
    SCOPED_TRACE(name);
    check_model(name);
  }
}

}  // namespace
}  // namespace kiln
