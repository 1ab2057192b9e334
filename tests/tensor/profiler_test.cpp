// kiln::profiler: every kernel the dispatcher and compiled programs run is counted once, per op,
// kernel and device; the report groups them by family. A profiler may be stopped and destroyed
// while other threads are inside the timing of a kernel.
#include "tensor/profiler.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "compiler/compile.h"
#include "kernels/cuda.h"
#include "kiln.h"
#include "tensor/registry.h"
#include "test_util.h"

namespace kiln {
namespace {

const profiler::KernelTime* find(const std::vector<profiler::KernelTime>& r,
                                 const std::string& op) {
  for (const profiler::KernelTime& t : r) {
    if (t.op == op) return &t;
  }
  return nullptr;
}

// A test op whose CPU kernel waits at a gate: it holds a thread inside the profiler's timing of
// a kernel for as long as the test needs (y = x).
struct Gate {
  std::mutex mutex;
  std::condition_variable changed;
  bool entered = false, open = false;
};
Gate* g_gate = nullptr;

SpecList gate_meta(const OpCall& c) {
  return {{to_shape(c.input(0).sizes()), c.input(0).dtype(), c.input(0).device()}};
}
void gate_cpu(OpCall& c) {
  {
    std::unique_lock<std::mutex> lock(g_gate->mutex);
    g_gate->entered = true;
    g_gate->changed.notify_all();
    g_gate->changed.wait(lock, [] { return g_gate->open; });
  }
  c.outputs[0].copy_(c.input(0));
}
KILN_DEFINE_OP(profiler_test_gate, OpKind::kFunctional, gate_meta);
KILN_REGISTER_KERNEL(profiler_test_gate, kCPU, gate_cpu);

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
  // Labelled with the executor of the program's step.
  EXPECT_EQ(m->executor, "eager");
  // A fused_cpu region's members, on the pool's threads too (256 rows: several blocks); eager
  // code is not labelled.
  auto g = compile([](const Tensor& a) { return (a * 2.0 + 1.0).relu(); });
  const Tensor a = randn({256, 512});
  (void)g(a);
  profiler::Profiler prof2;
  prof2.start();
  (void)g(a);
  (void)mm(x, w);
  prof2.stop();
  int64_t fused = 0;
  bool eager_mm = false;
  for (const auto& k : prof2.results()) {
    if (k.op == "mul" || k.op == "add" || k.op == "relu") {
      EXPECT_EQ(k.executor, "fused_cpu") << k.op;
      fused += k.calls;
    }
    eager_mm |= k.op == "mm" && k.executor.empty();
  }
  EXPECT_GE(fused, 3);
  EXPECT_TRUE(eager_mm);
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
  EXPECT_EQ(s.find("executor"), std::string::npos) << s;  // eager code only: no executor table
  r[0].executor = "matmul_epilogue";
  r[1].executor = "eager";
  std::ostringstream by_executor;
  profiler::print_report(r, 2, 5.0, by_executor);
  EXPECT_NE(by_executor.str().find("matmul_epilogue         3.000    75.0%"), std::string::npos)
      << by_executor.str();
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

// A profiler destroyed while another thread is inside a kernel it times: that thread finishes
// with the profiler's state kept alive for it, and records nothing (the kernel ended after the
// profiler stopped). The next profiler, made at once (with the memory the old one would have
// freed), does not receive the late kernel either: before the fix the thread locked and wrote
// the freed profiler's memory, which the next one reused.
TEST(Profiler, DestroyedWhileAnotherThreadTimesAKernel) {
  Gate gate;
  g_gate = &gate;
  const Tensor x = randn({8});
  Tensor y;
  std::thread worker;
  {
    profiler::Profiler prof;
    prof.start();
    worker = std::thread([&] { y = call_op1(KILN_OP(profiler_test_gate), {x}); });
    std::unique_lock<std::mutex> lock(gate.mutex);
    gate.changed.wait(lock, [&] { return gate.entered; });
  }
  profiler::Profiler next;
  next.start();
  {
    std::lock_guard<std::mutex> lock(gate.mutex);
    gate.open = true;
  }
  gate.changed.notify_all();
  worker.join();
  next.stop();
  g_gate = nullptr;
  EXPECT_TRUE(equal(y, x));
  EXPECT_EQ(find(next.results(), "profiler_test_gate"), nullptr);
}

// Profilers started, stopped and destroyed over and over while other threads run ops: some
// threads are inside run_timed whenever one goes (a use after free there is what ASan and TSan
// report). Each stopped profiler's results stay readable, and some of them counted the
// threads' kernels (so the timing path did run concurrently with the destructions).
TEST(Profiler, StartAndDestroyWhileOtherThreadsRunOps) {
  std::atomic<bool> done{false};
  std::vector<std::thread> workers;
  for (int w = 0; w < 3; ++w) {
    workers.emplace_back([&done] {
      const Tensor a = ones({16});
      Tensor b = ones({16});
      while (!done.load()) b = (b + a) * 0.5;
    });
  }
  int64_t counted = 0;
  for (int i = 0; i < 400; ++i) {
    profiler::Profiler prof;
    prof.start();
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    if (i % 2 == 0) continue;  // destroyed while recording
    prof.stop();
    for (const profiler::KernelTime& t : prof.results()) counted += t.calls;
  }
  done = true;
  for (std::thread& t : workers) t.join();
  EXPECT_GT(counted, 0);
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
