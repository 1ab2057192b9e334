// What changes from one optimizer step to the next lives in tensors that the update ops take as
// inputs, so that kiln::compile can record a step's op calls once and replay them with their
// attributes frozen: each parameter's step count (a 0-d int64 CPU tensor in its state, advanced
// by one increment_ call per update call) and each group's lr (a 0-d f64 CPU tensor its options
// own, written in place by set_lr and the schedulers). Checked here: the op calls a step makes
// (recorded through the dispatcher), the tensors' identity and values across steps, copies of
// options, checkpoints, and recorded calls replayed against live steps under an lr schedule.
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <memory>
#include <string>
#include <vector>

#include "nn/optim/adam.h"
#include "nn/optim/adamw.h"
#include "nn/optim/lr_scheduler.h"
#include "nn/optim/sgd.h"
#include "tensor/registry.h"
#include "test_util.h"

namespace kiln {
namespace {

using optim::Adam;
using optim::AdamOptions;
using optim::AdamW;
using optim::AdamWOptions;
using optim::OptimizerParamGroup;
using optim::SGD;
using optim::SGDOptions;

// Records the optimizer op calls dispatched while alive (inputs and attributes, as a tracer
// would), letting every call run.
class OptimCallRecorder {
 public:
  OptimCallRecorder() {
    calls().clear();
    set_dispatch_handler(DispatchKey::Trace, &handler_);
  }
  ~OptimCallRecorder() { set_dispatch_handler(DispatchKey::Trace, nullptr); }
  OptimCallRecorder(const OptimCallRecorder&) = delete;
  OptimCallRecorder& operator=(const OptimCallRecorder&) = delete;

  static std::vector<OpCall>& calls() {
    static std::vector<OpCall> c;
    return c;
  }
  static std::vector<std::string> names() {
    std::vector<std::string> out;
    for (const OpCall& c : calls()) out.push_back(c.name());
    return out;
  }

 private:
  static bool active(const OpCall& call) {
    const std::string& name = call.name();
    if (name == "increment_" || name == "adam_update_" || name == "sgd_update_") {
      OpCall copy;
      copy.op = call.op;
      copy.inputs = call.inputs;
      copy.attrs = call.attrs;
      calls().push_back(std::move(copy));
    }
    return false;  // only watch: the call continues down the chain
  }
  DispatchHandler handler_{&active, nullptr};
};

// Runs recorded calls again, with the tensors and the attributes they were recorded with.
void replay(const std::vector<OpCall>& calls) {
  NoGradGuard no_grad;
  for (const OpCall& c : calls) call_op(*c.op, c.inputs, c.attrs);
}

// increment_'s inputs are exactly the state_steps of the adam_update_ call after it (n each).
void expect_increment_feeds_update(const OpCall& inc, const OpCall& update, size_t n) {
  ASSERT_EQ(inc.inputs.size(), n);
  const size_t lists = (update.inputs.size() - 1) / n;  // params, ..., state_steps; then lr
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(inc.inputs[i].impl(), update.inputs[(lists - 1) * n + i].impl()) << i;
  }
}

void expect_host_count(const Tensor& step, int64_t want) {
  EXPECT_EQ(step.dtype(), kInt64);
  EXPECT_EQ(step.dim(), 0);
  EXPECT_TRUE(step.is_cpu());
  EXPECT_EQ(step.item<int64_t>(), want);
}

Tensor scalar_param(double v, ScalarType dtype) { return full({1}, v, dtype).requires_grad_(); }

// One AdamW step over two groups (f32 and f64 parameters in group 0: two update calls) makes,
// per update call, one increment_ call for its step counts and one adam_update_ call that takes
// them and the group's lr tensor; the counts are the same tensors at every step.
TEST(OptimReplay, AdamStepCountsAdvanceByOneIncrementPerUpdateCall) {
  manual_seed(5);
  std::vector<Tensor> p = {randn({3}).requires_grad_(), randn({2}, kFloat64).requires_grad_(),
                           randn({5}).requires_grad_(), randn({4}).requires_grad_()};
  std::vector<OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<Tensor>{p[0], p[1], p[2]});
  groups.emplace_back(std::vector<Tensor>{p[3]},
                      std::make_unique<AdamWOptions>(AdamWOptions(0.01).amsgrad(true)));
  AdamW opt(groups, AdamWOptions(0.1));
  const std::vector<std::string> want = {"increment_",   "adam_update_", "increment_",
                                         "adam_update_", "increment_",   "adam_update_"};
  std::vector<const TensorImpl*> step_impls;
  for (int s = 1; s <= 3; ++s) {
    for (Tensor& t : p) t.mutable_grad() = randn(t.sizes(), t.dtype());
    {
      OptimCallRecorder rec;
      opt.step();
    }
    ASSERT_EQ(OptimCallRecorder::names(), want) << "step " << s;
    const std::vector<OpCall>& calls = OptimCallRecorder::calls();
    expect_increment_feeds_update(calls[0], calls[1], 2);  // group 0, f32: p[0], p[2]
    expect_increment_feeds_update(calls[2], calls[3], 1);  // group 0, f64: p[1]
    expect_increment_feeds_update(calls[4], calls[5], 1);  // group 1
    const TensorImpl* lr0 = opt.param_groups()[0].options().lr_tensor().impl();
    EXPECT_EQ(calls[1].inputs.back().impl(), lr0);
    EXPECT_EQ(calls[3].inputs.back().impl(), lr0);
    EXPECT_EQ(calls[5].inputs.back().impl(), opt.param_groups()[1].options().lr_tensor().impl());
    for (size_t i = 0; i < p.size(); ++i) {
      const Tensor& step = opt.state().at(p[i].impl()).step;
      expect_host_count(step, s);
      if (s == 1) {
        step_impls.push_back(step.impl());
      } else {
        EXPECT_EQ(step.impl(), step_impls[i]) << "parameter " << i << ": advanced in place";
      }
    }
  }
  SafetensorsMetadata meta;
  (void)opt.state_dict(&meta);
  EXPECT_EQ(meta.at("state.1.step"), "3");  // saved as a number, as before
}

