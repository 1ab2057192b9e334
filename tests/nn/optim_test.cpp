// Optimizers: the first steps of SGD, Adam and AdamW against their published update rules
// (written out in double below), parameter groups, zero_grad, and contiguous against strided
// parameters. Checkpoints that resume bit-exactly: tests/nn/optim_checkpoint_test.cpp. The
// update ops themselves (kernel against decomposition, errors): tests/tensor/optim_test.cpp.
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <cmath>
#include <string>
#include <vector>

#include "nn/optim/adam.h"
#include "nn/optim/adamw.h"
#include "nn/optim/sgd.h"
#include "nn/optim_test_util.h"
#include "tensor/foreach.h"
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
using optimtest::make_adam;

// The gradients fed to scalar parameters on steps 1, 2, 3.
const std::vector<double> kGrads = {0.5, -1.25, 2.0};

Tensor scalar_param(double v, ScalarType dtype) { return full({1}, v, dtype).requires_grad_(); }

void set_grad(Tensor p, double g) { p.mutable_grad() = full({1}, g, p.dtype()); }

// Runs `opt` for kGrads.size() steps on `p`, returning p after each step.
std::vector<double> run_scalar(optim::Optimizer& opt, Tensor p) {
  std::vector<double> out;
  for (double g : kGrads) {
    set_grad(p, g);
    opt.step();
    out.push_back(p.item<double>());
  }
  return out;
}

// --- SGD ---------------------------------------------------------------------------------------

struct SgdCase {
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
};

// torch.optim.SGD's documented rule, in double.
std::vector<double> sgd_reference(const SgdCase& c, double p) {
  std::vector<double> out;
  double buf = 0;
  for (size_t t = 0; t < kGrads.size(); ++t) {
    double g = kGrads[t] + c.weight_decay * p;
    if (c.momentum != 0) {
      buf = t == 0 ? g : c.momentum * buf + (1 - c.dampening) * g;
      g = c.nesterov ? g + c.momentum * buf : buf;
    }
    p = p - c.lr * g;
    out.push_back(p);
  }
  return out;
}

TEST(OptimSgd, HandComputedMomentum) {
  // lr 0.1, momentum 0.9, constant gradient 1: buffers 1, 1.9, 2.71.
  Tensor p = scalar_param(1.0, kFloat64);
  SGD opt({p}, SGDOptions(0.1).momentum(0.9));
  std::vector<double> got;
  for (int i = 0; i < 3; ++i) {
    set_grad(p, 1.0);
    opt.step();
    got.push_back(p.item<double>());
  }
  EXPECT_NEAR(got[0], 1.0 - 0.1 * 1.0, 1e-15);
  EXPECT_NEAR(got[1], 0.9 - 0.1 * 1.9, 1e-15);
  EXPECT_NEAR(got[2], 0.71 - 0.1 * 2.71, 1e-15);
}

TEST(OptimSgd, FirstStepsMatchTheRule) {
  const std::vector<SgdCase> cases = {
      {0.1, 0, 0, 0, false},          // plain
      {0.05, 0, 0, 0.1, false},       // weight decay only
      {0.1, 0.9, 0, 0, false},        // momentum
      {0.1, 0.9, 0.25, 0.01, false},  // momentum, dampening, weight decay
      {0.1, 0.9, 0, 1e-2, true},      // Nesterov
  };
  for (const SgdCase& c : cases) {
    const std::vector<double> want = sgd_reference(c, 1.5);
    for (ScalarType dtype : {kFloat64, kFloat32}) {
      Tensor p = scalar_param(1.5, dtype);
      SGD opt({p}, SGDOptions(c.lr)
                       .momentum(c.momentum)
                       .dampening(c.dampening)
                       .weight_decay(c.weight_decay)
                       .nesterov(c.nesterov));
      const std::vector<double> got = run_scalar(opt, p);
      const double tol = dtype == kFloat64 ? 1e-14 : 1e-6;
      for (size_t t = 0; t < want.size(); ++t) {
        EXPECT_NEAR(got[t], want[t], tol) << "step " << t + 1 << " momentum " << c.momentum
                                          << " nesterov " << c.nesterov << " " << dtype_name(dtype);
      }
    }
  }
}

