// Tests of the CUDA runtime (kernels/cuda.h) and the CUDA copy and fill kernels.
//
// Suites named Gpu* carry the ctest label `gpu` and skip themselves, with the reason, when no
// GPU can be used; CudaAvailability runs everywhere.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda.h"
#include "kernels/cuda/runtime.h"
#include "tensor/ops.h"
#include "test_util.h"

namespace kiln {
namespace {

const std::vector<ScalarType> kAllDtypes = {kFloat, kDouble, kHalf,  kBFloat16,
                                            kInt64, kInt32,  kUInt8, kBool};

// A CPU tensor of `sizes` with varied values that every dtype can hold: small integers and
// fractions of both signs (zeros included, so bool gets both values). `seed` shifts the
// pattern so that tests don't all see the same numbers.
Tensor pattern(IntArrayRef sizes, ScalarType dtype, int64_t seed = 0) {
  Tensor t = empty(sizes, TensorOptions(dtype));
  const int64_t n = t.numel();
  visit_dtype(dtype, [&]<typename T>(TypeTag<T>) {
    T* p = t.data_ptr<T>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t k = (i * 37 + seed * 11) % 211 - 105;
      const double v = static_cast<double>(k) * 0.625 + (k % 3 == 0 ? 0.0 : 0.25);
      if constexpr (std::is_same_v<T, bool>) {
        p[i] = k % 4 != 0;
      } else if constexpr (std::is_same_v<T, uint8_t>) {
        p[i] = static_cast<T>(k + 105);  // 0 to 210
      } else if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
        p[i] = T(static_cast<float>(v));
      } else {
        p[i] = static_cast<T>(v);
      }
    }
  });
  return t;
}

// Element-by-element equality of two CPU tensors of the same dtype and shape, bit for bit
// (after making both contiguous).
void expect_same(const Tensor& actual, const Tensor& expected) {
  ASSERT_TRUE(actual.is_cpu());
  ASSERT_EQ(actual.dtype(), expected.dtype());
  ASSERT_EQ(to_shape(actual.sizes()), to_shape(expected.sizes()));
  const Tensor a = actual.contiguous(), e = expected.contiguous();
  const size_t width = element_size(a.dtype());
  const char* pa = static_cast<const char*>(a.data_ptr());
  const char* pe = static_cast<const char*>(e.data_ptr());
  int64_t mismatches = 0, first = -1;
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (std::memcmp(pa + i * width, pe + i * width, width) != 0) {
      if (first < 0) first = i;
      ++mismatches;
    }
  }
  EXPECT_EQ(mismatches, 0) << "first mismatch at flat index " << first << " for dtype "
                           << dtype_name(a.dtype());
}

TensorOptions on_cuda(ScalarType dtype, int index = 0) {
  return TensorOptions(dtype).device(Device(kCUDA, index));
}

// --- Runs everywhere ------------------------------------------------------------------------

TEST(CudaAvailability, ConsistentEverywhere) {
  const bool available = cuda::is_available();
  EXPECT_EQ(available, cuda::device_count() > 0);
  EXPECT_EQ(available, cuda::unavailable_reason().empty()) << cuda::unavailable_reason();
  if (!available) {
    EXPECT_KILN_ERROR(cuda::memory_stats(), "no CUDA device");
    EXPECT_KILN_ERROR(cuda::synchronize(), "[synchronize]");
    EXPECT_KILN_ERROR(cuda::current_device(), "[current_device] no CUDA device");
    EXPECT_KILN_ERROR(cuda::empty_cache(), "[empty_cache]");
    EXPECT_KILN_ERROR(cuda::internal::trim_graph_memory(0), "[trim_graph_memory] no CUDA device");
    EXPECT_KILN_ERROR(cuda::set_device(0), "[set_device]");
    EXPECT_KILN_ERROR(empty({2, 3}, TensorOptions(kFloat).device(kCUDA)), "[allocate]");
    EXPECT_KILN_ERROR(pattern({4}, kFloat).to(Device(kCUDA)), "cuda");
  }
}

// The knobs of kernels/cuda.h: a getter and a setter each, in every build.
// The power monitor says why it reports nothing where there is no GPU (or no NVML), and its
// report is all zeros there.
TEST(CudaAvailability, PowerMonitorWithoutAGpuSaysWhy) {
  if (cuda::is_available()) GTEST_SKIP() << "a GPU is present (GpuRuntime.PowerMonitorReportsAnInterval)";
  cuda::PowerMonitor m;
  EXPECT_FALSE(m.available());
  EXPECT_FALSE(m.unavailable_reason().empty());
  EXPECT_EQ(m.unavailable_reason(), cuda::unavailable_reason());  // built without CUDA, no driver
  const cuda::PowerReport r = m.stop();
  EXPECT_EQ(r.samples, 0);
  EXPECT_EQ(r.energy_joules, 0);
}

