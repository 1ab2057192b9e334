// Learning-rate schedules: each sets the lr of every parameter group from the group's base lr
// (its lr when the scheduler was made) and the step count, in closed form.
//
//   kiln::optim::AdamW opt(params, kiln::optim::AdamWOptions(3e-4));
//   kiln::optim::CosineAnnealingWithWarmup sched(opt, /*warmup_steps=*/100,
//                                                /*total_steps=*/10000, /*min_lr=*/3e-5);
//   for (...) { ...; opt.step(); sched.step(); }       // step() after optimizer.step()
//   double lr = sched.get_last_lr()[0];
//
// As in PyTorch, constructing a scheduler already sets the lr of step 0 (0 for a warmup from
// 0), and step() advances to the next step.
//
//   StepLR(opt, step_size, gamma = 0.1)        base * gamma^floor(t / step_size)
//   LambdaLR(opt, fn)                          base * fn(t)   (one fn, or one per group)
//   LinearWarmup(opt, warmup_steps, start_factor = 0)
//                                              base * (s + (1 - s) * min(t, N) / N)
//   CosineAnnealingWithWarmup(opt, warmup_steps W, total_steps T, min_lr = 0)
//                                              base * t / W while t < W, then
//                                              min_lr + (base - min_lr)(1 + cos(pi p)) / 2
//                                              with p = min(1, (t - W) / (T - W))
//   ConstantLR(opt, factor = 1/3, total_iters = 5)
//                                              base * factor while t < total_iters, then base
//
// Pitfall: resuming. The base lrs are read from the optimizer at construction, so make the
// scheduler before loading an optimizer checkpoint (which restores the decayed lrs), then
// set_last_epoch(steps_done).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "nn/optim/optimizer.h"

namespace kiln::optim {

class LRScheduler {
 public:
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;
  virtual ~LRScheduler() = default;

  // Advances one step and sets every group's lr.
  void step();
  // Jumps to step `epoch` and sets every group's lr (for resuming).
  void set_last_epoch(int64_t epoch);
  int64_t last_epoch() const { return last_epoch_; }
  // The lrs set by the last step, one per group.
  const std::vector<double>& get_last_lr() const { return last_lrs_; }
  const std::vector<double>& base_lrs() const { return base_lrs_; }

 protected:
  explicit LRScheduler(Optimizer& optimizer);
  // The lr of group `group` at step `epoch`.
  virtual double lr_at(int64_t epoch, double base_lr, size_t group) const = 0;
  // Derived constructors call this last: sets the lrs of step 0.
  void initialize() { set_last_epoch(0); }

 private:
  Optimizer& optimizer_;
  std::vector<double> base_lrs_;
  std::vector<double> last_lrs_;
  int64_t last_epoch_ = 0;
};

class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& optimizer, int64_t step_size, double gamma = 0.1);

 protected:
  double lr_at(int64_t epoch, double base_lr, size_t group) const override;

 private:
  int64_t step_size_;
  double gamma_;
};

class LambdaLR : public LRScheduler {
 public:
  using Fn = std::function<double(int64_t)>;
  LambdaLR(Optimizer& optimizer, Fn fn);
  // One function per parameter group.
  LambdaLR(Optimizer& optimizer, std::vector<Fn> fns);

 protected:
  double lr_at(int64_t epoch, double base_lr, size_t group) const override;

 private:
  std::vector<Fn> fns_;
};

class LinearWarmup : public LRScheduler {
 public:
  LinearWarmup(Optimizer& optimizer, int64_t warmup_steps, double start_factor = 0.0);

 protected:
  double lr_at(int64_t epoch, double base_lr, size_t group) const override;

 private:
  int64_t warmup_steps_;
  double start_factor_;
};

class CosineAnnealingWithWarmup : public LRScheduler {
 public:
  CosineAnnealingWithWarmup(Optimizer& optimizer, int64_t warmup_steps, int64_t total_steps,
                            double min_lr = 0.0);

 protected:
  double lr_at(int64_t epoch, double base_lr, size_t group) const override;

 private:
  int64_t warmup_steps_;
  int64_t total_steps_;
  double min_lr_;
};

class ConstantLR : public LRScheduler {
 public:
  ConstantLR(Optimizer& optimizer, double factor = 1.0 / 3, int64_t total_iters = 5);

 protected:
  double lr_at(int64_t epoch, double base_lr, size_t group) const override;

 private:
  double factor_;
  int64_t total_iters_;
};

}  // namespace kiln::optim
