// kiln::compile end to end on the CPU: compiled == eager for functions, modules and training
// steps; the cache, guards and recompile reasons; the errors for reading data while tracing.
#include "compiler/compile.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "compiler/executor.h"
#include "kernels/cuda/runtime.h"
#include "kiln.h"
#include "test_util.h"

namespace kiln {
namespace {

namespace F = nn::functional;

void expect_equal(const Tensor& a, const Tensor& b) {
  ASSERT_TRUE(a.defined() && b.defined());
  ASSERT_EQ(a.sizes(), b.sizes());
  ASSERT_EQ(a.dtype(), b.dtype());
  EXPECT_TRUE(equal(a, b)) << "compiled:\n" << a << "\neager:\n" << b;
}

TEST(Compile, FunctionMatchesEagerAndIsCached) {
  auto fn = [](const Tensor& x, const Tensor& w) { return relu(matmul(x, w)).sum(1) * 2.0; };
  auto f = compile(fn);
  manual_seed(1);
  const Tensor x = randn({4, 8}), w = randn({8, 3});
  expect_equal(f(x, w), fn(x, w));
  expect_equal(f(x, w), fn(x, w));
  EXPECT_EQ(f.stats().misses, 1);
  EXPECT_EQ(f.stats().hits, 1);
  // mm's [4, 3] and relu's [4, 3] live together, then sum's [4] replaces them: 2 * 48 bytes.
  EXPECT_EQ(f.stats().planned_peak_bytes, 96);
  const std::string listing = f.traces().front().str();
  EXPECT_NE(listing.find("= mm(a0, a1)"), std::string::npos) << listing;
  EXPECT_NE(listing.find("relu("), std::string::npos) << listing;
  EXPECT_NE(f.traces().back().str().find("[eager]"), std::string::npos);
}

// An op called under cuda::internal::TrustedIndicesScope is recorded so and replayed under it
// (an index_add whose indices the caller checked does not wait for the device on a GPU); the
// same op called without it is not.
TEST(Compile, TrustedIndicesAreRecordedAndReplayed) {
  auto fn = [](const Tensor& x, const Tensor& idx, const Tensor& rows) {
    Tensor a = x.clone();
    {
      cuda::internal::TrustedIndicesScope trusted;
      a.index_add_(0, idx, rows);
    }
    return a.index_add(0, idx, rows * 2.0);
  };
  auto f = compile(fn);
  manual_seed(2);
  const Tensor x = randn({5, 3}), rows = randn({4, 3});
  const Tensor idx = tensor(std::vector<int64_t>{4, 0, 4, 2}, kInt64);
  expect_equal(f(x, idx, rows), fn(x, idx, rows));
  expect_equal(f(x, idx, rows), fn(x, idx, rows));
  const compiler::Trace& t = f.traces().back();
  int trusted = 0, plain = 0;
  for (const compiler::BoundOp& op : t.ops) {
    if (op.name().rfind("index_add", 0) != 0) continue;
    (op.trusted_indices ? trusted : plain) += 1;
  }
  EXPECT_EQ(trusted, 1) << t.str();
  EXPECT_EQ(plain, 1) << t.str();
  EXPECT_NE(t.str().find("trusted indices"), std::string::npos) << t.str();
  EXPECT_FALSE(cuda::internal::indices_trusted);  // the replay's scope ended with its op
}

TEST(Compile, NewShapeRecompilesAndSaysWhy) {
  auto f = compile([](const Tensor& x) { return x * 3.0 + 1.0; });
  const Tensor a = randn({4, 8}), b = randn({4, 16});
  expect_equal(f(a), a * 3.0 + 1.0);
  expect_equal(f(b), b * 3.0 + 1.0);
  expect_equal(f(a), a * 3.0 + 1.0);
  EXPECT_EQ(f.stats().misses, 2);
  EXPECT_EQ(f.stats().hits, 1);
  ASSERT_EQ(f.stats().recompile_reasons.size(), 1u);
  EXPECT_NE(f.stats().recompile_reasons[0].find("argument 0: f32[4, 8] cpu -> f32[4, 16] cpu"),
            std::string::npos)
      << f.stats().recompile_reasons[0];
}

TEST(Compile, TraceDirGetsEveryStage) {
  const std::string dir = testing::TempDir() + "/kiln_traces_" + std::to_string(::getpid());
  auto f = compile([](const Tensor& x) { return x.exp() + x.exp(); },
                   CompileOptions().trace_dir(dir).name("twice"));
  const Tensor x = randn({3});
  expect_equal(f(x), x.exp() + x.exp());
  int files = 0;
  bool cse_file = false;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    ++files;
    cse_file |= e.path().filename().string() == "twice.1.7.cse.txt";
  }
  EXPECT_EQ(files, static_cast<int>(f.traces().size()));
  EXPECT_TRUE(cse_file);
  // cse merged the two exps.
  int exps = 0;
  for (const auto& op : f.traces().back().ops) exps += op.name() == "exp";
  EXPECT_EQ(exps, 1);
  std::filesystem::remove_all(dir);
}

// A trace directory that cannot be made (a file is in the way): the call says which file it could
// not write.
TEST(Compile, UnwritableTraceDirIsAClearError) {
  const std::string file = testing::TempDir() + "/kiln_not_a_dir_" + std::to_string(::getpid());
  std::ofstream(file) << "in the way";
  auto f = compile([](const Tensor& x) { return x.exp(); },
                   CompileOptions().trace_dir(file + "/traces").name("blocked"));
  try {
    f(randn({3}));
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot write the trace to " + file + "/traces/blocked."),
              std::string::npos)
        << e.what();
  }
  std::filesystem::remove(file);
}

