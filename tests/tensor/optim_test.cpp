// The optimizer-update ops adam_update_ and sgd_update_ (tensor/ops/optim.cpp) on the CPU: the
// fused kernel against the decomposition, bit for bit (both do the same float operations in the
// same order), for f32, bf16 and f16 parameters with f32 or 16-bit state, contiguous and strided
// tensors, empty and 0-d ones, one large enough for several threads, several steps and every
// option; f64 (which only the decomposition runs) against an f64 reference; and every misuse.
// The lr and the step counts are 0-d CPU tensor inputs: a call replayed with its attributes
// frozen follows their values, and the meta rules never read them. adam_update_'s optional
// gradient factor against foreach_mul_ then the plain update (the same bits). increment_, which
// advances the step counts.
#include "tensor/ops/optim.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tensor/foreach.h"
#include "tensor/ops.h"
#include "tensor/registry.h"
#include "tensor/storage.h"
#include "tensor/tensor_data.h"
#include "tensor/tensor_impl.h"
#include "test_util.h"

namespace kiln {
namespace {

using Attrs = absl::InlinedVector<Attr, 4>;

// Shapes: empty, 0-d, odd, 2-D, and one above the fused loop's grain (several threads).
const std::vector<Shape> kShapes = {{0}, {}, {7}, {33, 17}, {150, 201}};

// `values` in a fresh tensor of `dtype`: contiguous, or strided (transposed for 2-D, every other
// element of a larger buffer for 1-D).
Tensor laid_out(const Tensor& values, ScalarType dtype, bool strided) {
  const Tensor v = values.to(dtype);
  if (!strided || v.numel() < 2) return v.clone();
  if (v.dim() == 2) return v.t().contiguous().t();
  Tensor t = zeros({v.numel(), 2}, dtype).select(1, 0);
  t.copy_(v);
  return t;
}

// One list per input of an optimizer-update op, built twice from the same values: the same call
// for the kernel and for the decomposition.
struct Lists {
  std::vector<std::vector<Tensor>> lists;

