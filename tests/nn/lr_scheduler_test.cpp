// LR schedules against their formulas, written out in the test, over 20 steps and two
// parameter groups with different base lrs.
#include "nn/optim/lr_scheduler.h"

#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <cmath>
#include <functional>
#include <numbers>

#include "nn/optim/adamw.h"
#include "nn/optim/sgd.h"
#include "test_util.h"

namespace kiln {
namespace {

using optim::OptimizerParamGroup;
using optim::SGD;
using optim::SGDOptions;

constexpr int kSteps = 20;

// An SGD with two groups: base lrs 0.1 and 0.02.
struct TwoGroups {
  TwoGroups()
      : opt(
            [] {
              std::vector<OptimizerParamGroup> groups;
              groups.emplace_back(std::vector<Tensor>{zeros({2})});
              groups.emplace_back(std::vector<Tensor>{zeros({3})},
                                  std::make_unique<SGDOptions>(0.02));
              return groups;
            }(),
            SGDOptions(0.1)) {}
  SGD opt;
};

const double kBase[2] = {0.1, 0.02};

// Steps `sched` kSteps times (with an optimizer step before each, as in training) and checks
// each group's lr against want(step, base) at every step, including step 0.
void expect_schedule(optim::LRScheduler& sched, SGD& opt,
                     const std::function<double(int64_t, double)>& want) {
  for (int64_t t = 0; t <= kSteps; ++t) {
    if (t > 0) {
      opt.step();  // no gradients: a no-op, but the order users write
      sched.step();
    }
    EXPECT_EQ(sched.last_epoch(), t);
    ASSERT_EQ(sched.get_last_lr().size(), 2u);
    for (size_t g = 0; g < 2; ++g) {
      const double w = want(t, kBase[g]);
      EXPECT_NEAR(sched.get_last_lr()[g], w, 1e-15) << "step " << t << " group " << g;
      EXPECT_EQ(opt.param_groups()[g].options().get_lr(), sched.get_last_lr()[g]);
    }
  }
}

TEST(LrScheduler, StepLR) {
  TwoGroups s;
  optim::StepLR sched(s.opt, /*step_size=*/3, /*gamma=*/0.5);
  expect_schedule(sched, s.opt, [](int64_t t, double base) {
    return base * std::pow(0.5, static_cast<double>(t / 3));
  });
  EXPECT_KILN_ERROR(optim::StepLR(s.opt, 0), "[StepLR] step_size must be positive");
}

TEST(LrScheduler, LambdaLR) {
  TwoGroups s;
  optim::LambdaLR sched(s.opt, [](int64_t t) { return 1.0 / (1.0 + 0.1 * t); });
  expect_schedule(sched, s.opt, [](int64_t t, double base) { return base / (1.0 + 0.1 * t); });

  TwoGroups s2;
  optim::LambdaLR per_group(
      s2.opt, std::vector<optim::LambdaLR::Fn>{[](int64_t t) { return 0.9 * t; },
                                               [](int64_t) { return 2.0; }});
  per_group.step();
  per_group.step();
  EXPECT_NEAR(per_group.get_last_lr()[0], 0.1 * 1.8, 1e-15);
  EXPECT_NEAR(per_group.get_last_lr()[1], 0.04, 1e-15);
  EXPECT_KILN_ERROR(optim::LambdaLR(s2.opt, std::vector<optim::LambdaLR::Fn>{}),
                    "[LambdaLR] expected 2 functions");
}

TEST(LrScheduler, LinearWarmupFromZeroAndFromAFactor) {
  TwoGroups s;
  optim::LinearWarmup sched(s.opt, /*warmup_steps=*/8);
  EXPECT_EQ(s.opt.get_lr(), 0.0);  // step 0 of a warmup from 0
  expect_schedule(sched, s.opt, [](int64_t t, double base) {
    return t >= 8 ? base : base * static_cast<double>(t) / 8.0;
  });

  TwoGroups s2;
  optim::LinearWarmup from_factor(s2.opt, 5, /*start_factor=*/0.25);
  expect_schedule(from_factor, s2.opt, [](int64_t t, double base) {
    return t >= 5 ? base : base * (0.25 + 0.75 * static_cast<double>(t) / 5.0);
  });
  EXPECT_KILN_ERROR(optim::LinearWarmup(s2.opt, 5, 1.5), "[LinearWarmup] start_factor");
  EXPECT_KILN_ERROR(optim::LinearWarmup(s2.opt, -1), "[LinearWarmup] warmup_steps");
}

TEST(LrScheduler, CosineAnnealingWithWarmup) {
  TwoGroups s;
  const double min_lr = 0.005;
  optim::CosineAnnealingWithWarmup sched(s.opt, /*warmup_steps=*/4, /*total_steps=*/16, min_lr);
  expect_schedule(sched, s.opt, [&](int64_t t, double base) {
    if (t < 4) return base * static_cast<double>(t) / 4.0;
    const double progress = std::min(1.0, (t - 4) / 12.0);
    return min_lr + 0.5 * (base - min_lr) * (1 + std::cos(std::numbers::pi * progress));
  });
  // Landmarks: the peak right after warmup, the midpoint, min_lr at the end and after.
  sched.set_last_epoch(4);
  EXPECT_NEAR(sched.get_last_lr()[0], 0.1, 1e-15);
  sched.set_last_epoch(10);
  EXPECT_NEAR(sched.get_last_lr()[0], (0.1 + min_lr) / 2, 1e-15);
  sched.set_last_epoch(16);
  EXPECT_NEAR(sched.get_last_lr()[1], min_lr, 1e-15);
  sched.set_last_epoch(100);
  EXPECT_NEAR(sched.get_last_lr()[0], min_lr, 1e-15);
  EXPECT_KILN_ERROR(optim::CosineAnnealingWithWarmup(s.opt, 10, 5),
                    "[CosineAnnealingWithWarmup] need 0 <= warmup_steps <= total_steps");
}

TEST(LrScheduler, ConstantLR) {
  TwoGroups s;
  optim::ConstantLR sched(s.opt, /*factor=*/0.5, /*total_iters=*/4);
  expect_schedule(sched, s.opt, [](int64_t t, double base) { return t < 4 ? base * 0.5 : base; });
  TwoGroups s2;
  optim::ConstantLR defaults(s2.opt);  // PyTorch's defaults: factor 1/3 for 5 steps
  EXPECT_NEAR(defaults.get_last_lr()[0], 0.1 / 3, 1e-15);
  EXPECT_KILN_ERROR(optim::ConstantLR(s2.opt, 2.0), "[ConstantLR] constant multiplicative factor");
}

TEST(LrScheduler, DrivesAdamWAndResumes) {
  Tensor p = ones({4});
  optim::AdamW opt({p}, optim::AdamWOptions(1e-3));
  optim::StepLR sched(opt, 2, 0.1);
  EXPECT_EQ(sched.base_lrs(), std::vector<double>{1e-3});
  for (int i = 0; i < 4; ++i) sched.step();
  EXPECT_NEAR(opt.get_lr(), 1e-5, 1e-20);
  // A scheduler made for a resumed run jumps to the step reached.
  Tensor q = ones({4});
  optim::AdamW opt2({q}, optim::AdamWOptions(1e-3));
  optim::StepLR resumed(opt2, 2, 0.1);
  resumed.set_last_epoch(4);
  EXPECT_EQ(opt2.get_lr(), opt.get_lr());
  EXPECT_KILN_ERROR(resumed.set_last_epoch(-1), "[LRScheduler] the step must be non-negative");
  opt2.add_param_group(OptimizerParamGroup({ones({1})}));
  EXPECT_KILN_ERROR(resumed.step(), "[LRScheduler] the optimizer has 2 parameter groups");
}

}  // namespace
}  // namespace kiln