TEST(Compile, ScalarArgumentsAreGuarded) {
  auto f = compile([](const Tensor& x, double s) { return x * s; });
  const Tensor x = randn({3});
  expect_equal(f(x, 2.0), x * 2.0);
  expect_equal(f(x, 3.0), x * 3.0);
  EXPECT_EQ(f.stats().misses, 2);
}

TEST(Compile, DynamicDimensionsSayWhyTheyCompileAgain) {
  auto f = compile([](const Tensor& x) { return x.exp().sum(1); },
                   CompileOptions().dynamic(0, 1).recompile_limit(1));
  for (int64_t t : {3, 5, 7}) {
    const Tensor x = randn({2, t});
    expect_equal(f(x), x.exp().sum(1));
  }
  EXPECT_FALSE(f.stats().fell_back_to_eager);  // sizes of a dynamic dimension do not count
  // 3 and 5 compile, 7 shares their program (tests/compiler/dynamic_test.cpp).
  ASSERT_EQ(f.stats().recompile_reasons.size(), 1u);
  EXPECT_EQ(f.stats().dynamic_instances, 1);
  EXPECT_NE(f.stats().recompile_reasons[0].find("marked dynamic"), std::string::npos)
      << f.stats().recompile_reasons[0];
  EXPECT_KILN_ERROR(CompileOptions().dynamic(-1, 0), "must be non-negative");
}

TEST(Compile, SkipPassNamesThePasses) {
  EXPECT_KILN_ERROR(CompileOptions().skip_pass("fusion"),
                    "no pass is named 'fusion' (passes that can be skipped: autocast, decompose, "
                    "functionalize, simplify, dce, cse, fuse_norm_residual, fold_index_add, "
                    "fuse_qkv_rotary, fold_copy_into_mm, fuse, plan_memory)");
  for (const char* pass :
       {"autocast", "decompose", "functionalize", "simplify", "dce", "cse", "fuse_norm_residual",
        "fold_index_add", "fuse_qkv_rotary", "fuse", "plan_memory"}) {
    auto f =
        compile([](const Tensor& x) { return (x * 2.0).relu(); }, CompileOptions().skip_pass(pass));
    const Tensor x = randn({4, 4});
    expect_equal(f(x), (x * 2.0).relu());
    for (const compiler::Trace& t : f.traces()) EXPECT_NE(t.stage, pass);
  }
}

TEST(Compile, RecompileLimitFallsBackToEager) {
  auto f = compile([](const Tensor& x) { return x + 1.0; }, CompileOptions().recompile_limit(2));
  for (int64_t n = 1; n <= 4; ++n) {
    const Tensor x = randn({n});
    expect_equal(f(x), x + 1.0);
  }
  EXPECT_TRUE(f.stats().fell_back_to_eager);
  EXPECT_EQ(f.stats().misses, 2);
}

