// CUDA graphs of compiled programs (compiler/cuda_graph.h, CompileOptions::cuda_graphs): on the
// CPU, the option and the reason a program runs without graphs; on a GPU (GpuCudaGraph.*), a
// compiled tiny-Llama training step run as graphs against the same step without them, bit for
// bit, with one capture and replays after, captures again for a new shape or moved memory, losses
// kept across steps, dropout drawing eager's masks at every replay, and programs that cannot be
// captured running op by op with the reason.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "compiler/compile.h"
#include "compiler/cuda_graph.h"
#include "compiler/executor.h"
#include "compiler/passes.h"
#include "compiler/program.h"
#include "compiler/tracer.h"
#include "kernels/cuda.h"
#include "models/gpt.h"
#include "nn/functional.h"
#include "nn/optim/adamw.h"
#include "nn/optim/lr_scheduler.h"
#include "tensor/indexing.h"
#include "tensor/ops.h"
#include "tensor/ops/optim.h"
#include "tensor/deterministic.h"
#include "tensor/random.h"
#include "tensor/registry.h"
#include "tensor/storage.h"
#include "tensor/tensor_data.h"
#include "tensor/tensor_impl.h"
#include "test_util.h"
#include "tiny_step.h"

namespace kiln {
namespace {

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0;
}
bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(CudaGraphOptions, OnByDefault) {
  EXPECT_TRUE(CompileOptions().cuda_graphs());
  EXPECT_FALSE(CompileOptions().cuda_graphs(false).cuda_graphs());
}

TEST(CudaGraphOptions, CpuProgramRunsWithoutGraphsAndSaysWhy) {
  auto f = compile([](const Tensor& x) { return relu(x) * 2.0; });
  const Tensor x = randn({4, 8});
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(equal(f(x), relu(x) * 2.0));
  const compiler::CompileStats& s = f.stats();
  EXPECT_EQ(s.hits, 2);
  EXPECT_EQ(s.cuda_graph, "off");
  EXPECT_TRUE(starts_with(s.graph_reason, "a CPU program")) << s.graph_reason;
  EXPECT_EQ(s.graph_captures, 0);
  EXPECT_EQ(s.graph_replays, 0);
}

TEST(CudaGraphOptions, TurnedOffSaysSo) {
  auto f = compile([](const Tensor& x) { return x + 1.0; }, CompileOptions().cuda_graphs(false));
  const Tensor x = randn({3});
  (void)f(x);
  (void)f(x);
  EXPECT_EQ(f.stats().cuda_graph, "off");
  EXPECT_TRUE(contains(f.stats().graph_reason, "cuda_graphs(false)")) << f.stats().graph_reason;
}

TEST(CudaGraphOptions, CpuTrainingStepSaysWhy) {
  const auto config = models::ModelConfig::from_name("tiny-llama");
  test::TinyStep tiny(config, test::adamw(optim::AdamWOptions(3e-3)));
  auto step = compile([&](const Tensor& x, const Tensor& y) { return tiny.step(x, y); });
  for (int i = 0; i < 3; ++i) {
    manual_seed(100 + i);
    const auto [x, y] = test::next_token_batch(config.vocab_size, 2, 8);
    (void)step(x, y);
  }
  EXPECT_EQ(step.stats().cuda_graph, "off");
  EXPECT_TRUE(starts_with(step.stats().graph_reason, "a CPU program"))
      << step.stats().graph_reason;
}

// The AdamW update alone (f32 and bf16 parameters on `device`), compiled, with a scheduler
// changing the lr at every step, against the same optimizer in eager code: bit for bit at every
// step, moments and step counts included. Returns the compiled update's stats.
constexpr int kUpdateSteps = 7;
compiler::CompileStats compiled_adamw_update_against_eager(Device device) {
  manual_seed(21);
  std::vector<Tensor> compiled, eager;
  const std::vector<std::pair<Shape, ScalarType>> shapes = {
      {{1000}, kFloat}, {{33, 17}, kFloat}, {{8193}, kBFloat16}, {{7}, kBFloat16}};
  for (const auto& [shape, dtype] : shapes) {
    const Tensor init = randn(shape).to(device, dtype);
    compiled.push_back(init.clone().requires_grad_(true));
    eager.push_back(init.clone().requires_grad_(true));
  }
  const auto options = optim::AdamWOptions(1e-2).weight_decay(0.1);
  optim::AdamW opt_compiled(compiled, options), opt_eager(eager, options);
  auto decay = [](int64_t step) { return 1.0 / (1.0 + 0.5 * static_cast<double>(step)); };
  optim::LambdaLR sched_compiled(opt_compiled, decay), sched_eager(opt_eager, decay);
  auto update = compile([&]() { opt_compiled.step(); }, CompileOptions().name("adamw_update"));
  for (int k = 0; k < kUpdateSteps; ++k) {
    for (size_t i = 0; i < compiled.size(); ++i) {
      const Tensor g = randn(compiled[i].sizes()).to(device, compiled[i].dtype());
      // A graph reads the gradients where they are: written in place after the first step.
      Tensor& grad = compiled[i].mutable_grad();
      if (grad.defined()) {
        grad.copy_(g);
      } else {
        grad = g.clone();
      }
      eager[i].mutable_grad() = g.clone();
    }
    update();
    opt_eager.step();
    sched_compiled.step();
    sched_eager.step();
    for (size_t i = 0; i < compiled.size(); ++i) {
      EXPECT_TRUE(equal(compiled[i].detach().cpu(), eager[i].detach().cpu()))
          << "step " << k + 1 << " parameter " << i;
    }
  }
  for (size_t i = 0; i < compiled.size(); ++i) {
    const optim::OptimizerParamState& a = opt_compiled.state().at(compiled[i].impl());
    const optim::OptimizerParamState& b = opt_eager.state().at(eager[i].impl());
    EXPECT_EQ(a.step.device(), device);  // the parameter's: a GPU one's count lives on the GPU
    EXPECT_EQ(a.step_count(), kUpdateSteps);
    EXPECT_EQ(b.step_count(), kUpdateSteps);
    for (const auto& [name, buffer] : b.buffers) {
      EXPECT_TRUE(equal(a.buffers.at(name).cpu(), buffer.cpu())) << name << " of parameter " << i;
    }
  }
  return update.stats();
}

TEST(CudaGraphOptions, CompiledAdamWUpdateWithSchedulerEqualsEager) {
  const compiler::CompileStats s = compiled_adamw_update_against_eager(Device(kCPU));
  EXPECT_EQ(s.misses, 2);  // step 1 creates the state
  EXPECT_EQ(s.hits, kUpdateSteps - 2);
  EXPECT_EQ(s.cuda_graph, "off");
}

// How a program divides into graphs and host steps, and what it refuses, decided from the trace
// alone: traced here on proxies of CUDA tensors, which need no GPU.
std::shared_ptr<const compiler::Program> cuda_program(
    const std::function<Tensor(const Tensor&)>& fn, Device device = Device(kCUDA, 0)) {
  const Tensor x = compiler::proxy_of({{4, 8}, kFloat, device});
  compiler::TraceResult r = compiler::trace_callable(
      [&](const std::vector<Tensor>& a) { return std::vector<Tensor>{fn(a[0])}; }, {x});
  const std::vector<std::shared_ptr<const compiler::Executor>> eager = {
      compiler::find_executor("eager")};
  return std::make_shared<const compiler::Program>(compiler::assign_executors(r.trace, eager),
                                                   std::move(r.externals), eager);
}

TEST(CudaGraphAnalysis, GpuStepsAreCaptured) {
  const auto p = cuda_program([](const Tensor& x) { return relu(x * 2.0) + 1.0; });
  EXPECT_EQ(compiler::cuda_graph_refusal(*p, false), "");
  EXPECT_EQ(compiler::GraphedProgram(p).host_steps(), 0);
  EXPECT_EQ(compiler::GraphedProgram(p).graphs(), 0);  // captured at the first run only
}

TEST(CudaGraphAnalysis, StepsReadingCpuTensorsRunOnTheHost) {
  const Tensor scale = scalar_tensor(3.0, TensorOptions().dtype(kFloat));  // a 0-d CPU tensor
  const auto p = cuda_program([&](const Tensor& x) { return relu(x * scale) + 1.0; });
  EXPECT_EQ(compiler::cuda_graph_refusal(*p, false), "") << p->trace().str();
  EXPECT_EQ(compiler::GraphedProgram(p).host_steps(), 1) << p->trace().str();
  // Nothing but host steps: nothing to capture.
  const auto q = cuda_program([&](const Tensor& x) { return x * scale; });
  EXPECT_TRUE(starts_with(compiler::cuda_graph_refusal(*q, false), "no step has all its tensors"))
      << compiler::cuda_graph_refusal(*q, false);
}

// A CPU scalar that the caller keeps and changes between calls (an optimizer's lr) copied to the
// GPU: the copy is no host step; each run writes the scalar's value where the graphs read it.
TEST(CudaGraphAnalysis, CopiesOfAMutableCpuScalarToTheGpuAreLaunchInputs) {
  const Tensor lr = scalar_tensor(0.5, TensorOptions().dtype(kDouble));
  const Device gpu(kCUDA, 0);
  const auto p = cuda_program([&](const Tensor& x) { return relu(x * lr.to(gpu)) + 1.0; });
  EXPECT_EQ(compiler::cuda_graph_refusal(*p, false), "") << p->trace().str();
  EXPECT_EQ(compiler::GraphedProgram(p).host_steps(), 0) << p->trace().str();
  // Copied twice: both copies are launch inputs.
  const auto twice = cuda_program([&](const Tensor& x) { return x * lr.to(gpu) + lr.to(gpu); });
  EXPECT_EQ(compiler::GraphedProgram(twice).host_steps(), 0) << twice->trace().str();
  // Read by a CPU op too: the copy runs on the host, as that op does.
  const auto read =
      cuda_program([&](const Tensor& x) { return x * lr.to(gpu) + (lr * 2.0).to(gpu); });
  EXPECT_EQ(compiler::GraphedProgram(read).host_steps(), 3) << read->trace().str();
  // A returned copy runs on the host (the caller keeps a tensor of its own).
  compiler::TraceResult r = compiler::trace_callable(
      [&](const std::vector<Tensor>& a) {
        return std::vector<Tensor>{a[0] * 2.0, lr.to(gpu)};
      },
      {compiler::proxy_of({{4, 8}, kFloat, gpu})});
  const std::vector<std::shared_ptr<const compiler::Executor>> eager = {
      compiler::find_executor("eager")};
  const auto returned = std::make_shared<const compiler::Program>(
      compiler::assign_executors(r.trace, eager), std::move(r.externals), eager);
  EXPECT_EQ(compiler::GraphedProgram(returned).host_steps(), 1) << returned->trace().str();
  // A copy that converts (f64 to f32) runs on the host.
  const auto converted = cuda_program([&](const Tensor& x) { return x * lr.to(gpu, kFloat); });
  EXPECT_EQ(compiler::GraphedProgram(converted).host_steps(), 1) << converted->trace().str();
}

// A tensor of the GPU that has no memory (a storage of cuda:0 whose data is null, not a proxy):
// captured by the tracer as a parameter is, and all the analysis needs of one.
Tensor memoryless_gpu_tensor(const Shape& sizes, ScalarType dtype) {
  auto storage = std::make_shared<StorageImpl>(
      nullptr, static_cast<size_t>(numel_of(sizes)) * element_size(dtype), Device(kCUDA, 0),
      nullptr);
  return Tensor(std::make_shared<TensorImpl>(storage, sizes, contiguous_strides(sizes), 0, dtype));
}

#if !defined(KILN_WITH_CUDA)
// A CPU build has no CUDA kernel of adam_update_, so its tracer would expand a GPU call into the
// op's decomposition (as eager code would run it), where a CUDA build keeps it whole. This
// stand-in, which never runs (a CPU build has no GPU), keeps it whole here too.
// It claims the calls the real kernel claims: f32, bf16 and f16 parameters.
void adam_update_standin(OpCall&) {
  KILN_FAIL("[cuda_graph_test] the stand-in CUDA kernel of adam_update_ ran");
}
bool adam_update_standin_supports(const OpCall& c) {
  return internal::optim_compute_dtype(c) == kFloat;
}
KILN_REGISTER_KERNEL_IF(adam_update_, kCUDA, "standin", adam_update_standin,
                        adam_update_standin_supports);
#endif

// A training step on the GPU with AdamW: its step counts live on the GPU and its lr is a launch
// input, so the step, the update included, has no host step. The optimizer's state is made
// beforehand, as step 1 leaves it, so that one trace is the program later calls replay.
// The program of a training step of `opt` on the parameter `w`, traced on a proxy of a GPU batch.
std::shared_ptr<const compiler::Program> step_program(optim::Optimizer& opt, const Tensor& w) {
  const Tensor x = compiler::proxy_of({to_shape(w.sizes()), w.dtype(), Device(kCUDA, 0)});
  compiler::TraceResult r = compiler::trace_callable(
      [&](const std::vector<Tensor>& a) {
        opt.zero_grad();
        Tensor loss = (a[0] * w).sum();
        loss.backward();
        opt.step();
        return std::vector<Tensor>{loss};
      },
      {x});
  const std::vector<std::shared_ptr<const compiler::Executor>> eager = {
      compiler::find_executor("eager")};
  return std::make_shared<const compiler::Program>(compiler::assign_executors(r.trace, eager),
                                                   std::move(r.externals), eager);
}

// AdamW's state on `w` as its first step leaves it, in memoryless GPU tensors.
void made_state(optim::AdamW& opt, const Tensor& w) {
  optim::OptimizerParamState& st = opt.state()[w.impl()];
  st.step = memoryless_gpu_tensor({}, kInt64);
  st.buffers["exp_avg"] = memoryless_gpu_tensor(to_shape(w.sizes()), kFloat);
  st.buffers["exp_avg_sq"] = memoryless_gpu_tensor(to_shape(w.sizes()), kFloat);
}

TEST(CudaGraphAnalysis, AdamWTrainingStepHasNoHostStep) {
  const Tensor w = memoryless_gpu_tensor({4, 8}, kFloat).requires_grad_(true);
  optim::AdamW adamw({w}, optim::AdamWOptions(1e-2).weight_decay(0.1));
  made_state(adamw, w);
  const auto p = step_program(adamw, w);
  const std::string listing = p->trace().str();
  EXPECT_TRUE(contains(listing, "to_copy(") && contains(listing, "increment_(") &&
              contains(listing, "adam_update_("))
      << listing;
  EXPECT_EQ(compiler::cuda_graph_refusal(*p, false), "") << listing;
  EXPECT_EQ(compiler::GraphedProgram(p).host_steps(), 0) << listing;
}

// f64 parameters take adam_update_'s decomposition, which reads the lr and the step counts on
// the host: traced on a GPU, it says so rather than freeze their values.
TEST(CudaGraphAnalysis, F64AdamWOnTheGpuSaysItDoesNotTrace) {
  const Tensor w = memoryless_gpu_tensor({4, 8}, kDouble).requires_grad_(true);
  optim::AdamW adamw({w}, optim::AdamWOptions(1e-2));
  made_state(adamw, w);
  adamw.state()[w.impl()].buffers["exp_avg"] = memoryless_gpu_tensor({4, 8}, kDouble);
  adamw.state()[w.impl()].buffers["exp_avg_sq"] = memoryless_gpu_tensor({4, 8}, kDouble);
  EXPECT_KILN_ERROR(step_program(adamw, w),
                    "[adam_update_] the decomposition (f64 parameters) reads the lr and step "
                    "counts on the host, which a call traced by kiln::compile on cuda:0 cannot");
}

TEST(CudaGraphAnalysis, RefusesWhatACopyWouldHide) {
  // A returned view of the argument would be a view of the graph's copy of it.
  const auto view = cuda_program([](const Tensor& x) { return x.view({32}); });
  EXPECT_TRUE(contains(compiler::cuda_graph_refusal(*view, false), "a view of the argument"))
      << compiler::cuda_graph_refusal(*view, false);
  // An in-place write of the argument would write the copy.
  const auto write = cuda_program([](Tensor x) {
    x.add_(1.0);
    return x * 2.0;
  });
  EXPECT_TRUE(contains(compiler::cuda_graph_refusal(*write, false), "in place"))
      << compiler::cuda_graph_refusal(*write, false);
}

TEST(CudaGraphAnalysis, RefusesCpuProgramsAndBackwardPairs) {
  const auto cpu = cuda_program([](const Tensor& x) { return x * 2.0; }, Device(kCPU));
  EXPECT_TRUE(starts_with(compiler::cuda_graph_refusal(*cpu, false), "a CPU program"));
  const auto gpu = cuda_program([](const Tensor& x) { return x * 2.0; });
  EXPECT_TRUE(contains(compiler::cuda_graph_refusal(*gpu, true), "backward"));
}

// --- On a GPU ---------------------------------------------------------------------------------

class GpuCudaGraph : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  }
};