TEST(CudaKnobs, SettersRoundTrip) {
  struct Knob {
    bool (*get)();
    void (*set)(bool);
  };
  for (const Knob& k : {Knob{cuda::launch_sync, cuda::set_launch_sync},
                        Knob{cuda::matmul_autotune, cuda::set_matmul_autotune},
                        Knob{cuda::allow_tf32, cuda::set_allow_tf32}}) {
    const bool before = k.get();
    k.set(!before);
    EXPECT_EQ(k.get(), !before);
    k.set(before);
    EXPECT_EQ(k.get(), before);
  }
  EXPECT_FALSE(cuda::allow_tf32());  // PyTorch's default
}

using test::ScopedEnv;

// A knob's environment variable gives its initial value, read at its first use: a fresh process
// (the threadsafe death-test style re-runs the test binary up to the EXPECT_EXIT) sees it. Nothing
// in this test may read a knob outside the EXPECT_EXIT.
TEST(CudaKnobs, InitialValueFromTheEnvironment) {
  const std::string style = GTEST_FLAG_GET(death_test_style);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  for (const char* value : {"1", "0", ""}) {
    const bool on = std::string(value) == "1";
    const ScopedEnv env_sync("KILN_CUDA_SYNC", value), env_tune("KILN_MATMUL_AUTOTUNE", value);
    EXPECT_EXIT(std::exit(cuda::launch_sync() == on && cuda::matmul_autotune() == on ? 0 : 1),
                ::testing::ExitedWithCode(0), "")
        << "value \"" << value << "\"";
  }
  GTEST_FLAG_SET(death_test_style, style);
}

// ... and only then: a later change of the environment is not seen.
TEST(CudaKnobs, EnvironmentReadOnce) {
  const bool sync = cuda::launch_sync(), autotune = cuda::matmul_autotune();
  const ScopedEnv env_sync("KILN_CUDA_SYNC", sync ? "0" : "1");
  const ScopedEnv env_tune("KILN_MATMUL_AUTOTUNE", autotune ? "0" : "1");
  EXPECT_EQ(cuda::launch_sync(), sync);
  EXPECT_EQ(cuda::matmul_autotune(), autotune);
}

// --- GPU tests ------------------------------------------------------------------------------

class GpuFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  }
};
class GpuRuntime : public GpuFixture {};
class GpuCopy : public GpuFixture {};
class GpuFill : public GpuFixture {};
class GpuMemory : public GpuFixture {};

TEST_F(GpuRuntime, DevicesAndSynchronize) {
  const int n = cuda::device_count();
  ASSERT_GE(n, 1);
  for (int i = 0; i < n; ++i) {
    cuda::set_device(i);
    EXPECT_EQ(cuda::current_device(), i);
    cuda::synchronize();
    cuda::synchronize(i);
  }
  cuda::set_device(0);
  EXPECT_KILN_ERROR(cuda::set_device(n), "does not exist");
  EXPECT_KILN_ERROR(cuda::set_device(-3), "[set_device]");
  EXPECT_EQ(cuda::current_device(), 0);
  EXPECT_KILN_ERROR(empty({4}, on_cuda(kFloat, n)), "[allocate] cuda:");
}

TEST_F(GpuCopy, RoundTripEveryDtype) {
  for (ScalarType dt : kAllDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor cpu = pattern({3, 5, 7}, dt);
    const Tensor gpu = cpu.to(Device(kCUDA));
    EXPECT_TRUE(gpu.is_cuda());
    EXPECT_EQ(gpu.dtype(), dt);
    EXPECT_EQ(to_shape(gpu.sizes()), to_shape(cpu.sizes()));
    expect_same(gpu.to(Device(kCPU)), cpu);
  }
}

TEST_F(GpuCopy, EmptyAndScalarTensors) {
  const Tensor none = pattern({0, 3}, kFloat).to(Device(kCUDA));
  EXPECT_EQ(none.numel(), 0);
  EXPECT_EQ(none.to(Device(kCPU)).numel(), 0);
  const Tensor s = scalar_tensor(2.5, TensorOptions(kFloat)).to(Device(kCUDA));
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.item().toDouble(), 2.5);
}

