// kiln::compile over the whole op registry: for every sample of tests/compiler/op_samples*.h,
// compiled == eager (bitwise: a compiled program replays the eager kernels), forward and
// gradients, and the second call is a cache hit. CompiledRegistryCoverage checks that the
// samples' traces name every registry op, or that the op is excluded below with the reason: a new
// op fails it until it gets a sample, as tests/autograd/coverage_test.cpp does for gradchecks.
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "op_samples_nn.h"
#include "test_util.h"

namespace kiln::compiler_test {
namespace {

constexpr uint64_t kInputSeed = 1234;
constexpr uint64_t kRunSeed = 77;
constexpr uint64_t kWeightSeed = 99;

// Ops no sample can trace, and why.
const std::map<std::string, std::string> kExcluded = {
    {"nonzero", "data-dependent output shape (boolean-mask indexing runs it): compiling fails"},
    {"masked_select", "data-dependent output shape: compiling fails"},
};

std::string listing(const std::vector<compiler::Trace>& traces) {
  std::string s;
  for (const auto& t : traces) s += "--- stage " + t.stage + " ---\n" + t.str() + "\n";
  return s;
}

void collect_op_names(const std::vector<compiler::Trace>& traces, std::set<std::string>& names) {
  for (const auto& t : traces) {
    for (const auto& op : t.ops) names.insert(op.name());
  }
}

// Fresh handles to the inputs (the same storage: samples write only clones), floating ones
// requiring grad when `grad`.
Tensors leaves(const Tensors& inputs, bool grad) {
  Tensors out;
  for (const Tensor& t : inputs) {
    Tensor c = t.detach();
    if (grad && c.is_floating_point()) c.requires_grad_(true);
    out.push_back(c);
  }
  return out;
}

bool has_floating(const Tensors& ts) {
  for (const Tensor& t : ts) {
    if (t.is_floating_point()) return true;
  }
  return false;
}

// "" when `got` matches `want`; else what differs. A float mismatch within a tight tolerance is
// noted in `inexact` rather than failed (the kernels are the same, so bitwise equality is
// expected: the test prints each such case).
std::string compare(const Tensor& got, const Tensor& want, const std::string& what,
                    std::vector<std::string>& inexact) {
  if (got.defined() != want.defined()) {
    return what + (got.defined() ? ": defined compiled, undefined eager"
                                 : ": undefined compiled, defined eager");
  }
  if (!got.defined()) return "";
  if (got.sizes() != want.sizes() || got.dtype() != want.dtype()) {
    return what + ": compiled " + compiler::spec_str(compiler::spec_of(got)) + " vs eager " +
           compiler::spec_str(compiler::spec_of(want));
  }
  NoGradGuard no_grad;
  if (equal(got, want)) return "";
  if (got.is_floating_point() && allclose(got, want, 1e-5, 1e-6)) {
    inexact.push_back(what);
    return "";
  }
  std::ostringstream os;
  os << what << " differs:\ncompiled:\n" << got << "\neager:\n" << want;
  return os.str();
}

// sum_i (outputs[i] * weights[i]).sum() over the outputs that require grad.
Tensor weighted_sum(const Tensors& outputs, const Tensors& weights) {
  Tensor loss;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!weights[i].defined() || !outputs[i].requires_grad()) continue;
    const Tensor term = (outputs[i] * weights[i]).sum();
    loss = loss.defined() ? loss + term : term;
  }
  return loss;
}

// Runs `fn` on `inputs` from the sample's seed (random samples draw the same numbers each run).
template <typename Fn>
Tensors run(const OpSample& s, const Tensors& inputs, Fn& fn) {
  if (s.random) manual_seed(kRunSeed);
  return fn(inputs);
}

// The checks of one sample; failures name the sample and print the traced stages.
class SampleCheck {
 public:
  explicit SampleCheck(const OpSample& s) : s_(s) {
    manual_seed(kInputSeed);
    inputs_ = s.inputs();
  }

  // Forward, inputs not requiring grad: compiled twice (the second call a hit) against eager.
  void forward() {
    auto f = compile(s_.fn, CompileOptions().name(s_.name));
    const Tensors want = run(s_, leaves(inputs_, false), s_.fn);
    const RngState eager_rng = get_rng_state();
    for (int call = 0; call < 2; ++call) {
      const Tensors got = run(s_, leaves(inputs_, false), f);
      const std::string where = "call " + std::to_string(call + 1) + ", ";
      if (s_.random && get_rng_state().offset != eager_rng.offset) {
        fail(where + "the generator's offset differs from eager's", f.traces());
      }
      compare_all(got, want, where + "output ", f.traces());
    }
    if (f.stats().hits != 1 || f.stats().misses != 1) {
      fail("expected 1 miss then 1 hit, got " + std::to_string(f.stats().misses) + " misses, " +
               std::to_string(f.stats().hits) + " hits",
           f.traces());
    }
  }