TEST(OptimSgd, Errors) {
  Tensor p = scalar_param(1.0, kFloat32);
  EXPECT_KILN_ERROR(SGD({p}, SGDOptions(-0.1)), "[SGD] invalid learning rate");
  EXPECT_KILN_ERROR(SGD({p}, SGDOptions(0.1).momentum(-1)), "[SGD] invalid momentum");
  EXPECT_KILN_ERROR(SGD({p}, SGDOptions(0.1).weight_decay(-1)), "[SGD] invalid weight_decay");
  EXPECT_KILN_ERROR(SGD({p}, SGDOptions(0.1).nesterov(true)), "[SGD] Nesterov momentum requires");
  EXPECT_KILN_ERROR(SGD({p}, SGDOptions(0.1).momentum(0.9).dampening(0.1).nesterov(true)),
                    "[SGD] Nesterov momentum requires");
  EXPECT_KILN_ERROR(SGD({p, p}, SGDOptions(0.1)), "[SGD] some parameters appear in more than one");
  EXPECT_KILN_ERROR(SGD({ones({2}, kInt64)}, SGDOptions(0.1)), "[SGD] can only optimize floating");
  EXPECT_KILN_ERROR(SGD({p * 2}, SGDOptions(0.1)), "[SGD] can't optimize a non-leaf");
  // Options changed to invalid values after construction are caught at the step.
  SGD opt({p}, SGDOptions(0.1));
  static_cast<SGDOptions&>(opt.param_groups()[0].options()).lr(-1);
  set_grad(p, 1);
  EXPECT_KILN_ERROR(opt.step(), "[SGD] invalid learning rate");
}

// --- Adam and AdamW ----------------------------------------------------------------------------

struct AdamCase {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad;
};

// torch.optim.Adam (decoupled = false) and torch.optim.AdamW (decoupled = true), in double.
std::vector<double> adam_reference(const AdamCase& c, bool decoupled, double p) {
  std::vector<double> out;
  double m = 0, v = 0, vmax = 0;
  for (size_t i = 0; i < kGrads.size(); ++i) {
    const double t = static_cast<double>(i + 1);
    double g = kGrads[i];
    if (decoupled) {
      p = p * (1 - c.lr * c.weight_decay);
    } else {
      g = g + c.weight_decay * p;
    }
    m = c.beta1 * m + (1 - c.beta1) * g;
    v = c.beta2 * v + (1 - c.beta2) * g * g;
    vmax = std::max(vmax, v);
    const double m_hat = m / (1 - std::pow(c.beta1, t));
    const double v_used = c.amsgrad ? vmax : v;
    const double denom = std::sqrt(v_used) / std::sqrt(1 - std::pow(c.beta2, t)) + c.eps;
    p = p - c.lr * m_hat / denom;
    out.push_back(p);
  }
  return out;
}

const std::vector<AdamCase> kAdamCases = {
    {1e-3, 0.9, 0.999, 1e-8, 0, false},
    {0.1, 0.8, 0.99, 1e-3, 0.05, false},
    {0.1, 0.5, 0.9, 1e-8, 0.1, true},
    {0.05, 0.0, 0.5, 0.1, 0, true},
};

TEST(OptimAdam, HandComputedConstantGradient) {
  // With a constant gradient the bias-corrected moments equal g and g^2, so every step moves
  // by lr * g / (|g| + eps).
  Tensor p = scalar_param(1.0, kFloat64);
  Adam opt({p}, AdamOptions(0.1));
  for (int i = 1; i <= 3; ++i) {
    set_grad(p, 2.0);
    opt.step();
    EXPECT_NEAR(p.item<double>(), 1.0 - i * 0.1 * 2.0 / (2.0 + 1e-8), 1e-14);
  }
  const auto& st = opt.state().at(p.impl());
  EXPECT_EQ(st.step_count(), 3);
  EXPECT_NEAR(st.buffers.at("exp_avg").item<double>(), 2.0 * (1 - 0.9 * 0.9 * 0.9), 1e-14);
  EXPECT_NEAR(st.buffers.at("exp_avg_sq").item<double>(), 4.0 * (1 - std::pow(0.999, 3)), 1e-14);
  EXPECT_EQ(st.buffers.count("max_exp_avg_sq"), 0u);
}

TEST(OptimAdam, FirstStepsMatchTheRule) {
  for (const AdamCase& c : kAdamCases) {
    const std::vector<double> want = adam_reference(c, false, 1.5);
    for (ScalarType dtype : {kFloat64, kFloat32}) {
      Tensor p = scalar_param(1.5, dtype);
      Adam opt({p}, AdamOptions(c.lr)
                        .betas({c.beta1, c.beta2})
                        .eps(c.eps)
                        .weight_decay(c.weight_decay)
                        .amsgrad(c.amsgrad));
      const std::vector<double> got = run_scalar(opt, p);
      const double tol = dtype == kFloat64 ? 1e-14 : 2e-6;
      for (size_t t = 0; t < want.size(); ++t) {
        EXPECT_NEAR(got[t], want[t], tol) << "step " << t + 1 << " lr " << c.lr << " amsgrad "
                                          << c.amsgrad << " " << dtype_name(dtype);
      }
    }
  }
}