TEST(Compile, ModuleForwardUsesParametersByIdentity) {
  manual_seed(3);
  nn::Linear fc(8, 4);
  auto f = compile(fc);
  const Tensor x = randn({2, 8});
  {
    NoGradGuard no_grad;
    expect_equal(f(x), fc(x));
    // The program reads the parameter itself: an in-place change is seen by the next call.
    fc->weight.mul_(2.0);
    expect_equal(f(x), fc(x));
  }
  EXPECT_EQ(f.stats().misses, 1);
  EXPECT_NE(f.traces().front().str().find("p"), std::string::npos);
}

TEST(Compile, ReturnsVectorsAndTuplesAndTakesVectors) {
  auto f = compile([](const std::vector<Tensor>& xs) {
    return std::make_tuple(xs[0] + xs[1], std::vector<Tensor>{xs[0] * xs[1]}[0]);
  });
  const Tensor a = randn({3}), b = randn({3});
  auto [s, p] = f(std::vector<Tensor>{a, b});
  expect_equal(s, a + b);
  expect_equal(p, a * b);
}

TEST(Compile, ReadingValuesWhileTracingIsAClearError) {
  auto f = compile([](const Tensor& x) { return x * x.sum().item<double>(); });
  EXPECT_KILN_ERROR(f(randn({3})), "[item] reads a tensor's value while kiln::compile traces");
  auto g = compile([](const Tensor& x) { return x.masked_select(x > 0.0); });
  EXPECT_KILN_ERROR(g(randn({3})), "[masked_select] the shape of its output depends on the values");
  auto h = compile([](const Tensor& x) {
    std::ostringstream os;
    os << x;
    return x;
  });
  EXPECT_KILN_ERROR(h(randn({3})), "[print] prints the values of a tensor");
  // A failed trace leaves nothing behind: the captured tensors are real again.
  nn::Linear fc(3, 3);
  auto k = compile([&](const Tensor& x) { return fc(x) * fc(x).sum().item<double>(); });
  EXPECT_THROW(k(randn({1, 3})), Error);
  NoGradGuard no_grad;
  EXPECT_NO_THROW((void)fc->weight.sum().item<double>());
}

TEST(Compile, RandomOpsDrawWhatEagerDraws) {
  auto fn = [](const Tensor& x) {
    return F::dropout(x, F::DropoutFuncOptions().p(0.5).training(true));
  };
  auto f = compile(fn);
  const Tensor x = ones({64});
  for (int i = 0; i < 3; ++i) {
    manual_seed(7 + i);
    const Tensor got = f(x);
    const RngState after_compiled = get_rng_state();
    manual_seed(7 + i);
    const Tensor want = fn(x);
    expect_equal(got, want);
    EXPECT_EQ(get_rng_state().offset, after_compiled.offset);
  }
  EXPECT_EQ(f.stats().misses, 1);
  EXPECT_NE(f.traces().front().str().find("offset+0"), std::string::npos)
      << f.traces().front().str();
}

TEST(Compile, AutocastInsideTheCallableIsReplayed) {
  auto fn = [](const Tensor& a, const Tensor& b) {
    AutocastGuard guard(kCPU, kBFloat16);
    return matmul(a, b).relu();
  };
  auto f = compile(fn);
  const Tensor a = randn({4, 8}), b = randn({8, 4});
  for (int i = 0; i < 2; ++i) {
    const Tensor got = f(a, b);
    EXPECT_EQ(got.dtype(), kBFloat16);
    expect_equal(got, fn(a, b));
  }
  EXPECT_EQ(f.stats().hits, 1);
  EXPECT_NE(f.traces().front().str().find("autocast(cpu: bf16)"), std::string::npos)
      << f.traces().front().str();
}

TEST(Compile, UserExecutorClaimsOpsByName) {
  int calls = 0;
  compiler::register_executor(
      compiler::make_op_executor("test_relu", {{"relu", [&](OpCall& call) {
                                                  ++calls;
                                                  call.outputs = {call.input(0).clamp_min(0.0)};
                                                }}}));
  auto f = compile([](const Tensor& x) { return relu(x) + 1.0; },
                   CompileOptions().executors({"test_relu"}));
  const Tensor x = randn({5});
  expect_equal(f(x), relu(x) + 1.0);
  EXPECT_EQ(calls, 1);
  EXPECT_NE(f.traces().back().str().find("[test_relu]"), std::string::npos);
  EXPECT_KILN_ERROR(CompileOptions().executors({"no_such"}), "no executor is named 'no_such'");
}