// Every pair of dtypes, converted on the GPU, from the CPU to the GPU and from the GPU to the
// CPU, rounds exactly as the CPU conversion does.
TEST_F(GpuCopy, ConversionsMatchCpu) {
  for (ScalarType from : kAllDtypes) {
    const Tensor cpu = pattern({6, 50}, from, /*seed=*/3);
    const Tensor gpu = cpu.to(Device(kCUDA));
    for (ScalarType to : kAllDtypes) {
      SCOPED_TRACE(std::string(dtype_name(from)) + " -> " + std::string(dtype_name(to)));
      const Tensor expected = cpu.to(to);
      expect_same(gpu.to(to).to(Device(kCPU)), expected);                 // on the GPU
      expect_same(cpu.to(Device(kCUDA), to).to(Device(kCPU)), expected);  // CPU -> GPU
      expect_same(gpu.to(Device(kCPU), to), expected);                    // GPU -> CPU
    }
  }
}

TEST_F(GpuCopy, LargeConversionUsesManyBlocks) {
  // More elements than one pass of the grid covers (65536 blocks of 256 threads).
  const Tensor cpu = pattern({5, 4000, 1000}, kFloat, 7);
  const Tensor gpu = cpu.to(Device(kCUDA));
  expect_same(gpu.to(kBFloat16).to(Device(kCPU)), cpu.to(kBFloat16));
  expect_same(gpu.transpose(1, 2).contiguous().to(Device(kCPU)), cpu.transpose(1, 2).contiguous());
}

TEST_F(GpuCopy, NonContiguousSources) {
  for (ScalarType dt : {kFloat, kHalf, kInt64, kBool}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor cpu = pattern({4, 6, 5}, dt, 1);
    const Tensor views[] = {cpu.transpose(0, 2), cpu.narrow(1, 1, 3), cpu.select(2, 3),
                            cpu.permute({1, 2, 0}).narrow(0, 2, 2)};
    for (const Tensor& v : views) {
      ASSERT_FALSE(v.is_contiguous());
      // A strided CPU source to the GPU, and back.
      expect_same(v.to(Device(kCUDA)).to(Device(kCPU)), v.contiguous());
      expect_same(v.to(Device(kCUDA), kDouble).to(Device(kCPU)), v.to(kDouble));
    }
    // Strided GPU sources: made contiguous on the GPU, copied straight to the CPU, converted.
    const Tensor gpu = cpu.to(Device(kCUDA));
    expect_same(gpu.transpose(0, 2).contiguous().to(Device(kCPU)),
                cpu.transpose(0, 2).contiguous());
    expect_same(gpu.narrow(1, 1, 3).to(Device(kCPU)), cpu.narrow(1, 1, 3).contiguous());
    expect_same(gpu.select(2, 3).to(Device(kCPU), kFloat), cpu.select(2, 3).to(kFloat));
  }
}

TEST_F(GpuCopy, CopyIntoStridedAndBroadcast) {
  const Tensor src = pattern({5, 4}, kFloat, 2);
  // A transposed GPU destination, from the CPU and from the GPU, with a conversion.
  Tensor dst = zeros({4, 5}, on_cuda(kHalf));
  dst.t().copy_(src);
  expect_same(dst.to(Device(kCPU)), src.t().to(kHalf));
  Tensor dst2 = zeros({4, 5}, on_cuda(kDouble));
  dst2.t().copy_(src.to(Device(kCUDA)));
  expect_same(dst2.to(Device(kCPU)), src.t().to(kDouble));
  // Broadcasting a row into every row, CPU -> GPU and GPU -> GPU.
  const Tensor row = pattern({4}, kInt32, 5);
  Tensor b = empty({3, 4}, on_cuda(kInt64));
  b.copy_(row);
  expect_same(b.to(Device(kCPU)), row.expand({3, 4}).to(kInt64));
  b.zero_();
  b.copy_(row.to(Device(kCUDA)));
  expect_same(b.to(Device(kCPU)), row.expand({3, 4}).to(kInt64));
  // A GPU source into a strided CPU destination.
  Tensor host = zeros({4, 5}, TensorOptions(kFloat));
  host.t().copy_(src.to(Device(kCUDA)));
  expect_same(host, src.t().contiguous());
  Tensor host_col = zeros({5, 3}, TensorOptions(kBFloat16));
  host_col.select(1, 1).copy_(src.select(1, 2).to(Device(kCUDA)));
  expect_same(host_col.select(1, 1).contiguous(), src.select(1, 2).to(kBFloat16));
  expect_same(host_col.select(1, 0), zeros({5}, TensorOptions(kBFloat16)));
}