TEST(OptimAdamW, HandComputedDecoupledDecay) {
  // lr 0.1, weight decay 0.1, constant gradient: p <- p * 0.99 - 0.1 * g / (|g| + eps).
  Tensor p = scalar_param(1.0, kFloat64);
  AdamW opt({p}, AdamWOptions(0.1).weight_decay(0.1));
  const double step = 0.1 * 3.0 / (3.0 + 1e-8);
  const std::vector<double> want = {1.0 * 0.99 - step, (1.0 * 0.99 - step) * 0.99 - step,
                                    ((1.0 * 0.99 - step) * 0.99 - step) * 0.99 - step};
  for (int i = 0; i < 3; ++i) {
    set_grad(p, 3.0);
    opt.step();
    EXPECT_NEAR(p.item<double>(), want[i], 1e-14);
  }
}

TEST(OptimAdamW, FirstStepsMatchTheRule) {
  for (const AdamCase& c : kAdamCases) {
    const std::vector<double> want = adam_reference(c, true, -0.75);
    for (ScalarType dtype : {kFloat64, kFloat32}) {
      Tensor p = scalar_param(-0.75, dtype);
      AdamW opt({p}, AdamWOptions(c.lr)
                         .betas({c.beta1, c.beta2})
                         .eps(c.eps)
                         .weight_decay(c.weight_decay)
                         .amsgrad(c.amsgrad));
      const std::vector<double> got = run_scalar(opt, p);
      const double tol = dtype == kFloat64 ? 1e-14 : 2e-6;
      for (size_t t = 0; t < want.size(); ++t) {
        EXPECT_NEAR(got[t], want[t], tol) << "step " << t + 1 << " lr " << c.lr << " amsgrad "
                                          << c.amsgrad << " " << dtype_name(dtype);
      }
    }
  }
}

TEST(OptimAdamW, Defaults) {
  AdamWOptions o;
  EXPECT_EQ(o.lr(), 1e-3);
  EXPECT_EQ(std::get<0>(o.betas()), 0.9);
  EXPECT_EQ(std::get<1>(o.betas()), 0.999);
  EXPECT_EQ(o.eps(), 1e-8);
  EXPECT_EQ(o.weight_decay(), 1e-2);
  EXPECT_FALSE(o.amsgrad());
  EXPECT_EQ(AdamOptions().weight_decay(), 0.0);
}

TEST(OptimAdam, Errors) {
  Tensor p = scalar_param(1.0, kFloat32);
  EXPECT_KILN_ERROR(Adam({p}, AdamOptions(-1)), "[Adam] invalid learning rate");
  EXPECT_KILN_ERROR(Adam({p}, AdamOptions().betas({1.0, 0.999})),
                    "[Adam] invalid beta parameter at index 0");
  EXPECT_KILN_ERROR(Adam({p}, AdamOptions().betas({0.9, -0.1})),
                    "[Adam] invalid beta parameter at index 1");
  EXPECT_KILN_ERROR(Adam({p}, AdamOptions().eps(-1)), "[Adam] invalid epsilon");
  EXPECT_KILN_ERROR(AdamW({p}, AdamWOptions().weight_decay(-1)), "[AdamW] invalid weight_decay");
  // A group carrying another optimizer's options.
  std::vector<OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<Tensor>{p}, std::make_unique<SGDOptions>(0.1));
  EXPECT_KILN_ERROR(AdamW(groups, AdamWOptions()), "[AdamW] a parameter group has the options");
}

