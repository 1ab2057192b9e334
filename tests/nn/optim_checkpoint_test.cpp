// Optimizer checkpoints (Optimizer::save / load, state_dict / load_state_dict): SGD, Adam and
// AdamW resume bit-exactly after a save and a load into a fresh optimizer, the file's layout,
// load errors, and state kept in the parameters' dtype (state_in_param_dtype), including
// checkpoints written before that option existed. The update rules: tests/nn/optim_test.cpp.
#include <gtest/gtest.h>
#include <kiln/kiln.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "nn/optim/adam.h"
#include "nn/optim/adamw.h"
#include "nn/optim/sgd.h"
#include "nn/optim_test_util.h"
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

// Parameters covering each path: a multi-threaded fused f32 tensor, a small f32 tensor, an f64
// tensor (op path), and one that never gets a gradient (no state). Two groups.
std::vector<Tensor> make_params() {
  manual_seed(11);
  return {randn({40000}), randn({3, 5}), randn({7}, kFloat64), randn({4})};
}

std::vector<OptimizerParamGroup> two_groups(const std::vector<Tensor>& p,
                                            std::unique_ptr<optim::OptimizerOptions> second) {
  std::vector<OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<Tensor>{p[0], p[1]});
  groups.emplace_back(std::vector<Tensor>{p[2], p[3]}, std::move(second));
  return groups;
}

// Steps first, ..., last - 1 of a training run (the gradients depend on the step). The
// gradients are made without history: one recorded from a parameter that requires grad would
// hold that parameter through its graph, a cycle that is never freed (LeakSanitizer).
void train_steps(optim::Optimizer& opt, const std::vector<Tensor>& params, int first, int last) {
  for (int s = first; s < last; ++s) {
    for (size_t i = 0; i + 1 < params.size(); ++i) {
      Tensor p = params[i];
      NoGradGuard no_grad;
      p.mutable_grad() = p.sin() * 0.5 + p * p * 0.1 - 0.05 * static_cast<double>(s);
    }
    opt.step();
  }
}