TEST(OptimReplay, SgdStepCountsAdvanceByOneIncrementPerUpdateCall) {
  Tensor a = scalar_param(1.0, kFloat32);
  Tensor b = scalar_param(2.0, kFloat32);
  SGD opt({a, b}, SGDOptions(0.1).momentum(0.9));
  for (int s = 1; s <= 2; ++s) {
    a.mutable_grad() = full({1}, 1.0);
    b.mutable_grad() = full({1}, 1.0);
    {
      OptimCallRecorder rec;
      opt.step();
    }
    ASSERT_EQ(OptimCallRecorder::names(), (std::vector<std::string>{"increment_", "sgd_update_"}));
    const std::vector<OpCall>& calls = OptimCallRecorder::calls();
    ASSERT_EQ(calls[0].inputs.size(), 2u);
    EXPECT_EQ(calls[0].inputs[0].impl(), opt.state().at(a.impl()).step.impl());
    EXPECT_EQ(calls[0].inputs[1].impl(), opt.state().at(b.impl()).step.impl());
    EXPECT_EQ(calls[1].inputs.back().impl(), opt.param_groups()[0].options().lr_tensor().impl());
    expect_host_count(opt.state().at(a.impl()).step, s);
  }
}

// Each group's lr is a 0-d f64 CPU tensor its options own: set_lr and lr(v) write it in place;
// no two groups (nor the defaults) share one, and copies of options get their own.
TEST(OptimReplay, LrLivesInTheGroupsOwnTensor) {
  std::vector<OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<Tensor>{scalar_param(1.0, kFloat64)});
  groups.emplace_back(std::vector<Tensor>{scalar_param(1.0, kFloat64)},
                      std::make_unique<AdamWOptions>(0.01));
  AdamW opt(groups, AdamWOptions(0.1));
  const Tensor lr0 = opt.param_groups()[0].options().lr_tensor();
  const Tensor lr1 = opt.param_groups()[1].options().lr_tensor();
  EXPECT_EQ(lr0.dtype(), kFloat64);
  EXPECT_EQ(lr0.dim(), 0);
  EXPECT_TRUE(lr0.is_cpu());
  EXPECT_EQ(lr0.item<double>(), 0.1);
  EXPECT_EQ(lr1.item<double>(), 0.01);
  EXPECT_NE(lr0.impl(), lr1.impl());
  EXPECT_NE(lr0.impl(), opt.defaults().lr_tensor().impl());

  const uint64_t version = lr0._version();
  opt.set_lr(0.02);
  EXPECT_EQ(lr0.item<double>(), 0.02);
  EXPECT_EQ(lr1.item<double>(), 0.02);
  EXPECT_GT(lr0._version(), version);  // a write others can see
  static_cast<AdamWOptions&>(opt.param_groups()[1].options()).lr(0.5);
  EXPECT_EQ(lr1.item<double>(), 0.5);
  EXPECT_EQ(lr0.item<double>(), 0.02);
  EXPECT_EQ(opt.defaults().get_lr(), 0.1);
  EXPECT_EQ(opt.param_groups()[0].options().lr_tensor().impl(), lr0.impl());

  // Copies: construction and clone() give a new tensor holding the value; assignment writes the
  // value into the target's own tensor.
  AdamWOptions a(0.1);
  AdamWOptions c = a;
  EXPECT_NE(c.lr_tensor().impl(), a.lr_tensor().impl());
  c.lr(0.2);
  EXPECT_EQ(a.lr(), 0.1);
  EXPECT_EQ(c.lr(), 0.2);
  const std::unique_ptr<optim::OptimizerOptions> cloned = a.clone();
  EXPECT_NE(cloned->lr_tensor().impl(), a.lr_tensor().impl());
  EXPECT_EQ(cloned->get_lr(), 0.1);
  const TensorImpl* a_impl = a.lr_tensor().impl();
  a = c;
  EXPECT_EQ(a.lr_tensor().impl(), a_impl);
  EXPECT_EQ(a.lr(), 0.2);
  a.lr(0.3);
  EXPECT_EQ(c.lr(), 0.2);
  SGDOptions s(0.5);
  SGDOptions t = s;
  t.set_lr(0.25);
  EXPECT_EQ(s.lr(), 0.5);
  EXPECT_EQ(s.lr_tensor().item<double>(), 0.5);
  EXPECT_EQ(t.lr_tensor().item<double>(), 0.25);
}