// A contiguous f32 parameter (the fused loop in place, multi-threaded above 8K elements) against
// a transposed, non-contiguous one on the same values (the loop on f32 copies).
TEST(OptimAdamW, FusedMatchesOps) {
  for (bool amsgrad : {false, true}) {
    for (bool decoupled : {false, true}) {
      manual_seed(7);
      Tensor strided = randn({150, 400}).t();  // [400, 150], not contiguous
      Tensor dense = strided.contiguous();
      ASSERT_FALSE(strided.is_contiguous());
      std::unique_ptr<optim::Optimizer> a, b;
      if (decoupled) {
        a = std::make_unique<AdamW>(std::vector<Tensor>{dense},
                                    AdamWOptions(0.01).weight_decay(0.1).amsgrad(amsgrad));
        b = std::make_unique<AdamW>(std::vector<Tensor>{strided},
                                    AdamWOptions(0.01).weight_decay(0.1).amsgrad(amsgrad));
      } else {
        a = std::make_unique<Adam>(std::vector<Tensor>{dense},
                                   AdamOptions(0.01).weight_decay(0.1).amsgrad(amsgrad));
        b = std::make_unique<Adam>(std::vector<Tensor>{strided},
                                   AdamOptions(0.01).weight_decay(0.1).amsgrad(amsgrad));
      }
      for (int s = 0; s < 3; ++s) {
        Tensor g = randn({400, 150});
        dense.mutable_grad() = g;
        strided.mutable_grad() = g.clone();
        a->step();
        b->step();
      }
      EXPECT_TRUE(allclose(dense, strided, 1e-6, 1e-7)) << "amsgrad " << amsgrad;
      const auto& sa = a->state().at(dense.impl()).buffers;
      const auto& sb = b->state().at(strided.impl()).buffers;
      EXPECT_TRUE(allclose(sa.at("exp_avg"), sb.at("exp_avg"), 1e-6, 1e-7));
      EXPECT_TRUE(allclose(sa.at("exp_avg_sq"), sb.at("exp_avg_sq"), 1e-6, 1e-7));
    }
  }
}

TEST(OptimAdamW, LowPrecisionParamsKeepF32State) {
  manual_seed(3);
  Tensor ref = randn({64});
  Tensor half = ref.to(kBFloat16);
  Tensor ref32 = half.to(kFloat32);  // the same starting values
  AdamW a({half}, AdamWOptions(0.01));
  AdamW b({ref32}, AdamWOptions(0.01));
  for (int s = 0; s < 3; ++s) {
    Tensor g = randn({64});
    half.mutable_grad() = g.to(kBFloat16);
    ref32.mutable_grad() = g.to(kBFloat16).to(kFloat32);
    a.step();
    b.step();
  }
  EXPECT_EQ(half.dtype(), kBFloat16);
  EXPECT_EQ(a.state().at(half.impl()).buffers.at("exp_avg").dtype(), kFloat32);
  EXPECT_TRUE(allclose(half.to(kFloat32), ref32, 1e-2, 1e-2));
}

// --- state_in_param_dtype: moments in the parameter's dtype (torch's behaviour) ------------------

Tensor round_to(const Tensor& x, ScalarType dtype) { return x.to(dtype).to(kFloat64); }

TEST(OptimAdamStateInParamDtype, StateTakesTheParamDtype) {
  for (bool decoupled : {false, true}) {
    for (ScalarType dtype : {kBFloat16, kHalf, kFloat32, kFloat64}) {
      for (bool in_param : {false, true}) {
        Tensor p = randn({5, 3}).to(dtype).requires_grad_();
        auto opt = make_adam(decoupled, {p}, 0.1, /*amsgrad=*/true, in_param);
        p.mutable_grad() = randn({5, 3}).to(dtype);
        opt->step();
        const ScalarType want =
            in_param ? dtype : (dtype == kFloat64 ? kFloat64 : kFloat32);  // the default: f32
        for (const char* name : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}) {
          const Tensor& b = opt->state().at(p.impl()).buffers.at(name);
          EXPECT_EQ(b.dtype(), want) << name << " " << dtype_name(dtype) << " " << in_param;
          EXPECT_EQ(b.sizes(), p.sizes());
        }
        EXPECT_EQ(p.dtype(), dtype);
      }
    }
  }
  EXPECT_FALSE(AdamOptions().state_in_param_dtype());  // the defaults keep f32 state
  EXPECT_FALSE(AdamWOptions().state_in_param_dtype());
}

