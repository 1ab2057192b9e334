// GPU timing for kernels chosen by measurement (timing.h).
#include <algorithm>
#include <limits>

#include "kernels/cuda.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/timing.h"

namespace kiln::cuda {
namespace {

__global__ void busy_wait_kernel(uint64_t ns) {
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

}  // namespace

void busy_wait(cudaStream_t stream, int64_t us) {
  if (us <= 0) return;
  busy_wait_kernel<<<1, 1, 0, stream>>>(static_cast<uint64_t>(us) * 1000);
  KILN_CUDA_LAUNCH_CHECK("busy_wait_kernel");
}

std::vector<double> best_times(const std::vector<std::function<void()>>& candidates, int rounds,
                               int runs) {
  const size_t n = candidates.size();
  std::vector<double> ms(n, std::numeric_limits<double>::infinity());
  if (n == 0 || rounds <= 0 || runs <= 0) return ms;
  for (const auto& c : candidates) c();
  const Stream stream = current_stream();
  std::vector<Event> events;
  events.reserve(2 * n * static_cast<size_t>(rounds));
  for (size_t i = 0; i < 2 * n * static_cast<size_t>(rounds); ++i) events.emplace_back(true);
  // Long enough for the host to queue every timed run (30 us each: a cuDNN execution takes the
  // host about 10-20 us, a cuBLASLt launch less).
  busy_wait(stream, 30 * static_cast<int64_t>(n) * rounds * runs + 100);
  size_t e = 0;
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < n; ++i, e += 2) {
      events[e].record(stream);
      for (int k = 0; k < runs; ++k) candidates[i]();
      events[e + 1].record(stream);
    }
  }
  stream.synchronize();
  e = 0;
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < n; ++i, e += 2) {
      ms[i] = std::min(ms[i], static_cast<double>(events[e].elapsed_time(events[e + 1])) / runs);
    }
  }
  return ms;
}

}  // namespace kiln::cuda
