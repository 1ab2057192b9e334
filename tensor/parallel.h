// CPU parallelism: kiln's kernels split large work across a pool of threads (OpenMP), and
// Eigen's GEMM uses the same thread count.
//
//   kiln::set_num_threads(2);
//   kiln::internal::parallel_for(0, n, /*grain=*/32768, [&](int64_t b, int64_t e) { ... });
//
// parallel_for runs serially when the range is smaller than `grain`, when one thread is set,
// or when called from inside another parallel region.
#pragma once

#include <cstdint>
#include <functional>

namespace kiln {

void set_num_threads(int n);
int get_num_threads();

namespace internal {
// Elements per task below which splitting costs more than it gains (for memory-bound loops).
inline constexpr int64_t kGrainSize = 32768;
void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& f);
bool in_parallel_region();
}  // namespace internal

}  // namespace kiln