// Several steps against the rule in f64 with the same rounding: moments and parameter rounded
// to the parameter's dtype after each step, the amsgrad maximum of the stored v_max and the
// unrounded v feeding the denominator. A non-contiguous copy of the parameter (the op-path
// layout) gives the same bits as the contiguous one.
TEST(OptimAdamStateInParamDtype, MatchesRoundedReference) {
  struct C {
    bool decoupled, amsgrad;
    double wd, beta1;
  };
  const std::vector<C> cases = {
      {true, false, 0.1, 0.8}, {true, true, 0.1, 0.8},  {false, false, 0.05, 0.8},
      {false, true, 0.0, 0.8}, {true, false, 0.0, 0.3},  // lerp from the far end
  };
  for (ScalarType dtype : {kBFloat16, kHalf}) {
    for (const C& c : cases) {
      manual_seed(21);
      Tensor dense = randn({41, 33}).to(dtype).requires_grad_();  // 1353: not a multiple of 8
      Tensor strided = dense.detach().t().contiguous().t().requires_grad_();
      ASSERT_FALSE(strided.is_contiguous());
      auto a = make_adam(c.decoupled, {dense}, c.wd, c.amsgrad, true, c.beta1);
      auto b = make_adam(c.decoupled, {strided}, c.wd, c.amsgrad, true, c.beta1);
      Tensor p = dense.detach().to(kFloat64);
      Tensor m = zeros({41, 33}, kFloat64), v = zeros({41, 33}, kFloat64);
      Tensor vmax = zeros({41, 33}, kFloat64);
      for (int t = 1; t <= 5; ++t) {
        // Later steps smaller gradients, so that v_max keeps earlier values (amsgrad matters).
        const Tensor g16 = (randn({41, 33}) * (t <= 2 ? 1.0 : 0.2)).to(dtype);
        dense.mutable_grad() = g16;
        strided.mutable_grad() = g16.clone();
        a->step();
        b->step();
        Tensor g = g16.to(kFloat64);
        if (c.decoupled) {
          p = p * (1 - 0.02 * c.wd);
        } else {
          g = g + c.wd * p;
        }
        // The step uses the new moments unrounded; they are rounded when stored.
        const Tensor m_new = c.beta1 * m + (1 - c.beta1) * g;
        const Tensor v_new = 0.95 * v + 0.05 * g * g;
        m = round_to(m_new, dtype);
        v = round_to(v_new, dtype);
        Tensor v_used = v_new;
        if (c.amsgrad) {
          v_used = maximum(vmax, v_new);
          vmax = round_to(v_used, dtype);
        }
        const double bc1 = 1 - std::pow(c.beta1, t), bc2 = 1 - std::pow(0.95, t);
        p = round_to(p - 0.02 / bc1 * m_new / (v_used.sqrt() / std::sqrt(bc2) + 1e-8), dtype);
      }
      const std::string what = std::string(dtype_name(dtype)) + (c.decoupled ? " AdamW" : " Adam") +
                               (c.amsgrad ? " amsgrad" : "") + " beta1 " + std::to_string(c.beta1);
      const auto& st = a->state().at(dense.impl()).buffers;
      // One or two units in the last place of the 16-bit dtype: the reference's f64 values may
      // round to the neighbour of the f32 ones.
      const double rtol = dtype == kBFloat16 ? 1.6e-2 : 2e-3;
      EXPECT_TRUE(allclose(dense.to(kFloat64), p, rtol, 1e-4)) << what;
      ASSERT_EQ(st.at("exp_avg").dtype(), dtype) << what;
      EXPECT_TRUE(allclose(st.at("exp_avg").to(kFloat64), m, rtol, 1e-6)) << what;
      EXPECT_TRUE(allclose(st.at("exp_avg_sq").to(kFloat64), v, rtol, 1e-7)) << what;
      if (c.amsgrad) {
        EXPECT_TRUE(allclose(st.at("max_exp_avg_sq").to(kFloat64), vmax, rtol, 1e-7)) << what;
        // v_max holds the early, larger second moments.
        EXPECT_GT((st.at("max_exp_avg_sq").to(kFloat64) - st.at("exp_avg_sq").to(kFloat64))
                      .min()
                      .item<double>(),
                  -1e-12)
            << what;
        EXPECT_GT(st.at("max_exp_avg_sq").to(kFloat64).sum().item<double>(),
                  1.08 * st.at("exp_avg_sq").to(kFloat64).sum().item<double>())
            << what;
      } else {
        EXPECT_EQ(st.count("max_exp_avg_sq"), 0u);
      }
      // The strided parameter (op-path layout) gives the same bits.
      EXPECT_TRUE(equal(dense, strided)) << what;
      const auto& sb = b->state().at(strided.impl()).buffers;
      for (const auto& [key, buf] : st) EXPECT_TRUE(equal(buf, sb.at(key))) << what << " " << key;
    }
  }
}

