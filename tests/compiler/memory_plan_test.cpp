// plan_memory: intermediates placed in one arena by liveness. The plan is checked directly (no
// two values whose lifetimes overlap share bytes; reuse makes the arena smaller than the values
// added up) and end to end (compiled == eager, returned tensors never alias the next run's
// arena, a returned view keeps its own memory).
#include "compiler/memory_plan.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "compiler/compile.h"
#include "kiln.h"

namespace kiln {
namespace {

void expect_bits(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined() && want.defined()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(equal(got, want)) << what;
}

// Checks a planned trace: placed values whose lifetimes overlap occupy disjoint bytes, and every
// placed value lies inside its arena.
void expect_valid_plan(const compiler::Trace& t) {
  const size_t n = t.ops.size();
  const std::vector<int> at = compiler::step_positions(t);
  std::vector<int> first(t.values.size(), -1), last(t.values.size(), -1);
  for (size_t i = 0; i < n; ++i) {
    for (int v : t.ops[i].outputs) {
      if (v >= 0) first[static_cast<size_t>(v)] = at[i];
      if (v >= 0) last[static_cast<size_t>(v)] = std::max(last[static_cast<size_t>(v)], at[i]);
    }
    for (int v : t.ops[i].inputs) {
      if (v >= 0) last[static_cast<size_t>(v)] = std::max(last[static_cast<size_t>(v)], at[i]);
    }
  }
  std::vector<int> placed;
  for (size_t v = 0; v < t.values.size(); ++v) {
    const compiler::ValueInfo& info = t.values[v];
    if (info.arena < 0) continue;
    placed.push_back(static_cast<int>(v));
    const int64_t bytes =
        numel_of(info.spec.sizes) * static_cast<int64_t>(element_size(info.spec.dtype));
    ASSERT_LE(info.arena_offset + bytes, t.arenas[static_cast<size_t>(info.arena)].bytes);
    EXPECT_EQ(info.arena_offset % compiler::kArenaAlignment, 0);
  }
  for (size_t i = 0; i < placed.size(); ++i) {
    for (size_t j = i + 1; j < placed.size(); ++j) {
      const auto& a = t.values[static_cast<size_t>(placed[i])];
      const auto& b = t.values[static_cast<size_t>(placed[j])];
      if (a.arena != b.arena) continue;
      const size_t va = static_cast<size_t>(placed[i]), vb = static_cast<size_t>(placed[j]);
      const bool live_together = first[va] <= last[vb] && first[vb] <= last[va];
      const int64_t ea = a.arena_offset + numel_of(a.spec.sizes) * element_size(a.spec.dtype);
      const int64_t eb = b.arena_offset + numel_of(b.spec.sizes) * element_size(b.spec.dtype);
      const bool share_bytes = a.arena_offset < eb && b.arena_offset < ea;
      EXPECT_FALSE(live_together && share_bytes) << a.name << " and " << b.name << "\n" << t.str();
    }
  }
}

template <typename F>
const compiler::Trace* planned(const CompiledFunction<F>& f) {
  for (const compiler::Trace& t : f.traces()) {
    if (t.stage == "plan_memory") return &t;
  }
  return nullptr;
}

TEST(PlanMemory, ReusesBytesAndMatchesEager) {
  manual_seed(0);
  std::vector<Tensor> ws;
  for (int i = 0; i < 4; ++i) ws.push_back(randn({64, 64}) * 0.1);
  auto fn = [&](const Tensor& x) {
    Tensor h = x;
    for (const Tensor& w : ws) h = matmul(h, w).relu();
    return h.sum({1});
  };
  auto f = compile(fn);
  const Tensor x = randn({32, 64});
  expect_bits(f(x), fn(x), "first");
  const compiler::Trace* t = planned(f);
  ASSERT_NE(t, nullptr);
  ASSERT_EQ(t->arenas.size(), 1u);
  expect_valid_plan(*t);
  // 8 intermediates of 8 KiB, at most 2 live at once.
  EXPECT_LT(t->arenas[0].bytes, compiler::placed_bytes(*t));
  EXPECT_GT(f.stats().arena_bytes, 0);
  const std::string listing = f.traces().back().str();
  EXPECT_NE(listing.find(" @"), std::string::npos) << listing;
  EXPECT_NE(listing.find("arena "), std::string::npos) << listing;
  // A kept result is not overwritten by the next run.
  const Tensor kept = f(x);
  const Tensor copy = kept.clone();
  const Tensor other = f(randn({32, 64}));
  expect_bits(kept, copy, "kept across runs");
  (void)other;
}

TEST(PlanMemory, ReturnedViewsAndSkippingThePass) {
  auto fn = [](const Tensor& x) {
    Tensor m = matmul(x, x.t());
    return std::vector<Tensor>{m.t(), (m + 1.0).relu()};
  };
  auto f = compile(fn);
  const Tensor x = randn({16, 8});
  std::vector<Tensor> first = f(x);
  const Tensor copy = first[0].clone();
  std::vector<Tensor> again = f(randn({16, 8}));
  expect_bits(first[0], copy, "returned view");
  const std::vector<Tensor> want = fn(x);
  expect_bits(first[1], want[1], "second output");
  expect_valid_plan(*planned(f));

  auto skipped = compile(fn, CompileOptions().skip_pass("plan_memory"));
  expect_bits(skipped(x)[0], want[0], "skipped");
  EXPECT_EQ(planned(skipped), nullptr);
  EXPECT_EQ(skipped.stats().arena_bytes, 0);
}

TEST(PlanMemory, TrainingStepPlansAreValid) {
  manual_seed(1);
  nn::Sequential mlp(nn::Linear(32, 64), nn::GELU(), nn::Linear(64, 64), nn::Tanh(),
                     nn::Linear(64, 10));
  optim::SGD opt(mlp->parameters(), optim::SGDOptions(0.1).momentum(0.9));
  const Tensor x = randn({16, 32}), y = randint(0, 10, {16}, kInt64);
  auto step = [&](const Tensor& in, const Tensor& target) {
    opt.zero_grad();
    Tensor loss = nn::functional::cross_entropy(mlp->forward(in), target);
    loss.backward();
    opt.step();
    return loss;
  };
  auto f = compile(step);
  for (int i = 0; i < 3; ++i) f(x, y);
  for (const compiler::Trace& t : f.traces()) {
    if (t.stage == "plan_memory") expect_valid_plan(t);
  }
  ASSERT_NE(planned(f), nullptr);
  EXPECT_GT(f.stats().arena_bytes, 0);
}

}  // namespace
}  // namespace kiln