TEST(Compile, GradientsFlowThroughOneCompiledBackwardNode) {
  manual_seed(9);
  nn::Linear fc(5, 4);
  auto fn = [&](const Tensor& x) { return (F::gelu(fc(x)) * x.sum(1, true)).tanh(); };
  auto f = compile(fn);
  const Tensor x0 = randn({3, 5});
  Tensor xc = x0.clone().requires_grad_(true), xe = x0.clone().requires_grad_(true);
  const Tensor yc = f(xc);
  ASSERT_TRUE(yc.requires_grad());
  EXPECT_EQ(yc.grad_fn()->name(), "CompiledFunctionBackward");
  const Tensor go = randn({3, 4});
  autograd::backward({yc}, {go});
  const Tensor gw = fc->weight.grad().clone(), gb = fc->bias.grad().clone();
  fc->zero_grad();
  const Tensor ye = fn(xe);
  autograd::backward({ye}, {go});
  EXPECT_TRUE(allclose(yc, ye, 1e-6, 1e-6));
  EXPECT_TRUE(allclose(xc.grad(), xe.grad(), 1e-5, 1e-6));
  EXPECT_TRUE(allclose(gw, fc->weight.grad(), 1e-5, 1e-6));
  EXPECT_TRUE(allclose(gb, fc->bias.grad(), 1e-5, 1e-6));
  // The joint trace was split: a forward that saves, a backward that reads.
  bool has_backward = false;
  for (const auto& t : f.traces()) has_backward |= t.stage == "backward";
  EXPECT_TRUE(has_backward);
  // Without grad mode, the same signature but another program: no backward is traced.
  NoGradGuard no_grad;
  EXPECT_FALSE(f(x0).requires_grad());
}

// A compiled forward whose backward needs one of its own outputs (exp, tanh, softmax: the result is
// saved) hands out that output with the backward node as its grad_fn. The node must not hold the
// output's own handle, or output and node keep each other alive: a forward in grad mode whose
// backward never runs (an evaluation, an error in between) would keep its saved activations for
// good. Dropping the outputs frees them, on the traced call and on cached ones.
TEST(Compile, OutputsSavedForTheBackwardDoNotKeepTheirGraphAlive) {
  // relu saves its own result; on a transposed input, as the registry's samples run it.
  auto fn = [](const Tensor& x) { return x.relu(); };
  auto f = compile(fn);
  const Tensor x0 = randn({3, 4}).t();
  {
    // What eager autograd does: the output and its node go with the output's last handle.
    const Tensor x = x0.detach().requires_grad_(true);
    std::weak_ptr<TensorImpl> output;
    std::weak_ptr<autograd::Node> node;
    {
      const Tensor y = fn(x);
      output = y.impl_ptr();
      node = y.grad_fn();
    }
    ASSERT_TRUE(output.expired() && node.expired()) << "eager autograd keeps its graph";
  }
  for (int call = 0; call < 3; ++call) {
    const Tensor x = x0.detach().requires_grad_(true);
    std::weak_ptr<TensorImpl> output;
    std::weak_ptr<autograd::Node> node;
    {
      const Tensor y = f(x);
      ASSERT_TRUE(y.requires_grad()) << call;
      ASSERT_EQ(y.grad_fn()->name(), "CompiledFunctionBackward");
      output = y.impl_ptr();
      node = y.grad_fn();
    }
    EXPECT_TRUE(output.expired()) << "call " << call << ": the output outlives its last handle";
    EXPECT_TRUE(node.expired()) << "call " << call << ": the backward node outlives its outputs";
  }
  // The backward still runs from the saved values.
  const Tensor xc = x0.detach().requires_grad_(true), xe = x0.detach().requires_grad_(true);
  const Tensor go = randn({4, 3});
  autograd::backward({f(xc)}, {go});
  autograd::backward({fn(xe)}, {go});
  EXPECT_TRUE(equal(xc.grad(), xe.grad()));
}

