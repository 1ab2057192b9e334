// The functionalize pass (compiler/functionalize.h): which in-place ops become functional (the
// listing before and after), and compiled == eager bit for bit with the pass on and off, for
// writes to intermediates, through views, and to arguments and captured tensors (kept), and on
// 1000 random programs of such writes.
#include "compiler/functionalize.h"

#include <gtest/gtest.h>

#include <functional>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "compiler/compile.h"
#include "compiler/passes.h"
#include "compiler/tracer.h"
#include "trace_test_util.h"
#include "kiln.h"

namespace kiln {
namespace {

using compiler::Trace;
using test::count_ops;
using test::expect_bitwise;

Trace traced(const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& fn,
             const std::vector<Tensor>& args) {
  NoGradGuard no_grad;
  return compiler::trace_callable(fn, args).trace;
}

// Compiles `fn` with the pass on and off and checks both against eager on the same inputs; the
// inputs are cloned for each run (fn may write them). Returns the last compiled trace with the
// pass on.
Trace check_against_eager(const std::function<Tensor(const Tensor&, const Tensor&)>& fn) {
  manual_seed(7);
  const Tensor a = randn({4, 8}), b = randn({4, 8});
  Tensor ea = a.clone(), eb = b.clone();
  const Tensor want = fn(ea, eb);
  Trace last;
  for (bool on : {true, false}) {
    SCOPED_TRACE(on ? "functionalize on" : "functionalize off");
    CompileOptions options;
    if (!on) options.skip_pass("functionalize");
    auto f = compile(fn, options);
    for (int call = 0; call < 2; ++call) {  // traced, then the cached program
      Tensor ca = a.clone(), cb = b.clone();
      expect_bitwise(f(ca, cb), want, "result");
      expect_bitwise(ca, ea, "argument 0 after the call");
      expect_bitwise(cb, eb, "argument 1 after the call");
    }
    if (on) last = f.traces().back();
  }
  return last;
}

TEST(Functionalize, InplaceOpsOnIntermediatesBecomeFunctional) {
  auto fn = [](const std::vector<Tensor>& in) {
    Tensor t = in[0].exp();
    t.add_(in[1]);
    t.mul_(2.0);
    t.relu_();
    return std::vector<Tensor>{t.sum()};
  };
  const Trace before = traced(fn, {randn({4, 8}), randn({4, 8})});
  const Trace after = compiler::functionalize(before);
  const std::string listing = after.str();
  for (const char* inplace : {"add_", "mul_", "relu_"}) {
    EXPECT_EQ(count_ops(before, inplace), 1) << before.str();
    EXPECT_EQ(count_ops(after, inplace), 0) << listing;
  }
  EXPECT_NE(listing.find("# functionalize: 5 ops"), std::string::npos) << listing;
  EXPECT_NE(listing.find("t3 = add(t2, a1; 1)"), std::string::npos) << listing;
  EXPECT_NE(listing.find("t5 = mul(t3, p4; f32)"), std::string::npos) << listing;
  EXPECT_NE(listing.find("t6 = relu(t5)"), std::string::npos) << listing;
  EXPECT_EQ(compiler::functionalize(after).str(), listing) << "not idempotent";

  const Trace compiled = check_against_eager([](const Tensor& a, const Tensor& b) {
    Tensor t = a.exp();
    t.add_(b);
    t.mul_(2.0);
    t.relu_();
    return t.sum(1);
  });
  EXPECT_EQ(count_ops(compiled, "add_") + count_ops(compiled, "mul_"), 0) << compiled.str();
}

TEST(Functionalize, DeadWritesGoAndCseMergesMore) {
  // Two exps of one value, one of them written in place: without functionalization cse may not
  // merge them (the written one must stay its own tensor); with it, they merge.
  auto fn = [](const Tensor& a, const Tensor& b) {
    Tensor t1 = a.exp(), t2 = a.exp();
    t1.add_(b);
    Tensor dead = b * 3.0;
    dead.mul_(2.0);  // nothing reads it: dce drops the write once it is functional
    return t1 + t2;
  };
  const Trace compiled = check_against_eager(fn);
  EXPECT_EQ(count_ops(compiled, "exp"), 1) << compiled.str();
  EXPECT_EQ(count_ops(compiled, "mul") + count_ops(compiled, "mul_"), 0) << compiled.str();

  auto off = compile(fn, CompileOptions().skip_pass("functionalize"));
  (void)off(randn({4, 8}), randn({4, 8}));
  EXPECT_EQ(count_ops(off.traces().back(), "exp"), 2) << off.traces().back().str();
}

TEST(Functionalize, OldValueReadLaterKeepsTheWrite) {
  // v, half of t's storage, is read after the write: the write stays in place (a full view
  // would be rebuilt from the result, see WritesThroughViews).
  auto fn = [](const std::vector<Tensor>& in) {
    Tensor t = in[0].exp();
    Tensor v = t.narrow(0, 0, 2);
    t.add_(in[1]);
    return std::vector<Tensor>{v * 2.0, t};
  };
  const Trace after = compiler::functionalize(traced(fn, {randn({4, 8}), randn({4, 8})}));
  EXPECT_EQ(count_ops(after, "add_"), 1) << after.str();
  check_against_eager([](const Tensor& a, const Tensor& b) {
    Tensor t = a.exp();
    Tensor v = t.narrow(0, 0, 2);
    t.add_(b);
    return cat({v * 2.0, v}, 0) + t;
  });
}

TEST(Functionalize, WritesThroughViews) {
  // A full write through a view whose base is not read again becomes functional; a write
  // through a transposed view of a base read afterwards stays in place (see functionalize.h).
  auto through_view = [](const std::vector<Tensor>& in) {
    Tensor t = in[0].exp();
    Tensor v = t.view({32});
    v.mul_(2.0);
    return std::vector<Tensor>{v};
  };
  const Trace a = compiler::functionalize(traced(through_view, {randn({4, 8})}));
  EXPECT_EQ(count_ops(a, "mul_"), 0) << a.str();
  EXPECT_EQ(count_ops(a, "mul"), 1) << a.str();

  auto rebuilt = [](const std::vector<Tensor>& in) {
    Tensor t = in[0].exp();
    t.view({32}).mul_(2.0);  // a full write; t is read below
    return std::vector<Tensor>{t + in[0]};
  };
  const Trace r = compiler::functionalize(traced(rebuilt, {randn({4, 8})}));
  EXPECT_EQ(count_ops(r, "mul_"), 0) << r.str();
  EXPECT_NE(r.str().find("t6 = view(t4; [4, 8])"), std::string::npos) << r.str();
  EXPECT_NE(r.str().find("t5 = add(t6, a0; 1)"), std::string::npos) << r.str();

  auto base_read = [](const std::vector<Tensor>& in) {
    Tensor t = in[0].exp();
    t.transpose(0, 1).mul_(2.0);
    return std::vector<Tensor>{t + 1.0};
  };
  const Trace b = compiler::functionalize(traced(base_read, {randn({4, 8})}));
  EXPECT_EQ(count_ops(b, "mul_"), 1) << b.str();

  check_against_eager([](const Tensor& a, const Tensor& b) {
    Tensor t = a.exp();
    Tensor v = t.view({32});
    v.mul_(b.view({32}));
    Tensor u = (a + b).transpose(0, 1);
    u.mul_(2.0);  // u's base is read below
    Tensor w = a * b;
    w.transpose(0, 1).add_(1.0);
    Tensor x = a.exp();
    Tensor y = x.view({2, 16});
    y.view({32}).add_(b.view({32}));  // full writes: x and y are rebuilt from the result
    x.mul_(0.5);
    return v.view({4, 8}) + u.transpose(0, 1) + w + x + y.view({4, 8});
  });
}

TEST(Functionalize, WritesToArgumentsAndCapturedTensorsStay) {
  Tensor buffer = zeros({4, 8});
  auto fn = [&](const Tensor& arg, const Tensor& b) {
    Tensor a = arg;  // the same tensor
    a.mul_(2.0);     // an argument
    buffer.add_(b);  // a captured tensor
    Tensor v = a.view({32});
    v.add_(1.0);  // a view of an argument
    return a + buffer;
  };
  const Tensor x = randn({4, 8}), y = randn({4, 8});
  Tensor ex = x.clone();
  buffer.zero_();
  const Tensor want = fn(ex, y);
  const Tensor want_buffer = buffer.clone();
  buffer.zero_();
  auto f = compile(fn);
  Tensor cx = x.clone();
  expect_bitwise(f(cx, y), want, "result");
  expect_bitwise(cx, ex, "argument");
  expect_bitwise(buffer, want_buffer, "captured buffer");
  const Trace& t = f.traces().back();
  EXPECT_EQ(count_ops(t, "mul_"), 1) << t.str();
  EXPECT_EQ(count_ops(t, "add_"), 2) << t.str();
}

TEST(Functionalize, OpsWithoutACounterpartOrAnotherResultStay) {
  auto fn = [](const std::vector<Tensor>& in) {
    Tensor t = in[0].exp();
    t.fill_(3.0);  // no functional fill
    Tensor u = in[0].exp();
    u.add_(in[1]);  // f32 += f64: add would give f64
    return std::vector<Tensor>{t, u};
  };
  const Trace after =
      compiler::functionalize(traced(fn, {randn({4, 8}), randn({4, 8}).to(kDouble)}));
  EXPECT_EQ(count_ops(after, "fill_"), 1) << after.str();
  EXPECT_EQ(count_ops(after, "add_"), 1) << after.str();
}

// Random programs of in-place writes on intermediates, on views of them (full, strided and
// partial) and on an argument, with old values and views read afterwards: compiled (every
// program functionalized where the rules allow) == eager bit for bit, results and arguments.
std::vector<Tensor> random_writes(uint32_t seed, const Tensor& a_in, const Tensor& b) {
  std::mt19937 rng(seed);
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  Tensor a = a_in;
  std::vector<Tensor> pool = {a.sin(), a * b, b.cos() + 1.0};
  const int steps = 4 + static_cast<int>(rng() % 8);
  for (int s = 0; s < steps; ++s) {
    Tensor& t = pool[pick(pool.size())];
    switch (rng() % 9) {
      case 0:
        pool.push_back(t * 0.75 + 0.25);
        break;
      case 1:
        pool.push_back(t.numel() == 32 && t.is_contiguous() ? t.view({2, 16}) : t.sin());
        break;
      case 2:
        pool.push_back(t.dim() == 2 ? t.transpose(0, 1) : t.cos());
        break;
      case 3:
        pool.push_back(t.dim() == 2 && t.size(0) > 1 ? t.narrow(0, 0, 1) : t * 2.0);
        break;
      case 4:
        t.mul_(1.5);
        break;
      case 5:
        t.add_(0.5);
        break;
      case 6:
        t.relu_();
        break;
      case 7: {
        const Tensor& u = pool[pick(pool.size())];
        if (u.sizes() == t.sizes() && u.impl() != t.impl()) t.add_(u);
        break;
      }
      case 8:
        if (rng() % 4 == 0) a.add_(0.25);  // the argument: kept in place
        break;
    }
  }
  std::vector<Tensor> out;
  for (const Tensor& t : pool) out.push_back(t);
  return out;
}

TEST(Functionalize, RandomInplaceProgramsMatchEager) {
  int functionalized = 0;
  for (uint32_t seed = 0; seed < 1000; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    manual_seed(seed);
    const Tensor a = randn({4, 8}), b = randn({4, 8});
    Tensor ea = a.clone();
    const std::vector<Tensor> want = random_writes(seed, ea, b);
    auto f =
        compile([seed](const Tensor& x, const Tensor& y) { return random_writes(seed, x, y); });
    for (int call = 0; call < 2; ++call) {
      Tensor ca = a.clone();
      const std::vector<Tensor> got = f(ca, b);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < want.size(); ++i)
        expect_bitwise(got[i], want[i], "output " + std::to_string(i));
      expect_bitwise(ca, ea, "argument");
      if (HasFailure()) {
        for (const Trace& t : f.traces()) ADD_FAILURE() << t.str();
        return;
      }
    }
    auto inplace = [](const Trace& t) {
      int n = 0;
      for (const auto& op : t.ops) n += op.op->kind == OpKind::kInplace;
      return n;
    };
    for (size_t k = 1; k < f.traces().size(); ++k) {
      if (f.traces()[k].stage == "functionalize")
        functionalized += inplace(f.traces()[k - 1]) - inplace(f.traces()[k]);
    }
  }
  std::cout << "[functionalize] 1000 random programs: " << functionalized
            << " in-place ops made functional\n";
  EXPECT_GT(functionalized, 1000);
}

TEST(Functionalize, TrainingStepMatchesEager) {
  // SGD with momentum: parameter and buffer updates stay in place; the gradient arithmetic of
  // the backward (in-place accumulations on fresh tensors) becomes functional.
  struct Mlp {
    nn::Linear a{nullptr}, b{nullptr};
    Mlp() {
      manual_seed(3);
      a = nn::Linear(6, 16);
      b = nn::Linear(16, 3);
    }
    std::vector<Tensor> parameters() const { return {a->weight, a->bias, b->weight, b->bias}; }
  };
  Mlp eager, compiled;
  optim::SGD opt_e(eager.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  optim::SGD opt_c(compiled.parameters(), optim::SGDOptions(0.1).momentum(0.9));
  auto step_fn = [](Mlp& m, optim::SGD& opt, const Tensor& x, const Tensor& y) {
    opt.zero_grad();
    Tensor loss = nn::functional::cross_entropy(m.b(relu(m.a(x))), y);
    loss.backward();
    opt.step();
    return loss;
  };
  auto step =
      compile([&](const Tensor& x, const Tensor& y) { return step_fn(compiled, opt_c, x, y); });
  manual_seed(5);
  const Tensor x = randn({8, 6}), y = randint(0, 3, {8});
  for (int i = 0; i < 4; ++i) {
    expect_bitwise(step(x, y), step_fn(eager, opt_e, x, y), "loss");
    const auto pe = eager.parameters(), pc = compiled.parameters();
    for (size_t p = 0; p < pe.size(); ++p) {
      expect_bitwise(pc[p], pe[p], "parameter");
      expect_bitwise(pc[p].grad(), pe[p].grad(), "grad");
    }
  }
  EXPECT_GE(count_ops(step.traces().back(), "sgd_update_"), 1) << step.traces().back().str();
}

}  // namespace
}  // namespace kiln