TensorOptions on_gpu() { return TensorOptions().device(Device(kCUDA)); }
Device test_gpu() { return Device(kCUDA, 0); }

// tiny-llama (head size 16: attention runs as its decomposition), or with head size 64, where
// attention runs its CUDA kernels (cuDNN or the hand kernels, the measured choice).
models::ModelConfig tiny_llama(bool attention_kernels) {
  models::ModelConfig c = models::ModelConfig::from_name("tiny-llama");
  if (attention_kernels) {
    c.n_embd = 128;
    c.n_head = 2;
    c.n_query_groups = 1;
    c.head_size = 64;
  }
  return c;
}

// Two tiny Llamas made alike, one trained through graphs and one without.
struct TwoSteps {
  explicit TwoSteps(bool attention_kernels = false) : config(tiny_llama(attention_kernels)) {}
  models::ModelConfig config;
  test::TinyStep with{config, test::adamw(optim::AdamWOptions(3e-3).weight_decay(0.1)),
                      std::nullopt, on_gpu()};
  test::TinyStep without{config, test::adamw(optim::AdamWOptions(3e-3).weight_decay(0.1)),
                         std::nullopt, on_gpu()};
  CompiledFunction<std::function<Tensor(const Tensor&, const Tensor&)>> graphed{
      [this](const Tensor& x, const Tensor& y) { return with.step(x, y); },
      CompileOptions().name("graphed_step")};
  CompiledFunction<std::function<Tensor(const Tensor&, const Tensor&)>> plain{
      [this](const Tensor& x, const Tensor& y) { return without.step(x, y); },
      CompileOptions().name("plain_step").cuda_graphs(false)};

