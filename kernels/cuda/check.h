// What kiln's CUDA code (kernels/cuda/, later the compiler's runtime) builds on: error checks
// that turn CUDA status codes into kiln::Error, the stream eager ops run on, and a guard that
// switches the current device for a scope.
//
//   kiln::cuda::DeviceGuard guard(t.device().index());
//   cudaStream_t stream = kiln::cuda::current_stream();
//   KILN_CUDA_CHECK(cudaMemsetAsync(p, 0, n, stream));
//   my_kernel<<<blocks, threads, 0, stream>>>(...);
//   KILN_CUDA_LAUNCH_CHECK("my_kernel");
//
// Internal to kiln (includes the CUDA runtime header, which users of kiln need not have):
// the public part is kernels/cuda.h.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/cuda/runtime.h"

namespace kiln::cuda {

namespace internal {
// Throws kiln::Error "[cuda] <call> failed: <name>: <description> (file:line)".
[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);
// After a kernel launch: reports a launch error and, in KILN_CUDA_SYNC mode, an error raised
// while the kernel ran.
void check_launch(const char* kernel, const char* file, int line);
// In KILN_CUDA_SYNC mode, waits for the current device and reports what went wrong.
void sync_if_debug(const char* what, const char* file, int line);

// Sets `fn` (a function pointer) to the CUDA driver API's `name`, in its CUDA 12 version,
// reached through the runtime so that kiln does not link libcuda and still loads where no driver
// is installed. False, `fn` untouched, where the driver lacks it.
template <typename Fn>
bool driver_entry_point(const char* name, Fn& fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status{};
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &status) !=
          cudaSuccess ||
      status != cudaDriverEntryPointSuccess || p == nullptr) {
    return false;
  }
  fn = reinterpret_cast<Fn>(p);
  return true;
}
}  // namespace internal

// The stream kiln's eager ops run on is current_stream() (kernels/cuda.h): the default stream
// unless a StreamGuard picked another; a Stream converts to cudaStream_t.

// Makes `index` the current device for the scope (no-op when it already is, or index < 0).
// Restoring never throws: a destructor must not.
class DeviceGuard {
 public:
  explicit DeviceGuard(int index);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace kiln::cuda

#define KILN_CUDA_CHECK(expr)                                                              \
  do {                                                                                     \
    const cudaError_t kiln_cuda_err_ = (expr);                                             \
    if (kiln_cuda_err_ != cudaSuccess) [[unlikely]] {                                      \
      ::kiln::cuda::internal::throw_cuda_error(kiln_cuda_err_, #expr, __FILE__, __LINE__); \
    }                                                                                      \
  } while (0)

// Place right after a `kernel<<<...>>>` launch.
#define KILN_CUDA_LAUNCH_CHECK(kernel_name) \
  ::kiln::cuda::internal::check_launch(kernel_name, __FILE__, __LINE__)