// Same dtype, rows of contiguous elements on both sides (one cudaMemcpy2DAsync): FSDP's copy of
// a parameter's [world, shard] slices out of the gathered rows, into a contiguous tensor and into
// a narrowed one, whose elements between the rows stay untouched.
TEST_F(GpuCopy, RowsOfContiguousElements) {
  for (ScalarType dt : {kBFloat16, kFloat, kInt64, kBool}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor cpu = pattern({4, 37}, dt, 6);
    const Tensor gpu = cpu.to(Device(kCUDA));
    // Rows out of wider rows, into a contiguous tensor.
    Tensor packed = empty({4, 11}, on_cuda(dt));
    packed.copy_(gpu.narrow(1, 5, 11));
    expect_same(packed.to(Device(kCPU)), cpu.narrow(1, 5, 11).contiguous());
    // Into rows of a wider tensor: the columns around them keep their zeros.
    Tensor wide = zeros({4, 37}, on_cuda(dt));
    wide.narrow(1, 20, 11).copy_(packed);
    Tensor expected = zeros({4, 37}, TensorOptions(dt));
    expected.narrow(1, 20, 11).copy_(cpu.narrow(1, 5, 11));
    expect_same(wide.to(Device(kCPU)), expected);
    // One row (a narrow of a row is contiguous), and 3-d rows that merge into 2-d ones.
    Tensor one = zeros({11}, on_cuda(dt));
    one.copy_(gpu[2].narrow(0, 3, 11));
    expect_same(one.to(Device(kCPU)), cpu[2].narrow(0, 3, 11).contiguous());
    const Tensor cube = pattern({3, 4, 9}, dt, 8);
    Tensor sub = empty({3, 4, 5}, on_cuda(dt));
    sub.copy_(cube.to(Device(kCUDA)).narrow(2, 2, 5));
    expect_same(sub.to(Device(kCPU)), cube.narrow(2, 2, 5).contiguous());
    // Rows narrowed in two dimensions do not merge: the strided kernel takes them.
    Tensor both = empty({2, 2, 5}, on_cuda(dt));
    both.copy_(cube.to(Device(kCUDA)).narrow(1, 1, 2).narrow(2, 2, 5).narrow(0, 1, 2));
    expect_same(both.to(Device(kCPU)),
                cube.narrow(1, 1, 2).narrow(2, 2, 5).narrow(0, 1, 2).contiguous());
  }
}

TEST_F(GpuCopy, DeviceToDevice) {
  const Tensor cpu = pattern({33, 65}, kBFloat16, 4);
  const Tensor a = cpu.to(Device(kCUDA));
  const Tensor b = a.clone();
  EXPECT_TRUE(b.is_cuda());
  EXPECT_NE(b.data_ptr(), a.data_ptr());
  Tensor c = empty({33, 65}, on_cuda(kBFloat16));
  c.copy_(b);
  expect_same(c.to(Device(kCPU)), cpu);
  if (cuda::device_count() >= 2) {
    const Tensor other = a.to(Device(kCUDA, 1));
    EXPECT_EQ(other.device(), Device(kCUDA, 1));
    expect_same(other.to(Device(kCPU)), cpu);
    expect_same(a.t().to(Device(kCUDA, 1), kFloat).to(Device(kCPU)), cpu.t().to(kFloat));
    Tensor back = zeros({65, 33}, on_cuda(kBFloat16, 0));
    back.copy_(other.t());
    expect_same(back.to(Device(kCPU)), cpu.t().contiguous());
  }
}

TEST_F(GpuCopy, WithLaunchSync) {
  const bool before = cuda::launch_sync();
  cuda::set_launch_sync(true);
  const Tensor cpu = pattern({7, 9}, kFloat, 6);
  const Tensor gpu = cpu.to(Device(kCUDA));
  expect_same(gpu.t().to(kHalf).to(Device(kCPU)), cpu.t().to(kHalf));
  cuda::set_launch_sync(before);
}

TEST_F(GpuFill, ZerosOnesFullEveryDtype) {
  for (ScalarType dt : kAllDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    expect_same(zeros({17, 3}, on_cuda(dt)).to(Device(kCPU)), zeros({17, 3}, TensorOptions(dt)));
    expect_same(ones({5, 11}, on_cuda(dt)).to(Device(kCPU)), ones({5, 11}, TensorOptions(dt)));
    expect_same(full({2, 3, 4}, -3, on_cuda(dt)).to(Device(kCPU)),
                full({2, 3, 4}, -3, TensorOptions(dt)));
    expect_same(full({1000}, 1.5, on_cuda(dt)).to(Device(kCPU)),
                full({1000}, 1.5, TensorOptions(dt)));
  }
}