  std::pair<Tensor, Tensor> batch(int i, int64_t seq) {
    manual_seed(300 + i);
    auto [x, y] = test::next_token_batch(config.vocab_size, 2, seq);
    return {x.cuda(), y.cuda()};
  }

  // Steps [from, to) of both models, results unread; returns `to`.
  int run_both(int from, int to) {
    for (int i = from; i < to; ++i) {
      const auto [x, y] = batch(i, 32);
      (void)graphed(x, y);
      (void)plain(x, y);
    }
    return to;
  }

  // Both models' first parameter moved to new memory with the same values (as a load that
  // replaced the storage would leave it): the graphed step captures again.
  void move_first_parameter() {
    for (test::TinyStep* s : {&with, &without}) {
      Tensor p = s->model->parameters()[0];
      const Tensor moved = p.detach().clone();
      p.impl()->set_data(*moved.impl());
    }
  }

  // Every parameter and gradient of the two models, bit for bit.
  void expect_same_weights() {
    const std::vector<Tensor> a = with.model->parameters(), b = without.model->parameters();
    ASSERT_EQ(a.size(), b.size());
    for (size_t p = 0; p < a.size(); ++p) {
      EXPECT_TRUE(equal(a[p].cpu(), b[p].cpu())) << "parameter " << p;
      ASSERT_TRUE(a[p].grad().defined() && b[p].grad().defined()) << "parameter " << p;
      EXPECT_TRUE(equal(a[p].grad().cpu(), b[p].grad().cpu())) << "gradient " << p;
    }
  }
};