// load() creates the step tensors from the saved counts and writes the saved lrs into the
// groups' own tensors.
TEST(OptimReplay, LoadCreatesTheCountsAndKeepsTheLrTensors) {
  manual_seed(6);
  std::vector<Tensor> p = {randn({6}).requires_grad_(), randn({2}).requires_grad_()};
  AdamW a(p, AdamWOptions(0.03));
  for (int s = 0; s < 2; ++s) {
    p[0].mutable_grad() = randn({6});
    a.step();
  }
  SafetensorsMetadata meta;
  const TensorMap tensors = a.state_dict(&meta);
  std::vector<Tensor> q;
  for (const Tensor& t : p) q.push_back(t.detach().clone().requires_grad_());
  AdamW b(q, AdamWOptions(0.5));
  const Tensor lr = b.param_groups()[0].options().lr_tensor();
  b.load_state_dict(tensors, meta);
  expect_host_count(b.state().at(q[0].impl()).step, 2);
  EXPECT_EQ(b.state().count(q[1].impl()), 0u);  // never stepped: no state
  EXPECT_EQ(b.param_groups()[0].options().lr_tensor().impl(), lr.impl());
  EXPECT_EQ(lr.item<double>(), 0.03);
  q[0].mutable_grad() = randn({6});
  b.step();
  expect_host_count(b.state().at(q[0].impl()).step, 3);
}