// The 16-bit state takes f32 arithmetic: bit for bit the f32 optimizer (fused f32 loop) whose
// parameter and moments are rounded to the 16-bit dtype after every step, not the op path in
// bf16 (which would round every intermediate).
TEST(OptimAdamStateInParamDtype, ArithmeticIsF32RoundedOncePerStep) {
  for (ScalarType dtype : {kBFloat16, kHalf}) {
    for (bool decoupled : {false, true}) {
      manual_seed(4);
      Tensor p = randn({257}).to(dtype).requires_grad_();
      Tensor ref = p.detach().to(kFloat32).requires_grad_();  // the same values, in f32
      auto a = make_adam(decoupled, {p}, 0.1, /*amsgrad=*/true, /*in_param=*/true);
      auto b = make_adam(decoupled, {ref}, 0.1, /*amsgrad=*/true, /*in_param=*/false);
      for (int t = 0; t < 4; ++t) {
        const Tensor g = (randn({257}) * (t < 2 ? 1.0 : 0.1)).to(dtype);
        p.mutable_grad() = g;
        ref.mutable_grad() = g.to(kFloat32);
        a->step();
        b->step();
        ref.detach().copy_(ref.detach().to(dtype));
        for (auto& [key, buf] : b->state().at(ref.impl()).buffers) buf.copy_(buf.to(dtype));
      }
      const std::string what = std::string(dtype_name(dtype)) + (decoupled ? " AdamW" : " Adam");
      EXPECT_TRUE(equal(p, ref.to(dtype))) << what;
      const auto& sa = a->state().at(p.impl()).buffers;
      const auto& sb = b->state().at(ref.impl()).buffers;
      ASSERT_EQ(sa.size(), 3u) << what;
      for (const auto& [key, buf] : sa) {
        EXPECT_EQ(buf.dtype(), dtype) << what << " " << key;
        EXPECT_TRUE(equal(buf, sb.at(key).to(dtype))) << what << " " << key;
      }
    }
  }
}

// Groups may differ: one keeps f32 state, the other the parameters' dtype; changing the option
// between steps converts the state at the next step.
TEST(OptimAdamStateInParamDtype, PerGroupAndChangedBetweenSteps) {
  Tensor w = randn({9}).to(kBFloat16).requires_grad_();
  Tensor b = randn({9}).to(kBFloat16).requires_grad_();
  std::vector<OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<Tensor>{w});  // the defaults: bf16 state
  groups.emplace_back(std::vector<Tensor>{b}, AdamWOptions(0.01).clone());  // f32 state
  AdamW opt(groups, AdamWOptions(0.01).state_in_param_dtype(true));
  w.mutable_grad() = randn({9}).to(kBFloat16);
  b.mutable_grad() = randn({9}).to(kBFloat16);
  opt.step();
  EXPECT_EQ(opt.state().at(w.impl()).buffers.at("exp_avg").dtype(), kBFloat16);
  EXPECT_EQ(opt.state().at(b.impl()).buffers.at("exp_avg").dtype(), kFloat32);
  const Tensor m_b = opt.state().at(b.impl()).buffers.at("exp_avg").clone();
  static_cast<AdamWOptions&>(opt.param_groups()[1].options()).state_in_param_dtype(true);
  static_cast<AdamWOptions&>(opt.param_groups()[0].options()).state_in_param_dtype(false);
  opt.step();  // the grads are still set
  const auto& sw = opt.state().at(w.impl()).buffers;
  const auto& sb = opt.state().at(b.impl()).buffers;
  EXPECT_EQ(sw.at("exp_avg").dtype(), kFloat32);
  EXPECT_EQ(sw.at("exp_avg_sq").dtype(), kFloat32);
  EXPECT_EQ(sb.at("exp_avg").dtype(), kBFloat16);
  EXPECT_EQ(sb.at("exp_avg_sq").dtype(), kBFloat16);
  EXPECT_FALSE(equal(sb.at("exp_avg").to(kFloat32), m_b));  // converted, then updated
}

// --- Groups, zero_grad, step ---------------------------------------------------------------------