  TensorVec inputs() const {
    TensorVec in;
    for (const auto& l : lists) in.insert(in.end(), l.begin(), l.end());
    return in;
  }
};

// Lists of `count` tensors per shape: list k in dtypes[k], random values (abs for `positive`).
Lists make_lists(const std::vector<ScalarType>& dtypes, const std::vector<bool>& positive,
                 bool strided, uint64_t seed) {
  manual_seed(seed);
  Lists out;
  out.lists.resize(dtypes.size());
  for (const Shape& s : kShapes) {
    for (size_t k = 0; k < dtypes.size(); ++k) {
      const Tensor v = positive[k] ? randn(s).abs() : randn(s);
      out.lists[k].push_back(laid_out(v, dtypes[k], strided));
    }
  }
  return out;
}

// The 0-d CPU tensors an update call reads on the host: the lr and the step counts.
Tensor lr_tensor(double lr) { return scalar_tensor(lr, kDouble); }
Tensor step_tensor(int64_t t) { return scalar_tensor(t, kInt64); }

// `inputs` followed by the step counts `steps` (Adam; none for SGD) and the lr.
TensorVec with_scalars(TensorVec inputs, const Shape& steps, double lr) {
  for (int64_t t : steps) inputs.push_back(step_tensor(t));
  inputs.push_back(lr_tensor(lr));
  return inputs;
}

// Every tensor of `a` equals its peer in `b`, bit for bit.
void expect_same_bits(const Lists& a, const Lists& b, const std::string& what) {
  for (size_t k = 0; k < a.lists.size(); ++k) {
    for (size_t i = 0; i < a.lists[k].size(); ++i) {
      const Tensor& x = a.lists[k][i];
      const Tensor& y = b.lists[k][i];
      EXPECT_TRUE(equal(x, y)) << what << ": list " << k << " tensor " << i << " max abs diff "
                               << (x.to(kDouble) - y.to(kDouble)).abs().max().item<double>();
    }
  }
}

// --- adam_update_ ------------------------------------------------------------------------------

struct AdamCase {
  bool decoupled, amsgrad;
  double weight_decay, beta1;
};

const std::vector<AdamCase> kAdamCases = {
    {true, false, 0.1, 0.9},  {true, true, 0.1, 0.9},  {false, false, 0.05, 0.9},
    {false, true, 0.0, 0.9},  {true, false, 0.0, 0.3},  // lerp from the far end (1 - beta1 >= 0.5)
    {false, true, 0.02, 0.2},
};

Attrs adam_attrs(const AdamCase& c, int64_t n) {
  return {n, c.beta1, 0.95, 1e-8, c.weight_decay, c.decoupled, c.amsgrad};
}

// Lists (params, grads, exp_avgs, exp_avg_sqs[, max_exp_avg_sqs]) with grads replaced per step.
Lists make_adam(ScalarType dtype, ScalarType state, bool amsgrad, bool strided) {
  std::vector<ScalarType> dtypes = {dtype, dtype, state, state};
  std::vector<bool> positive = {false, false, false, true};
  if (amsgrad) {
    dtypes.push_back(state);
    positive.push_back(true);
  }
  return make_lists(dtypes, positive, strided, 3);
}

// Three steps through the CPU kernel and through the decomposition on copies of the same lists;
// parameter i is at step t + i (step counts differ per parameter).
void check_adam_kernel_matches_decomposition(ScalarType dtype, ScalarType state, bool strided) {
  static const OpDef& op = KILN_OP(adam_update_);
  for (const AdamCase& c : kAdamCases) {
    Lists a = make_adam(dtype, state, c.amsgrad, strided);
    Lists b = make_adam(dtype, state, c.amsgrad, strided);
    const int64_t n = static_cast<int64_t>(a.lists[0].size());
    for (int64_t t = 1; t <= 3; ++t) {
      manual_seed(50 + t);
      Shape steps;
      for (int64_t i = 0; i < n; ++i) {
        const Tensor g = randn(a.lists[0][i].sizes()).to(dtype);
        a.lists[1][i] = g;
        b.lists[1][i] = g.clone();
        steps.push_back(t + i);
      }
      call_op_with_kernel(op, "fused", with_scalars(a.inputs(), steps, 0.02), adam_attrs(c, n));
      call_decomposition(op, with_scalars(b.inputs(), steps, 0.02), adam_attrs(c, n));
    }
    const std::string what = std::string(dtype_name(dtype)) + " params, " +
                             std::string(dtype_name(state)) + " state" +
                             (strided ? ", strided" : "") + (c.decoupled ? ", AdamW" : ", Adam") +
                             (c.amsgrad ? " amsgrad" : "") + " wd " +
                             std::to_string(c.weight_decay) + " beta1 " + std::to_string(c.beta1);
    expect_same_bits(a, b, what);
    EXPECT_FALSE(equal(a.lists[0][4], make_adam(dtype, state, c.amsgrad, strided).lists[0][4]))
        << what << ": the parameters moved";
  }
}

TEST(OptimOpAdam, KernelMatchesDecompositionF32) {
  check_adam_kernel_matches_decomposition(kFloat, kFloat, false);
  check_adam_kernel_matches_decomposition(kFloat, kFloat, true);
}

TEST(OptimOpAdam, KernelMatchesDecompositionBf16ParamsF32State) {
  check_adam_kernel_matches_decomposition(kBFloat16, kFloat, false);
  check_adam_kernel_matches_decomposition(kBFloat16, kFloat, true);
}

TEST(OptimOpAdam, KernelMatchesDecomposition16BitState) {
  for (ScalarType dtype : {kBFloat16, kHalf}) {
    check_adam_kernel_matches_decomposition(dtype, dtype, false);
    check_adam_kernel_matches_decomposition(dtype, dtype, true);
  }
  check_adam_kernel_matches_decomposition(kHalf, kFloat, false);
}

// f64 has no kernel (the kernels compute in f32): the op runs its decomposition, which follows
// the rule in f64.
TEST(OptimOpAdam, F64RunsTheDecomposition) {
  static const OpDef& op = KILN_OP(adam_update_);
  for (const AdamCase& c : kAdamCases) {
    const std::vector<double> p0 = {1.5, -0.25, 3.0}, g = {0.5, -1.25, 2.0};
    const std::vector<double> m0 = {0.1, 0.2, -0.3}, v0 = {0.04, 0.5, 0.01}, x0 = {0.05, 0.1, 1.0};
    Tensor p = tensor(p0, kDouble), m = tensor(m0, kDouble), v = tensor(v0, kDouble);
    Tensor x = tensor(x0, kDouble);
    const Tensor grad = tensor(g, kDouble);
    EXPECT_KILN_ERROR(call_op_with_kernel(op, "fused",
                                          with_scalars(c.amsgrad ? TensorVec{p, grad, m, v, x}
                                                                 : TensorVec{p, grad, m, v},
                                                       {4}, 0.02),
                                          adam_attrs(c, 1)),
                      "[adam_update_] the cpu kernel 'fused' does not support this call");
    adam_update_({p}, {grad}, {m}, {v}, c.amsgrad ? std::vector<Tensor>{x} : std::vector<Tensor>{},
                 {step_tensor(4)}, lr_tensor(0.02), c.beta1, 0.95, c.weight_decay, 1e-8, c.amsgrad,
                 c.decoupled);
    for (size_t i = 0; i < 3; ++i) {
      double pi = p0[i], gi = g[i];
      if (c.decoupled) {
        pi *= 1 - 0.02 * c.weight_decay;
      } else {
        gi += c.weight_decay * pi;
      }
      const double mi = c.beta1 * m0[i] + (1 - c.beta1) * gi;
      const double vi = 0.95 * v0[i] + 0.05 * gi * gi;
      const double used = c.amsgrad ? std::max(x0[i], vi) : vi;
      const double denom = std::sqrt(used) / std::sqrt(1 - std::pow(0.95, 4)) + 1e-8;
      pi -= 0.02 / (1 - std::pow(c.beta1, 4)) * mi / denom;
      EXPECT_NEAR(p.to_vector<double>()[i], pi, 1e-14) << i;
      EXPECT_NEAR(m.to_vector<double>()[i], mi, 1e-15) << i;
      EXPECT_NEAR(v.to_vector<double>()[i], vi, 1e-15) << i;
      if (c.amsgrad) {
        EXPECT_NEAR(x.to_vector<double>()[i], used, 1e-15) << i;
      }
    }
  }
}

// The op writes params and state in place and bumps their versions; grads stay untouched.
TEST(OptimOpAdam, WritesInPlaceAndBumpsVersions) {
  Tensor p = randn({5}), g = randn({5}), m = zeros({5}), v = zeros({5}), x = zeros({5});
  const Tensor g0 = g.clone(), p0 = p.clone();
  const Tensor t = step_tensor(1), lr = lr_tensor(0.1);
  const uint64_t pv = p._version(), mv = m._version(), xv = x._version(), gv = g._version();
  const uint64_t tv = t._version(), lv = lr._version();
  adam_update_({p}, {g}, {m}, {v}, {x}, {t}, lr, 0.9, 0.999, 0.0, 1e-8, true, true);
  EXPECT_GT(p._version(), pv);
  EXPECT_GT(m._version(), mv);
  EXPECT_GT(x._version(), xv);
  EXPECT_EQ(g._version(), gv);
  EXPECT_TRUE(equal(g, g0));
  // The step count and the lr are read, not written.
  EXPECT_EQ(t._version(), tv);
  EXPECT_EQ(lr._version(), lv);
  EXPECT_EQ(t.item<int64_t>(), 1);
  // First step from zero state: m = 0.1 g, v = 0.001 g^2, p moves by lr * g / (|g| + eps).
  EXPECT_TRUE(allclose(m, g * 0.1, 1e-6, 1e-7));
  EXPECT_TRUE(allclose(p, p0 - 0.1 * g / (g.abs() + 1e-8), 1e-6, 1e-7));
  adam_update_({}, {}, {}, {}, {}, {}, lr, 0.9, 0.999, 0.0, 1e-8, false, false);  // nothing to do
}

TEST(OptimOpAdam, Errors) {
  static const OpDef& op = KILN_OP(adam_update_);
  auto f = [](IntArrayRef s, ScalarType d = kFloat) { return zeros(s, d); };
  const Tensor p = f({4}), g = f({4}), m = f({4}), v = f({4});
  const Tensor t1 = step_tensor(1), lr = lr_tensor(0.1);
  auto run = [&](TensorVec in, const Shape& steps = {1}, double lr = 0.1, double beta1 = 0.9,
                 double beta2 = 0.999, double eps = 1e-8, double wd = 0.0, bool amsgrad = false,
                 int64_t n = 1) {
    call_op(op, with_scalars(std::move(in), steps, lr), {n, beta1, beta2, eps, wd, false, amsgrad});
  };
  // The wrapper's list lengths.
  EXPECT_KILN_ERROR(
      adam_update_({p}, {}, {m}, {v}, {}, {t1}, lr, 0.9, 0.999, 0, 1e-8, false, false),
      "[adam_update_] expected 1 grads, exp_avgs, exp_avg_sqs and state_steps and 0 "
      "max_exp_avg_sqs, got 0, 1, 1, 1 and 0");
  EXPECT_KILN_ERROR(
      adam_update_({p}, {g}, {m}, {v}, {}, {t1}, lr, 0.9, 0.999, 0, 1e-8, true, false),
      "and 1 max_exp_avg_sqs, got 1, 1, 1, 1 and 0");
  EXPECT_KILN_ERROR(adam_update_({p}, {g}, {m}, {v}, {}, {}, lr, 0.9, 0.999, 0, 1e-8, false, false),
                    "got 1, 1, 1, 0 and 0");
  // The call's layout.
  EXPECT_KILN_ERROR(run({p, g, m, v}, {1}, 0.1, 0.9, 0.999, 1e-8, 0, false, -1),
                    "[adam_update_] the list length n must be non-negative, got -1");
  EXPECT_KILN_ERROR(run({p, g, m}),
                    "[adam_update_] expected 6 tensors for n = 1 (params, grads, exp_avgs, "
                    "exp_avg_sqs, state_steps, then lr) or 7 with a grad_factor, got 5");
  EXPECT_KILN_ERROR(run({p, g, m, v}, {1}, 0.1, 0.9, 0.999, 1e-8, 0, true),
                    "expected 7 tensors for n = 1 (params, grads, exp_avgs, exp_avg_sqs, "
                    "max_exp_avg_sqs, state_steps, then lr) or 8 with a grad_factor, got 6");
  EXPECT_KILN_ERROR(run({p, g, m, v}, {1, 2, 3}), "[adam_update_] expected 6 tensors for n = 1");
  // One tensor more is read as a grad_factor after the lr: here the lr's place holds a count.
  EXPECT_KILN_ERROR(run({p, g, m, v}, {1, 2}), "[adam_update_] lr must be a 0-d float64 CPU");
  EXPECT_KILN_ERROR(call_op(op, {p, g, m, v, t1, lr}, {int64_t{1}, 0.9}),
                    "[adam_update_] missing attribute 2");
  // Hyper-parameters; the lr and step counts are checked where they are read (the kernel).
  EXPECT_KILN_ERROR(run({p, g, m, v}, {1}, -0.1), "[adam_update_] invalid learning rate: -0.1");
  EXPECT_KILN_ERROR(run({p, g, m, v}, {1}, 0.1, 1.0), "[adam_update_] invalid beta1: 1");
  EXPECT_KILN_ERROR(run({p, g, m, v}, {1}, 0.1, 0.9, -0.5), "[adam_update_] invalid beta2: -0.5");
  EXPECT_KILN_ERROR(run({p, g, m, v}, {1}, 0.1, 0.9, 0.999, -1),
                    "[adam_update_] invalid epsilon value: -1");
  EXPECT_KILN_ERROR(run({p, g, m, v}, {1}, 0.1, 0.9, 0.999, 1e-8, -0.5),
                    "[adam_update_] invalid weight_decay value: -0.5");
  EXPECT_KILN_ERROR(run({p, g, m, v}, {0}),
                    "[adam_update_] state_steps[0] is 0: step counts start at 1");
  // The lr and step counts: 0-d CPU tensors of f64 and int64.
  const Attrs attrs = {int64_t{1}, 0.9, 0.999, 1e-8, 0.0, false, false};
  EXPECT_KILN_ERROR(call_op(op, {p, g, m, v, t1, scalar_tensor(0.1, kFloat)}, attrs),
                    "[adam_update_] lr must be a 0-d float64 CPU tensor, got a float32 tensor of "
                    "shape [] on cpu");
  EXPECT_KILN_ERROR(call_op(op, {p, g, m, v, t1, full({1}, 0.1, kDouble)}, attrs),
                    "lr must be a 0-d float64 CPU tensor, got a float64 tensor of shape [1]");
  EXPECT_KILN_ERROR(call_op(op, {p, g, m, v, scalar_tensor(1, kInt32), lr}, attrs),
                    "[adam_update_] state_steps[0] must be a 0-d int64 CPU tensor, got a int32 "
                    "tensor of shape []");
  EXPECT_KILN_ERROR(call_op(op, {p, g, m, v, full({1}, 1, kInt64), lr}, attrs),
                    "state_steps[0] must be a 0-d int64 CPU tensor");
  EXPECT_KILN_ERROR(call_op(op, {p, g, m, v, Tensor(), lr}, attrs),
                    "[adam_update_] state_steps[0] is undefined");
  EXPECT_KILN_ERROR(call_op(op, {p, g, m, v, t1, Tensor()}, attrs),
                    "[adam_update_] lr is undefined");
  // Parameters and grads.
  EXPECT_KILN_ERROR(run({Tensor(), g, m, v}), "[adam_update_] params[0] is undefined");
  EXPECT_KILN_ERROR(run({p, g, m, Tensor()}), "[adam_update_] exp_avg_sqs[0] is undefined");
  EXPECT_KILN_ERROR(run({f({4}, kInt64), f({4}, kInt64), m, v}),
                    "[adam_update_] expected floating-point params, got int64 for params[0]");
  EXPECT_KILN_ERROR(
      run({p, f({4}, kDouble), g, g, m, m, v, v}, {1, 1}, 0.1, 0.9, 0.999, 1e-8, 0, false, 2),
      "[adam_update_] params[1] has dtype float64 but params[0] has float32: one "
      "call takes parameters of one dtype");
  EXPECT_KILN_ERROR(run({p, f({3}), m, v}),
                    "[adam_update_] grads[0] has shape [3] but params[0] has shape [4]");
  EXPECT_KILN_ERROR(run({p, f({4}, kBFloat16), m, v}),
                    "[adam_update_] grads[0] has dtype bfloat16 but params[0] has dtype float32");
  // State.
  EXPECT_KILN_ERROR(run({p, g, f({4}, kBFloat16), f({4}, kBFloat16)}),
                    "[adam_update_] exp_avgs[0] has dtype bfloat16: the state takes the params' "
                    "dtype (float32)");
  const Tensor pb = f({4}, kBFloat16);
  EXPECT_KILN_ERROR(run({pb, pb, f({4}, kHalf), f({4}, kHalf)}),
                    "exp_avgs[0] has dtype float16: the state takes the params' dtype (bfloat16) "
                    "or float32");
  EXPECT_KILN_ERROR(run({p, g, m, f({4}, kDouble)}),
                    "[adam_update_] exp_avg_sqs[0] has dtype float64 but the call's state has "
                    "float32: one call takes state of one dtype");
  EXPECT_KILN_ERROR(run({p, g, m, v, f({2, 2})}, {1}, 0.1, 0.9, 0.999, 1e-8, 0, true),
                    "[adam_update_] max_exp_avg_sqs[0] has shape [2, 2] but params[0] has shape "
                    "[4]");
  // One device per call.
  const TensorOptions on_meta = TensorOptions().device(Device(kMeta));
  const Tensor meta = empty({4}, on_meta);
  EXPECT_KILN_ERROR(run({p, meta, m, v}), "[adam_update_] expected all tensors on the same device");
  // A 0-d CPU parameter passes the device check as the lr and step counts do
  // (allow_cpu_scalars), but the meta rule keeps every list on the parameters' device.
  const Tensor meta0 = empty(IntArrayRef(), on_meta);
  EXPECT_KILN_ERROR(run({f({}), meta0, meta0, meta0}),
                    "[adam_update_] grads[0] is on meta but params[0] is on cpu");
}

// The meta rule never reads the lr or the step counts (tracing runs on proxies without data):
// a call on meta tensors passes it whatever the values, which the kernels check when they read
// them.
TEST(OptimOpAdam, MetaRuleReadsNoValues) {
  static const OpDef& op = KILN_OP(adam_update_);
  const TensorOptions on_meta = TensorOptions().device(Device(kMeta));
  const Tensor p = empty({4}, on_meta);
  const Attrs attrs = {int64_t{1}, 0.9, 0.999, 1e-8, 0.0, false, false};
  const Tensor meta_step = empty(IntArrayRef(), on_meta.dtype(kInt64));
  const Tensor meta_lr = empty(IntArrayRef(), on_meta.dtype(kDouble));
  EXPECT_EQ(call_op(op, {p, p, p, p, meta_step, meta_lr}, attrs).size(), 3u);
  // CPU step counts and lr that a kernel would refuse (step 0, lr < 0) join meta parameters.
  EXPECT_EQ(call_op(op, {p, p, p, p, step_tensor(0), lr_tensor(-1)}, attrs).size(), 3u);
  EXPECT_KILN_ERROR(call_op(op, {p, p, p, p, empty(IntArrayRef(), on_meta), meta_lr}, attrs),
                    "state_steps[0] must be a 0-d int64 CPU tensor, got a float32 tensor of "
                    "shape [] on meta");
}

// Capturable calls: the lr and the step counts on the parameters' GPU (read there by the CUDA
// kernel) or all on the CPU, never split between the two. Checked on proxies of CUDA tensors (the
// tracer's), which need no GPU.
Tensor gpu_proxy(const Shape& sizes, ScalarType dtype, int device = 0) {
  return Tensor(std::make_shared<TensorImpl>(
      proxy_storage(static_cast<size_t>(numel_of(sizes)) * element_size(dtype),
                    Device(kCUDA, device)),
      sizes, contiguous_strides(sizes), 0, dtype));
}

TEST(OptimOpAdam, ScalarsAllOnTheCpuOrAllOnTheParamsDevice) {
  const ProxyModeGuard proxies;
  const Tensor p = gpu_proxy({4}, kFloat);
  const Tensor step = gpu_proxy({}, kInt64);
  const Tensor lr = gpu_proxy({}, kDouble);
  auto update = [&](const Tensor& t, const Tensor& l) {
    adam_update_({p}, {p}, {p}, {p}, {}, {t}, l, 0.9, 0.999, 0.1, 1e-8, false, true);
  };
  update(step, lr);                        // on the parameters' device
  update(step_tensor(1), lr_tensor(0.1));  // on the CPU
  EXPECT_KILN_ERROR(update(step, lr_tensor(0.1)),
                    "[adam_update_] state_steps[0] must be a 0-d int64 CPU tensor, got a int64 "
                    "tensor of shape [] on cuda:0 (the step counts are where the lr is");
  EXPECT_KILN_ERROR(update(step_tensor(1), lr),
                    "[adam_update_] state_steps[0] must be a 0-d int64 tensor on cuda:0, got a "
                    "int64 tensor of shape [] on cpu");
  const Tensor other_gpu_lr = gpu_proxy({}, kDouble, 1);
  EXPECT_KILN_ERROR(update(step, other_gpu_lr),
                    "[adam_update_] expected all tensors on the same device, got cuda:0 and "
                    "cuda:1");
  EXPECT_KILN_ERROR(update(step, gpu_proxy({}, kFloat)),
                    "[adam_update_] lr must be a 0-d float64 CPU tensor, got a float32 tensor of "
                    "shape [] on cuda:0 (or a 0-d float64 tensor on the params' device, cuda:0, "
                    "read there)");
  // increment_: the counts of one call on one device, the CPU or a GPU.
  increment_({step, gpu_proxy({}, kInt64)});
  EXPECT_KILN_ERROR(increment_({step, step_tensor(1)}),
                    "[increment_] tensors[1] must be a 0-d int64 tensor on cuda:0, got a int64 "
                    "tensor of shape [] on cpu (one call's counts share a device");
}

// What kiln::compile relies on: a call replayed with the attributes it was recorded with reads
// the lr and step counts afresh, so that changing them in place changes the update.
TEST(OptimOpAdam, ReplayedCallReadsTheCurrentLrAndSteps) {
  static const OpDef& op = KILN_OP(adam_update_);
  const AdamCase c = kAdamCases[0];
  Lists replayed = make_adam(kFloat, kFloat, false, false);
  Lists fresh = make_adam(kFloat, kFloat, false, false);
  const int64_t n = static_cast<int64_t>(replayed.lists[0].size());
  TensorVec steps;
  for (int64_t i = 0; i < n; ++i) steps.push_back(step_tensor(0));
  const Tensor lr = lr_tensor(0.02);
  TensorVec recorded = replayed.inputs();
  recorded.insert(recorded.end(), steps.begin(), steps.end());
  recorded.push_back(lr);
  const Attrs recorded_attrs = adam_attrs(c, n);
  const std::vector<double> lrs = {0.02, 0.005, 0.1};
  for (int64_t t = 1; t <= 3; ++t) {
    increment_(steps);
    *lr.data_ptr<double>() = lrs[t - 1];  // as set_lr writes it
    call_op(op, recorded, recorded_attrs);
    Shape counts(static_cast<size_t>(n), t);
    call_op(op, with_scalars(fresh.inputs(), counts, lrs[t - 1]), adam_attrs(c, n));
  }
  for (const Tensor& s : steps) EXPECT_EQ(s.item<int64_t>(), 3);
  expect_same_bits(replayed, fresh, "replayed against fresh calls");
}

// --- adam_update_ with a gradient factor ---------------------------------------------------------

// Three steps of the op with a gradient factor (`path`: the fused kernel, or the decomposition),
// against foreach_mul_(grads, factor) then the op without one, through the same path: the same
// bits (the product is rounded to the grad's dtype, as foreach_mul_ rounds it), and the grads
// the fused call read are left as they were. Without `zero_d`, the 0-d tensors are left out
// (foreach_mul_ multiplies a 0-d grad by a wider 0-d factor in the factor's dtype).
void check_grad_factor_matches_foreach_mul(ScalarType dtype, ScalarType state, bool strided,
                                           const Tensor& factor, bool decomposition,
                                           bool zero_d = true) {
  static const OpDef& op = KILN_OP(adam_update_);
  for (const AdamCase& c : kAdamCases) {
    Lists a = make_adam(dtype, state, c.amsgrad, strided);
    Lists b = make_adam(dtype, state, c.amsgrad, strided);
    if (!zero_d) {
      for (Lists* l : {&a, &b}) {
        for (auto& list : l->lists) list.erase(list.begin() + 1);  // kShapes[1] is 0-d
      }
    }
    const int64_t n = static_cast<int64_t>(a.lists[0].size());
    auto run = [&](TensorVec in) {
      if (decomposition) {
        call_decomposition(op, std::move(in), adam_attrs(c, n));
      } else {
        call_op_with_kernel(op, "fused", std::move(in), adam_attrs(c, n));
      }
    };
    for (int64_t t = 1; t <= 3; ++t) {
      manual_seed(70 + t);
      Shape steps;
      std::vector<Tensor> read;  // the grads the fused call reads, and their values
      for (int64_t i = 0; i < n; ++i) {
        const Tensor g = randn(a.lists[0][i].sizes()).to(dtype);
        a.lists[1][i] = g;
        b.lists[1][i] = g.clone();
        read.push_back(g.clone());
        steps.push_back(t + i);
      }
      TensorVec fused = with_scalars(a.inputs(), steps, 0.02);
      fused.push_back(factor);
      run(std::move(fused));
      foreach_mul_(b.lists[1], factor);
      run(with_scalars(b.inputs(), steps, 0.02));
      for (int64_t i = 0; i < n; ++i) EXPECT_TRUE(equal(a.lists[1][i], read[i])) << i;
    }
    const std::string what =
        std::string(dtype_name(dtype)) + " params, " + std::string(dtype_name(state)) + " state, " +
        std::string(dtype_name(factor.dtype())) + " factor" + (strided ? ", strided" : "") +
        (c.decoupled ? ", AdamW" : ", Adam") + (c.amsgrad ? " amsgrad" : "") +
        (decomposition ? ", decomposition" : ", kernel");
    a.lists[1] = b.lists[1];  // the grads differ by design: compare the rest
    expect_same_bits(a, b, what);
  }
}

// 0.37: not a power of two, so the rounding of g * factor matters for 16-bit grads.
TEST(OptimOpAdamGradFactor, MatchesForeachMulThenUpdate) {
  const Tensor f32 = scalar_tensor(0.37, kFloat);
  for (bool decomposition : {false, true}) {
    for (bool strided : {false, true}) {
      check_grad_factor_matches_foreach_mul(kFloat, kFloat, strided, f32, decomposition);
      check_grad_factor_matches_foreach_mul(kBFloat16, kFloat, strided, f32, decomposition);
      check_grad_factor_matches_foreach_mul(kBFloat16, kBFloat16, strided, f32, decomposition);
      check_grad_factor_matches_foreach_mul(kHalf, kHalf, strided, f32, decomposition);
    }
  }
  check_grad_factor_matches_foreach_mul(kHalf, kFloat, false, f32, false);
  check_grad_factor_matches_foreach_mul(kDouble, kDouble, false, scalar_tensor(0.37, kDouble),
                                        true);
  check_grad_factor_matches_foreach_mul(kDouble, kDouble, true, f32, true);
}

// The trainer's factor: f64 (clipping's coefficient), also in bf16.
TEST(OptimOpAdamGradFactor, OtherFactorDtypes) {
  for (ScalarType fd : {kDouble, kBFloat16}) {
    const Tensor f = scalar_tensor(0.37, kDouble).to(fd);
    for (bool decomposition : {false, true}) {
      check_grad_factor_matches_foreach_mul(kFloat, kFloat, false, f, decomposition, false);
      check_grad_factor_matches_foreach_mul(kBFloat16, kFloat, false, f, decomposition, false);
      check_grad_factor_matches_foreach_mul(kBFloat16, kBFloat16, true, f, decomposition, false);
    }
  }
}

// A factor of 1 changes nothing (the product is exact), and a call without the input is the
// plain update (the old call layout).
TEST(OptimOpAdamGradFactor, FactorOneIsThePlainUpdate) {
  static const OpDef& op = KILN_OP(adam_update_);
  const AdamCase c = kAdamCases[1];
  Lists a = make_adam(kBFloat16, kFloat, true, false);
  Lists b = make_adam(kBFloat16, kFloat, true, false);
  const int64_t n = static_cast<int64_t>(a.lists[0].size());
  Shape steps(static_cast<size_t>(n), 1);
  TensorVec in = with_scalars(a.inputs(), steps, 0.02);
  in.push_back(scalar_tensor(1.0, kDouble));
  call_op_with_kernel(op, "fused", in, adam_attrs(c, n));
  call_op_with_kernel(op, "fused", with_scalars(b.inputs(), steps, 0.02), adam_attrs(c, n));
  expect_same_bits(a, b, "factor 1");
  // The wrapper: an undefined factor is no input.
  Tensor p = randn({5}), m = zeros({5}), v = zeros({5});
  Tensor p2 = p.clone(), m2 = m.clone(), v2 = v.clone();
  const Tensor g = randn({5});
  adam_update_({p}, {g}, {m}, {v}, {}, {step_tensor(1)}, lr_tensor(0.1), 0.9, 0.999, 0.0, 1e-8,
               false, true, Tensor());
  adam_update_({p2}, {g}, {m2}, {v2}, {}, {step_tensor(1)}, lr_tensor(0.1), 0.9, 0.999, 0.0, 1e-8,
               false, true);
  EXPECT_TRUE(equal(p, p2));
  // A factor of 0.5 through the wrapper: the update of half the gradient.
  adam_update_({p}, {g}, {m}, {v}, {}, {step_tensor(2)}, lr_tensor(0.1), 0.9, 0.999, 0.0, 1e-8,
               false, true, scalar_tensor(0.5, kDouble));
  adam_update_({p2}, {g * 0.5}, {m2}, {v2}, {}, {step_tensor(2)}, lr_tensor(0.1), 0.9, 0.999, 0.0,
               1e-8, false, true);
  EXPECT_TRUE(equal(p, p2));
  EXPECT_TRUE(equal(m, m2));
}

TEST(OptimOpAdamGradFactor, Errors) {
  static const OpDef& op = KILN_OP(adam_update_);
  const Tensor p = zeros({4}), g = zeros({4}), m = zeros({4}), v = zeros({4});
  const Attrs attrs = {int64_t{1}, 0.9, 0.999, 1e-8, 0.0, false, false};
  auto run = [&](const Tensor& factor, const Tensor& param) {
    call_op(op, {param, g, m, v, step_tensor(1), lr_tensor(0.1), factor}, attrs);
  };
  EXPECT_KILN_ERROR(run(Tensor(), p),
                    "[adam_update_] grad_factor is undefined (leave it out for none)");
  EXPECT_KILN_ERROR(run(full({1}, 0.5), p),
                    "[adam_update_] grad_factor must be a 0-d floating-point tensor, got a "
                    "float32 tensor of shape [1] on cpu");
  EXPECT_KILN_ERROR(run(scalar_tensor(int64_t{1}, kInt64), p),
                    "[adam_update_] grad_factor must be a 0-d floating-point tensor, got a int64 "
                    "tensor of shape []");
  // A tensor the call writes: a 0-d parameter.
  const Tensor p0 = zeros({}), g0 = zeros({}), m0 = zeros({}), v0 = zeros({});
  EXPECT_KILN_ERROR(call_op(op, {p0, g0, m0, v0, step_tensor(1), lr_tensor(0.1), p0}, attrs),
                    "[adam_update_] grad_factor is a tensor the call writes: pass a copy");
  // On another device than the parameters (and not the CPU).
  const TensorOptions on_meta = TensorOptions().device(Device(kMeta));
  const Tensor mp = empty({4}, on_meta);
  EXPECT_EQ(call_op(op, {mp, mp, mp, mp, step_tensor(1), lr_tensor(0.1), scalar_tensor(0.5)}, attrs)
                .size(),
            3u);  // a CPU factor joins parameters on any device (GPU: gpu_optim_test.cpp)
}

// --- increment_ --------------------------------------------------------------------------------

TEST(OptimOpIncrement, AddsOneToEachCountInPlace) {
  const Tensor a = step_tensor(0), b = step_tensor(41);
  const uint64_t av = a._version(), bv = b._version();
  increment_({a, b});
  EXPECT_EQ(a.item<int64_t>(), 1);
  EXPECT_EQ(b.item<int64_t>(), 42);
  EXPECT_GT(a._version(), av);
  EXPECT_GT(b._version(), bv);
  increment_({a});
  EXPECT_EQ(a.item<int64_t>(), 2);
  EXPECT_EQ(b.item<int64_t>(), 42);
  increment_({});  // nothing to do
  // On meta proxies (tracing) the call checks and changes nothing.
  const Tensor proxy = empty(IntArrayRef(), TensorOptions().device(Device(kMeta)).dtype(kInt64));
  static const OpDef& op = KILN_OP(increment_);
  EXPECT_EQ(call_op(op, {proxy}, {int64_t{1}}).size(), 1u);
  EXPECT_EQ(op.backward, nullptr);
}

TEST(OptimOpIncrement, Errors) {
  static const OpDef& op = KILN_OP(increment_);
  const Tensor a = step_tensor(0);
  EXPECT_KILN_ERROR(call_op(op, {a}, {int64_t{2}}),
                    "[increment_] expected 2 tensors for n = 2, got 1");
  EXPECT_KILN_ERROR(increment_({scalar_tensor(1.0, kDouble)}),
                    "[increment_] tensors[0] must be a 0-d int64 CPU tensor, got a float64 tensor "
                    "of shape [] on cpu");
  EXPECT_KILN_ERROR(increment_({a, zeros({2}, kInt64)}),
                    "[increment_] tensors[1] must be a 0-d int64 CPU tensor, got a int64 tensor "
                    "of shape [2]");
  EXPECT_EQ(a.item<int64_t>(), 0);  // a failed call writes nothing
}

// --- sgd_update_ -------------------------------------------------------------------------------

struct SgdCase {
  double momentum, dampening, weight_decay;
  bool nesterov;
};

const std::vector<SgdCase> kSgdCases = {
    {0, 0, 0, false},         {0, 0, 0.1, false},   {0.9, 0, 0, false},
    {0.9, 0.25, 0.01, false}, {0.9, 0, 0.01, true},
};

Attrs sgd_attrs(const SgdCase& c, int64_t n, const Shape& fresh) {
  return {n, c.momentum, c.dampening, c.weight_decay, c.nesterov, fresh};
}

Lists make_sgd(ScalarType dtype, ScalarType state, bool momentum, bool strided) {
  std::vector<ScalarType> dtypes = {dtype, dtype};
  if (momentum) dtypes.push_back(state);
  return make_lists(dtypes, std::vector<bool>(dtypes.size(), false), strided, 4);
}

// Three steps; on the first, every other buffer is new (its values are not read).
void check_sgd_kernel_matches_decomposition(ScalarType dtype, ScalarType state, bool strided) {
  static const OpDef& op = KILN_OP(sgd_update_);
  for (const SgdCase& c : kSgdCases) {
    const bool momentum = c.momentum != 0;
    Lists a = make_sgd(dtype, state, momentum, strided);
    Lists b = make_sgd(dtype, state, momentum, strided);
    const int64_t n = static_cast<int64_t>(a.lists[0].size());
    for (int64_t t = 1; t <= 3; ++t) {
      manual_seed(70 + t);
      Shape fresh;
      for (int64_t i = 0; i < n; ++i) {
        const Tensor g = randn(a.lists[0][i].sizes()).to(dtype);
        a.lists[1][i] = g;
        b.lists[1][i] = g.clone();
        if (momentum) fresh.push_back(t == 1 && i % 2 == 0 ? 1 : 0);
      }
      call_op_with_kernel(op, "fused", with_scalars(a.inputs(), {}, 0.05), sgd_attrs(c, n, fresh));
      call_decomposition(op, with_scalars(b.inputs(), {}, 0.05), sgd_attrs(c, n, fresh));
    }
    const std::string what =
        std::string(dtype_name(dtype)) + " params, " + std::string(dtype_name(state)) + " state" +
        (strided ? ", strided" : "") + " momentum " + std::to_string(c.momentum) + " dampening " +
        std::to_string(c.dampening) + " wd " + std::to_string(c.weight_decay) +
        (c.nesterov ? " nesterov" : "");
    expect_same_bits(a, b, what);
  }
}

TEST(OptimOpSgd, KernelMatchesDecompositionF32) {
  check_sgd_kernel_matches_decomposition(kFloat, kFloat, false);
  check_sgd_kernel_matches_decomposition(kFloat, kFloat, true);
}

TEST(OptimOpSgd, KernelMatchesDecompositionLowPrecision) {
  for (ScalarType dtype : {kBFloat16, kHalf}) {
    check_sgd_kernel_matches_decomposition(dtype, kFloat, false);
    check_sgd_kernel_matches_decomposition(dtype, kFloat, true);
    check_sgd_kernel_matches_decomposition(dtype, dtype, false);
  }
}

// A new buffer takes the (decayed) gradient; an old one is decayed and accumulates it.
TEST(OptimOpSgd, NewBuffersTakeTheGradient) {
  for (ScalarType dtype : {kFloat, kDouble}) {
    Tensor p1 = full({3}, 1.0, dtype), p2 = full({3}, 1.0, dtype);
    const Tensor g = full({3}, 2.0, dtype);
    Tensor b1 = full({3}, 123.0, dtype), b2 = full({3}, 10.0, dtype);
    sgd_update_({p1, p2}, {g, g}, {b1, b2}, {1, 0}, lr_tensor(0.1), 0.5, 0.0, 0.25, false);
    // g + 0.25 p = 2.25; b1 = 2.25, b2 = 0.5 * 10 + 2.25 = 7.25.
    EXPECT_TRUE(allclose(b1, full({3}, 2.25, dtype))) << dtype_name(dtype);
    EXPECT_TRUE(allclose(b2, full({3}, 7.25, dtype))) << dtype_name(dtype);
    EXPECT_TRUE(allclose(p1, full({3}, 1 - 0.225, dtype))) << dtype_name(dtype);
    EXPECT_TRUE(allclose(p2, full({3}, 1 - 0.725, dtype))) << dtype_name(dtype);
  }
}

TEST(OptimOpSgd, Errors) {
  static const OpDef& op = KILN_OP(sgd_update_);
  const Tensor p = zeros({4}), g = zeros({4}), b = zeros({4});
  auto run = [&](TensorVec in, double momentum, const Shape& fresh, bool nesterov = false,
                 double dampening = 0, double lr = 0.1, double wd = 0) {
    call_op(op, with_scalars(std::move(in), {}, lr),
            {int64_t{1}, momentum, dampening, wd, nesterov, fresh});
  };
  EXPECT_KILN_ERROR(sgd_update_({p}, {g}, {}, {}, lr_tensor(0.1), 0.9, 0, 0, false),
                    "[sgd_update_] expected 1 grads and 1 momentum_buffers and new_buffers flags, "
                    "got 1, 0 and 0");
  EXPECT_KILN_ERROR(run({p, g}, 0.9, {}),
                    "[sgd_update_] expected 4 tensors for n = 1 (params, "
                    "grads, momentum_buffers, then lr), got 3");
  EXPECT_KILN_ERROR(run({p, g, b}, 0, {}), "[sgd_update_] expected 3 tensors for n = 1");
  EXPECT_KILN_ERROR(run({p, g, b}, 0.9, {}),
                    "[sgd_update_] expected 1 new_buffers flags (one per momentum buffer), got 0");
  EXPECT_KILN_ERROR(run({p, g, b}, 0.9, {2}), "[sgd_update_] new_buffers[0] is 2, expected 0 or 1");
  EXPECT_KILN_ERROR(run({p, g}, 0, {}, false, 0, -1), "[sgd_update_] invalid learning rate: -1");
  EXPECT_KILN_ERROR(run({p, g, b}, -0.5, {0}), "[sgd_update_] invalid momentum value: -0.5");
  EXPECT_KILN_ERROR(run({p, g}, 0, {}, false, 0, 0.1, -1),
                    "[sgd_update_] invalid weight_decay value: -1");
  EXPECT_KILN_ERROR(run({p, g}, 0, {}, true), "[sgd_update_] Nesterov momentum requires");
  EXPECT_KILN_ERROR(run({p, g, b}, 0.9, {0}, true, 0.1),
                    "[sgd_update_] Nesterov momentum requires");
  EXPECT_KILN_ERROR(run({p, zeros({5}), b}, 0.9, {0}),
                    "[sgd_update_] grads[0] has shape [5] but params[0] has shape [4]");
  EXPECT_KILN_ERROR(run({p, g, zeros({4}, kBFloat16)}, 0.9, {0}),
                    "[sgd_update_] momentum_buffers[0] has dtype bfloat16: the state takes the "
                    "params' dtype (float32)");
  EXPECT_KILN_ERROR(run({p, g, zeros({2})}, 0.9, {0}),
                    "[sgd_update_] momentum_buffers[0] has shape [2] but params[0] has shape [4]");
  EXPECT_KILN_ERROR(call_op(op, {p, g, zeros({})}, {int64_t{1}, 0.0, 0.0, 0.0, false, Shape{}}),
                    "[sgd_update_] lr must be a 0-d float64 CPU tensor, got a float32 tensor of "
                    "shape [] on cpu");
}

// A call replayed with its recorded attributes reads the lr afresh (see the Adam test).
TEST(OptimOpSgd, ReplayedCallReadsTheCurrentLr) {
  static const OpDef& op = KILN_OP(sgd_update_);
  const SgdCase c = kSgdCases[3];  // momentum, dampening, weight decay
  Lists replayed = make_sgd(kFloat, kFloat, true, false);
  Lists fresh = make_sgd(kFloat, kFloat, true, false);
  const int64_t n = static_cast<int64_t>(replayed.lists[0].size());
  const TensorVec recorded = with_scalars(replayed.inputs(), {}, 0.0);
  const Shape old_buffers(static_cast<size_t>(n), 0);
  for (double value : {0.05, 0.2, 0.01}) {
    *recorded.back().data_ptr<double>() = value;  // as set_lr writes it
    call_op(op, recorded, sgd_attrs(c, n, old_buffers));
    call_op(op, with_scalars(fresh.inputs(), {}, value), sgd_attrs(c, n, old_buffers));
  }
  expect_same_bits(replayed, fresh, "replayed against fresh calls");
}

}  // namespace
}  // namespace kiln
