// Matmul epilogues (compiler/fuse.h attach_epilogues, compiler/matmul_epilogue.cpp): which mm +
// add/sub pairs become one region, how it prints, and the compiled result against eager code
// (within rounding: addmm rounds once where eager rounds the product and then the sum). The
// built-in executor takes CUDA values only; these tests register a CPU instance.
#include <gtest/gtest.h>

#include <string>

#include "compiler/compile.h"
#include "compiler/executor.h"
#include "compiler/fuse.h"
#include "kiln.h"
#include "tests/compiler/tiny_step.h"

namespace kiln {
namespace {

const char* cpu_epilogue() {
  static const bool registered = [] {
    compiler::register_executor(compiler::make_matmul_epilogue_executor("epilogue_cpu", {kCPU}));
    return true;
  }();
  (void)registered;
  return "epilogue_cpu";
}

CompileOptions with_cpu_epilogue() {
  return CompileOptions().executors({cpu_epilogue(), "fused_cpu", "eager"});
}

int count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

template <typename F>
std::string listing(const CompiledFunction<F>& f) {
  return f.traces().back().str();
}

void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  const double err = (got.to(kDouble) - want.to(kDouble)).abs().max().item<double>();
  EXPECT_LE(err, tol) << what;
}

TEST(MatmulEpilogue, ResidualAddBecomesOneRegion) {
  manual_seed(0);
  const Tensor r = randn({32, 48}, kDouble), a = randn({32, 16}, kDouble),
               b = randn({16, 48}, kDouble);
  auto fn = [](const Tensor& r, const Tensor& a, const Tensor& b) { return r + mm(a, b); };
  auto f = compile(fn, with_cpu_epilogue());
  expect_close(f(r, a, b), fn(r, a, b), 1e-12, "r + a @ b");
  const std::string s = listing(f);
  EXPECT_EQ(count(s, "# region [epilogue_cpu]"), 1) << s;
  EXPECT_NE(s.find("    t"), std::string::npos) << s;  // members indented under the region
  EXPECT_EQ(count(s, "[eager]"), 0) << s;
}

TEST(MatmulEpilogue, EveryFormOfAddAndSub) {
  manual_seed(1);
  const Tensor r = randn({8, 12}, kDouble), a = randn({8, 5}, kDouble), b = randn({5, 12}, kDouble);
  const Tensor bias = randn({12}, kDouble);
  using Fn = Tensor (*)(const Tensor&, const Tensor&, const Tensor&);
  const std::vector<std::pair<std::string, Fn>> forms = {
      {"r + ab", [](const Tensor& r, const Tensor& a, const Tensor& b) { return r + mm(a, b); }},
      {"ab + r", [](const Tensor& r, const Tensor& a, const Tensor& b) { return mm(a, b) + r; }},
      {"r - ab", [](const Tensor& r, const Tensor& a, const Tensor& b) { return r - mm(a, b); }},
      {"ab - r", [](const Tensor& r, const Tensor& a, const Tensor& b) { return mm(a, b) - r; }},
      {"add(r, ab, 2)",
       [](const Tensor& r, const Tensor& a, const Tensor& b) { return add(r, mm(a, b), 2.5); }},
      {"add(ab, r, 2)",
       [](const Tensor& r, const Tensor& a, const Tensor& b) { return add(mm(a, b), r, 2.5); }},
      {"sub(r, ab, 3)",
       [](const Tensor& r, const Tensor& a, const Tensor& b) { return sub(r, mm(a, b), 3); }},
      {"sub(ab, r, 3)",
       [](const Tensor& r, const Tensor& a, const Tensor& b) { return sub(mm(a, b), r, 3); }},
  };
  for (const auto& [name, fn] : forms) {
    auto f = compile(fn, with_cpu_epilogue());
    expect_close(f(r, a, b), fn(r, a, b), 1e-12, name);
    EXPECT_EQ(count(listing(f), "# region [epilogue_cpu]"), 1) << name << "\n" << listing(f);
    // A bias row of n elements, broadcast over the rows.
    expect_close(f(bias, a, b), fn(bias, a, b), 1e-12, name + " (bias row)");
  }
}

TEST(MatmulEpilogue, TheSumOfTwoProductsTakesOneAsItsResidual) {
  manual_seed(6);
  const Tensor a = randn({8, 5}, kDouble), b = randn({5, 12}, kDouble),
               c = randn({8, 3}, kDouble), d = randn({3, 12}, kDouble);
  auto fn = [](const Tensor& a, const Tensor& b, const Tensor& c, const Tensor& d) {
    return mm(a, b).view({2, 4, 12}) + mm(c, d).view({2, 4, 12});
  };
  auto f = compile(fn, with_cpu_epilogue());
  expect_close(f(a, b, c, d), fn(a, b, c, d), 1e-12, "ab + cd");
  const std::string s = listing(f);
  EXPECT_EQ(count(s, "# region [epilogue_cpu]"), 1) << s;
  EXPECT_EQ(count(s, "mm("), 2) << s;
}

TEST(MatmulEpilogue, ThroughTheViewsOfALinearLayer) {
  // The residual stream of a block: x [B, T, C] + proj(h).view(B, T, C).
  manual_seed(2);
  const Tensor x = randn({2, 6, 8}, kDouble), h = randn({2, 6, 4}, kDouble),
               w = randn({8, 4}, kDouble);
  auto fn = [](const Tensor& x, const Tensor& h, const Tensor& w) {
    return x + mm(h.view({12, 4}), w.t()).view({2, 6, 8});
  };
  auto f = compile(fn, with_cpu_epilogue());
  expect_close(f(x, h, w), fn(x, h, w), 1e-12, "view chain");
  const std::string s = listing(f);
  EXPECT_EQ(count(s, "# region [epilogue_cpu]"), 1) << s;
}

TEST(MatmulEpilogue, GradientsThroughTheRegion) {
  manual_seed(3);
  Tensor r = randn({6, 7}, kDouble).requires_grad_(true);
  Tensor a = randn({6, 3}, kDouble).requires_grad_(true);
  Tensor b = randn({3, 7}, kDouble).requires_grad_(true);
  auto fn = [](const Tensor& r, const Tensor& a, const Tensor& b) {
    return (r + mm(a, b)).tanh().sum();
  };
  auto f = compile(fn, with_cpu_epilogue());
  const Tensor loss = f(r, a, b);
  loss.backward();
  const Tensor gr = r.grad().clone(), ga = a.grad().clone(), gb = b.grad().clone();
  r.mutable_grad() = Tensor();
  a.mutable_grad() = Tensor();
  b.mutable_grad() = Tensor();
  const Tensor want = fn(r, a, b);
  want.backward();
  expect_close(loss.detach(), want.detach(), 1e-12, "loss");
  expect_close(gr, r.grad(), 1e-12, "dr");
  expect_close(ga, a.grad(), 1e-12, "da");
  expect_close(gb, b.grad(), 1e-12, "db");
}

TEST(MatmulEpilogue, PairsThatStayApart) {
  manual_seed(4);
  const Tensor r = randn({8, 12}), a = randn({8, 5}), b = randn({5, 12});
  auto expect_no_region = [&](auto fn, const std::string& why) {
    auto f = compile(fn, with_cpu_epilogue());
    const Tensor got = f(r, a, b);
    EXPECT_TRUE(equal(got, fn(r, a, b))) << why;  // eager's kernels: eager's bits
    EXPECT_EQ(count(listing(f), "[epilogue_cpu]"), 0) << why << "\n" << listing(f);
  };
  // The product is read twice (by the add and by the mul).
  expect_no_region(
      [](const Tensor& r, const Tensor& a, const Tensor& b) {
        const Tensor p = mm(a, b);
        return (r + p) * p;
      },
      "product read twice");
  // The product is returned too.
  expect_no_region(
      [](const Tensor& r, const Tensor& a, const Tensor& b) {
        const Tensor p = mm(a, b);
        return (r + p) + p.sum();
      },
      "product read by a reduction as well");
  // Broadcasting the product, or a residual that is neither the output's shape nor a row.
  expect_no_region(
      [](const Tensor& r, const Tensor& a, const Tensor& b) {
        return r.narrow(1, 0, 1) + mm(a, b);
      },
      "a column residual");
  // Another dtype (promotion).
  expect_no_region(
      [](const Tensor& r, const Tensor& a, const Tensor& b) {
        return r.to(kDouble) + mm(a, b);
      },
      "promoted");
  // The default executors keep CPU programs bit-equal to eager: no epilogue on the CPU.
  auto fn = [](const Tensor& r, const Tensor& a, const Tensor& b) { return r + mm(a, b); };
  auto f = compile(fn);
  EXPECT_TRUE(equal(f(r, a, b), fn(r, a, b)));
  EXPECT_EQ(count(listing(f), "[matmul_epilogue]"), 0) << listing(f);
}

TEST(MatmulEpilogue, AttachEpiloguesLeavesOtherTracesAlone) {
  // The pass alone: with an executor that takes no epilogue, the trace comes back unchanged.
  manual_seed(5);
  auto f = compile([](const Tensor& r, const Tensor& a, const Tensor& b) { return r + mm(a, b); },
                   CompileOptions().executors({"eager"}));
  (void)f(randn({4, 4}), randn({4, 4}), randn({4, 4}));
  const compiler::Trace& t = f.traces().back();
  const compiler::Trace same =
      compiler::attach_epilogues(t, *compiler::find_executor("eager"));
  EXPECT_EQ(same.str(), t.str());
}

TEST(MatmulEpilogue, TinyLlamaTrainingStepMatchesEager) {
  // Every residual add of the forward and the backward's gradient adds of projections: the
  // step with the CPU epilogue executor equals eager code to f32 rounding.
  const auto config = models::ModelConfig::from_name("tiny-llama");
  test::TinyStep eager(config, test::adamw(optim::AdamWOptions(3e-3)));
  test::TinyStep compiled(config, test::adamw(optim::AdamWOptions(3e-3)));
  auto step = compile([&](const Tensor& x, const Tensor& y) { return compiled.step(x, y); },
                      with_cpu_epilogue());
  for (int i = 0; i < 3; ++i) {
    manual_seed(100 + i);
    const auto [x, y] = test::next_token_batch(config.vocab_size, 2, 16);
    expect_close(step(x, y), eager.step(x, y), 1e-4, "loss at step " + std::to_string(i));
  }
  const auto want = eager.model->parameters();
  const auto got = compiled.model->parameters();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) expect_close(got[i], want[i], 1e-5, "parameter");
  const std::string s = listing(step);
  // Forward: two residual adds per block (attention and MLP projections); backward: the
  // gradient adds of the projections' inputs.
  EXPECT_GE(count(s, "# region [epilogue_cpu]"), 2 * config.n_layer) << s;
}