TEST(Optim, ParamGroupsWithTheirOwnOptions) {
  Tensor w = scalar_param(1.0, kFloat64);
  Tensor b = scalar_param(1.0, kFloat64);
  std::vector<OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<Tensor>{w});  // the defaults: lr 0.1, weight decay 0.5
  groups.emplace_back(std::vector<Tensor>{b},
                      std::make_unique<AdamWOptions>(AdamWOptions(0.01).weight_decay(0)));
  AdamW opt(groups, AdamWOptions(0.1).weight_decay(0.5));
  ASSERT_EQ(opt.param_groups().size(), 2u);
  EXPECT_EQ(opt.size(), 2u);
  EXPECT_EQ(static_cast<AdamWOptions&>(opt.param_groups()[0].options()).weight_decay(), 0.5);
  set_grad(w, 1.0);
  set_grad(b, 1.0);
  opt.step();
  // First AdamW step: p * (1 - lr * wd) - lr * g / (|g| + eps).
  EXPECT_NEAR(w.item<double>(), 1.0 * (1 - 0.1 * 0.5) - 0.1 / (1 + 1e-8), 1e-14);
  EXPECT_NEAR(b.item<double>(), 1.0 - 0.01 / (1 + 1e-8), 1e-14);

  // Per-group lr, as libtorch; then set_lr for all groups.
  static_cast<AdamWOptions&>(opt.param_groups()[1].options()).lr(0.5);
  EXPECT_EQ(opt.param_groups()[1].options().get_lr(), 0.5);
  EXPECT_EQ(opt.get_lr(), 0.1);
  opt.set_lr(0.02);
  EXPECT_EQ(opt.param_groups()[0].options().get_lr(), 0.02);
  EXPECT_EQ(opt.param_groups()[1].options().get_lr(), 0.02);
  EXPECT_EQ(opt.defaults().get_lr(), 0.1);  // the defaults stay

  // A group added later takes the defaults unless it brings options.
  Tensor c = scalar_param(2.0, kFloat64);
  opt.add_param_group(OptimizerParamGroup({c}));
  EXPECT_EQ(opt.param_groups()[2].options().get_lr(), 0.1);
  EXPECT_KILN_ERROR(opt.add_param_group(OptimizerParamGroup({w})),
                    "[AdamW] some parameters appear in more than one parameter group");
}

TEST(Optim, ZeroGradAndSkippingParamsWithoutGrad) {
  Tensor a = scalar_param(1.0, kFloat32);
  Tensor b = scalar_param(2.0, kFloat32);
  SGD opt({a, b}, SGDOptions(0.1).momentum(0.9));
  (a * 3).sum().backward();
  ASSERT_TRUE(a.grad().defined());
  ASSERT_FALSE(b.grad().defined());
  opt.step();
  EXPECT_FLOAT_EQ(a.item<float>(), 1.0f - 0.1f * 3.0f);
  EXPECT_FLOAT_EQ(b.item<float>(), 2.0f);  // no grad: untouched, no state
  EXPECT_EQ(opt.state().count(b.impl()), 0u);

  // set_to_none = false zeroes the same gradient tensor in place.
  const TensorImpl* grad_impl = a.grad().impl();
  opt.zero_grad(/*set_to_none=*/false);
  ASSERT_TRUE(a.grad().defined());
  EXPECT_EQ(a.grad().impl(), grad_impl);
  EXPECT_EQ(a.grad().item<float>(), 0.0f);
  // The default (set_to_none = true, as libtorch) drops it.
  opt.zero_grad();
  EXPECT_FALSE(a.grad().defined());
  const float before = a.item<float>();
  opt.step();
  EXPECT_EQ(a.item<float>(), before);
}

TEST(Optim, StepRunsUnderNoGradAndBumpsTheVersion) {
  Tensor p = ones({40000}).requires_grad_();
  AdamW opt({p}, AdamWOptions(0.1));
  (p * p).sum().backward();
  const uint64_t version = p._version();
  opt.step();
  EXPECT_GT(p._version(), version);
  EXPECT_TRUE(p.is_leaf());
  EXPECT_EQ(p.grad_fn(), nullptr);
  EXPECT_TRUE(p.requires_grad());
}

TEST(Optim, StepWithClosure) {
  Tensor p = scalar_param(3.0, kFloat64);
  SGD opt({p}, SGDOptions(0.25));
  auto closure = [&] {
    opt.zero_grad();
    Tensor loss = (p * p).sum();
    loss.backward();
    return loss;
  };
  Tensor loss = opt.step(closure);
  EXPECT_DOUBLE_EQ(loss.item<double>(), 9.0);
  EXPECT_DOUBLE_EQ(p.item<double>(), 3.0 - 0.25 * 6.0);
  EXPECT_FALSE(opt.step().defined());
}