TEST_F(GpuCudaGraph, TrainingStepEqualsStepWithoutGraphsBitForBit) {
  TwoSteps t;
  constexpr int kSteps = 6;
  for (int i = 0; i < kSteps; ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    const auto [x, y] = t.batch(i, 32);
    const Tensor got = t.graphed(x, y), want = t.plain(x, y);
    EXPECT_TRUE(equal(got.cpu(), want.cpu()))
        << got.cpu().item<double>() << " vs " << want.cpu().item<double>();
    t.expect_same_weights();
  }
  const compiler::CompileStats& s = t.graphed.stats();
  // Steps 1 and 2 trace (the optimizer's moments appear on step 1), step 3 captures, 4-6 replay.
  EXPECT_EQ(s.cuda_graph, "replaying") << s.graph_reason;
  EXPECT_EQ(s.graph_captures, 1);
  EXPECT_EQ(s.graph_replays, kSteps - 3);
  EXPECT_TRUE(s.graph_recapture_reasons.empty());
  // AdamW's step counts live on the GPU and its lr is a launch input: the update is in the graph.
  EXPECT_EQ(s.graph_reason, "1 graph, 0 host steps");
  EXPECT_EQ(t.plain.stats().cuda_graph, "off");
  EXPECT_EQ(t.plain.stats().graph_captures, 0);
}