// A Linear layer with a bias and relu, and an mm with tanh-gelu: each pair is one region
// (run as addmm_activation) with the CPU instance, compiled == eager with gradients. gelu's
// backward reads the product: with gradients the tanh-gelu pair keeps it (addmm_gelu_aux, the
// next test); without, it is addmm_activation.
TEST(MatmulEpilogue, ReluAndTanhGeluAfterTheProduct) {
  manual_seed(8);
  auto relu_mlp = [](const Tensor& x, const Tensor& w, const Tensor& b) {
    return relu(linear(x, w, b));
  };
  auto gelu_mm = [](const Tensor& x, const Tensor& w) { return gelu(mm(x, w.t()), "tanh"); };
  const Tensor x = randn({2, 5, 6}, kDouble).requires_grad_(true);
  const Tensor x2 = randn({5, 6}, kDouble).requires_grad_(true);
  const Tensor w = randn({4, 6}, kDouble).requires_grad_(true);
  const Tensor b = randn({4}, kDouble).requires_grad_(true);
  auto f = compile(relu_mlp, with_cpu_epilogue());
  const Tensor got = f(x, w, b);
  std::string s;
  for (const compiler::Trace& t : f.traces()) s += t.str();
  EXPECT_GE(count(s, "# region [epilogue_cpu]"), 1) << s;  // the forward's addmm, view, relu
  const Tensor want = relu_mlp(x, w, b);
  EXPECT_TRUE(allclose(got, want, 1e-12, 1e-12));
  const auto grads = autograd::grad({got.sum()}, {x, w, b});
  const auto want_grads = autograd::grad({want.sum()}, {x, w, b});
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(allclose(grads[i], want_grads[i], 1e-12, 1e-12)) << i;

  auto g = compile(gelu_mm, with_cpu_epilogue());
  const Tensor gelu_got = g(x2, w);
  EXPECT_TRUE(allclose(gelu_got, gelu_mm(x2, w), 1e-12, 1e-12));
  {
    NoGradGuard no_grad;
    auto h = compile(gelu_mm, with_cpu_epilogue());
    const Tensor y = h(x2.detach(), w.detach());
    EXPECT_EQ(count(listing(h), "# region [epilogue_cpu]"), 1) << listing(h);
    EXPECT_TRUE(allclose(y, gelu_mm(x2.detach(), w.detach()), 1e-12, 1e-12));
  }
}