// step_with_grad_factor(f) gives the bits of foreach_mul_(grads, f) then step(), for Adam and
// AdamW, f32, bf16 and f64 parameters (a group with several dtypes: several update calls), f32
// and 16-bit state; the gradients are left as they are.
TEST(OptimGradFactor, MatchesForeachMulThenStep) {
  for (bool decoupled : {false, true}) {
    for (bool in_param : {false, true}) {
      auto make = [&] {
        manual_seed(11);
        std::vector<Tensor> ps = {randn({40, 30}).requires_grad_(),
                                  randn({17}).to(kBFloat16).requires_grad_(),
                                  randn({9}, kFloat64).requires_grad_()};
        for (Tensor& p : ps) p = p.detach().requires_grad_();
        return ps;
      };
      std::vector<Tensor> pa = make(), pb = make();
      auto a = make_adam(decoupled, pa, 0.1, /*amsgrad=*/true, in_param);
      auto b = make_adam(decoupled, pb, 0.1, /*amsgrad=*/true, in_param);
      EXPECT_TRUE(a->supports_grad_factor());
      for (int s = 0; s < 3; ++s) {
        const Tensor coef = scalar_tensor(0.3 + 0.2 * s, kDouble);  // as clipping makes it
        for (size_t i = 0; i < pa.size(); ++i) {
          const Tensor g = randn(pa[i].sizes()).to(pa[i].dtype());
          pa[i].mutable_grad() = g;
          pb[i].mutable_grad() = g.clone();
        }
        const std::vector<Tensor> before = {pa[0].grad().clone(), pa[1].grad().clone()};
        a->step_with_grad_factor(coef);
        EXPECT_TRUE(equal(pa[0].grad(), before[0]));
        EXPECT_TRUE(equal(pa[1].grad(), before[1]));
        for (const std::vector<Tensor>& group :
             foreach_groups({pb[0].grad(), pb[1].grad(), pb[2].grad()})) {
          foreach_mul_(group, coef);
        }
        b->step();
      }
      for (size_t i = 0; i < pa.size(); ++i) {
        EXPECT_TRUE(equal(pa[i], pb[i])) << "param " << i << " decoupled " << decoupled;
        const auto& sa = a->state().at(pa[i].impl()).buffers;
        const auto& sb = b->state().at(pb[i].impl()).buffers;
        for (const char* name : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}) {
          EXPECT_TRUE(equal(sa.at(name), sb.at(name))) << name << " of param " << i;
        }
      }
    }
  }
}

TEST(OptimGradFactor, UndefinedIsStepAndOtherOptimizersRefuse) {
  manual_seed(12);
  Tensor p = randn({6}).requires_grad_(), q = p.detach().clone().requires_grad_();
  AdamW a({p}, AdamWOptions(0.1)), b({q}, AdamWOptions(0.1));
  const Tensor g = randn({6});
  p.mutable_grad() = g;
  q.mutable_grad() = g.clone();
  a.step_with_grad_factor(Tensor());
  b.step();
  EXPECT_TRUE(equal(p, q));
  EXPECT_KILN_ERROR(a.step_with_grad_factor(full({1}, 0.5)),
                    "[AdamW] step_with_grad_factor: the factor must be a 0-d floating-point "
                    "tensor, got a float32 tensor of shape [1]");
  EXPECT_KILN_ERROR(a.step_with_grad_factor(scalar_tensor(int64_t{1}, kInt64)),
                    "the factor must be a 0-d floating-point tensor");
  SGD sgd({p}, SGDOptions(0.1));
  EXPECT_FALSE(sgd.supports_grad_factor());
  EXPECT_KILN_ERROR(sgd.step_with_grad_factor(scalar_tensor(0.5, kDouble)),
                    "[SGD] step_with_grad_factor: SGD does not fold a gradient factor into its "
                    "update; multiply the gradients (foreach_mul_) and call step()");
  const Tensor before = p.detach().clone();
  sgd.step_with_grad_factor(Tensor());  // undefined: step()
  EXPECT_FALSE(equal(p, before));
}

// With a closure, the factor multiplies the gradients the closure makes.
TEST(OptimGradFactor, WithClosure) {
  Tensor p = scalar_param(3.0, kFloat64);
  Adam opt({p}, AdamOptions(0.25));
  auto closure = [&] {
    opt.zero_grad();
    Tensor loss = (p * p).sum();
    loss.backward();
    return loss;
  };
  Tensor loss = opt.step_with_grad_factor(scalar_tensor(0.5, kDouble), closure);
  EXPECT_DOUBLE_EQ(loss.item<double>(), 9.0);
  EXPECT_DOUBLE_EQ(p.grad().item<double>(), 6.0);  // not written
  EXPECT_NEAR(opt.state().at(p.impl()).buffers.at("exp_avg").item<double>(), 0.1 * 3.0, 1e-15);
}

}  // namespace
}  // namespace kiln