std::string temp_file(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("kiln_optim_test_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

template <typename Opt, typename Options>
void check_resume(const Options& defaults, const Options& second, const Options& other) {
  // Six steps straight.
  std::vector<Tensor> straight = make_params();
  Opt a(two_groups(straight, second.clone()), defaults);
  train_steps(a, straight, 0, 6);

  // Three steps, save, a fresh optimizer (other options) on copies, load, three more.
  std::vector<Tensor> first = make_params();
  Opt b(two_groups(first, second.clone()), defaults);
  train_steps(b, first, 0, 3);
  const std::string path = temp_file(b.name() + ".safetensors");
  b.save(path);
  std::vector<Tensor> resumed;
  for (const Tensor& p : first) resumed.push_back(p.detach().clone());
  Opt c(two_groups(resumed, other.clone()), other);
  c.load(path);
  EXPECT_EQ(c.param_groups()[0].options().get_lr(), defaults.get_lr());
  EXPECT_EQ(c.param_groups()[1].options().get_lr(), second.get_lr());
  EXPECT_EQ(c.state().count(resumed[3].impl()), 0u);
  train_steps(c, resumed, 3, 6);
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_TRUE(equal(straight[i], resumed[i])) << b.name() << " parameter " << i;
  }
  std::filesystem::remove(path);
}

TEST(OptimCheckpoint, ResumesBitExactly) {
  check_resume<SGD>(SGDOptions(0.05).momentum(0.9).weight_decay(1e-3),
                    SGDOptions(0.02).momentum(0.8).nesterov(true), SGDOptions(0.5));
  check_resume<Adam>(AdamOptions(0.01).amsgrad(true).weight_decay(0.01),
                     AdamOptions(0.003).betas({0.8, 0.95}), AdamOptions(0.5));
  check_resume<AdamW>(AdamWOptions(0.01).weight_decay(0.1),
                      AdamWOptions(0.002).weight_decay(0).amsgrad(true).eps(1e-6),
                      AdamWOptions(0.5));
}

TEST(OptimCheckpoint, FileLayout) {
  std::vector<Tensor> p = make_params();
  AdamW opt(two_groups(p, AdamWOptions(0.002).amsgrad(true).clone()), AdamWOptions(0.01));
  train_steps(opt, p, 0, 2);
  SafetensorsMetadata meta;
  const TensorMap tensors = opt.state_dict(&meta);
  EXPECT_EQ(meta.at("kiln.optimizer"), "AdamW");
  EXPECT_EQ(meta.at("param_groups"), "2");
  EXPECT_EQ(meta.at("param_groups.0.num_params"), "2");
  EXPECT_EQ(meta.at("param_groups.1.lr"), "0.002");
  EXPECT_EQ(meta.at("param_groups.1.amsgrad"), "1");
  EXPECT_EQ(meta.at("state.0.step"), "2");
  EXPECT_EQ(meta.count("state.3.step"), 0u);
  EXPECT_EQ(tensors.count("state.0.exp_avg"), 1u);
  EXPECT_EQ(tensors.count("state.2.max_exp_avg_sq"), 1u);
  EXPECT_EQ(tensors.count("state.0.max_exp_avg_sq"), 0u);
  EXPECT_EQ(tensors.at("state.2.exp_avg").dtype(), kFloat64);
  EXPECT_EQ(tensors.at("state.1.exp_avg_sq").sizes(), p[1].sizes());
}

TEST(OptimCheckpoint, LoadErrors) {
  std::vector<Tensor> p = make_params();
  AdamW opt(two_groups(p, AdamWOptions(0.002).clone()), AdamWOptions(0.01));
  train_steps(opt, p, 0, 1);
  const std::string path = temp_file("errors.safetensors");
  opt.save(path);

  std::vector<Tensor> q = make_params();
  Adam adam(two_groups(q, AdamOptions().clone()), AdamOptions());
  EXPECT_KILN_ERROR(adam.load(path), "[Adam::load] the checkpoint holds the state of AdamW");
  AdamW one_group(q, AdamWOptions());
  EXPECT_KILN_ERROR(one_group.load(path), "has 2 parameter groups, the optimizer 1");
  std::vector<Tensor> r = make_params();
  r[1] = randn({5, 3});
  AdamW reshaped(two_groups(r, AdamWOptions(0.5).clone()), AdamWOptions(0.5));
  EXPECT_KILN_ERROR(reshaped.load(path), "\"state.1.exp_avg\" has shape [3, 5]");
  EXPECT_EQ(reshaped.get_lr(), 0.5);  // a failed load changes nothing
  EXPECT_TRUE(reshaped.state().empty());
  std::filesystem::remove(path);
}

// A state holds exactly the buffers its optimizer keeps, in a floating-point dtype: a missing
// second moment crashed the next step, unknown buffers and integer moments were accepted.
TEST(OptimCheckpoint, StateBuffersAreExactlyTheOptimizers) {
  std::vector<Tensor> p = make_params();
  AdamW opt(two_groups(p, AdamWOptions(0.002).amsgrad(true).clone()), AdamWOptions(0.01));
  train_steps(opt, p, 0, 1);
  SafetensorsMetadata meta;
  const TensorMap good = opt.state_dict(&meta);
  auto load_into_fresh = [&](const TensorMap& tensors) {
    std::vector<Tensor> q = make_params();
    AdamW fresh(two_groups(q, AdamWOptions(0.5).clone()), AdamWOptions(0.5));
    fresh.load_state_dict(tensors, meta);
  };
  EXPECT_NO_THROW(load_into_fresh(good));
  TensorMap bad = good;
  bad.erase("state.1.exp_avg_sq");
  EXPECT_KILN_ERROR(load_into_fresh(bad),
                    "[AdamW::load] the checkpoint has no \"state.1.exp_avg_sq\" (parameter 1 has "
                    "taken 1 steps; its state must hold exp_avg, exp_avg_sq)");
  bad = good;
  bad.erase("state.2.max_exp_avg_sq");  // group 1 has amsgrad
  EXPECT_KILN_ERROR(load_into_fresh(bad), "no \"state.2.max_exp_avg_sq\"");
  bad = good;
  bad["state.0.momentum_buffer"] = zeros({40000});
  EXPECT_KILN_ERROR(load_into_fresh(bad),
                    "unexpected tensor \"state.0.momentum_buffer\" in the checkpoint (AdamW keeps "
                    "exp_avg, exp_avg_sq for a parameter)");
  bad = good;
  bad["state.1.exp_avg"] = zeros({3, 5}, kInt32);
  EXPECT_KILN_ERROR(load_into_fresh(bad), "\"state.1.exp_avg\" is int32, not a floating-point");
  // SGD without momentum keeps nothing; with momentum, its buffer.
  std::vector<Tensor> s = make_params();
  SGD sgd(two_groups(s, SGDOptions(0.1).momentum(0.9).clone()), SGDOptions(0.1));
  train_steps(sgd, s, 0, 1);
  SafetensorsMetadata sgd_meta;
  TensorMap sgd_state = sgd.state_dict(&sgd_meta);
  EXPECT_EQ(sgd_state.size(), 1u);  // state.2.momentum_buffer
  sgd_state["state.0.momentum_buffer"] = zeros({40000});
  std::vector<Tensor> t = make_params();
  SGD other(two_groups(t, SGDOptions(0.1).clone()), SGDOptions(0.1));
  EXPECT_KILN_ERROR(other.load_state_dict(sgd_state, sgd_meta),
                    "unexpected tensor \"state.0.momentum_buffer\" in the checkpoint (SGD keeps no "
                    "buffers for a parameter)");
}

// bf16 parameters (a multi-threaded one, a small one), an f32 one and one without a gradient:
// group 0 keeps its moments in bf16, group 1 in f32.
std::vector<Tensor> make_bf16_params() {
  manual_seed(12);
  return {randn({40000}).to(kBFloat16), randn({3, 5}).to(kBFloat16), randn({7}),
          randn({4}).to(kBFloat16)};
}

TEST(OptimCheckpoint, StateInParamDtypeRoundTrips) {
  const AdamWOptions first_options =
      AdamWOptions(0.01).weight_decay(0.1).state_in_param_dtype(true);
  const AdamWOptions second_options = AdamWOptions(0.002).amsgrad(true);
  std::vector<Tensor> straight = make_bf16_params();
  AdamW a(two_groups(straight, second_options.clone()), first_options);
  train_steps(a, straight, 0, 6);

  std::vector<Tensor> first = make_bf16_params();
  AdamW b(two_groups(first, second_options.clone()), first_options);
  train_steps(b, first, 0, 3);
  SafetensorsMetadata meta;
  const TensorMap tensors = b.state_dict(&meta);
  EXPECT_EQ(meta.at("param_groups.0.state_in_param_dtype"), "1");
  EXPECT_EQ(meta.at("param_groups.1.state_in_param_dtype"), "0");
  EXPECT_EQ(tensors.at("state.0.exp_avg").dtype(), kBFloat16);
  EXPECT_EQ(tensors.at("state.1.exp_avg_sq").dtype(), kBFloat16);
  EXPECT_EQ(tensors.at("state.2.max_exp_avg_sq").dtype(), kFloat32);
  const std::string path = temp_file("bf16_state.safetensors");
  b.save(path);

  // A fresh optimizer whose options say the opposite: load restores them and the state's dtype.
  std::vector<Tensor> resumed;
  for (const Tensor& p : first) resumed.push_back(p.detach().clone());
  AdamW c(two_groups(resumed, AdamWOptions(0.5).state_in_param_dtype(true).clone()),
          AdamWOptions(0.5));
  c.load(path);
  EXPECT_TRUE(static_cast<AdamWOptions&>(c.param_groups()[0].options()).state_in_param_dtype());
  EXPECT_FALSE(static_cast<AdamWOptions&>(c.param_groups()[1].options()).state_in_param_dtype());
  for (int i = 0; i < 2; ++i) {
    const auto& bufs = c.state().at(resumed[i].impl()).buffers;
    EXPECT_EQ(bufs.at("exp_avg").dtype(), kBFloat16);
    EXPECT_TRUE(equal(bufs.at("exp_avg"), b.state().at(first[i].impl()).buffers.at("exp_avg")));
  }
  EXPECT_EQ(c.state().at(resumed[2].impl()).buffers.at("exp_avg").dtype(), kFloat32);
  train_steps(c, resumed, 3, 6);
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_TRUE(equal(straight[i], resumed[i])) << "parameter " << i;
  }
  std::filesystem::remove(path);
}

