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
//
// Streams and events, as torch.cuda's:
//
//   kiln::cuda::Stream side = kiln::cuda::Stream::create();
//   side.wait_stream(kiln::cuda::current_stream());   // inputs made on the default stream
//   {
//     kiln::cuda::StreamGuard guard(side);     // kernels, copies and allocations of the scope
//     y = kiln::matmul(a, b);                  // are queued on `side`
//   }
//   kiln::cuda::Event done(/*enable_timing=*/true);
//   done.record(side);
//   kiln::cuda::current_stream().wait(done);   // the default stream waits for `side`
//
//   kiln::Tensor h = kiln::randn({1 << 20}).pin_memory();
//   kiln::Tensor d = h.to(kiln::kCUDA, /*non_blocking=*/true);   // returns at once
//
// Streams made by Stream::create() come from a per-device pool of 32 (as PyTorch's stream
// pool) and live as long as the process, so memory allocated on one is always freed on a live
// stream. They do not synchronise with the default stream: order work across streams with
// events (or wait_stream). Memory is freed in the order of the stream that allocated it: a
// tensor allocated on one stream and used on another must stay alive until that use is done
// (synchronise first), as with PyTorch without record_stream.
#pragma once

#include <cstdint>
#include <string>

#include "tensor/storage.h"

// The CUDA runtime's stream and event handle types (cudaStream_t, cudaEvent_t) without its
// header.
struct CUstream_st;
struct CUevent_st;

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

class Event;

// A CUDA stream of one device: the default (legacy) stream or one from the pool. Converts to
// cudaStream_t for kernel launches.
class Stream {
 public:
  // The default stream of the current device.
  Stream();
  // The next stream of `device`'s pool (-1: the current device); created on first use,
  // non-blocking with respect to the default stream.
  static Stream create(int device = -1);
  // The default stream of `device` (-1: the current device).
  static Stream default_stream(int device = -1);

  int device() const;
  bool is_default() const { return handle_ == nullptr; }
  CUstream_st* handle() const { return handle_; }
  operator CUstream_st*() const { return handle_; }  // NOLINT: usable as a cudaStream_t

  // Waits on the host until all work queued on the stream is done.
  void synchronize() const;
  // True when all work queued on the stream is done.
  bool query() const;
  // Work queued on this stream after the call waits until `event` has happened.
  void wait(const Event& event) const;
  // Work queued on this stream after the call waits for the work queued on `other` so far.
  void wait_stream(const Stream& other) const;

  bool operator==(const Stream& o) const { return handle_ == o.handle_ && device() == o.device(); }
  bool operator!=(const Stream& o) const { return !(*this == o); }

 private:
  Stream(CUstream_st* handle, int device) : handle_(handle), device_(device) {}
  friend Stream current_stream(int device);
  CUstream_st* handle_ = nullptr;
  int device_ = -1;  // -1: the current device (the default stream as current_stream() gives it)
};

// The stream this thread's kernels, copies and allocations on `device` (-1: the current
// device) go to: the default stream unless a StreamGuard says otherwise.
Stream current_stream(int device = -1);

// Makes `stream` the current stream of its device, and its device the current device, for the
// scope; both are restored at its end.
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream previous_stream_;
  int previous_device_ = -1;
};

// A CUDA event: a point in a stream's work, to wait for, to order other streams after, or to
// time (enable_timing). The CUDA event is created on the first record(), on its stream's device.
class Event {
 public:
  explicit Event(bool enable_timing = false);
  ~Event();
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // Captures the work queued on `stream` so far (default: the current stream).
  void record();
  void record(const Stream& stream);
  // Waits on the host until the recorded work is done (returns at once if never recorded).
  void synchronize() const;
  // True when the recorded work is done (or nothing was recorded).
  bool query() const;
  // Milliseconds between this event and `end`, both recorded with enable_timing and done.
  float elapsed_time(const Event& end) const;

  bool is_recorded() const { return event_ != nullptr; }
  CUevent_st* handle() const { return event_; }
  int device() const { return device_; }

 private:
  CUevent_st* event_ = nullptr;
  int device_ = -1;
  bool timing_ = false;
};

namespace internal {
// A block of page-locked host memory (from a cache, cudaHostAlloc on a miss), for
// Tensor::pin_memory and non-blocking device-to-host copies.
Storage allocate_pinned(size_t nbytes);
// Notes that an asynchronous copy queued on `stream` reads or writes the pinned `storage`: its
// block is not reused before that work is done, even after the tensor dies.
void record_pinned_use(const StorageImpl& storage, CUstream_st* stream);
// Bytes of pinned memory held by the cache (in use or free), and freeing the unused blocks.
int64_t pinned_cached_bytes();
void empty_pinned_cache();
}  // namespace internal

}  // namespace kiln::cuda