// Whether some stage of f's programs runs an op named `name` in a region of `executor`.
template <typename F>
bool in_region(const CompiledFunction<F>& f, const std::string& name, const std::string& executor) {
  for (const compiler::Trace& t : f.traces()) {
    for (const compiler::BoundOp& op : t.ops) {
      if (op.name() == name && op.region >= 0 && op.executor == executor) return true;
    }
  }
  return false;
}

// A GPT-2 MLP (Linear, tanh-gelu, Linear) with gradients: the forward's addmm, view and gelu are
// one region that also writes the gelu's input for the backward (addmm_gelu_aux), and the
// backward's product of the second layer's gradient and gelu_backward another (mm_dgelu).
// Compiled == eager, in f64 with the CPU instance.
TEST(MatmulEpilogue, TanhGeluLayerKeepsItsInputAndItsGradientIsOneProduct) {
  manual_seed(10);
  auto mlp = [](const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                const Tensor& b2) { return linear(gelu(linear(x, w1, b1), "tanh"), w2, b2); };
  const Tensor x = randn({2, 5, 6}, kDouble).requires_grad_(true);
  const Tensor w1 = randn({8, 6}, kDouble).requires_grad_(true);
  const Tensor b1 = randn({8}, kDouble).requires_grad_(true);
  const Tensor w2 = randn({6, 8}, kDouble).requires_grad_(true);
  const Tensor b2 = randn({6}, kDouble).requires_grad_(true);
  auto f = compile(mlp, with_cpu_epilogue());
  const Tensor got = f(x, w1, b1, w2, b2);
  std::string s;
  for (const compiler::Trace& t : f.traces()) s += t.str();
  EXPECT_TRUE(in_region(f, "gelu", "epilogue_cpu")) << s;
  EXPECT_TRUE(in_region(f, "gelu_backward", "epilogue_cpu")) << s;
  const Tensor want = mlp(x, w1, b1, w2, b2);
  EXPECT_TRUE(allclose(got, want, 1e-12, 1e-12));
  const Tensor gy = randn(got.sizes(), kDouble);
  const auto grads = autograd::grad({got}, {x, w1, b1, w2, b2}, {gy});
  const auto want_grads = autograd::grad({want}, {x, w1, b1, w2, b2}, {gy});
  for (size_t i = 0; i < 5; ++i) EXPECT_TRUE(allclose(grads[i], want_grads[i], 1e-12, 1e-12)) << i;

  // Exact gelu has no cuBLASLt epilogue: its pair stays two ops.
  auto exact = [](const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                  const Tensor& b2) { return linear(gelu(linear(x, w1, b1)), w2, b2); };
  auto e = compile(exact, with_cpu_epilogue());
  const Tensor y = e(x, w1, b1, w2, b2);
  EXPECT_FALSE(in_region(e, "gelu", "epilogue_cpu"));
  EXPECT_FALSE(in_region(e, "gelu_backward", "epilogue_cpu"));
  EXPECT_TRUE(allclose(y, exact(x, w1, b1, w2, b2), 1e-12, 1e-12));
}

