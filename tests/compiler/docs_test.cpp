// The examples of docs/compiler.md, run as written: a user executor registered with
// make_op_executor, and C++ control flow frozen at trace time (and a scalar argument that is
// not). The doc's listing of kiln-tiny's training step comes from `kiln pretrain --compile`
// (TrainerTest.CompiledStepGivesTheEagerLosses checks that run against eager).
#include <gtest/gtest.h>

#include <string>

#include "compiler/compile.h"
#include "compiler/executor.h"
#include "kiln.h"

namespace kiln {
namespace {

// docs/compiler.md, "Executors": an executor that claims mm, counts its flops and runs it.
TEST(CompilerDocs, UserExecutorCountsMatmulFlops) {
  static int64_t mm_flops = 0;
  mm_flops = 0;
  compiler::register_executor(compiler::make_op_executor(
      "mm_counter", {{"mm", [](OpCall& call) {
                        const Tensor& a = call.input(0);
                        const Tensor& b = call.input(1);
                        mm_flops += 2 * a.size(0) * a.size(1) * b.size(1);
                        call.outputs = {mm(a, b)};
                      }}}));
  auto f = compile([](const Tensor& x, const Tensor& w) { return relu(matmul(x, w)); },
                   CompileOptions().executors({"mm_counter"}));  // "eager" comes after
  manual_seed(0);
  const Tensor x = randn({4, 16}), w = randn({16, 8});
  const Tensor y = f(x, w);
  EXPECT_TRUE(equal(y, relu(matmul(x, w))));
  EXPECT_EQ(mm_flops, 2 * 4 * 16 * 8);
  const std::string listing = f.traces().back().str();
  EXPECT_NE(listing.find("= mm(a0, a1)"), std::string::npos) << listing;
  EXPECT_NE(listing.find("[mm_counter]"), std::string::npos) << listing;
  EXPECT_NE(listing.find("[eager]"), std::string::npos) << listing;  // relu
}

// docs/compiler.md, "What is frozen at trace time".
TEST(CompilerDocs, ControlFlowIsFrozenScalarArgumentsAreNot) {
  const Tensor x = ones({3});
  bool double_it = false;
  auto frozen = compile([&](const Tensor& t) { return double_it ? t * 2.0 : t + 0.0; });
  EXPECT_TRUE(equal(frozen(x), x));
  double_it = true;
  EXPECT_TRUE(equal(frozen(x), x));  // still the traced branch: the if ran once, while tracing
  EXPECT_EQ(frozen.stats().misses, 1);

  auto guarded = compile([](const Tensor& t, bool d) { return d ? t * 2.0 : t + 0.0; });
  EXPECT_TRUE(equal(guarded(x, false), x));
  EXPECT_TRUE(equal(guarded(x, true), x * 2.0));  // a scalar argument is part of the signature
  EXPECT_EQ(guarded.stats().misses, 2);
  ASSERT_EQ(guarded.stats().recompile_reasons.size(), 1u);
  EXPECT_EQ(guarded.stats().recompile_reasons[0], "scalar argument 0: 0 -> 1");
}

}  // namespace
}  // namespace kiln