TEST_F(GpuFill, StridedViews) {
  const Tensor cpu = pattern({6, 8}, kFloat, 9);
  Tensor gpu = cpu.to(Device(kCUDA));
  Tensor expected = cpu.clone();
  gpu.select(1, 3).fill_(7.25);
  expected.select(1, 3).fill_(7.25);
  gpu.t().narrow(0, 5, 2).fill_(0);
  expected.t().narrow(0, 5, 2).fill_(0);
  expect_same(gpu.to(Device(kCPU)), expected);
  // A fill bumps the version like on the CPU.
  const uint64_t v = gpu.impl()->version();
  gpu.fill_(1);
  EXPECT_GT(gpu.impl()->version(), v);
}

// Clocks, power and energy over half a second of matrix products: plausible values, the
// energy counter's mean power within the board's reach, and stop() repeatable.
TEST_F(GpuRuntime, PowerMonitorReportsAnInterval) {
  cuda::PowerMonitor m(0);
  if (!m.available()) GTEST_SKIP() << "no power readings: " << m.unavailable_reason();
  const Device gpu(kCUDA, 0);
  const Tensor a = randn({4096, 4096}).to(kBFloat16).to(gpu);
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(500)) {
    for (int i = 0; i < 20; ++i) (void)mm(a, a);
    cuda::synchronize();
  }
  const cuda::PowerReport r = m.stop();
  EXPECT_GE(r.seconds, 0.5);
  EXPECT_GE(r.samples, 10);  // every 20 ms
  EXPECT_GT(r.energy_joules, 0);
  EXPECT_GT(r.mean_power_watts, 20);
  EXPECT_LT(r.mean_power_watts, 2000);
  EXPECT_GT(r.mean_sm_clock_mhz, 0);
  EXPECT_LE(r.mean_sm_clock_mhz, r.max_sm_clock_mhz);
  EXPECT_GT(r.power_limit_watts, 0);
  EXPECT_GE(r.power_capped, 0);
  EXPECT_LE(r.power_capped, 1);
  const cuda::PowerReport again = m.stop();
  EXPECT_EQ(again.energy_joules, r.energy_joules);
  EXPECT_EQ(again.samples, r.samples);
  std::printf("  %.2f s: %.0f MHz of %.0f, %.0f W of %.0f, %.1f J, power-capped %.0f%%\n",
              r.seconds, r.mean_sm_clock_mhz, r.max_sm_clock_mhz, r.mean_power_watts,
              r.power_limit_watts, r.energy_joules, 100 * r.power_capped);
}

TEST_F(GpuMemory, StatsFollowAllocations) {
  cuda::synchronize();
  const cuda::MemoryStats before = cuda::memory_stats();
  constexpr int64_t kBytes = int64_t{64} << 20;
  {
    const Tensor t = empty({kBytes / 4}, on_cuda(kFloat));
    const cuda::MemoryStats during = cuda::memory_stats();
    EXPECT_EQ(during.allocated, before.allocated + kBytes);
    EXPECT_GE(during.peak, during.allocated);
    EXPECT_GE(during.reserved, during.allocated);
  }
  const cuda::MemoryStats after = cuda::memory_stats();
  EXPECT_EQ(after.allocated, before.allocated);
  EXPECT_GE(after.peak, before.allocated + kBytes);
  // The freed block stays in the pool (the release threshold is high) until empty_cache().
  EXPECT_GE(after.reserved, kBytes);
  cuda::reset_peak_memory_stats();
  EXPECT_EQ(cuda::memory_stats().peak, after.allocated);
  cuda::empty_cache();
  EXPECT_LE(cuda::memory_stats().reserved, after.reserved - kBytes);
  EXPECT_GE(cuda::memory_stats().reserved, cuda::memory_stats().allocated);
}

