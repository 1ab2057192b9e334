// kiln::profiler: every kernel the dispatcher and compiled programs run is counted once, per op,
// kernel and device; the report groups them by family.
#include "tensor/profiler.h"

#include <gtest/gtest.h>

#include <sstream>

#include "compiler/compile.h"
#include "kernels/cuda.h"
#include "kiln.h"
#include "test_util.h"

namespace kiln {
namespace {

const profiler::KernelTime* find(const std::vector<profiler::KernelTime>& r, const std::string& op) {
  for (const profiler::KernelTime& t : r) {
    if (t.op == op) return &t;
  }
  return nullptr;
}

TEST(Profiler, CountsEveryKernelOnce) {
  const Tensor a = randn({64, 64}), b = randn({64, 64});
  profiler::Profiler prof;
  prof.start();
  Tensor c = mm(a, b);
  for (int i = 0; i < 3; ++i) c = c + 1.0;
  (void)c.transpose(0, 1);  // a view: no kernel
  prof.stop();
  (void)mm(a, b);  // after stop: not counted
  const auto r = prof.results();
  const profiler::KernelTime* m = find(r, "mm");
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->calls, 1);
  EXPECT_GT(m->ms, 0.0);
  EXPECT_TRUE(m->device.is_cpu());
  const profiler::KernelTime* add = find(r, "add");
  ASSERT_NE(add, nullptr);
  EXPECT_EQ(add->calls, 3);
  EXPECT_EQ(find(r, "transpose"), nullptr);
  for (size_t i = 1; i < r.size(); ++i) EXPECT_GE(r[i - 1].ms, r[i].ms);  // slowest first
}

TEST(Profiler, CountsCompiledProgramsKernels) {
  auto f = compile([](const Tensor& x, const Tensor& w) { return relu(mm(x, w)).sum(); });
  const Tensor x = randn({16, 8}), w = randn({8, 4});
  (void)f(x, w);  // compiles
  profiler::Profiler prof;
  prof.start();
  (void)f(x, w);
  (void)f(x, w);
  prof.stop();
  const auto r = prof.results();
  const profiler::KernelTime* m = find(r, "mm");
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->calls, 2);
}

TEST(Profiler, ReportGroupsByFamily) {
  EXPECT_EQ(profiler::family_of("mm"), "GEMM");
  EXPECT_EQ(profiler::family_of("flash_attention_backward"), "attention");
  EXPECT_EQ(profiler::family_of("rms_norm"), "norms");
  EXPECT_EQ(profiler::family_of("rotary_emb_qk"), "RoPE");
  EXPECT_EQ(profiler::family_of("swiglu"), "GLU");
  EXPECT_EQ(profiler::family_of("cross_entropy_fused"), "cross-entropy");
  EXPECT_EQ(profiler::family_of("adam_multi_"), "optimizer");
  EXPECT_EQ(profiler::family_of("to_copy"), "copies and casts");
  EXPECT_EQ(profiler::family_of("sum"), "reductions");
  EXPECT_EQ(profiler::family_of("mul"), "elementwise");
  std::vector<profiler::KernelTime> r = {{"mm", "", Device(kCPU), 4, 6.0},
                                         {"add", "", Device(kCPU), 8, 2.0}};
  std::ostringstream out;
  profiler::print_report(r, 2, 5.0, out);
  const std::string s = out.str();
  EXPECT_NE(s.find("4.00 ms of kernels per step in 6.0 launches (80% of the 5.00 ms step"),
            std::string::npos)
      << s;
  EXPECT_NE(s.find("GEMM"), std::string::npos) << s;
  EXPECT_NE(s.find("75.0%"), std::string::npos) << s;
  EXPECT_KILN_ERROR(profiler::print_report(r, 0, 1.0, out), "positive number of steps");
}

TEST(Profiler, OneRecordsAtATime) {
  profiler::Profiler a, b;
  a.start();
  EXPECT_KILN_ERROR(b.start(), "another profiler is recording");
  a.stop();
  b.start();
  EXPECT_TRUE(b.recording());
  b.stop();
  EXPECT_FALSE(b.recording());
}

TEST(GpuProfiler, TimesCudaKernelsWithEvents) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  const Tensor a = randn({1024, 1024}).to(Device(kCUDA)), b = randn({1024, 1024}).to(Device(kCUDA));
  profiler::Profiler prof;
  prof.start();
  for (int i = 0; i < 4; ++i) (void)mm(a, b);
  prof.stop();
  const auto r = prof.results();
  const profiler::KernelTime* m = find(r, "mm");
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->calls, 4);
  EXPECT_TRUE(m->device.is_cuda());
  EXPECT_GT(m->ms, 0.0);
  EXPECT_LT(m->ms, 1000.0);
}

}  // namespace
}  // namespace kiln