// The built-in executor on CUDA (in the default executors): the residual add through
// cuBLASLt's C matrix, forward and gradients, against eager CUDA code and an f64 reference.
TEST(GpuMatmulEpilogue, ResidualStreamOnCuda) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  manual_seed(7);
  const Device gpu(kCUDA, 0);
  auto fn = [](const Tensor& x, const Tensor& h, const Tensor& w) {
    return x + mm(h.view({-1, h.size(2)}), w.t()).view(x.sizes());
  };
  for (ScalarType dt : {kFloat, kBFloat16}) {
    const Tensor x64 = randn({4, 64, 256}, kDouble), h64 = randn({4, 64, 128}, kDouble),
                 w64 = randn({256, 128}, kDouble) * 0.1;
    const Tensor want = fn(x64, h64, w64);
    Tensor x = x64.to(dt).to(gpu).requires_grad_(true), h = h64.to(dt).to(gpu).requires_grad_(true),
           w = w64.to(dt).to(gpu).requires_grad_(true);
    auto f = compile(fn);
    const Tensor got = f(x, h, w);
    // The forward program's stages (the last trace is the backward program's).
    std::string s;
    for (const compiler::Trace& t : f.traces()) s += t.str();
    EXPECT_GE(count(s, "# region [matmul_epilogue]"), 1) << s;
    const Tensor eager = fn(x, h, w);
    // Within eager's own error against f64 (addmm rounds once, eager twice).
    const double tol = dt == kFloat ? 1e-3 : 0.1;
    expect_close(got.to(kCPU).to(kDouble), want, tol, "forward vs f64");
    const double eager_err = (eager.to(kCPU).to(kDouble) - want).abs().max().item<double>();
    const double got_err = (got.to(kCPU).to(kDouble) - want).abs().max().item<double>();
    EXPECT_LE(got_err, eager_err * 1.01 + 1e-6) << dtype_name(dt);
    // Gradients: the backward's projection-input gradient is added to the residual's.
    const Tensor g = randn(x.sizes(), kDouble).to(dt).to(gpu);
    const auto grads = autograd::grad({got}, {x, h, w}, {g});
    const auto eager_grads = autograd::grad({eager}, {x, h, w}, {g});
    for (size_t i = 0; i < 3; ++i) {
      const double scale = eager_grads[i].to(kCPU).to(kDouble).abs().max().item<double>();
      expect_close(grads[i].to(kCPU).to(kDouble), eager_grads[i].to(kCPU).to(kDouble),
                   (dt == kFloat ? 1e-4 : 2e-2) * scale, "gradient " + std::to_string(i));
    }
  }
}