  // Gradients of sum(outputs * fixed random weights) w.r.t. the floating inputs.
  void gradients() {
    if (!s_.grad || !has_floating(inputs_)) return;
    auto f = compile(s_.fn, CompileOptions().name(s_.name));
    const Tensors xe = leaves(inputs_, true), xc = leaves(inputs_, true);
    const Tensors oe = run(s_, xe, s_.fn);
    const Tensors oc = run(s_, xc, f);
    compare_all(oc, oe, "with grad, output ", f.traces());
    Tensors weights;
    manual_seed(kWeightSeed);
    for (const Tensor& o : oe) {
      weights.push_back(o.requires_grad() ? randn(o.sizes(), o.dtype()) : Tensor());
    }
    for (size_t i = 0; i < oc.size() && i < oe.size(); ++i) {
      if (oc[i].requires_grad() != oe[i].requires_grad()) {
        fail("output " + std::to_string(i) + " requires grad " +
                 std::to_string(oc[i].requires_grad()) + " (compiled) vs " +
                 std::to_string(oe[i].requires_grad()) + " (eager)",
             f.traces());
        return;
      }
      if (oc[i].requires_grad() && oc[i].grad_fn()->name() != "CompiledFunctionBackward") {
        fail("output " + std::to_string(i) + "'s grad_fn is " + oc[i].grad_fn()->name(),
             f.traces());
      }
    }
    const Tensor loss_e = weighted_sum(oe, weights), loss_c = weighted_sum(oc, weights);
    if (!loss_e.defined()) return;  // no differentiable output (comparisons, indices)
    loss_e.backward();
    loss_c.backward();
    for (size_t i = 0; i < xe.size(); ++i) {
      if (!xe[i].requires_grad()) continue;
      const std::string what = "grad of input " + std::to_string(i);
      const std::string diff = compare(xc[i].grad(), xe[i].grad(), what, inexact_);
      if (!diff.empty()) fail(diff, f.traces());
    }
  }

  const std::vector<std::string>& inexact() const { return inexact_; }

 private:
  void compare_all(const Tensors& got, const Tensors& want, const std::string& what,
                   const std::vector<compiler::Trace>& traces) {
    if (got.size() != want.size()) {
      fail(
          what + "count " + std::to_string(got.size()) + " vs eager " + std::to_string(want.size()),
          traces);
      return;
    }
    for (size_t i = 0; i < got.size(); ++i) {
      const std::string diff = compare(got[i], want[i], what + std::to_string(i), inexact_);
      if (!diff.empty()) fail(diff, traces);
    }
  }

  void fail(const std::string& what, const std::vector<compiler::Trace>& traces) const {
    ADD_FAILURE() << "[" << s_.name << "] " << what << "\n" << listing(traces);
  }

  const OpSample& s_;
  Tensors inputs_;
  std::vector<std::string> inexact_;
};

// The op names in the traces of every stage of `s`, compiled with and without gradients.
std::set<std::string> traced_ops(const OpSample& s) {
  std::set<std::string> names;
  manual_seed(kInputSeed);
  const Tensors inputs = s.inputs();
  for (bool grad : {false, true}) {
    if (grad && (!s.grad || !has_floating(inputs))) continue;
    auto f = compile(s.fn, CompileOptions().name(s.name));
    (void)run(s, leaves(inputs, grad), f);
    collect_op_names(f.traces(), names);
  }
  return names;
}

class CompiledRegistry : public ::testing::TestWithParam<OpSample> {};

TEST_P(CompiledRegistry, MatchesEager) {
  SampleCheck check(GetParam());
  try {
    check.forward();
    check.gradients();
  } catch (const Error& e) {
    ADD_FAILURE() << "[" << GetParam().name << "] " << e.what();
  }
  for (const std::string& what : check.inexact()) {
    std::cout << "[" << GetParam().name << "] " << what
              << ": not bitwise equal to eager (within rtol 1e-5, atol 1e-6)" << std::endl;
  }
}

INSTANTIATE_TEST_SUITE_P(Samples, CompiledRegistry, ::testing::ValuesIn(all_samples()),
                         [](const ::testing::TestParamInfo<OpSample>& info) {
                           return info.param.name;
                         });