// A checkpoint written before the option existed has no key: it loads as false (f32 state).
TEST(OptimCheckpoint, OlderCheckpointLoadsWithF32State) {
  for (bool decoupled : {false, true}) {
    std::vector<Tensor> p = make_bf16_params();
    auto a = make_adam(decoupled, {p[0], p[1], p[2]}, 0.1, true, /*in_param=*/false);
    train_steps(*a, {p[0], p[1], p[2], p[3]}, 0, 2);
    std::vector<Tensor> q;
    for (const Tensor& t : p) q.push_back(t.detach().clone().requires_grad_());
    auto b = make_adam(decoupled, {q[0], q[1], q[2]}, 0.1, true, /*in_param=*/true);
    SafetensorsMetadata meta;
    const TensorMap tensors = a->state_dict(&meta);
    ASSERT_EQ(meta.erase("param_groups.0.state_in_param_dtype"), 1u);
    b->load_state_dict(tensors, meta);
    const optim::OptimizerOptions& o = b->param_groups()[0].options();
    EXPECT_FALSE(decoupled ? static_cast<const AdamWOptions&>(o).state_in_param_dtype()
                           : static_cast<const AdamOptions&>(o).state_in_param_dtype());
    EXPECT_EQ(b->state().at(q[0].impl()).buffers.at("exp_avg").dtype(), kFloat32);
    // Resumes as the optimizer that wrote it.
    train_steps(*a, {p[0], p[1], p[2], p[3]}, 2, 4);
    train_steps(*b, {q[0], q[1], q[2], q[3]}, 2, 4);
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(equal(p[i], q[i])) << i;
    // Any other missing key is still an error.
    SafetensorsMetadata broken = meta;
    broken.erase("param_groups.0.amsgrad");
    EXPECT_KILN_ERROR(b->load_state_dict(tensors, broken),
                      "has no metadata entry \"param_groups.0.amsgrad\"");
    broken = meta;
    broken["param_groups.0.state_in_param_dtype"] = "yes";
    EXPECT_KILN_ERROR(b->load_state_dict(tensors, broken),
                      "\"param_groups.0.state_in_param_dtype\" is not a number: \"yes\"");
  }
}