// The same pairs on CUDA with the built-in executor: cuBLASLt's RELU_BIAS and GELU epilogues,
// against eager CUDA code and an f64 reference.
TEST(GpuMatmulEpilogue, ReluAndTanhGeluOnCuda) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  manual_seed(9);
  const Device gpu(kCUDA, 0);
  auto relu_mlp = [](const Tensor& x, const Tensor& w, const Tensor& b) {
    return relu(linear(x, w, b));
  };
  auto gelu_mm = [](const Tensor& x, const Tensor& w) {
    return gelu(mm(x.view({-1, x.size(2)}), w.t()), "tanh");
  };
  for (ScalarType dt : {kFloat, kBFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor x64 = randn({4, 64, 128}, kDouble), w64 = randn({256, 128}, kDouble) * 0.1,
                 b64 = randn({256}, kDouble);
    const double tol = dt == kFloat ? 1e-3 : 0.1;
    Tensor x = x64.to(dt).to(gpu).requires_grad_(true), w = w64.to(dt).to(gpu).requires_grad_(true),
           b = b64.to(dt).to(gpu).requires_grad_(true);
    auto f = compile(relu_mlp);
    const Tensor got = f(x, w, b);
    std::string s;
    for (const compiler::Trace& t : f.traces()) s += t.str();
    EXPECT_GE(count(s, "# region [matmul_epilogue]"), 1) << s;  // the forward's addmm, view, relu
    expect_close(got.to(kCPU).to(kDouble), relu_mlp(x64, w64, b64), tol, "relu forward vs f64");
    const Tensor eager = relu_mlp(x, w, b);
    const Tensor gy = randn(got.sizes(), kDouble).to(dt).to(gpu);
    const auto grads = autograd::grad({got}, {x, w, b}, {gy});
    const auto eager_grads = autograd::grad({eager}, {x, w, b}, {gy});
    for (size_t i = 0; i < 3; ++i) {
      const double scale = eager_grads[i].to(kCPU).to(kDouble).abs().max().item<double>();
      expect_close(grads[i].to(kCPU).to(kDouble), eager_grads[i].to(kCPU).to(kDouble),
                   (dt == kFloat ? 1e-4 : 3e-2) * scale, "relu gradient " + std::to_string(i));
    }
    NoGradGuard no_grad;
    auto g = compile(gelu_mm);
    const Tensor y = g(x.detach(), w.detach());
    EXPECT_EQ(count(listing(g), "# region [matmul_epilogue]"), 1) << listing(g);
    expect_close(y.to(kCPU).to(kDouble), gelu_mm(x64, w64), tol, "tanh-gelu forward vs f64");
  }
}

