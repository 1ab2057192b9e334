// The fuse pass and the fused_cpu executor: which ops become regions (the region rule of
// compiler/fuse.h), how a region prints, and compiled == eager bit for bit, forward and
// gradients, both when a region runs whole and when it runs in row blocks on the thread pool.
#include "compiler/fuse.h"

#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <string>
#include <vector>

#include "compiler/compile.h"
#include "kiln.h"

namespace kiln {
namespace {

void expect_bits(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined() && want.defined()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  EXPECT_TRUE(equal(got, want)) << what;
}

// The executors' listing of the last compilation.
template <typename F>
std::string final_listing(const CompiledFunction<F>& f) {
  return f.traces().back().str();
}

int count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

TEST(Fuse, ChainBecomesOneRegionAndMatchesEager) {
  auto fn = [](const Tensor& x, const Tensor& w, const Tensor& b) {
    return sigmoid(x * w + b).sum({1}, /*keepdim=*/true);
  };
  manual_seed(0);
  // 256 rows of 512: blocks of 32 rows (at least 4 per thread with a row op).
  const Tensor x = randn({256, 512}), w = randn({256, 512}), b = randn({512});
  auto f = compile(fn);
  expect_bits(f(x, w, b), fn(x, w, b), "blocked");
  const std::string listing = final_listing(f);
  EXPECT_NE(listing.find("fusion0:  # region [fused_cpu]"), std::string::npos) << listing;
  EXPECT_EQ(count(listing, "[fused_cpu]"), 1) << listing;
  // Every op is a member: indented under the region.
  EXPECT_NE(listing.find("    t"), std::string::npos) << listing;
  EXPECT_EQ(listing.find("[eager]"), std::string::npos) << listing;
  // Small tensors run the region whole.
  const Tensor xs = randn({3, 5}), ws = randn({3, 5}), bs = randn({5});
  expect_bits(f(xs, ws, bs), fn(xs, ws, bs), "whole");
}

TEST(Fuse, SkipPassAndEagerOnlyExecutorsKeepOpsApart) {
  auto fn = [](const Tensor& x) { return (x * 2.0 + 1.0).relu(); };
  const Tensor x = randn({64, 64});
  auto skipped = compile(fn, CompileOptions().skip_pass("fuse"));
  auto eager_only = compile(fn, CompileOptions().executors({"eager"}));
  expect_bits(skipped(x), fn(x), "skip_pass");
  expect_bits(eager_only(x), fn(x), "eager only");
  EXPECT_EQ(final_listing(skipped).find("region"), std::string::npos);
  EXPECT_EQ(final_listing(eager_only).find("region"), std::string::npos);
}

TEST(Fuse, InplaceOpsAndOutsideReadersCloseRegions) {
  // The relu reads t = x * 2 before add_ writes x: moving it after the add_ would be wrong.
  auto fn = [](const Tensor& x) {
    Tensor y = x.clone();
    Tensor t = y * 2.0;
    Tensor r = t.relu();
    y.add_(1.0);
    return r * y + t;
  };
  const Tensor x = randn({128, 300});
  auto f = compile(fn);
  expect_bits(f(x), fn(x), "in place");
  // A matmul reading a region value closes it; what follows starts another region.
  auto g = [](const Tensor& a, const Tensor& w) {
    Tensor h = (a * 3.0).sigmoid();
    return (matmul(h, w) + 1.0).relu() * h.sum({1}, true);
  };
  const Tensor a = randn({200, 64}), w = randn({64, 64});
  auto cg = compile(g);
  expect_bits(cg(a, w), g(a, w), "outside reader");
  const std::string listing = final_listing(cg);
  EXPECT_NE(listing.find("fusion1:"), std::string::npos) << listing;
}

TEST(Fuse, EigenSpelledOpsStayOutOfF32RegionsButFuseInBf16) {
  auto fn = [](const Tensor& x) { return (x * 0.5).tanh() + 1.0; };
  const Tensor x = randn({512, 256});
  auto f32 = compile(fn);
  expect_bits(f32(x), fn(x), "f32");
  EXPECT_EQ(final_listing(f32).find("region"), std::string::npos) << final_listing(f32);
  const Tensor xb = x.to(kBFloat16);
  auto bf16 = compile(fn);
  expect_bits(bf16(xb), fn(xb), "bf16");
  EXPECT_NE(final_listing(bf16).find("region"), std::string::npos) << final_listing(bf16);
}

TEST(Fuse, RowsOnlyWhereTheRuleAllows) {
  // mean over dim 1 without keepdim gives [64], which broadcasts along the last dim of a
  // [64, 64] tensor: a reader of it by rows would be wrong, so the subtraction is not fused.
  auto fn = [](const Tensor& x) { return (x * 2.0 - (x * 2.0).mean({1})).exp(); };
  const Tensor x = randn({64, 64});
  auto f = compile(fn);
  expect_bits(f(x), fn(x), "broadcast reduction");
  // A reduction over dim 0 never joins a region.
  auto g = [](const Tensor& x) { return (x + 1.0).sum({0}, true) * 3.0; };
  auto cg = compile(g);
  expect_bits(cg(x), g(x), "dim 0");
  const std::string listing = final_listing(cg);
  const size_t sum_at = listing.find("sum(");
  ASSERT_NE(sum_at, std::string::npos);
  // Not a member: the line is indented by two spaces, not four.
  EXPECT_EQ(listing.rfind("\n  t", sum_at), listing.rfind("\n", sum_at)) << listing;
}

TEST(Fuse, GradientsOfFusedChainsMatchEager) {
  auto fn = [](const Tensor& x, const Tensor& g, const Tensor& b) {
    Tensor h = x * g + b;
    Tensor s = h * sigmoid(h);  // silu by hand
    return (s.softmax(1) * s).sum();
  };
  manual_seed(3);
  const Tensor x0 = randn({300, 96}), g0 = randn({96}), b0 = randn({96});
  auto f = compile(fn);
  for (int trial = 0; trial < 2; ++trial) {
    Tensor xc = x0.clone().requires_grad_(true), gc = g0.clone().requires_grad_(true),
           bc = b0.clone().requires_grad_(true);
    Tensor xe = x0.clone().requires_grad_(true), ge = g0.clone().requires_grad_(true),
           be = b0.clone().requires_grad_(true);
    Tensor yc = f(xc, gc, bc), ye = fn(xe, ge, be);
    expect_bits(yc, ye, "loss");
    yc.backward();
    ye.backward();
    expect_bits(xc.grad(), xe.grad(), "x.grad");
    expect_bits(gc.grad(), ge.grad(), "g.grad");
    expect_bits(bc.grad(), be.grad(), "b.grad");
  }
  bool fused_backward = false;
  for (const compiler::Trace& t : f.traces()) {
    fused_backward |= t.stage == "executors" && t.fn_name.find("backward") != std::string::npos &&
                      t.str().find("[fused_cpu]") != std::string::npos;
  }
  EXPECT_TRUE(fused_backward);
}

// Random chains of pointwise and row ops over [rows, cols] tensors with broadcast operands, in
// f32, bf16 and f64, at sizes that run whole and in blocks: compiled == eager bit for bit.
TEST(Fuse, RandomChainsMatchEager) {
  std::mt19937 rng(1234);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
  const std::vector<int64_t> row_sizes = {1, 3, 17, 64, 257, 1000};
  const std::vector<int64_t> col_sizes = {1, 5, 64, 129, 700};
  const std::vector<ScalarType> dtypes = {kFloat, kBFloat16, kDouble};
  int blocked = 0;
  for (int program = 0; program < 150; ++program) {
    const int64_t rows = row_sizes[static_cast<size_t>(pick(6))];
    const int64_t cols = col_sizes[static_cast<size_t>(pick(5))];
    const ScalarType dtype = dtypes[static_cast<size_t>(pick(3))];
    const int length = 2 + pick(7);
    std::vector<int> ops;
    for (int k = 0; k < length; ++k) ops.push_back(pick(12));
    auto fn = [&](const Tensor& x, const Tensor& row_b, const Tensor& col_b) {
      Tensor h = x;
      for (int op : ops) {
        switch (op) {
          case 0:
            h = h + col_b;
            break;
          case 1:
            h = h * row_b;
            break;
          case 2:
            h = h.sigmoid();
            break;
          case 3:
            h = h - h.mean({1}, true);
            break;
          case 4:
            h = h.softmax(1);
            break;
          case 5:
            h = h * 0.5 + 0.25;
            break;
          case 6:
            h = where(h > 0.1, h, h * 0.01);
            break;
          case 7:
            h = h / (h.amax({1}, true).abs() + 1.0);
            break;
          case 8:
            h = h.square().clamp(-4.0, 4.0);
            break;
          case 9:
            h = h.exp().clamp_max(10.0);
            break;
          case 10:
            h = h.to(kFloat).to(h.dtype()) * x;
            break;
          default:
            h = h + h.var({1}, 0, true);
            break;
        }
      }
      return h;
    };
    const Tensor x = randn({rows, cols}).to(dtype), row_b = randn({rows, 1}).to(dtype),
                 col_b = randn({cols}).to(dtype);
    auto f = compile(fn);
    std::string what = "program " + std::to_string(program) + ": [" + std::to_string(rows) + ", " +
                       std::to_string(cols) + "] " + std::string(dtype_name(dtype)) + " ops";
    for (int op : ops) what += " " + std::to_string(op);
    expect_bits(f(x, row_b, col_b), fn(x, row_b, col_b), what);
    if (HasFailure()) {
      ADD_FAILURE() << final_listing(f);
      return;
    }
    blocked += rows * cols >= 2 * 16384 ? 1 : 0;
  }
  EXPECT_GT(blocked, 20);  // the blocked path ran
}

// Long rows: a reduction kernel with few rows splits its reduced dim across threads, which sums
// in another order, so blocks keep as many rows as eager's call had reason to keep.
TEST(Fuse, LongRowReductionsKeepEagersSummationOrder) {
  auto fn = [](const Tensor& x) { return (x * 1.5 + 0.1).sum({1}, true) * x.mean({1}, true); };
  manual_seed(5);
  for (int64_t rows : {3, 40}) {
    const Tensor x = randn({rows, 70000}, kDouble);
    auto f = compile(fn);
    expect_bits(f(x), fn(x), "rows " + std::to_string(rows));
    EXPECT_NE(final_listing(f).find("region"), std::string::npos);
  }
}

// Called under autocast: the autocast pass makes the casts ops of the trace, the region's ops
// carry no autocast state, and the region runs them with autocast off, as eager code ran them.
TEST(Fuse, RegionsUnderAutocastMatchEager) {
  auto fn = [](const Tensor& x, const Tensor& w) {
    return (matmul(x, w) * 0.5 + 1.0).softmax(1).sum({1}, true);
  };
  manual_seed(9);
  const Tensor x = randn({256, 64}), w = randn({64, 128});
  auto f = compile(fn);
  AutocastGuard autocast(kCPU, kBFloat16);
  for (int call = 0; call < 2; ++call) expect_bits(f(x, w), fn(x, w), "autocast");
  EXPECT_NE(final_listing(f).find("region"), std::string::npos) << final_listing(f);
}

TEST(Fuse, RegisteredExecutorNamesAreReserved) {
  EXPECT_THROW(compiler::register_executor(compiler::make_fused_cpu_executor()), Error);
}

}  // namespace
}  // namespace kiln