// As torch casts loaded floating state to the parameter's dtype, load converts the moments to
// the dtype the loaded options ask for: bf16 moments saved under the option load as f32 when
// the checkpoint says false (say, state written by another tool), f32 ones as bf16 when true.
TEST(OptimCheckpoint, LoadConvertsTheStateToTheOptionsDtype) {
  std::vector<Tensor> p = make_bf16_params();
  AdamW a({p[0], p[1]}, AdamWOptions(0.01).state_in_param_dtype(true).amsgrad(true));
  train_steps(a, {p[0], p[1], p[3]}, 0, 2);
  SafetensorsMetadata meta;
  const TensorMap bf16_state = a.state_dict(&meta);
  ASSERT_EQ(bf16_state.at("state.0.exp_avg").dtype(), kBFloat16);
  meta["param_groups.0.state_in_param_dtype"] = "0";
  AdamW b({p[0].detach().clone().requires_grad_(), p[1].detach().clone().requires_grad_()},
          AdamWOptions(0.01));
  b.load_state_dict(bf16_state, meta);
  for (const auto& [key, buf] : b.state().at(b.parameters()[1].impl()).buffers) {
    EXPECT_EQ(buf.dtype(), kFloat32) << key;
    EXPECT_TRUE(equal(buf, bf16_state.at("state.1." + key).to(kFloat32))) << key;
  }

  AdamW f32({p[0], p[1]}, AdamWOptions(0.01).amsgrad(true));
  train_steps(f32, {p[0], p[1], p[3]}, 0, 2);
  const TensorMap f32_state = f32.state_dict(&meta);
  ASSERT_EQ(f32_state.at("state.0.exp_avg").dtype(), kFloat32);
  meta["param_groups.0.state_in_param_dtype"] = "1";
  b.load_state_dict(f32_state, meta);
  for (const auto& [key, buf] : b.state().at(b.parameters()[0].impl()).buffers) {
    EXPECT_EQ(buf.dtype(), kBFloat16) << key;
    EXPECT_TRUE(equal(buf, f32_state.at("state.0." + key).to(kBFloat16))) << key;
  }
}

}  // namespace
}  // namespace kiln