// A learning rate that a scheduler changes at every step reaches the replayed graph (written into
// its copy before each launch): the step, the AdamW update included, is one graph, captured once,
// and gives the bits of the step without graphs at every step.
TEST_F(GpuCudaGraph, TrainingStepWithSchedulerIsOneGraph) {
  TwoSteps t;
  auto decay = [](int64_t step) { return 1.0 / (1.0 + 0.5 * static_cast<double>(step)); };
  optim::LambdaLR with_sched(*t.with.opt, decay), without_sched(*t.without.opt, decay);
  constexpr int kSteps = 7;
  for (int i = 0; i < kSteps; ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    const auto [x, y] = t.batch(i, 32);
    EXPECT_TRUE(equal(t.graphed(x, y).cpu(), t.plain(x, y).cpu()));
    t.expect_same_weights();
    with_sched.step();
    without_sched.step();
  }
  const compiler::CompileStats& s = t.graphed.stats();
  EXPECT_EQ(s.graph_reason, "1 graph, 0 host steps");
  EXPECT_EQ(s.graph_captures, 1);
  EXPECT_EQ(s.graph_replays, kSteps - 3);
  EXPECT_TRUE(s.graph_recapture_reasons.empty());
  for (const Tensor& p : t.with.model->parameters()) {
    const optim::OptimizerParamState& st = t.with.opt->state().at(p.impl());
    EXPECT_TRUE(st.step.is_cuda());
    EXPECT_EQ(st.step_count(), kSteps);
  }
}