// A callable that returns its argument, or a tensor it captured, hands it back as eager code does:
// the same tensor, still a leaf without a grad_fn (not turned into an output of the compiled
// backward, which would also make it and the node hold each other), and the gradients through
// every output are eager's (found by LeakSanitizer on a random program that returned its input).
TEST(Compile, ReturnedArgumentsAndCapturedTensorsStayLeaves) {
  manual_seed(4);
  nn::Linear fc(3, 2);
  auto fn = [&](const std::vector<Tensor>& a) -> std::vector<Tensor> {
    return {F::softmax(fc(a[0]), 1), a[0], fc->weight};
  };
  auto f = compile(fn);
  const Tensor x0 = randn({4, 3});
  const std::vector<Tensor> w{randn({4, 2}), randn({4, 3}), randn({2, 3})};
  auto loss = [&](const std::vector<Tensor>& y) {
    return (y[0] * w[0]).sum() + (y[1] * w[1]).sum() + (y[2] * w[2]).sum();
  };
  for (int call = 0; call < 2; ++call) {
    Tensor x = x0.detach().requires_grad_(true);
    std::weak_ptr<TensorImpl> arg = x.impl_ptr();
    std::weak_ptr<autograd::Node> node;
    {
      const std::vector<Tensor> y = f(std::vector<Tensor>{x});
      EXPECT_EQ(y[1].impl(), x.impl()) << call;
      EXPECT_EQ(y[2].impl(), fc->weight.impl()) << call;
      EXPECT_TRUE(x.is_leaf() && x.grad_fn() == nullptr) << call;
      EXPECT_TRUE(fc->weight.is_leaf() && fc->weight.grad_fn() == nullptr) << call;
      EXPECT_EQ(y[0].grad_fn()->name(), "CompiledFunctionBackward") << call;
      node = y[0].grad_fn();
      fc->zero_grad();
      loss(y).backward();
      const Tensor gx = x.grad().clone(), gw = fc->weight.grad().clone();
      fc->zero_grad();
      const Tensor xe = x0.detach().requires_grad_(true);
      loss(fn(std::vector<Tensor>{xe})).backward();
      EXPECT_TRUE(allclose(gx, xe.grad(), 1e-5, 1e-6)) << call;
      EXPECT_TRUE(allclose(gw, fc->weight.grad(), 1e-5, 1e-6)) << call;
    }
    x = Tensor();
    EXPECT_TRUE(arg.expired()) << "call " << call << ": the argument outlives its last handle";
    EXPECT_TRUE(node.expired()) << "call " << call << ": the backward node outlives its outputs";
  }
}

// Deterministic algorithms (tensor/deterministic.h) change kernel choices, so they are part of a
// compiled function's signature: toggling them traces again, and the reason names them.
TEST(Compile, DeterministicAlgorithmsArePartOfTheSignature) {
  auto f = compile([](const Tensor& x) { return (x * 2).sum(); });
  const Tensor x = randn({4, 3});
  EXPECT_FALSE(are_deterministic_algorithms_enabled());
  (void)f(x);
  {
    DeterministicGuard on(true);
    EXPECT_TRUE(are_deterministic_algorithms_enabled());
    EXPECT_TRUE(equal(f(x), (x * 2).sum()));
    (void)f(x);
  }
  EXPECT_FALSE(are_deterministic_algorithms_enabled());
  (void)f(x);
  EXPECT_EQ(f.stats().misses, 2);
  EXPECT_EQ(f.stats().hits, 2);
  bool named = false;
  for (const std::string& why : f.stats().recompile_reasons)
    named |= why.find("deterministic algorithms") != std::string::npos;
  EXPECT_TRUE(named);
}

// Attention whose lse is not in the loss: the tracer runs the autograd engine, whose zeros for
// lse's absent gradient the backward rule replaces by an undefined dlse, an absent input (`_`)
// of the traced flash_attention_backward; the gradients match eager's bitwise.
TEST(Compile, AbsentLseGradientIsAnUndefinedInputOfTheTracedBackward) {
  manual_seed(14);
  auto fn = [](const Tensor& q, const Tensor& k, const Tensor& v) {
    return F::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, std::nullopt,
                                           /*enable_gqa=*/true);
  };
  auto f = compile(fn);
  const Tensor q0 = randn({1, 4, 6, 8}, kDouble), k0 = randn({1, 2, 6, 8}, kDouble),
               v0 = randn({1, 2, 6, 8}, kDouble), dy = randn({1, 4, 6, 8}, kDouble);
  const auto leaf = [](const Tensor& t) { return t.detach().requires_grad_(true); };
  const Tensor qc = leaf(q0), kc = leaf(k0), vc = leaf(v0), qe = leaf(q0), ke = leaf(k0),
               ve = leaf(v0);
  const autograd::variable_list gc = autograd::grad({f(qc, kc, vc)}, {qc, kc, vc}, {dy});
  const autograd::variable_list ge = autograd::grad({fn(qe, ke, ve)}, {qe, ke, ve}, {dy});
  for (int i = 0; i < 3; ++i) expect_equal(gc[i], ge[i]);
  int backward_ops = 0;
  for (const compiler::Trace& t : f.traces()) {
    for (const auto& op : t.ops) {
      if (op.name() != "flash_attention_backward") continue;
      ++backward_ops;
      ASSERT_EQ(op.inputs.size(), 7u);
      EXPECT_EQ(op.inputs[6], -1) << "dlse should be absent in stage " << t.stage << ":\n"
                                  << t.str();
    }
  }
  EXPECT_GT(backward_ops, 0) << f.traces().front().str();
}