// The GPT-2 MLP of the CPU test above on CUDA, training: cuBLASLt's GELU_AUX_BIAS in the forward
// and DGELU in the backward, against eager CUDA code and an f64 reference.
TEST(GpuMatmulEpilogue, TanhGeluLayerTrainsThroughAuxAndDgelu) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  manual_seed(11);
  const Device gpu(kCUDA, 0);
  auto mlp = [](const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                const Tensor& b2) { return linear(gelu(linear(x, w1, b1), "tanh"), w2, b2); };
  for (ScalarType dt : {kFloat, kBFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor x64 = randn({4, 64, 128}, kDouble), w164 = randn({512, 128}, kDouble) * 0.1,
                 b164 = randn({512}, kDouble), w264 = randn({128, 512}, kDouble) * 0.05,
                 b264 = randn({128}, kDouble);
    std::vector<Tensor> p;
    for (const Tensor& t : {x64, w164, b164, w264, b264}) {
      p.push_back(t.to(dt).to(gpu).requires_grad_(true));
    }
    auto f = compile(mlp);
    const Tensor got = f(p[0], p[1], p[2], p[3], p[4]);
    std::string s;
    for (const compiler::Trace& t : f.traces()) s += t.str();
    EXPECT_TRUE(in_region(f, "gelu", "matmul_epilogue")) << s;
    EXPECT_TRUE(in_region(f, "gelu_backward", "matmul_epilogue")) << s;
    const double tol = dt == kFloat ? 1e-3 : 0.1;
    expect_close(got.to(kCPU).to(kDouble), mlp(x64, w164, b164, w264, b264), tol, "forward vs f64");
    const Tensor eager = mlp(p[0], p[1], p[2], p[3], p[4]);
    const Tensor gy = randn(got.sizes(), kDouble).to(dt).to(gpu);
    const auto grads = autograd::grad({got}, p, {gy});
    const auto eager_grads = autograd::grad({eager}, p, {gy});
    for (size_t i = 0; i < p.size(); ++i) {
      const double scale = eager_grads[i].to(kCPU).to(kDouble).abs().max().item<double>();
      expect_close(grads[i].to(kCPU).to(kDouble), eager_grads[i].to(kCPU).to(kDouble),
                   (dt == kFloat ? 1e-4 : 3e-2) * scale, "gradient " + std::to_string(i));
    }
  }
}

}  // namespace
}  // namespace kiln