// trim_graph_memory: the graph memory a dropped graph leaves reserved goes back to the driver,
// while kiln's pool keeps its cached blocks (empty_cache returns those too).
TEST_F(GpuMemory, TrimGraphMemoryKeepsThePool) {
  cuda::empty_cache();
  constexpr int64_t kBytes = int64_t{64} << 20;
  const Tensor x = ones({kBytes / 4}, on_cuda(kFloat));
  const Tensor out = zeros({1}, on_cuda(kFloat));
  { const Tensor cached = empty({kBytes / 4}, on_cuda(kFloat)); }  // freed into the pool
  {
    const std::shared_ptr<cuda::internal::CapturedGraph> graph =
        cuda::internal::capture_graph(0, [&] {
          out.copy_((x * 2).sum().reshape({1}));  // x * 2: graph memory, freed in the graph
          return std::vector<Storage>{};
        });
    graph->launch();
    EXPECT_NEAR(out.item<double>(), 2.0 * (kBytes / 4), 1e-3);
  }
  const cuda::MemoryStats dropped = cuda::memory_stats();
  cuda::internal::trim_graph_memory(0);
  const cuda::MemoryStats trimmed = cuda::memory_stats();
  EXPECT_EQ(trimmed.graph, 0);
  EXPECT_LE(trimmed.reserved, dropped.reserved - kBytes);   // x * 2's graph memory
  EXPECT_GE(trimmed.reserved, trimmed.allocated + kBytes);  // the pool's cached block
  cuda::empty_cache();
  EXPECT_LE(cuda::memory_stats().reserved, trimmed.reserved - kBytes);
}

// defer_to_each_launch: work the host starts after every launch of a graph, once the graph has
// reached the point of the call (its event), beside the rest of the graph; nothing outside a
// capture.
TEST_F(GpuRuntime, WorkDeferredToEachLaunchOfAGraph) {
  const Tensor x = zeros({1 << 20}, on_cuda(kFloat));
  const Tensor seen = zeros({1 << 20}, on_cuda(kFloat));
  const Tensor other = zeros({1 << 20}, on_cuda(kFloat));
  int starts = 0;
  cuda::Event done;
  const cuda::Stream caller = cuda::current_stream();
  EXPECT_FALSE(cuda::internal::capturing_graph());
  EXPECT_FALSE(cuda::internal::defer_to_each_launch([&] { ++starts; }));
  auto capture = [&] {
    return cuda::internal::capture_graph(0, [&] {
      EXPECT_TRUE(cuda::internal::capturing_graph());
      x.add_(1);
      EXPECT_TRUE(cuda::internal::defer_to_each_launch([&] {
        ++starts;
        EXPECT_NE(cuda::current_stream().handle(), caller.handle());
        seen.copy_(x * 3);  // queued on the deferred work's stream, after x + 1
        done.record();
      }));
      other.add_(2);  // the graph goes on beside the deferred copy
      return std::vector<Storage>{};
    });
  };
  // Each launch's part waits for that launch's mark; a second graph (its mark's word reused once
  // the first is gone) counts from its own first launch.
  int launches = 0;
  for (int graphs = 0; graphs < 2; ++graphs) {
    const std::shared_ptr<cuda::internal::CapturedGraph> graph = capture();
    EXPECT_EQ(starts, launches);  // not during the capture
    for (int k = 0; k < 3; ++k) {
      graph->launch();
      ++launches;
      EXPECT_EQ(starts, launches);
      EXPECT_EQ(cuda::current_stream().handle(), caller.handle());
      cuda::current_stream().wait(done);
      expect_same(seen.to(Device(kCPU)), full({1 << 20}, 3.0 * launches, TensorOptions(kFloat)));
      expect_same(other.to(Device(kCPU)), full({1 << 20}, 2.0 * launches, TensorOptions(kFloat)));
    }
  }
}

TEST_F(GpuMemory, OutOfMemoryIsAnError) {
  const int64_t in_use = cuda::memory_stats().allocated;
  // 1 PiB of floats.
  EXPECT_KILN_ERROR(empty({int64_t{1} << 48}, on_cuda(kFloat)),
                    "[allocate] CUDA out of memory: tried to allocate 1073741824.00 MiB; ");
  EXPECT_KILN_ERROR(empty({int64_t{1} << 48}, on_cuda(kFloat)), " MiB in use");
  EXPECT_EQ(cuda::memory_stats().allocated, in_use);
  // The device is still usable afterwards.
  expect_same(full({4}, 2, on_cuda(kInt32)).to(Device(kCPU)), full({4}, 2, TensorOptions(kInt32)));
}

TEST_F(GpuMemory, ZeroBytes) {
  const int64_t in_use = cuda::memory_stats().allocated;
  const Tensor t = empty({0}, on_cuda(kFloat));
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(cuda::memory_stats().allocated, in_use);
}

}  // namespace
}  // namespace kiln