// An lr schedule changes the update through the group's lr tensor: plain SGD with a constant
// gradient of 1 moves each step by that step's lr.
TEST(OptimReplay, SchedulerLrChangesTheUpdate) {
  Tensor p = scalar_param(1.0, kFloat64);
  SGD opt({p}, SGDOptions(0.1));
  optim::StepLR sched(opt, /*step_size=*/1, /*gamma=*/0.5);
  double want = 1.0;
  for (double lr : {0.1, 0.05, 0.025, 0.0125}) {
    EXPECT_EQ(opt.param_groups()[0].options().lr_tensor().item<double>(), lr);
    p.mutable_grad() = full({1}, 1.0, kFloat64);
    opt.step();
    want -= lr;
    EXPECT_EQ(p.item<double>(), want);
    sched.step();
  }
}

std::unique_ptr<optim::Optimizer> make_adam(bool decoupled, const Tensor& p) {
  if (decoupled) {
    return std::make_unique<AdamW>(std::vector<Tensor>{p},
                                   AdamWOptions(0.05).weight_decay(0.1).amsgrad(true));
  }
  return std::make_unique<Adam>(std::vector<Tensor>{p},
                                AdamOptions(0.05).weight_decay(0.1).amsgrad(true));
}

// What kiln::compile does with a training step: record the op calls of the first step, then
// replay them on later steps with their attributes frozen. The replayed Adam and AdamW (f32,
// amsgrad, weight decay) follow a cosine schedule with warmup and each step's bias correction
// exactly as live steps do; SGD with momentum follows a step schedule.
TEST(OptimReplay, ReplayedStepMatchesLiveStepsUnderASchedule) {
  for (int kind = 0; kind < 3; ++kind) {
    manual_seed(9);
    const Tensor init = randn({300});
    Tensor live = init.clone().requires_grad_();
    Tensor replayed = init.clone().requires_grad_();
    std::unique_ptr<optim::Optimizer> live_opt, replayed_opt;
    std::unique_ptr<optim::LRScheduler> live_sched, replayed_sched;
    if (kind < 2) {
      live_opt = make_adam(kind == 1, live);
      replayed_opt = make_adam(kind == 1, replayed);
      live_sched = std::make_unique<optim::CosineAnnealingWithWarmup>(*live_opt, 2, 6, 1e-3);
      replayed_sched =
          std::make_unique<optim::CosineAnnealingWithWarmup>(*replayed_opt, 2, 6, 1e-3);
    } else {
      live_opt = std::make_unique<SGD>(std::vector<Tensor>{live}, SGDOptions(0.1).momentum(0.9));
      replayed_opt =
          std::make_unique<SGD>(std::vector<Tensor>{replayed}, SGDOptions(0.1).momentum(0.9));
      live_sched = std::make_unique<optim::StepLR>(*live_opt, 2, 0.5);
      replayed_sched = std::make_unique<optim::StepLR>(*replayed_opt, 2, 0.5);
    }
    // SGD's first step creates its momentum buffers (new_buffers is an attribute): record the
    // second step.
    const int record_at = kind < 2 ? 0 : 1;
    std::vector<OpCall> recorded;
    for (int s = 0; s < 6; ++s) {
      const Tensor g = randn({300});
      live.mutable_grad() = g.clone();
      if (s < record_at) {
        replayed.mutable_grad() = g.clone();
        replayed_opt->step();
      } else if (s == record_at) {
        replayed.mutable_grad() = g.clone();
        OptimCallRecorder rec;
        replayed_opt->step();
        recorded = OptimCallRecorder::calls();
      } else {
        replayed.mutable_grad().copy_(g);  // the recorded grad tensor, written in place
        replay(recorded);
      }
      live_opt->step();
      live_sched->step();
      replayed_sched->step();
      EXPECT_TRUE(equal(live, replayed)) << "kind " << kind << " step " << s;
    }
    ASSERT_EQ(recorded.size(), 2u);
    expect_host_count(replayed_opt->state().at(replayed.impl()).step, 6);
    EXPECT_NE(replayed_opt->get_lr(), kind < 2 ? 0.05 : 0.1);  // the schedule moved it
  }
}

}  // namespace
}  // namespace kiln