TEST(CompiledRegistryCoverage, EveryOpIsTracedOrExcluded) {
  std::set<std::string> seen;
  for (const OpSample& s : all_samples()) {
    try {
      const std::set<std::string> ops = traced_ops(s);
      seen.insert(ops.begin(), ops.end());
    } catch (const Error& e) {
      ADD_FAILURE() << "[" << s.name << "] does not compile: " << e.what();
    }
  }
  const std::vector<std::string> names = Registry::get().names();
  std::vector<std::string> missing, stale;
  int64_t traced = 0;
  for (const std::string& name : names) {
    if (Registry::get().entry(name).meta == nullptr) continue;
    if (seen.count(name)) {
      ++traced;
    } else if (!kExcluded.count(name)) {
      missing.push_back(name);
    }
  }
  for (const auto& [name, reason] : kExcluded) {
    if (std::ranges::find(names, name) == names.end() || seen.count(name)) stale.push_back(name);
  }
  std::cout << "compiled == eager coverage: " << traced << " of " << names.size()
            << " registry ops traced by " << all_samples().size() << " samples, "
            << kExcluded.size() << " excluded" << std::endl;
  RecordProperty("compiled_coverage",
                 std::to_string(traced) + " of " + std::to_string(names.size()));
  std::string list;
  for (const auto& m : missing) list += " " + m;
  EXPECT_TRUE(missing.empty()) << "registry ops no sample traces (add one to "
                               << "tests/compiler/op_samples*.h, or exclude it with the reason):"
                               << list;
  list.clear();
  for (const auto& m : stale) list += " " + m;
  EXPECT_TRUE(stale.empty()) << "excluded but traced, or not registry ops:" << list;
}

// The excluded ops: their output shapes depend on data, so tracing them is a clear error.
TEST(CompiledRegistryCoverage, DataDependentOpsFailToCompile) {
  for (const auto& [name, reason] : kExcluded) {
    EXPECT_EQ(Registry::get().entry(name).kind, OpKind::kDynamic) << name << ": " << reason;
  }
  for (const std::string& name : Registry::get().names()) {
    if (Registry::get().entry(name).kind == OpKind::kDynamic) {
      EXPECT_TRUE(kExcluded.count(name)) << name << " is dynamic but has no exclusion";
    }
  }
  auto nz = compile([](const Tensor& x) { return x.index({x > 0.0}); });
  EXPECT_KILN_ERROR(nz(randn({4})), "[nonzero] the shape of its output depends on the values");
  auto ms = compile([](const Tensor& x) { return x.masked_select(x > 0.0); });
  EXPECT_KILN_ERROR(ms(randn({4})),
                    "[masked_select] the shape of its output depends on the values");
}

// adam_update_ and increment_ as optim::Adam's step runs them: a compiled training step against
// the eager one, from the same weights (the optimizer's state is created by the first call).
TEST(CompiledRegistryOptim, AdamStepMatchesEager) {
  auto make = [] {
    manual_seed(21);
    return nn::Linear(5, 3);
  };
  nn::Linear eager = make(), compiled = make();
  optim::Adam opt_e(eager->parameters(), optim::AdamOptions(0.01).weight_decay(0.1));
  optim::Adam opt_c(compiled->parameters(), optim::AdamOptions(0.01).weight_decay(0.1));
  auto step_fn = [](nn::Linear& m, optim::Adam& opt, const Tensor& x) {
    opt.zero_grad();
    Tensor loss = m(x).square().mean();
    loss.backward();
    opt.step();
    return loss;
  };
  auto step = compile([&](const Tensor& x) { return step_fn(compiled, opt_c, x); });
  manual_seed(22);
  const Tensor x = randn({4, 5});
  for (int i = 0; i < 4; ++i) {
    const Tensor want = step_fn(eager, opt_e, x);
    const Tensor got = step(x);
    EXPECT_TRUE(equal(got, want)) << "step " << i << "\n" << listing(step.traces());
    const auto pe = eager->parameters(), pc = compiled->parameters();
    for (size_t p = 0; p < pe.size(); ++p) {
      EXPECT_TRUE(equal(pc[p], pe[p])) << "step " << i << ", parameter " << p;
    }
  }
  std::set<std::string> ops;
  collect_op_names(step.traces(), ops);
  EXPECT_TRUE(ops.count("adam_update_") && ops.count("increment_")) << listing(step.traces());
  EXPECT_EQ(step.stats().hits, 2);
}

// --- Compiler bugs the samples found, kept as regression tests.

// cse must not merge two clones of one tensor when one of them is then written in place (the
// other would read the new contents: 2x + 2 instead of 2x + 1). adam_update_ with
// max_exp_avg_sqs and exp_avg_sqs cloned from one tensor met it.
TEST(CompiledRegistryBugs, CseKeepsClonesWrittenInPlaceApart) {
  auto fn = [](const Tensor& x) {
    Tensor p = x.clone(), q = x.clone();
    p.add_(1.0);
    return p + q;
  };
  auto f = compile(fn);
  const Tensor x = randn({3});
  EXPECT_TRUE(equal(f(x), fn(x))) << listing(f.traces());
}

}  // namespace
}  // namespace kiln::compiler_test
