// The schedules' closed forms and the shared stepping.
#include "nn/optim/lr_scheduler.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "tensor/error.h"

namespace kiln::optim {

LRScheduler::LRScheduler(Optimizer& optimizer) : optimizer_(optimizer) {
  for (const OptimizerParamGroup& g : optimizer.param_groups()) {
    base_lrs_.push_back(g.options().get_lr());
  }
}

void LRScheduler::step() { set_last_epoch(last_epoch_ + 1); }

void LRScheduler::set_last_epoch(int64_t epoch) {
  KILN_CHECK(epoch >= 0, "[LRScheduler] the step must be non-negative, got ", epoch);
  auto& groups = optimizer_.param_groups();
  KILN_CHECK(groups.size() == base_lrs_.size(), "[LRScheduler] the optimizer has ", groups.size(),
             " parameter groups but had ", base_lrs_.size(), " when the scheduler was made");
  last_epoch_ = epoch;
  last_lrs_.resize(groups.size());
  for (size_t i = 0; i < groups.size(); ++i) {
    last_lrs_[i] = lr_at(epoch, base_lrs_[i], i);
    groups[i].options().set_lr(last_lrs_[i]);
  }
}

StepLR::StepLR(Optimizer& optimizer, int64_t step_size, double gamma)
    : LRScheduler(optimizer), step_size_(step_size), gamma_(gamma) {
  KILN_CHECK(step_size > 0, "[StepLR] step_size must be positive, got ", step_size);
  initialize();
}

double StepLR::lr_at(int64_t epoch, double base_lr, size_t) const {
  return base_lr * std::pow(gamma_, static_cast<double>(epoch / step_size_));
}

LambdaLR::LambdaLR(Optimizer& optimizer, Fn fn)
    : LambdaLR(optimizer, std::vector<Fn>(optimizer.param_groups().size(), fn)) {}

LambdaLR::LambdaLR(Optimizer& optimizer, std::vector<Fn> fns)
    : LRScheduler(optimizer), fns_(std::move(fns)) {
  KILN_CHECK(fns_.size() == optimizer.param_groups().size(), "[LambdaLR] expected ",
             optimizer.param_groups().size(), " functions (one per group), got ", fns_.size());
  for (const Fn& f : fns_) KILN_CHECK(f != nullptr, "[LambdaLR] a function is empty");
  initialize();
}

double LambdaLR::lr_at(int64_t epoch, double base_lr, size_t group) const {
  return base_lr * fns_[group](epoch);
}

LinearWarmup::LinearWarmup(Optimizer& optimizer, int64_t warmup_steps, double start_factor)
    : LRScheduler(optimizer), warmup_steps_(warmup_steps), start_factor_(start_factor) {
  KILN_CHECK(warmup_steps >= 0, "[LinearWarmup] warmup_steps must be non-negative, got ",
             warmup_steps);
  KILN_CHECK(start_factor >= 0 && start_factor <= 1,
             "[LinearWarmup] start_factor must be in [0, 1], got ", start_factor);
  initialize();
}

double LinearWarmup::lr_at(int64_t epoch, double base_lr, size_t) const {
  if (epoch >= warmup_steps_) return base_lr;
  return base_lr * (start_factor_ + (1 - start_factor_) * static_cast<double>(epoch) /
                                        static_cast<double>(warmup_steps_));
}

CosineAnnealingWithWarmup::CosineAnnealingWithWarmup(Optimizer& optimizer, int64_t warmup_steps,
                                                     int64_t total_steps, double min_lr)
    : LRScheduler(optimizer),
      warmup_steps_(warmup_steps),
      total_steps_(total_steps),
      min_lr_(min_lr) {
  KILN_CHECK(warmup_steps >= 0 && warmup_steps <= total_steps,
             "[CosineAnnealingWithWarmup] need 0 <= warmup_steps <= total_steps, got warmup_steps ",
             warmup_steps, " and total_steps ", total_steps);
  KILN_CHECK(min_lr >= 0, "[CosineAnnealingWithWarmup] min_lr must be non-negative, got ", min_lr);
  initialize();
}

double CosineAnnealingWithWarmup::lr_at(int64_t epoch, double base_lr, size_t) const {
  if (epoch < warmup_steps_) {
    return base_lr * static_cast<double>(epoch) / static_cast<double>(warmup_steps_);
  }
  const int64_t span = total_steps_ - warmup_steps_;
  const double progress =
      span == 0 ? 1.0
                : std::min(1.0, static_cast<double>(epoch - warmup_steps_) / static_cast<double>(span));
  return min_lr_ + 0.5 * (base_lr - min_lr_) * (1 + std::cos(std::numbers::pi * progress));
}

ConstantLR::ConstantLR(Optimizer& optimizer, double factor, int64_t total_iters)
    : LRScheduler(optimizer), factor_(factor), total_iters_(total_iters) {
  KILN_CHECK(factor >= 0 && factor <= 1,
             "[ConstantLR] constant multiplicative factor expected to be between 0 and 1, got ",
             factor);
  KILN_CHECK(total_iters >= 0, "[ConstantLR] total_iters must be non-negative, got ",
             total_iters);
  initialize();
}

double ConstantLR::lr_at(int64_t epoch, double base_lr, size_t) const {
  return epoch < total_iters_ ? base_lr * factor_ : base_lr;
}

}  // namespace kiln::optim