// The AdamW update alone, compiled and replayed as one CUDA graph, equals eager AdamW bit for
// bit with an lr that changes at every step (written into the graph's copy before each launch).
TEST_F(GpuCudaGraph, AdamWUpdateWithSchedulerEqualsEagerBitForBit) {
  const compiler::CompileStats s = compiled_adamw_update_against_eager(test_gpu());
  EXPECT_EQ(s.cuda_graph, "replaying") << s.graph_reason;
  EXPECT_EQ(s.graph_reason, "1 graph, 0 host steps");
  EXPECT_EQ(s.graph_captures, 1);
  EXPECT_EQ(s.graph_replays, kUpdateSteps - 3);
  EXPECT_TRUE(s.graph_recapture_reasons.empty());
}

// With attention's CUDA kernels (deterministic algorithms: the backward without atomics, so that
// two runs can be compared bit for bit).
TEST_F(GpuCudaGraph, TrainingStepWithAttentionKernelsEqualsStepWithoutGraphs) {
  const DeterministicGuard deterministic(true);
  TwoSteps t(/*attention_kernels=*/true);
  for (int i = 0; i < 5; ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    const auto [x, y] = t.batch(i, 128);
    EXPECT_TRUE(equal(t.graphed(x, y).cpu(), t.plain(x, y).cpu()));
    t.expect_same_weights();
  }
  EXPECT_EQ(t.graphed.stats().cuda_graph, "replaying") << t.graphed.stats().graph_reason;
  EXPECT_EQ(t.graphed.stats().graph_captures, 1);
  EXPECT_EQ(t.graphed.stats().graph_replays, 2);
}

TEST_F(GpuCudaGraph, ReturnedLossesKeepTheirValues) {
  TwoSteps t;
  std::vector<Tensor> kept, want;
  for (int i = 0; i < 7; ++i) {
    const auto [x, y] = t.batch(i, 32);
    kept.push_back(t.graphed(x, y));  // not read until the end, as the trainer's log does
    want.push_back(t.plain(x, y).cpu());
  }
  ASSERT_EQ(t.graphed.stats().graph_captures, 1);
  for (size_t i = 0; i < kept.size(); ++i) {
    EXPECT_TRUE(equal(kept[i].cpu(), want[i])) << "step " << i + 1;
    for (size_t j = 0; j < i; ++j) EXPECT_NE(kept[i].data_ptr(), kept[j].data_ptr());
  }
}

TEST_F(GpuCudaGraph, NewShapeCapturesAgain) {
  TwoSteps t;
  int i = 0;
  auto both = [&](int64_t seq) {
    const auto [x, y] = t.batch(i++, seq);
    EXPECT_TRUE(equal(t.graphed(x, y).cpu(), t.plain(x, y).cpu())) << "seq " << seq;
  };
  for (int k = 0; k < 4; ++k) both(32);  // trace, trace, capture, replay
  EXPECT_EQ(t.graphed.stats().graph_captures, 1);
  both(16);  // a new program: compiled (its warm-up)
  both(16);  // captured
  both(16);
  EXPECT_EQ(t.graphed.stats().graph_captures, 2);
  both(32);  // the first program's graphs again
  EXPECT_EQ(t.graphed.stats().graph_captures, 2);
  EXPECT_EQ(t.graphed.stats().graph_replays, 3);
  t.expect_same_weights();
}

TEST_F(GpuCudaGraph, MovedParameterCapturesAgain) {
  TwoSteps t;
  int i = t.run_both(0, 4);
  ASSERT_EQ(t.graphed.stats().graph_captures, 1);
  t.move_first_parameter();
  for (; i < 6; ++i) {
    const auto [x, y] = t.batch(i, 32);
    EXPECT_TRUE(equal(t.graphed(x, y).cpu(), t.plain(x, y).cpu())) << "step " << i + 1;
  }
  const compiler::CompileStats& s = t.graphed.stats();
  EXPECT_EQ(s.graph_captures, 2);
  ASSERT_EQ(s.graph_recapture_reasons.size(), 1u);
  EXPECT_TRUE(contains(s.graph_recapture_reasons[0], "moved")) << s.graph_recapture_reasons[0];
  t.expect_same_weights();
}

