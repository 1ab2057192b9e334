// Streams, events and pinned host memory (kernels/cuda/runtime.h): work split over two streams
// ordered by events gives the CPU's results, events time work, pinned tensors round-trip,
// non-blocking copies equal the data once synchronised, and small host-to-device copies are
// queued. Gpu* suites skip without a GPU; the last suite checks the errors of a build or machine
// without one.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernels/cuda/runtime.h"
#include "kernels/gpu_test_util.h"
#include "tensor/ops.h"
#include "test_util.h"

namespace kiln {
namespace {

class GpuStreamTest : public test::GpuTest {};
class GpuStream : public GpuStreamTest {};
class GpuEvent : public GpuStreamTest {};
class GpuPinned : public GpuStreamTest {};

TEST_F(GpuStream, CurrentStreamFollowsTheGuard) {
  EXPECT_TRUE(cuda::current_stream().is_default());
  EXPECT_EQ(cuda::current_stream(), cuda::Stream::default_stream());
  const cuda::Stream s = cuda::Stream::create();
  EXPECT_FALSE(s.is_default());
  EXPECT_EQ(s.device(), cuda::current_device());
  {
    cuda::StreamGuard guard(s);
    EXPECT_EQ(cuda::current_stream(), s);
    const cuda::Stream t = cuda::Stream::create();
    {
      cuda::StreamGuard inner(t);
      EXPECT_EQ(cuda::current_stream(), t);
    }
    EXPECT_EQ(cuda::current_stream(), s);
  }
  EXPECT_TRUE(cuda::current_stream().is_default());
}

// Two side streams compute from the same input, events order them before the default stream
// combines the results.
TEST_F(GpuStream, TwoStreamsWithEventsMatchCpu) {
  manual_seed(1);
  const Tensor a_cpu = randn({513, 257});
  const Tensor w_cpu = randn({257, 129});
  const Tensor a = a_cpu.cuda(), w = w_cpu.cuda();
  const cuda::Stream s1 = cuda::Stream::create(), s2 = cuda::Stream::create();
  s1.wait_stream(cuda::current_stream());
  s2.wait_stream(cuda::current_stream());
  Tensor x, y;
  cuda::Event e1, e2;
  {
    cuda::StreamGuard guard(s1);
    x = matmul(a, w).relu() * 2.0 + 1.0;
    e1.record();
  }
  {
    cuda::StreamGuard guard(s2);
    y = a.exp().sum(1, /*keepdim=*/true).log() + matmul(a, w);
    e2.record(s2);
  }
  cuda::current_stream().wait(e1);
  cuda::current_stream().wait(e2);
  const Tensor z = (x + y).cpu();
  const Tensor expected = matmul(a_cpu, w_cpu).relu() * 2.0 + 1.0 +
                          (a_cpu.exp().sum(1, true).log() + matmul(a_cpu, w_cpu));
  EXPECT_TRUE(allclose(z, expected, 1e-3, 1e-3));
  cuda::synchronize();
  EXPECT_TRUE(s1.query());
  EXPECT_TRUE(s2.query());
}

TEST_F(GpuEvent, ElapsedTimeIsPositive) {
  const Tensor a = randn({1024, 1024}).cuda();
  cuda::Event start(/*enable_timing=*/true), end(/*enable_timing=*/true);
  EXPECT_FALSE(start.is_recorded());
  EXPECT_TRUE(start.query());  // nothing recorded: nothing to wait for
  start.record();
  Tensor b = a;
  for (int i = 0; i < 8; ++i) b = matmul(b, a) * 1e-3;
  end.record();
  end.synchronize();
  EXPECT_TRUE(end.query());
  EXPECT_GT(start.elapsed_time(end), 0.0f);
  EXPECT_TRUE(std::isfinite(b.abs().sum().item<double>()));
  cuda::Event untimed;
  untimed.record();
  untimed.synchronize();
  EXPECT_KILN_ERROR(start.elapsed_time(untimed), "enable_timing");
}

TEST_F(GpuPinned, RoundTrip) {
  manual_seed(2);
  const Tensor h = randn({1000, 37});
  EXPECT_FALSE(h.is_pinned());
  const Tensor p = h.pin_memory();
  EXPECT_TRUE(p.is_pinned());
  EXPECT_TRUE(p.is_cpu());
  EXPECT_TRUE(equal(p, h));
  EXPECT_TRUE(p.pin_memory().is_same(p));  // already pinned
  const Tensor d = p.cuda();
  EXPECT_TRUE(equal(d.cpu(), h));
  const Tensor strided = randn({64, 48}).t().pin_memory();  // a view's copy, contiguous
  EXPECT_TRUE(strided.is_pinned());
  EXPECT_TRUE(strided.is_contiguous());
  EXPECT_KILN_ERROR(d.pin_memory(), "[pin_memory]");
}

TEST_F(GpuPinned, NonBlockingCopiesThenSynchronize) {
  manual_seed(3);
  for (ScalarType dt : {kFloat, kBFloat16, kInt64}) {
    const Tensor h = (randn({4099}) * 100).to(dt);
    const Tensor p = h.pin_memory();
    const Tensor d = p.to(kCUDA, /*non_blocking=*/true);
    const Tensor converted = p.to(Device(kCUDA), kDouble, /*non_blocking=*/true);
    const Tensor back = (d * 2).to(kCPU, /*non_blocking=*/true);
    EXPECT_TRUE(back.is_pinned());
    cuda::synchronize();
    EXPECT_TRUE(equal(d.cpu(), h));
    EXPECT_TRUE(equal(converted.cpu(), h.to(kDouble)));
    EXPECT_TRUE(equal(back, (h * 2)));
  }
}

TEST_F(GpuPinned, NonBlockingOnASideStream) {
  manual_seed(4);
  const Tensor h = randn({1 << 20}).pin_memory();
  const cuda::Stream s = cuda::Stream::create();
  Tensor d, back;
  {
    cuda::StreamGuard guard(s);
    d = h.to(kCUDA, /*non_blocking=*/true);
    back = (d + 1.0).to(kCPU, /*non_blocking=*/true);
  }
  s.synchronize();
  EXPECT_TRUE(equal(back, h + 1.0));
}

// A host-to-device copy of at most 8 bytes (an optimizer's lr every step) is a queued kernel
// that carries the bytes: the values of every width arrive, on the current stream, in order with
// the work around them, and the host memory may change as soon as the copy returns.
TEST_F(GpuPinned, SmallHostToDeviceCopiesAreQueued) {
  for (ScalarType dt : {kBool, kByte, kHalf, kBFloat16, kInt32, kFloat, kInt64, kDouble}) {
    for (int64_t n : {int64_t{1}, int64_t{2}, int64_t{3}}) {
      if (n * static_cast<int64_t>(element_size(dt)) > 8) continue;
      const Tensor h = (arange(0, n, kDouble) * 1.5 + 1.0).to(dt);
      EXPECT_TRUE(equal(h.cuda().cpu(), h)) << dtype_name(dt) << " x" << n;
    }
  }
  Tensor lr = scalar_tensor(0.25, kDouble);
  const cuda::Stream s = cuda::Stream::create();
  Tensor d, later;
  {
    cuda::StreamGuard guard(s);
    const Tensor busy = randn({1 << 20}).cuda().mul(2.0);  // work queued before the copy
    d = lr.to(kCUDA);
    *lr.data_ptr<double>() = 4.0;  // the copy already holds its bytes
    later = d * busy.numel();
  }
  s.synchronize();
  EXPECT_EQ(d.cpu().item<double>(), 0.25);
  EXPECT_EQ(later.cpu().item<double>(), 0.25 * (1 << 20));
}

// A pinned block whose tensor died is reused for the next request of its size.
TEST_F(GpuPinned, BlocksAreCached) {
  { const Tensor p = randn({12345}).pin_memory(); }
  const int64_t before = cuda::internal::pinned_cached_bytes();
  for (int i = 0; i < 5; ++i) {
    const Tensor p = randn({12345}).pin_memory();
    EXPECT_TRUE(p.is_pinned());
  }
  EXPECT_EQ(cuda::internal::pinned_cached_bytes(), before);
  cuda::empty_cache();
  EXPECT_LT(cuda::internal::pinned_cached_bytes(), before);
}

// Without a GPU (or without CUDA), streams, events and pinned memory fail clearly.
TEST(CudaStreamsUnavailable, ClearErrors) {
  if (cuda::is_available()) GTEST_SKIP() << "a GPU is present";
  EXPECT_FALSE(randn({3}).is_pinned());
  EXPECT_KILN_ERROR(randn({3}).pin_memory(), "no CUDA device");
  EXPECT_KILN_ERROR(cuda::Stream::create(), "no CUDA device");
  cuda::Event e;
  EXPECT_FALSE(e.is_recorded());
  EXPECT_KILN_ERROR(e.record(), "no CUDA device");
}

}  // namespace
}  // namespace kiln
