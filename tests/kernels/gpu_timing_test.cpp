// The GPU timing that kernels chosen by measurement use (kernels/cuda/timing.h): busy_wait's
// length, and best_times ranking candidates of known lengths by their time per run.
#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "kernels/gpu_test_util.h"

#if defined(KILN_WITH_CUDA)
#include "kernels/cuda.h"
#include "kernels/cuda/timing.h"
#endif

namespace kiln {
namespace {

using test::GpuTest;

class GpuTiming : public GpuTest {};

#if defined(KILN_WITH_CUDA)
TEST_F(GpuTiming, BusyWaitLastsAtLeastItsLength) {
  const cuda::Stream stream = cuda::current_stream();
  for (int64_t us : {50, 400}) {
    cuda::Event start(true), stop(true);
    start.record(stream);
    cuda::busy_wait(stream, us);
    stop.record(stream);
    stop.synchronize();
    const double ms = start.elapsed_time(stop);
    EXPECT_GE(ms, 0.001 * static_cast<double>(us)) << us << " us";
    EXPECT_LT(ms, 0.001 * static_cast<double>(us) + 5.0) << us << " us";  // not stuck
  }
  cuda::busy_wait(stream, 0);  // nothing queued
  cuda::busy_wait(stream, -3);
  stream.synchronize();
}

TEST_F(GpuTiming, BestTimesRanksCandidatesPerRun) {
  const cuda::Stream stream = cuda::current_stream();
  int calls[3] = {0, 0, 0};
  // Candidates of 300, 100 and 200 us on the GPU, each run once to warm up and then twice in
  // each of three rounds.
  const std::vector<std::function<void()>> candidates = {
      [&] { ++calls[0], cuda::busy_wait(stream, 300); },
      [&] { ++calls[1], cuda::busy_wait(stream, 100); },
      [&] { ++calls[2], cuda::busy_wait(stream, 200); },
  };
  const std::vector<double> ms = cuda::best_times(candidates, /*rounds=*/3, /*runs=*/2);
  ASSERT_EQ(ms.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(calls[i], 1 + 3 * 2) << "candidate " << i;
  EXPECT_GE(ms[0], 0.300);
  EXPECT_GE(ms[1], 0.100);
  EXPECT_GE(ms[2], 0.200);
  EXPECT_LT(ms[1], ms[2]);
  EXPECT_LT(ms[2], ms[0]);
  // Per run, not per round of two runs.
  EXPECT_LT(ms[0], 0.450);
  EXPECT_TRUE(cuda::best_times({}, 3, 2).empty());
}
#endif

}  // namespace
}  // namespace kiln
