// kiln::cuda: the CUDA runtime as the user sees it: devices, synchronisation, memory statistics.
//
//   if (kiln::cuda::is_available()) {
//     kiln::Tensor x = kiln::ones({1024, 1024}, kiln::kCUDA);
//     kiln::cuda::synchronize();
//     std::cout << kiln::cuda::memory_stats().allocated << " bytes in use\n";
//   }
//
// This header includes no CUDA header and compiles in every build: in a CPU-only build (or on a
// machine without a GPU) is_available() is false, device_count() is 0 and unavailable_reason()
// says why; the functions that need a device throw kiln::Error.
//
// CUDA memory comes from each device's stream-ordered pool (cudaMallocAsync) with a release
// threshold so high that freed memory stays reserved for reuse: `reserved` stays above
// `allocated` until empty_cache() gives the unused part back to the driver.
//
// Debugging: with KILN_CUDA_SYNC=1 in the environment (or set_launch_sync(true)) every kernel
// launch and copy is followed by a device synchronisation, so that an asynchronous error is
// reported by the op that caused it.
#pragma once

#include <cstdint>
#include <string>

namespace kiln::cuda {

// True when kiln was built with CUDA and at least one GPU can be used.
bool is_available();
// The number of usable GPUs (0 when is_available() is false).
int device_count();
// Why is_available() is false ("kiln was built without CUDA", the driver's error, ...); empty
// when it is true.
std::string unavailable_reason();

// The device that CUDA calls of this thread go to, and setting it (cudaSetDevice).
int current_device();
void set_device(int index);

// Waits for all work queued on `device` (-1: the current device).
void synchronize(int device = -1);

// Bytes of CUDA memory on one device.
struct MemoryStats {
  int64_t allocated = 0;  // held by live tensors
  int64_t reserved = 0;   // held by the device's memory pool (allocated + cached)
  int64_t peak = 0;       // the highest `allocated` since the start or reset_peak_memory_stats()
};
MemoryStats memory_stats(int device = -1);
void reset_peak_memory_stats(int device = -1);
// Returns the pool's unused memory to the driver (after waiting for the device).
void empty_cache(int device = -1);

// The KILN_CUDA_SYNC debug mode: synchronise after every launch and copy.
bool launch_sync();
void set_launch_sync(bool enabled);

}  // namespace kiln::cuda
