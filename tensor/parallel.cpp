#include "tensor/parallel.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>

#include <Eigen/Core>

#include "tensor/error.h"

namespace kiln {

namespace {
std::atomic<int> g_num_threads{0};  // 0: not set yet, use OpenMP's default
}

void set_num_threads(int n) {
  KILN_CHECK(n >= 1, "[set_num_threads] expected a positive thread count, got ", n);
  g_num_threads.store(n);
  omp_set_num_threads(n);
  Eigen::setNbThreads(n);
}

int get_num_threads() {
  const int n = g_num_threads.load();
  return n > 0 ? n : omp_get_max_threads();
}

namespace internal {

bool in_parallel_region() { return omp_in_parallel() != 0; }

void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int threads = static_cast<int>(
      std::min<int64_t>(get_num_threads(), (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1)));
  if (threads <= 1 || in_parallel_region()) {
    f(begin, end);
    return;
  }
  // Exceptions must not escape an OpenMP region: keep the first and rethrow after.
  std::exception_ptr error;
  std::mutex mu;
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num();
    const int64_t nt = omp_get_num_threads();
    const int64_t chunk = (n + nt - 1) / nt;
    const int64_t b = begin + t * chunk;
    const int64_t e = std::min(end, b + chunk);
    if (b < e) {
      try {
        f(b, e);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace internal
}  // namespace kiln