TEST(Compile, DecomposePassExpandsFusedOps) {
  manual_seed(13);
  const Tensor x = randn({4, 16}), w = randn({16});
  auto fn = [](const Tensor& a, const Tensor& b) {
    return F::rms_norm(a, F::RMSNormFuncOptions({16}).weight(b).eps(1e-6)) + 1.0;
  };
  auto whole = compile(fn);
  auto expanded = compile(fn, CompileOptions().decompose({"rms_norm"}));
  EXPECT_TRUE(allclose(expanded(x, w), whole(x, w), 1e-5, 1e-6));
  auto count = [](const compiler::Trace& t, const std::string& name) {
    int n = 0;
    for (const auto& op : t.ops) n += op.name() == name;
    return n;
  };
  EXPECT_EQ(count(whole.traces().back(), "rms_norm"), 1);
  EXPECT_EQ(count(expanded.traces().back(), "rms_norm"), 0) << expanded.traces().back().str();
  EXPECT_GT(expanded.traces().back().ops.size(), 3u);
  EXPECT_KILN_ERROR(CompileOptions().decompose({"add"}), "add has no decomposition");
}

// A small MLP's training step, compiled and eager, from the same initial weights.
struct Mlp {
  nn::Linear a{nullptr}, b{nullptr};
  explicit Mlp(uint64_t seed) {
    manual_seed(seed);
    a = nn::Linear(6, 16);
    b = nn::Linear(16, 3);
  }
  std::vector<Tensor> parameters() const { return {a->weight, a->bias, b->weight, b->bias}; }
  Tensor loss(const Tensor& x, const Tensor& y) const { return F::cross_entropy(b(relu(a(x))), y); }
};

// SGD's update through its decomposition (how it runs on a GPU, where sgd_update_ has no
// kernel), compiled, with a scheduler changing the lr at every step: the program reads the lr
// tensor at every run rather than the number it held while tracing.
TEST(Compile, SgdDecompositionFollowsTheScheduler) {
  manual_seed(8);
  for (const double momentum : {0.0, 0.9}) {
    const Tensor init = randn({6, 5});
    Tensor pc = init.clone().requires_grad_(true), pe = init.clone().requires_grad_(true);
    const auto options = optim::SGDOptions(0.1).momentum(momentum).weight_decay(0.01);
    optim::SGD opt_c({pc}, options), opt_e({pe}, options);
    auto decay = [](int64_t step) { return 1.0 / (1.0 + static_cast<double>(step)); };
    optim::LambdaLR sched_c(opt_c, decay), sched_e(opt_e, decay);
    auto update = compile([&]() { opt_c.step(); }, CompileOptions().decompose({"sgd_update_"}));
    for (int k = 0; k < 5; ++k) {
      const Tensor g = randn({6, 5});
      // The program reads the gradient it captured: written in place after the first step.
      Tensor& grad = pc.mutable_grad();
      if (grad.defined()) {
        grad.copy_(g);
      } else {
        grad = g.clone();
      }
      pe.mutable_grad() = g.clone();
      update();
      opt_e.step();  // the CPU kernel
      sched_c.step();
      sched_e.step();
      EXPECT_TRUE(allclose(pc.detach(), pe.detach(), 1e-6, 1e-7))
          << "momentum " << momentum << ", step " << k + 1 << "\n"
          << update.traces().back().str();
    }
    EXPECT_GE(update.stats().hits, 2);
    bool decomposed = true;
    for (const auto& op : update.traces().back().ops) decomposed &= op.name() != "sgd_update_";
    EXPECT_TRUE(decomposed) << update.traces().back().str();
  }
}