// A training step's gradients stay in the graph's memory (kept until its next launch), not in
// static buffers beside it that would hold them through the forward too: the static buffers are
// the arguments only, and every gradient keeps its address from replay to replay.
TEST_F(GpuCudaGraph, GradientsStayInGraphMemory) {
  TwoSteps t;
  std::vector<const void*> addresses;
  for (int i = 0; i < 6; ++i) {
    const auto [x, y] = t.batch(i, 32);
    EXPECT_TRUE(equal(t.graphed(x, y).cpu(), t.plain(x, y).cpu())) << "step " << i + 1;
    if (i < 3) continue;  // replays from step 4 on
    std::vector<const void*> now;
    for (const Tensor& p : t.with.model->parameters()) now.push_back(p.grad().data_ptr());
    if (!addresses.empty()) {
      EXPECT_EQ(now, addresses) << "step " << i + 1;
    }
    addresses = now;
  }
  t.expect_same_weights();
  const compiler::CompileStats& s = t.graphed.stats();
  ASSERT_EQ(s.graph_captures, 1);
  int64_t grad_bytes = 0;
  for (const Tensor& p : t.with.model->parameters()) grad_bytes += p.numel() * p.element_size();
  const auto [x, y] = t.batch(0, 32);
  EXPECT_GE(s.graph_kept_bytes, grad_bytes);
  EXPECT_LE(s.graph_static_bytes, 2 * (x.numel() * x.element_size() + y.numel() * y.element_size()))
      << "only the arguments are copied into static buffers";
}

// A gradient held across a recapture (the old graph destroyed) keeps its memory and values
// until it dies, and the new graphs train on as before.
TEST_F(GpuCudaGraph, GradientHeldAcrossRecaptureKeepsItsValues) {
  TwoSteps t;
  int i = t.run_both(0, 5);
  ASSERT_EQ(t.graphed.stats().graph_captures, 1);
  Tensor held = t.with.model->parameters()[1].grad();
  const Tensor want = held.cpu();
  t.move_first_parameter();  // forces a recapture
  for (; i < 8; ++i) {
    const auto [x, y] = t.batch(i, 32);
    EXPECT_TRUE(equal(t.graphed(x, y).cpu(), t.plain(x, y).cpu())) << "step " << i + 1;
  }
  ASSERT_EQ(t.graphed.stats().graph_captures, 2);
  EXPECT_TRUE(equal(held.cpu(), want));
  EXPECT_NE(held.data_ptr(), t.with.model->parameters()[1].grad().data_ptr());
  held = Tensor();  // frees the old graph's allocation
  cuda::synchronize();
  const auto [x, y] = t.batch(i, 32);
  EXPECT_TRUE(equal(t.graphed(x, y).cpu(), t.plain(x, y).cpu()));
  t.expect_same_weights();
}

TEST_F(GpuCudaGraph, PeakMemoryIncludesGraphMemory) {
  TwoSteps t;
  for (int i = 0; i < 4; ++i) {
    const auto [x, y] = t.batch(i, 32);
    (void)t.graphed(x, y);
  }
  ASSERT_EQ(t.graphed.stats().graph_captures, 1);
  cuda::reset_peak_memory_stats();
  const auto [x, y] = t.batch(9, 32);
  (void)t.graphed(x, y);
  cuda::synchronize();
  const cuda::MemoryStats m = cuda::memory_stats();
  EXPECT_GT(m.graph, 0);
  EXPECT_GE(m.peak, m.allocated + m.graph);
  EXPECT_GE(m.reserved, m.graph);
}

// An op that waits for the device (advanced indexing checks its indices on the host): the
// capture fails, that call and the later ones run op by op, and the stats say why.
TEST_F(GpuCudaGraph, UncapturableProgramRunsAndSaysWhy) {
  auto f = compile([](const Tensor& x, const Tensor& i) { return x.index({i}) * 2.0; });
  const Tensor x = randn({8, 4}).cuda();
  const Tensor i = tensor({3, 1, 7}, TensorOptions().dtype(kInt64)).cuda();
  const Tensor want = (x.cpu().index({i.cpu()}) * 2.0);
  for (int k = 0; k < 4; ++k) EXPECT_TRUE(equal(f(x, i).cpu(), want)) << "call " << k + 1;
  const compiler::CompileStats& s = f.stats();
  EXPECT_EQ(s.cuda_graph, "off");
  EXPECT_TRUE(contains(s.graph_reason, "capturing")) << s.graph_reason;
  EXPECT_EQ(s.graph_captures, 0);
  EXPECT_EQ(s.graph_replays, 0);
  // The stream is usable after the failed capture.
  EXPECT_TRUE(equal((x + 1.0).cpu(), x.cpu() + 1.0));
}