TEST(Compile, TrainingStepMatchesEager) {
  Mlp eager(11), compiled(11);
  optim::SGD opt_e(eager.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  optim::SGD opt_c(compiled.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  auto step_fn = [](Mlp& m, optim::SGD& opt, const Tensor& x, const Tensor& y) {
    opt.zero_grad();
    Tensor loss = m.loss(x, y);
    loss.backward();
    opt.step();
    return loss;
  };
  auto step =
      compile([&](const Tensor& x, const Tensor& y) { return step_fn(compiled, opt_c, x, y); });
  manual_seed(5);
  const Tensor x = randn({8, 6}), y = randint(0, 3, {8});
  for (int i = 0; i < 5; ++i) {
    const Tensor want = step_fn(eager, opt_e, x, y);
    const Tensor got = step(x, y);
    expect_equal(got, want);
    for (size_t p = 0; p < 4; ++p) {
      expect_equal(compiled.parameters()[p], eager.parameters()[p]);
      expect_equal(compiled.parameters()[p].grad(), eager.parameters()[p].grad());
    }
  }
  // Step 1 created the momentum buffers (zeros(), recorded, kept in the optimizer's state): it
  // ran as traced and step 2 is traced again; steps 3-5 replay step 2's program.
  EXPECT_EQ(step.stats().misses, 2);
  EXPECT_EQ(step.stats().hits, 3);
  ASSERT_EQ(step.stats().recompile_reasons.size(), 1u);
  EXPECT_NE(step.stats().recompile_reasons[0].find("created state that outlives it"),
            std::string::npos)
      << step.stats().recompile_reasons[0];
  const std::string listing = step.traces().front().str();
  EXPECT_NE(listing.find("sgd_update_("), std::string::npos) << listing;
  EXPECT_NE(listing.find(".grad = "), std::string::npos) << listing;
}

// A first call that creates state the callable keeps (a lazily built table, as a model's RoPE
// cache) still gives outputs with a compiled backward, and so does every later call.
TEST(Compile, FirstCallCreatingStateStillHasAGradFn) {
  Tensor table;  // built on the first call, kept afterwards
  auto fn = [&](const Tensor& x) {
    if (!table.defined()) table = arange(0, 8, kFloat) * 0.5 + 1.0;
    return (x * table).sigmoid().sum();
  };
  auto f = compile(fn);
  const Tensor x0 = randn({4, 8});
  Tensor eager_table = arange(0, 8, kFloat) * 0.5 + 1.0;
  for (int call = 0; call < 3; ++call) {
    Tensor xc = x0.clone().requires_grad_(true), xe = x0.clone().requires_grad_(true);
    Tensor yc = f(xc);
    ASSERT_TRUE(yc.requires_grad()) << "call " << call;
    yc.backward();
    Tensor ye = (xe * eager_table).sigmoid().sum();
    ye.backward();
    expect_equal(yc, ye);
    expect_equal(xc.grad(), xe.grad());
  }
  ASSERT_TRUE(table.defined());
  expect_equal(table, eager_table);
}

// A step that starts with zero_grad() drops the previous gradients when its program starts, as
// eager code does, rather than holding them until the new ones are assigned at its end (a whole
// second set of gradients in memory).
TEST(Compile, ReplacedGradientsAreDroppedWhenTheRunStarts) {
  Mlp m(13);
  optim::SGD opt(m.parameters(), optim::SGDOptions(0.1));
  static bool grads_seen = false;
  static int probes = 0;
  static std::vector<Tensor>* params = nullptr;
  std::vector<Tensor> ps = m.parameters();
  params = &ps;
  compiler::register_executor(compiler::make_op_executor(
      "grad_probe", {{"mm", [](OpCall& call) {
                        ++probes;
                        for (const Tensor& p : *params) grads_seen |= p.grad().defined();
                        call.outputs = {mm(call.input(0), call.input(1))};
                      }}}));
  auto step = compile(
      [&](const Tensor& x, const Tensor& y) {
        opt.zero_grad();
        Tensor loss = m.loss(x, y);
        loss.backward();
        opt.step();
        return loss;
      },
      CompileOptions().executors({"grad_probe", "eager"}));
  const Tensor x = randn({8, 6}), y = randint(0, 3, {8});
  for (int i = 0; i < 4; ++i) {
    grads_seen = false;
    step(x, y);
    EXPECT_FALSE(grads_seen) << "call " << i;
    for (const Tensor& p : ps) EXPECT_TRUE(p.grad().defined());
  }
  EXPECT_EQ(step.stats().hits, 3);
  EXPECT_GT(probes, 4);  // the probe ran in every call
}

}  // namespace
}  // namespace kiln