// Random ops in a graph read each replay's Philox base from the device: dropout draws a new mask
// every replay, the one eager code draws at that point of the generator's stream.
TEST_F(GpuCudaGraph, DropoutDrawsWhatEagerDrawsAtEveryReplay) {
  namespace F = nn::functional;
  auto dropout = [](const Tensor& x) {
    return F::dropout(x, F::DropoutFuncOptions().p(0.5).training(true)) * 3.0;
  };
  auto f = compile(dropout);
  const Tensor x = randn({64, 67}).cuda();
  constexpr int kCalls = 6;
  manual_seed(7);
  std::vector<Tensor> got;
  for (int k = 0; k < kCalls; ++k) got.push_back(f(x));
  const RngState after_compiled = get_rng_state();
  manual_seed(7);
  for (int k = 0; k < kCalls; ++k) {
    EXPECT_TRUE(equal(got[static_cast<size_t>(k)].cpu(), dropout(x).cpu())) << "call " << k + 1;
    if (k > 0) {
      EXPECT_FALSE(equal(got[static_cast<size_t>(k)].cpu(), got[static_cast<size_t>(k - 1)].cpu()))
          << "call " << k + 1 << " repeats the mask of the call before";
    }
  }
  EXPECT_EQ(get_rng_state().offset,
            after_compiled.offset);  // the generator ends where eager's does
  const compiler::CompileStats& s = f.stats();
  EXPECT_EQ(s.cuda_graph, "replaying") << s.graph_reason;
  EXPECT_EQ(s.graph_captures, 1);
  EXPECT_EQ(s.graph_replays, kCalls - 2);
  // A new seed: captured again (the graphs hold the seed of their capture).
  manual_seed(8);
  const Tensor a = f(x);
  manual_seed(8);
  EXPECT_TRUE(equal(a.cpu(), dropout(x).cpu()));
  EXPECT_EQ(s.graph_captures, 2);
  ASSERT_FALSE(s.graph_recapture_reasons.empty());
  EXPECT_TRUE(contains(s.graph_recapture_reasons.back(), "seed"))
      << s.graph_recapture_reasons.back();
}

// A forward without host steps is one graph; its outputs are copied out of the graph's memory.
// A compiled program's device-side argument checks (an embedding's index bounds) are not waited
// for, op by op as in a graph: a bad index is reported by the next run, with its value, and the
// run after that is clean. Uncompiled code still reports it at once, naming the op.
TEST_F(GpuCudaGraph, BadIndexIsReportedByTheNextRun) {
  const Tensor w = randn({10, 4}).cuda();
  const Tensor good = tensor(std::vector<int64_t>{3, 1, 7}, kInt64).cuda();
  const Tensor bad = tensor(std::vector<int64_t>{3, 12, 7}, kInt64).cuda();
  const Tensor want = embedding(w, good).cpu() * 2.0;
  for (bool graphs : {false, true}) {
    SCOPED_TRACE(graphs ? "graphs" : "op by op");
    auto f = compile([](const Tensor& t, const Tensor& i) { return embedding(t, i) * 2.0; },
                     CompileOptions().cuda_graphs(graphs));
    for (int k = 0; k < 3; ++k) EXPECT_TRUE(equal(f(w, good).cpu(), want)) << "call " << k + 1;
    EXPECT_EQ(f.stats().cuda_graph, graphs ? "replaying" : "off");
    (void)f(w, bad);  // queued; its check is deferred
    cuda::synchronize();
    try {
      (void)f(w, good);
      ADD_FAILURE() << "the bad index was not reported";
    } catch (const Error& e) {
      EXPECT_TRUE(contains(e.what(), "found a bad argument (value 12: an index out of range"))
          << e.what();
    }
    EXPECT_TRUE(equal(f(w, good).cpu(), want));  // reported once; the next run is clean
  }
  EXPECT_THROW((void)embedding(w, bad), Error);  // uncompiled: at once
  try {
    (void)embedding(w, bad);
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "[embedding] index 12 is out of bounds")) << e.what();
  }
}

TEST_F(GpuCudaGraph, ForwardIsOneGraph) {
  const Tensor w = randn({16, 16}).cuda();
  auto f = compile([&](const Tensor& x) { return relu(matmul(x, w)).sum(1); });
  std::vector<Tensor> outs;
  std::vector<Tensor> xs;
  for (int k = 0; k < 5; ++k) {
    xs.push_back(randn({8, 16}).cuda());
    outs.push_back(f(xs.back()));
  }
  for (int k = 0; k < 5; ++k) {
    EXPECT_TRUE(equal(outs[static_cast<size_t>(k)].cpu(),
                      relu(matmul(xs[static_cast<size_t>(k)], w)).sum(1).cpu()))
        << "call " << k + 1;
  }
  const compiler::CompileStats& s = f.stats();
  EXPECT_EQ(s.cuda_graph, "replaying") << s.graph_reason;
  EXPECT_EQ(s.graph_reason, "1 graph, 0 host steps");
  EXPECT_EQ(s.graph_captures, 1);
  EXPECT_EQ(s.graph_replays, 3);
}

}  // namespace
}  // namespace kiln
